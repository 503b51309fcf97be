/* The portable C path of the kernels: the kernel bodies (kernels.h) compiled against vec_portable.h
 * (none: the baseline of the build, so every CPU runs it). Exports the
 * path's panel kernel of each block type (named in the block-type table, types.c) and its
 * sk_isa (the exported entry points choose it by id, api.c).
 */
#include "sk_internal.h"

#include "vec_portable.h"

#include "kernels.h"

void sk_q4k_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    q4k_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_q6k_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    q6k_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_q8_0_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    i8_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_q5_0_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    i8_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_q4_0_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    u4_panels(m, X, ldx, q, p0, p1, y, ldy, accum, 0);
}
void sk_q4_1_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    u4_panels(m, X, ldx, q, p0, p1, y, ldy, accum, 1);
}
void sk_q5_1_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    q5_1_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_q5k_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    q5k_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_q2k_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    q2k_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_iq4nl_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    iq4nl_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_iq4xs_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    iq4xs_panels(m, X, ldx, q, p0, p1, y, ldy, accum);
}
void sk_f16_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    float_panels(m, X, ldx, q, p0, p1, y, ldy, accum, SK_F16);
}
void sk_bf16_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    float_panels(m, X, ldx, q, p0, p1, y, ldy, accum, SK_BF16);
}
void sk_f32_panels_portable(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    float_panels(m, X, ldx, q, p0, p1, y, ldy, accum, SK_F32);
}

const sk_isa sk_isa_portable = {"portable", step, matmul, argmax_rows};
