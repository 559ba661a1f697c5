/* The inner parts of the float32 kernel (built with -mavx2 -mfma -DFLOAT32, and -mavx512f where the CPU has it),
   included by cpu_attention.c: a block of query rows attended to a chunk of keys and values, and the merges. Keys,
   values, queries and outputs are float32 (`elem`), and so is every product. Its vectors are AVX2's 8 floats or
   AVX-512's 16 (`LANES`, below): each output is the same sum of the same products in the same order either way, so
   both builds give the same bits, the wider in fewer instructions.

   Both products are one register-blocked kernel, C[rows x LANES vecs] = A[rows x depth] B[depth x LANES vecs] in at
   most SCORE_SUMS or OUTPUT_SUMS accumulators (below), each row of B loaded once for the rows and each element of A
   broadcast once for the vectors:
   - the scores come out transposed, a row a key: the chunk's keys (A, read in place, a few at a time against up to
     3 vectors of query rows) times the block's queries transposed (B, laid out once a block), so no key is moved;
   - each query row's softmax runs down its column, LANES rows to a vector, in place;
   - the outputs are the probabilities (A, down their columns) times the values (B, laid out 16 columns at a time as
     the chunk is taken).
   Transposing the keys instead (as this kernel did) cost a pass over each chunk that the products then did not
   hide: on SmolLM2's shapes over a 4k prefix, 2 cores of an AMD EPYC (Zen 3), this way attends one decoding stream
   in two thirds to four fifths of the time, 8 in about four fifths, 16 in about the same, and 432 query rows (16
   prompts of 27 tokens) 3 to 10 % slower (`benchmarks/attention_bench.py`; README, "Benchmarks"). */

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
typedef __mmask16 lanes_mask;
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec x) { _mm512_storeu_ps(p, x); }
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpower(vec n) {  /* 2^n for integral n in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* Which of LANES rows no longer see key k: the rows' last keys in `last`. */
static inline lanes_mask unseen(int64_t k, const int32_t *last) {
    return _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)k), _mm512_loadu_si512(last));
}
static inline vec where_unseen(lanes_mask m, vec x, vec to) { return _mm512_mask_blend_ps(m, x, to); }
static inline vec zero_where(lanes_mask m, vec x) { return _mm512_maskz_mov_ps((lanes_mask)~m, x); }
static inline vec zero_where_none(vec top, vec x) {  /* x where top is not minus infinity, else 0 */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(top, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), x);
}

static inline void transpose(vec r[LANES]) {  /* 16 rows of 16 floats, in place */
    __m512i bits[16];
    for (int i = 0; i < 16; i++) bits[i] = _mm512_castps_si512(r[i]);
    transpose16(bits);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(bits[i]);
}
#else
#define LANES 8
typedef __m256 vec;
typedef __m256 lanes_mask;  /* all ones in the lanes it holds */
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec x) { _mm256_storeu_ps(p, x); }
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpower(vec n) {  /* 2^n for integral n in [-126, 127] */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline lanes_mask unseen(int64_t k, const int32_t *last) {
    const __m256i lasts = _mm256_loadu_si256((const __m256i *)last);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)k), lasts));
}
static inline vec where_unseen(lanes_mask m, vec x, vec to) { return _mm256_blendv_ps(x, to, m); }
static inline vec zero_where(lanes_mask m, vec x) { return _mm256_andnot_ps(m, x); }
static inline vec zero_where_none(vec top, vec x) {
    return _mm256_and_ps(_mm256_cmp_ps(top, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ), x);
}

static inline void transpose(vec r[LANES]) {  /* 8 rows of 8 floats, in place */
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);  /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);  /* a0 b0 c0 d0 | a4 b4 c4 d4 */
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);  /* column i of the 8 rows */
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}
#endif

int prefixgate_request_amx(void) { return 0; }
static void configure_tiles(void) {}
static void release_tiles(void) {}

/* The sums a product holds in registers, in the scores and in the outputs: AVX2 has 16 vector registers, AVX-512 32.
   With AVX-512, 24 and 16 took the least time of the sizes tried (12 and 12, 16 and 16, 24 and 12, 24 and 8; 12 and
   24 the most) for SmolLM2's shapes on 2 cores of a Xeon, 432 prompt rows over a 4k prefix 432 to 470 ms against 546
   to 586 with 12 and 12. */
#if LANES == 16
#define SCORE_SUMS 24
#define OUTPUT_SUMS 16
#else
#define SCORE_SUMS 12
#define OUTPUT_SUMS 12
#endif
#define TILES 0  /* no part comes tiled to float32 (see cpu_attention_bf16.h) */
#define OUT_VECS (16 / LANES)  /* an output product's vectors: the 16 columns values are laid out in */

typedef struct {
    const float *keys;              /* the chunk's, rows of d, read in place */
    float values[MAX_DIM * KEYS];   /* the chunk's, 16 columns at a time: for each 16, a row of them a key */
    float queries[MAX_DIM * ROWS];  /* the block's rows transposed: column i is row i, columns padded to LANES */
    float scores[KEYS * ROWS];      /* transposed, as the queries' columns: scores, then probabilities in place */
    float out[ROWS * MAX_DIM];      /* the block's unnormalised output */
    float max[ROWS], sum[ROWS];
} scratch;

/* Keep where the chunk's keys [0, n) are, and lay its values out 16 columns at a time (for any count of rows). */
static void pack(const float *k, const float *v, int64_t n, int64_t d, int64_t rows, int tiled, scratch *w) {
    (void)rows, (void)tiled;  /* never tiled (TILES) */
    w->keys = k;
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < d; c += LANES)  /* column c of key i: in the 16 from c / 16 * 16, at c % 16 */
            vstore(w->values + (c / 16 * 16) * KEYS + i * 16 + c % 16, vload(v + i * d + c));
}

/* C = A B for `rows` rows and vecs * LANES columns (rows * vecs at most 24): A's element (r, i) at
   a[r * ar + i * ai], B's row i at b + i * ldb, C's row r at c + r * ldc. Asks for `ahead`'s share of this product, a
   line of each a step. */
static inline __attribute__((always_inline)) void product(const float *a, int64_t ar, int64_t ai, const float *b,
                                                          int64_t ldb, int64_t depth, float *c, int64_t ldc,
                                                          const int rows, const int vecs, ahead_of *ahead) {
    const char *next_k, *next_v;
    const int64_t lines = take_ahead(ahead, &next_k, &next_v);
    vec acc[24];
    for (int x = 0; x < rows * vecs; x++) acc[x] = vzero();
    for (int64_t i = 0; i < depth; i++) {
        if (i < lines) {
            _mm_prefetch(next_k + i * 64, _MM_HINT_T0);
            _mm_prefetch(next_v + i * 64, _MM_HINT_T0);
        }
        vec row[3];
        for (int v = 0; v < vecs; v++) row[v] = vload(b + i * ldb + v * LANES);
        for (int r = 0; r < rows; r++) {
            const vec x = vset(a[r * ar + i * ai]);
            for (int v = 0; v < vecs; v++) acc[r * vecs + v] = vfmadd(x, row[v], acc[r * vecs + v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) vstore(c + r * ldc + v * LANES, acc[r * vecs + v]);
}

/* The scores of keys [k, k + rows) against query rows [g, g + LANES vecs), into w->scores (its rows `padded`
   apart). */
static void score_keys(scratch *w, int64_t k, int64_t g, int64_t padded, int64_t d, int rows, int vecs,
                       ahead_of *ahead) {
    const float *a = w->keys + k * d, *b = w->queries + g;
    float *c = w->scores + k * padded + g;
#define SCORES(R, V) product(a, d, 1, b, padded, d, c, padded, R, V, ahead)
    switch (vecs * 16 + rows) {  /* the sizes attend_block asks for */
    case 16 + 8: SCORES(8, 1); break;
    case 16 + 7: SCORES(7, 1); break;
    case 16 + 6: SCORES(6, 1); break;
    case 16 + 5: SCORES(5, 1); break;
    case 16 + 4: SCORES(4, 1); break;
    case 16 + 3: SCORES(3, 1); break;
    case 16 + 2: SCORES(2, 1); break;
    case 16 + 1: SCORES(1, 1); break;
    case 32 + 6: SCORES(6, 2); break;
    case 32 + 5: SCORES(5, 2); break;
    case 32 + 4: SCORES(4, 2); break;
    case 32 + 3: SCORES(3, 2); break;
    case 32 + 2: SCORES(2, 2); break;
    case 32 + 1: SCORES(1, 2); break;
#if LANES == 16
    case 48 + 8: SCORES(8, 3); break;
    case 48 + 7: SCORES(7, 3); break;
    case 48 + 6: SCORES(6, 3); break;
    case 48 + 5: SCORES(5, 3); break;
    case 32 + 8: SCORES(8, 2); break;
    case 32 + 7: SCORES(7, 2); break;
#endif
    case 48 + 4: SCORES(4, 3); break;
    case 48 + 3: SCORES(3, 3); break;
    case 48 + 2: SCORES(2, 3); break;
    case 48 + 1: SCORES(1, 3); break;
    default: break;
    }
#undef SCORES
}

/* Output rows [r, r + rows) (at most OUTPUT_SUMS / OUT_VECS), columns [j, j + 16): their probabilities times the
   chunk's n values. */
static void output_rows(scratch *w, int64_t r, int64_t j, int64_t n, int64_t padded, int64_t d, int rows,
                        ahead_of *ahead) {
    const float *a = w->scores + r, *b = w->values + j * KEYS;
    float *c = w->out + r * d + j;
#define OUTPUTS(R) product(a, 1, padded, b, 16, n, c, d, R, OUT_VECS, ahead)
    switch (rows) {
#if OUT_VECS == 1
    case 16: OUTPUTS(16); break;
    case 15: OUTPUTS(15); break;
    case 14: OUTPUTS(14); break;
    case 13: OUTPUTS(13); break;
    case 12: OUTPUTS(12); break;
    case 11: OUTPUTS(11); break;
    case 10: OUTPUTS(10); break;
    case 9: OUTPUTS(9); break;
    case 8: OUTPUTS(8); break;
    case 7: OUTPUTS(7); break;
#endif
    case 6: OUTPUTS(6); break;
    case 5: OUTPUTS(5); break;
    case 4: OUTPUTS(4); break;
    case 3: OUTPUTS(3); break;
    case 2: OUTPUTS(2); break;
    case 1: OUTPUTS(1); break;
    default: break;
    }
#undef OUTPUTS
}

static inline vec exp2_vec(vec t) {  /* 2^t to float32 precision for t <= 0; 2^-126 at most below -126 */
    t = vmax(t, vset(-126.0f));
    const vec n = vround(t);
    const vec f = vsub(t, n);
    vec p = vset(EXP2_POLYNOMIAL[0]);
    for (int i = 1; i < 7; i++) p = vfmadd(p, f, vset(EXP2_POLYNOMIAL[i]));
    return vmul(p, vpower(n));
}

/* The softmax of the block's `padded` rows down their columns of the chunk's n scores, in place, a key at a time for
   all of them: each row's probabilities (unnormalised; 0 past `last[r]`, the last key row r sees, counted from the
   chunk's first, where `masked`), its max (scaled) and its sum of exponentials. */
static void softmax(scratch *w, int64_t padded, int64_t n, float scale, const int32_t *last, int masked) {
    const int64_t groups = padded / LANES;
    const vec none = vset(-INFINITY);
    vec top[ROWS / LANES], shift[ROWS / LANES], total[ROWS / LANES];
    for (int64_t g = 0; g < groups; g++) top[g] = none;
    for (int64_t k = 0; k < n; k++)
        for (int64_t g = 0; g < groups; g++) {
            vec s = vload(w->scores + k * padded + g * LANES);
            if (masked) s = where_unseen(unseen(k, last + g * LANES), s, none);
            top[g] = vmax(top[g], s);
        }
    /* Exponentials in base 2, the scale folded in. A row that sees no key here has them all masked to 0. */
    const float log2_scale = scale * 1.44269504088896341f;
    const vec factor = vset(log2_scale);
    for (int64_t g = 0; g < groups; g++) {
        shift[g] = zero_where_none(top[g], vmul(top[g], vset(-log2_scale)));
        total[g] = vzero();
    }
    for (int64_t k = 0; k < n; k++)
        for (int64_t g = 0; g < groups; g++) {
            float *at = w->scores + k * padded + g * LANES;
            vec e = exp2_vec(vfmadd(vload(at), factor, shift[g]));
            if (masked) e = zero_where(unseen(k, last + g * LANES), e);
            total[g] = vadd(total[g], e);
            vstore(at, e);
        }
    for (int64_t g = 0; g < groups; g++) {
        vstore(w->max + g * LANES, vmul(top[g], vset(scale)));
        vstore(w->sum + g * LANES, total[g]);
    }
}

/* Attend grouped rows [r0, r0 + count) of KV head h (count at most ROWS) to the chunk's n keys, from key t0 on: into
   w->out, w->max and w->sum (-infinity and 0 for a row that sees none of them). Each product asks for a share of
   what is left of `ahead` as it runs. */
static void attend_block(const rows_of *x, int64_t h, int64_t r0, int64_t count, int64_t t0, int64_t n, int64_t d,
                         float scale, scratch *w, ahead_of *ahead, const float *held) {
    (void)held;  /* each chunk's max is found here: see the bfloat16 build's */
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t g = 0; g < padded; g += LANES) {  /* the queries transposed, LANES rows at a time, zeros past count */
        const float *q[LANES];
        for (int i = 0; i < LANES; i++) {
            const int64_t r = r0 + g + i;
            q[i] = g + i < count ? x->q + head_of(x, h, r) * x->q_head + r % x->count * x->q_row : NULL;
        }
        for (int64_t c = 0; c < d; c += LANES) {
            vec rows[LANES];
            for (int i = 0; i < LANES; i++) rows[i] = q[i] ? vload(q[i] + c) : vzero();
            transpose(rows);
            for (int i = 0; i < LANES; i++) vstore(w->queries + (c + i) * padded + g, rows[i]);
        }
    }
    /* The scores a few keys at a time, against every 3 vectors of rows of the block before the next keys, so those
       keys stay in the nearest cache: as many keys as fill SCORE_SUMS (at most 8; with AVX2 4 keys, 6 or 8 where the
       block has 2 vectors of rows or 1). Then the outputs, 16 columns at a time for as many rows as fill
       OUTPUT_SUMS. */
    const int64_t vectors = padded / LANES > 3 ? 3 : padded / LANES;
    const int64_t keys = SCORE_SUMS / vectors < 8 ? SCORE_SUMS / vectors : 8;
    const int64_t out_rows = OUTPUT_SUMS / OUT_VECS;
    const int64_t calls = (n + keys - 1) / keys * ((padded + 3 * LANES - 1) / (3 * LANES)) +
                          (d / 16) * ((count + out_rows - 1) / out_rows);
    ahead->step = ((ahead->bytes - ahead->at) / 64 + calls - 1) / calls;
    for (int64_t k = 0; k < n; k += keys)
        for (int64_t g = 0; g < padded; g += 3 * LANES) {
            const int rows = (int)(n - k < keys ? n - k : keys);
            const int vecs = (int)((padded - g < 3 * LANES ? padded - g : 3 * LANES) / LANES);
            score_keys(w, k, g, padded, d, rows, vecs, ahead);
        }
    int32_t last[ROWS];  /* the last key each row sees, from the chunk's first (-1: none) */
    int masked = 0;
    for (int64_t i = 0; i < padded; i++) {
        const int64_t r = r0 + (i < count ? i : count - 1);  /* a padding row as the last real one */
        const int64_t to = x->causal_from < 0 ? n - 1 : x->causal_from + r % x->count - t0;
        last[i] = (int32_t)(to < -1 ? -1 : (to > n - 1 ? n - 1 : to));
        masked |= last[i] < n - 1;
    }
    softmax(w, padded, n, scale, last, masked);
    for (int64_t j = 0; j < d; j += 16)
        for (int64_t r = 0; r < count; r += out_rows)
            output_rows(w, r, j, n, padded, d, (int)(count - r < out_rows ? count - r : out_rows), ahead);
}

/* Merge a block's output into an item's running one (rows [0, count), each acc row `d` floats). */
static void merge_block(const scratch *w, int64_t count, int64_t d, float *acc, float *max, float *sum) {
    for (int64_t r = 0; r < count; r++) {
        const float most = fmaxf(max[r], w->max[r]);
        if (most == -INFINITY) continue;  /* a row that has seen no key yet, nor in this block */
        const float old = expf(max[r] - most), new = expf(w->max[r] - most);
        max[r] = most;
        sum[r] = old * sum[r] + new * w->sum[r];
        float *row = acc + r * d;
        const float *part = w->out + r * d;
        for (int64_t c = 0; c < d; c++) row[c] = old * row[c] + new * part[c];
    }
}

/* A held output row into `to`. */
static inline void load_held(const elem *held, float *to, int64_t d) { memcpy(to, held, sizeof(float) * d); }

/* `from` times `factor` into a held output row. */
static inline void store_held(const float *from, float factor, elem *held, int64_t d) {
    for (int64_t c = 0; c < d; c++) held[c] = from[c] * factor;
}
