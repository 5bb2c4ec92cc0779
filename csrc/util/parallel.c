/* parallel.c — see parallel.h. */
#define _GNU_SOURCE
#include "parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_WORKERS 1023

static pthread_mutex_t job_owner = PTHREAD_MUTEX_INITIALIZER; /* held by the caller running a job */
static pthread_mutex_t state = PTHREAD_MUTEX_INITIALIZER;     /* guards everything below */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t finished = PTHREAD_COND_INITIALIZER;
static int workers;               /* started so far */
static int atfork_registered;
static unsigned long generation;  /* bumped for every job */
static int open_slots;            /* workers that may still join the current job */
static int running;               /* workers inside the current job */
static struct {
    vram__item_fn fn;
    void *ctx;
    size_t n;
    size_t next; /* atomic */
} job;

static void run_items(void) {
    for (;;) {
        size_t i = __atomic_fetch_add(&job.next, 1, __ATOMIC_RELAXED);
        if (i >= job.n) return;
        job.fn(job.ctx, i);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&state);
    for (;;) {
        while (generation == seen || open_slots == 0) {
            seen = generation > seen && open_slots == 0 ? generation : seen;
            pthread_cond_wait(&wake, &state);
        }
        seen = generation;
        open_slots--;
        running++;
        pthread_mutex_unlock(&state);
        run_items();
        pthread_mutex_lock(&state);
        if (--running == 0) pthread_cond_signal(&finished);
    }
    return NULL;
}

/* In a forked child only the forking thread exists: forget the workers and reset the locks
 * (a parent thread may have held them at the moment of the fork). */
static void reset_after_fork(void) {
    pthread_mutex_init(&job_owner, NULL);
    pthread_mutex_init(&state, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&finished, NULL);
    workers = 0;
    open_slots = 0;
    running = 0;
}

/* Called with `state` held. Starting a worker can fail (resource limits); the job then simply
 * runs on fewer threads. */
static void ensure_workers(int wanted) {
    if (!atfork_registered) {
        atfork_registered = pthread_atfork(NULL, NULL, reset_after_fork) == 0;
    }
    while (workers < wanted && workers < MAX_WORKERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int rc = pthread_create(&t, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        workers++;
    }
}

void vram__parallel_for(size_t n_items, vram__item_fn fn, void *ctx, int threads) {
    if (n_items == 0) return;
    if (threads <= 1 || n_items == 1 || pthread_mutex_trylock(&job_owner) != 0) {
        for (size_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    int helpers = threads - 1;
    if ((size_t)helpers > n_items - 1) helpers = (int)(n_items - 1);
    pthread_mutex_lock(&state);
    ensure_workers(helpers);
    if (helpers > workers) helpers = workers;
    job.fn = fn;
    job.ctx = ctx;
    job.n = n_items;
    job.next = 0;
    open_slots = helpers;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&state);

    run_items();

    /* Close the job to late joiners, then wait for the workers already inside it: `ctx`
     * lives on the caller's stack. */
    pthread_mutex_lock(&state);
    open_slots = 0;
    while (running > 0) pthread_cond_wait(&finished, &state);
    pthread_mutex_unlock(&state);
    pthread_mutex_unlock(&job_owner);
}

int vram__default_threads(void) {
    const char *env = getenv("VRAMKIT_NUM_THREADS");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end == '\0' && v >= 1 && v <= 1024) return (int)v;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n > 1024 ? 1024 : n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (n > 1024 ? 1024 : (int)n) : 1;
}
