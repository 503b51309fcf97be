/* Kernel spike: y[q, N] = x[q, K] @ W^T straight from a GGUF's own Q4_K / Q6_K blocks.
 *
 * W [N, K] is the tensor's raw block bytes (row n = K/256 blocks of 144 (Q4_K) or 210 (Q6_K)
 * bytes, exactly as stored in the GGUF). x rows are quantized the way llama.cpp quantizes
 * activations for K-quants (quantize_row_q8_K_ref: per 256-block, iscale = -127/max, RNE
 * rounding, int8 with block sums), the dot products are integer (AVX512-VNNI vpdpbusd, the
 * per-32 (Q4_K) / per-16 (Q6_K) scales applied with vpdpwssd on the exact int32 partial sums),
 * then llama.cpp's float terms: d_x d_w sum_i(sc q8 q4) - d_x dmin sum_j(m_j bsum_j).
 *
 * Weights are read once per call: every weight block is unpacked once into registers and used
 * for all q activation rows before the next block is loaded.
 *
 * Bit-identity across q: the value of output (r, n) is produced by a fixed sequence of
 * operations over the K/256 blocks (integer parts exact, one float FMA per block into a
 * 16-lane accumulator, one fixed horizontal sum at the end) that does not depend on q, on the
 * other rows or on the thread split; the q-specialised loops only replicate that per-row
 * sequence. The build uses -ffp-contract=off so the compiler cannot fuse differently per
 * specialisation (the FMAs are explicit intrinsics).
 *
 * Build: gcc -O3 -march=native -mno-amx-tile -mno-amx-int8 -ffp-contract=off -fopenmp -shared -fPIC
 * Requires AVX512F/BW/VL + AVX512-VNNI + F16C (checked by the driver).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256
#define Q4K_BYTES 144
#define Q6K_BYTES 210
#define QMAX_SPECIAL 9

typedef struct {
    int q, nb;
    int8_t *qs;     /* [q][nb][256] (Q4_K: sub-blocks permuted 0,2,1,3,4,6,5,7) */
    float *d;       /* [q][nb] */
    int32_t *bs32;  /* [q][nb][8]  sums per 32 (sub-block order 0..7) */
    int16_t *bs16;  /* [q][nb][16] sums per 16 (natural order) */
} xq_t;

/* ---- activation quantization: llama.cpp's quantize_row_q8_K_ref, same rounding ---- */
static void quant_block(const float *x, int8_t *qs, float *d, int32_t *bs32, int16_t *bs16, int permute) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < QK; ++j) {
        float ax = x[j] < 0 ? -x[j] : x[j];
        if (ax > amax) { amax = ax; max = x[j]; }
    }
    int8_t tmp[QK];
    if (amax == 0.f) {
        memset(tmp, 0, QK);
        *d = 0.f;
    } else {
        const float iscale = -127.f / max;
        const __m512 vs = _mm512_set1_ps(iscale);
        for (int j = 0; j < QK; j += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(vs, _mm512_loadu_ps(x + j))); /* RNE */
            v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(tmp + j), _mm512_cvtepi32_epi8(v));
        }
        *d = 1.f / iscale;
    }
    for (int g = 0; g < 16; ++g) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += tmp[16 * g + i];
        bs16[g] = (int16_t)s;
    }
    for (int j = 0; j < 8; ++j) bs32[j] = bs16[2 * j] + bs16[2 * j + 1];
    if (permute) {
        static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
        for (int k = 0; k < 8; ++k) memcpy(qs + 32 * k, tmp + 32 * order[k], 32);
    } else {
        memcpy(qs, tmp, QK);
    }
}

static inline float hsum512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
static inline float hsum256(__m256 a) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}


/* byte index (into the 16-byte scale vector broadcast per lane) of each int16 word's scale, Q4_K */
static inline __m512i q4k_word_idx(int base) {
    uint8_t b[64];
    for (int w = 0; w < 32; ++w) {
        const int L = w / 8, p = w % 8;
        b[2 * w] = (uint8_t)(base + (L < 2 ? 0 : 2) + (p >= 4));
        b[2 * w + 1] = 0;
    }
    return _mm512_loadu_si512((const void *)b);
}
/* word index (into the 16 int16 scales, broadcast) of each int16 word's scale, Q6_K */
static inline __m512i q6k_word_idx(int base) {
    uint16_t b[32];
    for (int w = 0; w < 32; ++w) b[w] = (uint16_t)(base + (w % 8 >= 4 ? 4 : 0) + w / 8);
    return _mm512_loadu_si512((const void *)b);
}

/* ---- Q4_K: one output row n for Q activation rows (Q a compile-time constant when inlined) ---- */
static inline __attribute__((always_inline)) void q4k_row(const uint8_t *w, const xq_t *X, int r0, int Q, int N, int n, float *y) {
    const int nb = X->nb;
    __m512 accf[QMAX_SPECIAL];
    __m256 accm[QMAX_SPECIAL];
    for (int r = 0; r < Q; ++r) { accf[r] = _mm512_setzero_ps(); accm[r] = _mm256_setzero_ps(); }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    /* after packs(t0, t1) each 128-bit lane L holds words [t0 dwords 4L..4L+3, t1 dwords 4L..4L+3];
       t0 = (sub 0 | sub 2), t1 = (sub 1 | sub 3): word w's sub-block is (L < 2 ? 0 : 2) + (w % 8 >= 4) */
    const __m512i idxA = q4k_word_idx(0), idxB = q4k_word_idx(4);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *blk = w + (size_t)b * Q4K_BYTES;
        const float dw = f16(blk), dmin = f16(blk + 2);
        uint32_t a0, a1, a2;
        memcpy(&a0, blk + 4, 4);
        memcpy(&a1, blk + 8, 4);
        memcpy(&a2, blk + 12, 4);
        /* llama.cpp's 6-bit unpack: bytes of (s0, s1) = scales of sub-blocks 0..7, (m0, m1) = mins */
        const uint32_t s0 = a0 & 0x3f3f3f3f, m0 = a1 & 0x3f3f3f3f;
        const uint32_t s1 = (a2 & 0x0f0f0f0f) | (((a0 >> 6) & 0x03030303) << 4);
        const uint32_t m1 = ((a2 >> 4) & 0x0f0f0f0f) | (((a1 >> 6) & 0x03030303) << 4);
        const __m128i v = _mm_set_epi32((int)m1, (int)m0, (int)s1, (int)s0);
        const __m512i v4 = _mm512_broadcast_i32x4(v);
        const __m256i mn = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
        /* SA / SB: int16 words, each the scale of its word's sub-block (for packs(t0,t1) / packs(t2,t3)) */
        const __m512i SA = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, idxA, v4);
        const __m512i SB = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, idxB, v4);
        const __m512i q0 = _mm512_loadu_si512((const void *)(blk + 16));
        const __m512i q1 = _mm512_loadu_si512((const void *)(blk + 80));
        const __m512i W0 = _mm512_and_si512(q0, m4);                        /* sub 0 | sub 2 */
        const __m512i W1 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);  /* sub 1 | sub 3 */
        const __m512i W2 = _mm512_and_si512(q1, m4);                        /* sub 4 | sub 6 */
        const __m512i W3 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);  /* sub 5 | sub 7 */
#pragma GCC unroll 9
        for (int r = 0; r < Q; ++r) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const int8_t *xs = X->qs + xb * QK;
            const __m512i z = _mm512_setzero_si512();
            __m512i t0 = _mm512_dpbusd_epi32(z, W0, _mm512_loadu_si512((const void *)(xs)));
            __m512i t1 = _mm512_dpbusd_epi32(z, W1, _mm512_loadu_si512((const void *)(xs + 64)));
            __m512i t2 = _mm512_dpbusd_epi32(z, W2, _mm512_loadu_si512((const void *)(xs + 128)));
            __m512i t3 = _mm512_dpbusd_epi32(z, W3, _mm512_loadu_si512((const void *)(xs + 192)));
            /* |t| <= 4*15*127 fits int16: packs is exact, then one vpdpwssd applies two sub-blocks' scales */
            __m512i s = _mm512_dpwssd_epi32(z, _mm512_packs_epi32(t0, t1), SA);
            s = _mm512_dpwssd_epi32(s, _mm512_packs_epi32(t2, t3), SB);
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(X->bs32 + xb * 8)), mn);
            const float dx = X->d[xb];
            accf[r] = _mm512_fmadd_ps(_mm512_set1_ps(dx * dw), _mm512_cvtepi32_ps(s), accf[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dmin), _mm256_cvtepi32_ps(m), accm[r]);
        }
    }
    for (int r = 0; r < Q; ++r) y[(size_t)(r0 + r) * N + n] = hsum512(accf[r]) - hsum256(accm[r]);
}

/* ---- Q6_K ---- */
static inline __attribute__((always_inline)) void q6k_row(const uint8_t *w, const xq_t *X, int r0, int Q, int N, int n, float *y) {
    const int nb = X->nb;
    __m512 accf[QMAX_SPECIAL];
    for (int r = 0; r < Q; ++r) accf[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    /* per-half shift counts for qh: low 256 bits >> 0 / >> 4, high 256 bits >> 2 / >> 6 */
    const __m512i shA = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i shB = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    /* packs(t0, t1): lane L words [t0 dwords 4L.., t1 dwords 4L..] = groups of 16: L (t0), 4 + L (t1) */
    const __m512i idxA = q6k_word_idx(0), idxB = q6k_word_idx(8);
    for (int b = 0; b < nb; ++b) {
        const uint8_t *blk = w + (size_t)b * Q6K_BYTES;
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *scp = (const int8_t *)(blk + 192);
        const float dw = f16(blk + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scp));
        const __m512i sc16x2 = _mm512_inserti64x4(_mm512_castsi256_si512(sc16), sc16, 1);
        const __m512i SA = _mm512_permutexvar_epi16(idxA, sc16x2), SB = _mm512_permutexvar_epi16(idxB, sc16x2);
        __m512i W[4];
        for (int h = 0; h < 2; ++h) { /* 128 weights per half: ql 64 bytes, qh 32 bytes */
            const __m512i L = _mm512_loadu_si512((const void *)(ql + 64 * h));
            const __m256i hh = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            const __m512i H = _mm512_inserti64x4(_mm512_castsi256_si512(hh), hh, 1);
            W[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, shA), m3), 4));
            W[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, shB), m3), 4));
        }
#pragma GCC unroll 9
        for (int r = 0; r < Q; ++r) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const int8_t *xs = X->qs + xb * QK;
            const __m512i z = _mm512_setzero_si512();
            __m512i t[4];
            for (int k = 0; k < 4; ++k) t[k] = _mm512_dpbusd_epi32(z, W[k], _mm512_loadu_si512((const void *)(xs + 64 * k)));
            /* |t| <= 4*63*127 = 32004 fits int16: packs is exact */
            __m512i s = _mm512_dpwssd_epi32(z, _mm512_packs_epi32(t[0], t[1]), SA);
            s = _mm512_dpwssd_epi32(s, _mm512_packs_epi32(t[2], t[3]), SB);
            /* the -32 offset: sum_g sc_g * 32 * bsum16_g, exact integers */
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(X->bs16 + xb * 16)), sc16);
            s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(m, 5)));
            accf[r] = _mm512_fmadd_ps(_mm512_set1_ps(X->d[xb] * dw), _mm512_cvtepi32_ps(s), accf[r]);
        }
    }
    for (int r = 0; r < Q; ++r) y[(size_t)(r0 + r) * N + n] = hsum512(accf[r]);
}

#define DISPATCH(FN, w, X, q, N, n, y)                                                  \
    do {                                                                                \
        switch (q) {                                                                    \
        case 1: FN(w, X, 0, 1, N, n, y); break;                                         \
        case 2: FN(w, X, 0, 2, N, n, y); break;                                         \
        case 3: FN(w, X, 0, 3, N, n, y); break;                                         \
        case 4: FN(w, X, 0, 4, N, n, y); break;                                         \
        case 5: FN(w, X, 0, 5, N, n, y); break;                                         \
        case 6: FN(w, X, 0, 6, N, n, y); break;                                         \
        case 7: FN(w, X, 0, 7, N, n, y); break;                                         \
        case 8: FN(w, X, 0, 8, N, n, y); break;                                         \
        case 9: FN(w, X, 0, 9, N, n, y); break;                                         \
        default: /* rows in groups of 8 (same per-row sequence, so still bit-identical) */ \
            for (int r0 = 0; r0 < q; r0 += 8) FN(w, X, r0, (q - r0 < 8 ? q - r0 : 8), N, n, y); \
        }                                                                               \
    } while (0)

static void q4k_one(const uint8_t *w, const xq_t *X, int q, int N, int n, float *y) { DISPATCH(q4k_row, w, X, q, N, n, y); }
static void q6k_one(const uint8_t *w, const xq_t *X, int q, int N, int n, float *y) { DISPATCH(q6k_row, w, X, q, N, n, y); }

/* Scratch for the quantized activations (grown as needed; not thread-safe across callers). */
static void *g_buf = NULL;
static size_t g_cap = 0;

/* type: 12 = Q4_K, 14 = Q6_K (ggml's type ids). x [q, K] float32, w [N, K/256 * bytes], y [q, N] float32. */
int kq_matmul(int type, const float *x, int q, int K, const uint8_t *w, int N, float *y, int nthreads) {
    if (K % QK || q < 1) return -1;
    const int nb = K / QK;
    const size_t bpb = type == 12 ? Q4K_BYTES : type == 14 ? Q6K_BYTES : 0;
    if (!bpb) return -2;
    const size_t nblk = (size_t)q * nb;
    const size_t need = nblk * (QK + 4 + 32 + 32) + 256;
    if (need > g_cap) {
        free(g_buf);
        g_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        g_cap = need;
    }
    xq_t X;
    X.q = q;
    X.nb = nb;
    X.qs = (int8_t *)g_buf;
    X.bs32 = (int32_t *)(X.qs + nblk * QK);
    X.bs16 = (int16_t *)(X.bs32 + nblk * 8);
    X.d = (float *)(X.bs16 + nblk * 16);
    const int permute = type == 12;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < (long)nblk; ++i)
            quant_block(x + (size_t)(i / nb) * K + (size_t)(i % nb) * QK, X.qs + i * QK, X.d + i, X.bs32 + i * 8, X.bs16 + i * 16, permute);
#pragma omp for schedule(static)
        for (int n = 0; n < N; ++n) {
            const uint8_t *wr = w + (size_t)n * nb * bpb;
            if (type == 12) q4k_one(wr, &X, q, N, n, y);
            else q6k_one(wr, &X, q, N, n, y);
        }
    }
    return 0;
}

/* The quantized activations of the last call (for the driver's accuracy accounting). */
int kq_last_xq(int q, int K, int8_t *qs_out, float *d_out) {
    const int nb = K / QK;
    if (!g_buf) return -1;
    memcpy(qs_out, g_buf, (size_t)q * nb * QK);
    memcpy(d_out, (int8_t *)g_buf + (size_t)q * nb * (QK + 32 + 32), (size_t)q * nb * sizeof(float));
    return 0;
}
