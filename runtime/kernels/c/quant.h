/* Activation quantizers: a row of floats into llama.cpp's Q8_K (per 256) and Q8_0 (per 32)
 * blocks, the activations the panel kernels read (each type's kind: the block-type table).
 * Kernel body: included by kernels.h once per ISA path.
 */

/* llama.cpp's Q8_K activations: per 256, iscale = -127 / (the value of largest magnitude),
 * q = nearest(iscale * x) (<= 127), d = 1 / iscale; 16- and 32-sums of q. A block holding a
 * NaN or an infinity gets d = NaN (its products NaN: the caller refuses the logits, never reads
 * a token computed as if the value were 0; no non-finite value reaches a float-to-int cast) */
static void quant_a256(const float *x, int k, sk_a256 *out) {
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
        const int bad = nan || isinf(amax);
        if (amax == 0.f || bad) {
            memset(o, 0, sizeof *o);
            if (bad) o->d = NAN;
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
 * q = nearest(x / d); and the sum of q. A block holding a NaN or an infinity gets d = NaN, as
 * quant_a256 */
static void quant_a32(const float *x, int k, sk_a32 *out) {
    for (int b = 0; b < k / 32; ++b) {
        const float *xb = x + (size_t)b * 32;
        sk_a32 *o = out + b;
        float amax = 0.f;
        int nan = 0;
        for (int j = 0; j < 32; ++j) {
            amax = fmaxf(amax, fabsf(xb[j]));
            nan |= xb[j] != xb[j];
        }
        if (nan || isinf(amax)) {
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

/* quantize rows [r0, r1) of x (ld floats) for every activation kind in need (SK_ACT_* bits) */
static void quant_rows(sk_scratch *s, const float *x, int ld, int k, int r0, int r1, int need) {
    for (int r = r0; r < r1; ++r) {
        if (need & SK_ACT_Q8_K) quant_a256(x + (size_t)r * ld, k, s->a256 + (size_t)r * s->lda256);
        if (need & SK_ACT_Q8_0) quant_a32(x + (size_t)r * ld, k, s->a32 + (size_t)r * s->lda32);
    }
}
