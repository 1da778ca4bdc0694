/* The CUDA twin of cell_loop.h: the loop over time of a user-written recurrent cell (lightning_bppsa.nn.Recurrence)
   as three kernels, compiled from its traced step by lightning_bppsa/nn/cell_cuda.py. The generated source is the
   C source lightning_bppsa/nn/cell_kernel.py makes (its defines and the step's pointwise part, cell_values and
   cell_partials, run by one thread per coordinate j), then this file. Besides cell_loop.h's defines (REAL, H, M,
   D, NK, KH, NI, NS, NF, CLO, CHI, CELL_PRODUCTS, CELL_DIRECT: the kept partials' sums) it defines:

     CELL_INPUT_PARAMS, CELL_INPUT_POINTERS, CELL_INPUT_STRIDES, CELL_INPUT_HOST_ARGS(base)
                          the NI input-part values as kernel parameters (pointer, row stride) and their host words
     CELL_SPREAD          1 where H < 32 (cell_cuda.py): the products with the weights are spread over the whole
                          block, one thread per piece coordinate (forward) or read state column (backward), in
                          the same order of summation, put in shared memory for the threads j < H (a second
                          barrier per step); else thread j forms its own coordinate's (one barrier per step).
                          A state of narrow blocks (widths (31, 33): H = 1, 64 states, 64 pieces) otherwise runs
                          all NK CW and (CW / H) KH multiply-adds of a step in its one thread j = 0.

   Every parameter is a 64-bit word (pointers and long long: CuPy packs Python ints so). States are (B, T + 1, D);
   rows of the other arrays are (b, t) flattened, as on the CPU.

   bppsa_cell_cuda_forward: one block per batch row, thread j < H owns coordinate j of every state and piece.
     The pieces' weights (the rows [CLO, CHI) of wc = (D, KH)) are staged once in shared memory (staged = 0:
     read from global memory, through L1, where they do not fit the device's shared memory); the state lives
     in two shared buffers (step t reads one, writes the other: one barrier per step); thread j computes its
     pieces' coordinate (offsets + prev @ wc; CELL_SPREAD: every thread a share of all pieces' coordinates),
     puts them in shared memory for the generated step (which indexes piece[k H + j]), runs the step (values,
     and with partials the scales, diagonal and input partials straight to global memory) and copies its new
     coordinates to the states.
   bppsa_cell_cuda_backward: the reverse linear sweep of the factored Jacobians fused with the products the
     parameter VJP needs, one block per batch row: thread j keeps g_t at its coordinates (M registers); per step
     it writes its products (g times the partials by every piece and input value, summed over the new states),
     the pieces' ones also to shared memory (double-buffered: one barrier per step), then forms g_{t-1} at its
     coordinates: the pieces' products times the wt = (KH, D) columns [CLO, CHI) (staged as the forward's;
     CELL_SPREAD: every thread a share of the columns, through shared memory), plus the diagonal (one
     state) or the kept columns of the identity tiles of the states read directly, plus the direct gradient.
   bppsa_cell_cotangent: the products of every row from a states' gradient the scan made elsewhere
     (a grid-stride loop over (row, j)). */

typedef long long i64;

#define CELL_MAX_THREADS 256 /* H <= 256: one thread per coordinate (lightning_bppsa/nn/cell_cuda.py checks) */
#define CELL_CW (CHI - CLO)  /* the state columns the pieces read */
#if CELL_SPREAD /* ptxas otherwise keeps the items' loop to 32 registers and spills (CoprimeWidths, weights global) */
#define CELL_LAUNCH_BOUNDS __launch_bounds__(CELL_MAX_THREADS, 1)
#else
#define CELL_LAUNCH_BOUNDS __launch_bounds__(CELL_MAX_THREADS)
#endif

/* the generated sums' accessors for thread j: the new states' gradient g (registers), a row's kept scales s and
   input partials f, its products (out, and the pieces' in shared), the carry */
#define CU_G(p) g[p]
#define CU_S(n) s[(n) * H + j]
#define CU_F(n) f[(n) * H + j]
#define CU_OUT(k, e)                                              \
    {                                                             \
        const REAL v_ = (e);                                      \
        out[(k) * H + j] = v_;                                    \
        if (shared != nullptr && (k) < NK) shared[(k) * H + j] = v_; \
    }
#define CU_ADD(q, e) carry[q] += (e);

/* One coordinate's products: o[k] = Σ_p partial_k[p H + j] g[p] over the kept partials, for the pieces k < NK
   (their scales s) and the input values (their partials f), written to out[k H]; the pieces' also to
   shared[k H] (when not null). */
__device__ __forceinline__ void cell_products(const REAL (&g)[M], const REAL* __restrict__ s, const REAL* __restrict__ f,
                                              int j, REAL* __restrict__ out, REAL* __restrict__ shared) {
    (void)g; (void)s; (void)f;
    CELL_PRODUCTS(CU_G, CU_S, CU_F, CU_OUT)
}

/* The forward loop of batch row blockIdx.x; STAGED: the weights wc's rows [CLO, CHI) copied to shared memory (a
   template argument, so their reads are shared-memory loads, not generic ones). */
template <bool STAGED>
__device__ __forceinline__ void cell_forward(i64 steps, const REAL* __restrict__ wc, const REAL* __restrict__ offsets,
                                             REAL* __restrict__ states, i64 partials, REAL* __restrict__ scales,
                                             REAL* __restrict__ diagonal, REAL* __restrict__ fpart,
                                             const REAL* const* in, const int64_t* stride) {
    BPPSA_DYNAMIC_SHARED(smem);
    REAL* state = reinterpret_cast<REAL*>(smem);  // 2 x D
    REAL* piece = state + 2 * D;                   // KH
    REAL* shared_w = piece + KH;                   // CELL_CW x KH where staged
    const REAL* w = STAGED ? shared_w : wc + CLO * KH;
    const i64 b = blockIdx.x;
    const int j = threadIdx.x;
    if (STAGED)
        for (int e = j; e < CELL_CW * KH; e += blockDim.x) shared_w[e] = wc[CLO * KH + e];
    REAL* own = states + b * (steps + 1) * D;
    for (int e = j; e < D; e += blockDim.x) state[e] = own[e];
    __syncthreads();
    for (i64 t = 0; t < steps; ++t) {
        const i64 row = b * steps + t;
        const REAL* prev = state + (t & 1) * D;
        REAL* next = state + ((t + 1) & 1) * D;
#if CELL_SPREAD
        if (t > 0)  // s_t, complete since the last barrier
            for (int e = j; e < D; e += blockDim.x) own[t * D + e] = prev[e];
        for (int e = j; e < KH; e += blockDim.x) {  // piece coordinate e, summed in the order of the loop below
            REAL acc = offsets != nullptr ? offsets[row * KH + e] : REAL(0);
            for (int i = 0; i < CELL_CW; ++i) acc += prev[CLO + i] * w[i * KH + e];
            piece[e] = acc;
        }
        __syncthreads();  // every piece complete before the step reads them
        if (partials)
            for (int e = j; e < CELL_PARTIAL_ITEMS; e += blockDim.x)
                cell_item_partials(e, row, prev, piece, in, stride, next, scales, diagonal, fpart);
        else
            for (int e = j; e < CELL_VALUE_ITEMS; e += blockDim.x) cell_item_values(e, row, prev, piece, in, stride, next);
#else
        if (j < H) {
            REAL acc[NK > 0 ? NK : 1];
#pragma unroll
            for (int k = 0; k < NK; ++k) acc[k] = offsets != nullptr ? offsets[row * KH + k * H + j] : REAL(0);
            for (int i = 0; i < CELL_CW; ++i) {
                const REAL v = prev[CLO + i];
                const REAL* wi = w + i * KH + j;
#pragma unroll
                for (int k = 0; k < NK; ++k) acc[k] += v * wi[k * H];
            }
#pragma unroll
            for (int k = 0; k < NK; ++k) piece[k * H + j] = acc[k];
            if (partials)
                cell_partials(row, prev, piece, in, stride, next, scales, diagonal, fpart);
            else
                cell_values(row, prev, piece, in, stride, next);
#pragma unroll
            for (int p = 0; p < M; ++p) own[(t + 1) * D + p * H + j] = next[p * H + j];
        }
#endif
        __syncthreads();  // next is complete before step t + 1 reads it; prev is read by nobody any more
    }
#if CELL_SPREAD
    for (int e = j; e < D; e += blockDim.x) own[steps * D + e] = state[(steps & 1) * D + e];
#endif
}

/* The forward kernels: bppsa_cell_cuda_forward stages the weights, bppsa_cell_cuda_forward_global reads them from
   global memory (cell_cuda.py's Launch.entry picks one). */
#define CELL_FORWARD_KERNEL(name, staged)                                                                             \
    extern "C" __global__ void CELL_LAUNCH_BOUNDS                                                                     \
        name(i64 batch, i64 steps, const REAL* __restrict__ wc, const REAL* __restrict__ offsets,                     \
             REAL* __restrict__ states, i64 partials, REAL* __restrict__ scales, REAL* __restrict__ diagonal,          \
             REAL* __restrict__ fpart CELL_INPUT_PARAMS) {                                                            \
        (void)batch;                                                                                                  \
        const REAL* in[NI > 0 ? NI : 1] = {CELL_INPUT_POINTERS};                                                      \
        const int64_t stride[NI > 0 ? NI : 1] = {CELL_INPUT_STRIDES};                                                 \
        cell_forward<staged>(steps, wc, offsets, states, partials, scales, diagonal, fpart, in, stride);             \
    }                                                                                                                 \
    BPPSA_ENTRY(name, (),                                                                                             \
                ((i64)a[0], (i64)a[1], (const REAL*)a[2], (const REAL*)a[3], (REAL*)a[4], (i64)a[5], (REAL*)a[6],     \
                 (REAL*)a[7], (REAL*)a[8] CELL_INPUT_HOST_ARGS(9)))
CELL_FORWARD_KERNEL(bppsa_cell_cuda_forward, true)
CELL_FORWARD_KERNEL(bppsa_cell_cuda_forward_global, false)

/* The backward sweep of batch row blockIdx.x (the arguments as bppsa_cell_cuda_backward's); STAGED as the
   forward's. */
template <bool STAGED>
__device__ __forceinline__ void cell_backward(i64 steps, const REAL* __restrict__ wt, const REAL* __restrict__ scales,
                                              i64 scale_width, const REAL* __restrict__ diagonal,
                                              const REAL* __restrict__ fpart, const REAL* __restrict__ direct,
                                              i64 direct_width, i64 batch_stride, i64 step_stride,
                                              const REAL* __restrict__ final, REAL* __restrict__ out,
                                              REAL* __restrict__ products) {
    BPPSA_DYNAMIC_SHARED(smem);
    REAL* o = reinterpret_cast<REAL*>(smem);  // 2 x KH: the pieces' products of a step
    REAL* column = o + 2 * KH;                // CELL_SPREAD: CELL_CW, the read columns' sums of a step
    REAL* gs = column + (CELL_SPREAD ? CELL_CW : 0);  // CELL_SPREAD: 2 x D, the states' gradient g_t, g_{t-1}
    REAL* shared_w = gs + (CELL_SPREAD ? 2 * D : 0);  // KH x CELL_CW where staged
    const REAL* w = STAGED ? shared_w : wt + CLO;  // row r of the read columns at w + r * ws
    constexpr int ws = STAGED ? CELL_CW : D;
    const i64 b = blockIdx.x;
    const int j = threadIdx.x;
    if (STAGED)
        for (int e = j; e < KH * CELL_CW; e += blockDim.x) shared_w[e] = wt[(e / CELL_CW) * D + CLO + e % CELL_CW];
    const REAL* given = direct_width > 0 ? direct + b * batch_stride : nullptr;  // s_t's at (t - 1) step_stride
#if CELL_SPREAD
    for (int c = j; c < D; c += blockDim.x)
        gs[(steps & 1) * D + c] = (c < direct_width ? given[(steps - 1) * step_stride + c] : REAL(0)) +
                                  (final ? final[b * D + c] : REAL(0));
    __syncthreads();
    for (i64 t = steps; t >= 1; --t) {
        const i64 row = b * steps + t - 1;
        const REAL* g = gs + (t & 1) * D;
        REAL* ob = o + (t & 1) * KH;
        const REAL* s = scales + row * scale_width;
        for (int e = j; e < CELL_PRODUCT_ITEMS; e += blockDim.x)
            cell_item_products(e, g, s, fpart + row * NF * H, products + row * (NK + NI) * H, ob);
        __syncthreads();  // ob complete
        for (int e = j; e < CELL_CW; e += blockDim.x) {  // read column CLO + e, summed in the order of the loop below
            REAL acc = REAL(0);
            for (int r = 0; r < KH; ++r) acc += ob[r] * w[r * ws + e];
            column[e] = acc;
        }
        __syncthreads();  // every column complete
        const REAL* d = given && t >= 2 ? given + (t - 2) * step_stride : nullptr;
        const REAL* diag = diagonal != nullptr ? diagonal + row * D : nullptr;
        for (int c = j; c < D; c += blockDim.x)
            cell_item_gradient(c, g, s, column, diag, d, direct_width, gs + ((t - 1) & 1) * D);
        __syncthreads();  // g_{t-1} complete before step t - 1 reads it; the columns are read by nobody any more
    }
    for (int c = j; c < D; c += blockDim.x) out[b * D + c] = gs[c];
#else
    REAL g[M];
#pragma unroll
    for (int p = 0; p < M; ++p) {
        const int c = p * H + j;
        g[p] = j < H ? (c < direct_width ? given[(steps - 1) * step_stride + c] : REAL(0)) + (final ? final[b * D + c] : REAL(0))
                     : REAL(0);
    }
    __syncthreads();
    for (i64 t = steps; t >= 1; --t) {
        const i64 row = b * steps + t - 1;
        const REAL* s = scales + row * scale_width;
        REAL* ob = o + (t & 1) * KH;
        if (j < H) cell_products(g, s, fpart + row * NF * H, j, products + row * (NK + NI) * H, ob);
        __syncthreads();  // ob complete; the other buffer is written next step while late threads read this one
        if (j < H) {
            REAL carry[M];
#pragma unroll
            for (int q = 0; q < M; ++q) {
                REAL acc = REAL(0);
                if (q * H >= CLO && q * H < CHI) {
                    const REAL* wc = w + (q * H - CLO) + j;
                    for (int r = 0; r < KH; ++r) acc += ob[r] * wc[r * ws];
                }
                if (M == 1 && diagonal != nullptr) acc += g[0] * diagonal[row * D + j];
                carry[q] = acc;
            }
            CELL_DIRECT(CU_G, CU_S, CU_ADD)
            const REAL* d = given && t >= 2 ? given + (t - 2) * step_stride : nullptr;
#pragma unroll
            for (int q = 0; q < M; ++q) g[q] = (d && q * H + j < direct_width ? d[q * H + j] : REAL(0)) + carry[q];
        }
    }
    if (j < H)
#pragma unroll
        for (int q = 0; q < M; ++q) out[b * D + q * H + j] = g[q];
#endif
}

/* The backward kernels (staged as the forward's). direct: the direct gradients of the new states s_1..s_T in their
   first direct_width columns (0: none; the others' are zero), that of s_t at direct + b * batch_stride + (t - 1) *
   step_stride (as cell_loop.h reads them); final: (B, D), a further direct gradient of s_T, or null; out: (B, D),
   the gradient of s_0; products: (B T, (NK + NI) H). */
#define CELL_BACKWARD_KERNEL(name, staged)                                                                          \
    extern "C" __global__ void CELL_LAUNCH_BOUNDS                                                                   \
        name(i64 batch, i64 steps, const REAL* __restrict__ wt, const REAL* __restrict__ scales, i64 scale_width,   \
             const REAL* __restrict__ diagonal, const REAL* __restrict__ fpart, const REAL* __restrict__ direct,     \
             i64 direct_width, i64 batch_stride, i64 step_stride, const REAL* __restrict__ final,                   \
             REAL* __restrict__ out, REAL* __restrict__ products) {                                                 \
        (void)batch;                                                                                                \
        cell_backward<staged>(steps, wt, scales, scale_width, diagonal, fpart, direct, direct_width, batch_stride,  \
                              step_stride, final, out, products);                                                   \
    }                                                                                                               \
    BPPSA_ENTRY(name, (),                                                                                           \
                ((i64)a[0], (i64)a[1], (const REAL*)a[2], (const REAL*)a[3], (i64)a[4], (const REAL*)a[5],          \
                 (const REAL*)a[6], (const REAL*)a[7], (i64)a[8], (i64)a[9], (i64)a[10], (const REAL*)a[11],        \
                 (REAL*)a[12], (REAL*)a[13]))
CELL_BACKWARD_KERNEL(bppsa_cell_cuda_backward, true)
CELL_BACKWARD_KERNEL(bppsa_cell_cuda_backward_global, false)

/* grad: (B, T + 1, D), a scan's states' gradient; row (b, t) reads it at (b, t + 1). */
extern "C" __global__ void __launch_bounds__(CELL_MAX_THREADS)
    bppsa_cell_cuda_cotangent(i64 batch, i64 steps, const REAL* __restrict__ grad, const REAL* __restrict__ scales,
                              i64 scale_width, const REAL* __restrict__ fpart, REAL* __restrict__ out) {
    const i64 total = batch * steps * H;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
        const i64 r = e / H;
        const int j = (int)(e % H);
        const REAL* gr = grad + (r + r / steps + 1) * D + j;
        REAL g[M];
#pragma unroll
        for (int p = 0; p < M; ++p) g[p] = gr[p * H];
        cell_products(g, scales + r * scale_width, fpart + r * NF * H, j, out + r * (NK + NI) * H, nullptr);
    }
}
BPPSA_ENTRY(bppsa_cell_cuda_cotangent, (),
            ((i64)a[0], (i64)a[1], (const REAL*)a[2], (const REAL*)a[3], (i64)a[4], (const REAL*)a[5], (REAL*)a[6]))
