//! Causal (optionally sliding-window) grouped-query attention over an f32 cache.

use rayon::prelude::*;

use super::simd::{axpy, dot};
use crate::backend::AttentionShape;
use crate::kv::batch::BatchLayout;

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
        let qh = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
        attend_one(qh, window_start(pos, s.window), pos, s.scale, o, |j| {
            (
                &keys[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd],
                &values[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd],
            )
        });
    };
    let work = n * nh * (start + n) * hd;
    if work < 1 << 16 {
        out.chunks_mut(hd).enumerate().for_each(attend);
    } else {
        out.par_chunks_mut(hd).enumerate().for_each(attend);
    }
}

/// The first position a query at `pos` sees.
fn window_start(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    }
}

/// One head of one query row over positions `lo..=pos`, whose key and value
/// rows `kv(j)` gives: softmax of the scaled dot products, then the weighted
/// sum of values, in one fixed order wherever the rows are stored (so the
/// paged and contiguous caches give the same bits).
fn attend_one<'a>(
    qh: &[f32],
    lo: usize,
    pos: usize,
    scale: f32,
    o: &mut [f32],
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) {
    let mut scores: Vec<f32> = (lo..=pos).map(|j| dot(qh, kv(j).0) * scale).collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for sc in scores.iter_mut() {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    o.fill(0.0);
    for (j, p) in (lo..=pos).zip(&scores) {
        axpy(p / sum, kv(j).1, o);
    }
}

/// Causal attention of a ragged batch over a paged cache: `q` holds
/// `batch.rows()` rows, each sequence's rows at positions `start..`, keys
/// and values read through its block table from `keys`/`values`
/// (`[slots, num_kv_heads·head_dim]`).
pub fn paged_attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    batch: &BatchLayout,
    s: &AttentionShape,
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
    let group = nh / nkv;
    let kv_dim = nkv * hd;
    let q_dim = nh * hd;
    let bs = batch.block_size;
    let mut seq_of_row = vec![0; batch.rows()];
    for (i, seq) in batch.seqs.iter().enumerate() {
        seq_of_row[seq.rows.clone()].fill(i);
    }
    let attend = |(idx, o): (usize, &mut [f32])| {
        let (r, h) = (idx / nh, idx % nh);
        let seq = &batch.seqs[seq_of_row[r]];
        let pos = seq.start + (r - seq.rows.start);
        let kvh = h / group;
        let qh = &q[r * q_dim + h * hd..r * q_dim + (h + 1) * hd];
        attend_one(qh, window_start(pos, s.window), pos, s.scale, o, |j| {
            let slot = seq.block_table[j / bs] as usize * bs + j % bs;
            let at = slot * kv_dim + kvh * hd;
            (&keys[at..at + hd], &values[at..at + hd])
        });
    };
    let work: usize = batch.seqs.iter().map(|x| x.len() * x.context_len()).sum::<usize>() * nh * hd;
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
