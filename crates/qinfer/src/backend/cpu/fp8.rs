//! FP8 matrices on the CPU (see [`crate::quant::fp8`]): the E4M3 bytes stay
//! in the mapped file, the per-row group scales are f32 in memory.
//!
//! A tile of rows is dequantized (`f32(q) · scale`, as the reference computes
//! the weights) into a thread-local buffer and dotted with every activation
//! row, so each weight is decoded once per call and a row's result does not
//! depend on how many activation rows share the call.

use std::cell::RefCell;

use rayon::prelude::*;

use super::out_ptr::OutPtr;
use super::simd::dot;
use crate::quant::fp8::{E4M3_TABLE, Fp8Tensor};
use crate::tensor::Bytes;
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct Fp8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Columns per scale.
    pub group: usize,
    /// `rows × cols` E4M3 bytes.
    pub weight: Bytes,
    /// `rows × ⌈cols/group⌉`.
    pub scales: Vec<f32>,
}

impl Fp8Matrix {
    pub fn from_tensor(t: &Fp8Tensor) -> Result<Self> {
        let &[rows, cols] = t.shape() else {
            return Err(Error::tensor(&t.name, format!("expected a 2-D matrix, found shape {:?}", t.shape())));
        };
        Ok(Fp8Matrix { rows, cols, group: t.group, weight: t.weight.data.clone(), scales: t.scales.to_f32_vec() })
    }

    fn groups(&self) -> usize {
        self.cols.div_ceil(self.group)
    }

    /// Dequantizes row `r` into `out` (len = cols).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let q = &self.weight.as_slice()[r * self.cols..(r + 1) * self.cols];
        let g = self.groups();
        let scales = &self.scales[r * g..(r + 1) * g];
        for ((o, q), s) in out.chunks_mut(self.group).zip(q.chunks(self.group)).zip(scales) {
            for (o, &b) in o.iter_mut().zip(q) {
                *o = E4M3_TABLE[b as usize] * s;
            }
        }
    }
}

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Decoded values per tile: ~64 KiB stays in L2 beside the activations.
const TILE_FLOATS: usize = 16 * 1024;

/// out[t, r] = Σ_c x[t, c] · W[r, c]; x is `[n, cols]`, out is `[n, rows]`.
pub fn matmul(x: &[f32], n: usize, w: &Fp8Matrix, out: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul: activation width {} != weight cols {}", x.len() / n.max(1), w.cols);
    assert_eq!(out.len(), n * w.rows);
    let cols = w.cols;
    let threads = rayon::current_num_threads().max(1);
    let rows_per_tile = (TILE_FLOATS / cols.max(1)).clamp(1, 64).min(w.rows.div_ceil(threads * 8)).max(1);
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let optr = OutPtr::new(out);
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
            #[cfg(target_arch = "x86_64")]
            if super::simd::has_avx2() {
                return tiles_avx2(x, n, cols, &buf, r0, r1, w.rows, optr);
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

/// The decoded rows `r0..r1` (in `buf`) against every activation row in
/// register tiles of up to 4 activation rows × 3 weight rows, as the float
/// weights' prefill does; every tile shape sums alike, so a row's result
/// does not depend on its batch.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn tiles_avx2(x: &[f32], n: usize, cols: usize, buf: &[f32], r0: usize, r1: usize, rows: usize, out: OutPtr) {
    use super::simd::{FloatWeights, float_tile};
    fn run<const MR: usize, const NR: usize>(
        x: &[f32],
        t: usize,
        cols: usize,
        buf: &[f32],
        r0: usize,
        r: usize,
        rows: usize,
        out: OutPtr,
    ) {
        let xs: [*const f32; MR] = std::array::from_fn(|i| x[(t + i) * cols..].as_ptr());
        let ws: [*const u8; NR] = std::array::from_fn(|j| buf[(r + j - r0) * cols..].as_ptr().cast());
        // SAFETY: avx2 is present (checked by the caller); every pointer has
        // `cols` f32 values after it.
        let v = unsafe { float_tile::<MR, NR>(FloatWeights::F32, ws, xs, cols) };
        for (i, vi) in v.iter().enumerate() {
            for (j, vij) in vi.iter().enumerate() {
                // SAFETY: (t + i, r + j) is in bounds and written by this tile only.
                unsafe { *out.get().add((t + i) * rows + r + j) = *vij };
            }
        }
    }
    let mut t = 0;
    while t < n {
        let mr = (n - t).min(4);
        let mut r = r0;
        while r < r1 {
            let nr = (r1 - r).min(3);
            match (mr, nr) {
                (1, 3) => run::<1, 3>(x, t, cols, buf, r0, r, rows, out),
                (2, 3) => run::<2, 3>(x, t, cols, buf, r0, r, rows, out),
                (3, 3) => run::<3, 3>(x, t, cols, buf, r0, r, rows, out),
                (4, 3) => run::<4, 3>(x, t, cols, buf, r0, r, rows, out),
                (1, _) => run::<1, 1>(x, t, cols, buf, r0, r, rows, out),
                (2, _) => run::<2, 1>(x, t, cols, buf, r0, r, rows, out),
                (3, _) => run::<3, 1>(x, t, cols, buf, r0, r, rows, out),
                _ => run::<4, 1>(x, t, cols, buf, r0, r, rows, out),
            }
            r += if nr == 3 { 3 } else { 1 };
        }
        t += mr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::fp8::{Fp8Scaling, e4m3_to_f32};
    use crate::tensor::{DType, Tensor};

    /// Against an f64 product of the dequantized weights, over shapes with
    /// partial blocks and several tiles, and one row alone equal to the same
    /// row in a batch.
    #[test]
    fn matmul_matches_f64_reference_and_is_batch_invariant() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for (rows, cols, bm, bn) in [(5usize, 7usize, 2usize, 3usize), (300, 200, 128, 128), (64, 96, 32, 32)] {
            let q: Vec<u8> = (0..rows * cols).map(|_| (next() as u8) & 0xF7).collect();
            let (sr, sc) = (rows.div_ceil(bm), cols.div_ceil(bn));
            let s: Vec<f32> = (0..sr * sc).map(|_| 0.001 * (1 + next() % 100) as f32).collect();
            let weight = Tensor::new("w".into(), DType::F8_E4M3, vec![rows, cols], Bytes::from_vec(q.clone())).unwrap();
            let scale = Tensor::from_f32("s", vec![sr, sc], &s).unwrap();
            let t = Fp8Tensor::from_stored(weight, scale, Fp8Scaling::Block { rows: bm, cols: bn }).unwrap();
            let m = Fp8Matrix::from_tensor(&t).unwrap();
            let n = 5;
            let x: Vec<f32> = (0..n * cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
            let mut out = vec![0f32; n * rows];
            matmul(&x, n, &m, &mut out);
            for i in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols)
                        .map(|c| {
                            let w = e4m3_to_f32(q[r * cols + c]) * s[(r / bm) * sc + c / bn];
                            x[i * cols + c] as f64 * w as f64
                        })
                        .sum();
                    let got = out[i * rows + r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "({rows}x{cols}) [{i},{r}]: {got} vs {want}"
                    );
                }
            }
            let mut one = vec![0f32; rows];
            matmul(&x[2 * cols..3 * cols], 1, &m, &mut one);
            assert_eq!(one, out[2 * rows..3 * rows]);
        }
    }
}
