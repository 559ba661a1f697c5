/* A packed step's attention on x86 CPUs: see cpu_attention.py. Built one of two ways: for bfloat16 on AVX-512 BF16 (and
   AMX where there is), or with -DFLOAT32 for float32 on AVX2 and FMA (or AVX-512); the inner parts of each are in
   cpu_attention_bf16.h and cpu_attention_f32.h, the call and its sharing out of work here.

   A call attends parts (each request's rows over its own positions, or all readers' rows over a shared prefix), its
   work shared out by part, KV head and run of keys. Each item takes 256 keys at a time (packed for the products
   where a build's products need it, read in place where they do not), so that every key comes from memory once a
   call, then attends the part's query rows to them, fetching the next 256 meanwhile (or the first of the thread's
   next item): scores in float32, softmax in float32 (exponentials in base 2, the scale folded in), then the
   probabilities times V. A row sees every key, or causally those up to its own position. An item keeps an
   unnormalised output, the max of the scores and the sum of their exponentials for each row; at the end they merge
   across items and into the attention the caller holds over other keys, by log-sum-exp. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ROWS 64   /* query rows attended together */
#define KEYS 256  /* keys packed together */
#define MAX_DIM 256
#define MAX_RUNS 8  /* runs of keys per KV head at most: each run's output is held until the end of the call */

#if FLOAT32
typedef float elem;
#define DIM_MULTIPLE 16  /* the float32 products run 16 columns at a time */
#else
typedef uint16_t elem;  /* bfloat16's bits */
#define DIM_MULTIPLE 64  /* the bfloat16 products run 64 columns at a time */
#endif

/* 2^f for f in [-1/2, 1/2] to float32 precision: a polynomial's coefficients, highest degree first (each build's
   exponentials: 2^t is 2^round(t) times this at t - round(t)). */
static const float EXP2_POLYNOMIAL[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.618129107628477e-3f,
                                         5.550410866482158e-2f,  2.402265069591007e-1f,  6.931471805599453e-1f, 1.0f};

/* Where the queries, outputs and log-sum-exps are: row p of query head h at base + h * head + p * row (elements). */
typedef struct {
    const elem *q;
    elem *out;
    float *lse;
    int64_t q_head, q_row, out_head, out_row, lse_head, lse_row;
    int64_t groups, count;  /* query heads per KV head, and rows per query head */
    int64_t causal_from;    /* -1: every row sees every key; else row p sees keys [0, causal_from + p] */
} rows_of;

/* Query row i of KV head h's grouped rows (query head h * groups + i / count, position i % count). */
static inline int64_t head_of(const rows_of *x, int64_t h, int64_t i) { return h * x->groups + i / x->count; }

/* The next chunk's keys and values on their way to the cache while this chunk is attended. `take_ahead` hands one
   product its share, `step` lines (64 bytes) of each, to ask for as it runs: spread so, they arrive while the products
   run, where asked for in bursts they held up the products' own loads. The float32 products ask for theirs into the
   nearest cache one line a step; bfloat16 into the second-level cache, where the chunk is packed or read from (the
   nearest would not hold them beside what the block reads): on AMX a share at a time (`fetch_some`), without it each
   pass of the products a line of each a step. */
typedef struct {
    const char *k, *v;
    int64_t at, bytes, step;  /* bytes asked for so far, of `bytes` of each; lines a product asks for */
} ahead_of;

/* Set `k` and `v` to the lines one product asks for, and return how many (of each) they are. */
static inline int64_t take_ahead(ahead_of *ahead, const char **k, const char **v) {
    const int64_t left = (ahead->bytes - ahead->at) / 64, lines = left < ahead->step ? left : ahead->step;
    *k = ahead->k + ahead->at;
    *v = ahead->v + ahead->at;
    ahead->at += lines * 64;
    return lines;
}

static inline void fetch_some(ahead_of *ahead) {
    const char *k, *v;
    const int64_t lines = take_ahead(ahead, &k, &v);
    for (int64_t i = 0; i < lines; i++) {
        _mm_prefetch(k + i * 64, _MM_HINT_T1);
        _mm_prefetch(v + i * 64, _MM_HINT_T1);
    }
}

#if defined(__AVX512F__)  /* every build but float32's AVX2 one */
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
#endif

/* Each defines the scratch of a thread, pack (a chunk's keys and values made ready), attend_block (which also sees
   the next chunk fetched), merge_block (a block's output merged into an item's running one), load_held and
   store_held (an output row the caller holds, as float32 and back), and the AMX tile calls. */
#if FLOAT32
#include "cpu_attention_f32.h"
#else
#include "cpu_attention_bf16.h"
#endif

/* Keep a block's output as an item's running one: the first block of its rows (see merge_block). */
static void keep_block(const scratch *w, int64_t count, int64_t d, float *acc, float *max, float *sum) {
    memcpy(acc, w->out, sizeof(float) * count * d);
    memcpy(max, w->max, sizeof(float) * count);
    memcpy(sum, w->sum, sizeof(float) * count);
}

static __thread scratch *thread_scratch;  /* each thread's, kept for its next call */
static __thread float *thread_parts;      /* the calling thread's items' running outputs */
static __thread int64_t thread_parts_size;

/* One part of a call: query rows [first, first + count) of every query head, attended to their own keys and values
   ([kv_heads, tokens, d], KV heads `stride` elements apart; layer 0's at addresses k and v, each next layer's
   `layer_bytes` further). With causal_from -1 every row sees every key; otherwise row p sees keys [0, causal_from + p]
   (a prompt's new tokens after causal_from others); with causal_from TILED every row sees every key, and the keys and
   values lie as a build with TILES packs them for its products, 32 positions at a time (tokens a multiple of 32). Eight
   int64 from the caller, laid out once for a step's layers. */
typedef struct {
    int64_t first, count, k, v, layer_bytes, stride, tokens, causal_from;
} part_plan;
#define TILED (-2)

typedef struct {  /* where a part's work and results are, and the stage it merges in */
    int64_t items, splits, chunks, first_item, parts_at, first_row, stage;
} part_place;

/* Item `item` of a part (one of its items): its KV head's keys and values in layer `layer`, and its chunks [first,
   last). */
typedef struct {
    const elem *k, *v;
    int64_t h, first, last;
} item_span;

static item_span span_of(const part_plan *pp, const part_place *at, int64_t item, int64_t layer) {
    const int64_t h = (item - at->first_item) / at->splits, split = (item - at->first_item) % at->splits;
    return (item_span){(const elem *)(intptr_t)(pp->k + layer * pp->layer_bytes) + h * pp->stride,
                       (const elem *)(intptr_t)(pp->v + layer * pp->layer_bytes) + h * pp->stride, h,
                       at->chunks * split / at->splits, at->chunks * (split + 1) / at->splits};
}

/* Chunk c of a part's keys and values (from k and v, `tokens` in all) as the next to fetch. */
static ahead_of chunk_ahead(const elem *k, const elem *v, int64_t c, int64_t tokens, int64_t d) {
    const int64_t t0 = c * KEYS, n = tokens - t0 < KEYS ? tokens - t0 : KEYS;
    return (ahead_of){(const char *)(k + t0 * d), (const char *)(v + t0 * d), 0, n * d * (int64_t)sizeof(elem), 0};
}

/* 1: a call's parts may read the same rows, merging in stages (see prefixgate_attend_parts). */
int prefixgate_merges_in_stages(void) { return 1; }

/* 1 where parts may come tiled (this build has TILES), else 0. */
int prefixgate_takes_tiles(void) { return TILES; }

/* Lay `layers` layers of `heads` KV heads of `tokens` positions (a multiple of 32) out as a tiled part lies
   (`to_tiles` 1), or back into rows of d (0): from `from` into `to`, where each next layer, the values after the keys
   and each next KV head lie `layer`, `values` and `head` elements further (from[0] to[0], from[1] to[1] and so on: the
   strides of each). Returns 0, -1 where this build takes no tiled parts. */
int prefixgate_lay_out(const elem *from, elem *to, int64_t layers, int64_t heads, int64_t tokens, int64_t d,
                       const int64_t *strides, int to_tiles) {
#if TILES
    for (int64_t l = 0; l < layers; l++)
        for (int64_t h = 0; h < heads; h++) {
            const elem *k = from + l * strides[0] + h * strides[4];
            elem *t = to + l * strides[1] + h * strides[5];
            if (to_tiles) lay_out_tiles(k, k + strides[2], t, t + strides[3], tokens, d);
            else lay_out_rows(k, k + strides[2], t, t + strides[3], tokens, d);
        }
    return 0;
#else
    (void)from, (void)to, (void)layers, (void)heads, (void)tokens, (void)d, (void)strides, (void)to_tiles;
    return -1;
#endif
}

/* Attend the parts' query rows to their keys and values in layer `layer` and merge that, by log-sum-exp, into the
   attention over other keys the caller holds in `out` and `lse`, in place. Query head j reads KV head j / groups;
   queries and out are rows of d contiguous elements (`elem`), lse float32, each placed by its strides (in elements);
   keys and values rows of d contiguous elements. A held lse of -infinity holds nothing: out is then only written. With new_k and
   new_v (the step's new keys and values, placed by their strides, rows as the queries'), a causal part first has its
   rows' new keys and values written at positions [causal_from, causal_from + count). A part may read rows an earlier
   part reads (a step's shared prefix, read by rows that also attend their own keys): it merges after that one, as if
   called after it (the same bits). All parts run in one parallel region, their items of work shared out as threads
   come free, and merge stage by stage. Returns 0, -1 for sizes it does not take, -2 when memory ran out (nothing
   attended then). */
int prefixgate_attend_parts(const elem *q, int64_t q_head, int64_t q_row, elem *out, int64_t out_head,
                            int64_t out_row, float *lse, int64_t lse_head, int64_t lse_row, const elem *new_k,
                            int64_t new_k_head, int64_t new_k_row, const elem *new_v, int64_t new_v_head,
                            int64_t new_v_row, int64_t kv_heads, int64_t groups, int64_t d, float scale,
                            int64_t layer, int64_t count, const int64_t *plans) {
    if (d % DIM_MULTIPLE || d > MAX_DIM || groups < 1 || kv_heads < 1 || count < 1 || layer < 0) return -1;
    const part_plan *plan = (const part_plan *)plans;
    part_place *place = malloc(sizeof(part_place) * count);
    if (!place) return -2;
    /* Each KV head's keys in as few runs as give every thread the same number of a part's items: a run's first chunk
       comes from memory unfetched and each run is merged at the end, so more runs cost more than they balance. */
    const int64_t threads = omp_get_max_threads();
    int64_t common = threads, rest = kv_heads;  /* their greatest common divisor */
    while (rest) {
        const int64_t r = common % rest;
        common = rest;
        rest = r;
    }
    /* the fewest with kv_heads * runs a multiple of the threads, within the bound on what the call holds */
    const int64_t runs = threads / common < MAX_RUNS ? threads / common : MAX_RUNS;
    int64_t items = 0, floats = 0, merged_rows = 0, stage = 0, low = 0, high = 0;  /* [low, high): the stage's rows */
    for (int64_t p = 0; p < count; p++) {
        const part_plan *x = plan + p;
        if (x->tokens < 1 || x->count < 1 || x->causal_from >= x->tokens ||
            (new_k && x->causal_from >= 0 && x->causal_from + x->count > x->tokens) ||
            (x->causal_from == TILED && (!TILES || x->tokens % 32))) {
            free(place);
            return -1;
        }
        const int64_t chunks = (x->tokens + KEYS - 1) / KEYS, splits = chunks < runs ? chunks : runs;
        const int64_t end = x->first + x->count;
        if (p > 0 && x->first < high && low < end) {  /* rows within the span of this stage's: the next stage */
            stage++;
            low = x->first, high = end;
        } else {
            low = p > 0 && low < x->first ? low : x->first;
            high = high > end ? high : end;
        }
        place[p] = (part_place){kv_heads * splits, splits, chunks, items, floats, merged_rows, stage};
        items += kv_heads * splits;
        floats += kv_heads * splits * groups * x->count * (d + 2);
        merged_rows += kv_heads * groups * x->count;
    }
    if (thread_parts_size < floats) {
        free(thread_parts);
        thread_parts = malloc(sizeof(float) * floats);
        thread_parts_size = thread_parts ? floats : 0;
        if (!thread_parts) {
            free(place);
            return -2;
        }
    }
    float *parts = thread_parts;
    int failed = 0;
    int64_t claimed = 0;  /* items handed out */
#pragma omp parallel
    {
        if (!thread_scratch) thread_scratch = aligned_alloc(64, sizeof(scratch));
        scratch *w = thread_scratch;
        if (w) configure_tiles();
        else {
#pragma omp atomic write
            failed = 1;
        }
        if (new_k) {
#pragma omp for schedule(static)
            for (int64_t ph = 0; ph < count * kv_heads; ph++) {
                const part_plan *pp = plan + ph / kv_heads;
                const int64_t h = ph % kv_heads;
                if (pp->causal_from < 0) continue;
                elem *k = (elem *)(intptr_t)(pp->k + layer * pp->layer_bytes) + h * pp->stride + pp->causal_from * d;
                elem *v = (elem *)(intptr_t)(pp->v + layer * pp->layer_bytes) + h * pp->stride + pp->causal_from * d;
                for (int64_t i = 0; i < pp->count; i++) {
                    memcpy(k + i * d, new_k + h * new_k_head + (pp->first + i) * new_k_row, sizeof(elem) * d);
                    memcpy(v + i * d, new_v + h * new_v_head + (pp->first + i) * new_v_row, sizeof(elem) * d);
                }
            }  /* a barrier: every part's keys are written before any is read */
        }
        /* Items go to threads as they come free, each thread told its next item as it starts one, so that while it
           attends an item's last chunk it fetches the next item's first. With OpenMP's dynamic schedule, where a
           thread learns its next item only as it asks for it, SmolLM2's decode steps of 8 and 16 streams took 2 to 6 %
           more time, short or on a shared 4k prefix (the two builds in turn in one process, bfloat16 on AMX). */
        int64_t item = w ? __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED) : items;
        int64_t p = 0, next_p = 0;  /* the parts of this thread's item and next item: they come in increasing order */
        while (item < items) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            while (place[p].first_item + place[p].items <= item) p++;
            const part_plan *pp = plan + p;
            const part_place *at = place + p;
            const rows_of x = {q + pp->first * q_row, out + pp->first * out_row, lse + pp->first * lse_row, q_head,
                               q_row, out_head, out_row, lse_head, lse_row, groups, pp->count, pp->causal_from};
            const int64_t rows = groups * pp->count, stride = rows * (d + 2);
            const item_span span = span_of(pp, at, item, layer);
            const int64_t h = span.h, first = span.first, last = span.last;
            const elem *k = span.k, *v = span.v;
            float *acc = parts + at->parts_at + (item - at->first_item) * stride, *max = acc + rows * d, *sum = max + rows;
            for (int64_t c = first; c < last; c++) {
                const int64_t t0 = c * KEYS, n = pp->tokens - t0 < KEYS ? pp->tokens - t0 : KEYS;
                pack(k + t0 * d, v + t0 * d, n, d, rows, pp->causal_from == TILED, w);
                ahead_of ahead = {0};
                if (c + 1 < last) ahead = chunk_ahead(k, v, c + 1, pp->tokens, d);
                else if (next < items) {
                    next_p = next_p > p ? next_p : p;
                    while (place[next_p].first_item + place[next_p].items <= next) next_p++;
                    const item_span following = span_of(plan + next_p, place + next_p, next, layer);
                    ahead = chunk_ahead(following.k, following.v, following.first, plan[next_p].tokens, d);
                }
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                    const int64_t block = rows - r0 < ROWS ? rows - r0 : ROWS;
                    attend_block(&x, h, r0, block, t0, n, d, scale, w, &ahead, c == first ? NULL : max + r0);
                    if (c == first) keep_block(w, block, d, acc + r0 * d, max + r0, sum + r0);
                    else merge_block(w, block, d, acc + r0 * d, max + r0, sum + r0);
                }
            }
            item = next;
        }
#pragma omp barrier
        if (w) release_tiles();  /* past the barrier: `failed` is final */
        /* Stage by stage (the parts on rows an earlier part reads come in a later stage): each `omp for` ends in a
           barrier, so that a stage's rows merge into what the stage before left there, as a call of their own would. */
        for (int64_t begin = 0, end; !failed && begin < count; begin = end) {
            for (end = begin + 1; end < count && place[end].stage == place[begin].stage; end++) {}
            const int64_t last_row = end < count ? place[end].first_row : merged_rows;
            int64_t p = begin;
#pragma omp for schedule(static)
            for (int64_t row = place[begin].first_row; row < last_row; row++) {
                while (place[p].first_row + kv_heads * groups * plan[p].count <= row) p++;
                const part_plan *pp = plan + p;
                const part_place *at = place + p;
                const rows_of x = {q + pp->first * q_row, out + pp->first * out_row, lse + pp->first * lse_row,
                                   q_head, q_row, out_head, out_row, lse_head, lse_row, groups, pp->count, -1};
                const int64_t rows = groups * pp->count, stride = rows * (d + 2), splits = at->splits;
                const int64_t h = (row - at->first_row) / rows, r = (row - at->first_row) % rows;
                const int64_t head = head_of(&x, h, r), position = r % pp->count;
                const float *base = parts + at->parts_at + h * splits * stride;
                /* The caller's attention over its other keys is one more part, already normalised. */
                float *held_lse = x.lse + head * lse_head + position * lse_row;
                elem *held = x.out + head * out_head + position * out_row;
                float most = *held_lse;
                for (int64_t s = 0; s < splits; s++) most = fmaxf(most, base[s * stride + rows * d + r]);
                /* held -infinity: nothing held, and `held` is not read (it may be uninitialised memory) */
                const float own = *held_lse == -INFINITY ? 0.0f : expf(*held_lse - most);
                float total = own;
                float merged[MAX_DIM] __attribute__((aligned(64)));
                if (own == 0.0f) memset(merged, 0, sizeof(float) * d);
                else {
                    load_held(held, merged, d);
                    for (int64_t c = 0; c < d; c++) merged[c] *= own;
                }
                for (int64_t s = 0; s < splits; s++) {
                    const float *part = base + s * stride;
                    /* the part's output is unnormalised: weighted by e^(max - most), it counts as its sum says */
                    const float weight = expf(part[rows * d + r] - most);
                    total += weight * part[rows * d + rows + r];
                    for (int64_t c = 0; c < d; c++) merged[c] += weight * part[r * d + c];
                }
                store_held(merged, 1.0f / total, held, d);
                *held_lse = most + logf(total);
            }
        }
    }
    free(place);
    return failed ? -2 : 0;
}