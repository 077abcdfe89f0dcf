/* The op kernels that ``decoder_layers.c`` calls, linked into its library from their own
 * objects (ops/cpu/__init__.py's LINKED); each kernel's .c file includes this header too, so
 * the compiler holds both sides to one signature. What each argument means is documented at
 * its definition. */
#ifndef BASTION_CPU_KERNELS_H
#define BASTION_CPU_KERNELS_H
#include <stdint.h>

#define Q4_MAX_ROWS 8  /* the most rows one q4_gemv_f32 call takes */

int q4_gemv_f32(const float *x, int64_t num_rows, int64_t x_stride, const uint8_t *w,
                int64_t n, int64_t k, int levels, float *out, int64_t out_stride,
                int num_threads);

void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                  float *residual_out, const float *weight, float eps, int64_t num_rows,
                  int64_t width, float *out, int num_threads);

int64_t rotary_store_f32(const int64_t *positions, int64_t num_tokens, const float *query,
                         int64_t query_stride, const float *key, int64_t key_stride,
                         const float *value, int64_t value_stride, const float *cos_sin,
                         int64_t max_position, int64_t rotary_dim, int64_t num_q_heads,
                         int64_t num_kv_heads, int64_t head_size, float *query_out,
                         float *key_out, float *k_cache, float *v_cache,
                         const int64_t *slot_mapping, int64_t num_slots, int num_threads);

int64_t paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                   const int32_t *block_tables, int64_t table_stride,
                                   int64_t table_width, int64_t num_batch,
                                   const int32_t *seq_lens, const int32_t *query_start_loc,
                                   const int32_t *seq_ids, int64_t num_seqs, int64_t num_rows,
                                   int64_t num_blocks, float *out, int64_t num_q_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   float scale, float *scratch, int64_t scratch_stride,
                                   int64_t max_len, int num_threads);

void silu_and_mul_f32(const float *x, int64_t x_stride, int64_t num_rows, int64_t half,
                      float *out, int num_threads);

#endif
