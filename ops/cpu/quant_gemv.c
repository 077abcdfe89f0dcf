/* Decode rows times int8 weights with one scale per output row (the GGUF LM head kept
 * quantized): ``out [M, N] = x [M, K] @ (q [N, K] * scale [N])^T`` for M <= QGEMV_MAX_ROWS rows
 * of float32 activations.
 *
 * torch's ``_weight_int8pack_mm`` takes bfloat16 activations only and reads SmolLM2's 49152 x
 * 576 head (28 MB) at 4-6 GB/s on one core; this kernel keeps the activations in float32 and
 * reads it at 10-14 GB/s (docs/BENCHMARKS.md): a cache line of a weight row a step, four
 * products of 16 lanes summed before they join the accumulator, the lines ahead prefetched.
 *
 * Each (row, column) sums its products in 16 float32 lanes and reduces them once at the end,
 * then multiplies by the column's scale, so an input of one 1.0 (the tests' identity product)
 * yields ``q * scale`` exactly. Built without AVX-512 only the scalar loop runs;
 * ``q8_gemv_is_vectorized`` says which, and the launcher (quant_gemv.py) keeps torch's kernel
 * then. The launcher checks shapes, dtypes and strides.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define QGEMV_MAX_ROWS 8
#define LINE 64            /* weights (bytes) of a row a step */
#define PREFETCH_LINES 16  /* how far ahead in the weight stream */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

int q8_gemv_is_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Output column ``row`` for rows 0 .. M - 1, unscaled, into ``sums[m]``. One column at a time
 * measured fastest (2.5 ms at one row against 3.2 with four interleaved columns: more streams
 * defeat the prefetch). */
static inline void q8_column(const int8_t *row, int64_t k, const float *x, int64_t x_stride,
                             int M, float *sums) {
    int64_t start = 0;
#ifdef __AVX512F__
    __m512 acc[QGEMV_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (; start + LINE <= k; start += LINE) {
        const int8_t *line = row + start;
        _mm_prefetch((const char *)(line + PREFETCH_LINES * LINE), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512((const void *)line);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(bytes)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(bytes, 1)));
        const __m512 w2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(bytes, 2)));
        const __m512 w3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(bytes, 3)));
        for (int m = 0; m < M; m++) {
            const float *xs = x + m * x_stride + start;
            __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(xs));
            t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + 16), t);
            t = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xs + 32), t);
            t = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xs + 48), t);
            acc[m] = _mm512_add_ps(acc[m], t);
        }
    }
    for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
#else
    for (int m = 0; m < M; m++) sums[m] = 0.0f;
#endif
    for (int m = 0; m < M; m++) {
        float tail = 0.0f;
        for (int64_t i = start; i < k; i++) tail += (float)row[i] * x[m * x_stride + i];
        sums[m] += tail;
    }
}

#define Q8_CASE(MM)                                                                            \
    case MM:                                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t j = 0; j < n; j++) {                                                      \
            float sums[QGEMV_MAX_ROWS];                                                        \
            q8_column(w + j * k, k, x, x_stride, MM, sums);                                    \
            const float scale = bf16_to_f32(scales[j]);                                        \
            for (int m = 0; m < MM; m++) out[m * out_stride + j] = sums[m] * scale;            \
        }                                                                                      \
        break;

/* ``scales``: bfloat16 bits. Returns 0, or -1 for a row count the kernel does not take. */
int q8_gemv_f32(const float *x, int64_t num_rows, int64_t x_stride, const int8_t *w,
                const uint16_t *scales, int64_t n, int64_t k, float *out, int64_t out_stride,
                int num_threads) {
    switch (num_rows) {
        Q8_CASE(1)
        Q8_CASE(2)
        Q8_CASE(3)
        Q8_CASE(4)
        Q8_CASE(5)
        Q8_CASE(6)
        Q8_CASE(7)
        Q8_CASE(8)
        default:
            return -1;
    }
    return 0;
}
