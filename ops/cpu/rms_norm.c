/* RMS normalisation of float32 rows, alone or fused with the residual add, as
 * ``ops/layernorm.py``'s references compute it: with ``residual``, ``r = x + residual`` is
 * written to ``residual_out`` and normalised; ``out = r * (1 / sqrt(mean(r * r) + eps)) * weight``.
 *
 * One call replaces the reference's six to eight torch ops (each a dispatch and a pass over the
 * row), which at one decode row cost far more than the arithmetic. The sum of squares is
 * taken in double; every other step rounds as the reference's float32 ops do (compiled
 * without contraction), so the result is the reference's up to the last bit of the scale.
 * The launcher (rms_norm.py) checks shapes, dtypes and strides.
 */
#include "cpu_kernels.h"
#include <math.h>
#include <stddef.h>
#include <stdint.h>

void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                  float *residual_out, const float *weight, float eps, int64_t num_rows,
                  int64_t width, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 8)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = x + r * x_stride;
        float *dst = out + r * width;
        if (residual != NULL) {
            const float *res = residual + r * res_stride;
            float *sum = residual_out + r * width;
            for (int64_t c = 0; c < width; c++) sum[c] = row[c] + res[c];
            row = sum;
        }
        double squares = 0.0;
#pragma omp simd reduction(+ : squares)
        for (int64_t c = 0; c < width; c++) squares += (double)row[c] * (double)row[c];
        const float scale = 1.0f / sqrtf((float)(squares / (double)width) + eps);
        for (int64_t c = 0; c < width; c++) dst[c] = row[c] * scale * weight[c];
    }
}
