/* y = x W^T for a weight matrix stored in blocks: W[n, k] = scale[n, k / B] * code[n, k]
 * (- offset[n, k / B] where offsets are given), int8 codes, float32 scales and offsets.
 *
 * Exactness: each weight is rebuilt in float32 as fl(scale * code) (then minus the offset), the
 * formula the caller verified to reproduce the model's float32 weights bit for bit, and
 * multiplied with float32 activations; only the order of the float32 sums differs from
 * x @ W^T. Nothing is rounded to fewer bits (unlike llama.cpp, which quantizes activations).
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

/* One row's weights, rebuilt in float32 into w [K]. */
static inline void dequantize_row(const int8_t *codes, const float *scales, const float *offsets,
                                  int64_t K, int64_t B, float *w) {
    for (int64_t b = 0; b < K / B; b++) {
        __m256 s = _mm256_set1_ps(scales[b]);
        for (int64_t i = b * B; i < (b + 1) * B; i += 8) {
            __m256 v = _mm256_mul_ps(s, widen8(codes + i));
            if (offsets != NULL) v = _mm256_sub_ps(v, _mm256_set1_ps(offsets[b]));
            _mm256_storeu_ps(w + i, v);
        }
    }
}

static void rows(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, float *w,
                 int64_t first, int64_t last) {
    const int64_t nb = K / B;
    if (M == 1) {  /* one token: rebuild and multiply in registers, no scratch row */
        for (int64_t n = first; n < last; n++) {
            const int8_t *c = codes + n * K;
            const float *s = scales + n * nb, *o = offsets ? offsets + n * nb : NULL;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (int64_t b = 0; b < nb; b++) {
                __m256 sb = _mm256_set1_ps(s[b]);
                __m256 ob = _mm256_set1_ps(o ? o[b] : 0.0f);
                for (int64_t i = b * B; i < (b + 1) * B; i += 16) {
                    __m256 w0 = _mm256_mul_ps(sb, widen8(c + i)), w1 = _mm256_mul_ps(sb, widen8(c + i + 8));
                    if (o) { w0 = _mm256_sub_ps(w0, ob); w1 = _mm256_sub_ps(w1, ob); }
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), a0);
                    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), a1);
                }
            }
            y[n] = hsum8(_mm256_add_ps(a0, a1));
        }
        return;
    }
    for (int64_t n = first; n < last; n++) {
        dequantize_row(codes + n * K, scales + n * nb, offsets ? offsets + n * nb : NULL, K, B, w);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *x0 = x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 wk = _mm256_loadu_ps(w + k);
                a0 = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x0 + k), a0);
                a1 = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x1 + k), a1);
                a2 = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x2 + k), a2);
                a3 = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x3 + k), a3);
            }
            y[m * N + n] = hsum8(a0);
            y[(m + 1) * N + n] = hsum8(a1);
            y[(m + 2) * N + n] = hsum8(a2);
            y[(m + 3) * N + n] = hsum8(a3);
        }
        for (; m < M; m++) {
            const float *xm = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xm + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xm + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(xm + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(xm + k + 24), a3);
            }
            for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xm + k), a0);
            y[m * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
    }
}
#else
static void rows(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, float *w,
                 int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        for (int64_t k = 0; k < K; k++) {
            float v = scales[n * nb + k / B] * (float)codes[n * K + k];
            w[k] = offsets != NULL ? v - offsets[n * nb + k / B] : v;
        }
        for (int64_t m = 0; m < M; m++) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; k++) total += w[k] * x[m * K + k];
            y[m * N + n] = total;
        }
    }
}
#endif

/* Returns 0 on success, -1 for unsupported shapes, -2 if scratch memory is unavailable. */
int blockmm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
            const float *offsets, int64_t N, int64_t B, float *y, int threads) {
    if (M < 1 || B < 16 || B % 16 != 0 || K % B != 0) return -1;
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *w = (float *)aligned_alloc(64, (size_t)((K * sizeof(float) + 63) / 64 * 64));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (w == NULL) continue;
            int64_t first = t * ROWS_PER_TASK;
            int64_t last = first + ROWS_PER_TASK < N ? first + ROWS_PER_TASK : N;
            rows(x, M, K, codes, scales, offsets, N, B, y, w, first, last);
        }
        free(w);
    }
    return failed ? -2 : 0;
}
