// bench_glue.cpp — the cost of vramkit as torch's CUDA allocator, taken apart on any machine
// (issue 35, part 3), for benchmarks/torch_glue.py through _C.bench_torch_glue_pairs.
//
// torch reaches vramkit through CUDAPluggableAllocator: allocate() calls the alloc_fn it holds
// in a std::function, then records (size, device, stream) for the pointer in an unordered_map
// under a mutex; the storage's deleter finds the allocator through a shared_ptr, looks the
// pointer up, erases it under the same mutex and calls free_fn through another std::function
// (the behaviour of torch/csrc/cuda/CUDAPluggableAllocator.cpp). That bookkeeping is torch's,
// and a CPU build of torch has none of it, so this file does the same operations around
// vramkit's hooks to measure them, the hooks routed to a simulated device. The timing loops
// live here, in C++, so that the std::function calls are real ones.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "vramkit.h"

namespace {

struct Metadata { // what torch keeps per pointer
    size_t size;
    int device;
    void *stream;
};

struct Bookkeeping {
    std::function<void *(size_t, int, void *)> alloc_fn;
    std::function<void(void *, size_t, int, void *)> free_fn;
    std::mutex mutex;
    std::unordered_map<void *, Metadata> live;

    void *malloc(size_t size, int device, void *stream) {
        void *r = alloc_fn(size, device, stream);
        const std::lock_guard<std::mutex> lock(mutex);
        live.emplace(r, Metadata{size, device, stream});
        return r;
    }

    void raw_delete(void *ptr) {
        Metadata m{};
        {
            const std::lock_guard<std::mutex> lock(mutex);
            auto it = live.find(ptr);
            if (it == live.end()) return;
            m = it->second;
            live.erase(it);
        }
        free_fn(ptr, m.size, m.device, m.stream);
    }
};

double elapsed_ns(std::chrono::steady_clock::time_point start) {
    return static_cast<double>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

} // namespace

// mode 1: vramkit's hooks called directly (vramkit_torch_malloc / vramkit_torch_free);
// mode 2: the same hooks inside torch's bookkeeping. ns per pair in *ns_out; VRAM_OK, or the
// first failure (an out-of-memory is reported, not thrown, to the C caller).
extern "C" vram_status_t vram__bench_torch_glue(const uint64_t *sizes, size_t n, int mode, double *ns_out) {
    try {
        auto start = std::chrono::steady_clock::now();
        if (mode == 1) {
            for (size_t i = 0; i < n; i++) {
                void *p = vramkit_torch_malloc(static_cast<ssize_t>(sizes[i]), 0, nullptr);
                vramkit_torch_free(p, static_cast<ssize_t>(sizes[i]), 0, nullptr);
            }
        } else {
            auto keeper = std::make_shared<Bookkeeping>();
            keeper->alloc_fn = [](size_t s, int d, void *st) { return vramkit_torch_malloc(static_cast<ssize_t>(s), d, st); };
            keeper->free_fn = [](void *p, size_t s, int d, void *st) {
                vramkit_torch_free(p, static_cast<ssize_t>(s), d, st);
            };
            keeper->live.reserve(64);
            start = std::chrono::steady_clock::now();
            for (size_t i = 0; i < n; i++) {
                void *p = keeper->malloc(sizes[i], 0, nullptr);
                keeper->raw_delete(p);
            }
        }
        *ns_out = elapsed_ns(start) / static_cast<double>(n ? n : 1);
        return VRAM_OK;
    } catch (...) { // vramkit_torch_malloc's out-of-memory; its text is in vram_last_error()
        return VRAM_ERR_OOM;
    }
}
