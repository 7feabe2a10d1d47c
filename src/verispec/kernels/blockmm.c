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

/* 32 weights at c (one block of 32, or two blocks of 16 with scales s0, s1 and offsets o0, o1)
 * times x, into four accumulators. */
#define DOT32(c, x, s0, o0, s1, o1, a0, a1, a2, a3)                                             \
    do {                                                                                       \
        _mm_prefetch((const char *)((c) + PREFETCH_AHEAD), _MM_HINT_T0);                       \
        __m256 w0 = _mm256_mul_ps(s0, widen8(c)), w1 = _mm256_mul_ps(s0, widen8((c) + 8));     \
        __m256 w2 = _mm256_mul_ps(s1, widen8((c) + 16)), w3 = _mm256_mul_ps(s1, widen8((c) + 24)); \
        if (o) {                                                                               \
            w0 = _mm256_sub_ps(w0, o0); w1 = _mm256_sub_ps(w1, o0);                            \
            w2 = _mm256_sub_ps(w2, o1); w3 = _mm256_sub_ps(w3, o1);                            \
        }                                                                                      \
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), a0);                                      \
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps((x) + 8), a1);                                \
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps((x) + 16), a2);                               \
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps((x) + 24), a3);                               \
    } while (0)

/* Rows first..last-1 of y for one row of x, 32 weights per step into four accumulators (the
 * FMA latency is hidden); blocks of 32, or of 16 taken two at a time. */
static inline void rows_one(const float *x, int64_t K, const int8_t *codes, const float *scales,
                            const float *offsets, int64_t B, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb, *o = offsets ? offsets + n * nb : NULL;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = 0;
        if (B == 32) {
            for (int64_t b = 0; b < nb; b++, k += 32) {
                const __m256 sb = _mm256_set1_ps(s[b]), ob = _mm256_set1_ps(o ? o[b] : 0.0f);
                DOT32(c + k, x + k, sb, ob, sb, ob, a0, a1, a2, a3);
            }
        } else if (B == 16) {
            for (int64_t b = 0; b + 1 < nb; b += 2, k += 32) {
                const __m256 s0 = _mm256_set1_ps(s[b]), s1 = _mm256_set1_ps(s[b + 1]);
                const __m256 o0 = _mm256_set1_ps(o ? o[b] : 0.0f), o1 = _mm256_set1_ps(o ? o[b + 1] : 0.0f);
                DOT32(c + k, x + k, s0, o0, s1, o1, a0, a1, a2, a3);
            }
        }
        for (; k < K; k += 16) { /* other block sizes, and an odd last block of 16 */
            const __m256 sb = _mm256_set1_ps(s[k / B]), ob = _mm256_set1_ps(o ? o[k / B] : 0.0f);
            __m256 w0 = _mm256_mul_ps(sb, widen8(c + k)), w1 = _mm256_mul_ps(sb, widen8(c + k + 8));
            if (o) { w0 = _mm256_sub_ps(w0, ob); w1 = _mm256_sub_ps(w1, ob); }
            a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + k + 8), a1);
        }
        y[n] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
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

/* y rows for up to 8 rows of x at a time. */
static void rows(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows_one(xm, K, codes, scales, offsets, B, ym, first, last); break;
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
static void rows(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
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
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t first = t * ROWS_PER_TASK;
        int64_t last = first + ROWS_PER_TASK < N ? first + ROWS_PER_TASK : N;
        rows(x, M, K, codes, scales, offsets, N, B, y, first, last);
    }
    return 0;
}
