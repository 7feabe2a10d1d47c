/* qmatmul.c's loops for AVX2 (+ FMA + F16C), and for its VNNI forms (AVX-VNNI, AVX-512 VNNI on
 * 256-bit vectors, or emulated): included by qmatmul.c where isa.h sets VS_AVX2, never compiled on
 * its own. Owns the transposing decoders (8 outputs, one float32 lane each; 16 for a pair of groups in
 * 16-lane builds), the fused, buffered and
 * row-wise integer products, the float sequence of qmatmul.c's header in vector form, run_task (one
 * task's output groups over all of K) and the float weights' float_tiles. VS_VNNI selects vpdpbusd
 * (isa.h's dpbusd256) for the products; the sums, so the bits, are the same either way. */

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
#ifdef VS_VNNI_WIDE
    /* a pair of groups decoded at once (decode_pair_*, in the first group's buffer): wide[s] holds
     * inputs 4s .. 4s + 3 for the 16 lanes of both, as codes[s] of the first then of the second */
    uint8_t wide[MAX_STEPS][64] __attribute__((aligned(64)));
#endif
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

/* The 4 activations at x as one 32-bit value. */
static inline int32_t four_at(const int8_t *x) {
    int32_t four;
    memcpy(&four, x, 4);
    return four;
}

/* The 4 activations at x, in every 32-bit lane. */
static inline __m256i bcast4(const int8_t *x) { return _mm256_set1_epi32(four_at(x)); }

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

/* k_floats for one row whose float accumulators are in memory: acc [8] (and shift [8] with OFFS)
 * advanced in place. */
static inline __attribute__((always_inline)) void k_row(const KScales *k, const int OFFS, const int BIAS_LOG, __m256i isum,
                                                        float D, const int32_t *record, float *acc, float *shift) {
    __m256 a = _mm256_loadu_ps(acc), sh = OFFS ? _mm256_loadu_ps(shift) : _mm256_setzero_ps();
    k_floats(k, OFFS, BIAS_LOG, isum, D, record, &a, &sh);
    _mm256_storeu_ps(acc, a);
    if (OFFS) _mm256_storeu_ps(shift, sh);
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
#ifdef VS_VNNI
    (void)STEPS16;
    for (int r = 0; r < R; r++) out[r] = _mm256_setzero_si256();
    for (int i = 0; i < n; i++)
        for (int r = 0; r < R; r++) out[r] = dpbusd256(out[r], v[i], bcast4(x + r * ldq + 4 * i));
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
#ifdef VS_VNNI
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

/* Row-wise fused path (M <= 3, K-quants): instead of transposing the 8 rows'
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
 * One call runs a group of 8 outputs over all of K (see rows_group). VNNI builds use it too
 * (qmatmul.c's header says what was measured). */
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

#ifdef VS_VNNI_WIDE
/* Q6_K's row-wise path on 16-lane vectors (AVX-512 VNNI builds, and the emulated VNNI build, where a
 * wide vector is two 256-bit halves: isa.h's wide_*), one output row at a time: its super-blocks in
 * order, so that the 8 rows of a group are read as one stream (front to back) instead of 8
 * interleaved ones. Per output n and super-block b: ql's 64 bytes at 64h hold inputs 128h + 0..63
 * in their low nibbles and 128h + 64..127 in their high ones, qh's 32 bytes at 128 + 32h (in both
 * halves) give bits 4-5 (shifted per half); vpmaddubsw with the 64 consecutive activations gives
 * int16 pairs (8 lanes per sub-block of 16), and vpdpwssd by the sub-blocks' int8 scales (as int16
 * pairs, picked per lane by vpermd) adds them into 16 int32 partial sums of sum_j sc_j * (exact sum
 * over sub-block j of u * xq), u = q + 32 the stored 6-bit value. Their total less 32 * sum_j sc_j *
 * (sum of xq over j) (the record's sums per 16) is rows_group's exact int32 isum (integers summed
 * in any order are the same number), kept per (row, super-block, output); then the float steps of
 * k_floats, super-block by super-block with the 8 outputs as lanes, give the same bits. int16
 * bounds as rows_group's (a vpmaddubsw lane <= 2 * 63 * 127). On a Zen 4 (2 threads,
 * `scripts/kernel_ab.py`, weights in huge pages) the products took 0.75-0.84x rows_group's time at
 * 1-3 rows (the 1536 x 8960 down projection, the 151k-row head), and whole forwards of
 * Qwen2.5-Coder-1.5B Q4_K_M at 1, 2 and 3 tokens 0.98x, 0.94x and 0.95x against the kernels before
 * it (which also lacked the attention's reordering and the buffered path's spread prefetch; at 1-3
 * tokens the attention's is the only other change). Read row after row, forwards took 0.98-0.99x
 * the time of reading the 8 outputs' super-block b together.
 * The same forms for Q4_K were slower there than rows_group (1.14x at 1 row read together, 1.3x
 * and more row after row: twice its multiply instructions, whose int16 pairs rows_group adds before
 * widening), so Q4_K and Q5_K keep rows_group. */
#define SEQ_BLOCKS 128 /* super-blocks per row (K <= 32768) the path holds; longer rows take rows_group */

static const int32_t Q6_PICK[4][16] = { /* int32 lane l <- sub-block 4i + l / 4 */
    {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
    {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11}, {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};

static inline __attribute__((always_inline)) void rows_q6_wide(const int R, const uint8_t *const p[LANES], int64_t K,
                                                               const int8_t *xq, int64_t ldq, const float *xs,
                                                               int64_t ldx, const int32_t *xsum, int64_t ldsum,
                                                               Ahead *ahead, __m256 *out) {
    const int64_t blocks = K / 256;
    int32_t isum[ROWWISE_ROWS][SEQ_BLOCKS][LANES] __attribute__((aligned(32)));
    float d[SEQ_BLOCKS][LANES] __attribute__((aligned(32)));
    const wide_i m4 = wide_set1(0x0F0F0F0F), m30 = wide_set1(0x30303030), low16 = wide_set1(0xFFFF);
    for (int n = 0; n < LANES; n++)
        for (int64_t b = 0; b < blocks; b++) {
            ahead_step(ahead);
            const uint8_t *blk = p[n] + b * 210;
            const int8_t *x = xq + 256 * b;
            d[b][n] = _cvtsh_ss(ld16(blk + 208));
            /* the 16 scales as int16 pairs (sc, sc), then per lane of the products */
            const wide_i sc = wide_cvt8_32((const int8_t *)(blk + 192));
            const wide_i pairs = wide_or(wide_and(sc, low16), wide_slli32(sc, 16));
            wide_i scales[4];
            for (int i = 0; i < 4; i++) scales[i] = wide_permute32(pairs, wide_loadu(Q6_PICK[i]));
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            for (int r = 0; r < R; r++) {
                wide_i P = wide_zero();
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const wide_i L = wide_loadu(blk + 64 * h), Q = wide_bcast256(blk + 128 + 32 * h);
                    /* inputs 128h + 0..31 take qh's bits 0-1, 32..63 bits 2-3; 64..95 bits 4-5, 96..127 bits 6-7 */
                    const wide_i low = wide_or(wide_and(L, m4), wide_and(wide_slli16_halves(Q, 4, 2), m30));
                    const wide_i high = wide_or(wide_and(wide_srli16(L, 4), m4), wide_and(wide_srli16_halves(Q, 0, 2), m30));
                    const int8_t *xr = x + r * ldq + 128 * h;
                    P = wide_dpwssd(P, wide_maddubs(low, wide_loadu(xr)), scales[2 * h]);
                    P = wide_dpwssd(P, wide_maddubs(high, wide_loadu(xr + 64)), scales[2 * h + 1]);
                }
                /* the stored values' bias: 32 * sum_j sc_j * (sum of xq over sub-block j of 16) */
                const __m256i bias = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(xsum + r * ldsum + 16 * b)));
                isum[r][b][n] = (int32_t)((uint32_t)wide_sum(P) - ((uint32_t)sum8(bias) << 5));
            }
        }
    for (int r = 0; r < R; r++) { /* k_floats' steps (Q6_K: no mins), super-block by super-block */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256 row = _mm256_set1_ps(xs[r * ldx + 8 * b]);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)isum[r][b])),
                                                   _mm256_mul_ps(row, _mm256_load_ps(d[b]))));
        }
        out[r] = acc;
    }
}
#define ROWS_GROUP(TYPE, R, p, K, ...)                                                                       \
    ((TYPE) == GGUF_Q6_K && (K) <= 256 * SEQ_BLOCKS ? rows_q6_wide(R, p, K, __VA_ARGS__) : rows_group(TYPE, R, p, K, __VA_ARGS__))
#else
#define ROWS_GROUP rows_group
#endif

typedef void (*RowsGroup)(const uint8_t *const[LANES], int64_t, int, const int8_t *, int64_t, const float *, int64_t,
                          const int32_t *, int64_t, Ahead *, __m256 *);
#define ROWS_KERNEL(NAME, TYPE)                                                                                  \
    static __attribute__((noinline)) void rows_##NAME(const uint8_t *const p[LANES], int64_t K, int R, const int8_t *xq, \
                                                      int64_t ldq, const float *xs, int64_t ldx, const int32_t *xsum, \
                                                      int64_t ldsum, Ahead *ahead, __m256 *out) {                  \
        switch (R) {                                                                                             \
            case 1: ROWS_GROUP(TYPE, 1, p, K, xq, ldq, xs, ldx, xsum, ldsum, ahead, out); break;                 \
            case 2: ROWS_GROUP(TYPE, 2, p, K, xq, ldq, xs, ldx, xsum, ldsum, ahead, out); break;                 \
            default: ROWS_GROUP(TYPE, 3, p, K, xq, ldq, xs, ldx, xsum, ldsum, ahead, out); break;                \
        }                                                                                                        \
    }
ROWS_KERNEL(q4_k, GGUF_Q4_K)
ROWS_KERNEL(q5_k, GGUF_Q5_K)
ROWS_KERNEL(q6_k, GGUF_Q6_K)
#undef ROWS_KERNEL

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
static inline __m256i row_step(const int8_t *xq, int64_t ldq, int r, int64_t s) { return bcast4(xq + r * ldq + 4 * s); }

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
#ifdef VS_VNNI
        (void)SIGNED, (void)STEPS16, (void)ones;
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int64_t s = first; s < end; s++) {
            const __m256i w = _mm256_load_si256((const __m256i *)dec->codes[s]);
            for (int r = 0; r < R; r++) sums[r] = dpbusd256(sums[r], w, row_step(xq, ldq, r, s));
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
#ifdef VS_VNNI
        (void)STEPS16;
        __m256i sums[ROW_TILE];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int64_t s = first; s < end; s++) {
            const __m256i w = _mm256_load_si256((const __m256i *)dec->codes[s]);
            for (int r = 0; r < R; r++) sums[r] = dpbusd256(sums[r], w, row_step(xq, ldq, r, s));
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
    for (int r = 0; r < R; r++) k_row(&dec->k, OFFS, BIAS_LOG, isum[r], xs[r * ldx], xsum + r * ldsum, acc + 8 * r, shift + 8 * r);
}

#ifdef VS_VNNI_WIDE
/* Two output groups' decoded chunks (a, b) consumed as one 16-lane tile: per step one 512-bit
 * vpdpbusd per row instead of one 256-bit each (the loads of codes and the broadcasts of the
 * activations, not the products, bound the 8-lane tile: on a Zen 4 a loop of 8 rows x 8 lanes ran at
 * 66% of the vpdpbusd peak, the same loop x 16 lanes at the peak), then each group's float sequence
 * from its own half, exactly as `consume` / `consume_k` run it: every integer sum is the same, so
 * are the bits. acc / shift: group a's [R][8]; group b's `next` floats further. */

/* T[i], lane l = bytes 4i .. 4i + 3 of the 16 bytes at + off of row l of the pair: pa[l] for l < 8, pb[l - 8]
 * after (transpose16 for both groups at once: 128-bit lane q of the loads holds rows 4q + j). */
static inline __attribute__((always_inline)) void transpose_pair(const uint8_t *const pa[LANES], const uint8_t *const pb[LANES],
                                                                 int64_t off, wide_i T[4]) {
    wide_i v[4];
    for (int j = 0; j < 4; j++) v[j] = wide_load4x128(pa[j] + off, pa[4 + j] + off, pb[j] + off, pb[4 + j] + off);
    const wide_i t0 = wide_unpacklo32(v[0], v[1]), t1 = wide_unpackhi32(v[0], v[1]);
    const wide_i t2 = wide_unpacklo32(v[2], v[3]), t3 = wide_unpackhi32(v[2], v[3]);
    T[0] = wide_unpacklo64(t0, t2);
    T[1] = wide_unpackhi64(t0, t2);
    T[2] = wide_unpacklo64(t1, t3);
    T[3] = wide_unpackhi64(t1, t3);
}

/* Q4_K: decode_chunk for the groups of rows pa and pb at once, their codes into a->wide (16 lanes a
 * step: one transposition, one store and, in tile_sums, one load where two groups took two each). */
static __attribute__((noinline)) void decode_pair_q4_k(const uint8_t *const pa[LANES], const uint8_t *const pb[LANES],
                                                       int64_t k0, int64_t count, Decoded *a, Decoded *b) {
    (void)count;
    const int64_t off = (k0 / 256) * 144, qs = off + 16;
    const wide_i m4 = wide_set1(0x0F0F0F0F);
    k4_scales(pa, off, &a->k);
    k4_scales(pb, off, &b->k);
    for (int c = 0; c < 4; c++) {
        wide_i T[8];
        transpose_pair(pa, pb, qs + 32 * c, T);
        transpose_pair(pa, pb, qs + 32 * c + 16, T + 4);
        for (int i = 0; i < 8; i++) {
            wide_store(a->wide[16 * c + i], wide_and(T[i], m4));
            wide_store(a->wide[16 * c + 8 + i], wide_and(wide_srli16(T[i], 4), m4));
        }
    }
}

/* Q6_K: decode_chunk for the groups of rows pa and pb at once (as decode_pair_q4_k). */
static __attribute__((noinline)) void decode_pair_q6_k(const uint8_t *const pa[LANES], const uint8_t *const pb[LANES],
                                                       int64_t k0, int64_t count, Decoded *a, Decoded *b) {
    (void)count;
    const int64_t off = (k0 / 256) * 210;
    const wide_i m4 = wide_set1(0x0F0F0F0F), m30 = wide_set1(0x30303030);
    q6_scales(pa, off, &a->k);
    q6_scales(pb, off, &b->k);
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 2; half++) { /* inputs 128h + 32s + 16 half + 0..15, s = 0..3 */
            wide_i A[4], B[4], Q[4];
            transpose_pair(pa, pb, off + 64 * h + 16 * half, A);
            transpose_pair(pa, pb, off + 64 * h + 32 + 16 * half, B);
            transpose_pair(pa, pb, off + 128 + 32 * h + 16 * half, Q);
            uint8_t(*out)[64] = a->wide + 32 * h + 4 * half;
            for (int i = 0; i < 4; i++) {
                wide_store(out[i], wide_or(wide_and(A[i], m4), wide_and(wide_slli16(Q[i], 4), m30)));
                wide_store(out[8 + i], wide_or(wide_and(B[i], m4), wide_and(wide_slli16(Q[i], 2), m30)));
                wide_store(out[16 + i], wide_or(wide_and(wide_srli16(A[i], 4), m4), wide_and(Q[i], m30)));
                wide_store(out[24 + i], wide_or(wide_and(wide_srli16(B[i], 4), m4), wide_and(wide_srli16(Q[i], 2), m30)));
            }
        }
}

/* sums[r] = the exact int32 sums of steps first .. first + n - 1 of both groups, row r (r < R); WIDE:
 * their codes are in a->wide (decode_pair_*), else in each group's own buffer. */
static inline __attribute__((always_inline)) void tile_sums(const Decoded *a, const Decoded *b, int64_t first,
                                                            const int n, const int R, const int WIDE, const int8_t *xq,
                                                            int64_t ldq, wide_i *sums) {
    for (int r = 0; r < R; r++) sums[r] = wide_zero();
#pragma GCC unroll 8
    for (int i = 0; i < n; i++) {
        const int64_t s = first + i;
        const wide_i w = WIDE ? wide_loadu(a->wide[s]) : wide_load2((const int8_t *)a->codes[s], (const int8_t *)b->codes[s]);
        for (int r = 0; r < R; r++) sums[r] = wide_dpbusd(sums[r], w, wide_set1(four_at(xq + r * ldq + 4 * s)));
    }
}

/* `consume` (32-blocks) for a pair of groups. */
static inline __attribute__((always_inline)) void consume_pair(const Decoded *a, const Decoded *b, int J, const int R,
                                                               const int S, const int BIAS_LOG, const int8_t *xq,
                                                               int64_t ldq, const float *xs, int64_t ldx,
                                                               const int32_t *xsum, int64_t ldsum, float *acc,
                                                               int64_t next) {
    for (int j = 0; j < J; j++) {
        wide_i sums[ROW_TILE];
        tile_sums(a, b, (int64_t)j * (S / 4), S / 4, R, 0, xq, ldq, sums);
        __m256i half[ROW_TILE];
        for (int r = 0; r < R; r++) half[r] = wide_low(sums[r]);
        float_step(a, j, R, S, BIAS_LOG, half, xs, ldx, xsum, ldsum, acc);
        for (int r = 0; r < R; r++) half[r] = wide_high(sums[r]);
        float_step(b, j, R, S, BIAS_LOG, half, xs, ldx, xsum, ldsum, acc + next);
    }
}

/* `consume_k` (a K-quant super-block) for a pair of groups. */
static inline __attribute__((always_inline)) void consume_pair_k(const Decoded *a, const Decoded *b, const int R,
                                                                 const int S, const int OFFS, const int BIAS_LOG, const int WIDE,
                                                                 const int8_t *xq, int64_t ldq, const float *xs,
                                                                 int64_t ldx, const int32_t *xsum, int64_t ldsum,
                                                                 float *acc, float *shift, int64_t next) {
    wide_i isum[ROW_TILE];
    for (int j = 0; j < CHUNK / S; j++) {
        wide_i sums[ROW_TILE];
        tile_sums(a, b, (int64_t)j * (S / 4), S / 4, R, WIDE, xq, ldq, sums);
        const wide_i sc = wide_load2((const int8_t *)a->k.sc[j], (const int8_t *)b->k.sc[j]);
        for (int r = 0; r < R; r++) isum[r] = j ? wide_add(isum[r], wide_mullo(sums[r], sc)) : wide_mullo(sums[r], sc);
    }
    for (int r = 0; r < R; r++) {
        k_row(&a->k, OFFS, BIAS_LOG, wide_low(isum[r]), xs[r * ldx], xsum + r * ldsum, acc + 8 * r, shift + 8 * r);
        k_row(&b->k, OFFS, BIAS_LOG, wide_high(isum[r]), xs[r * ldx], xsum + r * ldsum, acc + next + 8 * r,
              shift + next + 8 * r);
    }
}
#endif

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
#if ROW_TILE == 8 /* the tiles of 4 to 7 rows (ROW_TILE rows: the default case) */
#define CONSUME_WIDE(S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_)                                              \
    case 4: CONSUME(4, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break;                                     \
    case 5: CONSUME(5, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break;                                     \
    case 6: CONSUME(6, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break;                                     \
    case 7: CONSUME(7, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break;
#elif ROW_TILE == 4
#define CONSUME_WIDE(S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_)
#else
#error "consume_* has cases for ROW_TILE 4 or 8"
#endif
#ifdef VS_VNNI_WIDE /* two groups as one 16-lane tile (VNNI builds: ROW_TILE 8) */
#define PAIR(R_, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_)                                                                     \
    (KQ_ ? consume_pair_k(a, b, R_, S_, OFFS_, BIAS_LOG_, WIDE_, xq, ldq, xs, ldx, xsum, ldsum, acc, shift, next)        \
         : consume_pair(a, b, J, R_, S_, BIAS_LOG_, xq, ldq, xs, ldx, xsum, ldsum, acc, next))
#define PAIR_KERNEL(NAME, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_)                                                      \
    static __attribute__((noinline)) void pair_##NAME(const Decoded *a, const Decoded *b, int J, int R,          \
                                                      const int8_t *xq, int64_t ldq, const float *xs,             \
                                                      int64_t ldx, const int32_t *xsum, int64_t ldsum, float *acc, \
                                                      float *shift, int64_t next) {                               \
        (void)J, (void)shift;                                                                                    \
        switch (R) {                                                                                             \
            case 1: PAIR(1, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            case 2: PAIR(2, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            case 3: PAIR(3, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            case 4: PAIR(4, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            case 5: PAIR(5, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            case 6: PAIR(6, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            case 7: PAIR(7, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                   \
            default: PAIR(8, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_); break;                                                  \
        }                                                                                                        \
    }
#else
#define PAIR_KERNEL(NAME, S_, KQ_, OFFS_, BIAS_LOG_, WIDE_)
#endif
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
            CONSUME_WIDE(S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_)                                          \
            default: CONSUME(ROW_TILE, S_, SIGNED_, STEPS16_, KQ_, OFFS_, BIAS_LOG_); break; \
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
    }                                                                                                            \
    PAIR_KERNEL(NAME, S_, KQ_, OFFS_, BIAS_LOG_, TYPE == GGUF_Q4_K || TYPE == GGUF_Q6_K)
/* int16 steps: codes 0..15 -> 8 (8 * 2 * 15 * 127 = 30480), 0..31 -> 4 (31496), 0..63 -> 2 (32004).
 * (GCC cannot see that decode_chunk sets f.isum[j] for every j < J that fused_floats reads.) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
TYPE_KERNELS(q4_0, GGUF_Q4_0, 32, 0, 8, 0, 0, 3)
TYPE_KERNELS(q5_0, GGUF_Q5_0, 32, 0, 4, 0, 0, 4)
#ifdef VS_VNNI
TYPE_KERNELS(q8_0, GGUF_Q8_0, 32, 0, 1, 0, 0, 7) /* codes + 128, unsigned */
#else
TYPE_KERNELS(q8_0, GGUF_Q8_0, 32, 1, 1, 0, 0, -1)
#endif
TYPE_KERNELS(q4_k, GGUF_Q4_K, 32, 0, 8, 1, 1, -1)
TYPE_KERNELS(q5_k, GGUF_Q5_K, 32, 0, 4, 1, 1, -1)
TYPE_KERNELS(q6_k, GGUF_Q6_K, 16, 0, 2, 1, 0, 5)
#pragma GCC diagnostic pop
#undef TYPE_KERNELS
#undef PAIR_KERNEL
#undef PAIR
#undef CONSUME_WIDE
#undef CONSUME

#ifdef VS_VNNI_WIDE
typedef void (*PairConsumer)(const Decoded *, const Decoded *, int, int, const int8_t *, int64_t, const float *, int64_t,
                             const int32_t *, int64_t, float *, float *, int64_t);
typedef void (*PairDecoder)(const uint8_t *const[LANES], const uint8_t *const[LANES], int64_t, int64_t, Decoded *, Decoded *);
#define PAIR_OF(NAME, DECODE) , pair_##NAME, DECODE
#else
#define PAIR_OF(NAME, DECODE)
#endif

typedef struct {
    Decoder decode;
    Consumer consume;
    FusedRows fused;
#ifdef VS_VNNI_WIDE
    PairConsumer pair; /* two groups as one 16-lane tile */
    PairDecoder decode_pair; /* two groups decoded at once for `pair` (NULL: each by `decode`) */
#endif
} Ops;

static Ops ops_of(int type) {
    switch (type) {
        case GGUF_Q4_0: return (Ops){decode_q4_0, consume_q4_0, fused_q4_0 PAIR_OF(q4_0, NULL)};
        case GGUF_Q5_0: return (Ops){decode_q5_0, consume_q5_0, fused_q5_0 PAIR_OF(q5_0, NULL)};
        case GGUF_Q8_0: return (Ops){decode_q8_0, consume_q8_0, fused_q8_0 PAIR_OF(q8_0, NULL)};
        case GGUF_Q4_K: return (Ops){decode_q4_k, consume_q4_k, fused_q4_k PAIR_OF(q4_k, decode_pair_q4_k)};
        case GGUF_Q5_K: return (Ops){decode_q5_k, consume_q5_k, fused_q5_k PAIR_OF(q5_k, NULL)};
        default: return (Ops){decode_q6_k, consume_q6_k, fused_q6_k PAIR_OF(q6_k, decode_pair_q6_k)};
    }
}
#undef PAIR_OF

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



static void run_task(int type, const TypeInfo *t, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                     int64_t g0, int64_t groups, const int8_t *xq, const float *xs, const float *xo,
                     const int32_t *xsum, int64_t M, Decoded *dec, float *acc, float *shift, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ldsum = K / 16;
    memset(acc, 0, sizeof(float) * (size_t)(groups * M * LANES));
    memset(shift, 0, sizeof(float) * (size_t)(groups * M * LANES));
    const Ops ops = ops_of(type);
    const int fused = M <= FUSED_ROWS;
    Ahead ahead = task_ahead(w, row_bytes, N, K, g0, groups);
    const RowsGroup rows = type == GGUF_Q4_K ? rows_q4_k : type == GGUF_Q5_K ? rows_q5_k : type == GGUF_Q6_K ? rows_q6_k : NULL;
    if (M <= ROWWISE_ROWS && rows) { /* the whole of K per call, accumulators in registers */
        /* prefetched in 8 parts per super-block, spread between the sums: a burst of a whole slice at
         * once was measured slower (fewer misses in flight where they are needed) */
        Ahead parts = {ahead.next, ahead.end, ((ahead.slice + 7) / 8 + 63) & ~(int64_t)63};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p[LANES];
            group_rows(w, row_bytes, N, g0 + g, p);
            const int64_t n0 = (g0 + g) * LANES, count = N - n0 < LANES ? N - n0 : LANES;
            __m256 out[ROWWISE_ROWS];
            rows(p, K, (int)M, xq, K, xs, nb, xsum, ldsum, &parts, out);
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
    /* the next task's slice of each chunk prefetched in groups + 2 parts: before the chunk, before
     * each group's decoding and before the tiles. At once, the prefetches stalled on the misses in
     * flight (perf: 10% of a 8-token forward at the prefetch); spread, forwards of 4 and 8 tokens of
     * Qwen2.5-Coder-1.5B took 0.97-0.98x the time on a Zen 4 (`scripts/kernel_ab.py forward`). */
    Ahead spread = {ahead.next, ahead.end, ((ahead.slice + groups + 1) / (groups + 2) + 63) & ~(int64_t)63};
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t count = K - k0 < CHUNK ? K - k0 : CHUNK;
        const int J = (int)(count / t->sub);
        ahead_step(&spread);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p[LANES];
            ahead_step(&spread);
            group_rows(w, row_bytes, N, g0 + g, p);
            if (fused) { /* decode and multiply at once, 2 rows at a time */
                for (int64_t m0 = 0; m0 < M; m0 += FUSED_TILE)
                    ops.fused(p, k0, count, (int)(M - m0 < FUSED_TILE ? M - m0 : FUSED_TILE), dec + g, xq + m0 * K + k0, K,
                              xs + m0 * nb + k0 / 32, xo + m0 * nb + k0 / 32, nb, xsum + m0 * ldsum + k0 / 16, ldsum,
                              acc + (g * M + m0) * LANES, shift + (g * M + m0) * LANES);
                continue;
            }
#ifdef VS_VNNI_WIDE
            if (ops.decode_pair && g + 1 < groups) { /* the pair `ops.pair` consumes below */
                const uint8_t *q[LANES];
                ahead_step(&spread);
                group_rows(w, row_bytes, N, g0 + g + 1, q);
                ops.decode_pair(p, q, k0, count, dec + g, dec + g + 1);
                g++;
                continue;
            }
#endif
            ops.decode(p, k0, count, dec + g);
        }
        ahead_step(&spread);
        if (fused) continue;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int R = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            int64_t g = 0;
#ifdef VS_VNNI_WIDE
            for (; g + 1 < groups; g += 2)
                ops.pair(dec + g, dec + g + 1, J, R, xq + m0 * K + k0, K, xs + m0 * nb + k0 / 32, nb,
                         xsum + m0 * ldsum + k0 / 16, ldsum, acc + (g * M + m0) * LANES, shift + (g * M + m0) * LANES,
                         M * LANES);
#endif
            for (; g < groups; g++) {
                float *a = acc + (g * M + m0) * LANES, *s = shift + (g * M + m0) * LANES;
                ops.consume(dec + g, J, R, xq + m0 * K + k0, K, xs + m0 * nb + k0 / 32, xo + m0 * nb + k0 / 32,
                            nb, xsum + m0 * ldsum + k0 / 16, ldsum, a, s);
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
