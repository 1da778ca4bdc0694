/* The sequential ("linear") schedule of the BPPSA scan on CPU: the whole recurrence
   g_t = g_{t+1} J_t (+ delta_t) in one call, batch rows spread over OpenMP threads (they are independent).
   Loaded by lightning_bppsa.kernels.cpu (built with kernels/_build.py); C99, OpenMP optional. */
#include <stdint.h>
#include <stdlib.h>

/* g_t = g_{t+1} J_t (+ add_t) for t = n-1 .. 0, every batch row on its own.
   factored: J_t = diag(u_t) + S_t W with S_t = [diag(s^1) .. diag(s^k)] (m = k d), W (m, d) row-major.
   dense:    jt (B, n, d, d) transposed Jacobians, g_t[c] = sum_r jt[b, t][c][r] g_{t+1}[r].
   The per-step tensors are (steps, B, width) views given by element strides: step t of row b starts at
   t * st + b * sb (their last dimension contiguous), so time-major and batch-major layouts run without a
   copy: scales (n, B, m), u (n, B, d) or NULL, add (n, B, d) or NULL, out (n + 1, B, d) with out[n] set. */
/* tmp = [g s^1, .., g s^k]: the row gradient scaled tile by tile (shared by both factored loops) */
#define BPPSA_SCALE_ROW(T, SUFFIX)                                                                 \
static inline void scale_row_##SUFFIX(const T* restrict g, const T* restrict s, int64_t d, int64_t m, \
                                      T* restrict tmp) {                                           \
    for (int64_t j = 0; j < m; j += d)                                                             \
        for (int64_t c = 0; c < d; ++c) tmp[j + c] = g[c] * s[j + c];                              \
}                                                                                                  \
/* acc[0 .. d) = add_t + g u_t (either may be NULL: no term) */                                    \
static inline void start_row_##SUFFIX(const T* restrict add, const T* restrict g, const T* restrict u, \
                                      int64_t d, T* restrict acc) {                                \
    for (int64_t c = 0; c < d; ++c) acc[c] = add ? add[c] : 0;                                     \
    if (u)                                                                                         \
        for (int64_t c = 0; c < d; ++c) acc[c] += g[c] * u[c];                                     \
}
BPPSA_SCALE_ROW(float, f32)
BPPSA_SCALE_ROW(double, f64)

/* the arguments every factored sweep takes */
#define BPPSA_FACTORED_ARGS(T)                                                                     \
    int64_t n, int64_t batch, int64_t d, int64_t m, const T *weight, const T *scales, int64_t s_t, \
        int64_t s_b, const T *u, int64_t u_t, int64_t u_b, const T *add, int64_t a_t, int64_t a_b, \
        T *out, int64_t o_t, int64_t o_b, int threads
#define BPPSA_FACTORED_CALL n, batch, d, m, weight, scales, s_t, s_b, u, u_t, u_b, add, a_t, a_b, out, o_t, o_b, threads
#define BPPSA_AT(p, x, t, b) ((p) ? (p) + (t) * x##_t + (b) * x##_b : NULL)

/* The factored sweep in column slabs of 8 NB (NB a constant; one slab when d <= 8 NB): a slab's output
   columns stay in registers while j runs over the m scaled inputs (zero-padded weight; two accumulator
   sets for even and odd j, so 2 NB independent FMA chains hide the FMA latency: ~2x faster than one set,
   and for wide states ~4-5x faster than 8 columns at a time). */
#define BPPSA_SLABS(T, SUFFIX, NB)                                                                 \
static void slabs_##SUFFIX##_##NB(BPPSA_FACTORED_ARGS(T)) {                                        \
    const int64_t width = 8 * NB, slabs = (d + width - 1) / width;                                 \
    T* wpad = (T*)calloc((size_t)(slabs * m * width), sizeof(T)); /* slab q: (m x width) */        \
    for (int64_t q = 0; q < slabs; ++q)                                                            \
        for (int64_t j = 0; j < m; ++j)                                                            \
            for (int64_t c = 0; c < width && q * width + c < d; ++c)                               \
                wpad[(q * m + j) * width + c] = weight[j * d + q * width + c];                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t b = 0; b < batch; ++b) {                                                          \
        T* tmp = (T*)malloc(sizeof(T) * (size_t)(m + slabs * width));                              \
        T* start = tmp + m;                                                                        \
        for (int64_t t = n - 1; t >= 0; --t) {                                                     \
            const T* g = out + (t + 1) * o_t + b * o_b;                                            \
            scale_row_##SUFFIX(g, scales + t * s_t + b * s_b, d, m, tmp);                          \
            start_row_##SUFFIX(BPPSA_AT(add, a, t, b), g, BPPSA_AT(u, u, t, b), d, start);         \
            T* restrict o = out + t * o_t + b * o_b;                                               \
            for (int64_t q = 0; q < slabs; ++q) {                                                  \
                const int64_t c0 = q * width, cols = d - c0 < width ? d - c0 : width;              \
                const T* restrict wq = wpad + q * m * width;                                       \
                T even[8 * NB], odd[8 * NB];                                                       \
                for (int c = 0; c < 8 * NB; ++c) even[c] = odd[c] = 0;                             \
                for (int64_t c = 0; c < cols; ++c) even[c] = start[c0 + c];                        \
                int64_t j = 0;                                                                     \
                for (; j + 1 < m; j += 2) {                                                        \
                    const T v0 = tmp[j], v1 = tmp[j + 1];                                          \
                    const T* restrict w0 = wq + j * 8 * NB;                                        \
                    const T* restrict w1 = w0 + 8 * NB;                                            \
                    for (int c = 0; c < 8 * NB; ++c) {                                             \
                        even[c] += v0 * w0[c];                                                     \
                        odd[c] += v1 * w1[c];                                                      \
                    }                                                                              \
                }                                                                                  \
                if (j < m) /* odd m: the last input */                                             \
                    for (int c = 0; c < 8 * NB; ++c) even[c] += tmp[j] * wq[j * 8 * NB + c];       \
                for (int64_t c = 0; c < cols; ++c) o[c0 + c] = even[c] + odd[c];                   \
            }                                                                                      \
        }                                                                                          \
        free(tmp);                                                                                 \
    }                                                                                              \
    free(wpad);                                                                                    \
}

#define BPPSA_SLABS_ALL(T, SUFFIX) \
    BPPSA_SLABS(T, SUFFIX, 1) BPPSA_SLABS(T, SUFFIX, 2) BPPSA_SLABS(T, SUFFIX, 3) BPPSA_SLABS(T, SUFFIX, 4)
BPPSA_SLABS_ALL(float, f32)
BPPSA_SLABS_ALL(double, f64)

#define BPPSA_KERNELS(T, SUFFIX)                                                                  \
void bppsa_linear_factored_##SUFFIX(BPPSA_FACTORED_ARGS(T)) {                                      \
    switch ((d + 7) / 8) {                                                                         \
        case 1: slabs_##SUFFIX##_1(BPPSA_FACTORED_CALL); return;                                   \
        case 2: slabs_##SUFFIX##_2(BPPSA_FACTORED_CALL); return;                                   \
        case 3: slabs_##SUFFIX##_3(BPPSA_FACTORED_CALL); return;                                   \
        default: slabs_##SUFFIX##_4(BPPSA_FACTORED_CALL); return; /* wide states: slabs of 32 */   \
    }                                                                                              \
}                                                                                                  \
void bppsa_linear_dense_##SUFFIX(int64_t n, int64_t batch, int64_t d, const T* jt, const T* add,   \
                                 int64_t a_t, int64_t a_b, T* out, int64_t o_t, int64_t o_b,       \
                                 int threads) {                                                    \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t b = 0; b < batch; ++b) {                                                          \
        for (int64_t t = n - 1; t >= 0; --t) {                                                     \
            const T* restrict g = out + (t + 1) * o_t + b * o_b;                                   \
            const T* restrict jac = jt + (b * n + t) * d * d;                                      \
            T* restrict o = out + t * o_t + b * o_b;                                               \
            for (int64_t c = 0; c < d; ++c) { /* 8 partial sums: one vector FMA per 8 terms */     \
                const T* restrict row = jac + c * d;                                               \
                T lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                             \
                int64_t r = 0;                                                                     \
                for (; r + 8 <= d; r += 8)                                                         \
                    for (int k = 0; k < 8; ++k) lanes[k] += row[r + k] * g[r + k];                 \
                T acc = add ? add[t * a_t + b * a_b + c] : 0;                                      \
                for (; r < d; ++r) acc += row[r] * g[r];                                           \
                o[c] = acc + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +                    \
                              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));                    \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

BPPSA_KERNELS(float, f32)
BPPSA_KERNELS(double, f64)
