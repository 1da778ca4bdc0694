// What kernels/recurrent.cu needs beyond kernels/cuda_host_emulation.h: a warp barrier, the math functions
// and the asynchronous row copy of the gi ring, with one spelling for nvcc/NVRTC and for the host build
// (g++). Kept apart from the shared emulation header so the two files can change independently.
#pragma once

#ifdef __CUDACC__

namespace bppsa_rec {
// __syncwarp orders the shared-memory stores and loads of the warp's lanes (independent thread scheduling).
__device__ __forceinline__ void warp_barrier() { __syncwarp(); }
}  // namespace bppsa_rec

#else

#include <math.h>

#include <deque>
#include <utility>
#include <vector>

namespace bppsa_rec {
// The emulated warp has 32 OS threads meeting at its barrier (the block is padded to whole warps).
inline void warp_barrier() { bppsa_emu_warp().barrier.wait(); }
}  // namespace bppsa_rec

#endif

namespace bppsa_rec {
// Accurate (libm / CUDA's non-intrinsic) functions: float64 must match torch to ~1e-12.
__device__ __forceinline__ float tanh_of(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_of(double x) { return tanh(x); }
__device__ __forceinline__ float sigmoid_of(float x) {
#ifdef __CUDA_ARCH__
    // 1 / d (d = 1 + e^-x >= 1) without the IEEE division, whose slow path is a called subroutine: ptxas saved
    // the grouped time loops' registers around that call, and spilled. Instead the approximate reciprocal
    // (__fdividef: 2 ulp, 0 where d > 2^126) and one Newton step: within 1 ulp of 1.0f / d, no branch. x below
    // -88 counts as -88 (e^88 is finite, the sigmoid < 2^-126 flushed to 0 either way); a NaN stays NaN.
    const float d = 1.0f + expf(x < -88.0f ? 88.0f : -x);
    const float r = __fdividef(1.0f, d);
    return fmaf(r, fmaf(-d, r, 1.0f), r);
#else
    return 1.0f / (1.0f + expf(-x));
#endif
}
__device__ __forceinline__ double sigmoid_of(double x) { return 1.0 / (1.0 + exp(-x)); }

// One lane's share of copying rows of N floats from global to shared memory: the 32 lanes of a warp copy a
// row together, lane l the words l, l + 32, ... (4-byte copies: a row may start at any float); or, with
// start_word(), each lane a word of its own (RowCopy<32>: one a lane at a time). The API is cp.async's:
// start() adds a row's copy to the open group, commit() closes the group, wait<P>() returns once at most P of
// the committed groups may still be in flight; a copy is visible to its own lane after the wait, to the OTHER
// lanes only after a warp barrier that follows it. Three implementations, one contract:
// - sm_80 and later: cp.async (the copy bypasses the registers; nothing waits for it but wait<P>).
// - older GPUs: a register stage, one row in flight: start() loads into registers (storing the previous
//   row first), wait() stores them. A row started at the top of a step and waited for at its end still
//   overlaps the step (rows started back to back, as in a prologue, wait for each other).
// - the host emulation: the copies land as LATE as the contract allows (at the wait that retires their
//   group), so a kernel that reads a row before waiting for it reads stale data in the tests.
template <int N>
struct RowCopy {
    static constexpr int kWords = (N + 31) / 32;  // per lane

    __device__ __forceinline__ void start(float* dst, const float* src) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int k = 0; k < kWords; ++k)
            if (lane + 32 * k < N) word(k, dst + lane + 32 * k, src + lane + 32 * k);
    }
    __device__ __forceinline__ void start_word(float* dst, const float* src) { word(0, dst, src); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    float value[kWords];
    float* target[kWords] = {};

    // the k-th word of a lane's row: the one it held before lands first
    __device__ __forceinline__ void word(int k, float* dst, const float* src) {
        if (target[k]) *target[k] = value[k];
        value[k] = *src;
        target[k] = dst;
    }
    __device__ __forceinline__ void commit() {}
    template <int Pending>
    __device__ __forceinline__ void wait() {
#pragma unroll
        for (int k = 0; k < kWords; ++k)
            if (target[k]) *target[k] = value[k], target[k] = nullptr;
    }
#elif defined(__CUDACC__)
    __device__ __forceinline__ void word(int, float* dst, const float* src) {
        const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(to), "l"(src) : "memory");
    }
    __device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
    template <int Pending>
    __device__ __forceinline__ void wait() {
        asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
    }
#else
    std::vector<std::pair<float*, const float*>> open;
    std::deque<std::vector<std::pair<float*, const float*>>> committed;

    void word(int, float* dst, const float* src) { open.emplace_back(dst, src); }
    void commit() {
        committed.push_back(std::move(open));
        open.clear();
    }
    template <int Pending>
    void wait() {
        while (committed.size() > static_cast<size_t>(Pending)) {
            for (const auto& [dst, src] : committed.front()) *dst = *src;
            committed.pop_front();
        }
    }
#endif
};
}  // namespace bppsa_rec
