/* Linear layers on x86 CPUs: float32 with AVX2 and FMA, or AVX-512, and bfloat16 with AVX-512 BF16; see
   packed_linear.py. Built as a torch operator, `prefixgate::linear_panels` (at the end), which a step calls with no
   Python between it and the kernel.

   A weight [n, k] is packed once (by packed_linear.py) into panels of 16 output columns, each k rows of 16 floats
   (the weight's rows transposed, zeros past n). A product y[m, n] = x[m, k] W^T runs two panels side by side against
   every row of x, so that each value of x read meets 32 columns: k in chunks of 128 rows of the panels (8 KiB each,
   held in the nearest cache while every few rows of x meet them), up to 12 rows at a time in 24 AVX-512 accumulators
   (or 3 in 12 of AVX2's vectors of 8), the partial outputs kept in a small buffer between chunks. While the first rows
   meet a chunk, the next chunk's lines are asked for, one of each panel a step, so the weight streams from memory as
   the products run. Each output is summed over k in the same order whatever the rows and columns beside it, and
   whichever of the two builds runs. (Meeting one panel at a time, each value of x read fed one FMA, and the loads
   bound the products: SmolLM2's 211 float32 layers on 2 cores of a Xeon took 0.74 of that time for 64 rows two panels
   at a time, the two builds in turn in one process.)

   A weight that is exactly a block code (w = d q + o for each 32 values of k along a row, q a small integer, d a
   half-precision number: what a GGUF file's Q4_1 or Q8_0 weights become as float32) may be packed as its codes
   instead: panels of 16 codes per value of k (int8, or where every code is 0 to 15 two to a byte, column j in the low
   half of byte j and column j + 8 in the high half), and for each 32 values of k the 16 columns' d and o. Each chunk
   is rebuilt as floats in a buffer before the rows meet it, d q + o in one rounding, which is the weight's value to
   the bit (d q is exact in float32), so the products are the float panels' to the bit while a quarter of the bytes,
   or less, come from memory. Where at most 12 rows (3 on AVX2) meet it (a decode step of a few streams), each value
   is rebuilt in registers as the rows meet it instead, the same sums without the buffer.

   A bfloat16 weight is packed as pair panels: for each two values of k, the 16 columns' two weights side by side (64
   bytes, one AVX-512 vector), which AVX-512 BF16's dot product (`vdpbf16ps`) multiplies by a row's two values of x and
   adds to 16 float32 sums at once; the rest runs as for floats, and each output is rounded to bfloat16 once, at the end
   (to nearest, ties to even, as torch rounds). They take at most PAIR_ROWS rows (a decode step of a few streams with
   AMX, up to 64 on dot products without it, every count on FMAs): more go to oneDNN's product on its own layout
   (`mkldnn::_linear_pointwise`, called here as packed_linear.py's Python operator calls it where the kernel does not
   take a layer), the faster there. A bfloat16 weight rounded from block codes may be packed as the codes too, in the
   pair panels' order (bfloat16 code panels): each pair row is rebuilt as float32 and rounded to bfloat16 in registers,
   which is the pair panel's row to the bit; they take up to CODED_PAIR_ROWS rows, the pair panels more, up to
   PAIR_ROWS. Built with AMX, the bfloat16 code panels take AMX_FROM to AMX_MANY rows on its tiles instead
   (amx_coded_linear up to AMX_ROWS, amx_coded_linear_many past them). */

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#define CHUNK 128       /* rows of a panel (values of k) held while every row of x meets them */
#define GROUP 64        /* rows of x a panel meets in one pass: its partial outputs are 64 by 16 floats */
#define BLOCK 32        /* values of k sharing a code's d and o */
/* The most rows a bfloat16 product takes on pair panels; oneDNN's product on its own layout takes more. Built with AMX,
   oneDNN's products run on its tiles and are about as fast at 8 rows (SmolLM2's 211 layers on 2 cores of a Xeon with
   AMX: 26.6 ms against 26.9 in a busy hour, 16.3 against 17.9 in an idle one) and the faster past them (12 rows 30.8
   against 28.4; both measured when a product met one panel at a time). Without AMX they run on AVX-512 BF16's dot
   products, as the pair panels do, and the pair panels are the faster for a whole pass of GROUP rows, about as fast
   past it: on 2 cores of a Xeon without AMX (linear_bench.py's layers, in the same run) 0.59 of oneDNN's time for 8
   rows, 0.74 for 16, 0.95 for 64, 0.99 for 216 and 1.01 for 512. On FMAs (ON_FMA, below) the pair panels are the
   faster at every count, so they take every row: 0.47 of oneDNN's time for 8 rows, 0.54 for 16, 0.64 for 64, 0.66
   for 216 and 0.75 for 512. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAIR_ROWS 8
#elif defined(ON_FMA)
#define PAIR_ROWS INT64_MAX
#else
#define PAIR_ROWS GROUP
#endif
/* The most rows a bfloat16 code panel takes, where the weight has one: rebuilding each pair of weights as the rows
   meet it reads fewer bytes but costs instructions, so it is the faster for few rows and the pair panels for more
   (SmolLM2's 211 layers on 2 cores of the Xeon, in turn: one row 8.9 ms against 12.2, four 11.6 against 14.5, five
   13.2 against 14.9, six 16.2 against 16.1, eight 19.7 against 18.3). */
#define CODED_PAIR_ROWS 5

/* 16 columns of one row: one AVX-512 vector where the build has AVX-512 (-mavx512f), else two AVX2 vectors. Each
   lane's arithmetic is the same in both, so the two builds give the same bits. A product meets two panels at a time:
   with 32 vector registers, AVX-512 accumulates up to 12 rows of them (24 sums); AVX2, with 16, up to 3 (12 vectors
   of 8). */
#if defined(__AVX512F__)
#define MOST_ROWS 12
typedef __m512 row16;
static inline __attribute__((always_inline)) row16 zero16(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) row16 load16(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) void store16(float *p, row16 v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) row16 fma16(float x, row16 b, row16 acc) {
    return _mm512_fmadd_ps(_mm512_set1_ps(x), b, acc);
}
/* The 16 columns' values at row i of a code panel (`half`: two codes to a byte), with the d and o of its block. */
static inline __attribute__((always_inline)) row16 rebuild(const int8_t *codes, const int half, int64_t i, row16 d,
                                                           row16 o) {
    __m512i q;
    if (half) {  /* bytes 0-7 twice: columns 0-7 their low halves, columns 8-15 their high halves */
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(codes + i * 8));
        const __m512i shifts = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
        q = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(bytes, bytes));
        q = _mm512_and_si512(_mm512_srlv_epi32(q, shifts), _mm512_set1_epi32(15));
    } else {
        q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + i * 16)));
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, o);
}
#else
#define MOST_ROWS 3
typedef struct {
    __m256 lo, hi;
} row16;
static inline __attribute__((always_inline)) row16 zero16(void) { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline __attribute__((always_inline)) row16 load16(const float *p) {
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline __attribute__((always_inline)) void store16(float *p, row16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline __attribute__((always_inline)) row16 fma16(float x, row16 b, row16 acc) {
    const __m256 xs = _mm256_set1_ps(x);
    return {_mm256_fmadd_ps(xs, b.lo, acc.lo), _mm256_fmadd_ps(xs, b.hi, acc.hi)};
}
static inline __attribute__((always_inline)) row16 rebuild(const int8_t *codes, const int half, int64_t i, row16 d,
                                                           row16 o) {
    __m256i q0, q1;
    if (half) {  /* column j in the low half of byte j, column j + 8 in its high half */
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i * 8)));
        q0 = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
        q1 = _mm256_srli_epi32(bytes, 4);
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(codes + i * 16));
        q0 = _mm256_cvtepi8_epi32(q);
        q1 = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q));
    }
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), d.lo, o.lo), _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), d.hi, o.hi)};
}
#endif

/* A call of f(..., rows, ...) with `rows` (1 to MOST_ROWS) a constant, so each count's loops unroll. */
#if MOST_ROWS > 3
#define ROWS_ABOVE_3(f, ...)                  \
    case 12: f(__VA_ARGS__, 12); break;       \
    case 11: f(__VA_ARGS__, 11); break;       \
    case 10: f(__VA_ARGS__, 10); break;       \
    case 9: f(__VA_ARGS__, 9); break;         \
    case 8: f(__VA_ARGS__, 8); break;         \
    case 7: f(__VA_ARGS__, 7); break;         \
    case 6: f(__VA_ARGS__, 6); break;         \
    case 5: f(__VA_ARGS__, 5); break;         \
    case 4: f(__VA_ARGS__, 4); break;
#else
#define ROWS_ABOVE_3(f, ...)
#endif
#define WITH_ROWS(rows, f, ...)               \
    switch (rows) {                           \
    ROWS_ABOVE_3(f, __VA_ARGS__)              \
    case 3: f(__VA_ARGS__, 3); break;         \
    case 2: f(__VA_ARGS__, 2); break;         \
    case 1: f(__VA_ARGS__, 1); break;         \
    default: break;                           \
    }

/* Where a product finds the second of the two panels it meets, and what it asks for meanwhile: the second panel's chunk
   `apart` bytes past the first's (0 where a weight's last panel has no other beside it and is met twice), for code
   panels its d and o `scales_apart` floats past the first's; and `lines` lines (64 bytes) of the next chunk of each,
   at `next` and `next_apart` bytes on, one of each a step (`next_apart` 0: of the first alone). */
struct two_panels {
    int64_t apart, scales_apart;
    const char *next;
    int64_t next_apart, lines;
};

static inline __attribute__((always_inline)) void ask(const two_panels &w, int64_t i) {
    if (i < w.lines) {
        _mm_prefetch(w.next + i * 64, _MM_HINT_T0);
        if (w.next_apart) _mm_prefetch(w.next + w.next_apart + i * 64, _MM_HINT_T0);
    }
}

/* The sums of `rows` rows for two panels: the first's rows 16 floats apart in c, the second's from c + GROUP * 16. */
static inline __attribute__((always_inline)) void load_sums(row16 acc[2][MOST_ROWS], const float *c, int add,
                                                            const int rows) {
    for (int q = 0; q < 2; q++)
        for (int r = 0; r < rows; r++) acc[q][r] = add ? load16(c + q * GROUP * 16 + r * 16) : zero16();
}
static inline __attribute__((always_inline)) void store_sums(float *c, row16 acc[2][MOST_ROWS], const int rows) {
    for (int q = 0; q < 2; q++)
        for (int r = 0; r < rows; r++) store16(c + q * GROUP * 16 + r * 16, acc[q][r]);
}

/* c[rows x 32] = (c if `add`) + a[rows x depth] b[depth x 32] (rows at most MOST_ROWS; a's rows `lda` apart; b two
   panels' chunks, each `depth` rows of 16 floats), so that each value of x read meets 32 columns. */
static inline __attribute__((always_inline)) void product(const float *a, int64_t lda, const float *b,
                                                          const two_panels &w, int64_t depth, float *c, int add,
                                                          const int rows) {
    const float *b2 = (const float *)((const char *)b + w.apart);
    row16 acc[2][MOST_ROWS];
    load_sums(acc, c, add, rows);
    for (int64_t i = 0; i < depth; i++) {
        ask(w, i);
        const row16 first = load16(b + i * 16), second = load16(b2 + i * 16);
        for (int r = 0; r < rows; r++) {
            acc[0][r] = fma16(a[r * lda + i], first, acc[0][r]);
            acc[1][r] = fma16(a[r * lda + i], second, acc[1][r]);
        }
    }
    store_sums(c, acc, rows);
}

#if defined(__AVX512BF16__)
/* Each of `rows` rows' products with pair row i of two panels (`pairs`: each panel's 16 columns' two values of k, side
   by side), added to its sums in float32 (`acc`): the second value's product and then the first's, each in one
   rounding, by `vdpbf16ps` (denormals flushed to zero), from the rows' bfloat16 values `lda` apart. */
static inline __attribute__((always_inline)) void add_pairs(__m512 acc[2][MOST_ROWS], const uint16_t *a, int64_t lda,
                                                            int64_t i, const __m512bh pairs[2], const int rows) {
    for (int r = 0; r < rows; r++) {
        int32_t values; /* the row's values of x at k = 2i and 2i + 1, against every column's pair */
        memcpy(&values, a + r * lda + 2 * i, sizeof values);
        const __m512bh xs = (__m512bh)_mm512_set1_epi32(values);
        for (int q = 0; q < 2; q++) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], xs, pairs[q]);
    }
}

#if defined(ON_FMA) && !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
/* Built with -DON_FMA (on Intel's CPUs without AMX, where `vdpbf16ps` does half the multiply-adds a second that FMAs
   do) the pair products run on float32 FMAs instead, the same sums to the bit, as the attention kernel's do there
   (cpu_attention_bf16.h): x's rows widened to float32 once a call, each pair row of the weight as its two float32
   vectors (a shift, a mask), the second's product added and then the first's, each in one rounding. */
#define PAIRS_ON_FMA 1

/* add_pairs() for rows widened to float32, on FMAs. */
static inline __attribute__((always_inline)) void add_pairs(__m512 acc[2][MOST_ROWS], const float *a, int64_t lda,
                                                            int64_t i, const __m512bh pairs[2], const int rows) {
    __m512 first[2], second[2];
    for (int q = 0; q < 2; q++) {
        first[q] = _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)pairs[q], 16));
        second[q] = _mm512_castsi512_ps(_mm512_and_si512((__m512i)pairs[q], _mm512_set1_epi32((int)0xffff0000u)));
    }
    for (int r = 0; r < rows; r++) {
        const __m512 x0 = _mm512_set1_ps(a[r * lda + 2 * i]), x1 = _mm512_set1_ps(a[r * lda + 2 * i + 1]);
        for (int q = 0; q < 2; q++)
            acc[q][r] = _mm512_fmadd_ps(x0, first[q], _mm512_fmadd_ps(x1, second[q], acc[q][r]));
    }
}

/* `count` bfloat16 values as float32, exactly. */
static void widen(const uint16_t *from, int64_t count, float *to) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16)
        _mm512_storeu_ps(to + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(from + i))), 16)));
    for (; i < count; i++) {
        const uint32_t bits = (uint32_t)from[i] << 16;
        memcpy(to + i, &bits, sizeof bits);
    }
}
#else
#define PAIRS_ON_FMA 0
#endif

/* product() in bfloat16: c[rows x 32] = (c if `add`) + a[rows x depth] b[depth x 32], a's rows (bfloat16, or widened
   to float32) `lda` apart, b two panels' chunks of `depth` / 2 pair rows (each two values of k for 16 columns, 64
   bytes), summed in float32 by add_pairs(). */
template <typename X>
static inline __attribute__((always_inline)) void product(const X *a, int64_t lda, const uint16_t *b,
                                                          const two_panels &w, int64_t depth, float *c, int add,
                                                          const int rows) {
    const uint16_t *b2 = (const uint16_t *)((const char *)b + w.apart);
    __m512 acc[2][MOST_ROWS];
    load_sums(acc, c, add, rows);
    for (int64_t i = 0; i < depth / 2; i++) {
        ask(w, i);
        const __m512bh pairs[2] = {(__m512bh)_mm512_loadu_si512(b + i * 32), (__m512bh)_mm512_loadu_si512(b2 + i * 32)};
        add_pairs(acc, a, lda, i, pairs, rows);
    }
    store_sums(c, acc, rows);
}

/* Two values of k (pair row i) of a bfloat16 code panel, as a pair panel holds them: its 32 codes in pair order (column
   j's two at 2j and 2j + 1; int8, or two to a byte: code p in the low half of byte p and code p + 16 in the high half
   of byte p), each rebuilt as decode() rebuilds a float32 weight, d q + o in one rounding, and then rounded to
   bfloat16 (to nearest, ties to even, as torch rounds a float32 weight to bfloat16). `d` and `o`: the 16 columns'
   of the block. */
static inline __attribute__((always_inline)) __m512bh rebuild_pair(const int8_t *codes, const int half, int64_t i,
                                                                   __m512 d, __m512 o) {
    /* each of columns 0 to 7 twice, and of 8 to 15 */
    const __m512i low_columns = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high_columns = _mm512_add_epi32(low_columns, _mm512_set1_epi32(8));
    __m512i low, high;
    if (half) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i * 16)));
        low = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
        high = _mm512_srli_epi32(bytes, 4);
    } else {
        low = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + i * 32)));
        high = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + i * 32 + 16)));
    }
    const __m512 first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_permutexvar_ps(low_columns, d),
                                         _mm512_permutexvar_ps(low_columns, o));
    const __m512 second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_permutexvar_ps(high_columns, d),
                                          _mm512_permutexvar_ps(high_columns, o));
    return _mm512_cvtne2ps_pbh(second, first);
}

/* product() in bfloat16 for a chunk of two bfloat16 code panels: each pair row rebuilt in registers as the pair
   panel's, so the sums are the pair panels' to the bit. */
template <typename X>
static inline __attribute__((always_inline)) void coded_pair_product(const X *a, int64_t lda, const int8_t *codes,
                                                                     const int half, const float *scales,
                                                                     const float *offsets, const two_panels &w,
                                                                     int64_t depth, float *c, int add,
                                                                     const int rows) {
    __m512 acc[2][MOST_ROWS];
    load_sums(acc, c, add, rows);
    for (int64_t i0 = 0; i0 < depth; i0 += BLOCK) {
        const float *d = scales + i0 / BLOCK * 16, *o = offsets + i0 / BLOCK * 16;
        const __m512 ds[2] = {_mm512_loadu_ps(d), _mm512_loadu_ps(d + w.scales_apart)};
        const __m512 os[2] = {_mm512_loadu_ps(o), _mm512_loadu_ps(o + w.scales_apart)};
        for (int64_t i = i0 / 2; i < (i0 + BLOCK) / 2; i++) {
            ask(w, i);
            const __m512bh pairs[2] = {rebuild_pair(codes, half, i, ds[0], os[0]),
                                       rebuild_pair(codes + w.apart, half, i, ds[1], os[1])};
            add_pairs(acc, a, lda, i, pairs, rows);
        }
    }
    store_sums(c, acc, rows);
}

/* The 16 sums of a row rounded to bfloat16 (to nearest, ties to even) after the bias is added, the first `columns`
   written to `out`. */
static inline void round_out(const float *c, const uint16_t *bias, int64_t columns, uint16_t *out) {
    __m512 sums = _mm512_loadu_ps(c);
    if (bias) {
        uint16_t b[16] = {0};
        memcpy(b, bias, columns * sizeof *b);
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16)));
    }
    if (columns == 16) {
        _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(sums));
        return;
    }
    uint16_t rounded[16];
    _mm256_storeu_si256((__m256i *)rounded, (__m256i)_mm512_cvtneps_pbh(sums));
    memcpy(out, rounded, columns * sizeof *out);
}
#endif

/* One chunk of two panels met by `count` rows of x (at most GROUP), in blocks of rows that ask for the lines `w` names:
   a lone block for both panels' next chunks, else the first block for the first panel's and the second for the
   second's. Where the first asked for both, two lines a step, and the second for none, bfloat16 rows on FMAs (2 cores
   of a Xeon without AMX, SmolLM2's 211 layers, their weights from memory, the two builds in turn in one process, three
   runs) took 1.04x to 1.07x as long for 16 to 32 rows and 1.00x to 1.03x for 64 (two runs): the products waited on the
   asking. */
template <typename T, typename B>
static void chunk(const T *x, int64_t k, int64_t count, const B *b, two_panels w, int64_t depth, float *c, int add) {
    /* blocks of rows as even as MOST_ROWS at most allows (16 rows: 8 and 8, not 12 and 4, whose 8 accumulators wait
       on the FMAs' latency) */
    const int64_t blocks = (count + MOST_ROWS - 1) / MOST_ROWS;
    const two_panels both = w;
    for (int64_t i = 0, r = 0; i < blocks; i++) {
        const int64_t rows = count / blocks + (i < count % blocks);
        if (blocks > 1) {
            w.next = both.next + (i == 1 ? both.next_apart : 0);
            w.next_apart = 0;
            w.lines = i < 2 ? both.lines : 0;
        }
        WITH_ROWS(rows, product, x + r * k, k, b, w, depth, c + r * 16, add)
        r += rows;
    }
}

/* b[depth x 16] = the floats of `depth` rows of code panel (depth a multiple of BLOCK), their d and o `scales` and
   `offsets` (16 each per BLOCK rows). */
static inline __attribute__((always_inline)) void decode(const int8_t *codes, const int half, const float *scales,
                                                         const float *offsets, int64_t depth, float *b) {
    for (int64_t i0 = 0; i0 < depth; i0 += BLOCK) {
        const row16 d = load16(scales + i0 / BLOCK * 16), o = load16(offsets + i0 / BLOCK * 16);
        for (int64_t i = i0; i < i0 + BLOCK; i++) store16(b + i * 16, rebuild(codes, half, i, d, o));
    }
}

/* product() for at most MOST_ROWS rows meeting a chunk of two code panels directly: each row of the chunk is rebuilt
   in registers as decode() rebuilds it, so the sums are the same to the bit, without a trip through a buffer. */
static inline __attribute__((always_inline)) void coded_product(const float *a, int64_t lda, const int8_t *codes,
                                                                const int half, const float *scales,
                                                                const float *offsets, const two_panels &w,
                                                                int64_t depth, float *c, int add, const int rows) {
    row16 acc[2][MOST_ROWS];
    load_sums(acc, c, add, rows);
    for (int64_t i0 = 0; i0 < depth; i0 += BLOCK) {
        const float *d = scales + i0 / BLOCK * 16, *o = offsets + i0 / BLOCK * 16;
        const row16 ds[2] = {load16(d), load16(d + w.scales_apart)}, os[2] = {load16(o), load16(o + w.scales_apart)};
        for (int64_t i = i0; i < i0 + BLOCK; i++) {
            ask(w, i);
            const row16 first = rebuild(codes, half, i, ds[0], os[0]);
            const row16 second = rebuild(codes + w.apart, half, i, ds[1], os[1]);
            for (int r = 0; r < rows; r++) {
                acc[0][r] = fma16(a[r * lda + i], first, acc[0][r]);
                acc[1][r] = fma16(a[r * lda + i], second, acc[1][r]);
            }
        }
    }
    store_sums(c, acc, rows);
}

/* A chunk of two code panels met by `count` rows of x, at most MOST_ROWS (`half` a constant where it is inlined). */
template <typename T>
static inline __attribute__((always_inline)) void coded_chunk(const T *x, int64_t k, int64_t count,
                                                              const int8_t *codes, const int half, const float *scales,
                                                              const float *offsets, const two_panels &w, int64_t depth,
                                                              float *c, int add) {
    WITH_ROWS(count, coded_product, x, k, codes, half, scales, offsets, w, depth, c, add)
}

#if defined(__AVX512BF16__)
/* coded_chunk() of two bfloat16 code panels, for rows of bfloat16 or widened to float32. */
template <typename X>
static inline __attribute__((always_inline)) void coded_pair_chunk(const X *x, int64_t k, int64_t count,
                                                                   const int8_t *codes, const int half,
                                                                   const float *scales, const float *offsets,
                                                                   const two_panels &w, int64_t depth, float *c,
                                                                   int add) {
    WITH_ROWS(count, coded_pair_product, x, k, codes, half, scales, offsets, w, depth, c, add)
}
#endif

/* A packed weight [n, k] and its bias, as packed_linear.py lays them out: float panels [n / 16][k][16] (n rounded up
   to 16), or code panels [n / 16][k][16] of `bits` 8 or 4 (then [n / 16][k][8] bytes) with their scales and offsets
   [n / 16][k / BLOCK][16] (k a multiple of BLOCK); or, `bfloat16`, pair panels [n / 16][k / 2][16][2] (k even), and
   where the weight was rounded from codes, bfloat16 code panels [n / 16][k / 2][32] (or [n / 16][k / 2][16] bytes) with
   their scales and offsets as above. The pointers not used, and a missing bias, are NULL. `onednn`: for bfloat16, the
   same weight laid out for oneDNN (its tensor, which the layer keeps), which takes more than PAIR_ROWS rows, and rows
   where the weight has no pair panels; NULL where the pair panels take every count (PAIR_ROWS without a bound). A
   weight takes bfloat16 rows exactly where it has pair panels or oneDNN's layout. */
struct prefixgate_linear_weight {
    int64_t n, k;
    const float *panels;
    const int8_t *codes;
    int64_t bits;
    const float *scales, *offsets;
    const void *bias;
    const uint16_t *pairs;
    c10::TensorImpl *onednn;
};

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_ROWS 64  /* the most rows a product of bfloat16 code panels takes on AMX's tiles: four of 16 */
#define AMX_FROM 2   /* and the fewest: one row of a decode step runs as fast on the code panels of CODED_PAIR_ROWS */
/* Past AMX_ROWS and up to AMX_MANY rows, two panels at a time on the tiles (amx_coded_linear_many); past them oneDNN's
   product, whose blocking of many rows keeps them nearer: SmolLM2's 211 layers took 188 ms for 1,024 rows against 167
   to 173 with oneDNN's, and 87 for 512 against 99 to 101 (linear_bench.py). A prompt's chunk is 512 tokens by default. */
#define AMX_MANY 512
#include <sys/syscall.h>
#include <unistd.h>

/* Whether Linux granted this process AMX's tile state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once as the
   library loads: without it a tile instruction faults. */
static const bool amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Tiles for products of `rows` rows of x (at most AMX_ROWS) by a weight tile: 0 to 3 the sums of 16 rows each, 4 and 5
   rows of x (16, and the rest past a multiple of 16), 6 the weight (16 pair rows of 16 columns). Loading a
   configuration zeroes every tile. */
static void configure_tiles(int64_t rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int64_t shape[7] = {rows, rows - 16, rows - 32, rows - 48, 16, rows % 16, 16};
    for (int t = 0; t < 7; t++) {
        const int64_t r = shape[t] < 0 ? 0 : shape[t] > 16 ? 16 : shape[t];
        config.rows[t] = (uint8_t)r;
        config.bytes_per_row[t] = r ? 64 : 0;
    }
    _tile_loadconfig(&config);
}

/* Rebuild pair rows [i, i + 16) of a panel's bfloat16 codes (a block of 32 values of k; `stride` bytes the 16 codes
   of one value of k) into a tile of 16 pair rows of 16 columns, asking meanwhile for the codes 4 to 8 blocks on (this
   panel's, or the next panel's, which the thread most likely takes next). */
static inline void rebuild_tile(const int8_t *codes, const int half, int64_t stride, const float *scales,
                                const float *offsets, int64_t i, uint16_t *tile) {
    const char *ahead = (const char *)codes + (i + 128) * stride * 2;
    for (int64_t line = 0; line < stride * 32; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    const __m512 d = _mm512_loadu_ps(scales + i / 16 * 16), o = _mm512_loadu_ps(offsets + i / 16 * 16);
    for (int64_t j = 0; j < 16; j++) _mm512_store_si512(tile + j * 32, (__m512i)rebuild_pair(codes, half, i + j, d, o));
}

/* Sums tile `t` (rows 16 t to 16 t + 15) += those rows of x at pair rows [i, i + 16) times the weight tile. */
#define ROW_TILE(t)                                                                         \
    if (16 * (t) + 16 <= rows) {                                                            \
        _tile_loadd(4, x + 16 * (t) * k + 2 * i, k * 2);                                   \
        _tile_dpbf16ps(t, 4, 6);                                                            \
    } else if (16 * (t) < rows) {                                                           \
        _tile_loadd(5, x + 16 * (t) * k + 2 * i, k * 2);                                   \
        _tile_dpbf16ps(t, 5, 6);                                                            \
    }

/* y[m, n] = x[m, k] W^T (+ bias) for up to AMX_ROWS bfloat16 rows of x against the weight's bfloat16 code panels, on
   AMX's tiles: each 32 values of k of a panel rebuilt as the pair panel holds them (rebuild_pair) into a tile of 16
   pair rows of 16 columns (1 KiB, two taken in turn so that one is rebuilt while the other is multiplied), then
   multiplied by the rows' 32 values of k, one instruction per 16 rows. The products read the codes only (SmolLM2:
   115 MB instead of 270), and the matrix units take 16 rows at the cost of one: a decode step of 16 streams costs
   about what one stream's does. Each output is summed over k pair by pair, as oneDNN's product on AMX sums it (the
   same bits for up to 32 rows, measured on SmolLM2's layers), and rounded once. */
static void amx_coded_linear(const struct prefixgate_linear_weight *w, const uint16_t *x, int64_t m, uint16_t *y) {
    const int64_t n = w->n, k = w->k, count = (n + 15) / 16, stride = w->bits * 2, pairs = k / 2, rows = m;
    const int half = w->bits == 4;
#pragma omp parallel
    {
        configure_tiles(rows);
        uint16_t weights[2][16 * 32] __attribute__((aligned(64)));
        float c[AMX_ROWS * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int8_t *codes = w->codes + p * k * stride;
            const float *scales = w->scales + p * k / BLOCK * 16, *offsets = w->offsets + p * k / BLOCK * 16;
            _tile_zero(0);  /* the tiles in use: an empty one may not be touched */
            if (rows > 16) _tile_zero(1);
            if (rows > 32) _tile_zero(2);
            if (rows > 48) _tile_zero(3);
            for (int64_t i = 0; i < pairs; i += 16) {  /* a block of 32 values of k: one tile */
                uint16_t *tile = weights[i / 16 % 2];
                rebuild_tile(codes, half, stride, scales, offsets, i, tile);
                _tile_loadd(6, tile, 64);
                ROW_TILE(0)
                ROW_TILE(1)
                ROW_TILE(2)
                ROW_TILE(3)
            }
            _tile_stored(0, c, 64);
            if (rows > 16) _tile_stored(1, c + 256, 64);
            if (rows > 32) _tile_stored(2, c + 512, 64);
            if (rows > 48) _tile_stored(3, c + 768, 64);
            const int64_t columns = n - p * 16 < 16 ? n - p * 16 : 16;
            for (int64_t r = 0; r < rows; r++)
                round_out(c + r * 16, w->bias ? (const uint16_t *)w->bias + p * 16 : nullptr, columns, y + r * n + p * 16);
        }
        _tile_release();
    }
}

/* Tiles for products of up to 32 rows of x by two panels' weight tiles: 0 and 1 the sums of rows 0 to 15 for the first
   panel and the second, 2 and 3 those of rows 16 to 31, 4 and 5 those rows of x, 6 and 7 the two weight tiles. */
static void configure_two_panels(int64_t rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int64_t first = rows < 16 ? rows : 16, second = rows > 16 ? rows - 16 : 0;
    const int64_t shape[8] = {first, first, second, second, first, second, 16, 16};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)shape[t];
        config.bytes_per_row[t] = shape[t] ? 64 : 0;
    }
    _tile_loadconfig(&config);
}

/* y[m, n] = x[m, k] W^T (+ bias) for more than AMX_ROWS bfloat16 rows of x against the weight's bfloat16 code panels,
   on AMX's tiles: a thread takes two panels at a time, rebuilds each whole once (as amx_coded_linear rebuilds a tile)
   into its part of `panels` (omp_get_max_threads() parts of 2 k / 2 x 32), then multiplies every 32 rows of x by
   both, four sums at a time, so that each tile loaded serves two products. */
static void amx_coded_linear_many(const struct prefixgate_linear_weight *w, const uint16_t *x, int64_t m, uint16_t *y,
                                  uint16_t *panels) {
    const int64_t n = w->n, k = w->k, count = (n + 15) / 16, stride = w->bits * 2, pairs = k / 2;
    const int half = w->bits == 4;
#pragma omp parallel
    {
        uint16_t *rebuilt = panels + omp_get_thread_num() * 2 * pairs * 32;  /* this thread's two panels' tiles */
        int64_t configured = -1;
        float c[2][32 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p0 = 0; p0 < count; p0 += 2) {
            const int both = p0 + 1 < count;
            for (int64_t q = 0; q <= both; q++) {
                const int8_t *codes = w->codes + (p0 + q) * k * stride;
                const float *scales = w->scales + (p0 + q) * k / BLOCK * 16;
                const float *offsets = w->offsets + (p0 + q) * k / BLOCK * 16;
                uint16_t *panel = rebuilt + q * pairs * 32;
                for (int64_t i = 0; i < pairs; i += 16) rebuild_tile(codes, half, stride, scales, offsets, i, panel + i * 32);
            }
            for (int64_t g = 0; g < m; g += 32) {
                const int64_t rows = m - g < 32 ? m - g : 32;
                const uint16_t *xs = x + g * k;
                if (rows != configured) {
                    configure_two_panels(rows);
                    configured = rows;
                }
                _tile_zero(0);
                if (both) _tile_zero(1);
                if (rows > 16) _tile_zero(2);
                if (rows > 16 && both) _tile_zero(3);
                for (int64_t i = 0; i < pairs; i += 16) {
                    _tile_loadd(6, rebuilt + i * 32, 64);
                    _tile_loadd(4, xs + 2 * i, k * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    if (both) {
                        _tile_loadd(7, rebuilt + (pairs + i) * 32, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (rows > 16) {
                        _tile_loadd(5, xs + 16 * k + 2 * i, k * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (both) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                if (both) _tile_stored(1, c[1], 64);
                if (rows > 16) _tile_stored(2, c[0] + 256, 64);
                if (rows > 16 && both) _tile_stored(3, c[1] + 256, 64);
                for (int64_t q = 0; q <= both; q++) {
                    const int64_t p = p0 + q, columns = n - p * 16 < 16 ? n - p * 16 : 16;
                    for (int64_t r = 0; r < rows; r++)
                        round_out(c[q] + r * 16, w->bias ? (const uint16_t *)w->bias + p * 16 : nullptr, columns,
                                  y + (g + r) * n + p * 16);
                }
            }
        }
        _tile_release();
    }
}
static bool on_tiles(int64_t m) { return amx_granted && m >= AMX_FROM && m <= AMX_MANY; }
#else
static bool on_tiles(int64_t) { return false; }
#endif

/* y[m, n] = x[m, k] W^T (+ bias[n]); x and y contiguous, of float32 (T float) or bfloat16 (T uint16_t), from the
   weight's code panels where `coded`, else its float or pair panels. Panels are shared out among the threads two at a
   time, side by side. */
template <typename T>
static void linear(const struct prefixgate_linear_weight *w, const int coded, const T *x, int64_t m, T *y) {
    constexpr bool pairs = sizeof(T) == 2;
    const int64_t n = w->n, k = w->k, count = (n + 15) / 16;
    /* bytes a row of a panel (16 values of one k) takes, and a whole panel: panels lie one after the other */
    const int64_t stride = coded ? w->bits * 2 : pairs ? 32 : 64, apart = k * stride;
    const int half = coded && w->bits == 4;
    const char *panels = coded ? (const char *)w->codes : pairs ? (const char *)w->pairs : (const char *)w->panels;
#if PAIRS_ON_FMA
    /* bfloat16 rows of x as float32, for products on FMAs: the calling thread's, read by every thread below */
    thread_local std::vector<float> wide;
    if constexpr (pairs) {
        if ((int64_t)wide.size() < m * k) wide.resize(m * k);
        widen(x, m * k, wide.data());
    }
    const float *widened_x = wide.data();
#endif
    for (int64_t g = 0; g < m; g += GROUP) {
        const int64_t rows = m - g < GROUP ? m - g : GROUP;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < count; p += 2) { /* panels p and p + 1, or p twice where it is the last */
            const int both = p + 1 < count;
            float c[2 * GROUP * 16] __attribute__((aligned(64)));
            float decoded[2 * CHUNK * 16] __attribute__((aligned(64)));
            const char *panel = panels + p * apart;
            for (int64_t k0 = 0; k0 < k; k0 += CHUNK) {
                const int64_t depth = k - k0 < CHUNK ? k - k0 : CHUNK;
                /* the next chunks: these panels', or the next two panels' first (past the last panel where it is
                   alone: a prefetch is a hint, and asks for no more than a line) */
                const int64_t after = k0 + depth;
                two_panels two = {.apart = both ? apart : 0,
                                  .scales_apart = both ? k / BLOCK * 16 : 0,
                                  .next = after < k ? panel + after * stride : panel + 2 * apart,
                                  .next_apart = apart,
                                  .lines = p + 2 < count || after < k ? depth * stride / 64 : 0};
                const int64_t block = (p * k + k0) / BLOCK * 16; /* the chunk's first d and o */
                const float *scales = coded ? w->scales + block : nullptr;
                const float *offsets = coded ? w->offsets + block : nullptr;
                const int8_t *codes = (const int8_t *)panel + k0 * stride;
                if constexpr (pairs) { /* at most PAIR_ROWS rows, and CODED_PAIR_ROWS on code panels */
#if PAIRS_ON_FMA
                    const float *xs = widened_x + g * k + k0;
#else
                    const T *xs = x + g * k + k0;
#endif
#if defined(__AVX512BF16__)
                    const int add = k0 > 0;
                    if (!coded) chunk(xs, k, rows, (const T *)(panel + k0 * stride), two, depth, c, add);
                    else if (half) coded_pair_chunk(xs, k, rows, codes, 1, scales, offsets, two, depth, c, add);
                    else coded_pair_chunk(xs, k, rows, codes, 0, scales, offsets, two, depth, c, add);
#endif
                } else {
                    const T *xs = x + g * k + k0;
                    if (!coded) chunk(xs, k, rows, (const T *)(panel + k0 * stride), two, depth, c, k0 > 0);
                    else if (rows <= MOST_ROWS && half)
                        coded_chunk(xs, k, rows, codes, 1, scales, offsets, two, depth, c, k0 > 0);
                    else if (rows <= MOST_ROWS)
                        coded_chunk(xs, k, rows, codes, 0, scales, offsets, two, depth, c, k0 > 0);
                    else { /* both panels' chunks rebuilt as floats, side by side */
                        for (int q = 0; q <= both; q++) {
                            const int8_t *from = codes + q * apart;
                            float *to = decoded + q * CHUNK * 16;
                            const int64_t more = q * k / BLOCK * 16;
                            if (half) decode(from, 1, scales + more, offsets + more, depth, to);
                            else decode(from, 0, scales + more, offsets + more, depth, to);
                        }
                        two.apart = both ? CHUNK * 16 * sizeof(float) : 0;
                        chunk(xs, k, rows, (const float *)decoded, two, depth, c, k0 > 0);
                    }
                }
            }
            for (int64_t q = 0; q <= both; q++) {
                const int64_t columns = n - (p + q) * 16 < 16 ? n - (p + q) * 16 : 16;
                for (int64_t r = 0; r < rows; r++) {
                    T *out = y + (g + r) * n + (p + q) * 16;
                    const float *sums = c + q * GROUP * 16 + r * 16;
                    if constexpr (pairs) {
#if defined(__AVX512BF16__)
                        round_out(sums, w->bias ? (const uint16_t *)w->bias + (p + q) * 16 : nullptr, columns, out);
#endif
                    } else {
                        const float *bias = (const float *)w->bias;
                        for (int64_t j = 0; j < columns; j++) out[j] = sums[j] + (bias ? bias[(p + q) * 16 + j] : 0.0f);
                    }
                }
            }
        }
    }
}

/* Each live layer's description by its number (packed_linear.py's, given in load order, so the same layer of a model
   has the same number in every process that loads it alike): a compiled step passes the number, a constant of its
   graph that torch's compile cache keys on. The description's address would differ in every process, so the cache
   never served a later start; the description as a tensor served it, but each of SmolLM2's 211 layers an input of the
   graph cost a compiled decode step about 0.9 ms (0.92x the time with numbers for one stream, 0.96x for 8 and 16:
   step_bench.py's steps, the two in turn in one process, bfloat16 on 2 cores of an AMD EPYC). */
static std::mutex described_lock;
static std::unordered_map<int64_t, prefixgate_linear_weight> described;

static void linear_describe(int64_t number, const at::Tensor &description) {
    TORCH_CHECK(description.device().is_cpu() && description.scalar_type() == at::kByte &&
                    description.is_contiguous() && description.numel() == (int64_t)sizeof(prefixgate_linear_weight),
                "linear_describe takes a weight's description, a CPU tensor of its ", sizeof(prefixgate_linear_weight),
                " bytes");
    prefixgate_linear_weight w;
    memcpy(&w, description.const_data_ptr(), sizeof w);
    const std::lock_guard<std::mutex> hold(described_lock);
    described[number] = w;
}

static void linear_forget(int64_t number) {
    const std::lock_guard<std::mutex> hold(described_lock);
    described.erase(number);
}

/* y = x W^T (+ bias) for rows x [..., k] of float32, or of bfloat16 for pair panels, W the packed weight described as
   number `weight` (linear_describe; its layer keeps the layouts the description points into alive, and forgets the
   number as it goes, see packed_linear.py). With `plain` (the weight as torch holds it, and `bias`), more than GROUP
   rows go to torch's own product instead (MKL's, on Intel's CPUs, which is the faster there past about 100 rows);
   bfloat16 rows past PAIR_ROWS go to oneDNN's (`onednn`). A C++ operator, so that a compiled step (C++ itself on a CPU) calls the kernel directly: SmolLM2's 211
   layers went through a Python one before, and a compiled decode step of one stream took 1.13 to 1.17 times as long
   with it, of 16 streams 1.05 to 1.09 times (README, "Benchmarks"). */
static at::Tensor linear_panels(const at::Tensor &x, int64_t weight, int64_t out_features,
                                const std::optional<at::Tensor> &plain, const std::optional<at::Tensor> &bias) {
    prefixgate_linear_weight held;
    {
        const std::lock_guard<std::mutex> hold(described_lock);
        const auto found = described.find(weight);
        TORCH_CHECK(found != described.end(), "linear_panels: no live layer is described as number ", weight);
        held = found->second;
    }
    const auto *w = &held;
    const bool bfloat16 = w->pairs != nullptr || w->onednn != nullptr;
    const auto dtype = bfloat16 ? at::kBFloat16 : at::kFloat;
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype, "linear_panels takes ",
                bfloat16 ? "bfloat16" : "float32", " rows on a CPU for this weight");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w->k, "linear_panels takes rows of ", w->k, " values, not ", x.sizes());
    TORCH_CHECK(out_features == w->n, "linear_panels: the weight has ", w->n, " outputs, not ", out_features);
    const int64_t m = x.numel() / w->k;
    if (plain && m > GROUP) return at::linear(x, *plain, bias);
    /* bfloat16 rows: code panels on AMX's tiles for up to AMX_MANY where the CPU has AMX; else code panels for up to
       CODED_PAIR_ROWS and pair panels for up to PAIR_ROWS; oneDNN's product past them */
    const bool tiles = bfloat16 && w->codes && on_tiles(m);
    const int coded = w->codes && (!bfloat16 || m <= CODED_PAIR_ROWS);
    if (bfloat16 && !tiles && !coded && (m > PAIR_ROWS || !w->pairs)) {  /* no pair panels beside tiles' codes */
        TORCH_CHECK(w->onednn, "linear_panels: ", m, " bfloat16 rows need oneDNN's layout, which this weight lacks");
        static const auto onednn =
            c10::Dispatcher::singleton()
                .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &,
                                  c10::string_view, c10::List<std::optional<at::Scalar>>,
                                  std::optional<c10::string_view>)>();
        const at::Tensor packed(c10::intrusive_ptr<c10::TensorImpl>::unsafe_reclaim_from_nonowning(w->onednn));
        return onednn.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
    }
    const at::Tensor rows = x.contiguous();
    std::vector<int64_t> shape = rows.sizes().vec();
    shape.back() = w->n;
    at::Tensor y = at::empty(shape, rows.options());
    if (m == 0) return y;
    if (!bfloat16) {
        linear(w, coded, rows.const_data_ptr<float>(), m, y.mutable_data_ptr<float>());
        return y;
    }
#if defined(__AVX512BF16__)
#if defined(AMX_ROWS)
    if (tiles) {
        const uint16_t *xs = (const uint16_t *)rows.const_data_ptr();
        if (m <= AMX_ROWS) amx_coded_linear(w, xs, m, (uint16_t *)y.mutable_data_ptr());
        else {
            const at::Tensor panels = at::empty({omp_get_max_threads(), w->k * 32}, rows.options());
            amx_coded_linear_many(w, xs, m, (uint16_t *)y.mutable_data_ptr(), (uint16_t *)panels.mutable_data_ptr());
        }
        return y;
    }
#endif
    linear(w, coded, (const uint16_t *)rows.const_data_ptr(), m, (uint16_t *)y.mutable_data_ptr());
#else
    TORCH_CHECK(false, "linear_panels: this build has no bfloat16 products (it needs AVX-512 BF16)");
#endif
    return y;
}

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
    m.def("linear_panels(Tensor x, int weight, int out_features, Tensor? plain=None, Tensor? bias=None) -> Tensor");
    m.def("linear_describe(int number, Tensor description) -> ()");
    m.def("linear_forget(int number) -> ()");
}
TORCH_LIBRARY_IMPL(prefixgate, CPU, m) {
    m.impl("linear_panels", &linear_panels);
    m.impl("linear_describe", &linear_describe);
}
TORCH_LIBRARY_IMPL(prefixgate, CatchAll, m) { m.impl("linear_forget", &linear_forget); }
