// The batched forward over many sequences (batch.rs): keys and values in a
// pool of fixed-size blocks, written through the batch's slot mapping and
// read through each sequence's block table; RoPE at each row's own position.
//
// The batch's description is uploaded once per forward as one table of ints
// (batch.rs `BatchTable`): per row its position, its sequence and its slot,
// per sequence where its block table starts, then the block tables back to
// back, then each sequence's first row and the number of rows (the paged
// flash attention's). Every kernel here reads it after the wait (it is written by a copy
// on the stream, like an activation).

#include "common.cuh"
#include "constants.cuh"
#include "kv.cuh"
#include "rope.cuh"

// RoPE of every head of `rows` rows of `x`, row r at positions[r] (the rows
// of a ragged batch are not consecutive positions, unlike the one-sequence
// `rope` of norm_rope.cu, which reads the pass's first position). One thread
// per rotated pair.
extern "C" __global__ void paged_rope(float* x, const int* positions, const float* inv_freq, int rows, int cols,
                                      int head_dim, int rotary_dim, int style) {
    grid_dependency_wait();
    int half = rotary_dim / 2;
    int heads = cols / head_dim;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)rows * heads * half) return;
    int i = idx % half;
    int h = (idx / half) % heads;
    int r = idx / ((long)half * heads);
    rope_pair(x + (size_t)r * cols + (size_t)h * head_dim, i, positions[r], inv_freq[i], half, style);
}

// Row r of k and v (`kv_dim` values each) into slot slots[r] of the layer's
// keys and values, one thread per value (coalesced reads; each row's writes
// are contiguous within its slot).
#define PAGED_KV_WRITE(NAME, T)                                                                                    \
    extern "C" __global__ void NAME(const float* k, const float* v, T* keys, T* values, const int* slots, int rows, \
                                    int kv_dim) {                                                                  \
        grid_dependency_wait();                                                                                    \
        long i = blockIdx.x * (long)blockDim.x + threadIdx.x;                                                      \
        if (i >= (long)rows * kv_dim) return;                                                                      \
        long r = i / kv_dim;                                                                                       \
        size_t dst = (size_t)slots[r] * kv_dim + (i - r * kv_dim);                                                 \
        kv_store(keys + dst, k[i]);                                                                                \
        kv_store(values + dst, v[i]);                                                                              \
    }
PAGED_KV_WRITE(paged_kv_write, float)
PAGED_KV_WRITE(paged_kv_write_f16, __half)

// Causal (optionally sliding-window) GQA attention of a ragged batch over the
// pool: block (row, head) of PAGED_THREADS threads attends the row's query
// head over positions [first, pos] of its sequence, each key's slot looked up
// in the sequence's block table. Each warp takes every PAGED_WARPS-th key and
// keeps its own online softmax (running max m, sum l, and Σ e^(s−m)·v); each
// lane holds PAGED_LANE_DIMS of the head's dims (lane + 32·i), so a key's
// dot product is one warp sum and its value row is read coalesced. The warps'
// states are merged at the end (each rescaled by e^(m_w − M)). All in f32.
// One launch serves decode rows and prefill chunks alike; a row's work grows
// with its context, so long contexts leave few blocks per row (a split over
// keys, as the one-sequence decode attention does, is the next step).
// PAGED_THREADS and PAGED_LANE_DIMS come from constants.cuh.
constexpr int PAGED_WARPS = PAGED_THREADS / 32;
template <typename T>
__device__ void paged_attention_head(const float* q, const T* keys, const T* values, float* out, const int* table,
                                     int rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                                     int window, float scale) {
    __shared__ float warp_ml[PAGED_WARPS][2];
    __shared__ float warp_o[PAGED_WARPS][32 * PAGED_LANE_DIMS];
    int r = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The batch table: positions, sequences, slots (rows each), then where
    // each sequence's block table starts in it.
    int pos = table[r];
    const int* blocks = table + table[3 * rows + table[rows + r]];
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int kv_dim = num_kv_heads * head_dim;
    int head_off = h / (num_heads / num_kv_heads) * head_dim;
    const float* qh = q + ((size_t)r * num_heads + h) * head_dim;
    float qr[PAGED_LANE_DIMS], acc[PAGED_LANE_DIMS];
#pragma unroll
    for (int i = 0; i < PAGED_LANE_DIMS; i++) {
        int c = lane + 32 * i;
        qr[i] = c < head_dim ? qh[c] : 0.0f;
        acc[i] = 0.0f;
    }
    const float neg_inf = -__int_as_float(0x7f800000);
    float m = neg_inf, l = 0.0f;
    for (int j = first + warp; j <= pos; j += PAGED_WARPS) {
        size_t slot = (size_t)blocks[j / block_size] * block_size + j % block_size;
        const T* kr = keys + slot * kv_dim + head_off;
        const T* vr = values + slot * kv_dim + head_off;
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < PAGED_LANE_DIMS; i++) {
            int c = lane + 32 * i;
            if (c < head_dim) d += qr[i] * kv_load(kr + c);
        }
        float s = warp_sum(d) * scale;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new);  // 0 at the first key (m = −inf)
        float p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < PAGED_LANE_DIMS; i++) {
            int c = lane + 32 * i;
            acc[i] = acc[i] * corr + (c < head_dim ? p * kv_load(vr + c) : 0.0f);
        }
        m = m_new;
    }
    if (lane == 0) { warp_ml[warp][0] = m; warp_ml[warp][1] = l; }
#pragma unroll
    for (int i = 0; i < PAGED_LANE_DIMS; i++) warp_o[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    // Every row sees at least its own key, so the largest max is finite; a
    // warp that saw no key (a context shorter than PAGED_WARPS) weighs 0.
    float big = neg_inf;
#pragma unroll
    for (int w = 0; w < PAGED_WARPS; w++) big = fmaxf(big, warp_ml[w][0]);
    float weight[PAGED_WARPS], total = 0.0f;
#pragma unroll
    for (int w = 0; w < PAGED_WARPS; w++) {
        weight[w] = warp_ml[w][0] > neg_inf ? expf(warp_ml[w][0] - big) : 0.0f;
        total += weight[w] * warp_ml[w][1];
    }
    float* o = out + ((size_t)r * num_heads + h) * head_dim;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; w++) sum += weight[w] * warp_o[w][c];
        o[c] = sum / total;
    }
}
#define PAGED_ATTENTION(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(PAGED_THREADS)                                                    \
        NAME(const float* q, const T* keys, const T* values, float* out, const int* table, int rows, int num_heads, \
             int num_kv_heads, int head_dim, int block_size, int window, float scale) {                            \
        grid_dependency_wait();                                                                                    \
        paged_attention_head<T>(q, keys, values, out, table, rows, num_heads, num_kv_heads, head_dim, block_size,  \
                                window, scale);                                                                    \
    }
PAGED_ATTENTION(paged_attention, float)
PAGED_ATTENTION(paged_attention_f16, __half)
