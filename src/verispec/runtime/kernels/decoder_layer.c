/* One decoder layer of the Llama family (Llama, Qwen2, Gemma 3 text) for a chunk of n tokens
 * (a contiguous continuation, or a tree of drafts in scratch slots), in one call, on weights in
 * int8 block form (blockmm.c).
 *
 * The same math as fastpath.FastDecoder._layer, written out in C so that a step does not pay
 * ~35 small PyTorch operators per layer (about a third of a one-token step, measured with scripts/profile_step.py):
 *
 *   h = norm_in(x); q, k, v = split(h Wqkv^T + b); q, k = norm_q(q), norm_k(k) per head;
 *   q, k = rotary(q, k; cos, sin); cache[start..start+n) (or the given slots) = k, v;
 *   a = softmax(scale q K^T, causal and window mask, or the given mask) V per head (query head h reads key/value
 *   head h / (heads / kv_heads)); a = a Wo^T + b; a = norm_post_attn(a) (Gemma);
 *   x = x + a; h = norm_pre_mlp(x); g, u = split(h Wgu^T); m = (act(g) * u) Wdown^T;
 *   m = norm_post_mlp(m) (Gemma); x = x + m.
 *
 * Norms are y = (x * 1/sqrt(mean(x^2) + eps)) * w (the caller passes w, or 1 + w for Gemma, as
 * fastpath.FusedNorm verified against the model's module); the cos/sin tables come from the
 * model's own rotary module. Sums of squares and softmax denominators are accumulated in double;
 * everything else is float32, so results differ from PyTorch's only in the rounding of sums and of
 * the transcendental functions. Built with -ffp-contract=off like blockmm.c.
 *
 * Batch invariance: every step works row by row (norms, rotary, activation) or, in the
 * attention, on chunks of keys at fixed boundaries (see attention()), and with the layer's
 * numerics int8 the linears are blockmm_int8.c's, so a token's output does not depend on how
 * many tokens share the call, on the thread count, nor on whether it sits in a tree of drafts
 * (a tree row computes what its position computes in a contiguous chunk over the same keys).
 * The portable build (no AVX2/FMA) performs the vector paths' operations lane by lane (fmaf for
 * the FMA chains, exp1 for exp8), so it gives the same bits as the AVX2 build. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "isa.h"

enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };
enum { ACT_GELU_TANH = 0, ACT_SILU = 1 };
/* the linears: blockmm_int8.c or blockmm.c on int8 block forms, or qmatmul.c on a GGUF file's blocks */
enum { NUMERICS_INT8 = 0, NUMERICS_FP32 = 1, NUMERICS_GGUF = 2 };

typedef struct {
    const int8_t *codes;
    const void *scales; /* float32, or float16 where half_scales */
    const float *offsets, *bias; /* offsets and bias may be NULL */
    int64_t out, in, block;
    int code_bias, code_span, half_scales; /* the packed form (blockmm_int8.c; int8 numerics only) */
} BlockLinear;

typedef struct {
    const float *weight; /* NULL: no such norm */
    float eps;
} Norm;

/* One matrix as a GGUF file stores it (qmatmul.c reads its blocks): `out` rows of the layer's
 * input width, ggml type `type`; data NULL: no such part. */
typedef struct {
    const void *data;
    int type;
    int64_t out;
    const float *bias; /* may be NULL */
} GgufPart;

typedef struct {
    GgufPart part[3]; /* outputs concatenated in order: q | k | v, gate | up, or one matrix */
} GgufLinear;

typedef struct {
    BlockLinear linear[4];
    Norm input, q, k, post_attention, pre_mlp, post_mlp;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    int64_t window; /* 0: full attention */
    float scaling;
    int act;
    int numerics; /* NUMERICS_INT8, NUMERICS_FP32 (`linear`) or NUMERICS_GGUF (`gguf`) */
    GgufLinear gguf[4];
    int rope_interleaved; /* rotate adjacent pairs (a GGUF Llama's permuted q/k), not halves */
} Layer;

/* Activations quantized in one of qmatmul.c's forms (block: per 32 inputs; super: per 256, the
 * K-quants'), in one allocation: xq [n, in], xs and xo [n, in / 32], xsum [n, in / 16]. */
typedef struct {
    int8_t *xq;
    float *xs, *xo;
    int32_t *xsum;
} Quantized;

static int quantize_form(const float *x, int64_t n, int64_t in, int super, Quantized *q, int threads) {
    const int64_t blocks = n * (in / 32);
    char *memory = malloc((size_t)(n * in) + sizeof(float) * (size_t)(2 * blocks) + sizeof(int32_t) * (size_t)(2 * blocks));
    if (!memory) return -1;
    q->xs = (float *)(void *)memory;
    q->xo = q->xs + blocks;
    q->xsum = (int32_t *)(void *)(q->xo + blocks);
    q->xq = (int8_t *)(q->xsum + 2 * blocks);
    const int status = super ? qmm_quantize_super(x, n, in, q->xq, q->xs, q->xo, q->xsum, threads)
                             : qmm_quantize(x, n, in, q->xq, q->xs, q->xo, q->xsum, threads);
    if (status != 0) {
        free(memory);
        q->xs = NULL;
        return -1;
    }
    return 0;
}

static int is_float_type(int type) { return type == GGUF_F32 || type == GGUF_F16 || type == GGUF_BF16; }
static int is_k_quant(int type) { return type == GGUF_Q4_K || type == GGUF_Q5_K || type == GGUF_Q6_K; }

/* y [n, width] = x [n, in] times the parts' matrices, side by side; x is quantized once per form the
 * parts read (qmatmul.c's numerics: a row's result depends on that row alone). */
static int gguf_linear(const GgufLinear *l, const float *x, int64_t n, int64_t in, float *y, int threads) {
    int64_t width = 0;
    int blocks = 0, supers = 0, floats = 0, count = 0;
    for (; count < 3 && l->part[count].data; count++) {
        const int type = l->part[count].type;
        width += l->part[count].out;
        floats |= is_float_type(type);
        supers |= is_k_quant(type);
        blocks |= !is_float_type(type) && !is_k_quant(type);
    }
    Quantized block = {0}, super = {0};
    int status = 0;
    if (blocks) status |= quantize_form(x, n, in, 0, &block, threads);
    if (supers && status == 0) status |= quantize_form(x, n, in, 1, &super, threads);
    if (status == 0 && !floats && blocks + supers == 1) { /* one call (one parallel region) for every part */
        const Quantized *q = supers ? &super : &block;
        QmmPart parts[3];
        for (int p = 0; p < count; p++) parts[p] = (QmmPart){l->part[p].data, l->part[p].type, l->part[p].out};
        status = qmm_matmul_parts(q->xq, q->xs, q->xo, q->xsum, n, in, parts, count, y, width, threads);
    } else if (status == 0) {
        int64_t offset = 0;
        for (int p = 0; p < count && status == 0; p++) {
            const GgufPart *part = &l->part[p];
            const Quantized *q = is_k_quant(part->type) ? &super : &block; /* float types read x itself */
            status = qmm_matmul(x, q->xq, q->xs, q->xo, q->xsum, n, in, part->data, part->type, part->out, y + offset,
                                width, threads);
            offset += part->out;
        }
    }
    int64_t offset = 0;
    for (int p = 0; p < count; p++) {
        const GgufPart *part = &l->part[p];
        if (part->bias)
            for (int64_t r = 0; r < n; r++)
                for (int64_t j = 0; j < part->out; j++) y[r * width + offset + j] += part->bias[j];
        offset += part->out;
    }
    free(block.xs), free(super.xs);
    return status ? -1 : 0;
}

/* Linear `which` of layer L (QKV, O, GATE_UP, DOWN): x [n, in] -> y [n, out]. */
static int linear(const Layer *L, int which, const float *x, int64_t n, int64_t in, float *y, int threads) {
    if (L->numerics == NUMERICS_GGUF) return gguf_linear(&L->gguf[which], x, n, in, y, threads);
    const BlockLinear *l = &L->linear[which];
    const int status = L->numerics == NUMERICS_INT8
        ? blockmm_int8(x, n, l->in, l->codes, l->scales, l->offsets, l->out, l->block, l->code_bias, l->code_span,
                       l->half_scales, y, threads)
        : blockmm(x, n, l->in, l->codes, (const float *)l->scales, l->offsets, l->out, l->block, y, threads);
    if (status != 0) return -1;
    if (l->bias)
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = 0; j < l->out; j++) y[r * l->out + j] += l->bias[j];
    return 0;
}

/* rows [rows, size] with row stride `stride`, normalised in place (or into out). */
static void rms_norm(const Norm *norm, const float *x, float *out, int64_t rows, int64_t size, int64_t stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *yr = out + r * stride;
        double squares = 0.0;
        for (int64_t i = 0; i < size; i++) squares += (double)xr[i] * xr[i];
        const float mean = (float)(squares / (double)size);
        const float inverse = 1.0f / sqrtf(mean + norm->eps);
        for (int64_t i = 0; i < size; i++) yr[i] = (xr[i] * inverse) * norm->weight[i];
    }
}

static float dot(const float *a, const float *b, int64_t size) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef VS_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (; i + 16 <= size; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(s0, s1));
    for (int j = 0; j < 8; j++) total += lanes[j];
#else
    float s0[8] = {0}, s1[8] = {0};
    for (; i + 16 <= size; i += 16)
        for (int j = 0; j < 8; j++) {
            s0[j] = fmaf(a[i + j], b[i + j], s0[j]);
            s1[j] = fmaf(a[i + 8 + j], b[i + 8 + j], s1[j]);
        }
    for (int j = 0; j < 8; j++) total += s0[j] + s1[j];
#endif
    for (; i < size; i++) total += a[i] * b[i];
    return total;
}

/* s_g[j] = q_g . keys[j * d ..] for j < count and each of `heads` query heads (q_g = q + g * d,
 * s_g = s + g * stride). Eight keys at a time (eight FMA chains, q_g loaded once per eight keys,
 * one horizontal reduction per eight scores), all heads scored on each group of eight keys before
 * the next: a query head sharing its key/value head with the others (grouped-query attention)
 * then finds those keys in L1 instead of reading them again (each head's arithmetic unchanged). */
static void scores_of(const float *q, int64_t heads, const float *keys, int64_t count, int64_t d, float *s,
                      int64_t stride) {
    int64_t j = 0;
#ifdef VS_AVX2
    if (d % 8 == 0) {
        for (; j + 8 <= count; j += 8) {
            const float *k = keys + j * d;
            for (int64_t g = 0; g < heads; g++) {
                const float *qg = q + g * d;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int64_t i = 0; i < d; i += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + i);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), qv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + d + i), qv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 2 * d + i), qv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 3 * d + i), qv, a3);
                    a4 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 4 * d + i), qv, a4);
                    a5 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 5 * d + i), qv, a5);
                    a6 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 6 * d + i), qv, a6);
                    a7 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 7 * d + i), qv, a7);
                }
                const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* per 128-bit half */
                const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
                _mm256_storeu_ps(s + g * stride + j,
                                 _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31)));
            }
        }
    }
#else
    if (d % 8 == 0) { /* the vector path's operations, lane by lane */
        for (; j + 8 <= count; j += 8)
            for (int64_t g = 0; g < heads; g++)
                for (int64_t t = 0; t < 8; t++) {
                    const float *k = keys + (j + t) * d, *qg = q + g * d;
                    float a[8] = {0};
                    for (int64_t i = 0; i < d; i += 8)
                        for (int l = 0; l < 8; l++) a[l] = fmaf(k[i + l], qg[i + l], a[l]);
                    s[g * stride + j + t] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
                }
    }
#endif
    for (; j < count; j++)
        for (int64_t g = 0; g < heads; g++) s[g * stride + j] = dot(q + g * d, keys + j * d, d);
}

#ifdef VS_AVX2
/* weighted_sum's vector part for HS (1..4) heads: outputs 0 .. fused - 1 of each, sixteen at a time,
 * one FMA chain per output over j in order. */
static inline __attribute__((always_inline)) void weighted_columns(const float *const pg[4], const int HS,
                                                                   const float *values, int64_t count, int64_t d,
                                                                   int64_t fused, float *const og[4]) {
    for (int64_t c = 0; c < fused; c += 16) {
        __m256 a[4][2];
        for (int h = 0; h < HS; h++) a[h][0] = a[h][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++) {
            const __m256 v0 = _mm256_loadu_ps(values + j * d + c), v1 = _mm256_loadu_ps(values + j * d + c + 8);
            for (int h = 0; h < HS; h++) {
                const __m256 pj = _mm256_set1_ps(pg[h][j]);
                a[h][0] = _mm256_fmadd_ps(pj, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(pj, v1, a[h][1]);
            }
        }
        for (int h = 0; h < HS; h++) {
            _mm256_storeu_ps(og[h] + c, a[h][0]);
            _mm256_storeu_ps(og[h] + c + 8, a[h][1]);
        }
    }
}
#endif

/* out_g[i] = sum_j p_g[j] * values[j * d + i] for i < d, j < count and each of `heads` heads
 * (p_g = p + g * p_stride, out_g = out + g * out_stride): one FMA chain per output over j in order, in
 * the first d / 64 * 64 outputs, and a plain multiply-add after them. Sixteen outputs of up to
 * four heads at a time in registers, so that each row of values is read once for the heads that
 * share it instead of once per head. */
static void weighted_sum(const float *p, int64_t p_stride, int64_t heads, const float *values, int64_t count,
                         int64_t d, float *out, int64_t out_stride) {
    const int64_t fused = d / 64 * 64; /* outputs computed with FMA (what is left of d: multiply-add) */
    (void)fused; /* unused without the vector path */
    for (int64_t g0 = 0; g0 < heads; g0 += 4) {
        const int64_t hs = heads - g0 < 4 ? heads - g0 : 4;
        const float *pg[4];
        float *og[4];
        for (int64_t h = 0; h < hs; h++) pg[h] = p + (g0 + h) * p_stride, og[h] = out + (g0 + h) * out_stride;
        int64_t c = 0;
#ifdef VS_AVX2
        switch (hs) { /* the head count a constant, so that the accumulators stay in registers */
            case 1: weighted_columns(pg, 1, values, count, d, fused, og); break;
            case 2: weighted_columns(pg, 2, values, count, d, fused, og); break;
            case 3: weighted_columns(pg, 3, values, count, d, fused, og); break;
            default: weighted_columns(pg, 4, values, count, d, fused, og); break;
        }
        c = fused;
#else
        for (; c < fused; c++)
            for (int64_t h = 0; h < hs; h++) {
                float a = 0.0f;
                for (int64_t j = 0; j < count; j++) a = fmaf(pg[h][j], values[j * d + c], a);
                og[h][c] = a;
            }
#endif
        for (int64_t h = 0; h < hs; h++) {
            for (int64_t i = c; i < d; i++) og[h][i] = 0.0f;
            for (int64_t j = 0; j < count; j++)
                for (int64_t i = c; i < d; i++) og[h][i] += pg[h][j] * values[j * d + i];
        }
    }
}

/* Rotary embedding of one head vector v [d] with cos/sin [d]: v * cos + rotate_half(v) * sin,
 * rotate_half(v) = (-v[d/2:], v[:d/2]) -- transformers' apply_rotary_pos_emb. `interleaved`: the
 * pairs are adjacent, (v[2i], v[2i+1]) turned by angle i (llama.cpp's "normal" rope, which a GGUF
 * Llama's q/k rows are permuted for); the tables' first half holds angle i's cos and sin. */
static void rotate(float *v, const float *cos_row, const float *sin_row, int64_t d, int interleaved) {
    const int64_t half = d / 2;
    if (interleaved) {
        for (int64_t i = 0; i < half; i++) {
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * cos_row[i] + (-b) * sin_row[i];
            v[2 * i + 1] = b * cos_row[i] + a * sin_row[i];
        }
        return;
    }
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_row[i] + (-b) * sin_row[i];
        v[i + half] = b * cos_row[i + half] + a * sin_row[i + half];
    }
}

#ifdef VS_AVX2
/* e^x for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial,
 * scaling by 2^n through the exponent bits); relative error about 1e-7, like expf. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

/* exp8 lane by lane: the same float32 operations in the same order. */
static inline float exp1(float x) {
    x = x > -87.3f ? x : -87.3f;
    x = x < 88.3f ? x : 88.3f;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    const float z = x * x;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = (y * z + x) + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return y * scale.f;
}

/* p[i] = act(g[i]) * u[i] for i < size. Both activations are g * sigmoid(z): SiLU with z = g;
 * gelu-tanh, 0.5 g (1 + tanh(c)) with c = sqrt(2/pi) (g + 0.044715 g^3), with z = 2c (the same
 * function: 1 + tanh(c) = 2 / (1 + e^(-2c)), written without the cancellation near tanh = -1). */
static void activation_product(int act, const float *g, const float *u, float *p, int64_t size) {
    int64_t i = 0;
#ifdef VS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), c0 = _mm256_set1_ps(2.0f * 0.7978845608028654f);
    const __m256 c1 = _mm256_set1_ps(0.044715f), minus = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= size; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 z = x;
        if (act == ACT_GELU_TANH)
            z = _mm256_mul_ps(c0, _mm256_add_ps(x, _mm256_mul_ps(c1, _mm256_mul_ps(_mm256_mul_ps(x, x), x))));
        const __m256 e = exp8(_mm256_xor_ps(z, minus)); /* e^(-z) */
        const __m256 a = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(p + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
    }
#else
    for (; i < size / 8 * 8; i++) { /* the vector path's operations (exp1: exp8's) where it would run */
        const float x = g[i];
        const float z = act == ACT_GELU_TANH ? (2.0f * 0.7978845608028654f) * (x + 0.044715f * ((x * x) * x)) : x;
        p[i] = x / (1.0f + exp1(-z)) * u[i];
    }
#endif
    for (; i < size; i++) {
        const float x = g[i];
        const float z = act == ACT_GELU_TANH ? 2.0f * 0.7978845608028654f * (x + 0.044715f * (x * x * x)) : x;
        p[i] = x / (1.0f + expf(-z)) * u[i];
    }
}

/* row[j] = e^(row[j] - best) for j < size. */
static void exp_shifted(float *row, int64_t size, float best) {
    int64_t j = 0;
#ifdef VS_AVX2
    const __m256 shift = _mm256_set1_ps(best);
    for (; j + 8 <= size; j += 8) _mm256_storeu_ps(row + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift)));
#else
    for (; j < size / 8 * 8; j++) row[j] = exp1(row[j] - best); /* exp8's operations, where the vector path would run */
#endif
    for (; j < size; j++) row[j] = expf(row[j] - best);
}

/* totals[g] = the sum of rows + g * stride [0 .. size), accumulated in double in j order, for the
 * heads g < heads with live[g]: the heads' additions interleaved (each sum one dependent chain). */
static void row_sums(const float *rows, int64_t stride, int64_t heads, const int *live, int64_t size, double *totals) {
    for (int64_t g = 0; g < heads; g++) totals[g] = 0.0;
    for (int64_t j = 0; j < size; j++)
        for (int64_t g = 0; g < heads; g++)
            if (live[g]) totals[g] += rows[g * stride + j];
}

/* Where each row of a call sits, and where its keys are: rows of one sequence or of several
 * (a batch), each a continuation (contiguous positions) or a node of a tree of drafts.
 *
 * KV memory is paged: each layer's keys (and values) are one pool [kv_heads, pool_blocks * BLOCK,
 * head_dim] of blocks of BLOCK positions, and a sequence's block table maps its logical blocks to
 * the pool's (a contiguous cache is the table 0, 1, 2, ...). Logical slot l of a sequence is
 * physical slot table[l / BLOCK] * BLOCK + l % BLOCK of the pool.
 *
 * Row r is at position positions[r] and writes its key and value to logical slot slots[r] of its
 * sequence (sequences[r]: its table is tables + sequences[r] * table_width). It sees the positions
 * of its run, window_low..positions[r] (causal, cut to the layer's window): a position p below
 * bases[r] is at logical slot p; positions bases[r]..positions[r] are at paths[path_starts[r] ..
 * path_starts[r + 1]) (a tree row's ancestors, then itself, in scratch slots), the last of which
 * is slots[r]. A contiguous row has no path (bases[r] > positions[r], slots[r] = positions[r]). So
 * a row sees exactly the keys of the same position in a contiguous chunk, wherever they are. */
#define BLOCK 64 /* positions per block of KV memory: also the attention's fixed chunk of keys */
typedef struct {
    const int64_t *positions, *slots, *bases, *path_starts, *paths, *sequences;
    const int64_t *tables;
    int64_t table_width, pool_blocks;
} Rows;

/* The physical slot (in the pool) of row r's logical slot `logical`. */
static inline int64_t physical_slot(const Rows *rows, int64_t r, int64_t logical) {
    const int64_t *table = rows->tables + rows->sequences[r] * rows->table_width;
    return table[logical / BLOCK] * BLOCK + logical % BLOCK;
}

/* The logical slot holding position p for row r (p within its run). */
static inline int64_t logical_slot(const Rows *rows, int64_t r, int64_t p) {
    return p < rows->bases[r] ? p : rows->paths[rows->path_starts[r] + p - rows->bases[r]];
}

/* 0 if every row's description is usable (paths of the right length ending at the row's own slot,
 * logical slots inside the sequence's table, table entries inside the pool), else -1. */
static int check_rows(const Rows *rows, int64_t n, int64_t sequence_count) {
    if (rows->table_width < 1 || rows->pool_blocks < 1 || sequence_count < 1) return -1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t position = rows->positions[r], base = rows->bases[r];
        const int64_t length = rows->path_starts[r + 1] - rows->path_starts[r];
        if (position < 0 || base < 0 || rows->sequences[r] < 0 || rows->sequences[r] >= sequence_count) return -1;
        if (length != (base <= position ? position - base + 1 : 0)) return -1;
        if (length ? rows->paths[rows->path_starts[r + 1] - 1] != rows->slots[r] : rows->slots[r] != position) return -1;
        const int64_t *table = rows->tables + rows->sequences[r] * rows->table_width;
        const int64_t last = base <= position ? base - 1 : position; /* highest position at its own slot */
        for (int64_t b = 0; b <= last / BLOCK && last >= 0; b++)
            if (b >= rows->table_width || table[b] < 0 || table[b] >= rows->pool_blocks) return -1;
        for (int64_t i = 0; i < length; i++) {
            const int64_t slot = rows->paths[rows->path_starts[r] + i];
            if (slot < 0 || slot / BLOCK >= rows->table_width || table[slot / BLOCK] < 0 ||
                table[slot / BLOCK] >= rows->pool_blocks) return -1;
        }
    }
    return 0;
}

/* The first position row r attends to in layer L (its window's start). */
static inline int64_t window_low(const Layer *L, const Rows *rows, int64_t r) {
    const int64_t position = rows->positions[r];
    return L->window > 0 && position - L->window + 1 > 0 ? position - L->window + 1 : 0;
}

/* Rows whose tasks on the same chunk of keys run one after the other (task_order). */
#define SHARING_ROWS 16

/* order[2i], order[2i + 1]: the i-th task to run and its row. Tiles of SHARING_ROWS consecutive rows
 * (a prefill chunk's, a verify's) see mostly the same chunks of keys: per tile and key/value head,
 * the chunks in position order and, per chunk, the tile's rows that see it, so that a chunk's keys
 * and values (BLOCK * head_dim floats each) are read from memory once for the tile and then from
 * the core's cache, instead of once per row. Only the order changes: every task computes what it
 * computed alone. */
static void task_order(const Layer *L, const Rows *rows, int64_t n, int64_t kvh, const int64_t *task_starts,
                       int64_t *order) {
    int64_t i = 0;
    for (int64_t r0 = 0; r0 < n; r0 += SHARING_ROWS) {
        const int64_t r1 = r0 + SHARING_ROWS < n ? r0 + SHARING_ROWS : n;
        int64_t lowest = INT64_MAX, highest = 0; /* the tile's chunks */
        for (int64_t r = r0; r < r1; r++) {
            const int64_t lo = window_low(L, rows, r) / BLOCK, hi = rows->positions[r] / BLOCK;
            lowest = lo < lowest ? lo : lowest, highest = hi > highest ? hi : highest;
        }
        for (int64_t kv = 0; kv < kvh; kv++)
            for (int64_t chunk = lowest; chunk <= highest; chunk++)
                for (int64_t r = r0; r < r1; r++) {
                    const int64_t lo = window_low(L, rows, r) / BLOCK, parts = rows->positions[r] / BLOCK - lo + 1;
                    if (chunk < lo || chunk - lo >= parts) continue;
                    order[2 * i] = task_starts[r] + kv * parts + (chunk - lo), order[2 * i + 1] = r;
                    i++;
                }
    }
}

/* Attention of the call's n queries over their sequences' keys, into attended [n, heads * d].
 * Each query's keys are cut at fixed absolute boundaries, multiples of BLOCK positions, into
 * chunks; a task (query row, key/value head, chunk) scores its keys for the `group` query heads
 * that share the key/value head and keeps, per head, the maximum score, the sum of exponentials
 * and the unnormalised sum of values; the chunks are then merged in their order (the split
 * flash-decoding uses). Threads only distribute the tasks: what a query computes depends on its
 * position (and window) and the keys of those positions alone, not on n, the other rows, their
 * sequences, the thread count or where the keys are stored, so a position's output is the same
 * bits however many positions (of however many sequences) share the call, contiguous or placed in
 * a tree (a chunk whose keys are not in consecutive physical slots -- a tree row's ancestors in
 * scratch slots -- is first copied, in position order, into a buffer of one chunk). A one-token
 * step still runs on every thread once the context has more than one chunk of keys. */
static int attention(const Layer *L, const float *qkv, int64_t qkv_width, int64_t n, const Rows *rows,
                     const float *kcache, const float *vcache, float *attended, int threads) {
    const int64_t d = L->head_dim, heads = L->heads, kvh = L->kv_heads, group = heads / kvh;
    const int64_t capacity = rows->pool_blocks * BLOCK;
    int64_t *task_starts = malloc(sizeof(int64_t) * (n + 1)); /* row r's tasks: task_starts[r] .. [r + 1] */
    if (!task_starts) return -1;
    task_starts[0] = 0;
    for (int64_t r = 0; r < n; r++)
        task_starts[r + 1] = task_starts[r] + kvh * (rows->positions[r] / BLOCK - window_low(L, rows, r) / BLOCK + 1);
    const int64_t tasks = task_starts[n], per_head = 2 + d;
    float *work = malloc(sizeof(float) * tasks * group * per_head); /* per task and head: max, sum, out[d] */
    int64_t *order = malloc(sizeof(int64_t) * 2 * tasks); /* (task, its row), in the order they run */
    if (!work || !order) {
        free(work);
        free(order);
        free(task_starts);
        return -1;
    }
    task_order(L, rows, n, kvh, task_starts, order);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (tasks > 1)
    {
        /* head g's scores: scores + g * BLOCK; then one chunk of gathered keys and values */
        float *scores = malloc(sizeof(float) * (group + 2 * d) * BLOCK);
        double *totals = malloc(sizeof(double) * group); /* head g's sum of exponentials */
        int *live = malloc(sizeof(int) * group);           /* whether head g has a finite score */
        if (!scores || !totals || !live) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tasks; i++) {
            const int64_t task = order[2 * i], r = order[2 * i + 1];
            const int64_t parts = (task_starts[r + 1] - task_starts[r]) / kvh;
            const int64_t local = task - task_starts[r], kv = local / parts, part = local % parts;
            const int64_t low = window_low(L, rows, r), high = rows->positions[r];
            const int64_t chunk = low / BLOCK + part;
            const int64_t first = chunk * BLOCK > low ? chunk * BLOCK : low;
            const int64_t last = (chunk + 1) * BLOCK - 1 < high ? (chunk + 1) * BLOCK - 1 : high;
            const int64_t size = last - first + 1;
            float *states = work + task * group * per_head; /* head g: states + g * per_head */
            for (int64_t g = 0; g < group; g++) states[g * per_head] = -INFINITY, states[g * per_head + 1] = 0.0f;
            if (size <= 0 || !scores || !totals || !live) continue;
            const int64_t start = physical_slot(rows, r, logical_slot(rows, r, first));
            int consecutive = last < rows->bases[r]; /* one logical block: one physical block, in order */
            if (!consecutive) {
                consecutive = 1;
                for (int64_t p = first + 1; consecutive && p <= last; p++)
                    consecutive = physical_slot(rows, r, logical_slot(rows, r, p)) == start + (p - first);
            }
            const float *keys = kcache + (kv * capacity + start) * d, *values = vcache + (kv * capacity + start) * d;
            if (!consecutive) { /* gather the chunk's keys and values in position order */
                float *kbuffer = scores + group * BLOCK, *vbuffer = kbuffer + BLOCK * d;
                for (int64_t j = 0; j < size; j++) {
                    const int64_t slot = physical_slot(rows, r, logical_slot(rows, r, first + j));
                    memcpy(kbuffer + j * d, kcache + (kv * capacity + slot) * d, sizeof(float) * d);
                    memcpy(vbuffer + j * d, vcache + (kv * capacity + slot) * d, sizeof(float) * d);
                }
                keys = kbuffer, values = vbuffer;
            }
            scores_of(qkv + r * qkv_width + kv * group * d, group, keys, size, d, scores, BLOCK);
            for (int64_t g = 0; g < group; g++) {
                float *state = states + g * per_head, *row = scores + g * BLOCK;
                float best = -INFINITY;
                for (int64_t j = 0; j < size; j++) {
                    row[j] *= L->scaling;
                    if (row[j] > best) best = row[j];
                }
                live[g] = best != -INFINITY;
                if (!live[g]) { /* every score -inf: weigh nothing (its sum is never read) */
                    for (int64_t j = 0; j < size; j++) row[j] = 0.0f;
                    continue;
                }
                state[0] = best;
                exp_shifted(row, size, best);
            }
            row_sums(scores, BLOCK, group, live, size, totals);
            for (int64_t g = 0; g < group; g++)
                if (live[g]) states[g * per_head + 1] = (float)totals[g];
            weighted_sum(scores, BLOCK, group, values, size, d, states + 2, per_head);
        }
        free(scores);
        free(totals);
        free(live);
    }
    free(order);
    if (failed) {
        free(work);
        free(task_starts);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (n * heads > 1)
    for (int64_t row_head = 0; row_head < n * heads; row_head++) {
        const int64_t r = row_head / heads, head = row_head % heads, kv = head / group, g = head % group;
        const int64_t parts = (task_starts[r + 1] - task_starts[r]) / kvh;
        /* chunk p of this row and key/value head: task task_starts[r] + kv * parts + p */
        const float *states = work + (task_starts[r] + kv * parts) * group * per_head + g * per_head;
        const int64_t step = group * per_head;
        float best = -INFINITY;
        for (int64_t part = 0; part < parts; part++)
            if (states[part * step + 1] > 0.0f && states[part * step] > best) best = states[part * step];
        double total = 0.0;
        for (int64_t part = 0; part < parts; part++) {
            const float weight = states[part * step + 1] > 0.0f ? expf(states[part * step] - best) : 0.0f;
            total += (double)weight * states[part * step + 1];
        }
        float *dst = attended + (r * heads + head) * d;
        for (int64_t i = 0; i < d; i++) dst[i] = 0.0f;
        for (int64_t part = 0; part < parts; part++) {
            const float weight = states[part * step + 1] > 0.0f ? expf(states[part * step] - best) : 0.0f;
            if (weight > 0.0f)
                for (int64_t i = 0; i < d; i++) dst[i] += weight * states[part * step + 2 + i];
        }
        const float denominator = (float)total;
        for (int64_t i = 0; i < d; i++) dst[i] = dst[i] / denominator;
    }
    free(work);
    free(task_starts);
    return 0;
}

/* x [n, hidden] in place: the layer's output for the n rows `rows` describes (see Rows), whose
 * keys/values are written to, and read from, the pools kcache/vcache [kv_heads, pool_blocks *
 * BLOCK, head_dim]; cos/sin are [n, head_dim] (each row's position's). The caller has checked
 * `rows` (check_rows). Returns 0, or -1 if an argument is unusable or memory ran out. */
static int layer_forward(const Layer *L, float *x, int64_t n, const Rows *rows, const float *cos_table,
                         const float *sin_table, float *kcache, float *vcache, int threads) {
    const int64_t H = L->hidden, d = L->head_dim, heads = L->heads, kvh = L->kv_heads;
    const int64_t qkv_width = (heads + 2 * kvh) * d, I = L->intermediate, capacity = rows->pool_blocks * BLOCK;
    if (n < 1 || heads % kvh != 0 || d % 2 != 0 || threads < 1) return -1;
    const int64_t scratch_floats = n * H + n * qkv_width + n * heads * d + n * H + n * 2 * I;
    float *scratch = malloc(sizeof(float) * scratch_floats);
    if (!scratch) return -1;
    float *h = scratch, *qkv = h + n * H, *attended = qkv + n * qkv_width, *projected = attended + n * heads * d;
    float *gate_up = projected + n * H;
    int status = 0;

    /* attention block */
    rms_norm(&L->input, x, h, n, H, H);
    status |= linear(L, QKV, h, n, H, qkv, threads);
    for (int64_t r = 0; r < n; r++) {
        float *q = qkv + r * qkv_width, *k = q + heads * d, *v = k + kvh * d;
        if (L->q.weight) rms_norm(&L->q, q, q, heads, d, d);
        if (L->k.weight) rms_norm(&L->k, k, k, kvh, d, d);
        for (int64_t head = 0; head < heads; head++)
            rotate(q + head * d, cos_table + r * d, sin_table + r * d, d, L->rope_interleaved);
        const int64_t slot = physical_slot(rows, r, rows->slots[r]);
        for (int64_t head = 0; head < kvh; head++) {
            rotate(k + head * d, cos_table + r * d, sin_table + r * d, d, L->rope_interleaved);
            memcpy(kcache + (head * capacity + slot) * d, k + head * d, sizeof(float) * d);
            memcpy(vcache + (head * capacity + slot) * d, v + head * d, sizeof(float) * d);
        }
    }
    status |= attention(L, qkv, qkv_width, n, rows, kcache, vcache, attended, threads);
    status |= linear(L, O, attended, n, heads * d, projected, threads);
    if (L->post_attention.weight) rms_norm(&L->post_attention, projected, projected, n, H, H);
    for (int64_t i = 0; i < n * H; i++) x[i] = x[i] + projected[i];

    /* MLP block */
    rms_norm(&L->pre_mlp, x, h, n, H, H);
    status |= linear(L, GATE_UP, h, n, H, gate_up, threads);
    float *product = gate_up; /* act(gate) * up, written over the gate half row by row */
    for (int64_t r = 0; r < n; r++) activation_product(L->act, gate_up + r * 2 * I, gate_up + r * 2 * I + I, product + r * I, I);
    status |= linear(L, DOWN, product, n, I, projected, threads);
    if (L->post_mlp.weight) rms_norm(&L->post_mlp, projected, projected, n, H, H);
    for (int64_t i = 0; i < n * H; i++) x[i] = x[i] + projected[i];
    free(scratch);
    return status ? -1 : 0;
}

/* Several layers in turn over the same rows (a whole forward, or the layers on one side of an
 * early exit), so that a step pays one call from Python instead of one per layer: layer i gets
 * its own rotary tables cos_tables[i]/sin_tables[i] and pools kcaches[i]/vcaches[i]; every layer's
 * rows are described by `rows` (see Rows; its tables list `sequence_count` sequences). x [n,
 * hidden] is updated in place. Returns 0, or -1 if `rows` is unusable (nothing computed) or a
 * layer failed (x is then partly updated). */
int decoder_layers(const Layer *const *layers, int64_t count, float *x, int64_t n, const Rows *rows,
                   int64_t sequence_count, const float *const *cos_tables, const float *const *sin_tables,
                   float *const *kcaches, float *const *vcaches, int threads) {
    if (count < 0 || n < 1 || check_rows(rows, n, sequence_count) != 0) return -1;
    for (int64_t i = 0; i < count; i++)
        if (layer_forward(layers[i], x, n, rows, cos_tables[i], sin_tables[i], kcaches[i], vcaches[i], threads) != 0)
            return -1;
    return 0;
}
