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
    let kv_dim = nkv * hd;
    debug_assert_eq!(q.len(), n * nh * hd);
    debug_assert!(keys.len() >= (start + n) * kv_dim && values.len() >= (start + n) * kv_dim);
    let tiles = spread(tiles_of(0, 0..n, nkv, nh / nkv), rayon::current_num_threads());
    let work = n * nh * (start + n) * hd;
    run_tiles(
        q,
        s,
        &tiles,
        work,
        out,
        |_, r| start + r,
        |_, j, kvh| {
            let at = j * kv_dim + kvh * hd;
            (&keys[at..at + hd], &values[at..at + hd])
        },
    );
}

/// The first position a query at `pos` sees.
pub(super) fn window_start(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    }
}

/// Query rows attended together: each key and value row read once serves
/// every row of the tile and every query head of its key head.
pub(super) const TILE_ROWS: usize = 16;

/// A unit of work: query rows `rows` (of sequence `seq`) for key head
/// `kvh` and its query heads `heads` (indices within its group).
pub(super) struct Tile {
    pub seq: usize,
    pub rows: std::ops::Range<usize>,
    pub kvh: usize,
    pub heads: std::ops::Range<usize>,
}

/// `rows` of sequence `seq` in tiles of [`TILE_ROWS`], for each key head
/// and all its `group` query heads.
pub(super) fn tiles_of(seq: usize, rows: std::ops::Range<usize>, nkv: usize, group: usize) -> Vec<Tile> {
    let mut tiles = Vec::new();
    for kvh in 0..nkv {
        let mut r = rows.start;
        while r < rows.end {
            let end = (r + TILE_ROWS).min(rows.end);
            tiles.push(Tile { seq, rows: r..end, kvh, heads: 0..group });
            r = end;
        }
    }
    tiles
}

/// Tiles of one query head each when there are fewer tiles than threads
/// (a decode step of few sequences): more parallel work, each key row read
/// once per head instead of once per group. The bits do not change.
pub(super) fn spread(tiles: Vec<Tile>, threads: usize) -> Vec<Tile> {
    if tiles.len() >= threads {
        return tiles;
    }
    tiles
        .into_iter()
        .flat_map(|t| {
            t.heads.clone().map(move |g| Tile { seq: t.seq, rows: t.rows.clone(), kvh: t.kvh, heads: g..g + 1 })
        })
        .collect()
}

/// Runs `tiles` (on the calling thread when `work` is small: a rayon
/// dispatch would cost more) and writes each one's rows and heads of `out`.
/// `pos(seq, row)` is a row's position; `kv(seq, j, kvh)` the key and value
/// rows of position `j`.
fn run_tiles<'a>(
    q: &[f32],
    s: &AttentionShape,
    tiles: &[Tile],
    work: usize,
    out: &mut [f32],
    pos: impl Fn(usize, usize) -> usize + Sync,
    kv: impl Fn(usize, usize, usize) -> (&'a [f32], &'a [f32]) + Sync,
) {
    let (hd, nh) = (s.head_dim, s.num_heads);
    let group = nh / s.num_kv_heads;
    let run = |t: &Tile| {
        #[cfg(target_arch = "x86_64")]
        if super::simd::has_avx2() {
            // SAFETY: the CPU supports avx2 and fma (checked above).
            return unsafe { attend_tile_avx2(q, s, t, &pos, &kv) };
        }
        attend_tile(q, s, t, &pos, &kv, dot, axpy)
    };
    let results: Vec<Vec<f32>> =
        if work < 1 << 16 { tiles.iter().map(run).collect() } else { tiles.par_iter().map(run).collect() };
    for (t, o) in tiles.iter().zip(results) {
        let width = t.heads.len() * hd;
        for (i, r) in t.rows.clone().enumerate() {
            let at = r * nh * hd + (t.kvh * group + t.heads.start) * hd;
            out[at..at + width].copy_from_slice(&o[i * width..(i + 1) * width]);
        }
    }
}

/// Each (row, head) of a tile: the positions `lo..=pos` it attends to,
/// where its scores start in one buffer, and the positions any of them sees.
pub(super) struct Spans {
    pub spans: Vec<(usize, usize)>,
    pub offsets: Vec<usize>,
    pub total: usize,
    pub first: usize,
    pub last: usize,
}

impl Spans {
    pub(super) fn of(s: &AttentionShape, t: &Tile, pos: &impl Fn(usize, usize) -> usize) -> Spans {
        let spans: Vec<(usize, usize)> = t
            .rows
            .clone()
            .flat_map(|r| {
                let p = pos(t.seq, r);
                std::iter::repeat_n((window_start(p, s.window), p), t.heads.len())
            })
            .collect();
        let offsets: Vec<usize> = spans
            .iter()
            .scan(0, |acc, &(lo, p)| {
                let at = *acc;
                *acc += p + 1 - lo;
                Some(at)
            })
            .collect();
        let total = spans.iter().map(|&(lo, p)| p + 1 - lo).sum();
        let first = spans.iter().map(|s| s.0).min().unwrap_or(0);
        let last = spans.iter().map(|s| s.1).max().unwrap_or(0);
        Spans { spans, offsets, total, first, last }
    }
}

/// Scores to softmax weights, per (row, head).
pub(super) fn softmax_spans(scores: &mut [f32], spans: &[(usize, usize)], offsets: &[usize]) {
    for (i, &(lo, p)) in spans.iter().enumerate() {
        let sc = &mut scores[offsets[i]..offsets[i] + p + 1 - lo];
        let max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in sc.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        for x in sc.iter_mut() {
            *x /= sum;
        }
    }
}

/// One tile: for each of its rows and each query head of its key head, the
/// softmax of the scaled dot products over positions `lo..=pos`, then the
/// weighted sum of values. Every (row, head) sums in position order, as
/// [`attend_one`] does alone, so tiling changes no bit; only each key and
/// value row is read once for the whole tile. Returns `[rows, heads·hd]`.
#[inline(always)]
fn attend_tile<'a>(
    q: &[f32],
    s: &AttentionShape,
    t: &Tile,
    pos: &impl Fn(usize, usize) -> usize,
    kv: &impl Fn(usize, usize, usize) -> (&'a [f32], &'a [f32]),
    dot: impl Fn(&[f32], &[f32]) -> f32,
    axpy: impl Fn(f32, &[f32], &mut [f32]),
) -> Vec<f32> {
    let (hd, nh) = (s.head_dim, s.num_heads);
    let group = nh / s.num_kv_heads;
    let Spans { spans, offsets, total, first, last } = Spans::of(s, t, pos);
    let mut scores = vec![0f32; total];
    let heads = t.heads.len();
    let query = |i: usize| {
        let (r, g) = (t.rows.start + i / heads, t.heads.start + i % heads);
        let h = t.kvh * group + g;
        &q[r * nh * hd + h * hd..r * nh * hd + (h + 1) * hd]
    };
    for j in first..=last {
        if j + AHEAD <= last {
            prefetch(kv(t.seq, j + AHEAD, t.kvh).0);
        }
        let k = kv(t.seq, j, t.kvh).0;
        for (i, &(lo, p)) in spans.iter().enumerate() {
            if lo <= j && j <= p {
                scores[offsets[i] + j - lo] = dot(query(i), k) * s.scale;
            }
        }
    }
    softmax_spans(&mut scores, &spans, &offsets);
    let mut out = vec![0f32; spans.len() * hd];
    for j in first..=last {
        if j + AHEAD <= last {
            prefetch(kv(t.seq, j + AHEAD, t.kvh).1);
        }
        let v = kv(t.seq, j, t.kvh).1;
        for (i, &(lo, p)) in spans.iter().enumerate() {
            if lo <= j && j <= p {
                axpy(scores[offsets[i] + j - lo], v, &mut out[i * hd..(i + 1) * hd]);
            }
        }
    }
    out
}

/// Positions ahead whose key (or value) rows a tile asks for while it works
/// on the current one: a tile reads one key head's slice of every cache
/// row, a strided walk the hardware prefetchers follow late.
const AHEAD: usize = 4;

/// Asks for the cache lines of `row` to be brought into L1.
#[inline(always)]
fn prefetch(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // SAFETY: prefetching has no architectural effect; the address is in bounds.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast()) };
    }
}

/// [`attend_tile`] compiled for AVX2+FMA, its dot products and axpys inlined.
///
/// # Safety
/// The CPU supports avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_tile_avx2<'a>(
    q: &[f32],
    s: &AttentionShape,
    t: &Tile,
    pos: &impl Fn(usize, usize) -> usize,
    kv: &impl Fn(usize, usize, usize) -> (&'a [f32], &'a [f32]),
) -> Vec<f32> {
    // SAFETY: the CPU supports avx2 and fma (this function's contract).
    attend_tile(q, s, t, pos, kv, |a, b| unsafe { super::simd::dot_fused(a, b) }, super::simd::axpy_fused)
}

/// One head of one query row over positions `lo..=pos`, whose key and value
/// rows `kv(j)` gives: softmax of the scaled dot products, then the weighted
/// sum of values, in position order (the reference the tiles must match).
#[cfg(test)]
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
    let kv_dim = nkv * hd;
    let bs = batch.block_size;
    let tiles: Vec<Tile> =
        batch.seqs.iter().enumerate().flat_map(|(i, seq)| tiles_of(i, seq.rows.clone(), nkv, nh / nkv)).collect();
    let tiles = spread(tiles, rayon::current_num_threads());
    let work: usize = batch.seqs.iter().map(|x| x.len() * x.context_len()).sum::<usize>() * nh * hd;
    let pos = |i: usize, r: usize| {
        let seq = &batch.seqs[i];
        seq.start + (r - seq.rows.start)
    };
    run_tiles(q, s, &tiles, work, out, pos, |i, j, kvh| {
        let seq = &batch.seqs[i];
        let slot = seq.block_table[j / bs] as usize * bs + j % bs;
        let at = slot * kv_dim + kvh * hd;
        (&keys[at..at + hd], &values[at..at + hd])
    });
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

    /// Tiles give the bits each (row, head) gives alone, windowed or not,
    /// for a chunk after earlier positions.
    #[test]
    fn tiles_match_one_row_at_a_time_bit_for_bit() {
        let mut x = 0x1234_5678u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2001) as f32 / 1000.0 - 1.0
        };
        for window in [None, Some(5)] {
            let s = AttentionShape { num_heads: 6, num_kv_heads: 2, head_dim: 8, window, scale: 0.35 };
            let (start, n) = (7, 37);
            let kv_dim = 2 * 8;
            let q: Vec<f32> = (0..n * 6 * 8).map(|_| rnd()).collect();
            let k: Vec<f32> = (0..(start + n) * kv_dim).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..(start + n) * kv_dim).map(|_| rnd()).collect();
            let mut out = vec![f32::NAN; q.len()];
            causal_attention(&q, n, start, &k, &v, &s, &mut out);
            // One query head per tile (as when tiles are fewer than threads): the same bits.
            let mut spread_out = vec![f32::NAN; q.len()];
            let tiles = spread(tiles_of(0, 0..n, 2, 3), usize::MAX);
            assert_eq!(tiles.len(), 2 * 3 * n.div_ceil(TILE_ROWS));
            run_tiles(
                &q,
                &s,
                &tiles,
                0,
                &mut spread_out,
                |_, r| start + r,
                |_, j, kvh| {
                    let at = j * kv_dim + kvh * 8;
                    (&k[at..at + 8], &v[at..at + 8])
                },
            );
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&spread_out), bits(&out));
            for t in 0..n {
                for h in 0..6 {
                    let kvh = h / 3;
                    let mut o = vec![0.0; 8];
                    let p = start + t;
                    attend_one(
                        &q[(t * 6 + h) * 8..(t * 6 + h + 1) * 8],
                        window_start(p, window),
                        p,
                        0.35,
                        &mut o,
                        |j| {
                            (
                                &k[j * kv_dim + kvh * 8..j * kv_dim + kvh * 8 + 8],
                                &v[j * kv_dim + kvh * 8..j * kv_dim + kvh * 8 + 8],
                            )
                        },
                    );
                    let got = &out[(t * 6 + h) * 8..(t * 6 + h + 1) * 8];
                    assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        o.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    );
                }
            }
        }
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
