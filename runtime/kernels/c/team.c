/* The kernels' thread team: nt threads, the caller of sk_team_run is thread 0 and nt - 1
 * workers persist between jobs. Inside a job threads meet at sk_bar (spinning: a step has
 * ~300 of them). Between jobs a worker spins for spin_us, then sleeps on a futex, so that a
 * long pause (a draft model on another runtime's threads, an idle server) costs no core.
 *
 * Deployment events:
 * - fork(): the child has only the forking thread, so the team is reset there (a
 *   pthread_atfork child handler; no job is in flight at the fork: the prepare handler takes
 *   the job lock) and the child's first job starts workers again, as many as were asked for.
 * - a failed pthread_create: the workers started so far are stopped and joined, the team is
 *   left at one thread and SK_E_THREADS returned; the next sk_team_start starts afresh.
 */
#define _GNU_SOURCE
#include "sk_internal.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

typedef struct {
    _Alignas(64) atomic_int v;
} sk_padded;

static struct {
    pthread_mutex_t call; /* one job (or start) at a time */
    int nt;               /* threads of a job now, the caller included */
    int want;             /* threads asked for (sk_team_start): a forked child's first job starts them */
    int spin_us, started;
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
} T = {.call = PTHREAD_MUTEX_INITIALIZER, .nt = 1, .want = 1, .spin_us = 200};

static uint64_t sk_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sk_bar(int tid, int nt) {
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
    /* seq_cst, as the sleepers load below: a worker that has not yet counted itself a sleeper
     * sees the new gen before it waits (the store-buffer pattern of sk_wait_gen) */
    atomic_fetch_add(&T.gen, 1);
#if defined(__linux__)
    if (atomic_load(&T.sleepers) > 0) syscall(SYS_futex, (void *)&T.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
}

/* stop and join workers 1..n-1 (all waiting for their next job); the team is then the caller alone */
static void sk_join_workers_locked(int n) {
    if (n > 1) {
        atomic_store(&T.quit, 1);
        sk_publish();
        for (int i = 1; i < n; ++i) pthread_join(T.th[i], NULL);
        atomic_store(&T.quit, 0);
    }
    T.started = 0;
    T.nt = 1;
}

static void sk_team_stop_locked(void) {
    if (T.started) sk_join_workers_locked(T.nt);
}

/* start workers 1..nt-1; on a failed pthread_create the ones started are joined again */
static int sk_spawn_locked(int nt) {
    T.start_gen = atomic_load(&T.gen);
    T.nt = nt;
    for (int i = 1; i < nt; ++i)
        if (pthread_create(&T.th[i], NULL, sk_worker, (void *)(intptr_t)i) != 0) {
            sk_join_workers_locked(i);
            T.want = 1; /* not retried at every job: the next sk_team_start asks again */
            return SK_E_THREADS;
        }
    T.started = 1;
    return SK_OK;
}

void sk_team_run(sk_job_fn fn, void *arg) {
    pthread_mutex_lock(&T.call);
    if (!T.started && T.want > 1) sk_spawn_locked(T.want); /* a forked child's first job; on failure it runs alone */
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

int sk_team_size(void) { return T.nt; }

/* ---------------------------------------------------------------- fork */

static void sk_fork_prepare(void) { pthread_mutex_lock(&T.call); /* no job in flight across the fork */ }
static void sk_fork_parent(void) { pthread_mutex_unlock(&T.call); }
static void sk_fork_child(void) {
    /* only the forking thread exists here: the workers' pthread_t are gone, nobody waits */
    pthread_mutex_init(&T.call, NULL);
    if (T.started) T.want = T.nt;
    T.started = 0;
    T.nt = 1;
    atomic_store(&T.quit, 0);
    atomic_store(&T.sleepers, 0);
    atomic_store(&T.arrive, 0);
    atomic_store(&T.done, 0);
}

__attribute__((constructor)) static void sk_team_init(void) { pthread_atfork(sk_fork_prepare, sk_fork_parent, sk_fork_child); }

/* ---------------------------------------------------------------- exported */

/* (re)start the team with nt threads in all (the caller included); spin_us: how long an idle
 * worker spins before it sleeps. SK_E_THREADS when a thread cannot be created (the team is
 * then the caller alone, no worker left behind) */
SK_EXPORT int sk_team_start(int nt, int spin_us) {
    if (nt < 1 || nt > SK_MAX_THREADS || spin_us < 0) return SK_E_ARGS;
    pthread_mutex_lock(&T.call);
    int rc = SK_OK;
    T.spin_us = spin_us;
    T.want = nt;
    if (!T.started || T.nt != nt) {
        sk_team_stop_locked();
        rc = sk_spawn_locked(nt);
    }
    pthread_mutex_unlock(&T.call);
    return rc;
}

SK_EXPORT int sk_team_threads(void) { return T.nt; }

/* the most threads a team may have (ThreadConfig refuses more) */
SK_EXPORT int sk_max_threads(void) { return SK_MAX_THREADS; }
