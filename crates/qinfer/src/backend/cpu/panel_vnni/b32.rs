//! Panels of the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::super::act_blocks::Q8Block;
use super::super::out_ptr::OutPtr;
use super::panel::{Ahead, LANES, MR, PANEL, Panel, Rows, available, splat4, store_lanes};
use crate::tensor::DType;

/// [`MR`] in ggml's order, whose 8 float sums a row (one per 4-value
/// chunk) take 8 registers: 2 rows, with the panel's 8 chunks of a block.
const GGML_MR: usize = 2;

/// How a 32-value block type's levels are made unsigned and its min applied.
#[derive(Clone, Copy)]
struct B32 {
    /// Added to every level to make it unsigned: the sum loses `offset·Σx`.
    offset: i32,
    /// Byte offset of the min `m` (Q4_1, Q5_1), if the type has one.
    min_at: Option<usize>,
    /// Whether `m·s_x` joins each block's step (Q5_1, as the scalar dot adds
    /// it there) or a separate sum added at the end (Q4_1).
    min_in_step: bool,
    /// Whether the float steps follow ggml's AVX2 order (Q4_0, Q4_1, Q8_0, as
    /// their AVX2 kernels in `q8_avx2` do) rather than the scalar dot's.
    ggml_order: bool,
}

fn b32_layout(dtype: DType) -> B32 {
    match dtype {
        DType::Q4_0 => B32 { offset: 8, min_at: None, min_in_step: false, ggml_order: true },
        DType::Q4_1 => B32 { offset: 0, min_at: Some(2), min_in_step: false, ggml_order: true },
        DType::Q5_0 => B32 { offset: 16, min_at: None, min_in_step: false, ggml_order: false },
        DType::Q5_1 => B32 { offset: 0, min_at: Some(2), min_in_step: true, ggml_order: false },
        DType::Q8_0 => B32 { offset: 128, min_at: None, min_in_step: false, ggml_order: true },
        _ => unreachable!("{} is not a 32-value block type", dtype.name()),
    }
}

/// Whether `dtype`'s panels sum in ggml's AVX2 order (Q4_0, Q4_1, Q8_0)
/// rather than the scalar dot's.
#[cfg(test)]
pub(super) fn ggml_order(dtype: DType) -> bool {
    b32_layout(dtype).ggml_order
}

/// `out[t, r]` = Σ_c x[t, c]·W[r, c] for 32-value block weights `bytes`
/// (`rows` rows of `blocks` blocks) and activations quantized to `xq`
/// (`n` rows of `blocks` blocks).
pub(crate) fn matmul_b32(
    dtype: DType,
    bytes: &[u8],
    rows: usize,
    blocks: usize,
    xq: &[Q8Block],
    n: usize,
    out: OutPtr,
) {
    assert!(available() && dtype.is_quantized() && !dtype.is_k_quant());
    let rb = blocks * dtype.block_bytes();
    assert_eq!(bytes.len(), rows * rb);
    assert_eq!(xq.len(), n * blocks);
    let layout = b32_layout(dtype);
    // offset·Σq per activation block (or, in ggml's order, per 4-value chunk):
    // the level offset's share of each sum.
    let xoff: Vec<i32> = if layout.ggml_order {
        xq.iter()
            .flat_map(|y| y.qs.chunks_exact(4).map(|c| layout.offset * c.iter().map(|&q| q as i32).sum::<i32>()))
            .collect()
    } else {
        xq.iter().map(|y| layout.offset * y.qs.iter().map(|&q| q as i32).sum::<i32>()).collect()
    };
    (0..rows.div_ceil(LANES)).into_par_iter().for_each(|p| {
        let w = Rows { bytes, rb, r0: p * LANES, count: (rows - p * LANES).min(LANES) };
        let next = Ahead::rows(bytes, rb, (p + 1) * LANES, rows);
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            // SAFETY: AVX-512 F/BW/VL/VNNI are present (`available`, asserted above).
            unsafe { unpack_b32(dtype, layout, &w, blocks, &mut panel) };
            let mut t = 0;
            while t < n {
                let take = (n - t).min(if layout.ggml_order { GGML_MR } else { MR });
                // The first pass over the panel brings in the next one.
                let ahead = if t == 0 { next } else { Ahead::NONE };
                let job = B32Job {
                    layout,
                    panel: &panel,
                    blocks,
                    xq,
                    xoff: &xoff,
                    t,
                    rows,
                    r0: w.r0,
                    count: w.count,
                    out,
                    ahead,
                };
                // SAFETY: as above; the panel holds `blocks` blocks and the
                // activation rows t..t+take exist.
                unsafe {
                    match (take, layout.ggml_order) {
                        (1, false) => job.run::<1>(),
                        (2, false) => job.run::<2>(),
                        (3, false) => job.run::<3>(),
                        (_, false) => job.run::<MR>(),
                        (1, true) => job.run_ggml::<1>(),
                        (_, true) => job.run_ggml::<GGML_MR>(),
                    }
                }
                t += take;
            }
        });
    });
}

/// Unpacks a panel of 32-value blocks: unsigned levels, `d` and `m` (0
/// where the type has none) per block. Each block of the 16 rows is read as
/// a 16 × 4 (Q8_0: 16 × 8) matrix of level dwords and transposed in
/// registers, so chunk k of the 16 rows lands as one 512-bit store; the
/// scales come in one gather. Rows past the matrix read a zero block (their
/// lanes are never stored). Every entry of the panel is written.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_b32(dtype: DType, layout: B32, w: &Rows, blocks: usize, panel: &mut Panel) {
    panel.levels.resize(blocks * 8 * LANES, 0);
    panel.d.resize(blocks * LANES, 0.0);
    panel.m.resize(blocks * LANES, 0.0);
    let bb = dtype.block_bytes();
    // Larger than any 32-value block; stands for the rows past the matrix.
    let zero = [0u8; 64];
    let base = w.bytes[w.r0 * w.rb..].as_ptr();
    // Each row's current block, advanced a block at a time (the zero block stays).
    let mut blk: [*const u8; LANES] =
        std::array::from_fn(|j| if j < w.count { base.wrapping_add(j * w.rb) } else { zero.as_ptr() });
    let step: [usize; LANES] = std::array::from_fn(|j| if j < w.count { bb } else { 0 });
    let live: __mmask16 = if w.count >= LANES { 0xffff } else { (1u16 << w.count) - 1 };
    // The gathers below address the panel's rows by i32 byte offsets.
    assert!(LANES * w.rb <= i32::MAX as usize, "a weight row of {} bytes is too long for a panel", w.rb);
    let row_at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(w.rb as i32),
    );
    let m4 = _mm512_set1_epi8(0x0f);
    let flip = _mm512_set1_epi8(-128);
    // Bits b of a 4-bit index, as 16 in byte b: Q5's fifth bits of one chunk.
    let fifth = _mm512_setr_epi32(
        0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000, 0x00101010, 0x10000000,
        0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000, 0x10101010,
    );
    let levels = panel.levels.as_mut_ptr();
    for b in 0..blocks {
        let at = b * bb;
        // SAFETY: `blk` points at block `b` of each live row (`bb` bytes) or
        // at the zero block (64 bytes); every offset read lies within a block.
        let chunks: [__m512i; 8] = unsafe {
            match dtype {
                DType::Q8_0 => {
                    let lo = transpose_16x4(&blk, 2);
                    let hi = transpose_16x4(&blk, 18);
                    std::array::from_fn(|k| _mm512_xor_si512(if k < 4 { lo[k] } else { hi[k - 4] }, flip))
                }
                _ => {
                    let (qs, qh) = match dtype {
                        DType::Q4_0 => (2, None),
                        DType::Q4_1 => (4, None),
                        DType::Q5_0 => (6, Some(2)),
                        DType::Q5_1 => (8, Some(4)),
                        _ => unreachable!("{} is not a 32-value block type", dtype.name()),
                    };
                    let q = transpose_16x4(&blk, qs);
                    let mut c: [__m512i; 8] = std::array::from_fn(|k| {
                        if k < 4 {
                            _mm512_and_si512(q[k], m4)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi32::<4>(q[k - 4]), m4)
                        }
                    });
                    if let Some(h) = qh {
                        // Bit v of qh is bit 4 of value v: chunk k takes bits 4k..4k+4.
                        let bits = _mm512_mask_i32gather_epi32::<1>(
                            _mm512_setzero_si512(),
                            live,
                            _mm512_add_epi32(row_at, _mm512_set1_epi32((at + h) as i32)),
                            base.cast(),
                        );
                        for (k, ck) in c.iter_mut().enumerate() {
                            let nib = _mm512_and_si512(
                                _mm512_srlv_epi32(bits, _mm512_set1_epi32(4 * k as i32)),
                                _mm512_set1_epi32(0xf),
                            );
                            *ck = _mm512_or_si512(*ck, _mm512_permutexvar_epi32(nib, fifth));
                        }
                    }
                    c
                }
            }
        };
        for (k, ck) in chunks.iter().enumerate() {
            // SAFETY: the panel holds `blocks`·8 chunks of 16 lanes.
            unsafe { _mm512_storeu_si512(levels.add((b * 8 + k) * LANES).cast(), *ck) };
        }
        // The dword at a block's start holds d and (Q4_1, Q5_1) m as f16.
        // SAFETY: each live row's block `b` starts at `at`; masked lanes read nothing.
        let dm = unsafe {
            _mm512_mask_i32gather_epi32::<1>(
                _mm512_setzero_si512(),
                live,
                _mm512_add_epi32(row_at, _mm512_set1_epi32(at as i32)),
                base.cast(),
            )
        };
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        let m = if layout.min_at.is_some() {
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)))
        } else {
            _mm512_setzero_ps()
        };
        // SAFETY: the panel holds `blocks`·16 scales of each kind.
        unsafe {
            _mm512_storeu_ps(panel.d.as_mut_ptr().add(b * LANES), d);
            _mm512_storeu_ps(panel.m.as_mut_ptr().add(b * LANES), m);
        }
        for (p, s) in blk.iter_mut().zip(step) {
            *p = p.wrapping_add(s);
        }
    }
}

/// The 16 bytes at `rows[j] + at` for the 16 rows, as four registers:
/// dword i of row j in lane j of register i.
///
/// # Safety
/// Each of the 16 pointers has 16 readable bytes at `at`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_16x4(rows: &[*const u8; LANES], at: usize) -> [__m512i; 4] {
    // SAFETY: the caller guarantees 16 readable bytes at each `rows[j] + at`.
    let load = |j: usize| unsafe { _mm_loadu_si128(rows[j].add(at).cast()) };
    // Register i holds rows i, 4 + i, 8 + i, 12 + i in its 128-bit quarters,
    // so that the in-quarter 4 × 4 transposes below leave row j in lane j.
    let a: [__m512i; 4] = std::array::from_fn(|i| {
        let v = _mm512_castsi128_si512(load(i));
        let v = _mm512_inserti32x4::<1>(v, load(4 + i));
        let v = _mm512_inserti32x4::<2>(v, load(8 + i));
        _mm512_inserti32x4::<3>(v, load(12 + i))
    });
    // Per quarter q: rows 4q..4q+4 (r0..r3), dwords d0..d3 of each.
    let r01_lo = _mm512_unpacklo_epi32(a[0], a[1]); // r0d0 r1d0 r0d1 r1d1
    let r01_hi = _mm512_unpackhi_epi32(a[0], a[1]); // r0d2 r1d2 r0d3 r1d3
    let r23_lo = _mm512_unpacklo_epi32(a[2], a[3]); // r2d0 r3d0 r2d1 r3d1
    let r23_hi = _mm512_unpackhi_epi32(a[2], a[3]); // r2d2 r3d2 r2d3 r3d3
    [
        _mm512_unpacklo_epi64(r01_lo, r23_lo),
        _mm512_unpackhi_epi64(r01_lo, r23_lo),
        _mm512_unpacklo_epi64(r01_hi, r23_hi),
        _mm512_unpackhi_epi64(r01_hi, r23_hi),
    ]
}

/// Activation rows `t..t+R` against one panel of 32-value blocks.
struct B32Job<'a> {
    layout: B32,
    panel: &'a Panel,
    blocks: usize,
    xq: &'a [Q8Block],
    xoff: &'a [i32],
    t: usize,
    rows: usize,
    r0: usize,
    count: usize,
    out: OutPtr,
    ahead: Ahead<'a>,
}

impl B32Job<'_> {
    /// Per block, the exact `s = Σ level·x − offset·Σx` in each lane, then the
    /// scalar dot's step: `acc + (d_w·d_x)·s` (Q4_0, Q5_0, Q8_0: the scalar's
    /// `+ 0` for Q5_0 changes no sum that starts at +0), `acc + ((d_w·d_x)·s
    /// + m_w·s_x)` (Q5_1), or for Q4_1 `m_w·s_x` summed apart and added last.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn run<const R: usize>(&self) {
        let (panel, blocks, t) = (self.panel, self.blocks, self.t);
        let has_min = self.layout.min_at.is_some();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut mins = [_mm512_setzero_ps(); R];
        let lv = panel.levels.as_ptr();
        let per = self.ahead.per_step(blocks);
        for b in 0..blocks {
            self.ahead.step(b, per);
            // SAFETY: the panel holds `blocks`·8 chunks of 16 lanes and `blocks`·16 scales.
            let (wv, dw, mw) = unsafe {
                let base = lv.add(b * 8 * LANES);
                let wv: [__m512i; 8] = std::array::from_fn(|k| _mm512_loadu_si512(base.add(k * LANES).cast()));
                (wv, _mm512_loadu_ps(panel.d.as_ptr().add(b * LANES)), _mm512_loadu_ps(panel.m.as_ptr().add(b * LANES)))
            };
            for i in 0..R {
                let y = &self.xq[(t + i) * blocks + b];
                let xp = y.qs.as_ptr();
                let mut s0 = _mm512_set1_epi32(-self.xoff[(t + i) * blocks + b]);
                let mut s1 = _mm512_setzero_si512();
                for k in (0..8).step_by(2) {
                    // SAFETY: `qs` holds 32 bytes; chunks k and k + 1 lie within it.
                    unsafe {
                        s0 = _mm512_dpbusd_epi32(s0, wv[k], splat4(xp.add(4 * k)));
                        s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], splat4(xp.add(4 * k + 4)));
                    }
                }
                let s = _mm512_add_epi32(s0, s1);
                let mut v = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(y.d)), _mm512_cvtepi32_ps(s));
                if has_min {
                    let m = _mm512_mul_ps(mw, _mm512_set1_ps(y.s));
                    if self.layout.min_in_step {
                        v = _mm512_add_ps(v, m);
                    } else {
                        mins[i] = _mm512_add_ps(mins[i], m);
                    }
                }
                acc[i] = _mm512_add_ps(acc[i], v);
            }
        }
        for i in 0..R {
            let a = if has_min && !self.layout.min_in_step { _mm512_add_ps(acc[i], mins[i]) } else { acc[i] };
            // SAFETY: row t + i of the output has `rows` floats; r0 + count ≤ rows.
            unsafe { store_lanes(self.out.get().add((t + i) * self.rows + self.r0), a, self.count) };
        }
    }
}

impl B32Job<'_> {
    /// ggml's AVX2 order, as `q8_avx2`'s kernels compute it: the exact i32
    /// sum of each 4-value chunk `k` of a block is a float lane `k` of 8,
    /// `acc_k = fma(d_w·d_x, sum_k, acc_k)` block after block, then the
    /// lanes reduced as `hsum_float_8` does, plus (Q4_1) the `m_w·s_x` sum.
    /// All 8 chunk sums of a row live in registers, so `d_w·d_x` is made
    /// once per block and row; hence at most [`GGML_MR`] rows a pass.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn run_ggml<const R: usize>(&self) {
        let (panel, blocks, t) = (self.panel, self.blocks, self.t);
        let mut lanes = [[_mm512_setzero_ps(); 8]; R];
        let lv = panel.levels.as_ptr();
        let per = self.ahead.per_step(blocks);
        for b in 0..blocks {
            self.ahead.step(b, per);
            // SAFETY: the panel holds `blocks`·8 chunks of 16 lanes and `blocks`·16 scales.
            let (wv, dw) = unsafe {
                let base = lv.add(b * 8 * LANES);
                let wv: [__m512i; 8] = std::array::from_fn(|k| _mm512_loadu_si512(base.add(k * LANES).cast()));
                (wv, _mm512_loadu_ps(panel.d.as_ptr().add(b * LANES)))
            };
            for (i, l) in lanes.iter_mut().enumerate() {
                let y = &self.xq[(t + i) * blocks + b];
                let dwx = _mm512_mul_ps(dw, _mm512_set1_ps(y.d));
                for (k, lk) in l.iter_mut().enumerate() {
                    let init = if self.layout.offset == 0 {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_set1_epi32(-self.xoff[((t + i) * blocks + b) * 8 + k])
                    };
                    // SAFETY: `qs` holds 32 bytes; chunk k lies within it.
                    let s = unsafe { _mm512_dpbusd_epi32(init, wv[k], splat4(y.qs.as_ptr().add(4 * k))) };
                    *lk = _mm512_fmadd_ps(dwx, _mm512_cvtepi32_ps(s), *lk);
                }
            }
        }
        for (i, l) in lanes.iter().enumerate() {
            let add = |a, b| _mm512_add_ps(a, b);
            let mut v = add(add(add(l[0], l[4]), add(l[2], l[6])), add(add(l[1], l[5]), add(l[3], l[7])));
            if self.layout.min_at.is_some() {
                let mut mins = _mm512_setzero_ps();
                for b in 0..blocks {
                    let y = &self.xq[(t + i) * blocks + b];
                    // SAFETY: the panel holds `blocks`·16 min scales.
                    let mw = unsafe { _mm512_loadu_ps(panel.m.as_ptr().add(b * LANES)) };
                    mins = add(mins, _mm512_mul_ps(mw, _mm512_set1_ps(y.s)));
                }
                v = add(v, mins);
            }
            // SAFETY: row t + i of the output has `rows` floats; r0 + count ≤ rows.
            unsafe { store_lanes(self.out.get().add((t + i) * self.rows + self.r0), v, self.count) };
        }
    }
}
