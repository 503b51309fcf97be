/* Vector backends of the panel kernels (included by sk_isa.h once per ISA).
 *
 * A kernel is written once against these operations; each ISA defines them over its own
 * registers. LANES = int32/float lanes per vector; a panel (SK_P = 16 columns) is processed
 * in SK_P / LANES halves. Every operation is exact on integers or one IEEE float operation
 * per lane, so the three backends compute the same bits lane by lane.
 *
 *   VLOADW(p)       64 / LANES*4 bytes of panel weights (one int32 lane = 4 bytes of a column)
 *   VNIB_LO(v)      low nibble of each byte;  VNIB_HI(v): high nibble (shifted down)
 *   DOTU(acc, w, x) acc + sum of 4 (u8 w_byte * s8 x_byte) per lane (w bytes <= 63)
 *   DOTS(acc, w, x) acc + sum of 4 (s8 w_byte * s8 x_byte) per lane, minus I8_BIAS * (x bytes sum)
 *   DOT16(acc, a, b) acc + lo16(a)*lo16(b) + hi16(a)*hi16(b) per lane (int16 pairs)
 *   XSET(p)         the 4 activation bytes at p broadcast to every lane
 */

#define vi SKF(vi)
#define vf SKF(vf)

#if SK_LEVEL == 2 /* ---------------------------------------------------------- AVX-512 VNNI */
#define LANES 16
typedef __m512i SKF(vi);
typedef __m512 SKF(vf);
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
#define U82F(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define I82F(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define U8TO32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define I8TO32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VMUL32(a, b) _mm512_mullo_epi32(a, b)
#define DOTU(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
/* s8 x s8 through the u8 x s8 instruction: (w + 128) * x, the 128 * sum(x) taken off per block */
#define DOTS(acc, w, x) _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi32((int)0x80808080)), x)
#define I8_BIAS 128
#define DOT16(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#define HI_X16 1 /* Q4_K high nibble used in place (x16); 1/16 folded into its (exact) scale */
#define RB 8     /* rows per register-blocked pass (32 zmm registers) */
#ifndef RB_Q4K
#define RB_Q4K 6
#endif

#elif SK_LEVEL == 1 /* ---------------------------------------------------------- AVX2 */
#define LANES 8
typedef __m256i SKF(vi);
typedef __m256 SKF(vf);
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
#define U82F(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define I82F(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define U8TO32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I8TO32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VMUL32(a, b) _mm256_mullo_epi32(a, b)
/* maddubs: u8 (<= 63) x s8 -> int16 pairs without saturation (63 * 127 * 2 < 32767); madd -> int32 */
static inline vi SKF(dotu)(vi acc, vi w, vi x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))); }
/* s8 x s8: |w| x sign(x, w) (|w| <= 128, |x| <= 127: 128 * 127 * 2 < 32767) */
static inline vi SKF(dots)(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1)));
}
#define DOTU(acc, w, x) SKF(dotu)(acc, w, x)
#define DOTS(acc, w, x) SKF(dots)(acc, w, x)
#define I8_BIAS 0
static inline vi SKF(dot16)(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#define DOT16(acc, a, b) SKF(dot16)(acc, a, b)
#define HI_X16 0 /* maddubs would saturate on 240: the high nibble is shifted down */
#define RB 4
#define RB_Q4K 4

#else /* ------------------------------------------------------------------------- portable C */
#define LANES 16
typedef struct {
    int32_t v[16];
} SKF(vi);
typedef struct {
    float v[16];
} SKF(vf);
static inline vi SKF(vloadw)(const void *p) {
    vi r;
    memcpy(r.v, p, 64);
    return r;
}
static inline vi SKF(vi32)(int32_t x) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = x;
    return r;
}
static inline vf SKF(fset1)(float x) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = x;
    return r;
}
#define VLOADW(p) SKF(vloadw)(p)
#define VI32(x) SKF(vi32)(x)
#define VZERO() SKF(vi32)(0)
#define FZERO() SKF(fset1)(0.f)
#define FSET1(x) SKF(fset1)(x)
#define SK_VOP2(name, T, expr)                     \
    static inline T SKF(name)(T a, T b) {          \
        T r;                                       \
        for (int l = 0; l < 16; ++l) r.v[l] = expr; \
        return r;                                  \
    }
SK_VOP2(vand, vi, a.v[l] & b.v[l])
SK_VOP2(vor, vi, a.v[l] | b.v[l])
SK_VOP2(vxor, vi, a.v[l] ^ b.v[l])
SK_VOP2(vsub32, vi, a.v[l] - b.v[l])
SK_VOP2(vadd32, vi, a.v[l] + b.v[l])
SK_VOP2(fmul, vf, a.v[l] * b.v[l])
SK_VOP2(fadd, vf, a.v[l] + b.v[l])
#define VAND(a, b) SKF(vand)(a, b)
#define VOR(a, b) SKF(vor)(a, b)
#define VXOR(a, b) SKF(vxor)(a, b)
#define VSUB32(a, b) SKF(vsub32)(a, b)
#define VADD32(a, b) SKF(vadd32)(a, b)
#define FMUL(a, b) SKF(fmul)(a, b)
#define FADD(a, b) SKF(fadd)(a, b)
/* 16-bit lane shifts; every caller masks the result to whole nibbles/2-bit fields per byte,
 * so a 32-bit shift (which differs only in bits the mask drops) is the same */
static inline vi SKF(vsrl)(vi a, int n) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = (int32_t)((uint32_t)a.v[l] >> n);
    return r;
}
static inline vi SKF(vsll)(vi a, int n) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = (int32_t)((uint32_t)a.v[l] << n);
    return r;
}
#define VSRL16(a, n) SKF(vsrl)(a, n)
#define VSLL16(a, n) SKF(vsll)(a, n)
#define VSLL32(a, n) SKF(vsll)(a, n)
static inline vf SKF(vcvt)(vi a) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = (float)a.v[l];
    return r;
}
static inline vf SKF(fma)(vf a, vf b, vf c) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = fmaf(a.v[l], b.v[l], c.v[l]);
    return r;
}
static inline vf SKF(fnma)(vf a, vf b, vf c) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = fmaf(-a.v[l], b.v[l], c.v[l]);
    return r;
}
static inline vf SKF(fload)(const float *p) {
    vf r;
    memcpy(r.v, p, 64);
    return r;
}
static inline void SKF(fstore)(float *p, vf a) { memcpy(p, a.v, 64); }
static inline vf SKF(h2f)(const void *p) {
    vf r;
    const uint16_t *h = (const uint16_t *)p;
    for (int l = 0; l < 16; ++l) r.v[l] = sk_h2f(h[l]);
    return r;
}
static inline vf SKF(u82f)(const void *p) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = (float)((const uint8_t *)p)[l];
    return r;
}
static inline vf SKF(i82f)(const void *p) {
    vf r;
    for (int l = 0; l < 16; ++l) r.v[l] = (float)((const int8_t *)p)[l];
    return r;
}
static inline vi SKF(u8to32)(const void *p) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = ((const uint8_t *)p)[l];
    return r;
}
#define VCVT(a) SKF(vcvt)(a)
#define FMA(a, b, c) SKF(fma)(a, b, c)
#define FNMA(a, b, c) SKF(fnma)(a, b, c)
#define FLOAD(p) SKF(fload)(p)
#define FSTORE(p, v) SKF(fstore)(p, v)
#define H2F(p) SKF(h2f)(p)
#define U82F(p) SKF(u82f)(p)
#define I82F(p) SKF(i82f)(p)
#define U8TO32(p) SKF(u8to32)(p)
static inline vi SKF(i8to32)(const void *p) {
    vi r;
    for (int l = 0; l < 16; ++l) r.v[l] = ((const int8_t *)p)[l];
    return r;
}
#define I8TO32(p) SKF(i8to32)(p)
SK_VOP2(vmul32, vi, (int32_t)((uint32_t)a.v[l] * (uint32_t)b.v[l]))
#define VMUL32(a, b) SKF(vmul32)(a, b)
static inline vi SKF(dotu)(vi acc, vi w, vi x) {
    for (int l = 0; l < 16; ++l) {
        const uint32_t ww = (uint32_t)w.v[l], xx = (uint32_t)x.v[l];
        int32_t s = 0;
        for (int e = 0; e < 4; ++e) s += (int32_t)((ww >> (8 * e)) & 255) * (int32_t)(int8_t)((xx >> (8 * e)) & 255);
        acc.v[l] += s;
    }
    return acc;
}
static inline vi SKF(dots)(vi acc, vi w, vi x) {
    for (int l = 0; l < 16; ++l) {
        const uint32_t ww = (uint32_t)w.v[l], xx = (uint32_t)x.v[l];
        int32_t s = 0;
        for (int e = 0; e < 4; ++e) s += (int32_t)(int8_t)((ww >> (8 * e)) & 255) * (int32_t)(int8_t)((xx >> (8 * e)) & 255);
        acc.v[l] += s;
    }
    return acc;
}
static inline vi SKF(dot16)(vi acc, vi a, vi b) {
    for (int l = 0; l < 16; ++l) {
        const uint32_t aa = (uint32_t)a.v[l], bb = (uint32_t)b.v[l];
        acc.v[l] += (int32_t)(int16_t)(aa & 0xFFFF) * (int32_t)(int16_t)(bb & 0xFFFF) + (int32_t)(int16_t)(aa >> 16) * (int32_t)(int16_t)(bb >> 16);
    }
    return acc;
}
#define DOTU(acc, w, x) SKF(dotu)(acc, w, x)
#define DOTS(acc, w, x) SKF(dots)(acc, w, x)
#define DOT16(acc, a, b) SKF(dot16)(acc, a, b)
#define I8_BIAS 0
#define HI_X16 0
#define RB 4
#define RB_Q4K 4
#endif

#define XSET(p) VI32(sk_ld32(p))
_Static_assert(RB_Q4K <= RB, "the row dispatch (SK_ROWS_CASES) covers RB rows");
#define HALVES (SK_P / LANES)
