// RMSNorm (with the residual add before it, or gated by silu(z)) and RoPE.

#include "common.cuh"
#include "rope.cuh"

// RMSNorm over each group of `group` values: out = x·rsqrt(mean(x²)+eps)·w,
// one block per group. With `y`, first x += y, written back (the residual add
// before the norm, fused). With `z`, the gated form: ·silu(z) (the Gated
// DeltaNet output norm). Groups of a multiple of 4 values are read as float4
// and up to NORM_HELD of them per thread stay in registers between the sum of
// squares and the output.
#define NORM_HELD 4
__device__ __forceinline__ float norm_out(float v, float inv, float w, const float* z, size_t i) {
    float o = w * (v * inv);
    if (z) {
        float g = z[i];
        o *= g / (1.0f + expf(-g));
    }
    return o;
}

// The weights of the values a thread holds are read before the wait for the
// kernel before (no kernel writes them), so that read is off the path from
// the inputs' arrival to the output.
__device__ void rms_norm_group(float* x, const float* y, const float* w, const float* z, float* out, int group,
                               float eps) {
    size_t base = (size_t)blockIdx.x * group;
    float ss = 0.0f;
    if (group % 4 == 0) {
        int n4 = group / 4;
        float4* x4 = reinterpret_cast<float4*>(x + base);
        const float4* y4 = reinterpret_cast<const float4*>(y + base);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* out4 = reinterpret_cast<float4*>(out + base);
        float4 held[NORM_HELD], held_w[NORM_HELD];
#pragma unroll
        for (int k = 0; k < NORM_HELD; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) held_w[k] = w4[i];
        }
        grid_dependency_wait();
        auto load = [&](int i) {
            float4 v = x4[i];
            if (y) {
                float4 a = y4[i];
                v.x += a.x; v.y += a.y; v.z += a.z; v.w += a.w;
                x4[i] = v;
            }
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            return v;
        };
        auto store = [&](int i, float4 v, float4 wv, float inv) {
            size_t o = base + 4 * i;
            out4[i] = make_float4(norm_out(v.x, inv, wv.x, z, o), norm_out(v.y, inv, wv.y, z, o + 1),
                                  norm_out(v.z, inv, wv.z, z, o + 2), norm_out(v.w, inv, wv.w, z, o + 3));
        };
#pragma unroll
        for (int k = 0; k < NORM_HELD; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) held[k] = load(i);
        }
        for (int i = threadIdx.x + NORM_HELD * blockDim.x; i < n4; i += blockDim.x) load(i);
        ss = block_sum(ss);
        float inv = rsqrtf(ss / group + eps);
#pragma unroll
        for (int k = 0; k < NORM_HELD; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) store(i, held[k], held_w[k], inv);
        }
        for (int i = threadIdx.x + NORM_HELD * blockDim.x; i < n4; i += blockDim.x) store(i, x4[i], w4[i], inv);
        return;
    }
    grid_dependency_wait();
    for (int c = threadIdx.x; c < group; c += blockDim.x) {
        float v = x[base + c];
        if (y) {
            v += y[base + c];
            x[base + c] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = rsqrtf(ss / group + eps);
    for (int c = threadIdx.x; c < group; c += blockDim.x) out[base + c] = norm_out(x[base + c], inv, w[c], z, base + c);
}

extern "C" __global__ void rms_norm(float* x, const float* y, const float* w, const float* z, float* out, int group,
                                    float eps) {
    rms_norm_group(x, y, w, z, out, group, eps);
}

// RoPE in place on every head of every row; one thread per rotated pair.
// style 0: rotate_half (i, i + rot/2); style 1: adjacent pairs (2i, 2i+1).
// Row r is at position step[0] + r.
extern "C" __global__ void rope(float* x, const int* step, const float* inv_freq, int rows, int cols,
                                int head_dim, int rotary_dim, int style) {
    grid_dependency_wait();
    int half = rotary_dim / 2;
    int heads = cols / head_dim;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)rows * heads * half) return;
    int i = idx % half;
    int h = (idx / half) % heads;
    int r = idx / ((long)half * heads);
    rope_pair(x + (size_t)r * cols + (size_t)h * head_dim, i, step[0] + r, inv_freq[i], half, style);
}
