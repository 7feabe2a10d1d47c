/* y = x W^T with int8 activations ("numerics int8"), batch-invariant bit for bit.
 *
 * W[n, k] = scale[n, k / B] * code[n, k] (- offset[n, k / B]), int8 codes, float32 scales and
 * offsets (blockmm.c's weights). Each row m of x is quantized per block of B inputs from that
 * row alone: xs[m, b] = max |x| / 127 (float32 division), xq = round-to-nearest-even(x / xs)
 * clamped to [-127, 127] (all zero where the block is); xo[m, b] = xs[m, b] * (float)sum(xq)
 * (offsets only). Then, for every (row m, output n), one fixed sequence of float32 operations:
 *
 *   acc[0..8) = 0
 *   for each step of 64 inputs at k (the last may have 16, 32 or 48):
 *     for each lane j < 8 whose 8 inputs, from i = k + 32 * ((j >> 1) & 1) + 16 * (j >> 2) + 8 * (j & 1),
 *     lie within K (all in one block b):
 *       acc[j] = acc[j] + (float)(sum of the 8 integer products) * (xs[m, b] * scale[n, b])
 *   total = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
 *   with offsets: t[0..8) = 0; for b in groups of 8 blocks: t[j] = t[j] + offset[n, b+j] * xo[m, b+j]
 *                 shift = (the same tree over t); then for the remaining blocks shift = shift + o * xo;
 *                 total = total - shift
 *   y[m, n] = total
 *
 * Every step is a correctly rounded float32 operation (built with -ffp-contract=off) and the
 * integer sums are exact, so the portable C below, the AVX2 path (vpmaddubsw/vpmaddwd on |w| and
 * sign(x, w): 2 * 128 * 127 fits in int16) and the VNNI paths (vpdpbusd, AVX-512 VNNI or
 * AVX-VNNI) give the same bits. (The lane order is vphaddd's: two chunks of 32 inputs, each
 * summed 4 by 4, are paired into sums of 8, so that each row converts, scales and accumulates
 * once per 64 inputs.) A row's result does not depend on the other rows of the call
 * (each row gets the same operations, whatever M and however rows are grouped), nor on the
 * thread count (threads split the outputs n; a reduction is never split).
 *
 * x [M, K] float32, codes [N, K] int8, scales and offsets [N, K / B] float32 (offsets may be
 * NULL), y [M, N] float32; B divides K and is a multiple of 16. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#define INT8_SIMD 1
#include <immintrin.h>
#endif

#define INT8_ROWS_PER_TASK 32 /* outputs per OpenMP task */
#define INT8_ROW_GROUP 4      /* rows of x sharing each loaded group of weights */

/* The lane scales of a row: xl[s * 8 + j] = xs[block of lane j of step s], 0 where the lane's
 * inputs are past K (steps of 64 inputs; see the header). */
static void lane_scales(const float *xs, int64_t K, int64_t B, float *xl) {
    for (int64_t k = 0; k < K; k += 64)
        for (int j = 0; j < 8; j++) {
            const int64_t i = k + 32 * ((j >> 1) & 1) + 16 * (j >> 2) + 8 * (j & 1);
            xl[k / 8 + j] = i < K ? xs[i / B] : 0.0f;
        }
}

/* Row m of x quantized per block: q [K] int8, xs [nb], xo [nb] (when offsets are used). */
static void quantize_row(const float *x, int64_t K, int64_t B, int8_t *q, float *xs, float *xo) {
    const int64_t nb = K / B;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * B;
        int8_t *qb = q + b * B;
        int64_t i = 0;
        float amax = 0.0f;
#ifdef INT8_SIMD
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m8 = _mm256_setzero_ps();
        for (; i + 8 <= B; i += 8) m8 = _mm256_max_ps(m8, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
#endif
        for (; i < B; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f;
        xs[b] = scale;
        int32_t total = 0;
        i = 0;
        if (scale > 0.0f) {
#ifdef INT8_SIMD
            const __m256 s = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
            for (; i + 8 <= B; i += 8) {
                __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xb + i), s),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r = _mm256_min_ps(_mm256_max_ps(r, low), high);
                const __m256i v = _mm256_cvtps_epi32(r);
                int32_t codes[8];
                _mm256_storeu_si256((__m256i *)codes, v);
                for (int j = 0; j < 8; j++) qb[i + j] = (int8_t)codes[j], total += codes[j];
            }
#endif
            for (; i < B; i++) {
                float r = nearbyintf(xb[i] / scale); /* the default rounding: to nearest, ties to even */
                r = r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
                qb[i] = (int8_t)r;
                total += (int32_t)r;
            }
        } else {
            for (; i < B; i++) qb[i] = 0;
        }
        if (xo) xo[b] = scale * (float)total;
    }
}

/* The fixed tree over 8 lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
static inline float tree8(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#ifdef INT8_SIMD
static inline float hsum8(__m256 v) { /* the same tree as tree8 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Integer sums of 4 consecutive products per 32-bit lane: |w| (unsigned) times sign(x, w). */
static inline __m256i dot4(__m256i aw, __m256i sx) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sx);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
#endif
}

/* sum_b o[b] * xo[b] in the fixed order of the header. */
static inline float offset_sum(const float *o, const float *xo, int64_t nb) {
    __m256 t = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_loadu_ps(o + b), _mm256_loadu_ps(xo + b)));
    float shift = hsum8(t);
    for (; b < nb; b++) shift = shift + o[b] * xo[b];
    return shift;
}

/* Integer sums of 8 products per lane, in the header's lane order, for the 64 codes at c and
 * the row's 64 codes at x: two chunks of 32, each summed 4 by 4, paired by vphaddd. */
static inline __m256i dot8(__m256i wa, __m256i awa, __m256i wb, __m256i awb, const int8_t *x) {
    const __m256i xa = _mm256_loadu_si256((const __m256i *)x), xb = _mm256_loadu_si256((const __m256i *)(x + 32));
    return _mm256_hadd_epi32(dot4(awa, _mm256_sign_epi8(xa, wa)), dot4(awb, _mm256_sign_epi8(xb, wb)));
}

/* Outputs first..last-1 for MM rows (a compile-time constant after inlining) of quantized x;
 * xl: the rows' lane scales (lane_scales, 8 per step of 64 inputs per row). The weight side of a step's scales,
 * ws, is built once per output and step and shared by the rows: blocks of 32 and 16 load it,
 * other block sizes (and a last step of fewer than 64 inputs) build it lane by lane. */
static inline __attribute__((always_inline)) void rows_int8(
        const int8_t *xq, const float *xl, const float *xo, const int MM, int64_t K, int64_t B, const int8_t *codes,
        const float *scales, const float *offsets, int64_t N, float *y, int64_t first, int64_t last) {
    const int64_t nb = K / B, whole = K / 64 * 64, lanes = (K + 63) / 64 * 8;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb;
        __m256 acc[INT8_ROW_GROUP];
        for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 64) {
            __m256 ws;
            if (B == 32 && k < whole) {
                const __m128 pair = _mm_castpd_ps(_mm_load_sd((const double *)(s + k / 32))); /* s0 s1 */
                const __m128 t = _mm_unpacklo_ps(pair, pair);                                  /* s0 s0 s1 s1 */
                ws = _mm256_set_m128(t, t);
            } else if (B == 16 && k < whole) {
                const __m128 four = _mm_loadu_ps(s + k / 16); /* blocks of inputs 0-15, 16-31, 32-47, 48-63 */
                ws = _mm256_set_m128(_mm_movehdup_ps(four), _mm_moveldup_ps(four));
            } else {
                float lanes[8];
                for (int j = 0; j < 8; j++) {
                    const int64_t i = k + 32 * ((j >> 1) & 1) + 16 * (j >> 2) + 8 * (j & 1);
                    lanes[j] = i < K ? s[i / B] : 0.0f;
                }
                ws = _mm256_loadu_ps(lanes);
            }
            _mm_prefetch((const char *)(c + k + 1024), _MM_HINT_T0);
            __m256i wa, wb;
            if (k < whole) {
                wa = _mm256_loadu_si256((const __m256i *)(c + k));
                wb = _mm256_loadu_si256((const __m256i *)(c + k + 32));
            } else { /* 16, 32 or 48 inputs left: zero codes past K */
                int8_t tail[64] = {0};
                for (int64_t i = k; i < K; i++) tail[i - k] = c[i];
                wa = _mm256_loadu_si256((const __m256i *)tail);
                wb = _mm256_loadu_si256((const __m256i *)(tail + 32));
            }
            const __m256i awa = _mm256_abs_epi8(wa), awb = _mm256_abs_epi8(wb);
            for (int m = 0; m < MM; m++) {
                __m256i sums;
                if (k < whole) {
                    sums = dot8(wa, awa, wb, awb, xq + m * K + k);
                } else {
                    int8_t tail[64] = {0};
                    for (int64_t i = k; i < K; i++) tail[i - k] = xq[m * K + i];
                    sums = dot8(wa, awa, wb, awb, tail);
                }
                const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(xl + m * lanes + k / 8), ws);
                acc[m] = _mm256_add_ps(acc[m], _mm256_mul_ps(_mm256_cvtepi32_ps(sums), scale));
            }
        }
        for (int m = 0; m < MM; m++) {
            float total = hsum8(acc[m]);
            if (offsets) total = total - offset_sum(offsets + n * nb, xo + m * nb, nb);
            y[m * N + n] = total;
        }
    }
}

static void group_int8(const int8_t *xq, const float *xl, const float *xo, int64_t rows, int64_t K, int64_t B,
                       const int8_t *codes, const float *scales, const float *offsets, int64_t N, float *y,
                       int64_t first, int64_t last) {
    switch (rows) {
        case 1: rows_int8(xq, xl, xo, 1, K, B, codes, scales, offsets, N, y, first, last); break;
        case 2: rows_int8(xq, xl, xo, 2, K, B, codes, scales, offsets, N, y, first, last); break;
        case 3: rows_int8(xq, xl, xo, 3, K, B, codes, scales, offsets, N, y, first, last); break;
        default: rows_int8(xq, xl, xo, 4, K, B, codes, scales, offsets, N, y, first, last); break;
    }
}
#else
/* Portable C: the header's sequence, lane by lane (xl: the rows' lane scales, see lane_scales). */
static void group_int8(const int8_t *xq, const float *xl, const float *xo, int64_t rows, int64_t K, int64_t B,
                       const int8_t *codes, const float *scales, const float *offsets, int64_t N, float *y,
                       int64_t first, int64_t last) {
    const int64_t nb = K / B, lanes = (K + 63) / 64 * 8;
    for (int64_t n = first; n < last; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * nb;
        for (int64_t m = 0; m < rows; m++) {
            const int8_t *q = xq + m * K;
            const float *xlm = xl + m * lanes;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t k = 0; k < K; k += 64) {
                for (int j = 0; j < 8; j++) {
                    const int64_t i = k + 32 * ((j >> 1) & 1) + 16 * (j >> 2) + 8 * (j & 1);
                    if (i >= K) continue;
                    int32_t sum = 0;
                    for (int64_t t = i; t < i + 8; t++) sum += (int32_t)c[t] * q[t];
                    const float scale = xlm[k / 8 + j] * s[i / B];
                    const float term = (float)sum * scale;
                    acc[j] = acc[j] + term;
                }
            }
            float total = tree8(acc);
            if (offsets) {
                const float *o = offsets + n * nb, *xom = xo + m * nb;
                float t[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                int64_t b = 0;
                for (; b + 8 <= nb; b += 8)
                    for (int j = 0; j < 8; j++) {
                        const float p = o[b + j] * xom[b + j];
                        t[j] = t[j] + p;
                    }
                float shift = tree8(t);
                for (; b < nb; b++) {
                    const float p = o[b] * xom[b];
                    shift = shift + p;
                }
                total = total - shift;
            }
            y[m * N + n] = total;
        }
    }
}
#endif

/* Returns 0 on success, -1 for unsupported shapes or no memory. */
int blockmm_int8(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int threads) {
    if (M < 1 || B < 16 || B % 16 != 0 || K % B != 0) return -1;
    const int64_t nb = K / B, tasks = (N + INT8_ROWS_PER_TASK - 1) / INT8_ROWS_PER_TASK;
    const int64_t lanes = (K + 63) / 64 * 8; /* lane scales per row: 8 per step of 64 inputs */
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc(sizeof(float) * (size_t)(M * (2 * nb + lanes)));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    float *xo = offsets ? xs + M * nb : NULL, *xl = xs + 2 * M * nb;
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * K, K, B, xq + m * K, xs + m * nb, xo ? xo + m * nb : NULL);
        lane_scales(xs + m * nb, K, B, xl + m * lanes);
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t first = t * INT8_ROWS_PER_TASK, last = first + INT8_ROWS_PER_TASK < N ? first + INT8_ROWS_PER_TASK : N;
        for (int64_t m0 = 0; m0 < M; m0 += INT8_ROW_GROUP) {
            const int64_t rows = M - m0 < INT8_ROW_GROUP ? M - m0 : INT8_ROW_GROUP;
            group_int8(xq + m0 * K, xl + m0 * lanes, xo ? xo + m0 * nb : NULL, rows, K, B, codes, scales, offsets, N,
                       y + m0 * N, first, last);
        }
    }
    free(xq);
    free(xs);
    return 0;
}
