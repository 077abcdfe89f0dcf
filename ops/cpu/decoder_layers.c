/* A decode step through a stack of Llama decoder layers and the final norm, in one call: the
 * op kernels of this folder, called in the order and with the arguments the model's op-by-op
 * path gives them (core/models/llama.py), so the result is that path's bit for bit (each
 * kernel is linked from its own object, built with its own flags: ops/cpu/__init__.py). The
 * int4 kernel takes at most Q4_MAX_ROWS rows a call: more go in chunks, each row's result the
 * same as in a call of fewer rows (every op here is row by row).
 *
 * Per layer, for M decode rows (one new token of each of M sequences, row i of sequence i):
 *     x, residual = rms_norm(hidden + residual)      (layer 0: residual = hidden, x = norm)
 *     qkv = x @ Wqkv^T                               (int4, quant_gemv4.c)
 *     q, k = rotary(q, k); store k, v at slot_mapping in the layer's paged cache
 *     a = paged attention of q over each sequence's seq_lens[i] cached keys and values
 *     x, residual = rms_norm(a @ Wo^T + residual)
 *     hidden = silu_and_mul(x @ Wgate_up^T) @ Wdown^T
 * and at the end ``out = rms_norm(hidden + residual)`` with the final norm's weight.
 *
 * Why: at one decode row each op is a few microseconds of arithmetic, and the Python around
 * it (module calls, launchers' checks, torch allocations, a ctypes call) cost more than the
 * matmuls themselves: ~300 torch ops and ~200 ctypes calls a token for SmolLM2's 30 layers.
 *
 * The launcher (decoder_layers.py) checks every weight's shape and the step's tensors; what
 * only the data can tell (a position, a slot, a block id) the op kernels check, skip and
 * count, and the count comes back here.
 */
#include "cpu_kernels.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One layer's weights (float32 norms, pack_q4 int4 layouts) and its KV cache. */
typedef struct {
    const float *input_norm;  /* [H] */
    const float *post_norm;   /* [H] */
    const uint8_t *qkv;       /* [Hq D + 2 Hk D] rows of H */
    const uint8_t *o;         /* [H] rows of Hq D */
    const uint8_t *gate_up;   /* [2 I] rows of H */
    const uint8_t *down;      /* [H] rows of I */
    float *k_cache;           /* [num_cache_blocks, block_size, Hk, D] */
    float *v_cache;
} DecoderLayer;

/* What every layer shares. */
typedef struct {
    int64_t hidden_size, num_q_heads, num_kv_heads, head_dim, intermediate_size;
    int64_t rotary_dim, max_position, block_size, num_cache_blocks;
    float eps, scale;
    int levels;                /* quant_gemv4's activation levels */
    const float *cos_sin;      /* [max_position, rotary_dim] */
    const float *final_norm;   /* [H] */
} DecoderShape;

/* ``x`` [M, K] @ ``w``^T -> ``out`` [M, N] for any M, in chunks of the int4 kernel's rows. */
static int q4_rows(const float *x, int64_t num_rows, int64_t k, const uint8_t *w, int64_t n,
                   int levels, float *out, int num_threads) {
    for (int64_t m = 0; m < num_rows; m += Q4_MAX_ROWS) {
        const int64_t rows = num_rows - m < Q4_MAX_ROWS ? num_rows - m : Q4_MAX_ROWS;
        const int status = q4_gemv_f32(x + m * k, rows, k, w, n, k, levels, out + m * n, n,
                                       num_threads);
        if (status) return status;
    }
    return 0;
}

/* ``hidden`` [M, H] (the embeddings; overwritten) -> ``out`` [M, H]. Returns 0; -1 for a
 * width the int4 kernel does not take, -2 out of memory, else the number of tokens and
 * (sequence, KV head) pairs the rotary and attention kernels refused. */
int64_t decoder_layers_f32(const DecoderShape *s, const DecoderLayer *layers,
                           int64_t num_layers, float *hidden, int64_t num_rows,
                           const int64_t *positions, const int64_t *slot_mapping,
                           const int32_t *block_tables, int64_t table_stride,
                           int64_t table_width, const int32_t *seq_lens,
                           const int32_t *query_start_loc, int64_t max_seq_len, float *out,
                           int num_threads) {
    const int64_t M = num_rows, H = s->hidden_size, D = s->head_dim;
    const int64_t Q = s->num_q_heads * D, KV = s->num_kv_heads * D, QKV = Q + 2 * KV;
    const int64_t I = s->intermediate_size;
    const int64_t group = s->num_q_heads / s->num_kv_heads;
    const int64_t scratch_stride = group * (max_seq_len + D);  /* as paged_attention.py's */
    const int64_t num_slots = s->num_cache_blocks * s->block_size;
    /* One allocation for the step's activations and the attention's per-thread scratch. */
    const int64_t floats = M * (2 * H + QKV + 2 * Q + KV + 3 * I)
                           + (int64_t)num_threads * scratch_stride;
    float *buf = malloc(sizeof(float) * (size_t)floats);
    if (buf == NULL) return -2;
    float *residual = buf, *x = residual + M * H, *qkv = x + M * H, *q = qkv + M * QKV;
    float *k = q + M * Q, *attn = k + M * KV, *gate_up = attn + M * Q, *act = gate_up + 2 * M * I;
    float *scratch = act + M * I;
    int64_t status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const DecoderLayer *w = layers + l;
        if (l == 0) {
            memcpy(residual, hidden, sizeof(float) * (size_t)(M * H));
            rms_norm_f32(hidden, H, NULL, 0, NULL, w->input_norm, s->eps, M, H, x, num_threads);
        } else {
            rms_norm_f32(hidden, H, residual, H, residual, w->input_norm, s->eps, M, H, x,
                         num_threads);
        }
        status = q4_rows(x, M, H, w->qkv, QKV, s->levels, qkv, num_threads);
        if (status) break;
        status = rotary_store_f32(positions, M, qkv, QKV, qkv + Q, QKV, qkv + Q + KV, QKV,
                                  s->cos_sin, s->max_position, s->rotary_dim, s->num_q_heads,
                                  s->num_kv_heads, D, q, k, w->k_cache, w->v_cache,
                                  slot_mapping, num_slots, num_threads);
        status += paged_decode_attention_f32(
            q, w->k_cache, w->v_cache, block_tables, table_stride, table_width, M, seq_lens,
            query_start_loc, NULL, M, M, s->num_cache_blocks, attn, s->num_q_heads,
            s->num_kv_heads, D, s->block_size, s->scale, scratch, scratch_stride, max_seq_len,
            num_threads);
        if (status) break;
        /* o-proj's output goes to ``hidden``, free since the input norm read it. */
        status = q4_rows(attn, M, Q, w->o, H, s->levels, hidden, num_threads);
        if (status) break;
        rms_norm_f32(hidden, H, residual, H, residual, w->post_norm, s->eps, M, H, x,
                     num_threads);
        status = q4_rows(x, M, H, w->gate_up, 2 * I, s->levels, gate_up, num_threads);
        if (status) break;
        silu_and_mul_f32(gate_up, 2 * I, M, I, act, num_threads);
        status = q4_rows(act, M, I, w->down, H, s->levels, hidden, num_threads);
    }
    if (status == 0)
        rms_norm_f32(hidden, H, residual, H, residual, s->final_norm, s->eps, M, H, out,
                     num_threads);
    free(buf);
    return status;
}
