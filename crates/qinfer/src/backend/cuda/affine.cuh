// Affine-quantized weights as the kernels read them: the storage of scales
// and biases (f32, bf16, GGUF super-block records), the levels of a 32-value
// chunk, their dot products with x, and the CUDA-core affine GEMV that the
// decode path (affine_gemv.cu) and the routed experts (moe.cu) share.
#pragma once

#include "common.cuh"
#include "gemv.cuh"

// The scale and bias of affine group i (row·groups + group) of a weight.
// f32 and bf16 ones are stored per group (formats `affine{B}`,
// `affine{B}_bf16`). GGUF's Q4_K and Q5_K (`affine{B}_k`, groups of 32) keep
// one 16-byte record per 256 values of a row, its 8 groups': f16 d and dmin,
// then per group j the byte sc_j | (m_j >> 4) << 6 and the low 4 bits of m_j
// as nibbles (group 2i's low). The scale d·sc_j and the bias −(dmin·m_j) are
// the f32 products ggml's decoder forms (formats/gguf/as_affine.rs
// `superblock_records`): 4.5 bits a value with the levels, against 6 with
// f32 scales and biases. Q6_K and Q3_K (`affine6_k`, `affine3_k`, groups of
// 16) keep 18 bytes per 256 values, as a Q6_K file does: f16 d, then the 16
// groups' signed scales; group j's scale is d·sc_j and its bias −K·d·sc_j
// (K = 32, 4; 6.56 bits a Q6_K value, against 10). Q2_K (`affine2_k`) keeps
// 20, as its file: f16 d and dmin, then the bytes sc_j | m_j << 4; scale
// d·sc_j, bias −(dmin·m_j). The bias pointer is not read.
struct alignas(16) KScales {
    unsigned char b[16];
};
template <int K>
struct alignas(2) SignedScales {
    unsigned char b[18];
};
using K6Scales = SignedScales<32>;
using K3Scales = SignedScales<4>;
struct alignas(4) K2Scales {
    unsigned char b[20];
};
// (Read-only loads, as the kernels' __restrict__ pointers made them.)
__device__ __forceinline__ float affine_scale(const float* s, size_t i) { return __ldg(s + i); }
__device__ __forceinline__ float affine_scale(const __nv_bfloat16* s, size_t i) { return __bfloat162float(__ldg(s + i)); }
__device__ __forceinline__ float affine_bias(const float*, const float* b, size_t i) { return __ldg(b + i); }
__device__ __forceinline__ float affine_bias(const __nv_bfloat16*, const __nv_bfloat16* b, size_t i) {
    return __bfloat162float(__ldg(b + i));
}
// Group j (0-7) of one record (in global or shared memory).
__device__ __forceinline__ float kscales_scale(const unsigned char* r, int j) {
    return __half2float(*reinterpret_cast<const __half*>(r)) * (float)(r[4 + j] & 63);
}
__device__ __forceinline__ float kscales_bias(const unsigned char* r, int j) {
    int m = ((r[4 + j] >> 6) << 4) | ((r[12 + (j >> 1)] >> (4 * (j & 1))) & 15);
    return -(__half2float(*reinterpret_cast<const __half*>(r + 2)) * (float)m);
}
__device__ __forceinline__ float affine_scale(const KScales* s, size_t i) { return kscales_scale(s[i >> 3].b, i & 7); }
__device__ __forceinline__ float affine_bias(const KScales* s, const KScales*, size_t i) {
    return kscales_bias(s[i >> 3].b, i & 7);
}
// An f16 at byte `at` of a record (2-byte aligned).
__device__ __forceinline__ float record_half(const unsigned char* r, int at) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(r + at))));
}
template <int K>
__device__ __forceinline__ float affine_scale(const SignedScales<K>* s, size_t i) {
    const unsigned char* r = s[i >> 4].b;
    return record_half(r, 0) * (float)(signed char)__ldg(r + 2 + (i & 15));
}
template <int K>
__device__ __forceinline__ float affine_bias(const SignedScales<K>* s, const SignedScales<K>*, size_t i) {
    return -(float)K * affine_scale(s, i);
}
__device__ __forceinline__ float affine_scale(const K2Scales* s, size_t i) {
    const unsigned char* r = s[i >> 4].b;
    return record_half(r, 0) * (float)(__ldg(r + 4 + (i & 15)) & 15);
}
__device__ __forceinline__ float affine_bias(const K2Scales* s, const K2Scales*, size_t i) {
    const unsigned char* r = s[i >> 4].b;
    return -(record_half(r, 2) * (float)(__ldg(r + 4 + (i & 15)) >> 4));
}
// The start of row `row`'s scales (or biases) among `groups` a row.
template <typename S>
__device__ __forceinline__ const S* affine_row_side(const S* base, size_t row, size_t groups) {
    return base + row * groups;
}
__device__ __forceinline__ const KScales* affine_row_side(const KScales* base, size_t row, size_t groups) {
    return base + row * (groups / 8);
}
template <int K>
__device__ __forceinline__ const SignedScales<K>* affine_row_side(const SignedScales<K>* base, size_t row,
                                                                  size_t groups) {
    return base + row * (groups / 16);
}
__device__ __forceinline__ const K2Scales* affine_row_side(const K2Scales* base, size_t row, size_t groups) {
    return base + row * (groups / 16);
}

// ---------------------------------------------------------------------------
// Affine-quantized weights (MLX layout): each row is a bit stream of BITS-bit
// levels in u32 words, low bits first; every run of 32 values fills exactly
// BITS words, and w = scale·q + bias per group of `group` values (scales and
// biases as f32 [rows, cols/group]). Groups are 16 values (ggml's K-quant
// sub-blocks, see formats/gguf/as_affine.rs) or a multiple of 32: a 32-value
// chunk lies in one group, or in two of 16 (`halves`).

// Level k (0..31) of a 32-value chunk held in BITS words.
template <int BITS>
__device__ __forceinline__ float affine_level(const unsigned* words, int k) {
    int bit = k * BITS, wi = bit >> 5, sh = bit & 31;
    unsigned v = words[wi] >> sh;
    if (sh + BITS > 32) v |= words[wi + 1] << (32 - sh);
    // 2^23 + level as float bits, minus 2^23: exact, and on the FP32 pipe
    // instead of the much narrower integer-to-float conversion.
    return __uint_as_float(0x4B000000u | (v & ((1u << BITS) - 1))) - 8388608.0f;
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
    } else if (BITS % 2 == 0) {
        // 2 and 6 bits: 8-byte loads (a chunk starts at an even word), half
        // the load instructions of word loads.
#pragma unroll
        for (int i = 0; i < BITS / 2; i++) {
            uint2 v = __ldcs(reinterpret_cast<const uint2*>(p) + i);
            words[2 * i] = v.x; words[2 * i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < BITS; i++) words[i] = __ldcs(p + i);
    }
}

// Decode GEMV, laid out as the float GEMV above: a block computes ROWS output
// rows, its threads striding over the rows' 32-value chunks together, each
// thread taking the same chunks of all ROWS rows (one read of x for ROWS rows),
// two chunks per row in flight. Per chunk and row it forms d = Σ q·x over the
// chunk's levels and adds s·d + b·Σx: two FMAs per chunk instead of a
// dequantizing FMA per value. (The two terms partly cancel when b ≈ −s·2^(bits−1);
// in f32 that costs a few of 24 bits, far below the bf16 weights' own error.)
//
// Levels of 2-, 4- and 8-bit weights are read without shifting: masked in
// place and ORed into the mantissa of 2^23, which gives 2^23 + q·2^p exactly
// for a level at bit p ≤ 23 − BITS (levels higher in the word come from its
// top half, p − 16). Subtracting 2^23 leaves q·2^p, and the chunk's x values
// are pre-scaled by 2^−p, so one LOP3, one FADD and one FFMA per level and row.
__host__ __device__ constexpr int affine_bitpos(int bits, int k) { return (k * bits) & 31; }
__host__ __device__ constexpr bool affine_from_top(int bits, int k) { return affine_bitpos(bits, k) + bits > 23; }
__host__ __device__ constexpr int affine_shift(int bits, int k) {
    return affine_from_top(bits, k) ? affine_bitpos(bits, k) - 16 : affine_bitpos(bits, k);
}

template <int BITS>
__device__ __forceinline__ float affine_level_scaled(const unsigned* words, const unsigned* tops, int k) {
    constexpr unsigned mask = (1u << BITS) - 1;
    unsigned src = affine_from_top(BITS, k) ? tops[(k * BITS) >> 5] : words[(k * BITS) >> 5];
    return __uint_as_float((src & (mask << affine_shift(BITS, k))) | 0x4B000000u) - 8388608.0f;
}

// Word-aligned levels share one of few offsets p (a multiple of BITS): their
// products q·2^p·x are summed per offset and scaled by 2^−p once per chunk.
template <int BITS>
__host__ __device__ constexpr int affine_offsets() { return 32 % BITS == 0 ? (23 - BITS) / BITS + 1 : 4; }

// Σ q·x over levels [K0, K1) of one 32-value chunk of levels (`words`) and
// x values `xv`.
template <int BITS, int K0 = 0, int K1 = 32>
__device__ __forceinline__ float affine_dot32(const unsigned (&words)[BITS], const float (&xv)[32]) {
    constexpr bool aligned = 32 % BITS == 0;
    constexpr int parts = affine_offsets<BITS>();
    unsigned tops[BITS];
#pragma unroll
    for (int i = 0; i < BITS; i++) tops[i] = words[i] >> 16;
    float d[parts];
#pragma unroll
    for (int p = 0; p < parts; p++) d[p] = 0.0f;
#pragma unroll
    for (int k = K0; k < K1; k++) {
        if (aligned) {
            d[affine_shift(BITS, k) / BITS] += affine_level_scaled<BITS>(words, tops, k) * xv[k];
        } else {
            d[k & 3] += affine_level<BITS>(words, k) * xv[k];
        }
    }
    float dot = 0.0f;
#pragma unroll
    for (int p = 0; p < parts; p++) dot += aligned ? d[p] * __uint_as_float((unsigned)(127 - p * BITS) << 23) : d[p];
    return dot;
}

// With HALVES (groups of 16) sc/bi apply to the chunk's first 16 values
// and sc2/bi2 to the rest.
template <int BITS, int ROWS, int ACT, bool HALVES>
__device__ __forceinline__ void affine_chunk_dot(const unsigned (&words)[ROWS][BITS], const float (&sc)[ROWS],
                                                 const float (&bi)[ROWS], const float (&sc2)[ROWS],
                                                 const float (&bi2)[ROWS], const float* __restrict__ x, int c,
                                                 int in_dim, int n_act, float (&acc)[ROWS][ACT]) {
#pragma unroll
    for (int t = 0; t < ACT; t++) {
        if (t < n_act) {
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + c);
            float xv[32], sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float4 v = xr[j];
                xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
                sum[0] += v.x; sum[1] += v.y; sum[2] += v.z; sum[3] += v.w;
            }
            if constexpr (HALVES) {
                float lo = 0.0f, hi = 0.0f;
#pragma unroll
                for (int k = 0; k < 16; k++) lo += xv[k], hi += xv[16 + k];
#pragma unroll
                for (int r = 0; r < ROWS; r++)
                    acc[r][t] += sc[r] * affine_dot32<BITS, 0, 16>(words[r], xv) + bi[r] * lo +
                                 sc2[r] * affine_dot32<BITS, 16, 32>(words[r], xv) + bi2[r] * hi;
                continue;
            }
            float sx = (sum[0] + sum[1]) + (sum[2] + sum[3]);
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r][t] += sc[r] * affine_dot32<BITS>(words[r], xv) + bi[r] * sx;
        }
    }
}

#define AFFINE_UNROLL 2

template <typename S, int BITS, int ROWS, int ACT, bool HALVES = false>
__device__ void gemv_affine(const unsigned* __restrict__ w, const S* __restrict__ scales,
                            const S* __restrict__ biases, const float* __restrict__ x,
                            const float* bias, float* y, int out_dim, int in_dim,
                            int group, int n_act) {
    int row0 = blockIdx.x * ROWS;
    int chunks = in_dim / 32, groups = in_dim / group;
    int rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) rows[r] = min(row0 + r, out_dim - 1);
    float acc[ROWS][ACT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) acc[r][t] = 0.0f;
    int stride = blockDim.x;
    for (int i0 = threadIdx.x; i0 < chunks; i0 += AFFINE_UNROLL * stride) {
        unsigned words[AFFINE_UNROLL][ROWS][BITS];
        float sc[AFFINE_UNROLL][ROWS], bi[AFFINE_UNROLL][ROWS], sc2[AFFINE_UNROLL][ROWS], bi2[AFFINE_UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < AFFINE_UNROLL; u++) {
            int i = min(i0 + u * stride, chunks - 1), g = i * 32 / group;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                affine_chunk<BITS>(w + (size_t)rows[r] * chunks * BITS, i, words[u][r]);
                sc[u][r] = affine_scale(scales, (size_t)rows[r] * groups + g);
                bi[u][r] = affine_bias(scales, biases, (size_t)rows[r] * groups + g);
                if constexpr (HALVES) {
                    sc2[u][r] = affine_scale(scales, (size_t)rows[r] * groups + g + 1);
                    bi2[u][r] = affine_bias(scales, biases, (size_t)rows[r] * groups + g + 1);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < AFFINE_UNROLL; u++) {
            int i = i0 + u * stride;
            if (i < chunks)
                affine_chunk_dot<BITS, ROWS, ACT, HALVES>(words[u], sc[u], bi[u], sc2[u], bi2[u], x, i * 32, in_dim,
                                                          n_act, acc);
        }
    }
    gemv_store<ROWS, ACT>(acc, bias, y, row0, out_dim, n_act);
}

// The tensor-core GEMMs (affine_gemm.cu, affine_gemm4.cu, moe_gemm.cu): d += a·b,
// a 16×16 bf16 A fragment, a 16×8 bf16 B fragment, f32 sums.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Their sum v of activation row a and output o ([n_act, out_dim], skipped
// past either): with `part`, into this split's partial sums
// (part[blockIdx.z]), which affine_gemm_reduce adds with the bias; else
// plus the bias, onto y with `accumulate`, into y.
__device__ __forceinline__ void agemm_store(float v, int a, int o, int n_act, int out_dim, const float* bias, float* y,
                                            float* part, int accumulate) {
    if (a >= n_act || o >= out_dim) return;
    size_t at = (size_t)a * out_dim + o;
    if (part) {
        part[(size_t)blockIdx.z * n_act * out_dim + at] = v;
    } else {
        if (bias) v += bias[o];
        if (accumulate) v += y[at];
        y[at] = v;
    }
}

// Every affine bit width qinfer reads (affine::SUPPORTED_BITS).
#define FOR_AFFINE_BITS(M) M(2) M(3) M(4) M(5) M(6) M(8)
