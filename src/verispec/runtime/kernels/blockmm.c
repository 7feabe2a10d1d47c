/* y = x W^T for a weight matrix stored in blocks: W[n, k] = scale[n, k / B] * code[n, k]
 * (- offset[n, k / B] where offsets are given), int8 codes, float32 scales and offsets.
 *
 * Exactness: the weights are the model's own, scale * code - offset, the formula the caller
 * verified to reproduce the model's float32 weights bit for bit, multiplied with float32
 * activations. Rows of x are taken in groups of 8; in a group of 4 to 8 rows each weight is
 * rebuilt as fl(scale * code) - offset and multiplied with every row; in a group of 1 to 3 rows
 * (decoding, a short verify, the rest of a longer one) the scale is applied once per block,
 * scale * sum(code * x) - offset * sum(x), each row exactly as if it were alone: the same real
 * number, rounded differently. Either way only the float32 rounding differs from x @ W^T, as it
 * would with another summation order; nothing is rounded to fewer bits (unlike llama.cpp, which
 * quantizes activations).
 *
 * x [M, K] float32, codes [N, K] int8, scales and offsets [N, K / B] float32 (offsets may be
 * NULL), y [M, N] float32. B divides K and is a multiple of 16. Rows n are split over `threads`
 * OpenMP threads. The vector code needs AVX2 and FMA (compiled in where isa.h sets VS_AVX2: AVX2,
 * FMA and F16C, as every SIMD variant of runtime/build.py enables them); otherwise a portable loop
 * computes the rows_few arithmetic in scalar C. */
#include <stdint.h>
#include <stdlib.h>
#include "kernels.h"
#include "isa.h"

#define ROWS_PER_TASK 64

#ifdef VS_AVX2
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_i a[i] * b[i]: eight lanes, then the lanes summed, then the rest in order. */
static inline float dot(const float *a, const float *b, int64_t size) {
    int64_t i = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= size; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float total = hsum8(acc);
    for (; i < size; i++) total += a[i] * b[i];
    return total;
}

#define PREFETCH_AHEAD 2048 /* bytes of codes ahead of the current ones: measured ~15% faster on the LM head */

/* The two partial sums of 32 inputs at xm for rows_few, with the codes widened in cs in the
 * order they are used: t0 = cs[0] * xm[0..8) + cs[2] * xm[second..), t1 = cs[1] * xm[first..)
 * + cs[3] * xm[24..). Blocks of 32 take (first, second) = (8, 16): t0 covers inputs 0-7 and
 * 16-23; pairs of blocks of 16 take (16, 8): t0 the first block, t1 the second. */
static inline __attribute__((always_inline)) void two_sums(const __m256 cs[4], const float *xm, int64_t first,
                                                           int64_t second, __m256 *t0, __m256 *t1) {
    *t0 = _mm256_mul_ps(cs[0], _mm256_loadu_ps(xm));
    *t1 = _mm256_mul_ps(cs[1], _mm256_loadu_ps(xm + first));
    *t0 = _mm256_fmadd_ps(cs[2], _mm256_loadu_ps(xm + second), *t0);
    *t1 = _mm256_fmadd_ps(cs[3], _mm256_loadu_ps(xm + 24), *t1);
}

/* Rows first..last-1 of y for MM rows of x (MM <= 3 in use; a compile-time constant after
 * inlining). Per block, t = sum_i code_i * x_i (codes widened to float), then y += scale * t,
 * and at the end y -= sum_b offset_b * xsum_b (xsum [MM, nb]: the blocks' sums of x, read only
 * when there are offsets; that sum taken by `dot`). The same real number as sum_i w_i x_i with
 * w_i = scale * code_i - offset, the scale applied once per block instead of once per weight:
 * fewer instructions per byte, which this path is bound by on one thread (the default model's
 * LM head, interleaved A/B: 28.2 -> 18.8 ms on 1 thread, 14.3 -> 13.0 ms on 2, where memory
 * bandwidth starts to bind). Each group of weights is widened once and used for every row, and
 * each row gets exactly the operations, in exactly the order, of a one-row call: the matmuls of
 * a verify of up to 3 tokens give each token bit for bit what a one-token step gives it (the LM
 * head on 2 rows, interleaved A/B: 17.9 -> 16.2 ms against rows_fixed). Blocks of 32, or of 16
 * taken two at a time. */
static inline __attribute__((always_inline)) void rows_few(
        const float *x, const int MM, const float *xsum, int64_t K, const int8_t *codes, const float *scales,
        const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb, *o = offsets ? offsets + n * nb : NULL;
        __m256 acc0[4], acc1[4];
        for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
        int64_t k = 0;
        if (B == 32) {
            for (int64_t b = 0; b < nb; b++, k += 32) {
                _mm_prefetch((const char *)(c + k + PREFETCH_AHEAD), _MM_HINT_T0);
                const __m256 cs[4] = {widen8(c + k), widen8(c + k + 8), widen8(c + k + 16), widen8(c + k + 24)};
                const __m256 sb = _mm256_set1_ps(s[b]);
                for (int m = 0; m < MM; m++) {
                    __m256 t0, t1;
                    two_sums(cs, x + m * K + k, 8, 16, &t0, &t1);
                    const __m256 t = _mm256_add_ps(t0, t1);
                    if (b & 1) acc1[m] = _mm256_fmadd_ps(sb, t, acc1[m]);
                    else acc0[m] = _mm256_fmadd_ps(sb, t, acc0[m]);
                }
            }
        } else if (B == 16) {
            for (int64_t b = 0; b + 1 < nb; b += 2, k += 32) {
                _mm_prefetch((const char *)(c + k + PREFETCH_AHEAD), _MM_HINT_T0);
                const __m256 cs[4] = {widen8(c + k), widen8(c + k + 16), widen8(c + k + 8), widen8(c + k + 24)};
                const __m256 s0 = _mm256_set1_ps(s[b]), s1 = _mm256_set1_ps(s[b + 1]);
                for (int m = 0; m < MM; m++) {
                    __m256 t0, t1;
                    two_sums(cs, x + m * K + k, 16, 8, &t0, &t1);
                    acc0[m] = _mm256_fmadd_ps(s0, t0, acc0[m]);
                    acc1[m] = _mm256_fmadd_ps(s1, t1, acc1[m]);
                }
            }
        }
        for (; k < K; k += 16) { /* other block sizes (16 weights never straddle a block), an odd last block of 16 */
            const __m256 c0 = widen8(c + k), c1 = widen8(c + k + 8), sb = _mm256_set1_ps(s[k / B]);
            for (int m = 0; m < MM; m++) {
                __m256 t = _mm256_mul_ps(c0, _mm256_loadu_ps(x + m * K + k));
                t = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x + m * K + k + 8), t);
                acc0[m] = _mm256_fmadd_ps(sb, t, acc0[m]);
            }
        }
        for (int m = 0; m < MM; m++) {
            float total = hsum8(_mm256_add_ps(acc0[m], acc1[m]));
            if (o) total -= dot(o, xsum + m * nb, nb);
            y[m * N + n] = total;
        }
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

/* y rows for up to 8 rows of x at a time: groups of up to 3 rows (decoding, a verify of up to 3
 * tokens, or what is left after groups of 8) take rows_few, groups of 4 to 8 rows_fixed (faster
 * there: measured 0.91-0.97x for rows_few at 4 rows); xsum: [M, nb], see rows_few. */
static void rows(const float *x, const float *xsum, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float *xm = x + m0 * K, *sm = xsum ? xsum + m0 * nb : NULL;
        float *ym = y + m0 * N;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows_few(xm, 1, sm, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 2: rows_few(xm, 2, sm, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 3: rows_few(xm, 3, sm, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 4: rows_fixed(xm, 4, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 5: rows_fixed(xm, 5, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 6: rows_fixed(xm, 6, K, codes, scales, offsets, N, B, ym, first, last); break;
            case 7: rows_fixed(xm, 7, K, codes, scales, offsets, N, B, ym, first, last); break;
            default: rows_fixed(xm, 8, K, codes, scales, offsets, N, B, ym, first, last); break;
        }
    }
}
#else
/* Portable C (no AVX2/FMA build): per output and row, each block's sum of code * x, scaled once
 * per block, the offsets subtracted at the end as on the rows_few path (the same real number). */
static void rows(const float *x, const float *xsum, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb, *o = offsets ? offsets + n * nb : NULL;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float t = 0.0f;
                for (int64_t i = b * B; i < (b + 1) * B; i++) t += (float)c[i] * xm[i];
                total += s[b] * t;
            }
            if (o) {
                float shift = 0.0f;
                for (int64_t b = 0; b < nb; b++) shift += o[b] * xsum[m * nb + b];
                total -= shift;
            }
            y[m * N + n] = total;
        }
    }
}
#endif

/* Which instruction-set variant this library was compiled as (blockmm.py checks it). */
const char *blockmm_isa(void) { return VS_ISA_NAME; }

/* Returns 0 on success, -1 for unsupported shapes. */
int blockmm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
            const float *offsets, int64_t N, int64_t B, float *y, int threads) {
    if (M < 1 || B < 16 || B % 16 != 0 || K % B != 0) return -1;
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, nb = K / B;
    /* The blocks' sums of x [M, nb], needed to subtract offsets on the rows_few path. */
    float local[256], *xsum = NULL;
    if (offsets) {
        xsum = M * nb <= 256 ? local : malloc(M * nb * sizeof(float));
        if (xsum == NULL) return -1;
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++) {
                float total = 0.0f;
                for (int64_t i = 0; i < B; i++) total += x[m * K + b * B + i];
                xsum[m * nb + b] = total;
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
