// What kernels/recurrent.cu needs beyond kernels/cuda_host_emulation.h: a warp barrier and the math
// functions, with one spelling for nvcc/NVRTC and for the host build (g++). Kept apart from the shared
// emulation header so the two files can change independently.
#pragma once

#ifdef __CUDACC__

namespace bppsa_rec {
// __syncwarp orders the shared-memory stores and loads of the warp's lanes (independent thread scheduling).
__device__ __forceinline__ void warp_barrier() { __syncwarp(); }
}  // namespace bppsa_rec

#else

#include <math.h>

namespace bppsa_rec {
// The emulated warp has 32 OS threads meeting at its barrier (the block is padded to whole warps).
inline void warp_barrier() { bppsa_emu_warp().barrier.wait(); }
}  // namespace bppsa_rec

#endif

namespace bppsa_rec {
// Accurate (libm / CUDA's non-intrinsic) functions: float64 must match torch to ~1e-12.
__device__ __forceinline__ float tanh_of(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_of(double x) { return tanh(x); }
__device__ __forceinline__ float sigmoid_of(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ double sigmoid_of(double x) { return 1.0 / (1.0 + exp(-x)); }
}  // namespace bppsa_rec
