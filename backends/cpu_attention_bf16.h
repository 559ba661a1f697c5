/* The inner parts of the bfloat16 kernel (built with -mavx512f -mavx512bw -mavx512dq -mavx512bf16, and -mamx-tile
   -mamx-bf16 where the CPU has AMX), included by cpu_attention.c: a chunk's keys packed for the products, a block of
   rows attended to them, and the merges. Keys and values are bfloat16 (`elem`, uint16_t bits); the products sum in
   float32. */

/* Built with AMX (-mamx-tile -mamx-bf16) the products run on its tiles; without, on AVX-512 BF16 dot products. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX 1
#else
#define AMX 0
#endif
/* Without AMX, built with -DON_FMA the products run on float32 FMAs instead of `vdpbf16ps`: each bfloat16 value as the
   float32 it is (a shift or a mask of its pair), each pair's second product added and then its first, each in one
   rounding, as `vdpbf16ps` adds them, so the sums are the same bits (but for denormals, which `vdpbf16ps` flushes).
   Where `vdpbf16ps` is the slower (on a Xeon without AMX, a loop of independent ones ran a quarter as many a second as
   one of FMAs: half the multiply-adds) this is the faster: SmolLM2's 30 layers over a 4k prefix on 2 cores of that
   Xeon, the two builds in turn in one process, 8 decoding streams 0.75x the time, 16 0.79x, 8 prompts of 28 tokens
   0.77x; whole compiled steps on that prefix (step_bench.py --attention-against) 0.89x, 0.86x and 0.82x.
   The products on FMAs read each chunk where it lies, 32 keys (their keys, then their values) made float32 at a time
   for every row, and each pass of them over its rows asks for a share of the next chunk, a line of each a step. Before,
   they packed each chunk first, widened each pair as a product read it (once for every 8 rows of the scores, every 4
   of the outputs), and asked for the next chunk at each step of the scores and each row's exponentials, 32 lines of
   each at a time: the same 30 layers, the two builds in turn in one process (attention_bench.py --from-memory
   --against DIR, the same Xeon, two runs), one stream took 0.68x and 0.74x the time, 8 streams 0.88x and 0.83x, 16
   streams 0.85x and 0.85x, 16 over a 7k prefix 0.87x and 0.91x, 16 prompts of 27 tokens 0.98x and 1.01x; compiled
   steps on the 4k prefix (step_bench.py --attention-against DIR) 0.89x, 0.94x and 0.96x for 1, 8 and 16 streams,
   0.98x for 8 prompts of 28 tokens. (A whole chunk's keys and values made float32 as they were packed, 64 KB each at
   d 64, had taken 1.11x to 1.18x as long for decoding streams.) */
#if !defined(ON_FMA) || AMX
#undef ON_FMA
#define ON_FMA 0
#endif
/* On the dot products, a part may come `tiled`: its keys and values laid out in the pool as packing lays a chunk out
   for the products (cpu_attention.KernelOrder), so that they are read where they lie, never packed. */
#define TILES (!AMX && !ON_FMA)

#if AMX
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

static void release_tiles(void) { _tile_release(); }
#else
int prefixgate_request_amx(void) { return 0; }
static void configure_tiles(void) {}
static void release_tiles(void) {}
#endif

static inline __m512 exp2_512(__m512 t) {  /* 2^t to float32 precision for finite t <= 0; 0 below -150 */
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_POLYNOMIAL[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLYNOMIAL[i]));
    return _mm512_scalef_ps(p, n);
}

/* 2^t for probabilities that are rounded to bfloat16 next (a relative step of 3.9e-3): a quartic, within 2.7e-6 of it
   (relative, for any t: 0 below -150, infinity from 128), is enough, and 2 products fewer than exp2_512's. Measured on
   2 cores with AMX, SmolLM2's 30 layers over a 4k prefix (attention_bench.py's cases): 432 prompt rows 150 ms against
   156, 16 decoding streams 12.4 against 12.6 to 13.0. Its argument split as t - floor(t) in one instruction
   (`vreduceps`, and `vscalefps` takes floor(t) itself) instead of rounding t and subtracting: 432 prompt rows 114 to
   118 ms against 121 (alternating builds, the Xeon). */
static inline __m512 exp2_bf16_512(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  /* t - floor(t), in [0, 1) */
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.013534149f), f, _mm512_set1_ps(0.052011497f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24144274f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69300383f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026f));
    return _mm512_scalef_ps(p, t);  /* times 2^floor(t) */
}

/* A row of the block's scores: a line longer than KEYS, so that the 16 rows a tile's store writes fall in 16 sets of
   the nearest cache. KEYS apart they fell in 4, and the four tiles a step of scores() stores (16 rows apart) in the
   same 4, each store then waiting on the lines written back before it: SmolLM2's 30 layers over a 4k prefix (2 cores
   with AMX, attention_bench.py's shapes, the builds in turn in one process) took 49.3 ms for 224 prompt rows against
   52.6, the scores' part of it 27 % less (timed with the TSC in a /tmp build). First in the scratch: where it was,
   after the queries, the fields after it moved by 4 KB and the kernel's calls for 16 decoding streams took 1 to 4 %
   longer in some runs (in others no longer); last, every call took 5 to 25 % longer. */
#define SCORE_ROW (KEYS + 16)

typedef struct {
    float scores[ROWS * SCORE_ROW];  /* rows of SCORE_ROW, a row's KEYS first; first here, see SCORE_ROW */
#if !ON_FMA  /* the chunk packed for the products (on FMAs they read it where it lies) */
    uint32_t keys[(KEYS / 16) * (MAX_DIM / 32) * 256];  /* per 16 keys and 32 columns: 16 column pairs x 16 keys */
    uint16_t values[(MAX_DIM / 16) * (KEYS / 2) * 32];  /* per 16 columns and 32 keys: 16 key pairs x 16 columns */
#endif
    uint16_t queries[ROWS * MAX_DIM];                   /* a block of query rows, padded to whole tiles */
    uint16_t probabilities[ROWS * KEYS];
    float out[ROWS * MAX_DIM];                          /* the block's unnormalised output */
    float max[ROWS], sum[ROWS];
#if AMX
    uint32_t query_pairs[(ROWS / 16) * (MAX_DIM / 32) * 256];  /* per 16 rows and 32 columns: 16 column pairs x 16 rows */
#endif
    const uint16_t *in_place, *in_place_values;  /* the chunk's keys and values, where attend_few reads them */
#if TILES
    /* where the products read the chunk: its packed keys, and its values' tiles, a tile of 16 columns and 32 keys
       `value_columns` elements from the one of the columns before, `value_keys` from the one of the keys before */
    const uint32_t *key_tiles;
    const uint16_t *value_tiles;
    int64_t value_columns, value_keys;
#endif
#if !AMX
    ahead_of *ahead;  /* the next chunk's, which each pass of the products asks a share of */
#endif
#if ON_FMA
    float float_queries[ROWS * MAX_DIM] __attribute__((aligned(64)));      /* the block's queries as float32 */
    float float_probabilities[ROWS * KEYS] __attribute__((aligned(64)));  /* and its probabilities */
    float float_keys[MAX_DIM / 2 * 64] __attribute__((aligned(64)));      /* 32 keys as float32 (float_keys()) */
    float float_values[32 * MAX_DIM] __attribute__((aligned(64)));        /* their values (float_values()) */
    const uint16_t *chunk_k, *chunk_v;  /* the chunk's keys and values, where the products read them */
    int64_t chunk_keys;
#endif
} scratch;

/* 32 columns of `count` rows (`stride` elements apart; zeros past them, to 16) as a tile of their column pairs: row c
   holds each row's columns 2c and 2c + 1. */
static inline void pair_tile(const uint16_t *rows, int64_t stride, int64_t count, uint32_t *tile) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; i++) r[i] = i < count ? _mm512_loadu_si512(rows + i * stride) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t i = 0; i < 16; i++) _mm512_store_si512(tile + i * 16, r[i]);
}

/* 32 values of V (rows of d; zeros from value n on), columns [c, c + width) (16, or a multiple of 32), as width / 16
   tiles `stride` elements apart: a tile's row i holds values 2i and 2i + 1 of each of 16 columns side by side, as the
   products with the values take them. */
static inline void pack_values(const uint16_t *v, int64_t n, int64_t d, int64_t c, int64_t width, uint16_t *tiles,
                               int64_t stride) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t pair = 0; pair < 16; pair++) {
        const uint16_t *a = v + 2 * pair * d + c, *b = a + d;
        const int has_a = 2 * pair < n, has_b = 2 * pair + 1 < n;
        if (width == 16) {  /* the low halves only: `low` takes elements 0 to 15 of each */
            const __m512i zero = _mm512_setzero_si512();
            const __m512i x = has_a ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)) : zero;
            const __m512i y = has_b ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b)) : zero;
            _mm512_store_si512(tiles + pair * 32, _mm512_permutex2var_epi16(x, low, y));
            continue;
        }
        for (int64_t h = 0; h < width; h += 32) {
            const __m512i x = has_a ? _mm512_loadu_si512(a + h) : _mm512_setzero_si512();
            const __m512i y = has_b ? _mm512_loadu_si512(b + h) : _mm512_setzero_si512();
            _mm512_store_si512(tiles + (h / 16) * stride + pair * 32, _mm512_permutex2var_epi16(x, low, y));
            _mm512_store_si512(tiles + (h / 16 + 1) * stride + pair * 32, _mm512_permutex2var_epi16(x, high, y));
        }
    }
}

/* Pack keys [0, n) of K and V (rows of d) for the products of `rows` query rows; keys past n are zeros. Where AMX
   takes a whole chunk for at most ROWS rows (one block), they are left where they are, for attend_few; on FMAs the
   products read every chunk where it is, 32 keys made float32 at a time; a `tiled` chunk (see TILES) is read where it
   is, packed already. */
static void pack(const uint16_t *k, const uint16_t *v, int64_t n, int64_t d, int64_t rows, int tiled, scratch *w) {
    const int in_place = AMX && rows <= ROWS && n == KEYS;
    w->in_place = in_place ? k : NULL;
    w->in_place_values = in_place ? v : NULL;
#if ON_FMA
    (void)d;
    w->chunk_k = k;
    w->chunk_v = v;
    w->chunk_keys = n;
#else
    if (in_place) return;
    const int64_t slabs = d / 32, padded = (n + 31) / 32 * 32, blocks = padded / 32;
#if TILES
    if (tiled) {
        w->key_tiles = (const uint32_t *)k;
        w->value_tiles = v;
        w->value_columns = 512;
        w->value_keys = d / 16 * 512;
        return;
    }
    w->key_tiles = w->keys;
    w->value_tiles = w->values;
    w->value_columns = blocks * 512;
    w->value_keys = 512;
#else
    (void)tiled;
#endif
#if !AMX
    /* On dot products, where one block of rows attends the chunk (a decode step's), the chunk's values are asked for
       into the nearest cache as packing begins, and each next 16 keys' rows as 16 are packed: the loads of both had
       held packing up (`perf annotate`: most of its samples on them), though the chunk was asked for into the
       second-level cache while the one before was attended. SmolLM2's 30 layers over a 4k prefix on 2 cores of the
       Zen 4 EPYC (attention_bench.py --from-memory --against, the builds in turn in one process, two runs): one stream
       0.91x to 0.97x the time, 8 streams 0.95x and 0.96x, 16 streams 0.97x and 0.98x, 16 over 7k 0.97x; compiled
       steps on the prefix (step_bench.py --attention-against) 0.98x for 1, 8 and 16 streams. Prompts (432 rows) lost
       1 % with it and are left as they were. */
    const int ask = rows <= ROWS;
    for (int64_t at = 0; ask && at < n * d * 2; at += 64) _mm_prefetch((const char *)v + at, _MM_HINT_T0);
#endif
    for (int64_t g = 0; g < padded; g += 16) {
        const int64_t keys = n - g >= 16 ? 16 : (n - g > 0 ? n - g : 0);
#if !AMX
        for (int64_t at = (g + 16) * d * 2; ask && at < (g + 32 < n ? g + 32 : n) * d * 2; at += 64)
            _mm_prefetch((const char *)k + at, _MM_HINT_T0);
#endif
        for (int64_t slab = 0; slab < slabs; slab++)
            pair_tile(k + g * d + slab * 32, d, keys, w->keys + ((g / 16) * slabs + slab) * 256);
    }
    for (int64_t block = 0; block < blocks; block++)  /* per 16 columns and 32 keys */
        pack_values(v + block * 32 * d, n - block * 32, d, 0, d, w->values + block * 512, blocks * 512);
#endif
}

#if TILES
/* One KV head's `tokens` keys and values (rows of d, a multiple of 32 of them) laid out as `pack` lays a chunk out for
   the products, into `key_tiles` and `value_tiles` (64-byte aligned): how a tiled part lies. */
static void lay_out_tiles(const uint16_t *k, const uint16_t *v, uint16_t *key_tiles, uint16_t *value_tiles,
                          int64_t tokens, int64_t d) {
    const int64_t slabs = d / 32;
    for (int64_t g = 0; g < tokens; g += 16)
        for (int64_t slab = 0; slab < slabs; slab++)
            pair_tile(k + g * d + slab * 32, d, 16, (uint32_t *)key_tiles + ((g / 16) * slabs + slab) * 256);
    for (int64_t b = 0; b < tokens / 32; b++) pack_values(v + b * 32 * d, 32, d, 0, d, value_tiles + b * d * 32, 512);
}

/* The inverse of lay_out_tiles: a tiled head's keys and values back into rows of d. */
static void lay_out_rows(const uint16_t *key_tiles, const uint16_t *value_tiles, uint16_t *k, uint16_t *v,
                         int64_t tokens, int64_t d) {
    const int64_t slabs = d / 32;
    for (int64_t g = 0; g < tokens; g += 16)
        for (int64_t slab = 0; slab < slabs; slab++) {
            const uint32_t *tile = (const uint32_t *)key_tiles + ((g / 16) * slabs + slab) * 256;
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(tile + i * 16);
            transpose16(r);  /* its own inverse: row i is key g + i's 16 column pairs */
            for (int64_t i = 0; i < 16; i++) _mm512_storeu_si512(k + (g + i) * d + slab * 32, r[i]);
        }
    /* a tile row holds two values' 16 columns interleaved: the first value's are the even elements */
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24,
                                          22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int64_t b = 0; b < tokens / 32; b++)
        for (int64_t c = 0; c < d; c += 32)
            for (int64_t pair = 0; pair < 16; pair++) {
                const uint16_t *low = value_tiles + b * d * 32 + (c / 16) * 512 + pair * 32;
                const __m512i x = _mm512_loadu_si512(low), y = _mm512_loadu_si512(low + 512);
                uint16_t *first = v + (b * 32 + 2 * pair) * d + c;
                _mm512_storeu_si512(first, _mm512_permutex2var_epi16(x, even, y));
                _mm512_storeu_si512(first + d, _mm512_permutex2var_epi16(x, odd, y));
            }
}
#endif

/* The columns of a pass of attend_few's outputs: its accumulators are `tiles` tiles of rows by width / 16 of columns,
   four at most. */
static inline int64_t few_width(int64_t tiles) { return tiles == 1 ? 64 : (tiles == 2 ? 32 : 16); }

#if AMX
#define SCORE_KEYS 16  /* keys a step of scores() takes: each asks for a share of the next chunk */

/* Scores of the block's query rows (in tiles of 16) against the packed keys, into w->scores. */
static void scores(scratch *w, int64_t count, int64_t tiles, int64_t padded, int64_t d, ahead_of *ahead) {
    (void)count;
    const int64_t slabs = d / 32;
    /* 16 rows by 16 keys a tile: the products summed over slabs of 32 columns, each key tile loaded once for
       every row tile (accumulators 0 to 3, keys 4 and 5, queries 6 and 7). */
    for (int64_t g = 0; g < padded; g += SCORE_KEYS) {
        fetch_some(ahead);
        const uint32_t *keys = w->keys + (g / 16) * slabs * 256;
        for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
            const int64_t tn = tiles - t0 < 4 ? tiles - t0 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t slab = 0; slab < slabs; slab++) {
                const uint16_t *q = w->queries + t0 * 16 * d + slab * 32;
                _tile_loadd(4, keys + slab * 256, 64);
                _tile_loadd(6, q, d * 2);
                _tile_dpbf16ps(0, 6, 4);
                if (tn > 1) {
                    _tile_loadd(7, q + 16 * d, d * 2);
                    _tile_dpbf16ps(1, 7, 4);
                }
                if (tn > 2) {
                    _tile_loadd(6, q + 32 * d, d * 2);
                    _tile_dpbf16ps(2, 6, 4);
                }
                if (tn > 3) {
                    _tile_loadd(7, q + 48 * d, d * 2);
                    _tile_dpbf16ps(3, 7, 4);
                }
            }
            float *scores = w->scores + t0 * 16 * SCORE_ROW + g;
            _tile_stored(0, scores, SCORE_ROW * 4);
            if (tn > 1) _tile_stored(1, scores + 16 * SCORE_ROW, SCORE_ROW * 4);
            if (tn > 2) _tile_stored(2, scores + 32 * SCORE_ROW, SCORE_ROW * 4);
            if (tn > 3) _tile_stored(3, scores + 48 * SCORE_ROW, SCORE_ROW * 4);
        }
    }
}

/* The block's unnormalised output, probabilities times values, into w->out: two tiles of rows by 32 columns at a
   time in four tiles, so that each tile of probabilities or of values loaded serves two products (one tile of rows by
   64 columns loaded 5 tiles for 4 products: 224 prompt rows over a 4k prefix, as SCORE_ROW's, 49.3 ms against 50.6). */
static void outputs(scratch *w, int64_t count, int64_t tiles, int64_t blocks, int64_t d) {
    (void)count;
    for (int64_t t = 0; t < tiles; t += 2) {
        const int two = t + 1 < tiles;
        const uint16_t *p = w->probabilities + t * 16 * KEYS;
        for (int64_t c = 0; c < d; c += 32) {
            const uint16_t *values = w->values + (c / 16) * blocks * 512;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t block = 0; block < blocks; block++) {
                _tile_loadd(4, p + block * 32, KEYS * 2);
                _tile_loadd(6, values + block * 512, 64);
                _tile_loadd(7, values + (blocks + block) * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, p + 16 * KEYS + block * 32, KEYS * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *out = w->out + t * 16 * d + c;
            _tile_stored(0, out, d * 4);
            _tile_stored(1, out + 16, d * 4);
            if (two) {
                _tile_stored(2, out + 16 * d, d * 4);
                _tile_stored(3, out + 16 * d + 16, d * 4);
            }
        }
    }
}
#else
#define SCORE_KEYS 32

/* A pass's share of the next chunk (take_ahead): `lines` lines of its keys and of its values, at k and v, asked for
   into the second-level cache one of each a step of the pass's loop, so that they come while its products run. */
typedef struct {
    const char *k, *v;
    int64_t lines;
} share;

static inline share take_share(ahead_of *ahead) {
    share s;
    s.lines = take_ahead(ahead, &s.k, &s.v);
    return s;
}

static inline __attribute__((always_inline)) void ask_line(const share *s, int64_t i) {
    if (i < s->lines) {
        _mm_prefetch(s->k + i * 64, _MM_HINT_T1);
        _mm_prefetch(s->v + i * 64, _MM_HINT_T1);
    }
}

/* The lines of a share that its pass's steps did not ask for, from line `from` on. */
static inline __attribute__((always_inline)) void ask_rest(const share *s, int64_t from) {
    for (int64_t i = from; i < s->lines; i++) ask_line(s, i);
}

#if ON_FMA
/* 16 pairs of bfloat16 as float32: the first of each pair (its low half), then the second. */
static inline __attribute__((always_inline)) void as_floats(__m512i pairs, __m512 floats[2]) {
    floats[0] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    floats[1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

/* `count` bfloat16 values (a multiple of 16) as float32. */
static inline void widen(const uint16_t *from, int64_t count, float *to) {
    for (int64_t i = 0; i < count; i += 16)
        _mm512_store_ps(to + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(from + i))), 16)));
}

/* The chunk's keys [g, g + 32) as float32, into w->float_keys: per column pair, the first column of keys g to g + 15
   and their second, then the same of keys g + 16 to g + 31 (zeros from the chunk's last key on). Made as the scores
   reach them, read where they lie: 8 KB at d 64, which stay in the nearest cache while every row's products read
   them. */
static void float_keys(scratch *w, int64_t g, int64_t d) {
    for (int64_t half = 0; half < 2; half++) {
        const int64_t from = g + 16 * half, left = w->chunk_keys - from;
        const int64_t keys = left >= 16 ? 16 : (left > 0 ? left : 0);
        for (int64_t slab = 0; slab < d / 32; slab++) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = i < keys ? _mm512_loadu_si512(w->chunk_k + (from + i) * d + slab * 32) : _mm512_setzero_si512();
            transpose16(r);  /* r[c]: column pair slab * 16 + c of the 16 keys */
            for (int64_t c = 0; c < 16; c++) {
                __m512 f[2];
                as_floats(r[c], f);
                float *to = w->float_keys + ((slab * 16 + c) * 4 + half * 2) * 16;
                _mm512_store_ps(to, f[0]);
                _mm512_store_ps(to + 16, f[1]);
            }
        }
    }
}

/* Scores of `rows` query rows from r0 against keys [g, g + 32) in w->float_keys, two accumulators a row: each vector
   of keys loaded once for the rows, each row's column broadcast once for both. A pair's second column is added to
   every accumulator before its first, the order `vdpbf16ps` adds them in. */
static inline __attribute__((always_inline)) void score_rows(scratch *w, int64_t g, int64_t r0, const int rows,
                                                             int64_t d) {
    __m512 acc[12][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *q = w->float_queries + r0 * d;
    const share next = take_share(w->ahead);
    for (int64_t pair = 0; pair < d / 2; pair++) {
        ask_line(&next, pair);
        for (int u = 1; u >= 0; u--) {
            const float *k = w->float_keys + pair * 64 + 16 * u;
            const __m512 k0 = _mm512_load_ps(k), k1 = _mm512_load_ps(k + 32);
            for (int r = 0; r < rows; r++) {
                const __m512 x = _mm512_set1_ps(q[r * d + 2 * pair + u]);
                acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
            }
        }
    }
    ask_rest(&next, d / 2);
    for (int r = 0; r < rows; r++) {
        _mm512_store_ps(w->scores + (r0 + r) * SCORE_ROW + g, acc[r][0]);
        _mm512_store_ps(w->scores + (r0 + r) * SCORE_ROW + g + 16, acc[r][1]);
    }
}

static void scores(scratch *w, int64_t count, int64_t tiles, int64_t padded, int64_t d, ahead_of *ahead) {
    (void)tiles, (void)ahead;  /* each pass asks for its share of the next chunk (w->ahead) */
    for (int64_t g = 0; g < padded; g += SCORE_KEYS) {  /* padded: a multiple of 32 */
        float_keys(w, g, d);
        int64_t r = 0;
        for (; r + 12 <= count; r += 12) score_rows(w, g, r, 12, d);
        if (count - r >= 8) {
            score_rows(w, g, r, 8, d);
            r += 8;
        }
        if (count - r >= 4) {
            score_rows(w, g, r, 4, d);
            r += 4;
        }
        switch (count - r) {
        case 3: score_rows(w, g, r, 3, d); break;
        case 2: score_rows(w, g, r, 2, d); break;
        case 1: score_rows(w, g, r, 1, d); break;
        }
    }
}

/* How many passes scores() and outputs() make over `count` rows of a chunk of `blocks` runs of 32 keys: each asks for
   a share of the next chunk. */
static inline int64_t passes(int64_t count, int64_t blocks, int64_t d) {
    const int64_t rest = count % 12, score_passes = count / 12 + (rest >= 8) + (rest % 8 >= 4) + (rest % 4 > 0);
    return blocks * (score_passes + d / 64 * (count / 6 + (count % 6 > 0)));
}

/* The chunk's values of keys [32 b, 32 b + 32) as float32, into w->float_values: per key, each 32 columns' even
   columns, then their odd ones (zeros from the chunk's last key on). */
static void float_values(scratch *w, int64_t b, int64_t d) {
    for (int64_t i = 0; i < 32; i++) {
        const int64_t key = b * 32 + i;
        float *to = w->float_values + i * d;
        for (int64_t c = 0; c < d; c += 32) {
            __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            if (key < w->chunk_keys) as_floats(_mm512_loadu_si512(w->chunk_v + key * d + c), f);
            _mm512_store_ps(to + c, f[0]);
            _mm512_store_ps(to + c + 16, f[1]);
        }
    }
}

/* Add keys [32 b, 32 b + 32) to output columns [c, c + 64) of `rows` rows from r0, in w->out (each 32 columns' even
   columns, then their odd ones, until outputs() orders them): each vector of a key's values loaded once for the rows,
   each row's probability broadcast to it. A pair's second key is added before its first, as `vdpbf16ps` adds them. */
static inline __attribute__((always_inline)) void output_rows(scratch *w, int64_t b, int64_t r0, const int rows,
                                                              int64_t c, int64_t d) {
    __m512 acc[6][4];
    float *out = w->out + r0 * d + c;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = b ? _mm512_load_ps(out + r * d + 16 * j) : _mm512_setzero_ps();
    const float *p = w->float_probabilities + r0 * KEYS + b * 32;
    const share next = take_share(w->ahead);
    for (int64_t pair = 0; pair < 16; pair++)
        for (int u = 1; u >= 0; u--) {
            ask_line(&next, 2 * pair + 1 - u);
            const float *v = w->float_values + (2 * pair + u) * d + c;
            __m512 x[4];
            for (int j = 0; j < 4; j++) x[j] = _mm512_load_ps(v + 16 * j);
            for (int r = 0; r < rows; r++) {
                const __m512 probability = _mm512_set1_ps(p[r * KEYS + 2 * pair + u]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(probability, x[j], acc[r][j]);
            }
        }
    ask_rest(&next, 32);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(out + r * d + 16 * j, acc[r][j]);
}

/* The block's unnormalised output, probabilities times values, into w->out: 32 keys at a time, made float32 once
   for every row. */
static void outputs(scratch *w, int64_t count, int64_t tiles, int64_t blocks, int64_t d) {
    (void)tiles;
    for (int64_t b = 0; b < blocks; b++) {
        float_values(w, b, d);
        for (int64_t c = 0; c < d; c += 64) {
            int64_t r = 0;
            for (; r + 6 <= count; r += 6) output_rows(w, b, r, 6, c, d);
            switch (count - r) {
            case 5: output_rows(w, b, r, 5, c, d); break;
            case 4: output_rows(w, b, r, 4, c, d); break;
            case 3: output_rows(w, b, r, 3, c, d); break;
            case 2: output_rows(w, b, r, 2, c, d); break;
            case 1: output_rows(w, b, r, 1, c, d); break;
            }
        }
    }
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int64_t r = 0; r < count; r++)  /* each 32 columns in order: even and odd side by side */
        for (int64_t c = 0; c < d; c += 32) {
            float *out = w->out + r * d + c;
            const __m512 even = _mm512_load_ps(out), odd = _mm512_load_ps(out + 16);
            _mm512_store_ps(out, _mm512_permutex2var_ps(even, low, odd));
            _mm512_store_ps(out + 16, _mm512_permutex2var_ps(even, high, odd));
        }
}
#else
typedef uint32_t __attribute__((may_alias)) bf16_pair;  /* two bfloat16 read as one 32-bit element */

/* Scores of `rows` query rows from r0 against 32 keys from key g (two groups of the packed keys), two accumulators
   a row: each vector of 16 keys' column pair loaded once for the rows, each row's pair broadcast once for both. */
static inline __attribute__((always_inline)) void score_rows(scratch *w, int64_t g, int64_t r0, const int rows,
                                                             int64_t d) {
    __m512 acc[8][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t *keys = w->key_tiles + (g / 16) * (d / 32) * 256, *next = keys + (d / 32) * 256;
    const bf16_pair *q = (const bf16_pair *)(w->queries + r0 * d);
    const share ahead = take_share(w->ahead);
    for (int64_t pair = 0; pair < d / 2; pair++) {
        ask_line(&ahead, pair);
        const int64_t at = (pair / 16) * 256 + (pair % 16) * 16;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + at), k1 = (__m512bh)_mm512_loadu_si512(next + at);
        for (int r = 0; r < rows; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)q[r * d / 2 + pair]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
        }
    }
    ask_rest(&ahead, d / 2);
    for (int r = 0; r < rows; r++) {
        _mm512_store_ps(w->scores + (r0 + r) * SCORE_ROW + g, acc[r][0]);
        _mm512_store_ps(w->scores + (r0 + r) * SCORE_ROW + g + 16, acc[r][1]);
    }
}

static void scores(scratch *w, int64_t count, int64_t tiles, int64_t padded, int64_t d, ahead_of *ahead) {
    (void)tiles, (void)ahead;  /* each pass asks for its share of the next chunk (w->ahead) */
    for (int64_t g = 0; g < padded; g += SCORE_KEYS) {  /* padded: a multiple of 32 */
        int64_t r = 0;
        for (; r + 8 <= count; r += 8) score_rows(w, g, r, 8, d);
        if (count - r >= 4) {
            score_rows(w, g, r, 4, d);
            r += 4;
        }
        if (count - r >= 2) {
            score_rows(w, g, r, 2, d);
            r += 2;
        }
        if (count - r >= 1) score_rows(w, g, r, 1, d);
    }
}

/* Output columns [c, c + 64) of `rows` rows from r0: each vector of a key pair's 16 values loaded once for the rows,
   each row's pair of probabilities broadcast to it. */
static inline __attribute__((always_inline)) void output_rows(scratch *w, int64_t r0, const int rows, int64_t c,
                                                              int64_t blocks, int64_t d) {
    __m512 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    const uint16_t *values = w->value_tiles + (c / 16) * w->value_columns;
    const bf16_pair *p = (const bf16_pair *)(w->probabilities + r0 * KEYS);
    const share ahead = take_share(w->ahead);
    for (int64_t pair = 0; pair < blocks * 16; pair++) {
        ask_line(&ahead, pair);
        const uint16_t *tiles = values + (pair / 16) * w->value_keys + (pair % 16) * 32;
        __m512bh v[4];
        for (int j = 0; j < 4; j++) v[j] = (__m512bh)_mm512_loadu_si512(tiles + j * w->value_columns);
        for (int r = 0; r < rows; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)p[r * KEYS / 2 + pair]);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, v[j]);
        }
    }
    ask_rest(&ahead, blocks * 16);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(w->out + (r0 + r) * d + c + 16 * j, acc[r][j]);
}

static void outputs(scratch *w, int64_t count, int64_t tiles, int64_t blocks, int64_t d) {
    (void)tiles;
    for (int64_t c = 0; c < d; c += 64) {
        int64_t r = 0;
        for (; r + 4 <= count; r += 4) output_rows(w, r, 4, c, blocks, d);
        if (count - r >= 2) {
            output_rows(w, r, 2, c, blocks, d);
            r += 2;
        }
        if (count - r >= 1) output_rows(w, r, 1, c, blocks, d);
    }
}

/* How many passes scores() and outputs() make over `count` rows of a chunk of `blocks` runs of 32 keys: each asks for
   a share of the next chunk. */
static inline int64_t passes(int64_t count, int64_t blocks, int64_t d) {
    const int64_t score_passes = count / 8 + (count % 8 >= 4) + (count % 4 >= 2) + count % 2;
    return blocks * score_passes + d / 64 * (count / 4 + (count % 4 >= 2) + count % 2);
}
#endif
#endif

#if AMX
/* attend_few's unnormalised output, probabilities times values, into w->out. The values are packed 32 keys at a time
   as the products take them, into a few KB that stay in the nearest cache (where packing the chunk's 32 KB first,
   before its scores, had them out of it by then), and the next chunk is asked for a share of each 32. SmolLM2's 30
   layers over a 4k prefix (attention_bench.py's shapes, 2 cores with AMX, the builds in turn in one process, 81
   rounds): one stream 3.52 ms against 3.86 with the chunk's values packed first, 8 streams 4.45 against 4.95, 16
   streams 5.80 against 6.12, and 16 streams over 7k 10.33 against 11.51. */
static void outputs_few(scratch *w, int64_t tiles, int64_t d, ahead_of *ahead) {
    const int64_t width = few_width(tiles);
    const uint16_t *p = w->probabilities, *v = w->in_place_values;
    uint16_t *values = w->values;  /* width / 16 tiles of the 32 keys' values, 512 elements apart */
    for (int64_t c = 0; c < d; c += width) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < KEYS / 32; b++) {
            fetch_some(ahead);
            pack_values(v + b * 32 * d, 32, d, c, width, values, 512);
            if (tiles == 1) {  /* accumulators: 64 columns */
                _tile_loadd(4, p + b * 32, KEYS * 2);
                _tile_loadd(5, values, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, values + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, values + 1024, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, values + 1536, 64);
                _tile_dpbf16ps(3, 4, 6);
            } else if (tiles == 2) {  /* two tiles of rows by 32 columns */
                _tile_loadd(4, p + b * 32, KEYS * 2);
                _tile_loadd(5, p + 16 * KEYS + b * 32, KEYS * 2);
                _tile_loadd(6, values, 64);
                _tile_loadd(7, values + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            } else {  /* three or four tiles of rows by 16 columns */
                _tile_loadd(5, values, 64);
                _tile_loadd(4, p + b * 32, KEYS * 2);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, p + 16 * KEYS + b * 32, KEYS * 2);
                _tile_dpbf16ps(1, 6, 5);
                _tile_loadd(4, p + 32 * KEYS + b * 32, KEYS * 2);
                _tile_dpbf16ps(2, 4, 5);
                if (tiles > 3) {
                    _tile_loadd(6, p + 48 * KEYS + b * 32, KEYS * 2);
                    _tile_dpbf16ps(3, 6, 5);
                }
            }
        }
        float *out = w->out + c;
        if (tiles == 1) {
            _tile_stored(0, out, d * 4);
            _tile_stored(1, out + 16, d * 4);
            _tile_stored(2, out + 32, d * 4);
            _tile_stored(3, out + 48, d * 4);
        } else if (tiles == 2) {
            _tile_stored(0, out, d * 4);
            _tile_stored(1, out + 16, d * 4);
            _tile_stored(2, out + 16 * d, d * 4);
            _tile_stored(3, out + 16 * d + 16, d * 4);
        } else {
            _tile_stored(0, out, d * 4);
            _tile_stored(1, out + 16 * d, d * 4);
            _tile_stored(2, out + 32 * d, d * 4);
            if (tiles > 3) _tile_stored(3, out + 48 * d, d * 4);
        }
    }
}

/* attend_few's exponentials of a tile of 16 rows (its scores a column of `across`, a key a row), 2^(score x factor +
   shift), as bfloat16 probabilities in the rows the products with the values take; returns each row's sum. */
static inline __m512 few_exponentials(scratch *w, const float *column, int64_t across, int whole, __m512i visible,
                                      __m512 factor, __m512 shift, int64_t t, int64_t blocks, ahead_of *ahead) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 total = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        fetch_some(ahead);
        __m512i p[16];
        for (int64_t i = 0; i < 16; i++) {
            __m512 e[2];
            for (int u = 0; u < 2; u++) {
                const int64_t j = b * 32 + 2 * i + u;
                e[u] = exp2_bf16_512(_mm512_fmadd_ps(_mm512_load_ps(column + j * across), factor, shift));
                if (!whole) e[u] = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(visible, _mm512_set1_epi32((int)j)), e[u]);
            }
            total = _mm512_add_ps(total, _mm512_add_ps(e[0], e[1]));
            p[i] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        }
        transpose16(p);
        for (int64_t i = 0; i < 16; i++) _mm512_store_si512(w->probabilities + (t * 16 + i) * KEYS + b * 32, p[i]);
    }
    return total;
}

/* attend_block for a whole run of KEYS keys and at most ROWS rows (a decode step's: 3 a stream for SmolLM2), its keys
   unpacked. The scores come transposed, a key a row: the keys are the products' first operand, 16 keys of 32 columns
   a tile read where they are (rows d apart), and the block's queries are packed instead, once a block. The softmax
   runs down the columns, 16 rows a vector, and the probabilities are transposed into the rows the outputs' products
   take (8 transposes of 16 by 16 a tile of rows, against 32 that packing 256 keys of 64 columns takes). SmolLM2's 30
   layers over a 4k prefix (attention_bench.py's shapes, 2 cores with AMX, the builds in turn in one process, two
   runs): one stream 5.41 and 6.27 ms against 6.12 and 6.72 with the keys packed, 8 streams 7.31 and 7.34 against 7.74
   and 7.63, 16 streams 8.02 and 9.28 against 8.91 and 10.60. Fewer keys (a run's last) stay packed: a request's own 40
   keys for 3 rows took longer in place, the softmax then running down 16 rows for 3. A chunk after a row's first takes
   the max the row holds (as attend_block does): the same script, 21 rounds, 1, 8 and 16 streams over the 4k prefix
   3.52, 4.37 and 5.70 ms against 3.65, 4.58 and 5.96 finding each chunk's max, 8 and 16 over 7k 8.08 and 9.98 against
   8.50 and 10.38 (a second run, slower throughout: 3.84, 4.82 and 6.23 against 3.83, 4.95 and 6.46; 8.54 and 10.83
   against 8.86 and 11.09). */
static void attend_few(const rows_of *x, int64_t r0, int64_t count, int64_t t0, int64_t d, float scale, scratch *w,
                       ahead_of *ahead, const float *held) {
    const uint16_t *keys = w->in_place;
    const int64_t n = KEYS, slabs = d / 32, tiles = (count + 15) / 16, blocks = KEYS / 32;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t slab = 0; slab < slabs; slab++)
            pair_tile(w->queries + t * 16 * d + slab * 32, d, 16, w->query_pairs + (t * slabs + slab) * 256);
    float *scores = w->scores;  /* [KEYS keys][tiles * 16 rows] */
    const int64_t across = tiles * 16;
    for (int64_t g = 0; g < KEYS; g += 16) {
        fetch_some(ahead);
        const uint16_t *k = keys + g * d;
        _tile_zero(0);
        if (tiles > 1) _tile_zero(1);
        if (tiles > 2) _tile_zero(2);
        if (tiles > 3) _tile_zero(3);
        for (int64_t slab = 0; slab < slabs; slab++) {
            _tile_loadd(4, k + slab * 32, d * 2);
            _tile_loadd(6, w->query_pairs + slab * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (tiles > 1) {
                _tile_loadd(7, w->query_pairs + (slabs + slab) * 256, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (tiles > 2) {
                _tile_loadd(6, w->query_pairs + (2 * slabs + slab) * 256, 64);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (tiles > 3) {
                _tile_loadd(7, w->query_pairs + (3 * slabs + slab) * 256, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
        }
        _tile_stored(0, scores + g * across, across * 4);
        if (tiles > 1) _tile_stored(1, scores + g * across + 16, across * 4);
        if (tiles > 2) _tile_stored(2, scores + g * across + 32, across * 4);
        if (tiles > 3) _tile_stored(3, scores + g * across + 48, across * 4);
    }
    const float log2_scale = scale * 1.44269504088896341f;
    for (int64_t t = 0; t < tiles; t++) {
        int32_t seen[16] __attribute__((aligned(64)));  /* the keys each row sees in the chunk */
        int64_t most_seen = 0;
        for (int64_t i = 0; i < 16; i++) {
            const int64_t r = t * 16 + i;
            int64_t visible = n;
            if (r < count && x->causal_from >= 0) {
                const int64_t last = x->causal_from + (r0 + r) % x->count - t0;
                visible = last < 0 ? 0 : (last + 1 < n ? last + 1 : n);
            }
            seen[i] = (int32_t)visible;
            most_seen = visible > most_seen ? visible : most_seen;
        }
        const __m512i visible = _mm512_load_si512(seen);
        const float *column = scores + t * 16;
        const int whole = x->causal_from < 0;  /* every row sees every key */
        const int64_t rows = count - t * 16 < 16 ? count - t * 16 : 16;
        const __mmask16 valid = (__mmask16)((1u << rows) - 1);
        const __m512 factor = _mm512_set1_ps(log2_scale);
        /* As in attend_block, rows that have all seen keys in the chunks before take the max they hold (scaled) for
           this chunk's exponentials instead of finding the chunk's own, unless a sum then passes 2^64 (or
           overflows): one pass over the scores fewer. */
        __m512 top = _mm512_setzero_ps(), total = _mm512_setzero_ps();
        int from_held = held != NULL;
        if (from_held) {
            top = _mm512_maskz_loadu_ps(valid, held + t * 16);
            from_held = !_mm512_mask_cmp_ps_mask(valid, top, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
        }
        if (from_held) {
            total = few_exponentials(w, column, across, whole, visible, factor,
                                     _mm512_mul_ps(top, _mm512_set1_ps(-1.44269504088896341f)), t, blocks, ahead);
            from_held = !_mm512_mask_cmp_ps_mask(valid, total, _mm512_set1_ps(0x1p64f), _CMP_NLT_UQ);
        }
        if (!from_held) {
            __m512 tops[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                              _mm512_set1_ps(-INFINITY)};
            if (whole)
                for (int64_t j = 0; j < n; j += 4)
                    for (int u = 0; u < 4; u++)
                        tops[u] = _mm512_max_ps(tops[u], _mm512_load_ps(column + (j + u) * across));
            else
                for (int64_t j = 0; j < most_seen; j++) {
                    const __mmask16 sees = _mm512_cmpgt_epi32_mask(visible, _mm512_set1_epi32((int)j));
                    tops[j & 3] =
                        _mm512_mask_max_ps(tops[j & 3], sees, tops[j & 3], _mm512_load_ps(column + j * across));
                }
            const __m512 most = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
            const __mmask16 any = _mm512_cmpgt_epi32_mask(visible, _mm512_setzero_si512());
            top = _mm512_mul_ps(most, _mm512_set1_ps(scale));
            total = few_exponentials(w, column, across, whole, visible, factor,
                                     _mm512_maskz_mul_ps(any, most, _mm512_set1_ps(-log2_scale)), t, blocks, ahead);
        }
        float tops_out[16] __attribute__((aligned(64))), totals[16] __attribute__((aligned(64)));
        _mm512_store_ps(tops_out, top);
        _mm512_store_ps(totals, total);
        for (int64_t i = 0; i < rows; i++) {
            w->max[t * 16 + i] = seen[i] ? tops_out[i] : -INFINITY;
            w->sum[t * 16 + i] = seen[i] ? totals[i] : 0.0f;
        }
    }
    outputs_few(w, tiles, d, ahead);
}
#endif

/* The largest of a row's first `visible` scores. Four running maxima, not one chain of 16 that the exponentials wait
   for: 432 prompt rows over a 4k prefix took 7% less time. */
static inline float row_max(const float *row, int64_t visible) {
    const int64_t whole = visible / 16 * 16;
    __m512 tops[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                      _mm512_set1_ps(-INFINITY)};
    int64_t i = 0;
    for (; i + 64 <= whole; i += 64)
        for (int j = 0; j < 4; j++) tops[j] = _mm512_max_ps(tops[j], _mm512_load_ps(row + i + 16 * j));
    for (; i < whole; i += 16) tops[0] = _mm512_max_ps(tops[0], _mm512_load_ps(row + i));
    __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
    const __mmask16 tail = (__mmask16)((1u << (visible - whole)) - 1);
    if (tail) top = _mm512_mask_max_ps(top, tail, top, _mm512_load_ps(row + whole));
    return _mm512_reduce_max_ps(top);
}

/* 2^(score x factor + shift) of a row's first `visible` scores, as bfloat16 probabilities (0 past them, to `padded`);
   returns their sum. */
static inline float exponentials(const float *row, int64_t visible, int64_t padded, __m512 factor, __m512 shift,
                                 uint16_t *probabilities) {
    const __mmask16 tail = (__mmask16)((1u << (visible % 16)) - 1);
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += 32) {
        __m512 e[2];
        for (int j = 0; j < 2; j++) {
            const int64_t at = i + 16 * j;
            if (at + 16 <= visible) e[j] = exp2_bf16_512(_mm512_fmadd_ps(_mm512_load_ps(row + at), factor, shift));
            else if (at < visible)
                e[j] = _mm512_maskz_mov_ps(tail, exp2_bf16_512(_mm512_fmadd_ps(_mm512_load_ps(row + at), factor, shift)));
            else e[j] = _mm512_setzero_ps();
        }
        total = _mm512_add_ps(total, _mm512_add_ps(e[0], e[1]));
        _mm512_store_si512(probabilities + i, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    return _mm512_reduce_add_ps(total);
}

/* Attend grouped rows [r0, r0 + count) of KV head h (count at most ROWS) to the n packed keys, the chunk's from key
   t0 on: into w->out, w->max and w->sum (-infinity and 0 for a row that sees none of them). The next chunk is asked
   for a share at a time: on AMX with each step of the scores and each row's exponentials (16 decoding streams over a
   7k prefix, attention_bench.py's case, SmolLM2's 30 layers, 2 cores with AMX, took 14.7 ms against 17.1 when it was
   asked for all at once as the block began: the products then waited for it); without AMX by each pass of the
   products, a line of each a step. On the dot products of the Zen 4 EPYC the rows' exponentials had asked for three
   quarters of it for 8 decoding streams, and a build that left their arithmetic out took no less time: asked for
   through the products instead, SmolLM2's 30 layers over a 4k prefix took 0.86x to 0.88x the time for 8 streams,
   0.94x for one and 0.97x for 16 (attention_bench.py --from-memory --against, the builds in turn in one process), and
   compiled steps on it 0.94x for 8 streams and 0.98x for one and for 16 (step_bench.py --attention-against). */
static void attend_block(const rows_of *x, int64_t h, int64_t r0, int64_t count, int64_t t0, int64_t n, int64_t d,
                         float scale, scratch *w, ahead_of *ahead, const float *held) {
    const int64_t tiles = (count + 15) / 16, padded = (n + 31) / 32 * 32, blocks = padded / 32;
    /* the shares on AMX: a step of the scores and a row's exponentials; with the keys in place, a step of the scores,
       a block of a tile's exponentials and a block of a pass of the outputs; without AMX, each pass of the products */
#if AMX
    const int64_t calls = w->in_place ? (KEYS / 16 + (tiles + d / few_width(tiles)) * (KEYS / 32))
                                      : padded / SCORE_KEYS + count;
#else
    const int64_t calls = passes(count, blocks, d);
    w->ahead = ahead;
#endif
    ahead->step = ((ahead->bytes - ahead->at) / 64 + calls - 1) / calls;
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = r0 + i;
        memcpy(w->queries + i * d, x->q + head_of(x, h, r) * x->q_head + r % x->count * x->q_row, sizeof(uint16_t) * d);
    }
    memset(w->queries + count * d, 0, sizeof(uint16_t) * (tiles * 16 - count) * d);
#if ON_FMA
    widen(w->queries, count * d, w->float_queries);
#endif
#if AMX
    if (w->in_place) {
        attend_few(x, r0, count, t0, d, scale, w, ahead, held);
        return;
    }
#endif
    scores(w, count, tiles, padded, d, ahead);
    /* Each row's max and sum of exponentials; probabilities past the last key it sees are 0. Rows past `count` are
       left as they are: their output rows are never read. Exponentials in base 2, the scale folded in. A row that has
       seen keys in the chunks before (`held`: its running max, scaled, or -infinity) takes that max for this chunk's
       instead of finding it: exponentials past 1 are fine (bfloat16 has float32's range, and the merge weighs the
       chunk by it), unless a score rises so far past it that their sum passes 2^64 (or overflows): then the chunk's
       own max, found after all. 224 prompt rows over a 4k prefix (SmolLM2's 30 layers, 2 cores with AMX) took 11% less
       time without the pass that finds it. */
    const float log2_scale = scale * 1.44269504088896341f;
    const __m512 factor = _mm512_set1_ps(log2_scale);
    for (int64_t r = 0; r < count; r++) {
        if (AMX) fetch_some(ahead);
        const float *row = w->scores + r * SCORE_ROW;
        uint16_t *probabilities = w->probabilities + r * KEYS;
        int64_t visible = n;  /* the keys this row sees in the chunk */
        if (x->causal_from >= 0) {
            const int64_t last = x->causal_from + (r0 + r) % x->count - t0;  /* its last key, from the chunk's first */
            visible = last < 0 ? 0 : (last + 1 < n ? last + 1 : n);
        }
        if (visible == 0) {
            memset(probabilities, 0, sizeof(uint16_t) * padded);
            w->max[r] = -INFINITY;
            w->sum[r] = 0.0f;
            continue;
        }
        float total = INFINITY;
        if (held && held[r] != -INFINITY) {
            w->max[r] = held[r];
            total = exponentials(row, visible, padded, factor, _mm512_set1_ps(-held[r] * 1.44269504088896341f),
                                 probabilities);
        }
        if (!(total < 0x1p64f)) {
            const float most = row_max(row, visible);
            w->max[r] = most * scale;
            total = exponentials(row, visible, padded, factor, _mm512_set1_ps(-most * log2_scale), probabilities);
        }
        w->sum[r] = total;
    }
#if ON_FMA
    for (int64_t r = 0; r < count; r++) widen(w->probabilities + r * KEYS, padded, w->float_probabilities + r * KEYS);
#endif
    outputs(w, count, tiles, blocks, d);
}

/* Merge a block's output into an item's running one (rows [0, count), each acc row `d` floats, then `max` and `sum`
   `rows` floats apart). The weights of 16 rows at a time. */
static void merge_block(const scratch *w, int64_t count, int64_t d, float *acc, float *max, float *sum) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), floor = _mm512_set1_ps(-200.0f);
    for (int64_t r0 = 0; r0 < count; r0 += 16) {
        const __mmask16 rows = count - r0 >= 16 ? 0xffff : (__mmask16)((1u << (count - r0)) - 1);
        const __m512 held = _mm512_maskz_loadu_ps(rows, max + r0), block = _mm512_maskz_loadu_ps(rows, w->max + r0);
        const __m512 most = _mm512_max_ps(held, block);
        /* A row that has seen no key yet (max -infinity) keeps nothing of what it holds, and gives nothing. */
        const __mmask16 seen = _mm512_mask_cmp_ps_mask(rows, most, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 old = _mm512_maskz_mov_ps(seen, exp2_512(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(held, most), log2e), floor)));
        const __m512 new = _mm512_maskz_mov_ps(seen, exp2_512(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(block, most), log2e), floor)));
        const __m512 total = _mm512_fmadd_ps(old, _mm512_maskz_loadu_ps(rows, sum + r0),
                                             _mm512_mul_ps(new, _mm512_maskz_loadu_ps(rows, w->sum + r0)));
        _mm512_mask_storeu_ps(max + r0, rows, most);
        _mm512_mask_storeu_ps(sum + r0, rows, total);
        float olds[16] __attribute__((aligned(64))), news[16] __attribute__((aligned(64)));
        _mm512_store_ps(olds, old);
        _mm512_store_ps(news, new);
        const int64_t n = count - r0 < 16 ? count - r0 : 16;
        for (int64_t i = 0; i < n; i++) {
            float *row = acc + (r0 + i) * d;
            const float *part = w->out + (r0 + i) * d;
            const __m512 a = _mm512_set1_ps(olds[i]), b = _mm512_set1_ps(news[i]);
            for (int64_t x = 0; x < d; x += 16)
                _mm512_storeu_ps(row + x, _mm512_fmadd_ps(a, _mm512_loadu_ps(row + x), _mm512_mul_ps(b, _mm512_loadu_ps(part + x))));
        }
    }
}

/* A held output row (bfloat16) as float32, into `to`. */
static inline void load_held(const elem *held, float *to, int64_t d) {
    for (int64_t c = 0; c < d; c += 16)
        _mm512_store_ps(to + c, _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(held + c))), 16)));
}

/* `from` times `factor` into a held output row, rounded to bfloat16 (to nearest, ties to even). */
static inline void store_held(const float *from, float factor, elem *held, int64_t d) {
    const __m512 f = _mm512_set1_ps(factor);
    for (int64_t c = 0; c < d; c += 16)
        _mm256_storeu_si256((__m256i *)(held + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(from + c), f)));
}
