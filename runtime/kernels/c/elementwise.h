/* Element-wise operations with a fixed lane structure (16-lane partial sums, fixed
 * reduction trees): each ISA path's vectoriser computes the same operations per lane, so no
 * result depends on the path. Kernel body: included by kernels.h once per ISA path.
 */

/* 16 float / int32 lanes as GCC vector values: lowered to what each ISA has, the same operations
 * per lane as scalar code */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

/* sum of 16 lanes by a fixed tree: ((l0+l8)+(l4+l12))+... */
static inline float tree16(float *part) {
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; ++l) part[l] = part[l] + part[l + w];
    return part[0];
}

/* 16 f16 values to f32 (exact on every path) */
static inline void cvt16(const uint16_t *h, float *out) {
#if SK_LEVEL == 2
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)));
#elif SK_LEVEL == 1
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
#else
    for (int l = 0; l < 16; ++l) out[l] = sk_h2f(h[l]);
#endif
}

/* out = x * (1 / sqrt(mean(x^2) + eps)) * w; x, w, out [n] */
static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) part[l] = part[l] + x[i + l] * x[i + l];
    for (; i < n; ++i) part[i & 15] = part[i & 15] + x[i] * x[i];
    const float scale = 1.f / sqrtf(tree16(part) / (float)n + eps);
    for (i = 0; i < n; ++i) out[i] = (x[i] * scale) * w[i];
}

/* e^x for x <= 88 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial),
 * mul/add only so that every ISA computes the same bits; flushes to 0 below -87.3; NaN for NaN */
static inline float exp_cephes(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = (p * (r * r) + r) + 1.f;
    const int32_t e = ((n == n ? (int32_t)n : 0) + 127) << 23; /* a NaN x: p is NaN, never cast it */
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* g[i] = silu(g[i]) * u[i] */
static void silu_mul(float *g, const float *u, int n) {
    for (int i = 0; i < n; ++i) g[i] = (g[i] / (1.f + exp_cephes(-g[i]))) * u[i];
}

/* tanh(x) as 1 - 2 / (e^2x + 1) over exp_cephes: mul/add/div only, the same bits on every ISA
 * (|error| < 1e-7 near 0, where the subtraction cancels; +-1 at the clamps) */
static inline float tanh_sk(float x) { return 1.f - 2.f / (exp_cephes(2.f * x) + 1.f); }

/* g[i] = gelu(g[i]) * u[i], GELU's tanh approximation (Hendrycks & Gimpel 2016, eq. in Sec. 2;
 * gemma's gelu_pytorch_tanh, llama.cpp's GGML_OP_GELU): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
static void gelu_mul(float *g, const float *u, int n) {
    for (int i = 0; i < n; ++i) {
        const float x = g[i], t = tanh_sk(0.7978845608028654f * (x + (0.044715f * x) * (x * x)));
        g[i] = ((0.5f * x) * (1.f + t)) * u[i];
    }
}

/* soft-capping (gemma2's attention scores and logits): x -> c * tanh(x / c) */
static inline float softcap_sk(float x, float c) { return c * tanh_sk(x / c); }

/* exp_cephes on 16 lanes at once: lane by lane the same operations (the clamps as selects, the
 * same multiplies and adds, the exponent from the same integral n) */
static inline __attribute__((always_inline)) void expf16(v16 *px) {
    v16 x = *px;
    const v16 lo = (v16){0} - 87.33654f, hi = (v16){0} + 88.0f;
    v16i m = x < lo;
    x = (v16)(((v16i)x & ~m) | ((v16i)lo & m));
    m = x > hi;
    x = (v16)(((v16i)x & ~m) | ((v16i)hi & m));
    const v16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = (p * (r * r) + r) + 1.f;
    const v16 nf = (v16)((v16i)n & (n == n)); /* NaN lanes (p NaN there) are not cast: 0 */
    const v16i e = (__builtin_convertvector(nf, v16i) + 127) << 23;
    *px = p * (v16)e;
}

/* softcap_sk on 16 lanes at once: lane by lane the same operations (expf16 is exp_cephes) */
static inline __attribute__((always_inline)) void softcap16(v16 *py, float c) {
    v16 z = (*py / c) * 2.f;
    expf16(&z);
    *py = c * (1.f - 2.f / (z + 1.f));
}

/* RoPE on one head's vector v [hd] at the position whose cos/sin rows are cs, sn [hd / 2]:
 * pairs (i, i + hd/2) (neox, qwen2) or (2i, 2i + 1) (llama.cpp's NORM, llama) */
static void rope(float *v, const float *cs, const float *sn, int hd, int neox) {
    const int half = hd / 2;
    for (int i = 0; i < half; ++i) {
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * cs[i] - x1 * sn[i];
        v[b] = x0 * sn[i] + x1 * cs[i];
    }
}
