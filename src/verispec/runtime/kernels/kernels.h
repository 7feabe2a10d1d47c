/* The functions the kernel library's C files call across files (and Python calls by name through
 * ctypes): one declaration each, included by every file, so that the compiler checks each
 * definition against the declaration its callers use. What each computes: the file that defines it. */
#ifndef VERISPEC_KERNELS_H
#define VERISPEC_KERNELS_H
#include <stdint.h>

/* blockmm.c: float32 activations times int8 block forms */
int blockmm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
            const float *offsets, int64_t N, int64_t B, float *y, int threads);

/* blockmm_int8.c: activations quantized per block, exact integer products with the block forms */
int blockmm_int8(const float *x, int64_t M, int64_t K, const int8_t *codes, const void *scales,
                 const float *offsets, int64_t N, int64_t B, int code_bias, int code_span, int half_scales, float *y,
                 int threads);

/* qmatmul.c: a GGUF file's own quantized blocks; `type` is the tensor's GGUF type id */
enum { GGUF_F32 = 0, GGUF_F16 = 1, GGUF_Q4_0 = 2, GGUF_Q5_0 = 6, GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13,
       GGUF_Q6_K = 14, GGUF_BF16 = 30 };
int qmm_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, float *xo, int32_t *xsum, int threads);
int qmm_quantize_super(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, float *xo, int32_t *xsum, int threads);
int qmm_matmul(const float *x, const int8_t *xq, const float *xs, const float *xo, const int32_t *xsum, int64_t M,
               int64_t K, const void *w, int type, int64_t N, float *y, int64_t ldy, int threads);
typedef struct {
    const void *weights;
    int type;
    int64_t n;
} QmmPart;
int qmm_matmul_parts(const int8_t *xq, const float *xs, const float *xo, const int32_t *xsum, int64_t M, int64_t K,
                     const QmmPart *parts, int count, float *y, int64_t ldy, int threads);

#endif
