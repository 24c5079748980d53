// qinfer's CUDA kernels, compiled at run time by NVRTC for the device's
// architecture. Activations are f32 row-major [rows, cols]; weights are stored
// as in the checkpoint (bf16, f16 or f32) and converted as they are read. Each
// kernel's CPU reference is the CPU backend's op of the same name.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
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

// ---------------------------------------------------------------------------
// Embedding rows: out[r] = table[ids[r]].
template <typename T>
__device__ void embed(const T* table, const unsigned* ids, float* out, int cols) {
    const T* row = table + (size_t)ids[blockIdx.x] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(size_t)blockIdx.x * cols + c] = to_f32(row[c]);
}
extern "C" __global__ void embed_bf16(const __nv_bfloat16* t, const unsigned* ids, float* o, int c) { embed(t, ids, o, c); }
extern "C" __global__ void embed_f16(const __half* t, const unsigned* ids, float* o, int c) { embed(t, ids, o, c); }
extern "C" __global__ void embed_f32(const float* t, const unsigned* ids, float* o, int c) { embed(t, ids, o, c); }

// ---------------------------------------------------------------------------
// Decode GEMV for up to 8 activation rows: y[t][o] = Σ_c W[o][c] x[t][c] (+ bias).
// One warp per output row; each lane reads 16 bytes of the weight row per load
// (8 bf16/f16 values, or 4 f32), so a warp streams 512 contiguous bytes per
// load, and the weight is read once for all activation rows. Memory bound by
// design: each lane issues GEMV_UNROLL independent loads before using any, so
// enough bytes are in flight to cover HBM latency (one load at a time reached
// only ~37% of the bandwidth on the H200).
#define GEMV_MAX_ROWS 8
#define GEMV_UNROLL 4

template <typename T, int VEC>
__device__ __forceinline__ void gemv_step(const uint4& packed, const float* __restrict__ x, int c, int in_dim,
                                          int n_rows, float* acc) {
    const T* wv = reinterpret_cast<const T*>(&packed);
    float w[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) w[j] = to_f32(wv[j]);
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; t++) {
        if (t < n_rows) {
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + c);
#pragma unroll
            for (int j = 0; j < VEC / 4; j++) {
                float4 xv = xr[j];
                acc[t] += w[4 * j] * xv.x + w[4 * j + 1] * xv.y + w[4 * j + 2] * xv.z + w[4 * j + 3] * xv.w;
            }
        }
    }
}

template <typename T, int VEC>
__device__ void gemv(const T* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias,
                     float* __restrict__ y, int out_dim, int in_dim, int n_rows) {
    int warps = blockDim.x >> 5;
    int o = blockIdx.x * warps + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (o >= out_dim) return;
    const T* row = w + (size_t)o * in_dim;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; t++) acc[t] = 0.0f;
    // Vector path over the largest multiple of 32*VEC; scalar tail after.
    // (16-byte loads need every row 16-byte aligned: in_dim a multiple of VEC.)
    const int step = 32 * VEC;
    int vec_end = in_dim % VEC == 0 ? (in_dim / step) * step : 0;
    int c = lane * VEC;
    for (; c + (GEMV_UNROLL - 1) * step < vec_end; c += GEMV_UNROLL * step) {
        uint4 packed[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) packed[u] = __ldcs(reinterpret_cast<const uint4*>(row + c + u * step));
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) gemv_step<T, VEC>(packed[u], x, c + u * step, in_dim, n_rows, acc);
    }
    for (; c < vec_end; c += step) {
        uint4 packed = __ldcs(reinterpret_cast<const uint4*>(row + c));
        gemv_step<T, VEC>(packed, x, c, in_dim, n_rows, acc);
    }
    for (int c = vec_end + lane; c < in_dim; c += 32) {
        float wv = to_f32(row[c]);
        for (int t = 0; t < n_rows; t++) acc[t] += wv * x[(size_t)t * in_dim + c];
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; t++) {
        if (t < n_rows) {
            float s = warp_sum(acc[t]);
            if (lane == 0) y[(size_t)t * out_dim + o] = s + (bias ? bias[o] : 0.0f);
        }
    }
}
extern "C" __global__ void gemv_bf16(const __nv_bfloat16* w, const float* x, const float* b, float* y, int o, int i, int n) {
    gemv<__nv_bfloat16, 8>(w, x, b, y, o, i, n);
}
extern "C" __global__ void gemv_f16(const __half* w, const float* x, const float* b, float* y, int o, int i, int n) {
    gemv<__half, 8>(w, x, b, y, o, i, n);
}
extern "C" __global__ void gemv_f32(const float* w, const float* x, const float* b, float* y, int o, int i, int n) {
    gemv<float, 4>(w, x, b, y, o, i, n);
}

// ---------------------------------------------------------------------------
// Affine-quantized weights (MLX layout): each row is a bit stream of BITS-bit
// levels in u32 words, low bits first; every run of 32 values fills exactly
// BITS words, and w = scale·q + bias per group of `group` values (scales and
// biases as f32 [rows, cols/group]).

// Level k (0..31) of a 32-value chunk held in BITS words.
template <int BITS>
__device__ __forceinline__ float affine_level(const unsigned* words, int k) {
    int bit = k * BITS, wi = bit >> 5, sh = bit & 31;
    unsigned v = words[wi] >> sh;
    if (sh + BITS > 32) v |= words[wi + 1] << (32 - sh);
    return (float)(v & ((1u << BITS) - 1));
}

// The BITS words of 32-value chunk `chunk` of a row (16-byte loads where the
// chunk is a whole number of them: 4 and 8 bits).
template <int BITS>
__device__ __forceinline__ void affine_chunk(const unsigned* __restrict__ row, int chunk, unsigned* words) {
    const unsigned* p = row + (size_t)chunk * BITS;
    if (BITS % 4 == 0) {
#pragma unroll
        for (int i = 0; i < BITS / 4; i++) {
            uint4 v = __ldcs(reinterpret_cast<const uint4*>(p) + i);
            words[4 * i] = v.x; words[4 * i + 1] = v.y; words[4 * i + 2] = v.z; words[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < BITS; i++) words[i] = __ldcs(p + i);
    }
}

// Decode GEMV, one warp per output row, one 32-value chunk per lane per step,
// the levels unpacked and dequantized (s·q + b) in registers. Not the shortcut
// s·Σx·q + b·Σx: with b ≈ −s·2^(bits−1) its two terms cancel (see the CPU
// backend's affine.rs).
template <int BITS>
__device__ void gemv_affine(const unsigned* __restrict__ w, const float* __restrict__ scales,
                            const float* __restrict__ biases, const float* __restrict__ x,
                            const float* __restrict__ bias, float* __restrict__ y, int out_dim, int in_dim,
                            int group, int n_rows) {
    int warps = blockDim.x >> 5;
    int o = blockIdx.x * warps + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (o >= out_dim) return;
    const unsigned* row = w + (size_t)o * (in_dim / 32) * BITS;
    int groups = in_dim / group;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; t++) acc[t] = 0.0f;
    for (int chunk = lane; chunk < in_dim / 32; chunk += 32) {
        unsigned words[BITS];
        affine_chunk<BITS>(row, chunk, words);
        int g = chunk * 32 / group;
        float s = scales[(size_t)o * groups + g], b = biases[(size_t)o * groups + g];
        float wv[32];
#pragma unroll
        for (int k = 0; k < 32; k++) wv[k] = s * affine_level<BITS>(words, k) + b;
#pragma unroll
        for (int t = 0; t < GEMV_MAX_ROWS; t++) {
            if (t < n_rows) {
                const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + chunk * 32);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float4 xv = xr[j];
                    acc[t] += wv[4 * j] * xv.x + wv[4 * j + 1] * xv.y + wv[4 * j + 2] * xv.z + wv[4 * j + 3] * xv.w;
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; t++) {
        if (t < n_rows) {
            float sum = warp_sum(acc[t]);
            if (lane == 0) y[(size_t)t * out_dim + o] = sum + (bias ? bias[o] : 0.0f);
        }
    }
}

// Rows [row0, row0 + rows) dequantized to bf16 (prefill: a transient tile for
// cuBLAS, never a resident copy); one thread per 32-value chunk.
template <int BITS>
__device__ void affine_to_bf16(const unsigned* __restrict__ w, const float* __restrict__ scales,
                               const float* __restrict__ biases, __nv_bfloat16* __restrict__ out, int row0,
                               int rows, int in_dim, int group) {
    long chunks = (long)in_dim / 32;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * chunks) return;
    long r = row0 + i / chunks;
    int chunk = i % chunks;
    unsigned words[BITS];
    affine_chunk<BITS>(w + r * chunks * BITS, chunk, words);
    int groups = in_dim / group, g = chunk * 32 / group;
    float s = scales[r * groups + g], b = biases[r * groups + g];
    __nv_bfloat16* dst = out + (i / chunks) * in_dim + chunk * 32;
#pragma unroll
    for (int k = 0; k < 32; k++) dst[k] = __float2bfloat16(s * affine_level<BITS>(words, k) + b);
}

// Embedding rows from an affine table, in f32.
template <int BITS>
__device__ void embed_affine(const unsigned* __restrict__ w, const float* __restrict__ scales,
                             const float* __restrict__ biases, const unsigned* ids, float* out, int cols, int group) {
    long r = ids[blockIdx.x];
    int chunks = cols / 32, groups = cols / group;
    for (int chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
        unsigned words[BITS];
        affine_chunk<BITS>(w + r * chunks * BITS, chunk, words);
        int g = chunk * 32 / group;
        float s = scales[r * groups + g], b = biases[r * groups + g];
        float* dst = out + (size_t)blockIdx.x * cols + chunk * 32;
#pragma unroll
        for (int k = 0; k < 32; k++) dst[k] = s * affine_level<BITS>(words, k) + b;
    }
}

#define AFFINE_KERNELS(B)                                                                                          \
    extern "C" __global__ void gemv_affine##B(const unsigned* w, const float* s, const float* bi, const float* x,  \
                                              const float* b, float* y, int o, int i, int g, int n) {              \
        gemv_affine<B>(w, s, bi, x, b, y, o, i, g, n);                                                             \
    }                                                                                                              \
    extern "C" __global__ void affine##B##_to_bf16(const unsigned* w, const float* s, const float* bi,             \
                                                   __nv_bfloat16* out, int r0, int rows, int i, int g) {           \
        affine_to_bf16<B>(w, s, bi, out, r0, rows, i, g);                                                          \
    }                                                                                                              \
    extern "C" __global__ void embed_affine##B(const unsigned* w, const float* s, const float* bi,                 \
                                               const unsigned* ids, float* out, int cols, int g) {                 \
        embed_affine<B>(w, s, bi, ids, out, cols, g);                                                              \
    }
AFFINE_KERNELS(2)
AFFINE_KERNELS(3)
AFFINE_KERNELS(4)
AFFINE_KERNELS(5)
AFFINE_KERNELS(6)
AFFINE_KERNELS(8)

// Activations to the weight's type for a cuBLAS GEMM.
extern "C" __global__ void f32_to_bf16(const float* x, __nv_bfloat16* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}
extern "C" __global__ void f32_to_f16(const float* x, __half* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(x[i]);
}

// x ≈ hi + lo in two bf16 (or f16) halves: a GEMM over each, summed, sees the
// activations to about 16 bits instead of 8.
extern "C" __global__ void f32_split_bf16(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    __nv_bfloat16 h = __float2bfloat16(x[i]);
    hi[i] = h;
    lo[i] = __float2bfloat16(x[i] - __bfloat162float(h));
}
extern "C" __global__ void f32_split_f16(const float* x, __half* hi, __half* lo, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half h = __float2half(x[i]);
    hi[i] = h;
    lo[i] = __float2half(x[i] - __half2float(h));
}

// y[r][c] += bias[c]
extern "C" __global__ void add_bias(float* y, const float* bias, int cols, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] += bias[i % cols];
}

// ---------------------------------------------------------------------------
// RMSNorm over each group of `group` values: out = x·rsqrt(mean(x²)+eps)·w.
// With `z`, the gated form: ·silu(z) (the Gated DeltaNet output norm).
extern "C" __global__ void rms_norm(const float* x, const float* w, const float* z, float* out, int group, float eps) {
    const float* xg = x + (size_t)blockIdx.x * group;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < group; c += blockDim.x) ss += xg[c] * xg[c];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / group + eps);
    for (int c = threadIdx.x; c < group; c += blockDim.x) {
        size_t i = (size_t)blockIdx.x * group + c;
        float v = w[c] * (xg[c] * inv);
        if (z) {
            float g = z[i];
            v *= g / (1.0f + expf(-g));
        }
        out[i] = v;
    }
}

// The pass's inputs on the device, so a recorded decode step (CUDA graph) can
// be replayed at any position: step[0] is the first row's position, step[1]
// the token id of a one-token pass. Set by a launch before the pass (or the
// replay), never baked into the recorded kernels' arguments.
extern "C" __global__ void set_step(int* step, int start, int id) {
    step[0] = start;
    step[1] = id;
}

// The rotation of pair i at position pos (angle in f32 as the reference
// computes it, cos/sin in double so large positions keep their precision).
__device__ __forceinline__ void rope_pair(float* head, int i, int pos, const float* inv_freq, int half, int style) {
    float angle = (float)pos * inv_freq[i];
    float c = (float)cos((double)angle), s = (float)sin((double)angle);
    int ia = style == 0 ? i : 2 * i, ib = style == 0 ? i + half : 2 * i + 1;
    float a = head[ia], b = head[ib];
    head[ia] = a * c - b * s;
    head[ib] = b * c + a * s;
}

// RoPE in place on every head of every row; one thread per rotated pair.
// style 0: rotate_half (i, i + rot/2); style 1: adjacent pairs (2i, 2i+1).
// Row r is at position step[0] + r.
extern "C" __global__ void rope(float* x, const int* step, const float* inv_freq, int rows, int cols,
                                int head_dim, int rotary_dim, int style) {
    int half = rotary_dim / 2;
    int heads = cols / head_dim;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)rows * heads * half) return;
    int i = idx % half;
    int h = (idx / half) % heads;
    int r = idx / ((long)half * heads);
    rope_pair(x + (size_t)r * cols + (size_t)h * head_dim, i, step[0] + r, inv_freq, half, style);
}

// Rows of k and v into the cache at positions step[0].. (one thread per value).
extern "C" __global__ void kv_append(const float* k, const float* v, float* keys, float* values, const int* step,
                                     int rows, int kv_dim) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= (long)rows * kv_dim) return;
    size_t dst = (size_t)step[0] * kv_dim + i;
    keys[dst] = k[i];
    values[dst] = v[i];
}

// ---------------------------------------------------------------------------
// Keys [lo, lo + n) of one KV head (at column `head_off` of rows `kv_dim` wide)
// scored against the query `qh` into `scores`, then replaced by e^(score − max).
// Returns (max, Σ e^(score − max)). Every thread of the block calls it.
__device__ float2 score_keys(const float* qh, const float* keys, int lo, int n, int kv_dim, int head_off,
                             int head_dim, float scale, float* scores) {
    __shared__ float red[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = warp; j < n; j += warps) {
        const float* k = keys + (size_t)(lo + j) * kv_dim + head_off;
        float d = 0.0f;
        for (int c = lane; c < head_dim; c += 32) d += qh[c] * k[c];
        d = warp_sum(d);
        if (lane == 0) scores[j] = d * scale;
    }
    __syncthreads();
    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = -__int_as_float(0x7f800000);
    for (int w = 0; w < warps; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = expf(scores[j] - m);
        scores[j] = e;
        sum += e;
    }
    return make_float2(m, block_sum(sum));
}

// o[c] = mul · Σ_j weights[j] · values[lo + j][head_off + c].
__device__ void weigh_values(const float* weights, const float* values, int lo, int n, int kv_dim, int head_off,
                             int head_dim, float mul, float* o) {
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += weights[j] * values[(size_t)(lo + j) * kv_dim + head_off + c];
        o[c] = acc * mul;
    }
}

// Causal (optionally sliding-window) GQA attention over the f32 cache. One
// block per (query row, head): scores for every visible key in shared memory,
// softmax, then the weighted sum of values. The simple form; a split-K
// flash-decoding kernel replaces it for long contexts.
extern "C" __global__ void attention(const float* q, const float* keys, const float* values, float* out,
                                     const int* step, int num_heads, int num_kv_heads, int head_dim, int window,
                                     float scale) {
    extern __shared__ float scores[];
    int t = blockIdx.x / num_heads, h = blockIdx.x % num_heads;
    int head_off = h / (num_heads / num_kv_heads) * head_dim;
    int pos = step[0] + t;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int n = pos + 1 - first;
    int kv_dim = num_kv_heads * head_dim;
    size_t row_head = (size_t)t * num_heads * head_dim + (size_t)h * head_dim;
    float2 ml = score_keys(q + row_head, keys, first, n, kv_dim, head_off, head_dim, scale, scores);
    weigh_values(scores, values, first, n, kv_dim, head_off, head_dim, 1.0f / ml.y, out + row_head);
}

// ---------------------------------------------------------------------------
// Split-K (flash-decoding) attention for a few query rows over a long cache:
// block (row·head, split) scores its chunk of ATTN_CHUNK keys, keeps its own
// max m and sum l and the unnormalized Σ e^(s−m)·v, and attention_combine
// merges the splits (rescaling each by e^(m_s − M)). The simple kernel above
// gives one block per head, 32 busy SMs for an 8B model at any context length.
// The number of splits is fixed by the caller (a power of two covering the
// keys, so a recorded step stays valid as the cache grows); splits past the
// last key are empty. With one split, `direct` receives the normalized output
// and no combine is needed.
#define ATTN_CHUNK 256
extern "C" __global__ void attention_split(const float* q, const float* keys, const float* values, float* part_o,
                                           float* part_ml, float* direct, const int* step, int num_heads,
                                           int num_kv_heads, int head_dim, int window, float scale, int splits) {
    __shared__ float scores[ATTN_CHUNK];
    int row_head = blockIdx.x, split = blockIdx.y;
    int t = row_head / num_heads, h = row_head % num_heads;
    int head_off = h / (num_heads / num_kv_heads) * head_dim;
    int pos = step[0] + t;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int lo = max(first, split * ATTN_CHUNK), hi = min(pos + 1, (split + 1) * ATTN_CHUNK);
    int n = hi - lo;
    size_t part = (size_t)row_head * splits + split;
    float* o = part_o + part * head_dim;
    if (n <= 0 && !direct) {
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) o[c] = 0.0f;
        if (threadIdx.x == 0) { part_ml[2 * part] = -__int_as_float(0x7f800000); part_ml[2 * part + 1] = 0.0f; }
        return;
    }
    int kv_dim = num_kv_heads * head_dim;
    const float* qh = q + (size_t)row_head * head_dim;
    float2 ml = score_keys(qh, keys, lo, n, kv_dim, head_off, head_dim, scale, scores);
    if (direct) {
        weigh_values(scores, values, lo, n, kv_dim, head_off, head_dim, 1.0f / ml.y, direct + (size_t)row_head * head_dim);
        return;
    }
    weigh_values(scores, values, lo, n, kv_dim, head_off, head_dim, 1.0f, o);
    if (threadIdx.x == 0) { part_ml[2 * part] = ml.x; part_ml[2 * part + 1] = ml.y; }
}

// One block per (row, head): out = Σ_s e^(m_s − M)·o_s / Σ_s e^(m_s − M)·l_s.
extern "C" __global__ void attention_combine(const float* part_o, const float* part_ml, float* out, int head_dim,
                                             int splits) {
    size_t base = (size_t)blockIdx.x * splits;
    float big = -__int_as_float(0x7f800000);
    for (int s = 0; s < splits; s++) big = fmaxf(big, part_ml[2 * (base + s)]);
    float total = 0.0f;
    for (int s = 0; s < splits; s++) {
        float m = part_ml[2 * (base + s)];
        if (m > -__int_as_float(0x7f800000)) total += expf(m - big) * part_ml[2 * (base + s) + 1];
    }
    float inv = 1.0f / total;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < splits; s++) {
            float m = part_ml[2 * (base + s)];
            if (m > -__int_as_float(0x7f800000)) acc += expf(m - big) * part_o[(base + s) * head_dim + c];
        }
        out[(size_t)blockIdx.x * head_dim + c] = acc * inv;
    }
}

// ---------------------------------------------------------------------------
// Elementwise.
extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
extern "C" __global__ void add_assign(float* x, const float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
// x ⊙ sigmoid(gate); gate_cols is x's width or 1 (a per-row scalar).
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, int cols, int gate_cols, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate_cols == cols ? gate[i] : gate[i / cols];
    x[i] *= 1.0f / (1.0f + expf(-g));
}
// dst[r][dst_off + g*len + j] = src[r][g*group + offset + j]: splits and concatenations.
extern "C" __global__ void copy_columns(const float* src, float* dst, int rows, int src_cols, int group, int offset,
                                        int len, int dst_cols, int dst_off) {
    int groups = src_cols / group;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)rows * groups * len) return;
    int j = idx % len;
    int g = (idx / len) % groups;
    int r = idx / ((long)len * groups);
    dst[(size_t)r * dst_cols + dst_off + g * len + j] = src[(size_t)r * src_cols + (size_t)g * group + offset + j];
}
// out[i] = x[idx[i]] (rows) — tokens routed to one expert.
extern "C" __global__ void gather_rows(const float* x, const int* idx, float* out, int cols) {
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(size_t)blockIdx.x * cols + c] = x[(size_t)idx[blockIdx.x] * cols + c];
}
// out[idx[i]] += w[i]·y[i] — one expert's outputs back into the token rows (an
// expert sees each token at most once, so rows never collide within a launch).
extern "C" __global__ void scatter_add_rows(const float* y, const int* idx, const float* w, float* out, int cols) {
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(size_t)idx[blockIdx.x] * cols + c] += w[blockIdx.x] * y[(size_t)blockIdx.x * cols + c];
}

// ---------------------------------------------------------------------------
// Gated DeltaNet. Depthwise causal conv1d + SiLU, one thread per channel,
// walking the rows in order; `window` holds the last kernel-1 inputs
// [kernel-1, channels] and is updated. Weight [channels, kernel].
template <typename T>
__device__ void gdn_conv(const float* x, const T* w, float* window, float* out, int rows, int channels, int kernel) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float hist[8];  // kernel - 1 <= 8
    int h = kernel - 1;
    for (int j = 0; j < h; j++) hist[j] = window[(size_t)j * channels + c];
    for (int t = 0; t < rows; t++) {
        float xt = x[(size_t)t * channels + c];
        float acc = 0.0f;
        for (int j = 0; j < h; j++) acc += to_f32(w[c * kernel + j]) * hist[j];
        acc += to_f32(w[c * kernel + h]) * xt;
        out[(size_t)t * channels + c] = acc / (1.0f + expf(-acc));
        for (int j = 0; j + 1 < h; j++) hist[j] = hist[j + 1];
        if (h > 0) hist[h - 1] = xt;
    }
    for (int j = 0; j < h; j++) window[(size_t)j * channels + c] = hist[j];
}
#define GDN_CONV(NAME, T)                                                                                          \
    extern "C" __global__ void NAME(const float* x, const T* w, float* win, float* out, int rows, int ch, int k) {  \
        gdn_conv(x, w, win, out, rows, ch, k);                                                                     \
    }
GDN_CONV(gdn_conv_bf16, __nv_bfloat16)
GDN_CONV(gdn_conv_f16, __half)
GDN_CONV(gdn_conv_f32, float)

// Per token: q, k L2-normalized per key head (q also ·1/√dk); g and β per value head.
extern "C" __global__ void gdn_prepare(float* q, float* k, const float* a, const float* b, const float* a_log,
                                       const float* dt_bias, float* g, float* beta, int nk, int nv, int dk) {
    int t = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int hh = warp; hh < 2 * nk; hh += warps) {
        float* v = (hh < nk ? q : k) + ((size_t)t * nk + (hh % nk)) * dk;
        float ss = 0.0f;
        for (int c = lane; c < dk; c += 32) ss += v[c] * v[c];
        ss = warp_sum(ss);
        float inv = rsqrtf(ss + 1e-6f) * (hh < nk ? rsqrtf((float)dk) : 1.0f);
        for (int c = lane; c < dk; c += 32) v[c] *= inv;
    }
    for (int h = threadIdx.x; h < nv; h += blockDim.x) {
        size_t i = (size_t)t * nv + h;
        float x = a[i] + dt_bias[h];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(a_log[h]) * sp;
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
}

// The recurrent gated delta rule over `rows` tokens. One block per value head,
// one thread per value column j: the thread owns column S[:, j] of the f32
// state [dk, dv] (kept in global memory; it stays in L1/L2).
extern "C" __global__ void gdn_recurrent(const float* q, const float* k, const float* v, const float* g,
                                         const float* beta, float* state, float* out, int rows, int nk, int nv, int dk,
                                         int dv, int tiled) {
    int h = blockIdx.x, j = threadIdx.x;
    // Value head h reads key head h / (nv/nk) (transformers), or h % nk when
    // the value heads are stored tiled (Qwen3.5 GGUFs).
    int kh = tiled ? h % nk : h / (nv / nk);
    float* s = state + (size_t)h * dk * dv;
    for (int t = 0; t < rows; t++) {
        const float* qt = q + ((size_t)t * nk + kh) * dk;
        const float* kt = k + ((size_t)t * nk + kh) * dk;
        float decay = expf(g[(size_t)t * nv + h]);
        float bt = beta[(size_t)t * nv + h];
        if (j < dv) {
            float mem = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = s[(size_t)i * dv + j] * decay;
                s[(size_t)i * dv + j] = e;
                mem += kt[i] * e;
            }
            float delta = (v[((size_t)t * nv + h) * dv + j] - mem) * bt;
            float o = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = s[(size_t)i * dv + j] + kt[i] * delta;
                s[(size_t)i * dv + j] = e;
                o += qt[i] * e;
            }
            out[((size_t)t * nv + h) * dv + j] = o;
        }
    }
}
