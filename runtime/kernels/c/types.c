/* The block-type table: what the kernels know of each GGUF block type they run (its block
 * size, bytes in a GGUF file and in a panel, the activations its kernels read, its row
 * dequantizer and its panel kernel on each ISA path), and the row dequantizers themselves.
 *
 * Adding a block type: one row here, one in runtime/kernels/panels.py (TABLE; a test checks
 * the two against each other through sk_type_describe), its dequantizer below, its panel
 * kernel in a dot_*.h body with one entry point per isa_*.c, and its packer in panels.py.
 */
#include "sk_internal.h"

/* ---------------------------------------------------------------- row dequantizers
 * column c of one block of one panel as floats, by the GGUF formulas (gguf-py's
 * dequantize_blocks); the export proves each tensor's panels against gguf.dequantize */

static void dequant_q4k(const uint8_t *o, int c, float *y) {
    const uint8_t *sc = o + 128 * SK_P, *mn = sc + 8 * SK_P, *dd = mn + 8 * SK_P;
    const float d = sk_h2f(sk_ld16(dd + 2 * c)), dmin = sk_h2f(sk_ld16(dd + 2 * (SK_P + c)));
    for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 8; ++t)
            for (int e = 0; e < 4; ++e) {
                const uint8_t v = o[((i * 8 + t) * SK_P + c) * 4 + e];
                const int k0 = 64 * i + 4 * t + e, k1 = k0 + 32;
                const float d0 = d * (float)sc[(2 * i) * SK_P + c], m0 = dmin * (float)mn[(2 * i) * SK_P + c];
                const float d1 = d * (float)sc[(2 * i + 1) * SK_P + c], m1 = dmin * (float)mn[(2 * i + 1) * SK_P + c];
                y[k0] = d0 * (float)(v & 15) - m0;
                y[k1] = d1 * (float)(v >> 4) - m1;
            }
}

/* Q6_K, and Q3_K (its values v - 4 laid out as Q6_K's v + 28, its scales s - 32 as Q6_K's) */
static void dequant_q6k(const uint8_t *o, int c, float *y) {
    const int8_t *sc = (const int8_t *)(o + 128 * SK_P + 64 * SK_P);
    const float d = sk_h2f(sk_ld16((const uint8_t *)(sc + 16 * SK_P) + 2 * c));
    for (int k = 0; k < 256; ++k) {
        const int sb = k / 16, t = (k % 16) / 4, e = k % 4, g = sb / 4, u = sb % 4;
        const uint8_t lb = o[(((sb >> 1) * 4 + t) * SK_P + c) * 4 + e];
        const int lo = (sb & 1) ? lb >> 4 : lb & 15, hi = (o[128 * SK_P + ((g * 4 + t) * SK_P + c) * 4 + e] >> (2 * u)) & 3;
        y[k] = (d * (float)sc[sb * SK_P + c]) * (float)((lo | hi << 4) - 32);
    }
}

/* Q5_K: Q4_K's layout plus the qh plane (bit 2i + half: the fifth bit of sub-block 2i + half) */
static void dequant_q5k(const uint8_t *o, int c, float *y) {
    const uint8_t *qh = o + 128 * SK_P, *sc = qh + 32 * SK_P, *mn = sc + 8 * SK_P, *dd = mn + 8 * SK_P;
    const float d = sk_h2f(sk_ld16(dd + 2 * c)), dmin = sk_h2f(sk_ld16(dd + 2 * (SK_P + c)));
    for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 8; ++t)
            for (int e = 0; e < 4; ++e) {
                const uint8_t v = o[((i * 8 + t) * SK_P + c) * 4 + e], hb = qh[(t * SK_P + c) * 4 + e];
                const int k0 = 64 * i + 4 * t + e, k1 = k0 + 32;
                const int q0 = (v & 15) | ((hb >> (2 * i)) & 1) << 4, q1 = (v >> 4) | ((hb >> (2 * i + 1)) & 1) << 4;
                const float d0 = d * (float)sc[(2 * i) * SK_P + c], m0 = dmin * (float)mn[(2 * i) * SK_P + c];
                const float d1 = d * (float)sc[(2 * i + 1) * SK_P + c], m1 = dmin * (float)mn[(2 * i + 1) * SK_P + c];
                y[k0] = d0 * (float)q0 - m0;
                y[k1] = d1 * (float)q1 - m1;
            }
}

/* Q2_K: GGUF's 2-bit bytes (value 128g + 32s + l: bits 2s of byte 32g + l), scale and min per 16 */
static void dequant_q2k(const uint8_t *o, int c, float *y) {
    const uint8_t *sc = o + 64 * SK_P, *mn = sc + 16 * SK_P, *dd = mn + 16 * SK_P;
    const float d = sk_h2f(sk_ld16(dd + 2 * c)), dmin = sk_h2f(sk_ld16(dd + 2 * (SK_P + c)));
    for (int k = 0; k < 256; ++k) {
        const int g = k / 128, s = (k % 128) / 32, l = k % 32, sb = k / 16;
        const int v = (o[((g * 8 + l / 4) * SK_P + c) * 4 + l % 4] >> (2 * s)) & 3;
        y[k] = (d * (float)sc[sb * SK_P + c]) * (float)v - dmin * (float)mn[sb * SK_P + c];
    }
}

/* IQ4_XS: per sub-block j of 32, nibbles as Q4_0's (value l low in byte l, 16 + l high) looked
 * up in IQ4_NL's table; a signed scale per 32, d per 256 */
static void dequant_iq4xs(const uint8_t *o, int c, float *y) {
    const int8_t *sc = (const int8_t *)(o + 128 * SK_P);
    const float d = sk_h2f(sk_ld16((const uint8_t *)(sc + 8 * SK_P) + 2 * c));
    for (int j = 0; j < 8; ++j) {
        const float ds = d * (float)sc[j * SK_P + c];
        for (int l = 0; l < 16; ++l) {
            const uint8_t v = o[((j * 4 + l / 4) * SK_P + c) * 4 + l % 4];
            y[32 * j + l] = ds * (float)sk_iq4nl_values[v & 15];
            y[32 * j + 16 + l] = ds * (float)sk_iq4nl_values[v >> 4];
        }
    }
}

/* Q8_0, and Q5_0 (its values unpacked to signed bytes at export) */
static void dequant_i8(const uint8_t *o, int c, float *y) {
    const float d = sk_h2f(sk_ld16(o + 32 * SK_P + 2 * c));
    for (int k = 0; k < 32; ++k) y[k] = d * (float)(int8_t)o[((k / 4) * SK_P + c) * 4 + k % 4];
}

/* IQ4_NL: Q4_0's layout, each nibble looked up in the table */
static void dequant_iq4nl(const uint8_t *o, int c, float *y) {
    const float d = sk_h2f(sk_ld16(o + 16 * SK_P + 2 * c));
    for (int k = 0; k < 16; ++k) {
        const uint8_t v = o[((k / 4) * SK_P + c) * 4 + k % 4];
        y[k] = d * (float)sk_iq4nl_values[v & 15];
        y[k + 16] = d * (float)sk_iq4nl_values[v >> 4];
    }
}

static void dequant_q4_0(const uint8_t *o, int c, float *y) {
    const float d = sk_h2f(sk_ld16(o + 16 * SK_P + 2 * c));
    for (int k = 0; k < 16; ++k) {
        const uint8_t v = o[((k / 4) * SK_P + c) * 4 + k % 4];
        y[k] = d * (float)((v & 15) - 8);
        y[k + 16] = d * (float)((v >> 4) - 8);
    }
}

static void dequant_q4_1(const uint8_t *o, int c, float *y) {
    const float d = sk_h2f(sk_ld16(o + 16 * SK_P + 2 * c)), mm = sk_h2f(sk_ld16(o + 16 * SK_P + 2 * (SK_P + c)));
    for (int k = 0; k < 16; ++k) {
        const uint8_t v = o[((k / 4) * SK_P + c) * 4 + k % 4];
        y[k] = d * (float)(v & 15) + mm;
        y[k + 16] = d * (float)(v >> 4) + mm;
    }
}

/* Q5_1: the 5-bit values 0..31 unpacked to bytes at export; d * q + m */
static void dequant_q5_1(const uint8_t *o, int c, float *y) {
    const float d = sk_h2f(sk_ld16(o + 32 * SK_P + 2 * c)), mm = sk_h2f(sk_ld16(o + 32 * SK_P + 2 * (SK_P + c)));
    for (int k = 0; k < 32; ++k) y[k] = d * (float)o[((k / 4) * SK_P + c) * 4 + k % 4] + mm;
}

/* float weights: one k (a "block" of 1) of column c */
static void dequant_f16(const uint8_t *o, int c, float *y) { y[0] = sk_h2f(sk_ld16(o + 2 * c)); }
static void dequant_bf16(const uint8_t *o, int c, float *y) { y[0] = sk_bits_f((uint32_t)sk_ld16(o + 2 * c) << 16); }
static void dequant_f32(const uint8_t *o, int c, float *y) { memcpy(y, o + 4 * c, 4); }

/* ---------------------------------------------------------------- the table */

#if SK_X86
#define SK_KERNELS(name) {sk_##name##_panels_portable, sk_##name##_panels_avx2, sk_##name##_panels_avx512}
#else
#define SK_KERNELS(name) {sk_##name##_panels_portable, NULL, NULL}
#endif

/* clang-format off */
const sk_type sk_types[SK_TYPE_IDS] = {
    /* ggml id      name    block gguf  panel        activations   dequantizer   panel kernel per ISA */
    [SK_F32]  = {"F32",     1,    4,    SK_F32_PSB,  SK_ACT_F32,   dequant_f32,  SK_KERNELS(f32)},
    [SK_F16]  = {"F16",     1,    2,    SK_F16_PSB,  SK_ACT_F32,   dequant_f16,  SK_KERNELS(f16)},
    [SK_Q4_0] = {"Q4_0",    32,   18,   SK_Q40_PSB,  SK_ACT_Q8_0,  dequant_q4_0, SK_KERNELS(q4_0)},
    [SK_Q4_1] = {"Q4_1",    32,   20,   SK_Q41_PSB,  SK_ACT_Q8_0,  dequant_q4_1, SK_KERNELS(q4_1)},
    [SK_Q5_0] = {"Q5_0",    32,   22,   SK_I8_PSB,   SK_ACT_Q8_0,  dequant_i8,   SK_KERNELS(q5_0)},
    [SK_Q5_1] = {"Q5_1",    32,   24,   SK_Q51_PSB,  SK_ACT_Q8_0,  dequant_q5_1, SK_KERNELS(q5_1)},
    [SK_Q8_0] = {"Q8_0",    32,   34,   SK_I8_PSB,   SK_ACT_Q8_0,  dequant_i8,   SK_KERNELS(q8_0)},
    [SK_Q2_K] = {"Q2_K",    256,  84,   SK_Q2K_PSB,  SK_ACT_Q8_K,  dequant_q2k,  SK_KERNELS(q2k)},
    [SK_Q3_K] = {"Q3_K",    256,  110,  SK_Q6K_PSB,  SK_ACT_Q8_K,  dequant_q6k,  SK_KERNELS(q6k)},
    [SK_Q4_K] = {"Q4_K",    256,  144,  SK_Q4K_PSB,  SK_ACT_Q8_K,  dequant_q4k,  SK_KERNELS(q4k)},
    [SK_Q5_K] = {"Q5_K",    256,  176,  SK_Q5K_PSB,  SK_ACT_Q8_K,  dequant_q5k,  SK_KERNELS(q5k)},
    [SK_Q6_K] = {"Q6_K",    256,  210,  SK_Q6K_PSB,  SK_ACT_Q8_K,  dequant_q6k,  SK_KERNELS(q6k)},
    [SK_IQ4_NL] = {"IQ4_NL", 32,  18,   SK_IQ4NL_PSB, SK_ACT_Q8_0, dequant_iq4nl, SK_KERNELS(iq4nl)},
    [SK_IQ4_XS] = {"IQ4_XS", 256, 136,  SK_IQ4XS_PSB, SK_ACT_Q8_K, dequant_iq4xs, SK_KERNELS(iq4xs)},
    [SK_BF16] = {"BF16",    1,    2,    SK_F16_PSB,  SK_ACT_F32,   dequant_bf16, SK_KERNELS(bf16)},
};
/* clang-format on */

void sk_dequant_row(const sk_mat *m, int n, float *out) {
    const sk_type *ty = sk_type_of(m->type);
    const int p = n / SK_P, c = n % SK_P, kb = ty->block, nb = m->k / kb;
    const uint8_t *w = m->w + (size_t)p * nb * ty->panel_bytes;
    for (int b = 0; b < nb; ++b) ty->dequant(w + (size_t)b * ty->panel_bytes, c, out + (size_t)b * kb);
}

/* the table's row of ggml type id t (runtime/kernels/panels.py checks its own table against
 * these): SK_OK, or SK_E_ARGS for a type the kernels do not run */
SK_EXPORT int sk_type_describe(int t, sk_type_desc *out) {
    const sk_type *ty = sk_type_of(t);
    if (!ty || !out) return SK_E_ARGS;
    memset(out, 0, sizeof *out);
    out->ggml_type = t;
    out->block = ty->block;
    out->gguf_bytes = ty->gguf_bytes;
    out->panel_bytes = ty->panel_bytes;
    out->act = ty->act;
    for (int i = 0; i < SK_ISA_COUNT; ++i)
        if (ty->panels[i]) out->isa_mask |= 1 << i;
    strncpy(out->name, ty->name, sizeof out->name - 1);
    return SK_OK;
}
