// Forward kernels of whole recurrent layers (one layer, one direction) that emit the states AND the
// Jacobian factors the BPPSA backward needs, in one pass over time. Torch's gate order.
//
// Kernels (suffix f32 / f64 / f32_regs), all with the parameters of BPPSA_REC_PARAMS:
//   bppsa_rnn_tanh_forward_*  h = tanh(gi + W h_prev + b)     no factor: f' = 1 - h² is a function of out
//   bppsa_rnn_relu_forward_*  h = relu(gi + W h_prev + b)     no factor (f' = the mask h > 0, from out)
//   bppsa_gru_forward_*       gh = W h_prev + b; r = σ(gi_r + gh_r), z = σ(gi_z + gh_z),
//                             n = tanh(gi_n + r gh_n), h = (h_prev - n) z + n (torch's form);
//                             f0 = scales [dn gh_n r(1-r), (h_prev-n) z(1-z), dn r]   (B, T, 3H)
//                             f1 = z (B, T, H), f2 = dn = (1-z)(1-n²) (B, T, H)
//   bppsa_lstm_forward_*      pre = gi + W h_prev (b_hh folded into gi); i, f, o = σ, g = tanh;
//                             c = f c_prev + i g, h = o tanh(c); f0 = cells c_1..c_T (B, T, H),
//                             f1 = activated gates [i, f, g, o] (B, T, 4H)
// Every kernel writes out (B, T, H) = h_1..h_T. Inputs: gi (B, T, G H) (x W_ihᵀ + b_ih, plus b_hh for
// RNN/LSTM when the caller folds it), w_hh (G H, H), b_hh (G H) or null, h0 (B, H), c0 (B, H) (LSTM only).
// All contiguous, batch-major.
//
// Schedule: one block per batch row (grid = B), persistent over the T steps. Thread j < H owns hidden
// unit j: it computes the G gate pre-activations of unit j (G dot products of length H), applies the cell
// and writes unit j of every output (neighbouring threads write neighbouring addresses: coalesced).
// - W_hh is loaded ONCE: into registers in the *_f32_regs kernels (float32, H <= 32: thread j holds row j of
//   each gate, G x 8 float4), else into shared memory, packed so that thread j reads its weights as 16-byte vectors
//   (float4 / double2) and the 32 lanes of a warp read 32 consecutive vectors (no bank conflict):
//       w[((g KC + kc) H + j) V + v] = W_hh[g H + j][kc V + v],  V = 16 / sizeof(T), KC = ceil(H / V)
//   (columns k >= H are zero padding).
// - The state h_{t-1} lives in shared memory (two buffers of KC V values: step t reads one and writes
//   the other, so ONE barrier per step suffices); a lane reads it as broadcast 16-byte vectors. The
//   unit's own h_{t-1}[j] and c_{t-1}[j] stay in registers.
// - gi_{t+1} is loaded into registers at the start of step t (its latency hides behind the dot products).
// - The barrier is __syncwarp when the block is one warp (H <= 32), else __syncthreads.
// - V independent partial sums per gate (one per vector lane) break the FMA dependency chain.
// Shared memory: (G H + 2) KC V elements (2 KC V with W_hh in registers), computed by
// kernels/recurrent_cuda.py:prepare (which also picks the *_f32_regs kernels), which returns
// None (the caller runs torch's cuDNN forward) when it exceeds the device's per-block opt-in limit or
// H > kMaxThreads.
#include "cuda_host_emulation.h"
#include "recurrent_emulation.h"

namespace {

using i64 = long long;
constexpr int kMaxThreads = 256;  // H <= 256: one thread per hidden unit
constexpr int kRegsF32 = 8;       // the *_f32_regs kernels: 8 float4 per gate hold a row of W_hh, H <= 32

enum Cell { kRnnTanh, kRnnRelu, kGru, kLstm };

template <int C>
constexpr int kGates = C == kGru ? 3 : C == kLstm ? 4 : 1;

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

// KRegs = 0: W_hh in shared memory (any H that fits). KRegs > 0: thread j keeps its G KRegs weight vectors in
// registers (H <= KRegs V; float32 with H <= 32) and shared memory holds only the state buffers.
template <class T, int C, int KRegs>
__device__ void layer_forward(const Layer<T>& p) {
    constexpr int G = kGates<C>, V = Pack<T>::kWidth;
    const int H = p.hidden, KC = (H + V - 1) / V, P = KC * V, j = threadIdx.x;
    const bool active = j < H;
    const i64 b = blockIdx.x, steps = p.steps;
    const bool one_warp = blockDim.x <= 32;

    BPPSA_DYNAMIC_SHARED(smem);
    T* w = reinterpret_cast<T*>(smem);
    T* state = w + (KRegs ? 0 : G * P * H);  // two buffers of P values
    Pack<T> w_reg[G][KRegs ? KRegs : 1];
    if constexpr (KRegs > 0) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int kc = 0; kc < KRegs; ++kc)
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    const int k = kc * V + v;
                    w_reg[g][kc].v[v] = active && k < H ? p.w_hh[(i64)(g * H + j) * H + k] : T(0);
                }
    } else {
        for (int e = threadIdx.x; e < G * P * H; e += blockDim.x) {  // once per launch: off the critical path
            const int v = e % V, unit = e / V % H, gk = e / (V * H);  // gk = g KC + kc
            const int k = gk % KC * V + v, g = gk / KC;
            w[e] = k < H ? p.w_hh[(i64)(g * H + unit) * H + k] : T(0);
        }
    }
    for (int e = threadIdx.x; e < 2 * P; e += blockDim.x) state[e] = e < H ? p.h0[b * H + e] : T(0);

    // Running pointers to unit j of step t (advanced once per step: no 64-bit index products in the loop).
    constexpr int W0 = C == kGru ? 3 : 1, W1 = C == kLstm ? 4 : 1;  // factor widths, in units of H
    const i64 first = b * steps;  // row b, step 0
    const T* gi_t = p.gi + first * G * H + j;
    T* out_t = p.out + first * H + j;
    T* f0_t = C == kGru || C == kLstm ? p.f0 + first * W0 * H + j : nullptr;
    T* f1_t = C == kGru || C == kLstm ? p.f1 + first * W1 * H + j : nullptr;
    T* f2_t = C == kGru ? p.f2 + first * H + j : nullptr;

    T h_own = T(0), c_own = T(0), bias[G], next[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        bias[g] = active && p.b_hh ? p.b_hh[g * H + j] : T(0);
        next[g] = active ? gi_t[g * H] : T(0);
    }
    if (active) {
        h_own = p.h0[b * H + j];
        if (C == kLstm) c_own = p.c0[b * H + j];
    }
    __syncthreads();

    const Pack<T>* w_own = reinterpret_cast<const Pack<T>*>(w) + j;
    for (i64 t = 0; t < steps; ++t) {
        const Pack<T>* h = reinterpret_cast<const Pack<T>*>(state + (t & 1) * P);
        T* h_next = state + ((t + 1) & 1) * P;
        if (active) {
            T x[G];
#pragma unroll
            for (int g = 0; g < G; ++g) x[g] = next[g];
            if (t + 1 < steps)  // prefetch gi_{t+1}
#pragma unroll
                for (int g = 0; g < G; ++g) next[g] = gi_t[(G + g) * H];

            T acc[G][V];
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int v = 0; v < V; ++v) acc[g][v] = T(0);
            if constexpr (KRegs > 0) {
#pragma unroll
                for (int kc = 0; kc < KRegs; ++kc) {
                    if (kc < KC) {
                        const Pack<T> hv = h[kc];
#pragma unroll
                        for (int g = 0; g < G; ++g)
#pragma unroll
                            for (int v = 0; v < V; ++v) acc[g][v] += hv.v[v] * w_reg[g][kc].v[v];
                    }
                }
            } else {
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
            T gh[G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                T sum = acc[g][0];
#pragma unroll
                for (int v = 1; v < V; ++v) sum += acc[g][v];
                gh[g] = sum + bias[g];
            }

            T h_new;
            if constexpr (C == kRnnTanh) {
                h_new = bppsa_rec::tanh_of(x[0] + gh[0]);
            } else if constexpr (C == kRnnRelu) {
                const T a = x[0] + gh[0];
                h_new = a <= T(0) ? T(0) : a;  // a NaN stays NaN, as torch's relu
            } else if constexpr (C == kGru) {
                const T r = bppsa_rec::sigmoid_of(x[0] + gh[0]);
                const T z = bppsa_rec::sigmoid_of(x[1] + gh[1]);
                const T n = bppsa_rec::tanh_of(x[2] + r * gh[2]);
                const T diff = h_own - n;
                h_new = diff * z + n;
                const T dn = (T(1) - z) * (T(1) - n * n);
                f0_t[0] = dn * gh[2] * r * (T(1) - r);  // scales
                f0_t[H] = diff * z * (T(1) - z);
                f0_t[2 * H] = dn * r;
                *f1_t = z;
                *f2_t = dn;
            } else {
                const T in = bppsa_rec::sigmoid_of(x[0] + gh[0]);
                const T forget = bppsa_rec::sigmoid_of(x[1] + gh[1]);
                const T cand = bppsa_rec::tanh_of(x[2] + gh[2]);
                const T og = bppsa_rec::sigmoid_of(x[3] + gh[3]);
                c_own = forget * c_own + in * cand;
                h_new = og * bppsa_rec::tanh_of(c_own);
                *f0_t = c_own;  // cells
                f1_t[0] = in;    // activated gates
                f1_t[H] = forget;
                f1_t[2 * H] = cand;
                f1_t[3 * H] = og;
            }
            h_next[j] = h_new;
            h_own = h_new;
            *out_t = h_new;
        }
        gi_t += G * H;
        out_t += H;
        if constexpr (C == kGru || C == kLstm) f0_t += W0 * H, f1_t += W1 * H;
        if constexpr (C == kGru) f2_t += H;
        // h_next is complete before anyone reads it; nobody reads h (the buffer step t+1 writes) any more
        if (one_warp)
            bppsa_rec::warp_barrier();
        else
            __syncthreads();
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

#define BPPSA_REC_KERNEL(NAME, CELL, T, SUFFIX, KREGS)                                                       \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1) bppsa_##NAME##_forward_##SUFFIX           \
        BPPSA_REC_PARAMS(T) {                                                                               \
        layer_forward<T, CELL, KREGS>(                                                                      \
            Layer<T>{gi, w_hh, b_hh, h0, c0, out, f0, f1, f2, batch, steps, (int)hidden});                  \
    }                                                                                                       \
    BPPSA_ENTRY(bppsa_##NAME##_forward_##SUFFIX, BPPSA_REC_PARAMS(T), BPPSA_REC_HOST_ARGS(T))

#define BPPSA_REC_KERNELS(T, SUFFIX, KREGS)                 \
    BPPSA_REC_KERNEL(rnn_tanh, kRnnTanh, T, SUFFIX, KREGS) \
    BPPSA_REC_KERNEL(rnn_relu, kRnnRelu, T, SUFFIX, KREGS) \
    BPPSA_REC_KERNEL(gru, kGru, T, SUFFIX, KREGS)          \
    BPPSA_REC_KERNEL(lstm, kLstm, T, SUFFIX, KREGS)

BPPSA_REC_KERNELS(float, f32, 0)
BPPSA_REC_KERNELS(double, f64, 0)
BPPSA_REC_KERNELS(float, f32_regs, kRegsF32)  // one warp, W_hh in registers: H <= 32
