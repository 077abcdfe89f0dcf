/* Decode rows times int4 weights (GGUF's Q4_0/Q4_1/Q4_K kept quantized), llama.cpp's way:
 * ``out [M, N] = x [M, K] @ W^T`` for M <= Q4_MAX_ROWS float32 rows, where every 32 input
 * features of an output row share ``w = (q - 8) * s + z`` (q in 0..15, s and z bfloat16).
 *
 * Each activation row is first quantized per group of 32: ``d = max |x| / 127``,
 * ``xq = round(x * (127 / max |x|))`` (int8, ties to even), and ``xs`` = the float32 sum of the
 * group's x. A group's dot is then
 *     sum_k w_k x_k = s * sum_k q_k x_k + (z - 8 s) * sum_k x_k
 *                  ~ (s d) * sum_k q_k xq_k + (z - 8 s) * xs,
 * the first sum exact in int32 by ``vpdpbusd`` (unsigned codes times signed int8, four products a
 * lane), the second exact but for the float32 sum: only x's rounding to int8 changes the result.
 *
 * Float32 FMAs over the codes (or AVX512-BF16 dot products) were compute-bound at 2x torch's
 * time (docs/BENCHMARKS.md); here 64 products cost one instruction, so the weights' bytes set
 * the pace.
 *
 * Layout (``pack_q4`` in quant_gemv4.py builds it once at load): an output row's groups in
 * blocks of up to 16 (the last block holds the rest, T groups), a block = 4 * 4T bytes of codes,
 * T bfloat16 scales, T bfloat16 zeros: 20 bytes a group, the row's blocks back to back and the
 * rows back to back (one stream for the prefetcher). Lane l of a 16-lane vector is group l of
 * the block: code byte ``i * 4T + 4 l + b`` holds code ``8 i + b`` of group l in its low nibble
 * and code ``8 i + 4 + b`` in its high one, so a 64-byte load gives two vpdpbusd operands whose
 * lanes each sum four codes of their own group, and after 8 of them lane l holds group l's
 * whole int32 dot: one conversion and two FMAs with 16 consecutive scales per 512 weights.
 * The activations are rearranged the same way (``quantize_rows``), with zeros past T.
 *
 * Built without AVX-512 VNNI nothing runs: ``q4_gemv_is_vectorized`` says 0 and the launcher
 * keeps torch's kernel, which a scalar loop here would not beat. The launcher checks shapes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_VNNI 1
#include <immintrin.h>
#endif

#define Q4_MAX_ROWS 8
#define GROUP 32
#define LANES 16            /* groups a block */
#define GROUP_BYTES 20      /* 16 of codes, 2 of scale, 2 of zero */
#define PREFETCH_BYTES 1024 /* how far ahead in the weight stream */

int q4_gemv_is_vectorized(void) {
#ifdef Q4_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef Q4_VNNI

/* One activation row's quantized form, per block: 8 vectors of 64 int8 (vector j, lane l:
 * codes 4j .. 4j + 3 of group l), then 16 scales d and 16 sums xs (zeros past the last group). */
typedef struct {
    int8_t xq[8][64];
    float d[LANES];
    float xs[LANES];
} QBlock;

static void quantize_row(const float *x, int64_t num_groups, QBlock *blocks) {
    memset(blocks, 0, sizeof(QBlock) * (size_t)((num_groups + LANES - 1) / LANES));
    for (int64_t g = 0; g < num_groups; g++) {
        QBlock *blk = blocks + g / LANES;
        const int l = (int)(g % LANES);
        const __m512 a = _mm512_loadu_ps(x + g * GROUP);
        const __m512 b = _mm512_loadu_ps(x + g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        blk->xs[l] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        if (amax == 0.0f) continue;  /* d = 0, xq = 0 (memset) */
        blk->d[l] = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(127.0f / amax);
        /* cvtps rounds to nearest even (the default MXCSR mode); |x * inv| <= 127. */
        const __m128i qa = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
        const __m128i qb = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)));
        int8_t q[GROUP];
        _mm_storeu_si128((__m128i *)q, qa);
        _mm_storeu_si128((__m128i *)(q + 16), qb);
        for (int j = 0; j < 8; j++) memcpy(&blk->xq[j][4 * l], q + 4 * j, 4);
    }
}

static inline __m512 bf16x16_to_f32(__mmask16 mask, const uint8_t *p) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Output column ``w`` (one packed row) against rows 0 .. M - 1, into ``sums[m]``. */
static inline void q4_column(const uint8_t *w, int64_t num_groups, const QBlock *x,
                             int64_t num_blocks, int M, float *sums) {
    __m512 acc[Q4_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const int64_t t = num_groups - blk * LANES < LANES ? num_groups - blk * LANES : LANES;
        for (int64_t off = 0; off < GROUP_BYTES * t; off += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + off), _MM_HINT_T0);
        const __mmask64 byte_mask = t == LANES ? ~0ULL : (1ULL << (4 * t)) - 1;
        const __mmask16 lane_mask = (__mmask16)((1u << t) - 1);
        __m512i codes[8];
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_maskz_loadu_epi8(byte_mask, (const void *)(w + i * 4 * t));
            codes[2 * i] = _mm512_and_si512(v, nibble);
            codes[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        const __m512 s = bf16x16_to_f32(lane_mask, w + 16 * t);
        const __m512 z = bf16x16_to_f32(lane_mask, w + 18 * t);
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);  /* z - 8 s */
        for (int m = 0; m < M; m++) {
            const QBlock *q = x + m * num_blocks + blk;
            /* Two chains of four: vpdpbusd's latency, not its throughput, would bound one. */
            __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                dot0 = _mm512_dpbusd_epi32(dot0, codes[j], _mm512_load_si512((const void *)q->xq[j]));
                dot1 = _mm512_dpbusd_epi32(dot1, codes[j + 1],
                                           _mm512_load_si512((const void *)q->xq[j + 1]));
            }
            const __m512i dot = _mm512_add_epi32(dot0, dot1);
            const __m512 sd = _mm512_mul_ps(s, _mm512_load_ps(q->d));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, acc[m]);
            acc[m] = _mm512_fmadd_ps(offset, _mm512_load_ps(q->xs), acc[m]);
        }
        w += GROUP_BYTES * t;
    }
    for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
}

#define Q4_CASE(MM)                                                                            \
    case MM:                                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t j = 0; j < n; j++) {                                                      \
            float sums[Q4_MAX_ROWS];                                                           \
            q4_column(w + j * row_bytes, num_groups, blocks, num_blocks, MM, sums);            \
            for (int m = 0; m < MM; m++) out[m * out_stride + j] = sums[m];                    \
        }                                                                                      \
        break;

#endif /* Q4_VNNI */

/* ``w``: packed rows of ``20 * k / 32`` bytes (the layout above); ``k`` a multiple of 32.
 * Returns 0, -1 for a row count or width the kernel does not take, -2 when out of memory or
 * built without AVX-512 VNNI. */
int q4_gemv_f32(const float *x, int64_t num_rows, int64_t x_stride, const uint8_t *w,
                int64_t n, int64_t k, float *out, int64_t out_stride, int num_threads) {
    if (num_rows < 1 || num_rows > Q4_MAX_ROWS || k <= 0 || k % GROUP) return -1;
#ifdef Q4_VNNI
    const int64_t num_groups = k / GROUP, num_blocks = (num_groups + LANES - 1) / LANES;
    const int64_t row_bytes = GROUP_BYTES * num_groups;
    QBlock *blocks = aligned_alloc(64, sizeof(QBlock) * (size_t)(num_rows * num_blocks));
    if (blocks == NULL) return -2;
    for (int64_t m = 0; m < num_rows; m++)
        quantize_row(x + m * x_stride, num_groups, blocks + m * num_blocks);
    switch (num_rows) {
        Q4_CASE(1)
        Q4_CASE(2)
        Q4_CASE(3)
        Q4_CASE(4)
        Q4_CASE(5)
        Q4_CASE(6)
        Q4_CASE(7)
        Q4_CASE(8)
    }
    free(blocks);
    return 0;
#else
    (void)x; (void)x_stride; (void)w; (void)n; (void)out; (void)out_stride; (void)num_threads;
    return -2;
#endif
}
