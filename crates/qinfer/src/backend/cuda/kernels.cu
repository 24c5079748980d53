// qinfer's CUDA kernels, compiled at run time by NVRTC for the device's
// architecture. Activations are f32 row-major [rows, cols]; weights are stored
// as in the checkpoint (bf16, f16 or f32) and converted as they are read. Each
// kernel's CPU reference is the CPU backend's op of the same name.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Programmatic dependent launch (sm_90 and later). Every kernel is launched
// with programmatic stream serialization, so it may be scheduled while the
// kernel before it in the stream is still running. Each kernel calls this
// first: it blocks until that kernel has finished and its writes are visible
// (so, transitively, every earlier one), and then lets the next kernel be
// scheduled. What runs ahead of it is the launch itself and, in the kernels
// that do it (the affine tensor-core GEMV, RMSNorm, the q|k|v prologue),
// reading weights, which no kernel writes; the decode attention reads the
// step inputs and the KV rows that earlier passes wrote (and, folding the
// prologue, the norm weights and its rotations' cos/sin at the step's position). Letting the next kernel go only
// after the wait keeps at most one kernel waiting behind a running one.
// tests/kernel_sources.rs checks every kernel against these rules.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

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

// A shared-memory pointer as the 32-bit address PTX's shared-space
// instructions (ldmatrix, cp.async) take.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// BYTES (4, 8 or 16) global → shared with cp.async, zero-filled when `valid`
// is false; 16-byte copies bypass L1.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "r"(valid ? 16 : 0));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "n"(BYTES), "r"(valid ? BYTES : 0));
}

#if __CUDA_ARCH__ >= 900
// (sm_90 and later.) An mbarrier in shared memory that one arrival (with the bytes a bulk copy
// will deliver) completes: the bulk copy's own completion, tracked apart
// from every cp.async group the thread committed before it.
__device__ __forceinline__ void mbar_init(unsigned bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) global → shared by
// the copy engine (one instruction for the whole range), completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
#endif

// An L2 policy that evicts the lines it tags first: for weights a decode step
// streams once, so that they leave L2 before the step's activations and
// caches do (8B q8g64 decode +1.2% in runs 78 and 79; q4g64 +0.1% in run 78,
// unchanged in run 79).
__device__ __forceinline__ unsigned long long l2_evict_first() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// A 16-byte cp.async (bypassing L1) whose L2 lines take `policy`.
__device__ __forceinline__ void cp_async_hinted(void* dst, const void* src, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "l"(policy));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One halving of a warp's reduce-scatter of per-lane sums d[0..2·HALF): the
// lane keeps the half named by its bit HALF and adds its partner's copy of
// it, into d[0..HALF).
template <int HALF>
__device__ __forceinline__ void reduce_scatter_half(float* d, int lane) {
    bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        float keep = upper ? d[i + HALF] : d[i], give = upper ? d[i] : d[i + HALF];
        d[i] = keep + __shfl_xor_sync(0xffffffffu, give, HALF);
    }
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

// Maximum over a block (block_sum's pattern; −inf where there is nothing).
__device__ float block_max(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int nwarps = blockDim.x >> 5;
    v = (threadIdx.x < nwarps) ? partial[threadIdx.x] : -__int_as_float(0x7f800000);
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
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
extern "C" __global__ void embed_bf16(const __nv_bfloat16* t, const unsigned* ids, float* o, int c) {
    grid_dependency_wait();
    embed(t, ids, o, c);
}
extern "C" __global__ void embed_f16(const __half* t, const unsigned* ids, float* o, int c) {
    grid_dependency_wait();
    embed(t, ids, o, c);
}
extern "C" __global__ void embed_f32(const float* t, const unsigned* ids, float* o, int c) {
    grid_dependency_wait();
    embed(t, ids, o, c);
}

// ---------------------------------------------------------------------------
// Decode GEMV for a few activation rows: y[t][o] = Σ_c W[o][c] x[t][c] (+ bias).
// A block computes ROWS consecutive output rows. Its threads stride over the
// rows' columns together in 16-byte chunks (8 bf16/f16 values or 4 f32), each
// thread reading the same columns of all ROWS rows, so one read of x serves
// ROWS rows and ROWS·GEMV_UNROLL independent loads are in flight per thread:
// memory bound by design, and HBM needs tens of KB in flight per SM. ACT is
// the activation rows' compile-time bound (1 for plain decode). The block then
// sums its threads' partial dot products. The bias may be y itself (one
// activation row): each output reads its bias just before writing itself,
// which is how a block's last projection adds into the residual stream.
#define GEMV_MAX_ROWS 8
#define GEMV_UNROLL 4

template <typename T, int VEC, int ROWS, int ACT>
__device__ __forceinline__ void gemv_chunk(const uint4 (&packed)[ROWS], const float* __restrict__ x, int c,
                                           int in_dim, int n_act, float (&acc)[ROWS][ACT]) {
#pragma unroll
    for (int t = 0; t < ACT; t++) {
        if (t < n_act) {
            float xv[VEC];
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + c);
#pragma unroll
            for (int j = 0; j < VEC / 4; j++) {
                float4 v = xr[j];
                xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const T* wv = reinterpret_cast<const T*>(&packed[r]);
#pragma unroll
                for (int j = 0; j < VEC; j++) acc[r][t] += to_f32(wv[j]) * xv[j];
            }
        }
    }
}

// The end of both GEMVs: each thread's partial dot products summed over the
// block, y[t][row0 + r] = Σ + bias for the block's rows. PAIRED: the block's
// rows are ROWS/2 gate rows then the matching up rows of a stacked gate|up
// weight, and y[t][row0 + r] = silu(gate)·up (as the swiglu kernel).
template <int ROWS, int ACT, bool PAIRED = false>
__device__ __forceinline__ void gemv_store(const float (&acc)[ROWS][ACT], const float* bias,
                                           float* y, int row0, int out_dim, int n_act) {
    __shared__ float partial[32][ROWS * ACT];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) {
            float v = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r * ACT + t] = v;
        }
    __syncthreads();
    if constexpr (PAIRED) {
        constexpr int HALF = ROWS / 2;
        if (threadIdx.x < HALF * ACT) {
            int r = threadIdx.x / ACT, t = threadIdx.x % ACT, o = row0 + r;
            float g = 0.0f, u = 0.0f;
            for (int k = 0; k < warps; k++) {
                g += partial[k][threadIdx.x];
                u += partial[k][HALF * ACT + threadIdx.x];
            }
            if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = g / (1.0f + expf(-g)) * u;
        }
        return;
    }
    if (threadIdx.x < ROWS * ACT) {
        int r = threadIdx.x / ACT, t = threadIdx.x % ACT, o = row0 + r;
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += partial[k][threadIdx.x];
        if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = sum + (bias ? bias[o] : 0.0f);
    }
}

// PAIRED: `w` is a stacked gate|up weight of 2·out_dim rows and y is
// silu(gate)·up, out_dim wide (see gemv_store).
template <typename T, int VEC, int ROWS, int ACT, bool PAIRED = false>
__device__ void gemv(const T* __restrict__ w, const float* __restrict__ x, const float* bias,
                     float* y, int out_dim, int in_dim, int n_act) {
    constexpr int UNITS = PAIRED ? ROWS / 2 : ROWS;  // outputs per block
    int row0 = blockIdx.x * UNITS;
    const T* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        rows[r] = w + ((size_t)min(row0 + r % UNITS, out_dim - 1) + (size_t)(r / UNITS) * out_dim) * in_dim;
    float acc[ROWS][ACT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) acc[r][t] = 0.0f;
    // 16-byte chunks need every row 16-byte aligned: in_dim a multiple of VEC.
    int chunks = in_dim % VEC == 0 ? in_dim / VEC : 0;
    int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + (GEMV_UNROLL - 1) * stride < chunks; i += GEMV_UNROLL * stride) {
        uint4 packed[GEMV_UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                packed[u][r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i + u * stride);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
            gemv_chunk<T, VEC, ROWS, ACT>(packed[u], x, (i + u * stride) * VEC, in_dim, n_act, acc);
    }
    for (; i < chunks; i += stride) {
        uint4 packed[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) packed[r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i);
        gemv_chunk<T, VEC, ROWS, ACT>(packed, x, i * VEC, in_dim, n_act, acc);
    }
    for (int c = chunks * VEC + threadIdx.x; c < in_dim; c += stride) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float wv = to_f32(rows[r][c]);
            for (int t = 0; t < n_act && t < ACT; t++) acc[r][t] += wv * x[(size_t)t * in_dim + c];
        }
    }
    gemv_store<ROWS, ACT, PAIRED>(acc, bias, y, row0, out_dim, n_act);
}

#define GEMV_KERNEL(NAME, T, VEC, ROWS, ACT, PAIRED)                                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME(const T* w, const float* x, const float* b, float* y,    \
                                                           int o, int i, int n) {                                  \
        grid_dependency_wait();                                                                                    \
        gemv<T, VEC, ROWS, ACT, PAIRED>(w, x, b, y, o, i, n);                                                      \
    }
// `_swiglu`: the PAIRED form, for a stacked gate|up weight (rows_per_block
// counts weight rows, half of them gate rows).
#define GEMV_KERNELS(NAME, T, VEC)                                                                                 \
    GEMV_KERNEL(NAME##_r1a1, T, VEC, 1, 1, false)                                                                  \
    GEMV_KERNEL(NAME##_r2a1, T, VEC, 2, 1, false)                                                                  \
    GEMV_KERNEL(NAME##_r4a1, T, VEC, 4, 1, false)                                                                  \
    GEMV_KERNEL(NAME##_r1a8, T, VEC, 1, GEMV_MAX_ROWS, false)                                                      \
    GEMV_KERNEL(NAME##_r2a8, T, VEC, 2, GEMV_MAX_ROWS, false)                                                      \
    GEMV_KERNEL(NAME##_r2a1_swiglu, T, VEC, 2, 1, true)                                                            \
    GEMV_KERNEL(NAME##_r4a1_swiglu, T, VEC, 4, 1, true)                                                            \
    GEMV_KERNEL(NAME##_r2a8_swiglu, T, VEC, 2, GEMV_MAX_ROWS, true)
GEMV_KERNELS(gemv_bf16, __nv_bfloat16, 8)
GEMV_KERNELS(gemv_f16, __half, 8)
GEMV_KERNELS(gemv_f32, float, 4)

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

// One activation row against many weight rows, x held in registers: each
// thread keeps two 32-value chunks of x (with their sums) for the whole block, which walks AFFINE_BLOCK_ROWS weight rows two at
// a time, loading the next two rows' levels while it works on these. No x
// traffic per row, so about three instructions per weight. For in_dim up to
// 64 values per thread × 256 threads.
#define AFFINE_BLOCK_ROWS 8

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
// Every affine bit width qinfer reads (affine::SUPPORTED_BITS).
#define FOR_AFFINE_BITS(M) M(2) M(3) M(4) M(5) M(6) M(8)
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

// Activations to the weight's type for a cuBLAS GEMM.
extern "C" __global__ void f32_to_bf16(const float* x, __nv_bfloat16* y, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}
extern "C" __global__ void f32_to_f16(const float* x, __half* y, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(x[i]);
}

// x ≈ hi + lo in two bf16 (or f16) halves: a GEMM over each, summed, sees the
// activations to about 16 bits instead of 8.
extern "C" __global__ void f32_split_bf16(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    __nv_bfloat16 h = __float2bfloat16(x[i]);
    hi[i] = h;
    lo[i] = __float2bfloat16(x[i] - __bfloat162float(h));
}
extern "C" __global__ void f32_split_f16(const float* x, __half* hi, __half* lo, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half h = __float2half(x[i]);
    hi[i] = h;
    lo[i] = __float2half(x[i] - __half2float(h));
}

// y[r][c] += bias[c]
extern "C" __global__ void add_bias(float* y, const float* bias, int cols, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] += bias[i % cols];
}

// ---------------------------------------------------------------------------
// RMSNorm over each group of `group` values: out = x·rsqrt(mean(x²)+eps)·w,
// one block per group. With `y`, first x += y, written back (the residual add
// before the norm, fused). With `z`, the gated form: ·silu(z) (the Gated
// DeltaNet output norm). Groups of a multiple of 4 values are read as float4
// and up to NORM_HELD of them per thread stay in registers between the sum of
// squares and the output.
#define NORM_HELD 4
__device__ __forceinline__ float norm_out(float v, float inv, float w, const float* z, size_t i) {
    float o = w * (v * inv);
    if (z) {
        float g = z[i];
        o *= g / (1.0f + expf(-g));
    }
    return o;
}

// The weights of the values a thread holds are read before the wait for the
// kernel before (no kernel writes them), so that read is off the path from
// the inputs' arrival to the output.
__device__ void rms_norm_group(float* x, const float* y, const float* w, const float* z, float* out, int group,
                               float eps) {
    size_t base = (size_t)blockIdx.x * group;
    float ss = 0.0f;
    if (group % 4 == 0) {
        int n4 = group / 4;
        float4* x4 = reinterpret_cast<float4*>(x + base);
        const float4* y4 = reinterpret_cast<const float4*>(y + base);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* out4 = reinterpret_cast<float4*>(out + base);
        float4 held[NORM_HELD], held_w[NORM_HELD];
#pragma unroll
        for (int k = 0; k < NORM_HELD; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) held_w[k] = w4[i];
        }
        grid_dependency_wait();
        auto load = [&](int i) {
            float4 v = x4[i];
            if (y) {
                float4 a = y4[i];
                v.x += a.x; v.y += a.y; v.z += a.z; v.w += a.w;
                x4[i] = v;
            }
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            return v;
        };
        auto store = [&](int i, float4 v, float4 wv, float inv) {
            size_t o = base + 4 * i;
            out4[i] = make_float4(norm_out(v.x, inv, wv.x, z, o), norm_out(v.y, inv, wv.y, z, o + 1),
                                  norm_out(v.z, inv, wv.z, z, o + 2), norm_out(v.w, inv, wv.w, z, o + 3));
        };
#pragma unroll
        for (int k = 0; k < NORM_HELD; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) held[k] = load(i);
        }
        for (int i = threadIdx.x + NORM_HELD * blockDim.x; i < n4; i += blockDim.x) load(i);
        ss = block_sum(ss);
        float inv = rsqrtf(ss / group + eps);
#pragma unroll
        for (int k = 0; k < NORM_HELD; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) store(i, held[k], held_w[k], inv);
        }
        for (int i = threadIdx.x + NORM_HELD * blockDim.x; i < n4; i += blockDim.x) store(i, x4[i], w4[i], inv);
        return;
    }
    grid_dependency_wait();
    for (int c = threadIdx.x; c < group; c += blockDim.x) {
        float v = x[base + c];
        if (y) {
            v += y[base + c];
            x[base + c] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = rsqrtf(ss / group + eps);
    for (int c = threadIdx.x; c < group; c += blockDim.x) out[base + c] = norm_out(x[base + c], inv, w[c], z, base + c);
}

extern "C" __global__ void rms_norm(float* x, const float* y, const float* w, const float* z, float* out, int group,
                                    float eps) {
    rms_norm_group(x, y, w, z, out, group, eps);
}

// The pass's inputs on the device, so a recorded decode step (CUDA graph) can
// be replayed at any position: step[0] is the first row's position, step[1]
// the token id of a one-token pass. Set by a launch before the pass (or the
// replay), never baked into the recorded kernels' arguments.
extern "C" __global__ void set_step(int* step, int start, int id) {
    grid_dependency_wait();
    step[0] = start;
    step[1] = id;
}

// The rotation of pair i at position pos (angle in f32 as the reference
// computes it, cos/sin in double so large positions keep their precision).
__device__ __forceinline__ float2 rope_angle(int pos, float inv_freq) {
    float angle = (float)pos * inv_freq;
    return make_float2((float)cos((double)angle), (float)sin((double)angle));
}

// Pair i rotated by the angle's (cos, sin).
__device__ __forceinline__ void rotate_pair(float* head, int i, float2 cs, int half, int style) {
    int ia = style == 0 ? i : 2 * i, ib = style == 0 ? i + half : 2 * i + 1;
    float a = head[ia], b = head[ib];
    head[ia] = a * cs.x - b * cs.y;
    head[ib] = b * cs.x + a * cs.y;
}

__device__ __forceinline__ void rope_pair(float* head, int i, int pos, float inv_freq, int half, int style) {
    rotate_pair(head, i, rope_angle(pos, inv_freq), half, style);
}

// RoPE in place on every head of every row; one thread per rotated pair.
// style 0: rotate_half (i, i + rot/2); style 1: adjacent pairs (2i, 2i+1).
// Row r is at position step[0] + r.
extern "C" __global__ void rope(float* x, const int* step, const float* inv_freq, int rows, int cols,
                                int head_dim, int rotary_dim, int style) {
    grid_dependency_wait();
    int half = rotary_dim / 2;
    int heads = cols / head_dim;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)rows * heads * half) return;
    int i = idx % half;
    int h = (idx / half) % heads;
    int r = idx / ((long)half * heads);
    rope_pair(x + (size_t)r * cols + (size_t)h * head_dim, i, step[0] + r, inv_freq[i], half, style);
}

// The KV cache holds f32 or f16 values (mod.rs `KvPrecision`): f16 halves
// the bytes every decode step reads (and the prefill's tensor cores take f16
// keys and values as they lie). A value is rounded once, where it is written;
// the arithmetic on it stays in f32.
__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void kv_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_store(__half* p, float v) { *p = __float2half_rn(v); }
// Four consecutive values (16- or 8-byte aligned) as a float4.
__device__ __forceinline__ float4 kv_load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 kv_load4(const __half* p) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}

// The attention prologue from a stacked q|k|v projection, one block per
// (row, head) over the query heads then the KV heads: the head's values
// (after the gate, for q_proj rows holding [query, gate] per head) RMS-normed
// with `q_norm`/`k_norm` when given, rotated at position step[0] + row, and
// written to `q_out`, or for KV heads the key to the cache with the value
// beside it. Same arithmetic as rms_norm then rope then kv_append. The norm
// weight and the rotation frequency of each thread's first value are read
// before the wait for the kernel before (no kernel writes them).
template <typename T>
__device__ void qkv_prologue_head(const float* qkv, float* q_out, float* gate_out, T* keys, T* values,
                                  const float* q_norm, const float* k_norm, const float* inv_freq, const int* step,
                                  int num_heads, int num_kv_heads, int head_dim, int output_gate, float eps,
                                  int rotary_dim, int style) {
    extern __shared__ float head[];
    int t = blockIdx.x, hh = blockIdx.y;
    int q_rows = num_heads * head_dim * (output_gate ? 2 : 1), kv_dim = num_kv_heads * head_dim;
    const float* row = qkv + (size_t)t * (q_rows + 2 * kv_dim);
    bool is_q = hh < num_heads;
    int kh = hh - num_heads;
    const float* src = is_q ? row + (size_t)hh * head_dim * (output_gate ? 2 : 1) : row + q_rows + kh * head_dim;
    const float* w = is_q ? q_norm : k_norm;
    int half = rotary_dim / 2, c0 = threadIdx.x;
    float w0 = w && c0 < head_dim ? w[c0] : 1.0f, freq0 = c0 < half ? inv_freq[c0] : 0.0f;
    grid_dependency_wait();
    int pos = step[0] + t;
    if (!is_q) {
        const float* v = row + q_rows + kv_dim + kh * head_dim;
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x)
            kv_store(values + (size_t)pos * kv_dim + kh * head_dim + c, v[c]);
    } else if (output_gate) {
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x)
            gate_out[((size_t)t * num_heads + hh) * head_dim + c] = src[head_dim + c];
    }
    float inv = 1.0f;
    if (w) {
        float ss = 0.0f;
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) ss += src[c] * src[c];
        inv = rsqrtf(block_sum(ss) / head_dim + eps);
    }
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x)
        head[c] = w ? (c == c0 ? w0 : w[c]) * (src[c] * inv) : src[c];
    __syncthreads();
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_pair(head, i, pos, i == c0 ? freq0 : inv_freq[i], half, style);
    __syncthreads();
    if (is_q) {
        float* dst = q_out + ((size_t)t * num_heads + hh) * head_dim;
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) dst[c] = head[c];
    } else {
        T* dst = keys + (size_t)pos * kv_dim + kh * head_dim;
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) kv_store(dst + c, head[c]);
    }
}

#define QKV_PROLOGUE(NAME, T)                                                                                      \
    extern "C" __global__ void NAME(const float* qkv, float* q_out, float* gate_out, T* keys, T* values,          \
                                    const float* q_norm, const float* k_norm, const float* inv_freq,             \
                                    const int* step, int num_heads, int num_kv_heads, int head_dim,              \
                                    int output_gate, float eps, int rotary_dim, int style) {                     \
        qkv_prologue_head<T>(qkv, q_out, gate_out, keys, values, q_norm, k_norm, inv_freq, step, num_heads,       \
                             num_kv_heads, head_dim, output_gate, eps, rotary_dim, style);                        \
    }
QKV_PROLOGUE(qkv_prologue, float)
QKV_PROLOGUE(qkv_prologue_f16, __half)

// Rows of k and v into the cache at positions step[0].. (one thread per value).
#define KV_APPEND(NAME, T)                                                                                         \
    extern "C" __global__ void NAME(const float* k, const float* v, T* keys, T* values, const int* step, int rows, \
                                    int kv_dim) {                                                                  \
        grid_dependency_wait();                                                                                    \
        long i = blockIdx.x * (long)blockDim.x + threadIdx.x;                                                      \
        if (i >= (long)rows * kv_dim) return;                                                                      \
        size_t dst = (size_t)step[0] * kv_dim + i;                                                                 \
        kv_store(keys + dst, k[i]);                                                                                \
        kv_store(values + dst, v[i]);                                                                              \
    }
KV_APPEND(kv_append, float)
KV_APPEND(kv_append_f16, __half)

// ---------------------------------------------------------------------------
// Keys [lo, lo + n) of one KV head (at column `head_off` of rows `kv_dim` wide)
// scored against the query `qh` into `scores`, then replaced by e^(score − max).
// Returns (max, Σ e^(score − max)). Every thread of the block calls it.
template <typename T>
__device__ float2 score_keys(const float* qh, const T* keys, int lo, int n, int kv_dim, int head_off,
                             int head_dim, float scale, float* scores) {
    __shared__ float red[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = warp; j < n; j += warps) {
        const T* k = keys + (size_t)(lo + j) * kv_dim + head_off;
        float d = 0.0f;
        for (int c = lane; c < head_dim; c += 32) d += qh[c] * kv_load(k + c);
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
template <typename T>
__device__ void weigh_values(const float* weights, const T* values, int lo, int n, int kv_dim, int head_off,
                             int head_dim, float mul, float* o) {
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += weights[j] * kv_load(values + (size_t)(lo + j) * kv_dim + head_off + c);
        o[c] = acc * mul;
    }
}

// Causal (optionally sliding-window) GQA attention over the cache. One
// block per (query row, head): scores for every visible key in shared memory,
// softmax, then the weighted sum of values. The simple form; a split-K
// flash-decoding kernel replaces it for long contexts.
// (The kernels below wait for the kernel before, then call it.)
template <typename T>
__device__ void attention_exact(const float* q, const T* keys, const T* values, float* out, const int* step,
                                int num_heads, int num_kv_heads, int head_dim, int window, float scale) {
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
#define ATTENTION_EXACT(NAME, T)                                                                                   \
    extern "C" __global__ void NAME(const float* q, const T* keys, const T* values, float* out, const int* step,   \
                                    int num_heads, int num_kv_heads, int head_dim, int window, float scale) {     \
        grid_dependency_wait();                                                                                    \
        attention_exact<T>(q, keys, values, out, step, num_heads, num_kv_heads, head_dim, window, scale);          \
    }
ATTENTION_EXACT(attention, float)
ATTENTION_EXACT(attention_f16, __half)

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
#define ATTN_CHUNK 128
// (Its kernels wait for the kernel before, then call it.)
template <typename T>
__device__ void attention_split_chunk(const float* q, const T* keys, const T* values, float* part_o, float* part_ml,
                                      float* direct, const int* step, int num_heads, int num_kv_heads, int head_dim,
                                      int window, float scale, int splits) {
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
#define ATTENTION_SPLIT(NAME, T)                                                                                   \
    extern "C" __global__ void NAME(const float* q, const T* keys, const T* values, float* part_o, float* part_ml,  \
                                    float* direct, const int* step, int num_heads, int num_kv_heads, int head_dim, \
                                    int window, float scale, int splits) {                                         \
        grid_dependency_wait();                                                                                    \
        attention_split_chunk<T>(q, keys, values, part_o, part_ml, direct, step, num_heads, num_kv_heads,          \
                                 head_dim, window, scale, splits);                                                 \
    }
ATTENTION_SPLIT(attention_split, float)
ATTENTION_SPLIT(attention_split_f16, __half)

// The same split-K decode attention for head dims of 64, 128 and 256, with
// GQA sharing: a block takes one KV head's chunk of keys for up to
// HEADS of the query heads that read it (DECODE_HEADS, or DECODE_FUSED_HEADS
// folding the prologue), so each key and value row is
// read once for all of them.
//
// Why the rows go through shared memory: the chunk's key and value rows are
// all copied in at once (cp.async), so the block waits for memory once
// instead of once per batch of keys and again for the values after the
// softmax. And the rows of positions before step[0] were written by earlier
// passes, so their copies are issued before the wait for the kernel before
// (the q|k|v prologue, which writes this pass's rows, or with the prologue
// folded in the q|k|v GEMV): at short contexts the whole cache arrives while
// that kernel runs. step[0] itself is written by
// set_step, which never immediately precedes a kernel launched to overlap
// it (mod.rs `ensure_step`), so it is final here; both it and the rows are
// read through L2 (an earlier kernel on this SM may hold stale L1 lines).
//
// Scores: each warp 8 keys a step, q in registers. Softmax: one warp per
// head. Values: each warp a slice of the keys, each lane 4 (or 8) contiguous
// dims; then the warps' sums are added. Output as attention_split's (parts,
// or `direct`).
#define DECODE_HEADS 4
// The kernel that folds the q|k|v prologue runs only where one block holds a
// head's whole cache (short contexts): there a block takes 2 query heads, so
// twice the blocks share the work (8B q4g64 decode at 128 keys 0.6-2.5%
// faster). Split caches keep 4: each block reads its chunk of keys and values
// from memory, and 2 heads a block made decode after 8192 tokens 22% slower.
#define DECODE_FUSED_HEADS 2
#define DECODE_THREADS 256
// Keys per block (`chunk`, chosen by mod.rs `decode_plan`): a cache of at
// most DECODE_ONE_BLOCK / HD keys is one block's, its key and value rows
// 128 KB of shared memory in f32, 64 KB in f16 (fewer keys, a power of two
// and at least 32, on a device that gives a block less); longer caches are
// split in chunks of 64 KB of rows (mod.rs `decode_plan`), so that three
// blocks share an SM and one's loads overlap another's arithmetic. The
// warps' value sums reuse the keys' rows: 8 warps' float4 sums of
// DECODE_HEADS heads fill the rows of decode_red_keys<T>() keys (32 in f32,
// 64 in f16), and a chunk of fewer keys leaves that much room before the
// values (mod.rs `decode_shared`).
#define DECODE_ONE_BLOCK 16384
template <typename T>
__host__ __device__ constexpr int decode_red_keys() { return (int)(8 * DECODE_HEADS * sizeof(float) / sizeof(T)); }
// Rows [j0, j1) of the chunk starting at key `lo` of KV head `kvh`, keys to
// `ks` and values to `vs` (HD values a row), in one cp.async group.
template <int HD, typename T>
__device__ __forceinline__ void decode_stage_rows(const T* keys, const T* values, T* ks, T* vs, int lo, int j0,
                                                  int j1, int kv_dim, int kvh) {
    constexpr int PER = 16 / (int)sizeof(T);  // values a 16-byte piece
    constexpr int PIECES = HD / PER;         // pieces a row
    for (int i = j0 * PIECES + threadIdx.x; i < j1 * PIECES; i += DECODE_THREADS) {
        int j = i / PIECES, p = i % PIECES;
        size_t src = (size_t)(lo + j) * kv_dim + kvh * HD + PER * p;
        cp_async<16>(ks + j * HD + PER * p, keys + src, true);
        cp_async<16>(vs + j * HD + PER * p, values + src, true);
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

// What one warp's head needs besides the head itself, read before the wait
// for the kernel before (weights and the step's position only): each lane's
// norm weights and the rotation of each of its pairs (double-precision
// sin and cos are the longest part of the prologue).
template <int HD>
struct DecodeHeadWeights {
    float w[HD / 32];
    float2 cs[HD / 64];
};

template <int HD>
__device__ __forceinline__ void decode_head_weights(DecodeHeadWeights<HD>& hw, const float* w, const float* inv_freq,
                                                    int pos, int half) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < HD / 32; k++) hw.w[k] = w ? w[lane + 32 * k] : 1.0f;
#pragma unroll
    for (int k = 0; k < HD / 64; k++)
        hw.cs[k] = lane + 32 * k < half ? rope_angle(pos, inv_freq[lane + 32 * k]) : make_float2(1.0f, 0.0f);
}

// One warp: dst = RMSNorm(src)·w (a copy without a norm), rotated: the
// arithmetic of qkv_prologue_head, for the decode attention that folds it
// (its Σx² summed over the warp's lanes instead of the block's threads).
template <int HD>
__device__ void decode_head_prologue(const float* src, float* dst, const DecodeHeadWeights<HD>& hw, bool norm,
                                     float eps, int half, int style) {
    int lane = threadIdx.x & 31;
    float v[HD / 32], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < HD / 32; k++) {
        v[k] = src[lane + 32 * k];
        ss += v[k] * v[k];
    }
    float inv = norm ? rsqrtf(warp_sum(ss) / HD + eps) : 1.0f;
#pragma unroll
    for (int k = 0; k < HD / 32; k++) dst[lane + 32 * k] = norm ? hw.w[k] * (v[k] * inv) : v[k];
    __syncwarp();
#pragma unroll
    for (int k = 0; k < HD / 64; k++)
        if (lane + 32 * k < half) rotate_pair(dst, lane + 32 * k, hw.cs[k], half, style);
    __syncwarp();
}

// The q|k|v prologue of a one-row decode step, for attention_decode<HD, true>:
// `q` is then the stacked projection row (queries, each with its gate after
// it when output_gate, then keys, then values), and each block norms and
// rotates its own query heads; the block whose keys end at this pass's
// position makes the new key and value rows in shared memory itself and,
// for the first block of query heads, writes them to the cache (and the
// heads' gates out). This saves the prologue kernel and its round trip.
struct DecodePrologue {
    const float* q_norm;
    const float* k_norm;
    const float* inv_freq;
    float* gate_out;
    float eps;
    int output_gate, rotary_dim, style;
};

template <int HD, bool FUSED, int HEADS, typename T>
__device__ void attention_decode(const float* q, T* keys, T* values, float* part_o, float* part_ml, float* direct,
                                 const int* step, int num_heads, int num_kv_heads, int window, float scale,
                                 int splits, int chunk, DecodePrologue pro) {
    constexpr int WARPS = DECODE_THREADS / 32;
    constexpr int V4 = HD >= 128 ? HD / 128 : 1;  // 4-value groups per lane per value row
    static_assert(HEADS <= DECODE_HEADS, "the value sums must fit the keys' space");
    extern __shared__ float4 decode_rows[];       // keys [max(chunk, red keys)][HD], then values
    T* ks = reinterpret_cast<T*>(decode_rows);
    T* vs = ks + max(chunk, decode_red_keys<T>()) * HD;
    // The warps' value sums reuse the keys' space (read only before the softmax).
    auto red = reinterpret_cast<float4(*)[HEADS][HD / 4]>(decode_rows);
    __shared__ float qs[HEADS][HD];
    __shared__ float scores[HEADS][DECODE_ONE_BLOCK / HD];
    __shared__ float ml[HEADS][2];
    int group = num_heads / num_kv_heads;
    int t = blockIdx.x / num_kv_heads, kvh = blockIdx.x % num_kv_heads, split = blockIdx.y;
    int g0 = blockIdx.z * HEADS, gh = min(HEADS, group - g0);
    int h0 = kvh * group + g0;  // first query head of this block
    int start = __ldcg(step);
    int pos = start + t;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int lo = max(first, split * chunk), hi = min(pos + 1, (split + 1) * chunk);
    int n = hi - lo;
    int kv_dim = num_kv_heads * HD;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int earlier = min(max(start - lo, 0), max(n, 0));  // rows written by earlier passes
    if (earlier > 0) decode_stage_rows<HD, T>(keys, values, ks, vs, lo, 0, earlier, kv_dim, kvh);
    DecodeHeadWeights<HD> hw;
    if constexpr (FUSED) decode_head_weights<HD>(hw, warp < HEADS ? pro.q_norm : pro.k_norm, pro.inv_freq, pos,
                                                 pro.rotary_dim / 2);
    grid_dependency_wait();
    if (n <= 0) {
        if (direct) return;  // one split always holds keys
        for (int i = threadIdx.x; i < gh * HD; i += DECODE_THREADS) {
            size_t part = ((size_t)t * num_heads + h0 + i / HD) * splits + split;
            part_o[part * HD + i % HD] = 0.0f;
            if (i % HD == 0) { part_ml[2 * part] = -__int_as_float(0x7f800000); part_ml[2 * part + 1] = 0.0f; }
        }
        return;
    }
    if constexpr (FUSED) {
        // One row (t = 0): warps 0..gh-1 make the query heads; in the block
        // holding this pass's position (its last key), the next warp the new
        // key and the one after the value.
        int q_stride = pro.output_gate ? 2 * HD : HD, q_rows = num_heads * q_stride;
        bool holds_pos = pos >= lo && pos < hi;
        if (warp < gh) {
            const float* src = q + (size_t)(h0 + warp) * q_stride;
            decode_head_prologue<HD>(src, qs[warp], hw, pro.q_norm, pro.eps, pro.rotary_dim / 2, pro.style);
            for (int c = lane; c < HD; c += 32) {
                qs[warp][c] *= scale;
                if (pro.output_gate && holds_pos) pro.gate_out[(size_t)(h0 + warp) * HD + c] = src[HD + c];
            }
        } else if (holds_pos && warp == HEADS) {
            // The new key is made in f32, then stored as the cache holds it.
            __shared__ float key_row[HD];
            decode_head_prologue<HD>(q + q_rows + kvh * HD, key_row, hw, pro.k_norm, pro.eps, pro.rotary_dim / 2,
                                     pro.style);
            T* row = ks + (pos - lo) * HD;
            for (int c = lane; c < HD; c += 32) {
                kv_store(row + c, key_row[c]);
                if (blockIdx.z == 0) kv_store(keys + (size_t)pos * kv_dim + kvh * HD + c, key_row[c]);
            }
        } else if (holds_pos && warp == HEADS + 1) {
            const float* src = q + q_rows + kv_dim + kvh * HD;
            for (int c = lane; c < HD; c += 32) {
                float v = src[c];
                kv_store(vs + (pos - lo) * HD + c, v);
                if (blockIdx.z == 0) kv_store(values + (size_t)pos * kv_dim + kvh * HD + c, v);
            }
        }
    } else {
        if (earlier < n) decode_stage_rows<HD, T>(keys, values, ks, vs, lo, earlier, n, kv_dim, kvh);
        for (int i = threadIdx.x; i < gh * HD; i += DECODE_THREADS)
            qs[i / HD][i % HD] = q[((size_t)t * num_heads + h0 + i / HD) * HD + i % HD] * scale;
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    // LPK lanes per key, each holding F4 float4s of q per head; KPW keys per warp step.
    constexpr int LPK = HD / 4 < 32 ? HD / 4 : 32, KPW = 32 / LPK, F4 = HD / 4 / LPK;
    int sub = lane / LPK, l = lane % LPK;
    float4 qv[HEADS][F4];
#pragma unroll
    for (int g = 0; g < HEADS; g++)
#pragma unroll
        for (int f = 0; f < F4; f++) qv[g][f] = reinterpret_cast<const float4*>(qs[g])[f * LPK + l];
    for (int j0 = warp * KPW; j0 < n; j0 += 8 * WARPS * KPW) {
        float4 kv[8][F4];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int j = j0 + u * WARPS * KPW + sub;
#pragma unroll
            for (int f = 0; f < F4; f++)
                kv[u][f] = j < n ? kv_load4(ks + j * HD + 4 * (f * LPK + l)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        // Each lane's share of the 8 keys' dot products with each head.
        float d[8 * HEADS];
#pragma unroll
        for (int u = 0; u < 8; u++)
#pragma unroll
            for (int g = 0; g < HEADS; g++) {
                float s = 0.0f;
#pragma unroll
                for (int f = 0; f < F4; f++)
                    s += qv[g][f].x * kv[u][f].x + qv[g][f].y * kv[u][f].y + qv[g][f].z * kv[u][f].z +
                         qv[g][f].w * kv[u][f].w;
                d[u * HEADS + g] = s;
            }
        if constexpr (LPK == 32) {
            // Sums over the warp, one per lane (a reduce-scatter): at each
            // halving, a lane keeps the half of its sums named by the bit
            // and adds its partner's, so lane i ends with sum i (of the N
            // sums, lane i mod N, the lanes' higher bits then added by
            // plain shuffles). 31 shuffles for 32 sums, where a reduction of
            // each would take 160.
            constexpr int N = 8 * HEADS;
            if constexpr (N >= 32) reduce_scatter_half<16>(d, lane);
            if constexpr (N >= 16) reduce_scatter_half<8>(d, lane);
            reduce_scatter_half<4>(d, lane);
            reduce_scatter_half<2>(d, lane);
            reduce_scatter_half<1>(d, lane);
#pragma unroll
            for (int o = N; o < 32; o <<= 1) d[0] += __shfl_xor_sync(0xffffffffu, d[0], o);
            int j = j0 + (lane % N / HEADS) * WARPS * KPW;
            if (lane < N && j < n) scores[lane % HEADS][j] = d[0];
        } else {
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int j = j0 + u * WARPS * KPW + sub;
#pragma unroll
                for (int g = 0; g < HEADS; g++) {
                    float v = d[u * HEADS + g];
                    for (int o = LPK / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (l == 0 && j < n) scores[g][j] = v;
                }
            }
        }
    }
    __syncthreads();
    if (warp < gh) {
        float m = -__int_as_float(0x7f800000);
        for (int j = lane; j < n; j += 32) m = fmaxf(m, scores[warp][j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float e = expf(scores[warp][j] - m);
            scores[warp][j] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { ml[warp][0] = m; ml[warp][1] = l; }
    }
    __syncthreads();
    if (HD >= 128) {
        float4 acc[HEADS][V4];
#pragma unroll
        for (int g = 0; g < HEADS; g++)
#pragma unroll
            for (int v = 0; v < V4; v++) acc[g][v] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int j = warp; j < n; j += WARPS) {
#pragma unroll
            for (int v = 0; v < V4; v++) {
                float4 x = kv_load4(vs + j * HD + 4 * (lane + 32 * v));
#pragma unroll
                for (int g = 0; g < HEADS; g++) {
                    float p = scores[g][j];
                    acc[g][v].x += p * x.x; acc[g][v].y += p * x.y;
                    acc[g][v].z += p * x.z; acc[g][v].w += p * x.w;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < HEADS; g++)
#pragma unroll
            for (int v = 0; v < V4; v++) red[warp][g][lane + 32 * v] = acc[g][v];
    } else {
        // 64 dims: a half-warp per key, two keys per warp step.
        int half = lane >> 4, l16 = lane & 15;
        float4 a[HEADS];
#pragma unroll
        for (int g = 0; g < HEADS; g++) a[g] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int j = 2 * warp + half; j < n; j += 2 * WARPS) {
            float4 x = kv_load4(vs + j * HD + 4 * l16);
#pragma unroll
            for (int g = 0; g < HEADS; g++) {
                float p = scores[g][j];
                a[g].x += p * x.x; a[g].y += p * x.y; a[g].z += p * x.z; a[g].w += p * x.w;
            }
        }
#pragma unroll
        for (int g = 0; g < HEADS; g++) {
            a[g].x += __shfl_xor_sync(0xffffffffu, a[g].x, 16);
            a[g].y += __shfl_xor_sync(0xffffffffu, a[g].y, 16);
            a[g].z += __shfl_xor_sync(0xffffffffu, a[g].z, 16);
            a[g].w += __shfl_xor_sync(0xffffffffu, a[g].w, 16);
            if (half == 0) red[warp][g][l16] = a[g];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gh * HD; i += DECODE_THREADS) {
        int g = i / HD, c = i % HD;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) sum += reinterpret_cast<const float*>(red[w][g])[c];
        size_t row_head = (size_t)t * num_heads + h0 + g;
        if (direct) {
            direct[row_head * HD + c] = sum / ml[g][1];
        } else {
            size_t part = row_head * splits + split;
            part_o[part * HD + c] = sum;
            if (c == 0) { part_ml[2 * part] = ml[g][0]; part_ml[2 * part + 1] = ml[g][1]; }
        }
    }
}
#define ATTENTION_DECODE(HD, SUFFIX, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attention_decode##HD##SUFFIX(                     \
        const float* q, T* k, T* v, float* po, float* pml, float* direct, const int* step, int nh, int nkv,        \
        int window, float scale, int splits, int chunk) {                                                          \
        attention_decode<HD, false, DECODE_HEADS, T>(q, k, v, po, pml, direct, step, nh, nkv, window, scale,       \
                                                     splits, chunk,                                                \
                                                     DecodePrologue{nullptr, nullptr, nullptr, nullptr, 0.0f, 0, 0, \
                                                                    0});                                           \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attention_decode##HD##_prologue##SUFFIX(          \
        const float* qkv, T* k, T* v, float* po, float* pml, float* direct, const int* step, int nh, int nkv,      \
        int window, float scale, int splits, int chunk, const float* q_norm, const float* k_norm,                  \
        const float* inv_freq, float* gate, float eps, int output_gate, int rotary_dim, int style) {               \
        attention_decode<HD, true, DECODE_FUSED_HEADS, T>(qkv, k, v, po, pml, direct, step, nh, nkv, window,       \
                                                          scale, splits, chunk,                                    \
                                                          DecodePrologue{q_norm, k_norm, inv_freq, gate, eps,      \
                                                                         output_gate, rotary_dim, style});         \
    }
ATTENTION_DECODE(64, , float)
ATTENTION_DECODE(128, , float)
ATTENTION_DECODE(256, , float)
ATTENTION_DECODE(64, _f16, __half)
ATTENTION_DECODE(128, _f16, __half)
ATTENTION_DECODE(256, _f16, __half)

// Block (row·head, 32 of its values): out = Σ_s e^(m_s − M)·o_s / Σ_s e^(m_s − M)·l_s.
// Each block computes every split's weight e^(m_s − M) once, into shared
// memory; then each warp sums every 8th split for the block's 32 values
// (coalesced, and a thread's loads independent of each other). One block per
// (row, head), each thread walking every split for its value, spent 22 µs
// merging 64 splits of 32 heads (ncu, H200). Shared memory (mod.rs
// `combine_shared`): the weights, then 8 × 32 partial sums.
#define COMBINE_DIMS 32
extern "C" __global__ void attention_combine(const float* part_o, const float* part_ml, float* out, int head_dim,
                                             int splits) {
    grid_dependency_wait();
    extern __shared__ float combine_weights[];
    float* partial = combine_weights + splits;  // [warps][COMBINE_DIMS]
    size_t base = (size_t)blockIdx.x * splits;
    const float neg_inf = -__int_as_float(0x7f800000);
    float big = neg_inf;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) big = fmaxf(big, part_ml[2 * (base + s)]);
    big = block_max(big);
    float total = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        float m = part_ml[2 * (base + s)];
        float w = m > neg_inf ? expf(m - big) : 0.0f;
        combine_weights[s] = w;
        total += w * part_ml[2 * (base + s) + 1];
    }
    float inv = 1.0f / block_sum(total);  // its barriers also publish the weights
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int c = blockIdx.y * COMBINE_DIMS + lane;
    float acc = 0.0f;
    if (c < head_dim) {
#pragma unroll 4
        for (int s = warp; s < splits; s += warps) acc += combine_weights[s] * part_o[(base + s) * head_dim + c];
    }
    partial[warp * COMBINE_DIMS + lane] = acc;
    __syncthreads();
    if (warp == 0 && c < head_dim) {
        float sum = 0.0f;
        for (int k = 0; k < warps; k++) sum += partial[k * COMBINE_DIMS + lane];
        out[(size_t)blockIdx.x * head_dim + c] = sum * inv;
    }
}

// ---------------------------------------------------------------------------
// Elementwise.
extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
// silu(gate) ⊙ up from stacked gate|up rows [rows, 2·width].
extern "C" __global__ void swiglu(const float* gu, float* out, int width, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    long r = i / width, c = i % width;
    float g = gu[r * 2 * width + c], u = gu[r * 2 * width + width + c];
    out[i] = g / (1.0f + expf(-g)) * u;
}
extern "C" __global__ void add_assign(float* x, const float* y, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
// x ⊙ sigmoid(gate); gate_cols is x's width or 1 (a per-row scalar).
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, int cols, int gate_cols, long n) {
    grid_dependency_wait();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate_cols == cols ? gate[i] : gate[i / cols];
    x[i] *= 1.0f / (1.0f + expf(-g));
}
// dst[r][dst_off + g*len + j] = src[r][g*group + offset + j]: splits and concatenations.
extern "C" __global__ void copy_columns(const float* src, float* dst, int rows, int src_cols, int group, int offset,
                                        int len, int dst_cols, int dst_off) {
    grid_dependency_wait();
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
    grid_dependency_wait();
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(size_t)blockIdx.x * cols + c] = x[(size_t)idx[blockIdx.x] * cols + c];
}
// out[idx[i]] += w[i]·y[i] — one expert's outputs back into the token rows (an
// expert sees each token at most once, so rows never collide within a launch).
extern "C" __global__ void scatter_add_rows(const float* y, const int* idx, const float* w, float* out, int cols) {
    grid_dependency_wait();
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(size_t)idx[blockIdx.x] * cols + c] += w[blockIdx.x] * y[(size_t)blockIdx.x * cols + c];
}

// ---------------------------------------------------------------------------
// Mixture of experts for a few tokens, decided on the device (no host sync,
// so a decode step with routed experts can be recorded). moe_route: per
// token (one block), softmax over the router logits, then the top_k experts
// by repeated block-wide argmax (ties to the lower index, as the CPU's stable
// sort), optionally renormalized; writes ids and weights [rows, top_k].
extern "C" __global__ void moe_route(const float* logits, int* ids, float* weights, int experts, int top_k,
                                     int renormalize) {
    grid_dependency_wait();
    __shared__ float probs[1024];
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
