/* Vector backend of the AVX-512 VNNI path: included once, by isa_avx512.c.
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
#ifndef SPECRT_VEC_AVX512_H
#define SPECRT_VEC_AVX512_H
#include "sk_internal.h"

#define SK_LEVEL 2                    /* 2 AVX-512 VNNI, 1 AVX2, 0 portable: what elementwise.h's conversions use */
#define SK_ISA_THIS SK_ISA_AVX512VNNI /* this path's column of the block-type table */

#define LANES 16
typedef __m512i vi;
typedef __m512 vf;
#define VLOADW(p) _mm512_loadu_si512((const void *)(p))
#define VI32(x) _mm512_set1_epi32(x)
#define VZERO() _mm512_setzero_si512()
#define FZERO() _mm512_setzero_ps()
#define VAND(a, b) _mm512_and_si512(a, b)
#define VOR(a, b) _mm512_or_si512(a, b)
#define VXOR(a, b) _mm512_xor_si512(a, b)
#define VSRL16(a, n) _mm512_srli_epi16(a, n)
#define VSLL16(a, n) _mm512_slli_epi16(a, n)
#define VSLL32(a, n) _mm512_slli_epi32(a, n)
#define VSUB32(a, b) _mm512_sub_epi32(a, b)
#define VADD32(a, b) _mm512_add_epi32(a, b)
#define VCVT(a) _mm512_cvtepi32_ps(a)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define FMUL(a, b) _mm512_mul_ps(a, b)
#define FADD(a, b) _mm512_add_ps(a, b)
#define FSET1(x) _mm512_set1_ps(x)
#define FLOAD(p) _mm512_loadu_ps(p)
#define FSTORE(p, v) _mm512_storeu_ps(p, v)
#define H2F(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define BF2F(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define U82F(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define I82F(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define U8TO32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define I8TO32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VMUL32(a, b) _mm512_mullo_epi32(a, b)
#define VTAB16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define VLUT(t, i) _mm512_shuffle_epi8(t, i)
/* a table whose looked-up bytes go to DOTS_TAB: here stored with the sign bit flipped, so the
 * flip DOTS makes per dot is made once per table (a lookup moves bytes, it commutes with the flip) */
#define VTAB16S(p) _mm512_xor_si512(VTAB16(p), _mm512_set1_epi32((int)0x80808080))
#define DOTU(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
/* s8 x s8 through the u8 x s8 instruction: (w + 128) * x, the 128 * sum(x) taken off per block */
#define DOTS(acc, w, x) _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi32((int)0x80808080)), x)
/* DOTS of bytes looked up in a VTAB16S table: the flip is already in them */
#define DOTS_TAB(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define I8_BIAS 128
#define DOT16(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#define HI_X16 1 /* Q4_K high nibble used in place (x16); 1/16 folded into its (exact) scale */
#define RB 8     /* rows per register-blocked pass (32 zmm registers) */
#ifndef RB_Q4K
#define RB_Q4K 6
#endif

#endif
