// pattern.cu — fill a buffer with a seeded word pattern and count words that differ.
// The tests write a distinct seed into every live block; an allocator that handed out
// overlapping memory would make some block fail its check.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pattern.h"

__device__ __forceinline__ uint32_t pattern_word(uint32_t seed, uint64_t i) {
    // A cheap integer hash (splitmix-style), so neighbouring words and seeds all differ.
    uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ull + i;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (uint32_t)x;
}

__global__ void fill_kernel(uint32_t *words, uint64_t n, uint32_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        words[i] = pattern_word(seed, i);
}

__global__ void check_kernel(const uint32_t *words, uint64_t n, uint32_t seed, unsigned long long *mismatches) {
    unsigned long long local = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        local += words[i] != pattern_word(seed, i);
    if (local) atomicAdd(mismatches, local);
}

static unsigned grid_for(uint64_t n) {
    uint64_t blocks = (n + 255) / 256;
    return (unsigned)(blocks < 4096 ? (blocks ? blocks : 1) : 4096);
}

extern "C" int vram__cuda_fill_pattern(uint64_t ptr, uint64_t nbytes, uint32_t seed, uint64_t stream) {
    cudaStream_t s = (cudaStream_t)stream;
    uint64_t n = nbytes / 4;
    fill_kernel<<<grid_for(n), 256, 0, s>>>((uint32_t *)ptr, n, seed);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    return (int)err;
}

extern "C" int vram__cuda_count_mismatches(uint64_t ptr, uint64_t nbytes, uint32_t seed, uint64_t stream,
                                           uint64_t *mismatches) {
    cudaStream_t s = (cudaStream_t)stream;
    uint64_t n = nbytes / 4;
    unsigned long long *counter = NULL, host = 0;
    cudaError_t err = cudaMalloc(&counter, sizeof *counter);
    if (err == cudaSuccess) err = cudaMemsetAsync(counter, 0, sizeof *counter, s);
    if (err == cudaSuccess) {
        check_kernel<<<grid_for(n), 256, 0, s>>>((const uint32_t *)ptr, n, seed, counter);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaMemcpyAsync(&host, counter, sizeof host, cudaMemcpyDeviceToHost, s);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    if (counter) cudaFree(counter);
    *mismatches = host;
    return (int)err;
}

extern "C" const char *vram__cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
