/* y = x W^T with int8 activations ("numerics int8"), batch-invariant bit for bit.
 *
 * W[n, k] = scale[n, k / B] * code[n, k] (- offset[n, k / B]), int8 codes, float32 scales and
 * offsets (blockmm.c's weights), given here in the packed layout of `gguf_blocks.PackedBlocks`:
 * outputs in groups of 8 (the last group padded with zero codes), and within a group, for each
 * 4 consecutive inputs, the 4 codes of output 0, then of output 1, ..., of output 7 (32 bytes):
 *   codes  [G, K / 4, 8, 4] int8      code[n, k] = codes[n / 8, k / 4, n % 8, k % 4]
 *   scales [G, K / B, 8] float32      scale[n, b] = scales[n / 8, b, n % 8] (offsets alike)
 * so that one 32-byte load gives 8 outputs x 4 inputs and the products of a row land in 8 lanes,
 * one per output: no horizontal sums.
 *
 * Each row m of x is quantized per block of B inputs from that row alone: xs[m, b] = max |x| / 127
 * (float32 division), xq = round-to-nearest-even(x / xs) clamped to [-127, 127] (all zero where
 * the block is); xo[m, b] = xs[m, b] * (float)sum(xq) (offsets only). Then, for every (row m,
 * output n), one fixed sequence of float32 operations over the blocks in order:
 *
 *   acc = 0; shift = 0
 *   for b = 0 .. K/B - 1:
 *     acc = acc + (float)(exact integer sum of code * xq over block b) * (xs[m, b] * scale[n, b])
 *     shift = shift + offset[n, b] * xo[m, b]              (offsets only)
 *   y[m, n] = acc - shift                                  (acc without offsets)
 *
 * Every step is a correctly rounded float32 operation (built with -ffp-contract=off) and the
 * integer sums are exact, so the portable C below, the AVX2 path (vpmaddubsw/vpmaddwd on |w| and
 * sign(x, w): |w| <= 128 and |x| <= 127, so a pair 2 * 128 * 127 fits in int16) and the VNNI paths
 * (vpdpbusd, AVX-512 VNNI or AVX-VNNI) give the same bits. A row's result does not depend on the
 * other rows of the call (each row gets the same operations whatever M and however rows are tiled),
 * nor on the thread count (threads split the output groups; a reduction is never split).
 *
 * The SIMD path works on tiles of up to 4 rows x 16 outputs: per 4 inputs it loads 32 bytes of
 * codes per group once for all 4 rows and does, per row and group, one sign, one vpmaddubsw, one
 * vpmaddwd and one add (one vpdpbusd with VNNI); the float work is once per block.
 *
 * x [M, K] float32, y [M, N] float32; B divides K and is a multiple of 4. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#define INT8_SIMD 1
#include <immintrin.h>
#endif

#define GROUP 8           /* outputs per packed group: one float32 lane each */
#define GROUPS_PER_TASK 4 /* output groups per OpenMP task */
#define ROW_TILE 4        /* rows of x sharing each loaded step of codes */

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

#ifdef INT8_SIMD
/* acc + the integer sums of 4 products per lane: |w| (unsigned, <= 128) times sign(x, w). */
static inline __m256i dot_step(__m256i acc, __m256i aw, __m256i sx) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, aw, sx);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, aw, sx);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}

/* Rows 0..R-1 of the quantized rows (xq [R, K], xs/xo [R, nb]) times output groups g0 .. g0+G-1
 * (R <= ROW_TILE and G <= 2 are compile-time constants after inlining). */
static inline __attribute__((always_inline)) void tile(
        const int8_t *xq, const float *xs, const float *xo, const int R, const int G, int64_t K, int64_t B,
        const int8_t *codes, const float *scales, const float *offsets, int64_t N, float *y, int64_t g0) {
    const int64_t nb = K / B, steps_per_block = B / 4;
    const int8_t *w0 = codes + g0 * K * GROUP, *w1 = w0 + K * GROUP; /* K / 4 steps of 32 bytes per group */
    __m256 acc[ROW_TILE][2], shift[ROW_TILE][2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm256_setzero_ps(), shift[r][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i sums[ROW_TILE][2];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) sums[r][g] = _mm256_setzero_si256();
        for (int64_t s = b * steps_per_block; s < (b + 1) * steps_per_block; s++) {
            __m256i w[2], aw[2];
            w[0] = _mm256_loadu_si256((const __m256i *)(w0 + s * 32));
            aw[0] = _mm256_abs_epi8(w[0]);
            if (G > 1) {
                w[1] = _mm256_loadu_si256((const __m256i *)(w1 + s * 32));
                aw[1] = _mm256_abs_epi8(w[1]);
            }
            _mm_prefetch((const char *)(w0 + s * 32 + 2048), _MM_HINT_T0);
            if (G > 1) _mm_prefetch((const char *)(w1 + s * 32 + 2048), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + s * 4, 4);
                const __m256i xb = _mm256_set1_epi32(four);
                for (int g = 0; g < G; g++) sums[r][g] = dot_step(sums[r][g], aw[g], _mm256_sign_epi8(xb, w[g]));
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 ws = _mm256_loadu_ps(scales + ((g0 + g) * nb + b) * GROUP);
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(xs[r * nb + b]), ws);
                acc[r][g] = _mm256_add_ps(acc[r][g], _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r][g]), scale));
            }
            if (offsets) {
                const __m256 wo = _mm256_loadu_ps(offsets + ((g0 + g) * nb + b) * GROUP);
                for (int r = 0; r < R; r++)
                    shift[r][g] = _mm256_add_ps(shift[r][g], _mm256_mul_ps(wo, _mm256_set1_ps(xo[r * nb + b])));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int64_t n = (g0 + g) * GROUP, count = N - n < GROUP ? N - n : GROUP;
            const __m256 v = offsets ? _mm256_sub_ps(acc[r][g], shift[r][g]) : acc[r][g];
            if (count == GROUP) {
                _mm256_storeu_ps(y + r * N + n, v);
            } else { /* the last group is short: only its real outputs */
                float lanes[GROUP];
                _mm256_storeu_ps(lanes, v);
                memcpy(y + r * N + n, lanes, sizeof(float) * (size_t)count);
            }
        }
}

#define TILE(R, G) tile(xq, xs, xo, R, G, K, B, codes, scales, offsets, N, y, g0)
static void tile_any(const int8_t *xq, const float *xs, const float *xo, int64_t rows, int64_t groups, int64_t K,
                     int64_t B, const int8_t *codes, const float *scales, const float *offsets, int64_t N, float *y,
                     int64_t g0) {
    switch (rows * 2 + (groups > 1)) {
        case 2: TILE(1, 1); break;
        case 3: TILE(1, 2); break;
        case 4: TILE(2, 1); break;
        case 5: TILE(2, 2); break;
        case 6: TILE(3, 1); break;
        case 7: TILE(3, 2); break;
        case 8: TILE(4, 1); break;
        default: TILE(4, 2); break;
    }
}
#undef TILE
#else
/* Portable C: the header's sequence, output by output (at most ROW_TILE rows, G groups). */
static void tile_any(const int8_t *xq, const float *xs, const float *xo, int64_t rows, int64_t groups, int64_t K,
                     int64_t B, const int8_t *codes, const float *scales, const float *offsets, int64_t N, float *y,
                     int64_t g0) {
    const int64_t nb = K / B;
    for (int64_t g = g0; g < g0 + groups; g++)
        for (int64_t lane = 0; lane < GROUP && g * GROUP + lane < N; lane++)
            for (int64_t m = 0; m < rows; m++) {
                const int64_t n = g * GROUP + lane;
                float acc = 0.0f, shift = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t sum = 0;
                    for (int64_t k = b * B; k < (b + 1) * B; k++)
                        sum += (int32_t)codes[(g * (K / 4) + k / 4) * 32 + lane * 4 + k % 4] * xq[m * K + k];
                    const float scale = xs[m * nb + b] * scales[(g * nb + b) * GROUP + lane];
                    const float term = (float)sum * scale;
                    acc = acc + term;
                    if (offsets) {
                        const float p = offsets[(g * nb + b) * GROUP + lane] * xo[m * nb + b];
                        shift = shift + p;
                    }
                }
                y[m * N + n] = offsets ? acc - shift : acc;
            }
}
#endif

/* Returns 0 on success, -1 for unsupported shapes or no memory. codes, scales and offsets are
 * packed (see the header); offsets may be NULL. */
int blockmm_int8(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 const float *offsets, int64_t N, int64_t B, float *y, int threads) {
    if (M < 1 || N < 1 || B < 4 || B % 4 != 0 || K % B != 0) return -1;
    const int64_t nb = K / B, groups = (N + GROUP - 1) / GROUP;
    const int64_t tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc(sizeof(float) * (size_t)(M * 2 * nb));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    float *xo = offsets ? xs + M * nb : NULL;
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, B, xq + m * K, xs + m * nb, xo ? xo + m * nb : NULL);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t first = t * GROUPS_PER_TASK, last = first + GROUPS_PER_TASK < groups ? first + GROUPS_PER_TASK : groups;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int64_t rows = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
            for (int64_t g0 = first; g0 < last; g0 += 2)
                tile_any(xq + m0 * K, xs + m0 * nb, xo ? xo + m0 * nb : NULL, rows, last - g0 < 2 ? 1 : 2, K, B,
                         codes, scales, offsets, N, y + m0 * N, g0);
        }
    }
    free(xq);
    free(xs);
    return 0;
}
