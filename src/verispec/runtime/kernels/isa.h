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
 *                    "wide" vector is two 256-bit halves (blockmm_int8.c's tile_wide).
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
