//! Causal (optionally sliding-window) grouped-query attention over an f32 cache.

use rayon::prelude::*;

use super::simd::{axpy, dot};
use crate::backend::AttentionShape;

/// `q`: `[n, num_heads·head_dim]` for positions `start..start+n`;
/// `keys`/`values`: `[start+n, num_kv_heads·head_dim]`; `out` like `q`.
pub fn causal_attention(
    q: &[f32],
    n: usize,
    start: usize,
    keys: &[f32],
    values: &[f32],
    s: &AttentionShape,
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
    let group = nh / nkv;
    let kv_dim = nkv * hd;
    let q_dim = nh * hd;
    debug_assert_eq!(q.len(), n * q_dim);
    debug_assert!(keys.len() >= (start + n) * kv_dim && values.len() >= (start + n) * kv_dim);
    // One task per (token, head): output slices are disjoint. Short decode steps
    // run on the calling thread; a rayon dispatch would cost more than the work.
    let attend = |(idx, o): (usize, &mut [f32])| {
        let (t, h) = (idx / nh, idx % nh);
        let pos = start + t;
        let kvh = h / group;
        let lo = match s.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let qh = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
        let mut scores: Vec<f32> =
            (lo..=pos).map(|j| dot(qh, &keys[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd]) * s.scale).collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        o.fill(0.0);
        for (j, p) in (lo..=pos).zip(&scores) {
            axpy(p / sum, &values[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd], o);
        }
    };
    let work = n * nh * (start + n) * hd;
    if work < 1 << 16 {
        out.chunks_mut(hd).enumerate().for_each(attend);
    } else {
        out.par_chunks_mut(hd).enumerate().for_each(attend);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single key makes attention return its value regardless of the query.
    #[test]
    fn first_position_returns_its_value() {
        let s = AttentionShape { num_heads: 2, num_kv_heads: 1, head_dim: 4, window: None, scale: 0.5 };
        let q = vec![1.0; 8];
        let k = vec![0.3; 4];
        let v = vec![1.0, 2.0, 3.0, 4.0];
        let mut out = vec![f32::NAN; 8];
        causal_attention(&q, 1, 0, &k, &v, &s, &mut out);
        assert_eq!(out, vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
    }

    /// With a window of 1 each position sees only itself.
    #[test]
    fn window_of_one_sees_only_itself() {
        let s = AttentionShape { num_heads: 1, num_kv_heads: 1, head_dim: 2, window: Some(1), scale: 1.0 };
        let q = vec![1.0, 0.0, 0.0, 1.0];
        let k = vec![5.0, 0.0, 0.0, 5.0];
        let v = vec![1.0, 1.0, 7.0, 9.0];
        let mut out = vec![f32::NAN; 4];
        causal_attention(&q, 2, 0, &k, &v, &s, &mut out);
        assert_eq!(out, vec![1.0, 1.0, 7.0, 9.0]);
    }
}
