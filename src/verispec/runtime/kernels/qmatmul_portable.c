/* qmatmul.c's loops in portable C (no SIMD: isa.h's VS_AVX2 unset): included by qmatmul.c, never
 * compiled on its own. The reference of every path: each group of 8 outputs decoded with
 * quants.h's decode_scalar, the exact integer sums and the float sequence of qmatmul.c's header
 * computed lane by lane (the SIMD paths do the same operations 8 or 16 lanes at a time), run_task
 * over a task's groups, and the float weights' float_tiles (fmaf lane by lane, the fixed tree). */

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


static void run_task(int type, const TypeInfo *t, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                     int64_t g0, int64_t groups, const int8_t *xq, const float *xs, const float *xo,
                     const int32_t *xsum, int64_t M, Decoded *dec, float *acc, float *shift, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ldsum = K / 16;
    memset(acc, 0, sizeof(float) * (size_t)(groups * M * LANES));
    memset(shift, 0, sizeof(float) * (size_t)(groups * M * LANES));
    (void)xo;
    Ahead ahead = task_ahead(w, row_bytes, N, K, g0, groups);
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t count = K - k0 < CHUNK ? K - k0 : CHUNK;
        const int J = (int)(count / t->sub);
        ahead_step(&ahead);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p[LANES];
            group_rows(w, row_bytes, N, g0 + g, p);
            decode8(type, p, k0, count, dec + g);
        }
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int R = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            for (int64_t g = 0; g < groups; g++) {
                float *a = acc + (g * M + m0) * LANES, *s = shift + (g * M + m0) * LANES;
                consume_portable(dec + g, J, R, t->sub, t->block == 256, t->offsets, xq + m0 * K + k0, K,
                                 xs + m0 * nb + k0 / 32, nb, xsum + m0 * ldsum + k0 / 16, ldsum, a, s);
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
