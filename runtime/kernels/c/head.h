/* The reduced LM head: each row's first maximum (numpy's argmax) and its logit or softmax
 * probability, without a logits row. Kernel body: included by kernels.h once per ISA path.
 */

/* x[0, n) (ids base..base+n-1) into the running first maximum (*bv, *bi; *bi < 0: none yet) as
 * numpy's argmax orders them: NaN ranks above every number and the first NaN stays; among equal
 * maxima the first id. Comparisons only (no arithmetic): the result does not depend on the lanes
 * or the ISA. */
static inline void argmax_scan(const float *x, int n, int base, float *bv, int32_t *bi) {
    if (*bi >= 0 && *bv != *bv) return; /* a NaN came first */
    int j = 0;
    if (n >= 16) {
        v16 mx = *(const v16 *)x;
        v16i nan = mx != mx;
        for (j = 16; j + 16 <= n; j += 16) {
            const v16 v = *(const v16 *)(x + j);
            const v16i gt = v > mx;
            mx = (v16)(((v16i)v & gt) | ((v16i)mx & ~gt));
            nan |= v != v;
        }
        int any = 0;
        for (int l = 0; l < 16; ++l) any |= nan[l];
        if (any) {
            for (int t = 0; t < j; ++t)
                if (x[t] != x[t]) {
                    *bv = x[t], *bi = base + t;
                    return;
                }
        }
        float m = mx[0];
        for (int l = 1; l < 16; ++l)
            if (mx[l] > m) m = mx[l];
        if (*bi < 0 || m > *bv)
            for (int t = 0; t < j; ++t)
                if (x[t] == m) {
                    *bv = x[t], *bi = base + t; /* x[t], not m: -0.0 == 0.0, the row's own bits */
                    break;
                }
    }
    for (; j < n; ++j) {
        const float v = x[j];
        if (v != v) {
            *bv = v, *bi = base + j;
            return;
        }
        if (*bi < 0 || v > *bv) *bv = v, *bi = base + j;
    }
}

/* sum of exp((x[t] - mx) * it) over t < n by the fixed lane structure (lane t % 16 adds its
 * terms in order of t, then tree16), 16 lanes at a time with expf16, the rest with expf: the
 * same bits on every ISA path */
static float exp_sum(const float *x, int n, float mx, float it) {
    v16 acc = (v16){0};
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        v16 z = (*(const v16 *)(x + t) - mx) * it;
        expf16(&z);
        acc = acc + z;
    }
    float part[16];
    memcpy(part, &acc, 64);
    for (; t < n; ++t) part[t & 15] = part[t & 15] + exp_cephes((x[t] - mx) * it);
    return tree16(part);
}

/* The LM head of nq rows (activations X, ldx blocks a row) reduced over ids [0, n_valid): each
 * row's first maximum, ids[r], and vals[r]: its logit (it <= 0), or (it > 0, a draft's greedy
 * step) its softmax probability at 1/T = it, softmax(logits * it)[ids[r]]. The ids are cut in
 * chunks of SK_HEAD_COLS columns, fixed whatever the thread count; threads take whole chunks,
 * project each into their own small buffer (no logits row is written) and keep per chunk and
 * row its first maximum and its sum of exp((x - max) * it). The chunks are then merged in id
 * order (the first maximum wins; the sum as sum_c s_c * exp((max_c - max) * it) in chunk
 * order), so every result is the same bits for any thread split and ISA path. The logits are
 * the ones the full head writes, bit for bit (the same panel kernels). With F (tests:
 * sk_argmax) the rows are read from F (ldf floats a row) instead of projected. With s->pens,
 * head row r with a penalty row competes as logits + penalty (float adds, as numpy's
 * np.add(row, pen) of the written row: constrained greedy decoding without a logits row). */
static void head_reduce(const sk_model *m, sk_scratch *s, const void *X, int ldx, int nq, int n_valid, float it, int32_t *ids, float *vals, int tid, int nt,
                        const float *F, int ldf) {
    const int np = (n_valid + SK_P - 1) / SK_P, ch = SK_HEAD_COLS / SK_P, nc = (np + ch - 1) / ch, mq = s->max_q;
    int a, b;
    thread_share(nc, tid, nt, &a, &b);
    float *buf = s->hbuf + (size_t)tid * mq * SK_HEAD_COLS;
    for (int c = a; c < b; ++c) {
        const int c0 = c * ch, c1 = c0 + ch < np ? c0 + ch : np, n0 = c0 * SK_P, n1 = c1 * SK_P < n_valid ? c1 * SK_P : n_valid;
        if (!F) {
            mm(&m->output, X, ldx, nq, c0, c1, buf, SK_HEAD_COLS, 0); /* panel c0 at buf[0] */
            if (m->final_softcap > 0.f)                               /* the logits the full head writes (step.h) */
                for (int r = 0; r < nq; ++r)
                    for (int t = 0; t < n1 - n0; ++t) buf[(size_t)r * SK_HEAD_COLS + t] = softcap_sk(buf[(size_t)r * SK_HEAD_COLS + t], m->final_softcap);
        }
        for (int r = 0; r < nq; ++r) {
            const float *x = F ? F + (size_t)r * ldf + n0 : buf + (size_t)r * SK_HEAD_COLS;
            const float *pen = s->pens ? s->pens[r] : NULL;
            if (pen) { /* the masked, biased row a caller would make of the logits row: one float add each */
                float *y = buf + (size_t)r * SK_HEAD_COLS;
                for (int t = 0; t < n1 - n0; ++t) y[t] = x[t] + pen[n0 + t];
                x = y;
            }
            const size_t o = (size_t)c * mq + r;
            float v = 0.f;
            int32_t i = -1;
            argmax_scan(x, n1 - n0, n0, &v, &i);
            s->amax_v[o] = v;
            s->amax_i[o] = i;
            if (it > 0.f) s->amax_s[o] = v - v == 0.f ? exp_sum(x, n1 - n0, v, it) : 0.f; /* a finite maximum only */
        }
    }
    sk_bar(tid, nt);
    int r0, r1;
    thread_share(nq, tid, nt, &r0, &r1);
    for (int r = r0; r < r1; ++r) {
        float v = 0.f;
        int32_t i = -1;
        for (int c = 0; c < nc; ++c) {
            const float cv = s->amax_v[(size_t)c * mq + r];
            if (i < 0 || (v == v && (cv > v || cv != cv))) v = cv, i = s->amax_i[(size_t)c * mq + r];
        }
        ids[r] = i;
        if (it <= 0.f) {
            vals[r] = v;
            continue;
        }
        if (v - v != 0.f) { /* NaN or inf at the maximum: no probability (the caller refuses the row) */
            vals[r] = v - v;
            continue;
        }
        float sum = 0.f;
        for (int c = 0; c < nc; ++c) {
            const size_t o = (size_t)c * mq + r;
            sum = sum + s->amax_s[o] * exp_cephes((s->amax_v[o] - v) * it);
        }
        vals[r] = 1.f / sum;
    }
}
