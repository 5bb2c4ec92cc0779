/* harness.h — a minimal test harness for vramkit's C tests: CHECK records a failure and
 * keeps going, so one run reports every broken expectation; main returns the count. */
#ifndef VRAM_TEST_HARNESS_H
#define VRAM_TEST_HARNESS_H

#include <stdio.h>
#include <string.h>

#include "vramkit.h"

static int harness_failures;
static int harness_checks;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        harness_checks++;                                                            \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            harness_failures++;                                                      \
        }                                                                            \
    } while (0)

#define CHECK_STATUS(expr, expected)                                                                      \
    do {                                                                                                  \
        harness_checks++;                                                                                 \
        vram_status_t check_status_ = (expr);                                                             \
        if (check_status_ != (expected)) {                                                                \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", __FILE__, __LINE__,  \
                    #expr, vram_status_name(check_status_), vram_status_name(expected), vram_last_error()); \
            harness_failures++;                                                                           \
        }                                                                                                 \
    } while (0)

#define CHECK_OK(expr) CHECK_STATUS(expr, VRAM_OK)
#define CHECK_CONTAINS(haystack, needle)                                                                   \
    do {                                                                                                   \
        harness_checks++;                                                                                  \
        if (!strstr((haystack), (needle))) {                                                               \
            fprintf(stderr, "%s:%d: expected \"%s\" in \"%s\"\n", __FILE__, __LINE__, (needle), (haystack)); \
            harness_failures++;                                                                            \
        }                                                                                                  \
    } while (0)
/* The pool's invariants hold. */
#define CHECK_POOL(pool) CHECK_OK(vram_pool_check(pool))

#define RUN(test)                                              \
    do {                                                       \
        int before_ = harness_failures;                        \
        test();                                                \
        printf("%s %s\n", harness_failures == before_ ? "ok  " : "FAIL", #test); \
    } while (0)

static inline int harness_finish(void) {
    printf("%d checks, %d failures\n", harness_checks, harness_failures);
    return harness_failures ? 1 : 0;
}

/* A stand-alone simulated pool for tests, with options in VRAMKIT_ALLOC_CONF syntax. */
static inline vram_pool_t *make_sim_pool(uint64_t capacity, const char *conf) {
    void *ctx = NULL;
    vram_pool_t *pool = NULL;
    if (vram_backend_sim_ctx(capacity, &ctx) != VRAM_OK) return NULL;
    if (vram_pool_create(vram_backend_sim(), ctx, (vram_device_t){VRAM_DEVICE_SIM, 99, 0}, conf, &pool) != VRAM_OK)
        return NULL;
    return pool;
}

static inline vram_stats_t get_stats(vram_pool_t *pool) {
    vram_stats_t s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    if (vram_get_stats(pool, &s) != VRAM_OK) fprintf(stderr, "vram_get_stats failed: %s\n", vram_last_error());
    return s;
}

#define MiB ((uint64_t)1 << 20)
#define GiB ((uint64_t)1 << 30)

#endif
