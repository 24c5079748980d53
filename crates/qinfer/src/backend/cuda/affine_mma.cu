// ---------------------------------------------------------------------------
// 4- and 8-bit affine decode GEMV on the tensor cores (1 to 4 activation rows).
//
// Why: a CUDA-core GEMV spends three instructions per 4-bit weight (mask,
// convert, FMA), which caps it near half of HBM speed. Here a 4-bit weight
// costs a quarter of an instruction to become an integer MMA operand (an
// 8-bit one none), and mma.m16n8k32 (u8 levels × s8 activations, s32 sums)
// does the multiply-adds, 512 per warp instruction, exactly.
//
// 4-bit levels: a u32 word holds levels n0..n7 (n_i at bits 4i). One LOP3 makes
// four u8 operands without shifting: w & 0x0F0F0F0F holds n0 n2 n4 n6, and
// w & 0xF0F0F0F0 holds 16·n1 16·n3 16·n5 16·n7. The odd levels' MMA runs
// first; its sums, multiples of 16, are shifted down exactly and accumulate
// the even levels' MMA.
//
// Activations: each unit of 64 values of x is scaled to put its largest |x|
// just under 32512 and rounded to an integer xi, split into a high and a low
// signed byte (xi = 256·hi + lo). The two digits are two columns of the MMA's
// B operand, so Σ q·xi is exact in s32. Rounding x to 1/32512 of its unit's
// largest value is the only error (bf16 activations, as the reference models
// carry them, keep 8 bits of each value).
//
// Layout: blocks (as many as fit on the device) loop over tiles of 16 rows;
// their 8 warps split a row's length, an m16 tile per warp, and each warp
// stages once the part of x it multiplies. Each warp streams its share of a
// tile into a ring of shared-memory stages with cp.async, 128 bytes a row
// per stage (4 units of 64 columns at 4 bits, 2 at 8), so each copy
// instruction reads whole 128-byte lines (loaded straight into fragments, 16
// rows a warp instruction touched 8 lines per 256 bytes and measured
// 1.0 TB/s). From a stage, lane (g = lane/4, c = lane%4) takes the 16 levels
// of columns 16c..16c+15 of each unit for rows g and g+8 (8 bytes at 4 bits,
// 16 at 8). The dot product does not care in which order k is summed, so the
// levels fill the lane's A fragment slots as they lie (at 4 bits the even
// levels of both words, then the odd ones), and x is staged in that same
// order: at 4 bits, per 16 columns, the even columns of the first 8, of the
// next 8, then the odd columns of each; at 8 bits, columns in order.
// A unit of 64 columns lies in one scale group (group sizes that are
// multiples of 64), so the group's scale and bias apply to the unit's sum:
// Σ(s·q + b)·x = (s·Σq·xi + b·Σxi)/scale. Groups of 32 (GGUF's Q4_0, Q4_K,
// Q8_0 as affine weights, and mlx's g32) split each sum by halves instead
// (HALVES below), for at most 2 activation rows.
// Scales and biases travel with the levels (cp.async too); this needs rows
// whose length is a multiple of 256 and groups of 32, 64 or 128.
//
// With PAIRED, rows g and g+8 of a tile are gate row i and up row width + i
// of a stacked gate|up weight, and the block writes silu(gate)·up; it takes
// its tiles in pairs, 16 outputs in a row.
//
// One activation row can go from GEMV to GEMV quantized (AmmaRow below): the
// block that computes 16 outputs quantizes them, and the next GEMV copies
// the digits instead of staging x (each lane scales its own 16 columns).
//
// With a norm weight, x is the residual stream h and the product is taken
// with RMSNorm(h)·norm_w: staging multiplies h by norm_w (the per-unit
// quantization does not care about the row's scale), keeps each unit's Σh²,
// and the row's 1/rms multiplies the sums in the epilogue. This saves the
// norm kernel between a residual add and the next block's first projection.
//
// The bias may be the output itself (one activation row): the thread that
// writes an output reads its own bias value (at the start of the tile, where
// the MMAs cover the load), which is how a block's last projection adds into
// the residual stream.

#include "affine.cuh"
#include "common.cuh"
#include "constants.cuh"

// AMMA_WARPS comes from constants.cuh.
// AMMA_STAGES comes from constants.cuh.
// AMMA_MAX_ACT comes from constants.cuh.
// A stage row is 128 bytes (4 units of 4-bit levels, 2 of 8-bit), its
// 16-byte chunks swizzled so that the fragment reads hit different banks:
// 8-byte reads of 4 rows at a time (4-bit: chunk k of row r at k ^ 2·(r & 3)),
// 16-byte reads of 2 rows at a time (8-bit: k ^ 4·(r & 1)).
#define AMMA_PITCH 128

// 64-column units per stage.
template <int BITS>
__host__ __device__ constexpr int amma_units() { return BITS == 4 ? 4 : 2; }

template <int BITS>
__device__ __forceinline__ int amma_swizzle(int row, int byte) {
    int flip = BITS == 4 ? 2 * (row & 3) : 4 * (row & 1);
    return row * AMMA_PITCH + ((((byte >> 4) ^ flip) << 4) | (byte & 15));
}

// d += a·b: a 16×32 u8 A fragment, a 32×8 s8 B fragment, s32 sums.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Bytes a stage holds per row of scales and of biases: units·64/GROUP
// values of S each; with super-block records (KScales: a stage of 4-bit
// levels is 256 columns, one record) the record alone.
template <typename S, int GROUP, int BITS>
struct AmmaSide {
    static constexpr int SCALES = amma_units<BITS>() * 64 / GROUP * sizeof(S);
    static constexpr int BIASES = SCALES;
    static constexpr bool RECORDS = false;
};
template <int GROUP, int BITS>
struct AmmaSide<KScales, GROUP, BITS> {
    static_assert(BITS == 4 && GROUP == 32, "records are per 256 columns of groups of 32");
    static constexpr int SCALES = sizeof(KScales);
    static constexpr int BIASES = 0;
    static constexpr bool RECORDS = true;
};

// One stage: 16 rows of its units' levels, then their scales, then their
// biases (AmmaSide's bytes per row).
template <typename S, int GROUP, int BITS>
struct alignas(16) AmmaStage {
    using Side = AmmaSide<S, GROUP, BITS>;
    unsigned char levels[16 * AMMA_PITCH];
    unsigned char side[16 * (Side::SCALES + Side::BIASES)];
    __device__ const unsigned char* scales(int row) const { return side + row * Side::SCALES; }
    __device__ const unsigned char* biases(int row) const { return side + 16 * Side::SCALES + row * Side::BIASES; }
};

// Scale and bias of group j of the stage's row whose scales and biases
// start at sc and bi.
template <typename S>
__device__ __forceinline__ float2 amma_group(const unsigned char* sc, const unsigned char* bi, int j) {
    return make_float2(to_f32(reinterpret_cast<const S*>(sc)[j]), to_f32(reinterpret_cast<const S*>(bi)[j]));
}
template <>
__device__ __forceinline__ float2 amma_group<KScales>(const unsigned char* sc, const unsigned char*, int j) {
    return make_float2(kscales_scale(sc, j), kscales_bias(sc, j));
}

// NaN-propagating max (fmaxf drops a NaN operand): a unit holding a NaN
// must poison its sums.
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// v·sc rounded to an integer xi, returned as the bits of the float
// 1.5·2²³ + 128 + xi: one FFMA rounds to nearest even (as a float-to-int
// conversion would, at a quarter of its throughput), and the low 16 bits are
// y = xi + 128 in two's complement. Byte 1 of y is xi's high digit
// (⌊y/256⌋ as a signed byte) and byte 0 xor 0x80 its low digit (y mod 256 −
// 128), so xi = 256·hi + lo splits with byte permutes.
#define AMMA_ROUND_MAGIC 12583040.0f  // 1.5·2²³ + 128
#define AMMA_ROUND_BITS 0x4B400080u   // its bits

// Packs the digits of y0..y3 (columns in the order given) into a word of
// high digits and a word of low digits.
__device__ __forceinline__ void amma_digits(unsigned y0, unsigned y1, unsigned y2, unsigned y3, unsigned& hi,
                                            unsigned& lo) {
    unsigned a = __byte_perm(y0, y1, 0x5140), b = __byte_perm(y2, y3, 0x5140);  // lo0 lo1 hi0 hi1
    hi = __byte_perm(a, b, 0x7632);
    lo = __byte_perm(a, b, 0x5410) ^ 0x80808080u;
}

// The scale of a unit (or slice) of x whose largest |x| is m: sc takes m just
// under 32512, inv = 1/sc, and poison is NaN where the unit holds an inf or a
// NaN (which poison the reference's products too). A unit of zeros, or one
// poisoned, keeps scale 1. Otherwise m < 2^e with e its binary exponent
// (−126 for subnormals, which the clamp below makes no different; at most 128,
// so sc and inv stay normal), so |x|·sc < (1 − 2^−7)·2^15 = 32512 and the
// high digit fits a signed byte.
struct AmmaScale {
    float sc, inv, poison;
};
__device__ __forceinline__ AmmaScale amma_scale(float m) {
    bool finite = m <= __uint_as_float(0x7f7fffffu);  // FLT_MAX; false for an inf or a NaN
    bool scaled = m > 0.0f && finite;
    int e = (int)((__float_as_uint(m) >> 23) & 0xFFu) - 126;
    int shift = max(-126, min(126, 15 - e));
    AmmaScale s;
    s.sc = scaled ? __uint_as_float((unsigned)(127 + shift) << 23) * 0.9921875f : 1.0f;
    // 1/sc rounded once: 128/127 as a float, times a power of two.
    s.inv = scaled ? __uint_as_float((unsigned)(127 - shift) << 23) * 1.00787401574803149606f : 1.0f;
    s.poison = finite ? 0.0f : __uint_as_float(0x7fc00000u);
    return s;
}

// Passes of 256 values a warp quantizes together: their loads are in flight
// together and their shuffle reductions interleave (one pass at a time left
// the warp waiting on L2 and on each reduction in turn).
#define AMMA_STAGE_PASSES 2

// The warp's sum of v[from..to), in a fixed order (lanes, then the shuffle
// tree), so that results repeat bit for bit; every lane gets it.
__device__ __forceinline__ float amma_warp_range_sum(const float* v, int from, int to) {
    float s = 0.0f;
    for (int k = from + (int)(threadIdx.x & 31); k < to; k += 32) s += v[k];
    return warp_sum(s);
}

// One warp stages units [beg, end) of n_act activation rows of x (times
// norm_w when given; then its Σx² of each row in warp_ss) into shared
// memory: per activation the high and then the low digit row (one byte per
// column, in MMA order: for 4-bit levels, per 16 columns the even columns of
// the first 8, of the next 8, then the odd ones; for 8-bit, columns in
// order), and per unit (Σxi, 1/scale). Each warp reads only the x it
// multiplies, so no block barrier stands before the first MMA.
template <int BITS, bool HALVES>
__device__ __forceinline__ void amma_stage_x(const float* __restrict__ x, const float* __restrict__ norm_w,
                                             int in_dim, int n_act, int beg, int end, unsigned char* xs,
                                             float2* stats, float* unit_ss, float* warp_ss) {
    constexpr int P = AMMA_STAGE_PASSES;
    int lane = threadIdx.x & 31, units = in_dim / 64;
    // Lanes 8j..8j+7 take the 8 blocks of 8 columns of one unit, so a unit's
    // max and sum are shuffle reductions over 8 lanes.
    int per_row = max((end - beg) * 8, 1), total = n_act * (end - beg) * 8;
    for (int i0 = 0; i0 < total; i0 += 32 * P) {
        float v[P][8], sq[P], m[P];
        int t[P], b[P];
        bool live[P];
#pragma unroll
        for (int p = 0; p < P; p++) {
            int i = i0 + 32 * p + lane;
            live[p] = i < total;
            t[p] = i / per_row, b[p] = beg * 8 + i % per_row;
#pragma unroll
            for (int k = 0; k < 8; k++) v[p][k] = 0.0f;
            if (live[p]) {
                const float4* xr = reinterpret_cast<const float4*>(x + (size_t)t[p] * in_dim + b[p] * 8);
                float4 v0 = xr[0], v1 = xr[1];
                v[p][0] = v0.x, v[p][1] = v0.y, v[p][2] = v0.z, v[p][3] = v0.w;
                v[p][4] = v1.x, v[p][5] = v1.y, v[p][6] = v1.z, v[p][7] = v1.w;
            }
        }
        if (norm_w) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                float nw[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                if (live[p]) {
                    const float4* wr = reinterpret_cast<const float4*>(norm_w + b[p] * 8);
                    float4 w0 = wr[0], w1 = wr[1];
                    nw[0] = w0.x, nw[1] = w0.y, nw[2] = w0.z, nw[3] = w0.w;
                    nw[4] = w1.x, nw[5] = w1.y, nw[6] = w1.z, nw[7] = w1.w;
                }
                sq[p] = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    sq[p] += v[p][k] * v[p][k];
                    v[p][k] *= nw[k];
                }
            }
        }
#pragma unroll
        for (int p = 0; p < P; p++) {
            m[p] = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++) m[p] = max_nan(m[p], fabsf(v[p][k]));
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                m[p] = max_nan(m[p], __shfl_xor_sync(0xffffffffu, m[p], o));
                if (norm_w) sq[p] += __shfl_xor_sync(0xffffffffu, sq[p], o);
            }
        }
        int sum[P];
        float poison[P], inv[P];
#pragma unroll
        for (int p = 0; p < P; p++) {
            AmmaScale s = amma_scale(m[p]);
            float sc = s.sc;
            inv[p] = s.inv, poison[p] = s.poison;
            unsigned y[8];
            sum[p] = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                y[k] = __float_as_uint(fmaf(v[p][k], sc, AMMA_ROUND_MAGIC));
                sum[p] += (int)(y[k] - AMMA_ROUND_BITS);
            }
            if (live[p]) {
                // Block b is the first or second 8 columns of 16-column slice b/2.
                unsigned char* slice = xs + (size_t)t[p] * 2 * in_dim + (b[p] >> 1) * 16;
                unsigned hi0, lo0, hi1, lo1;
                if (BITS == 4) {
                    amma_digits(y[0], y[2], y[4], y[6], hi0, lo0);  // even columns
                    amma_digits(y[1], y[3], y[5], y[7], hi1, lo1);  // odd columns
                    slice += (b[p] & 1) * 4;
                    *reinterpret_cast<unsigned*>(slice) = hi0;
                    *reinterpret_cast<unsigned*>(slice + 8) = hi1;
                    *reinterpret_cast<unsigned*>(slice + in_dim) = lo0;
                    *reinterpret_cast<unsigned*>(slice + in_dim + 8) = lo1;
                } else {
                    amma_digits(y[0], y[1], y[2], y[3], hi0, lo0);
                    amma_digits(y[4], y[5], y[6], y[7], hi1, lo1);
                    slice += (b[p] & 1) * 8;
                    *reinterpret_cast<uint2*>(slice) = make_uint2(hi0, hi1);
                    *reinterpret_cast<uint2*>(slice + in_dim) = make_uint2(lo0, lo1);
                }
            }
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                sum[p] += __shfl_xor_sync(0xffffffffu, sum[p], o);
                // With HALVES (groups of 32): each 32 columns' Σxi (lanes
                // 8j..8j+3 and 8j+4..8j+7), [n_act][units][2].
                if (HALVES && o == 2 && live[p] && (lane & 3) == 0)
                    stats[(t[p] * units + b[p] / 8) * 2 + ((b[p] >> 2) & 1)] =
                        make_float2((float)sum[p] + poison[p], inv[p]);
            }
        }
#pragma unroll
        for (int p = 0; p < P; p++) {
            // A non-finite unit's Σxi carries a NaN into its products' sums.
            if (live[p] && (lane & 7) == 0) {
                if (!HALVES) stats[t[p] * units + b[p] / 8] = make_float2((float)sum[p] + poison[p], inv[p]);
                if (norm_w) unit_ss[t[p] * units + b[p] / 8] = sq[p];
            }
        }
    }
    __syncwarp();
    if (norm_w) {
        // The warp's units of each row.
        for (int t = 0; t < n_act; t++) {
            float sq = amma_warp_range_sum(unit_ss + t * units, beg, end);
            if (lane == 0) warp_ss[t] = sq;
        }
    }
}

// A quantized row, as one GEMV hands its output to the next (one activation
// row of n values, n a multiple of 16): n high digits, n low digits (columns
// in order), then per slice of 16 values (Σxi + poison, 1/scale) as a float2,
// then per slice Σv² of the values before the norm weight. Slices, not units:
// a block's tile of 16 outputs is one slice, so the block that computes them
// quantizes them, and no block waits for another's.
struct AmmaRow {
    unsigned char* hi;
    float2* stats;
    float* ss;
    __device__ AmmaRow(unsigned char* base, int n)
        : hi(base), stats(reinterpret_cast<float2*>(base + 2 * (size_t)n)), ss(reinterpret_cast<float*>(stats + n / 16)) {}
};

// Lanes 0-15 of the calling warp hold outputs o0..o0+15 (a slice) of a row of
// n, lanes 16-31 zeros; every lane calls. The slice is quantized times nw
// (each lane's value of the next GEMV's folded RMSNorm weight, or 1), and
// Σv² is of v itself.
__device__ __forceinline__ void amma_quantize_slice(float v, float nw, int o0, int n, unsigned char* __restrict__ out) {
    int lane = threadIdx.x & 31;
    bool mine = lane < 16;
    float ss = v * v;
    v *= nw;
    // The slice's largest |v| and Σxi by one warp reduction each (this runs
    // on the kernel's tail): non-negative floats order as their bits, and a
    // NaN's bits (sign cleared) exceed an inf's, so the max keeps a NaN.
    float m = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    AmmaScale s = amma_scale(m);
    unsigned y = __float_as_uint(fmaf(v, s.sc, AMMA_ROUND_MAGIC));
    int sum = __reduce_add_sync(0xffffffffu, mine ? (int)(y - AMMA_ROUND_BITS) : 0);
    AmmaRow row(out, n);
    if (mine) {
        row.hi[o0 + lane] = (unsigned char)(y >> 8);             // byte 1: the high digit
        row.hi[n + o0 + lane] = (unsigned char)((y & 0xFFu) ^ 0x80u);  // byte 0 ^ 0x80: the low one
    }
    if (lane == 0) {
        row.stats[o0 / 16] = make_float2((float)sum + s.poison, s.inv);
        row.ss[o0 / 16] = ss;
    }
}

// One warp copies its units [beg, end) of a quantized row into the staged
// layout: digit rows at xs and xs + in_dim, slice stats, and with norm the
// slices' Σv². Per unit: 64 bytes of each digit row, 4 slices' stats (32
// bytes) and Σv² (16).
// On sm_90 and later lane 0 does it by bulk copies completing on `bar`
// (one phase): the wait for x is then for x alone, where a cp.async group
// completes only after every group committed before it (the weight stages
// issued ahead of it), and x's request leaves the cp.async path to the
// weights. 8B q4g64 decode +1.6%, 0.6B q4g64 +1.5% (session-ab run 103).
// Before sm_90 every lane copies by cp.async, one group left open for the
// caller to commit.
#if __CUDA_ARCH__ >= 900
#define AMMA_BULK_ROW 1
#else
#define AMMA_BULK_ROW 0
#endif
__device__ __forceinline__ void amma_copy_row(const unsigned char* __restrict__ row_in, int in_dim, int beg, int end,
                                              bool norm, unsigned char* xs, float2* stats, float* slice_ss,
                                              unsigned bar) {
    const unsigned char* st_in = row_in + 2 * (size_t)in_dim;
    const unsigned char* ss_in = st_in + (size_t)in_dim / 2;
    unsigned units = end - beg;
    unsigned char* st_out = reinterpret_cast<unsigned char*>(stats);
    unsigned char* ss_out = reinterpret_cast<unsigned char*>(slice_ss);
#if AMMA_BULK_ROW
    if ((threadIdx.x & 31) != 0) return;
    mbar_expect_bytes(bar, units * (64 + 64 + 32 + (norm ? 16 : 0)));
    if (units == 0) return;
    bulk_copy(xs + beg * 64, row_in + beg * 64, units * 64, bar);
    bulk_copy(xs + in_dim + beg * 64, row_in + in_dim + beg * 64, units * 64, bar);
    bulk_copy(st_out + beg * 32, st_in + beg * 32, units * 32, bar);
    if (norm) bulk_copy(ss_out + beg * 16, ss_in + beg * 16, units * 16, bar);
#else
    auto warp_copy = [](unsigned char* dst, const unsigned char* src, int bytes) {
        for (int o = 16 * (int)(threadIdx.x & 31); o < bytes; o += 512) cp_async<16>(dst + o, src + o, true);
    };
    warp_copy(xs + beg * 64, row_in + beg * 64, units * 64);
    warp_copy(xs + in_dim + beg * 64, row_in + in_dim + beg * 64, units * 64);
    warp_copy(st_out + beg * 32, st_in + beg * 32, units * 32);
    if (norm) warp_copy(ss_out + beg * 16, ss_in + beg * 16, units * 16);
#endif
}

// After the copy landed: 4-bit levels take x in MMA order (per 16 columns the
// even columns of the first 8, of the next 8, then the odd ones), so this
// warp's digits are permuted in place; with norm, the warp's Σv² of the row.
template <int BITS>
__device__ __forceinline__ void amma_settle_row(int in_dim, int beg, int end, bool norm, unsigned char* xs,
                                                const float* slice_ss, float* warp_ss) {
    int lane = threadIdx.x & 31;
    if (BITS == 4) {
        for (int k = lane; k < (end - beg) * 4 * 2; k += 32) {
            int slice = beg * 4 + (k >> 1);
            uint4* p = reinterpret_cast<uint4*>(xs + (k & 1) * in_dim) + slice;
            uint4 w = *p;
            *p = make_uint4(__byte_perm(w.x, w.y, 0x6420), __byte_perm(w.z, w.w, 0x6420),
                            __byte_perm(w.x, w.y, 0x7531), __byte_perm(w.z, w.w, 0x7531));
        }
    }
    if (norm) {
        float sq = amma_warp_range_sum(slice_ss, beg * 4, end * 4);
        if (lane == 0) warp_ss[0] = sq;
    }
    __syncwarp();
}

template <typename S, int GROUP, int BITS, bool PAIRED>
__device__ void gemv_affine_mma(const unsigned* __restrict__ w, const S* __restrict__ scales,
                                 const S* __restrict__ biases, const float* __restrict__ x,
                                 const float* __restrict__ norm_w, float eps, const float* bias, float* y,
                                 int out_dim, int in_dim, int n_act, const unsigned char* __restrict__ row_in,
                                 unsigned char* __restrict__ row_out, const float* __restrict__ out_norm, int lead) {
    using Stage = AmmaStage<S, GROUP, BITS>;
    using Side = typename Stage::Side;
    constexpr int SIDE = Side::SCALES;  // bytes a lane copies a stage (its row's scales, or biases)
    constexpr int UNITS = amma_units<BITS>();      // per stage
    constexpr int UNIT_BYTES = 8 * BITS;           // of a row
    constexpr int PER_STAGE = UNITS * 64 / GROUP;  // scale groups per stage and row
    // Groups of 32: a unit spans two. The MMA's 8 columns then carry two
    // activations (high and low digit) for each 32-column half, the other
    // half's B values zero, so each C column pair is one (activation, half)
    // dot: no more MMAs than a unit of one group (at most 2 activations).
    constexpr bool HALVES = GROUP == 32;
    constexpr int SIDE_COPY = SIDE < 16 ? SIDE : 16;  // bytes a cp.async moves
    // 128-byte aligned as in the one-module build (flash.cu's buffer set it
    // there): the handed-on row's bulk copies land at its start.
    extern __shared__ __align__(128) uint4 amma_shared[];
    __shared__ float partial[2][AMMA_WARPS][16][AMMA_MAX_ACT];
    __shared__ uint4 zeros[AMMA_WARPS];
    __shared__ float warp_ss[AMMA_WARPS][AMMA_MAX_ACT];  // with norm_w: each warp's Σx² of each row
    int units = in_dim / 64, groups = in_dim / GROUP;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    Stage* ring = reinterpret_cast<Stage*>(amma_shared) + warp * AMMA_STAGES;
    unsigned char* xs = reinterpret_cast<unsigned char*>(reinterpret_cast<Stage*>(amma_shared) + AMMA_WARPS * AMMA_STAGES);
    // With row_in (one activation row, quantized by the GEMV that wrote it;
    // see AmmaRow) x is copied, not staged: per slice of 16 columns a sum and
    // a scale, which lane c applies to its 16 columns of each unit.
    bool slices = row_in != nullptr;
    float2* stats = reinterpret_cast<float2*>(xs + (size_t)n_act * 2 * in_dim);  // [n_act][units] or [in_dim/16]
    float* unit_ss = reinterpret_cast<float*>(stats + (slices ? in_dim / 16 : n_act * units * (HALVES ? 2 : 1)));
    int width = PAIRED ? out_dim / 2 : out_dim;
    // A swiglu block takes its tiles of 8 outputs in pairs, 16 outputs in
    // a row: a slice of the row it may hand on quantized (row_out).
    int work = PAIRED ? (width + 15) / 16 : (out_dim + 15) / 16;
    auto tile_of = [&](int i) {
        return PAIRED ? 2 * ((int)blockIdx.x + (i >> 1) * (int)gridDim.x) + (i & 1) : (int)blockIdx.x + i * (int)gridDim.x;
    };
    // The weight row behind row `r` of tile `tile` (clamped: copies stay in bounds).
    auto tile_row = [&](int tile, int r) {
        if (PAIRED) {
            int o = min(tile * 8 + (r & 7), width - 1);
            return r < 8 ? o : width + o;
        }
        return min(tile * 16 + r, out_dim - 1);
    };
    // Units [beg, end) of this warp in every tile, in whole stages (rows are
    // a multiple of a stage's columns long).
    int per_warp = ((units + AMMA_WARPS - 1) / AMMA_WARPS + UNITS - 1) / UNITS * UNITS;
    int beg = min(warp * per_warp, units), end = min(beg + per_warp, units);
    int batches = (end - beg) / UNITS;
    int my_work = ((int)blockIdx.x < work) ? (work - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    int my_tiles = PAIRED ? 2 * my_work : my_work;
    int steps = batches * my_tiles;  // this warp's stages, tile by tile
    size_t row_bytes = (size_t)in_dim * BITS / 8;
    const unsigned char* wbase = reinterpret_cast<const unsigned char*>(w);
    const unsigned long long streamed = l2_evict_first();  // the levels' L2 policy
    const unsigned char* side_base = reinterpret_cast<const unsigned char*>(lane < 16 ? scales : biases);
    // Bytes of a row's scales (or biases), and of a stage's.
    const size_t side_row = Side::RECORDS ? (size_t)in_dim / 256 * SIDE : (size_t)groups * sizeof(S);
    constexpr int side_stage = Side::RECORDS ? SIDE : PER_STAGE * (int)sizeof(S);
    // Lanes 16-31 copy biases, which records do not have.
    const bool side_copies = lane < 16 || Side::BIASES > 0;
    // Stage after stage: 16-byte pieces of the levels (4 rows per
    // instruction, 8 lanes a row; first out of L2, see l2_evict_first), and
    // one row's scales (lanes 0-15) or biases (16-31). The copy state
    // advances by additions: the loop is issue-bound (a division and four
    // 64-bit row products a stage were a third of its instructions), so the
    // row addresses are found once a tile.
    const unsigned char* src[4];
    const unsigned char* side_src = nullptr;
    int issued = 0, issue_batch = 0, issue_tile = 0, issue_slot = 0;  // issue_tile: this block's tile index
    auto aim = [&](int tile) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            src[i] = wbase + (size_t)tile_row(tile, 4 * i + (lane >> 3)) * row_bytes + (size_t)beg * UNIT_BYTES +
                     (lane & 7) * 16;
        side_src = side_base + (size_t)tile_row(tile, lane & 15) * side_row + (size_t)(beg / UNITS) * side_stage;
    };
    aim(tile_of(issue_tile));
    // Stage byte offsets of this lane's copies (rows lane/8 + 4i share a swizzle).
    int level_dst = amma_swizzle<BITS>(lane >> 3, (lane & 7) * 16);
    int side_dst = 16 * AMMA_PITCH + (lane < 16 ? 0 : 16 * SIDE) + (lane & 15) * SIDE;  // scales, then biases

    auto issue = [&]() {
        if (issued < steps) {
            unsigned char* st = reinterpret_cast<unsigned char*>(ring + issue_slot);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                cp_async_hinted(st + level_dst + 4 * i * AMMA_PITCH, src[i], streamed);
                src[i] += UNITS * UNIT_BYTES;
            }
            if (side_copies) {
#pragma unroll
                for (int o = 0; o < SIDE; o += SIDE_COPY) cp_async<SIDE_COPY>(st + side_dst + o, side_src + o, true);
            }
            side_src += side_stage;
            issued++;
            issue_slot = issue_slot == AMMA_STAGES - 1 ? 0 : issue_slot + 1;
            if (++issue_batch == batches) {
                issue_batch = 0;
                issue_tile++;
                if (issued < steps) aim(tile_of(issue_tile));
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    // The barrier the handed-on row's bulk copies complete on (one phase).
    __shared__ alignas(8) unsigned long long row_bars[AMMA_WARPS];
    unsigned row_bar = smem_addr(&row_bars[warp]);
#if AMMA_BULK_ROW
    if (slices && lane == 0) mbar_init(row_bar);
    __syncwarp();
#endif
    // `lead` stages go out before the wait: they depend neither on x nor on
    // the kernel before this one. After a GEMV one: x's loads, after the
    // wait, queue behind the copies already in flight (a second stage there
    // made the 8B q4g64 decode 1-3% slower; none, or an L2 prefetch in its
    // place, 6%; with x by bulk copy, whose wait no longer includes the
    // stages, a second stage still cost 2.4%, run 103: the SM's requests
    // are served in order), so the next one follows the staging. After a
    // kernel that streams no weights (the decode attention, about 5 us on
    // a few SMs) the whole ring (affine.rs `affine_mma`): those copies land
    // long before the wait ends (8B q4g64 decode +0.1-0.4%, q8g64 +1.2%,
    // run 60).
    for (int b = 0; b < lead; b++) issue();
    grid_dependency_wait();
    if (lane == 0) zeros[warp] = make_uint4(0u, 0u, 0u, 0u);
    if (slices) {
        // The copy goes out, then the stages the lead left; the warp waits
        // for the copy alone.
        amma_copy_row(row_in, in_dim, beg, end, norm_w != nullptr, xs, stats, unit_ss, row_bar);
#if AMMA_BULK_ROW
        for (int b = lead; b < AMMA_STAGES - 1; b++) issue();
        mbar_wait(row_bar, 0);
#else
        asm volatile("cp.async.commit_group;\n" ::);
        for (int b = lead; b < AMMA_STAGES - 1; b++) issue();
        if (lead < AMMA_STAGES - 1)
            asm volatile("cp.async.wait_group %0;\n" ::"n"(AMMA_STAGES - 2));
        else
            asm volatile("cp.async.wait_group 0;\n" ::);
#endif
        __syncwarp();
        amma_settle_row<BITS>(in_dim, beg, end, norm_w != nullptr, xs, unit_ss, warp_ss[warp]);
    } else {
        amma_stage_x<BITS, HALVES>(x, norm_w, in_dim, n_act, beg, end, xs, stats, unit_ss, warp_ss[warp]);
        for (int b = lead; b < AMMA_STAGES - 1; b++) issue();
    }
    // B operand of this lane: activation g/2, its high (even g) or low digit;
    // lanes past the activations read zeros (one broadcast address).
    // With HALVES, B column g holds activation (g >> 1) & 1 of half g >> 2,
    // and this lane's columns (16c..16c+15 of a unit) are in half c >> 1.
    // With slices, B column g holds digit g & 1 of slice g >> 1 (columns
    // 16·(g >> 1) onwards of each unit), zero in the other lanes' columns:
    // C columns 2c and 2c + 1 are then lane c's own slice.
    int b_act = slices ? 0 : HALVES ? (g >> 1) & 1 : g >> 1;
    bool b_live = slices ? (g >> 1) == c : b_act < n_act && (!HALVES || (g >> 2) == (c >> 1));
    const uint4* xb = b_live ? reinterpret_cast<const uint4*>(xs + (b_act * 2 + (g & 1)) * (size_t)in_dim) + c
                             : zeros + warp;
    int xb_stride = b_live ? 4 : 0;  // uint4 per unit
    // This lane's C columns: activation c (with HALVES, c & 1 in half c >> 1;
    // with slices, slice c of activation 0).
    const float2* st_x = slices   ? stats + c
                         : HALVES ? stats + ((size_t)min(c & 1, n_act - 1) * units * 2 + (c >> 1))
                                  : stats + (size_t)min(c, n_act - 1) * units;
    int st_step = slices ? 4 : HALVES ? 2 : 1;  // float2 per unit
    unsigned even = 0x0F0F0F0Fu, odd = 0xF0F0F0F0u;
    float acc_top = 0.0f, acc_bottom = 0.0f;
    // An epilogue thread's activation row is threadIdx.x / OUT_ROWS in
    // every tile: it finds that row's 1/rms at its first tile (the warps'
    // Σx², after the tile's barrier), and keeps it.
    float inv_rms = 1.0f;
    // Outputs of a tile (per activation), and a swiglu pair's first 8 (lanes
    // 0-7 of warp 0) until its second tile completes the slice.
    constexpr int OUT_ROWS = PAIRED ? 8 : 16;
    float held = 0.0f;
    int read_slot = 0;
    for (int i = 0; i < my_tiles; i++) {
        // The norm weight a handed-on slice is quantized times, read now: at
        // the tile's end it would be a round trip on the kernel's tail.
        float out_nw = 1.0f;
        if (!PAIRED && out_norm && warp == 0 && lane < 16) out_nw = __ldg(out_norm + tile_of(i) * 16 + lane);
        // So is the bias of this thread's output in the epilogue (the same
        // round trip, and where the bias is y itself, the residual stream,
        // only this thread writes that value): a residual add's last tile
        // then waits for no load (8B q4g64: the o and down projections).
        float bias_v = 0.0f;
        if (!PAIRED && bias && threadIdx.x < 16 * AMMA_MAX_ACT) {
            int o = tile_of(i) * 16 + (int)threadIdx.x % 16;
            if (o < out_dim) bias_v = bias[o];
        }
        for (int batch = 0; batch < batches; batch++) {
            issue();
            asm volatile("cp.async.wait_group %0;\n" ::"n"(AMMA_STAGES - 1));
            __syncwarp();
            const Stage& st = ring[read_slot];
            read_slot = read_slot == AMMA_STAGES - 1 ? 0 : read_slot + 1;
            int u0 = beg + UNITS * batch;
            // The stage's scales and biases of rows g and g + 8, read ahead
            // of the MMAs (with HALVES each unit reads its half's own below).
            S sc_top[PER_STAGE], sc_bottom[PER_STAGE], bi_top[PER_STAGE], bi_bottom[PER_STAGE];
            if constexpr (!HALVES) {
#pragma unroll
                for (int k = 0; k < PER_STAGE; k++) {
                    sc_top[k] = reinterpret_cast<const S*>(st.scales(g))[k];
                    sc_bottom[k] = reinterpret_cast<const S*>(st.scales(g + 8))[k];
                    bi_top[k] = reinterpret_cast<const S*>(st.biases(g))[k];
                    bi_bottom[k] = reinterpret_cast<const S*>(st.biases(g + 8))[k];
                }
            }
#pragma unroll
            for (int k = 0; k < UNITS; k++) {
                int u = u0 + k;
                uint4 xv = xb[(size_t)u * xb_stride];
                int d[4] = {0, 0, 0, 0};
                if constexpr (BITS == 4) {
                    const unsigned char* lv = st.levels;
                    uint2 top = *reinterpret_cast<const uint2*>(lv + amma_swizzle<BITS>(g, k * 32 + 8 * c));
                    uint2 bottom = *reinterpret_cast<const uint2*>(lv + amma_swizzle<BITS>(g + 8, k * 32 + 8 * c));
                    mma_u8s8(d, top.x & odd, bottom.x & odd, top.y & odd, bottom.y & odd, xv.z, xv.w);
#pragma unroll
                    for (int j = 0; j < 4; j++) d[j] >>= 4;  // exact: odd levels were 16·q
                    mma_u8s8(d, top.x & even, bottom.x & even, top.y & even, bottom.y & even, xv.x, xv.y);
                } else {
                    // 8-bit levels are u8 operands as stored: columns 16c..16c+15.
                    const unsigned char* lv = st.levels;
                    uint4 top = *reinterpret_cast<const uint4*>(lv + amma_swizzle<BITS>(g, k * 64 + 16 * c));
                    uint4 bottom = *reinterpret_cast<const uint4*>(lv + amma_swizzle<BITS>(g + 8, k * 64 + 16 * c));
                    mma_u8s8(d, top.x, bottom.x, top.y, bottom.y, xv.x, xv.y);
                    mma_u8s8(d, top.z, bottom.z, top.w, bottom.w, xv.z, xv.w);
                }
                float2 s = st_x[(size_t)u * st_step];
                // Columns 2c and 2c+1 are activation c's high and low digit.
                float dot_top = (float)(d[0] * 256 + d[1]), dot_bottom = (float)(d[2] * 256 + d[3]);
                if constexpr (HALVES) {
                    // This lane's half: group 2k + c/2 of the stage's row.
                    int gk = 2 * k + (c >> 1);
                    float2 top = amma_group<S>(st.scales(g), st.biases(g), gk);
                    float2 bottom = amma_group<S>(st.scales(g + 8), st.biases(g + 8), gk);
                    acc_top += s.y * (top.x * dot_top + top.y * s.x);
                    acc_bottom += s.y * (bottom.x * dot_bottom + bottom.y * s.x);
                } else {
                    int gk = k * 64 / GROUP;
                    acc_top += s.y * (to_f32(sc_top[gk]) * dot_top + to_f32(bi_top[gk]) * s.x);
                    acc_bottom += s.y * (to_f32(sc_bottom[gk]) * dot_bottom + to_f32(bi_bottom[gk]) * s.x);
                }
            }
            __syncwarp();  // the stage is refilled by a later issue
        }
        // With slices, lane c summed slice c of each unit: the four lanes'
        // sums are the row's.
        if (slices) {
            acc_top += __shfl_xor_sync(0xffffffffu, acc_top, 1);
            acc_top += __shfl_xor_sync(0xffffffffu, acc_top, 2);
            acc_bottom += __shfl_xor_sync(0xffffffffu, acc_bottom, 1);
            acc_bottom += __shfl_xor_sync(0xffffffffu, acc_bottom, 2);
        }
        // The tile's sums over the warps (two slots: the next tile's partial
        // sums may land while this one's are read).
        int slot = i & 1;
        partial[slot][warp][g][c] = acc_top;
        partial[slot][warp][g + 8][c] = acc_bottom;
        acc_top = 0.0f, acc_bottom = 0.0f;
        __syncthreads();
        int tile = tile_of(i);
        // Epilogue thread (r, t): output row r of the tile for activation t,
        // so that activation 0's outputs lie in warp 0's first lanes.
        int r = (int)threadIdx.x % OUT_ROWS, t = (int)threadIdx.x / OUT_ROWS;
        if (norm_w && i == 0 && threadIdx.x < OUT_ROWS * AMMA_MAX_ACT) {
            int tn = min(t, n_act - 1);
            float total = 0.0f;
#pragma unroll
            for (int k = 0; k < AMMA_WARPS; k++) total += warp_ss[k][tn];
            inv_rms = rsqrtf(total / (float)in_dim + eps);
        }
        // With HALVES (not slices) columns t + 2 hold the second half's sums.
        bool second_half = HALVES && !slices && t < 2;
        float out_v = 0.0f;
        if (PAIRED) {
            int o = tile * 8 + r;
            if (threadIdx.x < 8 * AMMA_MAX_ACT && o < width && t < n_act) {
                float gate = 0.0f, up = 0.0f;
#pragma unroll
                for (int k = 0; k < AMMA_WARPS; k++) {
                    gate += partial[slot][k][r][t];
                    up += partial[slot][k][r + 8][t];
                    if (second_half) {
                        gate += partial[slot][k][r][t + 2];
                        up += partial[slot][k][r + 8][t + 2];
                    }
                }
                gate *= inv_rms, up *= inv_rms;
                out_v = gate / (1.0f + expf(-gate)) * up;
                y[(size_t)t * width + o] = out_v;
            }
        } else {
            int o = tile * 16 + r;
            if (threadIdx.x < 16 * AMMA_MAX_ACT && o < out_dim && t < n_act) {
                float sum = 0.0f;
#pragma unroll
                for (int k = 0; k < AMMA_WARPS; k++) {
                    sum += partial[slot][k][r][t];
                    if (second_half) sum += partial[slot][k][r][t + 2];
                }
                out_v = sum * inv_rms + bias_v;
                y[(size_t)t * out_dim + o] = out_v;
            }
        }
        // Handing the row on quantized (one activation row): warp 0's lanes
        // 0-15 hold a slice, for swiglu after the second tile of a pair.
        if (row_out && warp == 0) {
            if (PAIRED) {
                float second = __shfl_sync(0xffffffffu, out_v, lane & 7);
                if (i & 1)
                    amma_quantize_slice(lane < 8 ? held : lane < 16 ? second : 0.0f, 1.0f, (tile - 1) * 8, width,
                                        row_out);
                else
                    held = out_v;
            } else {
                amma_quantize_slice(lane < 16 ? out_v : 0.0f, out_nw, tile * 16, out_dim, row_out);
            }
        }
    }
}

// Per format, bit width and group size: the GEMV and its silu(gate)·up form.
// Shared memory: the stages, then the staged x and its units' sums (Rust:
// `affine_mma_shared_size`). `nw` (the norm weight) may be null, `b` (the
// bias) null or `y` itself. `q` is x as a quantized row (AmmaRow; one
// activation row) or null to stage x; `qo`, if not null, receives the output
// as a quantized row (one activation row, outputs a multiple of 16), times
// `qn` (the next GEMV's norm weight) when not null.
// 8-bit levels take groups of 32 and 64 only: a stage's scales of a row must
// be at least the 4 bytes a cp.async moves.
#define AFFINE_MMA(F, S, B, G)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
        gemv_##F##_mma_g##G(const unsigned* w, const S* s, const S* bi, const float* x, const float* nw, float eps, \
                            const float* b, float* y, int o, int i, int n, const unsigned char* q,                 \
                            unsigned char* qo, const float* qn, int lead) {                                        \
        gemv_affine_mma<S, G, B, false>(w, s, bi, x, nw, eps, b, y, o, i, n, q, qo, qn, lead);                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
        gemv_##F##_mma_g##G##_swiglu(const unsigned* w, const S* s, const S* bi, const float* x, const float* nw,  \
                                     float eps, float* y, int o, int i, int n, const unsigned char* q,             \
                                     unsigned char* qo, int lead) {                                                \
        gemv_affine_mma<S, G, B, true>(w, s, bi, x, nw, eps, nullptr, y, o, i, n, q, qo, nullptr, lead);           \
    }
AFFINE_MMA(affine4, float, 4, 32)
AFFINE_MMA(affine4_bf16, __nv_bfloat16, 4, 32)
AFFINE_MMA(affine8, float, 8, 32)
AFFINE_MMA(affine8_bf16, __nv_bfloat16, 8, 32)
AFFINE_MMA(affine4, float, 4, 64)
AFFINE_MMA(affine4, float, 4, 128)
AFFINE_MMA(affine4_bf16, __nv_bfloat16, 4, 64)
AFFINE_MMA(affine4_bf16, __nv_bfloat16, 4, 128)
AFFINE_MMA(affine8, float, 8, 64)
AFFINE_MMA(affine8_bf16, __nv_bfloat16, 8, 64)
AFFINE_MMA(affine4_k, KScales, 4, 32)
