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
 *   buffered (M > 2, K-quants M > 3): the chunk's codes are written once into a 2 KB buffer (L1) and
 *     `consume` runs tiles of up to ROW_TILE rows over it (8 on VNNI builds, else 4; one load of
 *     codes per 4 inputs for all rows of the tile), so
 *     the weights are read from memory and decoded once per call whatever M is; the float
 *     accumulators of every row live in a per-thread buffer between chunks; from M = 32 on, 4 groups
 *     share each chunk so that x is read from cache once per 32 outputs. Builds with 16-lane
 *     vpdpbusd (AVX-512 VNNI, and the emulated VNNI test build) consume two groups' buffers as one
 *     16-lane tile (`consume_pair`: per step one 512-bit product per row, the broadcast of the row's
 *     activations shared by both groups), so from M = 4 on a task holds 2 groups: on a Zen 4 the
 *     products of 64 rows ran 0.92-0.93x the time of the 8-lane tile (`scripts/kernel_ab.py product`,
 *     Q4_K and Q6_K) and whole forwards of 64 tokens of Qwen2.5-Coder-1.5B 0.90x; 4 to 16 tokens
 *     were unchanged (0.98-1.00x), the weights' reading and decoding bound them there.
 * Decoding costs about as much as the products of one row (measured on AVX2 Zen 2), so the fused
 * path for M = 1 is what keeps a one-token step near memory bandwidth; with more rows the products
 * (one vpmaddubsw per 32 of them, as in blockmm_int8.c) dominate. While a task's rows are read,
 * the next task's rows (contiguous in the file) are prefetched front to back, one slice per chunk.
 * Row-wise (M <= 3 on the K-quants, every SIMD build; `rows_group`): the transposition and
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
 * buffer is used. VNNI builds take it too (its sums are vpmaddubsw's: vpdpbusd instead changed
 * nothing measurable): on a Zen 4 (AVX-512 VNNI, 2 threads) whole forwards of Qwen2.5-Coder-1.5B
 * Q4_K_M (`scripts/kernel_ab.py forward --model`, builds alternated) took 0.90x the transposed
 * path's time at 2 rows and 0.95x at 3, and the products alone at 1 row 0.90x on Q4_K and Q5_K,
 * 0.91x on Q6_K, 0.71x on the 151k x 1536 Q6_K head (`kernel_ab.py product`).
 * Builds with 16-lane vectors take Q6_K row-wise without the horizontal adds per sub-block
 * (qmatmul_avx2.c's rows_q6_wide: 64 weights of one row a vector, the scales applied by vpdpwssd
 * before one reduction per row and super-block, the group's rows read one after the other): its
 * products 0.75-0.84x rows_group's time on a Zen 4, forwards of 1-3 tokens of that model 0.94-0.98x.
 * In the same builds the buffered path decodes Q4_K and Q6_K a pair of groups at once (decode_pair_*:
 * 16 rows transposed by 512-bit unpacks, one 64-byte store a step, one load a step in tile_sums where
 * two groups took two stores and a load plus an insert): on a Zen 5 the products of 4-16 rows (one
 * thread) took 0.90-0.95x the time (Q4_K) and 0.85-0.93x (Q6_K, the head's shape too), forwards of 4,
 * 8 and 16 tokens of Qwen2.5-Coder-1.5B (2 threads) 0.97x, the same bits (`scripts/kernel_ab.py`).
 * The portable build decodes the same chunks with scalar code and computes each (m, n) lane by lane.
 *
 * Threads (OpenMP) split the outputs: tasks of 1 group (4 from M = 32 on), taken in runs of
 * consecutive tasks as threads come free; a sum is never split, so the thread count changes no bit.
 *
 * AMX builds (real tiles, or the emulated test build) take the tile path for M >= 32 rows on the
 * quantized types: 16 weight rows decoded once per chunk and multiplied against 16 rows of
 * activations at a time by tile products, then the same float sequence (qmatmul_amx.c's header).
 *
 * Files (as ggml-cpu lays out its kernels; one translation unit, compiled per instruction-set
 * variant by runtime/build.py): this file holds the activations' quantization, the dispatch and the
 * exported functions; isa.h the instruction-set gate; quants.h the block formats and their portable
 * decoding (the reference per weight type); the loops come from one included file per level:
 * qmatmul_portable.c (no SIMD), qmatmul_avx2.c (AVX2 and its VNNI forms: the decoders, the fused,
 * buffered and row-wise paths, float_tiles) and, in AMX builds, qmatmul_amx.c (tile operations:
 * amx.h).
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
 *       the build: "amx", "amx-emulated", "avx512vnni", "avxvnni", "vnni-emulated", "avx2" or "portable"
 *   int qmm_tiles_init(void)
 *       0 where the tile path can run (AMX tile data granted by the kernel, or emulated), -1 not an
 *       AMX build, -2 refused: called once when the library is loaded
 *   int qmm_tile_rows(void)
 *       the M from which quantized products take the tile path (16), 0 in builds without it */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "numerics.h"
#include "isa.h"
#include "amx.h"
#include "quants.h"


#define LANES 8           /* outputs per group: one float32 lane each */
#define CHUNK 256         /* inputs decoded at a time */
#define MAX_STEPS (CHUNK / 4)
#define MAX_SUBS (CHUNK / 16)
/* Rows sharing each load of decoded codes. VNNI builds (vpdpbusd, 32 vector registers with
 * AVX-512) take 8: whole forwards of Qwen2.5-Coder-1.5B Q4_K_M on a Zen 4 (`scripts/kernel_ab.py
 * forward --model`) took 0.93-0.94x the time of 4 at 5, 8 and 16 tokens (1.01x at 4); the AVX2 build
 * on the same CPU gained nothing (0.96-1.01x), so it keeps 4. */
#ifdef VS_VNNI
#define ROW_TILE 8
#else
#define ROW_TILE 4
#endif
#define MAX_TASK_GROUPS 4 /* groups decoded per chunk (and per OpenMP task) when M is large */
#define MANY_ROWS 32      /* from this M on, a task holds MAX_TASK_GROUPS groups, else 1 (or 2, below) */
#define FUSED_ROWS 2      /* up to this M, chunks are decoded and multiplied at once (no buffer) */
#define FUSED_TILE 2      /* rows per fused call (3 or 4 were measured no faster than the buffer) */
#define ROWWISE_ROWS 3    /* up to this M, the K-quants take the row-wise path, one call */

/* Output groups per OpenMP task for M rows. VNNI builds with 16-lane vectors consume the buffered
 * chunks of two groups as one tile (qmatmul_avx2.c's consume_pair), so there a task of the buffered
 * path holds at least 2. */
static int64_t groups_per_task(int64_t M) {
    if (M >= MANY_ROWS) return MAX_TASK_GROUPS;
#ifdef VS_VNNI_WIDE
    if (M > ROWWISE_ROWS) return 2;
#endif
    return 1;
}


/* Bytes per row of a [*, K] weight of `type`, or -1 (unknown type, K < 1, K not allowed: a multiple
 * of the block for quantized types, of 8 for float ones). */
int64_t qmm_row_bytes(int type, int64_t K) {
    TypeInfo t;
    if (type_info(type, &t) != 0 || K < 1) return -1;
    if (K % (t.quantized ? t.block : 8) != 0) return -1;
    return K / t.block * t.bytes;
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

/* Prefetch bytes [from, to) of the weights into L2 (whole cache lines). Into L2 rather than L1: on a
 * Zen 4 (AVX-512 VNNI, 2 threads, Qwen2.5-Coder-1.5B Q4_K_M, `verispec profile` alternated) with the
 * L1 hint for tasks of up to 16 KiB, as before, the one-token step took 46 against 38 ms, verifies of
 * 2 and 4 tokens 58-61 and 76-79 against 50-53 and 65-67 ms, 8 sequences 111-128 against 103-108 ms,
 * prefill 132-135 against 142 tokens/s; the AVX2 build on the same CPU (`scripts/kernel_ab.py
 * forward --model`) 0.90x, 0.93x and 0.97x the time at 1, 2 and 8 tokens with L2. Zen 2 and the
 * Xeons were not measured. The non-temporal hint, or two tasks ahead, was slower. */
static inline void prefetch_range(const uint8_t *from, const uint8_t *to) {
    for (const uint8_t *a = (const uint8_t *)((uintptr_t)from & ~(uintptr_t)63); a < to; a += 64)
        __builtin_prefetch(a, 0, 2);
}

/* Prefetching of the next task's rows while a task runs: [next, end) one slice at a time. */
typedef struct {
    const uint8_t *next, *end;
    int64_t slice;
} Ahead;

static inline void ahead_step(Ahead *a) {
    if (a->next < a->end) {
        const uint8_t *to = a->next + a->slice < a->end ? a->next + a->slice : a->end;
        prefetch_range(a->next, to);
        a->next = to;
    }
}

/* While a task's rows (output groups g0 .. g0 + groups - 1) are read chunk by chunk, the rows of
 * the next task's groups (the same number of bytes, contiguous in the file) are prefetched front
 * to back, one slice per chunk. */
static inline Ahead task_ahead(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, int64_t g0, int64_t groups) {
    const int64_t chunks = (K + CHUNK - 1) / CHUNK, region = groups * LANES * row_bytes;
    const Ahead ahead = {w + (g0 + groups) * LANES * row_bytes, w + N * row_bytes, (region / chunks + 63) & ~(int64_t)63};
    return ahead;
}

/* The rows of output group `group` (LANES outputs); a short last group repeats its last row. */
static inline void group_rows(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t group, const uint8_t *p[LANES]) {
    for (int l = 0; l < LANES; l++) {
        const int64_t n = group * LANES + l;
        p[l] = w + (n < N ? n : N - 1) * row_bytes;
    }
}


#define FTILE_OUT 8 /* float weights: outputs per task */

/* The per-instruction-set loops (one file each, compiled as part of this one): run_task (the
 * quantized weights' row-wise / fused / buffered paths over a task's output groups) and float_tiles. */
#ifdef VS_AVX2
#include "qmatmul_avx2.c"
#else
#include "qmatmul_portable.c"
#endif
#ifdef VS_AMX
#include "qmatmul_amx.c" /* the tile path for wide forwards (M >= AMX_ROWS) */
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

const char *qmm_isa(void) { return VS_ISA_NAME; }

int qmm_matmul(const float *x, const int8_t *xq, const float *xs, const float *xo, const int32_t *xsum, int64_t M,
               int64_t K, const void *weights, int type, int64_t N, float *y, int64_t ldy, int threads) {
    TypeInfo t;
    const int64_t row_bytes = qmm_row_bytes(type, K);
    if (row_bytes < 0 || type_info(type, &t) != 0 || M < 1 || N < 1 || ldy < N || !weights || !y) return -1;
    if (threads < 1) threads = 1;
    const uint8_t *w = (const uint8_t *)weights;
    if (!t.quantized) return x ? float_matmul(x, M, K, w, type, row_bytes, N, y, ldy, threads) : -1;
    if (!xq || !xs || !xo || !xsum) return -1;
#ifdef VS_AMX
    if (M >= AMX_ROWS) {
        const QmmPart part = {weights, type, N};
        const int64_t offset = 0;
        return amx_matmul_parts(xq, xs, xsum, M, K, &part, 1, &offset, y, ldy, threads);
    }
#endif
    const int64_t groups = (N + LANES - 1) / LANES;
    const int64_t per_task = groups_per_task(M);
    const int64_t tasks = (groups + per_task - 1) / per_task;
    /* Threads take runs of consecutive tasks (each run's rows are contiguous in the file, and each
     * task prefetches the next one's) as they come free: a thread slowed by other work on its core
     * takes fewer. Which thread computes an output never changes its bits. */
    const int64_t run = tasks / ((int64_t)threads * 16) > 1 ? tasks / ((int64_t)threads * 16) : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        Decoded dec[MAX_TASK_GROUPS];
        float small[2 * 32 * LANES]; /* the accumulators of up to 32 rows of groups (16 rows of a pair) without malloc */
        const int on_stack = 2 * per_task * M * LANES <= 2 * 32 * LANES;
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
    const int64_t per_task = groups_per_task(M);
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
#ifdef VS_AMX
    if (M >= AMX_ROWS) return amx_matmul_parts(xq, xs, xsum, M, K, parts, count, offset, y, ldy, threads);
#endif
    const int64_t tasks = first[count];
    const int64_t run = tasks / ((int64_t)threads * 16) > 1 ? tasks / ((int64_t)threads * 16) : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        Decoded dec[MAX_TASK_GROUPS];
        float small[2 * 32 * LANES];
        const int on_stack = 2 * per_task * M * LANES <= 2 * 32 * LANES;
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


/* Whether the tile path of wide forwards can run: 0 yes (real AMX tiles granted by the kernel, or the
 * emulated build), -1 not an AMX build, -2 the kernel refused the tile data (blockmm.py then falls
 * back to the next variant). Called once, when the library is loaded. */
int qmm_tiles_init(void) {
#if defined(VS_AMX_REAL)
    return amx_request_tiles() == 0 ? 0 : -2;
#elif defined(VS_AMX_EMULATED)
    return 0;
#else
    return -1;
#endif
}

int qmm_tile_rows(void) {
#ifdef VS_AMX
    return AMX_ROWS;
#else
    return 0;
#endif
}
