// The paged KV pool in an encoded format (kv/format.rs, quant/turbo/): the
// per-sequence anchor, quantize-on-write, split-K decode attention reading
// the packed rows (dequantized in registers, the query rotated once into
// each head's key space and the value sum rotated back once), and the
// dequantization of a batch's blocks to f16 for the tensor-core prefill.
//
// Each side (keys, values) of each layer stores, per vector (block b, KV
// head h, offset o; index vi = (b·kv_heads + h)·block_size + o), its codes
// at vi·CODE_BYTES and its f32 scale at vi: a block's vectors of one head
// lie together, so the decode attention of a head reads them contiguously.
// The arithmetic is the CPU codec's (quant/turbo/codec.rs), step for step:
// the Walsh–Hadamard stages in the same order, the same thresholds and
// scales rounded as the CPU rounds them, so both give the same numbers up to
// the order of a few sums.
//
// Side formats (`FMT`): 2, 3, 4 Lloyd–Max bits (rotated); 8 uniform int8
// (rotated); 9 FP8 E4M3 (not rotated). Anchors, per pool block that starts
// a sequence, as f16: kv_dim key offsets, kv_dim value offsets, kv_dim key
// scales (kv/coded.rs explains them).

#include "common.cuh"
#include "constants.cuh"

constexpr int FMT_FP8 = 9;
constexpr int SIDE_KEYS = 0;
template <int F>
__device__ constexpr int fmt_bits() { return F == FMT_FP8 ? 8 : F; }
template <int F>
__device__ constexpr bool fmt_rotated() { return F != FMT_FP8; }

// Rows the anchor's key scales are measured over (kv/coded.rs SCALE_ROWS).
constexpr int SCALE_ROWS = 16;

// The unnormalized Walsh–Hadamard transform of HD = 32·P values, lane l
// holding values [l·P, l·P + P): stages of stride 1, 2, 4, … as the CPU's
// `fwht` takes them (strides below P within a lane, the rest across lanes).
template <int P>
__device__ __forceinline__ void warp_fwht(float (&x)[P]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 1; h < P; h <<= 1)
#pragma unroll
        for (int i = 0; i < P; i++)
            if ((i & h) == 0) {
                float u = x[i], v = x[i + h];
                x[i] = u + v;
                x[i + h] = u - v;
            }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
        for (int i = 0; i < P; i++) {
            float o = __shfl_xor_sync(0xffffffffu, x[i], m);
            x[i] = (lane & m) ? o - x[i] : x[i] + o;
        }
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// FP8 E4M3 (saturating at 448, ties to even), as quant/e4m3.rs rounds.
__device__ __forceinline__ unsigned char f32_to_e4m3(float x) {
    unsigned sign = x < 0.0f || (x == 0.0f && signbit(x)) ? 0x80u : 0u;
    float a = fabsf(x);
    if (isnan(a) || a > 464.0f) return sign | 0x7F;
    if (a < 1.0f / 64.0f) return sign | (unsigned)rintf(a * 512.0f);
    unsigned bits = __float_as_uint(a);
    int exp = (int)(bits >> 23) - 127;
    unsigned mant = bits & 0x7FFFFF, top = mant >> 20, rest = mant & 0xFFFFF, half = 0x80000;
    unsigned m = top + ((rest > half || (rest == half && (top & 1))) ? 1u : 0u);
    if (m == 8) { m = 0; exp += 1; }
    return sign | ((unsigned)(exp + 7) << 3) | m;
}

// An E4M3 byte's value divided by 2^8: its bits shifted into an f16 (whose
// exponent bias is 8 more) give exactly that, subnormals included.
__device__ __forceinline__ float e4m3_over_256(unsigned b) {
    float v = __half2float(__ushort_as_half((unsigned short)((b & 0x7F) << 7)));
    return (b & 0x80) ? -v : v;
}

// The batch table (batch.cu): row r's position, sequence, slot; a
// sequence's block table.
struct TableRow {
    int pos, slot;
    const int* blocks;
};
__device__ __forceinline__ TableRow table_row(const int* table, int rows, int r) {
    TableRow t;
    t.pos = table[r];
    t.slot = table[2 * rows + r];
    t.blocks = table + table[3 * rows + table[rows + r]];
    return t;
}

// An anchor value as stored: f16, clamped to its finite range (as kv/coded.rs).
__device__ __forceinline__ __half to_anchor(float x) { return __float2half_rn(fminf(fmaxf(x, -65504.0f), 65504.0f)); }

// Block (row, KV head), HD threads, for rows at position 0: that
// sequence's anchor (its first block's) from this row's key and value and
// the spread of the sequence's first SCALE_ROWS keys in the batch.
template <int HD>
__device__ void coded_anchor(const float* k, const float* v, __half* anchors, const int* table, int rows,
                             int kv_heads) {
    int r = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    if (table[r] != 0) return;
    int seq = table[rows + r];
    int n = 1;
    while (n < SCALE_ROWS && r + n < rows && table[rows + r + n] == seq) n++;
    int kv_dim = kv_heads * HD;
    size_t col = (size_t)h * HD + c;
    float k0 = k[(size_t)r * kv_dim + col], v0 = v[(size_t)r * kv_dim + col];
    float ms = 0.0f;
    for (int i = 0; i < n; i++) {
        float d = k[(size_t)(r + i) * kv_dim + col] - k0;
        ms += d * d / (float)n;
    }
    float mean = block_sum(ms) / HD;
    float s = n > 1 && mean > 0.0f ? powf(fmaxf(ms, mean * 1e-2f) / mean, 0.25f) : 1.0f;
    const int* blocks = table + table[3 * rows + seq];
    __half* a = anchors + (size_t)blocks[0] * 3 * kv_dim;
    a[col] = to_anchor(k0);
    a[kv_dim + col] = to_anchor(v0);
    a[2 * kv_dim + col] = to_anchor(s);
}

// One warp per (row, KV head) and side (blockIdx.y: keys, values): the row's key or value of that head made
// relative to its sequence's anchor, rotated, quantized and stored at its slot.
template <int HD>
__device__ void coded_encode(const float* x, unsigned char* codes, float* scales, const __half* anchors,
                             const float* signs, const float* book, const int* table, int rows, int kv_heads,
                             int block_size, int fmt, int side) {
    constexpr int P = HD / 32;
    int lane = threadIdx.x & 31;
    int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= rows * kv_heads) return;
    int r = item / kv_heads, h = item % kv_heads;
    TableRow t = table_row(table, rows, r);
    int kv_dim = kv_heads * HD;
    const __half* a = anchors + (size_t)t.blocks[0] * 3 * kv_dim;
    size_t vi = ((size_t)(t.slot / block_size) * kv_heads + h) * block_size + t.slot % block_size;
    float y[P];
#pragma unroll
    for (int i = 0; i < P; i++) {
        int col = h * HD + lane * P + i;
        float val = x[(size_t)r * kv_dim + col];
        y[i] = side == SIDE_KEYS ? (val - __half2float(a[col])) / __half2float(a[2 * kv_dim + col])
                                 : val - __half2float(a[kv_dim + col]);
    }
    int bits = fmt == FMT_FP8 ? 8 : fmt;
    unsigned char* out = codes + vi * (HD * bits / 8);
    if (fmt == FMT_FP8) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < P; i++) amax = fmaxf(amax, fabsf(y[i]));
        float scale = warp_max(amax) / 448.0f;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#pragma unroll
        for (int i = 0; i < P; i++) out[lane * P + i] = f32_to_e4m3(y[i] * inv);
        if (lane == 0) scales[vi] = scale;
        return;
    }
    const float inv_sqrt_d = 1.0f / sqrtf((float)HD);
#pragma unroll
    for (int i = 0; i < P; i++) y[i] *= signs[h * HD + lane * P + i];
    warp_fwht<P>(y);
#pragma unroll
    for (int i = 0; i < P; i++) y[i] *= inv_sqrt_d;
    if (fmt == 8) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < P; i++) amax = fmaxf(amax, fabsf(y[i]));
        float scale = warp_max(amax) / 127.0f;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#pragma unroll
        for (int i = 0; i < P; i++)
            out[lane * P + i] = (unsigned char)(signed char)fminf(fmaxf(roundf(y[i] * inv), -127.0f), 127.0f);
        if (lane == 0) scales[vi] = scale;
        return;
    }
    // Lloyd–Max: levels book[0..2^bits), thresholds after them.
    int levels = 1 << bits;
    const float* thresholds = book + 16;
    // Sums in the order the CPU takes them (quant/turbo/codec.rs
    // `lane_sum`): each lane's terms in order, unfused, then the butterfly.
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < P; i++) ss = __fadd_rn(ss, __fmul_rn(y[i], y[i]));
    float norm = sqrtf(warp_sum(ss));
    unsigned code[P];
    float dot = 0.0f, sq = 0.0f;
    float to_z = norm > 0.0f ? sqrtf((float)HD) / norm : 0.0f;
#pragma unroll
    for (int i = 0; i < P; i++) {
        float z = y[i] * to_z;
        unsigned c = 0;
        for (int j = 0; j < levels - 1; j++) c += thresholds[j] < z;
        code[i] = norm > 0.0f ? c : 0u;
        float l = book[code[i]];
        dot = __fadd_rn(dot, __fmul_rn(y[i], l));
        sq = __fadd_rn(sq, __fmul_rn(l, l));
    }
    dot = warp_sum(dot);
    sq = warp_sum(sq);
    float s = norm > 0.0f && sq > 0.0f ? dot / sq : 0.0f;
    s = __half2float(__float2half_rn(fminf(fmaxf(s, -65504.0f), 65504.0f)));
    // 8 codes fill `bits` bytes; the lanes holding one group of 8 OR their
    // parts together and the first of them stores the group.
    constexpr int G = P >= 8 ? 1 : 8 / P;  // lanes per group of 8 codes
    unsigned word = 0;
#pragma unroll
    for (int i = 0; i < P; i++) {
        int in_group = ((lane % G) * P + i) % 8;
        word |= code[i] << (in_group * bits);
        if (P >= 8 && in_group == 7) {
            int group = (lane * P + i) / 8;
            for (int b = 0; b < bits; b++) out[group * bits + b] = (word >> (8 * b)) & 0xFF;
            word = 0;
        }
    }
    if (P < 8) {
#pragma unroll
        for (int m = 1; m < G; m <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, m);
        if (lane % G == 0) {
            int group = lane / G;
            for (int b = 0; b < bits; b++) out[group * bits + b] = (word >> (8 * b)) & 0xFF;
        }
    }
    if (lane == 0) scales[vi] = s;
}

#define CODED_WRITE(HD)                                                                                          \
    extern "C" __global__ void coded_kv_anchor##HD(const float* k, const float* v, __half* anchors,              \
                                                   const int* table, int rows, int kv_heads) {                   \
        grid_dependency_wait();                                                                                  \
        coded_anchor<HD>(k, v, anchors, table, rows, kv_heads);                                                   \
    }                                                                                                            \
    extern "C" __global__ void coded_kv_encode##HD(                                                              \
        const float* k, const float* v, unsigned char* kcodes, float* kscales, unsigned char* vcodes,            \
        float* vscales, const __half* anchors, const float* ksigns, const float* vsigns, const float* books,     \
        const int* table, int rows, int kv_heads, int block_size, int kfmt, int vfmt) {                          \
        grid_dependency_wait();                                                                                  \
        if (blockIdx.y == 0)                                                                                     \
            coded_encode<HD>(k, kcodes, kscales, anchors, ksigns, books, table, rows, kv_heads, block_size, kfmt, \
                             SIDE_KEYS);                                                                         \
        else                                                                                                     \
            coded_encode<HD>(v, vcodes, vscales, anchors, vsigns, books + 32, table, rows, kv_heads, block_size,  \
                             vfmt, 1);                                                                           \
    }
CODED_WRITE(64)
CODED_WRITE(128)
CODED_WRITE(256)

// Codes 32·c … 32·c+31 of a packed row of B-bit codes: B words.
template <int B>
__device__ __forceinline__ void load_words(const unsigned char* row, int c, unsigned (&w)[B]) {
    const unsigned char* p = row + c * 4 * B;
    if constexpr (B % 4 == 0) {
#pragma unroll
        for (int i = 0; i < B / 4; i++) {
            uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + i);
            w[4 * i] = u.x; w[4 * i + 1] = u.y; w[4 * i + 2] = u.z; w[4 * i + 3] = u.w;
        }
    } else if constexpr (B % 2 == 0) {
#pragma unroll
        for (int i = 0; i < B / 2; i++) {
            uint2 u = __ldg(reinterpret_cast<const uint2*>(p) + i);
            w[2 * i] = u.x; w[2 * i + 1] = u.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < B; i++) w[i] = __ldg(reinterpret_cast<const unsigned*>(p) + i);
    }
}

template <int B>
__device__ __forceinline__ unsigned code_at(const unsigned (&w)[B], int i) {
    int bit = i * B, word = bit >> 5, sh = bit & 31;
    unsigned v = w[word] >> sh;
    if (sh + B > 32) v |= w[word + 1] << (32 - sh);
    return v & ((1u << B) - 1);
}

// A code's value before the vector's scale: a level, an int8, or an
// E4M3 byte over 2^8 (its scale is stored times 2^8 by the reader).
template <int F>
__device__ __forceinline__ float code_value(unsigned c, const float* lut) {
    if constexpr (F == FMT_FP8) return e4m3_over_256(c);
    else if constexpr (F == 8) return (float)(signed char)c;
    else return lut[c];
}

template <int F>
__device__ __forceinline__ float scale_factor() { return F == FMT_FP8 ? 256.0f : 1.0f; }

// Decode attention of batch rows over the encoded pool. Block (row·KV head,
// split, group of CODED_HEADS query heads), CODED_THREADS threads: the
// block's query heads are prepared once (times the attention scale and the
// anchor's key scales, rotated into the key space); each thread scores
// whole keys (its key's codes read in 16-byte pieces, each code's level
// from a table in shared memory); the softmax per head; then each key's
// value is taken by HD/8 threads (8 codes each) and the sums, reduced over
// the block, rotated back and offset by the anchor's value. Splits of
// `chunk` keys go to attention_combine (their sums carry the value offset
// times their weight, so the merge adds it once).
template <int HD, int KF, int VF>
__device__ void coded_attention(const float* q, const unsigned char* kcodes, const float* kscales,
                                const unsigned char* vcodes, const float* vscales, const __half* anchors,
                                const float* ksigns, const float* vsigns, const float* kbook, const float* vbook,
                                float* part_o, float* part_ml, float* direct, const int* table, int rows,
                                int num_heads, int kv_heads, int block_size, int window, float scale, int splits,
                                int chunk) {
    constexpr int H = CODED_HEADS, P = HD / 32, KB = fmt_bits<KF>(), VB = fmt_bits<VF>();
    constexpr int KCB = HD * KB / 8, VCB = HD * VB / 8;
    constexpr int T = HD / 8, KP = CODED_THREADS / T;  // threads per value row, value rows at once
    __shared__ __align__(16) float qr[H][HD];
    __shared__ float sc[H][CODED_CHUNK];
    __shared__ float red[KP][H][HD];
    __shared__ float klut[16], vlut[16];
    __shared__ float ml[H][2];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int group = num_heads / kv_heads;
    int row = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads, split = blockIdx.y;
    int g0 = blockIdx.z * H, gh = min(H, group - g0), h0 = kvh * group + g0;
    int kv_dim = kv_heads * HD;
    TableRow t = table_row(table, rows, row);
    int first = window > 0 ? max(0, t.pos + 1 - window) : 0;
    int lo = max(first, split * chunk), hi = min(t.pos + 1, (split + 1) * chunk), n = hi - lo;
    if (n <= 0) {
        if (direct) return;
        for (int i = tid; i < gh * HD; i += CODED_THREADS) {
            size_t part = ((size_t)row * num_heads + h0 + i / HD) * splits + split;
            part_o[part * HD + i % HD] = 0.0f;
            if (i % HD == 0) { part_ml[2 * part] = -__int_as_float(0x7f800000); part_ml[2 * part + 1] = 0.0f; }
        }
        return;
    }
    const __half* a = anchors + (size_t)t.blocks[0] * 3 * kv_dim;
    if (tid < 16) {
        klut[tid] = KB <= 4 && tid < (1 << KB) ? kbook[tid] : 0.0f;
        vlut[tid] = VB <= 4 && tid < (1 << VB) ? vbook[tid] : 0.0f;
    }
    const float inv_sqrt_d = 1.0f / sqrtf((float)HD);
    for (int g = warp; g < gh; g += CODED_THREADS / 32) {
        float x[P];
#pragma unroll
        for (int i = 0; i < P; i++) {
            int c = lane * P + i;
            x[i] = q[((size_t)row * num_heads + h0 + g) * HD + c] * scale *
                   __half2float(a[2 * kv_dim + kvh * HD + c]);
            if (fmt_rotated<KF>()) x[i] *= ksigns[kvh * HD + c];
        }
        if (fmt_rotated<KF>()) {
            warp_fwht<P>(x);
#pragma unroll
            for (int i = 0; i < P; i++) x[i] *= inv_sqrt_d;
        }
#pragma unroll
        for (int i = 0; i < P; i++) qr[g][lane * P + i] = x[i];
    }
    __syncthreads();
    // Scores: a thread per key.
    for (int j = lo + tid; j < hi; j += CODED_THREADS) {
        int b = __ldg(t.blocks + j / block_size);
        size_t vi = ((size_t)b * kv_heads + kvh) * block_size + j % block_size;
        const unsigned char* row_codes = kcodes + vi * KCB;
        float d[H];
#pragma unroll
        for (int g = 0; g < H; g++) d[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < HD / 32; c++) {
            unsigned w[KB];
            load_words<KB>(row_codes, c, w);
#pragma unroll
            for (int i = 0; i < 32; i += 4) {
                float v0 = code_value<KF>(code_at<KB>(w, i), klut), v1 = code_value<KF>(code_at<KB>(w, i + 1), klut);
                float v2 = code_value<KF>(code_at<KB>(w, i + 2), klut), v3 = code_value<KF>(code_at<KB>(w, i + 3), klut);
#pragma unroll
                for (int g = 0; g < H; g++) {
                    // One broadcast load for four of the head's coordinates.
                    float4 qv = *reinterpret_cast<const float4*>(&qr[g][32 * c + i]);
                    d[g] += qv.x * v0 + qv.y * v1 + qv.z * v2 + qv.w * v3;
                }
            }
        }
        float s = __ldg(kscales + vi) * scale_factor<KF>();
#pragma unroll
        for (int g = 0; g < H; g++) sc[g][j - lo] = d[g] * s;
    }
    __syncthreads();
    if (warp < gh) {
        float m = -__int_as_float(0x7f800000);
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[warp][j]);
        m = warp_max(m);
        float l = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float e = expf(sc[warp][j] - m);
            sc[warp][j] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { ml[warp][0] = m; ml[warp][1] = l; }
    }
    __syncthreads();
    // Values: HD/8 threads a row, 8 codes each.
    int kp = tid / T, gi = tid % T;
    float acc[H][8];
#pragma unroll
    for (int g = 0; g < H; g++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.0f;
    // VALUE_RUN rows' codes and scales are loaded before any is used, so
    // each warp keeps that many loads in flight (one row's 8 codes each
    // would leave the memory system idle between a warp's rows).
    constexpr int VALUE_RUN = 8;
    for (int j0 = lo + kp; j0 < hi; j0 += KP * VALUE_RUN) {
        unsigned long long words[VALUE_RUN];
        float vsc[VALUE_RUN];
#pragma unroll
        for (int u = 0; u < VALUE_RUN; u++) {
            int j = j0 + u * KP;
            words[u] = 0;
            vsc[u] = 0.0f;
            if (j < hi) {
                int b = __ldg(t.blocks + j / block_size);
                size_t vi = ((size_t)b * kv_heads + kvh) * block_size + j % block_size;
                const unsigned char* p = vcodes + vi * VCB + gi * VB;
                if constexpr (VB == 8) words[u] = __ldg(reinterpret_cast<const unsigned long long*>(p));
                else if constexpr (VB == 4) words[u] = __ldg(reinterpret_cast<const unsigned*>(p));
                else if constexpr (VB == 2) words[u] = __ldg(reinterpret_cast<const unsigned short*>(p));
                else
#pragma unroll
                    for (int k = 0; k < VB; k++) words[u] |= (unsigned long long)__ldg(p + k) << (8 * k);
                vsc[u] = __ldg(vscales + vi) * scale_factor<VF>();
            }
        }
#pragma unroll
        for (int u = 0; u < VALUE_RUN; u++) {
            int j = j0 + u * KP;
            if (j >= hi) break;
            float w[H];
#pragma unroll
            for (int g = 0; g < H; g++) w[g] = sc[g][j - lo] * vsc[u];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float val = code_value<VF>((unsigned)(words[u] >> (i * VB)) & ((1u << VB) - 1), vlut);
#pragma unroll
                for (int g = 0; g < H; g++) acc[g][i] += w[g] * val;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < H; g++)
#pragma unroll
        for (int i = 0; i < 8; i++) red[kp][g][8 * gi + i] = acc[g][i];
    __syncthreads();
    for (int i = tid; i < gh * HD; i += CODED_THREADS) {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < KP; k++) sum += red[k][i / HD][i % HD];
        qr[i / HD][i % HD] = sum;
    }
    __syncthreads();
    for (int g = warp; g < gh; g += CODED_THREADS / 32) {
        float x[P];
#pragma unroll
        for (int i = 0; i < P; i++) x[i] = qr[g][lane * P + i];
        if (fmt_rotated<VF>()) {
            warp_fwht<P>(x);
#pragma unroll
            for (int i = 0; i < P; i++) x[i] *= vsigns[kvh * HD + lane * P + i] * inv_sqrt_d;
        }
        size_t row_head = (size_t)row * num_heads + h0 + g;
        float l = ml[g][1];
#pragma unroll
        for (int i = 0; i < P; i++) {
            int c = lane * P + i;
            float v0 = __half2float(a[kv_dim + kvh * HD + c]);
            if (direct) {
                direct[row_head * HD + c] = x[i] / l + v0;
            } else {
                size_t part = row_head * splits + split;
                part_o[part * HD + c] = x[i] + l * v0;
                if (c == 0) { part_ml[2 * part] = ml[g][0]; part_ml[2 * part + 1] = l; }
            }
        }
    }
}

#define CODED_ATTENTION(HD, KF, VF)                                                                              \
    extern "C" __global__ void __launch_bounds__(CODED_THREADS) coded_attention##HD##_k##KF##v##VF(              \
        const float* q, const unsigned char* kc, const float* ks, const unsigned char* vc, const float* vs,      \
        const __half* anchors, const float* ksigns, const float* vsigns, const float* kbook, const float* vbook, \
        float* part_o, float* part_ml, float* direct, const int* table, int rows, int num_heads, int kv_heads,  \
        int block_size, int window, float scale, int splits, int chunk) {                                       \
        grid_dependency_wait();                                                                                  \
        coded_attention<HD, KF, VF>(q, kc, ks, vc, vs, anchors, ksigns, vsigns, kbook, vbook, part_o, part_ml,  \
                                    direct, table, rows, num_heads, kv_heads, block_size, window, scale, splits, \
                                    chunk);                                                                      \
    }
// The pairs the CUDA pool takes (kv_coded.rs CODED_PAIRS): the symmetric
// formats, and keys wider than values.
#define CODED_ATTENTION_PAIRS(HD)  \
    CODED_ATTENTION(HD, 2, 2)      \
    CODED_ATTENTION(HD, 3, 3)      \
    CODED_ATTENTION(HD, 4, 4)      \
    CODED_ATTENTION(HD, 8, 8)      \
    CODED_ATTENTION(HD, 9, 9)      \
    CODED_ATTENTION(HD, 8, 4)      \
    CODED_ATTENTION(HD, 8, 3)      \
    CODED_ATTENTION(HD, 8, 2)      \
    CODED_ATTENTION(HD, 4, 3)      \
    CODED_ATTENTION(HD, 4, 2)      \
    CODED_ATTENTION(HD, 3, 2)
CODED_ATTENTION_PAIRS(64)
CODED_ATTENTION_PAIRS(128)
CODED_ATTENTION_PAIRS(256)

// One warp per (block of the list, offset, KV head): the vector decoded,
// rotated back and offset by its sequence's anchor, as f16 at slot
// (list index · block_size + offset) of `out` ([slots, kv_dim]): the
// context of a batch's prompt chunks for the tensor-core attention.
// `map` holds per listed block its pool block and its sequence's first block.
template <int HD>
__device__ void coded_dequant(const unsigned char* codes, const float* scales, const __half* anchors,
                              const float* signs, const float* book, const int* map, __half* out, int n_blocks,
                              int kv_heads, int block_size, int fmt, int side) {
    constexpr int P = HD / 32;
    int lane = threadIdx.x & 31;
    long item = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= (long)n_blocks * block_size * kv_heads) return;
    int h = item % kv_heads, o = (item / kv_heads) % block_size, lb = item / ((long)kv_heads * block_size);
    int b = map[2 * lb], first = map[2 * lb + 1];
    int kv_dim = kv_heads * HD;
    size_t vi = ((size_t)b * kv_heads + h) * block_size + o;
    int bits = fmt == FMT_FP8 ? 8 : fmt;
    const unsigned char* row = codes + vi * (HD * bits / 8);
    float s = scales[vi];
    float x[P];
#pragma unroll
    for (int i = 0; i < P; i++) {
        int c = lane * P + i;
        if (fmt == FMT_FP8) x[i] = e4m3_over_256(row[c]) * 256.0f * s;
        else if (fmt == 8) x[i] = (float)(signed char)row[c] * s;
        else {
            int bit = c * bits;
            unsigned v = row[bit >> 3] | (unsigned)row[min((bit >> 3) + 1, HD * bits / 8 - 1)] << 8;
            x[i] = book[(v >> (bit & 7)) & ((1u << bits) - 1)] * s;
        }
    }
    if (fmt != FMT_FP8) {
        const float inv_sqrt_d = 1.0f / sqrtf((float)HD);
        warp_fwht<P>(x);
#pragma unroll
        for (int i = 0; i < P; i++) x[i] *= signs[h * HD + lane * P + i] * inv_sqrt_d;
    }
    const __half* a = anchors + (size_t)first * 3 * kv_dim;
#pragma unroll
    for (int i = 0; i < P; i++) {
        int col = h * HD + lane * P + i;
        float y = side == SIDE_KEYS ? x[i] * __half2float(a[2 * kv_dim + col]) + __half2float(a[col])
                                    : x[i] + __half2float(a[kv_dim + col]);
        out[((size_t)lb * block_size + o) * kv_dim + col] = __float2half_rn(y);
    }
}

#define CODED_DEQUANT(HD)                                                                                        \
    extern "C" __global__ void coded_kv_dequant##HD(const unsigned char* codes, const float* scales,             \
                                                    const __half* anchors, const float* signs, const float* book,\
                                                    const int* map, __half* out, int n_blocks, int kv_heads,     \
                                                    int block_size, int fmt, int side) {                         \
        grid_dependency_wait();                                                                                  \
        coded_dequant<HD>(codes, scales, anchors, signs, book, map, out, n_blocks, kv_heads, block_size, fmt,   \
                          side);                                                                                 \
    }
CODED_DEQUANT(64)
CODED_DEQUANT(128)
CODED_DEQUANT(256)
