/* specrt kernels: the library the Python side loads with ctypes (runtime/kernels/__init__.py).
 *
 * One translation unit: the ISA-independent parts (thread team, f16 conversion, row
 * dequantization, scratch, the exported entry points) and three copies of sk_isa.h, each
 * compiled for its ISA inside a `#pragma GCC target` region (AVX-512 VNNI, AVX2, portable C);
 * the path is chosen at run time (sk_cpu_isa, or the caller's choice for tests).
 * Build flags (setup.py): -O3 -ffp-contract=off -fno-fast-math -pthread: no contraction of a
 * multiply and an add into an FMA the source did not write, so the portable path and the
 * vectorised ones round identically.
 */
#define _GNU_SOURCE
#include "sk.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
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
#define SK_HEAD_COLS 1024     /* columns of the LM head a reduced head's chunk holds (a multiple of SK_P) */
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

typedef struct {
    float *x, *xn, *q, *k, *v, *att, *g, *u, *scores;
    sk_a256 *a256;
    sk_a32 *a32;
    const sk_kv **kvs; /* sk_step's rows: one sequence, positions start.. */
    int32_t *pos;
    int32_t *blk_r0, *blk_n;         /* attention row blocks of a step: first row, rows */
    float *hbuf;                     /* reduced head: per thread, max_q x SK_HEAD_COLS logits; per chunk and row ... */
    float *amax_v, *amax_s;          /* ... the first maximum, the sum of exp((x - max) / T) ... */
    int32_t *amax_i;                 /* ... and the maximum's id */
    atomic_int att_next[SK_MAX_LAYERS]; /* per layer: the next attention item to take */
    int n_blocks;
    int lda256, lda32, max_q, head_split;
    size_t ld_scores;
} sk_scratch;

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
/* software prefetch of [p, p + bytes): a thread streaming panels keeps enough cache lines in
 * flight to approach the memory bandwidth (its hardware prefetcher alone reached ~60% of it
 * beside the kernels' arithmetic); a prefetch past the end of a mapping is harmless */
#define SK_PF_AHEAD 2 /* K blocks (of the panel being read) ahead */
static inline void sk_prefetch(const uint8_t *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}
static inline int32_t sk_ld32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---------------------------------------------------------------- panel types */

static inline int sk_is_kquant(int t) { return t == SK_Q4_K || t == SK_Q6_K; }
static inline size_t sk_psb(int t) {
    switch (t) {
    case SK_Q4_K: return SK_Q4K_PSB;
    case SK_Q6_K: return SK_Q6K_PSB;
    case SK_Q8_0:
    case SK_Q5_0: return SK_I8_PSB;
    case SK_Q4_0: return SK_Q40_PSB;
    case SK_Q4_1: return SK_Q41_PSB;
    default: return 0;
    }
}
/* activation kinds a matrix reads: 1 = per 256 (Q8_K), 2 = per 32 (Q8_0) */
static inline int sk_need(const sk_mat *m) { return sk_is_kquant(m->type) ? 1 : 2; }

/* row n of a panel matrix as floats [k], by the GGUF formulas (gguf-py's dequantize_blocks) */
static void sk_dequant_row(const sk_mat *m, int n, float *out) {
    const int p = n / SK_P, c = n % SK_P, kb = sk_is_kquant(m->type) ? 256 : 32, nb = m->k / kb;
    const size_t psb = sk_psb(m->type);
    const uint8_t *w = m->w + (size_t)p * nb * psb;
    for (int b = 0; b < nb; ++b) {
        const uint8_t *o = w + (size_t)b * psb;
        float *y = out + (size_t)b * kb;
        if (m->type == SK_Q4_K) {
            const uint8_t *sc = o + 128 * SK_P, *mn = sc + 8 * SK_P;
            const uint16_t *dd = (const uint16_t *)(mn + 8 * SK_P);
            const float d = sk_h2f(dd[c]), dmin = sk_h2f(dd[SK_P + c]);
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
        } else if (m->type == SK_Q6_K) {
            const uint8_t *qh = o + 128 * SK_P;
            const int8_t *sc = (const int8_t *)(qh + 64 * SK_P);
            const float d = sk_h2f(((const uint16_t *)(sc + 16 * SK_P))[c]);
            for (int k = 0; k < 256; ++k) {
                const int sb = k / 16, t = (k % 16) / 4, e = k % 4, g = sb / 4, u = sb % 4;
                const uint8_t lb = o[(((sb >> 1) * 4 + t) * SK_P + c) * 4 + e];
                const int lo = (sb & 1) ? lb >> 4 : lb & 15, hi = (o[128 * SK_P + ((g * 4 + t) * SK_P + c) * 4 + e] >> (2 * u)) & 3;
                y[k] = (d * (float)sc[sb * SK_P + c]) * (float)((lo | hi << 4) - 32);
            }
        } else if (m->type == SK_Q8_0 || m->type == SK_Q5_0) {
            const float d = sk_h2f(((const uint16_t *)(o + 32 * SK_P))[c]);
            for (int k = 0; k < 32; ++k) y[k] = d * (float)(int8_t)o[((k / 4) * SK_P + c) * 4 + k % 4];
        } else {
            const uint16_t *dd = (const uint16_t *)(o + 16 * SK_P);
            const float d = sk_h2f(dd[c]);
            for (int k = 0; k < 16; ++k) {
                const uint8_t v = o[((k / 4) * SK_P + c) * 4 + k % 4];
                if (m->type == SK_Q4_1) {
                    const float mm = sk_h2f(dd[SK_P + c]);
                    y[k] = d * (float)(v & 15) + mm;
                    y[k + 16] = d * (float)(v >> 4) + mm;
                } else {
                    y[k] = d * (float)((v & 15) - 8);
                    y[k + 16] = d * (float)((v >> 4) - 8);
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- the thread team
 * nt threads: the caller of sk_team_run is thread 0, nt - 1 workers persist between calls.
 * Inside a job threads meet at sk_bar (spinning: a step has ~300 of them). Between jobs a
 * worker spins for spin_us, then sleeps on a futex, so that a long pause (a draft model on
 * another runtime's threads, an idle server) costs no core. */

typedef void (*sk_job_fn)(void *arg, int tid, int nt);
typedef struct {
    _Alignas(64) atomic_int v;
} sk_padded;

static struct {
    pthread_mutex_t call;
    int nt, spin_us, started;
    pthread_t th[SK_MAX_THREADS];
    _Alignas(64) atomic_uint gen; /* job number (a futex word) */
    _Alignas(64) atomic_int sleepers;
    _Alignas(64) atomic_int arrive; /* barrier arrivals in this job */
    _Alignas(64) atomic_int done;   /* workers finished with this job */
    atomic_int quit;
    unsigned start_gen; /* gen when the workers were created: their first job is the next */
    sk_job_fn fn;
    void *arg;
    sk_padded nbar[SK_MAX_THREADS]; /* barriers passed by each thread in this job */
} T = {.call = PTHREAD_MUTEX_INITIALIZER, .nt = 1, .spin_us = 200};

static inline void sk_pause(void) {
#if SK_X86
    _mm_pause();
#endif
}
static uint64_t sk_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sk_bar(int tid, int nt) {
    if (nt <= 1) return;
    const int n = atomic_load_explicit(&T.nbar[tid].v, memory_order_relaxed) + 1;
    atomic_store_explicit(&T.nbar[tid].v, n, memory_order_relaxed);
    const int target = n * nt;
    atomic_fetch_add_explicit(&T.arrive, 1, memory_order_acq_rel);
    /* spin; when the cores are oversubscribed (a peer thread descheduled), yield after a while
     * instead of burning the time slice the peer needs */
    for (unsigned i = 0; atomic_load_explicit(&T.arrive, memory_order_acquire) < target; ++i) {
        if (i < 4000) sk_pause();
        else sched_yield();
    }
}

static void sk_wait_gen(unsigned seen) {
    const uint64_t t0 = sk_now_ns(), spin = (uint64_t)T.spin_us * 1000ull;
    for (;;) {
        for (int i = 0; i < 200; ++i) {
            if (atomic_load_explicit(&T.gen, memory_order_acquire) != seen) return;
            sk_pause();
        }
        if (sk_now_ns() - t0 > spin) break;
    }
    atomic_fetch_add(&T.sleepers, 1);
    while (atomic_load_explicit(&T.gen, memory_order_acquire) == seen) {
#if defined(__linux__)
        syscall(SYS_futex, (void *)&T.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
        usleep(50);
#endif
    }
    atomic_fetch_sub(&T.sleepers, 1);
}

static void *sk_worker(void *p) {
    const int tid = (int)(intptr_t)p;
    unsigned seen = T.start_gen; /* not a fresh load: a job published before this thread ran is its own */
    for (;;) {
        sk_wait_gen(seen);
        seen = atomic_load_explicit(&T.gen, memory_order_acquire);
        if (atomic_load(&T.quit)) return NULL;
        T.fn(T.arg, tid, T.nt);
        atomic_fetch_add_explicit(&T.done, 1, memory_order_acq_rel);
    }
}

static void sk_publish(void) {
    atomic_fetch_add_explicit(&T.gen, 1, memory_order_acq_rel);
#if defined(__linux__)
    if (atomic_load(&T.sleepers) > 0) syscall(SYS_futex, (void *)&T.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
}

static void sk_team_stop_locked(void) {
    if (!T.started) return;
    atomic_store(&T.quit, 1);
    sk_publish();
    for (int i = 1; i < T.nt; ++i) pthread_join(T.th[i], NULL);
    atomic_store(&T.quit, 0);
    T.started = 0;
    T.nt = 1;
}

static void sk_team_run(sk_job_fn fn, void *arg) {
    pthread_mutex_lock(&T.call);
    const int nt = T.nt;
    T.fn = fn;
    T.arg = arg;
    atomic_store(&T.arrive, 0);
    atomic_store(&T.done, 0);
    for (int i = 0; i < nt; ++i) atomic_store_explicit(&T.nbar[i].v, 0, memory_order_relaxed);
    if (nt > 1) sk_publish();
    fn(arg, 0, nt);
    for (unsigned i = 0; atomic_load_explicit(&T.done, memory_order_acquire) < nt - 1; ++i) {
        if (i < 4000) sk_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&T.call);
}

/* ---------------------------------------------------------------- the three ISA copies */

#if SK_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,prefer-vector-width=512")
#define SK_LEVEL 2
#define SKF(n) n##_avx512
#include "sk_isa.h"
#undef SKF
#undef SK_LEVEL
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define SK_LEVEL 1
#define SKF(n) n##_avx2
#include "sk_isa.h"
#undef SKF
#undef SK_LEVEL
#pragma GCC pop_options
#endif

#define SK_LEVEL 0
#define SKF(n) n##_portable
#include "sk_isa.h"
#undef SKF
#undef SK_LEVEL

/* ---------------------------------------------------------------- exported entry points */

/* error codes (the Python side words them) */
enum { SK_OK = 0, SK_E_ISA = -1, SK_E_ARGS = -2, SK_E_TOKEN = -3, SK_E_NOMEM = -4, SK_E_THREADS = -5 };

SK_EXPORT int sk_abi(void) { return SK_ABI; }

#ifndef SK_SOURCES
#define SK_SOURCES "unknown"
#endif
/* the SHA-256 (16 hex digits) of the sources this library was built from (setup.py) */
SK_EXPORT const char *sk_sources(void) { return SK_SOURCES; }

/* the fastest path this CPU and build can run */
SK_EXPORT int sk_cpu_isa(void) {
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

/* (re)start the team with nt threads in all (the caller included); spin_us: how long an idle
 * worker spins before it sleeps */
SK_EXPORT int sk_team_start(int nt, int spin_us) {
    if (nt < 1 || nt > SK_MAX_THREADS || spin_us < 0) return SK_E_ARGS;
    pthread_mutex_lock(&T.call);
    int rc = SK_OK;
    T.spin_us = spin_us;
    if (!T.started || T.nt != nt) {
        sk_team_stop_locked();
        T.nt = nt;
        T.start_gen = atomic_load(&T.gen);
        for (int i = 1; i < nt; ++i)
            if (pthread_create(&T.th[i], NULL, sk_worker, (void *)(intptr_t)i) != 0) {
                T.nt = i; /* the ones started so far */
                sk_team_stop_locked();
                rc = SK_E_THREADS;
                break;
            }
        if (rc == SK_OK) T.started = 1;
    }
    pthread_mutex_unlock(&T.call);
    return rc;
}

SK_EXPORT int sk_team_threads(void) { return T.nt; }

static void *sk_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64)) return NULL;
    memset(p, 0, bytes);
    return p;
}

SK_EXPORT void sk_scratch_free(void *p) {
    sk_scratch *s = (sk_scratch *)p;
    if (!s) return;
    free(s->x); free(s->xn); free(s->q); free(s->k); free(s->v); free(s->att); free(s->g); free(s->u); free(s->scores);
    free(s->a256); free(s->a32); free(s->kvs); free(s->pos); free(s->blk_r0); free(s->blk_n); free(s->hbuf); free(s->amax_v); free(s->amax_s); free(s->amax_i);
    free(s);
}

/* scratch for steps of up to max_q rows: e = n_embd, qd = n_head * head_dim, kd = n_head_kv *
 * head_dim, f = n_ff, ctx = KV rows (attention scores); a matmul-only scratch passes its k as e */
SK_EXPORT void *sk_scratch_new(int max_q, int e, int qd, int kd, int f, int ctx) {
    if (max_q < 1 || e < 1 || qd < 0 || kd < 0 || f < 0 || ctx < 0) return NULL;
    sk_scratch *s = (sk_scratch *)calloc(1, sizeof *s);
    if (!s) return NULL;
    int maxk = e;
    if (qd > maxk) maxk = qd;
    if (f > maxk) maxk = f;
    s->max_q = max_q;
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
    /* not cleared: a thread writes its part before reading it, and untouched pages stay
     * out of the resident set (64 threads' parts are reserved) */
    if (posix_memalign((void **)&s->scores, 64, (size_t)SK_MAX_THREADS * s->ld_scores * 4)) s->scores = NULL;
    if (posix_memalign((void **)&s->hbuf, 64, (size_t)SK_MAX_THREADS * Q * SK_HEAD_COLS * 4)) s->hbuf = NULL;
    s->amax_v = sk_alloc((size_t)SK_HEAD_CHUNKS_MAX * Q * 4);
    s->amax_s = sk_alloc((size_t)SK_HEAD_CHUNKS_MAX * Q * 4);
    s->amax_i = sk_alloc((size_t)SK_HEAD_CHUNKS_MAX * Q * 4);
    s->a256 = sk_alloc(Q * s->lda256 * sizeof(sk_a256));
    s->a32 = sk_alloc(Q * s->lda32 * sizeof(sk_a32));
    s->kvs = sk_alloc(Q * sizeof(sk_kv *));
    s->pos = sk_alloc(Q * sizeof(int32_t));
    s->blk_r0 = sk_alloc(Q * sizeof(int32_t));
    s->blk_n = sk_alloc(Q * sizeof(int32_t));
    if (!s->x || !s->xn || !s->q || !s->k || !s->v || !s->att || !s->g || !s->u || !s->scores || !s->a256 || !s->a32 || !s->kvs || !s->pos ||
        !s->blk_r0 || !s->blk_n || !s->hbuf || !s->amax_v || !s->amax_s || !s->amax_i) {
        sk_scratch_free(s);
        return NULL;
    }
    return s;
}

static int sk_isa_ok(int isa) { return isa >= SK_ISA_PORTABLE && isa <= sk_cpu_isa(); }

static int sk_mat_ok(const sk_mat *m) {
    if (!m->w || m->n <= 0 || m->k <= 0 || m->n % SK_P || !sk_psb(m->type)) return 0;
    return m->k % (sk_is_kquant(m->type) ? 256 : 32) == 0;
}

/* y [q][m->n] = the matmul of float rows x [q][m->k], activations quantized as in a step */
SK_EXPORT int sk_matmul(int isa, const sk_mat *m, const float *x, int q, float *y, void *scratch) {
    sk_scratch *s = (sk_scratch *)scratch;
    if (!sk_isa_ok(isa)) return SK_E_ISA;
    if (!sk_mat_ok(m) || q < 1 || !s || q > s->max_q || (m->k + 255) / 256 > s->lda256 || m->k / 32 > s->lda32) return SK_E_ARGS;
#if SK_X86
    if (isa == SK_ISA_AVX512VNNI) return matmul_avx512(m, x, q, y, s), SK_OK;
    if (isa == SK_ISA_AVX2) return matmul_avx2(m, x, q, y, s), SK_OK;
#endif
    matmul_portable(m, x, q, y, s);
    return SK_OK;
}

/* ids[r], vals[r] = sk_step_argmax's reduced head over float rows x [q][ld], ids [0, n) (tests:
 * its chunks, scan, sums and merge, on rows the caller chooses) */
SK_EXPORT int sk_argmax(int isa, const float *x, int q, int n, int ld, float inv_temp, int32_t *ids, float *vals, void *scratch) {
    sk_scratch *s = (sk_scratch *)scratch;
    if (!sk_isa_ok(isa)) return SK_E_ISA;
    if (!s || !x || !ids || !vals || q < 1 || q > s->max_q || n < 1 || ld < n || n > SK_HEAD_CHUNKS_MAX * SK_HEAD_COLS) return SK_E_ARGS;
#if SK_X86
    if (isa == SK_ISA_AVX512VNNI) return argmax_rows_avx512(x, q, n, ld, inv_temp, ids, vals, s), SK_OK;
    if (isa == SK_ISA_AVX2) return argmax_rows_avx2(x, q, n, ld, inv_temp, ids, vals, s), SK_OK;
#endif
    argmax_rows_portable(x, q, n, ld, inv_temp, ids, vals, s);
    return SK_OK;
}

/* the last step's attention output of its last layer, rows [0, q) x n_head * head_dim floats
 * (before its 8-bit quantization: the bits the tests compare across calls) */
SK_EXPORT int sk_scratch_attention(void *scratch, int q, int cols, float *out) {
    sk_scratch *s = (sk_scratch *)scratch;
    if (!s || q < 1 || q > s->max_q || cols < 1) return SK_E_ARGS;
    memcpy(out, s->att, (size_t)q * cols * sizeof(float));
    return SK_OK;
}

/* rows [n0, n1) of a panel matrix as floats, out [(n1 - n0)][m->k] */
SK_EXPORT int sk_dequant(const sk_mat *m, int n0, int n1, float *out) {
    if (!sk_mat_ok(m) || n0 < 0 || n1 > m->n || n0 > n1) return SK_E_ARGS;
    for (int n = n0; n < n1; ++n) sk_dequant_row(m, n, out + (size_t)(n - n0) * m->k);
    return SK_OK;
}

/* checks shared by the step entry points; sets the attention split for q rows */
static int sk_step_check(int isa, const sk_model *m, sk_scratch *s, const int32_t *tokens, int q, int ldl, int lo) {
    if (!sk_isa_ok(isa)) return SK_E_ISA;
    if (!s || q < 1 || q > s->max_q || lo < 0 || lo > q || ldl < m->output.n) return SK_E_ARGS;
    if (m->head_dim % 16 || m->head_dim > SK_HEAD_DIM_MAX || m->n_head % m->n_head_kv) return SK_E_ARGS;
    for (int r = 0; r < q; ++r)
        if (tokens[r] < 0 || tokens[r] >= m->tok_embd.n) return SK_E_TOKEN; /* the embedding's rows (a draft's head may be trimmed) */
    if (m->n_layer > SK_MAX_LAYERS) return SK_E_ARGS;
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
    const int per = m->n_head / m->n_head_kv;
    int split = (per + SK_GROUP_MAX - 1) / SK_GROUP_MAX;
    while (split < per && nb * m->n_head_kv * split < 2 * T.nt) ++split;
    s->head_split = split;
    for (int l = 0; l < m->n_layer; ++l) atomic_store_explicit(&s->att_next[l], 0, memory_order_relaxed);
}

static void sk_step_go(int isa, const sk_model *m, const sk_kv *const *kvs, const int32_t *pos, sk_scratch *s, const int32_t *tokens, int q, float *logits, int ldl, int lo,
                       int32_t *ids, float *vals, int n_valid, float inv_temp) {
    sk_plan_attention(m, kvs, s, q);
#if SK_X86
    if (isa == SK_ISA_AVX512VNNI) { step_avx512(m, kvs, pos, s, tokens, q, logits, ldl, lo, ids, vals, n_valid, inv_temp); return; }
    if (isa == SK_ISA_AVX2) { step_avx2(m, kvs, pos, s, tokens, q, logits, ldl, lo, ids, vals, n_valid, inv_temp); return; }
#endif
    step_portable(m, kvs, pos, s, tokens, q, logits, ldl, lo, ids, vals, n_valid, inv_temp);
}

/* one decoder step: q new tokens at positions start..start+q-1 over KV rows [0, start);
 * writes KV rows [start, start+q) and logits rows [lo, q) (row r at logits + r * ldl) */
SK_EXPORT int sk_step(int isa, const sk_model *m, const sk_kv *kv, void *scratch, const int32_t *tokens, int q, int start, float *logits, int ldl, int lo) {
    sk_scratch *s = (sk_scratch *)scratch;
    const int rc = sk_step_check(isa, m, s, tokens, q, ldl, lo);
    if (rc != SK_OK) return rc;
    if (start < 0 || start + q > m->max_ctx) return SK_E_ARGS;
    for (int r = 0; r < q; ++r) {
        s->kvs[r] = kv;
        s->pos[r] = start + r;
    }
    sk_step_go(isa, m, (const sk_kv *const *)s->kvs, s->pos, s, tokens, q, logits, ldl, lo, NULL, NULL, 0, 0.f);
    return SK_OK;
}

/* sk_step with the LM head reduced to each row's greedy token (what greedy verification and a
 * greedy draft step read): rows [lo, q) get ids[r], their first maximum over ids [0, n_valid),
 * as numpy's argmax of the row sk_step writes (the same logits bit for bit: NaN ranks highest
 * and the first NaN wins; among equal maxima the lowest id), and vals[r]: its logit when
 * inv_temp <= 0, else its softmax probability at 1/T = inv_temp (NaN where the maximum is not
 * finite). No logits row is written: each thread keeps a few thousand logits in its cache at a
 * time. Every result is the same bits for any thread count and ISA path. */
SK_EXPORT int sk_step_argmax(int isa, const sk_model *m, const sk_kv *kv, void *scratch, const int32_t *tokens, int q, int start, int32_t *ids, float *vals, int n_valid,
                             float inv_temp, int lo) {
    sk_scratch *s = (sk_scratch *)scratch;
    const int rc = sk_step_check(isa, m, s, tokens, q, m->output.n, lo);
    if (rc != SK_OK) return rc;
    if (start < 0 || start + q > m->max_ctx || n_valid < 1 || n_valid > m->output.n || n_valid > SK_HEAD_CHUNKS_MAX * SK_HEAD_COLS || !ids || !vals) return SK_E_ARGS;
    for (int r = 0; r < q; ++r) {
        s->kvs[r] = kv;
        s->pos[r] = start + r;
    }
    sk_step_go(isa, m, (const sk_kv *const *)s->kvs, s->pos, s, tokens, q, NULL, 0, lo, ids, vals, n_valid, inv_temp);
    return SK_OK;
}

/* one decoder step over rows of several sequences (continuous batching, batched verification):
 * row r feeds tokens[r] at position pos[r] of the cache kvs[r]: it reads that cache's rows
 * [0, pos[r]] (the rows of this call at lower positions of the same cache included) and writes
 * its row pos[r]. Two rows may not name the same (cache, position). Every row's bits are the
 * ones sk_step gives it: rows never read another sequence's data and every output is computed
 * by the same operations whatever the call holds. Logits rows [lo, q) as sk_step. */
SK_EXPORT int sk_step_rows(int isa, const sk_model *m, const sk_kv *const *kvs, void *scratch, const int32_t *tokens, const int32_t *pos, int q, float *logits, int ldl, int lo) {
    sk_scratch *s = (sk_scratch *)scratch;
    const int rc = sk_step_check(isa, m, s, tokens, q, ldl, lo);
    if (rc != SK_OK) return rc;
    for (int r = 0; r < q; ++r)
        if (!kvs[r] || pos[r] < 0 || pos[r] >= m->max_ctx) return SK_E_ARGS;
    sk_step_go(isa, m, kvs, pos, s, tokens, q, logits, ldl, lo, NULL, NULL, 0, 0.f);
    return SK_OK;
}
