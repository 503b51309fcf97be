/* Grouped-query attention over the f16 KV cache (sk.h's layout), and the q/k/v post-processing
 * (biases, RoPE, the new rows into the cache) before it. Kernel body: included by kernels.h
 * once per ISA path.
 */

/* o[d] += e[t] * V[t][d] for t in [t0, t1), d < nd (a multiple of 16, at most 128): the same
 * multiply and add per lane in order of t as a scalar loop; o kept in registers over the t */
static inline void v_rows(const uint16_t *V, size_t ldv, const float *e, int t0, int t1, float *o, int nd) {
    v16 acc[8];
    const int nv = nd / 16;
    for (int k = 0; k < nv; ++k) memcpy(&acc[k], o + 16 * k, 64);
    for (int t = t0; t < t1; ++t) {
        const uint16_t *vr = V + (size_t)t * ldv;
        const float et = e[t];
        for (int k = 0; k < nv; ++k) {
            float f[16];
            cvt16(vr + 16 * k, f);
            v16 vrow;
            memcpy(&vrow, f, 64);
            acc[k] = acc[k] + et * vrow;
        }
    }
    for (int k = 0; k < nv; ++k) memcpy(o + 16 * k, &acc[k], 64);
}

/* attention of rows [r0, r0 + nr) of one sequence (cache kv; row r at position pos[r]) for kv
 * head g and heads [h0, h1) of its group: scores, softmax, V. The rows take each K tile and
 * each chunk of V rows in turn while it is in L1 (read from memory once for all of them);
 * each (row, head) output is computed by the same operations as when its row is alone in the
 * call (its accumulators see the same tiles and positions in the same order), and reads only
 * kv's rows [0, pos[r]] */
#define SK_V_CHUNK 32 /* V rows (positions) the block's rows take in turn */

/* scores of one row for K tile j, heads [h0, h0 + nh): sb[i][j*16 + lane]; nh a constant where
 * it is inlined. The accumulators are GCC vector values (16 lanes; lowered to what each ISA
 * has), so they live in registers: lane by lane the same multiplies and adds as scalar code */
static inline __attribute__((always_inline)) void score_tile(const uint16_t *kt, const float *Qh, int hd, float scale, float cap, float *sb, int lds, int j,
                                                             const int nh) {
    v16 acc[SK_GROUP_MAX];
    for (int i = 0; i < nh; ++i) acc[i] = (v16){0};
    for (int d = 0; d < hd; ++d) {
        float kf_[16];
        cvt16(kt + d * 16, kf_);
        v16 kf;
        memcpy(&kf, kf_, 64);
        for (int i = 0; i < nh; ++i) acc[i] = acc[i] + Qh[i * hd + d] * kf;
    }
    for (int i = 0; i < nh; ++i) {
        v16 y = acc[i] * scale;
        if (cap > 0.f) softcap16(&y, cap); /* gemma2: c * tanh(score / c) before the softmax */
        memcpy(sb + i * lds + j * 16, &y, 64);
    }
}

/* e = exp(s - mx) in place over s[0, T), and the sum of e by the fixed lane structure
 * (lane t % 16 adds its terms in order of t, then tree16): 16 lanes at a time, the rest alone */
static inline float softmax_sum(float *si, int T) {
    float m16[16];
    for (int l2 = 0; l2 < 16; ++l2) m16[l2] = si[0];
    int t = 0;
    /* the maximum: the same value whatever the order (no NaN here; a ternary, not libm's fmaxf) */
    for (; t + 16 <= T; t += 16)
        for (int l2 = 0; l2 < 16; ++l2) m16[l2] = si[t + l2] > m16[l2] ? si[t + l2] : m16[l2];
    float mx = m16[0];
    for (int l2 = 1; l2 < 16; ++l2) mx = m16[l2] > mx ? m16[l2] : mx;
    for (; t < T; ++t) mx = si[t] > mx ? si[t] : mx;
    float part[16] = {0};
    v16 acc = (v16){0};
    for (t = 0; t + 16 <= T; t += 16) {
        v16 x;
        memcpy(&x, si + t, 64);
        x = x - mx;
        expf16(&x);
        memcpy(si + t, &x, 64);
        acc = acc + x;
    }
    memcpy(part, &acc, 64);
    for (; t < T; ++t) {
        si[t] = exp_cephes(si[t] - mx);
        part[t & 15] = part[t & 15] + si[t];
    }
    return tree16(part);
}
static void attend(const sk_model *m, const sk_kv *kv, sk_scratch *s, int l, int r0, int nr, const int32_t *pos, int g, int h0, int h1, int tid) {
    const int hd = m->head_dim, nkv = m->n_head_kv, nh = h1 - h0, ctx = m->max_ctx, swa = m->layers[l].swa;
    const uint16_t *K = kv->k + (size_t)l * ctx * nkv * hd;
    const uint16_t *V = kv->v + (size_t)l * ctx * nkv * hd;
    /* row b attends to positions [T0[b], T[b]): all before it, or (a sliding layer) the last swa */
    int T[SK_ATT_ROWS], T0[SK_ATT_ROWS], Tmax = 0;
    for (int b = 0; b < nr; ++b) {
        T[b] = pos[r0 + b] + 1;
        T0[b] = swa > 0 && T[b] > swa ? T[b] - swa : 0;
        if (T[b] > Tmax) Tmax = T[b];
    }
    const int ntile = (Tmax + 15) / 16, lds = ntile * 16;
    float *sc = s->scores + (size_t)tid * s->ld_scores; /* [nr][nh][lds] */
    for (int j = 0; j < ntile; ++j) {
        const uint16_t *kt = K + ((size_t)j * nkv + g) * hd * 16;
        for (int b = 0; b < nr; ++b) {
            if (j * 16 >= T[b] || j * 16 + 16 <= T0[b]) continue; /* a tile past this row's position, or before its window */
            const float *Qh = s->q + (size_t)(r0 + b) * m->n_head * hd + (size_t)h0 * hd;
            float *sb = sc + (size_t)b * nh * lds;
            const float sc_ = m->attn_scale, cap = m->attn_softcap;
            switch (nh) { /* a constant head count per case: see score_tile */
            case 1: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 1); break;
            case 2: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 2); break;
            case 3: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 3); break;
            case 4: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 4); break;
            case 5: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 5); break;
            case 6: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 6); break;
            case 7: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 7); break;
            default: score_tile(kt, Qh, hd, sc_, cap, sb, lds, j, 8); break;
            }
        }
    }
    float inv[SK_ATT_ROWS][SK_GROUP_MAX];
    for (int b = 0; b < nr; ++b) {
        float *out = s->att + (size_t)(r0 + b) * m->n_head * hd;
        for (int i = 0; i < nh; ++i) {
            inv[b][i] = softmax_sum(sc + ((size_t)b * nh + i) * lds + T0[b], T[b] - T0[b]);
            for (int d = 0; d < hd; ++d) out[(h0 + i) * hd + d] = 0.f;
        }
    }
    for (int t0 = 0; t0 < Tmax; t0 += SK_V_CHUNK)
        for (int b = 0; b < nr; ++b) {
            const int ta = t0 > T0[b] ? t0 : T0[b], t1 = t0 + SK_V_CHUNK < T[b] ? t0 + SK_V_CHUNK : T[b];
            if (ta >= t1) continue;
            float *out = s->att + (size_t)(r0 + b) * m->n_head * hd;
            const float *sb = sc + (size_t)b * nh * lds;
            for (int i = 0; i < nh; ++i)
                for (int d0 = 0; d0 < hd; d0 += 128) /* 8 lane groups of one head in registers */
                    v_rows(V + g * hd + d0, nkv * hd, sb + i * lds, ta, t1, out + (h0 + i) * hd + d0, hd - d0 < 128 ? hd - d0 : 128);
        }
    for (int b = 0; b < nr; ++b) {
        float *out = s->att + (size_t)(r0 + b) * m->n_head * hd;
        for (int i = 0; i < nh; ++i) {
            float *o = out + (h0 + i) * hd;
            for (int d = 0; d < hd; ++d) o[d] = o[d] / inv[b][i];
        }
    }
}
#undef SK_V_CHUNK

/* biases, RoPE, and the new K/V rows into each row's cache: items (row, head) over q and kv heads */
static void qkv_post(const sk_model *m, const sk_kv *const *kvs, const int32_t *posv, sk_scratch *s, int l, int q, int tid, int nt) {
    const sk_layer *L = &m->layers[l];
    const int hd = m->head_dim, nh = m->n_head, nkv = m->n_head_kv, ctx = m->max_ctx, half = hd / 2;
    const int items = q * (nh + nkv);
    int a, b;
    thread_share(items, tid, nt, &a, &b);
    for (int it = a; it < b; ++it) {
        const int r = it / (nh + nkv), h = it % (nh + nkv), pos = posv[r];
        const sk_kv *kv = kvs[r];
        const float *rc = L->rope_cos ? L->rope_cos : m->rope_cos, *rs = L->rope_sin ? L->rope_sin : m->rope_sin;
        const float *cs = rc + (size_t)pos * half, *sn = rs + (size_t)pos * half;
        if (h < nh) {
            float *v = s->q + ((size_t)r * nh + h) * hd;
            if (L->bq)
                for (int d = 0; d < hd; ++d) v[d] = v[d] + L->bq[h * hd + d];
            if (L->q_norm) rmsnorm(v, L->q_norm, hd, m->norm_eps, v); /* in place: each out[i] reads x[i] only after the sum */
            rope(v, cs, sn, hd, m->rope_neox);
        } else {
            const int g = h - nh;
            float *kk = s->k + ((size_t)r * nkv + g) * hd, *vv = s->v + ((size_t)r * nkv + g) * hd;
            if (L->bk)
                for (int d = 0; d < hd; ++d) kk[d] = kk[d] + L->bk[g * hd + d];
            if (L->bv)
                for (int d = 0; d < hd; ++d) vv[d] = vv[d] + L->bv[g * hd + d];
            if (L->k_norm) rmsnorm(kk, L->k_norm, hd, m->norm_eps, kk);
            rope(kk, cs, sn, hd, m->rope_neox);
            uint16_t *kt = kv->k + (size_t)l * ctx * nkv * hd + (((size_t)(pos / 16) * nkv + g) * hd) * 16 + (pos & 15);
            uint16_t *vr = kv->v + (size_t)l * ctx * nkv * hd + ((size_t)pos * nkv + g) * hd;
            for (int d = 0; d < hd; ++d) {
                kt[d * 16] = sk_f2h(kk[d]);
                vr[d] = sk_f2h(vv[d]);
            }
        }
    }
}
