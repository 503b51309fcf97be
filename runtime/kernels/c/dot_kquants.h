/* Panel kernels of the 256-weight blocks (Q8_K activations): the K-quants Q2_K, Q4_K, Q5_K and
 * Q6_K (Q3_K's values are laid out as Q6_K panels: its kernel is Q6_K's), and IQ4_XS.
 * Kernel body: included by kernels.h once per ISA path (isa_*.c) and compiled there against
 * that path's vector backend (vec_*.h); each type's entry point per path is a one-line
 * function in isa_*.c, named sk_<type>_panels_<path>, listed in the block-type table (types.c).
 *
 * A rows kernel (q4k_rows, q6k_rows) computes Q rows (Q <= RB, a constant where it is
 * inlined) of one panel half (h: LANES of its 16 columns) over all K blocks, each weight
 * loaded and unpacked once for the Q rows; a panels function runs it over panels [p0, p1)
 * and passes of rows.
 */

/* Q4_K: y[r][c] += xd * (sum_i (ilo*d*sc_2i + ihi*d*sc_2i+1) - dmin * sum_j m_j * xsum32_j) */
static inline __attribute__((always_inline)) void q4k_rows(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                           int pf) {
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
static inline __attribute__((always_inline)) void q6k_rows(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                           int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F), m30 = VI32(0x30303030), lo16 = VI32(0xFFFF);
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
            /* unrolled so that u's parity and shift are constants: no branch or variable shift a value */
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) {
                const int sb = 4 * g + u;
                vi a[RB];
                for (int r = 0; r < Q; ++r) a[r] = VZERO();
                for (int t = 0; t < 4; ++t) {
                    if ((u & 1) == 0) lq[t] = VLOADW(o + (size_t)(((sb >> 1) * 4 + t) * SK_P) * 4 + h * LANES * 4);
                    const vi lo = (u & 1) ? VAND(VSRL16(lq[t], 4), m4) : VAND(lq[t], m4);
                    /* bits 2u, 2u+1 of each qh byte moved to bits 4, 5 by one 16-bit shift (no bit
                     * crosses into the masked places from the other byte), then masked */
                    const vi hb = VAND(u < 3 ? VSLL16(hq[t], 4 - 2 * u) : VSRL16(hq[t], 2), m30);
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

/* Q5_K: Q4_K's nibbles, scales and mins with a fifth bit per value from the qh plane (bit
 * 2i + half of a byte: sub-block 2i + half):
 * y[r][c] += xd * (sum_j a_j * d * sc_j - dmin * sum_j m_j * xsum32_j), values 0..31 */
static inline __attribute__((always_inline)) void q5k_rows(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                           int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F), m10 = VI32(0x10101010);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_Q5K_PSB;
        if (pf) sk_prefetch(o + SK_PF_AHEAD * SK_Q5K_PSB, SK_Q5K_PSB);
        const uint8_t *qh = o + 128 * SK_P, *sc = qh + 32 * SK_P, *mn = sc + 8 * SK_P;
        const uint16_t *dd = (const uint16_t *)(mn + 8 * SK_P);
        const vf d = H2F(dd + h * LANES), dmin = H2F(dd + SK_P + h * LANES);
        vf s[RB];
        for (int r = 0; r < Q; ++r) s[r] = FZERO();
        /* unrolled so that each sub-block's bit place is a constant shift */
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 2
            for (int half = 0; half < 2; ++half) {
                vi a[RB];
                for (int r = 0; r < Q; ++r) a[r] = VZERO();
                for (int t = 0; t < 8; ++t) {
                    const vi v = VLOADW(o + (size_t)((i * 8 + t) * SK_P) * 4 + h * LANES * 4);
                    const vi hv = VLOADW(qh + (size_t)(t * SK_P) * 4 + h * LANES * 4);
                    const vi lo = half ? VAND(VSRL16(v, 4), m4) : VAND(v, m4);
                    /* bit n = 2i + half of each qh byte moved to bit 4 by one 16-bit shift (no bit
                     * crosses into bit 4 from the other byte), then masked */
                    const int n = 2 * i + half;
                    const vi wq = VOR(lo, VAND(n <= 4 ? VSLL16(hv, 4 - n) : VSRL16(hv, n - 4), m10)); /* 0..31 */
#pragma GCC unroll 8
                    for (int r = 0; r < Q; ++r) a[r] = DOTU(a[r], wq, XSET(X[(size_t)r * ldx + b].q + 64 * i + 32 * half + 4 * t));
                }
                const vf sv = FMUL(d, U82F(sc + (2 * i + half) * SK_P + h * LANES));
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

/* Q2_K: 2-bit values (GGUF's own bytes), 4-bit scale and min per 16:
 * y[r][c] += xd * (d * float(sum_s sc_s * a_s) - dmin * float(sum_s m_s * xsum16_s)), the sums
 * exact int32 */
static inline __attribute__((always_inline)) void q2k_rows(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                           int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m3 = VI32(0x03030303);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_Q2K_PSB;
        if (pf) sk_prefetch(o + SK_PF_AHEAD * SK_Q2K_PSB, SK_Q2K_PSB);
        const uint8_t *sc = o + 64 * SK_P, *mn = sc + 16 * SK_P;
        const uint16_t *dd = (const uint16_t *)(mn + 16 * SK_P);
        const vf d = H2F(dd + h * LANES), dmin = H2F(dd + SK_P + h * LANES);
        vi is[RB];
        for (int r = 0; r < Q; ++r) is[r] = VZERO();
        for (int g = 0; g < 2; ++g)
            for (int sh = 0; sh < 4; ++sh)
                for (int hb = 0; hb < 2; ++hb) { /* sub-block 8g + 2sh + hb: values 128g + 32sh + 16hb .. +16 */
                    vi a[RB];
                    for (int r = 0; r < Q; ++r) a[r] = VZERO();
                    for (int tt = 0; tt < 4; ++tt) {
                        const int t = 4 * hb + tt;
                        const vi v = VLOADW(o + (size_t)((g * 8 + t) * SK_P) * 4 + h * LANES * 4);
                        const vi wq = VAND(VSRL16(v, 2 * sh), m3); /* 0..3 */
#pragma GCC unroll 8
                        for (int r = 0; r < Q; ++r) a[r] = DOTU(a[r], wq, XSET(X[(size_t)r * ldx + b].q + 128 * g + 32 * sh + 4 * t));
                    }
                    const vi scv = U8TO32(sc + (8 * g + 2 * sh + hb) * SK_P + h * LANES);
#pragma GCC unroll 8
                    for (int r = 0; r < Q; ++r) is[r] = VADD32(is[r], VMUL32(a[r], scv));
                }
        vi mp[8]; /* m_2j | m_2j+1 << 16 per lane, against the int16 pair of 16-sums */
        for (int j = 0; j < 8; ++j) mp[j] = VOR(U8TO32(mn + 2 * j * SK_P + h * LANES), VSLL32(U8TO32(mn + (2 * j + 1) * SK_P + h * LANES), 16));
#pragma GCC unroll 4
        for (int r = 0; r < Q; ++r) {
            const sk_a256 *xb = &X[(size_t)r * ldx + b];
            vi ma = VZERO();
            for (int j = 0; j < 8; ++j) ma = DOT16(ma, mp[j], XSET(xb->bs16 + 2 * j));
            yacc[r] = FMA(FSET1(xb->d), FNMA(dmin, VCVT(ma), FMUL(d, VCVT(is[r]))), yacc[r]);
        }
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

/* IQ4_XS: the file's nibbles (per sub-block of 32 as Q4_0's: value l in byte l's low nibble,
 * 16 + l in its high) looked up in IQ4_NL's table as they are read, a 6-bit signed scale per 32
 * and d per 256: y[r][c] += xd * (d * float(sum_j sc_j * a_j)), the sum exact int32 (|sum| < 2^28) */
static inline __attribute__((always_inline)) void iq4xs_rows(const uint8_t *w, int nb, const sk_a256 *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                             int pf) {
    vf yacc[RB];
    for (int r = 0; r < Q; ++r) yacc[r] = FZERO();
    const vi m4 = VI32(0x0F0F0F0F), tab = VTAB16S(sk_iq4nl_values);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * SK_IQ4XS_PSB;
        if (pf) sk_prefetch(o + SK_PF_AHEAD * SK_IQ4XS_PSB, SK_IQ4XS_PSB);
        const int8_t *sc = (const int8_t *)(o + 128 * SK_P);
        const vf d = H2F((const uint16_t *)(sc + 8 * SK_P) + h * LANES);
        vi is[RB];
        for (int r = 0; r < Q; ++r) is[r] = VZERO();
        for (int j = 0; j < 8; ++j) {
            vi a[RB];
            for (int r = 0; r < Q; ++r) a[r] = VZERO();
            for (int t = 0; t < 4; ++t) {
                const vi v = VLOADW(o + (size_t)((j * 4 + t) * SK_P) * 4 + h * LANES * 4);
                const vi wl = VLUT(tab, VAND(v, m4)), wh = VLUT(tab, VAND(VSRL16(v, 4), m4));
#pragma GCC unroll 8
                for (int r = 0; r < Q; ++r) {
                    const int8_t *xq = X[(size_t)r * ldx + b].q + 32 * j;
                    a[r] = DOTS_TAB(a[r], wl, XSET(xq + 4 * t));
                    a[r] = DOTS_TAB(a[r], wh, XSET(xq + 16 + 4 * t));
                }
            }
            const vi scv = I8TO32(sc + j * SK_P + h * LANES);
#pragma GCC unroll 8
            for (int r = 0; r < Q; ++r) is[r] = VADD32(is[r], VMUL32(VSUB32(a[r], VI32(I8_BIAS * X[(size_t)r * ldx + b].bs32[j])), scv));
        }
#pragma GCC unroll 8
        for (int r = 0; r < Q; ++r) yacc[r] = FMA(FSET1(X[(size_t)r * ldx + b].d), FMUL(d, VCVT(is[r])), yacc[r]);
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        FSTORE(yr, accum ? FADD(FLOAD(yr), yacc[r]) : yacc[r]);
    }
}

/* Q4_K panels [p0, p1) of m for q rows (sk_panels_fn: y[0] is column p0 * SK_P) */
static void q4k_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 256;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_Q4K_PSB;
        for (int r0 = 0; r0 < q; r0 += RB_Q4K) { /* Q4_K keeps 4 registers a row: fewer rows a pass */
            const int Q = q - r0 < RB_Q4K ? q - r0 : RB_Q4K;
            const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0; /* the first pass over a panel streams it from memory: fetch ahead */
#define CALL(QQ) q4k_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* Q6_K panels [p0, p1) of m for q rows (sk_panels_fn) */
static void q6k_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 256;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_Q6K_PSB;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) q6k_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* Q5_K panels [p0, p1) of m for q rows (sk_panels_fn) */
static void q5k_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 256;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_Q5K_PSB;
        for (int r0 = 0; r0 < q; r0 += RB_Q4K) {
            const int Q = q - r0 < RB_Q4K ? q - r0 : RB_Q4K;
            const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) q5k_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* Q2_K panels [p0, p1) of m for q rows (sk_panels_fn) */
static void q2k_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 256;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_Q2K_PSB;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) q2k_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}

/* IQ4_XS panels [p0, p1) of m for q rows (sk_panels_fn) */
static void iq4xs_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    const int nb = m->k / 256;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * nb * SK_IQ4XS_PSB;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const sk_a256 *x = (const sk_a256 *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) iq4xs_rows(w, nb, x, ldx, QQ, yp, ldy, h, accum, pf)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}
