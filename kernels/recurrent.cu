// Forward kernels of whole recurrent layers (one layer, one direction) that emit the states AND the
// Jacobian factors the BPPSA backward needs, in one pass over time. Torch's gate order.
//
// Cells (every kernel has the parameters of BPPSA_REC_PARAMS):
//   rnn_tanh  h = tanh(gi + W h_prev + b)     no factor: f' = 1 - h² is a function of out
//   rnn_relu  h = relu(gi + W h_prev + b)     no factor (f' = the mask h > 0, from out)
//   gru       gh = W h_prev + b; r = σ(gi_r + gh_r), z = σ(gi_z + gh_z),
//             n = tanh(gi_n + r gh_n), h = (h_prev - n) z + n (torch's form);
//             f0 = scales [dn gh_n r(1-r), (h_prev-n) z(1-z), dn r]   (B, T, 3H)
//             f1 = z (B, T, H), f2 = dn = (1-z)(1-n²) (B, T, H)
//   lstm      pre = gi + W h_prev (b_hh folded into gi); i, f, o = σ, g = tanh;
//             c = f c_prev + i g, h = o tanh(c); f0 = cells c_1..c_T (B, T, H),
//             f1 = activated gates [i, f, g, o] (B, T, 4H)
// Every kernel writes out (B, T, H) = h_1..h_T. Inputs: gi (B, T, G H) (x W_ihᵀ + b_ih, one GEMM before the
// launch, plus b_hh for RNN/LSTM when the caller folds it), w_hh (G H, H), b_hh (G H) or null, h0 (B, H),
// c0 (B, H) (LSTM only). All contiguous, batch-major.
//
// Two families, one block per batch row (grid = B), persistent over the T steps; thread j < H owns hidden
// unit j: it computes the G gate pre-activations of unit j (G dot products of length H), applies the cell
// and writes unit j of every output (neighbouring lanes write neighbouring addresses: coalesced).
//
// 1. bppsa_<cell>_forward_f32_h<H>: float32, H <= 32 a COMPILE-TIME constant (the module is compiled per H
//    on demand with -DBPPSA_REC_HIDDEN=<H>, or for a list with BPPSA_REC_HIDDEN_LIST(X) = X(1) X(5) ...),
//    one warp per row for the RNN cells; for GRU and LSTM a unit's G gates in G neighbouring lanes, 32 / G
//    units a warp (unit_group_forward: each lane one gate's dot product and activation, the unit's gates
//    exchanged by shuffles, every lane of the unit the cell's update; the stores shared out by gate; a block
//    barrier). A step's dependent path is: read h_{t-1} (KC broadcast LDS.128 from shared memory), the dot
//    products (fully unrolled, W_hh in registers: H floats a lane), the cell's functions, store h_t to shared
//    memory, a barrier (__syncwarp for one warp). Everything else is kept off that path (the time loops in
//    groups of steps: ring slots, state buffers and output offsets are immediates; their SASS pinned by the
//    tests):
//    - gi is staged through a ring of R = BPPSA_REC_RING step rows in shared memory, filled R - 1 steps
//      ahead by asynchronous copies (cp.async on sm_80+, bppsa_rec::RowCopy). The previous kernel loaded a
//      step's gi one step ahead, so a step could not be shorter than a global-load round trip: on an H100
//      it took ~375 ns a step at B16 T1000 H20 (gi in L2) against a modelled ~100 ns of dependent work, and
//      ~2x that at B256 T10000 (gi from DRAM): our reading of those measurements, not a profile. R - 2
//      steps of lead (~1.4 us at 100 ns a step) cover either latency.
//      PIPELINE INVARIANT (per lane, committed groups counted from the prologue's wait): iteration t
//      commits exactly one group, holding the lane's words of step t + R - 1 (empty beyond T) bound for slot
//      (t + R - 1) mod R = (t - 1) mod R, the slot step t - 1 read: every lane finished reading it before
//      the barrier that ended step t - 1, and the copy is issued after that barrier (after step t's own
//      loads, so that its instructions are not between the barrier and those loads). At the end of iteration
//      t, wait<R - 2> retires the groups of iterations <= t + 2 - R, i.e. step t + 1's row (steps < R - 1
//      come from the prologue, fully waited), and the barrier that follows makes it visible to every lane.
//      So step t reads slot t mod R, complete and not overwritten until iteration t + 1 issues its copy.
//    - b_hh is added to gi off the path ((gi + b) + dot; GRU's b_hn stays with its dot: r (W_hn h + b_hn)).
//    - out and the factors are stored straight to global memory (stores do not wait), by the lanes j < H;
//      lanes H..31 shadow unit H - 1 (every read in bounds, no per-lane guard inside the step) and store
//      nothing.
//    - Rows per block: one. The rows are independent, so packing several rows into a warp (H <= 16)
//      shares issue slots without shortening the dependent step; it pays only when B exceeds about 4 warps
//      per SM (one per scheduler: B > ~500 on an H100), beyond this design's range.
// 2. bppsa_<cell>_forward_{f32,f64}: any H <= 256 that fits (float64, and float32 with H > 32), W_hh in
//    shared memory, packed so that thread j reads its weights as 16-byte vectors (float4 / double2) and the 32
//    lanes of a warp read 32 consecutive vectors (no bank conflict):
//        w[((g KC + kc) H + j) V + v] = W_hh[g H + j][kc V + v],  V = 16 / sizeof(T), KC = ceil(H / V)
//    (columns k >= H are zero padding); gi is loaded into registers kForwardAhead steps ahead; the barrier
//    is __syncwarp when the block is one warp, else __syncthreads. Float32 with 32 < H compiles the same
//    kernel per cell and H (shared_forward's HF) with unit j's G rows of W_hh split over 1-2 lanes, in
//    registers where they fit (recurrent_cuda.wide_layout: RNN H <= 192, GRU H <= 104, LSTM H <= 72), else
//    partly in registers and the rest packed in shared memory. Where that shared memory exceeds a block's
//    (sm_90 at 227 KiB: GRU H > 160, LSTM H > 133), or H a block's 256 units (up to 512), a row runs as a
//    thread-block cluster of Q blocks
//    (recurrent_cuda.cluster_layout; BPPSA_REC_CLUSTER): block q owns units [q U, q U + U), U = ceil(H / Q),
//    their rows in its registers and shared memory, and stores its units' h_t into the state buffer of every
//    block of the cluster (distributed shared memory); the step's barrier is the cluster's, split: arrive
//    (release) after those stores, then the step's global stores, then wait (acquire). The backward alike
//    (its units' columns; its row r_t shared so).
// Both keep the state h_{t-1} in shared memory (two buffers of KC V values: step t reads one and writes the
// other, so ONE barrier per step suffices); a lane reads it as broadcast 16-byte vectors. The unit's own
// h_{t-1}[j] and c_{t-1}[j] stay in registers. V independent partial sums per gate break the FMA chains.
// Shared memory (computed by kernels/recurrent_cuda.py:shared_bytes, which with prepare picks the kernel
// and returns None where the caller runs torch's forward): family 1 the RNN's 2 32 + R H floats (its state
// buffers a value a lane), GRU / LSTM 2 KC 4 + R 32 W (the ring a word a thread of W warps), family 2
// (G H + 2) KC V elements.
#include "cuda_host_emulation.h"
#include "recurrent_emulation.h"

#ifndef BPPSA_REC_RING
#define BPPSA_REC_RING 16  // recurrent_cuda.RING_DEPTH passes it explicitly
#endif

namespace {

using i64 = long long;
[[maybe_unused]] constexpr int kMaxThreads = 256;  // family 2: H <= 256, one thread per hidden unit
constexpr int kRing = BPPSA_REC_RING;
static_assert(kRing >= 2, "the gi ring needs two slots: one being read, one being filled");
[[maybe_unused]] constexpr int kBackwardAhead = 4;  // steps of operands a backward thread has in flight (cell_backward)
static_assert(kBackwardAhead % 2 == 0, "cell_backward's groups: a step's row buffer from its parity in the group");
[[maybe_unused]] constexpr int kForwardAhead = 4;   // steps of gi a forward thread has in flight (shared_forward)
// steps of a group of fixed_forward's time loop (unrolled: ring slots and state buffers at compile-time
// offsets), dividing the ring (a group never wraps it); 4 where the ring allows
[[maybe_unused]] constexpr int kFixedUnroll = kRing % 4 == 0 ? 4 : kRing % 2 == 0 ? 2 : 1;

enum Cell { kRnnTanh, kRnnRelu, kGru, kLstm };
// the cells by their names in kernel names (BPPSA_REC_CELL)
[[maybe_unused]] constexpr Cell kCell_rnn_tanh = kRnnTanh, kCell_rnn_relu = kRnnRelu, kCell_gru = kGru,
                                kCell_lstm = kLstm;

template <int C>
constexpr int kGates = C == kGru ? 3 : C == kLstm ? 4 : 1;
template <int C>
constexpr int kFactors = C == kGru || C == kLstm ? 5 : 0;
// GRU's b_hn is multiplied by r (it belongs to the hidden side); every other bias adds to gi.
template <int C>
__device__ constexpr bool bias_inside(int g) { return C == kGru && g == 2; }

template <class T>
struct alignas(16) Pack {  // one 16-byte shared-memory access
    static constexpr int kWidth = 16 / sizeof(T);
    T v[kWidth];
};

template <class T>
struct Layer {
    const T* __restrict__ gi;
    const T* __restrict__ w_hh;
    const T* __restrict__ b_hh;
    const T* __restrict__ h0;
    const T* __restrict__ c0;
    T* __restrict__ out;
    T* __restrict__ f0;
    T* __restrict__ f1;
    T* __restrict__ f2;
    i64 batch, steps;
    int hidden;
};

// A gate's value where it needs no other gate: GRU's r and z, every LSTM gate activated; GRU's n needs r, so
// its hidden part v passes through (its input part u goes to cell_combine beside it).
template <class T, int C>
__device__ __forceinline__ T gate_stage(int g, T u, T v) {
    if constexpr (C == kGru) return g < 2 ? bppsa_rec::sigmoid_of(u + v) : v;
    return g == 2 ? bppsa_rec::tanh_of(u + v) : bppsa_rec::sigmoid_of(u + v);
}

// gate_stage for a lane of unit_group_forward, whose warp's lanes take different gates g: every function the
// cell's gates take computed, the lane's selected (a branch on g would diverge).
template <int C>
__device__ __forceinline__ float lane_gate_stage(int g, float u, float v) {
    const float sigmoid = bppsa_rec::sigmoid_of(u + v);
    if constexpr (C == kGru) return g < 2 ? sigmoid : v;
    const float tanh = bppsa_rec::tanh_of(u + v);
    return g == 2 ? tanh : sigmoid;
}

// The gated cells' update from their gate_stage values a (u2: GRU's input part of n); c is the LSTM's cell
// state (updated); f receives the unit's factors. Returns h_t.
template <class T, int C>
__device__ __forceinline__ T cell_combine(const T (&a)[kGates<C>], T u2, T h_prev, T& c, T (&f)[kFactors<C>]) {
    if constexpr (C == kGru) {
        const T r = a[0], z = a[1];
        const T n = bppsa_rec::tanh_of(u2 + r * a[2]);
        const T diff = h_prev - n;
        const T dn = (T(1) - z) * (T(1) - n * n);
        f[0] = dn * a[2] * r * (T(1) - r);  // scales
        f[1] = diff * z * (T(1) - z);
        f[2] = dn * r;
        f[3] = z;
        f[4] = dn;
        return diff * z + n;
    } else {
        c = a[1] * c + a[0] * a[2];
        f[0] = c;  // cells
#pragma unroll
        for (int g = 0; g < 4; ++g) f[1 + g] = a[g];  // activated gates: in, forget, cand, out
        return a[3] * bppsa_rec::tanh_of(c);
    }
}

// The cell on one unit: u[g] = gi_g (+ b_g unless inside), v[g] = (W h_prev)_g (+ b_g if inside); c is the
// LSTM's cell state (updated); f receives the unit's factors. Returns h_t.
template <class T, int C>
__device__ __forceinline__ T cell_update(const T (&u)[kGates<C>], const T (&v)[kGates<C>], T h_prev, T& c,
                                         T (&f)[kFactors<C> ? kFactors<C> : 1]) {
    if constexpr (C == kRnnTanh) {
        return bppsa_rec::tanh_of(u[0] + v[0]);
    } else if constexpr (C == kRnnRelu) {
        const T a = u[0] + v[0];
        return a <= T(0) ? T(0) : a;  // a NaN stays NaN, as torch's relu
    } else {
        T a[kGates<C>];
#pragma unroll
        for (int g = 0; g < kGates<C>; ++g) a[g] = gate_stage<T, C>(g, u[g], v[g]);
        return cell_combine<T, C>(a, u[2], h_prev, c, f);
    }
}

// Running pointers to unit j of step t of every output of row b (advanced once per step: no 64-bit index
// products in the loop), and the per-step stores.
template <class T, int C>
struct Outputs {
    static constexpr int W0 = C == kGru ? 3 : 1, W1 = C == kLstm ? 4 : 1;  // factor widths, in units of H
    T *out, *f0, *f1, *f2;

    __device__ Outputs(const Layer<T>& p, i64 b, int H, int j) {
        const i64 first = b * p.steps;  // row b, step 0
        out = p.out + first * H + j;
        f0 = kFactors<C> ? p.f0 + first * W0 * H + j : nullptr;
        f1 = kFactors<C> ? p.f1 + first * W1 * H + j : nullptr;
        f2 = C == kGru ? p.f2 + first * H + j : nullptr;
    }
    __device__ __forceinline__ void store(T h, const T (&f)[kFactors<C> ? kFactors<C> : 1], int H) {
        *out = h;
        if constexpr (C == kGru) {
            f0[0] = f[0];
            f0[H] = f[1];
            f0[2 * H] = f[2];
            *f1 = f[3];
            *f2 = f[4];
        } else if constexpr (C == kLstm) {
            *f0 = f[0];
#pragma unroll
            for (int g = 0; g < 4; ++g) f1[g * H] = f[1 + g];  // activated gates: in, forget, cand, out
        }
    }
    // unit_group_forward: the lane of gate g points at its gate's own factor (GRU: f0's scale g, LSTM: f1's gate g)
    __device__ __forceinline__ void own_gate(int g, int H) {
        if constexpr (C == kGru) f0 += g * H;
        if constexpr (C == kLstm) f1 += g * H;
    }
    // ... and stores its share of the unit's outputs (h_t, the factors f, `mine`: its gate's activated value),
    // predicated on g (no branch): gate 0 out, every gate its own factor (GRU: scale g, LSTM: gate g), GRU's
    // gates 1 and 2 z and dn, LSTM's gate 1 the cell
    __device__ __forceinline__ void store_share(T h, const T (&f)[kFactors<C> ? kFactors<C> : 1], T mine, int g) {
        if (g == 0) *out = h;
        if constexpr (C == kGru) {
            *f0 = g == 0 ? f[0] : g == 1 ? f[1] : f[2];
            if (g == 1) *f1 = f[3];
            if (g == 2) *f2 = f[4];
        } else if constexpr (C == kLstm) {
            *f1 = mine;
            if (g == 1) *f0 = f[0];
        }
    }
    __device__ __forceinline__ void advance(int H) {
        out += H;
        if constexpr (kFactors<C> > 0) f0 += W0 * H, f1 += W1 * H;
        if constexpr (C == kGru) f2 += H;
    }
};

// ---- family 1: float32, H <= 32 known at compile time, W_hh in registers, gi through the ring -----------

// The time loop of the forward kernels that stage gi through the ring: step(k, t, guarded) for t = 0 .. T - 1
// in groups of U (k = t - t0 a compile-time index where the group's loop unrolls), next_group() after each;
// `guarded` where the copy a step issues, of step t + R - 1, may lie beyond T (the groups near the end).
template <int U, class Step, class Next>
__device__ __forceinline__ void ring_groups(const i64 steps, Step& step, Next& next_group) {
    i64 t0 = 0;
    for (; t0 + U - 1 + kRing - 1 < steps; t0 += U) {  // every copy of the group within T
#pragma unroll
        for (int k = 0; k < U; ++k) step(k, t0 + k, false);
        next_group();
    }
    for (; t0 < steps; t0 += U) {
#pragma unroll
        for (int k = 0; k < U; ++k)
            if (t0 + k < steps) step(k, t0 + k, true);  // the same t in every thread: the barriers stay uniform
        next_group();
    }
}


template <int C, int H>
__device__ void fixed_forward(const Layer<float>& p) {
    static_assert(H >= 1 && H <= 32, "one warp: one lane per hidden unit");
    static_assert(kGates<C> == 1, "the RNN cells (the gated cells: unit_group_forward, a lane a gate of a unit)");
    constexpr int KC = (H + 3) / 4, A = H < 4 ? H : 4, U = kFixedUnroll;
    const int lane = threadIdx.x % 32;
    const bool active = lane < H;
    const int j = active ? lane : H - 1;  // lanes >= H shadow unit H - 1, store h into padding, nothing else
    const i64 b = blockIdx.x, steps = p.steps;

    BPPSA_DYNAMIC_SHARED(smem);
    // two buffers of a value per lane (16-byte aligned): every lane stores its h_t, those >= H into padding that
    // no product reads (a store no lane skips: the step needs no branch around it)
    float* state = reinterpret_cast<float*>(smem);
    float* ring = state + 2 * 32;  // kRing slots of one step's gi row (H values)

    const float* src = p.gi + b * steps * H;  // row b's gi, step 0
    bppsa_rec::RowCopy<H> copy;
    // prologue: steps 0 .. R-2 in flight together, waited for before the first step
    for (int s = 0; s < kRing - 1 && s < steps; ++s) copy.start(ring + s * H, src + s * H);
    copy.commit();
    src += (kRing - 1) * H;  // the row step 0 requests

    float w[H];
#pragma unroll
    for (int k = 0; k < H; ++k) w[k] = p.w_hh[j * H + k];
    const float u_bias = p.b_hh ? p.b_hh[j] : 0.0f;  // the RNN's b_hh adds to gi
    state[lane] = active ? p.h0[b * H + lane] : 0.0f;
    state[32 + lane] = 0.0f;
    float h_own = p.h0[b * H + j], c_own = 0.0f;
    float* out = p.out + b * steps * H + j;  // unit j of row b's h_1
    copy.template wait<0>();
    bppsa_rec::warp_barrier();

    // Step t = t0 + k of a group of U (t0 a multiple of U, held in slots base .. base + U - 1 of the ring): k is a
    // compile-time constant where the group's loop unrolls, so the state buffer (k's parity), the ring slots
    // and the offsets of out and src are immediates, the loop's bookkeeping once a group. `guarded`: the copy
    // may lie beyond T (the last groups).
    int base = 0;
    const auto step = [&](const int k, const i64 t, const bool guarded) {
        const int parity = U % 2 ? int(t & 1) : k & 1;  // the buffer h_{t-1} is in (t0 even where U is)
        const float* h_in = state + parity * 32;
        float* h_out = state + (parity ^ 1) * 32;
        const float u[1] = {ring[(base + k) * H + j] + u_bias};
        float acc[A];
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            const Pack<float> hv = reinterpret_cast<const Pack<float>*>(h_in)[kc];  // one broadcast LDS.128
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                if (4 * kc + v >= H) break;
                acc[v] = kc == 0 ? w[v] * hv.v[v] : fmaf(w[4 * kc + v], hv.v[v], acc[v]);
            }
        }
        float sum = A == 4 ? (acc[0] + acc[1]) + (acc[2] + acc[3]) : acc[0];
        if constexpr (A == 2 || A == 3) sum += acc[1];
        if constexpr (A == 3) sum += acc[2];
        const float v[1] = {sum};
        float f[1];  // the RNN cells have no factors
        h_own = cell_update<float, C>(u, v, h_own, c_own, f);
        h_out[lane] = h_own;
        if (active) out[k * H] = h_own;
        // The copy of step t + R - 1 into slot (t - 1) mod R, the one step t - 1 read (free since the last
        // barrier), issued after this step's loads: its instructions overlap the store of h_t instead of
        // delaying the loads.
        const int slot = k > 0 ? base + k - 1 : (base == 0 ? kRing - 1 : base - 1);
        if (!guarded || t + kRing - 1 < steps) copy.start(ring + slot * H, src + k * H);
        copy.commit();  // one group per step, empty near the end: wait<R - 2> counts steps
        copy.template wait<kRing - 2>();  // step t + 1's row has landed (in this lane's view) ...
        bppsa_rec::warp_barrier();  // ... and in every lane's, with h_t; nobody reads slot t or h_in any more
    };
    const auto next_group = [&] {
        out += U * H;
        src += U * H;
        base = base + U == kRing ? 0 : base + U;
    };
    ring_groups<U>(steps, step, next_group);
    copy.template wait<0>();  // no copy outlives the block (only empty groups can be pending here)
}

// The gated cells (GRU, LSTM) at H <= 32, a unit's gates in neighbouring lanes: lane u G + g of warp w holds
// gate g of unit j = w U + u (U = kGroupUnits: 10 GRU units a warp, 8 LSTM ones; kGroupWarps warps), row g H + j
// of W_hh in registers, and stages its own word of gi through the ring (read by itself alone: its wait makes
// it visible, no barrier). A step: the lane's gate (its dot product of h_{t-1} and gate_stage), the unit's G
// values exchanged by shuffles, every lane of the unit cell_combine alike (the same bits), the stores shared
// out by gate (Outputs::store_share), h_t into the state buffer; then ONE block barrier (every unit's h_t
// before step t + 1 reads the state). The previous design, a warp a gate, took two a step (its gates through
// shared memory, then h_t), each a round trip through shared memory on the step's dependent chain (issued
// GRU / LSTM 144 / 135 instructions a warp a step at H = 20, sm_90; on an H100 at b2ef8cf 438 / 467 ns a step
// against cuDNN's 362 / 330). Lanes beyond the units (a GRU warp's lanes 30 and 31, the last warp's beyond H)
// shadow unit H - 1 and store nothing. Everything a lane does depends on its gate g only through selects and
// predicated stores: the lanes of a warp take different g, a branch on it would diverge.
template <int C>
constexpr int kGroupUnits = 32 / kGates<C>;
template <int C, int H>
constexpr int kGroupWarps = (H + kGroupUnits<C> - 1) / kGroupUnits<C>;

template <int C, int H>
__device__ void unit_group_forward(const Layer<float>& p) {
    static_assert(H >= 1 && H <= 32 && (C == kGru || C == kLstm), "gated cells, a lane a gate of a unit");
    constexpr int G = kGates<C>, GH = G * H, KC = (H + 3) / 4, P = 4 * KC, A = H < 4 ? H : 4;
    constexpr int kThreads = 32 * kGroupWarps<C, H>;
    const int lane = threadIdx.x % 32, g = lane % G, leader = lane - g;  // leader: the lane of the unit's gate 0
    const int unit = static_cast<int>(threadIdx.x) / 32 * kGroupUnits<C> + lane / G;
    const bool active = lane / G < kGroupUnits<C> && unit < H;
    const int j = active ? unit : H - 1;  // the shadows compute unit H - 1's gate g and store nothing
    const i64 b = blockIdx.x, steps = p.steps;

    BPPSA_DYNAMIC_SHARED(smem);
    float* state = reinterpret_cast<float*>(smem);  // two buffers of P values (16-byte aligned)
    float* ring = state + 2 * P + threadIdx.x;      // kRing slots of kThreads words: this thread's word of each

    const float* src = p.gi + b * steps * GH + g * H + j;  // this lane's word of row b's gi, step 0
    bppsa_rec::RowCopy<32> copy;
    for (int s = 0; s < kRing - 1 && s < steps; ++s) copy.start_word(ring + s * kThreads, src + s * GH);
    copy.commit();
    src += (kRing - 1) * GH;

    float w[H];
#pragma unroll
    for (int k = 0; k < H; ++k) w[k] = p.w_hh[(g * H + j) * H + k];
    const float bias = p.b_hh ? p.b_hh[g * H + j] : 0.0f;
    const bool inside = C == kGru && g == 2;
    const float u_bias = inside ? 0.0f : bias;
    for (int e = threadIdx.x; e < P; e += blockDim.x) {
        state[e] = e < H ? p.h0[b * H + e] : 0.0f;
        state[P + e] = 0.0f;
    }
    float h_own = p.h0[b * H + j], c_own = C == kLstm ? p.c0[b * H + j] : 0.0f;
    Outputs<float, C> outputs(p, b, H, j);
    outputs.own_gate(g, H);
    copy.template wait<0>();
    __syncthreads();

    // Step t = t0 + k of a group of U, as fixed_forward's: ring slots, state buffers and gi's offsets at
    // compile-time offsets, the bookkeeping once a group, `guarded` where the copy may lie beyond T. The LSTM's
    // groups of 4, the GRU's of 2 (by 4 ptxas spilled the GRU's registers at H = 8, 23 and 32 a warp a gate).
    constexpr int U = C == kLstm && kRing % 4 == 0 ? 4 : kRing % 2 == 0 ? 2 : 1;
    int base = 0;
    const auto step = [&](const int k, const i64 t, const bool guarded) {
        const int parity = U % 2 ? int(t & 1) : k & 1;  // the buffer h_{t-1} is in
        const float* h_in = state + parity * P;
        float* h_out = state + (parity ^ 1) * P;
        const float u = ring[(base + k) * kThreads] + u_bias;
        float acc[A];
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            const Pack<float> hv = reinterpret_cast<const Pack<float>*>(h_in)[kc];  // one broadcast LDS.128
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                if (4 * kc + v >= H) break;
                acc[v] = kc == 0 ? w[v] * hv.v[v] : fmaf(w[4 * kc + v], hv.v[v], acc[v]);
            }
        }
        float sum = A == 4 ? (acc[0] + acc[1]) + (acc[2] + acc[3]) : acc[0];
        if constexpr (A == 2 || A == 3) sum += acc[1];
        if constexpr (A == 3) sum += acc[2];
        const float v = inside ? sum + bias : sum;  // x + 0.0f is not folded (-0): only where the bias is
        const float mine = lane_gate_stage<C>(g, u, v);
        // the copy of step t + R - 1 into slot (t - 1) mod R, the one this lane read at step t - 1 (its value used)
        const int slot = k > 0 ? base + k - 1 : (base == 0 ? kRing - 1 : base - 1);
        if (!guarded || t + kRing - 1 < steps) copy.start_word(ring + slot * kThreads, src + k * GH);
        copy.commit();

        float a[G], f[kFactors<C>];
#pragma unroll
        for (int q = 0; q < G; ++q) a[q] = __shfl_sync(0xffffffffu, mine, leader + q);
        const float u2 = C == kGru ? __shfl_sync(0xffffffffu, u, leader + 2) : 0.0f;  // n's input part
        const float h_new = cell_combine<float, C>(a, u2, h_own, c_own, f);
        if (active) {
            if (g == 0) h_out[j] = h_new;
            outputs.store_share(h_new, f, mine, g);
        }
        h_own = h_new;
        outputs.advance(H);
        copy.template wait<kRing - 2>();  // step t + 1's word has landed (this lane reads it alone) ...
        __syncthreads();  // ... and every unit's h_t is in the state; nobody reads h_in any more
    };
    const auto next_group = [&] {
        src += U * GH;
        base = base + U == kRing ? 0 : base + U;
    };
    ring_groups<U>(steps, step, next_group);
    copy.template wait<0>();
}

// The sum of v over the S adjacent lanes of a unit (S a power of two within a warp; every lane of the warp
// calls it): a butterfly of shuffles, which hands every lane the same bits (each addition commutes).
template <int S, class T>
__device__ __forceinline__ T unit_sum(T v) {
#pragma unroll
    for (int o = S / 2; o > 0; o /= 2) v += __shfl_sync(0xffffffffu, v, (threadIdx.x % 32) ^ o);
    return v;
}

// The units a block owns: all H of them, or in a cluster of Q blocks (float32, compiled per H) the
// per_block = ceil(H / Q) units from first = rank per_block (the last block may own fewer). A lane's unit:
// its `local` one, or, beyond the block's units, the block's last (shadowed: read, never stored).
struct ClusterUnits {
    __device__ ClusterUnits(int hidden, int per_block_, unsigned rank, int local)
        : per_block(per_block_), first(static_cast<int>(rank) * per_block_) {
        const int owned = hidden - first < per_block ? hidden - first : per_block;
        active = local < owned;
        unit = first + (active ? local : owned - 1);
    }
    int per_block, first, unit;
    bool active;
};

// A value of the state or row a step shares: into this block's shared memory, or in a cluster of Q blocks
// into every block's at the same offset (each block reads the whole vector from its own copy).
template <int Q, class T>
__device__ __forceinline__ void share(T* at, T v) {
    if constexpr (Q == 1) {
        *at = v;
    } else {
#pragma unroll
        for (int q = 0; q < Q; ++q) bppsa::store_cluster(at, static_cast<unsigned>(q), v);
    }
}

// ---- family 2: any H, W_hh in shared memory; or float32 H > 32 compiled per H, W_hh in registers ----------
//
// HF > 0 (a module compiled per cell and H, float32): unit j's rows of W_hh (G rows of H) split over S lanes a
// unit as the backward's columns (cell_backward below): lane s holds the 16-byte packs c = rc S + s of each
// row, the first RR in registers and the others in shared memory (lane by lane: neighbouring lanes read
// neighbouring packs), and reads the same packs of h_{t-1}; the S partial sums of a gate meet in a butterfly
// of shuffles, every lane of the unit runs the cell alike, the first one stores. HF = 0: W_hh in shared
// memory (above). Both take gi kForwardAhead steps ahead into registers (the time loop unrolled by
// that many, as the backward's operands: a lead of one step would not cover a load's latency once the step
// is short).

template <class T, int C, int HF = 0, int S = 1, int RR = -1, int Q = 1>
__device__ void shared_forward(const Layer<T>& p) {
    constexpr int G = kGates<C>, V = Pack<T>::kWidth;
    constexpr int RC = HF ? ((HF + V - 1) / V + S - 1) / S : 1;  // HF > 0: the packs of a row a lane has
    constexpr int RG = HF ? (RR < 0 || RR > RC ? RC : RR) : 1, RSH = HF ? RC - RG : 0;  // in registers / shared
    static_assert(HF == 0 || sizeof(T) == 4, "the per-H kernels: float32");
    static_assert(S >= 1 && S <= 32 && (S & (S - 1)) == 0, "a unit's lanes: a power of two within a warp");
    static_assert(Q == 1 || HF > 0, "a cluster's kernels are compiled per H");
    const int H = HF ? HF : p.hidden, KC = HF ? RC * S : (H + V - 1) / V, P = KC * V;
    const ClusterUnits units(H, (H + Q - 1) / Q, Q > 1 ? bppsa::cluster_rank() : 0u, threadIdx.x / S);
    const int part = threadIdx.x % S, j = units.unit;
    const bool active = units.active, first = active && part == 0;
    const int unit = j;  // HF > 0: lanes beyond the block's units shadow its last one, store nothing
    const i64 b = blockIdx.x / Q, steps = p.steps;
    const bool one_warp = Q == 1 && (HF ? HF * S <= 32 : blockDim.x <= 32);

    BPPSA_DYNAMIC_SHARED(smem);
    // HF = 0: W_hh packed, then the state buffers; HF > 0: the state buffers, then the packs beyond a lane's
    // RG, lane by lane ([g][rs][unit][part]: neighbouring lanes read neighbouring 16-byte packs)
    T* w = reinterpret_cast<T*>(smem) + (HF ? 2 * P : 0);
    T* state = reinterpret_cast<T*>(smem) + (HF ? 0 : G * P * H);  // two buffers of P values
    T w_reg[HF ? G : 1][HF ? RG * V : 1];                           // HF > 0: the lane's first RG packs of each row
    if constexpr (HF > 0) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int rc = 0; rc < RG; ++rc)
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    const int k = (rc * S + part) * V + v;
                    w_reg[g][rc * V + v] = k < H ? p.w_hh[(i64)(g * H + unit) * H + k] : T(0);
                }
        const int NU = units.per_block;
        for (int e = threadIdx.x; e < G * RSH * NU * S * V; e += blockDim.x) {  // once per launch
            const int v = e % V, lane = e / V % S, u = e / (V * S) % NU, rs = e / (V * S * NU) % (RSH ? RSH : 1);
            const int g = e / (V * S * NU * (RSH ? RSH : 1)), k = ((RG + rs) * S + lane) * V + v;
            const int owned = units.first + u;  // units beyond H (a last block's padding): zeros, never read
            w[e] = k < H && owned < H ? p.w_hh[(i64)(g * H + owned) * H + k] : T(0);
        }
    } else {
        for (int e = threadIdx.x; e < G * P * H; e += blockDim.x) {  // once per launch: off the critical path
            const int v = e % V, u = e / V % H, gk = e / (V * H);  // gk = g KC + kc
            const int k = gk % KC * V + v, g = gk / KC;
            w[e] = k < H ? p.w_hh[(i64)(g * H + u) * H + k] : T(0);
        }
    }
    for (int e = threadIdx.x; e < 2 * P; e += blockDim.x) state[e] = e < H ? p.h0[b * H + e] : T(0);

    const T* gi = p.gi + b * steps * G * H + unit;  // unit j of row b's gi, step 0
    Outputs<T, C> outputs(p, b, H, unit);
    T h_own = p.h0[b * H + unit], c_own = C == kLstm ? p.c0[b * H + unit] : T(0), u_bias[G], v_bias[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const T bias = p.b_hh ? p.b_hh[g * H + unit] : T(0);
        u_bias[g] = bias_inside<C>(g) ? T(0) : bias;
        v_bias[g] = bias_inside<C>(g) ? bias : T(0);
    }
    // gi of the next K steps in flight: ahead[k] holds step base + k's and is refilled, once used, with step
    // base + k + K's (k a compile-time index: no register moves waiting for the loads)
    T ahead[kForwardAhead][G];
    const auto load = [&](T (&row)[G], i64 t) {
        if (t < steps)
#pragma unroll
            for (int g = 0; g < G; ++g) row[g] = gi[t * G * H + g * H];
    };
#pragma unroll
    for (int k = 0; k < kForwardAhead; ++k) load(ahead[k], k);
    // a cluster: every block's state buffers are written before a peer's first store into them
    if constexpr (Q > 1)
        bppsa::cluster_sync();
    else
        __syncthreads();

    const Pack<T>* w_own = reinterpret_cast<const Pack<T>*>(w) + unit;
    for (i64 base = 0; base < steps; base += kForwardAhead) {
#pragma unroll
        for (int k = 0; k < kForwardAhead; ++k) {
            const i64 t = base + k;
            if (t >= steps) break;  // the same t in every thread: the barriers stay uniform
            const Pack<T>* h = reinterpret_cast<const Pack<T>*>(state + (t & 1) * P);
            T* h_next = state + ((t + 1) & 1) * P;
            T u[G];
#pragma unroll
            for (int g = 0; g < G; ++g) u[g] = ahead[k][g] + u_bias[g];
            load(ahead[k], t + kForwardAhead);

            T acc[G][V];
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int v = 0; v < V; ++v) acc[g][v] = T(0);
            if constexpr (HF > 0) {
#pragma unroll
                for (int rc = 0; rc < RG; ++rc) {
                    const Pack<T> hv = h[rc * S + part];
#pragma unroll
                    for (int g = 0; g < G; ++g)
#pragma unroll
                        for (int v = 0; v < V; ++v) acc[g][v] += hv.v[v] * w_reg[g][rc * V + v];
                }
                const Pack<T>* w_packs = reinterpret_cast<const Pack<T>*>(w) + (unit - units.first) * S + part;
#pragma unroll
                for (int rs = 0; rs < RSH; ++rs) {
                    const Pack<T> hv = h[(RG + rs) * S + part];
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const Pack<T> wv = w_packs[(g * RSH + rs) * units.per_block * S];
#pragma unroll
                        for (int v = 0; v < V; ++v) acc[g][v] += hv.v[v] * wv.v[v];
                    }
                }
            } else if (active) {
                for (int kc = 0; kc < KC; ++kc) {
                    const Pack<T> hv = h[kc];
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const Pack<T> wv = w_own[(g * KC + kc) * H];
#pragma unroll
                        for (int v = 0; v < V; ++v) acc[g][v] += hv.v[v] * wv.v[v];
                    }
                }
            }
            T v[G], f[kFactors<C> ? kFactors<C> : 1];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                T sum = acc[g][0];
#pragma unroll
                for (int e = 1; e < V; ++e) sum += acc[g][e];
                sum = unit_sum<S>(sum);
                v[g] = bias_inside<C>(g) ? sum + v_bias[g] : sum;
            }
            if (HF > 0 || active) {
                const T h_new = cell_update<T, C>(u, v, h_own, c_own, f);
                h_own = h_new;
                if (first) share<Q>(h_next + j, h_new);
                // a cluster: the peers' copies released, the outputs stored after it (its release waits for
                // every store before it, global ones too)
                if constexpr (Q > 1) bppsa::cluster_arrive();
                if (first) outputs.store(h_new, f, H);
            }
            outputs.advance(H);
            // h_next is complete before anyone reads it; nobody reads h (the buffer step t+1 writes) any more
            if (one_warp)
                bppsa_rec::warp_barrier();
            else if constexpr (Q > 1)
                bppsa::cluster_wait();
            else
                __syncthreads();
        }
    }
}

// ---- the backward: the linear recursion with the gate gradients, fused -------------------------------------
//
// kernels/recurrent.py's rnn/gru/lstm_backward on a GPU (without their parameter sums): one block per batch
// row, thread j < H owns unit j (as family 2). From the state gradient g = grad_out[T-1] + grad_h (LSTM also
// gc = grad_cn), each step t = T-1 .. 0 forms the row r (G H entries) that multiplies W_hh, writes the step's
// gate gradients and carries g to t - 1:
//     rnn_tanh  r = g (1 - h_t²)                    d_gi = d_gh = r
//     rnn_relu  r = (h_t <= 0) ? 0 : g              (a select, as torch's backward: a NaN h passes g)
//     gru       r = [g s_r, g s_z, g s_n]           d_gh = r, d_gi = [g s_r, g s_z, g dn]; diagonal g z
//     lstm      tc = tanh(c_t), gc_tot = gc + g o (1 - tc²)
//               r = [gc_tot g i(1-i), gc_tot c_{t-1} f(1-f), gc_tot i (1-g²), g tc o(1-o)]  d_gi = d_gh = r;
//               gc <- gc_tot f
//     g <- r W_hh (+ g z for the GRU) + grad_out[t-1];   after step 0: gh0 = g (gc0 = gc).
// The scan over the factored Jacobians computes the same g, but beside it the layer needs the direct
// gradients assembled, the factors' scales (the LSTM's: ~15 launches) and the gate gradients (1-3 more):
// here all of it stays in registers, the only cross-thread step being the product r W_hh. A step's
// dependent path: the unit's few multiplies (the LSTM's tanh), one shared store per gate, one barrier, then
// G H multiply-adds against W_hh's column j (shared memory, w[r H + j] = W_hh[r][j]: neighbouring threads
// read neighbouring words) with r read as broadcast 16-byte vectors. The unit's operands are loaded
// kBackwardAhead steps ahead into registers, off that path. r is double-buffered (step t writes buffer
// t & 1): one barrier per step suffices, as in family 2. Rows of r and W_hh are padded to P = G H rounded up to whole
// 16-byte vectors (zeros). Shared memory: (2 + H) P elements (backward_shared_bytes in recurrent_cuda.py); 2 P
// where W_hh is held in registers (float32, compiled per H: below). On an H200 the shared-memory kernel took
// ~0.65 us a step at H = 64 and ~1 us at H = 128 (cuda-calib-h200-be3c8e9.md's fused kernel column): its G H
// scalar shared loads of W_hh a step likely bound it (our reading, not a profile); the register kernels load
// none and took 0.15-0.21 us a step at H = 64, 0.40-0.56 us at H = 128 (RNN, cuda-calib-h200-a4e83a3.csv).

template <class T>
struct CellBackward {
    const T* __restrict__ f0;        // rnn: out (B, T, H); gru: scales (B, T, 3H); lstm: gates (B, T, 4H)
    const T* __restrict__ f1;        // gru: z (B, T, H); lstm: cells c_1..c_T (B, T, H); rnn: null
    const T* __restrict__ f2;        // gru: dn (B, T, H); lstm: c0 (B, H); rnn: null
    const T* __restrict__ w_hh;      // (G H, H)
    const T* __restrict__ grad_out;  // (B, T, H) or null
    const T* __restrict__ grad_h;    // (B, H) or null: h_T's own gradient
    const T* __restrict__ grad_cn;   // (B, H) or null (LSTM)
    T* __restrict__ d_gi;            // (B, T, G H)
    T* __restrict__ d_gh;            // (B, T, G H): the GRU's; null for the others (d_gi is d_gh)
    T* __restrict__ gh0;             // (B, H)
    T* __restrict__ gc0;             // (B, H) (LSTM)
    i64 batch, steps;
    int hidden;
};

// Unit j's operands of one step (rnn: h_t; gru: s_r, s_z, s_n, z, dn; lstm: i, f, g, o, c_t, c_{t-1}).
template <class T, int C>
struct UnitOperands {
    T v[C == kGru ? 5 : C == kLstm ? 6 : 1];

    __device__ void load(const CellBackward<T>& p, i64 b, i64 t, int H, int j) {
        constexpr int G = kGates<C>;
        const i64 at = (b * p.steps + t) * H + j;  // unit j of step t of a (B, T, H) tensor
        if constexpr (C == kRnnTanh || C == kRnnRelu) {
            v[0] = p.f0[at];
        } else {
            const T* gate = p.f0 + (b * p.steps + t) * G * H + j;
#pragma unroll
            for (int g = 0; g < G; ++g) v[g] = gate[g * H];
            if constexpr (C == kGru) {
                v[3] = p.f1[at], v[4] = p.f2[at];
            } else {
                v[4] = p.f1[at];
                v[5] = t > 0 ? p.f1[at - H] : p.f2[b * H + j];
            }
        }
    }
};

// The gate gradients of unit j's step t from its row entries r (and, for the GRU's n, g and dn) at d_gi / d_gh.
template <class T, int C>
__device__ __forceinline__ void store_gate_gradients(const UnitOperands<T, C>& u, T g, const T (&r)[kGates<C>],
                                                     T* d_gi, T* d_gh, int H) {
    if constexpr (C == kGru) {
#pragma unroll
        for (int q = 0; q < 3; ++q) d_gh[q * H] = r[q];
        d_gi[0] = r[0], d_gi[H] = r[1], d_gi[2 * H] = g * u.v[4];
    } else {
#pragma unroll
        for (int q = 0; q < kGates<C>; ++q) d_gi[q * H] = r[q];
    }
}

// Step t of unit j: the row entries r[g] (gate g's, into shared memory by the caller), the gate gradients
// stored at d_gi / d_gh (unit j of step t) where `store`, the LSTM's gc carried; returns g's diagonal part for
// t - 1.
template <class T, int C>
__device__ __forceinline__ T unit_backward(const UnitOperands<T, C>& u, T g, T& gc, T (&r)[kGates<C>],
                                           T* d_gi, T* d_gh, int H, bool store) {
    if constexpr (C == kRnnTanh) {
        r[0] = g * (T(1) - u.v[0] * u.v[0]);
    } else if constexpr (C == kRnnRelu) {
        r[0] = u.v[0] <= T(0) ? T(0) : g;
    } else if constexpr (C == kGru) {
#pragma unroll
        for (int q = 0; q < 3; ++q) r[q] = g * u.v[q];
        if (store) store_gate_gradients<T, C>(u, g, r, d_gi, d_gh, H);
        return g * u.v[3];
    } else {
        const T in = u.v[0], forget = u.v[1], cand = u.v[2], og = u.v[3];
        const T tc = bppsa_rec::tanh_of(u.v[4]);
        const T gc_tot = gc + g * og * (T(1) - tc * tc);
        r[0] = gc_tot * cand * in * (T(1) - in);
        r[1] = gc_tot * u.v[5] * forget * (T(1) - forget);
        r[2] = gc_tot * in * (T(1) - cand * cand);
        r[3] = g * tc * og * (T(1) - og);
        gc = gc_tot * forget;
    }
    if constexpr (C != kGru) {
        if (store) store_gate_gradients<T, C>(u, g, r, d_gi, d_gh, H);
    }
    return T(0);
}

// HF > 0: float32 with H = HF known at compile time (a module compiled per H): W_hh's column j split over S
// lanes per unit (S a power of two: a unit's lanes are adjacent, in one warp). Lane s of unit j holds the
// 16-byte packs c = rc S + s (rc < RC) of the column, the first RR in registers (all where they fit: then the
// block's shared memory is the two row buffers only) and the others in shared memory, lane by lane; a unit's S
// lanes read S neighbouring packs of the row buffer at once (no bank conflict), and their partial products
// meet in a butterfly of shuffles that hands every lane the same sum (each addition commutes); the S lanes of
// a unit run its pointwise step alike, the first one storing. The product's loops unroll fully. HF <= 32 (one
// warp): S = 1, lane j = unit j. HF = 0: any H, W_hh in shared memory, one thread per unit.
template <class T, int C, int HF = 0, int S = 1, int RR = -1, int Q = 1>
__device__ void cell_backward(const CellBackward<T>& p) {
    constexpr int G = kGates<C>, V = Pack<T>::kWidth;
    constexpr int RC = HF ? ((G * HF + V - 1) / V + S - 1) / S : 1;  // HF > 0: the packs of the column a lane has
    constexpr int RG = HF ? (RR < 0 || RR > RC ? RC : RR) : 1, RSH = HF ? RC - RG : 0;  // in registers / shared
    static_assert(HF == 0 || sizeof(T) == 4, "the per-H kernels: float32");
    static_assert(S >= 1 && S <= 32 && (S & (S - 1)) == 0, "a unit's lanes: a power of two within a warp");
    static_assert(Q == 1 || HF > 0, "a cluster's kernels are compiled per H");
    const int H = HF ? HF : p.hidden, GH = G * H, P = HF ? RC * S * V : (GH + V - 1) / V * V;
    const ClusterUnits units(H, (H + Q - 1) / Q, Q > 1 ? bppsa::cluster_rank() : 0u, threadIdx.x / S);
    const int part = threadIdx.x % S, j = units.unit;
    const bool active = units.active;
    const int column = j;  // HF > 0: lanes beyond the block's units shadow its last one
    const i64 b = blockIdx.x / Q, steps = p.steps;
    const bool one_warp = Q == 1 && (HF ? HF * S <= 32 : blockDim.x <= 32);

    BPPSA_DYNAMIC_SHARED(smem);
    T* rows = reinterpret_cast<T*>(smem);  // two buffers of P row entries
    // HF = 0: W_hh row-major, rows GH..P-1 zero; HF > 0: the packs beyond a lane's RG, lane by lane
    // ([rs][unit][part]: neighbouring lanes read neighbouring 16-byte packs)
    T* w = rows + 2 * P;
    T w_own_reg[HF ? RG * V : 1];  // HF > 0: the lane's first RG packs of column j
    if constexpr (HF > 0) {
#pragma unroll
        for (int rc = 0; rc < RG; ++rc)
#pragma unroll
            for (int v = 0; v < V; ++v) {
                const int row = (rc * S + part) * V + v;
                w_own_reg[rc * V + v] = row < GH ? p.w_hh[row * H + column] : T(0);
            }
        const int NU = units.per_block;
        for (int e = threadIdx.x; e < RSH * NU * S * V; e += blockDim.x) {  // once per launch
            const int v = e % V, lane = e / V % S, u = e / (V * S) % NU, rs = e / (V * S * NU);
            const int row = ((RG + rs) * S + lane) * V + v, owned = units.first + u;
            w[e] = row < GH && owned < H ? p.w_hh[row * H + owned] : T(0);
        }
    } else {
        for (int e = threadIdx.x; e < P * H; e += blockDim.x) w[e] = e < GH * H ? p.w_hh[e] : T(0);  // once
    }
    for (int e = GH + threadIdx.x; e < P; e += blockDim.x) rows[e] = rows[P + e] = T(0);  // the padding

    // Unit j's operands of the next K steps, in flight in registers: ring[k] holds those of the steps
    // t = base - k of the current group and is refilled, right after its step used it, with those of
    // t - K. The time loop is unrolled by K so that k is a compile-time index: no register moves, which
    // would wait for the loads (a lead of one step, ~0.2-0.3 us, would not cover a global load's latency).
    // Lanes beyond the units load unit H - 1's (in bounds; they store nothing).
    constexpr int K = kBackwardAhead;
    UnitOperands<T, C> ring[K];
    T direct[K];
    const auto load = [&](UnitOperands<T, C>& unit, T& gradient, i64 t) {
        unit.load(p, b, t, H, column);
        gradient = p.grad_out ? p.grad_out[(b * steps + t) * H + column] : T(0);
    };
#pragma unroll
    for (int k = 0; k < K; ++k)
        if (steps - 1 - k >= 0) load(ring[k], direct[k], steps - 1 - k);
    if (steps > 0 && p.grad_h) direct[0] += p.grad_h[b * H + column];  // h_T's own gradient
    T gc = C == kLstm && active && p.grad_cn ? p.grad_cn[b * H + j] : T(0), carried = T(0);
    // W_hh and the padding staged; a cluster: every block has started before a peer stores into its rows
    if constexpr (Q > 1)
        bppsa::cluster_sync();
    else
        __syncthreads();

    const T* w_own = w + j;
    // Step t = base - k writes row buffer t & 1: k's parity against base's, which every group shares (K even).
    T* const rows_even_k = rows + ((steps - 1) & 1) * P;
    T* const rows_odd_k = rows + (steps & 1) * P;
    // `guarded`: step t - K, whose operands this step loads, may be before step 0 (the last groups)
    const auto step = [&](const int k, const i64 t, const bool guarded) {
        T* r_shared = k & 1 ? rows_odd_k : rows_even_k;
        T g = T(0), r[G];
        const i64 at = (b * steps + t) * GH + j;
        T* const d_gh = C == kGru ? p.d_gh + at : nullptr;
        if (active) {
            g = carried + direct[k];
            // the GRU's diagonal part (the others: 0); a cluster stores the gate gradients after its arrival
            carried = unit_backward<T, C>(ring[k], g, gc, r, p.d_gi + at, d_gh, H, Q == 1 && part == 0);
            if (part == 0)
#pragma unroll
                for (int q = 0; q < G; ++q) share<Q>(r_shared + q * H + j, r[q]);
        }
        if constexpr (Q > 1) {  // the peers' rows released (the release waits for every store before it)
            bppsa::cluster_arrive();
            if (active && part == 0) store_gate_gradients<T, C>(ring[k], g, r, p.d_gi + at, d_gh, H);
        }
        if (!guarded || t - K >= 0) load(ring[k], direct[k], t - K);  // in flight while the block meets and multiplies
        // r_shared is complete; nobody reads the other buffer (step t + 1's) any more
        if (one_warp)
            bppsa_rec::warp_barrier();
        else if constexpr (Q > 1)
            bppsa::cluster_wait();
        else
            __syncthreads();
        if (HF > 0 || active) {  // HF > 0: every lane (the shuffles take the whole warp; j >= H shadow)
            T acc[V];
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v] = T(0);
            const Pack<T>* r_packs = reinterpret_cast<const Pack<T>*>(r_shared);
            if constexpr (HF > 0) {
#pragma unroll
                for (int rc = 0; rc < RG; ++rc) {
                    const Pack<T> rv = r_packs[rc * S + part];  // a broadcast 16-byte read per unit part
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] += rv.v[v] * w_own_reg[rc * V + v];
                }
                const Pack<T>* w_packs = reinterpret_cast<const Pack<T>*>(w) + (column - units.first) * S + part;
#pragma unroll
                for (int rs = 0; rs < RSH; ++rs) {
                    const Pack<T> rv = r_packs[(RG + rs) * S + part], wv = w_packs[rs * units.per_block * S];
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] += rv.v[v] * wv.v[v];
                }
            } else {
                for (int rc = 0; rc < P / V; ++rc) {
                    const Pack<T> rv = r_packs[rc];
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] += rv.v[v] * w_own[(rc * V + v) * H];
                }
            }
            T sum = acc[0];
#pragma unroll
            for (int v = 1; v < V; ++v) sum += acc[v];
            sum = unit_sum<S>(sum);
            // the GRU's diagonal part plus r W_hh; the other cells have none (no addition of a zero on the path)
            if (active) carried = C == kGru ? carried + sum : sum;
        }
    };
    i64 base = steps - 1;
    // The groups whose steps, and the steps they load, all lie within T: no check a step. Not the GRU's where
    // part of W_hh is read from shared memory (H > 104): its registers with a second copy of the loop spilled in
    // ptxas (sm_80, H = 128); at H <= 32 they did at H = 18 (sm_90) until the kernel asked for one block an SM
    // (its launch bounds), so that ptxas may use more registers rather than spill.
    if constexpr (C != kGru || RSH == 0)
        for (; base - (K - 1) - K >= 0; base -= K) {
#pragma unroll
            for (int k = 0; k < K; ++k) step(k, base - k, false);
        }
    for (; base >= 0; base -= K) {
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (base - k >= 0) step(k, base - k, true);  // the same t in every thread: the barriers stay uniform
    }
    if (active && part == 0) {
        p.gh0[b * H + j] = carried;
        if (C == kLstm) p.gc0[b * H + j] = gc;
    }
}

}  // namespace

#define BPPSA_REC_PARAMS(T)                                                                                 \
    (const T* __restrict__ gi, const T* __restrict__ w_hh, const T* __restrict__ b_hh,                     \
     const T* __restrict__ h0, const T* __restrict__ c0, T* __restrict__ out, T* __restrict__ f0,           \
     T* __restrict__ f1, T* __restrict__ f2, i64 batch, i64 steps, i64 hidden)
#define BPPSA_REC_HOST_ARGS(T)                                                                                \
    ((const T*)a[0], (const T*)a[1], (const T*)a[2], (const T*)a[3], (const T*)a[4], (T*)a[5], (T*)a[6],     \
     (T*)a[7], (T*)a[8], (i64)a[9], (i64)a[10], (i64)a[11])
#define BPPSA_REC_LAYER(T) Layer<T>{gi, w_hh, b_hh, h0, c0, out, f0, f1, f2, batch, steps, (int)hidden}

// family 1: the four cells at one compile-time H (BPPSA_REC_FIXED_KERNELS expands H before pasting it)
#define BPPSA_REC_FIXED_KERNEL(NAME, CELL, H)                                                               \
    extern "C" __global__ void __launch_bounds__(32) NAME BPPSA_REC_PARAMS(float) {                        \
        fixed_forward<CELL, H>(BPPSA_REC_LAYER(float));                                                     \
    }                                                                                                       \
    BPPSA_ENTRY(NAME, BPPSA_REC_PARAMS(float), BPPSA_REC_HOST_ARGS(float))
// the gated cells' forward at H <= 32: a unit's gates in neighbouring lanes
#define BPPSA_REC_UNIT_GROUP_KERNEL(NAME, CELL, H)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * kGroupWarps<CELL, H>) NAME BPPSA_REC_PARAMS(float) { \
        unit_group_forward<CELL, H>(BPPSA_REC_LAYER(float));                                                \
    }                                                                                                       \
    BPPSA_ENTRY(NAME, BPPSA_REC_PARAMS(float), BPPSA_REC_HOST_ARGS(float))
// the backward compiled for H, W_hh's column split over S lanes a unit (H S threads, whole warps), RR packs
// of a lane's share in registers (-1: all)
#define BPPSA_BWD_SPLIT_KERNEL(NAME, CELL, H, S, RR)                                                          \
    extern "C" __global__ void __launch_bounds__((H * S + 31) / 32 * 32, 1) NAME BPPSA_BWD_PARAMS(float) {    \
        cell_backward<float, CELL, H, S, RR>(CellBackward<float>{f0, f1, f2, w_hh, grad_out, grad_h, grad_cn, \
                                                                 d_gi, d_gh, gh0, gc0, batch, steps,          \
                                                                 (int)hidden});                               \
    }                                                                                                         \
    BPPSA_ENTRY(NAME, BPPSA_BWD_PARAMS(float), BPPSA_BWD_HOST_ARGS(float))
// H <= 32: the gated cells' column (3-4 H rows) over kFixedSplit lanes a unit (recurrent_cuda.FIXED_SPLIT): a
// step's product is then a half (GRU) or a quarter (LSTM) of the G H multiply-adds one lane did (measured:
// 135 / 200 instructions a step for GRU / LSTM at H = 20 in one warp, 0.46 / 0.60 us a step on an H200). The
// GRU's 4 lanes spilled in ptxas at H = 27 (sm_80) and 28-31 (sm_90); 2 do not.
template <int C>
constexpr int kFixedSplit = C == kGru ? 2 : C == kLstm ? 4 : 1;
#define BPPSA_BWD_FIXED_KERNEL(NAME, CELL, H) BPPSA_BWD_SPLIT_KERNEL(NAME, CELL, H, kFixedSplit<CELL>, -1)
#define BPPSA_REC_FIXED_KERNELS_(H)                                         \
    BPPSA_REC_FIXED_KERNEL(bppsa_rnn_tanh_forward_f32_h##H, kRnnTanh, H)  \
    BPPSA_REC_FIXED_KERNEL(bppsa_rnn_relu_forward_f32_h##H, kRnnRelu, H)  \
    BPPSA_REC_UNIT_GROUP_KERNEL(bppsa_gru_forward_f32_h##H, kGru, H)       \
    BPPSA_REC_UNIT_GROUP_KERNEL(bppsa_lstm_forward_f32_h##H, kLstm, H)     \
    BPPSA_BWD_FIXED_KERNEL(bppsa_rnn_tanh_backward_f32_h##H, kRnnTanh, H) \
    BPPSA_BWD_FIXED_KERNEL(bppsa_rnn_relu_backward_f32_h##H, kRnnRelu, H) \
    BPPSA_BWD_FIXED_KERNEL(bppsa_gru_backward_f32_h##H, kGru, H)           \
    BPPSA_BWD_FIXED_KERNEL(bppsa_lstm_backward_f32_h##H, kLstm, H)
#define BPPSA_REC_FIXED_KERNELS(H) BPPSA_REC_FIXED_KERNELS_(H)
// a module compiled for H > 32: one cell's float32 forward or backward (kernels/recurrent_cuda.py: wide_layout
// picks S and RR)
#define BPPSA_BWD_WIDE_KERNEL_(NAME, H, S, RR) \
    BPPSA_BWD_SPLIT_KERNEL(bppsa_##NAME##_backward_f32_h##H, kCell_##NAME, H, S, RR)
#define BPPSA_BWD_WIDE_KERNEL(NAME, H, S, RR) BPPSA_BWD_WIDE_KERNEL_(NAME, H, S, RR)
#define BPPSA_REC_WIDE_KERNEL_(NAME, H, S, RR)                                                             \
    extern "C" __global__ void __launch_bounds__((H * S + 31) / 32 * 32)                                   \
        bppsa_##NAME##_forward_f32_h##H BPPSA_REC_PARAMS(float) {                                          \
        shared_forward<float, kCell_##NAME, H, S, RR>(BPPSA_REC_LAYER(float));                             \
    }                                                                                                      \
    BPPSA_ENTRY(bppsa_##NAME##_forward_f32_h##H, BPPSA_REC_PARAMS(float), BPPSA_REC_HOST_ARGS(float))
#define BPPSA_REC_WIDE_KERNEL(NAME, H, S, RR) BPPSA_REC_WIDE_KERNEL_(NAME, H, S, RR)
// ... and for an H whose W_hh no block's registers and shared memory hold: a cluster of Q blocks (sm_90+), each
// owning ceil(H / Q) units (their rows / columns of W_hh), sharing the state / row through distributed shared
// memory (recurrent_cuda.cluster_layout picks Q, S and RR); a kernel a row of Q blocks, grid = B Q
#define BPPSA_REC_CLUSTER_THREADS(H, S, Q) (((H) + (Q) - 1) / (Q) * (S) + 31) / 32 * 32
#define BPPSA_REC_CLUSTER_KERNEL_(NAME, H, S, RR, Q)                                                       \
    extern "C" __global__ void __launch_bounds__(BPPSA_REC_CLUSTER_THREADS(H, S, Q), 1) BPPSA_CLUSTER_DIMS(Q) \
        bppsa_##NAME##_forward_f32_h##H##_c##Q BPPSA_REC_PARAMS(float) {                                  \
        shared_forward<float, kCell_##NAME, H, S, RR, Q>(BPPSA_REC_LAYER(float));                         \
    }                                                                                                      \
    BPPSA_ENTRY(bppsa_##NAME##_forward_f32_h##H##_c##Q, BPPSA_REC_PARAMS(float), BPPSA_REC_HOST_ARGS(float))
#define BPPSA_REC_CLUSTER_KERNEL(NAME, H, S, RR, Q) BPPSA_REC_CLUSTER_KERNEL_(NAME, H, S, RR, Q)
#define BPPSA_BWD_CLUSTER_KERNEL_(NAME, H, S, RR, Q)                                                       \
    extern "C" __global__ void __launch_bounds__(BPPSA_REC_CLUSTER_THREADS(H, S, Q), 1) BPPSA_CLUSTER_DIMS(Q) \
        bppsa_##NAME##_backward_f32_h##H##_c##Q BPPSA_BWD_PARAMS(float) {                                 \
        cell_backward<float, kCell_##NAME, H, S, RR, Q>(CellBackward<float>{                              \
            f0, f1, f2, w_hh, grad_out, grad_h, grad_cn, d_gi, d_gh, gh0, gc0, batch, steps, (int)hidden}); \
    }                                                                                                      \
    BPPSA_ENTRY(bppsa_##NAME##_backward_f32_h##H##_c##Q, BPPSA_BWD_PARAMS(float), BPPSA_BWD_HOST_ARGS(float))
#define BPPSA_BWD_CLUSTER_KERNEL(NAME, H, S, RR, Q) BPPSA_BWD_CLUSTER_KERNEL_(NAME, H, S, RR, Q)

// family 2
#define BPPSA_REC_KERNEL(NAME, CELL, T, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1) bppsa_##NAME##_forward_##SUFFIX           \
        BPPSA_REC_PARAMS(T) {                                                                               \
        shared_forward<T, CELL>(BPPSA_REC_LAYER(T));                                                        \
    }                                                                                                       \
    BPPSA_ENTRY(bppsa_##NAME##_forward_##SUFFIX, BPPSA_REC_PARAMS(T), BPPSA_REC_HOST_ARGS(T))
// KERNEL(NAME, CELL, T, SUFFIX) for each of the four cells
#define BPPSA_REC_EACH_CELL(KERNEL, T, SUFFIX) \
    KERNEL(rnn_tanh, kRnnTanh, T, SUFFIX)     \
    KERNEL(rnn_relu, kRnnRelu, T, SUFFIX)     \
    KERNEL(gru, kGru, T, SUFFIX)              \
    KERNEL(lstm, kLstm, T, SUFFIX)

// the backward kernels (in the default module)
#define BPPSA_BWD_PARAMS(T)                                                                                  \
    (const T* __restrict__ f0, const T* __restrict__ f1, const T* __restrict__ f2, const T* __restrict__ w_hh, \
     const T* __restrict__ grad_out, const T* __restrict__ grad_h, const T* __restrict__ grad_cn,              \
     T* __restrict__ d_gi, T* __restrict__ d_gh, T* __restrict__ gh0, T* __restrict__ gc0, i64 batch,          \
     i64 steps, i64 hidden)
#define BPPSA_BWD_HOST_ARGS(T)                                                                               \
    ((const T*)a[0], (const T*)a[1], (const T*)a[2], (const T*)a[3], (const T*)a[4], (const T*)a[5],         \
     (const T*)a[6], (T*)a[7], (T*)a[8], (T*)a[9], (T*)a[10], (i64)a[11], (i64)a[12], (i64)a[13])
#define BPPSA_BWD_KERNEL(NAME, CELL, T, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1) bppsa_##NAME##_backward_##SUFFIX            \
        BPPSA_BWD_PARAMS(T) {                                                                                \
        cell_backward<T, CELL>(CellBackward<T>{f0, f1, f2, w_hh, grad_out, grad_h, grad_cn, d_gi, d_gh, gh0,  \
                                               gc0, batch, steps, (int)hidden});                              \
    }                                                                                                        \
    BPPSA_ENTRY(bppsa_##NAME##_backward_##SUFFIX, BPPSA_BWD_PARAMS(T), BPPSA_BWD_HOST_ARGS(T))

// The module of one H holds only its four family-1 kernels (kernels/recurrent_cuda.py compiles it on
// demand); the default module holds family 2; a list (compile gates, sanitizer driver) adds to the default.
#if defined(BPPSA_REC_HIDDEN) && defined(BPPSA_REC_CELL) && defined(BPPSA_REC_CLUSTER) && defined(BPPSA_REC_FORWARD)
BPPSA_REC_CLUSTER_KERNEL(BPPSA_REC_CELL, BPPSA_REC_HIDDEN, BPPSA_REC_SPLIT, BPPSA_REC_REGISTER_PACKS,
                         BPPSA_REC_CLUSTER)
#elif defined(BPPSA_REC_HIDDEN) && defined(BPPSA_REC_CELL) && defined(BPPSA_REC_CLUSTER)
BPPSA_BWD_CLUSTER_KERNEL(BPPSA_REC_CELL, BPPSA_REC_HIDDEN, BPPSA_REC_SPLIT, BPPSA_REC_REGISTER_PACKS,
                         BPPSA_REC_CLUSTER)
#elif defined(BPPSA_REC_HIDDEN) && defined(BPPSA_REC_CELL) && defined(BPPSA_REC_FORWARD)
BPPSA_REC_WIDE_KERNEL(BPPSA_REC_CELL, BPPSA_REC_HIDDEN, BPPSA_REC_SPLIT, BPPSA_REC_REGISTER_PACKS)
#elif defined(BPPSA_REC_HIDDEN) && defined(BPPSA_REC_CELL)
BPPSA_BWD_WIDE_KERNEL(BPPSA_REC_CELL, BPPSA_REC_HIDDEN, BPPSA_REC_SPLIT, BPPSA_REC_REGISTER_PACKS)
#elif defined(BPPSA_REC_HIDDEN)
BPPSA_REC_FIXED_KERNELS(BPPSA_REC_HIDDEN)
#else
BPPSA_REC_EACH_CELL(BPPSA_REC_KERNEL, float, f32)
BPPSA_REC_EACH_CELL(BPPSA_REC_KERNEL, double, f64)
BPPSA_REC_EACH_CELL(BPPSA_BWD_KERNEL, float, f32)
BPPSA_REC_EACH_CELL(BPPSA_BWD_KERNEL, double, f64)
#ifdef BPPSA_REC_HIDDEN_LIST
BPPSA_REC_HIDDEN_LIST(BPPSA_REC_FIXED_KERNELS)
#endif
#ifdef BPPSA_REC_WIDE_LIST  // X(cell, H, S, register packs) ...: the compile gates
BPPSA_REC_WIDE_LIST(BPPSA_BWD_WIDE_KERNEL)
#endif
#ifdef BPPSA_REC_WIDE_FORWARD_LIST
BPPSA_REC_WIDE_FORWARD_LIST(BPPSA_REC_WIDE_KERNEL)
#endif
#ifdef BPPSA_REC_CLUSTER_LIST  // X(cell, H, S, register packs, Q) ...: the compile gates (sm_90)
BPPSA_REC_CLUSTER_LIST(BPPSA_BWD_CLUSTER_KERNEL)
#endif
#ifdef BPPSA_REC_CLUSTER_FORWARD_LIST
BPPSA_REC_CLUSTER_FORWARD_LIST(BPPSA_REC_CLUSTER_KERNEL)
#endif
#endif
