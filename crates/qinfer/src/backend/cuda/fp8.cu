// FP8 (E4M3) weights, one byte per value with an f32 scale per run of
// `group` columns of a row (quant/fp8.rs): the decode GEMV reading the bytes
// once, rows dequantized to bf16 tiles for the prefill's cuBLAS GEMMs, and
// embedding rows.

#include "common.cuh"
#include "constants.cuh"
#include "gemv.cuh"

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

// Sixteen E4M3 bytes of each of ROWS rows (at column c) against the
// activation rows: acc[r][t] += scale · Σ_k x[t][c + k] · q_k. With `uniform`
// (group a multiple of 16) the 16 values share a scale, applied to their sum;
// otherwise each value is scaled before the sum.
template <int ROWS, int ACT>
__device__ __forceinline__ void fp8_chunk(const uint4 (&q)[ROWS], const float* const (&srows)[ROWS], int c,
                                          int group, bool uniform, const float* __restrict__ x, int in_dim,
                                          int n_act, float (&acc)[ROWS][ACT]) {
#pragma unroll
    for (int t = 0; t < ACT; t++) {
        if (t < n_act) {
            float xv[16];
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + c);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float4 v = xr[j];
                xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                unsigned words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
                float sum = 0.0f;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float f[4];
                    e4m3x4_scaled(words[k], f);
                    if (uniform) {
#pragma unroll
                        for (int m = 0; m < 4; m++) sum += f[m] * xv[4 * k + m];
                    } else {
#pragma unroll
                        for (int m = 0; m < 4; m++) sum += f[m] * srows[r][(c + 4 * k + m) / group] * xv[4 * k + m];
                    }
                }
                acc[r][t] += uniform ? sum * (srows[r][c / group] * FP8_UNSCALE) : sum * FP8_UNSCALE;
            }
        }
    }
}

// y[t][o] = Σ_c x[t][c] · w[o][c] · scale(o, c) (+ bias[o]), the float
// GEMV's shape (gemv.cuh): a block's threads stride together over ROWS rows'
// columns in 16-byte chunks, GEMV_UNROLL·ROWS loads in flight per thread,
// then the block sums the partial dot products. Every row's sum runs in the
// same order whatever ROWS and ACT are, so a row's result does not depend on
// how many activation rows share the launch.
template <int ROWS, int ACT>
__device__ void gemv_fp8(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                         const float* __restrict__ x, const float* bias, float* y, int out_dim, int in_dim,
                         int group, int n_act) {
    int row0 = blockIdx.x * ROWS;
    int groups = (in_dim + group - 1) / group;
    const unsigned char* rows[ROWS];
    const float* srows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        size_t o = min(row0 + r, out_dim - 1);
        rows[r] = w + o * in_dim;
        srows[r] = scales + o * groups;
    }
    float acc[ROWS][ACT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) acc[r][t] = 0.0f;
    bool uniform = group % 16 == 0;
    // 16-byte chunks need every row 16-byte aligned: in_dim a multiple of 16.
    int chunks = in_dim % 16 == 0 ? in_dim / 16 : 0;
    int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + (GEMV_UNROLL - 1) * stride < chunks; i += GEMV_UNROLL * stride) {
        uint4 q[GEMV_UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < ROWS; r++) q[u][r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i + u * stride);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
            fp8_chunk<ROWS, ACT>(q[u], srows, (i + u * stride) * 16, group, uniform, x, in_dim, n_act, acc);
    }
    for (; i < chunks; i += stride) {
        uint4 q[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) q[r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i);
        fp8_chunk<ROWS, ACT>(q, srows, i * 16, group, uniform, x, in_dim, n_act, acc);
    }
    // Rows whose width is not a multiple of 16: one value per thread per step.
    for (int c = chunks * 16 + threadIdx.x; c < in_dim; c += stride) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float f[4];
            e4m3x4_scaled(rows[r][c], f);
            float wv = f[0] * srows[r][c / group] * FP8_UNSCALE;
            for (int t = 0; t < n_act && t < ACT; t++) acc[r][t] += wv * x[(size_t)t * in_dim + c];
        }
    }
    gemv_store<ROWS, ACT>(acc, bias, y, row0, out_dim, n_act);
}

#define GEMV_FP8_KERNEL(NAME, ROWS, ACT)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        NAME(const unsigned char* w, const float* scales, const float* x, const float* b, float* y, int o, int i, \
             int group, int n) {                                                                                   \
        grid_dependency_wait();                                                                                    \
        gemv_fp8<ROWS, ACT>(w, scales, x, b, y, o, i, group, n);                                                   \
    }
// Decode (one activation row) and up to GEMV_MAX_ROWS rows.
GEMV_FP8_KERNEL(gemv_fp8_r4a1, 4, 1)
GEMV_FP8_KERNEL(gemv_fp8_r2a8, 2, GEMV_MAX_ROWS)

// Rows [row0, row0 + rows) dequantized to bf16 (a transient prefill tile for
// cuBLAS, never a resident copy). Rows a multiple of 16 wide: one thread per
// 16 values, one 16-byte load and two 16-byte stores; otherwise one value
// per thread.
// With `lo`, also the remainder v − bf16(v) in bf16 (the parity
// configuration's second GEMM: about 16 bits of each weight, where bf16
// alone keeps 8 of the up to 28 an E4M3 value times an f32 scale has).
__device__ __forceinline__ void fp8_store_bf16(__nv_bfloat16* out, __nv_bfloat16* lo, size_t at, float v) {
    __nv_bfloat16 h = __float2bfloat16(v);
    out[at] = h;
    if (lo) lo[at] = __float2bfloat16(v - __bfloat162float(h));
}

extern "C" __global__ void fp8_to_bf16(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                       __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ lo, int row0,
                                       int rows, int in_dim, int group) {
    grid_dependency_wait();
    int groups = (in_dim + group - 1) / group;
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (in_dim % 16 == 0) {
        long chunks_per_row = in_dim / 16;
        if (t >= (long)rows * chunks_per_row) return;
        int r = (int)(t / chunks_per_row), c = (int)(t % chunks_per_row) * 16;
        size_t row = (size_t)(row0 + r);
        uint4 q = __ldcs(reinterpret_cast<const uint4*>(w + row * in_dim + c));
        unsigned words[4] = {q.x, q.y, q.z, q.w};
        const float* srow = scales + row * groups;
        __align__(16) __nv_bfloat16 v[16];
        __align__(16) __nv_bfloat16 rest[16];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float f[4];
            e4m3x4_scaled(words[k], f);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                float x = f[m] * srow[(c + 4 * k + m) / group] * FP8_UNSCALE;
                v[4 * k + m] = __float2bfloat16(x);
                rest[4 * k + m] = __float2bfloat16(x - __bfloat162float(v[4 * k + m]));
            }
        }
        uint4* dst = reinterpret_cast<uint4*>(out + (size_t)r * in_dim + c);
        dst[0] = reinterpret_cast<const uint4*>(v)[0];
        dst[1] = reinterpret_cast<const uint4*>(v)[1];
        if (lo) {
            uint4* dlo = reinterpret_cast<uint4*>(lo + (size_t)r * in_dim + c);
            dlo[0] = reinterpret_cast<const uint4*>(rest)[0];
            dlo[1] = reinterpret_cast<const uint4*>(rest)[1];
        }
        return;
    }
    if (t >= (long)rows * in_dim) return;
    int r = (int)(t / in_dim), c = (int)(t % in_dim);
    size_t row = (size_t)(row0 + r);
    float f[4];
    e4m3x4_scaled(w[row * in_dim + c], f);
    fp8_store_bf16(out, lo, t, f[0] * scales[row * groups + c / group] * FP8_UNSCALE);
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
