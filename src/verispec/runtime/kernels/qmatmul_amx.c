/* qmatmul.c's tile path for wide forwards (AMX-INT8, or its emulation: isa.h's VS_AMX): included by
 * qmatmul.c, never compiled on its own. For M >= AMX_ROWS rows of activations and a quantized
 * weight type (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), qmm_matmul and qmm_matmul_parts come here; fewer
 * rows keep the row-wise / fused / buffered paths of qmatmul_avx2.c.
 *
 * The work is split in tasks of 16 outputs (a short last tile repeats its last row); a task walks
 * K in chunks of 256 inputs (one K-quant super-block, or 8 blocks of 32). Each chunk of the 16
 * weight rows is decoded once into unsigned
 * bytes u = code + bias, row-major [16 outputs][256 inputs] (the bias of the AVX2 path: Q4_0 8,
 * Q5_0 16, Q6_K 32, Q8_0 128, Q4_K / Q5_K 0: u is then the stored quant itself, unpacked with AVX2)
 * and used by every row of the forward: per 16 rows of
 * activations and per sub-block j of S inputs (S = 32, Q6_K 16), one 16 x 16 x S tile product
 *   tile 1 (A): the 16 outputs' u over the sub-block: 16 rows of S bytes (stride 256)
 *   tile 2 (B): the activations of 16 rows over the sub-block, in the VNNI layout the instruction
 *               reads (row k: inputs 4k .. 4k + 3 of row 0, then of row 1, ..., of row 15: 64 bytes),
 *               repacked once per call (xb) from the quantized activations xq
 *   tile 0 (C): 16 outputs x 16 rows of exact int32 sums of u * xq, zeroed, then tile_dpbusd(0, 1, 2)
 * (u unsigned and xq signed, as TDPBUSD multiplies them, as the VNNI path does with vpdpbusd). The
 * sums are stored, the bias taken off as an integer (bias * sum(xq), from the activations' sums),
 * and then each (row, output) runs the float sequence of qmatmul.c's header exactly: per 32-block
 * acc = acc + (float)isum * (xs * d); per K-quant super-block isum = sum_j sc_j * sum_j (int32),
 * acc = acc + (float)isum * (D * d), shift = shift + (float)msum * (D * dmin), y = acc - shift. The
 * integers are the AVX2 path's and the float operations the same ones in the same order, so a
 * row's output has the same bits on this path as on every other, for any M and thread count. */

#define AMX_ROWS 16 /* from this M on, quantized products take the tile path */
#define AMX_N 16    /* outputs per task: the rows of tiles A and C */
#define AMX_M 16    /* activation rows per tile product: the int32 columns of tiles B and C */

typedef struct {
    uint8_t u[AMX_N][CHUNK] __attribute__((aligned(64))); /* codes + bias: tile A's rows */
    float ws[AMX_N][MAX_SUBS];                            /* 32-blocks: d of block j */
    int32_t sc[AMX_N][MAX_SUBS], mn[AMX_N][MAX_SUBS];     /* K-quants: the super-block's header */
    float d[AMX_N], dmin[AMX_N];
} AmxDecoded;

/* The bias of a type's unsigned codes (u = code + bias) as a power of two: log2, or -1 for none. */
static int amx_bias_log(int type) {
    switch (type) {
        case GGUF_Q4_0: return 3;
        case GGUF_Q5_0: return 4;
        case GGUF_Q8_0: return 7;
        case GGUF_Q6_K: return 5;
        default: return -1;
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

/* The unsigned codes u = code + bias of inputs k0 .. k0 + count - 1 of one row, into u[0 .. count):
 * for every type u is the stored quant itself (Q4_0 q, Q5_0 q, Q4_K q, Q5_K q, Q6_K q; Q8_0 the
 * int8 code with its top bit flipped), unpacked as quants.h's decode_scalar reads it (AVX2). */
static void amx_unpack(int type, const uint8_t *row, int64_t k0, int64_t count, uint8_t *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
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
                _mm256_storeu_si256((__m256i *)(u + 32 * b), q);
            }
            break;
        }
        case GGUF_Q8_0:
            for (int64_t b = 0; b < count / 32; b++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + (k0 / 32 + b) * 34 + 2));
                _mm256_storeu_si256((__m256i *)(u + 32 * b), _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
            }
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
                _mm256_storeu_si256((__m256i *)(u + 64 * c), lo);
                _mm256_storeu_si256((__m256i *)(u + 64 * c + 32), hi);
            }
            break;
        }
        default: { /* Q6_K */
            const uint8_t *blk = row + (k0 / 256) * 210, *ql = blk, *qh = blk + 128;
            for (int h = 0; h < 2; h++) {
                const __m256i Q = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                for (int s = 0; s < 4; s++) {
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (s & 1)));
                    const __m256i low = s < 2 ? _mm256_and_si256(L, m4) : _mm256_and_si256(_mm256_srli_epi16(L, 4), m4);
                    _mm256_storeu_si256((__m256i *)(u + 128 * h + 32 * s), _mm256_or_si256(low, amx_bits_to_4(Q, 2 * s, 0x30)));
                }
            }
            break;
        }
    }
}

/* Inputs k0 .. k0 + count - 1 of the 16 rows p[0..15], decoded into dec: the codes (amx_unpack),
 * and the scales as quants.h reads them (32-blocks: d per block; K-quants: the integer header). */
static void amx_decode(int type, const TypeInfo *t, const uint8_t *const p[AMX_N], int64_t k0, int64_t count,
                       AmxDecoded *dec) {
    for (int n = 0; n < AMX_N; n++) {
        amx_unpack(type, p[n], k0, count, dec->u[n]);
        if (t->block == 256)
            k_header_scalar(type, p[n] + (k0 / 256) * t->bytes, dec->sc[n], dec->mn[n], 1, &dec->d[n], &dec->dmin[n]);
        else
            for (int64_t j = 0; j < count / 32; j++) dec->ws[n][j] = half_to_float(ld16(p[n] + (k0 / 32 + j) * t->bytes));
    }
}

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

/* The sum of xq over sub-block j (S inputs) of a row, from its sums (xsum at the chunk's start):
 * the block form's sums per 16 (32-blocks), or the super-block form's record (K-quants: int16 pairs,
 * per 16 in 0..7, per 32 in 8..11). */
static inline int32_t amx_xsum(const int32_t *xsum, int kquant, int S, int j) {
    if (!kquant) return xsum[2 * j] + xsum[2 * j + 1];
    const uint32_t pair = (uint32_t)xsum[(S == 16 ? 0 : 8) + j / 2];
    return (int32_t)(int16_t)(j % 2 ? pair >> 16 : pair & 0xFFFFu);
}

/* One task: outputs n0 .. n0 + 15 of a weight (rows of row_bytes at w, N of them) for all M rows;
 * acc, shift: [AMX_N][mpad] floats of scratch, c: the stored tile C. */
static void amx_task(int type, const TypeInfo *t, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                     int64_t n0, const int8_t *xb, const float *xs, const int32_t *xsum, int64_t M, int64_t mpad,
                     AmxDecoded *dec, float *acc, float *shift, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ldsum = K / 16, K4 = K / 4;
    const int kquant = t->block == 256, S = t->sub, bias_log = amx_bias_log(type);
    int32_t c[AMX_N][AMX_M] __attribute__((aligned(64)));
    int32_t isum[AMX_N][AMX_M];
    const uint8_t *p[AMX_N];
    for (int n = 0; n < AMX_N; n++) p[n] = w + (n0 + n < N ? n0 + n : N - 1) * row_bytes;
    memset(acc, 0, sizeof(float) * (size_t)(AMX_N * mpad));
    memset(shift, 0, sizeof(float) * (size_t)(AMX_N * mpad));
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t count = K - k0 < CHUNK ? K - k0 : CHUNK;
        const int J = (int)(count / S);
        amx_decode(type, t, p, k0, count, dec);
        for (int64_t m0 = 0; m0 < M; m0 += AMX_M) {
            const int rows = (int)(M - m0 < AMX_M ? M - m0 : AMX_M);
            const int8_t *b = xb + (m0 / AMX_M) * K4 * 64;
            /* Per row r of the tile (0 for the padding rows past M, whose results are not stored):
             * corr[j] the bias times the row's sum of xq over sub-block j; rs[j] the row's scale of
             * block j (32-blocks), rs[0] its super-block's D (K-quants); msub[j] the row's sum of xq over
             * sub-block j of 32 (K-quants with mins). Loops over r run over all 16 (vectorised). */
            int32_t corr[MAX_SUBS][AMX_M], msub[MAX_SUBS][AMX_M];
            float rs[MAX_SUBS][AMX_M];
            for (int r = 0; r < AMX_M; r++) {
                const int real = r < rows;
                const int64_t m = m0 + r;
                const int32_t *sums = xsum + (real ? m : 0) * ldsum + k0 / 16;
                for (int j = 0; j < J; j++) {
                    corr[j][r] = real && bias_log >= 0 ? amx_xsum(sums, kquant, S, j) << bias_log : 0;
                    msub[j][r] = real && t->offsets ? amx_xsum(sums, 1, 32, j) : 0;
                    rs[j][r] = real && !kquant ? xs[m * nb + k0 / 32 + j] : 0.0f;
                }
                if (kquant) rs[0][r] = real ? xs[m * nb + k0 / 32] : 0.0f;
            }
            for (int j = 0; j < J; j++) {
                tile_zero(0);
                tile_load(1, dec->u[0] + j * S, CHUNK);
                tile_load(2, b + (k0 + (int64_t)j * S) / 4 * 64, 64);
                tile_dpbusd(0, 1, 2);
                tile_store(0, c, 4 * AMX_M);
                for (int n = 0; n < AMX_N; n++) {
                    if (kquant) { /* sc_j * the exact sum, in the integer domain */
                        const int32_t sc = dec->sc[n][j];
                        for (int r = 0; r < AMX_M; r++) isum[n][r] = (j == 0 ? 0 : isum[n][r]) + sc * (c[n][r] - corr[j][r]);
                        continue;
                    }
                    const float ws = dec->ws[n][j];
                    float *a = acc + n * mpad + m0;
                    for (int r = 0; r < AMX_M; r++) {
                        const float scale = rs[j][r] * ws, term = (float)(c[n][r] - corr[j][r]) * scale;
                        a[r] = a[r] + term;
                    }
                }
            }
            if (!kquant) continue;
            for (int n = 0; n < AMX_N; n++) { /* the super-block's float step */
                float *a = acc + n * mpad + m0, *sh = shift + n * mpad + m0;
                for (int r = 0; r < AMX_M; r++) {
                    const float scale = rs[0][r] * dec->d[n], term = (float)isum[n][r] * scale;
                    a[r] = a[r] + term;
                }
                if (!t->offsets) continue;
                int32_t msum[AMX_M];
                for (int r = 0; r < AMX_M; r++) msum[r] = 0;
                for (int j = 0; j < J; j++)
                    for (int r = 0; r < AMX_M; r++) msum[r] += dec->mn[n][j] * msub[j][r];
                for (int r = 0; r < AMX_M; r++) {
                    const float mscale = rs[0][r] * dec->dmin[n], mterm = (float)msum[r] * mscale;
                    sh[r] = sh[r] + mterm;
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
    int8_t *xb = aligned_alloc(64, (size_t)(mpad * K));
    if (!xb) return -1;
    amx_pack_rows(xq, M, K, xb);
    const int64_t tasks = first[count];
    const int64_t run = tasks / ((int64_t)threads * 16) > 1 ? tasks / ((int64_t)threads * 16) : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        AmxConfig config;
        memset(&config, 0, sizeof config);
        amx_config_tile(&config, 0, AMX_N, 4 * AMX_M);
        AmxDecoded *dec = aligned_alloc(64, sizeof(AmxDecoded));
        float *acc = malloc(sizeof(float) * (size_t)(2 * AMX_N * mpad));
        if (!dec || !acc) {
#pragma omp atomic write
            failed = 1;
        }
        int loaded_sub = 0, p = 0;
#pragma omp for schedule(dynamic, run)
        for (int64_t task = 0; task < tasks; task++) {
            if (!dec || !acc) continue;
            while (first[p + 1] <= task) p++;
            while (first[p] > task) p--;
            if (t[p].sub != loaded_sub) { /* tiles A and B sized for the part's sub-blocks */
                amx_config_tile(&config, 1, AMX_N, t[p].sub);
                amx_config_tile(&config, 2, t[p].sub / 4, 4 * AMX_M);
                amx_load_config(&config);
                loaded_sub = t[p].sub;
            }
            amx_task(parts[p].type, &t[p], (const uint8_t *)parts[p].weights, row_bytes[p], parts[p].n, K,
                     (task - first[p]) * AMX_N, xb, xs, xsum, M, mpad, dec, acc, acc + AMX_N * mpad, y + offset[p], ldy);
        }
        if (loaded_sub) amx_release();
        free(dec);
        free(acc);
    }
    free(xb);
    return failed ? -1 : 0;
}
