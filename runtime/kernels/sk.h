/* specrt kernels: exact q-row matmuls over GGUF blocks in a column-panel layout, and the
 * whole decoder step (RMSNorm, RoPE, grouped-query attention over an f16 KV cache, SwiGLU)
 * around them. The ABI the Python side (runtime/kernels/__init__.py, ctypes) binds to.
 *
 * Exactness contract: every output of every function here is computed by the same sequence
 * of floating-point operations whatever the call width q, the thread count and the ISA path
 * (AVX-512 VNNI, AVX2, portable C): integer sums are exact, float operations are explicit
 * (no contraction: built with -ffp-contract=off), reductions have a fixed lane structure.
 * So a row's bits depend on its own inputs only.
 */
#ifndef SPECRT_SK_H
#define SPECRT_SK_H
#include <stdint.h>

#define SK_ABI 3
#define SK_P 16        /* output columns per panel (one zmm of int32 lanes) */
#define SK_MAX_THREADS 64

/* ggml type ids (ggml.h) */
enum { SK_F32 = 0, SK_F16 = 1, SK_Q4_0 = 2, SK_Q4_1 = 3, SK_Q5_0 = 6, SK_Q8_0 = 8, SK_Q4_K = 12, SK_Q6_K = 14 };
/* ISA paths */
enum { SK_ISA_PORTABLE = 0, SK_ISA_AVX2 = 1, SK_ISA_AVX512VNNI = 2 };

/* bytes per (panel of 16 columns x one K block) of each panel type; K block = 256 (K-quants) or 32 */
#define SK_Q4K_PSB (128 * SK_P + 8 * SK_P + 8 * SK_P + 2 * SK_P + 2 * SK_P) /* 2368 */
#define SK_Q6K_PSB (128 * SK_P + 64 * SK_P + 16 * SK_P + 2 * SK_P)          /* 3360 */
#define SK_I8_PSB (32 * SK_P + 2 * SK_P)                                    /* 544: Q8_0, Q5_0 */
#define SK_Q40_PSB (16 * SK_P + 2 * SK_P)                                   /* 288 */
#define SK_Q41_PSB (16 * SK_P + 2 * SK_P + 2 * SK_P)                        /* 320 */

/* one weight matrix: y[r][n] = sum_k W[n][k] x[r][k], n < n_out, k < n_in; w = panels */
typedef struct {
    int32_t type, n, k, pad;
    const uint8_t *w;
} sk_mat;

typedef struct {
    sk_mat wq, wk, wv, wo, wgate, wup, wdown;
    const float *attn_norm, *ffn_norm; /* [n_embd] */
    const float *bq, *bk, *bv;         /* biases or NULL */
} sk_layer;

/* a decoder (llama / qwen2 / mistral families) over panel weights */
typedef struct {
    int32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, max_ctx;
    int32_t rope_neox, max_q, pad0, pad1;
    float norm_eps, attn_scale, pad2, pad3;
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

#endif
