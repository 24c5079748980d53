// Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention).
//
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

// Per token: q, k L2-normalized per key head (q also ·1/√dk); g and β per value head.
extern "C" __global__ void gdn_prepare(float* q, float* k, const float* a, const float* b, const float* a_log,
                                       const float* dt_bias, float* g, float* beta, int nk, int nv, int dk) {
    grid_dependency_wait();
    int t = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int hh = warp; hh < 2 * nk; hh += warps) {
        float* v = (hh < nk ? q : k) + ((size_t)t * nk + (hh % nk)) * dk;
        float ss = 0.0f;
        for (int c = lane; c < dk; c += 32) ss += v[c] * v[c];
        ss = warp_sum(ss);
        float inv = rsqrtf(ss + 1e-6f) * (hh < nk ? rsqrtf((float)dk) : 1.0f);
        for (int c = lane; c < dk; c += 32) v[c] *= inv;
    }
    for (int h = threadIdx.x; h < nv; h += blockDim.x) {
        size_t i = (size_t)t * nv + h;
        float x = a[i] + dt_bias[h];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(a_log[h]) * sp;
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
}

// The recurrent gated delta rule over `rows` tokens. One block per value head,
// one thread per value column j: the thread owns column S[:, j] of the f32
// state [dk, dv] (kept in global memory; it stays in L1/L2).
extern "C" __global__ void gdn_recurrent(const float* q, const float* k, const float* v, const float* g,
                                         const float* beta, float* state, float* out, int rows, int nk, int nv, int dk,
                                         int dv, int tiled) {
    grid_dependency_wait();
    int h = blockIdx.x, j = threadIdx.x;
    // Value head h reads key head h / (nv/nk) (transformers), or h % nk when
    // the value heads are stored tiled (Qwen3.5 GGUFs).
    int kh = tiled ? h % nk : h / (nv / nk);
    float* s = state + (size_t)h * dk * dv;
    for (int t = 0; t < rows; t++) {
        const float* qt = q + ((size_t)t * nk + kh) * dk;
        const float* kt = k + ((size_t)t * nk + kh) * dk;
        float decay = expf(g[(size_t)t * nv + h]);
        float bt = beta[(size_t)t * nv + h];
        if (j < dv) {
            float mem = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = s[(size_t)i * dv + j] * decay;
                s[(size_t)i * dv + j] = e;
                mem += kt[i] * e;
            }
            float delta = (v[((size_t)t * nv + h) * dv + j] - mem) * bt;
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

// The same recurrence with the state in registers, for key heads of DK = 128
// (Qwen3-Next, Qwen3.5): one warp per (value head, 16 value columns), each
// column split between two lanes (half of S[:, j] each, the halves' dot
// products added with one shuffle), held across all the tokens of the call:
// the state is read and written once per call instead of twice per token.
// q and k of each token are staged in shared memory and read as broadcasts.
template <int DK>
__device__ void gdn_recurrent_held(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                   float* state, float* out, int rows, int nk, int nv, int dv, int tiled) {
    constexpr int HALF = DK / 2;
    __shared__ float qs[DK], ks[DK];
    int h = blockIdx.x, lane = threadIdx.x, j = blockIdx.y * 16 + (lane & 15), i0 = (lane >> 4) * HALF;
    int kh = tiled ? h % nk : h / (nv / nk);
    bool ok = j < dv;
    float* st = state + (size_t)h * DK * dv;
    float s[HALF];
#pragma unroll
    for (int i = 0; i < HALF; i++) s[i] = ok ? st[(size_t)(i0 + i) * dv + j] : 0.0f;
    for (int t = 0; t < rows; t++) {
        for (int c = lane; c < DK; c += 32) {
            qs[c] = q[((size_t)t * nk + kh) * DK + c];
            ks[c] = k[((size_t)t * nk + kh) * DK + c];
        }
        __syncwarp();
        float decay = expf(g[(size_t)t * nv + h]);
        float bt = beta[(size_t)t * nv + h];
        float vj = ok ? v[((size_t)t * nv + h) * dv + j] : 0.0f;
        float o = gdn_step<HALF>(s, ks + i0, qs + i0, 1.0f, 1.0f, vj, decay, bt);
        if (ok && lane < 16) out[((size_t)t * nv + h) * dv + j] = o;
        __syncwarp();
    }
    if (ok) {
#pragma unroll
        for (int i = 0; i < HALF; i++) st[(size_t)(i0 + i) * dv + j] = s[i];
    }
}
// Arguments as gdn_recurrent's; `dk` must be 128 (the caller checks).
extern "C" __global__ void __launch_bounds__(32) gdn_recurrent_held128(const float* q, const float* k, const float* v,
                                                                     const float* g, const float* beta, float* state,
                                                                     float* out, int rows, int nk, int nv, int dk,
                                                                     int dv, int tiled) {
    grid_dependency_wait();
    gdn_recurrent_held<128>(q, k, v, g, beta, state, out, rows, nk, nv, dv, tiled);
}


// A decode step of the layer after its conv, for key heads of DK = 128: the
// work of gdn_prepare, gdn_recurrent_held and the gated RMSNorm in one launch.
// One block per value head, a warp per 16 of its value columns (the state
// split between lane halves as in gdn_recurrent_held). Per token the block
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
