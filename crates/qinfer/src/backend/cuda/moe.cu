// Routed experts on the device: the router's top-k (moe_route), one GEMV
// per (token, chosen expert) entry through tables of device pointers, and the
// fused silu(gate)·up and down kernels of a decode step; then the prefill's
// sorting of entries by expert (moe_prefill.rs).

#include "affine.cuh"
#include "common.cuh"
#include "constants.cuh"
#include "gemv.cuh"

// ---------------------------------------------------------------------------
// Mixture of experts for a few tokens, decided on the device (no host sync,
// so a decode step with routed experts can be recorded). moe_route: per
// token (one block), softmax over the router logits, then the top_k experts
// by repeated block-wide argmax (ties to the lower index, as the CPU's stable
// sort), optionally renormalized; writes ids and weights [rows, top_k].
extern "C" __global__ void moe_route(const float* logits, int* ids, float* weights, int experts, int top_k,
                                     int renormalize) {
    grid_dependency_wait();
    __shared__ float probs[MOE_MAX_EXPERTS];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (size_t)blockIdx.x * experts;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float m = -__int_as_float(0x7f800000);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) m = fmaxf(m, row[e]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) best_v[warp] = m;
    __syncthreads();
    m = -__int_as_float(0x7f800000);
    for (int w = 0; w < warps; w++) m = fmaxf(m, best_v[w]);
    __syncthreads();
    float sum = 0.0f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        probs[e] = expf(row[e] - m);
        sum += probs[e];
    }
    sum = block_sum(sum);
    float chosen = 0.0f;
    for (int s = 0; s < top_k; s++) {
        float bv = -1.0f;
        int bi = experts;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            float p = probs[e];
            if (p > bv || (p == bv && e < bi)) { bv = p; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < warps; w++)
                if (best_v[w] > best_v[0] || (best_v[w] == best_v[0] && best_i[w] < best_i[0])) {
                    best_v[0] = best_v[w];
                    best_i[0] = best_i[w];
                }
            int e = best_i[0];
            float p = probs[e] / sum;
            ids[blockIdx.x * top_k + s] = e;
            weights[blockIdx.x * top_k + s] = p;
            chosen += p;
            probs[e] = -2.0f;  // taken
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && renormalize)
        for (int s = 0; s < top_k; s++) weights[blockIdx.x * top_k + s] /= chosen;
}

// One GEMV per (token, chosen expert) entry b = blockIdx.y: the expert's
// weight from a table of device pointers by ids[b], its input row b / x_div
// of x (x_div = top_k: the token's row; 1: the entry's own row), output row b.
template <typename T, int VEC>
__device__ void moe_gemv(const unsigned long long* table, const int* ids, const float* x, float* y, int out_dim,
                         int in_dim, int x_div) {
    int b = blockIdx.y;
    const T* w = reinterpret_cast<const T*>(table[ids[b]]);
    gemv<T, VEC, 2, 1>(w, x + (size_t)(b / x_div) * in_dim, nullptr, y + (size_t)b * out_dim, out_dim, in_dim, 1);
}
#define MOE_GEMV(NAME, T, VEC)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(const unsigned long long* table, const int* ids,        \
                                                           const float* x, float* y, int o, int i, int x_div) {    \
        grid_dependency_wait();                                                                                    \
        moe_gemv<T, VEC>(table, ids, x, y, o, i, x_div);                                                           \
    }
MOE_GEMV(moe_gemv_bf16, __nv_bfloat16, 8)
MOE_GEMV(moe_gemv_f16, __half, 8)
MOE_GEMV(moe_gemv_f32, float, 4)

// The same for affine experts: tables of packed, scales and biases pointers.
template <typename S, int BITS, bool HALVES>
__device__ void moe_gemv_affine(const unsigned long long* packed, const unsigned long long* scales,
                                const unsigned long long* biases, const int* ids, const float* x, float* y,
                                int out_dim, int in_dim, int group, int x_div) {
    int b = blockIdx.y, e = ids[b];
    gemv_affine<S, BITS, 2, 1, HALVES>(reinterpret_cast<const unsigned*>(packed[e]), reinterpret_cast<const S*>(scales[e]),
                               reinterpret_cast<const S*>(biases[e]), x + (size_t)(b / x_div) * in_dim, nullptr,
                               y + (size_t)b * out_dim, out_dim, in_dim, group, 1);
}
#define MOE_GEMV_AFFINE(F, S, B, H)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) moe_gemv_##F(                                                \
        const unsigned long long* p, const unsigned long long* s, const unsigned long long* bi, const int* ids,    \
        const float* x, float* y, int o, int i, int g, int x_div) {                                                \
        grid_dependency_wait();                                                                                    \
        moe_gemv_affine<S, B, H>(p, s, bi, ids, x, y, o, i, g, x_div);                                             \
    }
#define MOE_AFFINE_FORMATS(B)                                                                                      \
    MOE_GEMV_AFFINE(affine##B, float, B, false)                                                                    \
    MOE_GEMV_AFFINE(affine##B##_bf16, __nv_bfloat16, B, false)                                                     \
    MOE_GEMV_AFFINE(affine##B##_g16, float, B, true)
FOR_AFFINE_BITS(MOE_AFFINE_FORMATS)
MOE_GEMV_AFFINE(affine4_k, KScales, 4, false)
MOE_GEMV_AFFINE(affine5_k, KScales, 5, false)
MOE_GEMV_AFFINE(affine2_k_g16, K2Scales, 2, true)
MOE_GEMV_AFFINE(affine3_k_g16, K3Scales, 3, true)
MOE_GEMV_AFFINE(affine6_k_g16, K6Scales, 6, true)

// out[t] = Σ_s weights[t·k + s] · y[t·k + s]   (one block per token).
extern "C" __global__ void moe_combine(const float* y, const float* weights, float* out, int top_k, int cols) {
    grid_dependency_wait();
    int t = blockIdx.x;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < top_k; s++) acc += weights[t * top_k + s] * y[((size_t)t * top_k + s) * cols + c];
        out[(size_t)t * cols + c] = acc;
    }
}

// ---------------------------------------------------------------------------
// Routed experts of a decode step in two kernels after moe_route (moe.rs
// `moe_on_device`), where the plain path took four (gate GEMV, up GEMV,
// silu·mul, down GEMV) and a combine:
//
// moe_swiglu_{F}: block (outputs o0..o0+MOE_ROWS-1, entry b = token·k + s)
//   writes silu(gate_e·x)·(up_e·x) for expert e = ids[b] and the entry's
//   token row x: the gate rows and the up rows stream side by side, so each
//   thread has 2·MOE_ROWS rows' chunks in flight.
// moe_down_{F}: block (outputs o0..o0+MOE_ROWS-1, token t) writes
//   Σ_s weights[t·k + s] · down_{ids[t·k + s]}·h[t·k + s]: the combine folded
//   into the GEMV, the token's k experts' rows read by one block, whose threads
//   take (expert, chunk) items (k·in_dim/32 of them at 4 bits: 192 for
//   Qwen3-30B-A3B, one a thread), so all its loads are independent.
//
// Chunks and their arithmetic are the CUDA-core GEMVs' (affine.cuh:
// affine_chunk_dot for affine levels, gemv.cuh: gemv_chunk for floats); every output is
// each row's dot, scaled and summed over the block as gemv_store does.
// MOE_ROWS comes from constants.cuh.

// One 32-value chunk `i` of R affine rows (their levels, scales and biases
// from row starts w, s, b) against x: acc[r] += row r · x.
template <typename S, int BITS, bool HALVES, int R>
__device__ __forceinline__ void moe_affine_chunk(const unsigned* const (&w)[R], const S* const (&s)[R],
                                                 const S* const (&b)[R], const float* __restrict__ x, int i,
                                                 int in_dim, int group, float (&acc)[R][1]) {
    int g = i * 32 / group;
    unsigned words[R][BITS];
    float sc[R], bi[R], sc2[R], bi2[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        affine_chunk<BITS>(w[r], i, words[r]);
        sc[r] = affine_scale(s[r], g);
        bi[r] = affine_bias(s[r], b[r], g);
        sc2[r] = HALVES ? affine_scale(s[r], g + 1) : 0.0f;
        bi2[r] = HALVES ? affine_bias(s[r], b[r], g + 1) : 0.0f;
    }
    affine_chunk_dot<BITS, R, 1, HALVES>(words, sc, bi, sc2, bi2, x, i * 32, in_dim, 1, acc);
}

// Row starts r = FROM..FROM+N-1 (output rows[r]) of expert `e`'s levels,
// scales and biases (from its tables).
template <typename S, int BITS, int FROM, int N, int R>
__device__ __forceinline__ void moe_affine_rows(const unsigned long long* packed, const unsigned long long* scales,
                                                const unsigned long long* biases, int e, const int (&rows)[R],
                                                int in_dim, int group, const unsigned* (&w)[R], const S* (&s)[R],
                                                const S* (&b)[R]) {
    size_t words = (size_t)in_dim / 32 * BITS, groups = (size_t)in_dim / group;
#pragma unroll
    for (int r = FROM; r < FROM + N; r++) {
        w[r] = reinterpret_cast<const unsigned*>(packed[e]) + rows[r] * words;
        s[r] = affine_row_side(reinterpret_cast<const S*>(scales[e]), rows[r], groups);
        b[r] = affine_row_side(reinterpret_cast<const S*>(biases[e]), rows[r], groups);
    }
}

template <typename S, int BITS, bool HALVES>
__device__ void moe_swiglu_affine(const unsigned long long* gp, const unsigned long long* gs,
                                  const unsigned long long* gb, const unsigned long long* up,
                                  const unsigned long long* us, const unsigned long long* ub, const int* ids,
                                  const float* x, float* y, int width, int in_dim, int group, int top_k) {
    constexpr int R = 2 * MOE_ROWS;
    int entry = blockIdx.y, e = ids[entry], o0 = blockIdx.x * MOE_ROWS;
    int rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = min(o0 + r % MOE_ROWS, width - 1);
    const unsigned* w[R];
    const S* s[R];
    const S* b[R];
    moe_affine_rows<S, BITS, 0, MOE_ROWS>(gp, gs, gb, e, rows, in_dim, group, w, s, b);         // gate rows
    moe_affine_rows<S, BITS, MOE_ROWS, MOE_ROWS>(up, us, ub, e, rows, in_dim, group, w, s, b);  // up rows
    const float* xr = x + (size_t)(entry / top_k) * in_dim;
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.0f;
    for (int i = threadIdx.x; i < in_dim / 32; i += blockDim.x)
        moe_affine_chunk<S, BITS, HALVES, R>(w, s, b, xr, i, in_dim, group, acc);
    gemv_store<R, 1, true>(acc, nullptr, y + (size_t)entry * width, o0, width, 1);
}

template <typename S, int BITS, bool HALVES>
__device__ void moe_down_affine(const unsigned long long* packed, const unsigned long long* scales,
                                const unsigned long long* biases, const int* ids, const float* weights,
                                const float* h, float* out, int out_dim, int in_dim, int group, int top_k) {
    constexpr int R = MOE_ROWS;
    int t = blockIdx.y, o0 = blockIdx.x * R, chunks = in_dim / 32;
    int rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = min(o0 + r, out_dim - 1);
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.0f;
    for (int item = threadIdx.x; item < top_k * chunks; item += blockDim.x) {
        int entry = t * top_k + item / chunks, i = item % chunks;
        const unsigned* w[R];
        const S* s[R];
        const S* b[R];
        moe_affine_rows<S, BITS, 0, R>(packed, scales, biases, ids[entry], rows, in_dim, group, w, s, b);
        float d[R][1];
#pragma unroll
        for (int r = 0; r < R; r++) d[r][0] = 0.0f;
        moe_affine_chunk<S, BITS, HALVES, R>(w, s, b, h + (size_t)entry * in_dim, i, in_dim, group, d);
        float wt = weights[entry];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r][0] += wt * d[r][0];
    }
    gemv_store<R, 1>(acc, nullptr, out + (size_t)t * out_dim, o0, out_dim, 1);
}

#define MOE_AFFINE_FUSED(F, S, B, H)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) moe_swiglu_##F(                                              \
        const unsigned long long* gp, const unsigned long long* gs, const unsigned long long* gb,                  \
        const unsigned long long* up, const unsigned long long* us, const unsigned long long* ub, const int* ids,  \
        const float* x, float* y, int width, int in_dim, int group, int top_k) {                                   \
        grid_dependency_wait();                                                                                    \
        moe_swiglu_affine<S, B, H>(gp, gs, gb, up, us, ub, ids, x, y, width, in_dim, group, top_k);                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) moe_down_##F(                                                \
        const unsigned long long* p, const unsigned long long* s, const unsigned long long* bi, const int* ids,    \
        const float* wts, const float* h, float* out, int out_dim, int in_dim, int group, int top_k) {             \
        grid_dependency_wait();                                                                                    \
        moe_down_affine<S, B, H>(p, s, bi, ids, wts, h, out, out_dim, in_dim, group, top_k);                       \
    }
#define MOE_FUSED_FORMATS(B)                                                                                       \
    MOE_AFFINE_FUSED(affine##B, float, B, false)                                                                   \
    MOE_AFFINE_FUSED(affine##B##_bf16, __nv_bfloat16, B, false)                                                    \
    MOE_AFFINE_FUSED(affine##B##_g16, float, B, true)
FOR_AFFINE_BITS(MOE_FUSED_FORMATS)
MOE_AFFINE_FUSED(affine4_k, KScales, 4, false)
MOE_AFFINE_FUSED(affine5_k, KScales, 5, false)
MOE_AFFINE_FUSED(affine2_k_g16, K2Scales, 2, true)
MOE_AFFINE_FUSED(affine3_k_g16, K3Scales, 3, true)
MOE_AFFINE_FUSED(affine6_k_g16, K6Scales, 6, true)

// Float experts (bf16, f16, f32 matrices from a table of pointers): the same
// two kernels over 16-byte chunks of VEC values (rows a whole number of them).
template <typename T, int VEC, int R>
__device__ __forceinline__ void moe_float_chunk(const T* const (&w)[R], const float* __restrict__ x, int i, int in_dim,
                                                float (&acc)[R][1]) {
    uint4 packed[R];
#pragma unroll
    for (int r = 0; r < R; r++) packed[r] = __ldcs(reinterpret_cast<const uint4*>(w[r]) + i);
    gemv_chunk<T, VEC, R, 1>(packed, x, i * VEC, in_dim, 1, acc);
}

template <typename T, int VEC>
__device__ void moe_swiglu_float(const unsigned long long* gate, const unsigned long long* up, const int* ids,
                                 const float* x, float* y, int width, int in_dim, int top_k) {
    constexpr int R = 2 * MOE_ROWS;
    int entry = blockIdx.y, e = ids[entry], o0 = blockIdx.x * MOE_ROWS;
    const T* w[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        w[r] = reinterpret_cast<const T*>(r < MOE_ROWS ? gate[e] : up[e]) +
               (size_t)min(o0 + r % MOE_ROWS, width - 1) * in_dim;
    const float* xr = x + (size_t)(entry / top_k) * in_dim;
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.0f;
    for (int i = threadIdx.x; i < in_dim / VEC; i += blockDim.x) moe_float_chunk<T, VEC, R>(w, xr, i, in_dim, acc);
    gemv_store<R, 1, true>(acc, nullptr, y + (size_t)entry * width, o0, width, 1);
}

template <typename T, int VEC>
__device__ void moe_down_float(const unsigned long long* table, const int* ids, const float* weights, const float* h,
                               float* out, int out_dim, int in_dim, int top_k) {
    constexpr int R = MOE_ROWS;
    int t = blockIdx.y, o0 = blockIdx.x * R, chunks = in_dim / VEC;
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.0f;
    for (int item = threadIdx.x; item < top_k * chunks; item += blockDim.x) {
        int entry = t * top_k + item / chunks, i = item % chunks;
        const T* w[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            w[r] = reinterpret_cast<const T*>(table[ids[entry]]) + (size_t)min(o0 + r, out_dim - 1) * in_dim;
        float d[R][1];
#pragma unroll
        for (int r = 0; r < R; r++) d[r][0] = 0.0f;
        moe_float_chunk<T, VEC, R>(w, h + (size_t)entry * in_dim, i, in_dim, d);
        float wt = weights[entry];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r][0] += wt * d[r][0];
    }
    gemv_store<R, 1>(acc, nullptr, out + (size_t)t * out_dim, o0, out_dim, 1);
}

#define MOE_FLOAT_FUSED(F, T, VEC)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) moe_swiglu_##F(const unsigned long long* gate,               \
                                                                     const unsigned long long* up, const int* ids, \
                                                                     const float* x, float* y, int width,          \
                                                                     int in_dim, int top_k) {                      \
        grid_dependency_wait();                                                                                    \
        moe_swiglu_float<T, VEC>(gate, up, ids, x, y, width, in_dim, top_k);                                       \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) moe_down_##F(const unsigned long long* table, const int* ids, \
                                                                   const float* wts, const float* h, float* out,   \
                                                                   int out_dim, int in_dim, int top_k) {           \
        grid_dependency_wait();                                                                                    \
        moe_down_float<T, VEC>(table, ids, wts, h, out, out_dim, in_dim, top_k);                                   \
    }
MOE_FLOAT_FUSED(bf16, __nv_bfloat16, 8)
MOE_FLOAT_FUSED(f16, __half, 8)
MOE_FLOAT_FUSED(f32, float, 4)

// ---------------------------------------------------------------------------
// Routed experts of a prefill on the device (moe_prefill.rs), after
// moe_route: the (token, choice) entries sorted by expert, each expert's rows
// through the grouped GEMM (moe_gemm.cu) or one cuBLAS GEMM, and the outputs
// summed back per token.
//
// moe_count: counts[e] = entries routed to e (counts zeroed before).
extern "C" __global__ void moe_count(const int* ids, int entries, int* counts) {
    grid_dependency_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < entries) atomicAdd(&counts[ids[i]], 1);
}

// moe_offsets (one warp): offsets[e] = Σ counts[e' < e], offsets[experts] =
// the entries; cursors start at the offsets. With tiles, also the grouped
// GEMM's segment tiles (moe_gemm.cu): each expert's rows in tiles of up to
// tile_rows, (expert, first row, end row, 0) in expert order, and their
// number in n_tiles (so the GEMM needs no counts on the host).
extern "C" __global__ void moe_offsets(const int* counts, int experts, int* offsets, int* cursors, int4* tiles,
                                       int* n_tiles, int tile_rows) {
    grid_dependency_wait();
    int lane = threadIdx.x & 31, per = (experts + 31) / 32;
    int beg = min(lane * per, experts), end = min(beg + per, experts), local = 0, local_tiles = 0;
    for (int e = beg; e < end; e++) {
        local += counts[e];
        local_tiles += (counts[e] + tile_rows - 1) / tile_rows;
    }
    int incl = local, incl_tiles = local_tiles;
    for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, incl, o), vt = __shfl_up_sync(0xffffffffu, incl_tiles, o);
        if (lane >= o) {
            incl += v;
            incl_tiles += vt;
        }
    }
    int run = incl - local, tile = incl_tiles - local_tiles;
    for (int e = beg; e < end; e++) {
        offsets[e] = run;
        cursors[e] = run;
        if (tiles)
            for (int r = 0; r < counts[e]; r += tile_rows)
                tiles[tile++] = make_int4(e, run + r, run + min(r + tile_rows, counts[e]), 0);
        run += counts[e];
    }
    if (lane == 31) {
        offsets[experts] = incl;
        if (n_tiles) *n_tiles = incl_tiles;
    }
}

// moe_scatter_{bf16,f16}: block b = entry (token b / top_k) takes the next
// row of its expert's segment (pos[b]) and writes the token's x there in the
// GEMM's input type (hi), and with lo the remainder x − hi too (as
// f32_split_*). Rows within a segment land in whatever order the atomics
// give; each GEMM output row depends on its own input row only, and the
// combine reads them back by pos, so the result does not depend on it.
__device__ __forceinline__ __nv_bfloat16 moe_narrow(float v, __nv_bfloat16*) { return __float2bfloat16(v); }
__device__ __forceinline__ __half moe_narrow(float v, __half*) { return __float2half(v); }
template <typename T>
__device__ void moe_scatter(const int* ids, const float* x, int cols, int top_k, int* cursors, int* pos, T* hi,
                            T* lo) {
    __shared__ int slot;
    int entry = blockIdx.x;
    if (threadIdx.x == 0) {
        slot = atomicAdd(&cursors[ids[entry]], 1);
        pos[entry] = slot;
    }
    __syncthreads();
    const float* xr = x + (size_t)(entry / top_k) * cols;
    T* h = hi + (size_t)slot * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = xr[c];
        T a = moe_narrow(v, h);
        h[c] = a;
        if (lo) lo[(size_t)slot * cols + c] = moe_narrow(v - to_f32(a), h);
    }
}
extern "C" __global__ void moe_scatter_bf16(const int* ids, const float* x, int cols, int top_k, int* cursors,
                                            int* pos, __nv_bfloat16* hi, __nv_bfloat16* lo) {
    grid_dependency_wait();
    moe_scatter(ids, x, cols, top_k, cursors, pos, hi, lo);
}
extern "C" __global__ void moe_scatter_f16(const int* ids, const float* x, int cols, int top_k, int* cursors,
                                           int* pos, __half* hi, __half* lo) {
    grid_dependency_wait();
    moe_scatter(ids, x, cols, top_k, cursors, pos, hi, lo);
}

// moe_gather_combine: block t writes out[t] = Σ weights[t·k + s]·y[pos[t·k +
// s]] over the token's choices in ascending expert order (the order in which
// the CPU backend, and the reference's index_add_, add the experts in).
// MOE_MAX_TOP_K comes from constants.cuh.
extern "C" __global__ void moe_gather_combine(const float* y, const int* ids, const int* pos, const float* weights,
                                              float* out, int top_k, int cols) {
    grid_dependency_wait();
    __shared__ int order[MOE_MAX_TOP_K];
    int t = blockIdx.x;
    const int* id = ids + (size_t)t * top_k;
    if (threadIdx.x < top_k) {
        // Rank of choice s by (expert, s): the experts of a token differ.
        int s = threadIdx.x, rank = 0;
        for (int j = 0; j < top_k; j++) rank += id[j] < id[s] || (id[j] == id[s] && j < s);
        order[rank] = s;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float sum = 0.0f;
        for (int r = 0; r < top_k; r++) {
            int entry = t * top_k + order[r];
            sum += weights[entry] * y[(size_t)pos[entry] * cols + c];
        }
        out[(size_t)t * cols + c] = sum;
    }
}
