/* The backward of out = [a | 1] @ [b ; bias] where a has few columns (an input projection of many rows of a
   narrow input: lightning_bppsa.gemm): both gradients in one pass over the output gradient, row block by row
   block, instead of two thin GEMMs (torch's CPU GEMM runs those far from its peak: ~0.5 ms each for 16000
   rows of 96 from 8 inputs, the pass ~0.2 ms). Loaded by lightning_bppsa.kernels.thin (built by
   kernels/_native.py); C99 with GCC / Clang vector extensions, OpenMP optional. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define KMAX 16   /* a's columns, at most */
#define BLOCK 32  /* rows a block: their gradient rows stay in L1 between the two products */
#define VBYTES 64 /* vector bytes (narrower CPUs split them) */
/* The gradient's rows come from memory (a backward's fresh buffer: 14 MB at 16000 x 224): each row's cache
   lines are asked for PREFETCH_ROWS rows ahead of their use (up to the thread's last row), which the
   hardware's stream prefetcher did not do for four rows read at once (cold: 3.6 -> 2.0 ms at that size) */
#define PREFETCH_ROWS 32
#define PREFETCH_ROW(row, last, grad, gs, n)                                                                   \
    do {                                                                                                       \
        if ((row) < (last))                                                                                    \
            for (int64_t l = 0; l < (n); l += 64 / (int64_t)sizeof(*(grad)))                                  \
                __builtin_prefetch((grad) + (row) * (gs) + l, 0, 3);                                           \
    } while (0)

/* ga's row r: the first K lanes of the two partial sums' total (KV vectors each) */
#define ROW_OUT(r, even, odd)                                                                                  \
    for (int v = 0; v < KV; ++v)                                                                               \
        for (int i = v * VL; i < K && i < (v + 1) * VL; ++i) ga[(r) * K + i] = (even[v] + odd[v])[i - v * VL];

#define BPPSA_THIN(T, SUFFIX)                                                                                  \
typedef T vec_##SUFFIX __attribute__((vector_size(VBYTES)));                                                  \
enum { VL_##SUFFIX = VBYTES / sizeof(T), KV_##SUFFIX = (KMAX + VBYTES / sizeof(T) - 1) / (VBYTES / sizeof(T)) }; \
static inline vec_##SUFFIX load_##SUFFIX(const T* p) {                                                        \
    vec_##SUFFIX v;                                                                                            \
    memcpy(&v, p, sizeof v);                                                                                   \
    return v;                                                                                                  \
}                                                                                                              \
static inline void store_##SUFFIX(T* p, vec_##SUFFIX v) { memcpy(p, &v, sizeof v); }                           \
/* rows [r0, r1): ga[r] = g[r] @ bt (bt: n rows of KV vectors, b's columns zero-padded), two partial sums a   \
   row, four rows at a time (8 independent FMA chains); gb (K + 1, n) += [a | 1]^T g, two column vectors at a  \
   time, the block's K + 1 sums in registers from zero, then added (a running sum over every row would lose   \
   float32 digits: 16000 rows, ~2e-6 relative) (K a constant where inlined) */                                                                   \
static inline __attribute__((always_inline)) void block_##SUFFIX(                                             \
    const int K, int64_t r0, int64_t r1, int64_t last, int64_t n, const T* grad, int64_t gs, const T* a,      \
    int64_t as, const T* bt, T* ga, T* gb) {                                                                   \
    enum { VL = VL_##SUFFIX, KV = KV_##SUFFIX };                                                               \
    if (ga) { /* four rows at a time: each vector of bt loaded serves them, two partial sums a row (8 chains) */ \
        int64_t r = r0;                                                                                        \
        for (; r + 4 <= r1; r += 4) {                                                                          \
            vec_##SUFFIX even[4][KV], odd[4][KV];                                                              \
            for (int q = 0; q < 4; ++q)                                                                        \
                for (int v = 0; v < KV; ++v) even[q][v] = odd[q][v] = (vec_##SUFFIX){0};                      \
            const T* g = grad + r * gs;                                                                        \
            for (int q = 0; q < 4; ++q) PREFETCH_ROW(r + PREFETCH_ROWS + q, last, grad, gs, n);              \
            int64_t c = 0;                                                                                     \
            for (; c + 2 <= n; c += 2)                                                                         \
                for (int v = 0; v < KV; ++v) {                                                                 \
                    const vec_##SUFFIX w0 = load_##SUFFIX(bt + (c * KV + v) * VL);                             \
                    const vec_##SUFFIX w1 = load_##SUFFIX(bt + ((c + 1) * KV + v) * VL);                       \
                    for (int q = 0; q < 4; ++q) even[q][v] += g[q * gs + c] * w0, odd[q][v] += g[q * gs + c + 1] * w1; \
                }                                                                                              \
            for (; c < n; ++c)                                                                                 \
                for (int v = 0; v < KV; ++v)                                                                   \
                    for (int q = 0; q < 4; ++q) even[q][v] += g[q * gs + c] * load_##SUFFIX(bt + (c * KV + v) * VL); \
            for (int q = 0; q < 4; ++q) ROW_OUT(r + q, even[q], odd[q])                                        \
        }                                                                                                      \
        for (; r < r1; ++r) {                                                                                  \
            vec_##SUFFIX even[KV], odd[KV];                                                                    \
            for (int v = 0; v < KV; ++v) even[v] = odd[v] = (vec_##SUFFIX){0};                                 \
            const T* g = grad + r * gs;                                                                        \
            int64_t c = 0;                                                                                     \
            for (; c + 2 <= n; c += 2)                                                                         \
                for (int v = 0; v < KV; ++v)                                                                   \
                    even[v] += g[c] * load_##SUFFIX(bt + (c * KV + v) * VL),                                   \
                    odd[v] += g[c + 1] * load_##SUFFIX(bt + ((c + 1) * KV + v) * VL);                          \
            for (; c < n; ++c)                                                                                 \
                for (int v = 0; v < KV; ++v) even[v] += g[c] * load_##SUFFIX(bt + (c * KV + v) * VL);          \
            ROW_OUT(r, even, odd)                                                                              \
        }                                                                                                      \
    }                                                                                                          \
    if (!gb) return;                                                                                           \
    int64_t c = 0;                                                                                             \
    for (; c + 2 * VL <= n; c += 2 * VL) {                                                                     \
        vec_##SUFFIX lo[KMAX + 1], hi[KMAX + 1];                                                               \
        for (int i = 0; i <= K; ++i) lo[i] = hi[i] = (vec_##SUFFIX){0};                                          \
        for (int64_t r = r0; r < r1; ++r) {                                                                    \
            if (!ga && c == 0) PREFETCH_ROW(r + PREFETCH_ROWS, last, grad, gs, n); /* else the first product did */\
            const vec_##SUFFIX gl = load_##SUFFIX(grad + r * gs + c), gh = load_##SUFFIX(grad + r * gs + c + VL); \
            const T* x = a + r * as;                                                                           \
            for (int i = 0; i < K; ++i) lo[i] += x[i] * gl, hi[i] += x[i] * gh;                                \
            lo[K] += gl, hi[K] += gh;                                                                          \
        }                                                                                                      \
        for (int i = 0; i <= K; ++i) {                                                                         \
            store_##SUFFIX(gb + i * n + c, load_##SUFFIX(gb + i * n + c) + lo[i]);                             \
            store_##SUFFIX(gb + i * n + c + VL, load_##SUFFIX(gb + i * n + c + VL) + hi[i]);                   \
        }                                                                                                      \
    }                                                                                                          \
    for (; c < n; ++c) { /* the last columns, fewer than two vectors */                                      \
        T sums[KMAX + 1] = {0};                                                                                \
        for (int64_t r = r0; r < r1; ++r) {                                                                    \
            const T g = grad[r * gs + c];                                                                      \
            for (int i = 0; i < K; ++i) sums[i] += a[r * as + i] * g;                                          \
            sums[K] += g;                                                                                      \
        }                                                                                                      \
        for (int i = 0; i <= K; ++i) gb[i * n + c] += sums[i];                                                 \
    }                                                                                                          \
}                                                                                                              \
static inline __attribute__((always_inline)) void rows_##SUFFIX(                                              \
    const int K, int64_t r0, int64_t r1, int64_t n, const T* grad, int64_t gs, const T* a, int64_t as,        \
    const T* bt, T* ga, T* gb) {                                                                               \
    for (int64_t b0 = r0; b0 < r1; b0 += BLOCK)                                                                \
        block_##SUFFIX(K, b0, b0 + BLOCK < r1 ? b0 + BLOCK : r1, r1, n, grad, gs, a, as, bt, ga, gb);          \
}                                                                                                              \
/* ga (rows, k) = grad @ b^T and gb (k + 1, n) = [a | 1]^T grad, either NULL: not wanted. grad (rows, n) and a \
   (rows, k) with unit column strides and row strides gs, as; b (k, n) with row stride bs. Threads take        \
   contiguous row ranges, each summing gb in a buffer of its own (added in thread order: the same bits for a  \
   thread count). Returns 0, or -1 where k is out of range or there is no memory. */                         \
int bppsa_thin_backward_##SUFFIX(int64_t rows, int64_t n, int64_t k, const T* grad, int64_t gs, const T* a,  \
                                 int64_t as, const T* b, int64_t bs, T* ga, T* gb, int threads) {             \
    enum { VL = VL_##SUFFIX, KV = KV_##SUFFIX };                                                               \
    if (k < 1 || k > KMAX) return -1;                                                                          \
    if (threads < 1) threads = 1;                                                                              \
    T* bt = calloc((size_t)(n > 0 ? n : 1) * KV * VL, sizeof(T));                                              \
    T* partial = gb ? calloc((size_t)threads * (k + 1) * (n > 0 ? n : 1), sizeof(T)) : NULL;                   \
    if (!bt || (gb && !partial)) {                                                                             \
        free(bt);                                                                                              \
        free(partial);                                                                                         \
        return -1;                                                                                             \
    }                                                                                                          \
    for (int64_t c = 0; c < n; ++c)                                                                            \
        for (int64_t i = 0; i < k; ++i) bt[c * KV * VL + i] = b[i * bs + c];                                   \
    PARALLEL_ROWS                                                                                              \
    {                                                                                                          \
        const int id = THREAD_ID, count = THREAD_COUNT;                                                        \
        const int64_t r0 = rows * id / count, r1 = rows * (id + 1) / count;                                    \
        T* own = gb ? partial + (int64_t)id * (k + 1) * n : NULL;                                              \
        switch (k) { /* a's width a constant in each copy: the sums stay in registers */                        \
        case 1: rows_##SUFFIX(1, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 2: rows_##SUFFIX(2, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 3: rows_##SUFFIX(3, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 4: rows_##SUFFIX(4, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 5: rows_##SUFFIX(5, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 6: rows_##SUFFIX(6, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 7: rows_##SUFFIX(7, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        case 8: rows_##SUFFIX(8, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                             \
        default: rows_##SUFFIX((int)k, r0, r1, n, grad, gs, a, as, bt, ga, own); break;                       \
        }                                                                                                      \
    }                                                                                                          \
    if (gb) {                                                                                                  \
        memcpy(gb, partial, sizeof(T) * (size_t)(k + 1) * n);                                                  \
        for (int t = 1; t < threads; ++t)                                                                      \
            for (int64_t e = 0; e < (k + 1) * n; ++e) gb[e] += partial[(int64_t)t * (k + 1) * n + e];          \
    }                                                                                                          \
    free(bt);                                                                                                  \
    free(partial);                                                                                             \
    return 0;                                                                                                  \
}

#ifdef _OPENMP
#define PARALLEL_ROWS _Pragma("omp parallel num_threads(threads)")
#define THREAD_ID omp_get_thread_num()
#define THREAD_COUNT omp_get_num_threads()
#else
#define PARALLEL_ROWS
#define THREAD_ID 0
#define THREAD_COUNT 1
#endif

BPPSA_THIN(float, f32)
BPPSA_THIN(double, f64)
