/* The loop over time of a user-written recurrent cell (lightning_bppsa.nn.Recurrence), compiled from its
   traced step by lightning_bppsa/nn/cell_kernel.py. The generated source defines, then includes this file:

     REAL                 the precision (float / double; the activations of activations.h come before)
     H, M, D              the width of a state tensor, their number, the flat state width M H
     NK, KH               the number of linear pieces (0: none) and their width NK H
     NI                   the number of input-part values the pointwise part reads
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

/* in[i] with stride[i]: the i-th input-part value the pointwise part reads (layout fixed by the generator);
   offsets NULL: the pieces have no input-only terms; partials 0: states only (scales, diagonal, fpart unused).
   Returns 0. */
int bppsa_cell_forward(int64_t batch, int64_t steps, int threads, const REAL* wc, const REAL* offsets,
                       const REAL* const* in, const int64_t* stride, REAL* states, int partials, REAL* scales,
                       REAL* diagonal, REAL* fpart) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        const int64_t id = 0, count = 1;
        (void)threads;
#endif
        const unsigned saved = flush_denormals();
        const int64_t lo = batch * id / count, hi = batch * (id + 1) / count;
        REAL piece[KH > 0 ? KH : 1];
        for (int64_t b = lo; b < hi; ++b) {
            for (int64_t t = 0; t < steps; ++t) {
                const int64_t row = b * steps + t;
                const REAL* prev = states + (b * (steps + 1) + t) * D;
                REAL* next = states + (b * (steps + 1) + t + 1) * D;
                if (KH > 0) {
                    for (int64_t c = 0; c < KH; ++c) piece[c] = offsets ? offsets[row * KH + c] : (REAL)0;
                    for (int64_t i = 0; i < D; ++i) {
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

/* The backward's products, row by row: out[r] = [pieces k | inputs i] of Σ_p partial[(k M + p) H + j] cot[p H + j]
   (the new states' cotangent times their partials by each piece and input value, summed over the new
   states p), from the scales' first NK M H columns (row width scale_width) and fpart; the cotangent of row
   (b, t) is the states' gradient grad (B, T + 1, D) at (b, t + 1). One pass over both instead of a
   broadcast product and a sum per kind. Returns 0. */
int bppsa_cell_cotangent(int64_t batch, int64_t steps, int threads, const REAL* grad, const REAL* scales,
                         int64_t scale_width, const REAL* fpart, REAL* out) {
    const int64_t rows = batch * steps;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; ++r) {
        const REAL* g = grad + (r + r / steps + 1) * D; /* (b (T + 1) + t + 1) D */
        const REAL* s = scales + r * scale_width;
        const REAL* f = fpart + r * NI * D;
        REAL* o = out + r * (NK + NI) * H;
        for (int64_t k = 0; k < NK; ++k)
            for (int64_t j = 0; j < H; ++j) {
                REAL acc = s[k * M * H + j] * g[j];
                for (int64_t p = 1; p < M; ++p) acc += s[(k * M + p) * H + j] * g[p * H + j];
                o[k * H + j] = acc;
            }
        for (int64_t i = 0; i < NI; ++i)
            for (int64_t j = 0; j < H; ++j) {
                REAL acc = f[i * M * H + j] * g[j];
                for (int64_t p = 1; p < M; ++p) acc += f[(i * M + p) * H + j] * g[p * H + j];
                o[(NK + i) * H + j] = acc;
            }
    }
    return 0;
}
