/* specrt kernels: exact q-row matmuls over GGUF blocks in a column-panel layout, and the
 * whole decoder step (RMSNorm, RoPE, grouped-query attention over an f16 KV cache, SwiGLU)
 * around them. The ABI the Python side (runtime/kernels/__init__.py, ctypes) binds to: the
 * structs below and the SK_EXPORT functions of api.c and types.c.
 *
 * Exactness contract: every output of every function here is computed by the same sequence
 * of floating-point operations whatever the call width q, the thread count and the ISA path
 * (AVX-512 VNNI, AVX2, portable C): integer sums are exact, float operations are explicit
 * (no contraction: built with -ffp-contract=off), reductions have a fixed lane structure.
 * So a row's bits depend on its own inputs only.
 *
 * Source map: docs/guide/kernels.md ("The C source").
 */
#ifndef SPECRT_SK_H
#define SPECRT_SK_H
#include <stdint.h>

#define SK_ABI 7
#define SK_P 16 /* output columns per panel (one zmm of int32 lanes) */
#define SK_MAX_THREADS 64

/* ggml type ids (ggml.h) of the block types the kernels run (the table: types.c) */
enum {
    SK_F32 = 0,
    SK_F16 = 1,
    SK_Q4_0 = 2,
    SK_Q4_1 = 3,
    SK_Q5_0 = 6,
    SK_Q5_1 = 7,
    SK_Q8_0 = 8,
    SK_Q2_K = 10,
    SK_Q3_K = 11,
    SK_Q4_K = 12,
    SK_Q5_K = 13,
    SK_Q6_K = 14,
    SK_IQ4_NL = 20,
    SK_IQ4_XS = 23,
    SK_BF16 = 30
};
#define SK_TYPE_IDS 40 /* ggml type ids below this have a row in the table (most rows empty) */

/* ISA paths, slowest first (the index of sk_isas[] in api.c) */
enum { SK_ISA_PORTABLE = 0, SK_ISA_AVX2 = 1, SK_ISA_AVX512VNNI = 2, SK_ISA_COUNT = 3 };

/* activation kinds a block type's kernels read (bit flags: a step quantizes every kind its
 * matrices need): llama.cpp's Q8_K (per 256) and Q8_0 (per 32), or the float rows themselves
 * (F32, F16, BF16 weights) */
enum { SK_ACT_Q8_K = 1, SK_ACT_Q8_0 = 2, SK_ACT_F32 = 4 };

/* return codes of the exported functions (the Python side words them) */
enum { SK_OK = 0, SK_E_ISA = -1, SK_E_ARGS = -2, SK_E_TOKEN = -3, SK_E_NOMEM = -4, SK_E_THREADS = -5, SK_E_MODEL = -6 };

/* one weight matrix: y[r][n] = sum_k W[n][k] x[r][k], n < n_out, k < n_in; w = panels */
typedef struct {
    int32_t type, n, k, pad;
    const uint8_t *w;
} sk_mat;

typedef struct {
    sk_mat wq, wk, wv, wo, wgate, wup, wdown;
    const float *attn_norm, *ffn_norm;           /* [n_embd] */
    const float *bq, *bk, *bv;                   /* biases or NULL */
    const float *q_norm, *k_norm;                /* per-head RMSNorm of q and k before RoPE [head_dim] (qwen3, gemma3) or NULL */
    const float *post_attn_norm, *post_ffn_norm; /* RMSNorm of the attention / FFN output before its residual add [n_embd] (gemma2/3) or NULL */
    const float *rope_cos, *rope_sin;            /* this layer's RoPE tables (gemma3's sliding layers: another base), or NULL: the model's */
    int32_t swa, pad;                            /* sliding window: a row at position p attends to positions > p - swa; 0: all before it */
} sk_layer;

/* the FFN's gate activation (sk_model.ffn_act) */
enum { SK_FFN_SILU = 0, SK_FFN_GELU = 1 }; /* SwiGLU; GeGLU with GELU's tanh approximation (gemma) */

/* a decoder (llama / qwen2 / qwen3 / mistral / phi3 / gemma2 / gemma3 families) over panel weights */
typedef struct {
    int32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, max_ctx;
    int32_t rope_neox, max_q, ffn_act, pad1;
    float norm_eps, attn_scale;
    float emb_scale;                   /* token rows times this (gemma: sqrt(n_embd)), or 0: as stored */
    float attn_softcap, final_softcap; /* scores, logits -> c * tanh(x / c) (gemma2), or 0: none */
    float pad2;
    const float *rope_cos, *rope_sin; /* [max_ctx][head_dim / 2] */
    const float *out_norm;            /* [n_embd] */
    sk_mat tok_embd, output;          /* token rows (n = ids, k = n_embd); the LM head (n = logits a row: n_vocab) */
    const sk_layer *layers;
} sk_model;

/* KV cache of one sequence, allocated by the caller for max_ctx rows (a multiple of 16):
 * k: [n_layer][max_ctx / 16][n_head_kv][head_dim][16] f16 (16 positions a tile: keys
 *    transposed so one score per lane), v: [n_layer][max_ctx][n_head_kv][head_dim] f16 */
typedef struct {
    uint16_t *k, *v;
} sk_kv;

/* one row of the block-type table as sk_type_describe gives it (the Python table,
 * runtime/kernels/panels.py, is checked against it) */
typedef struct {
    int32_t ggml_type;   /* ggml's id */
    int32_t block;       /* weights (k) per block */
    int32_t gguf_bytes;  /* bytes of one block in a GGUF file */
    int32_t panel_bytes; /* bytes of one block of one panel (SK_P columns) */
    int32_t act;         /* SK_ACT_Q8_K, SK_ACT_Q8_0 or SK_ACT_F32 */
    int32_t isa_mask;    /* bit i: a kernel for ISA path i */
    char name[16];       /* ggml's name */
} sk_type_desc;

#endif
