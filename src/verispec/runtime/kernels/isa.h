/* The instruction-set gate of the kernel library, written once (as ggml-cpu's per-architecture
 * headers): which SIMD level the compiler was given, the one VNNI selection, the name of the build,
 * and the SIMD helpers more than one kernel file uses. Every kernel source includes this header and
 * tests only these macros, never the compiler's own (__AVX2__, __AVX512VNNI__, ...):
 *
 *   VS_AVX2          AVX2 + FMA + F16C (every SIMD build of runtime/build.py: avx2, avxvnni, avx512vnni,
 *                    the emulated test builds, amx): the vector paths; without it, portable C.
 *   VS_VNNI          vpdpbusd on 256-bit vectors, as `dpbusd256` (AVX-512 VNNI + VL, AVX-VNNI, or
 *                    emulated from AVX2 with -DBLOCKMM_EMULATE_VNNI: exactly the same int32 sums);
 *                    VS_DPBUSD names the same operation as the intrinsic itself (blockmm_int8.c
 *                    calls it so: an inline wrapper there changes GCC's register allocation, and
 *                    with these two spellings every kernel compiles to the instructions it had
 *                    before the gate was shared).
 *   VS_VNNI_WIDE     16-lane (512-bit) vpdpbusd: AVX-512 VNNI, or the emulated VNNI build, where a
 *                    "wide" vector is two 256-bit halves: the wide_* helpers below (blockmm_int8.c's
 *                    tile_wide, qmatmul_avx2.c's consume_pair).
 *   VS_AVX512        the real AVX-512 instructions (512-bit registers) are available.
 *   VS_AMX           the tile path of qmatmul_amx.c: real AMX-INT8 (-mamx-tile -mamx-int8, the "amx"
 *                    variant) or its portable emulation (-DBLOCKMM_EMULATE_AMX, "amx-emulated");
 *                    the tile operations themselves are in amx.h.
 *   VS_ISA_NAME      the build's name as runtime/build.py knows it: "amx", "amx-emulated", "avx512vnni",
 *                    "avxvnni", "vnni-emulated", "avx2" or "portable" (blockmm_isa, qmm_isa).
 *
 * The integer sums are exact on every level, and the float sequences are written per level to be
 * the same operations, so the level changes no bit of any result. */
#ifndef VERISPEC_ISA_H
#define VERISPEC_ISA_H
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VS_AVX2 1
#include <immintrin.h>
#endif

#ifdef VS_AVX2
/* The sum of the 8 int32 lanes of v (wrapping, as integer adds do). */
static inline int32_t sum8(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
#endif

#if defined(VS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VS_AVX512 1
#endif

/* The VNNI selection, once: emulated (a test build) first, then AVX-512 VNNI, then AVX-VNNI. */
#if defined(VS_AVX2) && defined(BLOCKMM_EMULATE_VNNI)
#define VS_VNNI 1
#define VS_VNNI_EMULATED 1
#define VS_VNNI_WIDE 1
/* vpdpbusd computed exactly from AVX2: per 32-bit lane, acc + sum of 4 products of unsigned bytes of
 * u by signed bytes of s (two vpmaddwd of zero- / sign-extended halves; no int16 saturation). */
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
    const __m256i low = _mm256_set1_epi16(0x00FF);
    const __m256i u_even = _mm256_and_si256(u, low), u_odd = _mm256_srli_epi16(u, 8); /* zero-extended */
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
#define VS_DPBUSD dpbusd256
#elif defined(VS_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VS_VNNI 1
#define VS_VNNI_WIDE 1
#define VS_DPBUSD _mm256_dpbusd_epi32
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return VS_DPBUSD(acc, u, s); }
#elif defined(VS_AVX2) && defined(__AVXVNNI__)
#define VS_VNNI 1
#define VS_DPBUSD _mm256_dpbusd_avx_epi32
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return VS_DPBUSD(acc, u, s); }
#endif

#ifdef VS_VNNI_WIDE
/* Two output groups of 8 lanes as one 16-lane vector (blockmm_int8.c's tile_wide, qmatmul_avx2.c's
 * consume_pair): group a in lanes 0..7 (`wide_low`), group b in 8..15 (`wide_high`). In the emulated
 * build a "wide" vector is a pair of 256-bit ones and every operation is applied to both halves, so
 * the tiles' logic (lane order, loads, corrections) is tested on AVX2; the AVX-512 build uses one zmm. */
#ifdef VS_VNNI_EMULATED
typedef struct { __m256i lo, hi; } wide_i;
typedef struct { __m256 lo, hi; } wide_f;
static inline wide_i wide_load2(const int8_t *a, const int8_t *b) {
    return (wide_i){_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b)};
}
static inline wide_f wide_load2_ps(const float *a, const float *b) { return (wide_f){_mm256_loadu_ps(a), _mm256_loadu_ps(b)}; }
static inline wide_f wide_pair_ps(__m256 lo, __m256 hi) { return (wide_f){lo, hi}; }
static inline wide_i wide_zero(void) { return (wide_i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline wide_f wide_zero_ps(void) { return (wide_f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline wide_i wide_set1(int32_t v) { return (wide_i){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline wide_f wide_set1_ps(float v) { return (wide_f){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
static inline wide_i wide_flip(wide_i w) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    return (wide_i){_mm256_xor_si256(w.lo, flip), _mm256_xor_si256(w.hi, flip)};
}
static inline wide_i wide_dpbusd(wide_i acc, wide_i u, wide_i s) {
    return (wide_i){VS_DPBUSD(acc.lo, u.lo, s.lo), VS_DPBUSD(acc.hi, u.hi, s.hi)};
}
static inline wide_i wide_sub(wide_i a, wide_i b) { return (wide_i){_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
static inline wide_i wide_add(wide_i a, wide_i b) { return (wide_i){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
static inline wide_i wide_mullo(wide_i a, wide_i b) {
    return (wide_i){_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)};
}
/* Byte and int16 operations of the row-wise Q6_K path (qmatmul_avx2.c's rows_q6_wide). */
static inline wide_i wide_halves(__m256i low, __m256i high) { return (wide_i){low, high}; }
static inline wide_i wide_loadu(const void *p) {
    return (wide_i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
static inline wide_i wide_bcast256(const void *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return (wide_i){v, v};
}
static inline wide_i wide_and(wide_i a, wide_i b) { return (wide_i){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
/* The 16-output transposition of a pair of groups (qmatmul_avx2.c's transpose_pair): 128-bit lane q
 * of wide_load4x128 = the 16 bytes at p[q]; the unpacks work within 128-bit lanes as AVX-512's do. */
static inline wide_i wide_load4x128(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
    return (wide_i){_mm256_loadu2_m128i((const __m128i *)p1, (const __m128i *)p0),
                    _mm256_loadu2_m128i((const __m128i *)p3, (const __m128i *)p2)};
}
static inline wide_i wide_unpacklo32(wide_i a, wide_i b) { return (wide_i){_mm256_unpacklo_epi32(a.lo, b.lo), _mm256_unpacklo_epi32(a.hi, b.hi)}; }
static inline wide_i wide_unpackhi32(wide_i a, wide_i b) { return (wide_i){_mm256_unpackhi_epi32(a.lo, b.lo), _mm256_unpackhi_epi32(a.hi, b.hi)}; }
static inline wide_i wide_unpacklo64(wide_i a, wide_i b) { return (wide_i){_mm256_unpacklo_epi64(a.lo, b.lo), _mm256_unpacklo_epi64(a.hi, b.hi)}; }
static inline wide_i wide_unpackhi64(wide_i a, wide_i b) { return (wide_i){_mm256_unpackhi_epi64(a.lo, b.lo), _mm256_unpackhi_epi64(a.hi, b.hi)}; }
static inline void wide_store(void *p, wide_i v) { _mm256_store_si256((__m256i *)p, v.lo), _mm256_store_si256((__m256i *)p + 1, v.hi); }
static inline wide_i wide_slli16(wide_i a, const int n) { return (wide_i){_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
static inline wide_i wide_or(wide_i a, wide_i b) { return (wide_i){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
static inline wide_i wide_slli32(wide_i a, const int n) { return (wide_i){_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
/* 16-bit shifts, right by n; by LOW in the low half and HIGH in the high one (left, right) */
static inline wide_i wide_srli16(wide_i a, const int n) { return (wide_i){_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
static inline wide_i wide_slli16_halves(wide_i a, const int LOW, const int HIGH) {
    return (wide_i){_mm256_slli_epi16(a.lo, LOW), _mm256_slli_epi16(a.hi, HIGH)};
}
static inline wide_i wide_srli16_halves(wide_i a, const int LOW, const int HIGH) {
    return (wide_i){_mm256_srli_epi16(a.lo, LOW), _mm256_srli_epi16(a.hi, HIGH)};
}
static inline wide_i wide_maddubs(wide_i u, wide_i s) {
    return (wide_i){_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)};
}
/* vpdpwssd: acc + the sum of each lane's two int16 products (exact: vpmaddwd, then an int32 add) */
static inline wide_i wide_dpwssd(wide_i acc, wide_i a, wide_i b) {
    return (wide_i){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
/* 16 int8 at p as 16 int32 lanes; lanes of t picked by index (each 0..15); the sum of the lanes */
static inline wide_i wide_cvt8_32(const int8_t *p) {
    return (wide_i){_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline __m256i wide_permute_half(wide_i t, __m256i index) {
    const __m256i low = _mm256_permutevar8x32_epi32(t.lo, index), high = _mm256_permutevar8x32_epi32(t.hi, index);
    return _mm256_blendv_epi8(low, high, _mm256_cmpgt_epi32(index, _mm256_set1_epi32(7)));
}
static inline wide_i wide_permute32(wide_i t, wide_i index) {
    return (wide_i){wide_permute_half(t, index.lo), wide_permute_half(t, index.hi)};
}
static inline int32_t wide_sum(wide_i a) { return sum8(_mm256_add_epi32(a.lo, a.hi)); }
static inline __m256i wide_low(wide_i a) { return a.lo; }
static inline __m256i wide_high(wide_i a) { return a.hi; }
static inline wide_f wide_cvt(wide_i a) { return (wide_f){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline wide_f wide_add_ps(wide_f a, wide_f b) { return (wide_f){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline wide_f wide_sub_ps(wide_f a, wide_f b) { return (wide_f){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline wide_f wide_mul_ps(wide_f a, wide_f b) { return (wide_f){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline void wide_store_ps(float *y, wide_f v) { _mm256_storeu_ps(y, v.lo), _mm256_storeu_ps(y + 8, v.hi); }
#else
typedef __m512i wide_i;
typedef __m512 wide_f;
static inline wide_i wide_load2(const int8_t *a, const int8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline wide_f wide_pair_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline wide_f wide_load2_ps(const float *a, const float *b) { return wide_pair_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)); }
static inline wide_i wide_zero(void) { return _mm512_setzero_si512(); }
static inline wide_f wide_zero_ps(void) { return _mm512_setzero_ps(); }
static inline wide_i wide_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline wide_f wide_set1_ps(float v) { return _mm512_set1_ps(v); }
static inline wide_i wide_flip(wide_i w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
static inline wide_i wide_dpbusd(wide_i acc, wide_i u, wide_i s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline wide_i wide_sub(wide_i a, wide_i b) { return _mm512_sub_epi32(a, b); }
static inline wide_i wide_add(wide_i a, wide_i b) { return _mm512_add_epi32(a, b); }
static inline wide_i wide_mullo(wide_i a, wide_i b) { return _mm512_mullo_epi32(a, b); }
static inline wide_i wide_halves(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }
static inline wide_i wide_loadu(const void *p) { return _mm512_loadu_si512(p); }
static inline wide_i wide_and(wide_i a, wide_i b) { return _mm512_and_si512(a, b); }
static inline wide_i wide_load4x128(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
    const __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p0));
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p1), 1),
                                                 _mm_loadu_si128((const __m128i *)p2), 2),
                              _mm_loadu_si128((const __m128i *)p3), 3);
}
static inline wide_i wide_unpacklo32(wide_i a, wide_i b) { return _mm512_unpacklo_epi32(a, b); }
static inline wide_i wide_unpackhi32(wide_i a, wide_i b) { return _mm512_unpackhi_epi32(a, b); }
static inline wide_i wide_unpacklo64(wide_i a, wide_i b) { return _mm512_unpacklo_epi64(a, b); }
static inline wide_i wide_unpackhi64(wide_i a, wide_i b) { return _mm512_unpackhi_epi64(a, b); }
static inline void wide_store(void *p, wide_i v) { _mm512_store_si512(p, v); }
static inline wide_i wide_slli16(wide_i a, const int n) { return _mm512_slli_epi16(a, n); }
static inline wide_i wide_or(wide_i a, wide_i b) { return _mm512_or_si512(a, b); }
static inline wide_i wide_slli32(wide_i a, const int n) { return _mm512_slli_epi32(a, n); }
static inline wide_i wide_srli16(wide_i a, const int n) { return _mm512_srli_epi16(a, n); }
static inline wide_i wide_bcast256(const void *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }
static inline wide_i wide_slli16_halves(wide_i a, const int LOW, const int HIGH) {
    return _mm512_sllv_epi16(a, wide_halves(_mm256_set1_epi16((short)LOW), _mm256_set1_epi16((short)HIGH)));
}
static inline wide_i wide_srli16_halves(wide_i a, const int LOW, const int HIGH) {
    return _mm512_srlv_epi16(a, wide_halves(_mm256_set1_epi16((short)LOW), _mm256_set1_epi16((short)HIGH)));
}
static inline wide_i wide_maddubs(wide_i u, wide_i s) { return _mm512_maddubs_epi16(u, s); }
static inline wide_i wide_dpwssd(wide_i acc, wide_i a, wide_i b) { return _mm512_dpwssd_epi32(acc, a, b); }
static inline wide_i wide_cvt8_32(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline wide_i wide_permute32(wide_i t, wide_i index) { return _mm512_permutexvar_epi32(index, t); }
static inline int32_t wide_sum(wide_i a) { return _mm512_reduce_add_epi32(a); }
static inline __m256i wide_low(wide_i a) { return _mm512_castsi512_si256(a); }
static inline __m256i wide_high(wide_i a) { return _mm512_extracti64x4_epi64(a, 1); }
static inline wide_f wide_cvt(wide_i a) { return _mm512_cvtepi32_ps(a); }
static inline wide_f wide_add_ps(wide_f a, wide_f b) { return _mm512_add_ps(a, b); }
static inline wide_f wide_sub_ps(wide_f a, wide_f b) { return _mm512_sub_ps(a, b); }
static inline wide_f wide_mul_ps(wide_f a, wide_f b) { return _mm512_mul_ps(a, b); }
static inline void wide_store_ps(float *y, wide_f v) { _mm512_storeu_ps(y, v); }
#endif
#endif

/* The tile path: real AMX-INT8 where the compiler was given it, else the emulation when asked. */
#if defined(VS_AVX2) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(BLOCKMM_EMULATE_AMX)
#define VS_AMX 1
#define VS_AMX_REAL 1
#elif defined(VS_AVX2) && defined(BLOCKMM_EMULATE_AMX)
#define VS_AMX 1
#define VS_AMX_EMULATED 1
#endif

#if defined(VS_AMX_EMULATED)
#define VS_ISA_NAME "amx-emulated"
#elif defined(VS_AMX_REAL)
#define VS_ISA_NAME "amx"
#elif defined(VS_VNNI_EMULATED)
#define VS_ISA_NAME "vnni-emulated"
#elif defined(VS_VNNI) && defined(VS_VNNI_WIDE)
#define VS_ISA_NAME "avx512vnni"
#elif defined(VS_VNNI)
#define VS_ISA_NAME "avxvnni"
#elif defined(VS_AVX2)
#define VS_ISA_NAME "avx2"
#else
#define VS_ISA_NAME "portable"
#endif

#endif
