/* What every compiled CPU kernel of this package shares: the denormal switch and the activations in both
   precisions (float32 branch-free approximations, float64 libm). Included by recurrent.c and by the generated
   cell kernels (lightning_bppsa/nn/cell_kernel.py); static inline, so each includer gets its own copy. */
#ifndef BPPSA_ACTIVATIONS_H
#define BPPSA_ACTIVATIONS_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

/* Sets flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6); returns the old control word. */
static inline unsigned flush_denormals(void) {
#if defined(__SSE__)
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u);
    return saved;
#else
    return 0;
#endif
}

static inline void restore_denormals(unsigned saved) {
#if defined(__SSE__)
    _mm_setcsr(saved);
#else
    (void)saved;
#endif
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

#endif
