/* float32 linear layers on x86 CPUs with AVX2 and FMA, or AVX-512: see packed_linear.py. Built as a torch operator,
   `prefixgate::linear_panels` (at the end), which a step calls with no Python between it and the kernel.

   A weight [n, k] is packed once (by packed_linear.py) into panels of 16 output columns, each k rows of 16 floats
   (the weight's rows transposed, zeros past n). A product y[m, n] = x[m, k] W^T runs each panel against every row of
   x: k in chunks of 128 rows of the panel (8 KiB, held in the nearest cache while every few rows of x meet it), up
   to 12 rows at a time in as many AVX-512 accumulators (or 6 in 12 of AVX2's vectors of 8), the partial outputs kept
   in a small buffer between chunks. While the first rows meet a chunk, the next chunk's lines are asked for, one a
   step, so the weight streams from memory as the products run. Each output is summed over k in the same order
   whatever the rows beside it, and whichever of the two builds runs.

   A weight that is exactly a block code (w = d q + o for each 32 values of k along a row, q a small integer, d a
   half-precision number: what a GGUF file's Q4_1 or Q8_0 weights become as float32) may be packed as its codes
   instead: panels of 16 codes per value of k (int8, or where every code is 0 to 15 two to a byte, column j in the low
   half of byte j and column j + 8 in the high half), and for each 32 values of k the 16 columns' d and o. Each chunk
   is rebuilt as floats in a buffer before the rows meet it, d q + o in one rounding, which is the weight's value to
   the bit (d q is exact in float32), so the products are the float panels' to the bit while a quarter of the bytes,
   or less, come from memory. Where at most 12 rows (6 on AVX2) meet it (a decode step of a few streams), each value
   is rebuilt in registers as the rows meet it instead, the same sums without the buffer. */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#define CHUNK 128       /* rows of a panel (values of k) held while every row of x meets them */
#define GROUP 64        /* rows of x a panel meets in one pass: its partial outputs are 64 by 16 floats */
#define BLOCK 32        /* values of k sharing a code's d and o */

/* 16 columns of one row: one AVX-512 vector where the build has AVX-512 (-mavx512f), else two AVX2 vectors. Each
   lane's arithmetic is the same in both, so the two builds give the same bits. With 32 vector registers, AVX-512
   accumulates up to 12 rows at a time; AVX2, with 16, up to 6. */
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
#define MOST_ROWS 6
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
#if MOST_ROWS > 6
#define ROWS_ABOVE_6(f, ...)                  \
    case 12: f(__VA_ARGS__, 12); break;       \
    case 11: f(__VA_ARGS__, 11); break;       \
    case 10: f(__VA_ARGS__, 10); break;       \
    case 9: f(__VA_ARGS__, 9); break;         \
    case 8: f(__VA_ARGS__, 8); break;         \
    case 7: f(__VA_ARGS__, 7); break;
#else
#define ROWS_ABOVE_6(f, ...)
#endif
#define WITH_ROWS(rows, f, ...)               \
    switch (rows) {                           \
    ROWS_ABOVE_6(f, __VA_ARGS__)              \
    case 6: f(__VA_ARGS__, 6); break;         \
    case 5: f(__VA_ARGS__, 5); break;         \
    case 4: f(__VA_ARGS__, 4); break;         \
    case 3: f(__VA_ARGS__, 3); break;         \
    case 2: f(__VA_ARGS__, 2); break;         \
    case 1: f(__VA_ARGS__, 1); break;         \
    default: break;                           \
    }

/* c[rows x 16] = (c if `add`) + a[rows x depth] b[depth x 16] (rows at most MOST_ROWS; a's rows `lda` apart, b's rows
   16 floats), asking for `lines` lines (64 bytes) of `next`, one a step. */
static inline __attribute__((always_inline)) void product(const float *a, int64_t lda, const float *b, int64_t depth,
                                                          float *c, int add, const char *next, int64_t lines,
                                                          const int rows) {
    row16 acc[MOST_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = add ? load16(c + r * 16) : zero16();
    for (int64_t i = 0; i < depth; i++) {
        if (i < lines) _mm_prefetch(next + i * 64, _MM_HINT_T0);
        const row16 bi = load16(b + i * 16);
        for (int r = 0; r < rows; r++) acc[r] = fma16(a[r * lda + i], bi, acc[r]);
    }
    for (int r = 0; r < rows; r++) store16(c + r * 16, acc[r]);
}

/* One chunk of a panel met by `count` rows of x (at most GROUP), the first of them fetching `lines` of `next`. */
static void chunk(const float *x, int64_t k, int64_t count, const float *b, int64_t depth, float *c, int add,
                  const char *next, int64_t lines) {
    /* blocks of rows as even as MOST_ROWS at most allows (8 rows on AVX2: 4 and 4, not 6 and 2, whose 4 accumulators
       wait on the FMAs' latency) */
    const int64_t blocks = (count + MOST_ROWS - 1) / MOST_ROWS;
    for (int64_t i = 0, r = 0; i < blocks; i++, lines = 0) {
        const int64_t rows = count / blocks + (i < count % blocks);
        WITH_ROWS(rows, product, x + r * k, k, b, depth, c + r * 16, add, next, lines)
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

/* product() for at most MOST_ROWS rows meeting a chunk of code panel directly: each row of the chunk is rebuilt in
   registers as decode() rebuilds it, so the sums are the same to the bit, without a trip through a buffer. */
static inline __attribute__((always_inline)) void coded_product(const float *a, int64_t lda, const int8_t *codes,
                                                                const int half, const float *scales,
                                                                const float *offsets, int64_t depth, float *c, int add,
                                                                const char *next, int64_t lines, const int rows) {
    row16 acc[MOST_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = add ? load16(c + r * 16) : zero16();
    for (int64_t i0 = 0; i0 < depth; i0 += BLOCK) {
        const row16 d = load16(scales + i0 / BLOCK * 16), o = load16(offsets + i0 / BLOCK * 16);
        for (int64_t i = i0; i < i0 + BLOCK; i++) {
            if (i < lines) _mm_prefetch(next + i * 64, _MM_HINT_T0);
            const row16 bi = rebuild(codes, half, i, d, o);
            for (int r = 0; r < rows; r++) acc[r] = fma16(a[r * lda + i], bi, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store16(c + r * 16, acc[r]);
}

/* A chunk of code panel met by `count` rows of x, at most MOST_ROWS (`half` a constant where it is inlined). */
static inline __attribute__((always_inline)) void coded_chunk(const float *x, int64_t k, int64_t count,
                                                              const int8_t *codes, const int half, const float *scales,
                                                              const float *offsets, int64_t depth, float *c, int add,
                                                              const char *next, int64_t lines) {
    WITH_ROWS(count, coded_product, x, k, codes, half, scales, offsets, depth, c, add, next, lines)
}

/* A packed weight [n, k] and its bias, as packed_linear.py lays them out: float panels [n / 16][k][16] (n rounded up
   to 16), or code panels [n / 16][k][16] of `bits` 8 or 4 (then [n / 16][k][8] bytes) with their scales and offsets
   [n / 16][k / BLOCK][16] (k a multiple of BLOCK); the pointers not used, and a missing bias, are NULL. */
struct prefixgate_linear_weight {
    int64_t n, k;
    const float *panels;
    const int8_t *codes;
    int64_t bits;
    const float *scales, *offsets;
    const float *bias;
};

/* y[m, n] = x[m, k] W^T (+ bias[n]); x and y contiguous. Panels are shared out among the threads. */
static void linear(const struct prefixgate_linear_weight *w, const float *x, int64_t m, float *y) {
    const int64_t n = w->n, k = w->k, count = (n + 15) / 16;
    const int64_t stride = w->codes ? w->bits * 2 : 64; /* bytes a row of a panel (16 values of one k) takes */
    const int half = w->codes && w->bits == 4;
    for (int64_t g = 0; g < m; g += GROUP) {
        const int64_t rows = m - g < GROUP ? m - g : GROUP;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            float c[GROUP * 16] __attribute__((aligned(64)));
            float decoded[CHUNK * 16] __attribute__((aligned(64)));
            const char *panel = (w->codes ? (const char *)w->codes : (const char *)w->panels) + p * k * stride;
            for (int64_t k0 = 0; k0 < k; k0 += CHUNK) {
                const int64_t depth = k - k0 < CHUNK ? k - k0 : CHUNK;
                /* the next chunk, or the next panel's first: panels lie one after the other */
                const char *next = panel + (k0 + depth) * stride;
                const int64_t lines = p + 1 < count || k0 + depth < k ? depth * stride / 64 : 0;
                const float *xs = x + g * k + k0;
                if (!w->codes) {
                    chunk(xs, k, rows, (const float *)panel + k0 * 16, depth, c, k0 > 0, next, lines);
                    continue;
                }
                const int64_t block = (p * k + k0) / BLOCK * 16; /* the chunk's first d and o */
                const float *scales = w->scales + block, *offsets = w->offsets + block;
                const int8_t *codes = (const int8_t *)panel + k0 * stride;
                if (rows <= MOST_ROWS && half)
                    coded_chunk(xs, k, rows, codes, 1, scales, offsets, depth, c, k0 > 0, next, lines);
                else if (rows <= MOST_ROWS)
                    coded_chunk(xs, k, rows, codes, 0, scales, offsets, depth, c, k0 > 0, next, lines);
                else {
                    if (half) decode(codes, 1, scales, offsets, depth, decoded);
                    else decode(codes, 0, scales, offsets, depth, decoded);
                    chunk(xs, k, rows, decoded, depth, c, k0 > 0, next, lines);
                }
            }
            const int64_t columns = n - p * 16 < 16 ? n - p * 16 : 16;
            for (int64_t r = 0; r < rows; r++) {
                float *out = y + (g + r) * n + p * 16;
                for (int64_t j = 0; j < columns; j++) out[j] = c[r * 16 + j] + (w->bias ? w->bias[p * 16 + j] : 0.0f);
            }
        }
    }
}

/* y = x W^T (+ bias) for rows x [..., k] of float32, W the packed weight whose description lies at address `weight`
   (a `struct prefixgate_linear_weight` its layer keeps alive, see packed_linear.py): the layer's own operator, given
   the address its layer holds, and never any other number. With `plain` (the weight as torch holds it, and `bias`),
   more than GROUP rows go to torch's own product instead (MKL's, on Intel's CPUs, which is the faster there past about
   100 rows: packed_linear.py). A C++ operator, so that a compiled step (C++ itself on a CPU) calls the kernel
   directly: SmolLM2's 211 layers went through a Python one before, and a compiled decode step of one stream took 1.13
   to 1.17 times as long with it, of 16 streams 1.05 to 1.09 times (README, "Benchmarks"). */
static at::Tensor linear_panels(const at::Tensor &x, int64_t weight, int64_t out_features,
                                const std::optional<at::Tensor> &plain, const std::optional<at::Tensor> &bias) {
    const auto *w = reinterpret_cast<const prefixgate_linear_weight *>(weight);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "linear_panels takes float32 rows on a CPU");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w->k, "linear_panels takes rows of ", w->k, " values, not ", x.sizes());
    TORCH_CHECK(out_features == w->n, "linear_panels: the weight has ", w->n, " outputs, not ", out_features);
    if (plain && x.numel() / w->k > GROUP) return at::linear(x, *plain, bias);
    const at::Tensor rows = x.contiguous();
    std::vector<int64_t> shape = rows.sizes().vec();
    shape.back() = w->n;
    at::Tensor y = at::empty(shape, rows.options());
    if (rows.numel() > 0) linear(w, rows.const_data_ptr<float>(), rows.numel() / w->k, y.mutable_data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
    m.def("linear_panels(Tensor x, int weight, int out_features, Tensor? plain=None, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("linear_panels", &linear_panels); }
