/* SiLU-and-multiply of float32 rows: ``out[t, i] = silu(x[t, i]) * x[t, I + i]`` for a row of
 * 2 I, ``silu(a) = a / (1 + exp(-a))``, as ``ops/activation.py``'s reference computes it.
 *
 * One call instead of the reference's three torch ops (silu, slice, multiply). Compiled with
 * -ffast-math so that exp becomes glibc's vector expf: within a few float32 ulps of torch's
 * (tests/test_cpu_kernels.py states the tolerance). The launcher (activation.py) checks
 * shapes, dtypes and strides.
 */
#include "cpu_kernels.h"
#include <math.h>
#include <stdint.h>

void silu_and_mul_f32(const float *x, int64_t x_stride, int64_t num_rows, int64_t half,
                      float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 8)
    for (int64_t t = 0; t < num_rows; t++) {
        const float *gate = x + t * x_stride, *up = gate + half;
        float *dst = out + t * half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            /* -ffast-math assumes no infinities: exp's argument stays below float's range
             * (silu(a) < 1e-33 * |a| there, as torch's rounds to a denormal or zero). */
            const float e = expf(fminf(-gate[i], 80.0f));
            dst[i] = gate[i] / (1.0f + e) * up[i];
        }
    }
}
