/* Decode rows times int4 weights (GGUF's Q4_0/Q4_1/Q4_K kept quantized), llama.cpp's way:
 * ``out [M, N] = x [M, K] @ W^T`` for M <= Q4_MAX_ROWS float32 rows, where every 32 input
 * features of an output row share ``w = (q - 8) * s + z`` (q in 0..15, s and z bfloat16).
 *
 * Each activation row is first quantized per group of 32: ``d = max |x| / top``,
 * ``xq = round(x * (top / max |x|))`` (ties to even), and ``xs`` = the float32 sum of the
 * group's x. A group's dot is then
 *     sum_k w_k x_k = s * sum_k q_k x_k + (z - 8 s) * sum_k x_k
 *                  ~ (s d) * sum_k q_k xq_k + (z - 8 s) * xs,
 * the first sum exact in int32 by ``vpdpbusd`` (unsigned codes times signed int8, four products a
 * lane), the second exact but for the float32 sum: only x's rounding to xq changes the result.
 * ``levels`` 1 is llama.cpp's int8 (top = 127); 2 (the default) takes top = 127 * 256 and
 * writes xq as two int8 digits, ``256 hi + lo``, for twice the vpdpbusd: int8 activations moved
 * the embedded model's decode logprobs 3.5x as much as torch's bfloat16 casts, past
 * tests/test_quantized.py's bound; 16-bit ones are below bfloat16's rounding.
 *
 * Float32 FMAs over the codes (or AVX512-BF16 dot products) were compute-bound at 2x torch's
 * time (docs/BENCHMARKS.md); here 64 products cost one instruction, so the weights' bytes set
 * the pace.
 *
 * Layout (``pack_q4`` in quant_gemv4.py builds it once at load): a 16-lane vector holds L
 * consecutive groups of each of R = 16 / L consecutive output rows, L the largest of 8, 4, 2, 1
 * that divides the row's G groups (SmolLM2: G = 18, L = 2, R = 8; G = 48, L = 8, R = 2), so no
 * lane is padding. Lane r L + l of block b is group b L + l of row r of the tile. A tile of R
 * rows is G / L blocks back to back, the tiles back to back (one stream for the prefetcher); a
 * block is 4 code vectors of 64 bytes, 16 bfloat16 scales, 16 bfloat16 zeros (20 bytes a
 * group). Code byte ``64 i + 4 lane + b`` holds code ``8 i + b`` of its group in its low nibble
 * and code ``8 i + 4 + b`` in its high one, so a 64-byte load gives two vpdpbusd operands whose
 * lanes each sum four codes of their own group, and after 8 of them each lane holds its group's
 * whole int32 dot: one conversion and two FMAs with 16 scales per 512 weights; a tile's lanes
 * are summed by row once at its end. The activations are laid out the same way
 * (``quantize_row``), each row's pattern repeated for the R rows of a tile.
 *
 * Built without AVX-512 VNNI nothing runs: ``q4_gemv_is_vectorized`` says 0 and the launcher
 * keeps torch's kernel, which a scalar loop here would not beat. The launcher checks shapes.
 */
#include "cpu_kernels.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_VNNI 1
#include <immintrin.h>
#endif

/* Q4_MAX_ROWS (8): cpu_kernels.h */
#define GROUP 32
#define LANES 16            /* groups a block */
/* At most 8 lanes a row, so a tile is 2 rows or more: its lane sums are added up once for all
 * (16 lanes a row, the sums of one row a tile measured 20-30 % slower at K = 512). */
#define MAX_LANES_PER_ROW 8
#define BLOCK_BYTES 320     /* 20 a group: 16 of codes, 2 of scale, 2 of zero */
#define Q4_TINY 1e-30f       /* groups with max |x| at most this quantize to 0 */
#define PREFETCH_BYTES 4096 /* ahead in the weight stream (1024: 20 % slower a token) */

int q4_gemv_is_vectorized(void) {
#ifdef Q4_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef Q4_VNNI

/* One activation row's quantized form, per block b: 8 vectors of 64 int8 (vector j, lane
 * r L + l: xq 4j .. 4j + 3 of group b L + l, the same for every r) for the high digit, 8 for the
 * low one (levels 2), then the 16 lanes' scales d and sums xs. */
typedef struct {
    int8_t hi[8][64];
    int8_t lo[8][64];
    float d[LANES];
    float xs[LANES];
} QBlock;

/* ``levels`` 1: xq = round(x * 127 / max |x|) in ``hi``; 2: xq = round(x * 32512 / max |x|)
 * (32512 = 127 * 256) written as two int8 digits, xq = 256 hi + lo with lo in -128..127. */
static void quantize_row(const float *x, int64_t num_groups, int lanes_per_row, int levels,
                         QBlock *blocks) {
    const int64_t num_blocks = num_groups / lanes_per_row;
    memset(blocks, 0, sizeof(QBlock) * (size_t)num_blocks);
    const float top = levels == 2 ? 32512.0f : 127.0f;
    for (int64_t g = 0; g < num_groups; g++) {
        QBlock *blk = blocks + g / lanes_per_row;
        const int l = (int)(g % lanes_per_row);  /* lane of the tile's first row */
        const __m512 a = _mm512_loadu_ps(x + g * GROUP);
        const __m512 b = _mm512_loadu_ps(x + g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        blk->xs[l] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        /* d = 0, xq = 0 (memset) for a group of zeros, and for one so small that top / amax
         * would overflow (its products are below 1e-28: the xs term keeps its sum). A NaN takes
         * this branch too, and reaches the output through xs. */
        if (!(amax > Q4_TINY)) continue;
        blk->d[l] = amax / top;
        const __m512 inv = _mm512_set1_ps(top / amax);
        /* cvtps rounds to nearest even (the default MXCSR mode); |x * inv| <= top. */
        __m512i q[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)),
                        _mm512_cvtps_epi32(_mm512_mul_ps(b, inv))};
        for (int h = 0; h < 2; h++) {
            int8_t hi[16], lo[16];
            if (levels == 2) {
                /* hi = floor((xq + 128) / 256) in -127..127, lo = xq - 256 hi in -128..127 */
                const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(q[h], _mm512_set1_epi32(128)), 8);
                const __m512i low = _mm512_sub_epi32(q[h], _mm512_slli_epi32(high, 8));
                _mm_storeu_si128((__m128i *)lo, _mm512_cvtepi32_epi8(low));
                q[h] = high;
            }
            _mm_storeu_si128((__m128i *)hi, _mm512_cvtepi32_epi8(q[h]));
            for (int j = 0; j < 4; j++) {
                memcpy(&blk->hi[4 * h + j][4 * l], hi + 4 * j, 4);
                if (levels == 2) memcpy(&blk->lo[4 * h + j][4 * l], lo + 4 * j, 4);
            }
        }
    }
    if (lanes_per_row == LANES) return;  /* (not with MAX_LANES_PER_ROW 8) */
    /* Repeat the first row's lanes for the tile's other rows: each lane is 32 bits (4 int8, or
     * one float), so lane i takes lane i % L. */
    const __m512i repeat = _mm512_and_si512(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lanes_per_row - 1));
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        __m512i *v = (__m512i *)(blocks + blk);
        for (size_t i = 0; i < sizeof(QBlock) / 64; i++)
            _mm512_store_si512(v + i, _mm512_permutexvar_epi32(repeat, _mm512_load_si512(v + i)));
    }
}

static inline __m512 bf16x16_to_f32(const uint8_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One tile (``num_blocks`` blocks of R rows) against activation rows 0 .. M - 1: the 16 lane
 * sums of row m into ``lane_sums[m]``. */
static inline void q4_tile(const uint8_t *w, int64_t num_blocks, const QBlock *x, int M,
                           int levels, float lane_sums[][LANES]) {
    __m512 acc[Q4_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t blk = 0; blk < num_blocks; blk++, w += BLOCK_BYTES) {
        for (int off = 0; off < BLOCK_BYTES; off += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + off), _MM_HINT_T0);
        __m512i codes[8];
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512((const void *)(w + 64 * i));
            codes[2 * i] = _mm512_and_si512(v, nibble);
            codes[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        const __m512 s = bf16x16_to_f32(w + 256);
        const __m512 z = bf16x16_to_f32(w + 288);
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);  /* z - 8 s */
        for (int m = 0; m < M; m++) {
            const QBlock *q = x + m * num_blocks + blk;
            /* Two chains of four: vpdpbusd's latency, not its throughput, would bound one. */
            __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                dot0 = _mm512_dpbusd_epi32(dot0, codes[j], _mm512_load_si512((const void *)q->hi[j]));
                dot1 = _mm512_dpbusd_epi32(dot1, codes[j + 1],
                                           _mm512_load_si512((const void *)q->hi[j + 1]));
            }
            __m512i dot = _mm512_add_epi32(dot0, dot1);
            if (levels == 2) {
                /* |256 hi-dot + lo-dot| <= 32 * 15 * 32512 < 2^24: exact in float32 too. */
                __m512i low0 = _mm512_setzero_si512(), low1 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    low0 = _mm512_dpbusd_epi32(low0, codes[j], _mm512_load_si512((const void *)q->lo[j]));
                    low1 = _mm512_dpbusd_epi32(low1, codes[j + 1],
                                               _mm512_load_si512((const void *)q->lo[j + 1]));
                }
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), _mm512_add_epi32(low0, low1));
            }
            const __m512 sd = _mm512_mul_ps(s, _mm512_load_ps(q->d));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, acc[m]);
            acc[m] = _mm512_fmadd_ps(offset, _mm512_load_ps(q->xs), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(lane_sums[m], acc[m]);
}

#define Q4_CASE(MM)                                                                            \
    case MM:                                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t t = 0; t < num_tiles; t++) {                                              \
            float lane_sums[Q4_MAX_ROWS][LANES];                                               \
            q4_tile(w + t * tile_bytes, num_blocks, blocks, MM, levels, lane_sums);            \
            for (int m = 0; m < MM; m++)                                                       \
                for (int r = 0; r < rows_per_tile; r++) {                                      \
                    float sum = 0.0f;                                                          \
                    for (int l = 0; l < lanes_per_row; l++)                                    \
                        sum += lane_sums[m][r * lanes_per_row + l];                            \
                    out[m * out_stride + t * rows_per_tile + r] = sum;                         \
                }                                                                              \
        }                                                                                      \
        break;

#endif /* Q4_VNNI */

/* The lanes of a block that one output row takes: the largest power of two <= 8 dividing
 * ``num_groups`` (pack_q4 computes the same). */
int q4_lanes_per_row(int64_t num_groups) {
    int lanes = MAX_LANES_PER_ROW;
    while (num_groups % lanes) lanes /= 2;
    return lanes;
}

/* ``w``: the ``pack_q4`` layout above; ``k`` a multiple of 32, ``n`` of 16 / L. Returns 0, -1
 * for a row count, width or ``levels`` the kernel does not take, -2 when out of memory or built
 * without AVX-512 VNNI. */
int q4_gemv_f32(const float *x, int64_t num_rows, int64_t x_stride, const uint8_t *w,
                int64_t n, int64_t k, int levels, float *out, int64_t out_stride,
                int num_threads) {
    if (num_rows < 1 || num_rows > Q4_MAX_ROWS || k <= 0 || k % GROUP || levels < 1 || levels > 2)
        return -1;
    const int64_t num_groups = k / GROUP;
    const int lanes_per_row = q4_lanes_per_row(num_groups), rows_per_tile = LANES / lanes_per_row;
    if (n % rows_per_tile) return -1;
#ifdef Q4_VNNI
    const int64_t num_blocks = num_groups / lanes_per_row, num_tiles = n / rows_per_tile;
    const int64_t tile_bytes = BLOCK_BYTES * num_blocks;
    QBlock *blocks = aligned_alloc(64, sizeof(QBlock) * (size_t)(num_rows * num_blocks));
    if (blocks == NULL) return -2;
    for (int64_t m = 0; m < num_rows; m++)
        quantize_row(x + m * x_stride, num_groups, lanes_per_row, levels, blocks + m * num_blocks);
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
    (void)x; (void)x_stride; (void)w; (void)levels; (void)out; (void)out_stride; (void)num_threads;
    return -2;
#endif
}
