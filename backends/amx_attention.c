/* A packed step's attention on CPUs with AMX: see amx_attention.py.

   Work is shared out by KV head and run of keys. Each item packs 256 keys at a time (K transposed for the score tiles,
   V with the keys of each pair interleaved for the output tiles), so every key and value is read from memory once a
   call, then attends every query row to them in tiles of 16 rows: scores in float32 from bfloat16 products, softmax in
   float32, probabilities rounded to bfloat16 for the product with V (as torch's flash kernel does). A row sees every
   key, or causally those up to its own position. An item keeps an unnormalised output, the max of the scores and the
   sum of their exponentials for each row; at the end they merge across items and into the attention the caller holds
   over other keys, by log-sum-exp. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ROWS 64   /* query rows attended together: 4 tiles of 16 */
#define KEYS 256  /* keys packed together */
#define MAX_DIM 256
#define MAX_SPLITS 8  /* runs of keys per head, each an item of work */

/* Ask Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0 when granted. */
int prefixgate_request_amx(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {  /* all eight tiles 16 rows of 64 bytes */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.bytes_per_row[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

static inline __m512 exp512(__m512 x) {  /* e^x to float32 precision for x <= 0; 0 below -87 (and for -inf) */
    const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(above, _mm512_scalef_ps(p, n));
}

static inline void transpose16(__m512i r[16]) {  /* 16 rows of 16 32-bit elements, in place */
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

typedef struct {
    uint32_t keys[(KEYS / 16) * (MAX_DIM / 32) * 256];  /* per 16 keys and 32 columns: 16 column pairs x 16 keys */
    uint16_t values[(MAX_DIM / 16) * (KEYS / 2) * 32];  /* per 16 columns and 32 keys: 16 key pairs x 16 columns */
    uint16_t queries[ROWS * MAX_DIM];                   /* a block of query rows, padded to whole tiles */
    float scores[ROWS * KEYS];
    uint16_t probabilities[ROWS * KEYS];
    float out[ROWS * MAX_DIM];                          /* the block's unnormalised output */
    float max[ROWS], sum[ROWS];
} scratch;

/* Pack keys [0, n) of K and V (rows of d) for the tiles; keys past n are zeros. */
static void pack(const uint16_t *k, const uint16_t *v, int64_t n, int64_t d, scratch *w) {
    const int64_t slabs = d / 32, padded = (n + 31) / 32 * 32, blocks = padded / 32;
    for (int64_t g = 0; g < padded; g += 16) {
        const int64_t keys = n - g >= 16 ? 16 : (n - g > 0 ? n - g : 0);
        for (int64_t slab = 0; slab < slabs; slab++) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = i < keys ? _mm512_loadu_si512(k + (g + i) * d + slab * 32) : _mm512_setzero_si512();
            transpose16(r);
            uint32_t *tile = w->keys + ((g / 16) * slabs + slab) * 256;
            for (int64_t i = 0; i < 16; i++) _mm512_store_si512(tile + i * 16, r[i]);
        }
    }
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t pair = 0; pair < padded / 2; pair++) {
        const int64_t a = 2 * pair, b = 2 * pair + 1, block = pair / 16, row = pair % 16;
        for (int64_t c = 0; c < d; c += 32) {
            const __m512i x = a < n ? _mm512_loadu_si512(v + a * d + c) : _mm512_setzero_si512();
            const __m512i y = b < n ? _mm512_loadu_si512(v + b * d + c) : _mm512_setzero_si512();
            const int64_t j = c / 16;
            _mm512_store_si512(w->values + ((j * blocks + block) * 16 + row) * 32, _mm512_permutex2var_epi16(x, low, y));
            _mm512_store_si512(w->values + (((j + 1) * blocks + block) * 16 + row) * 32,
                               _mm512_permutex2var_epi16(x, high, y));
        }
    }
}

/* Where the queries, outputs and log-sum-exps are: row p of query head h at base + h * head + p * row (elements). */
typedef struct {
    const uint16_t *q;
    uint16_t *out;
    float *lse;
    int64_t q_head, q_row, out_head, out_row, lse_head, lse_row;
    int64_t groups, count;  /* query heads per KV head, and rows per query head */
    int64_t causal_from;    /* -1: every row sees every key; else row p sees keys [0, causal_from + p] */
} rows_of;

/* Query row i of KV head h's grouped rows (query head h * groups + i / count, position i % count). */
static inline int64_t head_of(const rows_of *x, int64_t h, int64_t i) { return h * x->groups + i / x->count; }

/* Attend grouped rows [r0, r0 + count) of KV head h (count at most ROWS) to the n packed keys, the chunk's from key
   t0 on: into w->out, w->max and w->sum (-infinity and 0 for a row that sees none of them). */
static void attend_block(const rows_of *x, int64_t h, int64_t r0, int64_t count, int64_t t0, int64_t n, int64_t d,
                         float scale, scratch *w) {
    const int64_t tiles = (count + 15) / 16, slabs = d / 32, padded = (n + 31) / 32 * 32, blocks = padded / 32;
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = r0 + i;
        memcpy(w->queries + i * d, x->q + head_of(x, h, r) * x->q_head + r % x->count * x->q_row, sizeof(uint16_t) * d);
    }
    memset(w->queries + count * d, 0, sizeof(uint16_t) * (tiles * 16 - count) * d);
    /* Scores, 16 rows by 16 keys a tile: the products summed over slabs of 32 columns. */
    for (int64_t g = 0; g < padded; g += 16) {
        for (int64_t t = 0; t < tiles; t++) {
            _tile_zero(0);
            for (int64_t slab = 0; slab < slabs; slab++) {
                _tile_loadd(1, w->queries + t * 16 * d + slab * 32, d * 2);
                _tile_loadd(2, w->keys + ((g / 16) * slabs + slab) * 256, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, w->scores + t * 16 * KEYS + g, KEYS * 4);
        }
    }
    /* Each row's max and sum of exponentials; probabilities past the last key are 0. Rows past `count` are left
       as they are: their output rows are never read. */
    const __m512 factor = _mm512_set1_ps(scale), none = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < count; r++) {
        float *row = w->scores + r * KEYS;
        int64_t visible = n;  /* the keys this row sees in the chunk */
        if (x->causal_from >= 0) {
            const int64_t last = x->causal_from + (r0 + r) % x->count - t0;  /* its last key, from the chunk's first */
            visible = last < 0 ? 0 : (last + 1 < n ? last + 1 : n);
        }
        if (visible == 0) {
            memset(w->probabilities + r * KEYS, 0, sizeof(uint16_t) * padded);
            w->max[r] = -INFINITY;
            w->sum[r] = 0.0f;
            continue;
        }
        __m512 top = none;
        for (int64_t i = 0; i < padded; i += 16) {
            const int64_t left = visible - i;
            const __mmask16 seen = left >= 16 ? 0xffff : (__mmask16)((1u << (left > 0 ? left : 0)) - 1);
            const __m512 x = _mm512_mask_mul_ps(none, seen, _mm512_load_ps(row + i), factor);
            _mm512_store_ps(row + i, x);
            top = _mm512_max_ps(top, x);
        }
        const float most = _mm512_reduce_max_ps(top);
        const __m512 shift = _mm512_set1_ps(most);
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < padded; i += 32) {
            const __m512 e0 = exp512(_mm512_sub_ps(_mm512_load_ps(row + i), shift));
            const __m512 e1 = exp512(_mm512_sub_ps(_mm512_load_ps(row + i + 16), shift));
            total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
            _mm512_store_si512(w->probabilities + r * KEYS + i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        w->max[r] = most;
        w->sum[r] = _mm512_reduce_add_ps(total);
    }
    /* Output, 16 rows by 64 columns at a time in four tiles: probabilities [16 x 32 keys] times values. */
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < d; c += 64) {
            const uint16_t *values = w->values + (c / 16) * blocks * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t block = 0; block < blocks; block++) {
                _tile_loadd(4, w->probabilities + t * 16 * KEYS + block * 32, KEYS * 2);
                _tile_loadd(5, values + block * 512, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, values + (blocks + block) * 512, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, values + (2 * blocks + block) * 512, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, values + (3 * blocks + block) * 512, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
            float *out = w->out + t * 16 * d + c;
            _tile_stored(0, out, d * 4);
            _tile_stored(1, out + 16, d * 4);
            _tile_stored(2, out + 32, d * 4);
            _tile_stored(3, out + 48, d * 4);
        }
    }
}

/* Merge a block's output into an item's running one (rows [0, count), each acc row `d` floats, then `max` and `sum`
   `rows` floats apart), the first block of a row copying it. */
static void merge_block(const scratch *w, int64_t count, int64_t d, int first, float *acc, float *max, float *sum) {
    for (int64_t r = 0; r < count; r++) {
        const float *block = w->out + r * d;
        float *row = acc + r * d;
        if (first || max[r] == -INFINITY) {  /* nothing merged yet, or nothing seen yet */
            memcpy(row, block, sizeof(float) * d);
            max[r] = w->max[r];
            sum[r] = w->sum[r];
            continue;
        }
        if (w->max[r] == -INFINITY) continue;  /* the row saw none of the block's keys */
        const float most = fmaxf(max[r], w->max[r]), old = expf(max[r] - most), new = expf(w->max[r] - most);
        const __m512 a = _mm512_set1_ps(old), b = _mm512_set1_ps(new);
        for (int64_t x = 0; x < d; x += 16)
            _mm512_storeu_ps(row + x, _mm512_fmadd_ps(a, _mm512_loadu_ps(row + x), _mm512_mul_ps(b, _mm512_loadu_ps(block + x))));
        max[r] = most;
        sum[r] = old * sum[r] + new * w->sum[r];
    }
}

static __thread scratch *thread_scratch;  /* each thread's, kept for its next call */
static __thread float *thread_parts;      /* the calling thread's items' running outputs */
static __thread int64_t thread_parts_size;

/* Attend each query row to keys and values [kv_heads, tokens, d] and merge that, by log-sum-exp, into the attention
   over other keys the caller holds in `out` and `lse`, in place. Query head j reads KV head j / groups; queries and
   out are bfloat16 rows of d contiguous elements, lse float32, each placed by its strides (in elements); keys and
   values bfloat16, rows of d contiguous, KV heads k_stride and v_stride apart. With causal_from -1 every query sees
   every key; otherwise query p sees keys [0, causal_from + p] (a prompt's new tokens after causal_from others). A
   held lse of -infinity holds nothing: out is then only written. Returns 0, -1 for sizes it does not take, -2 when
   memory ran out (nothing written then). */
int prefixgate_attend_into(const uint16_t *q, int64_t q_head, int64_t q_row, const uint16_t *k, const uint16_t *v,
                           int64_t k_stride, int64_t v_stride, int64_t kv_heads, int64_t groups, int64_t count,
                           int64_t tokens, int64_t d, float scale, uint16_t *out, int64_t out_head, int64_t out_row,
                           float *lse, int64_t lse_head, int64_t lse_row, int64_t causal_from) {
    if (d % 64 || d > MAX_DIM || tokens < 1 || count < 1 || groups < 1 || kv_heads < 1) return -1;
    if (causal_from >= tokens) return -1;
    const rows_of x = {q, out, lse, q_head, q_row, out_head, out_row, lse_head, lse_row, groups, count, causal_from};
    const int64_t rows = groups * count;  /* per KV head */
    const int64_t chunks = (tokens + KEYS - 1) / KEYS, splits = chunks < MAX_SPLITS ? chunks : MAX_SPLITS;
    const int64_t items = kv_heads * splits, stride = rows * (d + 2);
    if (thread_parts_size < items * stride) {
        free(thread_parts);
        thread_parts = malloc(sizeof(float) * items * stride);
        thread_parts_size = thread_parts ? items * stride : 0;
        if (!thread_parts) return -2;
    }
    float *parts = thread_parts;
    int failed = 0;
#pragma omp parallel
    {
        if (!thread_scratch) thread_scratch = aligned_alloc(64, sizeof(scratch));
        scratch *w = thread_scratch;
        if (w) configure_tiles();
        else {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!w) continue;
            const int64_t h = item / splits, split = item % splits;
            const int64_t first = chunks * split / splits, last = chunks * (split + 1) / splits;
            float *acc = parts + item * stride, *max = acc + rows * d, *sum = max + rows;
            for (int64_t c = first; c < last; c++) {
                const int64_t t0 = c * KEYS, n = tokens - t0 < KEYS ? tokens - t0 : KEYS;
                pack(k + h * k_stride + t0 * d, v + h * v_stride + t0 * d, n, d, w);
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                    const int64_t block = rows - r0 < ROWS ? rows - r0 : ROWS;
                    attend_block(&x, h, r0, block, t0, n, d, scale, w);
                    merge_block(w, block, d, c == first, acc + r0 * d, max + r0, sum + r0);
                }
            }
        }
        if (w) _tile_release();  /* the loop's end is a barrier: `failed` is final */
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t hr = 0; hr < kv_heads * rows; hr++) {
                const int64_t h = hr / rows, r = hr % rows, head = head_of(&x, h, r), p = r % count;
                const float *base = parts + h * splits * stride;
                /* The caller's attention over its other keys is one more part, already normalised. */
                float *held_lse = lse + head * lse_head + p * lse_row;
                uint16_t *held = out + head * out_head + p * out_row;
                float most = *held_lse;
                for (int64_t s = 0; s < splits; s++) most = fmaxf(most, base[s * stride + rows * d + r]);
                /* held -infinity: nothing held, and `held` is not read (it may be uninitialised memory) */
                const float own = *held_lse == -INFINITY ? 0.0f : expf(*held_lse - most);
                float total = own;
                float merged[MAX_DIM] __attribute__((aligned(64)));
                for (int64_t c = 0; c < d; c += 16) {
                    const __m512 o = own == 0.0f ? _mm512_setzero_ps() : _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(held + c))), 16));
                    _mm512_store_ps(merged + c, _mm512_mul_ps(o, _mm512_set1_ps(own)));
                }
                for (int64_t s = 0; s < splits; s++) {
                    const float *part = base + s * stride;
                    /* the part's output is unnormalised: weighted by e^(max - most), it counts as its sum says */
                    const float weight = expf(part[rows * d + r] - most);
                    total += weight * part[rows * d + rows + r];
                    const __m512 wv = _mm512_set1_ps(weight);
                    for (int64_t c = 0; c < d; c += 16)
                        _mm512_store_ps(merged + c, _mm512_fmadd_ps(wv, _mm512_loadu_ps(part + r * d + c), _mm512_load_ps(merged + c)));
                }
                const __m512 inverse = _mm512_set1_ps(1.0f / total);
                for (int64_t c = 0; c < d; c += 16)
                    _mm256_storeu_si256((__m256i *)(held + c),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(merged + c), inverse)));
                *held_lse = most + logf(total);
            }
        }
    }
    return failed ? -2 : 0;
}
