// malloc_shim.cpp — vramkit_torch_malloc, torch's alloc_fn, in C++ for one reason: an
// allocation that fails must throw. CUDAPluggableAllocator wraps whatever alloc_fn returns
// into a tensor without looking, so a NULL would become a tensor whose first kernel faults
// and poisons the CUDA context. torch's Python bindings turn a std::exception escaping an
// op into a Python RuntimeError with its what(), here vramkit's out-of-memory message.
// Nothing here includes PyTorch: the exception type is the standard library's.
#include <stdexcept>
#include <string>

#include "vramkit.h"

extern "C" void *vramkit_torch_malloc(ssize_t size, int device, void *stream) {
    void *ptr = nullptr;
    vram_status_t status = vram_torch_malloc(static_cast<int64_t>(size), device, stream, &ptr);
    if (status != VRAM_OK) throw std::runtime_error(std::string(vram_last_error()));
    return ptr;
}
