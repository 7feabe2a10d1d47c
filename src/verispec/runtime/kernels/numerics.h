/* The numerics blockmm_int8.c and qmatmul.c share, written once so that both compute alike:
 * float16 scales read exactly as float32, and how float32 activations become int8 codes: per block, scale = max |x| / 127; code = x / scale rounded to nearest (ties to
 * even), clamped to [-127, 127]; all codes 0 when the scale is 0. The AVX2 loops and the scalar
 * ones give the same bits (the same float32 division and rounding), so every build agrees. */
#ifndef VERISPEC_NUMERICS_H
#define VERISPEC_NUMERICS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "isa.h"

/* float16 -> float32, exact (every float16 is a float32). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        const float value = ldexpf((float)mantissa, -24);
        return sign ? -value : value;
    }
    const uint32_t bits = exponent == 31 ? sign | 0x7F800000u | (mantissa << 13)
                                         : sign | ((exponent + 112u) << 23) | (mantissa << 13);
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* max |x[i]| over i < n. */
static inline float abs_max(const float *x, int64_t n) {
    float amax = 0.0f;
    int64_t i = 0;
#ifdef VS_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m8 = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
#endif
    for (; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* q[i] = the code of x[i] at `scale`, for i < n; returns the sum of the codes, and adds the code
 * of input i to sums16[i / 16] when sums16 is given. */
static inline int32_t quantize_codes(const float *x, int64_t n, float scale, int8_t *q, int32_t *sums16) {
    int32_t total = 0;
    if (!(scale > 0.0f)) {
        memset(q, 0, (size_t)n);
        return 0;
    }
#ifdef VS_AVX2
    const int64_t vectors = n - n % 8; /* inputs the AVX2 loop takes */
    const __m256 s = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
    for (int64_t i = 0; i < vectors; i += 8) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, low), high);
        int32_t codes[8];
        _mm256_storeu_si256((__m256i *)codes, _mm256_cvtps_epi32(r));
        for (int j = 0; j < 8; j++) {
            q[i + j] = (int8_t)codes[j], total += codes[j];
            if (sums16) sums16[(i + j) / 16] += codes[j];
        }
    }
#else
    const int64_t vectors = 0;
#endif
    for (int64_t i = vectors; i < n; i++) {
        float r = nearbyintf(x[i] / scale); /* the default rounding: to nearest, ties to even */
        r = r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
        q[i] = (int8_t)r, total += (int32_t)r;
        if (sums16) sums16[i / 16] += (int32_t)r;
    }
    return total;
}

#endif
