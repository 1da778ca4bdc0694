/* Whole single-layer, single-direction recurrent layers on CPU: a forward that emits the states and the
   Jacobian factors in one pass, and a backward that runs the gradient recurrence (the BPPSA linear scan
   of the factored step Jacobians) with the gate gradients in the same pass. Elman RNN (tanh / relu), GRU
   and LSTM, float32 and float64, batch-major tensors. Loaded by lightning_bppsa.kernels.recurrent (built
   with kernels/_build.py); C99, OpenMP optional.

   Speed: batch rows are split over OpenMP threads (they are independent). Within a thread every step
   handles its rows four at a time: one product (4 x k) @ (k x m) with the weight transposed and
   zero-padded once per call, its output columns held in registers (recurrent_impl.h), then the
   activations of the same rows in a loop gcc vectorises. float32 tanh / sigmoid use the approximations of
   activations.h (libm's scalar tanhf would cost more than the product); float64 uses libm. Denormals are
   flushed for the duration of a call: long products of contracting Jacobians underflow, and x86 is
   10-100x slower on denormal operands. No -ffast-math: NaN propagates as in torch. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#include "activations.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- per-thread state ------------------------------------------------------------------------- */

/* The batch rows [*lo, *hi) of the calling thread: a static, contiguous split in whole pairs of rows, so
   rows are paired (0, 1), (2, 3), ... whatever the thread count (the parameter gradients' partial sums are
   per pair: the same sums in the same order for any thread count). */
static void thread_rows(int64_t batch, int64_t* lo, int64_t* hi) {
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
    const int64_t id = 0, count = 1;
#endif
    const int64_t pairs = (batch + 1) / 2;
    *lo = 2 * (pairs * id / count);
    *hi = 2 * (pairs * (id + 1) / count);
    *hi = *hi < batch ? *hi : batch;
}

/* The approximations over an array, for the accuracy test: the code the kernels inline, with denormals
   flushed as in the kernels. */
void bppsa_tanh_f32(int64_t n, const float* x, float* y) {
    const unsigned saved = flush_denormals();
    for (int64_t i = 0; i < n; ++i) y[i] = tanh_f32(x[i]);
    restore_denormals(saved);
}

void bppsa_sigmoid_f32(int64_t n, const float* x, float* y) {
    const unsigned saved = flush_denormals();
    for (int64_t i = 0; i < n; ++i) y[i] = sigmoid_f32(x[i]);
    restore_denormals(saved);
}

/* ---- the kernels, once per precision --------------------------------------------------------- */

/* how many steps ahead the sweeps prefetch their rows' data (one step of all rows outlasts a miss) */
#define BPPSA_PREFETCH_STEPS 2
/* steps of gate gradients a pair buffers before adding them to its parameter-gradient sums (recurrent_impl.h) */
#define BPPSA_SLOTS 8
/* rows a sweep step handles together (their products' independent FMA chains overlap); the parameter
   sums stay per pair of rows */
#define BPPSA_ROWS 4

#define BPPSA_CAT_(a, b) a##_##b
#define BPPSA_CAT(a, b) BPPSA_CAT_(a, b)

/* FMA: the products' fused multiply-add, spelled out: with contraction left to the compiler, the quad and the
   pair variants of a product fused different operations, so a row's bits depended on how rows were grouped,
   i.e. on the thread count (GRU / LSTM at B = 3, 6 on one vs two threads) */
#define REAL float
#define SUFFIX f32
#define LANES 8 /* elements of a 256-bit vector: the padding unit of weight rows */
#define FMA fmaf
#include "recurrent_impl.h"
#undef REAL
#undef SUFFIX
#undef LANES
#undef FMA

#define REAL double
#define SUFFIX f64
#define LANES 4
#define FMA fma
#include "recurrent_impl.h"
#undef REAL
#undef SUFFIX
#undef LANES
#undef FMA
