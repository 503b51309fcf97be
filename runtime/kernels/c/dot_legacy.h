/* Panel kernels of the 32-weight blocks (Q8_0 activations): Q8_0 and Q5_0 (signed bytes:
 * Q5_0's 5-bit values are unpacked to bytes at export), Q5_1 (unsigned bytes 0..31 and a
 * min), Q4_0 and Q4_1 (nibbles), IQ4_NL (nibbles looked up in its table).
 * Kernel body: included by kernels.h once per ISA path, as dot_kquants.h.
 */

/* Q8_0 / Q5_0 panels (signed bytes): y[r][c] += isum * (dw * dx) per 32-block */
static inline __attribute__((always_inline)) void i8_rows(const uint8_t *w, int nb, const sk_a32 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                          int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_I8_PSB;
        if (pf) sk_prefetch(o + 4 * SK_PF_AHEAD_LEG * SK_I8_PSB, SK_I8_PSB);
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
static inline __attribute__((always_inline)) void u4_rows(const uint8_t *w, int nb, int with_min, const sk_a32 *X, int ldx, int Q, float *y, int ldy, int h,
                                                          int accum, int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F);
    const int psb = with_min ? SK_Q41_PSB : SK_Q40_PSB;
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * psb;
        if (pf) sk_prefetch(o + 8 * SK_PF_AHEAD_LEG * psb, psb);
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

/* IQ4_NL panels (Q4_0's layout: the file's nibbles, d): each nibble looked up in the table
 * (sk_iq4nl_values) as it is read, so a block streams 18 bytes, not the 34 of its values as
 * bytes; per 32-block y += isum * (dw * dx), isum exact: the same int32 sums and float
 * operations as those values in Q8_0 panels (i8_rows) */
static inline __attribute__((always_inline)) void iq4nl_rows(const uint8_t *w, int nb, const sk_a32 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                             int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F), tab = VTAB16S(sk_iq4nl_values);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_IQ4NL_PSB;
        if (pf) sk_prefetch(o + 8 * SK_PF_AHEAD_LEG * SK_IQ4NL_PSB, SK_IQ4NL_PSB);
        const vf dw = H2F((const uint16_t *)(o + 16 * SK_P) + h * LANES);
        vi a[RB];
        for (int r = 0; r < Q; ++r) a[r] = VZERO();
        for (int t = 0; t < 4; ++t) {
            const vi v = VLOADW(o + (size_t)(t * SK_P) * 4 + h * LANES * 4);
            const vi wl = VLUT(tab, VAND(v, m4)), wh = VLUT(tab, VAND(VSRL16(v, 4), m4));
#pragma GCC unroll 4
            for (int r = 0; r < Q; ++r) {
                const int8_t *xq = X[(size_t)r * ldx + b].q;
                a[r] = DOTS_TAB(a[r], wl, XSET(xq + 4 * t));
                a[r] = DOTS_TAB(a[r], wh, XSET(xq + 16 + 4 * t));
            }
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

/* Q5_1 panels (5-bit values 0..31 unpacked to bytes at export, min m): per 32-block
 * y += isum * (dw * dx); y += (mw * dx) * xsum, as Q4_1 (u4_rows) */
static inline __attribute__((always_inline)) void q5_1_rows(const uint8_t *w, int nb, const sk_a32 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                            int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_Q51_PSB;
        if (pf) sk_prefetch(o + 4 * SK_PF_AHEAD_LEG * SK_Q51_PSB, SK_Q51_PSB);
        const uint16_t *dd = (const uint16_t *)(o + 32 * SK_P);
        const vf dw = H2F(dd + h * LANES), mw = H2F(dd + SK_P + h * LANES);
        vi a[RB];
        for (int r = 0; r < Q; ++r) a[r] = VZERO();
        for (int t = 0; t < 8; ++t) {
            const vi v = VLOADW(o + (size_t)(t * SK_P) * 4 + h * LANES * 4);
#pragma GCC unroll 4
            for (int r = 0; r < Q; ++r) a[r] = DOTU(a[r], v, XSET(X[(size_t)r * ldx + b].q + 4 * t));
        }
#pragma GCC unroll 4
        for (int r = 0; r < Q; ++r) {
            const sk_a32 *xb = &X[(size_t)r * ldx + b];
            const vf dx = FSET1(xb->d);
            yacc[r] = FMA(VCVT(a[r]), FMUL(dw, dx), yacc[r]);
            yacc[r] = FMA(FMUL(mw, dx), FSET1((float)xb->sum), yacc[r]);
        }
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

/* Q8_0 / Q5_0 panels [p0, p1) of m for q rows (sk_panels_fn: y[0] is column p0 * SK_P) */
static void i8_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 32;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_I8_PSB;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a32 *x = (const sk_a32 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) i8_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* Q5_1 panels [p0, p1) of m for q rows (sk_panels_fn) */
static void q5_1_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 32;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_Q51_PSB;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a32 *x = (const sk_a32 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) q5_1_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* IQ4_NL panels [p0, p1) of m for q rows (sk_panels_fn) */
static void iq4nl_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 32;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_IQ4NL_PSB;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a32 *x = (const sk_a32 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) iq4nl_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* Q4_0 (with_min 0) / Q4_1 (with_min 1) panels [p0, p1) of m for q rows (sk_panels_fn) */
static inline __attribute__((always_inline)) void u4_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum,
                                                            const int with_min) {
    const int nb = m->k / 32;
    const size_t psb = with_min ? SK_Q41_PSB : SK_Q40_PSB;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * psb;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a32 *x = (const sk_a32 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) u4_rows(w, nb, with_min, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}
