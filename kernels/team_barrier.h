/* A barrier for a team of threads inside one OpenMP region that spins (then yields) instead of sleeping.
 * The fused decode step has ~11 barriers per layer, and OpenMP's own (a futex under
 * OMP_WAIT_POLICY=PASSIVE) or a fork / join per GEMV costs more than the work between them; the
 * standalone GEMM (cpu_qgemm.c's driver) uses it too. Generation counting: the last thread to arrive
 * resets the count and bumps gen. Header-only: each file that includes it gets its own static copy. */
#ifndef EDGE_TEAM_BARRIER_H
#define EDGE_TEAM_BARRIER_H
#include <sched.h>
#include <stdatomic.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    atomic_int arrived, gen;
    int n;
} team_barrier;

static inline void team_barrier_init(team_barrier* b, int n) {
    atomic_init(&b->arrived, 0);
    atomic_init(&b->gen, 0);
    b->n = n;
}

/* Called by every thread at the top of a parallel region: returns the thread's id and sets b->n to the
 * team's size (thread 0 writes it, then an OpenMP barrier, so every thread reads it afterwards). */
static inline int team_enter(team_barrier* b) {
#ifdef _OPENMP
    const int t = omp_get_thread_num();
    if (t == 0) b->n = omp_get_num_threads();
#pragma omp barrier
    return t;
#else
    b->n = 1;
    return 0;
#endif
}

static void team_sync(void* p) {
    team_barrier* b = (team_barrier*)p;
    if (b->n <= 1) return;
    const int g = atomic_load_explicit(&b->gen, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->gen, g + 1, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->gen, memory_order_acquire) == g; spins++) {
        if (spins < (1 << 16)) {
#if defined(__x86_64__)
            _mm_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
        } else {
            sched_yield(); /* the machine is oversubscribed: let the thread we wait for run */
        }
    }
}
#endif
