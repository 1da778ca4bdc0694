// The BPPSA scan on CUDA: g_t = g_{t+1} J_t + δ_t for t = n-1 .. 0 (row gradients), per batch row.
//
// Three kernels per chain kind (dense, factored) and dtype (f32, f64):
//
//   bppsa_warpsweep_*  d <= 32 (factored: k <= 5 weight tiles): one warp per batch row runs the n steps
//                    in order, the state in registers (see "The warp-resident sweep" below).
//   bppsa_sweep_*    wider states: one block per batch row runs the n steps in order, through shared memory.
//   bppsa_chunked_*  ONE launch of B * p blocks, p = ceil(n / c): a block takes a ticket (atomicAdd),
//                    which names its (chunk q, row b); chunk q = 0 holds the LAST c steps (the block
//                    taking the last ticket sets the counter back to 0 for the next launch). It
//                    1. reduces its c steps to an aggregate X = [C; b] (g_lo = g_{hi+1} C + b),
//                       publishes it and sets its flag to AGGREGATE (release);
//                    2. looks back (decoupled look-back) over up to 32 earlier chunks of its row for
//                       the nearest one whose flag is INCLUSIVE, and pushes that chunk's left-boundary
//                       gradient through the aggregates in between: its carry g_{hi+1};
//                    3. publishes its own inclusive g_lo = carry C + b (flag INCLUSIVE), then
//                    4. sweeps its c steps from the carry, writing out[b, t] (d <= 32: warp 0 alone,
//                       with the warp-resident step).
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
// its operand (J_t, or the scaled rows s_t[j] W[j]) through the tile, so any d fits.
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
// Lane c owns g[c] (lanes >= d hold 0, kept so: the padding below multiplies their g); a step is
// y[c] = delta[c] + u[c] g[c] + sum_j a_j A[j][c], the a_j broadcast from the lane that holds them by
// __shfl_sync: no barrier and no shared-memory round trip of the state. The operand of the next step
// (scales / diagonal / delta, or a Jacobian column) is loaded into registers while this one computes.
// Factored: W (m x d, m = k d) is loaded ONCE per block into shared memory with a row stride of 32
// words (lane c reads W[j][c] at j * 32 + c: a compile-time offset per row, consecutive lanes on
// consecutive banks). Dense: lane c loads column c of J_t (row c of jacobians_t: strided across lanes,
// every element index clamped to d - 1). Loops over operand rows run in groups of kGroup rows (lanes l0 .. l0 + 3, an
// immediate shuffle source and shared offset each) and leave at the first group past d (uniform): rows
// d .. group end read padding that a dead lane's g = 0 cancels, and no integer division is executed.
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kGroup = 4;
constexpr int kMaxTiles = 5;  // factored weight rows m = k d with k <= 5 (LSTM: 5 tiles of [h; c])

template <class T, bool Factored>
struct WarpOperand;

template <class T>
struct WarpOperand<T, true> {  // s_t (lane l holds s_t[i d + l] of tile i), u_t[l], delta_t[l]
    T s[kMaxTiles], u, delta;
    // `lane` is clamped to d - 1 on dead lanes (valid addresses; their result is dropped)
    __device__ void load(const Problem<T>& p, i64 b, i64 t, int lane, int tiles) {
        const i64 step = b * p.n + t;
        const T* scales = p.scales + step * p.m + lane;
#pragma unroll
        for (int i = 0; i < kMaxTiles; ++i) {
            if (i == tiles) break;
            s[i] = scales[i * p.d];
        }
        u = p.diagonal ? p.diagonal[step * p.d + lane] : T(0);
        const T* direct = p.direct(b, t);
        delta = direct ? direct[lane] : T(0);
    }
    // y[c] = delta[c] + u[c] g[c] + sum_i sum_l (g[l] s[i d + l]) W[i d + l][c]; w: column c of W, stride 32
    __device__ T apply(T g, const T* w, int d, int tiles) const {
        T acc = delta + u * g;
#pragma unroll
        for (int i = 0; i < kMaxTiles; ++i) {
            if (i == tiles) break;  // uniform: the whole warp leaves together
            const T a = g * s[i];
            const T* rows = w + i * d * kWarp;
#pragma unroll
            for (int l0 = 0; l0 < kWarp; l0 += kGroup) {
                if (l0 >= d) break;
#pragma unroll
                for (int l = l0; l < l0 + kGroup; ++l) acc += __shfl_sync(kFullMask, a, l) * rows[l * kWarp];
            }
        }
        return acc;
    }
};

template <class T>
struct WarpOperand<T, false> {  // column c of J_t (J_t[i][c] = jacobians_t[c][i]) and delta_t[c]
    T column[kWarp], delta;
    __device__ void load(const Problem<T>& p, i64 b, i64 t, int lane, int) {
        const T* jt = p.mat + ((b * p.n + t) * p.d + lane) * p.d;
        const int last = p.d - 1;
#pragma unroll
        for (int i0 = 0; i0 < kWarp; i0 += kGroup) {
            if (i0 > last) break;
#pragma unroll
            for (int i = i0; i < i0 + kGroup; ++i) column[i] = jt[i < last ? i : last];  // padding: finite
        }
        const T* direct = p.direct(b, t);
        delta = direct ? direct[lane] : T(0);
    }
    // y[c] = delta[c] + sum_i g[i] J_t[i][c]
    __device__ T apply(T g, const T*, int d, int) const {
        T acc = delta;
#pragma unroll
        for (int i0 = 0; i0 < kWarp; i0 += kGroup) {
            if (i0 >= d) break;
#pragma unroll
            for (int i = i0; i < i0 + kGroup; ++i) acc += __shfl_sync(kFullMask, g, i) * column[i];
        }
        return acc;
    }
};

// Whether the warp-resident sweep takes this chain (kernels/cuda.py:warp_resident decides the same).
template <bool Factored>
__device__ bool warp_resident(int d, int m) {
    return d <= kWarp && (!Factored || (m % d == 0 && m / d <= kMaxTiles));
}

// Warp 0 of the block stages W in shared memory `w` (factored): rows padded to 32 words, kGroup - 1 zero
// rows after the last (the padding of the last group).
template <class T, bool Factored>
__device__ void stage_warp_weight(const Problem<T>& p, T* w) {
    if (!Factored) return;
    const bool live = (int)threadIdx.x < p.d;
    for (int j = 0; j < p.m + kGroup - 1; ++j)
        w[j * kWarp + threadIdx.x] = live && j < p.m ? p.mat[(i64)j * p.d + threadIdx.x] : T(0);
    __syncwarp(kFullMask);
}

// Steps hi .. lo of row b by warp 0, from the carry g_{hi+1} (lane c holds its element `g`), writing
// out[b, t]; w: the staged W (factored).
template <class T, bool Factored>
__device__ void warp_sweep(const Problem<T>& p, i64 b, i64 lo, i64 hi, T g, const T* w) {
    const int d = p.d, tiles = Factored ? p.m / p.d : 1;  // once per call
    const bool live = (int)threadIdx.x < d;
    const int lane = live ? (int)threadIdx.x : d - 1;  // a dead lane loads lane d - 1's operand, drops its result
    const T* w_column = w + threadIdx.x;
    g = live ? g : T(0);
    // Two operand buffers used in turn (no register copies): a step computes from one while the next
    // step's operand loads into the other.
    WarpOperand<T, Factored> even, odd;
    even.load(p, b, hi, lane, tiles);
    auto step = [&](const WarpOperand<T, Factored>& current, WarpOperand<T, Factored>& next, i64 t) {
        if (t > lo) next.load(p, b, t - 1, lane, tiles);
        const T y = current.apply(g, w_column, d, tiles);
        g = live ? y : T(0);
        if (live) p.out_row(b, t)[lane] = g;
    };
    for (i64 t = hi; t >= lo; t -= 2) {
        step(even, odd, t);
        if (t > lo) step(odd, even, t - 1);
    }
}

template <class T, bool Factored>
__device__ void warp_sweep_kernel(const Problem<T>& p) {
    BPPSA_DYNAMIC_SHARED(smem);
    T* w = reinterpret_cast<T*>(smem);
    stage_warp_weight<T, Factored>(p, w);
    const i64 b = blockIdx.x;
    const bool live = (int)threadIdx.x < p.d;
    const T g = live ? p.last(b)[threadIdx.x] : T(0);
    if (live) p.out_row(b, p.n)[threadIdx.x] = g;
    warp_sweep<T, Factored>(p, b, 0, p.n - 1, g, w);
}

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
    const int d = p.d, R = d + p.affine;
    T* mat_x = reinterpret_cast<T*>(smem);
    T* mat_y = mat_x + R * d;
    T* x = mat_y + R * d;
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

    // 4. The per-step gradients of the chunk: by warp 0 alone where the warp-resident step applies (the
    //    carry x is complete: the last product or copy above ended with a barrier; then W, staged over
    //    the matrices, is all the shared memory still in use), else by the whole block.
    if (warp_resident<Factored>(d, p.m)) {
        if (threadIdx.x >= kWarp) return;
        const T carry = (int)threadIdx.x < d ? x[threadIdx.x] : T(0);
        __syncwarp(kFullMask);  // every lane has its carry before W overwrites it
        T* w = reinterpret_cast<T*>(smem);
        stage_warp_weight<T, Factored>(p, w);
        warp_sweep<T, Factored>(p, b, lo, hi, carry, w);
        return;
    }
    sweep<T, Factored>(p, b, lo, hi, x, y, tile, tile_rows);
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

#define BPPSA_KERNELS(T, SUFFIX)                                                                        \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1) bppsa_sweep_dense_##SUFFIX BPPSA_PARAMS(T) { \
        sweep_kernel<T, false>(BPPSA_PROBLEM(T), (int)tile_rows);                                       \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)                                           \
        bppsa_sweep_factored_##SUFFIX BPPSA_PARAMS(T) {                                                  \
        sweep_kernel<T, true>(BPPSA_PROBLEM(T), (int)tile_rows);                                        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)                                           \
        bppsa_chunked_dense_##SUFFIX BPPSA_PARAMS(T) {                                                   \
        chunked_kernel<T, false>(BPPSA_PROBLEM(T), chunk, work, sync, epoch, (int)tile_rows);                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)                                           \
        bppsa_chunked_factored_##SUFFIX BPPSA_PARAMS(T) {                                                \
        chunked_kernel<T, true>(BPPSA_PROBLEM(T), chunk, work, sync, epoch, (int)tile_rows);                   \
    }                                                                                                   \
    BPPSA_ENTRY(bppsa_sweep_dense_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))                         \
    BPPSA_ENTRY(bppsa_sweep_factored_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))                      \
    BPPSA_ENTRY(bppsa_chunked_dense_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))                       \
    BPPSA_ENTRY(bppsa_chunked_factored_##SUFFIX, BPPSA_PARAMS(T), BPPSA_HOST_ARGS(T))

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

BPPSA_KERNELS(float, f32)
BPPSA_KERNELS(double, f64)
BPPSA_WARP_KERNELS(float, f32)
BPPSA_WARP_KERNELS(double, f64)
