/* qmatmul.c's tile path for wide forwards (AMX-INT8, or its emulation: isa.h's VS_AMX): included by
 * qmatmul.c, never compiled on its own. For M >= AMX_ROWS rows of activations and a quantized
 * weight type (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), qmm_matmul and qmm_matmul_parts come here; fewer
 * rows keep the row-wise / fused / buffered paths of qmatmul_avx2.c.
 *
 * The work is split in tasks of 16 outputs (a short last tile repeats its last row); a task walks
 * K in chunks of 256 inputs (one K-quant super-block, or 8 blocks of 32). Each chunk of the 16
 * weight rows is decoded once, row-major [16 outputs][256 inputs] of signed int8, and used by every
 * row of the forward, 16 rows of activations at a time: tile B holds them in the layout the
 * instruction reads (row k: inputs 4k .. 4k + 3 of row 0, then of row 1, ..., of row 15: 64 bytes),
 * repacked once per call (xb) from the quantized activations xq, and TDPBSSD (signed by signed)
 * sums codes times activations exactly in int32 (tile C: 16 outputs x 16 rows). Two forms:
 *   Q4_K: the sub-block scales go inside the codes. sc_j = 8 * high_j + low_j (3-bit digits) and
 *     sum_j sc_j * sum_{k in j} q_k x_k = sum_k (low q_k) x_k + 8 * sum_k (high q_k) x_k, both
 *     products of a 4-bit code by a digit at most 105: two rows of A per output (a table lookup per
 *     16 codes), tile products of 64 inputs into two tiles C over the whole super-block, and
 *     isum = C_low + 8 * C_high; no integer step per sub-block;
 *   the others: per sub-block j of S inputs (S = 32, Q6_K 16) a 16 x 16 x S product, its tile
 *     stored, and isum = sum_j sc_j * C_j (K-quants) in 16-lane vectors (one tile row, one vector),
 *     or for the 32-blocks the float step per block; two pairs of tiles C alternate, so that the
 *     products of one pair run while the sums of the other are read.
 * Codes are signed (Q4_0 q - 8, Q5_0 q - 16, Q6_K q - 32, Q8_0 as stored, Q4_K / Q5_K q), so no
 * bias is taken off afterwards. Then each (row, output) runs the float sequence of qmatmul.c's
 * header exactly: per 32-block acc = acc + (float)isum * (xs * d); per K-quant super-block
 * acc = acc + (float)isum * (D * d), shift = shift + (float)msum * (D * dmin) (msum by vpdpwssd from
 * the record's pairs), y = acc - shift. The integers are the other paths' and the float operations
 * the same ones in the same order, so a row's output has the same bits on this path as on every
 * other, for any M and thread count.
 *
 * Measured on an Intel Xeon with AMX (2 vCPUs). In a C microbenchmark a tile product and the store
 * of its 1 KB of sums took 7.7 ns in a loop, 16 vector multiply-adds of the stored sums 7.2 ns, and
 * the two did not overlap (14.9 ns interleaved); decoding the 16 rows costs about as much as the
 * whole one-row product. So at 16 rows the VNNI path's decoded tile is as fast (Q4_K 8960 x 1536
 * in cache: 0.66 against 0.69 ms, 2 threads), and with the weights read from memory the tile path
 * at 16 rows was 1.4-1.6x slower (the VNNI path hides the reads behind its decoding; this one did
 * not); at 32 rows the two were even and from 64 rows on the tile path led (128 rows of Q4_K: 0.65x
 * the time, Q6_K 0.73x). Hence AMX_ROWS = 32: prompts' chunks and
 * batches of 32 sequences or more. */

#define AMX_ROWS 32 /* from this M on, quantized products take the tile path (see the header) */
#define AMX_N 16    /* outputs per task: the rows of tiles A and C */
#define AMX_M 16    /* activation rows per tile product: the int32 columns of tiles B and C */

typedef struct {
    int8_t s[AMX_N][CHUNK] __attribute__((aligned(64))); /* signed codes: tile A's rows (Q4_K: sc_low * q) */
    int8_t hi[AMX_N][CHUNK] __attribute__((aligned(64))); /* Q4_K: sc_high * q */
    float ws[AMX_N][MAX_SUBS];                           /* 32-blocks: d of block j */
    KScales k[AMX_N / LANES]; /* K-quants: the headers of outputs 0..7 and 8..15 (qmatmul_avx2.c's) */
} AmxDecoded;

/* Output n's field f of the K-quant header (k4_scales / q6_scales: one lane per output). */
#define AMX_HEAD(dec, f, n) ((dec)->k[(n) / LANES].f[(n) % LANES])

/* The bias taken off a type's stored quant to give its signed code (code = q - bias): Q4_0 8, Q5_0 16,
 * Q6_K 32, else 0 (Q8_0 is stored signed; Q4_K, Q5_K codes are their quants). */
static int amx_bias(int type) {
    switch (type) {
        case GGUF_Q4_0: return 8;
        case GGUF_Q5_0: return 16;
        case GGUF_Q6_K: return 32;
        default: return 0;
    }
}

/* Bit 4 of byte i of the result = bit i of qh (i < 32): Q5_0's fifth bits as a vector. */
static inline __m256i amx_q5_0_bits(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* Bits `shift` .. of each byte of v moved to bit 4 (one bit, mask 0x10) or bits 4-5 (mask 0x30). */
static inline __m256i amx_bits_to_4(__m256i v, const int shift, const int mask) {
    const __m256i moved = shift <= 4 ? _mm256_slli_epi16(v, 4 - shift) : _mm256_srli_epi16(v, shift - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)mask));
}

/* The signed codes of inputs k0 .. k0 + count - 1 of one row, into s[0 .. count): the stored quant
 * unpacked as quants.h's decode_scalar reads it (AVX2), less the type's bias. */
static void amx_unpack(int type, const uint8_t *row, int64_t k0, int64_t count, int8_t *s) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8((char)amx_bias(type));
    const __m128i m4h = _mm_set1_epi8(0x0F);
    switch (type) {
        case GGUF_Q4_0:
        case GGUF_Q5_0: {
            const int five = type == GGUF_Q5_0, size = five ? 22 : 18;
            for (int64_t b = 0; b < count / 32; b++) {
                const uint8_t *blk = row + (k0 / 32 + b) * size;
                const __m128i v = _mm_loadu_si128((const __m128i *)(blk + (five ? 6 : 2)));
                __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4h), _mm_and_si128(v, m4h));
                if (five) q = _mm256_or_si256(q, amx_q5_0_bits(ld32(blk + 2)));
                _mm256_storeu_si256((__m256i *)(s + 32 * b), _mm256_sub_epi8(q, bias));
            }
            break;
        }
        case GGUF_Q8_0:
            for (int64_t b = 0; b < count / 32; b++)
                memcpy(s + 32 * b, row + (k0 / 32 + b) * 34 + 2, 32);
            break;
        case GGUF_Q4_K:
        case GGUF_Q5_K: {
            const int five = type == GGUF_Q5_K;
            const uint8_t *blk = row + (k0 / 256) * (five ? 176 : 144), *qs = blk + (five ? 48 : 16);
            const __m256i Q = _mm256_loadu_si256((const __m256i *)(blk + 16)); /* Q5_K: qh */
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (five) {
                    lo = _mm256_or_si256(lo, amx_bits_to_4(Q, 2 * c, 0x10));
                    hi = _mm256_or_si256(hi, amx_bits_to_4(Q, 2 * c + 1, 0x10));
                }
                _mm256_storeu_si256((__m256i *)(s + 64 * c), lo);
                _mm256_storeu_si256((__m256i *)(s + 64 * c + 32), hi);
            }
            break;
        }
        default: { /* Q6_K */
            const uint8_t *blk = row + (k0 / 256) * 210, *ql = blk, *qh = blk + 128;
            for (int h = 0; h < 2; h++) {
                const __m256i Q = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                for (int c = 0; c < 4; c++) {
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (c & 1)));
                    const __m256i low = c < 2 ? _mm256_and_si256(L, m4) : _mm256_and_si256(_mm256_srli_epi16(L, 4), m4);
                    const __m256i q = _mm256_or_si256(low, amx_bits_to_4(Q, 2 * c, 0x30));
                    _mm256_storeu_si256((__m256i *)(s + 128 * h + 32 * c), _mm256_sub_epi8(q, bias));
                }
            }
            break;
        }
    }
}

/* s * i for s, i < 8 x 16: the products of a 4-bit code by a 3-bit digit of a scale (at most 105). */
static const int8_t AMX_TIMES[8][16] __attribute__((aligned(16))) = {
#define ROW(s) {0, s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s, 7 * s, 8 * s, 9 * s, 10 * s, 11 * s, 12 * s, 13 * s, 14 * s, 15 * s}
    ROW(0), ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6), ROW(7)
#undef ROW
};

/* Q4_K with the sub-block scales inside the codes: sc_j = 8 * high_j + low_j (3-bit digits), so
 *   sum_j sc_j * sum_{k in j} q_k x_k = sum_k (low_j(k) q_k) x_k + 8 * sum_k (high_j(k) q_k) x_k,
 * the same integer, with both products of a code and a digit in int8 (at most 15 * 7). Rows of
 * dec->s get low_j * q, rows of dec->hi high_j * q (a table lookup per 16 codes), so that a tile
 * product runs over 64 inputs at once and the super-block's 8 scales cost no integer step per
 * sub-block. Needs the header (k4_scales) decoded first. */
static void amx_decode_q4_k_digits(const uint8_t *const p[AMX_N], int64_t k0, AmxDecoded *dec) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int n = 0; n < AMX_N; n++) {
        const uint8_t *qs = p[n] + (k0 / 256) * 144 + 16;
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i q[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
            for (int h = 0; h < 2; h++) {
                const int sc = AMX_HEAD(dec, sc[2 * c + h], n);
                const __m256i low = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)AMX_TIMES[sc & 7]));
                const __m256i high = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)AMX_TIMES[sc >> 3]));
                _mm256_store_si256((__m256i *)(dec->s[n] + 64 * c + 32 * h), _mm256_shuffle_epi8(low, q[h]));
                _mm256_store_si256((__m256i *)(dec->hi[n] + 64 * c + 32 * h), _mm256_shuffle_epi8(high, q[h]));
            }
        }
    }
}

/* Inputs k0 .. k0 + count - 1 of the 16 rows p[0..15], decoded into dec: the codes (amx_unpack),
 * and the scales (32-blocks: d per block; K-quants: the header of each group of 8 outputs, decoded
 * by the VNNI path's k4_scales / q6_scales). */
static void amx_decode(int type, const TypeInfo *t, const uint8_t *const p[AMX_N], int64_t k0, int64_t count,
                       AmxDecoded *dec) {
    if (type != GGUF_Q4_K)
        for (int n = 0; n < AMX_N; n++) amx_unpack(type, p[n], k0, count, dec->s[n]);
    if (t->block == 256) {
        for (int g = 0; g < AMX_N / LANES; g++) {
            if (type == GGUF_Q6_K) q6_scales(p + g * LANES, (k0 / 256) * t->bytes, &dec->k[g]);
            else k4_scales(p + g * LANES, (k0 / 256) * t->bytes, &dec->k[g]);
        }
        if (type == GGUF_Q4_K) amx_decode_q4_k_digits(p, k0, dec);
        return;
    }
    for (int n = 0; n < AMX_N; n++)
        for (int64_t j = 0; j < count / 32; j++) dec->ws[n][j] = half_to_float(ld16(p[n] + (k0 / 32 + j) * t->bytes));
}

/* The inputs per tile product of a type: 64 for Q4_K (its scales inside the codes), else its sub-block. */
static inline int amx_tile_k(int type, const TypeInfo *t) { return type == GGUF_Q4_K ? 64 : t->sub; }

/* xb [ceil(M / 16)][K / 4][64]: the quantized activations in tile B's layout, rows past M zero. */
static void amx_pack_rows(const int8_t *xq, int64_t M, int64_t K, int8_t *xb) {
    const int64_t tiles = (M + AMX_M - 1) / AMX_M;
    for (int64_t mt = 0; mt < tiles; mt++)
        for (int64_t kk = 0; kk < K / 4; kk++) {
            int8_t *row = xb + (mt * (K / 4) + kk) * 64;
            for (int r = 0; r < AMX_M; r++) {
                const int64_t m = mt * AMX_M + r;
                if (m < M) memcpy(row + 4 * r, xq + m * K + 4 * kk, 4);
                else memset(row + 4 * r, 0, 4);
            }
        }
}

/* A call's activations in the layouts the tasks read, made once per call: xb (tile B's, above),
 * scales [K / 32][mpad] (xs transposed: row m's scale of block a at a * mpad + m; the K-quants' D of
 * a super-block is its first block's), and for types with mins pairs [K / 256][4][mpad] (the
 * record's sums per 32 as int16 pairs, transposed), so that a tile of 16 rows reads each as one
 * vector; the padding rows past M are zero. */
typedef struct {
    int8_t *xb;
    float *scales;
    int32_t *pairs;
} AmxRows;

static void amx_rows_free(AmxRows *rows) {
    free(rows->xb);
    free(rows->scales);
    free(rows->pairs);
}

static int amx_rows_make(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K, int64_t mpad,
                         int with_pairs, AmxRows *rows) {
    const int64_t nb = K / 32, supers = K / 256, ldsum = K / 16;
    rows->xb = aligned_alloc(64, (size_t)(mpad * K));
    rows->scales = aligned_alloc(64, sizeof(float) * (size_t)(nb * mpad));
    rows->pairs = with_pairs ? aligned_alloc(64, sizeof(int32_t) * (size_t)(supers * 4 * mpad)) : NULL;
    if (!rows->xb || !rows->scales || (with_pairs && !rows->pairs)) {
        amx_rows_free(rows);
        return -1;
    }
    amx_pack_rows(xq, M, K, rows->xb);
    for (int64_t a = 0; a < nb; a++)
        for (int64_t m = 0; m < mpad; m++) rows->scales[a * mpad + m] = m < M ? xs[m * nb + a] : 0.0f;
    if (with_pairs)
        for (int64_t c = 0; c < supers; c++)
            for (int i = 0; i < 4; i++)
                for (int64_t m = 0; m < mpad; m++)
                    rows->pairs[(c * 4 + i) * mpad + m] = m < M ? xsum[m * ldsum + c * 16 + 8 + i] : 0;
    return 0;
}

/* Tiles: C 0-3 (two pairs, so that one pair's products run while the other's sums are read), A 4, 5
 * (the codes at s, row stride CHUNK), B 6, 7 (the activations at b: a sub-block's 4-input rows of 64
 * bytes). The exact sums of sub-blocks j and j + 1 of the 16 outputs x 16 activation rows into
 * tiles C0, C1 (both if `two`, else j alone), then stored into c[0], c[1] by amx_store_pair. */
#define amx_issue_pair(C0, C1, s, b, S, two)        \
    do {                                          \
        tile_zero(C0);                            \
        tile_load(4, (s), CHUNK);                 \
        tile_load(6, (b), 64);                    \
        tile_dpbssd(C0, 4, 6);                    \
        if (two) {                                \
            tile_zero(C1);                        \
            tile_load(5, (s) + (S), CHUNK);       \
            tile_load(7, (b) + (S) / 4 * 64, 64); \
            tile_dpbssd(C1, 5, 7);                \
        }                                         \
    } while (0)
#define amx_store_pair(C0, C1, c, two)                      \
    do {                                                  \
        tile_store(C0, (c)[0], 4 * AMX_M);                \
        if (two) tile_store(C1, (c)[1], 4 * AMX_M);       \
    } while (0)

/* isum[n] += sc_j * c[0][n] + sc_j+1 * c[1][n]: the K-quants' scales in the integer domain. */
static inline void amx_scale_pair(const AmxDecoded *dec, int j, int32_t c[2][AMX_N][AMX_M], wide_i isum[AMX_N]) {
    for (int n = 0; n < AMX_N; n++) {
        const wide_i t0 = wide_mullo(wide_loadu(c[0][n]), wide_set1(AMX_HEAD(dec, sc[j], n)));
        const wide_i t1 = wide_mullo(wide_loadu(c[1][n]), wide_set1(AMX_HEAD(dec, sc[j + 1], n)));
        isum[n] = wide_add(isum[n], wide_add(t0, t1));
    }
}

/* Q4_K: isum[n] = C_low + 8 * C_high over the chunk's 256 inputs, 4 steps of 64 (tiles C 0, 1; the
 * codes' digit rows A 4, 5 then 2, 3; the activations B 6 then 7, alternating). */
static inline void amx_q4_k_sums(const AmxDecoded *dec, const int8_t *b, int32_t c[2][AMX_N][AMX_M], wide_i isum[AMX_N]) {
    tile_zero(0);
    tile_zero(1);
    for (int kk = 0; kk < 4; kk += 2) {
        tile_load(4, dec->s[0] + 64 * kk, CHUNK);
        tile_load(5, dec->hi[0] + 64 * kk, CHUNK);
        tile_load(6, b + 16 * kk * 64, 64);
        tile_dpbssd(0, 4, 6);
        tile_dpbssd(1, 5, 6);
        tile_load(2, dec->s[0] + 64 * (kk + 1), CHUNK);
        tile_load(3, dec->hi[0] + 64 * (kk + 1), CHUNK);
        tile_load(7, b + 16 * (kk + 1) * 64, 64);
        tile_dpbssd(0, 2, 7);
        tile_dpbssd(1, 3, 7);
    }
    tile_store(0, c[0], 4 * AMX_M);
    tile_store(1, c[1], 4 * AMX_M);
    for (int n = 0; n < AMX_N; n++) isum[n] = wide_add(wide_loadu(c[0][n]), wide_slli32(wide_loadu(c[1][n]), 3));
}

/* The other K-quants: isum[n] = sum_j sc_j * (the exact sum of sub-block j), J = 8 or 16 sub-blocks of
 * S inputs, so P = J / 2 pairs (P even). Pairs alternate between tiles 0, 1 and 2, 3 and between the
 * buffers c[0] and c[1], and a pair's sums are read one pair after they were stored. */
static inline void amx_sub_block_sums(const AmxDecoded *dec, const int8_t *b, int S, int J,
                                      int32_t c[2][2][AMX_N][AMX_M], wide_i isum[AMX_N]) {
#define CODES(q) (dec->s[0] + 2 * (q) * S)
#define ACTS(q) (b + 2 * (q) * S / 4 * 64)
    const int P = J / 2;
    for (int n = 0; n < AMX_N; n++) isum[n] = wide_zero();
    amx_issue_pair(0, 1, CODES(0), ACTS(0), S, 1);
    for (int q = 0; q < P; q += 2) {
        amx_issue_pair(2, 3, CODES(q + 1), ACTS(q + 1), S, 1);
        amx_store_pair(0, 1, c[0], 1);
        if (q > 0) amx_scale_pair(dec, 2 * (q - 1), c[1], isum);
        if (q + 2 < P) amx_issue_pair(0, 1, CODES(q + 2), ACTS(q + 2), S, 1);
        amx_store_pair(2, 3, c[1], 1);
        amx_scale_pair(dec, 2 * q, c[0], isum);
    }
    amx_scale_pair(dec, 2 * (P - 1), c[1], isum);
#undef CODES
#undef ACTS
}

/* One task: outputs n0 .. n0 + 15 of a weight (rows of row_bytes at w, N of them) for all M rows;
 * acc, shift: [AMX_N][mpad] floats of scratch. A row of tile C (one output, 16 activation rows) is
 * one 16-lane vector (isa.h's wide_*), so every integer and float step below runs on 16 rows at
 * once, each lane the scalar sequence of qmatmul.c's header. */
static void amx_task(int type, const TypeInfo *t, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                     int64_t n0, const AmxRows *x, int64_t M, int64_t mpad, AmxDecoded *dec, float *acc, float *shift,
                     float *y, int64_t ldy) {
    const int64_t K4 = K / 4;
    const int kquant = t->block == 256, S = t->sub;
    int32_t c[2][2][AMX_N][AMX_M] __attribute__((aligned(64))); /* two pairs of stored tiles C */
    const uint8_t *p[AMX_N];
    for (int n = 0; n < AMX_N; n++) p[n] = w + (n0 + n < N ? n0 + n : N - 1) * row_bytes;
    memset(acc, 0, sizeof(float) * (size_t)(AMX_N * mpad));
    memset(shift, 0, sizeof(float) * (size_t)(AMX_N * mpad));
    Ahead ahead = task_ahead(w, row_bytes, N, K, n0 / LANES, AMX_N / LANES); /* the next task's rows */
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t count = K - k0 < CHUNK ? K - k0 : CHUNK;
        const int J = (int)(count / S);
        ahead_step(&ahead);
        amx_decode(type, t, p, k0, count, dec);
        for (int64_t m0 = 0; m0 < M; m0 += AMX_M) {
            const int8_t *b = x->xb + (m0 / AMX_M) * K4 * 64 + k0 / 4 * 64;
            const float *rs = x->scales + (k0 / 32) * mpad + m0; /* block j's scales: rs + j * mpad */
            const int32_t *msub = t->offsets ? x->pairs + (k0 / 256) * 4 * mpad + m0 : NULL; /* pair i: + i * mpad */
            if (kquant) {
                wide_i isum[AMX_N];
                if (type == GGUF_Q4_K) amx_q4_k_sums(dec, b, c[0], isum);
                else amx_sub_block_sums(dec, b, S, J, c, isum);
                const wide_f D = wide_load2_ps(rs, rs + 8);
                for (int n = 0; n < AMX_N; n++) { /* the super-block's float steps */
                    float *a = acc + n * mpad + m0;
                    const wide_f scale = wide_mul_ps(D, wide_set1_ps(AMX_HEAD(dec, d, n)));
                    wide_store_ps(a, wide_add_ps(wide_load2_ps(a, a + 8), wide_mul_ps(wide_cvt(isum[n]), scale)));
                    if (!t->offsets) continue;
                    wide_i msum = wide_zero();
                    for (int i = 0; i < 4; i++) msum = wide_dpwssd(msum, wide_set1(AMX_HEAD(dec, pair[i], n)), wide_loadu(msub + i * mpad));
                    float *sh = shift + n * mpad + m0;
                    const wide_f mscale = wide_mul_ps(D, wide_set1_ps(AMX_HEAD(dec, dmin, n)));
                    wide_store_ps(sh, wide_add_ps(wide_load2_ps(sh, sh + 8), wide_mul_ps(wide_cvt(msum), mscale)));
                }
                continue;
            }
            for (int j = 0; j < J; j += 2) { /* 32-blocks: acc = acc + isum_j * (xs_j * d_j), block by block */
                const int two = j + 1 < J;
                amx_issue_pair(0, 1, dec->s[0] + j * S, b + j * S / 4 * 64, S, two);
                amx_store_pair(0, 1, c[0], two);
                const wide_f x0 = wide_load2_ps(rs + j * mpad, rs + j * mpad + 8);
                const wide_f x1 = two ? wide_load2_ps(rs + (j + 1) * mpad, rs + (j + 1) * mpad + 8) : x0;
                for (int n = 0; n < AMX_N; n++) {
                    float *a = acc + n * mpad + m0;
                    wide_f v = wide_load2_ps(a, a + 8);
                    v = wide_add_ps(v, wide_mul_ps(wide_cvt(wide_loadu(c[0][0][n])), wide_mul_ps(x0, wide_set1_ps(dec->ws[n][j]))));
                    if (two) v = wide_add_ps(v, wide_mul_ps(wide_cvt(wide_loadu(c[0][1][n])), wide_mul_ps(x1, wide_set1_ps(dec->ws[n][j + 1]))));
                    wide_store_ps(a, v);
                }
            }
        }
    }
    const int64_t outputs = N - n0 < AMX_N ? N - n0 : AMX_N;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < outputs; n++)
            y[m * ldy + n0 + n] = t->offsets ? acc[n * mpad + m] - shift[n * mpad + m] : acc[n * mpad + m];
}

/* qmm_matmul_parts on the tile path (arguments checked by the caller; every part quantized):
 * the activations repacked once, then every part's tasks of 16 outputs across the threads. */
static int amx_matmul_parts(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
                            const QmmPart *parts, int count, const int64_t *offset, float *y, int64_t ldy, int threads) {
    enum { MAX_PARTS = 8 };
    TypeInfo t[MAX_PARTS];
    int64_t row_bytes[MAX_PARTS], first[MAX_PARTS + 1];
    const int64_t mpad = (M + AMX_M - 1) / AMX_M * AMX_M;
    first[0] = 0;
    for (int p = 0; p < count; p++) {
        if (type_info(parts[p].type, &t[p]) != 0) return -1;
        row_bytes[p] = qmm_row_bytes(parts[p].type, K);
        first[p + 1] = first[p] + (parts[p].n + AMX_N - 1) / AMX_N;
    }
    int with_pairs = 0;
    for (int p = 0; p < count; p++) with_pairs |= t[p].offsets;
    AmxRows x;
    if (amx_rows_make(xq, xs, xsum, M, K, mpad, with_pairs, &x) != 0) return -1;
    const int64_t tasks = first[count];
    const int64_t run = tasks / ((int64_t)threads * 16) > 1 ? tasks / ((int64_t)threads * 16) : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        AmxConfig config;
        memset(&config, 0, sizeof config);
        /* tiles 0-3: 16 rows of 64 bytes (C; Q4_K's A 2, 3 are that shape too) */
        for (int tile = 0; tile < 4; tile++) amx_config_tile(&config, tile, AMX_N, 4 * AMX_M);
        AmxDecoded *dec = aligned_alloc(64, sizeof(AmxDecoded));
        float *acc = malloc(sizeof(float) * (size_t)(2 * AMX_N * mpad));
        if (!dec || !acc) {
#pragma omp atomic write
            failed = 1;
        }
        int loaded_k = 0, p = 0;
#pragma omp for schedule(dynamic, run)
        for (int64_t task = 0; task < tasks; task++) {
            if (!dec || !acc) continue;
            while (first[p + 1] <= task) p++;
            while (first[p] > task) p--;
            const int tile_k = amx_tile_k(parts[p].type, &t[p]);
            if (tile_k != loaded_k) { /* A 4, 5 and B 6, 7 sized for the part's inputs per product */
                for (int tile = 4; tile < 6; tile++) {
                    amx_config_tile(&config, tile, AMX_N, tile_k);
                    amx_config_tile(&config, tile + 2, tile_k / 4, 4 * AMX_M);
                }
                amx_load_config(&config);
                loaded_k = tile_k;
            }
            amx_task(parts[p].type, &t[p], (const uint8_t *)parts[p].weights, row_bytes[p], parts[p].n, K,
                     (task - first[p]) * AMX_N, &x, M, mpad, dec, acc, acc + AMX_N * mpad, y + offset[p], ldy);
        }
        if (loaded_k) amx_release();
        free(dec);
        free(acc);
    }
    amx_rows_free(&x);
    return failed ? -1 : 0;
}
