// test_torch_hooks.cpp — the hooks torch's CUDAPluggableAllocator calls (vramkit_torch.h),
// routed to a simulated device (vram_torch_route), from C++ as torch calls them: allocations
// land in the pool with their counters, a failure throws std::runtime_error carrying vramkit's
// out-of-memory message (never a NULL that torch would wrap into a tensor), foreign pointers
// are ignored and counted, and the optional hooks act on the pool.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "vramkit.h"

static int failures, checks;
#define CHECK(cond)                                                                    \
    do {                                                                               \
        checks++;                                                                      \
        if (!(cond)) {                                                                 \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                                \
        }                                                                              \
    } while (0)

static const uint64_t MiB = 1 << 20;

static int64_t allocated(vram_pool_t *pool) {
    vram_stats_t s;
    std::memset(&s, 0, sizeof s);
    s.size = sizeof s;
    if (vram_get_stats(pool, &s) != VRAM_OK) return -1;
    return s.allocated_bytes[VRAM_STAT_ALL].current;
}

// Calls the hook and returns the exception's message ("" when nothing was thrown).
static std::string thrown_by(ssize_t size, int device) {
    try {
        void *p = vramkit_torch_malloc(size, device, nullptr);
        vramkit_torch_free(p, size, device, nullptr);
    } catch (const std::runtime_error &e) {
        return e.what();
    }
    return "";
}

int main() {
    vram_device_t sim;
    CHECK(vram_sim_create(256 * MiB, &sim) == VRAM_OK);
    char name[32];
    vram_device_format(sim, name, sizeof name);
    CHECK(vram_torch_route(name) == VRAM_OK);
    CHECK(vram_torch_route("cpu") == VRAM_ERR_INVALID_ARG);
    CHECK(vram_torch_route("sim:999") == VRAM_ERR_INVALID_ARG);
    vram_pool_t *pool = nullptr;
    CHECK(vram_device_pool(sim, &pool) == VRAM_OK);

    void *p = vramkit_torch_malloc(1000, 0, nullptr);
    CHECK(p != nullptr && allocated(pool) == 1024);
    CHECK(vramkit_torch_malloc(0, 0, nullptr) == nullptr); // torch's own allocator gives NULL for 0 too

    std::string oom = thrown_by((ssize_t)(300 * MiB), 0);
    CHECK(oom.find(std::string(name) + " out of memory. Tried to allocate 300.00 MiB") != std::string::npos);
    CHECK(allocated(pool) == 1024); // nothing changed
    CHECK(thrown_by(-5, 0).find("sizes must be >= 0") != std::string::npos);
    CHECK(thrown_by(64, -1).find("CUDA device -1, which does not exist") != std::string::npos);

    size_t base_size = 0;
    CHECK(vramkit_torch_base_alloc(p, &base_size) != nullptr && base_size == 2 * MiB);
    CHECK(vramkit_torch_base_alloc((void *)0x40, &base_size) == nullptr && base_size == 0);

    uint64_t stray = vram_torch_stray_frees();
    vramkit_torch_free((void *)0x1234, 16, 0, nullptr); // never vramkit's: ignored, counted
    vramkit_torch_free(nullptr, 0, 0, nullptr);
    CHECK(vram_torch_stray_frees() == stray + 1);

    // record_stream: the freed block waits for stream 7 before it is reused.
    vramkit_torch_record_stream(p, (void *)7);
    vramkit_torch_free(p, 1000, 0, nullptr);
    void *q = vramkit_torch_malloc(1000, 0, nullptr);
    CHECK(q != p);
    CHECK(vram_pool_synchronize(pool, 7) == VRAM_OK);
    vramkit_torch_free(q, 1000, 0, nullptr);
    CHECK(allocated(pool) == 0);

    // The memory fraction and empty_cache hooks act on the routed pool.
    vramkit_torch_set_memory_fraction(0.25, 0);
    CHECK(thrown_by((ssize_t)(100 * MiB), 0).find("allowed") != std::string::npos);
    vramkit_torch_set_memory_fraction(1.0, 0);
    CHECK(thrown_by((ssize_t)(100 * MiB), 0).empty());
    vramkit_torch_empty_cache();
    vram_stats_t s;
    std::memset(&s, 0, sizeof s);
    s.size = sizeof s;
    CHECK(vram_get_stats(pool, &s) == VRAM_OK && s.reserved_bytes[VRAM_STAT_ALL].current == 0);
    CHECK(vram_pool_check(pool) == VRAM_OK);
    CHECK(vram_torch_route("cuda") == VRAM_OK);

    std::printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
