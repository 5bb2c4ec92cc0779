// amp_cuda.cu — fused loss-scaling kernels: unscale + inf/NaN check (+ sum of squares), an
// in-place scale, the clip coefficient and the dynamic loss-scale update, all queued on the
// caller's stream so a training step never waits on the host. The public entry points and
// argument checks live in amp_cuda_api.c; these launchers assume validated arguments.
//
// The multi-tensor machinery follows PyTorch's multi_tensor_apply (MultiTensorApply.cuh): a
// by-value kernel argument names up to 110 tensors and 320 (tensor, chunk) blocks, one block
// per 65536-element chunk, and a tensor that does not fit continues in the next launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "vramkit.h"
#include "scale_rule.h"

namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;
constexpr int kMaxTensors = 110;
constexpr int kMaxBlocks = 320;
// Vectors each thread loads before it computes, so several 16-byte loads are in flight
// per thread: one outstanding load per thread cannot saturate HBM.
constexpr int kIlp = 4;

constexpr int kCheck = 1; // flag inf/NaN results into *found_inf
constexpr int kSumsq = 2; // add the sum of squares of the results into *sumsq

// 3384 bytes: pointers first and the byte-sized field last, so there are no padding holes.
struct MtaArgs {
    void *addr[kMaxTensors];
    int64_t numel[kMaxTensors];
    const float *factor; // read on the device so the host never waits for the scale
    float *found_inf;
    double *sumsq;
    int32_t block_chunk[kMaxBlocks]; // chunk index within its tensor
    uint8_t block_tensor[kMaxBlocks]; // slot in addr/numel (110 < 256)
};
// The whole struct is the kernel's only parameter; the classic limit is 4096 bytes.
static_assert(sizeof(MtaArgs) <= 4096, "multi-tensor kernel arguments exceed 4 KB");
static_assert(kMaxTensors <= 256, "block_tensor is a uint8_t");
// Chunk starts must stay 16-byte aligned for every dtype so only the base address decides
// whether a tensor takes the vector path.
static_assert((kChunk * 2) % 16 == 0, "chunk must keep 16-byte alignment");

// Arithmetic type: float for the 32- and 16-bit dtypes (as PyTorch's opmath), double for fp64.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(typename AccOf<T>::type x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// W elements moved as one access; with W * sizeof(T) == 16 the alignment makes the compiler
// emit a single 128-bit load/store.
template <typename T, int W> struct alignas(sizeof(T) * W) Pack {
    T v[W];
};

template <typename T, int MODE>
__device__ __forceinline__ void amp_elem(T &x, typename AccOf<T>::type f, bool &bad, typename AccOf<T>::type &ss) {
    using A = typename AccOf<T>::type;
    const T stored = from_acc<T>(to_acc(x) * f);
    const A r = to_acc(stored);
    // Testing only the stored value is enough: an inf/NaN input gives an inf/NaN product
    // for every factor (inf * 0 is NaN), so this also catches non-finite inputs, and it
    // catches finite values that overflow the storage type when rounded.
    if constexpr ((MODE & kCheck) != 0) bad |= !isfinite(r);
    if constexpr ((MODE & kSumsq) != 0) ss += r * r;
    x = stored;
}

// `n` Packs from `p`, block-strided so consecutive threads touch consecutive addresses.
template <typename T, int W, int MODE>
__device__ __forceinline__ void amp_span(T *p, int64_t n, typename AccOf<T>::type f, bool write, bool &bad,
                                         typename AccOf<T>::type &ss) {
    using P = Pack<T, W>;
    P *q = reinterpret_cast<P *>(p);
    for (int64_t base = threadIdx.x; base < n; base += (int64_t)kThreads * kIlp) {
        P v[kIlp];
        // All loads are issued before any store so the kIlp requests overlap.
#pragma unroll
        for (int k = 0; k < kIlp; ++k) {
            const int64_t i = base + (int64_t)k * kThreads;
            if (i < n) v[k] = q[i];
        }
#pragma unroll
        for (int k = 0; k < kIlp; ++k) {
            const int64_t i = base + (int64_t)k * kThreads;
            if (i < n) {
#pragma unroll
                for (int e = 0; e < W; ++e) amp_elem<T, MODE>(v[k].v[e], f, bad, ss);
                if (write) q[i] = v[k];
            }
        }
    }
}

// Sum over the block; the result is valid in thread 0 only.
template <typename A> __device__ __forceinline__ A block_sum(A v) {
    __shared__ A warp_part[kThreads / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_part[warp] = v;
    __syncthreads();
    v = A(0);
    if (warp == 0) {
        v = lane < kThreads / 32 ? warp_part[lane] : A(0);
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;
}

template <typename T, int MODE> __global__ void __launch_bounds__(kThreads) amp_mta_kernel(const MtaArgs args) {
    using A = typename AccOf<T>::type;
    constexpr int W = 16 / (int)sizeof(T);
    const int t = args.block_tensor[blockIdx.x];
    const int64_t start = (int64_t)args.block_chunk[blockIdx.x] * kChunk;
    const int64_t left = args.numel[t] - start;
    const int64_t n = left < kChunk ? left : kChunk;
    T *const base = static_cast<T *>(args.addr[t]);
    T *const p = base + start;
    const float factor = *args.factor;
    // A factor of exactly 1 changes no finite value, so skipping the store halves the
    // traffic of a check-only pass (PyTorch writes back regardless).
    const bool write = factor != 1.0f;
    if constexpr (MODE == 0) {
        if (!write) return; // nothing to check or sum either: the whole block is a no-op
    }
    bool bad = false;
    A ss = A(0);
    if ((reinterpret_cast<uintptr_t>(base) & 15u) == 0) {
        const int64_t nvec = n / W;
        amp_span<T, W, MODE>(p, nvec, (A)factor, write, bad, ss);
        amp_span<T, 1, MODE>(p + nvec * W, n - nvec * W, (A)factor, write, bad, ss);
    } else {
        // Only element-aligned (allowed by the contract): no wider access is legal here.
        amp_span<T, 1, MODE>(p, n, (A)factor, write, bad, ss);
    }
    if constexpr ((MODE & kCheck) != 0) {
        // One store per block instead of one per bad element; 0 is never written because the
        // caller zeroes found_inf and other blocks or launches may already have set it.
        const int any_bad = __syncthreads_or(bad);
        if (any_bad && threadIdx.x == 0) *args.found_inf = 1.0f;
    }
    if constexpr ((MODE & kSumsq) != 0) {
        const A total = block_sum(ss);
        if (threadIdx.x == 0) atomicAdd(args.sumsq, (double)total);
    }
}

// Runs every tensor of one dtype, in list order, through as many launches as it takes.
template <typename T, int MODE>
cudaError_t mta_dtype(const vram_tensor_t *tensors, uint64_t count, vram_dtype_t dtype, MtaArgs &a,
                      cudaStream_t stream) {
    int nt = 0, nb = 0;
    for (uint64_t i = 0; i < count; ++i) {
        if (tensors[i].dtype != dtype || tensors[i].numel <= 0) continue;
        const int64_t numel = tensors[i].numel;
        const int64_t chunks = (numel + kChunk - 1) / kChunk;
        if (chunks > INT32_MAX) return cudaErrorInvalidValue; // > 2^47 elements: not real memory
        a.addr[nt] = tensors[i].data;
        a.numel[nt] = numel;
        ++nt;
        for (int64_t c = 0; c < chunks; ++c) {
            a.block_tensor[nb] = (uint8_t)(nt - 1);
            a.block_chunk[nb] = (int32_t)c;
            ++nb;
            const bool last = c == chunks - 1;
            if (nb == kMaxBlocks || (nt == kMaxTensors && last)) {
                amp_mta_kernel<T, MODE><<<nb, kThreads, 0, stream>>>(a);
                const cudaError_t err = cudaGetLastError();
                if (err != cudaSuccess) return err;
                nb = 0;
                if (last) {
                    nt = 0;
                } else { // the rest of this tensor continues from slot 0 of the next launch
                    a.addr[0] = a.addr[nt - 1];
                    a.numel[0] = a.numel[nt - 1];
                    nt = 1;
                }
            }
        }
    }
    if (nb > 0) {
        amp_mta_kernel<T, MODE><<<nb, kThreads, 0, stream>>>(a);
        return cudaGetLastError();
    }
    return cudaSuccess;
}

// One kernel instantiation per dtype, so the list is walked once per dtype instead of
// dispatching on dtype inside the kernel.
template <int MODE> cudaError_t mta_all(const vram_tensor_t *tensors, uint64_t count, MtaArgs &a, cudaStream_t s) {
    cudaError_t err = mta_dtype<float, MODE>(tensors, count, VRAM_FLOAT32, a, s);
    if (err == cudaSuccess) err = mta_dtype<__half, MODE>(tensors, count, VRAM_FLOAT16, a, s);
    if (err == cudaSuccess) err = mta_dtype<__nv_bfloat16, MODE>(tensors, count, VRAM_BFLOAT16, a, s);
    if (err == cudaSuccess) err = mta_dtype<double, MODE>(tensors, count, VRAM_FLOAT64, a, s);
    return err;
}

__global__ void clip_coef_kernel(const double *sumsq, double max_norm, float *coef, float *norm) {
    const double total = sqrt(*sumsq);
    double c = max_norm / (total + 1e-6);
    if (c > 1.0) c = 1.0;
    // With an inf/NaN gradient the step is skipped anyway; leaving the gradients unclipped
    // (as the CPU path does) keeps them inspectable instead of turning them into NaN.
    if (!isfinite(total)) c = 1.0;
    *coef = (float)c;
    if (norm) *norm = (float)total;
}

// The policy travels by value so the caller's host struct need not outlive the launch.
__global__ void update_scale_kernel(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                    const float *found_inf, vram_scale_policy_t policy) {
    vram__scale_rule(scale, growth_tracker, hysteresis_tracker, *found_inf, &policy);
}

} // namespace

extern "C" int vram__amp_unscale_check_launch(const vram_tensor_t *tensors, uint64_t count, const float *inv_scale,
                                              float *found_inf, double *sumsq, uint64_t stream) {
    MtaArgs a{};
    a.factor = inv_scale;
    a.found_inf = found_inf;
    a.sumsq = sumsq;
    const cudaStream_t s = (cudaStream_t)stream;
    return (int)(sumsq ? mta_all<kCheck | kSumsq>(tensors, count, a, s) : mta_all<kCheck>(tensors, count, a, s));
}

extern "C" int vram__amp_scale_inplace_launch(const vram_tensor_t *tensors, uint64_t count, const float *factor,
                                              uint64_t stream) {
    MtaArgs a{};
    a.factor = factor;
    return (int)mta_all<0>(tensors, count, a, (cudaStream_t)stream);
}

extern "C" int vram__amp_clip_coef_launch(const double *sumsq, double max_norm, float *coef, float *norm,
                                          uint64_t stream) {
    clip_coef_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(sumsq, max_norm, coef, norm);
    return (int)cudaGetLastError();
}

extern "C" int vram__amp_update_scale_launch(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                             const float *found_inf, const vram_scale_policy_t *policy,
                                             uint64_t stream) {
    update_scale_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(scale, growth_tracker, hysteresis_tracker, found_inf,
                                                          *policy);
    return (int)cudaGetLastError();
}
