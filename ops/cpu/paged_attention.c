/* Decode attention over the paged KV cache, read in place (float32).
 *
 * For each sequence ``b`` of ``seq_ids`` (NULL: sequences 0 .. num_seqs - 1), which has one new
 * token, the query row ``query_start_loc[b]`` of ``q`` [T, Hq, D] attends over the first
 * ``seq_lens[b]`` keys and values of its blocks ``block_tables[b, :]`` in ``k_cache`` and
 * ``v_cache`` [num_blocks, block_size, Hk, D]; the result goes to the same row of ``out``.
 * GQA: the Hq / Hk query heads of a group share their KV head, so each (sequence, KV head)
 * task reads its keys and values once for the whole group.
 *
 * Two passes per task: the scaled scores of every key into a scratch row per query head, then
 * an exact softmax (max, exp, sum) and the weighted sum of the values. ``scratch`` holds one
 * row of ``scratch_stride >= group * (max_len + head_dim)`` floats per thread.
 *
 * The launcher (paged_attention.py) checks shapes, dtypes and contiguity. What only the data
 * can tell (a sequence id, a length, a block id, a query row) is checked here, per task: a task
 * that would read or write outside its buffers is skipped and counted, and the count returned.
 */
#include "cpu_kernels.h"
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

/* Whether a sequence's context stays inside the buffers: 1 <= len <= max_len (the scratch's
 * bound) and the table's width, every block it reads inside the cache, its query row inside q.
 * A malformed step (a scheduler bug) costs an error in the launcher, never a wild read. */
static int task_is_valid(const int32_t *table, int64_t table_width, int64_t num_blocks,
                         int64_t block_size, int64_t len, int64_t max_len, int64_t row,
                         int64_t num_rows) {
    if (len < 1 || len > max_len || len > table_width * block_size || row < 0 || row >= num_rows)
        return 0;
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return 0;
    return 1;
}

int64_t paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                   const int32_t *block_tables, int64_t table_stride,
                                   int64_t table_width, int64_t num_batch,
                                   const int32_t *seq_lens, const int32_t *query_start_loc,
                                   const int32_t *seq_ids, int64_t num_seqs, int64_t num_rows,
                                   int64_t num_blocks, float *out, int64_t num_q_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   float scale, float *scratch, int64_t scratch_stride,
                                   int64_t max_len, int num_threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim; /* floats from one slot to the next */
    const int64_t block_stride = block_size * slot_stride;
    int64_t num_bad = 0;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads) \
    reduction(+ : num_bad)
    for (int64_t i = 0; i < num_seqs; i++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t b = seq_ids != NULL ? seq_ids[i] : i;
            if (b < 0 || b >= num_batch) {
                num_bad++;
                continue;
            }
            const int64_t len = seq_lens[b];
            const int64_t row = query_start_loc[b];
            const int32_t *table = block_tables + b * table_stride;
            if (!task_is_valid(table, table_width, num_blocks, block_size, len, max_len, row,
                               num_rows)) {
                num_bad++;
                continue;
            }
            const float *qg = q + (row * num_q_heads + h * group) * head_dim;
            float *og = out + (row * num_q_heads + h * group) * head_dim;
            float *scores = scratch + omp_get_thread_num() * scratch_stride;
            float *acc = scores + group * len;

            for (int64_t start = 0; start < len; start += block_size) {
                const float *kb = k_cache + table[start / block_size] * block_stride + h * head_dim;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t t = 0; t < n; t++) {
                    const float *kr = kb + t * slot_stride;
                    for (int64_t g = 0; g < group; g++) {
                        const float *qr = qg + g * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qr[d] * kr[d];
                        scores[g * len + start + t] = dot * scale;
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * len;
                float top = s[0];
                for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) {
                    s[t] = expf(s[t] - top);
                    sum += s[t];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
                for (int64_t d = 0; d < head_dim; d++) acc[g * head_dim + d] = 0.0f;
            }
            for (int64_t start = 0; start < len; start += block_size) {
                const float *vb = v_cache + table[start / block_size] * block_stride + h * head_dim;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t t = 0; t < n; t++) {
                    const float *vr = vb + t * slot_stride;
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * len + start + t];
                        float *ar = acc + g * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) ar[d] += p * vr[d];
                    }
                }
            }
            for (int64_t j = 0; j < group * head_dim; j++) og[j] = acc[j];
        }
    }
    return num_bad;
}
