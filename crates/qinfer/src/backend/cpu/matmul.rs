//! `out = x · Wᵀ` for f32 activations and weights kept in their stored type.
//!
//! Work is split over tiles of weight rows, and each tile meets every
//! activation row, so a prefill reads each weight once and decode (one row)
//! streams the weights exactly once with no resident f32 copy.
//! Float weights: a tile is widened into a thread-local f32 buffer small enough
//! for L2. Block-quantized weights: activations are quantized to 8-bit blocks
//! once per call and multiplied in integers (see `q8`), as llama.cpp does.

use std::cell::RefCell;

use rayon::prelude::*;

use super::q8::{self, Q8Block};
use super::quant::dequantize_into;
use super::simd::dot;
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

/// Raw pointer for disjoint parallel writes into one output buffer.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements (its own weight rows).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not field access) so closures capture the Send wrapper, not the raw pointer.
    fn get(self) -> *mut f32 {
        self.0
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
    if w.dtype.is_quantized() {
        return matmul_q8(x, n, w, out);
    }
    let rows_per_tile = (TILE_FLOATS / w.cols.max(1)).clamp(1, 64);
    // Enough tiles to keep every thread busy, but no smaller than needed.
    let threads = rayon::current_num_threads().max(1);
    let min_tiles = threads * 8;
    let rows_per_tile = rows_per_tile.min(w.rows.div_ceil(min_tiles)).max(1);
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let optr = OutPtr(out.as_mut_ptr());
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

/// Quantized weights: 8-bit activations, integer block dots.
fn matmul_q8(x: &[f32], n: usize, w: &CpuMatrix, out: &mut [f32]) {
    let cols = w.cols;
    let blocks = cols / 32;
    let xq: Vec<Q8Block> = x
        .par_chunks(cols)
        .flat_map_iter(|row| {
            let mut v = Vec::with_capacity(blocks);
            q8::quantize_row(row, &mut v);
            v
        })
        .collect();
    let threads = rayon::current_num_threads().max(1);
    let rows_per_tile = w.rows.div_ceil(threads * 8).clamp(1, 64);
    let n_tiles = w.rows.div_ceil(rows_per_tile);
    let rb = w.row_bytes();
    let bytes = w.data.as_slice();
    let optr = OutPtr(out.as_mut_ptr());
    (0..n_tiles).into_par_iter().for_each(|tile| {
        let r0 = tile * rows_per_tile;
        let r1 = (r0 + rows_per_tile).min(w.rows);
        for t in 0..n {
            let xr = &xq[t * blocks..(t + 1) * blocks];
            for r in r0..r1 {
                let v = q8::dot(w.dtype, &bytes[r * rb..(r + 1) * rb], xr);
                // SAFETY: (t, r) is written by this tile only; in bounds by the asserts in `matmul`.
                unsafe { *optr.get().add(t * w.rows + r) = v };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn bf16_matmul_matches_naive() {
        let (rows, cols, n) = (37, 70, 5);
        let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        let bytes: Vec<u8> = wf.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect();
        let w = CpuMatrix { dtype: DType::BF16, rows, cols, data: Bytes::from_vec(bytes) };
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
        let mut out = vec![f32::NAN; n * rows];
        matmul(&x, n, &w, &mut out);
        for t in 0..n {
            for r in 0..rows {
                let want: f32 = (0..cols).map(|c| x[t * cols + c] * bf16::from_f32(wf[r * cols + c]).to_f32()).sum();
                assert!((out[t * rows + r] - want).abs() < 1e-4, "({t},{r})");
            }
        }
    }
}
