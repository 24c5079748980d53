// FP8 (E4M3) weights, one byte per value with an f32 scale per run of
// `group` columns of a row (quant/fp8.rs): the decode GEMV reading the bytes
// once, rows dequantized to bf16 tiles for the prefill's cuBLAS GEMMs, and
// embedding rows.

#include "common.cuh"
#include "constants.cuh"

// Four E4M3 bytes (little-endian in v) as floats times 2^-8. E4M3's exponent
// bias is 7 and f16's 15, so a byte's sign, exponent and mantissa moved into
// an f16's fields give its value times 2^-8 exactly, subnormals included;
// callers fold the 2^8 into the scale. Bytes 0 and 2 fill one half2, 1 and 3
// the other.
__device__ __forceinline__ void e4m3x4_scaled(unsigned v, float (&out)[4]) {
    unsigned even = ((v & 0x00800080u) << 8) | ((v & 0x007F007Fu) << 7);
    unsigned odd = (v & 0x80008000u) | ((v & 0x7F007F00u) >> 1);
    float2 e = __half22float2(*reinterpret_cast<const __half2*>(&even));
    float2 o = __half22float2(*reinterpret_cast<const __half2*>(&odd));
    out[0] = e.x;
    out[1] = o.x;
    out[2] = e.y;
    out[3] = o.y;
}

// The 2^8 the decoded values lack (see e4m3x4_scaled).
#define FP8_UNSCALE 256.0f

// acc[a] += Σ_k x[a][c0 + k] · w_k · scale for the 16 E4M3 bytes in q at
// columns c0.. of a row whose scales are srow.
__device__ __forceinline__ void fp8_accumulate16(uint4 q, int c0, const float* __restrict__ srow, int group,
                                                 bool uniform, const float* __restrict__ x, int in_dim, int n_act,
                                                 float (&acc)[GEMV_MAX_ROWS]) {
    unsigned words[4] = {q.x, q.y, q.z, q.w};
    float wv[16];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float f[4];
        e4m3x4_scaled(words[k], f);
#pragma unroll
        for (int m = 0; m < 4; m++) wv[4 * k + m] = f[m];
    }
    if (uniform) {
        float u = __ldg(srow + c0 / group) * FP8_UNSCALE;
#pragma unroll
        for (int k = 0; k < 16; k++) wv[k] *= u;
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) wv[k] *= __ldg(srow + (c0 + k) / group) * FP8_UNSCALE;
    }
#pragma unroll
    for (int a = 0; a < GEMV_MAX_ROWS; a++) {
        if (a < n_act) {
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)a * in_dim + c0);
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float4 v = __ldg(xr + k);
                sum += v.x * wv[4 * k] + v.y * wv[4 * k + 1] + v.z * wv[4 * k + 2] + v.w * wv[4 * k + 3];
            }
            acc[a] += sum;
        }
    }
}

// y[a][o] = Σ_c x[a][c] · w[o][c] · scale(o, c) (+ bias[o]) for n_act ≤
// GEMV_MAX_ROWS activation rows. One warp per weight row, 16 bytes per lane
// per step and two steps' loads in flight; a run of 16 values shares one
// scale when `group` is a multiple of 16 (the checkpoints' 128-column
// blocks, whole rows), else each value looks its scale up.
extern "C" __global__ void __launch_bounds__(256)
    gemv_fp8(const unsigned char* __restrict__ w, const float* __restrict__ scales, const float* __restrict__ x,
             const float* bias, float* y, int out_dim, int in_dim, int group, int n_act) {
    grid_dependency_wait();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int o = blockIdx.x * (blockDim.x >> 5) + warp;
    if (o >= out_dim) return;
    int groups = (in_dim + group - 1) / group;
    const unsigned char* row = w + (size_t)o * in_dim;
    const float* srow = scales + (size_t)o * groups;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int a = 0; a < GEMV_MAX_ROWS; a++) acc[a] = 0.0f;
    bool uniform = group % 16 == 0;
    int vec_end = (in_dim % 16 == 0) ? in_dim : 0;
    const int step = 32 * 16;
    for (int c0 = lane * 16; c0 < vec_end; c0 += 2 * step) {
        bool second = c0 + step < vec_end;
        uint4 q0 = __ldg(reinterpret_cast<const uint4*>(row + c0));
        uint4 q1 = second ? __ldg(reinterpret_cast<const uint4*>(row + c0 + step)) : make_uint4(0, 0, 0, 0);
        fp8_accumulate16(q0, c0, srow, group, uniform, x, in_dim, n_act, acc);
        if (second) fp8_accumulate16(q1, c0 + step, srow, group, uniform, x, in_dim, n_act, acc);
    }
    // Rows whose width is not a multiple of 16: one value per lane per step.
    for (int c = lane; c < in_dim && vec_end == 0; c += 32) {
        float f[4];
        e4m3x4_scaled(row[c], f);
        float wc = f[0] * srow[c / group] * FP8_UNSCALE;
        for (int a = 0; a < n_act; a++) acc[a] += x[(size_t)a * in_dim + c] * wc;
    }
#pragma unroll
    for (int a = 0; a < GEMV_MAX_ROWS; a++) {
        if (a < n_act) {
            float v = warp_sum(acc[a]);
            if (lane == 0) y[(size_t)a * out_dim + o] = v + (bias ? bias[o] : 0.0f);
        }
    }
}

// Rows [row0, row0 + rows) dequantized to bf16 (a transient prefill tile for
// cuBLAS, never a resident copy); one thread per 4 values.
extern "C" __global__ void fp8_to_bf16(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                       __nv_bfloat16* __restrict__ out, int row0, int rows, int in_dim, int group) {
    grid_dependency_wait();
    long i = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 4;
    long n = (long)rows * in_dim;
    if (i >= n) return;
    int groups = (in_dim + group - 1) / group;
    for (int k = 0; k < 4 && i + k < n; k++) {
        long e = i + k;
        int r = (int)(e / in_dim), c = (int)(e % in_dim);
        size_t at = (size_t)(row0 + r) * in_dim + c;
        float f[4];
        e4m3x4_scaled(w[at], f);
        out[e] = __float2bfloat16(f[0] * scales[(size_t)(row0 + r) * groups + c / group] * FP8_UNSCALE);
    }
}

// Embedding rows `ids` of an FP8 table, one block per id.
extern "C" __global__ void embed_fp8(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                     const unsigned* __restrict__ ids, float* out, int cols, int group) {
    grid_dependency_wait();
    size_t id = ids[blockIdx.x];
    int groups = (cols + group - 1) / group;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float f[4];
        e4m3x4_scaled(w[id * cols + c], f);
        out[(size_t)blockIdx.x * cols + c] = f[0] * scales[id * groups + c / group] * FP8_UNSCALE;
    }
}
