// FP8 (E4M3) weights, one byte per value with an f32 scale per run of
// `group` columns of a row (quant/fp8.rs): the decode GEMV reading the bytes
// once, rows dequantized to bf16 tiles for the prefill's cuBLAS GEMMs, and
// embedding rows.

#include "common.cuh"
#include "constants.cuh"
#include "gemv.cuh"

// Four E4M3 bytes (little-endian in v) as floats times 2^-8. E4M3's exponent
// bias is 7 and f16's 15, so a byte's sign, exponent and mantissa moved into
// an f16's fields give its value times 2^-8 exactly, subnormals included;
// callers fold the 2^8 into the scale. Bytes 0 and 2 fill one half2, 1 and 3
// the other.
__device__ __forceinline__ void e4m3x4_scaled(unsigned v, float (&out)[4]) {
    unsigned even = ((v & 0x00800080u) << 8) | ((v & 0x007F007Fu) << 7);
    unsigned odd = (v & 0x80008000u) | ((v & 0x7F007F00u) >> 1);
    float2 e = __half22float2(*reinterpret_cast<const __half2*>(&even));
    float2 o = __half22float2(*reinterpret_cast<const __half2*>(&odd));
    out[0] = e.x;
    out[1] = o.x;
    out[2] = e.y;
    out[3] = o.y;
}

// The 2^8 the decoded values lack (see e4m3x4_scaled).
#define FP8_UNSCALE 256.0f

// Sixteen E4M3 bytes of each of ROWS rows (at column c) against the
// activation rows: acc[r][t] += scale · Σ_k x[t][c + k] · q_k. With gi ≥ 0 the
// 16 values share the scale group gi (group a multiple of 16), applied to
// their sum; otherwise each value is scaled before the sum.
template <int ROWS, int ACT>
__device__ __forceinline__ void fp8_chunk(const uint4 (&q)[ROWS], const float* const (&srows)[ROWS], int c, int gi,
                                          int group, const float* __restrict__ x, int in_dim, int n_act,
                                          float (&acc)[ROWS][ACT]) {
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) s[r] = gi >= 0 ? srows[r][gi] * FP8_UNSCALE : FP8_UNSCALE;
#pragma unroll
    for (int t = 0; t < ACT; t++) {
        if (t < n_act) {
            float xv[16];
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + c);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float4 v = xr[j];
                xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                unsigned words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
                float sum = 0.0f;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float f[4];
                    e4m3x4_scaled(words[k], f);
                    if (gi >= 0) {
#pragma unroll
                        for (int m = 0; m < 4; m++) sum += f[m] * xv[4 * k + m];
                    } else {
#pragma unroll
                        for (int m = 0; m < 4; m++) sum += f[m] * srows[r][(c + 4 * k + m) / group] * xv[4 * k + m];
                    }
                }
                acc[r][t] += sum * s[r];
            }
        }
    }
}

// The scale group of the 16 columns at c, or -1 when they may span two
// groups (group not a multiple of 16). A division per chunk costs about as
// many instructions as the chunk's multiply-adds, so the usual cases (one
// group per row, a power-of-two group) take none.
struct Fp8Groups {
    int group, shift;  // shift: log2(group) for a power of two, else -1
    bool whole, uniform;
    __device__ Fp8Groups(int g, int in_dim) {
        group = g;
        shift = (g & (g - 1)) == 0 ? __ffs(g) - 1 : -1;
        whole = g >= in_dim;
        uniform = g % 16 == 0;
    }
    __device__ __forceinline__ int of(int c) const {
        if (!uniform) return -1;
        if (whole) return 0;
        return shift >= 0 ? c >> shift : c / group;
    }
};

// y[t][o] = Σ_c x[t][c] · w[o][c] · scale(o, c) (+ bias[o]), the float
// GEMV's shape (gemv.cuh): a block's threads stride together over ROWS rows'
// columns in 16-byte chunks, GEMV_UNROLL·ROWS loads in flight per thread,
// then the block sums the partial dot products. Every row's sum runs in the
// same order whatever ROWS and ACT are, so a row's result does not depend on
// how many activation rows share the launch.
template <int ROWS, int ACT>
__device__ void gemv_fp8(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                         const float* __restrict__ x, const float* bias, float* y, int out_dim, int in_dim,
                         int group, int n_act) {
    int row0 = blockIdx.x * ROWS;
    int groups = (in_dim + group - 1) / group;
    const unsigned char* rows[ROWS];
    const float* srows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        size_t o = min(row0 + r, out_dim - 1);
        rows[r] = w + o * in_dim;
        srows[r] = scales + o * groups;
    }
    float acc[ROWS][ACT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < ACT; t++) acc[r][t] = 0.0f;
    Fp8Groups groups_of(group, in_dim);
    // 16-byte chunks need every row 16-byte aligned: in_dim a multiple of 16.
    int chunks = in_dim % 16 == 0 ? in_dim / 16 : 0;
    int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + (GEMV_UNROLL - 1) * stride < chunks; i += GEMV_UNROLL * stride) {
        uint4 q[GEMV_UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < ROWS; r++) q[u][r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i + u * stride);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
        {
            int c = (i + u * stride) * 16;
            fp8_chunk<ROWS, ACT>(q[u], srows, c, groups_of.of(c), group, x, in_dim, n_act, acc);
        }
    }
    for (; i < chunks; i += stride) {
        uint4 q[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) q[r] = __ldcs(reinterpret_cast<const uint4*>(rows[r]) + i);
        fp8_chunk<ROWS, ACT>(q, srows, i * 16, groups_of.of(i * 16), group, x, in_dim, n_act, acc);
    }
    // Rows whose width is not a multiple of 16: one value per thread per step.
    for (int c = chunks * 16 + threadIdx.x; c < in_dim; c += stride) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float f[4];
            e4m3x4_scaled(rows[r][c], f);
            float wv = f[0] * srows[r][c / group] * FP8_UNSCALE;
            for (int t = 0; t < n_act && t < ACT; t++) acc[r][t] += wv * x[(size_t)t * in_dim + c];
        }
    }
    gemv_store<ROWS, ACT>(acc, bias, y, row0, out_dim, n_act);
}

#define GEMV_FP8_KERNEL(NAME, ROWS, ACT)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        NAME(const unsigned char* w, const float* scales, const float* x, const float* b, float* y, int o, int i, \
             int group, int n) {                                                                                   \
        grid_dependency_wait();                                                                                    \
        gemv_fp8<ROWS, ACT>(w, scales, x, b, y, o, i, group, n);                                                   \
    }
// Decode (one activation row) and up to GEMV_MAX_ROWS rows.
GEMV_FP8_KERNEL(gemv_fp8_r4a1, 4, 1)
GEMV_FP8_KERNEL(gemv_fp8_r2a8, 2, GEMV_MAX_ROWS)

// ---------------------------------------------------------------------------
// The decode GEMV on the tensor cores (1 to 4 activation rows, sm_89+).
//
// Why: the CUDA-core GEMV spends two and a half instructions per weight
// (convert, widen, FMA), which holds it well under HBM speed; here a weight
// costs half a conversion (cvt.rn.f16x2.e4m3x2 makes two f16 operands, and
// every E4M3 value is exactly an f16) and mma.m16n8k16 does the multiply-adds
// in f32.
//
// Activations: each x value is split into two f16, hi = f16(x) and
// lo = f16(x − hi), which carry about 22 of its bits; they are columns 2a and
// 2a + 1 of the MMA's B operand for activation row a, so one MMA serves up to
// four rows and hi + lo are added in f32 after it. A row whose largest |x|
// would overflow f16 is first scaled by a power of two (exact), undone on the
// sums.
//
// Layout: a block owns 16 rows and stages x (hi and lo per row) in shared
// memory once; its FP8_MMA_WARPS warps take the rows' 64-column units in
// turn, FP8_MMA_UNITS units in flight per lane. Lane (g = lane/4, c = lane%4)
// loads the 16 bytes of columns 16c..16c+15 of a unit for rows g and g+8.
// The dot product does not care in which order k is summed, so those bytes
// fill the lane's A slots as they lie (MMA m takes bytes 4m..4m+3), and
// the lane's B slots take x at the same columns. A unit lies in one scale
// group (groups a multiple of 64), whose scale multiplies the unit's sum.
// Every row's sums run in the same order whatever the number of activation
// rows, so a row's result does not depend on the rows beside it.
//
// With PAIRED, rows g and g+8 of a block are gate row i and up row width + i
// of a stacked gate|up weight (out_dim = width), and the block writes
// silu(gate)·up for its 8 outputs, as the swiglu kernel would.

// FP8_MMA_WARPS comes from constants.cuh.
#define FP8_MMA_UNITS 4
// FP8_MMA_PAD comes from constants.cuh.
// x rows whose largest |x| reaches this are scaled down first: hi + lo then
// stay finite in f16 (largest 65504).
#define FP8_MMA_X_LIMIT 16384.0f

// Two E4M3 bytes (the first in the low half) as an f16 pair.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned v) {
#if __CUDA_ARCH__ >= 890
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)v));
    return r;
#else
    __trap();  // the host takes this kernel only on sm_89 and later
    return 0;
#endif
}

__device__ __forceinline__ void mma_f16_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                              unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One row of x (times s) staged as f16 hi and lo copies, pitch halves
// apart; true where a value reached FP8_MMA_X_LIMIT (or is not finite).
__device__ __forceinline__ bool fp8_stage_row(const float* __restrict__ xr, float s, __half* hi, int pitch,
                                              int in_dim) {
    bool big = false;
    for (int c = threadIdx.x; c < in_dim; c += blockDim.x) {
        float v = xr[c] * s;
        big |= !(fabsf(v) < FP8_MMA_X_LIMIT);
        __half h = __float2half_rn(v);
        hi[c] = h;
        hi[pitch + c] = __float2half_rn(v - __half2float(h));
    }
    return big;
}

template <int ACT, bool PAIRED>
__device__ void gemv_fp8_mma(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                             const float* __restrict__ x, const float* bias, float* y, int out_dim, int in_dim,
                             int group, int n_act) {
    extern __shared__ __align__(16) unsigned char fp8_mma_shared[];
    __half* xs = reinterpret_cast<__half*>(fp8_mma_shared);  // [ACT][hi, lo][in_dim + pad]
    __shared__ float part[FP8_MMA_WARPS][16][ACT];
    __shared__ float unscale[ACT];
    int pitch = in_dim + FP8_MMA_PAD;
    // Stage x: hi and lo per value; again after a power-of-two scale in the
    // rare case that a value is too large for f16.
    bool big = false;
    for (int t = 0; t < n_act; t++)
        big |= fp8_stage_row(x + (size_t)t * in_dim, 1.0f, xs + (size_t)(2 * t) * pitch, pitch, in_dim);
    if (threadIdx.x < ACT) unscale[threadIdx.x] = 1.0f;
    if (__syncthreads_or(big)) {
        for (int t = 0; t < n_act; t++) {
            const float* xr = x + (size_t)t * in_dim;
            float m = 0.0f;
            for (int c = threadIdx.x; c < in_dim; c += blockDim.x) m = fmaxf(m, fabsf(xr[c]));
            m = block_max(m);
            // 2^-e with m·2^-e under the limit; inf and NaN go through as
            // they are (the sums are then not finite, as the reference's).
            int e = 0;
            if (isfinite(m) && m >= FP8_MMA_X_LIMIT) frexpf(m / FP8_MMA_X_LIMIT, &e);
            if (threadIdx.x == 0) unscale[t] = ldexpf(1.0f, e);
            fp8_stage_row(xr, ldexpf(1.0f, -e), xs + (size_t)(2 * t) * pitch, pitch, in_dim);
        }
    }
    __syncthreads();

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    int row0 = blockIdx.x * (PAIRED ? 8 : 16);
    int groups = (in_dim + group - 1) / group;
    size_t ra = min(row0 + g, out_dim - 1);
    size_t rb = PAIRED ? ra + out_dim : min(row0 + g + 8, out_dim - 1);
    const uint4* wa = reinterpret_cast<const uint4*>(w + ra * in_dim);
    const uint4* wb = reinterpret_cast<const uint4*>(w + rb * in_dim);
    const float* sa = scales + ra * groups;
    const float* sb = scales + rb * groups;
    // This lane's B column: activation g/2, its hi (even g) or lo copy.
    bool live = (g >> 1) < n_act;
    const __half* xrow = xs + (size_t)min(g, 2 * n_act - 1) * pitch + 16 * q;
    Fp8Groups groups_of(group, in_dim);
    int units = in_dim / 64;
    float tot_a = 0.0f, tot_b = 0.0f;
    for (int u0 = warp; u0 < units; u0 += FP8_MMA_WARPS * FP8_MMA_UNITS) {
        uint4 qa[FP8_MMA_UNITS], qb[FP8_MMA_UNITS];
#pragma unroll
        for (int k = 0; k < FP8_MMA_UNITS; k++) {
            int u = u0 + k * FP8_MMA_WARPS;
            if (u < units) {
                qa[k] = __ldcs(wa + 4 * u + q);
                qb[k] = __ldcs(wb + 4 * u + q);
            }
        }
#pragma unroll
        for (int k = 0; k < FP8_MMA_UNITS; k++) {
            int u = u0 + k * FP8_MMA_WARPS;
            if (u >= units) break;
            uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
            if (live) {
                x0 = *reinterpret_cast<const uint4*>(xrow + 64 * u);
                x1 = *reinterpret_cast<const uint4*>(xrow + 64 * u + 8);
            }
            unsigned xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            unsigned aw[4] = {qa[k].x, qa[k].y, qa[k].z, qa[k].w};
            unsigned bw[4] = {qb[k].x, qb[k].y, qb[k].z, qb[k].w};
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int m = 0; m < 4; m++)
                mma_f16_16816(c, e4m3x2_to_f16x2(aw[m]), e4m3x2_to_f16x2(bw[m]), e4m3x2_to_f16x2(aw[m] >> 16),
                              e4m3x2_to_f16x2(bw[m] >> 16), xw[2 * m], xw[2 * m + 1]);
            int gi = groups_of.of(64 * u);
            tot_a += (c[0] + c[1]) * sa[gi];
            tot_b += (c[2] + c[3]) * sb[gi];
        }
    }
    // Lane (g, q) holds rows g and g+8 of activation q.
    if (q < ACT) {
        part[warp][g][q] = tot_a;
        part[warp][g + 8][q] = tot_b;
    }
    __syncthreads();
    if constexpr (PAIRED) {
        if (threadIdx.x < 8 * ACT) {
            int r = threadIdx.x / ACT, t = threadIdx.x % ACT, o = row0 + r;
            float gate = 0.0f, up = 0.0f;
            for (int k = 0; k < FP8_MMA_WARPS; k++) {
                gate += part[k][r][t];
                up += part[k][r + 8][t];
            }
            gate *= unscale[t];
            up *= unscale[t];
            if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = gate / (1.0f + expf(-gate)) * up;
        }
        return;
    }
    if (threadIdx.x < 16 * ACT) {
        int r = threadIdx.x / ACT, t = threadIdx.x % ACT, o = row0 + r;
        float sum = 0.0f;
        for (int k = 0; k < FP8_MMA_WARPS; k++) sum += part[k][r][t];
        if (o < out_dim && t < n_act) y[(size_t)t * out_dim + o] = sum * unscale[t] + (bias ? bias[o] : 0.0f);
    }
}

#define GEMV_FP8_MMA_KERNEL(NAME, ACT, PAIRED)                                                                     \
    extern "C" __global__ void __launch_bounds__(FP8_MMA_WARPS * 32)                                               \
        NAME(const unsigned char* w, const float* scales, const float* x, const float* b, float* y, int o, int i, \
             int group, int n) {                                                                                   \
        grid_dependency_wait();                                                                                    \
        gemv_fp8_mma<ACT, PAIRED>(w, scales, x, b, y, o, i, group, n);                                             \
    }
GEMV_FP8_MMA_KERNEL(gemv_fp8_mma_a1, 1, false)
GEMV_FP8_MMA_KERNEL(gemv_fp8_mma_a2, 2, false)
GEMV_FP8_MMA_KERNEL(gemv_fp8_mma_a4, 4, false)
GEMV_FP8_MMA_KERNEL(gemv_fp8_mma_swiglu_a1, 1, true)
GEMV_FP8_MMA_KERNEL(gemv_fp8_mma_swiglu_a2, 2, true)
GEMV_FP8_MMA_KERNEL(gemv_fp8_mma_swiglu_a4, 4, true)

// Rows [row0, row0 + rows) dequantized to bf16 (a transient prefill tile for
// cuBLAS, never a resident copy). Rows a multiple of 16 wide: one thread per
// 16 values, one 16-byte load and two 16-byte stores; otherwise one value
// per thread.
// With `lo`, also the remainder v − bf16(v) in bf16 (the parity
// configuration's second GEMM: about 16 bits of each weight, where bf16
// alone keeps 8 of the up to 28 an E4M3 value times an f32 scale has).
__device__ __forceinline__ void fp8_store_bf16(__nv_bfloat16* out, __nv_bfloat16* lo, size_t at, float v) {
    __nv_bfloat16 h = __float2bfloat16(v);
    out[at] = h;
    if (lo) lo[at] = __float2bfloat16(v - __bfloat162float(h));
}

extern "C" __global__ void fp8_to_bf16(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                       __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ lo, int row0,
                                       int rows, int in_dim, int group) {
    grid_dependency_wait();
    int groups = (in_dim + group - 1) / group;
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (in_dim % 16 == 0) {
        long chunks_per_row = in_dim / 16;
        if (t >= (long)rows * chunks_per_row) return;
        int r = (int)(t / chunks_per_row), c = (int)(t % chunks_per_row) * 16;
        size_t row = (size_t)(row0 + r);
        uint4 q = __ldcs(reinterpret_cast<const uint4*>(w + row * in_dim + c));
        unsigned words[4] = {q.x, q.y, q.z, q.w};
        const float* srow = scales + row * groups;
        __align__(16) __nv_bfloat16 v[16];
        __align__(16) __nv_bfloat16 rest[16];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float f[4];
            e4m3x4_scaled(words[k], f);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                float x = f[m] * srow[(c + 4 * k + m) / group] * FP8_UNSCALE;
                v[4 * k + m] = __float2bfloat16(x);
                rest[4 * k + m] = __float2bfloat16(x - __bfloat162float(v[4 * k + m]));
            }
        }
        uint4* dst = reinterpret_cast<uint4*>(out + (size_t)r * in_dim + c);
        dst[0] = reinterpret_cast<const uint4*>(v)[0];
        dst[1] = reinterpret_cast<const uint4*>(v)[1];
        if (lo) {
            uint4* dlo = reinterpret_cast<uint4*>(lo + (size_t)r * in_dim + c);
            dlo[0] = reinterpret_cast<const uint4*>(rest)[0];
            dlo[1] = reinterpret_cast<const uint4*>(rest)[1];
        }
        return;
    }
    if (t >= (long)rows * in_dim) return;
    int r = (int)(t / in_dim), c = (int)(t % in_dim);
    size_t row = (size_t)(row0 + r);
    float f[4];
    e4m3x4_scaled(w[row * in_dim + c], f);
    fp8_store_bf16(out, lo, t, f[0] * scales[row * groups + c / group] * FP8_UNSCALE);
}

// Embedding rows `ids` of an FP8 table, one block per id.
extern "C" __global__ void embed_fp8(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                     const unsigned* __restrict__ ids, float* out, int cols, int group) {
    grid_dependency_wait();
    size_t id = ids[blockIdx.x];
    int groups = (cols + group - 1) / group;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float f[4];
        e4m3x4_scaled(w[id * cols + c], f);
        out[(size_t)blockIdx.x * cols + c] = f[0] * scales[id * groups + c / group] * FP8_UNSCALE;
    }
}
