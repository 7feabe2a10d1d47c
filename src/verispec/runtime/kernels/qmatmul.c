/* y = x W^T on a GGUF file's own quantized blocks (memory-mapped, read as stored), batch-invariant
 * bit for bit.
 *
 * W [N, K] is given as the file stores it: N rows of K / QK consecutive blocks, in ggml's layouts
 * (type ids are ggml's):
 *   Q4_0  (2)  18 bytes / 32:  d fp16, qs[16] (input i: qs[i] & 15, input 16 + i: qs[i] >> 4)   code q - 8
 *   Q5_0  (6)  22 bytes / 32:  d fp16, qh u32 (bit i: input i's bit 4), qs[16] as Q4_0        code q - 16
 *   Q8_0  (8)  34 bytes / 32:  d fp16, qs[32] int8                                            code q
 *   Q4_K (12) 144 bytes / 256: d, dmin fp16, 6-bit (sc, m) x 8 in 12 bytes, qs[128]
 *                              (sub-block 2c input l: qs[32c + l] & 15, 2c + 1: qs[32c + l] >> 4)   code q
 *   Q5_K (13) 176 bytes / 256: as Q4_K with qh[32] before qs (bit j of qh[l]: sub-block j input l's bit 4)
 *   Q6_K (14) 210 bytes / 256: ql[128], qh[64], sc[16] int8, d fp16; input 128h + 32s + l:
 *                              low 4 bits from ql[64h + 32(s & 1) + l] (s < 2 low nibble, else high),
 *                              bits 4-5 = (qh[32h + l] >> 2s) & 3                               code q - 32
 *   F32 (0), F16 (1), BF16 (30): plain rows.
 *
 * Activations (quantized types): each row of x [M, K] is quantized from that row alone, with one scale
 * per group of inputs: xs = max |x| / 127 over the group (float32 division), xq = round-half-even(x /
 * xs) clamped to [-127, 127] (all 0 and xs = 0 where the group is). Two forms, the same sizes:
 *   block form (`qmm_quantize`, the 32-block types Q4_0, Q5_0, Q8_0): groups of 32, exactly as
 *     blockmm_int8.c's quantize_row; xs[m, a] per block a of 32, xo[m, a] = xs[m, a] * (float)sum(xq
 *     over the block), xsum[m, b] = sum(xq over inputs 16b .. 16b + 15) (exact int32);
 *   super-block form (`qmm_quantize_super`, the K-quants, as ggml's Q8_K): groups of 256 (K a
 *     multiple of 256); xs[m, a] holds the scale D of the super-block of block a (8 copies), xo is 0,
 *     and xsum holds a record of 16 int32 per super-block: the sums of xq per 16 inputs as 8 pairs of
 *     int16 (low, high), the sums per 32 as 4 pairs, 4 zeros.
 *
 * Then for every (row m, output n):
 *   32-blocks, over the blocks a in order:
 *     isum_a = exact integer sum of code[n, k] * xq[m, k] over block a
 *     acc    = acc + (float)isum_a * (xs[m, a] * (float)d_a)
 *     y[m, n] = acc
 *   K-quants, over the super-blocks B in order (sub-blocks j of S = 32 inputs, Q6_K 16; sc_j, m_j the
 *   6-bit scales and mins, Q6_K's sc_j int8; d, dmin the super-block's float16 factors):
 *     isum_B = sum_j sc_j * (exact integer sum of code[n, k] * xq[m, k] over sub-block j)   (exact int32)
 *     acc    = acc + (float)isum_B * (D_B * d)
 *     shift  = shift + (float)msum_B * (D_B * dmin), msum_B = sum_j m_j * sum(xq over j)   (Q4_K, Q5_K)
 *     y[m, n] = acc - shift (Q4_K, Q5_K), else acc
 * each float step a correctly rounded float32 operation in this order (built with -ffp-contract=off,
 * no FMA here), the integer sums exact (|isum_B| < 2^28). For the 32-blocks this is blockmm_int8.c's
 * sequence, so Q8_0 and Q5_0 give the bits of blockmm_int8 on those matrices' exact block form
 * (gguf/blocks.py). The K-quants' sub-block scales multiply in the integer domain, so their float work
 * is one step per super-block instead of one per sub-block: 8-row products of Q4_K 0.91x the time of
 * the per-32 numerics, Q6_K 0.92x (`scripts/qmatmul_ab.py --rows 8`, one thread, Zen 2). A row's
 * result depends on nothing else: not on M, the row tiling, the thread count (threads split the
 * outputs, never a sum) nor the instruction set (portable C, AVX2, AVX2 + VNNI and AVX-512 VNNI give
 * the same bits).
 *
 * Float weights (F32, F16, BF16): x is used as float32 (not quantized); per (m, n) eight partial sums,
 * lane l over the inputs k = l, l + 8, l + 16, ... in order, p_l = fma(w[n, k], x[m, k], p_l) (one
 * rounding), then y = ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). The portable build does the
 * same lane by lane with fmaf.
 *
 * How the SIMD path gets there without repacking the file: outputs go in groups of 8, one float32
 * lane each (no horizontal sums). For a group and a chunk of 256 inputs (one K-quant super-block,
 * or 8 blocks of 32), `decode_chunk` reads the 8 rows' blocks straight from the file bytes,
 * transposes them in registers (two 128-bit loads per register, then a 4x4 dword transpose within
 * 128-bit lanes: 3 shuffles per 32 bytes) so that one 32-byte vector holds 4 consecutive inputs of
 * each of the 8 outputs, and unpacks nibbles / high bits into unsigned codes u = code + bias (Q4_0
 * +8, Q5_0 +16, Q6_K +32, Q4_K/Q5_K +0; Q8_0 stays signed on AVX2 and becomes code + 128 on VNNI
 * builds); the sub-block scales ws_j (and wo_j) are computed for the 8 outputs at once (one lane
 * each) from the transposed block headers. The integer sums are blockmm_int8.c's: per 4 inputs,
 * per row one broadcast of 4 activations and vpmaddubsw + vpaddw (int16 sums over at most 8 steps
 * for codes 0..15, 4 for 0..31, 2 for 0..63, so no lane exceeds 32767: steps * 2 * max_code * 127),
 * vpmaddwd into int32 per sub-block (for the K-quants vpmaddwd by sc_j instead of by 1, or vpmulld by
 * sc_j after vpdpbusd), minus bias * sum(xq) (bias a power of two: a shift; for Q6_K once per
 * super-block, 32 * sum_j sc_j * sum(xq over j) from the record's pairs with vpmaddwd); signed Q8_0
 * codes use vpabsb / vpsignb as blockmm_int8.c does; VNNI builds use vpdpbusd (exact int32). Then the
 * float32 sequence above once per block (32-blocks) or super-block (K-quants). Two ways to feed them:
 *   fused (M <= 2, the one-token step and the smallest drafts): each code vector goes from the
 *     transpose straight into the products of the 1 or 2 rows (no buffer); the float steps follow
 *     from the kept int32 sums;
 *   buffered (M > 2): the chunk's codes are written once into a 2 KB buffer (L1) and `consume` runs
 *     tiles of up to 4 rows over it (one load of codes per 4 inputs for all rows of the tile), so
 *     the weights are read from memory and decoded once per call whatever M is; the float
 *     accumulators of every row live in a per-thread buffer between chunks; from M = 32 on, 4 groups
 *     share each chunk so that x is read from cache once per 32 outputs.
 * Decoding costs about as much as the products of one row (measured on AVX2 Zen 2), so the fused
 * path for M = 1 is what keeps a one-token step near memory bandwidth; with more rows the products
 * (one vpmaddubsw per 32 of them, as in blockmm_int8.c) dominate. While a task's rows are read,
 * the next task's rows (contiguous in the file) are prefetched front to back, one slice per chunk.
 * Row-wise (M <= 3 on the K-quants, AVX2 builds without VNNI; `rows_group`): the transposition and
 * the broadcasts cost more instructions than the products at M = 1, so there the 8 rows' bytes are
 * used as they lie: a 32-byte vector holds 16 consecutive code bytes of two outputs (Q4_K, Q5_K:
 * rows q and q + 4, one per 128-bit half) or 32 of one (Q6_K: one row, two sub-blocks of 16),
 * multiplied by 16 or 32 consecutive activations (no broadcast per step), and a short tree of
 * vphaddw / vpmaddwd / vphaddd turns the int16 partial sums of the 8 outputs into the same exact
 * int32 sum per (output, sub-block), lanes = outputs, then times sc_j (vpmulld); the numbers are the
 * same. One call runs a group over all of K with the float accumulators in registers, the header of
 * a super-block decoded once from its transposed bytes, and the prefetching of the next task spread
 * in 8 parts per super-block. About 1.5 times fewer instructions per weight than the transposed fused
 * path at M = 1 on Zen 2. At M = 3 (a verify of 3 tokens) one row-wise pass over the weights took
 * 90.5 ms on Qwen2.5-1.5B against the buffered path's 97.3 ms (`verispec profile --widths 3`, two
 * runs each, 2 threads, Zen 2, per-32 numerics); at M = 4 it was 2% slower, so from M = 4 on the
 * buffer is used.
 * The portable build decodes the same chunks with scalar code and computes each (m, n) lane by lane.
 *
 * Threads (OpenMP) split the outputs: tasks of 1 group (4 from M = 32 on), taken in runs of
 * consecutive tasks as threads come free; a sum is never split, so the thread count changes no bit.
 *
 * Exported (int64 sizes; int functions return 0 on success, -1 on bad arguments or no memory):
 *   int64_t qmm_row_bytes(int type, int64_t K)
 *       bytes per row of a [*, K] weight, -1 for an unknown type or a K not allowed (quantized types:
 *       a multiple of the block, 32 or 256; float types: a multiple of 8)
 *   int qmm_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, float *xo,
 *                    int32_t *xsum, int threads)
 *       x [M, K] (K a multiple of 32) -> the block form: xq [M, K], xs [M, K/32], xo [M, K/32], xsum [M, K/16]
 *   int qmm_quantize_super(same arguments)
 *       the super-block form (K a multiple of 256), in arrays of the same sizes
 *   int qmm_matmul(const float *x, const int8_t *xq, const float *xs, const float *xo,
 *                  const int32_t *xsum, int64_t M, int64_t K, const void *w, int type, int64_t N,
 *                  float *y, int64_t ldy, int threads)
 *       y[m * ldy + n] for the N x K weight w (the file's bytes); quantized types read xq, xs, xo,
 *       xsum (x may be NULL) in the form of their type (K-quants: the super-block form), float types
 *       read x (the others may be NULL); ldy >= N, so that several
 *       matrices fed by the same activations can write column ranges of one output buffer
 *   int qmm_matmul_f32(const float *x, int64_t M, int64_t K, const void *w, int type, int64_t N,
 *                      float *y, int64_t ldy, int threads)
 *       qmm_quantize or qmm_quantize_super (buffers allocated inside) then qmm_matmul, for one matrix
 *   int qmm_get_rows(const void *w, int type, int64_t N, int64_t K, const int64_t *ids, int64_t count,
 *                    float *out)
 *       out [count, K] = rows ids of W dequantized exactly as gguf-py does (Q4_K / Q5_K:
 *       fl(fl(d * sc) * q) - fl(dmin * m); Q6_K: fl(fl(d * sc) * (q - 32)); 32-blocks: fl(d * code))
 *   const char *qmm_isa(void)
 *       the build: "avx512vnni", "avxvnni", "vnni-emulated", "avx2" or "portable" */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "numerics.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_SIMD 1
#include <immintrin.h>
#endif


#define LANES 8           /* outputs per group: one float32 lane each */
#define CHUNK 256         /* inputs decoded at a time */
#define MAX_STEPS (CHUNK / 4)
#define MAX_SUBS (CHUNK / 16)
#define ROW_TILE 4        /* rows sharing each load of decoded codes */
#define MAX_TASK_GROUPS 4 /* groups decoded per chunk (and per OpenMP task) when M is large */
#define MANY_ROWS 32      /* from this M on, a task holds MAX_TASK_GROUPS groups, else 1 */
#define FUSED_ROWS 2      /* up to this M, chunks are decoded and multiplied at once (no buffer) */
#define FUSED_TILE 2      /* rows per fused call (3 or 4 were measured no faster than the buffer) */
#define ROWWISE_ROWS 3    /* up to this M, the K-quants take the row-wise path (AVX2 without VNNI), one call */
#define PREFETCH_NEAR 16384 /* a task's rows up to this many bytes are prefetched into L1, more into L2 */

typedef struct {
    int block;   /* inputs per block */
    int bytes;   /* bytes per block */
    int sub;     /* inputs per sub-block (one float scale) */
    int offsets; /* wo_j / shift (Q4_K, Q5_K) */
    int quantized;
} TypeInfo;

static int type_info(int type, TypeInfo *t) {
    switch (type) {
        case GGUF_F32: *t = (TypeInfo){1, 4, 1, 0, 0}; return 0;
        case GGUF_F16: *t = (TypeInfo){1, 2, 1, 0, 0}; return 0;
        case GGUF_BF16: *t = (TypeInfo){1, 2, 1, 0, 0}; return 0;
        case GGUF_Q4_0: *t = (TypeInfo){32, 18, 32, 0, 1}; return 0;
        case GGUF_Q5_0: *t = (TypeInfo){32, 22, 32, 0, 1}; return 0;
        case GGUF_Q8_0: *t = (TypeInfo){32, 34, 32, 0, 1}; return 0;
        case GGUF_Q4_K: *t = (TypeInfo){256, 144, 32, 1, 1}; return 0;
        case GGUF_Q5_K: *t = (TypeInfo){256, 176, 32, 1, 1}; return 0;
        case GGUF_Q6_K: *t = (TypeInfo){256, 210, 16, 0, 1}; return 0;
        default: return -1;
    }
}

/* Bytes per row of a [*, K] weight of `type`, or -1 (unknown type, K < 1, K not allowed: a multiple
 * of the block for quantized types, of 8 for float ones). */
int64_t qmm_row_bytes(int type, int64_t K) {
    TypeInfo t;
    if (type_info(type, &t) != 0 || K < 1) return -1;
    if (K % (t.quantized ? t.block : 8) != 0) return -1;
    return K / t.block * t.bytes;
}

static inline uint16_t ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Scalar decoding of inputs k0 .. k0 + count - 1 of one row (k0 and count multiples of the block;
 * K-quants: count = 256): the signed codes, and ws / wo per sub-block (ws[j * stride]). */
static void decode_scalar(int type, const uint8_t *row, int64_t k0, int64_t count, int8_t *code, float *ws,
                          float *wo, int stride) {
    switch (type) {
        case GGUF_Q4_0:
            for (int64_t b = 0; b < count / 32; b++) {
                const uint8_t *blk = row + (k0 / 32 + b) * 18;
                ws[b * stride] = half_to_float(ld16(blk));
                for (int i = 0; i < 16; i++) {
                    code[32 * b + i] = (int8_t)((blk[2 + i] & 15) - 8);
                    code[32 * b + 16 + i] = (int8_t)((blk[2 + i] >> 4) - 8);
                }
            }
            break;
        case GGUF_Q5_0:
            for (int64_t b = 0; b < count / 32; b++) {
                const uint8_t *blk = row + (k0 / 32 + b) * 22;
                const uint32_t qh = ld32(blk + 2);
                ws[b * stride] = half_to_float(ld16(blk));
                for (int i = 0; i < 16; i++) {
                    code[32 * b + i] = (int8_t)(((blk[6 + i] & 15) | (((qh >> i) & 1) << 4)) - 16);
                    code[32 * b + 16 + i] = (int8_t)(((blk[6 + i] >> 4) | (((qh >> (16 + i)) & 1) << 4)) - 16);
                }
            }
            break;
        case GGUF_Q8_0:
            for (int64_t b = 0; b < count / 32; b++) {
                const uint8_t *blk = row + (k0 / 32 + b) * 34;
                ws[b * stride] = half_to_float(ld16(blk));
                memcpy(code + 32 * b, blk + 2, 32);
            }
            break;
        case GGUF_Q4_K:
        case GGUF_Q5_K: {
            const int five = type == GGUF_Q5_K;
            const uint8_t *blk = row + (k0 / 256) * (five ? 176 : 144);
            const float d = half_to_float(ld16(blk)), dmin = half_to_float(ld16(blk + 2));
            const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                scale_min_k4(j, blk + 4, &sc, &m);
                ws[j * stride] = d * (float)sc;
                wo[j * stride] = dmin * (float)m;
            }
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                    if (five) lo |= ((qh[l] >> (2 * c)) & 1) << 4, hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    code[64 * c + l] = (int8_t)lo;
                    code[64 * c + 32 + l] = (int8_t)hi;
                }
            break;
        }
        case GGUF_Q6_K: {
            const uint8_t *blk = row + (k0 / 256) * 210, *ql = blk, *qh = blk + 128;
            const float d = half_to_float(ld16(blk + 208));
            for (int j = 0; j < 16; j++) ws[j * stride] = d * (float)(int8_t)blk[192 + j];
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t byte = ql[64 * h + 32 * (s & 1) + l];
                        const int low = s < 2 ? byte & 15 : byte >> 4, high = (qh[32 * h + l] >> (2 * s)) & 3;
                        code[128 * h + 32 * s + l] = (int8_t)((low | (high << 4)) - 32);
                    }
            break;
        }
        default:
            break;
    }
}

/* A K-quant super-block's header at blk: sc[j * stride], mn[j * stride] (Q4_K / Q5_K mins; Q6_K: 0)
 * for its sub-blocks, and d, dmin (Q6_K: 0) as float32. */
static inline void k_header_scalar(int type, const uint8_t *blk, int32_t *sc, int32_t *mn, int stride, float *d, float *dmin) {
    if (type == GGUF_Q6_K) {
        for (int j = 0; j < 16; j++) sc[j * stride] = (int8_t)blk[192 + j], mn[j * stride] = 0;
        *d = half_to_float(ld16(blk + 208));
        *dmin = 0.0f;
        return;
    }
    for (int j = 0; j < 8; j++) {
        int s, m;
        scale_min_k4(j, blk + 4, &s, &m);
        sc[j * stride] = s, mn[j * stride] = m;
    }
    *d = half_to_float(ld16(blk));
    *dmin = half_to_float(ld16(blk + 2));
}

/* ---------------------------------------------------------------------------------------------
 * Activations */

/* Row x [K] quantized with one scale per GROUP inputs: q [K], xs [K / 32] (the scale of each block of
 * 32's group). GROUP 32, the block form: xo [K / 32] = scale * (sum of q over the block), xsum [K / 16]
 * the sums of q per 16. GROUP 256, the super-block form of the K-quants: xo is 0, and xsum holds per
 * super-block a record of 16 int32: 8 pairs of int16 (low, high) = the sums of q over inputs 16t ..
 * 16t + 15 for t = 2i, 2i + 1, then 4 pairs of the sums over 32 inputs (sub-blocks 2i, 2i + 1), then
 * 4 zeros (|sum| <= 32 * 127 fits int16); the K-quant kernels multiply them in pairs (vpmaddwd). */
static inline int32_t int16_pair(int32_t low, int32_t high) {
    return (int32_t)(((uint32_t)low & 0xFFFFu) | ((uint32_t)high << 16));
}

static void quantize_row(const float *x, int64_t K, const int GROUP, int8_t *q, float *xs, float *xo, int32_t *xsum) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        int32_t sums[GROUP / 16]; /* of q per 16 inputs of the group */
        const float scale = abs_max(x + g * GROUP, GROUP) / 127.0f;
        for (int64_t b = g * (GROUP / 32); b < (g + 1) * (GROUP / 32); b++) {
            int32_t *half = sums + 2 * (b - g * (GROUP / 32));
            half[0] = half[1] = 0;
            const int32_t total = quantize_codes(x + b * 32, 32, scale, q + b * 32, half);
            xs[b] = scale;
            xo[b] = GROUP == 256 ? 0.0f : scale * (float)total;
        }
        if (GROUP == 32) {
            xsum[2 * g] = sums[0], xsum[2 * g + 1] = sums[1];
            continue;
        }
        int32_t *record = xsum + 16 * g; /* |sum over 32| <= 32 * 127: int16 */
        for (int t = 0; t < 8; t++) record[t] = int16_pair(sums[2 * t], sums[2 * t + 1]);
        for (int t = 0; t < 4; t++) record[8 + t] = int16_pair(sums[4 * t] + sums[4 * t + 1], sums[4 * t + 2] + sums[4 * t + 3]);
        for (int t = 12; t < 16; t++) record[t] = 0;
    }
}

static int quantize_rows(const float *x, int64_t M, int64_t K, const int GROUP, int8_t *xq, float *xs, float *xo,
                         int32_t *xsum, int threads) {
    if (!x || !xq || !xs || !xo || !xsum || M < 1 || K < GROUP || K % GROUP != 0) return -1;
    const int64_t nb = K / 32;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (threads > 1 && M * K >= 65536)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, GROUP, xq + m * K, xs + m * nb, xo + m * nb, xsum + m * 2 * nb);
    return 0;
}

int qmm_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, float *xo, int32_t *xsum, int threads) {
    return quantize_rows(x, M, K, 32, xq, xs, xo, xsum, threads);
}

int qmm_quantize_super(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, float *xo, int32_t *xsum, int threads) {
    return quantize_rows(x, M, K, 256, xq, xs, xo, xsum, threads);
}

/* ---------------------------------------------------------------------------------------------
 * Quantized weights: decoding and the integer / float loops */

/* Prefetch bytes [from, to) of the weights (whole cache lines; `near`: into L1, else into L2). */
static inline void prefetch_range(const uint8_t *from, const uint8_t *to, int near) {
    for (const uint8_t *a = (const uint8_t *)((uintptr_t)from & ~(uintptr_t)63); a < to; a += 64) {
        if (near) __builtin_prefetch(a, 0, 3);
        else __builtin_prefetch(a, 0, 2);
    }
}


#ifdef QMM_SIMD
#if defined(BLOCKMM_EMULATE_VNNI)
/* The test build "vnni-emulated" (blockmm.py): the VNNI code paths on AVX2, vpdpbusd computed exactly. */
#define QMM_VNNI 1
#define QMM_ISA "vnni-emulated"
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    const __m256i low = _mm256_set1_epi16(0x00FF);
    const __m256i u_even = _mm256_and_si256(u, low), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QMM_VNNI 1
#define QMM_ISA "avx512vnni"
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define QMM_VNNI 1
#define QMM_ISA "avxvnni"
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define QMM_ISA "avx2"
#endif

/* A chunk of 8 outputs, decoded: codes[s] holds inputs 4s .. 4s + 3 of the chunk for lanes 0..7
 * (byte 4 * lane + t: input 4s + t), as unsigned u = code + bias (signed codes for Q8_0 on AVX2);
 * ws[j] / wo[j] the float scales of sub-block j, one lane per output. */
/* A K-quant super-block's header for 8 outputs, one 32-bit lane each: sc[j] the scale of sub-block j
 * (int32; Q6_K signed), sc2[j] the same as two int16 (a vpmaddwd operand), pair[i] two int16 that
 * multiply a pair of the activations' sums (the super-block form's record): Q4_K / Q5_K (m_2i,
 * m_2i+1) times the sums over sub-blocks 2i, 2i + 1 (i < 4); Q6_K (sc_2i, sc_2i+1) times the sums over
 * its sub-blocks 2i, 2i + 1 of 16 (i < 8); d, dmin the super-block's float16 factors as float32. */
typedef struct {
    int32_t sc[MAX_SUBS][LANES] __attribute__((aligned(32)));
    int32_t sc2[MAX_SUBS][LANES] __attribute__((aligned(32)));
    int32_t pair[8][LANES] __attribute__((aligned(32)));
    float d[LANES] __attribute__((aligned(32)));
    float dmin[LANES] __attribute__((aligned(32)));
} KScales;

typedef struct {
    uint8_t codes[MAX_STEPS][32] __attribute__((aligned(32)));
    float ws[MAX_SUBS][LANES] __attribute__((aligned(32))); /* 32-blocks: d of block j */
    KScales k;                                               /* K-quants */
} Decoded;

static inline __m256i load_pair(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* T[i], lane l = bytes 4i .. 4i + 3 of the 16 bytes at p[l] + off (i = 0..3). */
static inline __attribute__((always_inline)) void transpose16(const uint8_t *const p[LANES], int64_t off, __m256i T[4]) {
    const __m256i v0 = load_pair(p[0] + off, p[4] + off), v1 = load_pair(p[1] + off, p[5] + off);
    const __m256i v2 = load_pair(p[2] + off, p[6] + off), v3 = load_pair(p[3] + off, p[7] + off);
    const __m256i t0 = _mm256_unpacklo_epi32(v0, v1), t1 = _mm256_unpackhi_epi32(v0, v1);
    const __m256i t2 = _mm256_unpacklo_epi32(v2, v3), t3 = _mm256_unpackhi_epi32(v2, v3);
    T[0] = _mm256_unpacklo_epi64(t0, t2);
    T[1] = _mm256_unpackhi_epi64(t0, t2);
    T[2] = _mm256_unpacklo_epi64(t1, t3);
    T[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The 8 float16 values at p[l] + off, as float32. */
static inline __m256 half8(const uint8_t *const p[LANES], int64_t off) {
    const __m128i h = _mm_setr_epi16((short)ld16(p[0] + off), (short)ld16(p[1] + off), (short)ld16(p[2] + off),
                                     (short)ld16(p[3] + off), (short)ld16(p[4] + off), (short)ld16(p[5] + off),
                                     (short)ld16(p[6] + off), (short)ld16(p[7] + off));
    return _mm256_cvtph_ps(h);
}

#define SRL16(v, n) _mm256_srli_epi16(v, n)
#define SLL16(v, n) _mm256_slli_epi16(v, n)

/* Keeps the compiler from regrouping a chain of integer additions (it would compute every product
 * first and run out of registers). */
#define PIN(v) __asm__("" : "+x"(v))

/* The 4 activations at x, in every 32-bit lane. */
static inline __m256i bcast4(const int8_t *x) {
    int32_t four;
    memcpy(&four, x, 4);
    return _mm256_set1_epi32(four);
}

/* Q4_K / Q5_K super-block headers at p[l] + off, one lane per output: d, dmin, and the 6-bit scales
 * and mins as bytes 0..3 of each 32-bit lane (sc_low: sc_0..3, m_low: m_0..3, sc_high: sc_4..7,
 * m_high: m_4..7). */
typedef struct {
    __m256 d, dmin;
    __m256i sc_low, m_low, sc_high, m_high;
} K4Header;

static inline __attribute__((always_inline)) K4Header k4_header(const uint8_t *const p[LANES], int64_t off) {
    __m256i H[4]; /* H[0]: d | dmin << 16, H[1..3]: the 12 bytes of packed scales and mins */
    transpose16(p, off, H);
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i dd = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(H[0], order), _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i m3F = _mm256_set1_epi8(0x3F), m0F = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    K4Header h;
    h.d = _mm256_cvtph_ps(_mm256_castsi256_si128(dd));
    h.dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(dd, 1));
    h.sc_low = _mm256_and_si256(H[1], m3F);
    h.m_low = _mm256_and_si256(H[2], m3F);
    h.sc_high = _mm256_or_si256(_mm256_and_si256(H[3], m0F), _mm256_and_si256(_mm256_srli_epi32(H[1], 2), m30));
    h.m_high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(H[3], 4), m0F), _mm256_and_si256(_mm256_srli_epi32(H[2], 2), m30));
    return h;
}

/* Byte t (0..3) of each 32-bit lane of v, as int32 (unsigned). */
static inline __attribute__((always_inline)) __m256i k4_byte(__m256i v, const int t) {
    const __m256i pick = _mm256_setr_epi32((int)(0x80808000u + t), (int)(0x80808004u + t), (int)(0x80808008u + t),
                                           (int)(0x8080800Cu + t), (int)(0x80808000u + t), (int)(0x80808004u + t),
                                           (int)(0x80808008u + t), (int)(0x8080800Cu + t));
    return _mm256_shuffle_epi8(v, pick);
}

/* The lanes' int16 pair (low, high) of int32 values below 2^15 in magnitude; (v, v): two copies of v. */
static inline __m256i pair16(__m256i low, __m256i high) {
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(high, 16));
}

/* Q4_K / Q5_K: the header of the super-block at p[l] + off, one lane per output. */
static inline __attribute__((always_inline)) void k4_scales(const uint8_t *const p[LANES], int64_t off, KScales *k) {
    const K4Header h = k4_header(p, off);
    _mm256_store_ps(k->d, h.d);
    _mm256_store_ps(k->dmin, h.dmin);
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        const __m256i s0 = k4_byte(h.sc_low, t), s1 = k4_byte(h.sc_high, t);
        _mm256_store_si256((__m256i *)k->sc[t], s0);
        _mm256_store_si256((__m256i *)k->sc[4 + t], s1);
        _mm256_store_si256((__m256i *)k->sc2[t], pair16(s0, s0));
        _mm256_store_si256((__m256i *)k->sc2[4 + t], pair16(s1, s1));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) { /* (m_2i, m_2i+1) and (m_4+2i, m_5+2i) */
        _mm256_store_si256((__m256i *)k->pair[i], pair16(k4_byte(h.m_low, 2 * i), k4_byte(h.m_low, 2 * i + 1)));
        _mm256_store_si256((__m256i *)k->pair[2 + i], pair16(k4_byte(h.m_high, 2 * i), k4_byte(h.m_high, 2 * i + 1)));
    }
}

/* Q6_K: the header of the super-block at p[l] + off, one lane per output. */
static inline __attribute__((always_inline)) void q6_scales(const uint8_t *const p[LANES], int64_t off, KScales *k) {
    __m256i S[4];
    transpose16(p, off + 192, S); /* the 16 int8 scales */
    _mm256_store_ps(k->d, half8(p, off + 208));
    __m256i sc[MAX_SUBS];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        sc[j] = _mm256_srai_epi32(_mm256_slli_epi32(S[j / 4], 24 - 8 * (j % 4)), 24);
        _mm256_store_si256((__m256i *)k->sc[j], sc[j]);
        _mm256_store_si256((__m256i *)k->sc2[j], pair16(sc[j], sc[j]));
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) _mm256_store_si256((__m256i *)k->pair[i], pair16(sc[2 * i], sc[2 * i + 1]));
}

/* sum over i < n of k->pair[i] times the row's pair of int16 sums pairs[i] (exact int32 per lane):
 * Q4_K / Q5_K (n = 4, the sums per 32) sum_j m_j * (sum of xq over sub-block j), Q6_K (n = 8, the sums
 * per 16) sum_j sc_j * (sum of xq over sub-block j). */
static inline __attribute__((always_inline)) __m256i pair_sums(const KScales *k, const int32_t *pairs, const int n) {
    __m256i total = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)k->pair[0]), _mm256_set1_epi32(pairs[0]));
#pragma GCC unroll 8
    for (int i = 1; i < n; i++)
        total = _mm256_add_epi32(total, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)k->pair[i]), _mm256_set1_epi32(pairs[i])));
    return total;
}

/* The float sequence of a K-quant super-block for one row, from isum = sum_j sc_j * (exact sum of
 * sub-block j, codes as stored): Q6_K first takes off the bias 32 * sum_j sc_j * (sum of xq over j);
 * acc = acc + (float)isum * (D * d), and for Q4_K / Q5_K shift = shift + (float)msum * (D * dmin),
 * msum = sum_j m_j * (sum of xq over j). D: the row's super-block scale xs, record: its sums. */
static inline __attribute__((always_inline)) void k_floats(const KScales *k, const int OFFS, const int BIAS_LOG,
                                                           __m256i isum, float D, const int32_t *record, __m256 *acc,
                                                           __m256 *shift) {
    if (BIAS_LOG >= 0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(pair_sums(k, record, 8), BIAS_LOG));
    const __m256 row = _mm256_set1_ps(D);
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(row, _mm256_load_ps(k->d))));
    if (OFFS)
        *shift = _mm256_add_ps(*shift, _mm256_mul_ps(_mm256_cvtepi32_ps(pair_sums(k, record + 8, 4)),
                                                     _mm256_mul_ps(row, _mm256_load_ps(k->dmin))));
}

/* Bit 4 of byte t of each lane = bit 4q + t of that lane of H (Q5_0's high bits, q = 0..7). */
static inline __m256i q5_0_high(__m256i H, int q) {
    const __m256i index = _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                           0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
                                          _mm256_set1_epi8((char)(q / 2)));
    const __m256i bits = q % 2 ? _mm256_set1_epi32((int)0x80402010u) : _mm256_set1_epi32(0x08040201);
    const __m256i picked = _mm256_and_si256(_mm256_shuffle_epi8(H, index), bits);
    return _mm256_and_si256(_mm256_cmpeq_epi8(picked, bits), _mm256_set1_epi8(0x10));
}

/* Where decoded code vectors go: into dec->codes (R = 0, the buffer `consume` reads), or straight
 * into the integer sums of R = 1 or 2 rows of activations ("fused", no buffer: f->isum[j][r] is the
 * exact int32 sum of sub-block j, before the bias correction). */
typedef struct {
    const int8_t *xq; /* row 0 of the tile, at the chunk's first input */
    int64_t ldq;
    __m256i isum[MAX_SUBS][FUSED_TILE];
} Fused;

/* out[r] = sum over i < n of code vector v[i] times the 4 activations x[r * ldq + 4i .. + 3] of row r,
 * exact int32 per lane, for rows r < R (steps outer, rows inner: each code vector is used by every row
 * while in a register). STEPS16 = 0: signed codes (Q8_0 on AVX2), else unsigned ones summed in int16
 * over at most STEPS16 steps (see the header) before vpmaddwd. */
static inline __attribute__((always_inline)) void dot_rows(const __m256i *v, const int n, const int STEPS16, const int R,
                                                           const int8_t *x, int64_t ldq, __m256i *out) {
#ifdef QMM_VNNI
    (void)STEPS16;
    for (int r = 0; r < R; r++) out[r] = _mm256_setzero_si256();
    for (int i = 0; i < n; i++)
        for (int r = 0; r < R; r++) out[r] = dpbusd(out[r], v[i], bcast4(x + r * ldq + 4 * i));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (!STEPS16) {
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_si256();
        for (int i = 0; i < n; i++) {
            const __m256i magnitude = _mm256_abs_epi8(v[i]);
            for (int r = 0; r < R; r++)
                out[r] = _mm256_add_epi32(out[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                      magnitude, _mm256_sign_epi8(bcast4(x + r * ldq + 4 * i), v[i])), ones));
        }
    } else {
        for (int c = 0; c < n; c += STEPS16) {
            __m256i pairs[ROW_TILE];
            for (int r = 0; r < R; r++) pairs[r] = _mm256_maddubs_epi16(v[c], bcast4(x + r * ldq + 4 * c));
            for (int i = c + 1; i < c + STEPS16 && i < n; i++)
                for (int r = 0; r < R; r++) {
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(v[i], bcast4(x + r * ldq + 4 * i)));
                    PIN(pairs[r]);
                }
            for (int r = 0; r < R; r++) {
                const __m256i wide = _mm256_madd_epi16(pairs[r], ones);
                out[r] = c == 0 ? wide : _mm256_add_epi32(out[r], wide);
            }
        }
    }
#endif
}

/* n code vectors for steps s0 .. s0 + n - 1 of the chunk (all in one sub-block of SPB steps). */
static inline __attribute__((always_inline)) void emit(Decoded *dec, Fused *f, const int R, const int STEPS16,
                                                       const int SPB, int64_t s0, const __m256i *v, const int n) {
    if (R == 0) {
        for (int i = 0; i < n; i++) _mm256_store_si256((__m256i *)dec->codes[s0 + i], v[i]);
        return;
    }
    const int64_t j = s0 / SPB;
    __m256i d[ROW_TILE];
    dot_rows(v, n, STEPS16, R, f->xq + 4 * s0, f->ldq, d);
    for (int r = 0; r < R; r++) f->isum[j][r] = s0 % SPB == 0 ? d[r] : _mm256_add_epi32(f->isum[j][r], d[r]);
}

/* Decode inputs k0 .. k0 + count - 1 of the rows p[0..7]: scales into dec->ws / wo, codes emitted
 * (see emit) as unsigned u = code + bias, or signed for Q8_0 on AVX2 (TYPE, R constant after inlining). */
static inline __attribute__((always_inline)) void decode_chunk(const int TYPE, const uint8_t *const p[LANES], int64_t k0,
                                                               int64_t count, Decoded *dec, Fused *f, const int R) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), m10 = _mm256_set1_epi8(0x10);
    if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q5_0) {
        const int five = TYPE == GGUF_Q5_0, size = five ? 22 : 18, steps16 = five ? 4 : 8;
        for (int64_t b = 0; b < count / 32; b++) {
            const int64_t off = (k0 / 32 + b) * size;
            __m256i T[4], lo[4], hi[4];
            _mm256_store_ps(dec->ws[b], half8(p, off));
            transpose16(p, off + (five ? 6 : 2), T);
            for (int i = 0; i < 4; i++) lo[i] = _mm256_and_si256(T[i], m4), hi[i] = _mm256_and_si256(SRL16(T[i], 4), m4);
            if (five) {
                const __m256i H = _mm256_setr_epi32((int)ld32(p[0] + off + 2), (int)ld32(p[1] + off + 2),
                                                    (int)ld32(p[2] + off + 2), (int)ld32(p[3] + off + 2),
                                                    (int)ld32(p[4] + off + 2), (int)ld32(p[5] + off + 2),
                                                    (int)ld32(p[6] + off + 2), (int)ld32(p[7] + off + 2));
                for (int i = 0; i < 4; i++)
                    lo[i] = _mm256_or_si256(lo[i], q5_0_high(H, i)), hi[i] = _mm256_or_si256(hi[i], q5_0_high(H, 4 + i));
            }
            emit(dec, f, R, steps16, 8, 8 * b, lo, 4);
            emit(dec, f, R, steps16, 8, 8 * b + 4, hi, 4);
        }
    } else if (TYPE == GGUF_Q8_0) {
        for (int64_t b = 0; b < count / 32; b++) {
            const int64_t off = (k0 / 32 + b) * 34;
            __m256i T[8];
            _mm256_store_ps(dec->ws[b], half8(p, off));
            transpose16(p, off + 2, T);
            transpose16(p, off + 18, T + 4);
#ifdef QMM_VNNI
            for (int i = 0; i < 8; i++) T[i] = _mm256_xor_si256(T[i], _mm256_set1_epi8((char)0x80)); /* code + 128 */
#endif
            emit(dec, f, R, 0, 8, 8 * b, T, 8);
        }
    } else if (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
        const int five = TYPE == GGUF_Q5_K;
        const int64_t off = (k0 / 256) * (five ? 176 : 144), qs = off + (five ? 48 : 16);
        __m256i Q[8];
        k4_scales(p, off, &dec->k);
        if (five) {
            transpose16(p, off + 16, Q);
            transpose16(p, off + 32, Q + 4);
        }
        for (int c = 0; c < 4; c++) {
            __m256i T[8], lo[8], hi[8];
            transpose16(p, qs + 32 * c, T);
            transpose16(p, qs + 32 * c + 16, T + 4);
            for (int i = 0; i < 8; i++) {
                lo[i] = _mm256_and_si256(T[i], m4);
                hi[i] = _mm256_and_si256(SRL16(T[i], 4), m4);
                if (five) { /* bit 2c of qh -> bit 4 of the low nibbles' code, bit 2c + 1 -> the high ones' */
                    __m256i l, h;
                    switch (c) {
                        case 0: l = SLL16(Q[i], 4), h = SLL16(Q[i], 3); break;
                        case 1: l = SLL16(Q[i], 2), h = SLL16(Q[i], 1); break;
                        case 2: l = Q[i], h = SRL16(Q[i], 1); break;
                        default: l = SRL16(Q[i], 2), h = SRL16(Q[i], 3); break;
                    }
                    lo[i] = _mm256_or_si256(lo[i], _mm256_and_si256(l, m10));
                    hi[i] = _mm256_or_si256(hi[i], _mm256_and_si256(h, m10));
                }
            }
            emit(dec, f, R, five ? 4 : 8, 8, 16 * c, lo, 8);
            emit(dec, f, R, five ? 4 : 8, 8, 16 * c + 8, hi, 8);
        }
    } else { /* Q6_K */
        const int64_t off = (k0 / 256) * 210;
        q6_scales(p, off, &dec->k);
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) { /* inputs 128h + 32s + 16 half + 0..15, s = 0..3 */
                __m256i A[4], B[4], Q[4], v[4];
                transpose16(p, off + 64 * h + 16 * half, A);
                transpose16(p, off + 64 * h + 32 + 16 * half, B);
                transpose16(p, off + 128 + 32 * h + 16 * half, Q);
                for (int i = 0; i < 4; i++)
                    v[i] = _mm256_or_si256(_mm256_and_si256(A[i], m4), _mm256_and_si256(SLL16(Q[i], 4), m30));
                emit(dec, f, R, 2, 4, 32 * h + 4 * half, v, 4);
                for (int i = 0; i < 4; i++)
                    v[i] = _mm256_or_si256(_mm256_and_si256(B[i], m4), _mm256_and_si256(SLL16(Q[i], 2), m30));
                emit(dec, f, R, 2, 4, 32 * h + 8 + 4 * half, v, 4);
                for (int i = 0; i < 4; i++)
                    v[i] = _mm256_or_si256(_mm256_and_si256(SRL16(A[i], 4), m4), _mm256_and_si256(Q[i], m30));
                emit(dec, f, R, 2, 4, 32 * h + 16 + 4 * half, v, 4);
                for (int i = 0; i < 4; i++)
                    v[i] = _mm256_or_si256(_mm256_and_si256(SRL16(B[i], 4), m4), _mm256_and_si256(SRL16(Q[i], 2), m30));
                emit(dec, f, R, 2, 4, 32 * h + 24 + 4 * half, v, 4);
            }
    }
}

#ifndef QMM_VNNI
#define QMM_ROWWISE 1
/* Row-wise fused path (M <= 3, K-quants, AVX2 without VNNI): instead of transposing the 8 rows'
 * bytes into 4-input steps, each 32-byte vector holds 16 consecutive code bytes of two outputs
 * (Q4_K, Q5_K: rows q and q + 4, one per 128-bit half, as they lie in the file) or 32 of one output
 * (Q6_K: one row, two sub-blocks of 16), so the activations are 16 or 32 consecutive bytes (broadcast
 * to both halves, or loaded as they are) instead of 4 broadcast per step. Each vpmaddubsw gives int16
 * partial sums of one (output, sub-block) per 128-bit half, and a short tree of vphaddw / vpmaddwd /
 * vphaddd turns the partial sums of the 8 outputs into one int32 vector per sub-block, lanes =
 * outputs, as the transposed path has them: exact integer sums, so the same numbers, and the float
 * sequence that follows is the header's, per sub-block in order. int16 bounds (codes u <= U,
 * |xq| <= 127, one vpmaddubsw lane <= 2 * U * 127): Q4_K (U = 15) 8 lanes <= 30480 before vpmaddwd;
 * Q5_K (U = 31) 4 lanes <= 31496, then int32; Q6_K (U = 63) 2 lanes <= 32004, then int32.
 * One call runs a group of 8 outputs over all of K (see rows_group). VNNI builds keep the transposed
 * path (vpdpbusd makes its products cheap; not measured here). */
static inline __m256i bcast16(const int8_t *x) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x)); }

/* Q4_K / Q5_K, super-block at p[l] + off: the exact sums of sub-blocks 2c (e[r]) and 2c + 1 (o[r]) for
 * rows r < R of x (at the super-block's first input, row stride ldq). qs[32c + l] holds input l of
 * sub-block 2c (low nibble) and 2c + 1 (high nibble); the two sub-blocks are done one after the other
 * (the bytes read twice: fewer registers live, so no spills with 2 rows). */
static inline __attribute__((always_inline)) void k4_sums(const int FIVE, const int c, const uint8_t *const p[LANES],
                                                          int64_t off, const int R, const int8_t *x, int64_t ldq,
                                                          __m256i *e_out, __m256i *o_out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    const int64_t qs = off + (FIVE ? 48 : 16) + 32 * c, qh = off + 16;
#pragma GCC unroll 2
    for (int hi = 0; hi < 2; hi++) {
        const int j = 2 * c + hi; /* the sub-block */
        __m256i E[ROWWISE_ROWS][2];
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) { /* rows q and q + 4 */
            const __m256i v0 = load_pair(p[q] + qs, p[q + 4] + qs), v1 = load_pair(p[q] + qs + 16, p[q + 4] + qs + 16);
            __m256i u0 = _mm256_and_si256(hi ? SRL16(v0, 4) : v0, m4), u1 = _mm256_and_si256(hi ? SRL16(v1, 4) : v1, m4);
            if (FIVE) { /* bit j of qh[l] -> bit 4 of the code */
                const __m256i b0 = load_pair(p[q] + qh, p[q + 4] + qh), b1 = load_pair(p[q] + qh + 16, p[q + 4] + qh + 16);
                u0 = _mm256_or_si256(u0, _mm256_and_si256(j < 4 ? SLL16(b0, 4 - j) : j > 4 ? SRL16(b0, j - 4) : b0, m10));
                u1 = _mm256_or_si256(u1, _mm256_and_si256(j < 4 ? SLL16(b1, 4 - j) : j > 4 ? SRL16(b1, j - 4) : b1, m10));
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xr = x + r * ldq + 32 * j;
                const __m256i e = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast16(xr)), _mm256_maddubs_epi16(u1, bcast16(xr + 16)));
                /* q odd: [row q - 1: 4, row q: 4 | rows q + 3, q + 4: 4, 4] */
                E[r][q / 2] = q % 2 == 0 ? e : _mm256_hadd_epi16(E[r][q / 2], e);
            }
        }
        for (int r = 0; r < R; r++) { /* lanes = rows 0..3 | 4..7 */
            const __m256i v = FIVE ? _mm256_hadd_epi32(_mm256_madd_epi16(E[r][0], ones), _mm256_madd_epi16(E[r][1], ones))
                                   : _mm256_madd_epi16(_mm256_hadd_epi16(E[r][0], E[r][1]), ones);
            if (hi) o_out[r] = v;
            else e_out[r] = v;
        }
    }
}

/* Q6_K, super-block at p[l] + off: the sums (codes + 32) of sub-blocks 8h + 2s (a[r]) and 8h + 2s + 1
 * (b[r]). Inputs 128h + 32s + (0..31) of one row are one vector of codes: low 4 bits from
 * ql[64h + 32(s & 1) + l] (s < 2 low nibble, else high), bits 4-5 from qh[32h + l] >> 2s; its product
 * with those 32 activations holds sub-block 8h + 2s in the low half and 8h + 2s + 1 in the high one. */
static inline __attribute__((always_inline)) void q6_sums(const int h, const int s, const uint8_t *const p[LANES],
                                                          int64_t off, const int R, const int8_t *x, int64_t ldq,
                                                          __m256i *a_out, __m256i *b_out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    __m256i P[ROWWISE_ROWS], H[ROWWISE_ROWS], G[ROWWISE_ROWS];
#pragma GCC unroll 8
    for (int n = 0; n < LANES; n++) {
        const uint8_t *row = p[n] + off;
        __asm__ volatile("" : "+r"(row)); /* a fresh load for each s: keeping the shared bytes would spill them */
        const __m256i L = _mm256_loadu_si256((const __m256i *)(row + 64 * h + 32 * (s & 1)));
        const __m256i Q = _mm256_loadu_si256((const __m256i *)(row + 128 + 32 * h));
        const __m256i low = s < 2 ? _mm256_and_si256(L, m4) : _mm256_and_si256(SRL16(L, 4), m4);
        const __m256i high = s == 0 ? SLL16(Q, 4) : s == 1 ? SLL16(Q, 2) : s == 2 ? Q : SRL16(Q, 2);
        const __m256i code = _mm256_or_si256(low, _mm256_and_si256(high, m30));
        for (int r = 0; r < R; r++) {
            __m256i v = _mm256_maddubs_epi16(code, _mm256_loadu_si256((const __m256i *)(x + r * ldq + 128 * h + 32 * s)));
            if (n % 2 == 0) {
                P[r] = v;
                continue;
            }
            v = _mm256_madd_epi16(_mm256_hadd_epi16(P[r], v), ones); /* [n - 1: 2, n: 2 | the same], int32 */
            if (n % 4 == 1) {
                H[r] = v;
                continue;
            }
            v = _mm256_hadd_epi32(H[r], v); /* rows n - 3 .. n, first sub-block | the same, second */
            if (n == 3) {
                G[r] = v;
                continue;
            }
            a_out[r] = _mm256_permute2x128_si256(G[r], v, 0x20);
            b_out[r] = _mm256_permute2x128_si256(G[r], v, 0x31);
        }
    }
}

/* Prefetching of the next task's rows while a task runs: [next, end) one slice at a time. */
typedef struct {
    const uint8_t *next, *end;
    int64_t slice;
    int near;
} Ahead;

static inline void ahead_step(Ahead *a) {
    if (a->next < a->end) {
        const uint8_t *to = a->next + a->slice < a->end ? a->next + a->slice : a->end;
        prefetch_range(a->next, to, a->near);
        a->next = to;
    }
}

/* The fused row-wise product of the group p[0..7] with rows r < R of the activations (super-block
 * form: xq, xs, xsum at input 0, row strides ldq, ldx, ldsum) over all K inputs: out[r] = y (acc - shift). Per super-block, the
 * header first (KScales), then the integer sums of the sub-blocks, each times sc_j (vpmulld) into
 * one int32 sum, then the super-block's float step (k_floats). */
static inline __attribute__((always_inline)) void rows_group(const int TYPE, const int R, const uint8_t *const p[LANES],
                                                             int64_t K, const int8_t *xq, int64_t ldq, const float *xs,
                                                             int64_t ldx, const int32_t *xsum, int64_t ldsum, Ahead *ahead,
                                                             __m256 *out) {
    __m256 acc[ROWWISE_ROWS], shift[ROWWISE_ROWS];
    KScales k;
    for (int r = 0; r < R; r++) acc[r] = shift[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        const int8_t *x = xq + 256 * b;
        __m256i isum[ROWWISE_ROWS];
        if (TYPE == GGUF_Q6_K) {
            const int64_t off = b * 210;
            q6_scales(p, off, &k);
#pragma GCC unroll 8
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 8
                for (int q = 0; q < 4; q++) {
                    __m256i sa[ROWWISE_ROWS], sb[ROWWISE_ROWS];
                    const int j = 8 * h + 2 * q;
                    ahead_step(ahead);
                    q6_sums(h, q, p, off, R, x, ldq, sa, sb);
                    const __m256i sc_a = _mm256_load_si256((const __m256i *)k.sc[j]), sc_b = _mm256_load_si256((const __m256i *)k.sc[j + 1]);
                    for (int r = 0; r < R; r++) {
                        const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(sa[r], sc_a), _mm256_mullo_epi32(sb[r], sc_b));
                        isum[r] = j == 0 ? both : _mm256_add_epi32(isum[r], both);
                    }
                }
        } else {
            const int five = TYPE == GGUF_Q5_K;
            const int64_t off = b * (five ? 176 : 144);
            k4_scales(p, off, &k);
#pragma GCC unroll 8
            for (int c = 0; c < 4; c++) {
                __m256i e[ROWWISE_ROWS], od[ROWWISE_ROWS];
                ahead_step(ahead);
                ahead_step(ahead);
                k4_sums(five, c, p, off, R, x, ldq, e, od);
                const __m256i sc_e = _mm256_load_si256((const __m256i *)k.sc[2 * c]), sc_o = _mm256_load_si256((const __m256i *)k.sc[2 * c + 1]);
                for (int r = 0; r < R; r++) {
                    const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(e[r], sc_e), _mm256_mullo_epi32(od[r], sc_o));
                    isum[r] = c == 0 ? both : _mm256_add_epi32(isum[r], both);
                }
            }
        }
        for (int r = 0; r < R; r++)
            k_floats(&k, TYPE != GGUF_Q6_K, TYPE == GGUF_Q6_K ? 5 : -1, isum[r], xs[r * ldx + 8 * b], xsum + r * ldsum + 16 * b,
                     &acc[r], &shift[r]);
    }
    for (int r = 0; r < R; r++) out[r] = TYPE == GGUF_Q6_K ? acc[r] : _mm256_sub_ps(acc[r], shift[r]);
}

typedef void (*RowsGroup)(const uint8_t *const[LANES], int64_t, int, const int8_t *, int64_t, const float *, int64_t,
                          const int32_t *, int64_t, Ahead *, __m256 *);
#define ROWS_KERNEL(NAME, TYPE)                                                                                  \
    static __attribute__((noinline)) void rows_##NAME(const uint8_t *const p[LANES], int64_t K, int R, const int8_t *xq, \
                                                      int64_t ldq, const float *xs, int64_t ldx, const int32_t *xsum, \
                                                      int64_t ldsum, Ahead *ahead, __m256 *out) {                  \
        switch (R) {                                                                                             \
            case 1: rows_group(TYPE, 1, p, K, xq, ldq, xs, ldx, xsum, ldsum, ahead, out); break;                 \
            case 2: rows_group(TYPE, 2, p, K, xq, ldq, xs, ldx, xsum, ldsum, ahead, out); break;                 \
            default: rows_group(TYPE, 3, p, K, xq, ldq, xs, ldx, xsum, ldsum, ahead, out); break;                \
        }                                                                                                        \
    }
ROWS_KERNEL(q4_k, GGUF_Q4_K)
ROWS_KERNEL(q5_k, GGUF_Q5_K)
ROWS_KERNEL(q6_k, GGUF_Q6_K)
#undef ROWS_KERNEL

#endif

/* bias * (sum of xq over sub-block j) of one row, bias = 2^BIAS_LOG, in every lane. */
static inline __m256i correction(const int BIAS_LOG, const int S, const int32_t *xsum, int64_t j) {
    const __m256i count = S == 16 ? _mm256_set1_epi32(xsum[j])
                                  : _mm256_add_epi32(_mm256_set1_epi32(xsum[2 * j]), _mm256_set1_epi32(xsum[2 * j + 1]));
    return _mm256_slli_epi32(count, BIAS_LOG);
}

/* The float sequence of block j (32-blocks) for rows 0..R-1, from their exact integer sums (minus the
 * bias correction, BIAS_LOG >= 0: codes stored as code + 2^BIAS_LOG). */
static inline __attribute__((always_inline)) void float_step(const Decoded *dec, int j, const int R, const int S,
                                                             const int BIAS_LOG, const __m256i *sums, const float *xs,
                                                             int64_t ldx, const int32_t *xsum, int64_t ldsum, float *acc) {
    const int64_t ai = (int64_t)j * S / 32;
    const __m256 ws = _mm256_load_ps(dec->ws[j]);
    for (int r = 0; r < R; r++) {
        __m256i total = sums[r];
        if (BIAS_LOG >= 0) total = _mm256_sub_epi32(total, correction(BIAS_LOG, S, xsum + r * ldsum, j));
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(xs[r * ldx + ai]), ws);
        _mm256_storeu_ps(acc + 8 * r, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * r), _mm256_mul_ps(_mm256_cvtepi32_ps(total), scale)));
    }
}

/* The 4 activations of step s of row r, in every 32-bit lane. */
static inline __m256i row_step(const int8_t *xq, int64_t ldq, int r, int64_t s) {
    int32_t four;
    memcpy(&four, xq + r * ldq + 4 * s, 4);
    return _mm256_set1_epi32(four);
}

/* pairs[r] = the int16 sums over steps c .. c + STEPS16 - 1 of the buffered codes (unsigned) times
 * row r's activations (vpmaddubsw, vpaddw), for rows r < R. */
static inline __attribute__((always_inline)) void step_pairs(const Decoded *dec, int64_t c, const int STEPS16, const int R,
                                                             const int8_t *xq, int64_t ldq, __m256i *pairs) {
    for (int r = 0; r < R; r++)
        pairs[r] = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)dec->codes[c]), row_step(xq, ldq, r, c));
    for (int i = 1; i < STEPS16; i++) {
        const __m256i w = _mm256_load_si256((const __m256i *)dec->codes[c + i]);
        for (int r = 0; r < R; r++) {
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(w, row_step(xq, ldq, r, c + i)));
            PIN(pairs[r]);
        }
    }
}

/* Rows 0..R-1 (xq, xs, xsum at the chunk's start, row strides ldq, ldx, ldsum) times a decoded chunk
 * of J blocks of 32 (S = 32): acc [R][8] (in memory between chunks) advanced by the float sequence of
 * the header. SIGNED: Q8_0's signed codes on AVX2; STEPS16: steps summed in int16 before vpmaddwd
 * (unsigned codes). R, S, SIGNED, STEPS16 are compile-time constants after inlining. */
static inline __attribute__((always_inline)) void consume(const Decoded *dec, int J, const int R, const int S,
                                                          const int SIGNED, const int STEPS16, const int BIAS_LOG,
                                                          const int8_t *xq, int64_t ldq, const float *xs, int64_t ldx,
                                                          const int32_t *xsum, int64_t ldsum, float *acc) {
    const int steps = S / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < J; j++) {
        const int64_t first = (int64_t)j * steps, end = first + steps;
        __m256i sums[ROW_TILE];
#ifdef QMM_VNNI
        (void)SIGNED, (void)STEPS16, (void)ones;
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int64_t s = first; s < end; s++) {
            const __m256i w = _mm256_load_si256((const __m256i *)dec->codes[s]);
            for (int r = 0; r < R; r++) sums[r] = dpbusd(sums[r], w, row_step(xq, ldq, r, s));
        }
#else
        if (SIGNED) {
            for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
            for (int64_t s = first; s < end; s++) {
                const __m256i w = _mm256_load_si256((const __m256i *)dec->codes[s]), aw = _mm256_abs_epi8(w);
                for (int r = 0; r < R; r++)
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                  aw, _mm256_sign_epi8(row_step(xq, ldq, r, s), w)), ones));
            }
        } else {
            for (int64_t c = first; c < end; c += STEPS16) {
                __m256i pairs[ROW_TILE];
                step_pairs(dec, c, STEPS16, R, xq, ldq, pairs);
                for (int r = 0; r < R; r++) {
                    const __m256i wide = _mm256_madd_epi16(pairs[r], ones);
                    sums[r] = c == first ? wide : _mm256_add_epi32(sums[r], wide);
                }
            }
        }
#endif
        float_step(dec, j, R, S, BIAS_LOG, sums, xs, ldx, xsum, ldsum, acc);
    }
}

/* Rows 0..R-1 times a decoded K-quant super-block (J = 256 / S sub-blocks): per sub-block the exact
 * sums scaled by sc_j in the integer domain (vpmaddwd by sc_j instead of by 1, or vpmulld after
 * vpdpbusd), then one float step per row (k_floats); acc / shift [R][8] in memory between chunks. */
static inline __attribute__((always_inline)) void consume_k(const Decoded *dec, const int R, const int S, const int STEPS16,
                                                            const int OFFS, const int BIAS_LOG, const int8_t *xq,
                                                            int64_t ldq, const float *xs, int64_t ldx, const int32_t *xsum,
                                                            int64_t ldsum, float *acc, float *shift) {
    const int steps = S / 4, J = CHUNK / S;
    __m256i isum[ROW_TILE];
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < J; j++) {
        const int64_t first = (int64_t)j * steps, end = first + steps;
#ifdef QMM_VNNI
        (void)STEPS16;
        __m256i sums[ROW_TILE];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int64_t s = first; s < end; s++) {
            const __m256i w = _mm256_load_si256((const __m256i *)dec->codes[s]);
            for (int r = 0; r < R; r++) sums[r] = dpbusd(sums[r], w, row_step(xq, ldq, r, s));
        }
        const __m256i sc = _mm256_load_si256((const __m256i *)dec->k.sc[j]);
        for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(sums[r], sc));
#else
        const __m256i sc2 = _mm256_load_si256((const __m256i *)dec->k.sc2[j]);
        for (int64_t c = first; c < end; c += STEPS16) {
            __m256i pairs[ROW_TILE];
            step_pairs(dec, c, STEPS16, R, xq, ldq, pairs);
            for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs[r], sc2));
        }
#endif
    }
    for (int r = 0; r < R; r++) {
        __m256 a = _mm256_loadu_ps(acc + 8 * r), sh = OFFS ? _mm256_loadu_ps(shift + 8 * r) : _mm256_setzero_ps();
        k_floats(&dec->k, OFFS, BIAS_LOG, isum[r], xs[r * ldx], xsum + r * ldsum, &a, &sh);
        _mm256_storeu_ps(acc + 8 * r, a);
        if (OFFS) _mm256_storeu_ps(shift + 8 * r, sh);
    }
}

/* The float sequence of a fused chunk, accumulators in registers: 32-blocks block by block (KQ = 0),
 * a K-quant super-block's sums scaled by sc_j in the integer domain, then k_floats (KQ = 1). */
static inline __attribute__((always_inline)) void fused_floats(const Decoded *dec, const Fused *f, int J, const int R,
                                                               const int S, const int KQ, const int OFFS, const int BIAS_LOG,
                                                               const float *xs, int64_t ldx, const int32_t *xsum,
                                                               int64_t ldsum, float *acc, float *shift) {
    __m256 a[FUSED_TILE], sh[FUSED_TILE];
    for (int r = 0; r < R; r++) {
        a[r] = _mm256_loadu_ps(acc + 8 * r);
        sh[r] = OFFS ? _mm256_loadu_ps(shift + 8 * r) : _mm256_setzero_ps();
    }
    if (KQ) {
        for (int r = 0; r < R; r++) {
            __m256i isum = _mm256_mullo_epi32(f->isum[0][r], _mm256_load_si256((const __m256i *)dec->k.sc[0]));
            for (int j = 1; j < J; j++)
                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(f->isum[j][r], _mm256_load_si256((const __m256i *)dec->k.sc[j])));
            k_floats(&dec->k, OFFS, BIAS_LOG, isum, xs[r * ldx], xsum + r * ldsum, &a[r], &sh[r]);
        }
    } else {
        for (int j = 0; j < J; j++) {
            const int64_t ai = (int64_t)j * S / 32;
            const __m256 ws = _mm256_load_ps(dec->ws[j]);
            for (int r = 0; r < R; r++) {
                __m256i total = f->isum[j][r];
                if (BIAS_LOG >= 0) total = _mm256_sub_epi32(total, correction(BIAS_LOG, S, xsum + r * ldsum, j));
                a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(_mm256_set1_ps(xs[r * ldx + ai]), ws)));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc + 8 * r, a[r]);
        if (OFFS) _mm256_storeu_ps(shift + 8 * r, sh[r]);
    }
}

typedef void (*Decoder)(const uint8_t *const[LANES], int64_t, int64_t, Decoded *);
typedef void (*Consumer)(const Decoded *, int, int, const int8_t *, int64_t, const float *, const float *, int64_t,
                         const int32_t *, int64_t, float *, float *);
typedef void (*FusedRows)(const uint8_t *const[LANES], int64_t, int64_t, int, Decoded *, const int8_t *, int64_t,
                          const float *, const float *, int64_t, const int32_t *, int64_t, float *, float *);

/* Per type: decode_* fills the buffer, consume_* runs tiles of up to 4 rows over it, fused_* decodes
 * and multiplies 1 or 2 rows at once (no buffer), then runs the float sequence. KQ: a K-quant (the
 * super-block numerics, OFFS: with mins); BIAS_LOG: codes stored as code + 2^BIAS_LOG (-1: as they are). */
#define CONSUME(R_, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_)                                              \
    (KQ_ ? consume_k(dec, R_, S_, STEPS16_, OFFS_, BIAS_LOG_, xq, ldq, xs, ldx, xsum, ldsum, acc, shift)                  \
         : consume(dec, J, R_, S_, SIGNED_, STEPS16_, BIAS_LOG_, xq, ldq, xs, ldx, xsum, ldsum, acc))
#define TYPE_KERNELS(NAME, TYPE, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_)                                   \
    static __attribute__((noinline)) void decode_##NAME(const uint8_t *const p[LANES], int64_t k0, int64_t count, \
                                                        Decoded *dec) {                                           \
        decode_chunk(TYPE, p, k0, count, dec, NULL, 0);                                                          \
    }                                                                                                            \
    static __attribute__((noinline)) void consume_##NAME(const Decoded *dec, int J, int R, const int8_t *xq,     \
                                                         int64_t ldq, const float *xs, const float *xo, int64_t ldx, \
                                                         const int32_t *xsum, int64_t ldsum, float *acc, float *shift) { \
        (void)J, (void)xo, (void)xsum, (void)ldsum, (void)shift;                                                 \
        switch (R) {                                                                                             \
            case 1: CONSUME(1, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break; \
            case 2: CONSUME(2, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break; \
            case 3: CONSUME(3, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break; \
            default: CONSUME(4, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break; \
        }                                                                                                        \
    }                                                                                                            \
    static __attribute__((noinline)) void fused_##NAME(const uint8_t *const p[LANES], int64_t k0, int64_t count, int R, \
                                                       Decoded *dec, const int8_t *xq, int64_t ldq,               \
                                                       const float *xs, const float *xo, int64_t ldx,             \
                                                       const int32_t *xsum, int64_t ldsum, float *acc, float *shift) { \
        Fused f;                                                                                                 \
        (void)xo;                                                                                                \
        const uint8_t *rows[LANES];                                                                              \
        for (int l = 0; l < LANES; l++) rows[l] = p[l];                                                          \
        f.xq = xq, f.ldq = ldq;                                                                                  \
        const int J = (int)(count / S_);                                                                         \
        switch (R) {                                                                                             \
            case 1:                                                                                              \
                decode_chunk(TYPE, rows, k0, count, dec, &f, 1);                                                 \
                fused_floats(dec, &f, J, 1, S_, KQ_, OFFS_, BIAS_LOG_, xs, ldx, xsum, ldsum, acc, shift);    \
                break;                                                                                           \
            default:                                                                                             \
                decode_chunk(TYPE, rows, k0, count, dec, &f, 2);                                                 \
                fused_floats(dec, &f, J, 2, S_, KQ_, OFFS_, BIAS_LOG_, xs, ldx, xsum, ldsum, acc, shift);    \
                break;                                                                                           \
        }                                                                                                        \
    }
/* int16 steps: codes 0..15 -> 8 (8 * 2 * 15 * 127 = 30480), 0..31 -> 4 (31496), 0..63 -> 2 (32004).
 * (GCC cannot see that decode_chunk sets f.isum[j] for every j < J that fused_floats reads.) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
TYPE_KERNELS(q4_0, GGUF_Q4_0, 32, 0, 8, 0, 0, 3)
TYPE_KERNELS(q5_0, GGUF_Q5_0, 32, 0, 4, 0, 0, 4)
#ifdef QMM_VNNI
TYPE_KERNELS(q8_0, GGUF_Q8_0, 32, 0, 1, 0, 0, 7) /* codes + 128, unsigned */
#else
TYPE_KERNELS(q8_0, GGUF_Q8_0, 32, 1, 1, 0, 0, -1)
#endif
TYPE_KERNELS(q4_k, GGUF_Q4_K, 32, 0, 8, 1, 1, -1)
TYPE_KERNELS(q5_k, GGUF_Q5_K, 32, 0, 4, 1, 1, -1)
TYPE_KERNELS(q6_k, GGUF_Q6_K, 16, 0, 2, 1, 0, 5)
#pragma GCC diagnostic pop
#undef TYPE_KERNELS
#undef CONSUME

typedef struct {
    Decoder decode;
    Consumer consume;
    FusedRows fused;
} Ops;

static Ops ops_of(int type) {
    switch (type) {
        case GGUF_Q4_0: return (Ops){decode_q4_0, consume_q4_0, fused_q4_0};
        case GGUF_Q5_0: return (Ops){decode_q5_0, consume_q5_0, fused_q5_0};
        case GGUF_Q8_0: return (Ops){decode_q8_0, consume_q8_0, fused_q8_0};
        case GGUF_Q4_K: return (Ops){decode_q4_k, consume_q4_k, fused_q4_k};
        case GGUF_Q5_K: return (Ops){decode_q5_k, consume_q5_k, fused_q5_k};
        default: return (Ops){decode_q6_k, consume_q6_k, fused_q6_k};
    }
}

/* y[m, lanes] = acc (- shift) for the real outputs of a group. */
static void store_group(const float *acc, const float *shift, int offsets, int64_t M, int64_t count, float *y,
                        int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        __m256 v = _mm256_loadu_ps(acc + 8 * m);
        if (offsets) v = _mm256_sub_ps(v, _mm256_loadu_ps(shift + 8 * m));
        if (count == LANES) {
            _mm256_storeu_ps(y + m * ldy, v);
        } else {
            float lanes[LANES];
            _mm256_storeu_ps(lanes, v);
            memcpy(y + m * ldy, lanes, sizeof(float) * (size_t)count);
        }
    }
}

#else /* portable C */
#define QMM_ISA "portable"

typedef struct {
    int8_t codes[LANES][CHUNK]; /* signed codes, lane by lane */
    float ws[MAX_SUBS][LANES];  /* 32-blocks: d */
    int32_t sc[MAX_SUBS][LANES], mn[MAX_SUBS][LANES];
    float d[LANES], dmin[LANES]; /* K-quants: the super-block's header */
} Decoded;

static void decode8(int type, const uint8_t *const p[LANES], int64_t k0, int64_t count, Decoded *dec) {
    float wo[MAX_SUBS * LANES]; /* the K-quants' float mins, not used here */
    for (int l = 0; l < LANES; l++) {
        decode_scalar(type, p[l], k0, count, dec->codes[l], &dec->ws[0][l], wo + l, LANES);
        if (type == GGUF_Q4_K || type == GGUF_Q5_K || type == GGUF_Q6_K)
            k_header_scalar(type, p[l] + (k0 / 256) * qmm_row_bytes(type, 256), &dec->sc[0][l], &dec->mn[0][l], LANES,
                            &dec->d[l], &dec->dmin[l]);
    }
}

/* The header's float sequences lane by lane: 32-blocks block by block; a K-quant super-block (J
 * sub-blocks of S, the chunk) with its integer sums scaled by sc_j, then one float step. */
static void consume_portable(const Decoded *dec, int J, int R, int S, int kquant, int offsets, const int8_t *xq,
                             int64_t ldq, const float *xs, int64_t ldx, const int32_t *xsum, int64_t ldsum, float *acc,
                             float *shift) {
    for (int r = 0; r < R; r++)
        for (int l = 0; l < LANES; l++) {
            float a = acc[8 * r + l], sh = shift[8 * r + l];
            int32_t isum = 0, msum = 0;
            for (int j = 0; j < J; j++) {
                int32_t sum = 0;
                for (int k = j * S; k < (j + 1) * S; k++) sum += (int32_t)dec->codes[l][k] * xq[r * ldq + k];
                if (kquant) {
                    isum += dec->sc[j][l] * sum;
                    if (offsets) { /* the record's sum over sub-block j: int16 pair 8 + j / 2, half j % 2 */
                        const uint32_t pair = (uint32_t)xsum[r * ldsum + 8 + j / 2];
                        msum += dec->mn[j][l] * (int32_t)(int16_t)(j % 2 ? pair >> 16 : pair & 0xFFFFu);
                    }
                    continue;
                }
                const int64_t ai = (int64_t)j * S / 32;
                const float scale = xs[r * ldx + ai] * dec->ws[j][l];
                const float term = (float)sum * scale;
                a = a + term;
            }
            if (kquant) {
                const float D = xs[r * ldx];
                const float scale = D * dec->d[l], term = (float)isum * scale;
                a = a + term;
                if (offsets) {
                    const float mscale = D * dec->dmin[l], mterm = (float)msum * mscale;
                    sh = sh + mterm;
                }
            }
            acc[8 * r + l] = a;
            shift[8 * r + l] = sh;
        }
}

static void store_group(const float *acc, const float *shift, int offsets, int64_t M, int64_t count, float *y,
                        int64_t ldy) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t l = 0; l < count; l++) y[m * ldy + l] = offsets ? acc[8 * m + l] - shift[8 * m + l] : acc[8 * m + l];
}
#endif

static void run_task(int type, const TypeInfo *t, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                     int64_t g0, int64_t groups, const int8_t *xq, const float *xs, const float *xo,
                     const int32_t *xsum, int64_t M, Decoded *dec, float *acc, float *shift, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ldsum = K / 16;
    memset(acc, 0, sizeof(float) * (size_t)(groups * M * LANES));
    memset(shift, 0, sizeof(float) * (size_t)(groups * M * LANES));
#ifdef QMM_SIMD
    const Ops ops = ops_of(type);
    const int fused = M <= FUSED_ROWS;
#else
    const int fused = 0;
    (void)xo;
#endif
    /* While this task's rows are read chunk by chunk, the rows of the next task's groups (the same
     * number of bytes, contiguous in the file) are prefetched front to back, one slice per chunk. */
    const int64_t chunks = (K + CHUNK - 1) / CHUNK, region = groups * LANES * row_bytes;
    const int64_t slice = (region / chunks + 63) & ~(int64_t)63;
    const uint8_t *next = w + (g0 + groups) * LANES * row_bytes, *end = w + N * row_bytes;
    const int near = region <= PREFETCH_NEAR;
#ifdef QMM_ROWWISE
    const RowsGroup rows = type == GGUF_Q4_K ? rows_q4_k : type == GGUF_Q5_K ? rows_q5_k : type == GGUF_Q6_K ? rows_q6_k : NULL;
    if (M <= ROWWISE_ROWS && rows) { /* the whole of K per call, accumulators in registers */
        /* prefetched in 8 parts per super-block, spread between the sums: a burst of a whole slice at
         * once was measured slower (fewer misses in flight where they are needed) */
        Ahead ahead = {next, end, ((slice + 7) / 8 + 63) & ~(int64_t)63, near};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p[LANES];
            for (int l = 0; l < LANES; l++) {
                const int64_t n = (g0 + g) * LANES + l;
                p[l] = w + (n < N ? n : N - 1) * row_bytes; /* a short last group repeats its last row */
            }
            const int64_t n0 = (g0 + g) * LANES, count = N - n0 < LANES ? N - n0 : LANES;
            __m256 out[ROWWISE_ROWS];
            rows(p, K, (int)M, xq, K, xs, nb, xsum, ldsum, &ahead, out);
            for (int64_t r = 0; r < M; r++) {
                float *yr = y + r * ldy + n0;
                if (count == LANES) {
                    _mm256_storeu_ps(yr, out[r]);
                } else {
                    float lanes[LANES];
                    _mm256_storeu_ps(lanes, out[r]);
                    memcpy(yr, lanes, sizeof(float) * (size_t)count);
                }
            }
        }
        return;
    }
#endif
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t count = K - k0 < CHUNK ? K - k0 : CHUNK;
        const int J = (int)(count / t->sub);
        if (next < end) {
            const uint8_t *to = next + slice < end ? next + slice : end;
            prefetch_range(next, to, near);
            next = to;
        }
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p[LANES];
            for (int l = 0; l < LANES; l++) {
                const int64_t n = (g0 + g) * LANES + l;
                p[l] = w + (n < N ? n : N - 1) * row_bytes; /* a short last group repeats its last row */
            }
#ifdef QMM_SIMD
            if (fused) { /* decode and multiply at once, 2 rows at a time */
                for (int64_t m0 = 0; m0 < M; m0 += FUSED_TILE)
                    ops.fused(p, k0, count, (int)(M - m0 < FUSED_TILE ? M - m0 : FUSED_TILE), dec + g, xq + m0 * K + k0, K,
                              xs + m0 * nb + k0 / 32, xo + m0 * nb + k0 / 32, nb, xsum + m0 * ldsum + k0 / 16, ldsum,
                              acc + (g * M + m0) * LANES, shift + (g * M + m0) * LANES);
                continue;
            }
            ops.decode(p, k0, count, dec + g);
#else
            decode8(type, p, k0, count, dec + g);
#endif
        }
        if (fused) continue;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int R = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            for (int64_t g = 0; g < groups; g++) {
                float *a = acc + (g * M + m0) * LANES, *s = shift + (g * M + m0) * LANES;
#ifdef QMM_SIMD
                ops.consume(dec + g, J, R, xq + m0 * K + k0, K, xs + m0 * nb + k0 / 32, xo + m0 * nb + k0 / 32,
                            nb, xsum + m0 * ldsum + k0 / 16, ldsum, a, s);
#else
                consume_portable(dec + g, J, R, t->sub, t->block == 256, t->offsets, xq + m0 * K + k0, K,
                                 xs + m0 * nb + k0 / 32, nb, xsum + m0 * ldsum + k0 / 16, ldsum, a, s);
#endif
            }
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n = (g0 + g) * LANES, count = N - n < LANES ? N - n : LANES;
        store_group(acc + g * M * LANES, shift + g * M * LANES, t->offsets, M, count, y + n, ldy);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Float weights: eight lanes of partial sums per (m, n), then the fixed tree (see the header). */

#define FTILE_OUT 8

#ifdef QMM_SIMD
static inline __m256 load_w8(int type, const uint8_t *row, int64_t k) {
    if (type == GGUF_F32) return _mm256_loadu_ps((const float *)row + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (type == GGUF_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float reduce8(__m256 v) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* p_i + p_{i+4} */
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));                                  /* q0 + q2, q1 + q3 */
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}

/* Rows 0..R-1 of x times outputs rows[0..U-1]. */
static inline __attribute__((always_inline)) void float_tile(int type, const float *x, int64_t ldx, const int R,
                                                             const int U, const uint8_t *const rows[], int64_t K,
                                                             float *y, int64_t ldy) {
    __m256 acc[4][FTILE_OUT];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) acc[r][u] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[FTILE_OUT];
        for (int u = 0; u < U; u++) wv[u] = load_w8(type, rows[u], k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int u = 0; u < U; u++) acc[r][u] = _mm256_fmadd_ps(wv[u], xv, acc[r][u]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) y[r * ldy + u] = reduce8(acc[r][u]);
}

static __attribute__((noinline)) void float_tiles(int type, const float *x, int64_t K, int64_t M, const uint8_t *const rows[],
                                                  int64_t count, float *y, int64_t ldy) {
    int64_t m0 = 0;
    if (M == 1) { /* one row: 8 outputs at once */
        if (count == 8) {
            float_tile(type, x, K, 1, 8, rows, K, y, ldy);
            return;
        }
        for (int64_t u = 0; u < count; u++) float_tile(type, x, K, 1, 1, rows + u, K, y + u, ldy);
        return;
    }
    for (; m0 + 4 <= M; m0 += 4)
        for (int64_t u = 0; u < count; u += 2) {
            if (count - u >= 2) float_tile(type, x + m0 * K, K, 4, 2, rows + u, K, y + m0 * ldy + u, ldy);
            else float_tile(type, x + m0 * K, K, 4, 1, rows + u, K, y + m0 * ldy + u, ldy);
        }
    for (; m0 < M; m0++)
        for (int64_t u = 0; u < count;) {
            if (count - u >= 4) {
                float_tile(type, x + m0 * K, K, 1, 4, rows + u, K, y + m0 * ldy + u, ldy);
                u += 4;
            } else {
                float_tile(type, x + m0 * K, K, 1, 1, rows + u, K, y + m0 * ldy + u, ldy);
                u += 1;
            }
        }
}
#else
static inline float load_w1(int type, const uint8_t *row, int64_t k) {
    if (type == GGUF_F32) {
        float v;
        memcpy(&v, row + 4 * k, 4);
        return v;
    }
    return type == GGUF_F16 ? half_to_float(ld16(row + 2 * k)) : bf16_to_float(ld16(row + 2 * k));
}

static void float_tiles(int type, const float *x, int64_t K, int64_t M, const uint8_t *const rows[], int64_t count,
                        float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t u = 0; u < count; u++) {
            float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t k = 0; k < K; k += 8)
                for (int l = 0; l < 8; l++) p[l] = fmaf(load_w1(type, rows[u], k + l), x[m * K + k + l], p[l]);
            const float q0 = p[0] + p[4], q1 = p[1] + p[5], q2 = p[2] + p[6], q3 = p[3] + p[7];
            const float r0 = q0 + q2, r1 = q1 + q3;
            y[m * ldy + u] = r0 + r1;
        }
}
#endif

static int float_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int type, int64_t row_bytes, int64_t N,
                        float *y, int64_t ldy, int threads) {
    const int64_t blocks = (N + FTILE_OUT - 1) / FTILE_OUT;
    const int64_t run = blocks / ((int64_t)threads * 16) > 1 ? blocks / ((int64_t)threads * 16) : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, run) if (threads > 1 && blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * FTILE_OUT, count = N - n0 < FTILE_OUT ? N - n0 : FTILE_OUT;
        const uint8_t *rows[FTILE_OUT];
        for (int64_t u = 0; u < FTILE_OUT; u++) rows[u] = w + (n0 + (u < count ? u : count - 1)) * row_bytes;
        float_tiles(type, x, K, M, rows, count, y + n0, ldy);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Exported */

const char *qmm_isa(void) { return QMM_ISA; }

int qmm_matmul(const float *x, const int8_t *xq, const float *xs, const float *xo, const int32_t *xsum, int64_t M,
               int64_t K, const void *weights, int type, int64_t N, float *y, int64_t ldy, int threads) {
    TypeInfo t;
    const int64_t row_bytes = qmm_row_bytes(type, K);
    if (row_bytes < 0 || type_info(type, &t) != 0 || M < 1 || N < 1 || ldy < N || !weights || !y) return -1;
    if (threads < 1) threads = 1;
    const uint8_t *w = (const uint8_t *)weights;
    if (!t.quantized) return x ? float_matmul(x, M, K, w, type, row_bytes, N, y, ldy, threads) : -1;
    if (!xq || !xs || !xo || !xsum) return -1;
    const int64_t groups = (N + LANES - 1) / LANES;
    const int64_t per_task = M >= MANY_ROWS ? MAX_TASK_GROUPS : 1;
    const int64_t tasks = (groups + per_task - 1) / per_task;
    /* Threads take runs of consecutive tasks (each run's rows are contiguous in the file, and each
     * task prefetches the next one's) as they come free: a thread slowed by other work on its core
     * takes fewer. Which thread computes an output never changes its bits. */
    const int64_t run = tasks / ((int64_t)threads * 16) > 1 ? tasks / ((int64_t)threads * 16) : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        Decoded dec[MAX_TASK_GROUPS];
        float small[2 * 16 * LANES]; /* the accumulators of up to 16 rows (one group) without malloc */
        const int on_stack = 2 * per_task * M * LANES <= 2 * 16 * LANES;
        float *acc = on_stack ? small : malloc(sizeof(float) * (size_t)(2 * per_task * M * LANES));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, run)
        for (int64_t task = 0; task < tasks; task++) {
            if (!acc) continue;
            const int64_t g0 = task * per_task, count = groups - g0 < per_task ? groups - g0 : per_task;
            run_task(type, &t, w, row_bytes, N, K, g0, count, xq, xs, xo, xsum, M, dec, acc, acc + per_task * M * LANES,
                     y, ldy);
        }
        if (!on_stack) free(acc);
    }
    return failed ? -1 : 0;
}

/* Several quantized matrices fed by the same quantized activations (a layer's q, k and v; gate and
 * up), their outputs side by side in y: part p writes columns offset_p .. offset_p + N_p - 1, offset_p
 * the sum of the earlier parts' N. One parallel region over every part's tasks: a small matrix (a
 * key/value projection) costs no region of its own, and threads balance across the parts. Each
 * output's bits are qmm_matmul's. Float-typed parts are refused (-1): call qmm_matmul for them. */
int qmm_matmul_parts(const int8_t *xq, const float *xs, const float *xo, const int32_t *xsum, int64_t M, int64_t K,
                     const QmmPart *parts, int count, float *y, int64_t ldy, int threads) {
    enum { MAX_PARTS = 8 };
    TypeInfo t[MAX_PARTS];
    int64_t row_bytes[MAX_PARTS], first[MAX_PARTS + 1], offset[MAX_PARTS], groups[MAX_PARTS];
    if (count < 1 || count > MAX_PARTS || M < 1 || !xq || !xs || !xo || !xsum || !y) return -1;
    if (threads < 1) threads = 1;
    const int64_t per_task = M >= MANY_ROWS ? MAX_TASK_GROUPS : 1;
    int64_t width = 0;
    first[0] = 0;
    for (int p = 0; p < count; p++) {
        row_bytes[p] = qmm_row_bytes(parts[p].type, K);
        if (row_bytes[p] < 0 || type_info(parts[p].type, &t[p]) != 0 || !t[p].quantized || parts[p].n < 1 ||
            !parts[p].weights)
            return -1;
        offset[p] = width;
        width += parts[p].n;
        groups[p] = (parts[p].n + LANES - 1) / LANES;
        first[p + 1] = first[p] + (groups[p] + per_task - 1) / per_task;
    }
    if (ldy < width) return -1;
    const int64_t tasks = first[count];
    const int64_t run = tasks / ((int64_t)threads * 16) > 1 ? tasks / ((int64_t)threads * 16) : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        Decoded dec[MAX_TASK_GROUPS];
        float small[2 * 16 * LANES];
        const int on_stack = 2 * per_task * M * LANES <= 2 * 16 * LANES;
        float *acc = on_stack ? small : malloc(sizeof(float) * (size_t)(2 * per_task * M * LANES));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
        int p = 0; /* the part of the task: tasks come in order within a run */
#pragma omp for schedule(dynamic, run)
        for (int64_t task = 0; task < tasks; task++) {
            if (!acc) continue;
            while (first[p + 1] <= task) p++;
            while (first[p] > task) p--;
            const int64_t g0 = (task - first[p]) * per_task;
            const int64_t n = groups[p] - g0 < per_task ? groups[p] - g0 : per_task;
            run_task(parts[p].type, &t[p], (const uint8_t *)parts[p].weights, row_bytes[p], parts[p].n, K, g0, n, xq,
                     xs, xo, xsum, M, dec, acc, acc + per_task * M * LANES, y + offset[p], ldy);
        }
        if (!on_stack) free(acc);
    }
    return failed ? -1 : 0;
}

int qmm_matmul_f32(const float *x, int64_t M, int64_t K, const void *weights, int type, int64_t N, float *y,
                   int64_t ldy, int threads) {
    TypeInfo t;
    if (!x || qmm_row_bytes(type, K) < 0 || type_info(type, &t) != 0 || M < 1) return -1;
    if (!t.quantized) return qmm_matmul(x, NULL, NULL, NULL, NULL, M, K, weights, type, N, y, ldy, threads);
    const int64_t nb = K / 32;
    enum { SMALL = 16384 }; /* activations of up to this many inputs in all are quantized on the stack */
    int8_t small_q[SMALL];
    float small_s[2 * SMALL / 32];
    int32_t small_sum[SMALL / 16];
    const int on_stack = M * K <= SMALL;
    int8_t *xq = on_stack ? small_q : malloc((size_t)(M * K));
    float *xs = on_stack ? small_s : malloc(sizeof(float) * (size_t)(2 * M * nb));
    int32_t *xsum = on_stack ? small_sum : malloc(sizeof(int32_t) * (size_t)(2 * M * nb));
    int status = -1;
    const int super = t.block == 256; /* the K-quants read the super-block form */
    if (xq && xs && xsum &&
        (super ? qmm_quantize_super(x, M, K, xq, xs, xs + M * nb, xsum, threads)
               : qmm_quantize(x, M, K, xq, xs, xs + M * nb, xsum, threads)) == 0)
        status = qmm_matmul(x, xq, xs, xs + M * nb, xsum, M, K, weights, type, N, y, ldy, threads);
    if (!on_stack) {
        free(xq);
        free(xs);
        free(xsum);
    }
    return status;
}

int qmm_get_rows(const void *weights, int type, int64_t N, int64_t K, const int64_t *ids, int64_t count, float *out) {
    TypeInfo t;
    const int64_t row_bytes = qmm_row_bytes(type, K);
    if (row_bytes < 0 || type_info(type, &t) != 0 || !weights || N < 1 || count < 0 || (count > 0 && (!ids || !out)))
        return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const uint8_t *w = (const uint8_t *)weights;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        float *o = out + i * K;
        if (!t.quantized) {
            for (int64_t k = 0; k < K; k++)
                if (type == GGUF_F32) memcpy(o + k, row + 4 * k, 4);
                else o[k] = type == GGUF_F16 ? half_to_float(ld16(row + 2 * k)) : bf16_to_float(ld16(row + 2 * k));
            continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
            const int64_t n = K - k0 < CHUNK ? K - k0 : CHUNK;
            int8_t code[CHUNK] = {0};
            float ws[MAX_SUBS] = {0}, wo[MAX_SUBS] = {0};
            decode_scalar(type, row, k0, n, code, ws, wo, 1);
            for (int64_t k = 0; k < n; k++) { /* gguf-py: fl(ws * q) (- wo) */
                const float v = ws[k / t.sub] * (float)code[k];
                o[k0 + k] = t.offsets ? v - wo[k / t.sub] : v;
            }
        }
    }
    return 0;
}
