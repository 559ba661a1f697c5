/* The inner parts of the float32 kernel (built with -mavx2 -mfma -DFLOAT32), included by cpu_attention.c: a chunk's
   keys transposed for the products, a block of rows attended to them, and the merges. Keys, values, queries and
   outputs are float32 (`elem`), and so is every product.

   Both products of a block are one register-blocked kernel, C[rows x 16] = A[rows x depth] B[depth x 16] in
   12 accumulators (6 rows by two vectors of 8), each row of B loaded once for the rows, each element of A broadcast
   once for both vectors: the scores, queries times the chunk's keys transposed (16 keys a row of B), and the
   outputs, probabilities times values (16 columns of V a row of B, read where they are). */

int prefixgate_request_amx(void) { return 0; }
static void configure_tiles(void) {}
static void release_tiles(void) {}

typedef struct {
    float keys[KEYS * MAX_DIM];     /* per 16 keys: d columns of 16 keys (K transposed) */
    const float *values;            /* the chunk's values, rows of d, read in place */
    float queries[ROWS * MAX_DIM];  /* a block of query rows */
    float scores[ROWS * KEYS];      /* scores, then the probabilities in place */
    float out[ROWS * MAX_DIM];      /* the block's unnormalised output */
    float max[ROWS], sum[ROWS];
} scratch;

static inline void transpose8(__m256 r[8]) {  /* 8 rows of 8 floats, in place */
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

/* Transpose keys [0, n) of K (rows of d) into w->keys, 16 keys a row of each column, keys past n (to a multiple of
   16) zeros; keep where V is. */
static void pack(const float *k, const float *v, int64_t n, int64_t d, scratch *w) {
    const int64_t padded = (n + 15) / 16 * 16;
    for (int64_t g = 0; g < padded; g += 8) {
        float *group = w->keys + (g / 16) * d * 16 + g % 16;
        for (int64_t c = 0; c < d; c += 8) {
            __m256 r[8];
            for (int64_t i = 0; i < 8; i++) r[i] = g + i < n ? _mm256_loadu_ps(k + (g + i) * d + c) : _mm256_setzero_ps();
            transpose8(r);
            for (int64_t i = 0; i < 8; i++) _mm256_storeu_ps(group + (c + i) * 16, r[i]);
        }
    }
    w->values = v;
}

/* C[rows x 16] = A[rows x depth] B[depth x 16] (rows at most 6): A's rows `lda` apart, B's `ldb`, C's `ldc`. */
static inline __attribute__((always_inline)) void product(const float *a, int64_t lda, const float *b, int64_t ldb,
                                                          int64_t depth, float *c, int64_t ldc, const int rows) {
    __m256 acc[6][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < depth; i++) {
        const __m256 b0 = _mm256_loadu_ps(b + i * ldb), b1 = _mm256_loadu_ps(b + i * ldb + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 x = _mm256_broadcast_ss(a + r * lda + i);
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(c + r * ldc, acc[r][0]);
        _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
    }
}

/* C[count x columns] = A[count x depth] B[depth x columns], columns a multiple of 16, B's 16 columns from column j at
   `b + j * jump`: each 16 columns of B stay in the cache while every 6 rows of A meet them. With each product of up
   to 6 rows, a few lines of `ahead` are fetched. */
static void products(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t jump, int64_t depth, float *c,
                     int64_t ldc, int64_t count, int64_t columns, ahead_of *ahead) {
    for (int64_t j = 0; j < columns; j += 16) {
        const float *bj = b + (j / 16) * jump;
        int64_t r = 0;
        for (; r + 6 <= count; r += 6) {
            product(a + r * lda, lda, bj, ldb, depth, c + r * ldc + j, ldc, 6);
            fetch_ahead(ahead);
        }
        if (r < count) fetch_ahead(ahead);
        switch (count - r) {
        case 5: product(a + r * lda, lda, bj, ldb, depth, c + r * ldc + j, ldc, 5); break;
        case 4: product(a + r * lda, lda, bj, ldb, depth, c + r * ldc + j, ldc, 4); break;
        case 3: product(a + r * lda, lda, bj, ldb, depth, c + r * ldc + j, ldc, 3); break;
        case 2: product(a + r * lda, lda, bj, ldb, depth, c + r * ldc + j, ldc, 2); break;
        case 1: product(a + r * lda, lda, bj, ldb, depth, c + r * ldc + j, ldc, 1); break;
        default: break;
        }
    }
}

static inline __m256 exp2_256(__m256 t) {  /* 2^t to float32 precision for t <= 0; 2^-126 at most below -126 */
    t = _mm256_max_ps(t, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_POLYNOMIAL[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLYNOMIAL[i]));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

static inline float sum8(__m256 x) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

static inline float max8(__m256 x) {
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}

/* Attend grouped rows [r0, r0 + count) of KV head h (count at most ROWS) to the n packed keys, the chunk's from key
   t0 on: into w->out, w->max and w->sum (-infinity and 0 for a row that sees none of them). What is left of `ahead`
   is fetched meanwhile. */
static void attend_block(const rows_of *x, int64_t h, int64_t r0, int64_t count, int64_t t0, int64_t n, int64_t d,
                         float scale, scratch *w, ahead_of *ahead) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = r0 + i;
        memcpy(w->queries + i * d, x->q + head_of(x, h, r) * x->q_head + r % x->count * x->q_row, sizeof(float) * d);
    }
    /* Over the scores' products, a share of the lines with each: all of them by the last. */
    const int64_t columns = (n + 15) / 16 * 16, calls = (count + 5) / 6 * (columns / 16);
    ahead->step = ((ahead->bytes - ahead->at) / 64 + calls - 1) / calls;
    products(w->queries, d, w->keys, 16, d * 16, d, w->scores, KEYS, count, columns, ahead);
    /* Each row's max and sum of exponentials; probabilities past the last key it sees are 0. Exponentials in base
       2, the scale folded in. */
    const float log2_scale = scale * 1.44269504088896341f;
    for (int64_t r = 0; r < count; r++) {
        float *row = w->scores + r * KEYS;
        int64_t visible = n;  /* the keys this row sees in the chunk */
        if (x->causal_from >= 0) {
            const int64_t last = x->causal_from + (r0 + r) % x->count - t0;  /* its last key, from the chunk's first */
            visible = last < 0 ? 0 : (last + 1 < n ? last + 1 : n);
        }
        memset(row + visible, 0, sizeof(float) * (n - visible));
        if (visible == 0) {
            w->max[r] = -INFINITY;
            w->sum[r] = 0.0f;
            continue;
        }
        int64_t i = 0;
        __m256 top = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= visible; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + i));
        float most = max8(top);
        for (; i < visible; i++) most = fmaxf(most, row[i]);
        const __m256 factor = _mm256_set1_ps(log2_scale), shift = _mm256_set1_ps(-most * log2_scale);
        __m256 total = _mm256_setzero_ps();
        for (i = 0; i + 8 <= visible; i += 8) {
            const __m256 e = exp2_256(_mm256_fmadd_ps(_mm256_loadu_ps(row + i), factor, shift));
            total = _mm256_add_ps(total, e);
            _mm256_storeu_ps(row + i, e);
        }
        float sum = sum8(total);
        for (; i < visible; i++) {
            row[i] = exp2f(fmaxf((row[i] - most) * log2_scale, -126.0f));
            sum += row[i];
        }
        w->max[r] = most * scale;
        w->sum[r] = sum;
    }
    products(w->scores, KEYS, w->values, d, 16, n, w->out, d, count, d, ahead);  /* nothing left to fetch */
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
