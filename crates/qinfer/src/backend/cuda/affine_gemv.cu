// The CUDA-core affine GEMVs (decode: any bit width, groups of 16 or more),
// the prefill's bf16 tiles of affine weights (and of experts' weights), and
// embedding rows from an affine table.

#include "affine.cuh"
#include "common.cuh"
#include "constants.cuh"

// One activation row against many weight rows, x held in registers: each
// thread keeps two 32-value chunks of x (with their sums) for the whole block, which walks AFFINE_BLOCK_ROWS weight rows two at
// a time, loading the next two rows' levels while it works on these. No x
// traffic per row, so about three instructions per weight. For in_dim up to
// 64 values per thread × 256 threads.
// AFFINE_BLOCK_ROWS comes from constants.cuh.

template <typename S, int BITS>
__device__ __forceinline__ void affine_load_row(const unsigned* __restrict__ w, const S* __restrict__ scales,
                                                const S* __restrict__ biases, int row, int chunks, int groups,
                                                int group, unsigned (&words)[2][BITS], float (&sc)[2],
                                                float (&bi)[2]) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int i = min((int)threadIdx.x + j * (int)blockDim.x, chunks - 1), g = i * 32 / group;
        affine_chunk<BITS>(w + (size_t)row * chunks * BITS, i, words[j]);
        sc[j] = affine_scale(scales, (size_t)row * groups + g);
        bi[j] = affine_bias(scales, biases, (size_t)row * groups + g);
    }
}

template <int BITS>
__device__ __forceinline__ float affine_row_dot(const unsigned (&words)[2][BITS], const float (&sc)[2],
                                                const float (&bi)[2], const float (&xv)[2][32],
                                                const float (&sx)[2]) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; j++) acc += sc[j] * affine_dot32<BITS>(words[j], xv[j]) + bi[j] * sx[j];
    return acc;
}

template <typename S, int BITS>
__device__ void gemv_affine_rows(const unsigned* __restrict__ w, const S* __restrict__ scales,
                                 const S* __restrict__ biases, const float* __restrict__ x,
                                 const float* bias, float* y, int out_dim, int in_dim,
                                 int group) {
    static_assert(32 % BITS == 0, "word-aligned levels only");
    __shared__ float partial[AFFINE_BLOCK_ROWS][32];
    int chunks = in_dim / 32, groups = in_dim / group;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float xv[2][32], sx[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int i = threadIdx.x + j * blockDim.x;
        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)min(i, chunks - 1) * 32);
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int q = 0; q < 8; q++) {
            float4 v = xr[q];
            if (i >= chunks) v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int m = 0; m < 4; m++) {
                sum[m] += e[m];
                xv[j][4 * q + m] = e[m];
            }
        }
        sx[j] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    }
    int row0 = blockIdx.x * AFFINE_BLOCK_ROWS;
    unsigned words[2][2][BITS];
    float sc[2][2], bi[2][2];
#pragma unroll
    for (int u = 0; u < 2; u++)
        affine_load_row<S, BITS>(w, scales, biases, min(row0 + u, out_dim - 1), chunks, groups, group, words[u],
                                 sc[u], bi[u]);
#pragma unroll
    for (int r = 0; r < AFFINE_BLOCK_ROWS; r += 2) {
        unsigned next[2][2][BITS];
        float nsc[2][2], nbi[2][2];
        if (r + 2 < AFFINE_BLOCK_ROWS) {
#pragma unroll
            for (int u = 0; u < 2; u++)
                affine_load_row<S, BITS>(w, scales, biases, min(row0 + r + 2 + u, out_dim - 1), chunks, groups,
                                         group, next[u], nsc[u], nbi[u]);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float v = warp_sum(affine_row_dot<BITS>(words[u], sc[u], bi[u], xv, sx));
            if (lane == 0) partial[r + u][warp] = v;
        }
        if (r + 2 < AFFINE_BLOCK_ROWS) {
#pragma unroll
            for (int u = 0; u < 2; u++) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
#pragma unroll
                    for (int i = 0; i < BITS; i++) words[u][j][i] = next[u][j][i];
                    sc[u][j] = nsc[u][j];
                    bi[u][j] = nbi[u][j];
                }
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < AFFINE_BLOCK_ROWS) {
        int o = row0 + threadIdx.x;
        float sum = 0.0f;
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) sum += partial[threadIdx.x][k];
        if (o < out_dim) y[o] = sum + (bias ? bias[o] : 0.0f);
    }
}

// Rows [row0, row0 + rows) dequantized to bf16 (prefill: a transient tile for
// cuBLAS, never a resident copy); one thread per 32-value chunk, written as
// four 16-byte stores (2-byte stores made each warp store instruction touch
// 32 sectors for 64 bytes, and the dequantization of an 8B model took ~70 ms).
template <typename S, int BITS>
__device__ void affine_to_bf16(const unsigned* __restrict__ w, const S* __restrict__ scales,
                               const S* __restrict__ biases, __nv_bfloat16* __restrict__ out, int row0, int rows,
                               int in_dim, int group) {
    long chunks = (long)in_dim / 32;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * chunks) return;
    long r = row0 + i / chunks;
    int chunk = i % chunks;
    unsigned words[BITS];
    affine_chunk<BITS>(w + r * chunks * BITS, chunk, words);
    int groups = in_dim / group, g = chunk * 32 / group, g2 = group == 16 ? g + 1 : g;
    float s0 = affine_scale(scales, r * groups + g), b0 = affine_bias(scales, biases, r * groups + g);
    float s1 = affine_scale(scales, r * groups + g2), b1 = affine_bias(scales, biases, r * groups + g2);
    uint4* dst = reinterpret_cast<uint4*>(out + (i / chunks) * in_dim + chunk * 32);
#pragma unroll
    for (int p = 0; p < 4; p++) {
        unsigned packed[4];
        float s = p < 2 ? s0 : s1, b = p < 2 ? b0 : b1;  // values 8p..8p+7: the second 16 from p = 2
#pragma unroll
        for (int k = 0; k < 4; k++) {
            __nv_bfloat162 two = __floats2bfloat162_rn(s * affine_level<BITS>(words, 8 * p + 2 * k) + b,
                                                       s * affine_level<BITS>(words, 8 * p + 2 * k + 1) + b);
            packed[k] = *reinterpret_cast<unsigned*>(&two);
        }
        dst[p] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}

// Expert e0 + blockIdx.y of a layer's (pointer tables of levels, scales and
// biases) dequantized to bf16 at out + blockIdx.y·rows·in_dim, for the
// prefill's per-expert GEMMs (moe_prefill.rs); experts no token chose are
// skipped (counts[e] = 0).
template <typename S, int BITS>
__device__ void moe_affine_to_bf16(const unsigned long long* packed, const unsigned long long* scales,
                                   const unsigned long long* biases, const int* counts, int e0,
                                   __nv_bfloat16* out, int rows, int in_dim, int group) {
    int e = e0 + blockIdx.y;
    if (counts[e] == 0) return;
    affine_to_bf16<S, BITS>(reinterpret_cast<const unsigned*>(packed[e]), reinterpret_cast<const S*>(scales[e]),
                            reinterpret_cast<const S*>(biases[e]), out + (size_t)blockIdx.y * rows * in_dim, 0,
                            rows, in_dim, group);
}

// Embedding rows from an affine table, in f32.
template <typename S, int BITS>
__device__ void embed_affine(const unsigned* __restrict__ w, const S* __restrict__ scales,
                             const S* __restrict__ biases, const unsigned* ids, float* out, int cols, int group) {
    long r = ids[blockIdx.x];
    int chunks = cols / 32, groups = cols / group;
    for (int chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
        unsigned words[BITS];
        affine_chunk<BITS>(w + r * chunks * BITS, chunk, words);
        int g = chunk * 32 / group, g2 = group == 16 ? g + 1 : g;
        float s0 = affine_scale(scales, r * groups + g), b0 = affine_bias(scales, biases, r * groups + g);
        float s1 = affine_scale(scales, r * groups + g2), b1 = affine_bias(scales, biases, r * groups + g2);
        float* dst = out + (size_t)blockIdx.x * cols + chunk * 32;
#pragma unroll
        for (int k = 0; k < 32; k++) dst[k] = (k < 16 ? s0 : s1) * affine_level<BITS>(words, k) + (k < 16 ? b0 : b1);
    }
}

// Every affine kernel twice: scales and biases as f32 (format `affine{B}`) and
// as bf16 (`affine{B}_bf16`, when the checkpoint stores them so: half the
// bytes, and exact).
#define GEMV_AFFINE(F, S, B, R, A)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        gemv_##F##_r##R##a##A(const unsigned* w, const S* s, const S* bi, const float* x, const float* b,          \
                              float* y, int o, int i, int g, int n) {                                              \
        grid_dependency_wait();                                                                                    \
        gemv_affine<S, B, R, (A == 8 ? GEMV_MAX_ROWS : 1)>(w, s, bi, x, b, y, o, i, g, n);                         \
    }
// Groups of 16 (`gemv_{format}_g16_r{R}a{A}`): f32 scales or Q6_K's records
// (the backend widens bf16 ones at upload).
#define GEMV_AFFINE16(F, S, B, R, A)                                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        gemv_##F##_g16_r##R##a##A(const unsigned* w, const S* s, const S* bi, const float* x, const float* b,      \
                                  float* y, int o, int i, int g, int n) {                                          \
        grid_dependency_wait();                                                                                    \
        gemv_affine<S, B, R, (A == 8 ? GEMV_MAX_ROWS : 1), true>(w, s, bi, x, b, y, o, i, g, n);                   \
    }
// The prefill's bf16 tiles and the embedding rows of a format.
#define AFFINE_DEQUANT(F, S, B)                                                                                    \
    extern "C" __global__ void F##_to_bf16(const unsigned* w, const S* s, const S* bi, __nv_bfloat16* out,         \
                                           int r0, int rows, int i, int g) {                                       \
        grid_dependency_wait();                                                                                    \
        affine_to_bf16<S, B>(w, s, bi, out, r0, rows, i, g);                                                       \
    }                                                                                                              \
    extern "C" __global__ void moe_##F##_to_bf16(const unsigned long long* w, const unsigned long long* s,         \
                                                 const unsigned long long* bi, const int* counts, int e0,          \
                                                 __nv_bfloat16* out, int rows, int i, int g) {                     \
        grid_dependency_wait();                                                                                    \
        moe_affine_to_bf16<S, B>(w, s, bi, counts, e0, out, rows, i, g);                                           \
    }                                                                                                              \
    extern "C" __global__ void embed_##F(const unsigned* w, const S* s, const S* bi, const unsigned* ids,          \
                                         float* out, int cols, int g) {                                            \
        grid_dependency_wait();                                                                                    \
        embed_affine<S, B>(w, s, bi, ids, out, cols, g);                                                           \
    }
#define AFFINE_KERNELS(F, S, B)                                                                                    \
    GEMV_AFFINE(F, S, B, 1, 1)                                                                                     \
    GEMV_AFFINE(F, S, B, 2, 1)                                                                                     \
    GEMV_AFFINE(F, S, B, 4, 1)                                                                                     \
    GEMV_AFFINE(F, S, B, 1, 8)                                                                                     \
    GEMV_AFFINE(F, S, B, 2, 8)                                                                                     \
    AFFINE_DEQUANT(F, S, B)
#define AFFINE16_KERNELS(F, S, B)                                                                                  \
    GEMV_AFFINE16(F, S, B, 1, 1)                                                                                   \
    GEMV_AFFINE16(F, S, B, 2, 1)                                                                                   \
    GEMV_AFFINE16(F, S, B, 4, 1)                                                                                   \
    GEMV_AFFINE16(F, S, B, 1, 8)                                                                                   \
    GEMV_AFFINE16(F, S, B, 2, 8)
#define AFFINE_FORMATS(B)                                                                                          \
    AFFINE_KERNELS(affine##B, float, B)                                                                            \
    AFFINE_KERNELS(affine##B##_bf16, __nv_bfloat16, B)                                                             \
    AFFINE16_KERNELS(affine##B, float, B)
FOR_AFFINE_BITS(AFFINE_FORMATS)
// Q4_K and Q5_K's super-block records (groups of 32 only), Q2_K, Q3_K and
// Q6_K's (groups of 16 only).
AFFINE_KERNELS(affine4_k, KScales, 4)
AFFINE_KERNELS(affine5_k, KScales, 5)
#define AFFINE16_RECORDS(F, S, B) AFFINE16_KERNELS(F, S, B) AFFINE_DEQUANT(F, S, B)
AFFINE16_RECORDS(affine2_k, K2Scales, 2)
AFFINE16_RECORDS(affine3_k, K3Scales, 3)
AFFINE16_RECORDS(affine6_k, K6Scales, 6)
#define GEMV_AFFINE_ROWS(F, S, B)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gemv_##F##_rows(const unsigned* w, const S* s, const S* bi,  \
                                                                      const float* x, const float* b, float* y,    \
                                                                      int o, int i, int g) {                       \
        grid_dependency_wait();                                                                                    \
        gemv_affine_rows<S, B>(w, s, bi, x, b, y, o, i, g);                                                        \
    }
GEMV_AFFINE_ROWS(affine2, float, 2)
GEMV_AFFINE_ROWS(affine4, float, 4)
GEMV_AFFINE_ROWS(affine8, float, 8)
GEMV_AFFINE_ROWS(affine2_bf16, __nv_bfloat16, 2)
GEMV_AFFINE_ROWS(affine4_bf16, __nv_bfloat16, 4)
GEMV_AFFINE_ROWS(affine8_bf16, __nv_bfloat16, 8)
GEMV_AFFINE_ROWS(affine4_k, KScales, 4)
