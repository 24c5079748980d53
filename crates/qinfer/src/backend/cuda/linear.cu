// The float GEMV kernels (decode), and what the cuBLAS GEMMs of a prefill
// take and give: activations narrowed to the weight's type, the bias added.

#include "common.cuh"
#include "constants.cuh"
#include "gemv.cuh"

#define GEMV_KERNEL(NAME, T, VEC, ROWS, ACT, PAIRED)                                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME(const T* w, const float* x, const float* b, float* y,    \
                                                           int o, int i, int n) {                                  \
        grid_dependency_wait();                                                                                    \
        gemv<T, VEC, ROWS, ACT, PAIRED>(w, x, b, y, o, i, n);                                                      \
    }
// `_swiglu`: the PAIRED form, for a stacked gate|up weight (rows_per_block
// counts weight rows, half of them gate rows).
#define GEMV_KERNELS(NAME, T, VEC)                                                                                 \
    GEMV_KERNEL(NAME##_r1a1, T, VEC, 1, 1, false)                                                                  \
    GEMV_KERNEL(NAME##_r2a1, T, VEC, 2, 1, false)                                                                  \
    GEMV_KERNEL(NAME##_r4a1, T, VEC, 4, 1, false)                                                                  \
    GEMV_KERNEL(NAME##_r1a8, T, VEC, 1, GEMV_MAX_ROWS, false)                                                      \
    GEMV_KERNEL(NAME##_r2a8, T, VEC, 2, GEMV_MAX_ROWS, false)                                                      \
    GEMV_KERNEL(NAME##_r2a1_swiglu, T, VEC, 2, 1, true)                                                            \
    GEMV_KERNEL(NAME##_r4a1_swiglu, T, VEC, 4, 1, true)                                                            \
    GEMV_KERNEL(NAME##_r2a8_swiglu, T, VEC, 2, GEMV_MAX_ROWS, true)
GEMV_KERNELS(gemv_bf16, __nv_bfloat16, 8)
GEMV_KERNELS(gemv_f16, __half, 8)
GEMV_KERNELS(gemv_f32, float, 4)

// Activations to the weight's type for a cuBLAS GEMM.
extern "C" __global__ void f32_to_bf16(const float* x, __nv_bfloat16* y, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}
extern "C" __global__ void f32_to_f16(const float* x, __half* y, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(x[i]);
}

// x ≈ hi + lo in two bf16 (or f16) halves: a GEMM over each, summed, sees the
// activations to about 16 bits instead of 8.
extern "C" __global__ void f32_split_bf16(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    __nv_bfloat16 h = __float2bfloat16(x[i]);
    hi[i] = h;
    lo[i] = __float2bfloat16(x[i] - __bfloat162float(h));
}
extern "C" __global__ void f32_split_f16(const float* x, __half* hi, __half* lo, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half h = __float2half(x[i]);
    hi[i] = h;
    lo[i] = __float2half(x[i] - __half2float(h));
}

// y[r][c] += bias[c]
extern "C" __global__ void add_bias(float* y, const float* bias, int cols, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] += bias[i % cols];
}
