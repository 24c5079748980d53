// Elementwise and row kernels: embedding rows of float tables, the step
// inputs of a pass, SwiGLU, adds, gates, column and row copies.

#include "common.cuh"

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

// The pass's inputs on the device, so a recorded decode step (CUDA graph) can
// be replayed at any position: step[0] is the first row's position, step[1]
// the token id of a one-token pass. Set by a launch before the pass (or the
// replay), never baked into the recorded kernels' arguments.
extern "C" __global__ void set_step(int* step, int start, int id) {
    grid_dependency_wait();
    step[0] = start;
    step[1] = id;
}

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
