// The BPPSA scan on CUDA: g_t = g_{t+1} J_t + δ_t for t = n-1 .. 0 (row gradients), per batch row.
//
// Three kernels per chain kind (dense, factored) and dtype (f32, f64):
//
//   bppsa_warpsweep_*  d <= 32 (factored: k <= 5 weight tiles): one warp per batch row runs the n steps
//                    in order, the state in registers, operands staged through a cp.async ring, from a
//                    module compiled for that (d, k) (see "The warp-resident sweep" below).
//   bppsa_sweep_*    wider states: one block per batch row runs the n steps in order, through shared memory.
//   bppsa_chunked_*  ONE launch of B * p blocks, p = ceil(n / c): a block takes a ticket (atomicAdd),
//                    which names its (chunk q, row b); chunk q = 0 holds the LAST c steps (the block
//                    taking the last ticket sets the counter back to 0 for the next launch). It
//                    1. reduces its c steps to an aggregate X = [C; b] (g_lo = g_{hi+1} C + b),
//                       publishes it and sets its flag to AGGREGATE (release); float32 chains with
//                       k d <= 104 in a module compiled for their (d, k): by the block, one warp, a row
//                       of C per lane (WarpAggregate), else by the block's shared-memory product;
//                    2. looks back (decoupled look-back) over up to 32 earlier chunks of its row for
//                       the nearest one whose flag is INCLUSIVE, and pushes that chunk's left-boundary
//                       gradient through the aggregates in between: its carry g_{hi+1};
//                    3. publishes its own inclusive g_lo = carry C + b (flag INCLUSIVE), then
//                    4. sweeps its c steps from the carry, writing out[b, t] (d <= 32: warp 0 alone,
//                       with the warp-resident step, in a module compiled for that (d, k)).
//                    A block waits only on chunks with smaller tickets, i.e. blocks that already
//                    started: no forward-progress deadlock whatever the scheduler does.
//
// Layouts (contiguous, batch-major):
//   dense     mat = jacobians_t (B, n, d, d): jacobians_t[b, t][c][i] = J_t[i][c]
//   factored  mat = weight (m, d), m = k d; scales (B, n, m); diagonal (B, n, d) or null:
//             (g J_t)[c] = u_t[c] g[c] + sum_j g[j mod d] s_t[j] W[j][c]      (J_t never formed)
//   grad      (B, d) last-state (affine = 0) or (B, n + 1, d) per-step (affine = 1)
//   out       (B, n + 1, d)
//   work      chunked only: B p aggregates of R x d (R = d + affine), then B p inclusives of d
//   sync      chunked only, 64-bit words: [ticket counter, B p flags]; epoch >= 1, this launch's number
//
// Flags need no clearing between launches: a chunk publishes epoch * 4 + state (kAggregate, kInclusive)
// and a reader takes a flag as published only if its epoch is this launch's, so what earlier launches
// left behind (smaller or other epochs, 0 in a fresh buffer) never satisfies a wait. Invariant, kept by
// kernels/cuda.py (_look_back_flags): two launches that may overlap never share a sync buffer (one buffer
// per device and stream, launches on a stream run one after another; a CUDA graph capture gets a buffer
// of its own, zeroed by a captured memset before each replay), and launches sharing a buffer never share
// an epoch (a per-buffer counter on the host, 64-bit: it does not wrap). The ticket counter is 0 at every
// launch: 0 in a fresh buffer, then set back to 0 by the block that takes a launch's last ticket (no block
// of that launch takes one after it; the kernel's end orders the store before the next launch).
//
// Memory ordering of the look-back: a chunk publishes its data with L2 stores (st.cg), a barrier (the
// end of the product that stored them), then ONE release store of its flag by thread 0 (cumulative over the block's stores ordered by the
// barrier). A reader polls flags with relaxed loads (an acquire load per poll would invalidate the
// SM's L1 each time), then every polling lane runs one fence.acq_rel.gpu after the ballot, then a
// barrier, and the block reads the published data through L2 (ld.cg), never through L1.
//
// Shared memory (dynamic, bytes computed by kernels/cuda.py:launch_config, which also budgets the
// chunked kernels' static words: STATIC_SHARED_BYTES there, checked against ptxas): two R x d
// matrices (chunked), two d-vectors, and a tile of `tile_rows` x d operand rows; every step streams
// its operand (J_t, or the scaled rows s_t[j] W[j]) through the tile, so any d fits. The warp sweeps
// (d <= 32): their operand ring and, where it is not in registers, W (WarpLayout below).
#include "cuda_host_emulation.h"

namespace {

constexpr int kMatrixBlock = 2;  // a thread computes kMatrixBlock x kMatrixBlock outputs of a matrix step
constexpr int kMaxThreads = 256;
constexpr unsigned kAggregate = 1, kInclusive = 2;  // a chunk flag's state: its low 2 bits, the epoch above
constexpr int kLookBack = 32;                       // predecessors inspected at once (one warp)

using i64 = long long;

// Operand of one step: y[c] = sum_j x[j mod d] A[j][c] + diag[c] x[c] (+ addend[c] on one row), j < K.
// prefetch() asks L1 for the operand while the step before it computes (the loads of a step are
// otherwise on the sequential critical path).
template <class T>
__device__ void prefetch_span(const T* p, int count) {  // one 128-byte line per thread
    for (int e = threadIdx.x * (128 / sizeof(T)); e < count; e += blockDim.x * (128 / sizeof(T)))
        bppsa::prefetch_l1(p + e);
}

// Visits e = threadIdx.x, threadIdx.x + blockDim.x, .. < rows * inner as f(e / inner, e % inner), the
// divisions done once per call, not per element (in SASS an integer division is ~20 instructions).
template <class F>
__device__ void for_each_strided(int rows, int inner, F f) {
    const int step_major = blockDim.x / inner, step_minor = blockDim.x % inner;
    for (int major = threadIdx.x / inner, minor = threadIdx.x % inner; major < rows;) {
        f(major, minor);
        major += step_major;
        minor += step_minor;
        if (minor >= inner) minor -= inner, ++major;
    }
}

template <class T>
struct DenseStep {  // A = J_t, from jacobians_t (transposed): A[i][c] = jt[c][i]
    const T* jt;
    const T* delta;  // δ_t, d values, or null
    int d;
    __device__ int rows() const { return d; }
    __device__ void load_tile(T* tile, int j0, int count) const {
        const T* from = jt + j0;
        const int n = d;  // i fastest: contiguous global reads
        for_each_strided(d, count, [&](int c, int i) { tile[i * n + c] = from[(i64)c * n + i]; });
    }
    __device__ T diag(int) const { return T(0); }
    __device__ T addend(int c) const { return delta ? delta[c] : T(0); }
    __device__ void prefetch() const {
        prefetch_span(jt, d * d);
        if (delta) prefetch_span(delta, d);
    }
};

template <class T>
struct FactoredStep {  // A[j][c] = s_t[j] W[j][c], plus diag(u_t)
    const T* weight;
    const T* scales;    // s_t, m values
    const T* diagonal;  // u_t, d values, or null
    const T* delta;     // δ_t, d values, or null
    int d, m;
    __device__ int rows() const { return m; }
    __device__ void load_tile(T* tile, int j0, int count) const {
        const T* s = scales + j0;
        const T* w = weight + (i64)j0 * d;
        const int n = d;
        for_each_strided(count, d, [&](int j, int c) { tile[j * n + c] = s[j] * w[(i64)j * n + c]; });
    }
    __device__ T diag(int c) const { return diagonal ? diagonal[c] : T(0); }
    __device__ T addend(int c) const { return delta ? delta[c] : T(0); }
    __device__ void prefetch() const {  // the weight is shared by every step: it stays cached
        prefetch_span(scales, m);
        if (diagonal) prefetch_span(diagonal, d);
        if (delta) prefetch_span(delta, d);
    }
};

template <class T>
struct AggregateStep {  // A = C of a published chunk aggregate [C; b] (row-major, read through L2)
    const T* c_matrix;
    bool affine;  // add b (the row after C)
    int d;
    __device__ int rows() const { return d; }
    __device__ void load_tile(T* tile, int j0, int count) const {
        for (int e = threadIdx.x; e < count * d; e += blockDim.x)
            tile[e] = bppsa::load_shared_global(c_matrix + (i64)j0 * d + e);
    }
    __device__ T diag(int) const { return T(0); }
    __device__ T addend(int c) const { return affine ? bppsa::load_shared_global(c_matrix + d * d + c) : T(0); }
};

// Y = X A + diag(A) X for the R x d rows X (shared), by the whole block; row `add_row` of Y also gets
// the operand's addend. Y is written to shared memory and, if `store` is not null, to global memory
// (R x d, row-major). Two barriers per step: after a tile is loaded (X, written before the call, is
// then complete too) and at the end (Y ready, the tile free for the next step's load).
// A thread owns an RB x CB block of outputs per pass (rows rg RB .. rg RB + RB - 1, columns cg,
// cg + groups, ..: neighbouring threads read neighbouring tile columns), so that per operand row it
// reads RB + CB shared values for RB CB FMAs; and two partial sums of each output (even and odd operand
// rows), so 2 RB CB independent FMA chains hide the FMA latency. Vectors: RB = CB = 1.
template <int RB, int CB, class T, class Op>
__device__ void product(const Op& op, const T* X, T* Y, int R, int d, T* tile, int tile_rows, int add_row,
                        T* store) {
    const int col_groups = (d + CB - 1) / CB, groups = (R + RB - 1) / RB * col_groups, K = op.rows();
    for (int base = 0; base < groups; base += blockDim.x) {
        const int group = base + threadIdx.x;
        const bool active = group < groups;  // an idle thread computes row 0, column 0 and drops it
        int row[RB], col[CB];
        bool valid_row[RB], valid_col[CB];
#pragma unroll
        for (int i = 0; i < RB; ++i) {
            const int r = active ? group / col_groups * RB + i : R;
            valid_row[i] = r < R;
            row[i] = valid_row[i] ? r * d : 0;
        }
#pragma unroll
        for (int j = 0; j < CB; ++j) {
            const int c = group % col_groups + j * col_groups;
            valid_col[j] = c < d;
            col[j] = valid_col[j] ? c : 0;
        }
        T even[RB][CB], odd[RB][CB];
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
            for (int j = 0; j < CB; ++j) even[i][j] = odd[i][j] = T(0);
        for (int j0 = 0; j0 < K; j0 += tile_rows) {
            const int count = K - j0 < tile_rows ? K - j0 : tile_rows;
            // the previous tile consumed (before the first tile of the first pass: the end of the last step)
            if (j0 > 0 || base > 0) __syncthreads();
            op.load_tile(tile, j0, count);
            __syncthreads();
            int xc = j0 % d;  // tile row jj multiplies X column (j0 + jj) mod d
            int jj = 0;
            for (; jj + 1 < count; jj += 2) {
                const int xn = xc + 1 == d ? 0 : xc + 1;
                T xa[RB], xb[RB], ta[CB], tb[CB];
#pragma unroll
                for (int i = 0; i < RB; ++i) xa[i] = X[row[i] + xc], xb[i] = X[row[i] + xn];
#pragma unroll
                for (int j = 0; j < CB; ++j) ta[j] = tile[jj * d + col[j]], tb[j] = tile[(jj + 1) * d + col[j]];
#pragma unroll
                for (int i = 0; i < RB; ++i)
#pragma unroll
                    for (int j = 0; j < CB; ++j) {
                        even[i][j] += xa[i] * ta[j];
                        odd[i][j] += xb[i] * tb[j];
                    }
                xc = xn + 1 == d ? 0 : xn + 1;
            }
            if (jj < count)
#pragma unroll
                for (int i = 0; i < RB; ++i)
#pragma unroll
                    for (int j = 0; j < CB; ++j) even[i][j] += X[row[i] + xc] * tile[jj * d + col[j]];
        }
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
            for (int j = 0; j < CB; ++j) {
                if (!(valid_row[i] && valid_col[j])) continue;
                const int o = row[i] + col[j];
                T v = even[i][j] + odd[i][j] + op.diag(col[j]) * X[o];
                if (row[i] == add_row * d) v += op.addend(col[j]);
                Y[o] = v;
                if (store) bppsa::store_shared_global(store + o, v);
            }
    }
    __syncthreads();
}

template <class T>
struct Problem {
    const T* mat;
    const T* scales;
    const T* diagonal;
    const T* grad;
    T* out;
    i64 n, batch;
    int d, m, affine;

    __device__ const T* direct(i64 b, i64 t) const {  // δ_t of row b, or null (last-state loss)
        return affine ? grad + (b * (n + 1) + t) * d : nullptr;
    }
    __device__ const T* last(i64 b) const { return affine ? grad + (b * (n + 1) + n) * d : grad + b * d; }
    __device__ T* out_row(i64 b, i64 t) const { return out + (b * (n + 1) + t) * d; }
};

template <class T, bool Factored>
struct StepOf;
template <class T>
struct StepOf<T, false> {
    static __device__ DenseStep<T> at(const Problem<T>& p, i64 b, i64 t) {
        return {p.mat + (b * p.n + t) * p.d * p.d, p.direct(b, t), p.d};
    }
};
template <class T>
struct StepOf<T, true> {
    static __device__ FactoredStep<T> at(const Problem<T>& p, i64 b, i64 t) {
        const T* u = p.diagonal ? p.diagonal + (b * p.n + t) * p.d : nullptr;
        return {p.mat, p.scales + (b * p.n + t) * p.m, u, p.direct(b, t), p.d, p.m};
    }
};

// Sweep steps hi .. lo of row b from the carry g_{hi+1} in `x` (shared, d values), writing out[b, t].
template <class T, bool Factored>
__device__ void sweep(const Problem<T>& p, i64 b, i64 lo, i64 hi, T* x, T* y, T* tile, int tile_rows) {
    for (i64 t = hi; t >= lo; --t) {
        if (t > lo) StepOf<T, Factored>::at(p, b, t - 1).prefetch();
        product<1, 1>(StepOf<T, Factored>::at(p, b, t), x, y, 1, p.d, tile, tile_rows, 0, p.out_row(b, t));
        T* swap = x;
        x = y;
        y = swap;
    }
}

template <class T>
__device__ void copy_row(const T* from, T* to, T* also, int d) {  // to (shared) = from; also (global) too
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const T v = bppsa::load_shared_global(from + c);
        to[c] = v;
        if (also) also[c] = v;
    }
    __syncthreads();
}

template <class T, bool Factored>
__device__ void sweep_kernel(const Problem<T>& p, int tile_rows) {
    BPPSA_DYNAMIC_SHARED(smem);
    T* x = reinterpret_cast<T*>(smem);
    T* y = x + p.d;
    T* tile = y + p.d;
    const i64 b = blockIdx.x;
    copy_row(p.last(b), x, p.out_row(b, p.n), p.d);
    sweep<T, Factored>(p, b, 0, p.n - 1, x, y, tile, tile_rows);
}

// ---- The warp-resident sweep (d <= 32): one warp per batch row, the state in registers --------------
//
// Compiled per state size: a module built with -DBPPSA_WARP_D=d -DBPPSA_WARP_K=k (kernels/cuda.py compiles
// one per (d, k) on first use; NVRTC caches it) has d and the factored weight's tile count k as constants,
// so every loop below is unrolled and every register index is static. Lane c owns g[c] (lanes >= d are
// dead: they compute on clamped addresses and drop the result; nobody reads their state). A step is
//
//     y[c] = delta[c] + u[c] g[c] + sum_l g[l] J[l][c],      g[l] broadcast by __shfl_sync from lane l,
//
// with lane c's column J[.][c] of the step in registers (dense: read from the ring; factored:
// J[l][c] = sum_i s_t[i d + l] W[i d + l][c], the k scales broadcast from the ring, W in registers where it
// fits, else lane c's transposed column in shared memory). The linear kernel forms the column during the
// step before, off the dependent chain, which is then d shuffles and d FMAs in kChains independent partial
// sums (fixed association: bit-identical run to run). The chunked kernel's chunk sweeps run the lean
// variant (Lean: the column formed in its own step, W in shared memory): about half the registers, so
// that the block's matrix products keep their occupancy.
//
// Operands are staged up to S steps ahead (S = WarpLayout::kDepth) in a ring of S slots in shared memory,
// filled by asynchronous copies (cp.async; one commit group per step, empty groups past the chain's end
// keep the count uniform). Step t lives in slot t mod S. Let f = t - 1 (linear) or t (Lean) be the step
// formed in iteration t (steps descending). Invariant, per iteration t:
//   1. wait until at most S - 2 groups are pending: step f's copies (this lane's) have landed;
//   2. __syncwarp: every lane's copies of step f are visible, and every lane has finished forming step
//      f + 1 from its slot (in iteration t + 1), so
//   3. slot f + 1 is free: the copies of step f + 1 - S (the same slot) are issued into it, then committed;
//   4. step f is formed from its slot into registers (linear: while step t's chain runs).
// So S - 1 steps are in flight while one is formed. S is the largest power of two <= kMaxDepth
// whose ring (plus a shared W) fits kWarpSharedBytes: for factored f32 chains (a step's operand is
// (k + 2) d values) 32, or 16 where a shared W takes its room; fewer for dense ones (d^2 + d values a step:
// 8 at d = 32 f32, 4 f64). At ~50-150 ns a step, 15-31 steps in flight cover a global-memory latency of
// ~1-2 us.
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kMaxTiles = 5;                 // factored weight rows m = k d with k <= 5 (LSTM: 5 tiles of [h; c])
constexpr int kChains = 4;                   // partial sums of a step's dot product (hides the FMA latency)
constexpr int kMaxDepth = 32;                // ring slots at most
constexpr int kWarpSharedBytes = 47 * 1024;  // ring + shared W: every device's 48 KiB, with the chunked kernel's static words
constexpr int kRegisterWords = 160;  // W in registers where it and two columns take this many 32-bit words a lane (no spill: the compile gate)

template <class T>
__host__ __device__ constexpr int vector_elements() {  // elements of one 16-byte shared-memory load
    return 16 / (int)sizeof(T);
}
template <class T>
__host__ __device__ constexpr int whole_vectors(int n) {  // n rounded up to whole vectors
    return (n + vector_elements<T>() - 1) / vector_elements<T>() * vector_elements<T>();
}
template <class T>
__host__ __device__ constexpr int lane_stride(int n) {  // an odd number of whole vectors >= n: one vector per lane, no bank conflict
    const int vectors = (n + vector_elements<T>() - 1) / vector_elements<T>();
    return (vectors | 1) * vector_elements<T>();
}
__host__ __device__ constexpr int ring_depth(int slot_bytes, int budget) {
    int depth = kMaxDepth;
    while (depth > 2 && depth * slot_bytes > budget) depth /= 2;
    return depth;
}

// Whether the chunked kernel of a chain forms its chunk aggregates in one warp (WarpAggregate; the block is that
// warp) where its module is specialised: float32 chains of k d <= kWarpAggregateWidth (k = 1 dense). Wider or
// float64 ones spilled at 255 registers (the sweep's lean form with k tiles and a row of C together; not
// monotonic in k d: 27 x 4 spilled, 28 x 4 did not): they keep the block's product.
// kernels/cuda.py:warp_aggregates states the same rule.
constexpr int kWarpAggregateWidth = 104;
__host__ __device__ constexpr bool aggregates_in_warp(int element_bytes, int k, int d) {
    return element_bytes == 4 && k * d <= kWarpAggregateWidth;
}

// Shared memory of a warp sweep (elements of T, from the block's dynamic base): S slots, then (if W is
// not in registers) W transposed, lane c's column at c * kWeightStride, tile i at i * kPart.
// Slot: factored [s_t tile 0 .. k - 1 | u_t | delta_t], each kPart long; dense [J_t^T rows, kRow apart | delta_t].
// kernels/cuda.py:warp_layout computes the same (a test compares them).
template <class T, bool Factored, int D, int K, bool Lean>
struct WarpLayout {
    static constexpr int kVector = vector_elements<T>();
    static constexpr int kPart = whole_vectors<T>(D);
    static constexpr int kRow = lane_stride<T>(D);
    static constexpr int kU = Factored ? K * kPart : D * kRow;
    static constexpr int kDelta = Factored ? kU + kPart : kU;
    static constexpr int kSlot = kDelta + kPart;  // whole vectors: every slot 16-byte aligned
    static constexpr bool kWeightInRegisters = Factored && !Lean && (K + 2) * D * (int)sizeof(T) / 4 <= kRegisterWords;
    static constexpr int kWeightStride = lane_stride<T>(K * kPart);
    static constexpr int kWeight = Factored && !kWeightInRegisters ? kWarp * kWeightStride : 0;
    // the chunked kernel's aggregate (lean, aggregates_in_warp) after W: one step's J' (row l at l * kJRow) and
    // each lane's row of C (at r * kRow: no bank conflict)
    static constexpr bool kAggregates = Lean && aggregates_in_warp((int)sizeof(T), K, D);
    static constexpr int kJRow = kPart;
    static constexpr int kAggregate = kAggregates ? D * kJRow + kWarp * kRow : 0;
    static constexpr int kDepth =
        ring_depth(kSlot * (int)sizeof(T), kWarpSharedBytes - (kWeight + kAggregate) * (int)sizeof(T));
    static constexpr int kAggregateAt = kDepth * kSlot + kWeight;
    static constexpr int kBytes = (kAggregateAt + kAggregate) * (int)sizeof(T);
    static_assert(kBytes <= kWarpSharedBytes, "a warp sweep's shared memory exceeds its budget");
    static_assert((kDepth & (kDepth - 1)) == 0 && kDepth >= 2, "the ring's depth is a power of two >= 2");
};

// Steps hi .. lo of row b by warp 0 of the block, from the carry g_{hi+1} (lane c holds `g`), writing
// out[b, t]; `shared`: the block's dynamic shared memory (WarpLayout), free for the sweep.
template <class T, bool Factored, int D, int K, bool Lean>
struct WarpSweep {
    using L = WarpLayout<T, Factored, D, K, Lean>;
    static constexpr int S = L::kDepth, V = L::kVector;
    struct Column {  // one step's operand as lane c holds it: J[l][c] (l < d), u_t[c], delta_t[c]
        T j[D];
        T u, delta;
    };

    const Problem<T>& p;
    i64 b;
    T* ring;
    int lane, c;  // c: the lane's column, clamped to d - 1 on dead lanes (valid addresses)
    bool live;
    const T* w_shared;
    T w[L::kWeightInRegisters ? K * D : 1];  // W[j][c], j < k d (registers)

    __device__ WarpSweep(const Problem<T>& problem, i64 row, T* shared)
        : p(problem), b(row), ring(shared), lane((int)threadIdx.x), c(lane < D ? lane : D - 1), live(lane < D),
          w_shared(shared + S * L::kSlot + lane * L::kWeightStride) {
        if constexpr (Factored) {
            T* own = shared + S * L::kSlot + lane * L::kWeightStride;  // this lane's column only: no barrier
#pragma unroll
            for (int i = 0; i < K; ++i)
#pragma unroll
                for (int l = 0; l < D; ++l) {
                    const T v = p.mat[(i64)(i * D + l) * D + c];
                    if constexpr (L::kWeightInRegisters)
                        w[i * D + l] = v;
                    else
                        own[i * L::kPart + l] = v;
                }
        }
        // what no copy writes (no u_t, no delta_t) reads 0 in every slot; the prologue's barrier shares it
        for (int s = 0; s < S; ++s) {
            if (Factored && !p.diagonal && lane < L::kPart) ring[s * L::kSlot + L::kU + lane] = T(0);
            if (!p.affine && lane < L::kPart) ring[s * L::kSlot + L::kDelta + lane] = T(0);
        }
    }

    __device__ T* slot(i64 t) const { return ring + (int)(t & (S - 1)) * L::kSlot; }

    // Queue the copies of step t's operand into `to` (its slot), the warp's lanes over consecutive elements.
    __device__ void stage(i64 t, T* to) const {
        const i64 step = b * p.n + t;
        if constexpr (Factored) {
            const T* s = p.scales + step * (K * D);
#pragma unroll
            for (int e0 = 0; e0 < K * D; e0 += kWarp) {
                const int e = e0 + lane;
                if (e < K * D) bppsa::copy_async(to + e / D * L::kPart + e % D, s + e);
            }
            if (p.diagonal && live) bppsa::copy_async(to + L::kU + lane, p.diagonal + step * D + lane);
        } else {
            const T* jt = p.mat + step * (D * D);
            // lean (chunked kernel, <= 128 registers): not fully unrolled, or the copies' offsets, hoisted
            // out of the step loop, take the registers (spills at d = 22 .. 30 float32)
#pragma unroll(Lean ? 4 : 32)
            for (int e0 = 0; e0 < D * D; e0 += kWarp) {
                const int e = e0 + lane;
                if (e < D * D) bppsa::copy_async(to + e / D * L::kRow + e % D, jt + e);
            }
        }
        const T* direct = p.direct(b, t);
        if (direct && live) bppsa::copy_async(to + L::kDelta + lane, direct + lane);
    }

    // Lane c's operand of the step in slot `from`, into registers.
    __device__ void form(Column& col, const T* from) const {
#pragma unroll
        for (int l0 = 0; l0 < D; l0 += V) {
            T acc[V];
            if constexpr (Factored) {
#pragma unroll
                for (int i = 0; i < K; ++i) {
                    T s[V], wv[V];
                    bppsa::load_shared_vector(from + i * L::kPart + l0, s);  // the same address in every lane
                    if constexpr (L::kWeightInRegisters) {
#pragma unroll
                        for (int v = 0; v < V; ++v) wv[v] = l0 + v < D ? w[i * D + l0 + v] : T(0);
                    } else {
                        bppsa::load_shared_vector(w_shared + i * L::kPart + l0, wv);
                    }
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] = i == 0 ? s[v] * wv[v] : acc[v] + s[v] * wv[v];
                }
            } else {
                bppsa::load_shared_vector(from + c * L::kRow + l0, acc);  // row c of J_t^T: column c of J_t
            }
#pragma unroll
            for (int v = 0; v < V; ++v)
                if (l0 + v < D) col.j[l0 + v] = acc[v];
        }
        col.u = Factored ? from[L::kU + c] : T(0);
        col.delta = from[L::kDelta + c];
    }

    // y[c] = delta[c] + u[c] g[c] + sum_l g[l] J[l][c]: the step's dependent chain.
    __device__ static T apply(T g, const Column& col) {
        static_assert(kChains == 4, "the final sum below adds four partial sums");
        T acc[kChains] = {T(0), T(0), T(0), T(0)};
#pragma unroll
        for (int l = 0; l < D; ++l) acc[l % kChains] += __shfl_sync(kFullMask, g, l) * col.j[l];
        T own = col.delta;
        if constexpr (Factored) own += col.u * g;  // dense: no u_t (0 * g is not folded away: NaN, -0)
        return own + ((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }

    // Steps hi .. lo in order, each operand staged through the ring: on_step(col, t) with lane c's column of
    // step t (formed a step ahead where not Lean).
    template <class OnStep>
    __device__ void each_step(i64 lo, i64 hi, OnStep&& on_step) {
        constexpr int ahead = Lean ? 0 : 1;  // step t forms step t - ahead
        for (int i = 0; i < S - 1 + ahead; ++i) {  // prologue: steps hi, hi - 1, .., one group each
            if (hi - i >= lo) stage(hi - i, slot(hi - i));
            bppsa::copy_async_commit();
        }
        Column even, odd;  // two register operands used in turn (linear): no copies between them
        if constexpr (!Lean) {
            bppsa::copy_async_wait<S - 1>();  // step hi landed (this lane's copies) ...
            __syncwarp(kFullMask);             // ... and every lane's
            form(even, slot(hi));
        }
        auto step = [&](Column& current, Column& next, i64 t) {
            const i64 formed = t - ahead;
            bppsa::copy_async_wait<S - 2>();  // 1. step `formed` landed (this lane's copies)
            __syncwarp(kFullMask);             // 2. every lane's; every lane is done with slot formed + 1
            if (formed + 1 - S >= lo) stage(formed + 1 - S, slot(formed + 1));  // 3. the same slot
            bppsa::copy_async_commit();
            // 4. (linear at t = lo: a slot's old contents, never used)
            form(Lean ? current : next, slot(formed));
            on_step(current, t);
        };
        if constexpr (Lean) {  // one operand: formed and used in the same step
            for (i64 t = hi; t >= lo; --t) step(even, even, t);
        } else {
            for (i64 t = hi; t >= lo; t -= 2) {
                step(even, odd, t);
                if (t > lo) step(odd, even, t - 1);
            }
        }
        bppsa::copy_async_wait<0>();  // nothing in flight when the block ends (the groups left are empty)
    }

    // The sweep: g_t for t = hi .. lo from g_{hi+1} (lane c holds g[c]), written to out[b, t].
    __device__ void run(T g, i64 lo, i64 hi) {
        each_step(lo, hi, [&](const Column& col, i64 t) {
            g = apply(g, col);
            if (live) p.out_row(b, t)[lane] = g;
        });
    }
};

#ifdef BPPSA_WARP_D
constexpr int kWarpD = BPPSA_WARP_D;
constexpr int kWarpK = BPPSA_WARP_K;
static_assert(1 <= kWarpD && kWarpD <= kWarp && 1 <= kWarpK && kWarpK <= kMaxTiles, "BPPSA_WARP_D / _K out of range");

// The module's specialisation: the chain it serves (d, and for a factored chain k tiles), else a trap.
template <class T, bool Factored, bool Lean>
using WarpSweepOf = WarpSweep<T, Factored, kWarpD, Factored ? kWarpK : 1, Lean>;

template <bool Factored, class T>
__device__ void check_warp_shape(const Problem<T>& p) {
    if (p.d != kWarpD || (Factored && p.m != kWarpK * kWarpD)) bppsa::fail();
}

// Whether this module's chunked kernel of a chain forms its aggregates in one warp (aggregates_in_warp).
template <class T, bool Factored>
constexpr bool kWarpAggregate = WarpSweepOf<T, Factored, true>::L::kAggregates;

// The chunked kernel's aggregate [C; b] of steps hi .. lo of row b (g_lo = g_{hi+1} C + b) by the block's one
// warp, stored to `store` (R x d, row-major, through L2). Lane r < d owns row r of C; a step is
// C_r <- C_r J'_t with J'_t = J_t + diag(u_t), which every lane writes a column of into shared memory and
// every lane reads whole, by broadcast vector loads: d^2 FMAs a lane, no shuffle. The new row is built one
// vector of columns at a time into the lane's own row buffer in shared memory (read back at the step's end),
// so that a lane holds one row, not two (two rows and the loads in flight spilled at d = 16 float32). The
// affine row b is a vector: lane c holds b[c], stepped as the sweep's state (b <- b J_t + u_t b + delta_t,
// WarpSweep::apply). Operands come through the sweep's ring, as the chunk's sweep later reads them.
template <class T, bool Factored>
struct WarpAggregate {
    using A = typename WarpSweepOf<T, Factored, true>::L;
    using Column = typename WarpSweepOf<T, Factored, true>::Column;
    static constexpr int D = kWarpD, V = vector_elements<T>();
    T* jbuf;  // J'_t
    T* own;   // this lane's row buffer
    int lane;
    T row[D];  // row `lane` of C (lanes >= d: an identity row nobody stores)

    // `shared`: the block's dynamic shared memory (WarpLayout)
    __device__ explicit WarpAggregate(T* shared)
        : jbuf(shared + A::kAggregateAt), own(jbuf + D * A::kJRow + (int)threadIdx.x * A::kRow), lane((int)threadIdx.x) {
#pragma unroll
        for (int c = 0; c < D; ++c) row[c] = lane == c ? T(1) : T(0);
    }

    // C_r <- C_r J'_t (the affine row: the caller's sweep state)
    __device__ void step(const Column& col) {
        if (lane < D)
#pragma unroll
            for (int l = 0; l < D; ++l) jbuf[l * A::kJRow + lane] = Factored && l == lane ? col.j[l] + col.u : col.j[l];
        __syncwarp(kFullMask);  // J'_t whole in every lane's view
#pragma unroll
        for (int c0 = 0; c0 < D; c0 += V) {
            T y[V];
#pragma unroll
            for (int v = 0; v < V; ++v) y[v] = T(0);
#pragma unroll
            for (int l = 0; l < D; ++l) {
                T jv[V];
                bppsa::load_shared_vector(jbuf + l * A::kJRow + c0, jv);  // the same address in every lane
#pragma unroll
                for (int v = 0; v < V; ++v) y[v] += row[l] * jv[v];
            }
            bppsa::store_shared_vector(own + c0, y);
        }
        __syncwarp(kFullMask);  // every lane has read J'_t before the next step writes it
#pragma unroll
        for (int c0 = 0; c0 < D; c0 += V) {
            T y[V];
            bppsa::load_shared_vector(own + c0, y);
#pragma unroll
            for (int v = 0; v < V; ++v)
                if (c0 + v < D) row[c0 + v] = y[v];
        }
    }

    // [C; b] to `store` (R x d, row-major, through L2); `b_lane`: b[lane] (affine)
    __device__ void store_to(T* store, bool affine, T b_lane) const {
        if (lane >= D) return;
#pragma unroll
        for (int c = 0; c < D; ++c) bppsa::store_shared_global(store + lane * D + c, row[c]);
        if (affine) bppsa::store_shared_global(store + D * D + lane, b_lane);
    }
};

template <class T, bool Factored>
__device__ void warp_sweep_kernel(const Problem<T>& p) {
    BPPSA_DYNAMIC_SHARED(smem);
    check_warp_shape<Factored>(p);
    const i64 b = blockIdx.x;
    const bool live = (int)threadIdx.x < kWarpD;
    const T g = live ? p.last(b)[threadIdx.x] : T(0);
    if (live) p.out_row(b, p.n)[threadIdx.x] = g;
    WarpSweepOf<T, Factored, false>(p, b, reinterpret_cast<T*>(smem)).run(g, 0, p.n - 1);
}
#endif

#ifndef BPPSA_WARP_D
template <class T, bool Factored>
constexpr bool kWarpAggregate = false;
#endif
// The chunked kernels' block and __launch_bounds__ (<= 65536 / (threads x blocks) registers a thread).
template <class T, bool Factored>
constexpr int kChunkedThreads = kWarpAggregate<T, Factored> ? kWarp : kMaxThreads;
template <class T, bool Factored>
constexpr int kChunkedBlocksPerSm = kWarpAggregate<T, Factored> ? 8 : sizeof(T) == 4 ? 2 : 1;

// Raise a chunk's flag to `value` (epoch * 4 + state). Called right after the product that stored what it
// announces (st.cg): that product's closing barrier orders every thread's stores before thread 0's
// release store, which is cumulative (one release by one thread instead of a fence in every thread).
__device__ inline void publish(bppsa::u64* flag, bppsa::u64 value) {
    if (threadIdx.x == 0) bppsa::store_release(flag, value);
}

template <class T, bool Factored>
__device__ void chunked_kernel(const Problem<T>& p, i64 chunk, T* work, bppsa::u64* sync, i64 epoch, int tile_rows) {
    BPPSA_DYNAMIC_SHARED(smem);
    BPPSA_SHARED(unsigned, shared_ticket, 1);
    BPPSA_SHARED(int, shared_hops, 1);
#ifdef BPPSA_WARP_D
    check_warp_shape<Factored>(p);
#endif
    const int d = p.d, R = d + p.affine;
    T* mat_x = reinterpret_cast<T*>(smem);
    T* mat_y = mat_x + R * d;
    // the carries after the aggregate's matrices, or from the base where it is formed in registers
    T* x = kWarpAggregate<T, Factored> ? mat_x : mat_y + R * d;
    T* y = x + d;
    T* tile = y + d;

    if (threadIdx.x == 0) {
        const bppsa::u64 ticket = bppsa::take_ticket(sync);
        if (ticket >= gridDim.x) bppsa::fail();                   // the counter was not 0 at the launch
        if (ticket + 1 == gridDim.x) bppsa::reset_ticket(sync);  // every ticket of this launch is taken
        shared_ticket[0] = (unsigned)ticket;
    }
    __syncthreads();
    const i64 ticket = shared_ticket[0];
    const i64 q = ticket / p.batch, b = ticket % p.batch;  // tickets run over chunk 0 of every row first
    const i64 chunks = (p.n + chunk - 1) / chunk;
    const i64 hi = p.n - q * chunk - 1, lo = hi + 1 - chunk < 0 ? 0 : hi + 1 - chunk;
    bppsa::u64* flags = sync + 1;
    // this launch's flag values: a flag of another epoch (an earlier launch's, or 0) is not published yet
    const bppsa::u64 aggregate_flag = (bppsa::u64)epoch * 4 + kAggregate;
    const bppsa::u64 inclusive_flag = (bppsa::u64)epoch * 4 + kInclusive;
    T* aggregates = work;
    T* inclusives = work + p.batch * chunks * R * d;
    auto aggregate_of = [&](i64 k) { return aggregates + (k * p.batch + b) * R * d; };
    auto inclusive_of = [&](i64 k) { return inclusives + (k * p.batch + b) * d; };

    // Steps 2 and 3, after the aggregate is published: x = the carry g_{hi+1} (shared), this chunk's inclusive
    // published.
    const auto carry_in = [&] {
        // 2. The carry g_{hi+1}: the last-state gradient for chunk 0, else decoupled look-back.
        if (q == 0) {
            copy_row(p.last(b), x, p.out_row(b, p.n), d);
        } else {
            if (threadIdx.x < 32) {  // warp 0: lane l inspects chunk q - 1 - l
                const int lane = threadIdx.x;
                const i64 k = q - 1 - lane;
                bppsa::u64 flag = 0;
                if (k >= 0)
                    while (((flag = bppsa::load_relaxed(&flags[k * p.batch + b])) >> 2) != (bppsa::u64)epoch)
                        bppsa::spin_pause();
                const unsigned inclusive = __ballot_sync(0xffffffffu, flag == inclusive_flag);
                int hops;
                if (inclusive) {
                    hops = __ffs(inclusive) - 1;
                } else {  // only aggregates in the window: wait for the farthest one's inclusive
                    hops = q - 1 < kLookBack - 1 ? (int)(q - 1) : kLookBack - 1;
                    if (lane == 0)
                        while (bppsa::load_relaxed(&flags[(q - 1 - hops) * p.batch + b]) != inclusive_flag)
                            bppsa::spin_pause();
                }
                bppsa::fence_acq_rel();  // what the polls saw published is visible to this lane's later reads ...
                if (lane == 0) shared_hops[0] = hops;
            }
            __syncthreads();  // ... and, through the barrier, to the whole block's
            copy_row(inclusive_of(q - 1 - shared_hops[0]), x, (T*)nullptr, d);
        }

        // 3. Push the carry through the aggregates of chunks q - hops .. q - 1 (farthest first), then, if a
        //    later chunk needs it, through this chunk's own: its inclusive g_lo = carry C + b, published so
        //    that later chunks need not wait for step 4. ONE call site for both: a carry recomputed here is
        //    bit-identical to the inclusive its chunk published, so the result does not depend on how far
        //    the look-back went (run-to-run identical bits whatever the schedule: deterministic).
        const int hops = q == 0 ? 0 : shared_hops[0];
        for (int l = hops - 1; l >= (q + 1 < chunks ? -1 : 0); --l) {
            const bool own = l < 0;
            product<1, 1>(AggregateStep<T>{aggregate_of(q - 1 - l), p.affine != 0, d}, x, y, 1, d, tile, tile_rows, 0,
                          own ? inclusive_of(q) : (T*)nullptr);
            if (!own) {  // the carry moves one chunk closer; the own product leaves x = the carry for step 4
                T* swap = x;
                x = y;
                y = swap;
            }
        }
        if (q + 1 < chunks) publish(&flags[q * p.batch + b], inclusive_flag);
    };

#ifdef BPPSA_WARP_D
    if constexpr (kWarpAggregate<T, Factored>) {
        // 1. and 4. by the block's one warp, in ONE instantiation of the sweep's step loop run twice (two inlined
        //    copies spilled at d = 32): pass 0 the aggregate (WarpAggregate; its affine row b is the sweep's
        //    state g, from 0), pass 1 the sweep from the carry, writing out[b, t]. Between them the ring and W
        //    give their memory to steps 2 and 3, and are staged again.
        using Aggregate = WarpAggregate<T, Factored>;
        Aggregate aggregate(reinterpret_cast<T*>(smem));
        T g = T(0);
#pragma unroll 1
        for (int pass = 0; pass < 2; ++pass) {
            WarpSweepOf<T, Factored, true> sweep(p, b, reinterpret_cast<T*>(smem));
            sweep.each_step(lo, hi, [&](const typename Aggregate::Column& col, i64 t) {
                g = sweep.apply(g, col);
                if (pass == 0)
                    aggregate.step(col);
                else if (sweep.live)
                    p.out_row(b, t)[sweep.lane] = g;
            });
            if (pass == 1) break;
            aggregate.store_to(aggregate_of(q), p.affine != 0, g);
            __syncthreads();  // the block is the warp: every lane's stores before thread 0's release
            publish(&flags[q * p.batch + b], aggregate_flag);
            carry_in();  // ends with a barrier: x complete
            g = sweep.live ? x[threadIdx.x] : T(0);
            __syncwarp(kFullMask);  // every lane has its carry before the ring overwrites it
        }
    } else
#endif
    {  // the block's shared-memory product (the generic module; wider or float64 chains)
        // 1. The aggregate [C; b] of steps hi .. lo: start from [I; 0], multiply by J_t, add δ_t to row d.
        for (int e = threadIdx.x; e < R * d; e += blockDim.x) mat_x[e] = e / d == e % d ? T(1) : T(0);
        for (i64 t = hi; t >= lo; --t) {
            if (t > lo) StepOf<T, Factored>::at(p, b, t - 1).prefetch();
            T* store = t == lo ? aggregate_of(q) : nullptr;
            product<kMatrixBlock, kMatrixBlock>(StepOf<T, Factored>::at(p, b, t), mat_x, mat_y, R, d, tile, tile_rows, d, store);
            T* swap = mat_x;
            mat_x = mat_y;
            mat_y = swap;
        }
        publish(&flags[q * p.batch + b], aggregate_flag);
        carry_in();
        // 4. The per-step gradients of the chunk: in a module specialised for d <= 32, by warp 0 alone with the
        //    warp-resident step (the carry x is complete: the last product or copy above ended with a barrier;
        //    then the warp's ring and W, over the matrices, are all the shared memory still in use), else by
        //    the whole block.
#ifdef BPPSA_WARP_D
        if (threadIdx.x >= kWarp) return;
        const T carry = (int)threadIdx.x < d ? x[threadIdx.x] : T(0);
        __syncwarp(kFullMask);  // every lane has its carry before the ring overwrites it
        WarpSweepOf<T, Factored, true>(p, b, reinterpret_cast<T*>(smem)).run(carry, lo, hi);
#else
        sweep<T, Factored>(p, b, lo, hi, x, y, tile, tile_rows);
#endif
    }
}

}  // namespace

#define BPPSA_PARAMS(T)                                                                                  \
    (const T* __restrict__ mat, const T* __restrict__ scales, const T* __restrict__ diagonal,            \
     const T* __restrict__ grad, T* __restrict__ out, T* work, unsigned long long* sync, i64 n, i64 batch, \
     i64 d, i64 m, i64 chunk, i64 affine, i64 tile_rows, i64 epoch)
#define BPPSA_HOST_ARGS(T)                                                                              \
    ((const T*)a[0], (const T*)a[1], (const T*)a[2], (const T*)a[3], (T*)a[4], (T*)a[5],               \
     (unsigned long long*)a[6], (i64)a[7], (i64)a[8], (i64)a[9], (i64)a[10], (i64)a[11], (i64)a[12],     \
     (i64)a[13], (i64)a[14])
#define BPPSA_PROBLEM(T) \
    Problem<T> { mat, scales, diagonal, grad, out, n, batch, (int)d, (int)m, (int)affine }

// A module holds the chunked kernels and either (specialised, -DBPPSA_WARP_D) the warp sweeps or (generic)
// the block sweeps; kernels/cuda.py picks the module per launch (Launch.warp_shape).
#define BPPSA_CHUNKED_KERNELS(T, SUFFIX)                                                                 \
    extern "C" __global__ void __launch_bounds__(kChunkedThreads<T, false>, kChunkedBlocksPerSm<T, false>)                       \
        bppsa_chunked_dense_##SUFFIX BPPSA_PARAMS(T) {                                                   \
        chunked_kernel<T, false>(BPPSA_PROBLEM(T), chunk, work, sync, epoch, (int)tile_rows);                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kChunkedThreads<T, true>, kChunkedBlocksPerSm<T, true>)                         \
        bppsa_chunked_factored_##SUFFIX BPPSA_PARAMS(T) {                                                \
        chunked_kernel<T, true>(BPPSA_PROBLEM(T), chunk, work, sync, epoch, (int)tile_rows);                   \
    }                                                                                                   \
    BPPSA_ENTRY(bppsa_chunked_dense_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))                       \
    BPPSA_ENTRY(bppsa_chunked_factored_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))

#define BPPSA_SWEEP_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1) bppsa_sweep_dense_##SUFFIX BPPSA_PARAMS(T) { \
        sweep_kernel<T, false>(BPPSA_PROBLEM(T), (int)tile_rows);                                       \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)                                           \
        bppsa_sweep_factored_##SUFFIX BPPSA_PARAMS(T) {                                                  \
        sweep_kernel<T, true>(BPPSA_PROBLEM(T), (int)tile_rows);                                        \
    }                                                                                                   \
    BPPSA_ENTRY(bppsa_sweep_dense_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))                         \
    BPPSA_ENTRY(bppsa_sweep_factored_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))

// One warp per block: the block is the row's warp (launch_config: block = 32, grid = B).
#define BPPSA_WARP_KERNELS(T, SUFFIX)                                                                   \
    extern "C" __global__ void __launch_bounds__(kWarp) bppsa_warpsweep_dense_##SUFFIX BPPSA_PARAMS(T) {  \
        warp_sweep_kernel<T, false>(BPPSA_PROBLEM(T));                                                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kWarp) bppsa_warpsweep_factored_##SUFFIX BPPSA_PARAMS(T) { \
        warp_sweep_kernel<T, true>(BPPSA_PROBLEM(T));                                                   \
    }                                                                                                   \
    BPPSA_ENTRY(bppsa_warpsweep_dense_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))                     \
    BPPSA_ENTRY(bppsa_warpsweep_factored_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))

BPPSA_CHUNKED_KERNELS(float, f32)
BPPSA_CHUNKED_KERNELS(double, f64)
#ifdef BPPSA_WARP_D
BPPSA_WARP_KERNELS(float, f32)
BPPSA_WARP_KERNELS(double, f64)
#ifndef __CUDACC__
// The host emulation's view of the layout, for the test that kernels/cuda.py:warp_layout computes the same.
template <class T, bool Lean>
long long warp_layout_value(long long factored, long long depth) {
    if (factored) return depth ? WarpSweepOf<T, true, Lean>::S : WarpSweepOf<T, true, Lean>::L::kBytes;
    return depth ? WarpSweepOf<T, false, Lean>::S : WarpSweepOf<T, false, Lean>::L::kBytes;
}
// The shared bytes (depth = 0) or the ring's depth (depth = 1) of the module's warp sweep.
extern "C" long long bppsa_warp_layout(long long factored, long long element_bytes, long long lean, long long depth) {
    if (element_bytes == 4)
        return lean ? warp_layout_value<float, true>(factored, depth) : warp_layout_value<float, false>(factored, depth);
    return lean ? warp_layout_value<double, true>(factored, depth) : warp_layout_value<double, false>(factored, depth);
}
#endif
#else
BPPSA_SWEEP_KERNELS(float, f32)
BPPSA_SWEEP_KERNELS(double, f64)
#endif
