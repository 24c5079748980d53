//! `out = x · Wᵀ` for f32 activations and weights kept in their stored type.
//!
//! Work is split over tiles of weight rows, and each tile meets every
//! activation row, so a prefill reads each weight once and decode (one row)
//! streams the weights exactly once with no resident f32 copy.
//! Within a tile, register tiles of up to 4 activation rows × 2–4 weight rows
//! load each weight once per 4 activation rows.
//! Float weights: with AVX2 rows are widened 8 values at a time in registers
//! (`simd::float_tile`); without, a tile is widened into a thread-local f32
//! buffer. Block-quantized weights: activations are quantized to 8-bit blocks
//! once per call and multiplied in integers (see `q8`), as llama.cpp does;
//! K-quant weights take 256-value Q8_K activations (see `q8k`).

use std::cell::RefCell;

use rayon::prelude::*;

use super::out_ptr::OutPtr;
use super::q8::{self, Q8Block};
use super::q8k::{self, Q8KBlock};
use super::simd::dot;
use crate::quant::ggml::dequantize_into;
use crate::quant::kquants;
use crate::tensor::{Bytes, DType};

/// A 2-D weight `[rows, cols]` in its stored type.
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl CpuMatrix {
    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.cols).expect("row length checked at load")
    }
    /// Decodes row `r` into `out` (len = cols).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        dequantize_into(self.dtype, &self.data.as_slice()[r * rb..(r + 1) * rb], out);
    }
}

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Bytes of decoded weights per tile: ~64 KiB keeps a tile in L2 next to the activations.
const TILE_FLOATS: usize = 16 * 1024;

/// out[t, r] = Σ_c x[t, c] · W[r, c]; x is `[n, cols]`, out is `[n, rows]`.
pub fn matmul(x: &[f32], n: usize, w: &CpuMatrix, out: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul: activation width {} != weight cols {}", x.len() / n.max(1), w.cols);
    assert_eq!(out.len(), n * w.rows);
    if w.dtype.is_k_quant() {
        return matmul_q8k(x, n, w, out);
    }
    if w.dtype.is_quantized() {
        return matmul_q8(x, n, w, out);
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        return matmul_float_avx2(x, n, w, out);
    }
    matmul_float_portable(x, n, w, out)
}

/// Float weights without AVX2: a tile of rows is widened into a thread-local
/// buffer, then dotted with every activation row.
fn matmul_float_portable(x: &[f32], n: usize, w: &CpuMatrix, out: &mut [f32]) {
    let rows_per_tile = (TILE_FLOATS / w.cols.max(1)).clamp(1, 64);
    // Enough tiles to keep every thread busy, but no smaller than needed.
    let threads = rayon::current_num_threads().max(1);
    let min_tiles = threads * 8;
    let rows_per_tile = rows_per_tile.min(w.rows.div_ceil(min_tiles)).max(1);
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let optr = OutPtr::new(out);
    let cols = w.cols;
    (0..n_tiles).into_par_iter().for_each(|tile| {
        let r0 = tile * rows_per_tile;
        let r1 = (r0 + rows_per_tile).min(w.rows);
        TILE.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.resize(rows_per_tile * cols, 0.0);
            for r in r0..r1 {
                let off = (r - r0) * cols;
                w.decode_row(r, &mut buf[off..off + cols]);
            }
            for t in 0..n {
                let xr = &x[t * cols..(t + 1) * cols];
                for r in r0..r1 {
                    let off = (r - r0) * cols;
                    let v = dot(xr, &buf[off..off + cols]);
                    // SAFETY: (t, r) is written by this tile only; in bounds by the asserts above.
                    unsafe { *optr.get().add(t * w.rows + r) = v };
                }
            }
        });
    });
}

/// Float weights with AVX2: rows are widened in registers, no tile buffer.
#[cfg(target_arch = "x86_64")]
fn matmul_float_avx2(x: &[f32], n: usize, w: &CpuMatrix, out: &mut [f32]) {
    use super::simd::FloatWeights;
    let kind = match w.dtype {
        DType::F32 => FloatWeights::F32,
        DType::F16 => FloatWeights::F16,
        DType::BF16 => FloatWeights::BF16,
        DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q8_0
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K => unreachable!("quantized weights use the integer paths"),
        DType::U32 | DType::F8_E4M3 => unreachable!("packed words and FP8 bytes are rejected by upload"),
    };
    let threads = rayon::current_num_threads().max(1);
    let rb = w.row_bytes();
    let rows_per_tile = if n == 1 {
        w.rows.div_ceil(threads * 8).next_multiple_of(4).clamp(4, 256)
    } else {
        // The tile is reread for every group of activation rows: keep it in L2.
        let fit = (FLOAT_TILE_BYTES / rb.max(1)).clamp(3, 96) / 3 * 3;
        fit.min(w.rows.div_ceil(threads * 4).next_multiple_of(3))
    };
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let job = FloatJob { kind, bytes: w.data.as_slice(), rb, rows: w.rows, cols: w.cols, x, out: OutPtr::new(out) };
    (0..n_tiles).into_par_iter().for_each(|tile| {
        let r0 = tile * rows_per_tile;
        let r1 = (r0 + rows_per_tile).min(w.rows);
        let mut t = 0;
        while t < n {
            match n - t {
                1 => job.tile::<1, 4>(t, r0, r1),
                2 => job.tile::<2, 3>(t, r0, r1),
                3 => job.tile::<3, 3>(t, r0, r1),
                _ => job.tile::<4, 3>(t, r0, r1),
            }
            t += (n - t).min(4);
        }
    });
}

/// Bytes of float weights per prefill tile (L2 holds it next to the activations).
#[cfg(target_arch = "x86_64")]
const FLOAT_TILE_BYTES: usize = 96 * 1024;

#[cfg(target_arch = "x86_64")]
struct FloatJob<'a> {
    kind: super::simd::FloatWeights,
    bytes: &'a [u8],
    rb: usize,
    rows: usize,
    cols: usize,
    x: &'a [f32],
    out: OutPtr,
}

#[cfg(target_arch = "x86_64")]
impl FloatJob<'_> {
    fn tile<const MR: usize, const NR: usize>(&self, t: usize, r0: usize, r1: usize) {
        let x: [*const f32; MR] =
            std::array::from_fn(|i| self.x[(t + i) * self.cols..(t + i + 1) * self.cols].as_ptr());
        let wrow = |r: usize| self.bytes[r * self.rb..(r + 1) * self.rb].as_ptr();
        let mut r = r0;
        while r + NR <= r1 {
            // SAFETY: avx2 is present (checked in `matmul`); the slices above
            // hold `cols` values per row.
            let v = unsafe {
                super::simd::float_tile::<MR, NR>(self.kind, std::array::from_fn(|j| wrow(r + j)), x, self.cols)
            };
            store(self.out, self.rows, t, r, v);
            r += NR;
        }
        while r < r1 {
            // SAFETY: as above.
            let v = unsafe { super::simd::float_tile::<MR, 1>(self.kind, [wrow(r)], x, self.cols) };
            store(self.out, self.rows, t, r, v);
            r += 1;
        }
    }
}

/// Writes a register tile to rows `t..` and columns `r..` of the output.
#[inline(always)]
fn store<const MR: usize, const NR: usize>(out: OutPtr, rows: usize, t: usize, r: usize, v: [[f32; NR]; MR]) {
    for (i, vi) in v.iter().enumerate() {
        for (j, vij) in vi.iter().enumerate() {
            // SAFETY: (t + i, r + j) lies in the caller's rows and in bounds
            // (asserted in `matmul`); no other task writes it.
            unsafe { *out.get().add((t + i) * rows + r + j) = *vij };
        }
    }
}

/// Activation rows per register tile in a prefill: each unpacked weight block
/// serves this many rows.
const Q8_MR: usize = 4;

/// Bytes of quantized weights per prefill tile: the tile is reread for every
/// group of `Q8_MR` activation rows, so it should stay in L1.
const Q8_TILE_BYTES: usize = 16 * 1024;

/// Activation rows from which the AVX-512 panel kernels take over: a panel
/// is unpacked once per call, which pays once several rows share it.
const PANEL_MIN_ROWS: usize = 4;

/// The same for K-quants, whose panels unpack at a higher cost: below this
/// the multi-row dots ([`q8k::dot_rows`]) read each weight row once per 4
/// activation rows instead.
const K_PANEL_MIN_ROWS: usize = 9;

/// Quantized weights: 8-bit activations, integer block dots.
fn matmul_q8(x: &[f32], n: usize, w: &CpuMatrix, out: &mut [f32]) {
    let cols = w.cols;
    let blocks = cols / 32;
    // Taken (not borrowed) so that a nested call on this thread cannot conflict.
    let mut xq = XQ.with(|b| std::mem::take(&mut *b.borrow_mut()));
    xq.clear();
    xq.resize(n * blocks, Q8Block::ZERO);
    if n == 1 {
        q8::quantize_row(x, &mut xq);
    } else {
        xq.par_chunks_mut(blocks).zip(x.par_chunks(cols)).for_each(|(q, row)| q8::quantize_row(row, q));
    }
    #[cfg(target_arch = "x86_64")]
    if n >= PANEL_MIN_ROWS && super::panel_vnni::available() {
        super::panel_vnni::matmul_b32(w.dtype, w.data.as_slice(), w.rows, blocks, &xq, n, OutPtr::new(out));
        XQ.with(|b| *b.borrow_mut() = xq);
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let rb = w.row_bytes();
    let rows_per_tile = if n == 1 {
        // Decode streams each weight once: tiles only need to balance the threads.
        w.rows.div_ceil(threads * 8).next_multiple_of(4).clamp(4, 256)
    } else {
        let fit = (Q8_TILE_BYTES / rb.max(1)).clamp(4, 64) / 4 * 4;
        fit.min(w.rows.div_ceil(threads * 4).next_multiple_of(4))
    };
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let job =
        Q8Job { dtype: w.dtype, bytes: w.data.as_slice(), rb, rows: w.rows, xq: &xq, blocks, out: OutPtr::new(out) };
    (0..n_tiles).into_par_iter().for_each(|tile| {
        let r0 = tile * rows_per_tile;
        let r1 = (r0 + rows_per_tile).min(w.rows);
        let mut t = 0;
        while t < n {
            match n - t {
                1 => job.tile::<1, 4>(t, r0, r1),
                2 => job.tile::<2, 2>(t, r0, r1),
                3 => job.tile::<3, 2>(t, r0, r1),
                _ => job.tile::<Q8_MR, 2>(t, r0, r1),
            }
            t += (n - t).min(Q8_MR);
        }
    });
    XQ.with(|b| *b.borrow_mut() = xq);
}

thread_local! {
    static XQ: RefCell<Vec<Q8Block>> = const { RefCell::new(Vec::new()) };
    static XQK: RefCell<Vec<Q8KBlock>> = const { RefCell::new(Vec::new()) };
}

/// K-quant weights: activations quantized to Q8_K once per call, then one
/// integer dot per (activation row, weight row), parallel over weight-row tiles.
fn matmul_q8k(x: &[f32], n: usize, w: &CpuMatrix, out: &mut [f32]) {
    let cols = w.cols;
    let blocks = cols / kquants::QK_K;
    let mut xq = XQK.with(|b| std::mem::take(&mut *b.borrow_mut()));
    xq.clear();
    xq.resize(n * blocks, Q8KBlock::ZERO);
    xq.par_chunks_mut(blocks.max(1)).zip(x.par_chunks(cols.max(1))).for_each(|(q, row)| q8k::quantize_row(row, q));
    #[cfg(target_arch = "x86_64")]
    if n >= K_PANEL_MIN_ROWS && super::panel_vnni::available() {
        super::panel_vnni::matmul_k(w.dtype, w.data.as_slice(), w.rows, blocks, &xq, n, OutPtr::new(out));
        XQK.with(|b| *b.borrow_mut() = xq);
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let rb = w.row_bytes();
    let rows_per_tile = w.rows.div_ceil(threads * 8).clamp(1, 64);
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let (bytes, rows, optr) = (w.data.as_slice(), w.rows, OutPtr::new(out));
    let xq_ref = &xq;
    let x = |t: usize| &xq_ref[t * blocks..(t + 1) * blocks];
    (0..n_tiles).into_par_iter().for_each(|tile| {
        let r0 = tile * rows_per_tile;
        let r1 = (r0 + rows_per_tile).min(rows);
        for r in r0..r1 {
            let wr = &bytes[r * rb..(r + 1) * rb];
            // Up to 4 activation rows per read of the weight row.
            let mut t = 0;
            while t < n {
                let take = (n - t).min(4);
                match take {
                    1 => store(optr, rows, t, r, [[q8k::dot(w.dtype, wr, x(t))]]),
                    2 => store(optr, rows, t, r, q8k::dot_rows(w.dtype, wr, [x(t), x(t + 1)]).map(|v| [v])),
                    3 => {
                        let v = q8k::dot_rows(w.dtype, wr, [x(t), x(t + 1), x(t + 2)]);
                        store(optr, rows, t, r, v.map(|v| [v]))
                    }
                    _ => {
                        let v = q8k::dot_rows(w.dtype, wr, [x(t), x(t + 1), x(t + 2), x(t + 3)]);
                        store(optr, rows, t, r, v.map(|v| [v]))
                    }
                }
                t += take;
            }
        }
    });
    XQK.with(|b| *b.borrow_mut() = xq);
}

/// One quantized matmul: the weights, the quantized activations and the output.
struct Q8Job<'a> {
    dtype: DType,
    bytes: &'a [u8],
    rb: usize,
    rows: usize,
    xq: &'a [Q8Block],
    blocks: usize,
    out: OutPtr,
}

impl Q8Job<'_> {
    fn wrow(&self, r: usize) -> &[u8] {
        &self.bytes[r * self.rb..(r + 1) * self.rb]
    }

    /// Activation rows `t..t+MR` against weight rows `r0..r1`, `NR` weight rows at a time.
    fn tile<const MR: usize, const NR: usize>(&self, t: usize, r0: usize, r1: usize) {
        let x: [&[Q8Block]; MR] = std::array::from_fn(|i| &self.xq[(t + i) * self.blocks..(t + i + 1) * self.blocks]);
        let mut r = r0;
        while r + NR <= r1 {
            let v = q8::dot_tile::<MR, NR>(self.dtype, std::array::from_fn(|j| self.wrow(r + j)), x);
            store(self.out, self.rows, t, r, v);
            r += NR;
        }
        while r < r1 {
            let v = q8::dot_tile::<MR, 1>(self.dtype, [self.wrow(r)], x);
            store(self.out, self.rows, t, r, v);
            r += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn float_bytes(dtype: DType, v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|v| match dtype {
                DType::F32 => v.to_le_bytes().to_vec(),
                DType::F16 => half::f16::from_f32(*v).to_le_bytes().to_vec(),
                DType::BF16 => bf16::from_f32(*v).to_le_bytes().to_vec(),
                DType::Q4_0
                | DType::Q4_1
                | DType::Q5_0
                | DType::Q5_1
                | DType::Q8_0
                | DType::Q2_K
                | DType::Q3_K
                | DType::Q4_K
                | DType::Q5_K
                | DType::Q6_K
                | DType::U32
                | DType::F8_E4M3 => unreachable!(),
            })
            .collect()
    }

    /// Every float dtype, tile remainders in rows, columns and activation rows.
    #[test]
    fn float_matmul_matches_naive() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (rows, cols, n) in [(37, 70, 5), (8, 64, 1), (13, 9, 7), (3, 3, 2)] {
                let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
                let w = CpuMatrix { dtype, rows, cols, data: Bytes::from_vec(float_bytes(dtype, &wf)) };
                let x: Vec<f32> = (0..n * cols).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
                let mut out = vec![f32::NAN; n * rows];
                matmul(&x, n, &w, &mut out);
                let mut portable = vec![f32::NAN; n * rows];
                matmul_float_portable(&x, n, &w, &mut portable);
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    w.decode_row(r, &mut row);
                    for t in 0..n {
                        let want: f32 = (0..cols).map(|c| x[t * cols + c] * row[c]).sum();
                        for got in [out[t * rows + r], portable[t * rows + r]] {
                            assert!(
                                (got - want).abs() < 1e-4,
                                "{dtype:?} {rows}x{cols} n={n} ({t},{r}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `n` values of `dtype` as random blocks whose f16 scales are finite (alternating sign).
    fn random_blocks(seed: &mut u64, dtype: DType, n: usize) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut bytes: Vec<u8> = (0..dtype.bytes_for(n).unwrap())
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (*seed >> 56) as u8
            })
            .collect();
        for blk in bytes.chunks_exact_mut(bb) {
            for (k, &off) in kquants::f16_field_offsets(dtype).iter().enumerate() {
                blk[off..off + 2].copy_from_slice(&[[0x66, 0x2e], [0x00, 0xb0]][k]);
            }
        }
        bytes
    }

    /// K-quant weights: the parallel matmul equals the Q8_K reference dot per output.
    #[test]
    fn k_quant_matmul_matches_reference_dot() {
        let mut seed = 5u64;
        for dtype in [DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K] {
            for (rows, cols, n) in [(13, 512, 3), (5, 256, 1)] {
                let w = CpuMatrix {
                    dtype,
                    rows,
                    cols,
                    data: Bytes::from_vec(random_blocks(&mut seed, dtype, rows * cols)),
                };
                let x: Vec<f32> = (0..n * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let mut out = vec![f32::NAN; n * rows];
                matmul(&x, n, &w, &mut out);
                let rb = w.row_bytes();
                let mut xq = vec![Q8KBlock::ZERO; cols / 256];
                for t in 0..n {
                    q8k::quantize_row(&x[t * cols..(t + 1) * cols], &mut xq);
                    for r in 0..rows {
                        let want = q8k::dot(dtype, &w.data.as_slice()[r * rb..(r + 1) * rb], &xq);
                        assert_eq!(out[t * rows + r], want, "{dtype:?} ({t},{r})");
                    }
                }
            }
        }
    }

    /// Quantized weights: the tiled matmul equals the scalar reference dot per output.
    #[test]
    fn quantized_matmul_matches_reference_dot() {
        let mut seed = 3u64;
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0] {
            for (rows, cols, n) in [(37, 96, 5), (9, 32, 1), (70, 160, 9)] {
                let w = CpuMatrix {
                    dtype,
                    rows,
                    cols,
                    data: Bytes::from_vec(random_blocks(&mut seed, dtype, rows * cols)),
                };
                let x: Vec<f32> = (0..n * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let mut out = vec![f32::NAN; n * rows];
                matmul(&x, n, &w, &mut out);
                let rb = w.row_bytes();
                let mut xq = vec![Q8Block::ZERO; cols / 32];
                for t in 0..n {
                    q8::quantize_row_scalar(&x[t * cols..(t + 1) * cols], &mut xq);
                    for r in 0..rows {
                        let want = q8::dot(dtype, &w.data.as_slice()[r * rb..(r + 1) * rb], &xq);
                        let got = out[t * rows + r];
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{dtype:?} ({t},{r}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
