/* Vector backend of the portable C (16 lanes as plain arrays) path: included once, by isa_portable.c.
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
#ifndef SPECRT_VEC_PORTABLE_H
#define SPECRT_VEC_PORTABLE_H
#include "sk_internal.h"

#define SK_LEVEL 0                  /* 2 AVX-512 VNNI, 1 AVX2, 0 portable: what elementwise.h's conversions use */
#define SK_ISA_THIS SK_ISA_PORTABLE /* this path's column of the block-type table */

#define LANES 16
typedef struct {
    int32_t v[16];
} vi;
typedef struct {
    float v[16];
} vf;
static inline vi vloadw(const void *p) {
    vi r;
    memcpy(r.v, p, 64);
    return r;
}
static inline vi vi32(int32_t x) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = x;
    return r;
}
static inline vf vfset1(float x) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = x;
    return r;
}
#define VLOADW(p) vloadw(p)
#define VI32(x) vi32(x)
#define VZERO() vi32(0)
#define FZERO() vfset1(0.f)
#define FSET1(x) vfset1(x)
static inline vi vand(vi a, vi b) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] & b.v[l];
    return r;
}
static inline vi vor(vi a, vi b) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] | b.v[l];
    return r;
}
static inline vi vxor(vi a, vi b) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] ^ b.v[l];
    return r;
}
static inline vi vsub32(vi a, vi b) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] - b.v[l];
    return r;
}
static inline vi vadd32(vi a, vi b) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] + b.v[l];
    return r;
}
static inline vf vfmul(vf a, vf b) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] * b.v[l];
    return r;
}
static inline vf vfadd(vf a, vf b) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] + b.v[l];
    return r;
}
#define VAND(a, b) vand(a, b)
#define VOR(a, b) vor(a, b)
#define VXOR(a, b) vxor(a, b)
#define VSUB32(a, b) vsub32(a, b)
#define VADD32(a, b) vadd32(a, b)
#define FMUL(a, b) vfmul(a, b)
#define FADD(a, b) vfadd(a, b)
/* 16-bit lane shifts; every caller masks the result to whole nibbles/2-bit fields per byte,
 * so a 32-bit shift (which differs only in bits the mask drops) is the same */
static inline vi vsrl(vi a, int n) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = (int32_t)((uint32_t)a.v[l] >> n);
    return r;
}
static inline vi vsll(vi a, int n) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = (int32_t)((uint32_t)a.v[l] << n);
    return r;
}
#define VSRL16(a, n) vsrl(a, n)
#define VSLL16(a, n) vsll(a, n)
#define VSLL32(a, n) vsll(a, n)
static inline vf vcvt(vi a) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = (float)a.v[l];
    return r;
}
static inline vf vfma(vf a, vf b, vf c) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = fmaf(a.v[l], b.v[l], c.v[l]);
    return r;
}
static inline vf vfnma(vf a, vf b, vf c) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = fmaf(-a.v[l], b.v[l], c.v[l]);
    return r;
}
static inline vf vfload(const float *p) {
    vf r;
    memcpy(r.v, p, 64);
    return r;
}
static inline void vfstore(float *p, vf a) { memcpy(p, a.v, 64); }
static inline vf vh2f(const void *p) {
    vf r;
    const uint16_t *h = (const uint16_t *)p;
    for (int l = 0; l < 16; ++l) r.v[l] = sk_h2f(h[l]);
    return r;
}
static inline vf vu82f(const void *p) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = (float)((const uint8_t *)p)[l];
    return r;
}
static inline vf vi82f(const void *p) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = (float)((const int8_t *)p)[l];
    return r;
}
static inline vi vu8to32(const void *p) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = ((const uint8_t *)p)[l];
    return r;
}
#define VCVT(a) vcvt(a)
#define FMA(a, b, c) vfma(a, b, c)
#define FNMA(a, b, c) vfnma(a, b, c)
#define FLOAD(p) vfload(p)
#define FSTORE(p, v) vfstore(p, v)
#define H2F(p) vh2f(p)
static inline vf vbf2f(const void *p) {
    vf r;
    const uint16_t *h = (const uint16_t *)p;
    for (int l = 0; l < 16; ++l) r.v[l] = sk_bits_f((uint32_t)h[l] << 16);
    return r;
}
#define BF2F(p) vbf2f(p)
#define U82F(p) vu82f(p)
#define I82F(p) vi82f(p)
#define U8TO32(p) vu8to32(p)
static inline vi vi8to32(const void *p) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = ((const int8_t *)p)[l];
    return r;
}
#define I8TO32(p) vi8to32(p)
static inline vi vmul32(vi a, vi b) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = (int32_t)((uint32_t)a.v[l] * (uint32_t)b.v[l]);
    return r;
}
#define VMUL32(a, b) vmul32(a, b)
static inline vi vdotu(vi acc, vi w, vi x) {
    for (int l = 0; l < 16; ++l) {
        const uint32_t ww = (uint32_t)w.v[l], xx = (uint32_t)x.v[l];
        int32_t s = 0;
        for (int e = 0; e < 4; ++e) s += (int32_t)((ww >> (8 * e)) & 255) * (int32_t)(int8_t)((xx >> (8 * e)) & 255);
        acc.v[l] += s;
    }
    return acc;
}
static inline vi vdots(vi acc, vi w, vi x) {
    for (int l = 0; l < 16; ++l) {
        const uint32_t ww = (uint32_t)w.v[l], xx = (uint32_t)x.v[l];
        int32_t s = 0;
        for (int e = 0; e < 4; ++e) s += (int32_t)(int8_t)((ww >> (8 * e)) & 255) * (int32_t)(int8_t)((xx >> (8 * e)) & 255);
        acc.v[l] += s;
    }
    return acc;
}
static inline vi vdot16(vi acc, vi a, vi b) {
    for (int l = 0; l < 16; ++l) {
        const uint32_t aa = (uint32_t)a.v[l], bb = (uint32_t)b.v[l];
        acc.v[l] += (int32_t)(int16_t)(aa & 0xFFFF) * (int32_t)(int16_t)(bb & 0xFFFF) + (int32_t)(int16_t)(aa >> 16) * (int32_t)(int16_t)(bb >> 16);
    }
    return acc;
}
/* the table in the first 16 bytes of a vector; VLUT reads each byte of i as an index into them */
static inline vi vtab16(const void *p) {
    vi r = vi32(0);
    memcpy(r.v, p, 16);
    return r;
}
static inline vi vlut(vi t, vi i) {
    vi r;
    const uint8_t *tb = (const uint8_t *)t.v, *ib = (const uint8_t *)i.v;
    uint8_t *rb = (uint8_t *)r.v;
    for (int b = 0; b < 64; ++b) rb[b] = tb[ib[b] & 15];
    return r;
}
#define VTAB16(p) vtab16(p)
#define VLUT(t, i) vlut(t, i)
#define VTAB16S(p) VTAB16(p) /* no flip on this path (I8_BIAS 0) */
#define DOTU(acc, w, x) vdotu(acc, w, x)
#define DOTS(acc, w, x) vdots(acc, w, x)
#define DOTS_TAB(acc, w, x) DOTS(acc, w, x)
#define DOT16(acc, a, b) vdot16(acc, a, b)
#define I8_BIAS 0
#define HI_X16 0
#define RB 4
#define RB_Q4K 4

#endif
