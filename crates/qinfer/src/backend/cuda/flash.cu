// Prefill attention on the tensor cores (flash attention, causal, optional
// sliding window), with the score tile, probabilities and output kept in
// registers as mma.sync fragments.
//
// A block of WARPS warps takes 16·WARPS query rows of one head; each warp owns
// 16 rows. Keys and values are walked in tiles of BK, double-buffered in
// shared memory by cp.async from the layer's f16 cache (an f32 cache is
// copied to f16 first, `kv_to_half`, once per call), so a tile's loads
// overlap the previous tile's products. Per tile a warp forms S = Q·Kᵀ
// (m16n8k16, f16 in, f32 out), takes the online softmax of its rows in
// registers (running max m and sum l, the output rescaled by
// e^(m_old − m_new)), and adds P·V, with P's accumulator fragment reused as
// the A operand: the score matrix never leaves registers.
//
// Rounding: q (pre-scaled), k, v and p are f16 (11 significant bits), sums
// and the softmax in f32.

#include "common.cuh"

#define FLASH_LOG2E 1.4426950408889634f

__device__ __forceinline__ void flash_ldmatrix(unsigned (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void flash_ldmatrix_trans(unsigned (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// d += a·b for a 16×16 f16 A fragment and a 16×8 B fragment, f32 accumulate.
__device__ __forceinline__ void flash_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned flash_pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// The f16 copy of an f32 cache's keys and values that flash_prefill reads: n
// values of each (a multiple of 4).
extern "C" __global__ void kv_to_half(const float* __restrict__ k, const float* __restrict__ v, __half* kh,
                                      __half* vh, size_t n) {
    grid_dependency_wait();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n / 4; i += stride) {
        float4 a = reinterpret_cast<const float4*>(k)[i], b = reinterpret_cast<const float4*>(v)[i];
        reinterpret_cast<__half2*>(kh)[2 * i] = __floats2half2_rn(a.x, a.y);
        reinterpret_cast<__half2*>(kh)[2 * i + 1] = __floats2half2_rn(a.z, a.w);
        reinterpret_cast<__half2*>(vh)[2 * i] = __floats2half2_rn(b.x, b.y);
        reinterpret_cast<__half2*>(vh)[2 * i + 1] = __floats2half2_rn(b.z, b.w);
    }
}

// BIDIR: every query row sees every key row (a vision tower's patches): the
// keys are the `rows` rows of `keys`/`values` themselves, `step` is unused.
// Grid: (num_heads, query blocks). Query blocks run last-first: the causal
// ones near the end see the most keys, so they start before the short ones.
// PAGED: the rows of a batch's sequences over a paged pool, grid (num_heads,
// query blocks of the longest sequence, sequences). `step` is then the batch
// table (batch.cu), `rows` the batch's rows, and sequence s's rows are
// [table[seq_rows + s], table[seq_rows + s + 1]), at consecutive positions
// from its first row's; key j sits in slot blocks[j / block_size]·block_size
// + j % block_size.
template <int HD, int BK, int WARPS, bool PAGED, bool BIDIR = false>
__device__ void flash_prefill(const float* __restrict__ q, const __half* __restrict__ keys,
                              const __half* __restrict__ values, float* __restrict__ out, const int* step, int rows,
                              int num_heads, int num_kv_heads, int window, float scale, int block_size = 0,
                              int seq_rows = 0) {
    constexpr int BQ = 16 * WARPS, THREADS = 32 * WARPS;
    // Shared rows padded by 16 bytes: the 8 rows an ldmatrix reads fall in
    // different banks.
    constexpr int LD = HD + 8;
    constexpr int CHUNKS = HD / 8;  // 16-byte pieces of a row
    extern __shared__ __align__(128) unsigned char smem[];
    __half* qs = reinterpret_cast<__half*>(smem);  // [BQ][LD]
    __half* ks = qs + BQ * LD;                     // [2][BK][LD]
    __half* vs = ks + 2 * BK * LD;                 // [2][BK][LD]
    const float neg_inf = -__int_as_float(0x7f800000);
    int h = blockIdx.x, kvh = h / (num_heads / num_kv_heads);
    int q0 = (gridDim.y - 1 - blockIdx.y) * BQ, start;
    int kv_dim = num_kv_heads * HD, q_dim = num_heads * HD;
    const int* blocks = nullptr;
    if constexpr (PAGED) {
        int s = blockIdx.z, row0 = step[seq_rows + s];
        blocks = step + step[3 * rows + s];
        rows = step[seq_rows + s + 1] - row0;
        if (q0 >= rows) return;
        start = step[row0];
        q += (size_t)row0 * q_dim;
        out += (size_t)row0 * q_dim;
    } else if constexpr (BIDIR) {
        start = 0;
    } else {
        start = step[0];
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    int last = start + min(q0 + BQ, rows) - 1;  // the block's last query position
    int k_begin = window > 0 ? max(0, start + q0 + 1 - window) / BK * BK : 0;
    int k_end = BIDIR ? rows : last + 1;
    int tiles = (k_end - k_begin + BK - 1) / BK;

    auto load_tile = [&](int k0, int stage) {
        __half* kd = ks + stage * BK * LD;
        __half* vd = vs + stage * BK * LD;
#pragma unroll
        for (int u = 0; u < BK * CHUNKS / THREADS; u++) {
            int i = threadIdx.x + u * THREADS, j = i / CHUNKS, c = i % CHUNKS, key = k0 + j;
            bool ok = key < k_end;
            size_t row = ok ? key : 0;
            if constexpr (PAGED) row = (size_t)blocks[row / block_size] * block_size + row % block_size;
            size_t at = row * kv_dim + kvh * HD + c * 8;
            cp_async<16>(kd + j * LD + c * 8, keys + at, ok);
            cp_async<16>(vd + j * LD + c * 8, values + at, ok);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    load_tile(k_begin, 0);

    // q rounded to f16 after scaling, four values per thread at a time.
    for (int i = threadIdx.x; i < BQ * HD / 4; i += THREADS) {
        int r = i / (HD / 4), c = 4 * (i % (HD / 4));
        float4 v = q0 + r < rows ? *reinterpret_cast<const float4*>(q + (size_t)(q0 + r) * q_dim + h * HD + c)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
        unsigned* d = reinterpret_cast<unsigned*>(qs + r * LD + c);
        d[0] = flash_pack(v.x * scale, v.y * scale);
        d[1] = flash_pack(v.z * scale, v.w * scale);
    }

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    // Rows g and g + 8 of the warp's 16: running max and this lane's part of
    // the running sum (the quad's four parts are added at the end).
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};
    int pos0 = start + q0 + warp * 16 + g;  // row g's position; row g + 8 is pos0 + 8
    // ldmatrix addresses: lane → (row, column) of the x4 load's four matrices.
    int mat = lane >> 3, mrow = lane & 7;
    const __half* q_at = qs + (warp * 16 + mrow + (mat & 1) * 8) * LD + (mat >> 1) * 8;
    int k_row = mrow + (mat >> 1) * 8, k_col = (mat & 1) * 8;  // K: b0,b1 of n-tile 2p, then of 2p + 1
    int v_row = mrow + (mat & 1) * 8, v_col = (mat >> 1) * 8;  // V (transposed): b0,b1 of 2p, then 2p + 1

    for (int tile = 0; tile < tiles; tile++) {
        int k0 = k_begin + tile * BK, stage = tile & 1;
        if (tile + 1 < tiles) {
            load_tile(k0 + BK, stage ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const __half* kt = ks + stage * BK * LD;
        const __half* vt = vs + stage * BK * LD;

        float s[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            unsigned a[4];
            flash_ldmatrix(a, q_at + kk * 16);
#pragma unroll
            for (int p = 0; p < BK / 16; p++) {
                unsigned b[4];
                flash_ldmatrix(b, kt + (p * 16 + k_row) * LD + kk * 16 + k_col);
                flash_mma(s[2 * p], a[0], a[1], a[2], a[3], b[0], b[1]);
                flash_mma(s[2 * p + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }
        // Causal and window masks, only where the tile reaches them.
        if (BIDIR ? k0 + BK > k_end : k0 + BK - 1 > start + q0 + warp * 16 || window > 0) {
#pragma unroll
            for (int n = 0; n < BK / 8; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int key = k0 + n * 8 + 2 * t + (e & 1), pos = pos0 + (e >> 1) * 8;
                    bool ok = BIDIR ? key < k_end : key <= pos && (window <= 0 || key > pos - window);
                    if (!ok) s[n][e] = neg_inf;
                }
            }
        }
        // Online softmax of rows g (e = 0, 1) and g + 8 (e = 2, 3).
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = neg_inf;
#pragma unroll
            for (int n = 0; n < BK / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float m_new = fmaxf(m[r], mx);
            // A row with nothing visible yet keeps p = 0 (and nothing to rescale).
            float base = m_new == neg_inf ? 0.0f : m_new * FLASH_LOG2E;
            float alpha = exp2f(m[r] * FLASH_LOG2E - base);
            m[r] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < BK / 8; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float p = exp2f(fmaf(s[n][2 * r + e], FLASH_LOG2E, -base));
                    s[n][2 * r + e] = p;
                    sum += p;
                }
            }
            l[r] = l[r] * alpha + sum;
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                o[n][2 * r] *= alpha;
                o[n][2 * r + 1] *= alpha;
            }
        }
        // O += P·V: the score fragments of keys 16p..16p+15 are the A operand.
#pragma unroll
        for (int p = 0; p < BK / 16; p++) {
            unsigned a0 = flash_pack(s[2 * p][0], s[2 * p][1]), a1 = flash_pack(s[2 * p][2], s[2 * p][3]);
            unsigned a2 = flash_pack(s[2 * p + 1][0], s[2 * p + 1][1]);
            unsigned a3 = flash_pack(s[2 * p + 1][2], s[2 * p + 1][3]);
#pragma unroll
            for (int d = 0; d < HD / 16; d++) {
                unsigned b[4];
                flash_ldmatrix_trans(b, vt + (p * 16 + v_row) * LD + d * 16 + v_col);
                flash_mma(o[2 * d], a0, a1, a2, a3, b[0], b[1]);
                flash_mma(o[2 * d + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
        __syncthreads();  // this stage is refilled two tiles on
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = q0 + warp * 16 + g + r * 8;
        if (row < rows) {
            float inv = 1.0f / l[r];
            float* dst = out + (size_t)row * q_dim + h * HD + 2 * t;
#pragma unroll
            for (int n = 0; n < HD / 8; n++)
                *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        }
    }
}

// Head dim, keys per tile, warps per block: mirrored by `flash_tile` in attention_plan.rs.
// Two blocks per SM: for head dim 128 that caps registers at 128 (a few
// spilled); measured on the H200 at 8192 causal rows, 273 TFLOP/s against
// 255 with one block of 172 registers.
#define FLASH_PREFILL(HD, BK, WARPS)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) flash_prefill##HD(                                 \
        const float* q, const __half* k, const __half* v, float* o, const int* step, int rows, int nh, int nkv,    \
        int window, float scale) {                                                                                 \
        grid_dependency_wait();                                                                                    \
        flash_prefill<HD, BK, WARPS, false>(q, k, v, o, step, rows, nh, nkv, window, scale);                       \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) flash_prefill##HD##_paged(                         \
        const float* q, const __half* k, const __half* v, float* o, const int* table, int rows, int nh, int nkv,   \
        int window, float scale, int block_size, int seq_rows) {                                                   \
        grid_dependency_wait();                                                                                    \
        flash_prefill<HD, BK, WARPS, true>(q, k, v, o, table, rows, nh, nkv, window, scale, block_size, seq_rows); \
    }
FLASH_PREFILL(64, 64, 8)
FLASH_PREFILL(128, 64, 8)
FLASH_PREFILL(256, 32, 4)

// Bidirectional attention over one image's patches (vision towers): head
// dims 64, 80 (72 padded) and 128, with flash_bidir_tile's tiling.
#define FLASH_BIDIR(HD, BK, WARPS)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 2)                                                  \
        flash_bidir##HD(const float* q, const __half* k, const __half* v, float* o, int rows, int nh, float scale) { \
        grid_dependency_wait();                                                                                  \
        flash_prefill<HD, BK, WARPS, false, true>(q, k, v, o, nullptr, rows, nh, nh, 0, scale);                   \
    }
FLASH_BIDIR(64, 64, 8)
FLASH_BIDIR(80, 64, 4)
FLASH_BIDIR(128, 64, 8)
