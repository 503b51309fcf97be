/* The decoder step (embedding, layers, LM head) as one team job, and the tests' jobs (one
 * matmul, the reduced head over given rows). Kernel body: included by kernels.h once per ISA
 * path; the path's sk_isa (isa_*.c) points at step, matmul and argmax_rows.
 */

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
} step_args;

/* the activations a matrix of kind act reads from row r0 on, and their stride (blocks a row,
 * or floats): the quantized blocks of the scratch, or the float rows xf (ldf floats a row) */
static inline const void *act_rows(const sk_scratch *s, int act, const float *xf, int ldf, int r0, int *ldx) {
    if (act == SK_ACT_Q8_K) return *ldx = s->lda256, (const void *)(s->a256 + (size_t)r0 * s->lda256);
    if (act == SK_ACT_Q8_0) return *ldx = s->lda32, (const void *)(s->a32 + (size_t)r0 * s->lda32);
    return *ldx = ldf, (const void *)(xf + (size_t)r0 * ldf);
}

/* nm matrices over the same activations (quantized in the scratch from, or for float weights
 * read as, the float rows xf of ldf floats): this thread's share of their panels, one list */
static void mm_share(sk_scratch *s, const float *xf, int ldf, const sk_mat *const *mats, float *const *ys, const int *ldy, int nm, int q, int accum, int tid,
                     int nt) {
    int total = 0;
    for (int i = 0; i < nm; ++i) total += mats[i]->n / SK_P;
    int a, b;
    thread_share(total, tid, nt, &a, &b);
    int base = 0;
    for (int i = 0; i < nm; ++i) {
        const int np = mats[i]->n / SK_P, lo = a > base ? a - base : 0, hi = b - base < np ? b - base : np;
        if (lo < hi) {
            int ldx;
            const void *X = act_rows(s, act_of(mats[i]), xf, ldf, 0, &ldx);
            mm(mats[i], X, ldx, q, lo, hi, ys[i] + (size_t)lo * SK_P, ldy[i], accum);
        }
        base += np;
    }
}

/* the residual add of a block's output projection w (over the activations of the float rows
 * xf, ldf floats a row): x += w xf, or (post: gemma2/3's post-attention / post-FFN norm) x +=
 * RMSNorm(w xf) * post, the projection written to xn first. Ends at a barrier. */
static void out_proj(sk_scratch *s, const sk_mat *w, const float *xf, int ldf, const float *post, float eps, int E, int q, int r0, int r1, int tid, int nt) {
    const sk_mat *mats[1] = {w};
    float *ys[1] = {post ? s->xn : s->x};
    const int ld[1] = {E};
    mm_share(s, xf, ldf, mats, ys, ld, 1, q, !post, tid, nt);
    sk_bar(tid, nt);
    if (!post) return;
    for (int r = r0; r < r1; ++r) {
        float *x = s->x + (size_t)r * E, *y = s->xn + (size_t)r * E;
        rmsnorm(y, post, E, eps, y);
        for (int i = 0; i < E; ++i) x[i] = x[i] + y[i];
    }
    sk_bar(tid, nt);
}

static void step_job(void *arg, int tid, int nt) {
    const step_args *A = (const step_args *)arg;
    const sk_model *m = A->m;
    sk_scratch *s = A->s;
    const int q = A->q, E = m->n_embd, hd = m->head_dim, nh = m->n_head, nkv = m->n_head_kv, F = m->n_ff;
    int r0, r1;
    thread_share(q, tid, nt, &r0, &r1);
    for (int r = r0; r < r1; ++r) {
        float *x = s->x + (size_t)r * E;
        sk_dequant_row(&m->tok_embd, A->tokens[r], x);
        if (m->emb_scale != 0.f) /* gemma: the token rows times sqrt(n_embd) */
            for (int i = 0; i < E; ++i) x[i] = x[i] * m->emb_scale;
    }
    sk_bar(tid, nt);
    for (int l = 0; l < m->n_layer; ++l) {
        const sk_layer *L = &m->layers[l];
        for (int r = r0; r < r1; ++r) rmsnorm(s->x + (size_t)r * E, L->attn_norm, E, m->norm_eps, s->xn + (size_t)r * E);
        quant_rows(s, s->xn, E, E, r0, r1, act_of(&L->wq) | act_of(&L->wk) | act_of(&L->wv));
        sk_bar(tid, nt);
        {
            const sk_mat *mats[3] = {&L->wq, &L->wk, &L->wv};
            float *ys[3] = {s->q, s->k, s->v};
            const int ld[3] = {nh * hd, nkv * hd, nkv * hd};
            mm_share(s, s->xn, E, mats, ys, ld, 3, q, 0, tid, nt);
        }
        sk_bar(tid, nt);
        qkv_post(m, A->kvs, A->pos, s, l, q, tid, nt);
        sk_bar(tid, nt);
        {
            /* items (row block, kv head, head chunk), taken in turn from a counter: blocks differ
             * in rows, and which thread computes an item never changes its bits */
            const int per = nh / nkv, split = s->head_split, chunk = (per + split - 1) / split, items = s->n_blocks * nkv * split;
            for (int it; (it = atomic_fetch_add_explicit(&s->att_next[l], 1, memory_order_relaxed)) < items;) {
                const int bk = it / (nkv * split), g = (it / split) % nkv, c = it % split;
                const int h0 = g * per + c * chunk, h1 = h0 + chunk < (g + 1) * per ? h0 + chunk : (g + 1) * per;
                const int first = s->blk_r0[bk];
                if (h0 < h1) attend(m, A->kvs[first], s, l, first, s->blk_n[bk], A->pos, g, h0, h1, tid);
            }
        }
        sk_bar(tid, nt);
        quant_rows(s, s->att, nh * hd, nh * hd, r0, r1, act_of(&L->wo));
        sk_bar(tid, nt);
        out_proj(s, &L->wo, s->att, nh * hd, L->post_attn_norm, m->norm_eps, E, q, r0, r1, tid, nt);
        for (int r = r0; r < r1; ++r) rmsnorm(s->x + (size_t)r * E, L->ffn_norm, E, m->norm_eps, s->xn + (size_t)r * E);
        quant_rows(s, s->xn, E, E, r0, r1, act_of(&L->wgate) | act_of(&L->wup));
        sk_bar(tid, nt);
        {
            const sk_mat *mats[2] = {&L->wgate, &L->wup};
            float *ys[2] = {s->g, s->u};
            const int ld[2] = {F, F};
            mm_share(s, s->xn, E, mats, ys, ld, 2, q, 0, tid, nt);
        }
        sk_bar(tid, nt);
        {
            /* SwiGLU (in place in g) and its quantization per activation block: items (row, block;
             * float weights read g's rows: a row an item) */
            const int need = act_of(&L->wdown), kb = need == SK_ACT_Q8_K ? 256 : need == SK_ACT_Q8_0 ? 32 : F, nb = F / kb, items = q * nb;
            int a, b;
            thread_share(items, tid, nt, &a, &b);
            for (int it = a; it < b; ++it) {
                const int r = it / nb, j = it % nb;
                float *gg = s->g + (size_t)r * F + (size_t)j * kb;
                if (m->ffn_act == SK_FFN_GELU) gelu_mul(gg, s->u + (size_t)r * F + (size_t)j * kb, kb);
                else silu_mul(gg, s->u + (size_t)r * F + (size_t)j * kb, kb);
                if (need & SK_ACT_Q8_K) quant_a256(gg, kb, s->a256 + (size_t)r * s->lda256 + (size_t)j);
                if (need & SK_ACT_Q8_0) quant_a32(gg, kb, s->a32 + (size_t)r * s->lda32 + (size_t)j);
            }
        }
        sk_bar(tid, nt);
        out_proj(s, &L->wdown, s->g, F, L->post_ffn_norm, m->norm_eps, E, q, r0, r1, tid, nt);
    }
    /* the LM head on rows [lo, q) only */
    const int lo = A->lo, nq = q - lo;
    if (nq <= 0) return;
    int s0, s1;
    thread_share(nq, tid, nt, &s0, &s1);
    for (int r = lo + s0; r < lo + s1; ++r) rmsnorm(s->x + (size_t)r * E, m->out_norm, E, m->norm_eps, s->xn + (size_t)r * E);
    quant_rows(s, s->xn, E, E, lo + s0, lo + s1, act_of(&m->output));
    sk_bar(tid, nt);
    {
        int ldx;
        const void *X = act_rows(s, act_of(&m->output), s->xn, E, lo, &ldx);
        if (A->ids) {
            head_reduce(m, s, X, ldx, nq, A->n_valid, A->inv_temp, A->ids + lo, A->vals + lo, tid, nt, NULL, 0);
            return;
        }
        int a, b;
        thread_share(m->output.n / SK_P, tid, nt, &a, &b);
        float *y = A->logits + (size_t)lo * A->ldl + (size_t)a * SK_P;
        mm(&m->output, X, ldx, nq, a, b, y, A->ldl, 0);
        if (m->final_softcap > 0.f) /* gemma2: c * tanh(logit / c) */
            for (int r = 0; r < nq; ++r)
                for (int c = 0; c < (b - a) * SK_P; ++c) y[(size_t)r * A->ldl + c] = softcap_sk(y[(size_t)r * A->ldl + c], m->final_softcap);
    }
}

static void step(const sk_model *m, const sk_kv *const *kvs, const int32_t *pos, sk_scratch *s, const int32_t *tokens, int q, float *logits, int ldl, int lo,
                 int32_t *ids, float *vals, int n_valid, float inv_temp) {
    step_args a = {m, kvs, pos, s, tokens, q, lo, logits, ldl, ids, vals, n_valid, inv_temp};
    sk_team_run(step_job, &a);
}

/* one matmul over float rows x [q][k] (quantized here as the step would), for tests */
typedef struct {
    const sk_mat *m;
    const float *x;
    int q;
    float *y;
    sk_scratch *s;
} mm_args;

static void mm_job(void *arg, int tid, int nt) {
    const mm_args *A = (const mm_args *)arg;
    int r0, r1;
    thread_share(A->q, tid, nt, &r0, &r1);
    quant_rows(A->s, A->x, A->m->k, A->m->k, r0, r1, act_of(A->m));
    sk_bar(tid, nt);
    const sk_mat *mats[1] = {A->m};
    float *ys[1] = {A->y};
    const int ld[1] = {A->m->n};
    mm_share(A->s, A->x, A->m->k, mats, ys, ld, 1, A->q, 0, tid, nt);
}

static void matmul(const sk_mat *m, const float *x, int q, float *y, sk_scratch *s) {
    mm_args a = {m, x, q, y, s};
    sk_team_run(mm_job, &a);
}

/* the reduced head over float rows x [q][ld], ids [0, n) (tests) */
typedef struct {
    const float *x;
    int q, n, ld;
    float it;
    int32_t *ids;
    float *vals;
    sk_scratch *s;
} amax_args;

static void amax_job(void *arg, int tid, int nt) {
    const amax_args *A = (const amax_args *)arg;
    head_reduce(NULL, A->s, NULL, 0, A->q, A->n, A->it, A->ids, A->vals, tid, nt, A->x, A->ld);
}

static void argmax_rows(const float *x, int q, int n, int ld, float it, int32_t *ids, float *vals, sk_scratch *s) {
    amax_args a = {x, q, n, ld, it, ids, vals, s};
    sk_team_run(amax_job, &a);
}
