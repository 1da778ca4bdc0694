/* Whole single-layer, single-direction recurrent layers on CPU: a forward that emits the states and the
   Jacobian factors in one pass, and a backward that runs the gradient recurrence (the BPPSA linear scan
   of the factored step Jacobians) with the gate gradients in the same pass. Elman RNN (tanh / relu), GRU
   and LSTM, float32 and float64, batch-major tensors. Loaded by lightning_bppsa.kernels.recurrent (built
   with kernels/_build.py); C99, OpenMP optional.

   Speed: batch rows are split over OpenMP threads (they are independent). Within a thread every step
   handles its rows four at a time: one product (4 x k) @ (k x m) with the weight transposed and
   zero-padded once per call, its output columns held in registers (recurrent_impl.h), then the
   activations of the same rows in a loop gcc vectorises. float32 tanh / sigmoid use the approximations
   below (libm's scalar tanhf would cost more than the product); float64 uses libm. Denormals are
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
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- per-thread state ------------------------------------------------------------------------- */

/* Sets flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6); returns the old control word. */
static unsigned flush_denormals(void) {
#if defined(__SSE__)
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u);
    return saved;
#else
    return 0;
#endif
}

static void restore_denormals(unsigned saved) {
#if defined(__SSE__)
    _mm_setcsr(saved);
#else
    (void)saved;
#endif
}

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

/* ---- float32 activations ---------------------------------------------------------------------
   Branch-free, so gcc vectorises the loops that call them; NaN in gives NaN out (the clamps below are
   comparisons, false for NaN). Max errors against float64 over a dense grid of [-30, 30] and of
   magnitudes 1e-30..1 (tests/kernels/test_recurrent.py): tanh 1.37 ulp, sigmoid 2.46 ulp (torch's
   own float32 sigmoid: also 2.46). */

static inline float bits_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* exp(x) for x in [-87, 88] (2^k stays a normal number) or NaN. x = k ln2 + r with |r| <= ln2/2
   (Cody-Waite: ln2 split in a 9-bit head, exact times k, and a tail); exp(r) by its Taylor polynomial of
   degree 7 (truncation error < 6e-9 relative); 2^k built in the exponent bits. */
static inline float exp_core_f32(float x) {
    /* adding 1.5 * 2^23 rounds x log2(e) to an integer held in the low mantissa bits of t */
    const float shifter = 12582912.0f;
    const float t = x * 1.44269504f + shifter;
    const float k = t - shifter;
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* unsigned arithmetic: a NaN's bits give some scale, and NaN times any scale is NaN */
    const uint32_t scale = (float_bits(t) - 0x4B400000u + 127u) << 23;
    return p * bits_as_float(scale);
}

/* exp(x) for any x: clamped to [-87, 88] first (NaN passes the comparisons). */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    return exp_core_f32(x);
}

/* tanh(x): |x| < 0.625 by x + x^3 P(x^2) (P fitted for relative error, 1e-8 with float32 coefficients),
   otherwise 1 - 2 / (exp(2|x|) + 1) (no cancellation there: the result is > 0.55); |x| > 10 gives 1
   (float32 tanh rounds to 1 from |x| = 9.02 on). */
static inline float tanh_f32(float x) {
    float a = fabsf(x);
    a = a > 10.0f ? 10.0f : a;
    const float u = a * a;
    float p = -0.0057051284f;
    p = p * u + 0.020639211f;
    p = p * u + -0.053739753f;
    p = p * u + 0.13331443f;
    p = p * u + -0.3333328f;
    const float small = a + a * u * p;
    const float large = 1.0f - 2.0f / (exp_core_f32(2.0f * a) + 1.0f); /* 2a <= 20: no clamp needed */
    return copysignf(a < 0.625f ? small : large, x);
}

/* sigmoid(x) = 1 / (1 + exp(-x)): no cancellation anywhere. Below x = -87.3 the result would be a
   denormal: it is 0, explicitly (gcc folds the clamped lanes to a constant at compile time, where the
   run-time flush-to-zero mode does not apply). */
static inline float sigmoid_f32(float x) {
    const float s = 1.0f / (1.0f + exp_f32(-x));
    return s < FLT_MIN ? 0.0f : s;
}

static inline double tanh_f64(double x) { return tanh(x); }
static inline double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }

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

#define REAL float
#define SUFFIX f32
#define LANES 8 /* elements of a 256-bit vector: the padding unit of weight rows */
#include "recurrent_impl.h"
#undef REAL
#undef SUFFIX
#undef LANES

#define REAL double
#define SUFFIX f64
#define LANES 4
#include "recurrent_impl.h"
#undef REAL
#undef SUFFIX
#undef LANES
