/* Panel kernels of float weights (F32, F16 and BF16 matrices) on the float activation rows
 * themselves (SK_ACT_F32: nothing quantized). Kernel body: included by kernels.h once per ISA
 * path, as dot_kquants.h.
 *
 * Panel layout: per k, the 16 columns' values as the file stores them (f32, f16 or bf16).
 * Each column's sum is two FMA chains in k order (even k, odd k) added at the end: a fixed
 * sequence of IEEE operations per lane, so the same bits on every ISA path and call width.
 */

/* the LANES weights of half h of a panel's row kk (kind: SK_F32, SK_F16 or SK_BF16) as floats */
static inline __attribute__((always_inline)) vf float_weights(const uint8_t *w, int kk, int h, const int kind) {
    if (kind == SK_F32) return FLOAD((const float *)w + (size_t)kk * SK_P + h * LANES);
    const uint16_t *p = (const uint16_t *)w + (size_t)kk * SK_P + h * LANES;
    return kind == SK_F16 ? H2F(p) : BF2F(p);
}

/* y[r][c] = sum_k W[c][k] x[r][k] for Q rows (Q <= RB) of one panel half, k even and odd in two chains */
static inline __attribute__((always_inline)) void float_rows(const uint8_t *w, int k, const float *X, int ldx, int Q, float *y, int ldy, int h, int accum,
                                                             int pf, const int kind) {
    const int bytes = kind == SK_F32 ? SK_F32_PSB : SK_F16_PSB;
    vf e[RB], o[RB];
    for (int r = 0; r < Q; ++r) e[r] = o[r] = FZERO();
    int kk = 0;
    for (; kk + 1 < k; kk += 2) {
        if (pf && (kk & 15) == 0) sk_prefetch(w + (size_t)(kk + 16 * SK_PF_AHEAD_LEG) * bytes, 16 * (size_t)bytes);
        const vf w0 = float_weights(w, kk, h, kind), w1 = float_weights(w, kk + 1, h, kind);
#pragma GCC unroll 8
        for (int r = 0; r < Q; ++r) {
            e[r] = FMA(w0, FSET1(X[(size_t)r * ldx + kk]), e[r]);
            o[r] = FMA(w1, FSET1(X[(size_t)r * ldx + kk + 1]), o[r]);
        }
    }
    if (kk < k) { /* an odd k's last one: the even chain */
        const vf w0 = float_weights(w, kk, h, kind);
        for (int r = 0; r < Q; ++r) e[r] = FMA(w0, FSET1(X[(size_t)r * ldx + kk]), e[r]);
    }
    for (int r = 0; r < Q; ++r) {
        float *yr = y + (size_t)r * ldy + h * LANES;
        const vf s = FADD(e[r], o[r]);
        FSTORE(yr, accum ? FADD(FLOAD(yr), s) : s);
    }
}

/* float panels [p0, p1) of m for q float rows X (ldx floats a row; sk_panels_fn) */
static inline __attribute__((always_inline)) void float_panels(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum,
                                                               const int kind) {
    const size_t psb = kind == SK_F32 ? SK_F32_PSB : SK_F16_PSB;
    for (int p = p0; p < p1; ++p) {
        const uint8_t *w = m->w + (size_t)p * m->k * psb;
        for (int r0 = 0; r0 < q; r0 += RB) {
            const int Q = q - r0 < RB ? q - r0 : RB;
            const float *x = (const float *)X + (size_t)r0 * ldx;
            float *yp = y + (size_t)r0 * ldy + (size_t)(p - p0) * SK_P;
            for (int h = 0; h < HALVES; ++h) {
                const int pf = r0 == 0 && h == 0;
#define CALL(QQ) float_rows(w, m->k, x, ldx, QQ, yp, ldy, h, accum, pf, kind)
                SK_ROWS_CASES(CALL)
#undef CALL
            }
        }
    }
}
