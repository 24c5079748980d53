//! Panels of the K-quants (Q2_K … Q6_K): 256-value super-blocks, integer
//! scales per group of 16 or 32 values.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::super::act_blocks::Q8KBlock;
use super::super::out_ptr::OutPtr;
use super::panel::{Ahead, LANES, MR, PANEL, Panel, Rows, available, splat4, store_lanes};
use crate::quant::kquants::{self, QK_K};
use crate::tensor::DType;

/// Writes the 256 levels of row `j`'s super-block `b` into the panel: chunk
/// k (values 4k..4k+4) goes to lane j of the panel's chunk b·64 + k.
///
/// # Safety
/// The panel holds the chunks of super-block `b`; `j < 16`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn put_levels_k(levels: &mut [u32], lv: &[u8; QK_K], b: usize, j: usize) {
    let stride = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for q in 0..4 {
        // SAFETY: `lv` holds 4·64 bytes; chunks b·64 + 16q .. +16 of lane j lie in the panel (caller).
        unsafe {
            let v = _mm512_loadu_si512(lv[64 * q..].as_ptr().cast());
            let at = levels.as_mut_ptr().add((b * (QK_K / 4) + 16 * q) * LANES + j);
            _mm512_i32scatter_epi32::<4>(at.cast(), stride, v);
        }
    }
}

/// How a K-quant's levels are stored in a panel and its groups scaled.
#[derive(Clone, Copy)]
struct KLayout {
    /// Values per integer scale (16, or 32 where adjacent 16-value groups share one).
    group: usize,
    /// Added to every level to make it unsigned (Q3_K 4, Q6_K 32).
    offset: i32,
    /// Whether the type has mins (Q2_K, Q4_K, Q5_K).
    mins: bool,
}

fn k_layout(dtype: DType) -> KLayout {
    match dtype {
        DType::Q2_K => KLayout { group: 16, offset: 0, mins: true },
        DType::Q3_K => KLayout { group: 16, offset: 4, mins: false },
        DType::Q4_K | DType::Q5_K => KLayout { group: 32, offset: 0, mins: true },
        DType::Q6_K => KLayout { group: 16, offset: 32, mins: false },
        _ => unreachable!("{} is not a K-quant", dtype.name()),
    }
}

/// As [`matmul_b32`] for K-quant weights and Q8_K activations.
pub(crate) fn matmul_k(dtype: DType, bytes: &[u8], rows: usize, blocks: usize, xq: &[Q8KBlock], n: usize, out: OutPtr) {
    assert!(available() && dtype.is_k_quant());
    let rb = blocks * dtype.block_bytes();
    assert_eq!(bytes.len(), rows * rb);
    assert_eq!(xq.len(), n * blocks);
    let layout = k_layout(dtype);
    (0..rows.div_ceil(LANES)).into_par_iter().for_each(|p| {
        let w = Rows { bytes, rb, r0: p * LANES, count: (rows - p * LANES).min(LANES) };
        // One burst: a K panel serves 9 or more rows, a pass long enough to
        // cover it (prompts measured no slower than without it).
        Ahead::rows(bytes, rb, (p + 1) * LANES, rows).all();
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            // SAFETY: AVX-512 F/BW/VNNI are present (asserted above).
            unsafe { unpack_k(dtype, layout, &w, blocks, &mut panel) };
            let mut t = 0;
            while t < n {
                let take = (n - t).min(MR);
                // SAFETY: as above; the panel holds `blocks` super-blocks.
                unsafe {
                    match (take, layout.group) {
                        (1, 16) => run_k::<1, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (2, 16) => run_k::<2, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (3, 16) => run_k::<3, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (_, 16) => run_k::<MR, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (1, _) => run_k::<1, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (2, _) => run_k::<2, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (3, _) => run_k::<3, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (_, _) => run_k::<MR, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                    }
                }
                t += take;
            }
        });
    });
}

/// The 256 levels of one K-quant super-block as unsigned bytes (`q + offset`).
#[inline(always)]
fn k_levels(dtype: DType, layout: KLayout, blk: &[u8], lv: &mut [u8; QK_K]) {
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            let (qh, qs) =
                if dtype == DType::Q5_K { (Some(&blk[16..48]), &blk[48..176]) } else { (None, &blk[16..144]) };
            for pair in 0..4 {
                for l in 0..32 {
                    let byte = qs[pair * 32 + l];
                    let (mut lo, mut hi) = (byte & 0x0f, byte >> 4);
                    if let Some(qh) = qh {
                        lo |= ((qh[l] >> (2 * pair)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * pair + 1)) & 1) << 4;
                    }
                    lv[pair * 64 + l] = lo;
                    lv[pair * 64 + 32 + l] = hi;
                }
            }
        }
        DType::Q6_K => {
            let (ql, qh) = (&blk[0..128], &blk[128..192]);
            for half in 0..2 {
                for l in 0..32 {
                    let (a, c) = (ql[half * 64 + l], ql[half * 64 + 32 + l]);
                    let h = qh[half * 32 + l];
                    let base = half * 128;
                    lv[base + l] = (a & 0x0f) | ((h & 3) << 4);
                    lv[base + 32 + l] = (c & 0x0f) | (((h >> 2) & 3) << 4);
                    lv[base + 64 + l] = (a >> 4) | (((h >> 4) & 3) << 4);
                    lv[base + 96 + l] = (c >> 4) | (((h >> 6) & 3) << 4);
                }
            }
        }
        _ => {
            let u = kquants::unpack(dtype, blk);
            for (o, &q) in lv.iter_mut().zip(&u.q) {
                *o = (q as i32 + layout.offset) as u8;
            }
        }
    }
}

/// Per 16-value group: the integer scale and min of a K-quant super-block.
fn k_scales(dtype: DType, blk: &[u8]) -> ([i32; 16], [i32; 16], f32, f32) {
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            let (mut sc, mut mn) = ([0; 16], [0; 16]);
            for j in 0..8 {
                let (s, m) = kquants::scale_min_k4(j, &blk[4..16]);
                (sc[2 * j], sc[2 * j + 1]) = (s as i32, s as i32);
                (mn[2 * j], mn[2 * j + 1]) = (m as i32, m as i32);
            }
            (sc, mn, kquants::f16_at(blk, 0), kquants::f16_at(blk, 2))
        }
        DType::Q6_K => (std::array::from_fn(|g| blk[192 + g] as i8 as i32), [0; 16], kquants::f16_at(blk, 208), 0.0),
        DType::Q3_K => (kquants::q3_k_scales(&blk[96..108]), [0; 16], kquants::f16_at(blk, 108), 0.0),
        DType::Q2_K => (
            std::array::from_fn(|g| (blk[g] & 0x0f) as i32),
            std::array::from_fn(|g| (blk[g] >> 4) as i32),
            kquants::f16_at(blk, 80),
            kquants::f16_at(blk, 82),
        ),
        _ => unreachable!("{} is not a K-quant", dtype.name()),
    }
}

/// Unpacks a K-quant panel: levels, `d`/`dmin` per super-block, scales per
/// `layout.group` values, and the mins (or offset × scales) as i16 pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_k(dtype: DType, layout: KLayout, w: &Rows, blocks: usize, panel: &mut Panel) {
    let groups = QK_K / layout.group;
    panel.levels.clear();
    panel.levels.resize(blocks * (QK_K / 4) * LANES, 0);
    panel.d.clear();
    panel.d.resize(blocks * LANES, 0.0);
    panel.m.clear();
    panel.m.resize(blocks * LANES, 0.0);
    panel.scales.clear();
    panel.scales.resize(blocks * groups * LANES, 0);
    panel.aux.clear();
    panel.aux.resize(blocks * 8 * LANES, 0);
    let bb = dtype.block_bytes();
    let mut lv = [0u8; QK_K];
    for j in 0..LANES {
        let Some(row) = w.row(j) else { continue };
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            k_levels(dtype, layout, blk, &mut lv);
            assert!(panel.levels.len() >= (b + 1) * (QK_K / 4) * LANES);
            // SAFETY: asserted above; j < 16.
            unsafe { put_levels_k(&mut panel.levels, &lv, b, j) };
            let (sc, mn, d, dmin) = k_scales(dtype, blk);
            panel.d[b * LANES + j] = d;
            panel.m[b * LANES + j] = dmin;
            for g in 0..groups {
                panel.scales[(b * groups + g) * LANES + j] = sc[g * layout.group / 16];
            }
            // Per pair of 16-value groups, as two i16 (|min| < 64, |offset·scale| ≤ 32·128).
            let aux = |g: usize| if layout.mins { mn[g] } else { layout.offset * sc[g] } as i16 as u16 as u32;
            for h in 0..8 {
                panel.aux[(b * 8 + h) * LANES + j] = aux(2 * h) | (aux(2 * h + 1) << 16);
            }
        }
    }
}

/// Activation rows `t..t+R` against one K-quant panel (`G` values per
/// scale): per super-block the exact `isum = Σ_g scale_g·Σ level·x` (less
/// `Σ offset·scale_g·bsum_g` for Q3_K/Q6_K) and `msum = Σ_g min_g·bsum_g`,
/// then `acc + ((d·d_x)·isum − (dmin·d_x)·msum)` as the scalar dot.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run_k<const R: usize, const G: usize>(
    layout: KLayout,
    panel: &Panel,
    blocks: usize,
    xq: &[Q8KBlock],
    t: usize,
    rows: usize,
    r0: usize,
    count: usize,
    out: OutPtr,
) {
    let groups = QK_K / G;
    let chunks = G / 4;
    let mut acc = [_mm512_setzero_ps(); R];
    let lv = panel.levels.as_ptr();
    for b in 0..blocks {
        let mut isum = [_mm512_setzero_si512(); R];
        let ys: [&Q8KBlock; R] = std::array::from_fn(|i| &xq[(t + i) * blocks + b]);
        for g in 0..groups {
            // SAFETY: the panel holds `blocks`·64 chunks of 16 lanes and
            // `blocks`·`groups` scale vectors; group g's chunks lie in the block.
            let (wv, sc) = unsafe {
                let base = lv.add((b * (QK_K / 4) + g * chunks) * LANES);
                let wv: [__m512i; 8] = std::array::from_fn(|k| {
                    if k < chunks { _mm512_loadu_si512(base.add(k * LANES).cast()) } else { _mm512_setzero_si512() }
                });
                (wv, _mm512_loadu_si512(panel.scales.as_ptr().add((b * groups + g) * LANES).cast()))
            };
            for i in 0..R {
                let xp = ys[i].qs.as_ptr();
                let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for k in (0..chunks).step_by(2) {
                    // SAFETY: chunks k, k + 1 of group g lie within the 256 `qs` bytes.
                    unsafe {
                        s0 = _mm512_dpbusd_epi32(s0, wv[k], splat4(xp.add(g * G + 4 * k)));
                        s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], splat4(xp.add(g * G + 4 * k + 4)));
                    }
                }
                isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(sc, _mm512_add_epi32(s0, s1)));
            }
        }
        // SAFETY: the panel holds 8 aux vectors and one d/m vector per super-block.
        let (aux, dw, mw) = unsafe {
            let aux: [__m512i; 8] =
                std::array::from_fn(|h| _mm512_loadu_si512(panel.aux.as_ptr().add((b * 8 + h) * LANES).cast()));
            (aux, _mm512_loadu_ps(panel.d.as_ptr().add(b * LANES)), _mm512_loadu_ps(panel.m.as_ptr().add(b * LANES)))
        };
        for i in 0..R {
            let y = ys[i];
            // Σ_g aux_g·bsum_g, two groups per `vpdpwssd` (bsums are i16 pairs in memory).
            let mut side = _mm512_setzero_si512();
            for (h, a) in aux.iter().enumerate() {
                // SAFETY: `bsums` holds 16 i16, so pair h (bytes 4h..4h+4) is in bounds.
                side = _mm512_dpwssd_epi32(side, *a, unsafe { splat4(y.bsums.as_ptr().add(2 * h).cast()) });
            }
            let (is, ms) =
                if layout.mins { (isum[i], side) } else { (_mm512_sub_epi32(isum[i], side), _mm512_setzero_si512()) };
            let yd = _mm512_set1_ps(y.d);
            let v = _mm512_sub_ps(
                _mm512_mul_ps(_mm512_mul_ps(dw, yd), _mm512_cvtepi32_ps(is)),
                _mm512_mul_ps(_mm512_mul_ps(mw, yd), _mm512_cvtepi32_ps(ms)),
            );
            acc[i] = _mm512_add_ps(acc[i], v);
        }
    }
    for (i, a) in acc.iter().enumerate() {
        // SAFETY: row t + i of the output has `rows` floats; r0 + count ≤ rows.
        unsafe { store_lanes(out.get().add((t + i) * rows + r0), *a, count) };
    }
}
