// Attention over the KV cache: the q|k|v prologue and the KV append, the
// exact kernel (parity and odd head dims), the split-K decode kernels and
// their combine. The prefill's tensor-core kernel is flash.cu's.

#include "common.cuh"
#include "constants.cuh"
#include "kv.cuh"
#include "rope.cuh"

// The attention prologue from a stacked q|k|v projection, one block per
// (row, head) over the query heads then the KV heads: the head's values
// (after the gate, for q_proj rows holding [query, gate] per head) RMS-normed
// with `q_norm`/`k_norm` when given, rotated at position step[0] + row, and
// written to `q_out`, or for KV heads the key to the cache with the value
// beside it. Same arithmetic as rms_norm then rope then kv_append. The norm
// weight and the rotation frequency of each thread's first value are read
// before the wait for the kernel before (no kernel writes them).
// PAGED: the rows of a batch (batch.cu), `step` its batch table: row t at
// position table[t], its key and value to slot table[2·rows + t] of a paged
// pool.
template <typename T, bool PAGED>
__device__ void qkv_prologue_head(const float* qkv, float* q_out, float* gate_out, T* keys, T* values,
                                  const float* q_norm, const float* k_norm, const float* inv_freq, const int* step,
                                  int num_heads, int num_kv_heads, int head_dim, int output_gate, float eps,
                                  int rotary_dim, int style, int rows = 0) {
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
    int pos, dst;  // the row's position, and the cache row or pool slot it writes
    if constexpr (PAGED) {
        pos = step[t];
        dst = step[2 * rows + t];
    } else {
        pos = step[0] + t;
        dst = pos;
    }
    if (!is_q) {
        const float* v = row + q_rows + kv_dim + kh * head_dim;
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x)
            kv_store(values + (size_t)dst * kv_dim + kh * head_dim + c, v[c]);
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
        T* out = keys + (size_t)dst * kv_dim + kh * head_dim;
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) kv_store(out + c, head[c]);
    }
}

#define QKV_PROLOGUE(NAME, T)                                                                                      \
    extern "C" __global__ void NAME(const float* qkv, float* q_out, float* gate_out, T* keys, T* values,          \
                                    const float* q_norm, const float* k_norm, const float* inv_freq,             \
                                    const int* step, int num_heads, int num_kv_heads, int head_dim,              \
                                    int output_gate, float eps, int rotary_dim, int style) {                     \
        qkv_prologue_head<T, false>(qkv, q_out, gate_out, keys, values, q_norm, k_norm, inv_freq, step, num_heads, \
                                    num_kv_heads, head_dim, output_gate, eps, rotary_dim, style);                 \
    }                                                                                                              \
    extern "C" __global__ void NAME##_paged(const float* qkv, float* q_out, float* gate_out, T* keys, T* values,  \
                                            const float* q_norm, const float* k_norm, const float* inv_freq,     \
                                            const int* table, int num_heads, int num_kv_heads, int head_dim,     \
                                            int output_gate, float eps, int rotary_dim, int style, int rows) {   \
        qkv_prologue_head<T, true>(qkv, q_out, gate_out, keys, values, q_norm, k_norm, inv_freq, table, num_heads, \
                                   num_kv_heads, head_dim, output_gate, eps, rotary_dim, style, rows);            \
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
// ATTN_CHUNK comes from constants.cuh.
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
// it (graph.rs `ensure_step`), so it is final here; both it and the rows are
// read through L2 (an earlier kernel on this SM may hold stale L1 lines).
//
// Scores: each warp 8 keys a step, q in registers. Softmax: one warp per
// head. Values: each warp a slice of the keys, each lane 4 (or 8) contiguous
// dims; then the warps' sums are added. Output as attention_split's (parts,
// or `direct`).
// DECODE_HEADS comes from constants.cuh.
// The kernel that folds the q|k|v prologue runs only where one block holds a
// head's whole cache (short contexts): there a block takes 2 query heads, so
// twice the blocks share the work (8B q4g64 decode at 128 keys 0.6-2.5%
// faster). Split caches keep 4: each block reads its chunk of keys and values
// from memory, and 2 heads a block made decode after 8192 tokens 22% slower.
// DECODE_FUSED_HEADS comes from constants.cuh.
// DECODE_THREADS comes from constants.cuh.
// Keys per block (`chunk`, chosen by attention_plan.rs `decode_plan`): a cache of at
// most DECODE_ONE_BLOCK / HD keys is one block's, its key and value rows
// 128 KB of shared memory in f32, 64 KB in f16 (fewer keys, a power of two
// and at least 32, on a device that gives a block less); longer caches are
// split in chunks of 64 KB of rows (attention_plan.rs `decode_plan`), so that three
// blocks share an SM and one's loads overlap another's arithmetic. The
// warps' value sums reuse the keys' rows: 8 warps' float4 sums of
// DECODE_HEADS heads fill the rows of decode_red_keys<T>() keys (32 in f32,
// 64 in f16), and a chunk of fewer keys leaves that much room before the
// values (attention_plan.rs `decode_shared`).
// DECODE_ONE_BLOCK comes from constants.cuh.
template <typename T>
__host__ __device__ constexpr int decode_red_keys() { return (int)(8 * DECODE_HEADS * sizeof(float) / sizeof(T)); }
// Rows [j0, j1) of the chunk starting at key `lo` of KV head `kvh`, keys to
// `ks` and values to `vs` (HD values a row), in one cp.async group. PAGED:
// key j sits in slot blocks[j / block_size]·block_size + j % block_size of
// a paged pool; else at row j of a contiguous cache.
template <int HD, bool PAGED, typename T>
__device__ __forceinline__ void decode_stage_rows(const T* keys, const T* values, T* ks, T* vs, int lo, int j0,
                                                  int j1, int kv_dim, int kvh, const int* blocks, int block_size) {
    constexpr int PER = 16 / (int)sizeof(T);  // values a 16-byte piece
    constexpr int PIECES = HD / PER;         // pieces a row
    for (int i = j0 * PIECES + threadIdx.x; i < j1 * PIECES; i += DECODE_THREADS) {
        int j = i / PIECES, p = i % PIECES;
        size_t key = lo + j;
        if constexpr (PAGED) key = (size_t)__ldg(blocks + key / block_size) * block_size + key % block_size;
        size_t src = key * kv_dim + kvh * HD + PER * p;
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

// PAGED: rows of a batch over a paged pool. `step` is then the batch table
// (batch.cu): row t's position is table[t] and its sequence's block table
// is found through it; every key, this pass's too, was written before.
template <int HD, bool FUSED, bool PAGED, int HEADS, typename T>
__device__ void attention_decode(const float* q, T* keys, T* values, float* part_o, float* part_ml, float* direct,
                                 const int* step, int num_heads, int num_kv_heads, int window, float scale,
                                 int splits, int chunk, DecodePrologue pro, int rows = 0, int block_size = 0) {
    static_assert(!(FUSED && PAGED), "the paged form takes the prologue's rows from the pool");
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
    const int* blocks = nullptr;
    int start, pos;
    if constexpr (PAGED) {
        pos = __ldg(step + t);
        blocks = step + __ldg(step + 3 * rows + __ldg(step + rows + t));
        start = 0;
    } else {
        start = __ldcg(step);
        pos = start + t;
    }
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int lo = max(first, split * chunk), hi = min(pos + 1, (split + 1) * chunk);
    int n = hi - lo;
    int kv_dim = num_kv_heads * HD;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int earlier = min(max(start - lo, 0), max(n, 0));  // rows written by earlier passes
    if (earlier > 0)
        decode_stage_rows<HD, PAGED, T>(keys, values, ks, vs, lo, 0, earlier, kv_dim, kvh, blocks, block_size);
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
        if (earlier < n)
            decode_stage_rows<HD, PAGED, T>(keys, values, ks, vs, lo, earlier, n, kv_dim, kvh, blocks, block_size);
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
        attention_decode<HD, false, false, DECODE_HEADS, T>(q, k, v, po, pml, direct, step, nh, nkv, window,      \
                                                            scale, splits, chunk,                                  \
                                                            DecodePrologue{nullptr, nullptr, nullptr, nullptr,     \
                                                                           0.0f, 0, 0, 0});                        \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attention_decode##HD##_prologue##SUFFIX(          \
        const float* qkv, T* k, T* v, float* po, float* pml, float* direct, const int* step, int nh, int nkv,      \
        int window, float scale, int splits, int chunk, const float* q_norm, const float* k_norm,                  \
        const float* inv_freq, float* gate, float eps, int output_gate, int rotary_dim, int style) {               \
        attention_decode<HD, true, false, DECODE_FUSED_HEADS, T>(qkv, k, v, po, pml, direct, step, nh, nkv,        \
                                                                 window, scale, splits, chunk,                     \
                                                                 DecodePrologue{q_norm, k_norm, inv_freq, gate,    \
                                                                                eps, output_gate, rotary_dim,      \
                                                                                style});                           \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attention_decode##HD##_paged##SUFFIX(             \
        const float* q, T* k, T* v, float* po, float* pml, float* direct, const int* table, int nh, int nkv,       \
        int window, float scale, int splits, int chunk, int rows, int block_size) {                                \
        attention_decode<HD, false, true, DECODE_HEADS, T>(q, k, v, po, pml, direct, table, nh, nkv, window,       \
                                                           scale, splits, chunk,                                   \
                                                           DecodePrologue{nullptr, nullptr, nullptr, nullptr,      \
                                                                          0.0f, 0, 0, 0},                          \
                                                           rows, block_size);                                      \
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
// merging 64 splits of 32 heads (ncu, H200). Shared memory (attention_plan.rs
// `combine_shared`): the weights, then 8 × 32 partial sums.
// COMBINE_DIMS comes from constants.cuh.
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
