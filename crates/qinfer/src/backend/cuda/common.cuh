// Helpers every kernel file shares: the dependent-launch wait, loads of
// stored values as f32, shared-memory copies (cp.async, the bulk copy engine
// and its mbarrier), an L2 eviction hint, and warp and block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Programmatic dependent launch (sm_90 and later). Every kernel is launched
// with programmatic stream serialization, so it may be scheduled while the
// kernel before it in the stream is still running. Each kernel calls this
// first: it blocks until that kernel has finished and its writes are visible
// (so, transitively, every earlier one), and then lets the next kernel be
// scheduled. What runs ahead of it is the launch itself and, in the kernels
// that do it (the affine tensor-core GEMV, RMSNorm, the q|k|v prologue),
// reading weights, which no kernel writes; the decode attention reads the
// step inputs and the KV rows that earlier passes wrote (and, folding the
// prologue, the norm weights and its rotations' cos/sin at the step's position). Letting the next kernel go only
// after the wait keeps at most one kernel waiting behind a running one.
// tests/kernel_sources.rs checks every kernel against these rules.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// A shared-memory pointer as the 32-bit address PTX's shared-space
// instructions (ldmatrix, cp.async) take.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// BYTES (4, 8 or 16) global → shared with cp.async, zero-filled when `valid`
// is false; 16-byte copies bypass L1.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "r"(valid ? 16 : 0));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "n"(BYTES), "r"(valid ? BYTES : 0));
}

#if __CUDA_ARCH__ >= 900
// (sm_90 and later.) An mbarrier in shared memory that one arrival (with the bytes a bulk copy
// will deliver) completes: the bulk copy's own completion, tracked apart
// from every cp.async group the thread committed before it.
__device__ __forceinline__ void mbar_init(unsigned bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) global → shared by
// the copy engine (one instruction for the whole range), completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
#endif

// An L2 policy that evicts the lines it tags first: for weights a decode step
// streams once, so that they leave L2 before the step's activations and
// caches do (8B q8g64 decode +1.2%; q4g64 unchanged within noise).
__device__ __forceinline__ unsigned long long l2_evict_first() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// A 16-byte cp.async (bypassing L1) whose L2 lines take `policy`.
__device__ __forceinline__ void cp_async_hinted(void* dst, const void* src, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "l"(policy));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One halving of a warp's reduce-scatter of per-lane sums d[0..2·HALF): the
// lane keeps the half named by its bit HALF and adds its partner's copy of
// it, into d[0..HALF).
template <int HALF>
__device__ __forceinline__ void reduce_scatter_half(float* d, int lane) {
    bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        float keep = upper ? d[i + HALF] : d[i], give = upper ? d[i] : d[i + HALF];
        d[i] = keep + __shfl_xor_sync(0xffffffffu, give, HALF);
    }
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int nwarps = blockDim.x >> 5;
    v = (threadIdx.x < nwarps) ? partial[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    float r = partial[0];
    __syncthreads();
    return r;
}

// Maximum over a block (block_sum's pattern; −inf where there is nothing).
__device__ float block_max(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int nwarps = blockDim.x >> 5;
    v = (threadIdx.x < nwarps) ? partial[threadIdx.x] : -__int_as_float(0x7f800000);
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    float r = partial[0];
    __syncthreads();
    return r;
}
