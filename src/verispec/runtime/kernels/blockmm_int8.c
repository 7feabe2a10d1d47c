/* y = x W^T with int8 activations ("numerics int8"), batch-invariant bit for bit.
 *
 * W[n, k] = scale[n, k / B] * code[n, k] (- offset[n, k / B]), int8 codes, float32 scales and
 * offsets (blockmm.c's weights), given here in the packed layout of `gguf.blocks.PackedBlocks`:
 * outputs in groups of 8 (the last group padded), and within a group, for each 4 consecutive
 * inputs, the 4 codes of output 0, then of output 1, ..., of output 7 (32 bytes):
 *   codes  [G, K / 4, 8, 4] bytes     code[n, k] = codes[n / 8, k / 4, n % 8, k % 4] (- code_bias)
 *   scales [G, K / B, 8] float32      scale[n, b] = scales[n / 8, b, n % 8] (offsets alike), or
 *                                     float16 (half_scales) where every scale is one exactly
 * so that one 32-byte load gives 8 outputs x 4 inputs and the products of a row land in 8 lanes,
 * one per output: no horizontal sums. The bytes are one of (chosen per matrix when packing):
 *   signed codes   (code_bias < 0): the int8 codes themselves, any of -128..127 (Q8_0);
 *   unsigned codes (code_bias >= 0): u = code + code_bias as uint8 in 0..code_span, code_bias and
 *                  code_span <= 128 (Q4_K 0..15, Q5_0 -16..15, Q6_K -32..31: spans 15, 31, 63).
 *
 * Each row m of x is quantized per block of B inputs from that row alone: xs[m, b] = max |x| / 127
 * (float32 division), xq = round-to-nearest-even(x / xs) clamped to [-127, 127] (all zero where
 * the block is); xo[m, b] = xs[m, b] * (float)sum(xq) (offsets only), xt[m, b] = code_bias * sum(xq)
 * (exact int32; unsigned codes with code_bias > 0, and signed codes on VNNI with 128). Then, for
 * every (row m, output n), one fixed sequence of float32 operations over the blocks in order:
 *
 *   acc = 0; shift = 0
 *   for b = 0 .. K/B - 1:
 *     acc = acc + (float)(exact integer sum of code * xq over block b) * (xs[m, b] * scale[n, b])
 *     shift = shift + offset[n, b] * xo[m, b]              (offsets only)
 *   y[m, n] = acc - shift                                  (acc without offsets)
 *
 * Every step is a correctly rounded float32 operation (built with -ffp-contract=off) and the
 * integer sums are exact, so the portable C below, the AVX2 path and the VNNI paths (vpdpbusd,
 * AVX-512 VNNI or AVX-VNNI) give the same bits. The exact integer sum of a block, per code form:
 *   signed:   sum(code * xq). AVX2: vpmaddubsw(|w|, sign(x, w)) then vpmaddwd(., 1) into int32 per
 *             4 inputs (|w| <= 128 and |x| <= 127, so a pair 2 * 128 * 127 fits in int16); VNNI:
 *             vpdpbusd(code + 128, xq) (the code's top bit flipped: an unsigned byte), then minus
 *             xt[m, b] = 128 * sum(xq), as the unsigned form does.
 *   unsigned: sum(u * xq) - xt[m, b]. AVX2: vpmaddubsw(u, xq) gives int16 pairs of at most
 *             2 * code_span * 127 in magnitude, added in int16 (vpaddw) over chunks of at most
 *             steps16 steps of 4 inputs, then vpmaddwd(., 1) into int32 (at every chunk and block
 *             end); steps16 = 4 for spans up to 32 (not 8 for smaller ones: measured slower), 2 up to
 *             64, 1 up to 128, so that no int16 lane exceeds steps16 * 2 * code_span * 127 <= 32512
 *             (no wrap, no saturation); VNNI: vpdpbusd(u, xq).
 * A row's result does not depend on the other rows of the call (each row gets the same operations
 * whatever M and however rows are tiled), nor on the thread count (threads split the output
 * groups; a reduction is never split).
 *
 * The SIMD path works on tiles of up to 4 rows x 16 outputs (signed codes) or 4 rows x 8 outputs
 * (unsigned codes: the int16 and int32 sums of one group fill the registers): per 4 inputs it
 * loads 32 bytes of codes per group once for all rows and does, per row and group, one sign, one
 * vpmaddubsw, one vpmaddwd and one add on signed codes, one vpmaddubsw and one vpaddw on unsigned
 * ones (one vpdpbusd with VNNI, for both forms); the float work is once per block. The AVX-512
 * VNNI build runs two whole groups as one 16-lane tile (`tile_wide`, one 512-bit vpdpbusd per row
 * and step). BLOCKMM_EMULATE_VNNI builds the VNNI paths for AVX2 (a test build, see runtime/build.py; the
 * instruction-set macros are isa.h's).
 *
 * x [M, K] float32, y [M, N] float32; B divides K and is a multiple of 4. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "numerics.h"
#include "isa.h"

#define GROUP 8           /* outputs per packed group: one float32 lane each */
#define GROUPS_PER_TASK 4 /* output groups per OpenMP task */
#define ROW_TILE 4        /* rows of x sharing each loaded step of codes */
/* Bytes of codes prefetched ahead of the ones being read (load_step, tile_wide). On a 2-core AVX2 EPYC
 * (read bandwidth ~30 GB/s), 2048 left the LM head's one-token read at ~20 GB/s; 8192 brings it to ~30
 * (`verispec profile`: a one-token step 16.5 -> 13.9-14.9 ms; 16384 and more: no better). */
#define CODES_AHEAD 8192

/* The packed scales [G, K / B, 8]: float32, or float16 where every scale is one exactly (a GGUF
 * Q8_0 or Q5_0 matrix's own fp16 scales: half the bytes a one-token step reads for them). Either
 * way a scale enters the float sequence as the same float32 value. */
typedef struct {
    const void *data;
    int half;
} Scales;

/* Scale i of the packed scales, as float32 (exact: every float16 is a float32). */
static inline float scale_at(Scales scales, int64_t i) {
    if (!scales.half) return ((const float *)scales.data)[i];
    return half_to_float(((const uint16_t *)scales.data)[i]);
}

/* Row m of x quantized per block: q [K] int8, xs [nb], xo [nb] (when offsets are used), xt [nb]
 * (code_bias * sum(q), when given). */
static void quantize_row(const float *x, int64_t K, int64_t B, int8_t *q, float *xs, float *xo, int32_t *xt,
                         int32_t code_bias) {
    for (int64_t b = 0; b < K / B; b++) {
        const float scale = abs_max(x + b * B, B) / 127.0f;
        const int32_t total = quantize_codes(x + b * B, B, scale, q + b * B, NULL);
        xs[b] = scale;
        if (xo) xo[b] = scale * (float)total;
        if (xt) xt[b] = code_bias * total;
    }
}

#ifdef VS_AVX2

/* 32 bytes of codes of step s (4 inputs x 8 outputs) of both groups, prefetching ahead. */
static inline __attribute__((always_inline)) void load_step(__m256i w[2], const int8_t *w0, const int8_t *w1,
                                                            const int G, int64_t s) {
    w[0] = _mm256_loadu_si256((const __m256i *)(w0 + s * 32));
    if (G > 1) w[1] = _mm256_loadu_si256((const __m256i *)(w1 + s * 32));
    _mm_prefetch((const char *)(w0 + s * 32 + CODES_AHEAD), _MM_HINT_T0);
    if (G > 1) _mm_prefetch((const char *)(w1 + s * 32 + CODES_AHEAD), _MM_HINT_T0);
}

/* The 4 activations of step s of row r as one 32-bit value. */
static inline int32_t row_four(const int8_t *xq, int64_t K, int r, int64_t s) {
    int32_t four;
    memcpy(&four, xq + r * K + s * 4, 4);
    return four;
}

/* The 4 activations of step s of row r, in each 32-bit lane. */
static inline __m256i row_step(const int8_t *xq, int64_t K, int r, int64_t s) {
    return _mm256_set1_epi32(row_four(xq, K, r, s));
}

/* Scales i .. i+7 of the packed scales, as float32 (F16C converts float16 exactly). */
static inline __m256 scales8(Scales scales, int64_t i) {
    return scales.half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)scales.data + i)))
                       : _mm256_loadu_ps((const float *)scales.data + i);
}

/* Rows 0..R-1 of the quantized rows (xq [R, K], xs/xo/xt [R, nb]) times output groups g0 .. g0+G-1,
 * on signed codes (S = 0) or unsigned ones (S = steps16, see the header; R <= ROW_TILE, G <= 2 and S
 * are compile-time constants after inlining). */
static inline __attribute__((always_inline)) void tile(
        const int8_t *xq, const float *xs, const float *xo, const int32_t *xt, const int R, const int G, const int S,
        int64_t K, int64_t B, const int8_t *codes, Scales scales, const float *offsets, int64_t N, float *y,
        int64_t g0) {
    const int64_t nb = K / B, steps_per_block = B / 4;
    const int8_t *w0 = codes + g0 * K * GROUP, *w1 = w0 + K * GROUP; /* K / 4 steps of 32 bytes per group */
    __m256 acc[ROW_TILE][2], shift[ROW_TILE][2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm256_setzero_ps(), shift[r][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t first = b * steps_per_block, end = first + steps_per_block;
        __m256i sums[ROW_TILE][2];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) sums[r][g] = _mm256_setzero_si256();
        if (!S) {
#ifdef VS_VNNI
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            for (int64_t s = first; s < end; s++) { /* u = code + 128 (a flipped top bit); xt removes 128 * sum(xq) */
                __m256i w[2];
                load_step(w, w0, w1, G, s);
                for (int g = 0; g < G; g++) w[g] = _mm256_xor_si256(w[g], flip);
                for (int r = 0; r < R; r++) {
                    const __m256i xb = row_step(xq, K, r, s);
                    for (int g = 0; g < G; g++) sums[r][g] = VS_DPBUSD(sums[r][g], w[g], xb);
                }
            }
#else
            for (int64_t s = first; s < end; s++) {
                __m256i w[2], aw[2];
                load_step(w, w0, w1, G, s);
                for (int g = 0; g < G; g++) aw[g] = _mm256_abs_epi8(w[g]);
                for (int r = 0; r < R; r++) {
                    const __m256i xb = row_step(xq, K, r, s);
                    for (int g = 0; g < G; g++)
                        sums[r][g] = _mm256_add_epi32(sums[r][g], _mm256_madd_epi16(_mm256_maddubs_epi16(
                            aw[g], _mm256_sign_epi8(xb, w[g])), _mm256_set1_epi16(1)));
                }
            }
#endif
        } else {
            __m256i w[2];
#ifdef VS_VNNI
            for (int64_t s = first; s < end; s++) {
                load_step(w, w0, w1, G, s);
                for (int r = 0; r < R; r++) {
                    const __m256i xb = row_step(xq, K, r, s);
                    for (int g = 0; g < G; g++) sums[r][g] = VS_DPBUSD(sums[r][g], w[g], xb);
                }
            }
#else
            for (int64_t chunk = first; chunk < end; chunk += S) { /* int16 sums over at most S steps */
                __m256i pairs[ROW_TILE][2];
                for (int r = 0; r < R; r++)
                    for (int g = 0; g < G; g++) pairs[r][g] = _mm256_setzero_si256();
                for (int i = 0; i < S && chunk + i < end; i++) {
                    load_step(w, w0, w1, G, chunk + i);
                    for (int r = 0; r < R; r++) {
                        const __m256i xb = row_step(xq, K, r, chunk + i);
                        for (int g = 0; g < G; g++)
                            pairs[r][g] = _mm256_add_epi16(pairs[r][g], _mm256_maddubs_epi16(w[g], xb));
                    }
                }
                for (int r = 0; r < R; r++)
                    for (int g = 0; g < G; g++)
                        sums[r][g] = _mm256_add_epi32(sums[r][g], _mm256_madd_epi16(pairs[r][g], _mm256_set1_epi16(1)));
            }
#endif
        }
        if (xt) /* code_bias * sum(xq): unsigned codes, and signed ones on VNNI */
            for (int r = 0; r < R; r++) {
                const __m256i correction = _mm256_set1_epi32(xt[r * nb + b]);
                for (int g = 0; g < G; g++) sums[r][g] = _mm256_sub_epi32(sums[r][g], correction);
            }
        for (int g = 0; g < G; g++) {
            const __m256 ws = scales8(scales, ((g0 + g) * nb + b) * GROUP);
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

#ifdef VS_VNNI_WIDE
/* `tile` for two whole output groups at once on VNNI builds (both code forms: flip = 1 for signed
 * codes, summed as code + 128), lanes 0-7 group g0 and 8-15 group g0 + 1: per row and step one
 * 64-multiply-add vpdpbusd; the same per-lane operations as `tile`, so the same bits. */
static inline __attribute__((always_inline)) void tile_wide(
        const int8_t *xq, const float *xs, const float *xo, const int32_t *xt, const int R, const int flip, int64_t K,
        int64_t B, const int8_t *codes, Scales scales, const float *offsets, int64_t N, float *y, int64_t g0) {
    const int64_t nb = K / B, steps_per_block = B / 4;
    const int8_t *w0 = codes + g0 * K * GROUP, *w1 = w0 + K * GROUP;
    wide_f acc[ROW_TILE], shift[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = wide_zero_ps(), shift[r] = wide_zero_ps();
    for (int64_t b = 0; b < nb; b++) {
        wide_i sums[ROW_TILE];
        for (int r = 0; r < R; r++) sums[r] = wide_zero();
        for (int64_t s = b * steps_per_block; s < (b + 1) * steps_per_block; s++) {
            wide_i w = wide_load2(w0 + s * 32, w1 + s * 32);
            _mm_prefetch((const char *)(w0 + s * 32 + CODES_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + s * 32 + CODES_AHEAD), _MM_HINT_T0);
            if (flip) w = wide_flip(w);
            for (int r = 0; r < R; r++) sums[r] = wide_dpbusd(sums[r], w, wide_set1(row_four(xq, K, r, s)));
        }
        if (xt)
            for (int r = 0; r < R; r++) sums[r] = wide_sub(sums[r], wide_set1(xt[r * nb + b]));
        const wide_f ws = wide_pair_ps(scales8(scales, (g0 * nb + b) * GROUP), scales8(scales, ((g0 + 1) * nb + b) * GROUP));
        for (int r = 0; r < R; r++)
            acc[r] = wide_add_ps(acc[r], wide_mul_ps(wide_cvt(sums[r]), wide_mul_ps(wide_set1_ps(xs[r * nb + b]), ws)));
        if (offsets) {
            const wide_f wo = wide_load2_ps(offsets + (g0 * nb + b) * GROUP, offsets + ((g0 + 1) * nb + b) * GROUP);
            for (int r = 0; r < R; r++) shift[r] = wide_add_ps(shift[r], wide_mul_ps(wo, wide_set1_ps(xo[r * nb + b])));
        }
    }
    const int64_t n = g0 * GROUP, count = N - n < 2 * GROUP ? N - n : 2 * GROUP;
    for (int r = 0; r < R; r++) {
        const wide_f v = offsets ? wide_sub_ps(acc[r], shift[r]) : acc[r];
        if (count == 2 * GROUP) {
            wide_store_ps(y + r * N + n, v);
        } else { /* the last group is short: only its real outputs */
            float lanes[2 * GROUP];
            wide_store_ps(lanes, v);
            memcpy(y + r * N + n, lanes, sizeof(float) * (size_t)count);
        }
    }
}

#define TILE_WIDE(R, F) tile_wide(xq, xs, xo, xt, R, F, K, B, codes, scales, offsets, N, y, g0)
static __attribute__((noinline)) void tiles_wide(const int8_t *xq, const float *xs, const float *xo,
                                                 const int32_t *xt, int64_t rows, int flip, int64_t K, int64_t B,
                                                 const int8_t *codes, Scales scales, const float *offsets,
                                                 int64_t N, float *y, int64_t g0) {
    switch (rows * 2 + flip) {
        case 2: TILE_WIDE(1, 0); break;
        case 3: TILE_WIDE(1, 1); break;
        case 4: TILE_WIDE(2, 0); break;
        case 5: TILE_WIDE(2, 1); break;
        case 6: TILE_WIDE(3, 0); break;
        case 7: TILE_WIDE(3, 1); break;
        case 8: TILE_WIDE(4, 0); break;
        default: TILE_WIDE(4, 1); break;
    }
}
#undef TILE_WIDE
#endif

#define TILE(R, G, S) tile(xq, xs, xo, xt, R, G, S, K, B, codes, scales, offsets, N, y, g)
#define TILE_ROWS(G, S)                 \
    switch (rows) {                     \
        case 1: TILE(1, G, S); break;   \
        case 2: TILE(2, G, S); break;   \
        case 3: TILE(3, G, S); break;   \
        default: TILE(4, G, S); break;  \
    }
/* The signed and the unsigned tiles are compiled as separate functions (noinline): in one, the
 * register allocation of the signed tiles' inner loop gets worse. */
static __attribute__((noinline)) void tiles_signed(const int8_t *xq, const float *xs, const float *xo,
                                                   const int32_t *xt, int64_t rows, int64_t groups, int64_t K,
                                                   int64_t B, const int8_t *codes, Scales scales,
                                                   const float *offsets, int64_t N, float *y, int64_t g) {
    if (groups > 1) {
        TILE_ROWS(2, 0);
    } else {
        TILE_ROWS(1, 0);
    }
}

static __attribute__((noinline)) void tiles_unsigned(const int8_t *xq, const float *xs, const float *xo,
                                                     const int32_t *xt, int64_t rows, int64_t groups, int64_t K,
                                                     int64_t B, const int8_t *codes, Scales scales,
                                                     const float *offsets, int steps16, int64_t N, float *y,
                                                     int64_t g0) {
    for (int64_t g = g0; g < g0 + groups; g++) {
        if (steps16 == 4) {
            TILE_ROWS(1, 4);
        } else if (steps16 == 2) {
            TILE_ROWS(1, 2);
        } else {
            TILE_ROWS(1, 1);
        }
    }
}

static void tile_any(const int8_t *xq, const float *xs, const float *xo, const int32_t *xt, int64_t rows,
                     int64_t groups, int64_t K, int64_t B, const int8_t *codes, Scales scales,
                     const float *offsets, int steps16, int64_t N, float *y, int64_t g0) {
#ifdef VS_VNNI_WIDE
    if (groups == 2) {
        tiles_wide(xq, xs, xo, xt, rows, !steps16, K, B, codes, scales, offsets, N, y, g0);
        return;
    }
#endif
    if (steps16)
        tiles_unsigned(xq, xs, xo, xt, rows, groups, K, B, codes, scales, offsets, steps16, N, y, g0);
    else
        tiles_signed(xq, xs, xo, xt, rows, groups, K, B, codes, scales, offsets, N, y, g0);
}
#undef TILE_ROWS
#undef TILE
#else
/* Portable C: the header's sequence, output by output (at most ROW_TILE rows, G groups). */
static void tile_any(const int8_t *xq, const float *xs, const float *xo, const int32_t *xt, int64_t rows,
                     int64_t groups, int64_t K, int64_t B, const int8_t *codes, Scales scales,
                     const float *offsets, int steps16, int64_t N, float *y, int64_t g0) {
    const int64_t nb = K / B;
    const uint8_t *u = (const uint8_t *)codes; /* unsigned codes (steps16 > 0) */
    for (int64_t g = g0; g < g0 + groups; g++)
        for (int64_t lane = 0; lane < GROUP && g * GROUP + lane < N; lane++)
            for (int64_t m = 0; m < rows; m++) {
                const int64_t n = g * GROUP + lane;
                float acc = 0.0f, shift = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t sum = 0;
                    for (int64_t k = b * B; k < (b + 1) * B; k++) {
                        const int64_t at = (g * (K / 4) + k / 4) * 32 + lane * 4 + k % 4;
                        sum += (steps16 ? (int32_t)u[at] : (int32_t)codes[at]) * xq[m * K + k];
                    }
                    if (xt) sum -= xt[m * nb + b];
                    const float scale = xs[m * nb + b] * scale_at(scales, (g * nb + b) * GROUP + lane);
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
 * packed (see the header); offsets may be NULL; code_bias < 0: signed codes, else unsigned ones
 * u = code + code_bias in 0..code_span (code_bias and code_span at most 128); half_scales: the
 * scales are float16, else float32. */
int blockmm_int8(const float *x, int64_t M, int64_t K, const int8_t *codes, const void *scale_data,
                 const float *offsets, int64_t N, int64_t B, int code_bias, int code_span, int half_scales, float *y,
                 int threads) {
    if (M < 1 || N < 1 || B < 4 || B % 4 != 0 || K % B != 0) return -1;
    if (code_bias > 128 || (code_bias >= 0 && (code_span < 0 || code_span > 128))) return -1;
    const Scales scales = {scale_data, half_scales != 0};
    const int64_t nb = K / B, groups = (N + GROUP - 1) / GROUP;
    const int64_t tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
    const int steps16 = code_bias < 0 ? 0 : code_span <= 32 ? 4 : code_span <= 64 ? 2 : 1; /* 0: signed codes */
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc(sizeof(float) * (size_t)(M * 2 * nb));
#ifdef VS_VNNI
    const int xt_bias = code_bias >= 0 ? code_bias : 128; /* signed codes are summed as code + 128 (see tile) */
#else
    const int xt_bias = code_bias;
#endif
    int32_t *xt = xt_bias > 0 ? malloc(sizeof(int32_t) * (size_t)(M * nb)) : NULL;
    if (!xq || !xs || (xt_bias > 0 && !xt)) {
        free(xq);
        free(xs);
        free(xt);
        return -1;
    }
    float *xo = offsets ? xs + M * nb : NULL;
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, B, xq + m * K, xs + m * nb, xo ? xo + m * nb : NULL, xt ? xt + m * nb : NULL,
                     xt_bias);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t first = t * GROUPS_PER_TASK, last = first + GROUPS_PER_TASK < groups ? first + GROUPS_PER_TASK : groups;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int64_t rows = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
            for (int64_t g0 = first; g0 < last; g0 += 2)
                tile_any(xq + m0 * K, xs + m0 * nb, xo ? xo + m0 * nb : NULL, xt ? xt + m0 * nb : NULL, rows,
                         last - g0 < 2 ? 1 : 2, K, B, codes, scales, offsets, steps16, N, y + m0 * N, g0);
        }
    }
    free(xq);
    free(xs);
    free(xt);
    return 0;
}
