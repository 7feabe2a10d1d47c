/* The GGUF weight blocks qmatmul.c reads, and their portable reference per weight type: the block
 * sizes (TypeInfo), the exact float16 / bfloat16 reads, and the scalar decoding of a row's blocks into
 * signed codes and float scales (decode_scalar) or a K-quant super-block's integer header
 * (k_header_scalar). The layouts are listed in qmatmul.c's header. Every path's codes are these
 * (the SIMD decoders in qmatmul_avx2.c and the tile path's in qmatmul_amx.c produce the same
 * numbers, biased to unsigned bytes where their products need them); the portable build
 * (qmatmul_portable.c) and qmm_get_rows use these functions as they are. */
#ifndef VERISPEC_QUANTS_H
#define VERISPEC_QUANTS_H
#include <stdint.h>
#include <string.h>
#include "kernels.h"
#include "numerics.h"

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


#endif
