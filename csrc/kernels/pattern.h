/* pattern.h — a device-side fill/verify pattern used by the CUDA tests to prove that
 * allocations never overlap: each block is filled with words derived from its own seed, and
 * any block another allocation scribbled on shows mismatches. Only built with CUDA. */
#ifndef VRAM_KERNELS_PATTERN_H
#define VRAM_KERNELS_PATTERN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Both return 0 or a cudaError_t value; they synchronize the stream before returning. */
int vram__cuda_fill_pattern(uint64_t ptr, uint64_t nbytes, uint32_t seed, uint64_t stream);
int vram__cuda_count_mismatches(uint64_t ptr, uint64_t nbytes, uint32_t seed, uint64_t stream,
                                uint64_t *mismatches);
const char *vram__cuda_error_string(int err);

#ifdef __cplusplus
}
#endif
#endif
