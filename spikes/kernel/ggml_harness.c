/* ggml reference for the kernel spike: y[q, N] = x[q, K] @ W^T with ggml_mul_mat on the CPU
 * backend, W a GGML_TYPE_Q4_K / Q6_K [K, N] tensor holding the GGUF's bytes, x f32 [K, q].
 *
 * repack = 0: the weight lives in a plain CPU buffer (ggml's per-type vec_dot path);
 * repack = 1: the weight lives in the CPU backend's "CPU_REPACK" extra buffer type, the one
 *             llama.cpp puts Q4_K weights in by default on AVX2 machines (q4_K_8x8 gemv/gemm).
 * Both run one ggml_backend_graph_compute with n_threads threads (OpenMP build).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

typedef struct {
    struct ggml_context *cw, *cx;
    ggml_backend_buffer_t bw, bx;
    ggml_backend_t be;
    struct ggml_tensor *w, *x, *y;
    struct ggml_cgraph *gf;
    int q, K, N;
    char buft_name[64];
} gh_t;

static ggml_backend_buffer_type_t repack_buft(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) return NULL;
    for (ggml_backend_buffer_type_t *b = get(dev); b && *b; ++b)
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    return NULL;
}

/* type: 12 Q4_K, 14 Q6_K. Returns NULL on failure. */
void *gh_new(int type, const void *wbytes, int K, int N, int q, int repack, int nthreads) {
    gh_t *h = calloc(1, sizeof(gh_t));
    h->q = q; h->K = K; h->N = N;
    struct ggml_init_params pw = {ggml_tensor_overhead() * 4, NULL, true};
    h->cw = ggml_init(pw);
    h->w = ggml_new_tensor_2d(h->cw, (enum ggml_type)type, K, N);
    ggml_backend_buffer_type_t bt = repack ? repack_buft() : ggml_backend_cpu_buffer_type();
    if (!bt) { fprintf(stderr, "no CPU_REPACK buffer type\n"); return NULL; }
    snprintf(h->buft_name, sizeof h->buft_name, "%s", ggml_backend_buft_name(bt));
    h->bw = ggml_backend_alloc_ctx_tensors_from_buft(h->cw, bt);
    if (!h->bw) return NULL;
    ggml_backend_tensor_set(h->w, wbytes, 0, ggml_nbytes(h->w));  /* repacks in the repack buffer */

    struct ggml_init_params px = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    h->cx = ggml_init(px);
    h->x = ggml_new_tensor_2d(h->cx, GGML_TYPE_F32, K, q);
    h->y = ggml_mul_mat(h->cx, h->w, h->x);
    h->gf = ggml_new_graph(h->cx);
    ggml_build_forward_expand(h->gf, h->y);
    h->bx = ggml_backend_alloc_ctx_tensors_from_buft(h->cx, ggml_backend_cpu_buffer_type());
    h->be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(h->be, nthreads);
    return h;
}

const char *gh_buft(void *hp) { return ((gh_t *)hp)->buft_name; }

/* x [q, K] f32 row-major in, y [q, N] f32 out. */
int gh_run(void *hp, const float *x, float *y) {
    gh_t *h = hp;
    memcpy(h->x->data, x, sizeof(float) * (size_t)h->q * h->K);
    if (ggml_backend_graph_compute(h->be, h->gf) != GGML_STATUS_SUCCESS) return -1;
    memcpy(y, h->y->data, sizeof(float) * (size_t)h->q * h->N);
    return 0;
}

void gh_free(void *hp) {
    gh_t *h = hp;
    ggml_backend_free(h->be);
    ggml_backend_buffer_free(h->bx);
    ggml_backend_buffer_free(h->bw);
    ggml_free(h->cx);
    ggml_free(h->cw);
    free(h);
}
