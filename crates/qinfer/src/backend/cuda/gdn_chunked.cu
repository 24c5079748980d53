// ---------------------------------------------------------------------------
// The gated delta rule over a prompt in chunks of 64 tokens, for key heads of
// 128: the WY/UT form of the CPU's `gdn::chunked` (transformers'
// torch_chunk_gated_delta_rule) on the tensor cores.
//
// Why: token by token (gdn_scan128) the recurrence is a chain of 128×dv
// state updates per token. In chunks, all but a short per-chunk chain
// becomes matrix products, most of them computed for all chunks in parallel.
// Measured at the 4B hybrid's shapes (H200, session-ab.txt runs 26-29):
// pp8192 31.1k → 37.6k tok/s and pp512 29.3k → 34.9k in the same runs,
// although ncu, timing each kernel alone, has the two forms level at 8192
// tokens (gdn_scan128 2.29 ms a layer; here 8 slices of 157-162 µs
// (prep) + 130 µs (state)). The prep's balanced tiles (run 31) took it to
// 140-148 µs, pp8192 to 38.3k.
//
// Within a chunk of L tokens with cumulative log decay c (g summed from the
// chunk's start), A[i][j] = β_i (k_i·k_j) e^{c_i − c_j} (j < i), and
// U = (I + A)⁻¹ (βv), W = (I + A)⁻¹ (β e^c k). With P[i][j] = (q_i·k_j)
// e^{c_i − c_j} (j ≤ i) and the state S carried in from earlier chunks:
//   V' = U − W S,   o = e^c q S + P V',   S ← e^{c_L} S + Σ_j e^{c_L − c_j} k_j V'_jᵀ.
// Writing o = (e^c q − P W) S + P U moves everything but three products with
// S into the per-chunk kernel:
//   gdn_chunk_prep (a block per chunk and value head, all in parallel): A and
//     P (tensor cores), U and W (forward substitution, a thread per column,
//     CUDA cores), then Q' = e^c q − P W and O₀ = P U (tensor cores);
//   gdn_chunk_state (a block per value head and GDN_CHUNK_COLS of its
//     columns, chunk after chunk): V' = U − W S and o = Q' S + O₀, then the
//     state update, S in the warps' accumulators.
// Tokens past the prompt's end are zeros (k = q = v = β = g = 0), which
// leaves every product as the shorter chunk's.
//
// Precision: each f32 operand is split into a TF32 high part and a TF32 low
// part (x − hi), and a product takes three MMAs (lo·hi, hi·lo, hi·hi) with
// f32 accumulation: about f32 accuracy (within 4e-6 of the CPU's f32 chunked
// form over 1100 tokens in the CUDA tests; a single TF32 MMA keeps 11 bits,
// errors near 1e-3). The cost: the state kernel took 85 µs a slice with one
// MMA a product against 130 µs with three (run 28).
//
// The per-chunk kernel hands its operands over in the MMA's A-fragment order
// (float4 per lane, see gck_frag): the state kernel copies them into shared
// memory whole (16-byte cp.async, a chunk ahead of their use) and each lane
// reads its fragment as one 16-byte load.

#include "common.cuh"
#include "constants.cuh"

// GDN_CHUNK comes from constants.cuh.
// GCK_PITCH comes from constants.cuh. // a row of 128 q or k values (A-operand reads: pitch ≡ 4 mod 32)
// GCK_TRI comes from constants.cuh. // a row of A or P (A-operand reads of P: pitch ≡ 4 mod 32)

// The pitch of X = [U | W] rows: dv + 128 columns rounded up to GCK_X_ALIGN,
// plus GCK_X_PAD (B-operand reads: ≡ 8 mod 32). Rust: `gdn_chunk_x_pitch`.
// GCK_X_ALIGN comes from constants.cuh.
// GCK_X_PAD comes from constants.cuh.
__host__ __device__ constexpr int gck_x_pitch(int dv) {
    return (dv + 128 + GCK_X_ALIGN - 1) / GCK_X_ALIGN * GCK_X_ALIGN + GCK_X_PAD;
}

__device__ __forceinline__ unsigned gck_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void gck_mma_raw(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                            unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// acc[t] += a·b_t for NT tiles sharing one A fragment (a: this lane's A
// fragment of a 16×8 tile, (b0[t], b1[t]): its B fragment of the t-th 8×8
// tile), f32 operands as three TF32 MMAs each. Pass by pass over the tiles,
// so that consecutive MMAs go to different accumulators: each MMA waits on
// the one before it into the same accumulator. Tiles from `live` on are
// skipped.
template <int NT>
__device__ __forceinline__ void gck_mma(float (&acc)[NT][4], float4 a, const float (&b0)[NT],
                                        const float (&b1)[NT], int live = NT) {
    unsigned ah0 = gck_tf32(a.x), ah1 = gck_tf32(a.y), ah2 = gck_tf32(a.z), ah3 = gck_tf32(a.w);
    unsigned al0 = gck_tf32(a.x - __uint_as_float(ah0)), al1 = gck_tf32(a.y - __uint_as_float(ah1)),
             al2 = gck_tf32(a.z - __uint_as_float(ah2)), al3 = gck_tf32(a.w - __uint_as_float(ah3));
    unsigned bh0[NT], bh1[NT], bl0[NT], bl1[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        bh0[t] = gck_tf32(b0[t]), bh1[t] = gck_tf32(b1[t]);
        bl0[t] = gck_tf32(b0[t] - __uint_as_float(bh0[t])), bl1[t] = gck_tf32(b1[t] - __uint_as_float(bh1[t]));
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (t < live) gck_mma_raw(acc[t], al0, al1, al2, al3, bh0[t], bh1[t]);
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (t < live) gck_mma_raw(acc[t], ah0, ah1, ah2, ah3, bl0[t], bl1[t]);
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (t < live) gck_mma_raw(acc[t], ah0, ah1, ah2, ah3, bh0[t], bh1[t]);
}

// The A fragment of tile (row 16·mt, column 8·ks) of a row-major matrix
// `m` (`pitch` floats a row) for lane (g, c): rows g and g + 8, columns c
// and c + 4, in the order the MMA takes them.
__device__ __forceinline__ float4 gck_frag(const float* m, int pitch, int mt, int ks, int g, int c) {
    const float* p = m + (16 * mt + g) * pitch + 8 * ks + c;
    return make_float4(p[0], p[8 * pitch], p[4], p[8 * pitch + 4]);
}

// Per chunk `blockIdx.x` of the `rows` tokens at q, k, v, g, beta (rows as
// gdn_scan128 takes them) and value head `blockIdx.y`, into the chunk-head's
// slots (index b = chunk·nv + head):
//   wf, qf: −W and Q' as A fragments [b][4 token tiles][16 key steps][32 lanes] (float4);
//   kf: (e^{c_L − c_j} k_j)ᵀ as A fragments [b][8 key tiles][8 token steps][32 lanes];
//   u, o0: U and O₀ [b][64][dv]; last: e^{c_L} [b].
// 256 threads; dv ≤ 256; dynamic shared memory as carved below (Rust:
// `gdn_chunk_prep_shared`).
__device__ void gdn_chunk_prep_body(const float* __restrict__ q, const float* __restrict__ k,
                                    const float* __restrict__ v, const float* __restrict__ g,
                                    const float* __restrict__ beta, float4* __restrict__ wf, float4* __restrict__ qf,
                                    float4* __restrict__ kf, float* __restrict__ u, float* __restrict__ o0,
                                    float* __restrict__ last, int rows, int nk, int nv, int dv, int tiled,
                                    int qk_stride, int v_stride) {
    extern __shared__ float gck_shared[];
    constexpr int P = GCK_PITCH;
    const int xp = gck_x_pitch(dv);
    float* ks_ = gck_shared;                 // k rows [64][P]
    float* qs = ks_ + GDN_CHUNK * P;         // q rows [64][P], later Q'
    float* xs = qs + GDN_CHUNK * P;          // [64][xp]: v | k, then U | W
    float* as = xs + GDN_CHUNK * xp;         // A [64][GCK_TRI] (strictly lower)
    float* ps = as + GDN_CHUNK * GCK_TRI;    // P [64][GCK_TRI] (lower)
    float* cum = ps + GDN_CHUNK * GCK_TRI;   // c_i
    float* bt = cum + GDN_CHUNK;             // β_i
    float* ew = bt + GDN_CHUNK;              // β_i e^{c_i}
    float* fj = ew + GDN_CHUNK;              // e^{c_L − c_j}
    int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int gq = lane >> 2, cq = lane & 3;
    int kh = tiled ? h % nk : h / (nv / nk);
    int t0 = n * GDN_CHUNK, len = min(GDN_CHUNK, rows - t0);
    size_t b = (size_t)n * nv + h;
    int cols = dv + 128;

    // The chunk's q, k, v (zeros past the prompt), g and β, all copies in
    // flight at once (rows past the prompt read its last row, zero-filled).
    for (int p = tid; p < GDN_CHUNK * 32; p += blockDim.x) {
        int i = p >> 5, r = 4 * (p & 31);
        size_t at = (size_t)(t0 + min(i, len - 1)) * qk_stride + kh * 128 + r;
        cp_async<16>(ks_ + i * P + r, k + at, i < len);
        cp_async<16>(qs + i * P + r, q + at, i < len);
    }
    for (int i = warp; i < GDN_CHUNK; i += blockDim.x / 32) {
        size_t t = t0 + min(i, len - 1);
        for (int c = lane; c < xp; c += 32) {
            const float* src = c < dv ? v + t * v_stride + h * dv + c : k + t * qk_stride + kh * 128 + min(c - dv, 127);
            cp_async<4>(xs + i * xp + c, src, i < len && c < cols);
        }
    }
    if (tid < GDN_CHUNK) {
        size_t at = (size_t)(t0 + min(tid, len - 1)) * nv + h;
        cp_async<4>(cum + tid, g + at, tid < len);
        cp_async<4>(bt + tid, beta + at, tid < len);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    if (tid == 0) {
        // In token order, as the CPU sums it.
        float acc = 0.0f;
        for (int i = 0; i < GDN_CHUNK; i++) {
            acc += cum[i];
            cum[i] = acc;
        }
    }
    __syncthreads();
    float cl = cum[GDN_CHUNK - 1];
    if (tid < GDN_CHUNK) {
        ew[tid] = bt[tid] * expf(cum[tid]);
        fj[tid] = expf(cl - cum[tid]);
    }

    // A (warps 0-3) and P (warps 4-7): token tile `warp & 3` against the
    // key tiles at or before it, k·k or q·k over the 128 key dimensions.
    {
        int mt = warp & 3;
        bool is_p = warp >= 4;
        const float* am = is_p ? qs : ks_;
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        for (int kt = 0; kt < 16; kt++) {
            float4 a = gck_frag(am, P, mt, kt, gq, cq);
            float b0[8], b1[8];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const float* br = ks_ + (8 * min(nt, 2 * mt + 1) + gq) * P + 8 * kt + cq;
                b0[nt] = br[0], b1[nt] = br[4];
            }
            gck_mma<8>(acc, a, b0, b1, 2 * mt + 2);
        }
        __syncthreads();  // cum, bt from tid < 64 above
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            if (nt < 2 * mt + 2) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int i = 16 * mt + gq + (e >> 1) * 8, j = 8 * nt + 2 * cq + (e & 1);
                    float dec = expf(cum[i] - cum[j]);
                    if (is_p) ps[i * GCK_TRI + j] = j <= i ? acc[nt][e] * dec : 0.0f;
                    else as[i * GCK_TRI + j] = j < i ? bt[i] * acc[nt][e] * dec : 0.0f;
                }
            }
        }
    }
    // (e^{c_L − c_j} k_j)ᵀ: key dimension i, token j.
    for (int p = tid; p < 8 * 8 * 32; p += blockDim.x) {
        int mt = p >> 8, kt = (p >> 5) & 7, ln = p & 31, g_ = ln >> 2, c_ = ln & 3;
        int i = 16 * mt + g_, j = 8 * kt + c_;
        kf[b * 2048 + p] = make_float4(fj[j] * ks_[j * P + i], fj[j] * ks_[j * P + i + 8],
                                       fj[j + 4] * ks_[(j + 4) * P + i], fj[j + 4] * ks_[(j + 4) * P + i + 8]);
    }
    if (tid == 0) last[b] = expf(cl);
    __syncthreads();

    // U = (I + A)⁻¹ βv and W = (I + A)⁻¹ β e^c k by forward substitution, a
    // thread per column of X, the column in registers.
    for (int col = tid; col < cols; col += blockDim.x) {
        float x[GDN_CHUNK];
        float* xc = xs + col;
#pragma unroll
        for (int i = 0; i < GDN_CHUNK; i++) x[i] = (col < dv ? bt[i] : ew[i]) * xc[i * xp];
        // Four partial sums a row: four chains of FMAs instead of one.
#pragma unroll
        for (int i = 1; i < GDN_CHUNK; i++) {
            const float* ai = as + i * GCK_TRI;
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j + 4 <= i; j += 4) {
                float4 a4 = *reinterpret_cast<const float4*>(ai + j);
                part[0] = fmaf(a4.x, x[j], part[0]);
                part[1] = fmaf(a4.y, x[j + 1], part[1]);
                part[2] = fmaf(a4.z, x[j + 2], part[2]);
                part[3] = fmaf(a4.w, x[j + 3], part[3]);
            }
#pragma unroll
            for (int j = i & ~3; j < i; j++) part[j & 3] = fmaf(ai[j], x[j], part[j & 3]);
            x[i] -= (part[0] + part[1]) + (part[2] + part[3]);
        }
#pragma unroll
        for (int i = 0; i < GDN_CHUNK; i++) xc[i * xp] = x[i];
    }
    __syncthreads();

    // Q' = e^c q − P W (into qs, in place: each thread rewrites the values it
    // read) and O₀ = P U (out): tiles of 16 tokens × 8 columns, P's key steps
    // up to the tile's diagonal.
    // Units of 4 tiles of 8 columns (one A fragment for 4 MMAs). A unit of
    // token tile mt takes 2·mt + 2 key steps; the tiles are spread so that
    // each warp's units add up alike (20 steps a warp at dv = 128, where
    // warp 3 took 32 and warp 0 took 8 with mt = unit % 4).
    int vu = (dv + 31) / 32, units = 4 * 4 + 4 * vu;
    for (int t = warp; t < units; t += 8) {
        bool is_q = t < 16;
        int tt = is_q ? t : t - 16, nu = tt >> 2, mt = ((tt & 3) + 2 * (tt >> 3)) & 3;
        if (!is_q) mt = 3 - mt;
        int c0 = is_q ? dv + 32 * nu : 32 * nu;  // X column of the unit's first
        float acc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = 16 * mt + gq + (e >> 1) * 8, r = 32 * nu + 8 * nt + 2 * cq + (e & 1);
                acc[nt][e] = is_q ? expf(cum[i]) * qs[i * P + r] : 0.0f;
            }
        }
        for (int kt = 0; kt < 2 * mt + 2; kt++) {
            float4 a = gck_frag(ps, GCK_TRI, mt, kt, gq, cq);
            if (is_q) a = make_float4(-a.x, -a.y, -a.z, -a.w);
            float b0[4], b1[4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const float* br = xs + (8 * kt + cq) * xp + c0 + 8 * nt + gq;
                b0[nt] = br[0], b1[nt] = br[4 * xp];
            }
            gck_mma<4>(acc, a, b0, b1);
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = 16 * mt + gq + (e >> 1) * 8, r = 32 * nu + 8 * nt + 2 * cq + (e & 1);
                if (is_q) qs[i * P + r] = acc[nt][e];
                else if (r < dv) o0[(b * GDN_CHUNK + i) * dv + r] = acc[nt][e];
            }
        }
    }
    __syncthreads();
    for (int p = tid; p < 4 * 16 * 32; p += blockDim.x) {
        int mt = p >> 9, kt = (p >> 5) & 15, ln = p & 31;
        float4 w = gck_frag(xs + dv, xp, mt, kt, ln >> 2, ln & 3);
        wf[b * 2048 + p] = make_float4(-w.x, -w.y, -w.z, -w.w);
        qf[b * 2048 + p] = gck_frag(qs, P, mt, kt, ln >> 2, ln & 3);
    }
    for (int i = warp; i < GDN_CHUNK; i += blockDim.x / 32) {
        for (int c = lane; c < dv; c += 32) u[(b * GDN_CHUNK + i) * dv + c] = xs[i * xp + c];
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_prep(const float* q, const float* k, const float* v, const float* g, const float* beta, float4* wf,
                   float4* qf, float4* kf, float* u, float* o0, float* last, int rows, int nk, int nv, int dv,
                   int tiled, int qk_stride, int v_stride) {
    grid_dependency_wait();
    gdn_chunk_prep_body(q, k, v, g, beta, wf, qf, kf, u, o0, last, rows, nk, nv, dv, tiled, qk_stride, v_stride);
}

// Value columns per block of gdn_chunk_state (Rust: GDN_CHUNK_COLS).
// GDN_CHUNK_COLS comes from constants.cuh.
// A row of the state or V' in shared memory: the block's columns and
// GCK_SP_PAD more (B-operand reads: ≡ 8 mod 32). Rust: GDN_CHUNK_STATE_PAD.
// GCK_SP_PAD comes from constants.cuh.
#define GCK_SP (GDN_CHUNK_COLS + GCK_SP_PAD)

// acc += A·B over KT k-steps of 8 (gdn_chunk_state's two products): this
// lane's A fragments af[32·kt], B the rows of `b` (pitch GCK_SP) from 8·kt,
// columns c0 onwards (two n-tiles of 8).
template <int KT>
__device__ __forceinline__ void gck_mma_rows(float (&acc)[2][4], const float4* af, const float* b, int c0) {
    int lane = threadIdx.x & 31, gq = lane >> 2, cq = lane & 3;
#pragma unroll 4
    for (int kt = 0; kt < KT; kt++) {
        float b0[2], b1[2];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const float* br = b + (8 * kt + cq) * GCK_SP + c0 + 8 * nt + gq;
            b0[nt] = br[0], b1[nt] = br[4 * GCK_SP];
        }
        gck_mma<2>(acc, af[kt * 32], b0, b1);
    }
}

// The chunks of gdn_chunk_prep in order, for value head `blockIdx.x` and
// columns GDN_CHUNK_COLS·blockIdx.y onwards: state [nv][128][dv] in and out,
// out [rows][nv·dv]. 512 threads; dynamic shared memory as carved below
// (Rust: `GDN_CHUNK_STATE_SHARED`). Each chunk's fragments are copied
// (cp.async) into shared memory while the chunk before it computes. Per
// chunk, from the state in shared memory, warps 0-7 form V' and warps 8-15
// the output, a tile of 16 tokens × 16 columns each; then each warp adds
// Kdᵀ V' to its tile of 16 state rows × 16 columns, held as MMA
// accumulators for the whole call. (Sixteen warps, not eight with the
// fragments in registers: at 8 warps the kernel spilled and each scheduler's
// two warps left it idle more than half the time.)
__device__ void gdn_chunk_state_body(const float4* __restrict__ wf, const float4* __restrict__ qf,
                                     const float4* __restrict__ kf, const float* __restrict__ u,
                                     const float* __restrict__ o0, const float* __restrict__ last,
                                     float* __restrict__ state, float* __restrict__ out, int rows, int nv,
                                     int dv) {
    constexpr int BV = GDN_CHUNK_COLS, SP = GCK_SP;
    extern __shared__ float4 gck_state_shared[];
    float4* frags = gck_state_shared;  // [2 chunks][−W, Q', Kdᵀ][2048]
    float* ss = reinterpret_cast<float*>(frags + 2 * 3 * 2048);
    float* vs = ss + 128 * SP;
    int h = blockIdx.x, col0 = blockIdx.y * BV, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int gq = lane >> 2, cq = lane & 3;
    int chunks = (rows + GDN_CHUNK - 1) / GDN_CHUNK;
    float* st = state + (size_t)h * 128 * dv;
    // The state tile of this warp: rows 16·sm.., block columns sc..sc+15.
    int sm = warp & 7, sc = 16 * (warp >> 3);
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = 16 * sm + gq + (e >> 1) * 8, j = col0 + sc + 8 * nt + 2 * cq + (e & 1);
            s[nt][e] = j < dv ? st[(size_t)i * dv + j] : 0.0f;
        }
    }
    // The V' or output tile of this warp: tokens 16·mt.., block columns bc..bc+15.
    bool is_o = warp >= 8;
    int mt = warp & 3, bc = 16 * ((warp >> 2) & 1);
    const float* init_src = is_o ? o0 : u;
    float init[2][4];
    // Chunk n's fragments into buffer n & 1 (one cp.async group) and its
    // U or O₀ values into `init`.
    auto fetch = [&](int n) {
        size_t b = (size_t)n * nv + h;
        float4* dst = frags + (n & 1) * 3 * 2048;
        for (int p = tid; p < 3 * 2048; p += blockDim.x) {
            const float4* src = p < 2048 ? wf : p < 4096 ? qf : kf;
            cp_async<16>(dst + p, src + b * 2048 + (p & 2047), true);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        const float* src = init_src + b * GDN_CHUNK * dv;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = 16 * mt + gq + (e >> 1) * 8, j = col0 + bc + 8 * nt + 2 * cq + (e & 1);
                init[nt][e] = j < dv ? src[(size_t)i * dv + j] : 0.0f;
            }
        }
    };
    fetch(0);
    for (int n = 0; n < chunks; n++) {
        size_t b = (size_t)n * nv + h;
        const float4* fr = frags + (n & 1) * 3 * 2048;
        float el = last[b];
        asm volatile("cp.async.wait_group 0;\n" ::);
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++)
                ss[(16 * sm + gq + (e >> 1) * 8) * SP + sc + 8 * nt + 2 * cq + (e & 1)] = s[nt][e];
        }
        float acc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][e] = init[nt][e];
        }
        // The state and chunk n's fragments are in place, and every warp is
        // done with chunk n − 1 (so its buffer may be refilled).
        __syncthreads();
        if (n + 1 < chunks) fetch(n + 1);
        // V' = U − W·S (from −W), or the output O₀ + Q'·S: 16 rows of 8.
        gck_mma_rows<16>(acc, fr + (is_o ? 2048 : 0) + mt * 16 * 32 + lane, ss, bc);
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = 16 * mt + gq + (e >> 1) * 8, j = bc + 8 * nt + 2 * cq + (e & 1);
                if (!is_o) vs[i * SP + j] = acc[nt][e];
                else if (n * GDN_CHUNK + i < rows && col0 + j < dv)
                    out[((size_t)(n * GDN_CHUNK + i) * nv + h) * dv + col0 + j] = acc[nt][e];
            }
        }
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] *= el;
        }
        // S += Kdᵀ·V': the chunk's 64 tokens, 8 at a time.
        gck_mma_rows<8>(s, fr + 2 * 2048 + sm * 8 * 32 + lane, vs, sc);
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = 16 * sm + gq + (e >> 1) * 8, j = col0 + sc + 8 * nt + 2 * cq + (e & 1);
            if (j < dv) st[(size_t)i * dv + j] = s[nt][e];
        }
    }
}

extern "C" __global__ void __launch_bounds__(512, 1)
    gdn_chunk_state(const float4* wf, const float4* qf, const float4* kf, const float* u, const float* o0,
                    const float* last, float* state, float* out, int rows, int nv, int dv) {
    grid_dependency_wait();
    gdn_chunk_state_body(wf, qf, kf, u, o0, last, state, out, rows, nv, dv);
}
