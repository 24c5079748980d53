// ---------------------------------------------------------------------------
// Grouped expert GEMM for MoE prefill (moe_prefill.rs): one launch computes
// y[r] = x[r] · W_eᵀ for every row r of the entries sorted by expert, each
// block one (segment tile of up to 64 rows of one expert, 128 outputs).
//
// Why: a prefill of a few hundred tokens gives each of 128 experts a few
// dozen rows; one cuBLAS GEMM per expert and projection was ~18k launches a
// 30B-A3B forward, and affine experts were first dequantized to a bf16 copy
// (written and read back: 1.2 GB a layer). Here affine experts are
// dequantized straight into shared memory, a 32-value chunk per thread, and
// each expert's weights are read once per 64 of its rows. Larger batches
// keep cuBLAS (its GEMMs are faster than this kernel once a segment holds
// a hundred rows or more; moe_prefill.rs has the measured bound).
//
// Tiles: 64 rows × 128 outputs × 64 k a stage, 4 warps of 32 × 64 outputs,
// mma.sync m16n8k16 (bf16 or f16 in, f32 sums) from ldmatrix fragments.
// Global loads of the next stage are issued into registers before the
// current stage's MMAs and stored (dequantized) after them: one barrier a
// stage over two shared buffers (54 KiB, dynamic). A block waits about one
// memory latency a stage: at 32 deep the 30B-A3B's gate GEMM at 512 tokens
// took 127 µs for 12.9 GFLOP (ncu, run 98, about 100 TFLOP/s); 64 deep
// measured the same within noise in the model's prefill (run 99), as did
// 4 blocks an SM at 128 registers, and asking L2 for the x rows and weights
// 3 stages ahead lost 9% (run 102). A deeper cp.async ring is what is left
// to try. Split activations (x = hi + lo, see f32_split_*) run the k loop
// once per part into the same sums.

#include "affine.cuh"
#include "common.cuh"
#include "constants.cuh"

// MG_BM comes from constants.cuh.
// MG_BN comes from constants.cuh.
// MG_BK comes from constants.cuh.
// Shared rows padded to 72 values (144 bytes): the 8 rows an ldmatrix reads
// start in 8 different 4-bank groups.
#define MG_LD (MG_BK + 8)
// Dynamic shared memory of a block: two stages of the A and B tiles.
// MG_SHARED comes from constants.cuh.
static_assert(MG_SHARED == 2 * (MG_BM + MG_BN) * MG_LD * 2, "two stages of A and B tiles");

template <typename T>
__device__ __forceinline__ void mg_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mg_mma<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                      unsigned b1) {
    mma_bf16_16816(d, a[0], a[1], a[2], a[3], b0, b1);
}
// The f16 form (affine.cuh has the bf16 one only).
template <>
__device__ __forceinline__ void mg_mma<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mg_ldmatrix(unsigned (&r)[4], const void* p) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Float experts (bf16 or f16 [n, k] matrices): a stage of the B tile is 128
// rows of 64 values, eight 16-byte pieces a thread.
template <typename T>
struct MgFloatExperts {
    using Elem = T;
    const unsigned long long* w;
    uint4 held[8];
    __device__ void load(int e, int n0, int n, int k, int k0) {
        const T* base = reinterpret_cast<const T*>(w[e]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int piece = threadIdx.x + i * 128, row = n0 + (piece >> 3);
            held[i] = row < n ? *reinterpret_cast<const uint4*>(base + (size_t)row * k + k0 + (piece & 7) * 8)
                              : make_uint4(0, 0, 0, 0);
        }
    }
    __device__ void store(T* tile) const {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int piece = threadIdx.x + i * 128;
            *reinterpret_cast<uint4*>(tile + (piece >> 3) * MG_LD + (piece & 7) * 8) = held[i];
        }
    }
};

// Affine experts (any bit width, scales as stored): thread t holds row t's
// two 32-value chunks of the stage (their BITS words each and each chunk's
// one or two groups' scale and bias) and writes them dequantized to bf16,
// 128 bytes.
template <typename S, int BITS>
struct MgAffineExperts {
    using Elem = __nv_bfloat16;
    const unsigned long long* w;
    const unsigned long long* scales;
    const unsigned long long* biases;
    int group;
    unsigned words[2][BITS];
    float sb[2][4];  // per chunk: scale and bias of its first 16 values, then of its second 16
    __device__ void load(int e, int n0, int n, int k, int k0) {
        int row = min(n0 + (int)threadIdx.x, n - 1);  // rows past n are computed and never stored
        int chunks = k / 32, groups = k / group;
        const unsigned* levels = reinterpret_cast<const unsigned*>(w[e]) + (size_t)row * chunks * BITS;
        const S* sc = reinterpret_cast<const S*>(scales[e]);
        const S* bi = reinterpret_cast<const S*>(biases[e]);
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int at = k0 + 32 * c;
            affine_chunk<BITS>(levels, at / 32, words[c]);
            size_t g = (size_t)row * groups + at / group, g2 = group == 16 ? g + 1 : g;
            sb[c][0] = affine_scale(sc, g);
            sb[c][1] = affine_bias(sc, bi, g);
            sb[c][2] = affine_scale(sc, g2);
            sb[c][3] = affine_bias(sc, bi, g2);
        }
    }
    __device__ void store(__nv_bfloat16* tile) const {
        uint4* dst = reinterpret_cast<uint4*>(tile + threadIdx.x * MG_LD);
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int p = 0; p < 4; p++) {
                unsigned packed[4];
                // values 16..31 of a chunk from its second group of 16
                float s = sb[c][p < 2 ? 0 : 2], b = sb[c][p < 2 ? 1 : 3];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    __nv_bfloat162 two = __floats2bfloat162_rn(s * affine_level<BITS>(words[c], 8 * p + 2 * q) + b,
                                                               s * affine_level<BITS>(words[c], 8 * p + 2 * q + 1) + b);
                    packed[q] = *reinterpret_cast<unsigned*>(&two);
                }
                dst[4 * c + p] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
    }
};

// Called after grid_dependency_wait (the tiles and x are activations).
// tiles[blockIdx.x] = (expert, first row, end row) of a segment tile, for
// blocks below n_tiles (moe_offsets writes both on the device; the grid is
// an upper bound); the block's outputs are blockIdx.y·128 onwards. x: one
// or two inputs (hi, and lo or null) of [rows, k] values; y: [rows, n] f32.
template <typename Experts>
__device__ void moe_gemm(Experts experts, const int4* tiles, const int* n_tiles, const typename Experts::Elem* x_hi,
                         const typename Experts::Elem* x_lo, float* y, int n, int k) {
    using T = typename Experts::Elem;
    extern __shared__ uint4 mg_shared[];
    T(*a_tile)[MG_BM * MG_LD] = reinterpret_cast<T(*)[MG_BM * MG_LD]>(mg_shared);
    T(*b_tile)[MG_BN * MG_LD] = reinterpret_cast<T(*)[MG_BN * MG_LD]>(a_tile + 2);
    if ((int)blockIdx.x >= *n_tiles) return;
    int4 tile = tiles[blockIdx.x];
    int e = tile.x, row0 = tile.y, row_end = tile.z, n0 = blockIdx.y * MG_BN;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;  // the warp's 32 × 64 outputs

    int k_stages = k / MG_BK, stages = k_stages * (x_lo ? 2 : 1);
    uint4 a_held[4];
    auto load = [&](int s) {
        const T* x = s < k_stages ? x_hi : x_lo;
        int k0 = (s % k_stages) * MG_BK;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int piece = threadIdx.x + i * 128, r = row0 + (piece >> 3);
            a_held[i] = r < row_end ? *reinterpret_cast<const uint4*>(x + (size_t)r * k + k0 + (piece & 7) * 8)
                                    : make_uint4(0, 0, 0, 0);
        }
        experts.load(e, n0, n, k, k0);
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int piece = threadIdx.x + i * 128;
            *reinterpret_cast<uint4*>(&a_tile[buf][(piece >> 3) * MG_LD + (piece & 7) * 8]) = a_held[i];
        }
        experts.store(b_tile[buf]);
    };

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;

    load(0);
    store(0);
    __syncthreads();
    // ldmatrix lanes: A rows lane & 15 at k + 8·(lane >> 4); B (stored
    // [n][k]) rows (lane & 7) + 8·(lane >> 4) at k + 8·((lane >> 3) & 1).
    int a_row = lane & 15, a_col = (lane >> 4) * 8;
    int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
    for (int s = 0; s < stages; s++) {
        int buf = s & 1;
        if (s + 1 < stages) load(s + 1);
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk += 16) {
            unsigned a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) mg_ldmatrix(a[i], &a_tile[buf][(wm + 16 * i + a_row) * MG_LD + kk + a_col]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                unsigned b[4];
                mg_ldmatrix(b, &b_tile[buf][(wn + 16 * j + b_row) * MG_LD + kk + b_col]);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    mg_mma<T>(acc[i][2 * j], a[i], b[0], b[1]);
                    mg_mma<T>(acc[i][2 * j + 1], a[i], b[2], b[3]);
                }
            }
        }
        if (s + 1 < stages) store(buf ^ 1);
        __syncthreads();
    }

    int g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int col = n0 + wn + 8 * j + c;
            if (col >= n) continue;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = row0 + wm + 16 * i + g + 8 * h;
                if (r < row_end)
                    *reinterpret_cast<float2*>(y + (size_t)r * n + col) =
                        make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            }
        }
}

extern "C" __global__ void __launch_bounds__(128)
    moe_gemm_bf16(const unsigned long long* w, const int4* tiles, const int* n_tiles, const __nv_bfloat16* x_hi,
                  const __nv_bfloat16* x_lo, float* y, int n, int k) {
    grid_dependency_wait();
    moe_gemm(MgFloatExperts<__nv_bfloat16>{w}, tiles, n_tiles, x_hi, x_lo, y, n, k);
}
extern "C" __global__ void __launch_bounds__(128)
    moe_gemm_f16(const unsigned long long* w, const int4* tiles, const int* n_tiles, const __half* x_hi,
                 const __half* x_lo, float* y, int n, int k) {
    grid_dependency_wait();
    moe_gemm(MgFloatExperts<__half>{w}, tiles, n_tiles, x_hi, x_lo, y, n, k);
}
// moe_gemm_{storage}: one per affine storage, as moe_{storage}_to_bf16.
#define MOE_GEMM_AFFINE(F, S, B)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                                              \
        moe_gemm_##F(const unsigned long long* w, const unsigned long long* s, const unsigned long long* bi,       \
                     int group, const int4* tiles, const int* n_tiles, const __nv_bfloat16* x_hi,                  \
                     const __nv_bfloat16* x_lo, float* y, int n, int k) {                                          \
        grid_dependency_wait();                                                                                    \
        MgAffineExperts<S, B> experts;                                                                             \
        experts.w = w;                                                                                             \
        experts.scales = s;                                                                                        \
        experts.biases = bi;                                                                                       \
        experts.group = group;                                                                                     \
        moe_gemm(experts, tiles, n_tiles, x_hi, x_lo, y, n, k);                                                    \
    }
#define MOE_GEMM_FORMATS(B) MOE_GEMM_AFFINE(affine##B, float, B) MOE_GEMM_AFFINE(affine##B##_bf16, __nv_bfloat16, B)
FOR_AFFINE_BITS(MOE_GEMM_FORMATS)
MOE_GEMM_AFFINE(affine4_k, KScales, 4)
MOE_GEMM_AFFINE(affine5_k, KScales, 5)
MOE_GEMM_AFFINE(affine2_k, K2Scales, 2)
MOE_GEMM_AFFINE(affine3_k, K3Scales, 3)
MOE_GEMM_AFFINE(affine6_k, K6Scales, 6)
