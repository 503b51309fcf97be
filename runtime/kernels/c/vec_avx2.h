/* Vector backend of the AVX2 (with FMA, F16C, BMI2) path: included once, by isa_avx2.c.
 *
 * A kernel body (dot_*.h) is written once against these operations; each ISA path defines them
 * over its own registers. LANES = int32/float lanes per vector; a panel (SK_P = 16 columns) is
 * processed in SK_P / LANES halves. Every operation is exact on integers or one IEEE float
 * operation per lane, so the three backends compute the same bits lane by lane.
 *
 *   VLOADW(p)        64 / LANES*4 bytes of panel weights (one int32 lane = 4 bytes of a column)
 *   DOTU(acc, w, x)  acc + sum of 4 (u8 w_byte * s8 x_byte) per lane (w bytes <= 63)
 *   DOTS(acc, w, x)  acc + sum of 4 (s8 w_byte * s8 x_byte) per lane, minus I8_BIAS * (x bytes sum)
 *   DOT16(acc, a, b) acc + lo16(a)*lo16(b) + hi16(a)*hi16(b) per lane (int16 pairs)
 *   XSET(p)          the 4 activation bytes at p broadcast to every lane (kernels.h)
 *   VTAB16(p)        the 16 bytes at p as a lookup table for VLUT (each 128-bit lane holds them)
 *   VLUT(t, i)       per byte: t's byte number i (every byte of i is 0..15)
 *   VTAB16S, DOTS_TAB  a table and dot for looked-up signed bytes: DOTS_TAB(acc, VLUT(VTAB16S(p), i), x)
 *                    == DOTS(acc, VLUT(VTAB16(p), i), x)
 *   H2F, BF2F(p)     LANES f16 / bf16 values at p as floats (exact)
 *   RB, RB_Q4K       rows per register-blocked pass (Q4_K keeps more registers a row)
 *   HI_X16           1: Q4_K's high nibble is used in place (x16), its scale / 16
 */
#ifndef SPECRT_VEC_AVX2_H
#define SPECRT_VEC_AVX2_H
#include "sk_internal.h"

#define SK_LEVEL 1              /* 2 AVX-512 VNNI, 1 AVX2, 0 portable: what elementwise.h's conversions use */
#define SK_ISA_THIS SK_ISA_AVX2 /* this path's column of the block-type table */

#define LANES 8
typedef __m256i vi;
typedef __m256 vf;
#define VLOADW(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI32(x) _mm256_set1_epi32(x)
#define VZERO() _mm256_setzero_si256()
#define FZERO() _mm256_setzero_ps()
#define VAND(a, b) _mm256_and_si256(a, b)
#define VOR(a, b) _mm256_or_si256(a, b)
#define VXOR(a, b) _mm256_xor_si256(a, b)
#define VSRL16(a, n) _mm256_srli_epi16(a, n)
#define VSLL16(a, n) _mm256_slli_epi16(a, n)
#define VSLL32(a, n) _mm256_slli_epi32(a, n)
#define VSUB32(a, b) _mm256_sub_epi32(a, b)
#define VADD32(a, b) _mm256_add_epi32(a, b)
#define VCVT(a) _mm256_cvtepi32_ps(a)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define FMUL(a, b) _mm256_mul_ps(a, b)
#define FADD(a, b) _mm256_add_ps(a, b)
#define FSET1(x) _mm256_set1_ps(x)
#define FLOAD(p) _mm256_loadu_ps(p)
#define FSTORE(p, v) _mm256_storeu_ps(p, v)
#define H2F(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define BF2F(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define U82F(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define I82F(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define U8TO32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I8TO32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VMUL32(a, b) _mm256_mullo_epi32(a, b)
#define VTAB16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define VLUT(t, i) _mm256_shuffle_epi8(t, i)
#define VTAB16S(p) VTAB16(p) /* no flip on this path (I8_BIAS 0) */
/* maddubs: u8 (<= 63) x s8 -> int16 pairs without saturation (63 * 127 * 2 < 32767); madd -> int32 */
static inline vi dotu(vi acc, vi w, vi x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))); }
/* s8 x s8: |w| x sign(x, w) (|w| <= 128, |x| <= 127: 128 * 127 * 2 < 32767) */
static inline vi dots(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1)));
}
#define DOTU(acc, w, x) dotu(acc, w, x)
#define DOTS(acc, w, x) dots(acc, w, x)
#define DOTS_TAB(acc, w, x) DOTS(acc, w, x)
#define I8_BIAS 0
static inline vi dot16(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#define DOT16(acc, a, b) dot16(acc, a, b)
#define HI_X16 0 /* maddubs would saturate on 240: the high nibble is shifted down */
#define RB 4
#define RB_Q4K 4

#endif
