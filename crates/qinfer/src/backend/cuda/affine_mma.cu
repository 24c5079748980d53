// ---------------------------------------------------------------------------
// 4-bit affine decode GEMV on the tensor cores (1 to 4 activation rows).
//
// Why: a CUDA-core GEMV spends three instructions per 4-bit weight (mask,
// convert, FMA), which caps it near half of HBM speed. Here a weight costs
// 5/8 of an instruction to become an f16 operand, and mma.m16n8k16 does the
// multiply-adds, 256 weights per warp instruction.
//
// Levels: a u32 word holds levels n0..n7 (n_i at bits 4i). One LOP3 per two
// levels makes an f16 pair without shifting them down:
//   (w & 0x000F000F) | 0x64006400   = (1024 + n0,      1024 + n4)
//   (w & 0x00F000F0) | 0x64006400   = (1024 + 16·n1,   1024 + 16·n5)
// and the same on w >> 8 for n2, n6 and 16·n3, 16·n7. All are exact in f16.
// The 16 on odd levels is undone by staging the odd columns' x divided by 16
// (a power of two: exact), and the 1024 by subtracting 1024·Σx per group.
//
// x precision: each activation is staged as two f16 values, hi = f16(x) and
// lo = f16(x − hi), carried as two columns of the MMA's B operand (the
// products of x to ~2^−22; the accumulation is f32). Before that, each unit
// of 64 values is scaled by a power of two that puts its largest |x| just
// under 2^15, so no value overflows f16; its sum is scaled back exactly.
//
// Layout: a block computes 16 rows (8 warps splitting the row's length; an
// m16 tile per warp). Each warp streams its share of the 16 rows into a ring
// of shared-memory stages with cp.async, 4 units of 64 columns (128 bytes a
// row) per stage, so each copy instruction reads whole 128-byte lines: loaded
// straight into fragments, 16 rows a warp instruction touched 8 lines per
// 256 bytes and measured at 1.0 TB/s. From a stage, lane (g = lane/4,
// c = lane%4) takes 8 bytes (16 levels) of rows g and g+8 per unit: columns
// 16c..16c+15 of that unit. The dot
// product does not care in which order k is summed, so MMA step j of a unit
// takes from each lane the levels its A fragment slots need (word j/2, pairs
// (n0,n4),(n1,n5) for even j and (n2,n6),(n3,n7) for odd j), and x is staged
// in shared memory in that same order: each 8 columns as x0 x4 x1 x5 x2 x6 x3 x7.
// A unit of 64 columns lies in one scale group (group sizes that are
// multiples of 64), so the group's scale and bias apply to the unit's sum:
// Σ(s·q + b)·x = s·(D − 1024·Σx̃) + b·Σx, D the MMA's sum, x̃ the staged values.
// Scales and biases travel with the levels (cp.async too); this needs rows
// whose length is a multiple of 256 and groups of 64 or 128.
//
// With PAIRED, rows g and g+8 of a tile are gate row i and up row width + i
// of a stacked gate|up weight, and the block writes silu(gate)·up.

#define AMMA_WARPS 8
#define AMMA_STAGES 3
#define AMMA_MAX_ACT 4
// Row pitch of a stage in shared memory: 4 units of 32 bytes and 32 bytes of
// padding, so the 8-byte fragment reads of 4 rows at a time hit 32 banks.
#define AMMA_PITCH 160

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

template <int BYTES>
__device__ __forceinline__ void amma_cp(void* dst, const void* src, bool valid) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "r"(valid ? 16 : 0));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "n"(BYTES), "r"(valid ? BYTES : 0));
}

// (a & b) | c in one LOP3 (the compiler splits it when b and c are both
// immediates: a LOP3 takes one).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The f16 pairs of one word's levels, in MMA step order (see above).
__device__ __forceinline__ void amma_levels(unsigned w, unsigned (&p)[4], unsigned lo_mask, unsigned hi_mask,
                                            unsigned magic) {
    unsigned h = w >> 8;
    p[0] = and_or(w, lo_mask, magic);
    p[1] = and_or(w, hi_mask, magic);
    p[2] = and_or(h, lo_mask, magic);
    p[3] = and_or(h, hi_mask, magic);
}

__device__ __forceinline__ unsigned pack_half2(__half lo, __half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}

// One stage: 16 rows of 4 units' levels, then their scales and biases
// (4·64/GROUP values of S per row each).
template <typename S, int GROUP>
struct alignas(16) AmmaStage {
    static constexpr int SIDE = 4 * 64 / GROUP * sizeof(S);  // bytes per row of scales (or biases)
    unsigned char levels[16 * AMMA_PITCH];
    unsigned char scales[16 * SIDE];
    unsigned char biases[16 * SIDE];
};

// Stages n_act activation rows of x into shared memory: hi and lo f16 rows in
// MMA order, each unit scaled by its own power of two, and per unit
// (1024·Σx̃, Σx, 1/scale).
__device__ __forceinline__ void amma_stage_x(const float* __restrict__ x, int in_dim, int n_act, uint4* xs,
                                             float4* stats) {
    int blocks8 = in_dim / 8;
    // Threads with consecutive ids take the 8 blocks of 8 columns of one
    // unit, so a unit's max and sums are shuffle reductions over 8 lanes.
    int total = n_act * blocks8, rounds = (total + blockDim.x - 1) / blockDim.x;
    for (int r = 0; r < rounds; r++) {
        int i = r * blockDim.x + threadIdx.x;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        int t = i / blocks8, b = i % blocks8;
        if (i < total) {
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + b * 8);
            float4 v0 = xr[0], v1 = xr[1];
            v[0] = v0.x, v[1] = v0.y, v[2] = v0.z, v[3] = v0.w, v[4] = v1.x, v[5] = v1.y, v[6] = v1.z, v[7] = v1.w;
        }
        float m = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) m = fmaxf(m, fabsf(v[k]));
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        int e = 0;
        frexpf(m, &e);  // m < 2^e
        // Units of zeros or with an infinity keep scale 1 (inf/NaN propagate
        // as in the reference); the shift stays a normal float either way.
        int shift = (m > 0.0f && m <= 3.0e38f) ? max(-126, min(126, 15 - e)) : 0;
        float sc = ldexpf(1.0f, shift);
        float off = 0.0f, sum = 0.0f;
        __half hi[8], lo[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float f = v[k] * sc * ((k & 1) ? 0.0625f : 1.0f);
            hi[k] = __float2half_rn(f);
            lo[k] = __float2half_rn(f - __half2float(hi[k]));
            float staged = __half2float(hi[k]) + __half2float(lo[k]);
            off += staged;
            sum += (k & 1) ? 16.0f * staged : staged;
        }
        if (i < total) {
            uint4* dst = xs + (size_t)t * 2 * blocks8 + b;
            dst[0] = make_uint4(pack_half2(hi[0], hi[4]), pack_half2(hi[1], hi[5]), pack_half2(hi[2], hi[6]),
                                pack_half2(hi[3], hi[7]));
            dst[blocks8] = make_uint4(pack_half2(lo[0], lo[4]), pack_half2(lo[1], lo[5]), pack_half2(lo[2], lo[6]),
                                      pack_half2(lo[3], lo[7]));
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            off += __shfl_xor_sync(0xffffffffu, off, o);
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        if (i < total && (i & 7) == 0)
            stats[t * (in_dim / 64) + b / 8] = make_float4(1024.0f * off, sum, ldexpf(1.0f, -shift), 0.0f);
    }
}

template <typename S, int GROUP, bool PAIRED>
__device__ void gemv_affine4_mma(const unsigned* __restrict__ w, const S* __restrict__ scales,
                                 const S* __restrict__ biases, const float* __restrict__ x,
                                 const float* __restrict__ bias, float* __restrict__ y, int out_dim, int in_dim,
                                 int n_act) {
    using Stage = AmmaStage<S, GROUP>;
    constexpr int SIDE = Stage::SIDE;
    constexpr int PER_STAGE = 4 * 64 / GROUP;  // scale groups per stage and row
    extern __shared__ uint4 amma_shared[];
    __shared__ float partial[2][AMMA_WARPS][16][AMMA_MAX_ACT];
    __shared__ uint4 zeros[2];
    int units = in_dim / 64, blocks8 = in_dim / 8, groups = in_dim / GROUP;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    Stage* ring = reinterpret_cast<Stage*>(amma_shared) + warp * AMMA_STAGES;
    uint4* xs = reinterpret_cast<uint4*>(reinterpret_cast<Stage*>(amma_shared) + AMMA_WARPS * AMMA_STAGES);
    float4* stats = reinterpret_cast<float4*>(xs + (size_t)n_act * 2 * blocks8);  // [n_act][units]
    int width = PAIRED ? out_dim / 2 : out_dim;
    int tiles = PAIRED ? (width + 7) / 8 : (out_dim + 15) / 16;
    // The weight row behind row `r` of tile `tile` (clamped: copies stay in bounds).
    auto tile_row = [&](int tile, int r) {
        if (PAIRED) {
            int o = min(tile * 8 + (r & 7), width - 1);
            return r < 8 ? o : width + o;
        }
        return min(tile * 16 + r, out_dim - 1);
    };
    // Units [beg, end) of this warp in every tile, in whole stages of 4 (rows
    // are a multiple of 256 values long).
    int per_warp = ((units + AMMA_WARPS - 1) / AMMA_WARPS + 3) & ~3;
    int beg = min(warp * per_warp, units), end = min(beg + per_warp, units);
    int batches = (end - beg) / 4;
    int my_tiles = ((int)blockIdx.x < tiles) ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    int steps = batches * my_tiles;  // this warp's stages, tile by tile
    size_t row_bytes = (size_t)in_dim / 2;
    const unsigned char* wbase = reinterpret_cast<const unsigned char*>(w);
    const unsigned char* side_base = reinterpret_cast<const unsigned char*>(lane < 16 ? scales : biases);
    // Stage `step`: 16-byte pieces of the levels (4 rows per instruction, 8
    // lanes a row), and one row's scales (lanes 0-15) or biases (16-31).
    auto issue = [&](int step) {
        if (step < steps) {
            Stage& st = ring[step % AMMA_STAGES];
            int tile = (int)blockIdx.x + (step / batches) * (int)gridDim.x;
            int u0 = beg + 4 * (step % batches);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = 4 * i + (lane >> 3);
                amma_cp<16>(st.levels + r * AMMA_PITCH + (lane & 7) * 16,
                            wbase + (size_t)tile_row(tile, r) * row_bytes + (size_t)u0 * 32 + (lane & 7) * 16, true);
            }
            unsigned char* side = (lane < 16 ? st.scales : st.biases) + (lane & 15) * SIDE;
            size_t first = (size_t)tile_row(tile, lane & 15) * groups + (size_t)u0 * 64 / GROUP;
            amma_cp<SIDE>(side, side_base + first * sizeof(S), true);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    // The first stages go out before x is staged: they do not depend on it.
#pragma unroll
    for (int b = 0; b < AMMA_STAGES - 1; b++) issue(b);
    if (threadIdx.x < 2) zeros[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
    amma_stage_x(x, in_dim, n_act, xs, stats);
    __syncthreads();
    // B operand rows of this lane: activation g/2, hi (even g) or lo; lanes
    // past the activations read zeros (one broadcast address).
    bool b_live = (g >> 1) < n_act;
    const uint4* xb = b_live ? xs + ((size_t)(g >> 1) * 2 + (g & 1)) * blocks8 + 2 * c : zeros;
    int xb_stride = b_live ? 8 : 0;
    const float4* st_x = stats + (size_t)min(c, n_act - 1) * units;  // this lane's C columns: activation c
    unsigned lo_mask = 0x000F000Fu, hi_mask = 0x00F000F0u, magic = 0x64006400u;
    float acc_top = 0.0f, acc_bottom = 0.0f;
    for (int i = 0; i < my_tiles; i++) {
        for (int batch = 0; batch < batches; batch++) {
            int step = i * batches + batch;
            issue(step + AMMA_STAGES - 1);
            asm volatile("cp.async.wait_group %0;\n" ::"n"(AMMA_STAGES - 1));
            __syncwarp();
            const Stage& st = ring[step % AMMA_STAGES];
            int u0 = beg + 4 * batch;
            S sc_top[PER_STAGE], sc_bottom[PER_STAGE], bi_top[PER_STAGE], bi_bottom[PER_STAGE];
#pragma unroll
            for (int k = 0; k < PER_STAGE; k++) {
                sc_top[k] = reinterpret_cast<const S*>(st.scales + g * SIDE)[k];
                sc_bottom[k] = reinterpret_cast<const S*>(st.scales + (g + 8) * SIDE)[k];
                bi_top[k] = reinterpret_cast<const S*>(st.biases + g * SIDE)[k];
                bi_bottom[k] = reinterpret_cast<const S*>(st.biases + (g + 8) * SIDE)[k];
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int u = u0 + k;
                uint2 top = *reinterpret_cast<const uint2*>(st.levels + g * AMMA_PITCH + k * 32 + 8 * c);
                uint2 bottom = *reinterpret_cast<const uint2*>(st.levels + (g + 8) * AMMA_PITCH + k * 32 + 8 * c);
                uint4 x0 = xb[(size_t)u * xb_stride], x1 = xb[(size_t)u * xb_stride + (b_live ? 1 : 0)];
                unsigned pt0[4], pt1[4], pb0[4], pb1[4];
                amma_levels(top.x, pt0, lo_mask, hi_mask, magic);
                amma_levels(top.y, pt1, lo_mask, hi_mask, magic);
                amma_levels(bottom.x, pb0, lo_mask, hi_mask, magic);
                amma_levels(bottom.y, pb1, lo_mask, hi_mask, magic);
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                flash_mma(d, pt0[0], pb0[0], pt0[1], pb0[1], x0.x, x0.y);
                flash_mma(d, pt0[2], pb0[2], pt0[3], pb0[3], x0.z, x0.w);
                flash_mma(d, pt1[0], pb1[0], pt1[1], pb1[1], x1.x, x1.y);
                flash_mma(d, pt1[2], pb1[2], pt1[3], pb1[3], x1.z, x1.w);
                float4 s = st_x[u];
                int gk = k * 64 / GROUP;
                acc_top += s.z * (to_f32(sc_top[gk]) * ((d[0] + d[1]) - s.x) + to_f32(bi_top[gk]) * s.y);
                acc_bottom += s.z * (to_f32(sc_bottom[gk]) * ((d[2] + d[3]) - s.x) + to_f32(bi_bottom[gk]) * s.y);
            }
            __syncwarp();  // the stage is refilled by a later issue
        }
        // The tile's sums over the warps (two slots: the next tile's partial
        // sums may land while this one's are read).
        int slot = i & 1;
        partial[slot][warp][g][c] = acc_top;
        partial[slot][warp][g + 8][c] = acc_bottom;
        acc_top = 0.0f, acc_bottom = 0.0f;
        __syncthreads();
        int tile = (int)blockIdx.x + i * (int)gridDim.x;
        if (PAIRED) {
            if (threadIdx.x < 8 * AMMA_MAX_ACT) {
                int r = threadIdx.x / AMMA_MAX_ACT, t = threadIdx.x % AMMA_MAX_ACT, o = tile * 8 + r;
                float gate = 0.0f, up = 0.0f;
#pragma unroll
                for (int k = 0; k < AMMA_WARPS; k++) {
                    gate += partial[slot][k][r][t];
                    up += partial[slot][k][r + 8][t];
                }
                if (o < width && t < n_act) y[(size_t)t * width + o] = gate / (1.0f + expf(-gate)) * up;
            }
        } else if (threadIdx.x < 16 * AMMA_MAX_ACT) {
            int r = threadIdx.x / AMMA_MAX_ACT, t = threadIdx.x % AMMA_MAX_ACT, o = tile * 16 + r;
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < AMMA_WARPS; k++) sum += partial[slot][k][r][t];
            if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = sum + (bias ? bias[o] : 0.0f);
        }
    }
}

// Per format and group size (64, 128): the GEMV and its silu(gate)·up form.
// Shared memory: the stages, then the staged x (Rust: `affine_mma_shared`).
#define AFFINE_MMA(F, S, G)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
        gemv_##F##_mma_g##G(const unsigned* w, const S* s, const S* bi, const float* x, const float* b, float* y,  \
                            int o, int i, int n) {                                                                 \
        gemv_affine4_mma<S, G, false>(w, s, bi, x, b, y, o, i, n);                                                 \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
        gemv_##F##_mma_g##G##_swiglu(const unsigned* w, const S* s, const S* bi, const float* x, float* y, int o,  \
                                     int i, int n) {                                                               \
        gemv_affine4_mma<S, G, true>(w, s, bi, x, nullptr, y, o, i, n);                                            \
    }
AFFINE_MMA(affine4, float, 64)
AFFINE_MMA(affine4, float, 128)
AFFINE_MMA(affine4_bf16, __nv_bfloat16, 64)
AFFINE_MMA(affine4_bf16, __nv_bfloat16, 128)
