/* The recurrent kernels in one precision: included by recurrent.c with REAL (float / double), SUFFIX
   (f32 / f64: the names' suffix and the activations' suffix) and LANES (the weight padding unit).
   All tensors batch-major and contiguous: a (B, T, w) tensor's row b, step t starts at (b T + t) w.
   Every exported function returns 0, or 1 when memory ran out (nothing written then). */

#define F(name) BPPSA_CAT(name, SUFFIX)

/* ---- the per-step product ---------------------------------------------------------------------- */

/* y[r][0 .. NB LANES) = x[r][0 .. k) @ w[:, 0 .. NB LANES) for ROWS rows; w is (k x ld) row-major. The
   accumulators (ROWS x NB vectors) stay in registers over all k; ROWS = 2 shares each weight load. */
#define BPPSA_PRODUCT(ROWS, NB)                                                                      \
    static inline void F(product_##ROWS##_##NB)(const REAL* const* x, int64_t k, const REAL* w,      \
                                                int64_t ld, REAL* const* y) {                        \
        REAL acc[ROWS][NB * LANES]; /* set from j = 0 (k >= 1): zeroing it compiles to a slow memset */ \
        for (int r = 0; r < ROWS; ++r)                                                               \
            for (int c = 0; c < NB * LANES; ++c) acc[r][c] = x[r][0] * w[c];                         \
        for (int64_t j = 1; j < k; ++j) {                                                            \
            const REAL* restrict wj = w + j * ld;                                                    \
            for (int r = 0; r < ROWS; ++r) {                                                         \
                const REAL v = x[r][j];                                                              \
                for (int c = 0; c < NB * LANES; ++c) acc[r][c] = FMA(v, wj[c], acc[r][c]);           \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < ROWS; ++r)                                                               \
            for (int c = 0; c < NB * LANES; ++c) y[r][c] = acc[r][c];                                \
    }
BPPSA_PRODUCT(2, 1)
BPPSA_PRODUCT(2, 2)
BPPSA_PRODUCT(2, 3)
BPPSA_PRODUCT(2, 4)
BPPSA_PRODUCT(4, 3)
#undef BPPSA_PRODUCT

/* Columns [c0, m) of y[r] = x[r][0 .. k) @ w for rows = 1 or 2, in blocks of at most 4 vectors (8
   accumulators); a missing second row repeats row 0 into the scratch row. */
static void F(pair_product)(int rows, const REAL* const* x, int64_t k, const REAL* w, int64_t ld, int64_t c0,
                            int64_t m, REAL* const* y, REAL* scratch) {
    const REAL* const xs[2] = {x[0], rows == 2 ? x[1] : x[0]};
    for (; c0 < m; c0 += 4 * LANES) {
        const int64_t vectors = (m - c0) / LANES;
        REAL* const yc[2] = {y[0] + c0, rows == 2 ? y[1] + c0 : scratch};
        const REAL* wc = w + c0;
        switch (vectors < 4 ? vectors : 4) {
            case 1: F(product_2_1)(xs, k, wc, ld, yc); break;
            case 2: F(product_2_2)(xs, k, wc, ld, yc); break;
            case 3: F(product_2_3)(xs, k, wc, ld, yc); break;
            default: F(product_2_4)(xs, k, wc, ld, yc); break;
        }
    }
}

/* y[r][0 .. m) = x[r][0 .. k) @ w for rows = 1 .. BPPSA_ROWS (4); m <= ld, both multiples of LANES.
   Each step is latency-bound: a row's product is a chain of k dependent FMAs per accumulator, so three or
   four rows run as a quad (four chains in flight, 12 accumulators) in blocks of 3 vectors; what is left
   (1 or 2 vectors: gcc vectorises a quad block that narrow across rows, measured 2-8x slower) and one or
   two rows run as pairs. A missing row repeats row 0 into the scratch row. Every row's sums run in the
   same order in any shape, so results do not depend on how rows were grouped (nor on the thread count). */
static void F(product)(int rows, const REAL* const* x, int64_t k, const REAL* w, int64_t ld, int64_t m,
                       REAL* const* y, REAL* scratch) {
    int64_t c0 = 0;
    if (rows > 2) {
        const REAL* const xs[4] = {x[0], x[1], x[2], rows == 4 ? x[3] : x[0]};
        for (; m - c0 >= 3 * LANES; c0 += 3 * LANES) {
            REAL* const yc[4] = {y[0] + c0, y[1] + c0, y[2] + c0, rows == 4 ? y[3] + c0 : scratch};
            F(product_4_3)(xs, k, w + c0, ld, yc);
        }
        F(pair_product)(rows - 2, x + 2, k, w, ld, c0, m, y + 2, scratch);
        rows = 2;
    }
    F(pair_product)(rows, x, k, w, ld, c0, m, y, scratch);
}

/* ---- weights, buffers and the sweep over steps -------------------------------------------------- */

static inline int64_t F(padded_width)(int64_t width) { return (width + LANES - 1) / LANES * LANES; }

/* (cols x ld) zero-padded transpose of the (rows x cols) w: the forward's h @ W_hhᵀ. */
static REAL* F(transposed)(const REAL* w, int64_t rows, int64_t cols, int64_t ld) {
    REAL* out = (REAL*)calloc((size_t)(cols * ld), sizeof(REAL));
    if (out)
        for (int64_t j = 0; j < cols; ++j)
            for (int64_t c = 0; c < rows; ++c) out[j * ld + c] = w[c * cols + j];
    return out;
}

/* (rows x ld) zero-padded copy of the (rows x cols) w: the backward's d @ W_hh. */
static REAL* F(padded)(const REAL* w, int64_t rows, int64_t cols, int64_t ld) {
    REAL* out = (REAL*)calloc((size_t)(rows * ld), sizeof(REAL));
    if (out)
        for (int64_t j = 0; j < rows; ++j) memcpy(out + j * ld, w + j * cols, sizeof(REAL) * (size_t)cols);
    return out;
}

/* Everything a kernel's step of one or two rows reads and writes (each kernel uses what it needs), and
   the (B, T, width) tensors it streams through, for the prefetch. */
typedef struct {
    int64_t steps, hidden, ld;
    const REAL *gi, *weight, *bias, *h0, *c0, *grad_out, *grad_h, *scales, *z, *dn, *gates;
    REAL *out, *second, *third, *fourth, *g, *gc, *tmp, *scratch; /* per-row buffers, ld apart */
    int relu;
    /* a backward that also sums the parameter gradients (Eq. 2; partial != NULL): the inputs x (B, T, I),
       the states h_1..h_T (B, T, H) and h_0; the gate gradients of each pair's last BPPSA_SLOTS steps in
       dh / di (rows ldg apart, zero padded: d of h W_hhᵀ and of x W_ihᵀ; di == dh where they are equal);
       the partial sums per pair of rows */
    int64_t inputs, ldg;
    const REAL *x, *states;
    REAL *dh, *di, *partial;
    /* a forward that projects the inputs itself (x != NULL, gi == NULL): gi_t = x_t W_ihᵀ + b_in per row,
       from w_in = W_ihᵀ (I x ld) and b_in (ld), into the per-row buffers gbuf */
    const REAL *w_in, *b_in;
    REAL* gbuf;
    int streams, written; /* the streams: read ones first, then `written` ones the step writes */
    const REAL* stream[8];
    int64_t stream_width[8];
} F(args);

/* Adds a (B, T, width) tensor that every step reads one row-slice of (NULL: skipped). */
static void F(add_stream)(F(args)* a, const REAL* tensor, int64_t width) {
    if (tensor) {
        a->stream[a->streams] = tensor;
        a->stream_width[a->streams++] = width;
    }
}

/* Adds a (B, T, width) tensor that every step writes one row-slice of (after all read ones). */
static void F(add_output)(F(args)* a, const REAL* tensor, int64_t width) {
    if (tensor) {
        F(add_stream)(a, tensor, width);
        a->written++;
    }
}

/* Batch-major tensors give each row its own stream per tensor (B x 6 streams), more than the hardware
   prefetcher follows: without this the sweeps wait on memory (measured ~2x slower). */
static inline void F(prefetch_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
#if defined(__GNUC__)
    for (int r = 0; r < rows; ++r)
        for (int s = 0; s < a->streams; ++s) {
            const char* first = (const char*)(a->stream[s] + ((b + r) * a->steps + t) * a->stream_width[s]);
            const char* last = first + a->stream_width[s] * (int64_t)sizeof(REAL) - 1;
            const uintptr_t line = (uintptr_t)63;
            first = (const char*)((uintptr_t)first & ~line);
            if (s < a->streams - a->written)
                for (const char* p = first; p <= last; p += 64) __builtin_prefetch(p, 0, 3);
            else /* for writing: the line arrives owned, so the store does not wait for it */
                for (const char* p = first; p <= last; p += 64) __builtin_prefetch(p, 1, 3);
        }
#else
    (void)a, (void)t, (void)b, (void)rows;
#endif
}

typedef void (*F(step_fn))(const F(args)*, int64_t t, int64_t b, int rows);

/* Runs step(a, t, b, rows) for every step t (last to first when reverse) and, within a step, for this
   thread's rows two at a time; rows are split over the threads, denormals flushed while it runs. */
static inline void F(sweep)(const F(args)* a, int64_t batch, int reverse, F(step_fn) step, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const unsigned saved = flush_denormals();
        int64_t lo, hi;
        thread_rows(batch, &lo, &hi);
        for (int64_t i = 0; i < a->steps; ++i) {
            const int64_t t = reverse ? a->steps - 1 - i : i;
            const int64_t ahead = reverse ? t - BPPSA_PREFETCH_STEPS : t + BPPSA_PREFETCH_STEPS;
            for (int64_t b = lo; b < hi; b += BPPSA_ROWS) {
                const int rows = hi - b < BPPSA_ROWS ? (int)(hi - b) : BPPSA_ROWS;
                if (ahead >= 0 && ahead < a->steps) F(prefetch_step)(a, ahead, b, rows);
                step(a, t, b, rows);
            }
        }
        restore_denormals(saved);
    }
}

/* Offset of row b, step t in a batch-major (B, T, width) tensor. */
#define AT(b, t, width) (((b) * a->steps + (t)) * (width))

/* The element-wise parts, one row of one step each; restrict parameters (not locals) let gcc vectorise
   them without run-time alias checks. */

static inline void F(add_into)(int64_t H, REAL* restrict g, const REAL* restrict direct) {
    for (int64_t c = 0; c < H; ++c) g[c] += direct[c];
}

/* The buffer row of `row`'s gate gradients at step t: each pair keeps its last BPPSA_SLOTS steps, slot s
   of row r at row 2 s + r of the pair's (2 BPPSA_SLOTS x ldg) block (steps counted from the sweep's start). */
static inline REAL* F(slot_row)(const F(args)* a, REAL* buffer, int64_t row, int64_t t) {
    const int64_t slot = (a->steps - 1 - t) % BPPSA_SLOTS;
    return buffer + ((row / 2) * 2 * BPPSA_SLOTS + 2 * slot + (row & 1)) * a->ldg;
}

/* acc[j][0 .. NB LANES) += Σ_q u[q][j] d[q][0 .. NB LANES) for JB rows j from j0, and with BIAS also
   bias[0 .. NB LANES) += Σ_q d[q] in the same pass over q: the (JB + BIAS) x NB accumulators stay in
   registers over all q (12 independent FMA chains for 4 x 3: enough to hide the FMA latency; fewer than four
   rows, e.g. a narrow input's I = 1, take the bias row's chains beside them). Either way each sum runs over q
   in order: the same bits as separate passes. BIAS is a constant, so gcc drops the bias code without it. */
#define BPPSA_TERMS(NAME, JB, NB, BIAS)                                                                      \
    static inline void F(NAME)(int m, const REAL* const* u, int64_t j0, const REAL* const* d, int64_t c0,    \
                               REAL* acc, int64_t ld, REAL* bias) {                                          \
        REAL s[JB + BIAS][NB * LANES];                                                                       \
        for (int r = 0; r < JB; ++r)                                                                         \
            for (int c = 0; c < NB * LANES; ++c) s[r][c] = acc[(j0 + r) * ld + c0 + c];                      \
        if (BIAS)                                                                                            \
            for (int c = 0; c < NB * LANES; ++c) s[JB + BIAS - 1][c] = bias[c0 + c];                         \
        for (int q = 0; q < m; ++q) {                                                                        \
            const REAL* restrict dq = d[q] + c0;                                                             \
            for (int r = 0; r < JB; ++r) {                                                                   \
                const REAL v = u[q][j0 + r];                                                                 \
                for (int c = 0; c < NB * LANES; ++c) s[r][c] += v * dq[c];                                   \
            }                                                                                                \
            if (BIAS)                                                                                        \
                for (int c = 0; c < NB * LANES; ++c) s[JB + BIAS - 1][c] += dq[c];                           \
        }                                                                                                    \
        for (int r = 0; r < JB; ++r)                                                                         \
            for (int c = 0; c < NB * LANES; ++c) acc[(j0 + r) * ld + c0 + c] = s[r][c];                      \
        if (BIAS)                                                                                            \
            for (int c = 0; c < NB * LANES; ++c) bias[c0 + c] = s[JB + BIAS - 1][c];                         \
    }
BPPSA_TERMS(terms_4_1, 4, 1, 0)
BPPSA_TERMS(terms_4_3, 4, 3, 0)
BPPSA_TERMS(terms_1_1, 1, 1, 0)
BPPSA_TERMS(terms_1_3, 1, 3, 0)
BPPSA_TERMS(terms_bias_0_1, 0, 1, 1)
BPPSA_TERMS(terms_bias_0_3, 0, 3, 1)
BPPSA_TERMS(terms_bias_1_1, 1, 1, 1)
BPPSA_TERMS(terms_bias_1_3, 1, 3, 1)
BPPSA_TERMS(terms_bias_2_1, 2, 1, 1)
BPPSA_TERMS(terms_bias_2_3, 2, 3, 1)
BPPSA_TERMS(terms_bias_3_1, 3, 1, 1)
BPPSA_TERMS(terms_bias_3_3, 3, 3, 1)
#undef BPPSA_TERMS

/* terms_bias_COUNT_NB for count < 4 rows and nb in {1, 3} vectors. */
static inline void F(terms_bias)(int64_t count, int64_t nb, int m, const REAL* const* u, const REAL* const* d,
                                 int64_t c0, REAL* acc, int64_t ld, REAL* bias) {
    switch (count * 4 + nb) {
        case 1: F(terms_bias_0_1)(m, u, 0, d, c0, acc, ld, bias); break;
        case 3: F(terms_bias_0_3)(m, u, 0, d, c0, acc, ld, bias); break;
        case 5: F(terms_bias_1_1)(m, u, 0, d, c0, acc, ld, bias); break;
        case 7: F(terms_bias_1_3)(m, u, 0, d, c0, acc, ld, bias); break;
        case 9: F(terms_bias_2_1)(m, u, 0, d, c0, acc, ld, bias); break;
        case 11: F(terms_bias_2_3)(m, u, 0, d, c0, acc, ld, bias); break;
        case 13: F(terms_bias_3_1)(m, u, 0, d, c0, acc, ld, bias); break;
        default: F(terms_bias_3_3)(m, u, 0, d, c0, acc, ld, bias); break;
    }
}

/* acc[j] += Σ_q u_q[j] D[q] for j < count and (unless bias is NULL) bias += Σ_q D[q], over the buffered rows
   q < m that are present (u_q NULL: a missing row, whose D row is zero). */
static void F(add_terms)(const F(args)* a, int64_t count, const REAL* const* u, int m, const REAL* d, REAL* acc,
                         REAL* bias) {
    const int64_t n = a->ldg;
    const REAL *us[2 * BPPSA_SLOTS], *ds[2 * BPPSA_SLOTS];
    int k = 0;
    for (int q = 0; q < m; ++q)
        if (u[q]) us[k] = u[q], ds[k++] = d + q * n;
    /* blocks of 3 vectors, then single ones: gcc vectorised a 2-vector block across rows with shuffles and
       spills (measured 1.5-2.5x slower sums wherever n / LANES leaves 2, e.g. RNN H=40 or 64, GRU H=20) */
    const int fused = bias && count < 4; /* the bias in the rows' pass (terms_bias) */
    for (int64_t c0 = 0, nb; c0 < n; c0 += nb * LANES) {
        nb = (n - c0) / LANES >= 3 ? 3 : 1;
        if (fused) {
            F(terms_bias)(count, nb, k, us, ds, c0, acc, n, bias);
            continue;
        }
        int64_t j = 0;
        for (; j + 4 <= count; j += 4) {
            if (nb == 1) F(terms_4_1)(k, us, j, ds, c0, acc, n, NULL);
            else F(terms_4_3)(k, us, j, ds, c0, acc, n, NULL);
        }
        for (; j < count; ++j) {
            if (nb == 1) F(terms_1_1)(k, us, j, ds, c0, acc, n, NULL);
            else F(terms_1_3)(k, us, j, ds, c0, acc, n, NULL);
        }
    }
    if (bias && !fused)
        for (int q = 0; q < k; ++q) F(add_into)(n, bias, ds[q]);
}

/* Eq. 2 inside the sweep: every BPPSA_SLOTS steps (and at the last), the pair's buffered step terms of every
   parameter gradient go into the pair's partial sums, (H + I + 2) rows of ldg: h_prev ⊗ d_gh (W_hhᵀ),
   x ⊗ d_gi (W_ihᵀ), d_gi (b_ih), d_gh (b_hh). Kept in the sweep, the gate gradients never go to memory;
   buffered, each partial sum is read and written once per BPPSA_SLOTS steps, not every step. */
static inline void F(accumulate_pair)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden, I = a->inputs, n = a->ldg, slot = (a->steps - 1 - t) % BPPSA_SLOTS;
    if (slot != BPPSA_SLOTS - 1 && t != 0) return;
    const int m = 2 * (int)(slot + 1);
    const REAL *hp[2 * BPPSA_SLOTS], *xs[2 * BPPSA_SLOTS];
    for (int q = 0; q < m; ++q) {
        const int64_t row = b + (q & 1), step = t + slot - q / 2; /* slot s holds step t + slot - s */
        const int present = (q & 1) < rows;
        hp[q] = !present ? NULL : step ? a->states + AT(row, step - 1, H) : a->h0 + row * H;
        xs[q] = present ? a->x + AT(row, step, I) : NULL;
    }
    const int64_t p = b / 2;
    REAL* acc = a->partial + p * (H + I + 2) * n;
    const int64_t block = p * 2 * BPPSA_SLOTS * n;
    /* one buffer for d_gh and d_gi (RNN, LSTM): b_hh's sums are b_ih's, copied when the partials are reduced */
    F(add_terms)(a, H, hp, m, a->dh + block, acc, a->di == a->dh ? NULL : acc + (H + I + 1) * n);
    F(add_terms)(a, I, xs, m, a->di + block, acc + H * n, acc + (H + I) * n);
}

/* accumulate_pair for each pair of a step's rows (rows from b, b even). */
static inline void F(accumulate)(const F(args)* a, int64_t t, int64_t b, int rows) {
    for (int r = 0; r < rows; r += 2) F(accumulate_pair)(a, t, b + r, rows - r < 2 ? rows - r : 2);
}

/* Where a backward step puts row r's gate gradients: its buffer slot (summed into the partials, copied to
   `tensor` when one is wanted) or straight into `tensor` (width w). */
static inline REAL* F(gate_row)(const F(args)* a, REAL* buffer, REAL* tensor, int64_t b, int64_t t, int64_t w) {
    return a->partial ? F(slot_row)(a, buffer, b, t) : tensor + AT(b, t, w);
}

/* Copies the buffered gate gradients of the rows to `tensor` (width w) when the caller wants them too. */
static inline void F(keep_rows)(const F(args)* a, REAL* buffer, REAL* tensor, int64_t b, int64_t t, int rows,
                                int64_t w) {
    if (a->partial && tensor)
        for (int r = 0; r < rows; ++r)
            memcpy(tensor + AT(b + r, t, w), F(slot_row)(a, buffer, b + r, t), sizeof(REAL) * (size_t)w);
}

/* The input projections gi_t of the rows: rows of the given gi, or computed here from x_t (see F(args)). */
static inline void F(input_rows)(const F(args)* a, int64_t t, int64_t b, int rows, int64_t width, const REAL** gi) {
    if (!a->x) {
        for (int r = 0; r < rows; ++r) gi[r] = a->gi + AT(b + r, t, width);
        return;
    }
    const REAL* xs[BPPSA_ROWS] = {NULL};
    REAL* ys[BPPSA_ROWS] = {NULL};
    for (int r = 0; r < rows; ++r) xs[r] = a->x + AT(b + r, t, a->inputs), ys[r] = a->gbuf + (b + r) * a->ld;
    F(product)(rows, xs, a->inputs, a->w_in, a->ld, a->ld, ys, a->scratch + b * a->ld);
    for (int r = 0; r < rows; ++r) {
        F(add_into)(width, ys[r], a->b_in);
        gi[r] = ys[r];
    }
}

/* The common start of a forward step for its rows: prev = h_{t-1}, gh = h_{t-1} W_hhᵀ (in tmp) and gi = the
   input projections (width wide). */
typedef struct {
    const REAL* prev[BPPSA_ROWS];
    REAL* gh[BPPSA_ROWS];
    const REAL* gi[BPPSA_ROWS];
} F(step_rows);

static inline F(step_rows) F(forward_rows)(const F(args)* a, int64_t t, int64_t b, int rows, int64_t width) {
    const int64_t H = a->hidden;
    F(step_rows) s = {{NULL}, {NULL}, {NULL}};
    for (int r = 0; r < rows; ++r) {
        s.prev[r] = t ? a->out + AT(b + r, t - 1, H) : a->h0 + (b + r) * H;
        s.gh[r] = a->tmp + (b + r) * a->ld;
    }
    F(input_rows)(a, t, b, rows, width, s.gi);
    F(product)(rows, s.prev, H, a->weight, a->ld, a->ld, s.gh, a->scratch + b * a->ld);
    return s;
}

/* ---- Elman RNN --------------------------------------------------------------------------------- */

/* h = f(gi + gh + b_hh). The backward needs f' only, which is a function of h (no factor is stored). */
static inline void F(rnn_activate)(int64_t H, int relu, const REAL* restrict gi, const REAL* restrict gh,
                                   const REAL* restrict bias, REAL* restrict h) {
    if (relu) {
        for (int64_t c = 0; c < H; ++c) {
            const REAL pre = gi[c] + (gh[c] + bias[c]);
            h[c] = pre <= 0 ? 0 : pre;
        }
    } else {
        for (int64_t c = 0; c < H; ++c) h[c] = F(tanh)(gi[c] + (gh[c] + bias[c]));
    }
}

/* d_a = g ⊙ f'(h): 1 - h² for tanh; for relu torch's threshold_backward, a select: 0 where h <= 0 even for
   a NaN g, else g (a NaN h passes the gradient). */
static inline void F(rnn_gate_grad)(int64_t H, int relu, const REAL* restrict g, const REAL* restrict h,
                                    REAL* restrict d) {
    if (relu)
        for (int64_t c = 0; c < H; ++c) d[c] = h[c] <= 0 ? 0 : g[c];
    else
        for (int64_t c = 0; c < H; ++c) d[c] = g[c] * (1 - h[c] * h[c]);
}

/* h_t = f(gi_t + h_{t-1} W_hhᵀ + b_hh): out = h. */
static inline void F(rnn_forward_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden;
    const F(step_rows) s = F(forward_rows)(a, t, b, rows, H);
    for (int r = 0; r < rows; ++r)
        F(rnn_activate)(H, a->relu, s.gi[r], s.gh[r], a->bias, a->out + AT(b + r, t, H));
}

/* d_a_t = g_t ⊙ f'(h_t) (out; h_t in scales), g_{t-1} = d_a_t W_hh + grad_out[t - 1]; g holds g_t per row (ld apart). */
static inline void F(rnn_backward_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden;
    const REAL* x[BPPSA_ROWS] = {NULL};
    REAL* y[BPPSA_ROWS] = {NULL};
    for (int r = 0; r < rows; ++r) {
        REAL* d = F(gate_row)(a, a->dh, a->out, b + r, t, H);
        y[r] = a->g + (b + r) * a->ld;
        F(rnn_gate_grad)(H, a->relu, y[r], a->scales + AT(b + r, t, H), d);
        x[r] = d;
    }
    F(keep_rows)(a, a->dh, a->out, b, t, rows, H);
    if (a->partial) F(accumulate)(a, t, b, rows);
    F(product)(rows, x, H, a->weight, a->ld, a->ld, y, a->scratch + b * a->ld);
    if (t > 0 && a->grad_out)
        for (int r = 0; r < rows; ++r) F(add_into)(H, y[r], a->grad_out + AT(b + r, t - 1, H));
}

/* ---- GRU --------------------------------------------------------------------------------------- */

/* r, z = σ(gi + gh + b_hh); n = tanh(gi_n + r (gh_n + b_hn)); h = n + z (h_prev - n) (torch's order);
   dn = (1-z)(1-n²); scales = [dn gh_n r(1-r), (h_prev - n) z(1-z), dn r]. */
static inline void F(gru_activate)(int64_t H, const REAL* restrict gi, const REAL* restrict gh,
                                   const REAL* restrict bias, const REAL* restrict prev, REAL* restrict h,
                                   REAL* restrict scales, REAL* restrict zs, REAL* restrict dns) {
    for (int64_t c = 0; c < H; ++c) {
        const REAL gh_n = gh[2 * H + c] + bias[2 * H + c];
        const REAL reset = F(sigmoid)(gi[c] + (gh[c] + bias[c]));
        const REAL z = F(sigmoid)(gi[H + c] + (gh[H + c] + bias[H + c]));
        const REAL n = F(tanh)(gi[2 * H + c] + reset * gh_n);
        const REAL diff = prev[c] - n;
        const REAL dn = (1 - z) * (1 - n * n);
        h[c] = n + z * diff;
        scales[c] = dn * gh_n * (reset * (1 - reset));
        scales[H + c] = diff * (z * (1 - z));
        scales[2 * H + c] = dn * reset;
        zs[c] = z;
        dns[c] = dn;
    }
}

/* d_gh = tile(g, 3) ⊙ scales; d_gi = d_gh but g ⊙ dn in the n block. */
static inline void F(gru_gate_grad)(int64_t H, const REAL* restrict g, const REAL* restrict scales,
                                    const REAL* restrict dn, REAL* restrict d_gh, REAL* restrict d_gi) {
    for (int64_t c = 0; c < H; ++c) {
        const REAL gc = g[c];
        d_gh[c] = d_gi[c] = gc * scales[c];
        d_gh[H + c] = d_gi[H + c] = gc * scales[H + c];
        d_gh[2 * H + c] = gc * scales[2 * H + c];
        d_gi[2 * H + c] = gc * dn[c];
    }
}

/* g_{t-1} = g_t ⊙ z + (d_gh W_hh) (+ the direct gradient when there is one). */
static inline void F(gru_state_grad)(int64_t H, REAL* restrict g, const REAL* restrict z,
                                     const REAL* restrict product, const REAL* restrict direct) {
    if (direct)
        for (int64_t c = 0; c < H; ++c) g[c] = g[c] * z[c] + product[c] + direct[c];
    else
        for (int64_t c = 0; c < H; ++c) g[c] = g[c] * z[c] + product[c];
}

/* gh = h W_hhᵀ, then gru_activate: out = h, second = scales, third = z, fourth = dn. */
static inline void F(gru_forward_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden;
    const F(step_rows) s = F(forward_rows)(a, t, b, rows, 3 * H);
    for (int r = 0; r < rows; ++r)
        F(gru_activate)(H, s.gi[r], s.gh[r], a->bias, s.prev[r], a->out + AT(b + r, t, H),
                        a->second + AT(b + r, t, 3 * H), a->third + AT(b + r, t, H), a->fourth + AT(b + r, t, H));
}

/* out = d_gh, second = d_gi, then g_{t-1} = g_t ⊙ z + d_gh W_hh + grad_out[t - 1]. */
static inline void F(gru_backward_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden;
    const REAL* x[BPPSA_ROWS] = {NULL};
    REAL* y[BPPSA_ROWS] = {NULL};
    for (int r = 0; r < rows; ++r) {
        REAL* d_gh = F(gate_row)(a, a->dh, a->out, b + r, t, 3 * H);
        F(gru_gate_grad)(H, a->g + (b + r) * a->ld, a->scales + AT(b + r, t, 3 * H), a->dn + AT(b + r, t, H),
                         d_gh, F(gate_row)(a, a->di, a->second, b + r, t, 3 * H));
        x[r] = d_gh;
        y[r] = a->tmp + (b + r) * a->ld;
    }
    F(keep_rows)(a, a->dh, a->out, b, t, rows, 3 * H);
    F(keep_rows)(a, a->di, a->second, b, t, rows, 3 * H);
    if (a->partial) F(accumulate)(a, t, b, rows);
    F(product)(rows, x, 3 * H, a->weight, a->ld, a->ld, y, a->scratch + b * a->ld);
    for (int r = 0; r < rows; ++r)
        F(gru_state_grad)(H, a->g + (b + r) * a->ld, a->z + AT(b + r, t, H), y[r],
                          t > 0 && a->grad_out ? a->grad_out + AT(b + r, t - 1, H) : NULL);
}

/* ---- LSTM -------------------------------------------------------------------------------------- */

/* i, f, o = σ(gi + gh), g = tanh(gi + gh); c = f c_prev + i g; h = o tanh(c); gates = [i, f, g, o]. */
static inline void F(lstm_activate)(int64_t H, const REAL* restrict gi, const REAL* restrict gh,
                                    const REAL* restrict c_prev, REAL* restrict h, REAL* restrict cell,
                                    REAL* restrict gates) {
    for (int64_t c = 0; c < H; ++c) {
        const REAL i = F(sigmoid)(gi[c] + gh[c]);
        const REAL f = F(sigmoid)(gi[H + c] + gh[H + c]);
        const REAL g = F(tanh)(gi[2 * H + c] + gh[2 * H + c]);
        const REAL o = F(sigmoid)(gi[3 * H + c] + gh[3 * H + c]);
        const REAL cn = f * c_prev[c] + i * g;
        cell[c] = cn;
        h[c] = o * F(tanh)(cn);
        gates[c] = i;
        gates[H + c] = f;
        gates[2 * H + c] = g;
        gates[3 * H + c] = o;
    }
}

/* gc_tot = gc + gh o (1 - tanh² c); d = [gc_tot g i(1-i), gc_tot c_prev f(1-f), gc_tot i (1-g²),
   gh tanh(c) o(1-o)]; gc becomes gc_tot f (the gradient of c_prev). */
static inline void F(lstm_gate_grad)(int64_t H, const REAL* restrict gates, const REAL* restrict cell,
                                     const REAL* restrict c_prev, const REAL* restrict gh, REAL* restrict gc,
                                     REAL* restrict d) {
    for (int64_t c = 0; c < H; ++c) {
        const REAL i = gates[c], f = gates[H + c], g = gates[2 * H + c], o = gates[3 * H + c];
        const REAL tc = F(tanh)(cell[c]);
        const REAL total = gc[c] + gh[c] * o * (1 - tc * tc);
        d[c] = total * g * (i * (1 - i));
        d[H + c] = total * c_prev[c] * (f * (1 - f));
        d[2 * H + c] = total * i * (1 - g * g);
        d[3 * H + c] = gh[c] * tc * (o * (1 - o));
        gc[c] = total * f;
    }
}

/* pre = gi + h W_hhᵀ, then lstm_activate: out = h, second = cells c, third = gates. */
static inline void F(lstm_forward_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden;
    const F(step_rows) s = F(forward_rows)(a, t, b, rows, 4 * H);
    for (int r = 0; r < rows; ++r)
        F(lstm_activate)(H, s.gi[r], s.gh[r],
                         t ? a->second + AT(b + r, t - 1, H) : a->c0 + (b + r) * H, a->out + AT(b + r, t, H),
                         a->second + AT(b + r, t, H), a->third + AT(b + r, t, 4 * H));
}

/* out = d_gates, then gh_{t-1} = d_gates W_hh + grad_out[t - 1], gc_{t-1} = gc_tot f; g / gc hold gh_t /
   gc_t per row; scales = the cells. */
static inline void F(lstm_backward_step)(const F(args)* a, int64_t t, int64_t b, int rows) {
    const int64_t H = a->hidden;
    const REAL* x[BPPSA_ROWS] = {NULL};
    REAL* y[BPPSA_ROWS] = {NULL};
    for (int r = 0; r < rows; ++r) {
        REAL* d = F(gate_row)(a, a->dh, a->out, b + r, t, 4 * H);
        y[r] = a->g + (b + r) * a->ld;
        F(lstm_gate_grad)(H, a->gates + AT(b + r, t, 4 * H), a->scales + AT(b + r, t, H),
                          t ? a->scales + AT(b + r, t - 1, H) : a->c0 + (b + r) * H, y[r],
                          a->gc + (b + r) * a->ld, d);
        x[r] = d;
    }
    F(keep_rows)(a, a->dh, a->out, b, t, rows, 4 * H);
    if (a->partial) F(accumulate)(a, t, b, rows);
    F(product)(rows, x, 4 * H, a->weight, a->ld, a->ld, y, a->scratch + b * a->ld);
    if (t > 0 && a->grad_out)
        for (int r = 0; r < rows; ++r) F(add_into)(H, y[r], a->grad_out + AT(b + r, t - 1, H));
}

#undef AT

/* ---- exported entry points ----------------------------------------------------------------------
   Each allocates its padded weight (and bias / per-row buffers), runs the sweep, frees them. */

/* The per-row state buffers (B x ld, zeroed) and the padded weight/bias; 1 if any allocation failed. */
static int F(allocate)(F(args)* a, int64_t batch, REAL** weight, REAL** bias, REAL** tmp, REAL** g, REAL** gc) {
    *tmp = (REAL*)calloc((size_t)(2 * batch * a->ld) + 1, sizeof(REAL)); /* tmp, then scratch */
    *g = (REAL*)calloc((size_t)(batch * a->ld) + 1, sizeof(REAL));
    *gc = (REAL*)calloc((size_t)(batch * a->ld) + 1, sizeof(REAL));
    *bias = (REAL*)calloc((size_t)a->ld + 1, sizeof(REAL));
    a->tmp = *tmp, a->scratch = *tmp + batch * a->ld, a->g = *g, a->gc = *gc, a->bias = *bias, a->weight = *weight;
    return !(*weight && *bias && *tmp && *g && *gc);
}

static void F(release)(REAL* weight, REAL* bias, REAL* tmp, REAL* g, REAL* gc) {
    free(weight), free(bias), free(tmp), free(g), free(gc);
}

/* Runs a forward: W_hh (G H x H) transposed into an (H x ld) weight, b_hh (G H or NULL) padded; with
   x != NULL the input projection from w_ih (G H x I) and b_in (G H or NULL). */
static int F(forward)(F(args)* a, int64_t batch, int64_t gates, const REAL* w_hh, const REAL* b_hh,
                      int64_t inputs, const REAL* x, const REAL* w_ih, const REAL* b_in, F(step_fn) step,
                      int threads) {
    const int64_t H = a->hidden;
    a->ld = F(padded_width)(gates * H);
    REAL *weight = F(transposed)(w_hh, gates * H, H, a->ld), *bias, *tmp, *g, *gc, *w_in = NULL, *bias_in = NULL;
    REAL* gbuf = NULL;
    if (x) {
        a->x = x, a->inputs = inputs;
        w_in = F(transposed)(w_ih, gates * H, inputs, a->ld);
        bias_in = (REAL*)calloc((size_t)a->ld, sizeof(REAL));
        gbuf = (REAL*)calloc((size_t)(batch * a->ld) + 1, sizeof(REAL));
        a->w_in = w_in, a->b_in = bias_in, a->gbuf = gbuf;
        if (bias_in && b_in) memcpy(bias_in, b_in, sizeof(REAL) * (size_t)(gates * H));
    }
    if (F(allocate)(a, batch, &weight, &bias, &tmp, &g, &gc) || (x && !(w_in && bias_in && gbuf))) {
        F(release)(weight, bias, tmp, g, gc);
        free(w_in), free(bias_in), free(gbuf);
        return 1;
    }
    if (b_hh) memcpy(bias, b_hh, sizeof(REAL) * (size_t)(gates * H));
    F(sweep)(a, batch, 0, step, threads);
    F(release)(weight, bias, tmp, g, gc);
    free(w_in), free(bias_in), free(gbuf);
    return 0;
}

/* What a backward needs to sum the parameter gradients in its sweep (grad_w_hh == NULL: it does not):
   x (B, T, I), the forward's out (B, T, H) and h0, and where the sums go, laid out as torch's parameters
   ((G H, I), (G H, H), (G H), (G H); the biases may be NULL). */
typedef struct {
    int64_t inputs;
    const REAL *x, *out, *h0;
    REAL *grad_w_ih, *grad_w_hh, *grad_b_ih, *grad_b_hh;
} F(eq2);

/* The sums of the pairs' partials (in pair order: the same result for any thread count), transposed into
   torch's layout. */
static void F(reduce_partials)(const F(args)* a, const F(eq2)* e, int64_t batch, int64_t gh) {
    const int64_t H = a->hidden, I = a->inputs, n = a->ldg, block = (H + I + 2) * n, pairs = (batch + 1) / 2;
    for (int64_t j = 0; j < H + I + 2; ++j)
        for (int64_t c = 0; c < gh; ++c) {
            const int64_t row = j == H + I + 1 && a->di == a->dh ? H + I : j; /* b_hh's sums are b_ih's */
            REAL sum = 0;
            for (int64_t p = 0; p < pairs; ++p) sum += a->partial[p * block + row * n + c];
            if (j < H) e->grad_w_hh[c * H + j] = sum;
            else if (j < H + I) e->grad_w_ih[c * I + (j - H)] = sum;
            else if (j == H + I && e->grad_b_ih) e->grad_b_ih[c] = sum;
            else if (j == H + I + 1 && e->grad_b_hh) e->grad_b_hh[c] = sum;
        }
}

/* Runs a backward: W_hh (G H x H) padded to (G H x ld); g starts as grad_out[:, T-1] + grad_h (either may
   be NULL), gc as grad_c (or 0); on return g0 / gc0 (either may be NULL) hold the gradients of h_0 / c_0,
   and with e->grad_w_hh the parameter gradients are in e. */
static int F(backward)(F(args)* a, int64_t batch, int64_t gates, const REAL* w_hh, const REAL* grad_c,
                       REAL* g0, REAL* gc0, const F(eq2)* e, int separate_input_grads, F(step_fn) step,
                       int threads) {
    const int64_t H = a->hidden;
    a->ld = F(padded_width)(H);
    REAL *weight = F(padded)(w_hh, gates * H, H, a->ld), *bias, *tmp, *g, *gc, *dh = NULL, *di = NULL;
    REAL* partial = NULL;
    if (e->grad_w_hh) {
        const int64_t pairs = (batch + 1) / 2, I = e->inputs;
        a->inputs = I, a->x = e->x, a->states = e->out;
        a->ldg = F(padded_width)(gates * H);
        const size_t buffers = (size_t)(pairs * 2 * BPPSA_SLOTS * a->ldg) + 1;
        dh = (REAL*)calloc(buffers, sizeof(REAL));
        di = separate_input_grads ? (REAL*)calloc(buffers, sizeof(REAL)) : dh;
        partial = (REAL*)calloc((size_t)(pairs * (H + I + 2) * a->ldg) + 1, sizeof(REAL));
        a->dh = dh, a->di = di, a->partial = partial;
        /* read streams go before the written ones in the prefetch list */
        for (int s = a->streams; s > a->streams - a->written; --s)
            a->stream[s + 1] = a->stream[s - 1], a->stream_width[s + 1] = a->stream_width[s - 1];
        a->stream[a->streams - a->written] = e->x, a->stream_width[a->streams - a->written] = e->inputs;
        a->stream[a->streams - a->written + 1] = e->out, a->stream_width[a->streams - a->written + 1] = H;
        a->streams += 2;
    }
    const int failed =
        F(allocate)(a, batch, &weight, &bias, &tmp, &g, &gc) || (e->grad_w_hh && !(dh && di && partial));
    if (failed) {
        F(release)(weight, bias, tmp, g, gc);
        free(partial), free(dh);
        if (di != dh) free(di);
        return 1;
    }
    for (int64_t b = 0; b < batch; ++b) {
        if (a->grad_out && a->steps > 0)
            memcpy(g + b * a->ld, a->grad_out + (b * a->steps + a->steps - 1) * H, sizeof(REAL) * (size_t)H);
        if (a->grad_h) F(add_into)(H, g + b * a->ld, a->grad_h + b * H);
        if (grad_c) memcpy(gc + b * a->ld, grad_c + b * H, sizeof(REAL) * (size_t)H);
    }
    F(sweep)(a, batch, 1, step, threads);
    for (int64_t b = 0; b < batch; ++b) {
        if (g0) memcpy(g0 + b * H, g + b * a->ld, sizeof(REAL) * (size_t)H);
        if (gc0) memcpy(gc0 + b * H, gc + b * a->ld, sizeof(REAL) * (size_t)H);
    }
    if (partial) F(reduce_partials)(a, e, batch, gates * H);
    F(release)(weight, bias, tmp, g, gc);
    free(partial), free(dh);
    if (di != dh) free(di);
    return 0;
}

/* The forwards' common tail of arguments: x (B, T, I) with w_ih and b_in (see F(forward)), or x = NULL
   and the given gi. */
#define BPPSA_PROJECTION_ARGS int64_t inputs, const REAL *x, const REAL *w_ih, const REAL *b_in
#define BPPSA_INPUT_STREAM(width) (x ? F(add_stream)(&a, x, inputs) : F(add_stream)(&a, gi, width))

int F(bppsa_rnn_forward)(int64_t batch, int64_t steps, int64_t hidden, const REAL* gi, const REAL* w_hh,
                         const REAL* b_hh, const REAL* h0, int relu, REAL* out, BPPSA_PROJECTION_ARGS,
                         int threads) {
    F(args) a = {0};
    a.steps = steps, a.hidden = hidden, a.gi = gi, a.h0 = h0, a.relu = relu, a.out = out;
    BPPSA_INPUT_STREAM(hidden), F(add_output)(&a, out, hidden);
    return F(forward)(&a, batch, 1, w_hh, b_hh, inputs, x, w_ih, b_in, F(rnn_forward_step), threads);
}

/* The backwards' common tail of arguments: the eq2 fields (grad_w_hh NULL: no parameter gradients). */
#define BPPSA_EQ2_ARGS                                                                                     \
    int64_t inputs, const REAL *x, const REAL *out, const REAL *h0, REAL *grad_w_ih, REAL *grad_w_hh,      \
        REAL *grad_b_ih, REAL *grad_b_hh
#define BPPSA_EQ2 {inputs, x, out, h0, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh}

/* states: the forward's out, h_1..h_T; d_a (NULL: not wanted, with the parameter gradients) */
int F(bppsa_rnn_backward)(int64_t batch, int64_t steps, int64_t hidden, const REAL* states, const REAL* w_hh,
                          const REAL* grad_out, const REAL* grad_h, int relu, REAL* d_a, REAL* g0, BPPSA_EQ2_ARGS,
                          int threads) {
    F(args) a = {0};
    const F(eq2) e = BPPSA_EQ2;
    a.steps = steps, a.hidden = hidden, a.scales = states, a.grad_out = grad_out, a.relu = relu, a.out = d_a;
    a.grad_h = grad_h;
    a.h0 = h0;
    if (!grad_w_hh) F(add_stream)(&a, states, hidden); /* with the sums the backward streams out (= states) */
    F(add_stream)(&a, grad_out, hidden), F(add_output)(&a, d_a, hidden);
    return F(backward)(&a, batch, 1, w_hh, NULL, g0, NULL, &e, 0, F(rnn_backward_step), threads);
}

int F(bppsa_gru_forward)(int64_t batch, int64_t steps, int64_t hidden, const REAL* gi, const REAL* w_hh,
                         const REAL* b_hh, const REAL* h0, REAL* out, REAL* scales, REAL* z, REAL* dn,
                         BPPSA_PROJECTION_ARGS, int threads) {
    F(args) a = {0};
    a.steps = steps, a.hidden = hidden, a.gi = gi, a.h0 = h0;
    a.out = out, a.second = scales, a.third = z, a.fourth = dn;
    BPPSA_INPUT_STREAM(3 * hidden), F(add_output)(&a, out, hidden), F(add_output)(&a, scales, 3 * hidden);
    F(add_output)(&a, z, hidden), F(add_output)(&a, dn, hidden);
    return F(forward)(&a, batch, 3, w_hh, b_hh, inputs, x, w_ih, b_in, F(gru_forward_step), threads);
}

/* d_gh, d_gi (either NULL: not wanted, with the parameter gradients) */
int F(bppsa_gru_backward)(int64_t batch, int64_t steps, int64_t hidden, const REAL* scales, const REAL* z,
                          const REAL* dn, const REAL* w_hh, const REAL* grad_out, const REAL* grad_h, REAL* d_gh,
                          REAL* d_gi, REAL* g0, BPPSA_EQ2_ARGS, int threads) {
    F(args) a = {0};
    const F(eq2) e = BPPSA_EQ2;
    a.steps = steps, a.hidden = hidden, a.scales = scales, a.z = z, a.dn = dn, a.grad_out = grad_out;
    a.grad_h = grad_h;
    a.out = d_gh, a.second = d_gi, a.h0 = h0;
    F(add_stream)(&a, scales, 3 * hidden), F(add_stream)(&a, z, hidden), F(add_stream)(&a, dn, hidden);
    F(add_stream)(&a, grad_out, hidden), F(add_output)(&a, d_gh, 3 * hidden), F(add_output)(&a, d_gi, 3 * hidden);
    return F(backward)(&a, batch, 3, w_hh, NULL, g0, NULL, &e, 1, F(gru_backward_step), threads);
}

int F(bppsa_lstm_forward)(int64_t batch, int64_t steps, int64_t hidden, const REAL* gi, const REAL* w_hh,
                          const REAL* h0, const REAL* c0, REAL* out, REAL* cells, REAL* gates,
                          BPPSA_PROJECTION_ARGS, int threads) {
    F(args) a = {0};
    a.steps = steps, a.hidden = hidden, a.gi = gi, a.h0 = h0, a.c0 = c0;
    a.out = out, a.second = cells, a.third = gates;
    BPPSA_INPUT_STREAM(4 * hidden), F(add_output)(&a, out, hidden), F(add_output)(&a, cells, hidden);
    F(add_output)(&a, gates, 4 * hidden);
    return F(forward)(&a, batch, 4, w_hh, NULL, inputs, x, w_ih, b_in, F(lstm_forward_step), threads);
}

#undef BPPSA_PROJECTION_ARGS
#undef BPPSA_INPUT_STREAM

/* d_gates (NULL: not wanted, with the parameter gradients) */
int F(bppsa_lstm_backward)(int64_t batch, int64_t steps, int64_t hidden, const REAL* gates, const REAL* cells,
                           const REAL* c0, const REAL* w_hh, const REAL* grad_out, const REAL* grad_h,
                           const REAL* grad_cn, REAL* d_gates, REAL* gh0, REAL* gc0, BPPSA_EQ2_ARGS, int threads) {
    F(args) a = {0};
    const F(eq2) e = BPPSA_EQ2;
    a.steps = steps, a.hidden = hidden, a.gates = gates, a.scales = cells, a.c0 = c0, a.grad_out = grad_out;
    a.grad_h = grad_h;
    a.out = d_gates, a.h0 = h0;
    F(add_stream)(&a, gates, 4 * hidden), F(add_stream)(&a, cells, hidden), F(add_stream)(&a, grad_out, hidden);
    F(add_output)(&a, d_gates, 4 * hidden);
    return F(backward)(&a, batch, 4, w_hh, grad_cn, gh0, gc0, &e, 0, F(lstm_backward_step), threads);
}

#undef BPPSA_EQ2_ARGS
#undef BPPSA_EQ2

#undef F
