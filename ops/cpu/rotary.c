/* Neox-style rotary embedding of a step's queries and keys, and the store of the rotated keys
 * and the values in the paged KV cache (float32), in one pass instead of torch's ~20 small ops.
 *
 * Token t at ``positions[t]`` reads cos from the first half of its row of ``cos_sin``
 * [max_pos, rotary_dim] and sin from the second; in each head the first rotary_dim / 2 dims x1
 * and the next rotary_dim / 2 x2 become ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, the
 * dims past rotary_dim are copied. Rows of ``query``, ``key`` and ``value`` may have any stride
 * (they are views of the fused QKV output); ``query_out`` [T, Hq * D] and ``key_out``
 * [T, Hk * D] are contiguous. With ``slot_mapping``, key_out's row and value's row of token t
 * go to slot ``slot_mapping[t]`` of ``k_cache`` / ``v_cache`` [num_slots, Hk * D]; a slot < 0
 * (padding) stores nothing. A token whose position is outside [0, max_position) or whose slot is
 * past num_slots is skipped and counted (the launcher raises): never a read or write outside
 * the buffers.
 *
 * # NOTE: built with -ffp-contract=off: each product and sum rounds on its own, as torch's
 * separate multiply and add do, so the result is bit for bit the torch reference's.
 */
#include "cpu_kernels.h"
#include <stdint.h>
#include <string.h>

static void rotate_heads(const float *x, float *out, int64_t num_heads, int64_t head_size,
                         const float *cos, const float *sin, int64_t half) {
    for (int64_t h = 0; h < num_heads; h++) {
        const float *xh = x + h * head_size;
        float *oh = out + h * head_size;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            oh[i] = xh[i] * cos[i] - xh[i + half] * sin[i];
            oh[i + half] = xh[i + half] * cos[i] + xh[i] * sin[i];
        }
        for (int64_t i = 2 * half; i < head_size; i++) oh[i] = xh[i];
    }
}

int64_t rotary_store_f32(const int64_t *positions, int64_t num_tokens, const float *query,
                         int64_t query_stride, const float *key, int64_t key_stride,
                         const float *value, int64_t value_stride, const float *cos_sin,
                         int64_t max_position, int64_t rotary_dim, int64_t num_q_heads,
                         int64_t num_kv_heads, int64_t head_size, float *query_out,
                         float *key_out, float *k_cache, float *v_cache,
                         const int64_t *slot_mapping, int64_t num_slots, int num_threads) {
    const int64_t half = rotary_dim / 2;
    const int64_t kv_width = num_kv_heads * head_size;
    int64_t num_bad = 0;
    /* A decode step's few tokens are less work than waking a second thread. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64) \
    reduction(+ : num_bad)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping != NULL ? slot_mapping[t] : -1;
        if (positions[t] < 0 || positions[t] >= max_position || slot >= num_slots) {
            num_bad++;
            continue;
        }
        const float *cos = cos_sin + positions[t] * rotary_dim;
        const float *sin = cos + half;
        rotate_heads(query + t * query_stride, query_out + t * num_q_heads * head_size,
                     num_q_heads, head_size, cos, sin, half);
        float *k_row = key_out + t * kv_width;
        rotate_heads(key + t * key_stride, k_row, num_kv_heads, head_size, cos, sin, half);
        if (slot >= 0) {
            memcpy(k_cache + slot * kv_width, k_row, sizeof(float) * kv_width);
            memcpy(v_cache + slot * kv_width, value + t * value_stride, sizeof(float) * kv_width);
        }
    }
    return num_bad;
}
