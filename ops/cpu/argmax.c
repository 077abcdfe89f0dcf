/* Row-wise argmax of float32 logits, as torch.argmax defines it: the first index of the
 * largest value, where a NaN counts as larger than anything (the first NaN wins).
 *
 * torch's CPU argmax compares (value, index) pairs one element at a time: 1.4 ms for 16 rows
 * of a 49k vocabulary on one core, against 0.1 ms for its vectorised amax. Here a row takes two
 * vectorised passes: its maximum, then the first index holding it. The first pass also sums
 * ``x * 0``, which is NaN only if the row holds a NaN or an infinity; only such rows look for a
 * NaN before the maximum. Compiled without -ffast-math, which would fold the NaN tests away.
 * The launcher (argmax.py) checks shapes, dtypes and strides.
 */
#include <math.h>
#include <stdint.h>

/* The first index in [0, n) where ``row[c] != row[c]`` (``nan``) or ``row[c] == value``, found
 * 64 columns at a time; n when there is none. */
static int64_t first_match(const float *row, int64_t n, float value, int nan) {
    for (int64_t start = 0; start < n; start += 64) {
        const int64_t end = n - start < 64 ? n : start + 64;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t c = start; c < end; c++) hit |= nan ? row[c] != row[c] : row[c] == value;
        if (hit) {
            int64_t c = start;
            while (!(nan ? row[c] != row[c] : row[c] == value)) c++;
            return c;
        }
    }
    return n;
}

void argmax_rows_f32(const float *x, int64_t num_rows, int64_t num_cols, int64_t row_stride,
                     int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = x + r * row_stride;
        float top = row[0];
        float probe = 0.0f;
#pragma omp simd reduction(max : top) reduction(+ : probe)
        for (int64_t c = 0; c < num_cols; c++) {
            top = row[c] > top ? row[c] : top;
            probe += row[c] * 0.0f;
        }
        int64_t best = isnan(probe) ? first_match(row, num_cols, 0.0f, 1) : num_cols;
        if (best == num_cols) best = first_match(row, num_cols, top, 0);
        out[r] = best;
    }
}
