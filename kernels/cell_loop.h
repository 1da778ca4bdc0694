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
   threads take contiguous blocks of them and run all their steps. States are (B, T + 1, D), rows of the
   other arrays (b, t) flattened. Denormals are flushed for the call, as in recurrent.c. */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* partial sums of the backward's product over the pieces' rows (independent FMA chains; 4 measured best
   against 1 and 2 on the gated cell and the LSTM variant, H = 32) */
#define CARRY_SETS 4

/* how many steps ahead the backward asks for the factors it reads (descending addresses, one dependent step
   at a time: the hardware prefetcher alone left the sweep waiting on them; 2-8 measured alike, LSTM H = 32) */
#define PREFETCH_STEPS 4

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

/* in[i] with stride[i]: the i-th input-part value the pointwise part reads (layout fixed by the generator);
   offsets NULL: the pieces have no input-only terms; partials 0: states only (scales, diagonal, fpart unused).
   Returns 0. */
int bppsa_cell_forward(int64_t batch, int64_t steps, int threads, const REAL* wc, const REAL* offsets,
                       const REAL* const* in, const int64_t* stride, REAL* states, int partials, REAL* scales,
                       REAL* diagonal, REAL* fpart) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#else
    (void)threads;
#endif
    {
        const unsigned saved = flush_denormals();
        int64_t lo, hi;
        thread_rows(batch, &lo, &hi);
        REAL piece[KH > 0 ? KH : 1];
        for (int64_t b = lo; b < hi; ++b) {
            for (int64_t t = 0; t < steps; ++t) {
                const int64_t row = b * steps + t;
                const REAL* prev = states + (b * (steps + 1) + t) * D;
                REAL* next = states + (b * (steps + 1) + t + 1) * D;
                if (KH > 0) {
                    for (int64_t c = 0; c < KH; ++c) piece[c] = offsets ? offsets[row * KH + c] : (REAL)0;
                    for (int64_t i = CLO; i < CHI; ++i) { /* the state columns the pieces read */
                        const REAL v = prev[i];
                        const REAL* w = wc + i * KH;
                        for (int64_t c = 0; c < KH; ++c) piece[c] += v * w[c];
                    }
                }
                if (partials) {
                    cell_partials(row, prev, piece, in, stride, next, scales, diagonal, fpart);
                } else {
                    cell_values(row, prev, piece, in, stride, next);
                }
            }
        }
        restore_denormals(saved);
    }
    return 0;
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

/* The backward's linear scan of the factored step Jacobians fused with its products, row by row (rows are
   independent; OpenMP threads take blocks of them): from g_T = direct at T, for t = T .. 1 (J_t's factors
   at row (b, t - 1)):
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
   the products carry everything else the VJP needs, so the other states' gradients stay in two rows of
   this thread's stack (not written out: B (T + 1) D elements a step). Returns 0. */
int bppsa_cell_backward(int64_t batch, int64_t steps, int threads, const REAL* wt, const REAL* scales,
                        int64_t scale_width, const REAL* diagonal, const REAL* fpart, const REAL* direct,
                        int64_t direct_width, int64_t batch_stride, int64_t step_stride, const REAL* final,
                        REAL* out, REAL* products) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#else
    (void)threads;
#endif
    {
        const unsigned saved = flush_denormals();
        int64_t lo, hi;
        thread_rows(batch, &lo, &hi);
        REAL carry[D], rows[2][D];
        for (int64_t b = lo; b < hi; ++b) {
            /* s_t's direct gradient at given + (t - 1) step_stride */
            const REAL* given = direct_width > 0 ? direct + b * batch_stride : NULL;
            const REAL* own = final ? final + b * D : NULL;
            REAL* g = rows[0];
            for (int64_t c = 0; c < D; ++c) g[c] = own ? own[c] : 0;
            for (int64_t c = 0; c < direct_width; ++c) g[c] += given[(steps - 1) * step_stride + c];
            for (int64_t t = steps; t >= 1; --t) {
                const int64_t row = b * steps + t - 1;
                const REAL* s = scales + row * scale_width;
                REAL* o = products + row * (NK + NI) * H;
                if (t > PREFETCH_STEPS) { /* the sweep reads the factors backwards, a row a step: ask for them early */
                    const char* ahead = (const char*)(s - PREFETCH_STEPS * scale_width);
                    for (int64_t e = 0; e < scale_width * (int64_t)sizeof(REAL); e += 64) __builtin_prefetch(ahead + e);
                }
                row_products(g, s, fpart + row * NF * H, o);
                /* CARRY_SETS partial sums over the pieces' rows: as many independent FMA chains as that many
                   times the read columns' vectors (one set of a few vectors would be latency-bound) */
                REAL part[CARRY_SETS][CHI > CLO ? CHI - CLO : 1];
                for (int64_t a = 0; a < CARRY_SETS; ++a)
                    for (int64_t c = 0; c < CHI - CLO; ++c) part[a][c] = 0;
                int64_t r = 0;
                for (; r + CARRY_SETS <= KH; r += CARRY_SETS)
                    for (int64_t a = 0; a < CARRY_SETS; ++a) {
                        const REAL v = o[r + a];
                        const REAL* w = wt + (r + a) * D + CLO;
                        for (int64_t c = 0; c < CHI - CLO; ++c) part[a][c] += v * w[c];
                    }
                for (; r < KH; ++r) {
                    const REAL v = o[r];
                    const REAL* w = wt + r * D + CLO;
                    for (int64_t c = 0; c < CHI - CLO; ++c) part[0][c] += v * w[c];
                }
                for (int64_t c = 0; c < D; ++c) carry[c] = 0;
                for (int64_t a = 0; a < CARRY_SETS; ++a)
                    for (int64_t c = 0; c < CHI - CLO; ++c) carry[CLO + c] += part[a][c];
                if (M == 1 && diagonal) {
                    for (int64_t j = 0; j < H; ++j) carry[j] += g[j] * diagonal[row * D + j];
                }
                for (int64_t j = 0; j < H; ++j) {
                    CELL_DIRECT(ROW_G, ROW_S, ROW_ADD)
                }
                REAL* prev = g == rows[0] ? rows[1] : rows[0];
                const int64_t width = t >= 2 ? direct_width : 0;
                const REAL* d = width > 0 ? given + (t - 2) * step_stride : NULL;
                for (int64_t c = 0; c < width; ++c) prev[c] = d[c] + carry[c];
                for (int64_t c = width; c < D; ++c) prev[c] = carry[c];
                g = prev;
            }
            for (int64_t c = 0; c < D; ++c) out[b * D + c] = g[c];
        }
        restore_denormals(saved);
    }
    return 0;
}
