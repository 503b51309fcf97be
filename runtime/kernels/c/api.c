/* The exported entry points of the library the Python side loads with ctypes
 * (runtime/kernels/__init__.py): version stamps, the ISA choice, the scratch, and the calls
 * (decoder steps, and the matmul/argmax/dequant/attention entry points tests use). Every call
 * checks what it is given (shapes against the model's dims and the scratch's, positions,
 * token ids, buffers) before any kernel runs, and the kernels read the checked copies.
 * The ISA path is a row of sk_isas (one table of function pointers per path), chosen by id.
 */
#include "sk_internal.h"

#include <stdlib.h>
#if SK_X86
#include <cpuid.h>
#endif

SK_EXPORT int sk_abi(void) { return SK_ABI; }

#ifndef SK_SOURCES
#define SK_SOURCES "unknown"
#endif
/* the SHA-256 (16 hex digits) of the sources this library was built from (setup.py) */
SK_EXPORT const char *sk_sources(void) { return SK_SOURCES; }

/* ---------------------------------------------------------------- ISA paths */

/* indexed by SK_ISA_* (NULL: not built here) */
static const sk_isa *const sk_isas[SK_ISA_COUNT] = {
    &sk_isa_portable,
#if SK_X86
    &sk_isa_avx2,
    &sk_isa_avx512vnni,
#else
    NULL,
    NULL,
#endif
};

static int sk_detect_isa(void) {
#if SK_X86
    __builtin_cpu_init();
    unsigned a, b, c, d;
    const int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    if (f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma"))
        return SK_ISA_AVX512VNNI;
    if (f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")) return SK_ISA_AVX2;
#endif
    return SK_ISA_PORTABLE;
}

/* the fastest path this CPU and build can run */
SK_EXPORT int sk_cpu_isa(void) {
    static int best = -1; /* the CPU does not change: asked once */
    if (best < 0) best = sk_detect_isa();
    return best;
}

/* the name of ISA path id i, or NULL */
SK_EXPORT const char *sk_isa_name(int i) { return i >= 0 && i < SK_ISA_COUNT && sk_isas[i] ? sk_isas[i]->name : NULL; }

/* the path `isa` when this CPU runs it, else NULL */
static const sk_isa *sk_isa_get(int isa) { return isa >= 0 && isa <= sk_cpu_isa() ? sk_isas[isa] : NULL; }

/* ---------------------------------------------------------------- scratch */

static void *sk_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64)) return NULL;
    memset(p, 0, bytes);
    return p;
}

/* not cleared: a thread writes its part before reading it, and untouched pages stay out of
 * the resident set (SK_MAX_THREADS threads' parts are reserved) */
static void *sk_alloc_lazy(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes) ? NULL : p;
}

SK_EXPORT void sk_scratch_free(void *p) {
    sk_scratch *s = (sk_scratch *)p;
    if (!s) return;
    void *bufs[] = {s->x,   s->xn,  s->q,   s->k,   s->v,      s->att,   s->g,    s->u,      s->scores, s->a256,
                    s->a32, s->kvs, s->pos, s->tok, s->blk_r0, s->blk_n, s->hbuf, s->amax_v, s->amax_s, s->amax_i};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) free(bufs[i]);
    free(s);
}

/* scratch for steps of up to max_q rows: e = n_embd, qd = n_head * head_dim, kd = n_head_kv *
 * head_dim, f = n_ff, ctx = KV rows (attention scores); a matmul-only scratch passes its k as e.
 * A step checks its model's dims against these. NULL: bad sizes or out of memory */
SK_EXPORT void *sk_scratch_new(int max_q, int e, int qd, int kd, int f, int ctx) {
    if (max_q < 1 || e < 1 || qd < 0 || kd < 0 || f < 0 || ctx < 0 || max_q > 1 << 16 || ctx > 1 << 24) return NULL;
    sk_scratch *s = (sk_scratch *)calloc(1, sizeof *s);
    if (!s) return NULL;
    int maxk = e;
    if (qd > maxk) maxk = qd;
    if (f > maxk) maxk = f;
    s->max_q = max_q;
    s->e = e, s->qd = qd, s->kd = kd, s->f = f, s->ctx = ctx, s->maxk = maxk;
    s->lda256 = (maxk + 255) / 256;
    s->lda32 = (maxk + 31) / 32;
    const size_t Q = (size_t)max_q;
    s->x = sk_alloc(Q * e * 4);
    s->xn = sk_alloc(Q * maxk * 4);
    s->q = sk_alloc(Q * (qd ? qd : 1) * 4);
    s->k = sk_alloc(Q * (kd ? kd : 1) * 4);
    s->v = sk_alloc(Q * (kd ? kd : 1) * 4);
    s->att = sk_alloc(Q * (qd ? qd : 1) * 4);
    s->g = sk_alloc(Q * (f ? f : 1) * 4);
    s->u = sk_alloc(Q * (f ? f : 1) * 4);
    s->ld_scores = (size_t)SK_ATT_ROWS * SK_GROUP_MAX * (size_t)((ctx + 15) / 16 * 16 + 16);
    s->scores = sk_alloc_lazy((size_t)SK_MAX_THREADS * s->ld_scores * 4);
    s->hbuf = sk_alloc_lazy((size_t)SK_MAX_THREADS * Q * SK_HEAD_COLS * 4);
    s->amax_v = sk_alloc((size_t)SK_HEAD_CHUNKS_MAX * Q * 4);
    s->amax_s = sk_alloc((size_t)SK_HEAD_CHUNKS_MAX * Q * 4);
    s->amax_i = sk_alloc((size_t)SK_HEAD_CHUNKS_MAX * Q * 4);
    s->a256 = sk_alloc(Q * s->lda256 * sizeof(sk_a256));
    s->a32 = sk_alloc(Q * s->lda32 * sizeof(sk_a32));
    s->kvs = sk_alloc(Q * sizeof(sk_kv *));
    s->pos = sk_alloc(Q * sizeof(int32_t));
    s->tok = sk_alloc(Q * sizeof(int32_t));
    s->blk_r0 = sk_alloc(Q * sizeof(int32_t));
    s->blk_n = sk_alloc(Q * sizeof(int32_t));
    if (!s->x || !s->xn || !s->q || !s->k || !s->v || !s->att || !s->g || !s->u || !s->scores || !s->a256 || !s->a32 || !s->kvs || !s->pos || !s->tok ||
        !s->blk_r0 || !s->blk_n || !s->hbuf || !s->amax_v || !s->amax_s || !s->amax_i) {
        sk_scratch_free(s);
        return NULL;
    }
    return s;
}

/* ---------------------------------------------------------------- checks */

/* a matrix the kernels run: a known type, whole panels and blocks, weights present */
static int sk_mat_ok(const sk_mat *m) {
    const sk_type *ty = sk_type_of(m->type);
    return ty && m->w && m->n > 0 && m->k > 0 && m->n % SK_P == 0 && m->k % ty->block == 0;
}

static int sk_mat_is(const sk_mat *m, int n, int k) { return sk_mat_ok(m) && m->n == n && m->k == k; }

/* every shape of the model agrees with its dims and fits the scratch's buffers */
static int sk_model_ok(const sk_model *m, const sk_scratch *s) {
    const int E = m->n_embd, hd = m->head_dim, nh = m->n_head, nkv = m->n_head_kv, F = m->n_ff;
    if (m->n_layer < 1 || m->n_layer > SK_MAX_LAYERS || E < 1 || F < 1 || nkv < 1 || nh < nkv || nh % nkv) return 0;
    if (hd < 16 || hd % 16 || hd > SK_HEAD_DIM_MAX || m->max_ctx < 16 || m->max_ctx % 16) return 0;
    if (!m->rope_cos || !m->rope_sin || !m->out_norm || !m->layers) return 0;
    /* the FFN's activation one of two; scales and caps finite, >= 0 (0: none; !(x >= 0) is true for NaN) */
    if ((m->ffn_act != SK_FFN_SILU && m->ffn_act != SK_FFN_GELU) || !(m->emb_scale >= 0.f) || !(m->attn_softcap >= 0.f) || !(m->final_softcap >= 0.f)) return 0;
    if (isinf(m->emb_scale) || isinf(m->attn_softcap) || isinf(m->final_softcap)) return 0;
    if ((int64_t)nh * hd > INT32_MAX / 2) return 0;
    if (E > s->e || nh * hd > s->qd || nkv * hd > s->kd || F > s->f || m->max_ctx > s->ctx) return 0;
    /* the embedding has a row per id of the vocabulary; the head (a draft's may be trimmed) no more */
    if (!sk_mat_ok(&m->tok_embd) || m->tok_embd.k != E || m->tok_embd.n != m->n_vocab) return 0;
    if (!sk_mat_ok(&m->output) || m->output.k != E || m->output.n > m->n_vocab) return 0;
    for (int l = 0; l < m->n_layer; ++l) {
        const sk_layer *L = &m->layers[l];
        if (!sk_mat_is(&L->wq, nh * hd, E) || !sk_mat_is(&L->wk, nkv * hd, E) || !sk_mat_is(&L->wv, nkv * hd, E) || !sk_mat_is(&L->wo, E, nh * hd) ||
            !sk_mat_is(&L->wgate, F, E) || !sk_mat_is(&L->wup, F, E) || !sk_mat_is(&L->wdown, E, F) || !L->attn_norm || !L->ffn_norm)
            return 0;
        if (L->swa < 0 || !L->rope_cos != !L->rope_sin) return 0; /* a layer's own RoPE tables come in pairs */
    }
    return 1;
}

/* checks shared by the step entry points: the model, widths and buffers, then the tokens,
 * copied into the scratch (the step reads the copy: a caller's buffer changed after this
 * check is never read) */
static int sk_step_check(const sk_model *m, sk_scratch *s, const int32_t *tokens, int q, int ldl, int lo) {
    if (!m || !s || !tokens || q < 1 || q > s->max_q || lo < 0 || lo > q || ldl < m->output.n) return SK_E_ARGS;
    if (!sk_model_ok(m, s)) return SK_E_MODEL;
    for (int r = 0; r < q; ++r) {
        const int32_t t = tokens[r];
        if (t < 0 || t >= m->tok_embd.n) return SK_E_TOKEN; /* the embedding's rows (a draft's head may be trimmed) */
        s->tok[r] = t;
    }
    return SK_OK;
}

/* the attention's work for rows [0, q): blocks of at most SK_ATT_ROWS consecutive rows of one
 * sequence (a sequence's rows split evenly), and heads of one KV head per item: at most
 * SK_GROUP_MAX, and enough items for the team (neither changes how a row is computed) */
static void sk_plan_attention(const sk_model *m, const sk_kv *const *kvs, sk_scratch *s, int q) {
    int nb = 0;
    for (int r = 0; r < q;) {
        int e = r + 1;
        while (e < q && kvs[e] == kvs[r]) ++e;
        const int len = e - r, parts = (len + SK_ATT_ROWS - 1) / SK_ATT_ROWS;
        for (int i = 0; i < parts; ++i) {
            const int a = r + len * i / parts, b = r + len * (i + 1) / parts;
            s->blk_r0[nb] = a;
            s->blk_n[nb++] = b - a;
        }
        r = e;
    }
    s->n_blocks = nb;
    const int per = m->n_head / m->n_head_kv, nt = sk_team_size();
    int split = (per + SK_GROUP_MAX - 1) / SK_GROUP_MAX;
    while (split < per && nb * m->n_head_kv * split < 2 * nt) ++split;
    s->head_split = split;
    for (int l = 0; l < m->n_layer; ++l) atomic_store_explicit(&s->att_next[l], 0, memory_order_relaxed);
}

/* rows [0, q) of the scratch (kvs, pos, tok: checked) through the path's step */
static void sk_step_go(const sk_isa *I, const sk_model *m, sk_scratch *s, int q, float *logits, int ldl, int lo, int32_t *ids, float *vals, int n_valid,
                       float inv_temp) {
    const sk_kv *const *kvs = (const sk_kv *const *)s->kvs;
    sk_plan_attention(m, kvs, s, q);
    I->step(m, kvs, s->pos, s, s->tok, q, logits, ldl, lo, ids, vals, n_valid, inv_temp);
}

/* rows r < q at positions start + r of one cache */
static int sk_one_sequence(const sk_model *m, const sk_kv *kv, sk_scratch *s, int q, int start) {
    if (!kv || !kv->k || !kv->v || start < 0 || start > m->max_ctx - q) return SK_E_ARGS; /* not start + q > max_ctx: no overflow */
    for (int r = 0; r < q; ++r) {
        s->kvs[r] = kv;
        s->pos[r] = start + r;
    }
    return SK_OK;
}

/* ---------------------------------------------------------------- decoder steps */

/* one decoder step: q new tokens at positions start..start+q-1 over KV rows [0, start);
 * writes KV rows [start, start+q) and logits rows [lo, q) (row r at logits + r * ldl) */
SK_EXPORT int sk_step(int isa, const sk_model *m, const sk_kv *kv, void *scratch, const int32_t *tokens, int q, int start, float *logits, int ldl, int lo) {
    sk_scratch *s = (sk_scratch *)scratch;
    const sk_isa *I = sk_isa_get(isa);
    if (!I) return SK_E_ISA;
    int rc = sk_step_check(m, s, tokens, q, ldl, lo);
    if (rc == SK_OK) rc = sk_one_sequence(m, kv, s, q, start);
    if (rc == SK_OK && lo < q && !logits) rc = SK_E_ARGS;
    if (rc != SK_OK) return rc;
    sk_step_go(I, m, s, q, logits, ldl, lo, NULL, NULL, 0, 0.f);
    return SK_OK;
}

/* sk_step with the LM head reduced to each row's greedy token (what greedy verification and a
 * greedy draft step read): rows [lo, q) get ids[r], their first maximum over ids [0, n_valid),
 * as numpy's argmax of the row sk_step writes (the same logits bit for bit: NaN ranks highest
 * and the first NaN wins; among equal maxima the lowest id), and vals[r]: its logit when
 * inv_temp <= 0, else its softmax probability at 1/T = inv_temp (NaN where the maximum is not
 * finite). No logits row is written: each thread keeps a few thousand logits in its cache at a
 * time. Every result is the same bits for any thread count and ISA path. pens (NULL: none):
 * per row r in [lo, q), pens[r - lo] is NULL or a penalty row of n_valid floats the row's
 * logits get added before the scan (constrained greedy decoding: a grammar's 0 / -inf mask
 * plus a logit bias), the result numpy's argmax of np.add(logits_row, pen), bit for bit. */
SK_EXPORT int sk_step_argmax(int isa, const sk_model *m, const sk_kv *kv, void *scratch, const int32_t *tokens, int q, int start, int32_t *ids, float *vals,
                             int n_valid, float inv_temp, int lo, const float *const *pens) {
    sk_scratch *s = (sk_scratch *)scratch;
    const sk_isa *I = sk_isa_get(isa);
    if (!I) return SK_E_ISA;
    int rc = sk_step_check(m, s, tokens, q, m ? m->output.n : 0, lo);
    if (rc == SK_OK) rc = sk_one_sequence(m, kv, s, q, start);
    if (rc == SK_OK && (n_valid < 1 || n_valid > m->output.n || n_valid > SK_HEAD_CHUNKS_MAX * SK_HEAD_COLS || !ids || !vals)) rc = SK_E_ARGS;
    if (rc != SK_OK) return rc;
    s->pens = pens;
    sk_step_go(I, m, s, q, NULL, 0, lo, ids, vals, n_valid, inv_temp);
    s->pens = NULL;
    return SK_OK;
}

/* one decoder step over rows of several sequences (continuous batching, batched verification):
 * row r feeds tokens[r] at position pos[r] of the cache kvs[r]: it reads that cache's rows
 * [0, pos[r]] (the rows of this call at lower positions of the same cache included) and writes
 * its row pos[r]. Two rows may not name the same (cache, position). Every row's bits are the
 * ones sk_step gives it: rows never read another sequence's data and every output is computed
 * by the same operations whatever the call holds. Logits rows [lo, q) as sk_step. */
SK_EXPORT int sk_step_rows(int isa, const sk_model *m, const sk_kv *const *kvs, void *scratch, const int32_t *tokens, const int32_t *pos, int q, float *logits,
                           int ldl, int lo) {
    sk_scratch *s = (sk_scratch *)scratch;
    const sk_isa *I = sk_isa_get(isa);
    if (!I) return SK_E_ISA;
    const int rc = sk_step_check(m, s, tokens, q, ldl, lo);
    if (rc != SK_OK) return rc;
    if (!kvs || !pos || (lo < q && !logits)) return SK_E_ARGS;
    for (int r = 0; r < q; ++r) {
        const int32_t p = pos[r];
        const sk_kv *kv = kvs[r];
        if (!kv || !kv->k || !kv->v || p < 0 || p >= m->max_ctx) return SK_E_ARGS;
        s->kvs[r] = kv;
        s->pos[r] = p;
    }
    sk_step_go(I, m, s, q, logits, ldl, lo, NULL, NULL, 0, 0.f);
    return SK_OK;
}

/* ---------------------------------------------------------------- tests' entry points */

/* y [q][m->n] = the matmul of float rows x [q][m->k], activations quantized as in a step;
 * x and y hold q rows of m->k and m->n floats */
SK_EXPORT int sk_matmul(int isa, const sk_mat *m, const float *x, int q, float *y, void *scratch) {
    sk_scratch *s = (sk_scratch *)scratch;
    const sk_isa *I = sk_isa_get(isa);
    if (!I) return SK_E_ISA;
    if (!m || !sk_mat_ok(m) || !x || !y || q < 1 || !s || q > s->max_q || m->k > s->maxk) return SK_E_ARGS;
    I->matmul(m, x, q, y, s);
    return SK_OK;
}

/* ids[r], vals[r] = sk_step_argmax's reduced head over float rows x [q][ld], ids [0, n) (tests:
 * its chunks, scan, sums and merge, penalty rows pens as sk_step_argmax's, on rows the caller chooses) */
SK_EXPORT int sk_argmax(int isa, const float *x, int q, int n, int ld, float inv_temp, int32_t *ids, float *vals, void *scratch, const float *const *pens) {
    sk_scratch *s = (sk_scratch *)scratch;
    const sk_isa *I = sk_isa_get(isa);
    if (!I) return SK_E_ISA;
    if (!s || !x || !ids || !vals || q < 1 || q > s->max_q || n < 1 || ld < n || n > SK_HEAD_CHUNKS_MAX * SK_HEAD_COLS) return SK_E_ARGS;
    s->pens = pens;
    I->argmax_rows(x, q, n, ld, inv_temp, ids, vals, s);
    s->pens = NULL;
    return SK_OK;
}

/* the last step's attention output of its last layer, rows [0, q) x cols floats (cols: the
 * model's n_head * head_dim, at most the scratch's), before its 8-bit quantization: the bits
 * the tests compare across calls */
SK_EXPORT int sk_scratch_attention(void *scratch, int q, int cols, float *out) {
    sk_scratch *s = (sk_scratch *)scratch;
    if (!s || !out || q < 1 || q > s->max_q || cols < 1 || cols > s->qd) return SK_E_ARGS;
    for (int r = 0; r < q; ++r) memcpy(out + (size_t)r * cols, s->att + (size_t)r * s->qd, (size_t)cols * sizeof(float));
    return SK_OK;
}

/* rows [n0, n1) of a panel matrix as floats, out [(n1 - n0)][m->k] */
SK_EXPORT int sk_dequant(const sk_mat *m, int n0, int n1, float *out) {
    if (!m || !sk_mat_ok(m) || !out || n0 < 0 || n1 > m->n || n0 > n1) return SK_E_ARGS;
    for (int n = n0; n < n1; ++n) sk_dequant_row(m, n, out + (size_t)(n - n0) * m->k);
    return SK_OK;
}
