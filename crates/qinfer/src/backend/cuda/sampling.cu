// Sampling on the device, so that only a token id crosses to the host. The
// reference is `pick` in engine/sampler.rs: repetition penalty, temperature,
// top-k, top-p, min-p, then a draw from what is left, with candidates ordered
// by scaled logit, descending, ties by lower token id.
//
// Nothing is sorted. Every filter keeps a prefix of that order, so each is a
// cut: the position in the order where a running total (of candidates, or of
// probability) first reaches a target. A cut is found by a radix select over
// the order-preserving bits of the scaled logit, 8 bits per pass, with a
// histogram of the total per digit; ties at the final key are resolved in
// token order. The draw itself is one more cut, at u times the kept mass.

#include "common.cuh"
#include "constants.cuh"

// SAMPLE_THREADS comes from constants.cuh.
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// ARGMAX_BLOCKS: the blocks sampling.rs launches `sample_argmax` with.
// Values a thread loads at once (with ARGMAX_BLOCKS·256 threads, one round
// for vocabularies up to 262144).
#define ARGMAX_BATCH 8

// Unsigned keys in the order of the floats (larger float, larger key).
__device__ __forceinline__ unsigned sample_key(float v) {
    unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A position in the candidate order: everything with a larger key, and the
// candidates of this key up to token `idx`, are at or before it.
struct SamplePos {
    unsigned key;
    int idx;
};

__device__ __forceinline__ bool sample_within(unsigned key, int idx, SamplePos p) {
    return key > p.key || (key == p.key && idx <= p.idx);
}

__device__ __forceinline__ SamplePos sample_earlier(SamplePos a, SamplePos b) {
    return sample_within(a.key, a.idx, b) ? a : b;
}

// Block-wide reductions for SAMPLE_THREADS threads. `red` is shared scratch
// of SAMPLE_WARPS values; every thread gets the result.
__device__ float sample_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[threadIdx.x & 31];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

struct SampleMax {
    __device__ unsigned operator()(unsigned a, unsigned b) const { return max(a, b); }
};
struct SampleMin {
    __device__ unsigned operator()(unsigned a, unsigned b) const { return min(a, b); }
};

template <typename Op>
__device__ unsigned sample_reduce_u(unsigned v, unsigned* red, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[threadIdx.x & 31];
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    return v;
}

// Inclusive prefix sum over the block in thread order; `red` as above.
__device__ float sample_scan(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        float t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    if (lane == 31) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = red[lane];
        for (int o = 1; o < 32; o <<= 1) {
            float t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        red[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v += red[warp - 1];
    __syncthreads();
    return v;
}

struct SampleShared {
    float hist[SAMPLE_WARPS * 256];
    float bins[256];
    float red[SAMPLE_WARPS];
    unsigned ured[SAMPLE_WARPS];
    int found;
    float above;
};

// The last candidate at or before `limit`.
__device__ SamplePos sample_last(const float* x, int n, float temperature, SamplePos limit, SampleShared& sh) {
    unsigned kmin = 0xffffffffu;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        unsigned k = sample_key(x[i] / temperature);
        if (sample_within(k, i, limit)) kmin = min(kmin, k);
    }
    kmin = sample_reduce_u(kmin, sh.ured, SampleMin{});
    unsigned last = 0;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        unsigned k = sample_key(x[i] / temperature);
        if (k == kmin && sample_within(k, i, limit)) last = max(last, (unsigned)i + 1);
    }
    last = sample_reduce_u(last, sh.ured, SampleMax{});
    return SamplePos{kmin, (int)last - 1};
}

// The first position at or before `limit` where the running total of
// weight(scaled logit) over the order reaches `target` (> 0); the last
// candidate within `limit` when rounding leaves the total short of it.
template <typename Weight>
__device__ SamplePos sample_cut(const float* x, int n, float temperature, SamplePos limit, float target, Weight weight,
                                SampleShared& sh) {
    int warp = threadIdx.x >> 5;
    unsigned prefix = 0;
    float above = 0.0f;  // weight of the candidates with a larger key
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < SAMPLE_WARPS * 256; b += SAMPLE_THREADS) sh.hist[b] = 0.0f;
        if (threadIdx.x == 0) sh.found = 0x7fffffff;
        __syncthreads();
        unsigned high = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            float s = x[i] / temperature;
            unsigned k = sample_key(s);
            if ((k & high) == prefix && sample_within(k, i, limit)) {
                atomicAdd(&sh.hist[warp * 256 + ((k >> shift) & 255)], weight(s));
            }
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            float t = 0.0f;
            for (int w = 0; w < SAMPLE_WARPS; ++w) t += sh.hist[w * 256 + threadIdx.x];
            sh.bins[threadIdx.x] = t;
        }
        __syncthreads();
        // Thread t looks at digit 255 - t: the inclusive scan is the weight
        // of this digit and every larger one. The cut is in the largest digit
        // whose total reaches the target.
        float mine = threadIdx.x < 256 ? sh.bins[255 - threadIdx.x] : 0.0f;
        float incl = sample_scan(mine, sh.red);
        if (threadIdx.x < 256 && above + incl >= target) atomicMin(&sh.found, (int)threadIdx.x);
        __syncthreads();
        int t = sh.found;
        if (t == 0x7fffffff) return sample_last(x, n, temperature, limit, sh);
        if (threadIdx.x == t) sh.above = above + incl - mine;
        __syncthreads();
        above = sh.above;
        prefix |= (unsigned)(255 - t) << shift;
        __syncthreads();
    }
    // The key is `prefix`; walk its candidates in token order, 1024 at a time.
    for (int base = 0; base < n; base += SAMPLE_THREADS) {
        int i = base + threadIdx.x;
        bool tie = false;
        float w = 0.0f;
        if (i < n) {
            float s = x[i] / temperature;
            tie = sample_key(s) == prefix && sample_within(prefix, i, limit);
            if (tie) w = weight(s);
        }
        if (threadIdx.x == 0) sh.found = 0x7fffffff;
        float incl = sample_scan(w, sh.red);
        if (tie && above + incl >= target) atomicMin(&sh.found, i);
        __syncthreads();
        int hit = sh.found;
        if (hit != 0x7fffffff) return SamplePos{prefix, hit};
        above += sh.red[SAMPLE_WARPS - 1];
        __syncthreads();
    }
    return sample_last(x, n, temperature, limit, sh);
}

struct SampleCount {
    __device__ float operator()(float) const { return 1.0f; }
};

struct SampleProb {
    float max, inv_z;
    __device__ float operator()(float s) const { return expf(s - max) * inv_z; }
};

// The block's sum of weight(s) over the candidates within `limit` (scaled
// logits s), the same for every thread.
template <typename W>
__device__ float sample_mass(const float* x, int n, float temperature, SamplePos limit, W weight,
                             SampleShared& sh) {
    float total = 0.0f;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        float s = x[i] / temperature;
        if (sample_within(sample_key(s), i, limit)) total += weight(s);
    }
    return sample_sum(total, sh.red);
}

// min-p: `limit` cut back to the candidates whose probability reaches `cut`
// (a prefix of the order, as the probabilities fall along it).
__device__ SamplePos sample_min_p(const float* x, int n, float temperature, SamplePos limit, float cut,
                                  SampleProb prob, SampleShared& sh) {
    unsigned kmin = 0xffffffffu;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        float s = x[i] / temperature;
        unsigned k = sample_key(s);
        if (sample_within(k, i, limit) && prob(s) >= cut) kmin = min(kmin, k);
    }
    kmin = sample_reduce_u(kmin, sh.ured, SampleMin{});
    return kmin != 0xffffffffu ? sample_earlier(limit, SamplePos{kmin, 0x7fffffff}) : limit;
}

// The pick from the n candidates x (positions in x order ties as token ids
// do), by the whole block: temperature > 0, top_k = 0 for none, top_p = 1
// for none, min_p = 0 for none; u in [0, 1). Returns the position in x.
__device__ int sample_filtered_pick(const float* x, int n, float temperature, int top_k, float top_p, float min_p,
                                    float u, SampleShared& sh) {
    unsigned kmax = 0;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) kmax = max(kmax, sample_key(x[i] / temperature));
    kmax = sample_reduce_u(kmax, sh.ured, SampleMax{});
    float smax = __uint_as_float((kmax & 0x80000000u) ? (kmax & 0x7fffffffu) : ~kmax);
    SamplePos limit{0u, 0x7fffffff};
    if (top_k > 0 && top_k < n) limit = sample_cut(x, n, temperature, limit, (float)top_k, SampleCount{}, sh);
    float z = sample_mass(x, n, temperature, limit, SampleProb{smax, 1.0f}, sh);
    SampleProb prob{smax, 1.0f / z};
    if (top_p < 1.0f) limit = sample_cut(x, n, temperature, limit, top_p, prob, sh);
    // The most likely candidate has weight exp(0) = 1.
    if (min_p > 0.0f) limit = sample_min_p(x, n, temperature, limit, prob(smax) * min_p, prob, sh);
    float total = sample_mass(x, n, temperature, limit, prob, sh);
    return sample_cut(x, n, temperature, limit, fmaxf(u * total, 1e-38f), prob, sh).idx;
}

// Where a pick goes: `out`, and with `feed` (sampling.rs `sample_ahead`) the
// step inputs of the next one-token pass (position feed_start, the pick) and
// the host's pinned slot `feed_host`, so no other launch or copy stands
// between the pick and the next step.
__device__ __forceinline__ void sample_emit(unsigned pick, unsigned* out, int* feed, int feed_start,
                                            unsigned* feed_host) {
    *out = pick;
    if (feed) {
        feed[0] = feed_start;
        feed[1] = (int)pick;
        // No fence: the host reads the slot only after an event recorded
        // behind this kernel, whose completion makes its writes visible.
        *(volatile unsigned*)feed_host = pick;
    }
}

// One block of SAMPLE_THREADS over the whole vocabulary (sample_filtered_pick).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_filtered(const float* x, int n, float temperature, int top_k, float top_p, float min_p, float u,
                    unsigned* out, int* feed, int feed_start, unsigned* feed_host) {
    grid_dependency_wait();
    __shared__ SampleShared sh;
    int pick = sample_filtered_pick(x, n, temperature, top_k, top_p, min_p, u, sh);
    if (threadIdx.x == 0) sample_emit((unsigned)pick, out, feed, feed_start, feed_host);
}

// With a top-k of at most TOPK_MAX, every later filter and the draw see only
// the k best candidates, so the vocabulary is cut down first on many SMs:
// TOPK_BLOCKS blocks each find the top k of their slice (a radix select as
// above), and write those candidates out in token order. The global top k
// is among them. The last block to finish (by the ticket) gathers the
// slices' candidates, still in token order (so ties resolve as over the
// whole vocabulary), into shared memory and picks from them as
// sample_filtered does from everything. Dynamic shared memory: the gathered
// logits, then their token ids (TOPK_BLOCKS·TOPK_MAX each).
//
// Without a top-k (top_k = 0) the same cut-down serves top-p, min-p and
// plain temperature: each block keeps the TOPK_MAX best of its slice and
// also writes the slice's max scaled logit and Σexp(s − max) (so the last
// block has the whole vocabulary's normalizer) and its best candidate left
// out. Every candidate before the best one left out over all slices (E) is
// among the gathered ones, so a filter or a draw that ends before E is
// exactly what the whole vocabulary gives (sample_nucleus_pick). When it
// would not end before E (a flat distribution) the last block picks from
// the whole vocabulary itself, as sample_filtered does, and counts it in
// `fallbacks`.
// TOPK_BLOCKS comes from constants.cuh.
// TOPK_MAX comes from constants.cuh.

// Whether candidate (key, id) comes before (ekey, eid) in the order.
__device__ __forceinline__ bool sample_before(unsigned key, int id, unsigned ekey, int eid) {
    return key > ekey || (key == ekey && id < eid);
}

// The pick from the gathered candidates x (token ids `ids`, m of them)
// with the whole vocabulary's max scaled logit `smax` and normalizer `z`,
// E = (ekey, eid, its scaled logit es) the best candidate not gathered (eid
// = INT_MAX when none was left out). Returns the position in x, or -1 when
// the result could depend on candidates not gathered.
__device__ int sample_nucleus_pick(const float* x, const int* ids, int m, float temperature, float top_p, float min_p,
                                   float u, float smax, float z, unsigned ekey, int eid, float es, SampleShared& sh) {
    if (!(z > 0.0f) || !isfinite(z) || !isfinite(smax)) return -1;
    SampleProb prob{smax, 1.0f / z};
    // The mass before E: the same over the gathered candidates as over the
    // whole vocabulary (every candidate before E was gathered).
    float before = 0.0f;
    for (int i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
        float s = x[i] / temperature;
        if (sample_before(sample_key(s), ids[i], ekey, eid)) before += prob(s);
    }
    before = sample_sum(before, sh.red);
    bool none_left_out = eid == 0x7fffffff;
    // Margins for rounding: the mass is summed in another order than the cuts'.
    const float slack = 1e-5f;
    SamplePos limit{0u, 0x7fffffff};
    bool bounded = none_left_out;  // the kept candidates all come before E
    if (top_p < 1.0f) {
        if (!none_left_out && before < top_p * (1.0f + slack)) return -1;
        limit = sample_cut(x, m, temperature, limit, top_p, prob, sh);
        bounded = true;
    }
    if (min_p > 0.0f) {
        float cut = prob(smax) * min_p;
        limit = sample_min_p(x, m, temperature, limit, cut, prob, sh);
        if (!bounded) {
            if (prob(es) >= cut * (1.0f - slack)) return -1;  // E itself would be kept
            bounded = true;
        }
    }
    float total = 1.0f;  // nothing filtered: the whole vocabulary's mass
    if (bounded) {
        total = sample_mass(x, m, temperature, limit, prob, sh);
    } else if (u * total > before * (1.0f - slack)) {
        return -1;  // the draw lands at or past E
    }
    return sample_cut(x, m, temperature, limit, fmaxf(u * total, 1e-38f), prob, sh).idx;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_top_k(const float* x, int n, float temperature, int top_k, float top_p, float min_p, float u,
                 float* cand_x, int* cand_id, int* cand_count, float* slice_max, float* slice_z, float* left_x,
                 int* left_id, unsigned* ticket, unsigned* fallbacks, unsigned* out, int* feed, int feed_start,
                 unsigned* feed_host) {
    grid_dependency_wait();
    __shared__ SampleShared sh;
    __shared__ int offsets[TOPK_BLOCKS + 1];
    __shared__ bool last;
    extern __shared__ float gathered[];  // [TOPK_BLOCKS·TOPK_MAX] logits, then as many ids
    int* gathered_id = reinterpret_cast<int*>(gathered + TOPK_BLOCKS * TOPK_MAX);
    int per = (n + gridDim.x - 1) / gridDim.x, b0 = min((int)blockIdx.x * per, n), len = min(per, n - b0);
    const float* xs = x + b0;
    int keep = top_k > 0 ? top_k : TOPK_MAX;
    SamplePos limit{0u, 0x7fffffff};
    if (keep < len) limit = sample_cut(xs, len, temperature, limit, (float)keep, SampleCount{}, sh);
    if (top_k == 0) {
        // The slice's max and Σexp(s − max), and its best candidate left out
        // (largest key, then lowest id).
        unsigned kmax = 0, kleft = 0;
        for (int i = threadIdx.x; i < len; i += SAMPLE_THREADS) {
            unsigned k = sample_key(xs[i] / temperature);
            kmax = max(kmax, k);
            if (!sample_within(k, i, limit)) kleft = max(kleft, k);
        }
        kmax = sample_reduce_u(kmax, sh.ured, SampleMax{});
        kleft = sample_reduce_u(kleft, sh.ured, SampleMax{});
        float smax = __uint_as_float((kmax & 0x80000000u) ? (kmax & 0x7fffffffu) : ~kmax);
        float zs = 0.0f;
        unsigned first = 0xffffffffu;
        for (int i = threadIdx.x; i < len; i += SAMPLE_THREADS) {
            float s = xs[i] / temperature;
            unsigned k = sample_key(s);
            zs += expf(s - smax);
            if (k == kleft && !sample_within(k, i, limit)) first = min(first, (unsigned)i);
        }
        zs = sample_sum(zs, sh.red);
        first = sample_reduce_u(first, sh.ured, SampleMin{});
        if (threadIdx.x == 0) {
            slice_max[blockIdx.x] = len > 0 ? smax : __int_as_float(0xff800000);
            slice_z[blockIdx.x] = len > 0 ? zs : 0.0f;
            left_x[blockIdx.x] = first == 0xffffffffu ? 0.0f : xs[first];
            left_id[blockIdx.x] = first == 0xffffffffu ? 0x7fffffff : b0 + (int)first;
        }
    }
    // The slice's candidates within the cut, in token order (a block scan of
    // the kept flags per 1024 tokens).
    int count = 0;
    for (int base = 0; base < len; base += SAMPLE_THREADS) {
        int i = base + threadIdx.x;
        bool kept = i < len && sample_within(sample_key(xs[i] / temperature), i, limit);
        int incl = (int)sample_scan(kept ? 1.0f : 0.0f, sh.red);
        if (kept) {
            cand_x[blockIdx.x * TOPK_MAX + count + incl - 1] = xs[i];
            cand_id[blockIdx.x * TOPK_MAX + count + incl - 1] = b0 + i;
        }
        count += (int)sh.red[SAMPLE_WARPS - 1];
        __syncthreads();
    }
    // Every thread's candidates are written before the ticket is taken.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        cand_count[blockIdx.x] = count;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < gridDim.x) offsets[threadIdx.x + 1] = __ldcg(cand_count + threadIdx.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int b = 0; b < (int)gridDim.x; b++) offsets[b + 1] += offsets[b];
        *ticket = 0u;  // rearmed for the next call
    }
    __syncthreads();
    for (int i = threadIdx.x; i < (int)gridDim.x * TOPK_MAX; i += SAMPLE_THREADS) {
        int b = i / TOPK_MAX, j = i % TOPK_MAX;
        if (j < offsets[b + 1] - offsets[b]) {
            gathered[offsets[b] + j] = __ldcg(cand_x + i);
            gathered_id[offsets[b] + j] = __ldcg(cand_id + i);
        }
    }
    __syncthreads();
    if (top_k > 0) {
        int pick = sample_filtered_pick(gathered, offsets[gridDim.x], temperature, top_k, top_p, min_p, u, sh);
        if (threadIdx.x == 0) sample_emit((unsigned)gathered_id[pick], out, feed, feed_start, feed_host);
        return;
    }
    // The whole vocabulary's max and normalizer, and E: in a fixed order
    // (block by block), so results repeat bit for bit.
    __shared__ float whole[2];
    __shared__ unsigned left_key;
    __shared__ int left_token;
    __shared__ float left_s;
    if (threadIdx.x == 0) {
        float smax = __int_as_float(0xff800000), z = 0.0f, es = 0.0f;
        unsigned ekey = 0u;
        int eid = 0x7fffffff;
        for (int b = 0; b < (int)gridDim.x; b++) smax = fmaxf(smax, __ldcg(slice_max + b));
        for (int b = 0; b < (int)gridDim.x; b++) {
            float mb = __ldcg(slice_max + b);
            if (mb > __int_as_float(0xff800000)) z += __ldcg(slice_z + b) * expf(mb - smax);
            int id = __ldcg(left_id + b);
            if (id != 0x7fffffff) {
                float s = __ldcg(left_x + b) / temperature;
                unsigned k = sample_key(s);
                if (sample_before(k, id, ekey, eid)) ekey = k, eid = id, es = s;
            }
        }
        whole[0] = smax, whole[1] = z;
        left_key = ekey, left_token = eid, left_s = es;
    }
    __syncthreads();
    int pick = sample_nucleus_pick(gathered, gathered_id, offsets[gridDim.x], temperature, top_p, min_p, u, whole[0],
                                   whole[1], left_key, left_token, left_s, sh);
    if (pick >= 0) {
        if (threadIdx.x == 0) sample_emit((unsigned)gathered_id[pick], out, feed, feed_start, feed_host);
        return;
    }
    pick = sample_filtered_pick(x, n, temperature, 0, top_p, min_p, u, sh);
    if (threadIdx.x == 0) {
        sample_emit((unsigned)pick, out, feed, feed_start, feed_host);
        *fallbacks += 1u;
    }
}

// Greedy: the first index of the largest value. ARGMAX_BLOCKS blocks take a
// slice each; the last block to finish (by the ticket) reduces their results
// and rearms the ticket.
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ void argmax_block(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_better(ov, oi, v, i)) v = ov, i = oi;
    }
    if ((threadIdx.x & 31) == 0) sv[threadIdx.x >> 5] = v, si[threadIdx.x >> 5] = i;
    __syncthreads();
    int nwarps = blockDim.x >> 5;
    v = threadIdx.x < nwarps ? sv[threadIdx.x] : __int_as_float(0xff800000);
    i = threadIdx.x < nwarps ? si[threadIdx.x] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_better(ov, oi, v, i)) v = ov, i = oi;
    }
}

// The argmax of row `x` by the gridDim.x blocks of one grid row, their
// partials in `part_v`/`part_i`, the last to finish (by `ticket`) reducing.
__device__ void argmax_run(const float* x, int n, float* part_v, int* part_i, unsigned* ticket, unsigned* out,
                           int* feed, int feed_start, unsigned* feed_host) {
    __shared__ bool last;
    float v = __int_as_float(0xff800000);
    int idx = 0x7fffffff;
    // ARGMAX_BATCH loads in flight before the first comparison: one at a
    // time, each waited a round trip to L2 (about 9 a thread at Qwen3's
    // vocabulary, all on the step's critical path).
    int stride = gridDim.x * blockDim.x;
    for (int base = blockIdx.x * blockDim.x + threadIdx.x; base < n; base += ARGMAX_BATCH * stride) {
        float xv[ARGMAX_BATCH];
#pragma unroll
        for (int k = 0; k < ARGMAX_BATCH; k++) {
            int i = base + k * stride;
            xv[k] = i < n ? x[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < ARGMAX_BATCH; k++) {
            int i = base + k * stride;
            if (i < n && argmax_better(xv[k], i, v, idx)) v = xv[k], idx = i;
        }
    }
    argmax_block(v, idx);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = idx;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    v = __int_as_float(0xff800000);
    idx = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        float bv = ((volatile float*)part_v)[b];
        int bi = ((volatile int*)part_i)[b];
        if (argmax_better(bv, bi, v, idx)) v = bv, idx = bi;
    }
    __syncthreads();
    argmax_block(v, idx);
    if (threadIdx.x == 0) {
        // All NaN (or empty): index 0, as the host's argmax.
        sample_emit(idx < n ? (unsigned)idx : 0u, out, feed, feed_start, feed_host);
        *ticket = 0u;
    }
}

extern "C" __global__ void __launch_bounds__(256)
    sample_argmax(const float* x, int n, float* part_v, int* part_i, unsigned* ticket, unsigned* out, int* feed,
                  int feed_start, unsigned* feed_host) {
    grid_dependency_wait();
    argmax_run(x, n, part_v, part_i, ticket, out, feed, feed_start, feed_host);
}

// Greedy picks of many rows in one launch: grid row p takes logits row
// at[2p] of `x` (rows n wide) with its own partials (gridDim.x of them) and
// ticket (zero before the launch, rearmed after), and writes out[at[2p + 1]].
extern "C" __global__ void __launch_bounds__(256)
    sample_argmax_rows(const float* x, int n, const int* at, float* part_v, int* part_i, unsigned* tickets,
                       unsigned* out) {
    grid_dependency_wait();
    int p = blockIdx.y;
    size_t parts = (size_t)p * gridDim.x;
    argmax_run(x + (size_t)at[2 * p] * n, n, part_v + parts, part_i + parts, tickets + p, out + at[2 * p + 1],
               nullptr, 0, nullptr);
}

// Repetition penalty on the distinct token ids `ids` (no two threads share a
// logit): positive logits divided by the penalty, negative ones multiplied.
extern "C" __global__ void sample_penalty(float* x, const unsigned* ids, int count, int n, float penalty) {
    grid_dependency_wait();
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count || ids[j] >= (unsigned)n) return;
    float l = x[ids[j]];
    x[ids[j]] = l > 0.0f ? l / penalty : l * penalty;
}
