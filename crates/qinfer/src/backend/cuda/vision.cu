// A vision tower's ops beyond the language model's: LayerNorm with a bias,
// GELU in place, and the rotary split of q|k|v rows into the operands of
// the bidirectional flash attention (flash.cu's `flash_bidir`).

#include "common.cuh"

// LayerNorm of each row (one block per row): the mean, then the biased
// variance of the centred values (two passes, as torch).
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* out, int cols,
                                      float eps) {
    grid_dependency_wait();
    const float* row = x + (size_t)blockIdx.x * cols;
    float* dst = out + (size_t)blockIdx.x * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += row[c];
    float mean = block_sum(s) / cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float d = row[c] - mean;
        ss += d * d;
    }
    float inv = rsqrtf(block_sum(ss) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = (row[c] - mean) * inv * w[c] + b[c];
}

// GELU in place: the tanh approximation (gelu_pytorch_tanh) or the exact one.
extern "C" __global__ void gelu_tanh(float* x, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}
extern "C" __global__ void gelu_erf(float* x, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    x[i] = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
}

// q|k|v rows [rows, 3·heads·hd] → rotated queries (f32) and keys (f16) and
// the values (f16), each [rows, heads·hdp], every head padded with zeros
// from hd to hdp columns. rotary row r: hd/2 cosines, then hd/2 sines; pair
// j joins columns j and j + hd/2. Grid (rows), a thread per output column.
extern "C" __global__ void vision_qkv(const float* qkv, const float* rotary, float* q, __half* k, __half* v,
                                      int heads, int hd, int hdp) {
    grid_dependency_wait();
    int r = blockIdx.x, half = hd / 2, d = heads * hd;
    const float* src = qkv + (size_t)r * 3 * d;
    const float* cs = rotary + (size_t)r * hd;
    for (int i = threadIdx.x; i < heads * hdp; i += blockDim.x) {
        int h = i / hdp, c = i % hdp;
        size_t at = (size_t)r * heads * hdp + i;
        if (c >= hd) {
            q[at] = 0.0f;
            k[at] = __float2half(0.0f);
            v[at] = __float2half(0.0f);
            continue;
        }
        int j = c < half ? c : c - half;
        float cosv = cs[j], sinv = cs[half + j];
        const float* qh = src + h * hd;
        const float* kh = src + d + h * hd;
        float qr, kr;
        if (c < half) {
            qr = qh[c] * cosv - qh[c + half] * sinv;
            kr = kh[c] * cosv - kh[c + half] * sinv;
        } else {
            qr = qh[c] * cosv + qh[c - half] * sinv;
            kr = kh[c] * cosv + kh[c - half] * sinv;
        }
        q[at] = qr;
        k[at] = __float2half(kr);
        v[at] = __float2half(src[2 * d + h * hd + c]);
    }
}
