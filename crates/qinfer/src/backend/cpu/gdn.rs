//! Gated DeltaNet on the CPU: the depthwise causal conv1d, and the gated delta
//! rule in its two forms, which must agree: recurrent (one token at a time, for
//! decode) and chunked (64-token chunks in the WY/UT formulation, for prompts;
//! cost linear in length). Follows transformers' `causal_conv1d_fn`,
//! `torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule`
//! (modeling_qwen3_next.py).

use rayon::prelude::*;

use super::simd::{axpy, dot};
use crate::config::GdnConfig;

/// Tokens per chunk of the chunked form (the reference's `chunk_size`).
pub const CHUNK: usize = GdnConfig::CHUNK_SIZE;

/// One layer's state for one sequence.
#[derive(Debug, Clone)]
pub struct CpuGdnState {
    pub cfg: GdnConfig,
    /// The last `kernel - 1` conv inputs, `[kernel - 1, conv_dim]`, oldest first
    /// (zeros for a fresh sequence: the reference's causal zero padding).
    pub conv: Vec<f32>,
    /// Per value head a `[dk, dv]` matrix, f32 as the reference keeps it.
    pub recurrent: Vec<f32>,
}

impl CpuGdnState {
    pub fn new(cfg: &GdnConfig) -> Self {
        CpuGdnState {
            cfg: cfg.clone(),
            conv: vec![0.0; (cfg.conv_kernel - 1) * cfg.conv_dim()],
            recurrent: vec![0.0; cfg.num_v_heads * cfg.k_head_dim * cfg.v_head_dim],
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// torch's `softplus` (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `x` `[rows, channels]` through the depthwise conv `weight` `[channels, kernel]`
/// then SiLU; `window` (the last `kernel - 1` inputs) is read first and updated.
pub fn causal_conv1d_silu(x: &[f32], channels: usize, weight: &[f32], window: &mut [f32]) -> Vec<f32> {
    let rows = x.len() / channels;
    let kernel = weight.len() / channels;
    let hist = kernel - 1;
    debug_assert_eq!(window.len(), hist * channels);
    // Tap-major weights so the inner loop runs along channels.
    let mut taps = vec![0f32; kernel * channels];
    for c in 0..channels {
        for j in 0..kernel {
            taps[j * channels + c] = weight[c * kernel + j];
        }
    }
    let mut ext = Vec::with_capacity((hist + rows) * channels);
    ext.extend_from_slice(window);
    ext.extend_from_slice(x);
    let mut out = vec![0f32; rows * channels];
    let conv_row = |(t, o): (usize, &mut [f32])| {
        for j in 0..kernel {
            let src = &ext[(t + j) * channels..(t + j + 1) * channels];
            let w = &taps[j * channels..(j + 1) * channels];
            for ((o, s), w) in o.iter_mut().zip(src).zip(w) {
                *o += w * s;
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    };
    if rows * channels < 1 << 15 {
        out.chunks_mut(channels).enumerate().for_each(conv_row);
    } else {
        out.par_chunks_mut(channels).enumerate().for_each(conv_row);
    }
    window.copy_from_slice(&ext[rows * channels..]);
    out
}

/// Per-token inputs of the delta rule after normalization, value-head major for
/// the gates: `q`/`k` L2-normalized (q also scaled by 1/√dk), `g` the log decay
/// and `beta` the write strength, both `[T, nv]`.
pub struct DeltaInputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

/// The reference's `l2norm`: `x · rsqrt(Σx² + 1e-6)` per head.
fn l2_normalize(x: &mut [f32], dim: usize, scale: f32) {
    for head in x.chunks_exact_mut(dim) {
        let ss: f32 = head.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss + 1e-6).sqrt() * scale;
        head.iter_mut().for_each(|v| *v *= inv);
    }
}

/// β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias); q, k L2-normalized.
pub fn prepare(
    cfg: &GdnConfig,
    q: &[f32],
    k: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
) -> DeltaInputs {
    let nv = cfg.num_v_heads;
    let mut q = q.to_vec();
    let mut k = k.to_vec();
    l2_normalize(&mut q, cfg.k_head_dim, 1.0 / (cfg.k_head_dim as f32).sqrt());
    l2_normalize(&mut k, cfg.k_head_dim, 1.0);
    let g = a.iter().enumerate().map(|(i, &a)| -a_log[i % nv].exp() * softplus(a + dt_bias[i % nv])).collect();
    let beta = b.iter().map(|&b| 1.0 / (1.0 + (-b).exp())).collect();
    DeltaInputs { q, k, g, beta }
}

/// Runs `per_head(h, k_head, state_h, out_h)` for every value head in parallel,
/// where `out_h` is `[T, dv]`, then interleaves the heads into `[T, nv·dv]`.
fn for_each_head<F>(cfg: &GdnConfig, t_len: usize, state: &mut [f32], per_head: F) -> Vec<f32>
where
    F: Fn(usize, usize, &mut [f32], &mut [f32]) + Sync,
{
    let (nv, dk, dv) = (cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim);
    let mut per: Vec<Vec<f32>> = vec![vec![0f32; t_len * dv]; nv];
    let run = |(h, (s, o)): (usize, (&mut [f32], &mut Vec<f32>))| per_head(h, cfg.k_head_of(h), s, o);
    if t_len * nv * dk * dv < 1 << 16 {
        state.chunks_mut(dk * dv).zip(per.iter_mut()).enumerate().for_each(run);
    } else {
        state.par_chunks_mut(dk * dv).zip(per.par_iter_mut()).enumerate().for_each(run);
    }
    let mut out = vec![0f32; t_len * nv * dv];
    for (h, o) in per.iter().enumerate() {
        for t in 0..t_len {
            out[(t * nv + h) * dv..(t * nv + h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    out
}

/// One token at a time: S ← S·e^g; δ = β(v − kᵀS); S ← S + k δᵀ; o = qᵀS.
pub fn recurrent(cfg: &GdnConfig, x: &DeltaInputs, v: &[f32], state: &mut [f32]) -> Vec<f32> {
    let (nk, nv, dk, dv) = (cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim);
    let t_len = v.len() / (nv * dv);
    for_each_head(cfg, t_len, state, |h, kh, s, o| {
        let mut delta = vec![0f32; dv];
        for t in 0..t_len {
            let q = &x.q[(t * nk + kh) * dk..(t * nk + kh + 1) * dk];
            let k = &x.k[(t * nk + kh) * dk..(t * nk + kh + 1) * dk];
            let vt = &v[(t * nv + h) * dv..(t * nv + h + 1) * dv];
            let decay = x.g[t * nv + h].exp();
            let beta = x.beta[t * nv + h];
            s.iter_mut().for_each(|e| *e *= decay);
            delta.fill(0.0);
            for (i, row) in s.chunks_exact(dv).enumerate() {
                axpy(k[i], row, &mut delta);
            }
            for (d, vj) in delta.iter_mut().zip(vt) {
                *d = (vj - *d) * beta;
            }
            let ot = &mut o[t * dv..(t + 1) * dv];
            for (i, row) in s.chunks_exact_mut(dv).enumerate() {
                axpy(k[i], &delta, row);
                axpy(q[i], row, ot);
            }
        }
    })
}

/// The chunked form. Within a chunk of L tokens with cumulative log decay c,
/// A[i][j] = β_i (k_i·k_j) e^{c_i − c_j} (j < i); U = (I + A)⁻¹ (βv) and
/// W = (I + A)⁻¹ (β e^{c} k) by forward substitution; then against the state S
/// carried from earlier chunks: V' = U − W S,
/// o_i = e^{c_i} q_iᵀS + Σ_{j≤i} (q_i·k_j) e^{c_i − c_j} V'_j,
/// S ← e^{c_L} S + Σ_j e^{c_L − c_j} k_j V'_jᵀ.
pub fn chunked(cfg: &GdnConfig, x: &DeltaInputs, v: &[f32], state: &mut [f32]) -> Vec<f32> {
    let (nk, nv, dk, dv) = (cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim);
    let t_len = v.len() / (nv * dv);
    for_each_head(cfg, t_len, state, |h, kh, s, o| {
        let mut cum = [0f32; CHUNK];
        let mut a = vec![0f32; CHUNK * CHUNK];
        let mut u = vec![0f32; CHUNK * dv];
        let mut w = vec![0f32; CHUNK * dk];
        let mut k_tail = vec![0f32; dk];
        for c0 in (0..t_len).step_by(CHUNK) {
            let l = CHUNK.min(t_len - c0);
            let qi = |i: usize| &x.q[((c0 + i) * nk + kh) * dk..((c0 + i) * nk + kh + 1) * dk];
            let ki = |i: usize| &x.k[((c0 + i) * nk + kh) * dk..((c0 + i) * nk + kh + 1) * dk];
            let vi = |i: usize| &v[((c0 + i) * nv + h) * dv..((c0 + i) * nv + h + 1) * dv];
            let beta = |i: usize| x.beta[(c0 + i) * nv + h];
            let mut acc = 0f32;
            for (i, c) in cum.iter_mut().enumerate().take(l) {
                acc += x.g[(c0 + i) * nv + h];
                *c = acc;
            }
            for i in 0..l {
                for j in 0..i {
                    a[i * CHUNK + j] = beta(i) * dot(ki(i), ki(j)) * (cum[i] - cum[j]).exp();
                }
            }
            // Forward substitution for U and W (unit lower-triangular system).
            for i in 0..l {
                let (done, rest) = u.split_at_mut(i * dv);
                let ui = &mut rest[..dv];
                for (d, s) in ui.iter_mut().zip(vi(i)) {
                    *d = beta(i) * s;
                }
                let (wdone, wrest) = w.split_at_mut(i * dk);
                let wi = &mut wrest[..dk];
                let scale = beta(i) * cum[i].exp();
                for (d, s) in wi.iter_mut().zip(ki(i)) {
                    *d = scale * s;
                }
                for j in 0..i {
                    let aij = a[i * CHUNK + j];
                    axpy(-aij, &done[j * dv..(j + 1) * dv], ui);
                    axpy(-aij, &wdone[j * dk..(j + 1) * dk], wi);
                }
            }
            // V' = U − W S (in place in u).
            for i in 0..l {
                let ui = &mut u[i * dv..(i + 1) * dv];
                for (r, row) in s.chunks_exact(dv).enumerate() {
                    axpy(-w[i * dk + r], row, ui);
                }
            }
            for i in 0..l {
                let ot = &mut o[(c0 + i) * dv..(c0 + i + 1) * dv];
                let q = qi(i);
                let e = cum[i].exp();
                for (r, row) in s.chunks_exact(dv).enumerate() {
                    axpy(e * q[r], row, ot);
                }
                for j in 0..=i {
                    let coef = dot(q, ki(j)) * (cum[i] - cum[j]).exp();
                    axpy(coef, &u[j * dv..(j + 1) * dv], ot);
                }
            }
            let last = cum[l - 1];
            let total = last.exp();
            s.iter_mut().for_each(|e| *e *= total);
            for j in 0..l {
                let f = (last - cum[j]).exp();
                for (d, kv) in k_tail.iter_mut().zip(ki(j)) {
                    *d = f * kv;
                }
                let vj = &u[j * dv..(j + 1) * dv];
                for (r, row) in s.chunks_exact_mut(dv).enumerate() {
                    axpy(k_tail[r], vj, row);
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> GdnConfig {
        GdnConfig {
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: 16,
            v_head_dim: 24,
            conv_kernel: 4,
            v_heads_tiled: false,
        }
    }

    /// Deterministic pseudo-random values in [-1, 1) (xorshift), fresh per seed.
    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn inputs(c: &GdnConfig, t: usize, seed: u64) -> (DeltaInputs, Vec<f32>) {
        let q = rand_vec(t * c.key_dim(), seed);
        let k = rand_vec(t * c.key_dim(), seed + 1);
        let v = rand_vec(t * c.value_dim(), seed + 2);
        let a = rand_vec(t * c.num_v_heads, seed + 3);
        let b = rand_vec(t * c.num_v_heads, seed + 4);
        let a_log = rand_vec(c.num_v_heads, seed + 5);
        let dt_bias = rand_vec(c.num_v_heads, seed + 6);
        (prepare(c, &q, &k, &a, &b, &a_log, &dt_bias), v)
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    #[test]
    fn chunked_equals_recurrent_across_chunk_boundaries() {
        let c = cfg();
        for (i, &t) in [1usize, 63, 64, 65, 300].iter().enumerate() {
            let (x, v) = inputs(&c, t, 100 + i as u64);
            let mut s_rec = rand_vec(c.num_v_heads * c.k_head_dim * c.v_head_dim, 7);
            let mut s_chk = s_rec.clone();
            let o_rec = recurrent(&c, &x, &v, &mut s_rec);
            let o_chk = chunked(&c, &x, &v, &mut s_chk);
            assert!(max_rel(&o_chk, &o_rec) < 1e-5, "T={t}: output differs by {}", max_rel(&o_chk, &o_rec));
            assert!(max_rel(&s_chk, &s_rec) < 1e-5, "T={t}: state differs by {}", max_rel(&s_chk, &s_rec));
        }
    }

    #[test]
    fn conv_state_carries_across_calls() {
        let (ch, k) = (6, 4);
        let x = rand_vec(10 * ch, 3);
        let w = rand_vec(ch * k, 4);
        let mut win_full = vec![0f32; (k - 1) * ch];
        let full = causal_conv1d_silu(&x, ch, &w, &mut win_full);
        let mut win = vec![0f32; (k - 1) * ch];
        let mut parts = causal_conv1d_silu(&x[..3 * ch], ch, &w, &mut win);
        for t in 3..10 {
            parts.extend(causal_conv1d_silu(&x[t * ch..(t + 1) * ch], ch, &w, &mut win));
        }
        assert_eq!(full, parts);
        assert_eq!(win_full, win);
        // Row 0 sees only itself (zero padding): silu(w[c][k-1]·x[0][c]).
        for c in 0..ch {
            let want = silu(w[c * k + k - 1] * x[c]);
            assert!((full[c] - want).abs() < 1e-6);
        }
    }
}
