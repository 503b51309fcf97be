/* One ISA's kernels: included by sk.c three times (SK_LEVEL 2 = AVX-512 VNNI, 1 = AVX2,
 * 0 = portable C), each inside its own `#pragma GCC target` region, with SKF(name) giving
 * each copy its own names. Plain C loops here are written lane by lane (fixed 16-lane
 * partial sums, fixed reduction trees) so that the vectoriser of each ISA computes the
 * same operations per lane: a result's bits never depend on the ISA, the call width or the
 * thread split.
 */
#include "sk_vec.h"

/* ---------------------------------------------------------------- panel kernels: RB rows */

/* Q4_K: y[r][c] += xd * (sum_i (ilo*d*sc_2i + ihi*d*sc_2i+1) - dmin * sum_j m_j * xsum32_j) */
static inline __attribute__((always_inline)) void SKF(q4k_rows)(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h,
                                                                 int accum, int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F);
#if HI_X16
    const vi mh = VI32((int)0xF0F0F0F0);
    const vf sixteenth = FSET1(1.f / 16.f);
#endif
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_Q4K_PSB;
        if (pf) sk_prefetch(o + SK_PF_AHEAD * SK_Q4K_PSB, SK_Q4K_PSB);
        const uint8_t *sc = o + 128 * SK_P, *mn = sc + 8 * SK_P;
        const uint16_t *dd = (const uint16_t *)(mn + 8 * SK_P);
        const vf d = H2F(dd + h * LANES), dmin = H2F(dd + SK_P + h * LANES);
        vf s[RB];
        for (int r = 0; r < Q; ++r) s[r] = FZERO();
        for (int i = 0; i < 4; ++i) {
            /* sub-block 2i (low nibbles), then 2i+1 (high): one int32 accumulator a row at a time,
             * the 64-byte weight loads repeated from L1 for the second */
            for (int half = 0; half < 2; ++half) {
                vi a[RB];
                for (int r = 0; r < Q; ++r) a[r] = VZERO();
                for (int t = 0; t < 8; ++t) {
                    const vi v = VLOADW(o + (size_t)((i * 8 + t) * SK_P) * 4 + h * LANES * 4);
#if HI_X16
                    const vi wq = half ? VAND(v, mh) : VAND(v, m4);
#else
                    const vi wq = half ? VAND(VSRL16(v, 4), m4) : VAND(v, m4);
#endif
#pragma GCC unroll 8
                    for (int r = 0; r < Q; ++r) a[r] = DOTU(a[r], wq, XSET(X[(size_t)r * ldx + b].q + 64 * i + 32 * half + 4 * t));
                }
#if HI_X16
                const vf sv = half ? FMUL(FMUL(d, U82F(sc + (2 * i + 1) * SK_P + h * LANES)), sixteenth) : FMUL(d, U82F(sc + (2 * i) * SK_P + h * LANES));
#else
                const vf sv = FMUL(d, U82F(sc + (2 * i + half) * SK_P + h * LANES));
#endif
#pragma GCC unroll 8
                for (int r = 0; r < Q; ++r) s[r] = FMA(VCVT(a[r]), sv, s[r]);
            }
        }
        vi mp[4]; /* m_2i | m_2i+1 << 16 per lane, against the int16 pair of 32-sums */
        for (int i = 0; i < 4; ++i) mp[i] = VOR(U8TO32(mn + 2 * i * SK_P + h * LANES), VSLL32(U8TO32(mn + (2 * i + 1) * SK_P + h * LANES), 16));
#pragma GCC unroll 4
        for (int r = 0; r < Q; ++r) {
            const sk_a256 *xb = &X[(size_t)r * ldx + b];
            vi ma = VZERO();
            for (int i = 0; i < 4; ++i) ma = DOT16(ma, mp[i], XSET(xb->bs32 + 2 * i));
            yacc[r] = FMA(FSET1(xb->d), FNMA(dmin, VCVT(ma), s[r]), yacc[r]);
        }
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

/* Q6_K: y[r][c] += xd * (d * float(isum)), isum = sum_s sc_s * a_s - 32 * sum_s sc_s * xsum16_s, all in
 * exact int32 (|isum| < 4e8): one rounding per super-block, the offset term by int16 pairs */
static inline __attribute__((always_inline)) void SKF(q6k_rows)(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h,
                                                                 int accum, int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F), m3 = VI32(0x03030303), lo16 = VI32(0xFFFF);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_Q6K_PSB;
        if (pf) sk_prefetch(o + SK_PF_AHEAD * SK_Q6K_PSB, SK_Q6K_PSB);
        const uint8_t *qh = o + 128 * SK_P;
        const int8_t *sc = (const int8_t *)(qh + 64 * SK_P);
        const vf d = H2F((const uint16_t *)(sc + 16 * SK_P) + h * LANES);
        vi is[RB];
        for (int r = 0; r < Q; ++r) is[r] = VZERO();
        for (int g = 0; g < 4; ++g) {
            vi hq[4], lq[4] = {VZERO(), VZERO(), VZERO(), VZERO()};
            for (int t = 0; t < 4; ++t) hq[t] = VLOADW(qh + (size_t)((g * 4 + t) * SK_P) * 4 + h * LANES * 4);
            for (int u = 0; u < 4; ++u) {
                const int sb = 4 * g + u;
                vi a[RB];
                for (int r = 0; r < Q; ++r) a[r] = VZERO();
                for (int t = 0; t < 4; ++t) {
                    if ((u & 1) == 0) lq[t] = VLOADW(o + (size_t)(((sb >> 1) * 4 + t) * SK_P) * 4 + h * LANES * 4);
                    const vi lo = (u & 1) ? VAND(VSRL16(lq[t], 4), m4) : VAND(lq[t], m4);
                    const vi hb = VSLL16(VAND(u ? VSRL16(hq[t], 2 * u) : hq[t], m3), 4);
                    const vi wq = VOR(lo, hb); /* 0..63 */
#pragma GCC unroll 8
                    for (int r = 0; r < Q; ++r) a[r] = DOTU(a[r], wq, XSET(X[(size_t)r * ldx + b].q + 16 * sb + 4 * t));
                }
                const vi scv = I8TO32(sc + sb * SK_P + h * LANES);
#pragma GCC unroll 8
                for (int r = 0; r < Q; ++r) is[r] = VADD32(is[r], VMUL32(a[r], scv));
            }
        }
        vi scp[8]; /* sc_2j | sc_2j+1 << 16 as int16 pairs, against the pairs of 16-sums */
        for (int j = 0; j < 8; ++j) scp[j] = VOR(VAND(I8TO32(sc + 2 * j * SK_P + h * LANES), lo16), VSLL32(I8TO32(sc + (2 * j + 1) * SK_P + h * LANES), 16));
#pragma GCC unroll 8
        for (int r = 0; r < Q; ++r) {
            const sk_a256 *xb = &X[(size_t)r * ldx + b];
            vi m = VZERO();
            for (int j = 0; j < 8; ++j) m = DOT16(m, scp[j], XSET(xb->bs16 + 2 * j));
            yacc[r] = FMA(FSET1(xb->d), FMUL(d, VCVT(VSUB32(is[r], VSLL32(m, 5)))), yacc[r]);
        }
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

/* Q8_0 / Q5_0 panels (signed bytes): y[r][c] += isum * (dw * dx) per 32-block */
static inline __attribute__((always_inline)) void SKF(i8_rows)(const uint8_t *w, int nb, const sk_a32 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                               int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_I8_PSB;
        if (pf) sk_prefetch(o + 4 * SK_PF_AHEAD * SK_I8_PSB, SK_I8_PSB);
        const vf dw = H2F((const uint16_t *)(o + 32 * SK_P) + h * LANES);
        vi a[RB];
        for (int r = 0; r < Q; ++r) a[r] = VZERO();
        for (int t = 0; t < 8; ++t) {
            const vi v = VLOADW(o + (size_t)(t * SK_P) * 4 + h * LANES * 4);
#pragma GCC unroll 4
            for (int r = 0; r < Q; ++r) a[r] = DOTS(a[r], v, XSET(X[(size_t)r * ldx + b].q + 4 * t));
        }
#pragma GCC unroll 4
        for (int r = 0; r < Q; ++r) {
            const sk_a32 *xb = &X[(size_t)r * ldx + b];
            const vi isum = VSUB32(a[r], VI32(I8_BIAS * xb->sum));
            yacc[r] = FMA(VCVT(isum), FMUL(dw, FSET1(xb->d)), yacc[r]);
        }
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

/* Q4_0 (offset 8) / Q4_1 (min m) panels of nibbles: per 32-block
 * Q4_0: y += (isum - 8 * xsum) * (dw * dx);  Q4_1: y += isum * (dw * dx); y += (mw * dx) * xsum */
static inline __attribute__((always_inline)) void SKF(u4_rows)(const uint8_t *w, int nb, int with_min, const sk_a32 *X, int ldx, int Q, float *y, int ldy, int h,
                                                                int accum, int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F);
    const int psb = with_min ? SK_Q41_PSB : SK_Q40_PSB;
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * psb;
        if (pf) sk_prefetch(o + 8 * SK_PF_AHEAD * psb, psb);
        const uint16_t *dd = (const uint16_t *)(o + 16 * SK_P);
        const vf dw = H2F(dd + h * LANES);
        vi a[RB];
        for (int r = 0; r < Q; ++r) a[r] = VZERO();
        for (int t = 0; t < 4; ++t) {
            const vi v = VLOADW(o + (size_t)(t * SK_P) * 4 + h * LANES * 4);
            const vi wl = VAND(v, m4), wh = VAND(VSRL16(v, 4), m4);
#pragma GCC unroll 4
            for (int r = 0; r < Q; ++r) {
                const int8_t *xq = X[(size_t)r * ldx + b].q;
                a[r] = DOTU(a[r], wl, XSET(xq + 4 * t));
                a[r] = DOTU(a[r], wh, XSET(xq + 16 + 4 * t));
            }
        }
        if (with_min) {
            const vf mw = H2F(dd + SK_P + h * LANES);
#pragma GCC unroll 4
            for (int r = 0; r < Q; ++r) {
                const sk_a32 *xb = &X[(size_t)r * ldx + b];
                const vf dx = FSET1(xb->d);
                yacc[r] = FMA(VCVT(a[r]), FMUL(dw, dx), yacc[r]);
                yacc[r] = FMA(FMUL(mw, dx), FSET1((float)xb->sum), yacc[r]);
            }
        } else {
#pragma GCC unroll 4
            for (int r = 0; r < Q; ++r) {
                const sk_a32 *xb = &X[(size_t)r * ldx + b];
                yacc[r] = FMA(VCVT(VSUB32(a[r], VI32(8 * xb->sum))), FMUL(dw, FSET1(xb->d)), yacc[r]);
            }
        }
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

#if RB != 8 && RB != 4
#error "SK_ROWS_CASES dispatches passes of 4 or 8 rows only: another RB would leave rows of a pass unwritten"
#endif
#if RB == 8
#define SK_ROWS_CASES(CALL) \
    switch (Q) {            \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    case 4: CALL(4); break; \
    case 5: CALL(5); break; \
    case 6: CALL(6); break; \
    case 7: CALL(7); break; \
    default: CALL(8); break; \
    }
#else
#define SK_ROWS_CASES(CALL) \
    switch (Q) {            \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    default: CALL(4); break; \
    }
#endif

/* panels [p0, p1) of m for q rows of activations X (ldx blocks a row) into y (ldy floats a
 * row); accum: add into y (a residual) instead of storing */
static void SKF(mm)(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int t = m->type, kb = sk_is_kquant(t) ? 256 : 32, nb = m->k / kb;
    const size_t psb = sk_psb(t);
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * psb;
        const int rb = t == SK_Q4_K ? RB_Q4K : RB; /* Q4_K keeps 4 registers a row: fewer rows a pass */
        for (int r0 = 0; r0 < q; r0 += rb) {
            const int Q = q - r0 < rb ? q - r0 : rb;
            float *yp = y + (size_t)r0 * ldy + (size_t)p * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0; /* the first pass over a panel streams it from memory: fetch ahead */
                if (t == SK_Q4_K) {
                    const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
#define C4K(QQ) SKF(q4k_rows)(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                    SK_ROWS_CASES(C4K)
                } else if (t == SK_Q6_K) {
                    const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
#define C6K(QQ) SKF(q6k_rows)(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                    SK_ROWS_CASES(C6K)
                } else if (t == SK_Q8_0 || t == SK_Q5_0) {
                    const sk_a32 *x = (const sk_a32 *)X + (size_t)r0 * ldx;
#define CI8(QQ) SKF(i8_rows)(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                    SK_ROWS_CASES(CI8)
                } else {
                    const sk_a32 *x = (const sk_a32 *)X + (size_t)r0 * ldx;
                    const int with_min = t == SK_Q4_1;
#define CU4(QQ) SKF(u4_rows)(w, nb, with_min, x, ldx, QQ, yp, ldy, h, accum, pf)
                    SK_ROWS_CASES(CU4)
                }
#undef C4K
#undef C6K
#undef CI8
#undef CU4
            }
        }
    }
}

/* ---------------------------------------------------------------- element-wise, lane-structured */

/* sum of 16 lanes by a fixed tree: ((l0+l8)+(l4+l12))+... */
static inline float SKF(tree16)(float *part) {
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; ++l) part[l] = part[l] + part[l + w];
    return part[0];
}

/* 16 f16 values to f32 (exact on every path) */
static inline void SKF(cvt16)(const uint16_t *h, float *out) {
#if SK_LEVEL == 2
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)));
#elif SK_LEVEL == 1
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
#else
    for (int l = 0; l < 16; ++l) out[l] = sk_h2f(h[l]);
#endif
}

/* out = x * (1 / sqrt(mean(x^2) + eps)) * w; x, w, out [n] */
static void SKF(rmsnorm)(const float *x, const float *w, int n, float eps, float *out) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) part[l] = part[l] + x[i + l] * x[i + l];
    for (; i < n; ++i) part[i & 15] = part[i & 15] + x[i] * x[i];
    const float scale = 1.f / sqrtf(SKF(tree16)(part) / (float)n + eps);
    for (i = 0; i < n; ++i) out[i] = (x[i] * scale) * w[i];
}

/* e^x for x <= 88 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial),
 * mul/add only so that every ISA computes the same bits; flushes to 0 below -87.3 */
static inline float SKF(expf)(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = (p * (r * r) + r) + 1.f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* g[i] = silu(g[i]) * u[i] */
static void SKF(silu_mul)(float *g, const float *u, int n) {
    for (int i = 0; i < n; ++i) g[i] = (g[i] / (1.f + SKF(expf)(-g[i]))) * u[i];
}

/* llama.cpp's Q8_K activations: per 256, iscale = -127 / (the value of largest magnitude),
 * q = nearest(iscale * x) (<= 127), d = 1 / iscale; 16- and 32-sums of q. A block holding a
 * NaN gets d = NaN (its products NaN: the caller refuses the logits, never reads a token
 * computed as if the NaN were 0) */
static void SKF(quant_a256)(const float *x, int k, sk_a256 *out) {
    for (int b = 0; b < k / 256; ++b) {
        const float *xb = x + (size_t)b * 256;
        sk_a256 *o = out + b;
        float amax = 0.f, max = 0.f;
        int nan = 0;
        for (int j = 0; j < 256; ++j) {
            const float a = fabsf(xb[j]);
            nan |= a != a;
            if (a > amax) {
                amax = a;
                max = xb[j];
            }
        }
        if (amax == 0.f || nan) {
            memset(o, 0, sizeof *o);
            if (nan) o->d = NAN;
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; ++j) {
            const int v = (int)((iscale * xb[j] + 12582912.f) - 12582912.f);
            o->q[j] = (int8_t)(v > 127 ? 127 : v);
        }
        o->d = 1.f / iscale;
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int i = 0; i < 16; ++i) s += o->q[16 * g + i];
            o->bs16[g] = (int16_t)s;
        }
        for (int j = 0; j < 8; ++j) o->bs32[j] = (int16_t)(o->bs16[2 * j] + o->bs16[2 * j + 1]);
    }
}

/* llama.cpp's Q8_0 activations: per 32, d = amax / 127 (kept as f16, as its block stores it),
 * q = nearest(x / d); and the sum of q. A block holding a NaN gets d = NaN, as quant_a256 */
static void SKF(quant_a32)(const float *x, int k, sk_a32 *out) {
    for (int b = 0; b < k / 32; ++b) {
        const float *xb = x + (size_t)b * 32;
        sk_a32 *o = out + b;
        float amax = 0.f;
        int nan = 0;
        for (int j = 0; j < 32; ++j) {
            amax = fmaxf(amax, fabsf(xb[j]));
            nan |= xb[j] != xb[j];
        }
        if (nan) {
            memset(o, 0, sizeof *o);
            o->d = NAN;
            continue;
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int s = 0;
        for (int j = 0; j < 32; ++j) {
            const int v = (int)((xb[j] * id + 12582912.f) - 12582912.f);
            o->q[j] = (int8_t)v;
            s += v;
        }
        o->d = sk_h2f(sk_f2h(d));
        o->sum = s;
    }
}

/* ---------------------------------------------------------------- the decoder step (args) */

typedef struct {
    const sk_model *m;
    const sk_kv *const *kvs; /* row r's sequence: its KV cache ... */
    const int32_t *pos;      /* ... and its position there (reads rows [0, pos[r]], writes pos[r]) */
    sk_scratch *s;
    const int32_t *tokens;
    int q, lo; /* rows [lo, q) get logits */
    float *logits;
    int ldl;
    int32_t *ids; /* reduced head (sk_step_argmax): rows [lo, q) get their first maximum over ids [0, n_valid) ... */
    float *vals;  /* ... and its logit (inv_temp <= 0) or softmax probability at 1/T = inv_temp, not a logits row */
    int n_valid;
    float inv_temp;
} SKF(step_args);

static inline void SKF(range)(int n, int tid, int nt, int *a, int *b) {
    *a = (int)((int64_t)n * tid / nt);
    *b = (int)((int64_t)n * (tid + 1) / nt);
}

/* quantize rows [r0, r1) of x (ld floats) for every activation kind the mats need */
static void SKF(quant_rows)(sk_scratch *s, const float *x, int ld, int k, int r0, int r1, int need) {
    for (int r = r0; r < r1; ++r) {
        if (need & 1) SKF(quant_a256)(x + (size_t)r * ld, k, s->a256 + (size_t)r * s->lda256);
        if (need & 2) SKF(quant_a32)(x + (size_t)r * ld, k, s->a32 + (size_t)r * s->lda32);
    }
}

/* nm matrices over the same activations: this thread's share of their panels, one list */
static void SKF(mm_share)(sk_scratch *s, const sk_mat *const *mats, float *const *ys, const int *ldy, int nm, int q, int accum, int tid, int nt) {
    int total = 0;
    for (int i = 0; i < nm; ++i) total += mats[i]->n / SK_P;
    int a, b;
    SKF(range)(total, tid, nt, &a, &b);
    int base = 0;
    for (int i = 0; i < nm; ++i) {
        const int np = mats[i]->n / SK_P, lo = a > base ? a - base : 0, hi = b - base < np ? b - base : np;
        if (lo < hi) {
            const int k256 = sk_is_kquant(mats[i]->type);
            SKF(mm)(mats[i], k256 ? (const void *)s->a256 : (const void *)s->a32, k256 ? s->lda256 : s->lda32, q, lo, hi, ys[i], ldy[i], accum);
        }
        base += np;
    }
}

/* 16 float / int32 lanes as GCC vector values: lowered to what each ISA has, the same operations
 * per lane as scalar code */
typedef float SKF(v16) __attribute__((vector_size(64), aligned(4)));
typedef int32_t SKF(v16i) __attribute__((vector_size(64), aligned(4)));

/* o[d] += e[t] * V[t][d] for t in [t0, t1), d < nd (a multiple of 16, at most 128): the same
 * multiply and add per lane in order of t as a scalar loop; o kept in registers over the t */
static inline void SKF(v_rows)(const uint16_t *V, size_t ldv, const float *e, int t0, int t1, float *o, int nd) {
    SKF(v16) acc[8];
    const int nv = nd / 16;
    for (int k = 0; k < nv; ++k) memcpy(&acc[k], o + 16 * k, 64);
    for (int t = t0; t < t1; ++t) {
        const uint16_t *vr = V + (size_t)t * ldv;
        const float et = e[t];
        for (int k = 0; k < nv; ++k) {
            float f[16];
            SKF(cvt16)(vr + 16 * k, f);
            SKF(v16) vf;
            memcpy(&vf, f, 64);
            acc[k] = acc[k] + et * vf;
        }
    }
    for (int k = 0; k < nv; ++k) memcpy(o + 16 * k, &acc[k], 64);
}

/* attention of rows [r0, r0 + nr) of one sequence (cache kv; row r at position pos[r]) for kv
 * head g and heads [h0, h1) of its group: scores, softmax, V. The rows take each K tile and
 * each chunk of V rows in turn while it is in L1 (read from memory once for all of them);
 * each (row, head) output is computed by the same operations as when its row is alone in the
 * call (its accumulators see the same tiles and positions in the same order), and reads only
 * kv's rows [0, pos[r]] */
#define SK_V_CHUNK 32 /* V rows (positions) the block's rows take in turn */

/* scores of one row for K tile j, heads [h0, h0 + nh): sb[i][j*16 + lane]; nh a constant where
 * it is inlined. The accumulators are GCC vector values (16 lanes; lowered to what each ISA
 * has), so they live in registers: lane by lane the same multiplies and adds as scalar code */
static inline __attribute__((always_inline)) void SKF(score_tile)(const uint16_t *kt, const float *Qh, int hd, float scale, float *sb, int lds, int j, const int nh) {
    SKF(v16) acc[SK_GROUP_MAX];
    for (int i = 0; i < nh; ++i) acc[i] = (SKF(v16)){0};
    for (int d = 0; d < hd; ++d) {
        float kf_[16];
        SKF(cvt16)(kt + d * 16, kf_);
        SKF(v16) kf;
        memcpy(&kf, kf_, 64);
        for (int i = 0; i < nh; ++i) acc[i] = acc[i] + Qh[i * hd + d] * kf;
    }
    for (int i = 0; i < nh; ++i) {
        const SKF(v16) y = acc[i] * scale;
        memcpy(sb + i * lds + j * 16, &y, 64);
    }
}

/* SKF(expf) on 16 lanes at once: lane by lane the same operations (the clamps as selects, the
 * same multiplies and adds, the exponent from the same integral n) */
static inline __attribute__((always_inline)) void SKF(expf16)(SKF(v16) *px) {
    SKF(v16) x = *px;
    const SKF(v16) lo = (SKF(v16)){0} - 87.33654f, hi = (SKF(v16)){0} + 88.0f;
    SKF(v16i) m = x < lo;
    x = (SKF(v16))(((SKF(v16i))x & ~m) | ((SKF(v16i))lo & m));
    m = x > hi;
    x = (SKF(v16))(((SKF(v16i))x & ~m) | ((SKF(v16i))hi & m));
    const SKF(v16) n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    SKF(v16) r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    SKF(v16) p = (SKF(v16)){0} + 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = (p * (r * r) + r) + 1.f;
    const SKF(v16i) e = (__builtin_convertvector(n, SKF(v16i)) + 127) << 23;
    *px = p * (SKF(v16))e;
}

/* e = exp(s - mx) in place over s[0, T), and the sum of e by the fixed lane structure
 * (lane t % 16 adds its terms in order of t, then tree16): 16 lanes at a time, the rest alone */
static inline float SKF(softmax_sum)(float *si, int T) {
    float m16[16];
    for (int l2 = 0; l2 < 16; ++l2) m16[l2] = si[0];
    int t = 0;
    /* the maximum: the same value whatever the order (no NaN here; a ternary, not libm's fmaxf) */
    for (; t + 16 <= T; t += 16)
        for (int l2 = 0; l2 < 16; ++l2) m16[l2] = si[t + l2] > m16[l2] ? si[t + l2] : m16[l2];
    float mx = m16[0];
    for (int l2 = 1; l2 < 16; ++l2) mx = m16[l2] > mx ? m16[l2] : mx;
    for (; t < T; ++t) mx = si[t] > mx ? si[t] : mx;
    float part[16] = {0};
    SKF(v16) acc = (SKF(v16)){0};
    for (t = 0; t + 16 <= T; t += 16) {
        SKF(v16) x;
        memcpy(&x, si + t, 64);
        x = x - mx;
        SKF(expf16)(&x);
        memcpy(si + t, &x, 64);
        acc = acc + x;
    }
    memcpy(part, &acc, 64);
    for (; t < T; ++t) {
        si[t] = SKF(expf)(si[t] - mx);
        part[t & 15] = part[t & 15] + si[t];
    }
    return SKF(tree16)(part);
}
static void SKF(attend)(const sk_model *m, const sk_kv *kv, sk_scratch *s, int l, int r0, int nr, const int32_t *pos, int g, int h0, int h1, int tid) {
    const int hd = m->head_dim, nkv = m->n_head_kv, nh = h1 - h0, ctx = m->max_ctx;
    const uint16_t *K = kv->k + (size_t)l * ctx * nkv * hd;
    const uint16_t *V = kv->v + (size_t)l * ctx * nkv * hd;
    int T[SK_ATT_ROWS], Tmax = 0;
    for (int b = 0; b < nr; ++b) {
        T[b] = pos[r0 + b] + 1;
        if (T[b] > Tmax) Tmax = T[b];
    }
    const int ntile = (Tmax + 15) / 16, lds = ntile * 16;
    float *sc = s->scores + (size_t)tid * s->ld_scores; /* [nr][nh][lds] */
    for (int j = 0; j < ntile; ++j) {
        const uint16_t *kt = K + ((size_t)j * nkv + g) * hd * 16;
        for (int b = 0; b < nr; ++b) {
            if (j * 16 >= T[b]) continue; /* a tile past this row's position */
            const float *Qh = s->q + (size_t)(r0 + b) * m->n_head * hd + (size_t)h0 * hd;
            float *sb = sc + (size_t)b * nh * lds;
            const float sc_ = m->attn_scale;
            switch (nh) { /* a constant head count per case: see score_tile */
            case 1: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 1); break;
            case 2: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 2); break;
            case 3: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 3); break;
            case 4: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 4); break;
            case 5: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 5); break;
            case 6: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 6); break;
            case 7: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 7); break;
            default: SKF(score_tile)(kt, Qh, hd, sc_, sb, lds, j, 8); break;
            }
        }
    }
    float inv[SK_ATT_ROWS][SK_GROUP_MAX];
    for (int b = 0; b < nr; ++b) {
        float *out = s->att + (size_t)(r0 + b) * m->n_head * hd;
        for (int i = 0; i < nh; ++i) {
            inv[b][i] = SKF(softmax_sum)(sc + ((size_t)b * nh + i) * lds, T[b]);
            for (int d = 0; d < hd; ++d) out[(h0 + i) * hd + d] = 0.f;
        }
    }
    for (int t0 = 0; t0 < Tmax; t0 += SK_V_CHUNK)
        for (int b = 0; b < nr; ++b) {
            const int t1 = t0 + SK_V_CHUNK < T[b] ? t0 + SK_V_CHUNK : T[b];
            float *out = s->att + (size_t)(r0 + b) * m->n_head * hd;
            const float *sb = sc + (size_t)b * nh * lds;
            for (int i = 0; i < nh; ++i)
                for (int d0 = 0; d0 < hd; d0 += 128) /* 8 lane groups of one head in registers */
                    SKF(v_rows)(V + g * hd + d0, nkv * hd, sb + i * lds, t0, t1, out + (h0 + i) * hd + d0, hd - d0 < 128 ? hd - d0 : 128);
        }
    for (int b = 0; b < nr; ++b) {
        float *out = s->att + (size_t)(r0 + b) * m->n_head * hd;
        for (int i = 0; i < nh; ++i) {
            float *o = out + (h0 + i) * hd;
            for (int d = 0; d < hd; ++d) o[d] = o[d] / inv[b][i];
        }
    }
}
#undef SK_V_CHUNK

static void SKF(rope)(float *v, const float *cs, const float *sn, int hd, int neox) {
    const int half = hd / 2;
    for (int i = 0; i < half; ++i) {
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * cs[i] - x1 * sn[i];
        v[b] = x0 * sn[i] + x1 * cs[i];
    }
}

/* biases, RoPE, and the new K/V rows into each row's cache: items (row, head) over q and kv heads */
static void SKF(qkv_post)(const sk_model *m, const sk_kv *const *kvs, const int32_t *posv, sk_scratch *s, int l, int q, int tid, int nt) {
    const sk_layer *L = &m->layers[l];
    const int hd = m->head_dim, nh = m->n_head, nkv = m->n_head_kv, ctx = m->max_ctx, half = hd / 2;
    const int items = q * (nh + nkv);
    int a, b;
    SKF(range)(items, tid, nt, &a, &b);
    for (int it = a; it < b; ++it) {
        const int r = it / (nh + nkv), h = it % (nh + nkv), pos = posv[r];
        const sk_kv *kv = kvs[r];
        const float *cs = m->rope_cos + (size_t)pos * half, *sn = m->rope_sin + (size_t)pos * half;
        if (h < nh) {
            float *v = s->q + ((size_t)r * nh + h) * hd;
            if (L->bq)
                for (int d = 0; d < hd; ++d) v[d] = v[d] + L->bq[h * hd + d];
            SKF(rope)(v, cs, sn, hd, m->rope_neox);
        } else {
            const int g = h - nh;
            float *kk = s->k + ((size_t)r * nkv + g) * hd, *vv = s->v + ((size_t)r * nkv + g) * hd;
            if (L->bk)
                for (int d = 0; d < hd; ++d) kk[d] = kk[d] + L->bk[g * hd + d];
            if (L->bv)
                for (int d = 0; d < hd; ++d) vv[d] = vv[d] + L->bv[g * hd + d];
            SKF(rope)(kk, cs, sn, hd, m->rope_neox);
            uint16_t *kt = kv->k + (size_t)l * ctx * nkv * hd + (((size_t)(pos / 16) * nkv + g) * hd) * 16 + (pos & 15);
            uint16_t *vr = kv->v + (size_t)l * ctx * nkv * hd + ((size_t)pos * nkv + g) * hd;
            for (int d = 0; d < hd; ++d) {
                kt[d * 16] = sk_f2h(kk[d]);
                vr[d] = sk_f2h(vv[d]);
            }
        }
    }
}

/* ---------------------------------------------------------------- the argmax head */

/* x[0, n) (ids base..base+n-1) into the running first maximum (*bv, *bi; *bi < 0: none yet) as
 * numpy's argmax orders them: NaN ranks above every number and the first NaN stays; among equal
 * maxima the first id. Comparisons only (no arithmetic): the result does not depend on the lanes
 * or the ISA. */
static inline void SKF(argmax_scan)(const float *x, int n, int base, float *bv, int32_t *bi) {
    if (*bi >= 0 && *bv != *bv) return; /* a NaN came first */
    int j = 0;
    if (n >= 16) {
        SKF(v16) mx = *(const SKF(v16) *)x;
        SKF(v16i) nan = mx != mx;
        for (j = 16; j + 16 <= n; j += 16) {
            const SKF(v16) v = *(const SKF(v16) *)(x + j);
            const SKF(v16i) gt = v > mx;
            mx = (SKF(v16))(((SKF(v16i))v & gt) | ((SKF(v16i))mx & ~gt));
            nan |= v != v;
        }
        int any = 0;
        for (int l = 0; l < 16; ++l) any |= nan[l];
        if (any) {
            for (int t = 0; t < j; ++t)
                if (x[t] != x[t]) {
                    *bv = x[t], *bi = base + t;
                    return;
                }
        }
        float m = mx[0];
        for (int l = 1; l < 16; ++l)
            if (mx[l] > m) m = mx[l];
        if (*bi < 0 || m > *bv)
            for (int t = 0; t < j; ++t)
                if (x[t] == m) {
                    *bv = x[t], *bi = base + t; /* x[t], not m: -0.0 == 0.0, the row's own bits */
                    break;
                }
    }
    for (; j < n; ++j) {
        const float v = x[j];
        if (v != v) {
            *bv = v, *bi = base + j;
            return;
        }
        if (*bi < 0 || v > *bv) *bv = v, *bi = base + j;
    }
}

/* sum of exp((x[t] - mx) * it) over t < n by the fixed lane structure (lane t % 16 adds its
 * terms in order of t, then tree16), 16 lanes at a time with expf16, the rest with expf: the
 * same bits on every ISA path */
static float SKF(exp_sum)(const float *x, int n, float mx, float it) {
    SKF(v16) acc = (SKF(v16)){0};
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        SKF(v16) z = (*(const SKF(v16) *)(x + t) - mx) * it;
        SKF(expf16)(&z);
        acc = acc + z;
    }
    float part[16];
    memcpy(part, &acc, 64);
    for (; t < n; ++t) part[t & 15] = part[t & 15] + SKF(expf)((x[t] - mx) * it);
    return SKF(tree16)(part);
}

/* The LM head of nq rows (activations X, ldx blocks a row) reduced over ids [0, n_valid): each
 * row's first maximum, ids[r], and vals[r]: its logit (it <= 0), or (it > 0, a draft's greedy
 * step) its softmax probability at 1/T = it, softmax(logits * it)[ids[r]]. The ids are cut in
 * chunks of SK_HEAD_COLS columns, fixed whatever the thread count; threads take whole chunks,
 * project each into their own small buffer (no logits row is written) and keep per chunk and
 * row its first maximum and its sum of exp((x - max) * it). The chunks are then merged in id
 * order (the first maximum wins; the sum as sum_c s_c * exp((max_c - max) * it) in chunk
 * order), so every result is the same bits for any thread split and ISA path. The logits are
 * the ones the full head writes, bit for bit (the same panel kernels). With F (tests:
 * sk_argmax) the rows are read from F (ldf floats a row) instead of projected. */
static void SKF(head_reduce)(const sk_model *m, sk_scratch *s, const void *X, int ldx, int nq, int n_valid, float it, int32_t *ids, float *vals, int tid,
                             int nt, const float *F, int ldf) {
    const int np = (n_valid + SK_P - 1) / SK_P, ch = SK_HEAD_COLS / SK_P, nc = (np + ch - 1) / ch, mq = s->max_q;
    int a, b;
    SKF(range)(nc, tid, nt, &a, &b);
    float *buf = s->hbuf + (size_t)tid * mq * SK_HEAD_COLS;
    for (int c = a; c < b; ++c) {
        const int c0 = c * ch, c1 = c0 + ch < np ? c0 + ch : np, n0 = c0 * SK_P, n1 = c1 * SK_P < n_valid ? c1 * SK_P : n_valid;
        /* mm writes panel p at column p * SK_P of y: shift y so that panel c0 lands at buf[0] */
        if (!F) SKF(mm)(&m->output, X, ldx, nq, c0, c1, buf - (ptrdiff_t)n0, SK_HEAD_COLS, 0);
        for (int r = 0; r < nq; ++r) {
            const float *x = F ? F + (size_t)r * ldf + n0 : buf + (size_t)r * SK_HEAD_COLS;
            const size_t o = (size_t)c * mq + r;
            float v = 0.f;
            int32_t i = -1;
            SKF(argmax_scan)(x, n1 - n0, n0, &v, &i);
            s->amax_v[o] = v;
            s->amax_i[o] = i;
            if (it > 0.f) s->amax_s[o] = v - v == 0.f ? SKF(exp_sum)(x, n1 - n0, v, it) : 0.f; /* a finite maximum only */
        }
    }
    sk_bar(tid, nt);
    int r0, r1;
    SKF(range)(nq, tid, nt, &r0, &r1);
    for (int r = r0; r < r1; ++r) {
        float v = 0.f;
        int32_t i = -1;
        for (int c = 0; c < nc; ++c) {
            const float cv = s->amax_v[(size_t)c * mq + r];
            if (i < 0 || (v == v && (cv > v || cv != cv))) v = cv, i = s->amax_i[(size_t)c * mq + r];
        }
        ids[r] = i;
        if (it <= 0.f) {
            vals[r] = v;
            continue;
        }
        if (v - v != 0.f) { /* NaN or inf at the maximum: no probability (the caller refuses the row) */
            vals[r] = v - v;
            continue;
        }
        float sum = 0.f;
        for (int c = 0; c < nc; ++c) {
            const size_t o = (size_t)c * mq + r;
            sum = sum + s->amax_s[o] * SKF(expf)((s->amax_v[o] - v) * it);
        }
        vals[r] = 1.f / sum;
    }
}

/* ---------------------------------------------------------------- the decoder step */

static void SKF(step_job)(void *arg, int tid, int nt) {
    const SKF(step_args) *A = (const SKF(step_args) *)arg;
    const sk_model *m = A->m;
    sk_scratch *s = A->s;
    const int q = A->q, E = m->n_embd, hd = m->head_dim, nh = m->n_head, nkv = m->n_head_kv, F = m->n_ff;
    int r0, r1;
    SKF(range)(q, tid, nt, &r0, &r1);
    for (int r = r0; r < r1; ++r) sk_dequant_row(&m->tok_embd, A->tokens[r], s->x + (size_t)r * E);
    sk_bar(tid, nt);
    for (int l = 0; l < m->n_layer; ++l) {
        const sk_layer *L = &m->layers[l];
        for (int r = r0; r < r1; ++r) SKF(rmsnorm)(s->x + (size_t)r * E, L->attn_norm, E, m->norm_eps, s->xn + (size_t)r * E);
        SKF(quant_rows)(s, s->xn, E, E, r0, r1, sk_need(&L->wq) | sk_need(&L->wk) | sk_need(&L->wv));
        sk_bar(tid, nt);
        {
            const sk_mat *mats[3] = {&L->wq, &L->wk, &L->wv};
            float *ys[3] = {s->q, s->k, s->v};
            const int ld[3] = {nh * hd, nkv * hd, nkv * hd};
            SKF(mm_share)(s, mats, ys, ld, 3, q, 0, tid, nt);
        }
        sk_bar(tid, nt);
        SKF(qkv_post)(m, A->kvs, A->pos, s, l, q, tid, nt);
        sk_bar(tid, nt);
        {
            /* items (row block, kv head, head chunk), taken in turn from a counter: blocks differ
             * in rows, and which thread computes an item never changes its bits */
            const int per = nh / nkv, split = s->head_split, chunk = (per + split - 1) / split, items = s->n_blocks * nkv * split;
            for (int it; (it = atomic_fetch_add_explicit(&s->att_next[l], 1, memory_order_relaxed)) < items;) {
                const int bk = it / (nkv * split), g = (it / split) % nkv, c = it % split;
                const int h0 = g * per + c * chunk, h1 = h0 + chunk < (g + 1) * per ? h0 + chunk : (g + 1) * per;
                const int r0 = s->blk_r0[bk];
                if (h0 < h1) SKF(attend)(m, A->kvs[r0], s, l, r0, s->blk_n[bk], A->pos, g, h0, h1, tid);
            }
        }
        sk_bar(tid, nt);
        SKF(quant_rows)(s, s->att, nh * hd, nh * hd, r0, r1, sk_need(&L->wo));
        sk_bar(tid, nt);
        {
            const sk_mat *mats[1] = {&L->wo};
            float *ys[1] = {s->x};
            const int ld[1] = {E};
            SKF(mm_share)(s, mats, ys, ld, 1, q, 1, tid, nt);
        }
        sk_bar(tid, nt);
        for (int r = r0; r < r1; ++r) SKF(rmsnorm)(s->x + (size_t)r * E, L->ffn_norm, E, m->norm_eps, s->xn + (size_t)r * E);
        SKF(quant_rows)(s, s->xn, E, E, r0, r1, sk_need(&L->wgate) | sk_need(&L->wup));
        sk_bar(tid, nt);
        {
            const sk_mat *mats[2] = {&L->wgate, &L->wup};
            float *ys[2] = {s->g, s->u};
            const int ld[2] = {F, F};
            SKF(mm_share)(s, mats, ys, ld, 2, q, 0, tid, nt);
        }
        sk_bar(tid, nt);
        {
            /* SwiGLU and its quantization per activation block: items (row, block) */
            const int need = sk_need(&L->wdown), kb = (need & 1) ? 256 : 32, nb = F / kb, items = q * nb;
            int a, b;
            SKF(range)(items, tid, nt, &a, &b);
            for (int it = a; it < b; ++it) {
                const int r = it / nb, j = it % nb;
                float *gg = s->g + (size_t)r * F + (size_t)j * kb;
                SKF(silu_mul)(gg, s->u + (size_t)r * F + (size_t)j * kb, kb);
                if (need & 1) SKF(quant_a256)(gg, kb, s->a256 + (size_t)r * s->lda256 + (size_t)j);
                if (need & 2) SKF(quant_a32)(gg, kb, s->a32 + (size_t)r * s->lda32 + (size_t)j);
            }
        }
        sk_bar(tid, nt);
        {
            const sk_mat *mats[1] = {&L->wdown};
            float *ys[1] = {s->x};
            const int ld[1] = {E};
            SKF(mm_share)(s, mats, ys, ld, 1, q, 1, tid, nt);
        }
        sk_bar(tid, nt);
    }
    /* the LM head on rows [lo, q) only */
    const int lo = A->lo, nq = q - lo;
    if (nq <= 0) return;
    int s0, s1;
    SKF(range)(nq, tid, nt, &s0, &s1);
    for (int r = lo + s0; r < lo + s1; ++r) SKF(rmsnorm)(s->x + (size_t)r * E, m->out_norm, E, m->norm_eps, s->xn + (size_t)r * E);
    SKF(quant_rows)(s, s->xn, E, E, lo + s0, lo + s1, sk_need(&m->output));
    sk_bar(tid, nt);
    {
        const int k256 = sk_is_kquant(m->output.type);
        const void *X = k256 ? (const void *)(s->a256 + (size_t)lo * s->lda256) : (const void *)(s->a32 + (size_t)lo * s->lda32);
        if (A->ids) {
            SKF(head_reduce)(m, s, X, k256 ? s->lda256 : s->lda32, nq, A->n_valid, A->inv_temp, A->ids + lo, A->vals + lo, tid, nt, NULL, 0);
            return;
        }
        int a, b;
        SKF(range)(m->output.n / SK_P, tid, nt, &a, &b);
        SKF(mm)(&m->output, X, k256 ? s->lda256 : s->lda32, nq, a, b, A->logits + (size_t)lo * A->ldl, A->ldl, 0);
    }
}

static void SKF(step)(const sk_model *m, const sk_kv *const *kvs, const int32_t *pos, sk_scratch *s, const int32_t *tokens, int q, float *logits, int ldl, int lo,
                      int32_t *ids, float *vals, int n_valid, float inv_temp) {
    SKF(step_args) a = {m, kvs, pos, s, tokens, q, lo, logits, ldl, ids, vals, n_valid, inv_temp};
    sk_team_run(SKF(step_job), &a);
}

/* one matmul over float rows x [q][k] (quantized here as the step would), for tests */
typedef struct {
    const sk_mat *m;
    const float *x;
    int q;
    float *y;
    sk_scratch *s;
} SKF(mm_args);

static void SKF(mm_job)(void *arg, int tid, int nt) {
    const SKF(mm_args) *A = (const SKF(mm_args) *)arg;
    int r0, r1;
    SKF(range)(A->q, tid, nt, &r0, &r1);
    SKF(quant_rows)(A->s, A->x, A->m->k, A->m->k, r0, r1, sk_need(A->m));
    sk_bar(tid, nt);
    const sk_mat *mats[1] = {A->m};
    float *ys[1] = {A->y};
    const int ld[1] = {A->m->n};
    SKF(mm_share)(A->s, mats, ys, ld, 1, A->q, 0, tid, nt);
}

static void SKF(matmul)(const sk_mat *m, const float *x, int q, float *y, sk_scratch *s) {
    SKF(mm_args) a = {m, x, q, y, s};
    sk_team_run(SKF(mm_job), &a);
}

/* the reduced head over float rows x [q][ld], ids [0, n) (tests) */
typedef struct {
    const float *x;
    int q, n, ld;
    float it;
    int32_t *ids;
    float *vals;
    sk_scratch *s;
} SKF(amax_args);

static void SKF(amax_job)(void *arg, int tid, int nt) {
    const SKF(amax_args) *A = (const SKF(amax_args) *)arg;
    SKF(head_reduce)(NULL, A->s, NULL, 0, A->q, A->n, A->it, A->ids, A->vals, tid, nt, A->x, A->ld);
}

static void SKF(argmax_rows)(const float *x, int q, int n, int ld, float it, int32_t *ids, float *vals, sk_scratch *s) {
    SKF(amax_args) a = {x, q, n, ld, it, ids, vals, s};
    sk_team_run(SKF(amax_job), &a);
}

#undef LANES
#undef HALVES
#undef RB
#undef RB_Q4K
#undef HI_X16
#undef I8_BIAS
#undef VLOADW
#undef VI32
#undef VZERO
#undef FZERO
#undef VAND
#undef VOR
#undef VXOR
#undef VSRL16
#undef VSLL16
#undef VSLL32
#undef VSUB32
#undef VADD32
#undef VCVT
#undef FMA
#undef FNMA
#undef FMUL
#undef FADD
#undef FSET1
#undef FLOAD
#undef FSTORE
#undef H2F
#undef U82F
#undef I82F
#undef U8TO32
#undef I8TO32
#undef VMUL32
#undef SK_ROWS_CASES
#undef DOTU
#undef DOTS
#undef DOT16
#undef XSET
#undef vi
#undef vf
