// ---------------------------------------------------------------------------
// The tensor-core affine GEMM for 4-bit levels (affine_gemm.cu's kernel
// takes the other widths), for the decode rows of a batch.
//
// Why a kernel of its own: dequantizing each weight as s·q + b in f32 and
// rounding it to bf16 costs about six instructions a weight, which left the
// general kernel issue-bound near a quarter of HBM speed at 16 rows. Here a
// 4-bit level becomes an MMA operand in half an instruction: one LOP3 on a
// word of 8 levels, (w >> 8e) & 0x000F000F | 0x43004300, makes two bf16
// values 128 + q (exact: bf16 steps by 1 between 128 and 256). The MMA sums
// Σ(128 + q)·x over a span of columns that share one scale and bias, and the
// span's epilogue applies them in f32:
//   Σ(s·q + b)·x = s·Σ(128 + q)·x + (b − 128·s)·Σx,
// with Σx of the span's bf16 activations from the prep kernel below. The
// levels enter the MMA exactly and the scale in f32, so no weight is rounded
// to bf16 (the general kernel and the prefill path round each one); x is
// rounded to bf16 as there, and the sums are f32.
//
// Column order: from word m of a row (columns 8m..8m+7, level i at bits 4i)
// shift 8e gives levels 2e and 2e+4, shift 8e+4 levels 2e+1 and 2e+5. In
// 32-column chunk h of a unit, lane (g, c) takes word 4h + c of its rows g
// and g+8, so that k-step e of the MMA holds, at the fragment's columns 2c,
// 2c+1, 2c+8, 2c+9, columns 2e, 2e+4, 2e+1, 2e+5 of that word: each k-step
// lies in one chunk of 32 columns (one scale group, down to groups of 32).
// The prep kernel writes each 8 columns of x in the order 0 4 1 5 2 6 3 7,
// so a lane's B fragments for both k-steps of a chunk are one 16-byte read.
//
// Layout: a block takes AG4_ROW_WARPS·16 weight rows (an m16 tile a warp)
// and ACT activation rows (every warp all of them), and a range of 64-column units (the
// whole row, or one split when the grid would not fill the device; the
// splits are added by affine_gemm_reduce). A stage is 256 columns: 128
// bytes of each weight row (one line, 16-byte chunks swizzled by row so the
// warps' word reads hit distinct banks), 512 bytes of each activation row
// (16-byte chunks swizzled by row parity, for the same reason), and the
// activation rows' span sums, and each weight row's scales and biases for
// the stage's spans (as the words of global memory that hold them, see
// ag4_side_words); AG4_STAGES of them come in by cp.async, so that the
// scales are as far ahead as the levels they scale.

#include "affine.cuh"
#include "common.cuh"
#include "constants.cuh"

// AG4_ROW_WARPS, AG4_STAGES and AG4_COLS (a stage's columns:
// 4 units of 64, 128 bytes of a row's levels) come from constants.cuh.
#define AG4_ROWS (AG4_ROW_WARPS * 16)
static_assert(AG4_COLS == 256, "a stage is 128 bytes of each row's levels");
// The most spans of one scale (32 columns at least) a stage holds.
#define AG4_SPANS (AG4_COLS / 32)
#define AG4_MAGIC 0x43004300u  // two bf16 128.0

// A block's shape and shared memory for ACT activation rows.
template <int ACT>
struct Ag4 {
    static constexpr int NT = ACT / 8;  // n8 tiles a warp
    static constexpr int THREADS = AG4_ROW_WARPS * 32;
    static constexpr int LEVELS = AG4_ROWS * 128;
    static constexpr int ACTS = ACT * 512;
    static constexpr int SUMS = AG4_SPANS * ACT * 4;
    // Then the scales' and biases' words, 2·ag4_side_words a weight row.
    static constexpr int STAGE = LEVELS + ACTS + SUMS;
    static constexpr int LEVEL_PIECES = AG4_ROWS * 8 / THREADS;  // 16-byte copies a thread
    static constexpr int ACT_PIECES = ACT * 32 / THREADS;
};

// The 4-byte words of global memory a stage copies for one weight row's
// scales (and as many for its biases): the `n` values of the stage's spans
// (256 / group, or one where a group spans stages), of `size` bytes each,
// whose first value need not start a word (2-byte values at an odd index).
// The host's side_words is the same function.
__device__ __forceinline__ int ag4_side_words(int group, int size) {
    int n = group < AG4_COLS ? AG4_COLS / group : 1;
    return (n * size + 3) / 4 + (size == 2 ? 1 : 0);
}

// A 4-byte cp.async of the first `bytes` (0 to 4) of a word, zero-filling the rest.
__device__ __forceinline__ void ag4_copy_word(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ float ag4_side_value(const unsigned char* p, float) {
    return *reinterpret_cast<const float*>(p);
}
__device__ __forceinline__ float ag4_side_value(const unsigned char* p, __nv_bfloat16) {
    return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

// x (f32 [n_act, in_dim]) to the GEMM's input: bf16, each 8 columns in the
// order 0 4 1 5 2 6 3 7, and per activation row and span of `span` columns
// the sum of the rounded values, at sums[row · sums_row + span index]. One
// thread takes 8 columns; the span/8 threads of a span (consecutive lanes of
// one warp, as in_dim is a multiple of span) add their sums in a fixed tree.
extern "C" __global__ void affine_gemm4_prep(const float* __restrict__ x, __nv_bfloat16* __restrict__ xq,
                                             float* __restrict__ sums, int n_act, int in_dim, int span,
                                             int sums_row) {
    grid_dependency_wait();
    int per_row = in_dim / 8;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = i < (long)n_act * per_row;
    int row = live ? (int)(i / per_row) : 0, o = live ? (int)(i % per_row) : 0;
    float s = 0.0f;
    if (live) {
        const float4* p = reinterpret_cast<const float4*>(x + (size_t)row * in_dim + (size_t)o * 8);
        float4 a = p[0], b = p[1];
        __nv_bfloat162 q[4] = {__floats2bfloat162_rn(a.x, b.x), __floats2bfloat162_rn(a.y, b.y),
                               __floats2bfloat162_rn(a.z, b.z), __floats2bfloat162_rn(a.w, b.w)};
#pragma unroll
        for (int k = 0; k < 4; k++) s += __low2float(q[k]) + __high2float(q[k]);
        *reinterpret_cast<uint4*>(xq + (size_t)row * in_dim + (size_t)o * 8) = *reinterpret_cast<uint4*>(q);
    }
    int lanes = span / 8;
    for (int d = 1; d < lanes; d <<= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (live && o % lanes == 0) sums[(size_t)row * sums_row + o / lanes] = s;
}

// y[n_act, out_dim] (=, or += with `accumulate`) x·wᵀ + bias, or with `part`
// this split's sums into part[blockIdx.z]. xq and sums from
// affine_gemm4_prep; per_split a multiple of the stage's 4 units; `span` the
// columns one scale covers within a stage (the group, at most 256).
template <typename S, int ACT>
__device__ void affine_gemm4(const unsigned char* __restrict__ w, const S* __restrict__ scales,
                             const S* __restrict__ biases, const __nv_bfloat16* __restrict__ xq,
                             const float* __restrict__ sums, const float* __restrict__ bias, float* y, float* part,
                             int out_dim, int in_dim, int group, int span, int n_act, int per_split, int accumulate) {
    using G = Ag4<ACT>;
    constexpr int NT = G::NT;
    extern __shared__ __align__(128) unsigned char ag4_shared[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int row0 = blockIdx.x * AG4_ROWS, act0 = blockIdx.y * ACT;
    const int units = in_dim / 64;
    const int u0 = blockIdx.z * per_split, u1 = min(units, u0 + per_split);
    const int stages = (u1 - u0 + 3) / 4;
    // Spans a stage; chunks of 32 columns a span (1, 2, 4 or 8), as a shift.
    const int spans = AG4_COLS / span, chunk_shift = __ffs(span / 32) - 1;
    const int sums_row = (units + 3) / 4 * spans;
    const int groups = in_dim / group;
    const size_t row_bytes = (size_t)in_dim / 2;

    // Each thread's copies, the same every stage but for the stage's offset.
    const unsigned char* lsrc[G::LEVEL_PIECES];
    int ldst[G::LEVEL_PIECES];
#pragma unroll
    for (int k = 0; k < G::LEVEL_PIECES; k++) {
        int p = tid + k * G::THREADS, r = p >> 3, j = p & 7;
        lsrc[k] = w + (size_t)min(row0 + r, out_dim - 1) * row_bytes + (size_t)u0 * 32 + j * 16;
        ldst[k] = r * 128 + ((j ^ (r & 7)) << 4);
    }
    const unsigned char* asrc[G::ACT_PIECES];
    int adst[G::ACT_PIECES];
#pragma unroll
    for (int k = 0; k < G::ACT_PIECES; k++) {
        int p = tid + k * G::THREADS, r = p >> 5, j = p & 31;
        asrc[k] = reinterpret_cast<const unsigned char*>(xq + (size_t)min(act0 + r, n_act - 1) * in_dim +
                                                         (size_t)u0 * 64) + j * 16;
        adst[k] = G::LEVELS + r * 512 + ((j ^ ((r & 1) << 2)) << 4);
    }
    // The side words: each weight row's scales, then its biases, side_w
    // words each, after the stage's sums.
    constexpr int SIZE = sizeof(S);
    const int side_w = ag4_side_words(group, SIZE);
    const int stage_bytes = G::STAGE + AG4_ROWS * 2 * side_w * 4;
    const long side_end = (long)out_dim * groups * SIZE;  // bytes of each of scales and biases
    // Stage i (of this split) into ring slot `slot`. Units past the split
    // are zero-filled: zero levels meet zero activations and zero sums (the
    // scales of spans past it are some row's, or zeros past the last).
    auto load = [&](int slot, int i) {
        unsigned char* st = ag4_shared + slot * stage_bytes;
        int su = u0 + 4 * i;
#pragma unroll
        for (int k = 0; k < G::LEVEL_PIECES; k++) {
            int j = (tid + k * G::THREADS) & 7;
            cp_async<16>(st + ldst[k], lsrc[k] + i * 128, su + (j >> 1) < u1);
        }
#pragma unroll
        for (int k = 0; k < G::ACT_PIECES; k++) {
            int j = (tid + k * G::THREADS) & 31;
            cp_async<16>(st + adst[k], asrc[k] + i * 512, su + (j >> 3) < u1);
        }
        float* sst = reinterpret_cast<float*>(st + G::LEVELS + G::ACTS);
        for (int p = tid; p < ACT * spans; p += G::THREADS) {
            int r = p % ACT, sp = p / ACT;
            bool valid = su + sp * span / 64 < u1;
            const float* src = sums + (size_t)min(act0 + r, n_act - 1) * sums_row + (size_t)(su / 4) * spans + sp;
            cp_async<4>(sst + sp * ACT + r, valid ? src : sums, valid);
        }
        unsigned char* side = st + G::STAGE;
        const int g_lo = su * 64 / group;
        for (int p = tid; p < AG4_ROWS * 2 * side_w; p += G::THREADS) {
            int r = p / (2 * side_w), rem = p - r * 2 * side_w, bias = rem >= side_w, wi = rem - bias * side_w;
            long first = ((long)min(row0 + r, out_dim - 1) * groups + g_lo) * SIZE;
            long at = (first & ~3L) + 4 * wi;
            int bytes = (int)max(0L, min(4L, side_end - at));
            const unsigned char* base = reinterpret_cast<const unsigned char*>(bias ? biases : scales);
            ag4_copy_word(side + p * 4, bytes > 0 ? base + at : base, bytes);
        }
    };

#pragma unroll
    for (int s = 0; s < AG4_STAGES - 1; s++) {
        if (s < stages) load(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }

    float acc[NT][4], tmp[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[t][q] = tmp[t][q] = 0.0f;
    const int wr = warp * 16 + g;  // the lane's first weight row in the block
    for (int i = 0; i < stages; i++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AG4_STAGES - 2));
        // Every warp is done with the stage the next load overwrites.
        __syncthreads();
        if (i + AG4_STAGES - 1 < stages) load((i + AG4_STAGES - 1) % AG4_STAGES, i + AG4_STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        const unsigned char* st = ag4_shared + (i % AG4_STAGES) * stage_bytes;
        const unsigned char* la_row = st + wr * 128 + 4 * c;
        const unsigned char* lb_row = la_row + 8 * 128;
        const unsigned char* x_row = st + G::LEVELS + g * 512;
        // The lane's two rows' side words, and where their first value starts.
        const int g_lo = (u0 + 4 * i) * 64 / group;
        const unsigned char* side_a = st + G::STAGE + wr * 2 * side_w * 4;
        const unsigned char* side_b = side_a + 8 * 2 * side_w * 4;
        const int skew_a = (int)((((long)min(row0 + wr, out_dim - 1) * groups + g_lo) * SIZE) & 3);
        const int skew_b = (int)((((long)min(row0 + wr + 8, out_dim - 1) * groups + g_lo) * SIZE) & 3);
        const float* sst = reinterpret_cast<const float*>(st + G::LEVELS + G::ACTS);
#pragma unroll
        for (int k = 0; k < 8; k++) {  // chunk k: unit k / 2, half k % 2
            unsigned la = *reinterpret_cast<const unsigned*>(la_row + ((k ^ g) << 4));
            unsigned lb = *reinterpret_cast<const unsigned*>(lb_row + ((k ^ g) << 4));
            uint4 bf[NT];
#pragma unroll
            for (int t = 0; t < NT; t++)
                bf[t] = *reinterpret_cast<const uint4*>(x_row + t * 8 * 512 + (((4 * k + c) ^ ((g & 1) << 2)) << 4));
#pragma unroll
            for (int e = 0; e < 2; e++) {
                unsigned a0 = ((la >> (8 * e)) & 0x000F000Fu) | AG4_MAGIC;
                unsigned a2 = ((la >> (8 * e + 4)) & 0x000F000Fu) | AG4_MAGIC;
                unsigned a1 = ((lb >> (8 * e)) & 0x000F000Fu) | AG4_MAGIC;
                unsigned a3 = ((lb >> (8 * e + 4)) & 0x000F000Fu) | AG4_MAGIC;
#pragma unroll
                for (int t = 0; t < NT; t++)
                    mma_bf16_16816(tmp[t], a0, a1, a2, a3, e ? bf[t].z : bf[t].x, e ? bf[t].w : bf[t].y);
            }
            if (((k + 1) & ((1 << chunk_shift) - 1)) == 0) {
                // The span's scales: s·Σ(128 + q)·x + (b − 128·s)·Σx.
                int sp = k >> chunk_shift, at = group < AG4_COLS ? sp * SIZE : 0;
                float s_a = ag4_side_value(side_a + skew_a + at, S{}), s_b = ag4_side_value(side_b + skew_b + at, S{});
                float b_a = ag4_side_value(side_a + side_w * 4 + skew_a + at, S{});
                float b_b = ag4_side_value(side_b + side_w * 4 + skew_b + at, S{});
                float2 sa = make_float2(s_a, fmaf(-128.0f, s_a, b_a)), sb = make_float2(s_b, fmaf(-128.0f, s_b, b_b));
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float2 xs = *reinterpret_cast<const float2*>(sst + sp * ACT + 8 * t + 2 * c);
                    acc[t][0] += fmaf(sa.x, tmp[t][0], sa.y * xs.x);
                    acc[t][1] += fmaf(sa.x, tmp[t][1], sa.y * xs.y);
                    acc[t][2] += fmaf(sb.x, tmp[t][2], sb.y * xs.x);
                    acc[t][3] += fmaf(sb.x, tmp[t][3], sb.y * xs.y);
#pragma unroll
                    for (int q = 0; q < 4; q++) tmp[t][q] = 0.0f;
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // Sum (t, q): weight row g + 8·(q / 2) of the warp's tile, activation
    // row 8t + 2c + q % 2.
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int q = 0; q < 4; q++)
            agemm_store(acc[t][q], act0 + 8 * t + 2 * c + (q & 1), row0 + wr + 8 * (q >> 1), n_act, out_dim, bias, y,
                        part, accumulate);
    }
}

// Per 4-bit storage (f32 or bf16 scales), one kernel per activation tile:
// `gemm4_{format}_a{rows}` (the host's ACT_TILES).
#define AFFINE_GEMM4_NT(F, S, ACT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(Ag4<ACT>::THREADS)                                                 \
        gemm4_##F##_a##ACT(const unsigned char* w, const S* s, const S* bi, const __nv_bfloat16* xq,               \
                           const float* sums, const float* b, float* y, float* part, int o, int i, int g, int span, \
                           int n, int per_split, int acc) {                                                         \
        grid_dependency_wait();                                                                                     \
        affine_gemm4<S, ACT>(w, s, bi, xq, sums, b, y, part, o, i, g, span, n, per_split, acc);                     \
    }
#define AFFINE_GEMM4(F, S) AFFINE_GEMM4_NT(F, S, 16)
AFFINE_GEMM4(affine4, float)
AFFINE_GEMM4(affine4_bf16, __nv_bfloat16)
