// ---------------------------------------------------------------------------
// Affine-quantized GEMM on the tensor cores, for the decode rows of a batch
// (more activation rows than the GEMVs take, up to AGEMM's row limit on the
// host side).
//
// Why: past the GEMVs' rows, affine weights were dequantized whole to a bf16
// copy that cuBLAS then multiplied: 4.5 bytes of traffic a 4-bit weight
// (levels read, bf16 written, bf16 read again) where its levels are 0.5. Here
// each lane dequantizes its levels in registers straight into the A fragments
// of mma.m16n8k16 (bf16 × bf16, f32 sums): the levels are read once per block
// of activation rows, and nothing is written but the outputs.
//
// Numbers: those of the prefill path it replaces. Each weight s·q + b is
// formed in f32 and rounded to bf16, each activation is rounded to bf16 (the
// caller narrows x), and the products are summed in f32.
//
// Layout: a block takes AGEMM_WARPS·16 weight rows (an m16 tile a warp), 8·NT
// activation rows (NT n8 tiles) and a range of 64-column units: the whole row,
// or one split of it when the grid would not fill the device (each split then
// writes its sums to `part`, and affine_gemm_reduce adds them in order). Each
// unit's levels (BITS·8 bytes a weight row) and its activations (128 bytes a
// row, 16-byte chunks swizzled by row so that the fragment reads hit distinct
// banks) come into a ring of AGEMM_STAGES stages with cp.async.
//
// Lane (g, c) takes columns 16c..16c+15 of each unit for its tile's rows g
// and g+8. The dot product does not care in which order k is summed, so
// k-step s (of 4) of the MMA puts columns 16c+4s and 16c+4s+1 where the
// fragment layout has columns 2c and 2c+1, and 16c+4s+2, 16c+4s+3 where it
// has 2c+8 and 2c+9; the activations' B fragments follow the same order. A
// lane thus reads 2·BITS contiguous bytes of levels a row (any bit width, the
// row's bit stream read as it lies) and 32 contiguous bytes of each
// activation row, and its 16 columns lie in one scale group (groups are
// multiples of 16): one scale and one bias a row and unit.

#include "affine.cuh"
#include "common.cuh"
#include "constants.cuh"

// AGEMM_WARPS and AGEMM_STAGES come from constants.cuh.
#define AGEMM_ROWS (AGEMM_WARPS * 16)

// Words of a lane's 16 levels (16·BITS bits).
template <int BITS>
__host__ __device__ constexpr int agemm_words() { return (BITS + 1) / 2; }

// A lane's 16 levels from the 2·BITS bytes at p (of a stage row), level j at
// bit j·BITS of the words. Even widths start at a multiple of 4 bytes, odd
// ones (3 and 5 bits) at a multiple of 2.
template <int BITS>
__device__ __forceinline__ void agemm_lane_levels(const unsigned char* p, unsigned (&lw)[agemm_words<BITS>()]) {
    if constexpr (BITS % 2 == 0) {
        const unsigned* q = reinterpret_cast<const unsigned*>(p);
#pragma unroll
        for (int i = 0; i < BITS / 2; i++) lw[i] = q[i];
    } else {
        const unsigned short* q = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
        for (int i = 0; i < agemm_words<BITS>(); i++) {
            unsigned hi = 2 * i + 1 < BITS ? (unsigned)q[2 * i + 1] : 0u;
            lw[i] = (unsigned)q[2 * i] | (hi << 16);
        }
    }
}

// Level j of a lane's 16, as an exact float (2^23 + q as float bits, minus 2^23).
template <int BITS>
__device__ __forceinline__ float agemm_level(const unsigned (&lw)[agemm_words<BITS>()], int j) {
    int bit = j * BITS, wi = bit >> 5, sh = bit & 31;
    unsigned v = lw[wi] >> sh;
    if (sh + BITS > 32) v |= lw[wi + 1] << (32 - sh);
    return __uint_as_float(0x4B000000u | (v & ((1u << BITS) - 1))) - 8388608.0f;
}

// Levels j and j+1 of a row, dequantized and rounded to a bf16 pair (j low).
template <int BITS>
__device__ __forceinline__ unsigned agemm_pair(const unsigned (&lw)[agemm_words<BITS>()], int j, float s, float b) {
    __nv_bfloat162 two = __floats2bfloat162_rn(fmaf(s, agemm_level<BITS>(lw, j), b),
                                               fmaf(s, agemm_level<BITS>(lw, j + 1), b));
    return *reinterpret_cast<unsigned*>(&two);
}

// Bytes of one stage: the block's weight rows' levels of a unit, then the
// activation rows' bf16 values of it.
template <int BITS, int ACT>
__host__ __device__ constexpr int agemm_stage_bytes() { return AGEMM_ROWS * BITS * 8 + ACT * 128; }

// Unit u of the block's weight rows (row0.., clamped to the weight's last)
// and activation rows (act0.., clamped to the last) into `stage`.
template <int BITS, int ACT>
__device__ __forceinline__ void agemm_load(unsigned char* stage, const unsigned char* __restrict__ w,
                                           size_t row_bytes, int row0, int out_dim,
                                           const __nv_bfloat16* __restrict__ x, int in_dim, int act0, int n_act,
                                           int u) {
    for (int p = threadIdx.x; p < AGEMM_ROWS * BITS; p += AGEMM_WARPS * 32) {
        int r = p / BITS, k = p % BITS;
        int row = min(row0 + r, out_dim - 1);
        cp_async<8>(stage + r * BITS * 8 + k * 8, w + (size_t)row * row_bytes + (size_t)u * BITS * 8 + k * 8, true);
    }
    unsigned char* xs = stage + AGEMM_ROWS * BITS * 8;
    for (int p = threadIdx.x; p < ACT * 8; p += AGEMM_WARPS * 32) {
        int r = p >> 3, k = p & 7;
        int a = min(act0 + r, n_act - 1);
        cp_async<16>(xs + r * 128 + ((k ^ (r & 7)) << 4), x + (size_t)a * in_dim + u * 64 + k * 8, true);
    }
}

// y[n_act, out_dim] (=, or += with `accumulate`) x·wᵀ + bias, or with `part`
// this split's sums into part[blockIdx.z]. x is bf16 [n_act, in_dim]; in_dim
// a multiple of 64; each split `per_split` units.
template <typename S, int BITS, int NT>
__device__ void affine_gemm_mma(const unsigned char* __restrict__ w, const S* __restrict__ scales,
                                const S* __restrict__ biases, const __nv_bfloat16* __restrict__ x,
                                const float* __restrict__ bias, float* y, float* part, int out_dim, int in_dim,
                                int group, int n_act, int per_split, int accumulate) {
    constexpr int ACT = 8 * NT;
    constexpr int STAGE = agemm_stage_bytes<BITS, ACT>();
    extern __shared__ __align__(16) unsigned char agemm_shared[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    int row0 = blockIdx.x * AGEMM_ROWS, act0 = blockIdx.y * ACT;
    int units = in_dim / 64;
    int u0 = blockIdx.z * per_split, u1 = min(units, u0 + per_split);
    size_t row_bytes = (size_t)in_dim * BITS / 8;
    size_t groups = in_dim / group;
    // The lane's two rows (clamped as the stages are: rows past the weight's
    // are computed and not stored).
    size_t ra = min(row0 + warp * 16 + g, out_dim - 1), rb = min(row0 + warp * 16 + g + 8, out_dim - 1);
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < AGEMM_STAGES - 1; s++) {
        if (u0 + s < u1)
            agemm_load<BITS, ACT>(agemm_shared + s * STAGE, w, row_bytes, row0, out_dim, x, in_dim, act0, n_act,
                                  u0 + s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int u = u0; u < u1; u++) {
        int i = u - u0;
        // This unit's scales and biases (global loads, issued before the wait).
        size_t gi = (size_t)(u * 64 + 16 * c) / group;
        float sa = affine_scale(scales, ra * groups + gi), ba = affine_bias(scales, biases, ra * groups + gi);
        float sb = affine_scale(scales, rb * groups + gi), bb = affine_bias(scales, biases, rb * groups + gi);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AGEMM_STAGES - 2));
        // Every warp is done with the stage the next load overwrites.
        __syncthreads();
        int ahead = u + AGEMM_STAGES - 1;
        if (ahead < u1)
            agemm_load<BITS, ACT>(agemm_shared + ((i + AGEMM_STAGES - 1) % AGEMM_STAGES) * STAGE, w, row_bytes, row0,
                                  out_dim, x, in_dim, act0, n_act, ahead);
        asm volatile("cp.async.commit_group;\n" ::);
        const unsigned char* st = agemm_shared + (i % AGEMM_STAGES) * STAGE;
        unsigned la[agemm_words<BITS>()], lb[agemm_words<BITS>()];
        agemm_lane_levels<BITS>(st + (warp * 16 + g) * BITS * 8 + 2 * BITS * c, la);
        agemm_lane_levels<BITS>(st + (warp * 16 + g + 8) * BITS * 8 + 2 * BITS * c, lb);
        const unsigned char* xs = st + AGEMM_ROWS * BITS * 8;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            // Columns 16c+8h..16c+8h+7 of activation row 8t+g (whose row & 7 is g).
            uint4 bf[NT];
#pragma unroll
            for (int t = 0; t < NT; t++)
                bf[t] = *reinterpret_cast<const uint4*>(xs + (8 * t + g) * 128 + (((2 * c + h) ^ g) << 4));
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int j = 8 * h + 4 * e;  // levels j..j+3: k-step 2h+e
                unsigned a0 = agemm_pair<BITS>(la, j, sa, ba), a1 = agemm_pair<BITS>(lb, j, sb, bb);
                unsigned a2 = agemm_pair<BITS>(la, j + 2, sa, ba), a3 = agemm_pair<BITS>(lb, j + 2, sb, bb);
#pragma unroll
                for (int t = 0; t < NT; t++)
                    mma_bf16_16816(acc[t], a0, a1, a2, a3, e ? bf[t].z : bf[t].x, e ? bf[t].w : bf[t].y);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // Sum (t, i): weight row g + 8·(i / 2) of the warp's tile, activation
    // row 8t + 2c + i % 2.
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            agemm_store(acc[t][i], act0 + 8 * t + 2 * c + (i & 1), row0 + warp * 16 + g + 8 * (i >> 1), n_act,
                        out_dim, bias, y, part, accumulate);
    }
}

// The splits' sums in order, plus the bias, into (or onto) y.
extern "C" __global__ void affine_gemm_reduce(const float* __restrict__ part, const float* __restrict__ bias,
                                              float* y, int splits, int n_act, int out_dim, int accumulate) {
    grid_dependency_wait();
    size_t n = (size_t)n_act * out_dim, i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = 0.0f;
    for (int z = 0; z < splits; z++) v += part[(size_t)z * n + i];
    if (bias) v += bias[i % out_dim];
    if (accumulate) v += y[i];
    y[i] = v;
}

// Per format and bit width, one kernel per activation tile of 16, 32 and 64
// rows: `gemm_{format}_mma_a{8·NT}`. Shared memory: AGEMM_STAGES stages
// (Rust: `affine_gemm_shared`).
#define AFFINE_GEMM_NT(F, S, B, NT)                                                                                \
    extern "C" __global__ void __launch_bounds__(AGEMM_WARPS * 32)                                                 \
        gemm_##F##_mma_a##NT(const unsigned char* w, const S* s, const S* bi, const __nv_bfloat16* x,             \
                             const float* b, float* y, float* part, int o, int i, int g, int n, int per_split,     \
                             int acc) {                                                                            \
        grid_dependency_wait();                                                                                    \
        affine_gemm_mma<S, B, NT / 8>(w, s, bi, x, b, y, part, o, i, g, n, per_split, acc);                        \
    }
#define AFFINE_GEMM(F, S, B) AFFINE_GEMM_NT(F, S, B, 16) AFFINE_GEMM_NT(F, S, B, 32) AFFINE_GEMM_NT(F, S, B, 64)
#define AFFINE_GEMM_FORMATS(B)                 \
    AFFINE_GEMM(affine##B, float, B)           \
    AFFINE_GEMM(affine##B##_bf16, __nv_bfloat16, B)
FOR_AFFINE_BITS(AFFINE_GEMM_FORMATS)
// GGUF's super-block records: Q4_K and Q5_K (groups of 32), Q2_K, Q3_K and
// Q6_K (groups of 16).
AFFINE_GEMM(affine4_k, KScales, 4)
AFFINE_GEMM(affine5_k, KScales, 5)
AFFINE_GEMM(affine2_k, K2Scales, 2)
AFFINE_GEMM(affine3_k, K3Scales, 3)
AFFINE_GEMM(affine6_k, K6Scales, 6)
