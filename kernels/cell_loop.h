/* The loop over time of a user-written recurrent cell (lightning_bppsa.nn.Recurrence), compiled from its
   traced step by lightning_bppsa/nn/cell_kernel.py. The generated source defines, then includes this file:

     REAL                 the precision (float / double; the activations of activations.h come before)
     H, M, D              the width of a state tensor, their number, the flat state width M H
     NK, KH               the number of linear pieces (0: none) and their width NK H
     NI                   the number of input-part values the pointwise part reads
     NS, NF               the kept columns (H wide) of the scales and of the partials by the input values: those
                          not zero by the graph's structure, in the generator's order (nn/cell_kernel.py _Layout)
     CLO, CHI             the state columns the pieces read (both products skip the others)
     CELL_PRODUCTS(G, S, F, OUT)  OUT(k, Σ S(n) G(p)) for each piece k, then OUT(NK + i, Σ F(n) G(p)) for each
                          input value i: the sums over the kept columns n (of new state p) of its partials
     CELL_DIRECT(G, S, ADD)  with several states: ADD(q, Σ S(n) G(p)) for each state q read directly (the kept
                          columns of its identity tile)
     cell_values(row, prev, piece, in, stride, next)
     cell_partials(row, prev, piece, in, stride, next, scales, diagonal, fpart)
                          the step's pointwise part for one batch row: the new state from the old one, the
                          pieces and the input part's values, and (partials) every partial derivative the
                          factored Jacobians and the parameter gradients need

   A step of row b: piece = offsets[row] + prev @ wc (the state's linear maps, wc = (D, KH), the input-only
   terms of those maps precomputed in offsets), then the pointwise part. Rows are independent: OpenMP
   threads take contiguous blocks of them and run all their steps, MV_ROWS rows in lockstep (one product with
   the weights for all of them), the rest one by one. States are (B, T + 1, D), rows of the
   other arrays (b, t) flattened. Denormals are flushed for the call, as in recurrent.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* how many steps ahead the backward asks for the factors it reads (descending addresses, one dependent step
   at a time: the hardware prefetcher alone left the sweep waiting on them; 2-8 measured alike, LSTM H = 32),
   into L2 (PREFETCH_LEVEL 2): MV_ROWS rows' factors that many steps ahead into L1 evicted the weights there
   (WideFirst, H = 32: ~5% slower) */
#define PREFETCH_STEPS 4
#define PREFETCH_LEVEL 2

/* The steps' products with the weights (the forward's prev @ wc, the backward's u @ wt) run on MV_ROWS batch rows
   at once, in GCC / Clang vectors of VBYTES: each weight vector loaded serves every row of the block, and the
   block's sums stay in registers (MV_ROWS x at most MV_VECS vectors, beside MV_VECS of weights: 31 of AVX-512's
   32 registers). Row by row, the compiler kept the sums of a 96-wide product in memory: each weight row's
   update waited on a store and reload of all of them (WideFirst, H = 32: ~3.5 of ~5 ms forward, the same
   backward; 4 rows of 6 vectors measured best there against 2 and 8 rows). */
#if defined(__AVX512F__)
#define VBYTES 64
#define MV_ROWS 4
#define MV_VECS 6
#elif defined(__AVX__)
#define VBYTES 32
#define MV_ROWS 2
#define MV_VECS 5
#else
#define VBYTES 16
#define MV_ROWS 2
#define MV_VECS 5
#endif
typedef REAL vec_t __attribute__((vector_size(VBYTES)));
#define VL ((int64_t)(VBYTES / sizeof(REAL)))
#define VECS(n) (((n) + VL - 1) / VL)  /* vectors of a padded row of n values */
#define FWD_VECS VECS(KH)              /* the forward's product: the pieces */
#define BWD_VECS VECS(CHI - CLO)       /* the backward's: the state columns the pieces read */

static inline vec_t vec_load(const REAL* p) {
    vec_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vec_store(REAL* p, vec_t v) { memcpy(p, &v, sizeof v); }

/* Cache lines a product asks for while it runs: lines[r] of each row r, count of them, for writing (into L1) or
   (write 0) reading (into PREFETCH_LEVEL). One row's lines per weight row of the product, not in a burst: a burst
   of requests (4 rows' factors, 72 lines) stalled the loop until they were in flight, a product's FMAs were
   waiting behind them (WideFirst, H = 32: its backward ~8% faster spread; asking for the lines the forward's
   pointwise part writes so, ~10% faster forward). */
typedef struct {
    const char* lines[MV_ROWS];
    int64_t count;
} ahead_t;

static inline __attribute__((always_inline)) void ask(const int R, const ahead_t* ahead, int64_t line,
                                                      const int write) {
    for (int r = 0; r < R; ++r) {
        if (write) __builtin_prefetch(ahead->lines[r] + line * 64, 1, 3);
        else __builtin_prefetch(ahead->lines[r] + line * 64, 0, PREFETCH_LEVEL);
    }
}

/* out[r][c] += Σ_{i < n} x[r][i] w[i][c] over the NV vectors of columns at out[r], w (rows ws apart): R rows'
   sums in registers, each weight vector loaded once for all of them (R and NV are constants where inlined);
   asks for ahead's lines first, first + 1, ... (those below its count), one a weight row */
static inline __attribute__((always_inline)) void tile(const int R, const int NV, int64_t n,
                                                       const REAL* const* x, const REAL* w, int64_t ws,
                                                       REAL* const* out, int64_t c0, const ahead_t* ahead,
                                                       int64_t first, const int write) {
    vec_t acc[MV_ROWS][MV_VECS];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = vec_load(out[r] + c0 + v * VL);
    for (int64_t i = 0; i < n; ++i) {
        if (first + i < ahead->count) ask(R, ahead, first + i, write);
        vec_t wv[MV_VECS];
        for (int v = 0; v < NV; ++v) wv[v] = vec_load(w + i * ws + c0 + v * VL);
        for (int r = 0; r < R; ++r) {
            const REAL xi = x[r][i];
            for (int v = 0; v < NV; ++v) acc[r][v] += xi * wv[v];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) vec_store(out[r] + c0 + v * VL, acc[r][v]);
}

/* out[r] += x[r] @ w for R rows: w (n, nvec VL), rows ws apart, zero past the product's width; out[r] nvec VL
   wide; the columns in tiles of at most MV_VECS vectors, as even as they go (8 vectors: 4 + 4, not 6 + 2); asks
   for ahead's lines meanwhile (those the tiles' weight rows leave over after them) */
static inline __attribute__((always_inline)) void product_rows(const int R, int64_t n, const REAL* const* x,
                                                               const REAL* w, int64_t ws, const int nvec,
                                                               REAL* const* out, const ahead_t* ahead,
                                                               const int write) {
    const int tiles = (nvec + MV_VECS - 1) / MV_VECS, per = tiles > 0 ? (nvec + tiles - 1) / tiles : 1;
    int v0 = 0;
    int64_t first = 0;
    for (; v0 + per <= nvec; v0 += per, first += n) tile(R, per, n, x, w, ws, out, v0 * VL, ahead, first, write);
    if (v0 < nvec) tile(R, nvec - v0, n, x, w, ws, out, v0 * VL, ahead, first, write), first += n;
    for (; first < ahead->count; ++first) ask(R, ahead, first, write);
}

/* count REAL aligned for vectors in a new block (free it with release), or NULL if there is no memory: malloc's,
   rounded up (C99 has no aligned_alloc) */
static REAL* aligned(int64_t count) {
    const size_t bytes = (size_t)(count > 0 ? count : 1) * sizeof(REAL) + VBYTES + sizeof(void*);
    char* block = malloc(bytes);
    if (!block) return NULL;
    char* start = block + sizeof(void*);
    start += (VBYTES - (uintptr_t)start % VBYTES) % VBYTES;
    memcpy(start - sizeof(void*), &block, sizeof(void*)); /* the block, just before its start */
    return (REAL*)start;
}

static void release(REAL* p) {
    if (!p) return;
    void* block;
    memcpy(&block, (char*)p - sizeof(void*), sizeof(void*));
    free(block);
}

/* The rows (n, width) of w (row stride ld) as the products read them, in *rows with row stride *ws: w itself where
   a row is whole vectors, else a zero-padded copy, also in *copy (release it; NULL where none was made).
   Returns 0, or -1 where there is no memory for the copy. */
static int weight_rows(const REAL* w, int64_t n, int64_t width, int64_t ld, const REAL** rows, int64_t* ws,
                       REAL** copy) {
    const int64_t padded = VECS(width) * VL;
    *copy = NULL;
    *rows = w;
    *ws = ld;
    if (padded == width) return 0;
    REAL* out = aligned(n * padded);
    if (!out) return -1;
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < width; ++c) out[i * padded + c] = w[i * ld + c];
        for (int64_t c = width; c < padded; ++c) out[i * padded + c] = 0;
    }
    *copy = out;
    *rows = out;
    *ws = padded;
    return 0;
}

/* Ask for count REAL at p, into the cache level PREFETCH_LEVEL. */
static inline void prefetch(const REAL* p, int64_t count) {
    for (int64_t e = 0; e < count * (int64_t)sizeof(REAL); e += 64)
        __builtin_prefetch((const char*)p + e, 0, PREFETCH_LEVEL);
}

/* The batch rows [*lo, *hi) of the calling thread: a contiguous block (rows are independent). */
static inline void thread_rows(int64_t batch, int64_t* lo, int64_t* hi) {
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
    const int64_t id = 0, count = 1;
#endif
    *lo = batch * id / count;
    *hi = batch * (id + 1) / count;
}

/* R rows' steps from row b0 (R a constant where inlined): their pieces (piece[r], FWD_VECS VL wide each) = the
   offsets + prev @ wc (wp: wc's read rows, ws apart, as weight_rows gives them), then their pointwise parts. */
static inline __attribute__((always_inline)) void forward_rows(const int R, int64_t b0, int64_t steps,
                                                               const REAL* wp, int64_t ws, const REAL* offsets,
                                                               const REAL* const* in, const int64_t* stride,
                                                               REAL* states, int partials, REAL* scales,
                                                               REAL* diagonal, REAL* fpart, REAL* const* piece) {
    for (int64_t t = 0; t < steps; ++t) {
        const REAL* prev[MV_ROWS];
        for (int r = 0; r < R; ++r) {
            const int64_t row = (b0 + r) * steps + t;
            prev[r] = states + ((b0 + r) * (steps + 1) + t) * D + CLO;
            if (KH > 0) {
                if (offsets) memcpy(piece[r], offsets + row * KH, KH * sizeof(REAL));
                else memset(piece[r], 0, KH * sizeof(REAL));
            }
        }
        ahead_t written = {{NULL}, 0}; /* the factors' rows this step writes */
        if (partials) {
            written.count = (NS * H * (int64_t)sizeof(REAL) + 63) / 64;
            for (int r = 0; r < R; ++r) written.lines[r] = (const char*)(scales + ((b0 + r) * steps + t) * NS * H);
        }
        if (KH > 0) product_rows(R, CHI - CLO, prev, wp, ws, FWD_VECS, piece, &written, 1);
        for (int r = 0; r < R; ++r) {
            const int64_t row = (b0 + r) * steps + t;
            const REAL* old = states + ((b0 + r) * (steps + 1) + t) * D;
            REAL* next = states + ((b0 + r) * (steps + 1) + t + 1) * D;
            if (partials) {
                cell_partials(row, old, piece[r], in, stride, next, scales, diagonal, fpart);
            } else {
                cell_values(row, old, piece[r], in, stride, next);
            }
        }
    }
}

/* in[i] with stride[i]: the i-th input-part value the pointwise part reads (layout fixed by the generator);
   offsets NULL: the pieces have no input-only terms; partials 0: states only (scales, diagonal, fpart unused).
   Returns 0, or -1 where its scratch could not be allocated (nothing written then is valid). */
int bppsa_cell_forward(int64_t batch, int64_t steps, int threads, const REAL* wc, const REAL* offsets,
                       const REAL* const* in, const int64_t* stride, REAL* states, int partials, REAL* scales,
                       REAL* diagonal, REAL* fpart) {
    const REAL* wp = NULL;
    REAL* copy = NULL;
    int64_t ws = 0;
    if (KH > 0 && weight_rows(wc + CLO * KH, CHI - CLO, KH, KH, &wp, &ws, &copy) != 0) return -1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
#else
    (void)threads;
#endif
    {
        const unsigned saved = flush_denormals();
        int64_t lo, hi;
        thread_rows(batch, &lo, &hi);
        REAL* buffer = aligned(MV_ROWS * FWD_VECS * VL);
        REAL* piece[MV_ROWS];
        for (int r = 0; r < MV_ROWS; ++r) piece[r] = buffer ? buffer + r * FWD_VECS * VL : NULL;
        if (!buffer) {
            failed = 1;
        } else {
            int64_t b = lo;
            for (; b + MV_ROWS <= hi; b += MV_ROWS)
                forward_rows(MV_ROWS, b, steps, wp, ws, offsets, in, stride, states, partials, scales, diagonal, fpart,
                             piece);
            for (; b < hi; ++b)
                forward_rows(1, b, steps, wp, ws, offsets, in, stride, states, partials, scales, diagonal, fpart,
                             piece);
        }
        release(buffer);
        restore_denormals(saved);
    }
    release(copy);
    return failed ? -1 : 0;
}

/* the generated sums' accessors, at coordinate j of a row: the new states' gradient g, the row's kept scales s
   and input partials f, its products o and the carry */
#define ROW_G(p) g[(p) * H + j]
#define ROW_S(n) s[(n) * H + j]
#define ROW_F(n) f[(n) * H + j]
#define ROW_OUT(k, e) o[(k) * H + j] = (e);
#define ROW_ADD(q, e) carry[(q) * H + j] += (e);

/* One row's backward products: o = [pieces k | inputs i] of Σ_p partial_k[p] g[p] (the new states' gradient g
   times their partials by each piece and input value, summed over the new states p whose partial is kept),
   from the kept scales s and input partials f. */
static inline void row_products(const REAL* restrict g, const REAL* restrict s, const REAL* restrict f,
                                REAL* restrict o) {
    (void)g; (void)s; (void)f; (void)o;
    for (int64_t j = 0; j < H; ++j) {
        CELL_PRODUCTS(ROW_G, ROW_S, ROW_F, ROW_OUT)
    }
}

/* The products of every row (after a scan that ran elsewhere): row (b, t) from the states' gradient grad
   (B, T + 1, D) at (b, t + 1), the scales (row width scale_width) and fpart. Returns 0. */
int bppsa_cell_cotangent(int64_t batch, int64_t steps, int threads, const REAL* grad, const REAL* scales,
                         int64_t scale_width, const REAL* fpart, REAL* out) {
    const int64_t rows = batch * steps;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; ++r)
        row_products(grad + (r + r / steps + 1) * D, scales + r * scale_width, fpart + r * NF * H,
                     out + r * (NK + NI) * H);
    return 0;
}

/* R rows' sweeps from row b0 (R a constant where inlined; bppsa_cell_backward says what they compute), each row's
   gradient in g[r] (D wide), its carry in carry[r] (D wide) and its sums with the weights in sums[r] (BWD_VECS VL
   wide): per step the rows' products, then the block's u @ wt at once (wp: wt's read columns, ws apart, as
   weight_rows gives them), then each row's direct terms. */
static inline __attribute__((always_inline)) void backward_rows(
    const int R, int64_t b0, int64_t steps, const REAL* wp, int64_t ws, const REAL* scales, int64_t scale_width,
    const REAL* diagonal, const REAL* fpart, const REAL* direct, int64_t direct_width, int64_t batch_stride,
    int64_t step_stride, const REAL* final, REAL* out, REAL* products, REAL* const* g, REAL* const* carry,
    REAL* const* sums) {
    const REAL* given[MV_ROWS]; /* s_t's direct gradient at given + (t - 1) step_stride */
    for (int r = 0; r < R; ++r) {
        const int64_t b = b0 + r;
        given[r] = direct_width > 0 ? direct + b * batch_stride : NULL;
        const REAL* own = final ? final + b * D : NULL;
        for (int64_t c = 0; c < D; ++c) g[r][c] = own ? own[c] : 0;
        for (int64_t c = 0; c < direct_width; ++c) g[r][c] += given[r][(steps - 1) * step_stride + c];
    }
    for (int64_t t = steps; t >= 1; --t) {
        const REAL* u[MV_ROWS];
        ahead_t factors; /* the rows' factors PREFETCH_STEPS steps back */
        factors.count = t > PREFETCH_STEPS ? (scale_width * (int64_t)sizeof(REAL) + 63) / 64 : 0;
        for (int r = 0; r < R; ++r) {
            const int64_t row = (b0 + r) * steps + t - 1;
            const REAL* s = scales + row * scale_width;
            REAL* o = products + row * (NK + NI) * H;
            /* the sweep reads the factors and direct gradients backwards, a row a step: ask for them early (the
               factors while the product runs) */
            factors.lines[r] = (const char*)(s - (t > PREFETCH_STEPS ? PREFETCH_STEPS * scale_width : 0));
            if (t > PREFETCH_STEPS + 1 && direct_width > 0)
                prefetch(given[r] + (t - 2 - PREFETCH_STEPS) * step_stride, direct_width);
            row_products(g[r], s, fpart + row * NF * H, o);
            u[r] = o;
            if (KH > 0) memset(sums[r], 0, BWD_VECS * VL * sizeof(REAL));
        }
        if (KH > 0) product_rows(R, KH, u, wp, ws, BWD_VECS, sums, &factors, 0);
        else
            for (int64_t line = 0; line < factors.count; ++line) ask(R, &factors, line, 0);
        for (int r = 0; r < R; ++r) {
            const int64_t row = (b0 + r) * steps + t - 1;
            const REAL* s = scales + row * scale_width;
            REAL* cr = carry[r];
            const REAL* gr = g[r];
            for (int64_t c = 0; c < CLO; ++c) cr[c] = 0;
            for (int64_t c = CLO; c < CHI; ++c) cr[c] = KH > 0 ? sums[r][c - CLO] : 0;
            for (int64_t c = CHI; c < D; ++c) cr[c] = 0;
            if (M == 1 && diagonal) {
                for (int64_t j = 0; j < H; ++j) cr[j] += gr[j] * diagonal[row * D + j];
            }
            {
                const REAL* restrict g = gr; /* the accessors' names */
                REAL* restrict carry = cr;
                (void)g; (void)s; (void)carry;
                for (int64_t j = 0; j < H; ++j) {
                    CELL_DIRECT(ROW_G, ROW_S, ROW_ADD)
                }
            }
            const int64_t width = t >= 2 ? direct_width : 0;
            const REAL* d = width > 0 ? given[r] + (t - 2) * step_stride : NULL;
            REAL* next = g[r];
            for (int64_t c = 0; c < width; ++c) next[c] = d[c] + cr[c];
            for (int64_t c = width; c < D; ++c) next[c] = cr[c];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int64_t c = 0; c < D; ++c) out[(b0 + r) * D + c] = g[r][c];
}

/* The backward's linear scan of the factored step Jacobians fused with its products, row by row (rows are
   independent; OpenMP threads take blocks of them, and each thread MV_ROWS rows at a time): from g_T = direct at
   T, for t = T .. 1 (J_t's factors at row (b, t - 1)):
     products[row] = [pieces k | inputs i] as bppsa_cell_cotangent, from g_t;
     g_{t-1} = direct_{t-1} + g_t J_t = direct_{t-1} + u wt (u the pieces' products, wt = (KH, D) the
               pieces' weight rows; only the state columns [CLO, CHI) any piece reads) + the direct terms
               (one state: diagonal; several: the kept columns of the identity tiles, CELL_DIRECT).
   direct: the direct gradients of the new states s_1..s_T (s_0 has none) in their first direct_width columns
   (0: none; the other columns' are zero), that of s_t at direct + b * batch_stride + (t - 1) * step_stride,
   unit stride along the columns; final: (B, D), a further direct gradient of s_T, or NULL. As they are
   given, so that the outputs' gradients are read where autograd left them: no (B, T + 1, D) copy, nor a
   zero-filled (B, T, D) one where the outputs are the first state tensor of several, nor a transposed copy
   of time-major outputs. out: (B, D), the gradient of s_0:
   the products carry everything else the VJP needs, so the other states' gradients stay in a thread's
   scratch (not written out: B (T + 1) D elements a step). Returns 0, or -1 where its scratch could not be
   allocated (nothing written then is valid). */
int bppsa_cell_backward(int64_t batch, int64_t steps, int threads, const REAL* wt, const REAL* scales,
                        int64_t scale_width, const REAL* diagonal, const REAL* fpart, const REAL* direct,
                        int64_t direct_width, int64_t batch_stride, int64_t step_stride, const REAL* final,
                        REAL* out, REAL* products) {
    const REAL* wp = NULL;
    REAL* copy = NULL;
    int64_t ws = 0;
    if (KH > 0 && weight_rows(wt + CLO, KH, CHI - CLO, D, &wp, &ws, &copy) != 0) return -1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
#else
    (void)threads;
#endif
    {
        const unsigned saved = flush_denormals();
        int64_t lo, hi;
        thread_rows(batch, &lo, &hi);
        const int64_t width = BWD_VECS * VL > 0 ? BWD_VECS * VL : 1; /* a row's sums */
        REAL* buffer = aligned(MV_ROWS * (2 * D + width));
        REAL *g[MV_ROWS], *carry[MV_ROWS], *sums[MV_ROWS];
        for (int r = 0; r < MV_ROWS; ++r) {
            sums[r] = buffer ? buffer + r * width : NULL; /* first: aligned for vectors */
            g[r] = buffer ? buffer + MV_ROWS * width + r * D : NULL;
            carry[r] = buffer ? buffer + MV_ROWS * (width + D) + r * D : NULL;
        }
        if (!buffer) {
            failed = 1;
        } else {
            int64_t b = lo;
            for (; b + MV_ROWS <= hi; b += MV_ROWS)
                backward_rows(MV_ROWS, b, steps, wp, ws, scales, scale_width, diagonal, fpart, direct, direct_width,
                              batch_stride, step_stride, final, out, products, g, carry, sums);
            for (; b < hi; ++b)
                backward_rows(1, b, steps, wp, ws, scales, scale_width, diagonal, fpart, direct, direct_width,
                              batch_stride, step_stride, final, out, products, g, carry, sums);
        }
        release(buffer);
        restore_denormals(saved);
    }
    release(copy);
    return failed ? -1 : 0;
}
