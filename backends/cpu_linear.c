/* float32 linear layers on x86 CPUs with AVX2 and FMA: see packed_linear.py.

   A weight [n, k] is packed once into panels of 16 output columns, each k rows of 16 floats (the weight's rows
   transposed, zeros past n). A product y[m, n] = x[m, k] W^T runs each panel against every row of x: k in chunks of
   128 rows of the panel (8 KiB, held in the nearest cache while every 6 rows of x meet it), each 6 rows in 12
   accumulators (6 rows by two vectors of 8), the partial outputs kept in a small buffer between chunks. While the
   first rows meet a chunk, the next chunk's lines are asked for, one a step, so the weight streams from memory as the
   products run. Each output is summed over k in the same order whatever the rows beside it. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 128       /* rows of a panel (values of k) held while every row of x meets them */
#define GROUP 64        /* rows of x a panel meets in one pass: its partial outputs are 64 by 16 floats */

void prefixgate_pack_linear(const float *w, int64_t n, int64_t k, float *panels) {
    for (int64_t p = 0; p < (n + 15) / 16; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < 16; j++)
                panels[(p * k + i) * 16 + j] = p * 16 + j < n ? w[(p * 16 + j) * k + i] : 0.0f;
}

/* c[rows x 16] = (c if `add`) + a[rows x depth] b[depth x 16] (rows at most 6; a's rows `lda` apart, b's rows 16
   floats), asking for `lines` lines (64 bytes) of `next`, one a step. */
static inline __attribute__((always_inline)) void product(const float *a, int64_t lda, const float *b, int64_t depth,
                                                          float *c, int add, const int rows, const char *next,
                                                          int64_t lines) {
    __m256 acc[6][2];
    for (int r = 0; r < rows; r++) {
        acc[r][0] = add ? _mm256_loadu_ps(c + r * 16) : _mm256_setzero_ps();
        acc[r][1] = add ? _mm256_loadu_ps(c + r * 16 + 8) : _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < depth; i++) {
        if (i < lines) _mm_prefetch(next + i * 64, _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(b + i * 16), b1 = _mm256_loadu_ps(b + i * 16 + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 x = _mm256_broadcast_ss(a + r * lda + i);
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(c + r * 16, acc[r][0]);
        _mm256_storeu_ps(c + r * 16 + 8, acc[r][1]);
    }
}

/* One chunk of a panel met by `count` rows of x (at most GROUP), the first of them fetching `lines` of `next`. */
static void chunk(const float *x, int64_t k, int64_t count, const float *b, int64_t depth, float *c, int add,
                  const char *next, int64_t lines) {
    int64_t r = 0;
    for (; r + 6 <= count; r += 6, lines = 0) product(x + r * k, k, b, depth, c + r * 16, add, 6, next, lines);
    switch (count - r) {
    case 5: product(x + r * k, k, b, depth, c + r * 16, add, 5, next, lines); break;
    case 4: product(x + r * k, k, b, depth, c + r * 16, add, 4, next, lines); break;
    case 3: product(x + r * k, k, b, depth, c + r * 16, add, 3, next, lines); break;
    case 2: product(x + r * k, k, b, depth, c + r * 16, add, 2, next, lines); break;
    case 1: product(x + r * k, k, b, depth, c + r * 16, add, 1, next, lines); break;
    default: break;
    }
}

/* y[m, n] = x[m, k] W^T (+ bias[n] where bias is not NULL), W packed by prefixgate_pack_linear; x and y contiguous.
   Panels are shared out among the threads. */
void prefixgate_linear(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias,
                       float *y) {
    const int64_t count = (n + 15) / 16;
    for (int64_t g = 0; g < m; g += GROUP) {
        const int64_t rows = m - g < GROUP ? m - g : GROUP;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            float c[GROUP * 16] __attribute__((aligned(64)));
            const float *panel = panels + p * k * 16;
            for (int64_t k0 = 0; k0 < k; k0 += CHUNK) {
                const int64_t depth = k - k0 < CHUNK ? k - k0 : CHUNK;
                /* the next chunk, or the next panel's first: panels lie one after the other */
                const char *next = (const char *)(panel + (k0 + depth) * 16);
                const int64_t lines = p + 1 < count || k0 + depth < k ? depth : 0;
                chunk(x + g * k + k0, k, rows, panel + k0 * 16, depth, c, k0 > 0, next, lines);
            }
            const int64_t columns = n - p * 16 < 16 ? n - p * 16 : 16;
            for (int64_t r = 0; r < rows; r++) {
                float *out = y + (g + r) * n + p * 16;
                for (int64_t j = 0; j < columns; j++) out[j] = c[r * 16 + j] + (bias ? bias[p * 16 + j] : 0.0f);
            }
        }
    }
}
