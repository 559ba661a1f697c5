/* float32 linear layers on x86 CPUs with AVX2 and FMA: see packed_linear.py. Built as a torch operator,
   `prefixgate::linear_panels` (at the end), which a step calls with no Python between it and the kernel.

   A weight [n, k] is packed once (by packed_linear.py) into panels of 16 output columns, each k rows of 16 floats
   (the weight's rows transposed, zeros past n). A product y[m, n] = x[m, k] W^T runs each panel against every row of
   x: k in chunks of 128 rows of the panel (8 KiB, held in the nearest cache while every 6 rows of x meet it), each 6
   rows in 12 accumulators (6 rows by two vectors of 8), the partial outputs kept in a small buffer between chunks.
   While the first rows meet a chunk, the next chunk's lines are asked for, one a step, so the weight streams from
   memory as the products run. Each output is summed over k in the same order whatever the rows beside it.

   A weight that is exactly a block code (w = d q + o for each 32 values of k along a row, q a small integer, d a
   half-precision number: what a GGUF file's Q4_1 or Q8_0 weights become as float32) may be packed as its codes
   instead: panels of 16 codes per value of k (int8, or where every code is 0 to 15 two to a byte, column j in the low
   half of byte j and column j + 8 in the high half), and for each 32 values of k the 16 columns' d and o. Each chunk
   is rebuilt as floats in a buffer before the rows meet it, d q + o in one rounding, which is the weight's value to
   the bit (d q is exact in float32), so the products are the float panels' to the bit while a quarter of the bytes,
   or less, come from memory. Where at most 6 rows of x meet it (a decode step of a few streams), each value is
   rebuilt in registers as the rows meet it instead, the same sums without the buffer. */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <torch/library.h>

#include <vector>

#define CHUNK 128       /* rows of a panel (values of k) held while every row of x meets them */
#define GROUP 64        /* rows of x a panel meets in one pass: its partial outputs are 64 by 16 floats */
#define BLOCK 32        /* values of k sharing a code's d and o */

/* The accumulators of up to 6 rows by 16 columns: started from c (where `add`) or zero, and written back to c. */
#define ACC_START(acc, c, add, rows)                                                          \
    for (int r = 0; r < (rows); r++) {                                                        \
        acc[r][0] = (add) ? _mm256_loadu_ps((c) + r * 16) : _mm256_setzero_ps();              \
        acc[r][1] = (add) ? _mm256_loadu_ps((c) + r * 16 + 8) : _mm256_setzero_ps();          \
    }
#define ACC_FINISH(acc, c, rows)                                                              \
    for (int r = 0; r < (rows); r++) {                                                        \
        _mm256_storeu_ps((c) + r * 16, acc[r][0]);                                            \
        _mm256_storeu_ps((c) + r * 16 + 8, acc[r][1]);                                        \
    }
/* Every row meets value i of the 16 columns (b0, b1). */
#define ACC_MEET(acc, a, lda, i, b0, b1, rows)                                                \
    for (int r = 0; r < (rows); r++) {                                                        \
        const __m256 x = _mm256_broadcast_ss((a) + r * (lda) + (i));                         \
        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);                                        \
        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);                                        \
    }

/* c[rows x 16] = (c if `add`) + a[rows x depth] b[depth x 16] (rows at most 6; a's rows `lda` apart, b's rows 16
   floats), asking for `lines` lines (64 bytes) of `next`, one a step. */
static inline __attribute__((always_inline)) void product(const float *a, int64_t lda, const float *b, int64_t depth,
                                                          float *c, int add, const int rows, const char *next,
                                                          int64_t lines) {
    __m256 acc[6][2];
    ACC_START(acc, c, add, rows);
    for (int64_t i = 0; i < depth; i++) {
        if (i < lines) _mm_prefetch(next + i * 64, _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(b + i * 16), b1 = _mm256_loadu_ps(b + i * 16 + 8);
        ACC_MEET(acc, a, lda, i, b0, b1, rows);
    }
    ACC_FINISH(acc, c, rows);
}

/* One chunk of a panel met by `count` rows of x (at most GROUP), the first of them fetching `lines` of `next`. */
static void chunk(const float *x, int64_t k, int64_t count, const float *b, int64_t depth, float *c, int add,
                  const char *next, int64_t lines) {
    /* blocks of rows as even as 6 at most allows (8 rows: 4 and 4, not 6 and 2, whose 4 accumulators wait on the
       FMAs' latency) */
    const int64_t blocks = (count + 5) / 6;
    for (int64_t i = 0, r = 0; i < blocks; i++, lines = 0) {
        const int64_t rows = count / blocks + (i < count % blocks);
        switch (rows) {
        case 6: product(x + r * k, k, b, depth, c + r * 16, add, 6, next, lines); break;
        case 5: product(x + r * k, k, b, depth, c + r * 16, add, 5, next, lines); break;
        case 4: product(x + r * k, k, b, depth, c + r * 16, add, 4, next, lines); break;
        case 3: product(x + r * k, k, b, depth, c + r * 16, add, 3, next, lines); break;
        case 2: product(x + r * k, k, b, depth, c + r * 16, add, 2, next, lines); break;
        case 1: product(x + r * k, k, b, depth, c + r * 16, add, 1, next, lines); break;
        default: break;
        }
        r += rows;
    }
}

/* The 16 columns' values at row i of a code panel (`half`: two codes to a byte), with the d and o of its block. */
static inline __attribute__((always_inline)) void rebuild(const int8_t *codes, const int half, int64_t i, __m256 d0,
                                                          __m256 d1, __m256 o0, __m256 o1, __m256 *b0, __m256 *b1) {
    __m256i q0, q1;
    if (half) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i * 8)));
        q0 = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
        q1 = _mm256_srli_epi32(bytes, 4);
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(codes + i * 16));
        q0 = _mm256_cvtepi8_epi32(q);
        q1 = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q));
    }
    *b0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), d0, o0);
    *b1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), d1, o1);
}

/* b[depth x 16] = the floats of `depth` rows of code panel (depth a multiple of BLOCK), their d and o `scales` and
   `offsets` (16 each per BLOCK rows). */
static inline __attribute__((always_inline)) void decode(const int8_t *codes, const int half, const float *scales,
                                                         const float *offsets, int64_t depth, float *b) {
    for (int64_t i0 = 0; i0 < depth; i0 += BLOCK) {
        const float *d = scales + i0 / BLOCK * 16, *o = offsets + i0 / BLOCK * 16;
        const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
        const __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
        for (int64_t i = i0; i < i0 + BLOCK; i++) {
            __m256 b0, b1;
            rebuild(codes, half, i, d0, d1, o0, o1, &b0, &b1);
            _mm256_store_ps(b + i * 16, b0);
            _mm256_store_ps(b + i * 16 + 8, b1);
        }
    }
}

/* product() for at most 6 rows meeting a chunk of code panel directly: each row of the chunk is rebuilt in registers
   as decode() rebuilds it, so the sums are the same to the bit, without a trip through a buffer. */
static inline __attribute__((always_inline)) void coded_product(const float *a, int64_t lda, const int8_t *codes,
                                                                const int half, const float *scales,
                                                                const float *offsets, int64_t depth, float *c, int add,
                                                                const int rows, const char *next, int64_t lines) {
    __m256 acc[6][2];
    ACC_START(acc, c, add, rows);
    for (int64_t i0 = 0; i0 < depth; i0 += BLOCK) {
        const float *d = scales + i0 / BLOCK * 16, *o = offsets + i0 / BLOCK * 16;
        const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
        const __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
        for (int64_t i = i0; i < i0 + BLOCK; i++) {
            if (i < lines) _mm_prefetch(next + i * 64, _MM_HINT_T0);
            __m256 b0, b1;
            rebuild(codes, half, i, d0, d1, o0, o1, &b0, &b1);
            ACC_MEET(acc, a, lda, i, b0, b1, rows);
        }
    }
    ACC_FINISH(acc, c, rows);
}

/* A chunk of code panel met by `count` rows of x, at most 6 (`half` a constant where it is inlined). */
static inline __attribute__((always_inline)) void coded_chunk(const float *x, int64_t k, int64_t count,
                                                              const int8_t *codes, const int half, const float *scales,
                                                              const float *offsets, int64_t depth, float *c, int add,
                                                              const char *next, int64_t lines) {
    switch (count) {
    case 6: coded_product(x, k, codes, half, scales, offsets, depth, c, add, 6, next, lines); break;
    case 5: coded_product(x, k, codes, half, scales, offsets, depth, c, add, 5, next, lines); break;
    case 4: coded_product(x, k, codes, half, scales, offsets, depth, c, add, 4, next, lines); break;
    case 3: coded_product(x, k, codes, half, scales, offsets, depth, c, add, 3, next, lines); break;
    case 2: coded_product(x, k, codes, half, scales, offsets, depth, c, add, 2, next, lines); break;
    case 1: coded_product(x, k, codes, half, scales, offsets, depth, c, add, 1, next, lines); break;
    default: break;
    }
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
                if (rows <= 6 && half)
                    coded_chunk(xs, k, rows, codes, 1, scales, offsets, depth, c, k0 > 0, next, lines);
                else if (rows <= 6)
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
   the address its layer holds, and never any other number. A C++ operator, so that a compiled step (C++ itself on a
   CPU) calls the kernel directly: SmolLM2's 211 layers went through a Python one before, and a compiled decode step of
   one stream took 1.13 to 1.17 times as long with it, of 16 streams 1.05 to 1.09 times (README, "Benchmarks"). */
static at::Tensor linear_panels(const at::Tensor &x, int64_t weight, int64_t out_features) {
    const auto *w = reinterpret_cast<const prefixgate_linear_weight *>(weight);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "linear_panels takes float32 rows on a CPU");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w->k, "linear_panels takes rows of ", w->k, " values, not ", x.sizes());
    TORCH_CHECK(out_features == w->n, "linear_panels: the weight has ", w->n, " outputs, not ", out_features);
    const at::Tensor rows = x.contiguous();
    std::vector<int64_t> shape = rows.sizes().vec();
    shape.back() = w->n;
    at::Tensor y = at::empty(shape, rows.options());
    if (rows.numel() > 0) linear(w, rows.const_data_ptr<float>(), rows.numel() / w->k, y.mutable_data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(prefixgate, m) { m.def("linear_panels(Tensor x, int weight, int out_features) -> Tensor"); }
TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("linear_panels", &linear_panels); }
