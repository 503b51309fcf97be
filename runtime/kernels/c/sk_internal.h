/* What the library's translation units share and the Python side never sees: limits, the
 * activation blocks, the scratch, the block-type table, the ISA table, the thread team, and
 * the ISA-independent helpers (f16 conversion, prefetch).
 *
 * Translation units (docs/guide/kernels.md, "The C source"):
 *   api.c            exported entry points: argument checks, scratch, ISA choice
 *   team.c           the thread team (persistent workers, barriers, fork and failure handling)
 *   types.c          the block-type table and the row dequantizers
 *   isa_avx512.c     the AVX-512 VNNI path  } each compiles the kernel bodies below with its
 *   isa_avx2.c       the AVX2 path          } own vector backend (vec_*.h) inside its own
 *   isa_portable.c   the portable C path    } `#pragma GCC target`, and exports one sk_isa
 * Kernel bodies, written once and compiled once per ISA path:
 *   quant.h          activation quantizers (Q8_K, Q8_0)
 *   dot_kquants.h    panel kernels of the K-quant family (Q2_K, Q4_K, Q5_K, Q6_K; Q3_K's
 *                    panels are Q6_K's) and IQ4_XS (nibbles looked up in IQ4_NL's table)
 *   dot_float.h      panel kernels of float weights (F32, F16, BF16) on float activations
 *   dot_legacy.h     panel kernels of the 32-blocks (Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, IQ4_NL)
 *   elementwise.h    lane-structured sums, RMSNorm, exp, SiLU, RoPE
 *   attention.h      grouped-query attention over the f16 KV cache
 *   head.h           the reduced LM head (each row's first maximum)
 *   step.h           the decoder step and the test jobs (matmul, argmax)
 */
#ifndef SPECRT_SK_INTERNAL_H
#define SPECRT_SK_INTERNAL_H
#include "sk.h"

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define SK_X86 1
#else
#define SK_X86 0
#endif

#define SK_EXPORT __attribute__((visibility("default")))
#define SK_GROUP_MAX 8      /* query heads of one KV head processed together */
#define SK_HEAD_DIM_MAX 256 /* head_dim <= 256, a multiple of 16 */
#define SK_ATT_ROWS 4       /* rows of one sequence an attention item takes together (K/V read once for them) */
#define SK_MAX_LAYERS 512
#define SK_HEAD_COLS 1024      /* columns of the LM head a reduced head's chunk holds (a multiple of SK_P) */
#define SK_HEAD_CHUNKS_MAX 512 /* chunks of a reduced head: ids < 524,288 */

/* activations: llama.cpp's Q8_K (per 256) and Q8_0 (per 32) with the sums the kernels use */
typedef struct {
    int8_t q[256];
    int16_t bs16[16];
    int16_t bs32[8];
    float d;
    int32_t pad[3];
} sk_a256; /* 320 bytes */
typedef struct {
    int8_t q[32];
    float d;
    int32_t sum;
    int32_t pad[6];
} sk_a32; /* 64 bytes */

/* the buffers of steps of up to max_q rows over a model of the dims it was made for */
typedef struct {
    float *x, *xn, *q, *k, *v, *att, *g, *u, *scores;
    sk_a256 *a256;
    sk_a32 *a32;
    const sk_kv **kvs; /* sk_step's rows: one sequence, positions start.. */
    int32_t *pos;
    int32_t *tok;                       /* the step's token ids, copied when checked (the step reads this copy) */
    int32_t *blk_r0, *blk_n;            /* attention row blocks of a step: first row, rows */
    float *hbuf;                        /* reduced head: per thread, max_q x SK_HEAD_COLS logits; per chunk and row ... */
    float *amax_v, *amax_s;             /* ... the first maximum, the sum of exp((x - max) / T) ... */
    int32_t *amax_i;                    /* ... and the maximum's id */
    const float *const *pens;           /* reduced head, for one call: head row r's penalty row of n_valid floats added to its
                                           logits before the scan (a grammar mask 0 / -inf, a logit bias), or NULL (none) */
    atomic_int att_next[SK_MAX_LAYERS]; /* per layer: the next attention item to take */
    int n_blocks;
    int lda256, lda32, max_q, head_split;
    int e, qd, kd, f, ctx, maxk; /* the dims the buffers were sized for (sk_scratch_new) */
    size_t ld_scores;
} sk_scratch;

/* ---------------------------------------------------------------- panel layouts
 * bytes per (panel of 16 columns x one K block) of each panel type (the layouts:
 * runtime/kernels/panels.py); K block = 256 (K-quants) or 32 */
#define SK_Q4K_PSB (128 * SK_P + 8 * SK_P + 8 * SK_P + 2 * SK_P + 2 * SK_P)             /* 2368 */
#define SK_Q6K_PSB (128 * SK_P + 64 * SK_P + 16 * SK_P + 2 * SK_P)                      /* 3360 */
#define SK_I8_PSB (32 * SK_P + 2 * SK_P)                                                /* 544: Q8_0, Q5_0 */
#define SK_Q40_PSB (16 * SK_P + 2 * SK_P)                                               /* 288 */
#define SK_Q41_PSB (16 * SK_P + 2 * SK_P + 2 * SK_P)                                    /* 320 */
#define SK_Q51_PSB (32 * SK_P + 2 * SK_P + 2 * SK_P)                                    /* 576: Q5_1 */
#define SK_Q5K_PSB (128 * SK_P + 32 * SK_P + 8 * SK_P + 8 * SK_P + 2 * SK_P + 2 * SK_P) /* 2880 */
#define SK_Q2K_PSB (64 * SK_P + 16 * SK_P + 16 * SK_P + 2 * SK_P + 2 * SK_P)            /* 1600 */
#define SK_IQ4XS_PSB (128 * SK_P + 8 * SK_P + 2 * SK_P)                                 /* 2208 */
#define SK_IQ4NL_PSB SK_Q40_PSB                                                         /* 288: Q4_0's layout */
#define SK_F16_PSB (2 * SK_P)                                                           /* 32 a k: F16, BF16 */
#define SK_F32_PSB (4 * SK_P)                                                           /* 64 a k: F32 */

/* ---------------------------------------------------------------- the block-type table */

/* panels [p0, p1) of m for q rows of activations X (ldx blocks a row, or floats for SK_ACT_F32;
 * the activation kind of m's type) into y (ldy floats a row; y[0] is column p0 * SK_P); accum: add into y (a
 * residual) instead of storing */
typedef void sk_panels_fn(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum);
/* column c of one block of one panel (o: its panel_bytes) as floats y[block] */
typedef void sk_dequant_fn(const uint8_t *o, int c, float *y);

typedef struct {
    const char *name;    /* ggml's name */
    int32_t block;       /* weights (k) per block; 0: the kernels do not run this type */
    int32_t gguf_bytes;  /* bytes of one GGUF block */
    int32_t panel_bytes; /* bytes of one block of one panel of SK_P columns */
    int32_t act;         /* SK_ACT_Q8_K, SK_ACT_Q8_0 or SK_ACT_F32 */
    sk_dequant_fn *dequant;
    sk_panels_fn *panels[SK_ISA_COUNT]; /* the kernel of each ISA path (NULL: not built here) */
} sk_type;

extern const sk_type sk_types[SK_TYPE_IDS]; /* indexed by ggml type id (types.c) */

/* the table's row of a type the kernels run, else NULL */
static inline const sk_type *sk_type_of(int t) { return t >= 0 && t < SK_TYPE_IDS && sk_types[t].block ? &sk_types[t] : NULL; }

/* row n of a panel matrix as floats [m->k], by the GGUF formulas (types.c) */
void sk_dequant_row(const sk_mat *m, int n, float *out);

/* each ISA path's panel kernels (defined in isa_<path>.c, listed in the table in types.c) */
sk_panels_fn sk_q4k_panels_portable, sk_q6k_panels_portable, sk_q8_0_panels_portable, sk_q5_0_panels_portable, sk_q4_0_panels_portable, sk_q4_1_panels_portable,
    sk_q5_1_panels_portable, sk_q5k_panels_portable, sk_q2k_panels_portable, sk_iq4xs_panels_portable, sk_iq4nl_panels_portable, sk_f16_panels_portable,
    sk_bf16_panels_portable, sk_f32_panels_portable;
#if SK_X86
sk_panels_fn sk_q4k_panels_avx2, sk_q6k_panels_avx2, sk_q8_0_panels_avx2, sk_q5_0_panels_avx2, sk_q4_0_panels_avx2, sk_q4_1_panels_avx2, sk_q5_1_panels_avx2,
    sk_q5k_panels_avx2, sk_q2k_panels_avx2, sk_iq4xs_panels_avx2, sk_iq4nl_panels_avx2, sk_f16_panels_avx2, sk_bf16_panels_avx2, sk_f32_panels_avx2;
sk_panels_fn sk_q4k_panels_avx512, sk_q6k_panels_avx512, sk_q8_0_panels_avx512, sk_q5_0_panels_avx512, sk_q4_0_panels_avx512, sk_q4_1_panels_avx512,
    sk_q5_1_panels_avx512, sk_q5k_panels_avx512, sk_q2k_panels_avx512, sk_iq4xs_panels_avx512, sk_iq4nl_panels_avx512, sk_f16_panels_avx512,
    sk_bf16_panels_avx512, sk_f32_panels_avx512;
#endif

/* ---------------------------------------------------------------- the ISA table */

/* one ISA path's whole-call functions (the exported entry points choose one by id) */
typedef struct {
    const char *name;
    /* a decoder step: row r feeds tokens[r] at position pos[r] of cache kvs[r]; logits rows
     * [lo, q) (or, with ids, the reduced head: ids/vals rows [lo, q) over ids [0, n_valid)) */
    void (*step)(const sk_model *m, const sk_kv *const *kvs, const int32_t *pos, sk_scratch *s, const int32_t *tokens, int q, float *logits, int ldl, int lo,
                 int32_t *ids, float *vals, int n_valid, float inv_temp);
    void (*matmul)(const sk_mat *m, const float *x, int q, float *y, sk_scratch *s);
    void (*argmax_rows)(const float *x, int q, int n, int ld, float it, int32_t *ids, float *vals, sk_scratch *s);
} sk_isa;

extern const sk_isa sk_isa_portable;
#if SK_X86
extern const sk_isa sk_isa_avx2, sk_isa_avx512vnni;
#endif

/* ---------------------------------------------------------------- the thread team (team.c) */

typedef void (*sk_job_fn)(void *arg, int tid, int nt);
/* run fn(arg, tid, nt) on every thread of the team (the caller is thread 0); one job at a time */
void sk_team_run(sk_job_fn fn, void *arg);
/* the threads' meeting point inside a job */
void sk_bar(int tid, int nt);
/* threads of the team now */
int sk_team_size(void);

/* ---------------------------------------------------------------- f16 (IEEE binary16) */

static inline float sk_bits_f(uint32_t w) {
    float f;
    memcpy(&f, &w, 4);
    return f;
}
static inline uint32_t sk_f_bits(float f) {
    uint32_t w;
    memcpy(&w, &f, 4);
    return w;
}
/* exact (every f16 is an f32) */
static inline float sk_h2f(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = sk_bits_f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = sk_bits_f((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t r = two_w < (1u << 27) ? sk_f_bits(denormalized) : sk_f_bits(normalized);
    return sk_bits_f(sign | r);
}
/* round to nearest even, as F16C's vcvtps2ph with rounding mode 0 (the FP16 library's method) */
static inline uint16_t sk_f2h(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = sk_f_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = sk_bits_f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = sk_f_bits(base), exp_bits = (bits >> 13) & 0x00007C00u, mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
/* an f16 stored at p (any alignment) */
static inline uint16_t sk_ld16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline int32_t sk_ld32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* IQ4_NL's 16 non-linear values, which IQ4_XS shares (ggml's kvalues_iq4nl, gguf-py's
 * IQ4_NL.kvalues): the IQ4 panels keep the file's nibbles and the kernels look them up here */
static const int8_t sk_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* software prefetch of [p, p + bytes): a thread streaming panels keeps enough cache lines in
 * flight to approach the memory bandwidth (its hardware prefetcher alone reached ~60% of it
 * beside the kernels' arithmetic); a prefetch past the end of a mapping is harmless.
 * Into L2, not L1 (prefetcht1): on Zen 4 the L1 hint with 2 K blocks ahead left the wide calls'
 * arithmetic waiting on memory, one after the other; the L2 hint with 4 ahead overlapped them
 * (the 1.5B target's step 2.3x faster at 5 rows, 2.1x at 8, 1.1x at 1; same bits:
 * docs/bench/kernel_tq/). The 32-weight types and float rows go into L2 too, at their old
 * distance: the draft (mostly those types) measured 0.80x-0.93x at 1 row, within that machine's
 * noise (docs/results/speed.md). The three can be set at build time (CFLAGS=-DSK_PF_AHEAD=...;
 * scripts/kernel_builds_ab.py times builds against each other). */
#ifndef SK_PF_AHEAD
#define SK_PF_AHEAD 4 /* 256-weight blocks (of the panel being read) ahead */
#endif
#ifndef SK_PF_AHEAD_LEG
#define SK_PF_AHEAD_LEG 2 /* the 32-weight types' and float rows' distance: x 4 or 8 blocks, x 16 float rows */
#endif
#ifndef SK_PF_LOC
#define SK_PF_LOC 2 /* __builtin_prefetch locality: 2 = prefetcht1 (L2) */
#endif
static inline void sk_prefetch(const uint8_t *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, SK_PF_LOC);
}

static inline void sk_pause(void) {
#if SK_X86
    _mm_pause();
#endif
}

#endif
