/* y = x W^T for a weight matrix stored in blocks: W[n, k] = scale[n, k / B] * code[n, k]
 * (- offset[n, k / B] where offsets are given), int8 codes, float32 scales and offsets.
 *
 * Exactness: the weights are the model's own, scale * code - offset, the formula the caller
 * verified to reproduce the model's float32 weights bit for bit, multiplied with float32
 * activations. For several rows of x each weight is rebuilt as fl(scale * code) - offset and
 * multiplied with every row; for one row (decoding) the scale is applied once per block,
 * scale * sum(code * x) - offset * sum(x): the same real number, rounded differently. Either
 * way only the float32 rounding differs from x @ W^T, as it would with another summation
 * order; nothing is rounded to fewer bits (unlike llama.cpp, which quantizes activations).
 *
 * x [M, K] float32, codes [N, K] int8, scales and offsets [N, K / B] float32 (offsets may be
 * NULL), y [M, N] float32. B divides K and is a multiple of 16. Rows n are split over `threads`
 * OpenMP threads. */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS_PER_TASK 64

#ifdef __AVX2__
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define PREFETCH_AHEAD 2048 /* bytes of codes ahead of the current ones: measured ~15% faster on the LM head */

/* Rows first..last-1 of y for one row of x. Per block, t = sum_i code_i * x_i (codes widened to
 * float), then y += scale * t, and at the end y -= sum_b offset_b * xsum_b (xsum: the blocks'
 * sums of x; only read when there are offsets). The same real number as sum_i w_i x_i with
 * w_i = scale * code_i - offset, the scale applied once per block instead of once per weight:
 * fewer instructions per byte, which this path is bound by on one thread (the default model's
 * LM head, interleaved A/B: 28.2 -> 18.8 ms on 1 thread, 14.3 -> 13.0 ms on 2, where memory
 * bandwidth starts to bind). Blocks of 32, or of 16 taken two at a time. */
static inline void rows_one(const float *x, const float *xsum, int64_t K, const int8_t *codes,
                            const float *scales, const float *offsets, int64_t B, float *y,
                            int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb, *o = offsets ? offsets + n * nb : NULL;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        int64_t k = 0;
        if (B == 32) {
            for (int64_t b = 0; b < nb; b++, k += 32) {
                _mm_prefetch((const char *)(c + k + PREFETCH_AHEAD), _MM_HINT_T0);
                __m256 t0 = _mm256_mul_ps(widen8(c + k), _mm256_loadu_ps(x + k));
                __m256 t1 = _mm256_mul_ps(widen8(c + k + 8), _mm256_loadu_ps(x + k + 8));
                t0 = _mm256_fmadd_ps(widen8(c + k + 16), _mm256_loadu_ps(x + k + 16), t0);
                t1 = _mm256_fmadd_ps(widen8(c + k + 24), _mm256_loadu_ps(x + k + 24), t1);
                const __m256 sb = _mm256_set1_ps(s[b]), t = _mm256_add_ps(t0, t1);
                if (b & 1) acc1 = _mm256_fmadd_ps(sb, t, acc1);
                else acc0 = _mm256_fmadd_ps(sb, t, acc0);
            }
        } else if (B == 16) {
            for (int64_t b = 0; b + 1 < nb; b += 2, k += 32) {
                _mm_prefetch((const char *)(c + k + PREFETCH_AHEAD), _MM_HINT_T0);
                __m256 t0 = _mm256_mul_ps(widen8(c + k), _mm256_loadu_ps(x + k));
                __m256 t1 = _mm256_mul_ps(widen8(c + k + 16), _mm256_loadu_ps(x + k + 16));
                t0 = _mm256_fmadd_ps(widen8(c + k + 8), _mm256_loadu_ps(x + k + 8), t0);
                t1 = _mm256_fmadd_ps(widen8(c + k + 24), _mm256_loadu_ps(x + k + 24), t1);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s[b]), t0, acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s[b + 1]), t1, acc1);
            }
        }
        for (; k < K; k += 16) { /* other block sizes (16 weights never straddle a block), an odd last block of 16 */
            __m256 t = _mm256_mul_ps(widen8(c + k), _mm256_loadu_ps(x + k));
            t = _mm256_fmadd_ps(widen8(c + k + 8), _mm256_loadu_ps(x + k + 8), t);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s[k / B]), t, acc0);
        }
        float total = hsum8(_mm256_add_ps(acc0, acc1));
        if (o) {
            float shift = 0.0f;
            for (int64_t b = 0; b < nb; b++) shift += o[b] * xsum[b];
            total -= shift;
        }
        y[n] = total;
    }
}

/* Rows first..last-1 of y for M = MM rows of x (MM a compile-time constant after inlining, so
 * the accumulators live in registers). Each group of 8 weights is rebuilt once, in registers,
 * and multiplied with every row of x; with MM <= 4 two accumulators per row alternate between
 * groups to hide the FMA latency. */
static inline __attribute__((always_inline)) void rows_fixed(
        const float *x, const int MM, int64_t K, const int8_t *codes, const float *scales,
        const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb, *o = offsets ? offsets + n * nb : NULL;
        __m256 even[8], odd[8];
        for (int m = 0; m < MM; m++) even[m] = odd[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256 sb = _mm256_set1_ps(s[b]);
            const __m256 ob = _mm256_set1_ps(o ? o[b] : 0.0f);
            for (int64_t i = b * B; i < (b + 1) * B; i += 16) {
                _mm_prefetch((const char *)(c + i + PREFETCH_AHEAD), _MM_HINT_T0);
                __m256 w0 = _mm256_mul_ps(sb, widen8(c + i)), w1 = _mm256_mul_ps(sb, widen8(c + i + 8));
                if (o) { w0 = _mm256_sub_ps(w0, ob); w1 = _mm256_sub_ps(w1, ob); }
                for (int m = 0; m < MM; m++) {
                    const float *xm = x + m * K + i;
                    if (MM <= 4) {
                        even[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), even[m]);
                        odd[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), odd[m]);
                    } else {
                        even[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), even[m]);
                        even[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), even[m]);
                    }
                }
            }
        }
        for (int m = 0; m < MM; m++) y[m * N + n] = hsum8(MM <= 4 ? _mm256_add_ps(even[m], odd[m]) : even[m]);
    }
}

/* y rows for up to 8 rows of x at a time (xsum: see rows_one; used when M == 1). */
static void rows(const float *x, const float *xsum, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows_one(xm, xsum, K, codes, scales, offsets, B, ym, first, last); break;
            case 2: rows_fixed(xm, 2, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 3: rows_fixed(xm, 3, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 4: rows_fixed(xm, 4, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 5: rows_fixed(xm, 5, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 6: rows_fixed(xm, 6, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 7: rows_fixed(xm, 7, K, codes, scales, offsets, N, B, ym, first, last); break;
            default: rows_fixed(xm, 8, K, codes, scales, offsets, N, B, ym, first, last); break;
        }
    }
}
#else
static void rows(const float *x, const float *xsum, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        for (int64_t m = 0; m < M; m++) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float w = scales[n * nb + k / B] * (float)codes[n * K + k];
                if (offsets != NULL) w -= offsets[n * nb + k / B];
                total += w * x[m * K + k];
            }
            y[m * N + n] = total;
        }
    }
}
#endif

/* Returns 0 on success, -1 for unsupported shapes. */
int blockmm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
            const float *offsets, int64_t N, int64_t B, float *y, int threads) {
    if (M < 1 || B < 16 || B % 16 != 0 || K % B != 0) return -1;
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, nb = K / B;
    /* The blocks' sums of x for the row that takes the one-row path (the last, when M % 8 == 1),
     * needed to subtract offsets there. */
    float local[256], *xsum = NULL;
    if (offsets && M % 8 == 1) {
        xsum = nb <= 256 ? local : malloc(nb * sizeof(float));
        if (xsum == NULL) return -1;
        const float *last_row = x + (M - 1) * K;
        for (int64_t b = 0; b < nb; b++) {
            float total = 0.0f;
            for (int64_t i = 0; i < B; i++) total += last_row[b * B + i];
            xsum[b] = total;
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t first = t * ROWS_PER_TASK;
        int64_t last = first + ROWS_PER_TASK < N ? first + ROWS_PER_TASK : N;
        rows(x, xsum, M, K, codes, scales, offsets, N, B, y, first, last);
    }
    if (xsum != local) free(xsum);
    return 0;
}
