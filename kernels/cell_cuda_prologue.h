// What the C spelling of a cell's generated step (lightning_bppsa/nn/cell_kernel.py) needs to compile as CUDA
// device code (nvcc, NVRTC) and in the host emulation (g++ with cuda_host_emulation.h, included before):
// int64_t, `restrict`, NAN / INFINITY and the activations the generator names (sigmoid_f32, tanh_f64, ...).
// lightning_bppsa/nn/cell_cuda.py puts it where the C source includes activations.h; see cell_loop_cuda.h.
#if defined(__CUDACC_RTC__)  // NVRTC has no system headers (a macro: no clash with a builtin typedef)
#define int64_t long long
#else
#include <stdint.h>
#include <math.h>
#endif

#ifndef restrict  // C's keyword; CUDA C++ and g++ spell it __restrict__
#define restrict __restrict__
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

// Accurate activations (libm / CUDA's non-intrinsic functions, no fast-math): float64 must match torch to
// ~1e-12; float32 is within a few ulp of torch's own.
__device__ __forceinline__ float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }
__device__ __forceinline__ float tanh_f32(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_f64(double x) { return tanh(x); }
