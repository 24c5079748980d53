// Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention).

#include "common.cuh"
#include "constants.cuh"

// Depthwise causal conv1d + SiLU, one thread per channel, walking the rows in
// order; `window` holds the last kernel-1 inputs [kernel-1, channels] and is
// updated. Weight [channels, kernel]; input rows `stride` apart (the conv
// channels may be the first columns of a wider stacked projection), output
// [rows, channels].
template <typename T>
__device__ void gdn_conv(const float* x, const T* w, float* window, float* out, int rows, int channels, int kernel,
                         int stride) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float hist[8];  // kernel - 1 <= 8
    int h = kernel - 1;
    for (int j = 0; j < h; j++) hist[j] = window[(size_t)j * channels + c];
    for (int t = 0; t < rows; t++) {
        float xt = x[(size_t)t * stride + c];
        float acc = 0.0f;
        for (int j = 0; j < h; j++) acc += to_f32(w[c * kernel + j]) * hist[j];
        acc += to_f32(w[c * kernel + h]) * xt;
        out[(size_t)t * channels + c] = acc / (1.0f + expf(-acc));
        for (int j = 0; j + 1 < h; j++) hist[j] = hist[j + 1];
        if (h > 0) hist[h - 1] = xt;
    }
    for (int j = 0; j < h; j++) window[(size_t)j * channels + c] = hist[j];
}
#define GDN_CONV(NAME, T)                                                                                          \
    extern "C" __global__ void NAME(const float* x, const T* w, float* win, float* out, int rows, int ch, int k,    \
                                    int stride) {                                                                  \
        grid_dependency_wait();                                                                                    \
        gdn_conv(x, w, win, out, rows, ch, k, stride);                                                             \
    }
GDN_CONV(gdn_conv_bf16, __nv_bfloat16)
GDN_CONV(gdn_conv_f16, __half)
GDN_CONV(gdn_conv_f32, float)

// The conv of many sequences' one decode row each in one launch: row
// blockIdx.y of `x` continues from, and updates, its own sequence's window
// (`windows`, a device pointer per row).
#define GDN_CONV_SEQS(NAME, T)                                                                                     \
    extern "C" __global__ void NAME(const float* x, const T* w, const unsigned long long* windows, float* out,      \
                                    int ch, int k, int stride) {                                                   \
        grid_dependency_wait();                                                                                    \
        int r = blockIdx.y;                                                                                        \
        gdn_conv(x + (size_t)r * stride, w, (float*)windows[r], out + (size_t)r * ch, 1, ch, k, stride);           \
    }
GDN_CONV_SEQS(gdn_conv_seqs_bf16, __nv_bfloat16)
GDN_CONV_SEQS(gdn_conv_seqs_f16, __half)
GDN_CONV_SEQS(gdn_conv_seqs_f32, float)

// The same conv for a prompt: one thread per channel and run of
// GDN_CONV_RUN rows, all runs at once (walking thousands of rows in order,
// each thread waited on one load per row), each input read once per run.
// Inputs before the first row come from `window`, which gdn_conv_window
// advances afterwards; the sums are gdn_conv's, in its order.
// KERNEL: the kernel size when known at compile time (4, every Qwen GDN
// model: the window stays in registers), else 0 (read from `kernel`).
// GDN_CONV_RUN comes from constants.cuh.
template <typename T, int KERNEL>
__device__ void gdn_conv_rows(const float* x, const T* w, const float* window, float* out, int rows, int channels,
                              int kernel, int stride) {
    if (KERNEL) kernel = KERNEL;
    int c = blockIdx.x * blockDim.x + threadIdx.x, t0 = blockIdx.y * GDN_CONV_RUN, h = kernel - 1;
    if (c >= channels) return;
    float hist[8], taps[9];  // kernel - 1 <= 8
#pragma unroll
    for (int j = 0; j <= (KERNEL ? KERNEL - 1 : 8); j++)
        if (j <= h) taps[j] = to_f32(w[c * kernel + j]);
#pragma unroll
    for (int j = 0; j < (KERNEL ? KERNEL - 1 : 8); j++) {
        if (j >= h) break;
        int r = t0 - h + j;  // the input row before the run that this slot holds
        hist[j] = r >= 0 ? x[(size_t)r * stride + c] : window[(size_t)(h + r) * channels + c];
    }
    for (int t = t0; t < min(t0 + GDN_CONV_RUN, rows); t++) {
        float xt = x[(size_t)t * stride + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < (KERNEL ? KERNEL - 1 : 8); j++)
            if (j < h) acc += taps[j] * hist[j];
        acc += taps[h] * xt;
        out[(size_t)t * channels + c] = acc / (1.0f + expf(-acc));
#pragma unroll
        for (int j = 0; j < (KERNEL ? KERNEL - 1 : 8) - 1; j++)
            if (j + 1 < h) hist[j] = hist[j + 1];
        if (h > 0) hist[h - 1] = xt;
    }
}
#define GDN_CONV_ROWS(NAME, T)                                                                                     \
    extern "C" __global__ void NAME(const float* x, const T* w, const float* win, float* out, int rows, int ch,    \
                                    int k, int stride) {                                                           \
        grid_dependency_wait();                                                                                    \
        if (k == 4)                                                                                                \
            gdn_conv_rows<T, 4>(x, w, win, out, rows, ch, k, stride);                                              \
        else                                                                                                       \
            gdn_conv_rows<T, 0>(x, w, win, out, rows, ch, k, stride);                                              \
    }
GDN_CONV_ROWS(gdn_conv_rows_bf16, __nv_bfloat16)
GDN_CONV_ROWS(gdn_conv_rows_f16, __half)
GDN_CONV_ROWS(gdn_conv_rows_f32, float)

// After gdn_conv_rows: the window becomes the last kernel-1 inputs of
// (window, x). One thread per channel, slots in ascending order: slot j takes
// x's row rows-h+j, or (short prompts) old slot rows+j, not yet overwritten.
extern "C" __global__ void gdn_conv_window(const float* x, float* window, int rows, int channels, int kernel,
                                           int stride) {
    grid_dependency_wait();
    int c = blockIdx.x * blockDim.x + threadIdx.x, h = kernel - 1;
    if (c >= channels) return;
    for (int j = 0; j < h; j++) {
        int r = rows - h + j;
        window[(size_t)j * channels + c] = r >= 0 ? x[(size_t)r * stride + c] : window[(size_t)(rows + j) * channels + c];
    }
}

// Per token: q, k L2-normalized per key head (q also ·1/√dk); g and β per value head.
// Rows of q and k are `qk_stride` apart, of a and b `ab_stride` (they may be
// columns of wider stacked rows); g and β are [rows, nv].
extern "C" __global__ void gdn_prepare(float* q, float* k, const float* a, const float* b, const float* a_log,
                                       const float* dt_bias, float* g, float* beta, int nk, int nv, int dk,
                                       int qk_stride, int ab_stride) {
    grid_dependency_wait();
    int t = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int hh = warp; hh < 2 * nk; hh += warps) {
        float* v = (hh < nk ? q : k) + (size_t)t * qk_stride + (hh % nk) * dk;
        float ss = 0.0f;
        for (int c = lane; c < dk; c += 32) ss += v[c] * v[c];
        ss = warp_sum(ss);
        float inv = rsqrtf(ss + 1e-6f) * (hh < nk ? rsqrtf((float)dk) : 1.0f);
        for (int c = lane; c < dk; c += 32) v[c] *= inv;
    }
    for (int h = threadIdx.x; h < nv; h += blockDim.x) {
        size_t i = (size_t)t * nv + h, in = (size_t)t * ab_stride + h;
        float x = a[in] + dt_bias[h];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(a_log[h]) * sp;
        beta[i] = 1.0f / (1.0f + expf(-b[in]));
    }
}

// The recurrent gated delta rule over `rows` tokens. One block per value head,
// one thread per value column j: the thread owns column S[:, j] of the f32
// state [dk, dv] (kept in global memory; it stays in L1/L2). Rows of q and k
// are `qk_stride` apart, of v `v_stride`; g and β are [rows, nv].
extern "C" __global__ void gdn_recurrent(const float* q, const float* k, const float* v, const float* g,
                                         const float* beta, float* state, float* out, int rows, int nk, int nv, int dk,
                                         int dv, int tiled, int qk_stride, int v_stride) {
    grid_dependency_wait();
    int h = blockIdx.x, j = threadIdx.x;
    // Value head h reads key head h / (nv/nk) (transformers), or h % nk when
    // the value heads are stored tiled (Qwen3.5 GGUFs).
    int kh = tiled ? h % nk : h / (nv / nk);
    float* s = state + (size_t)h * dk * dv;
    for (int t = 0; t < rows; t++) {
        const float* qt = q + (size_t)t * qk_stride + kh * dk;
        const float* kt = k + (size_t)t * qk_stride + kh * dk;
        float decay = expf(g[(size_t)t * nv + h]);
        float bt = beta[(size_t)t * nv + h];
        if (j < dv) {
            float mem = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = s[(size_t)i * dv + j] * decay;
                s[(size_t)i * dv + j] = e;
                mem += kt[i] * e;
            }
            float delta = (v[(size_t)t * v_stride + h * dv + j] - mem) * bt;
            float o = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = s[(size_t)i * dv + j] + kt[i] * delta;
                s[(size_t)i * dv + j] = e;
                o += qt[i] * e;
            }
            out[((size_t)t * nv + h) * dv + j] = o;
        }
    }
}

// One token of the gated delta rule for a lane's half of a state column
// S[:, j] (`s`, rows i0..i0+HALF; `ks` and `qs` point at those rows of k and
// q, scaled by `ik` and `iq` as they are read): decay, the delta against
// what the state recalls for k, the rank-1 update, and the read-out by q.
// The two lanes of a column add their halves with one shuffle; returns o_j.
template <int HALF>
__device__ __forceinline__ float gdn_step(float (&s)[HALF], const float* ks, const float* qs, float ik, float iq,
                                          float v, float decay, float bt) {
    float mem = 0.0f;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        s[i] *= decay;
        mem += ks[i] * ik * s[i];
    }
    mem += __shfl_xor_sync(0xffffffffu, mem, 16);
    float delta = (v - mem) * bt;
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        s[i] += ks[i] * ik * delta;
        o += qs[i] * iq * s[i];
    }
    return o + __shfl_xor_sync(0xffffffffu, o, 16);
}

// The recurrence over a prompt, for key heads of 128 (Qwen3-Next, Qwen3.5):
// the state in registers for the whole call, each column S[:, j] split over
// 8 lanes (16 rows each: 16 FMAs a lane per dot product, three shuffles to
// add them), a warp per 4 value columns, a block (4 warps) per value head
// and 16 of its columns: twice as many warps as columns split over 4 lanes,
// so that two warps per scheduler hide each other's per-token chain. The
// block stages the inputs of 12 tokens at a time (q and k of its key head,
// its columns of v, g and β) with cp.async, one group ahead of the tokens
// being computed, so no token waits on a load; each token's output shares
// are added after the group, off the recurrence's chain.
// Measured at the 4B hybrid's shapes: against each column over 4 lanes, the
// hybrid's prefill went from 26.0k to 28.1k tok/s at 8192 tokens in one run
// (though ncu, timing the kernel alone, has both near 2.35 ms a layer); two
// columns per 8 lanes (halving the shared-memory loads per column, but one
// warp per scheduler) took 2.70 ms; each column over 2 lanes, loading each
// token's q and k as it came, about 14 ms (estimated from the prefill rate).
#define GDN_SCAN_TOKENS 12
#define GDN_SCAN_LANES 8                            // per column
#define GDN_SCAN_ROWS (128 / GDN_SCAN_LANES)        // of a column, per lane
// GDN_SCAN_COLS comes from constants.cuh.
static_assert(GDN_SCAN_COLS == 4 * (32 / GDN_SCAN_LANES), "a block's warps cover GDN_SCAN_COLS columns");
// A staged q or k row: a part of GDN_SCAN_ROWS values per lane of a column,
// each padded by 4 so that the lanes of a column, reading one part each,
// hit different banks.
#define GDN_SCAN_PITCH (GDN_SCAN_ROWS + 4)
struct __align__(16) GdnScanStage {
    float q[GDN_SCAN_TOKENS][GDN_SCAN_LANES * GDN_SCAN_PITCH];
    float k[GDN_SCAN_TOKENS][GDN_SCAN_LANES * GDN_SCAN_PITCH];
    float v[GDN_SCAN_TOKENS][GDN_SCAN_COLS];
    float g[GDN_SCAN_TOKENS];
    float beta[GDN_SCAN_TOKENS];
};

// Arguments as gdn_recurrent's; `dk` must be 128 (the caller checks).
// Grid: (value heads, ⌈dv/GDN_SCAN_COLS⌉), 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    gdn_scan128(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                float* __restrict__ out, int rows, int nk, int nv, int dk, int dv, int tiled, int qk_stride,
                int v_stride) {
    grid_dependency_wait();
    constexpr int R = GDN_SCAN_ROWS, L = GDN_SCAN_LANES, PER_WARP = 32 / L;
    __shared__ GdnScanStage stage[2];
    // Per token and thread: its share of its column's output.
    __shared__ float shares[GDN_SCAN_TOKENS][128];
    int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int col0 = blockIdx.y * GDN_SCAN_COLS, mine = warp * PER_WARP + lane / L, j = col0 + mine;
    int part = lane % L;
    int kh = tiled ? h % nk : h / (nv / nk);
    bool ok = j < dv;
    float* st = state + (size_t)h * 128 * dv;
    float s[R];
#pragma unroll
    for (int i = 0; i < R; i++) s[i] = ok ? st[(size_t)(part * R + i) * dv + j] : 0.0f;
    // Tokens [12·group, 12·group + 12) into stage group % 2; past the last
    // token, zeros (never read).
    auto issue = [&](int group) {
        int t0 = group * GDN_SCAN_TOKENS;
        if (t0 < rows) {
            GdnScanStage& sg = stage[group & 1];
            int n = min(GDN_SCAN_TOKENS, rows - t0);
            for (int p = tid; p < GDN_SCAN_TOKENS * 64; p += blockDim.x) {
                int tt = p >> 6, which = (p >> 5) & 1, c = p & 31;  // c: 16-byte piece of the row
                int t = t0 + min(tt, n - 1);
                const float* src = (which ? k : q) + (size_t)t * qk_stride + kh * 128 + c * 4;
                float* dst = (which ? sg.k[tt] : sg.q[tt]) + (c / (R / 4)) * GDN_SCAN_PITCH + (c % (R / 4)) * 4;
                cp_async<16>(dst, src, tt < n);
            }
            for (int p = tid; p < GDN_SCAN_TOKENS * GDN_SCAN_COLS; p += blockDim.x) {
                int tt = p / GDN_SCAN_COLS, c = p % GDN_SCAN_COLS;
                int t = t0 + min(tt, n - 1);
                cp_async<4>(&sg.v[tt][c], v + (size_t)t * v_stride + h * dv + min(col0 + c, dv - 1),
                            tt < n && col0 + c < dv);
            }
            if (tid < 2 * GDN_SCAN_TOKENS) {
                int tt = tid % GDN_SCAN_TOKENS, t = t0 + min(tt, n - 1);
                bool is_g = tid < GDN_SCAN_TOKENS;
                cp_async<4>(is_g ? &sg.g[tt] : &sg.beta[tt], (is_g ? g : beta) + (size_t)t * nv + h, tt < n);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    int groups = (rows + GDN_SCAN_TOKENS - 1) / GDN_SCAN_TOKENS;
    issue(0);
    for (int group = 0; group < groups; group++) {
        issue(group + 1);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const GdnScanStage& sg = stage[group & 1];
        int t0 = group * GDN_SCAN_TOKENS, n = min(GDN_SCAN_TOKENS, rows - t0);
        // The group's per-token scalars in registers, before the chain starts.
        float decay[GDN_SCAN_TOKENS], bt[GDN_SCAN_TOKENS], vj[GDN_SCAN_TOKENS];
#pragma unroll
        for (int tt = 0; tt < GDN_SCAN_TOKENS; tt++) {
            decay[tt] = expf(sg.g[tt]);
            bt[tt] = sg.beta[tt];
            vj[tt] = sg.v[tt][mine];
        }
        // Unrolled: the scalars stay in registers, and a token's loads of k
        // and q may go out while the token before it finishes.
#pragma unroll
        for (int tt = 0; tt < GDN_SCAN_TOKENS; tt++) {
            if (tt >= n) break;
            const float* ks = sg.k[tt] + part * GDN_SCAN_PITCH;
            const float* qs = sg.q[tt] + part * GDN_SCAN_PITCH;
            float kv[R];
#pragma unroll
            for (int i = 0; i < R; i += 4) {
                float4 f = *reinterpret_cast<const float4*>(ks + i);
                kv[i] = f.x, kv[i + 1] = f.y, kv[i + 2] = f.z, kv[i + 3] = f.w;
            }
            // Four partial sums: the dot products are chains of dependent
            // FMAs otherwise.
            float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < R; i++) {
                s[i] *= decay[tt];
                m[i & 3] += kv[i] * s[i];
            }
            float mem = (m[0] + m[1]) + (m[2] + m[3]);
#pragma unroll
            for (int o = 1; o < L; o <<= 1) mem += __shfl_xor_sync(0xffffffffu, mem, o);
            float delta = (vj[tt] - mem) * bt[tt];
            float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < R; i += 4) {
                float4 qv = *reinterpret_cast<const float4*>(qs + i);
                s[i] += kv[i] * delta;
                s[i + 1] += kv[i + 1] * delta;
                s[i + 2] += kv[i + 2] * delta;
                s[i + 3] += kv[i + 3] * delta;
                o[0] += qv.x * s[i];
                o[1] += qv.y * s[i + 1];
                o[2] += qv.z * s[i + 2];
                o[3] += qv.w * s[i + 3];
            }
            shares[tt][tid] = (o[0] + o[1]) + (o[2] + o[3]);
        }
        __syncwarp();
        // The warp's columns × the group's tokens: add each column's shares.
        for (int p = lane; p < PER_WARP * n; p += 32) {
            int tt = p / PER_WARP, c = p % PER_WARP, col = col0 + warp * PER_WARP + c;
            const float* share = &shares[tt][warp * 32 + c * L];
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < L; i++) sum += share[i];
            if (col < dv) out[((size_t)(t0 + tt) * nv + h) * dv + col] = sum;
        }
        __syncthreads();  // the stage is refilled by the next issue
    }
    if (ok) {
#pragma unroll
        for (int i = 0; i < R; i++) st[(size_t)(part * R + i) * dv + j] = s[i];
    }
}

// A decode step of the layer after its conv, for key heads of DK = 128: the
// work of gdn_prepare, the recurrence (gdn_step) and the gated RMSNorm in one launch.
// One block per value head, a warp per 16 of its value columns (the state
// split between lane halves, as gdn_step takes it). Per token the block
// stages and L2-normalizes its key head's q and k, forms g and β from the
// stacked projection's a and b, advances the recurrence, and normalizes the
// head's output gated by silu(z), with the same float operations in the same
// order as the separate kernels.
// `conv`: [rows, 2·nk·DK + nv·dv] (q|k|v); `mixed`: the stacked projection,
// rows `stride` apart, z at column z_at, b at b_at and a at a_at.
// Every load a token needs that does not depend on the state (v, z, a, b
// and the per-head constants) is issued before the first barrier: a decode
// step is a chain of dependent round trips to memory, not a stream of bytes.
// (Spreading a head over a cluster of 4 blocks, so that the state streams
// through 4× the SMs, measured no faster on the H200: 7.8 µs against 7.6
// for conv + this kernel at the 4B hybrid's shapes.)
template <int DK>
__device__ void gdn_decode(const float* __restrict__ conv, const float* __restrict__ mixed, int stride, int z_at,
                           int b_at, int a_at, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                           const float* __restrict__ norm_w, float* __restrict__ state, float* __restrict__ out,
                           int rows, int nk, int nv, int dv, int tiled, float eps) {
    constexpr int HALF = DK / 2;
    __shared__ float qs[DK], ks[DK], red[32], scalars[4];
    int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int j = warp * 16 + (lane & 15), i0 = (lane >> 4) * HALF;
    int kh = tiled ? h % nk : h / (nv / nk);
    int kd = nk * DK, vd = nv * dv, cd = 2 * kd + vd;
    bool ok = j < dv;
    float* st = state + (size_t)h * DK * dv;
    float s[HALF];
#pragma unroll
    for (int i = 0; i < HALF; i++) s[i] = ok ? st[(size_t)(i0 + i) * dv + j] : 0.0f;
    float wj = ok ? norm_w[j] : 0.0f, decay_rate = expf(a_log[h]), bias_h = dt_bias[h];
    for (int t = 0; t < rows; t++) {
        const float* ct = conv + (size_t)t * cd;
        const float* mt = mixed + (size_t)t * stride;
        float vj = ok ? ct[2 * kd + h * dv + j] : 0.0f, zj = ok ? mt[z_at + h * dv + j] : 0.0f;
        float a_in = mt[a_at + h], b_in = mt[b_at + h];
        for (int c = threadIdx.x; c < 2 * DK; c += blockDim.x) {
            if (c < DK) qs[c] = ct[kh * DK + c];
            else ks[c - DK] = ct[kd + kh * DK + c - DK];
        }
        __syncthreads();
        if (warp == 0) {
            float sq = 0.0f, sk = 0.0f;
            for (int c = lane; c < DK; c += 32) {
                sq += qs[c] * qs[c];
                sk += ks[c] * ks[c];
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            if (lane == 0) {
                scalars[0] = rsqrtf(sq + 1e-6f) * rsqrtf((float)DK);
                scalars[1] = rsqrtf(sk + 1e-6f);
                float x = a_in + bias_h;
                float sp = x > 20.0f ? x : log1pf(expf(x));
                scalars[2] = expf(-decay_rate * sp);
                scalars[3] = 1.0f / (1.0f + expf(-b_in));
            }
        }
        __syncthreads();
        float o = gdn_step<HALF>(s, ks + i0, qs + i0, scalars[1], scalars[0], vj, scalars[2], scalars[3]);
        // The gated RMSNorm over the head's dv outputs.
        bool mine = ok && lane < 16;
        float ss = warp_sum(mine ? o * o : 0.0f);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float total = 0.0f;
        for (int w = 0; w < warps; w++) total += red[w];
        if (mine) {
            float inv = rsqrtf(total / dv + eps);
            out[(size_t)t * vd + h * dv + j] = wj * (o * inv) * (zj / (1.0f + expf(-zj)));
        }
        __syncthreads();  // qs, ks and red are refilled for the next token
    }
    if (ok) {
#pragma unroll
        for (int i = 0; i < HALF; i++) st[(size_t)(i0 + i) * dv + j] = s[i];
    }
}
// Block: 32·⌈dv/16⌉ threads (dv ≤ 128: the 64 state values a lane holds need
// the registers of at most 8 warps).
extern "C" __global__ void __launch_bounds__(256)
    gdn_decode128(const float* conv, const float* mixed, int stride, int z_at, int b_at, int a_at, const float* a_log,
                  const float* dt_bias, const float* norm_w, float* state, float* out, int rows, int nk, int nv,
                  int dv, int tiled, float eps) {
    grid_dependency_wait();
    gdn_decode<128>(conv, mixed, stride, z_at, b_at, a_at, a_log, dt_bias, norm_w, state, out, rows, nk, nv, dv,
                    tiled, eps);
}

// gdn_decode128 over many sequences' one decode row each in one launch: row
// blockIdx.y with its own sequence's recurrent state (`states`, a device
// pointer per row).
extern "C" __global__ void __launch_bounds__(256)
    gdn_decode128_seqs(const float* conv, const float* mixed, int stride, int z_at, int b_at, int a_at,
                       const float* a_log, const float* dt_bias, const float* norm_w, const unsigned long long* states,
                       float* out, int nk, int nv, int dv, int tiled, float eps) {
    grid_dependency_wait();
    int r = blockIdx.y;
    size_t cd = (size_t)2 * nk * 128 + (size_t)nv * dv;
    gdn_decode<128>(conv + r * cd, mixed + (size_t)r * stride, stride, z_at, b_at, a_at, a_log, dt_bias, norm_w,
                    (float*)states[r], out + (size_t)r * nv * dv, 1, nk, nv, dv, tiled, eps);
}
