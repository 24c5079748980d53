//! Causal attention over an encoded KV cache (FP8, f16, TurboQuant): each
//! key and value row is decoded once per tile into a small buffer and used
//! by every query row and head of the tile, never into a copy of the cache.
//! Queries are moved into the key codec's space once (rotated, and for
//! TurboQuant_prod also sketched), values are summed in the value codec's
//! space and the sum rotated back once.

use rayon::prelude::*;

use super::attention::{Spans, Tile, softmax_spans, spread, tiles_of};
use super::simd::{axpy, dot};
use crate::backend::AttentionShape;
use crate::kv::batch::BatchLayout;
use crate::kv::coded::CodedLayer;

/// [`super::attention::causal_attention`] over encoded rows (row `j` of the
/// cache is position `j`).
pub fn causal_attention(q: &[f32], n: usize, start: usize, kv: &CodedLayer, s: &AttentionShape, out: &mut [f32]) {
    let (nh, nkv) = (s.num_heads, s.num_kv_heads);
    let tiles = spread(tiles_of(0, 0..n, nkv, nh / nkv), rayon::current_num_threads());
    let work = n * nh * (start + n) * s.head_dim;
    run_tiles(q, s, &tiles, work, out, kv, |_, r| start + r, |_, j| j, |_| 0);
}

/// [`super::attention::paged_attention`] over encoded rows.
pub fn paged_attention(q: &[f32], kv: &CodedLayer, batch: &BatchLayout, s: &AttentionShape, out: &mut [f32]) {
    let (nh, nkv) = (s.num_heads, s.num_kv_heads);
    let bs = batch.block_size;
    let tiles: Vec<Tile> =
        batch.seqs.iter().enumerate().flat_map(|(i, seq)| tiles_of(i, seq.rows.clone(), nkv, nh / nkv)).collect();
    let tiles = spread(tiles, rayon::current_num_threads());
    let work: usize = batch.seqs.iter().map(|x| x.len() * x.context_len()).sum::<usize>() * nh * s.head_dim;
    let pos = |i: usize, r: usize| {
        let seq = &batch.seqs[i];
        seq.start + (r - seq.rows.start)
    };
    let slot = |i: usize, j: usize| {
        let seq = &batch.seqs[i];
        seq.block_table[j / bs] as usize * bs + j % bs
    };
    run_tiles(q, s, &tiles, work, out, kv, pos, slot, |i| batch.seqs[i].block_table[0]);
}

#[allow(clippy::too_many_arguments)]
fn run_tiles(
    q: &[f32],
    s: &AttentionShape,
    tiles: &[Tile],
    work: usize,
    out: &mut [f32],
    kv: &CodedLayer,
    pos: impl Fn(usize, usize) -> usize + Sync,
    slot: impl Fn(usize, usize) -> usize + Sync,
    anchor: impl Fn(usize) -> u32 + Sync,
) {
    let (hd, nh) = (s.head_dim, s.num_heads);
    let group = nh / s.num_kv_heads;
    let run = |t: &Tile| {
        #[cfg(target_arch = "x86_64")]
        if super::simd::has_avx2() {
            // SAFETY: the CPU supports avx2 and fma (checked above).
            return unsafe { attend_tile_avx2(q, s, t, kv, &pos, &slot, &anchor) };
        }
        attend_tile(q, s, t, kv, &pos, &slot, &anchor, dot, axpy)
    };
    let results: Vec<Vec<f32>> =
        if work < 1 << 16 { tiles.iter().map(run).collect() } else { tiles.par_iter().map(run).collect() };
    for (t, o) in tiles.iter().zip(results) {
        let width = t.heads.len() * hd;
        // The sequence's value offset, subtracted when its rows were encoded.
        let offset = &kv.value_anchor(anchor(t.seq))[t.kvh * hd..(t.kvh + 1) * hd];
        for (i, r) in t.rows.clone().enumerate() {
            let at = r * nh * hd + (t.kvh * group + t.heads.start) * hd;
            out[at..at + width].copy_from_slice(&o[i * width..(i + 1) * width]);
            for head in out[at..at + width].chunks_exact_mut(hd) {
                head.iter_mut().zip(offset).for_each(|(x, c)| *x += c);
            }
        }
    }
}

/// One tile's softmax-weighted values, `[rows, heads·hd]`, every (row, head)
/// summing in position order.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q: &[f32],
    s: &AttentionShape,
    t: &Tile,
    kv: &CodedLayer,
    pos: &impl Fn(usize, usize) -> usize,
    slot: &impl Fn(usize, usize) -> usize,
    anchor: &impl Fn(usize) -> u32,
    dot: impl Fn(&[f32], &[f32]) -> f32,
    axpy: impl Fn(f32, &[f32], &mut [f32]),
) -> Vec<f32> {
    let (hd, nh) = (s.head_dim, s.num_heads);
    let group = nh / s.num_kv_heads;
    let (kc, vc) = (kv.codecs.key(kv.codec_layer, t.kvh), kv.codecs.value(kv.codec_layer, t.kvh));
    let (k_row, v_row) = (kv.codecs.key_row_bytes(), kv.codecs.value_row_bytes());
    let (k_at, v_at) = (t.kvh * kc.bytes(), t.kvh * vc.bytes());
    let Spans { spans, offsets, total, first, last } = Spans::of(s, t, pos);
    let heads = t.heads.len();
    let ql = kc.query_len();
    let mut prepared = vec![0f32; spans.len() * ql];
    let key_scales = &kv.key_scales(anchor(t.seq))[t.kvh * hd..(t.kvh + 1) * hd];
    let mut scaled = vec![0f32; hd];
    for (i, p) in prepared.chunks_exact_mut(ql).enumerate() {
        let (r, g) = (t.rows.start + i / heads, t.heads.start + i % heads);
        let h = t.kvh * group + g;
        let qh = &q[r * nh * hd + h * hd..r * nh * hd + (h + 1) * hd];
        scaled.iter_mut().zip(qh).zip(key_scales).for_each(|((o, x), s)| *o = x * s);
        kc.prepare_query(&scaled, p);
    }
    let mut scores = vec![0f32; total];
    let mut key = vec![0f32; ql];
    for j in first..=last {
        let at = slot(t.seq, j) * k_row + k_at;
        kc.decode(&kv.keys[at..at + kc.bytes()], &mut key);
        for (i, &(lo, p)) in spans.iter().enumerate() {
            if lo <= j && j <= p {
                scores[offsets[i] + j - lo] = dot(&prepared[i * ql..(i + 1) * ql], &key) * s.scale;
            }
        }
    }
    softmax_spans(&mut scores, &spans, &offsets);
    let mut out = vec![0f32; spans.len() * hd];
    let mut value = vec![0f32; hd];
    for j in first..=last {
        let at = slot(t.seq, j) * v_row + v_at;
        vc.decode(&kv.values[at..at + vc.bytes()], &mut value);
        for (i, &(lo, p)) in spans.iter().enumerate() {
            if lo <= j && j <= p {
                axpy(scores[offsets[i] + j - lo], &value, &mut out[i * hd..(i + 1) * hd]);
            }
        }
    }
    for o in out.chunks_exact_mut(hd) {
        vc.finish(o);
    }
    out
}

/// [`attend_tile`] compiled for AVX2+FMA, its dot products and axpys inlined.
///
/// # Safety
/// The CPU supports avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_tile_avx2(
    q: &[f32],
    s: &AttentionShape,
    t: &Tile,
    kv: &CodedLayer,
    pos: &impl Fn(usize, usize) -> usize,
    slot: &impl Fn(usize, usize) -> usize,
    anchor: &impl Fn(usize) -> u32,
) -> Vec<f32> {
    // SAFETY: the CPU supports avx2 and fma (this function's contract).
    attend_tile(q, s, t, kv, pos, slot, anchor, |a, b| unsafe { super::simd::dot_fused(a, b) }, super::simd::axpy_fused)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::kv::KvShape;
    use crate::kv::codecs::KvCodecs;
    use crate::kv::coded::CodedRows;

    /// Attention over encoded rows equals attention computed one (row, head)
    /// at a time from the decoded rows, and (but for TurboQuant_prod keys,
    /// whose scores are estimates, not a decoded vector) f32 attention over
    /// the rows decoded and rotated back; every kind of format, GQA and
    /// windowed: the kernel adds no error of its own.
    #[test]
    fn coded_attention_is_f32_attention_over_the_decoded_cache() {
        let mut x = 0x9e37_79b9u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2001) as f32 / 1000.0 - 1.0
        };
        for format in ["f16", "fp8", "turbo8", "turbo4", "k4v3", "k3pv2"] {
            for window in [None, Some(6)] {
                let (hd, nh, nkv) = (16, 6, 2);
                let s = AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, window, scale: 0.7 };
                let shape = KvShape { num_layers: 2, num_kv_heads: nkv, head_dim: hd };
                let codecs = Arc::new(KvCodecs::new(format.parse().unwrap(), shape).unwrap());
                let (start, n, layer) = (5, 21, 1);
                let kv_dim = nkv * hd;
                let q: Vec<f32> = (0..n * nh * hd).map(|_| rnd()).collect();
                let k: Vec<f32> = (0..(start + n) * kv_dim).map(|_| 3.0 * rnd()).collect();
                let v: Vec<f32> = (0..(start + n) * kv_dim).map(|_| rnd()).collect();
                let mut rows = CodedRows::new(codecs.clone(), vec![0, 1], 0);
                rows.append(layer, 0, &k, &v);
                let kv = rows.layer(layer);
                let (c, keys, values) = (kv.codec_layer, kv.keys, kv.values);
                let (ka, va) = (kv.key_anchor(0), kv.value_anchor(0));
                let ks = kv.key_scales(0);
                // Position 0 is the anchor, kept in f16.
                let k0: Vec<f32> = k[..kv_dim].iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
                assert_eq!(ka, &k0[..]);
                let mut got = vec![f32::NAN; q.len()];
                causal_attention(&q, n, start, &kv, &s, &mut got);
                let decode = |bytes: &[u8], row: usize, codec: &crate::quant::turbo::VectorCodec| {
                    let mut y = vec![0f32; codec.query_len()];
                    codec.decode(&bytes[row..row + codec.bytes()], &mut y);
                    y
                };
                // One (row, head) at a time, straight from the definition:
                // scores of the prepared query against each decoded key,
                // softmax, decoded values summed and rotated back.
                for t in 0..n {
                    for h in 0..nh {
                        let kvh = h / (nh / nkv);
                        let (kc, vc) = (codecs.key(c, kvh), codecs.value(c, kvh));
                        let p = start + t;
                        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
                        let mut pq = vec![0f32; kc.query_len()];
                        let qs: Vec<f32> =
                            q[(t * nh + h) * hd..][..hd].iter().zip(&ks[kvh * hd..]).map(|(x, s)| x * s).collect();
                        kc.prepare_query(&qs, &mut pq);
                        let sc: Vec<f32> = (lo..=p)
                            .map(|j| {
                                let key = decode(keys, j * codecs.key_row_bytes() + kvh * kc.bytes(), kc);
                                pq.iter().zip(&key).map(|(a, b)| a * b).sum::<f32>() * 0.7
                            })
                            .collect();
                        let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let e: Vec<f32> = sc.iter().map(|x| (x - m).exp()).collect();
                        let sum: f32 = e.iter().sum();
                        let mut o = vec![0f32; hd];
                        for (j, w) in (lo..=p).zip(&e) {
                            let val = decode(values, j * codecs.value_row_bytes() + kvh * vc.bytes(), vc);
                            o.iter_mut().zip(&val).for_each(|(o, v)| *o += w / sum * v);
                        }
                        vc.finish(&mut o);
                        o.iter_mut().zip(&va[kvh * hd..]).for_each(|(o, a)| *o += a);
                        for (a, b) in got[(t * nh + h) * hd..][..hd].iter().zip(&o) {
                            assert!((a - b).abs() < 2e-5, "{format} {window:?}: {a} vs {b}");
                        }
                    }
                }
                if format == "k3pv2" {
                    continue;
                }
                let mut dk = vec![0f32; k.len()];
                let mut dv = vec![0f32; v.len()];
                for j in 0..start + n {
                    for h in 0..nkv {
                        let (kc, vc) = (codecs.key(c, h), codecs.value(c, h));
                        let mut kr = decode(keys, j * codecs.key_row_bytes() + h * kc.bytes(), kc);
                        let mut vr = decode(values, j * codecs.value_row_bytes() + h * vc.bytes(), vc);
                        kc.finish(&mut kr);
                        vc.finish(&mut vr);
                        kr.iter_mut().zip(&ka[h * hd..]).zip(&ks[h * hd..]).for_each(|((x, a), s)| *x = *x * s + a);
                        vr.iter_mut().zip(&va[h * hd..]).for_each(|(x, a)| *x += a);
                        dk[j * kv_dim + h * hd..][..hd].copy_from_slice(&kr);
                        dv[j * kv_dim + h * hd..][..hd].copy_from_slice(&vr);
                    }
                }
                if format == "f16" {
                    // Decoding and undoing the anchor gives the rows written.
                    for (a, b) in dk.iter().zip(&k).chain(dv.iter().zip(&v)) {
                        assert!((a - b).abs() < 2e-3 * b.abs().max(1.0), "f16 rows: {a} vs {b}");
                    }
                }
                let mut want = vec![f32::NAN; q.len()];
                super::super::attention::causal_attention(&q, n, start, &dk, &dv, &s, &mut want);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 2e-5, "{format} {window:?}: {a} vs {b}");
                }
            }
        }
    }
}
