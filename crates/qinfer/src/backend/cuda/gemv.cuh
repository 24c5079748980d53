// The CUDA-core float GEMV (bf16, f16, f32 weights) that linear.cu
// instantiates and the routed experts (moe.cu) share.
#pragma once

#include "common.cuh"
#include "constants.cuh"

// ---------------------------------------------------------------------------
// Decode GEMV for a few activation rows: y[t][o] = Σ_c W[o][c] x[t][c] (+ bias).
// A block computes ROWS consecutive output rows. Its threads stride over the
// rows' columns together in 16-byte chunks (8 bf16/f16 values or 4 f32), each
// thread reading the same columns of all ROWS rows, so one read of x serves
// ROWS rows and ROWS·GEMV_UNROLL independent loads are in flight per thread:
// memory bound by design, and HBM needs tens of KB in flight per SM. ACT is
// the activation rows' compile-time bound (1 for plain decode). The block then
// sums its threads' partial dot products. The bias may be y itself (one
// activation row): each output reads its bias just before writing itself,
// which is how a block's last projection adds into the residual stream.
// GEMV_MAX_ROWS comes from constants.cuh.
#define GEMV_UNROLL 4

template <typename T, int VEC, int ROWS, int ACT>
__device__ __forceinline__ void gemv_chunk(const uint4 (&packed)[ROWS], const float* __restrict__ x, int c,
                                           int in_dim, int n_act, float (&acc)[ROWS][ACT]) {
#pragma unroll
    for (int t = 0; t < ACT; t++) {
        if (t < n_act) {
            float xv[VEC];
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + c);
#pragma unroll
            for (int j = 0; j < VEC / 4; j++) {
                float4 v = xr[j];
                xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const T* wv = reinterpret_cast<const T*>(&packed[r]);
#pragma unroll
                for (int j = 0; j < VEC; j++) acc[r][t] += to_f32(wv[j]) * xv[j];
            }
        }
    }
}

// The end of both GEMVs: each thread's partial dot products summed over the
// block, y[t][row0 + r] = Σ + bias for the block's rows. PAIRED: the block's
// rows are ROWS/2 gate rows then the matching up rows of a stacked gate|up
// weight, and y[t][row0 + r] = silu(gate)·up (as the swiglu kernel).
template <int ROWS, int ACT, bool PAIRED = false>
__device__ __forceinline__ void gemv_store(const float (&acc)[ROWS][ACT], const float* bias,
                                           float* y, int row0, int out_dim, int n_act) {
    __shared__ float partial[32][ROWS * ACT];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) {
            float v = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r * ACT + t] = v;
        }
    __syncthreads();
    if constexpr (PAIRED) {
        constexpr int HALF = ROWS / 2;
        if (threadIdx.x < HALF * ACT) {
            int r = threadIdx.x / ACT, t = threadIdx.x % ACT, o = row0 + r;
            float g = 0.0f, u = 0.0f;
            for (int k = 0; k < warps; k++) {
                g += partial[k][threadIdx.x];
                u += partial[k][HALF * ACT + threadIdx.x];
            }
            if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = g / (1.0f + expf(-g)) * u;
        }
        return;
    }
    if (threadIdx.x < ROWS * ACT) {
        int r = threadIdx.x / ACT, t = threadIdx.x % ACT, o = row0 + r;
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += partial[k][threadIdx.x];
        if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = sum + (bias ? bias[o] : 0.0f);
    }
}

// PAIRED: `w` is a stacked gate|up weight of 2·out_dim rows and y is
// silu(gate)·up, out_dim wide (see gemv_store).
template <typename T, int VEC, int ROWS, int ACT, bool PAIRED = false>
__device__ void gemv(const T* __restrict__ w, const float* __restrict__ x, const float* bias,
                     float* y, int out_dim, int in_dim, int n_act) {
    constexpr int UNITS = PAIRED ? ROWS / 2 : ROWS;  // outputs per block
    int row0 = blockIdx.x * UNITS;
    const T* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        rows[r] = w + ((size_t)min(row0 + r % UNITS, out_dim - 1) + (size_t)(r / UNITS) * out_dim) * in_dim;
    float acc[ROWS][ACT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) acc[r][t] = 0.0f;
    // 16-byte chunks need every row 16-byte aligned: in_dim a multiple of VEC.
    int chunks = in_dim % VEC == 0 ? in_dim / VEC : 0;
    int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + (GEMV_UNROLL - 1) * stride < chunks; i += GEMV_UNROLL * stride) {
        uint4 packed[GEMV_UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                packed[u][r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i + u * stride);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
            gemv_chunk<T, VEC, ROWS, ACT>(packed[u], x, (i + u * stride) * VEC, in_dim, n_act, acc);
    }
    for (; i < chunks; i += stride) {
        uint4 packed[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) packed[r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i);
        gemv_chunk<T, VEC, ROWS, ACT>(packed, x, i * VEC, in_dim, n_act, acc);
    }
    for (int c = chunks * VEC + threadIdx.x; c < in_dim; c += stride) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float wv = to_f32(rows[r][c]);
            for (int t = 0; t < n_act && t < ACT; t++) acc[r][t] += wv * x[(size_t)t * in_dim + c];
        }
    }
    gemv_store<ROWS, ACT, PAIRED>(acc, bias, y, row0, out_dim, n_act);
}
