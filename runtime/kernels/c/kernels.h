/* The kernel bodies, included once by each isa_*.c after its vector backend (vec_*.h), in
 * the order they use each other. Everything here is static: each ISA path's translation unit
 * has its own copy, compiled for its instructions; isa_*.c exports what the library calls.
 */
#ifndef SPECRT_KERNELS_H
#define SPECRT_KERNELS_H

#define XSET(p) VI32(sk_ld32(p)) /* the 4 activation bytes at p in every lane */
_Static_assert(RB_Q4K <= RB, "the row dispatch (SK_ROWS_CASES) covers RB rows");
#define HALVES (SK_P / LANES)

/* Q = rows of a pass (1..RB) as a constant: each case inlines the rows kernel for that many
 * rows, its accumulators held in registers */
#if RB != 8 && RB != 4
#error "SK_ROWS_CASES dispatches passes of 4 or 8 rows only: another RB would leave rows of a pass unwritten"
#endif
#if RB == 8
#define SK_ROWS_CASES(CALL)  \
    switch (Q) {             \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    case 4: CALL(4); break;  \
    case 5: CALL(5); break;  \
    case 6: CALL(6); break;  \
    case 7: CALL(7); break;  \
    default: CALL(8); break; \
    }
#else
#define SK_ROWS_CASES(CALL)  \
    switch (Q) {             \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    default: CALL(4); break; \
    }
#endif

/* this thread's share [*a, *b) of n items split evenly over nt threads */
static inline void thread_share(int n, int tid, int nt, int *a, int *b) {
    *a = (int)((int64_t)n * tid / nt);
    *b = (int)((int64_t)n * (tid + 1) / nt);
}

/* the activation kind (SK_ACT_*) a matrix reads: its type's (the block-type table, types.c) */
static inline int act_of(const sk_mat *m) { return sk_type_of(m->type)->act; }

#include "quant.h"
#include "dot_kquants.h"
#include "dot_legacy.h"
#include "dot_float.h"

/* panels [p0, p1) of m for q rows into y (y[0]: column p0 * SK_P): its type's kernel on this
 * path, from the block-type table (types.c) */
static inline void mm(const sk_mat *m, const void *X, int ldx, int q, int p0, int p1, float *y, int ldy, int accum) {
    sk_type_of(m->type)->panels[SK_ISA_THIS](m, X, ldx, q, p0, p1, y, ldy, accum);
}

#include "elementwise.h"
#include "attention.h"
#include "head.h"
#include "step.h"

#endif
