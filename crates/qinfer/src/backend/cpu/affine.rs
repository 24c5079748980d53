//! Affine-quantized matrices on the CPU (MLX layout, see [`crate::quant::affine`]):
//! the packed words stay in the mapped file; only the per-group scales and
//! biases (1/16 to 1/64 of the values) are decoded to f32 at load.
//!
//! Weights are dequantized (w = s·q + b, as `mx.dequantize` and MLX's CPU
//! `quantized_matmul` do) before they meet the activations: in registers for
//! decode, into a per-tile buffer for prefill (read once per call, never a
//! resident copy). Not the shortcut `s·Σ x·q + b·Σ x` per group: with
//! b ≈ −s·2^(bits−1) the two terms are up to 2^(bits−1) times the result and
//! cancel, and their f32 rounding put the Qwen3.5 fixtures' logits 3–4× farther
//! from the float64 truth than mlx-lm (3.6e-4 against 8.6e-5; see tests/parity_mlx.rs).

use std::cell::RefCell;

use rayon::prelude::*;

use super::simd::dot;
use crate::quant::affine::{AffineParams, AffineTensor, unpack};
use crate::tensor::Bytes;
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct AffineMatrix {
    pub rows: usize,
    pub cols: usize,
    pub params: AffineParams,
    /// `rows × cols·bits/8` bytes of packed levels.
    pub packed: Bytes,
    /// `rows × cols/group_size` each.
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

impl AffineMatrix {
    pub fn from_tensor(t: &AffineTensor) -> Result<Self> {
        let &[rows, cols] = t.shape.as_slice() else {
            return Err(Error::tensor(&t.name, format!("expected a 2-D matrix, found shape {:?}", t.shape)));
        };
        Ok(AffineMatrix {
            rows,
            cols,
            params: t.params,
            packed: t.packed.data.clone(),
            scales: t.scales.to_f32_vec(),
            biases: t.biases.to_f32_vec(),
        })
    }

    fn groups(&self) -> usize {
        self.cols / self.params.group_size
    }

    fn row_bytes(&self) -> usize {
        self.params.row_bytes(self.cols)
    }

    /// Unpacks row `r`'s levels (not yet scaled) into `q` (len = cols).
    fn unpack_row(&self, r: usize, q: &mut [f32]) {
        let rb = self.row_bytes();
        unpack(self.params.bits, &self.packed.as_slice()[r * rb..(r + 1) * rb], q);
    }

    /// Decodes row `r` into `out` (len = cols): an embedding lookup.
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        self.unpack_row(r, out);
        let g = self.groups();
        let gs = self.params.group_size;
        for (j, chunk) in out.chunks_exact_mut(gs).enumerate() {
            let (s, b) = (self.scales[r * g + j], self.biases[r * g + j]);
            for v in chunk {
                *v = s * *v + b;
            }
        }
    }
}

thread_local! {
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Raw pointer for disjoint parallel writes into one output buffer.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements (its own weight rows).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// out[t, r] = Σ_c x[t, c] · W[r, c]; x is `[n, cols]`, out is `[n, rows]`.
pub fn matmul(x: &[f32], n: usize, w: &AffineMatrix, out: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "affine matmul: activation width {} != weight cols {}", x.len() / n.max(1), w.cols);
    assert_eq!(out.len(), n * w.rows);
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        return if n == 1 { gemv_avx2(x, w, out) } else { matmul_avx2(x, n, w, out) };
    }
    matmul_portable(x, n, w, out)
}

/// Splits `rows` into tiles for the threads and runs `tile(r0, r1)` on each,
/// on this thread alone when the whole product is too small to share.
fn for_row_tiles(rows: usize, rows_per_tile: usize, work: usize, tile: impl Fn(usize, usize) + Sync) {
    let n_tiles = rows.div_ceil(rows_per_tile);
    let run = |t: usize| tile(t * rows_per_tile, ((t + 1) * rows_per_tile).min(rows));
    if n_tiles == 1 || work < 1 << 14 {
        (0..n_tiles).for_each(run);
    } else {
        (0..n_tiles).into_par_iter().for_each(run);
    }
}

#[cfg(target_arch = "x86_64")]
impl AffineMatrix {
    fn row_ptrs(&self, r: usize) -> super::affine_avx2::AffineRow {
        let (rb, g) = (self.row_bytes(), self.groups());
        super::affine_avx2::AffineRow {
            packed: self.packed.as_slice()[r * rb..(r + 1) * rb].as_ptr(),
            scales: self.scales[r * g..(r + 1) * g].as_ptr(),
            biases: self.biases[r * g..(r + 1) * g].as_ptr(),
        }
    }
}

/// Decode: each weight row is dequantized in registers and meets the one
/// activation row; 2 rows at a time share each activation load.
#[cfg(target_arch = "x86_64")]
fn gemv_avx2(x: &[f32], w: &AffineMatrix, out: &mut [f32]) {
    use super::affine_avx2::dot_rows;
    const NR: usize = 2;
    let threads = rayon::current_num_threads().max(1);
    let rows_per_tile = w.rows.div_ceil(threads * 8).next_multiple_of(NR).clamp(NR, 256);
    let (bits, gs, cols) = (w.params.bits, w.params.group_size, w.cols);
    let optr = OutPtr(out.as_mut_ptr());
    for_row_tiles(w.rows, rows_per_tile, w.rows * cols, |r0, r1| {
        let mut r = r0;
        while r < r1 {
            let nr = if r + NR <= r1 { NR } else { 1 };
            let mut v = [0f32; NR];
            macro_rules! rows {
                ($bits:literal) => {
                    // SAFETY: avx2/fma present (checked in `matmul`); rows r..r+nr exist and hold
                    // `cols` values in whole groups; x holds `cols` floats.
                    unsafe {
                        if nr == NR {
                            v = dot_rows::<$bits, NR>(gs, std::array::from_fn(|j| w.row_ptrs(r + j)), x.as_ptr(), cols);
                        } else {
                            v[0] = dot_rows::<$bits, 1>(gs, [w.row_ptrs(r)], x.as_ptr(), cols)[0];
                        }
                    }
                };
            }
            match bits {
                2 => rows!(2),
                3 => rows!(3),
                4 => rows!(4),
                5 => rows!(5),
                6 => rows!(6),
                _ => rows!(8),
            }
            for (j, vj) in v[..nr].iter().enumerate() {
                // SAFETY: row r + j belongs to this tile only; in bounds (asserted in `matmul`).
                unsafe { *optr.get().add(r + j) = *vj };
            }
            r += nr;
        }
    });
}

thread_local! {
    static DEQUANTIZED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Bytes of dequantized f32 weights per prefill tile: it is reread for every
/// group of activation rows, so it should stay in L2.
#[cfg(target_arch = "x86_64")]
const PREFILL_TILE_BYTES: usize = 128 * 1024;

/// Prefill: a tile of rows is dequantized once into a thread-local f32 buffer
/// (never the whole matrix), then multiplied with every activation row by the
/// float register-tile kernel.
#[cfg(target_arch = "x86_64")]
fn matmul_avx2(x: &[f32], n: usize, w: &AffineMatrix, out: &mut [f32]) {
    use super::affine_avx2::dequantize_row;
    let (bits, gs, cols) = (w.params.bits, w.params.group_size, w.cols);
    let threads = rayon::current_num_threads().max(1);
    let fit = (PREFILL_TILE_BYTES / (4 * cols)).clamp(3, 96) / 3 * 3;
    let rows_per_tile = fit.min(w.rows.div_ceil(threads * 4).next_multiple_of(3));
    let optr = OutPtr(out.as_mut_ptr());
    for_row_tiles(w.rows, rows_per_tile, w.rows * cols * n, |r0, r1| {
        DEQUANTIZED.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.resize(rows_per_tile * cols, 0.0);
            for r in r0..r1 {
                let (row, dst) = (w.row_ptrs(r), buf[(r - r0) * cols..].as_mut_ptr());
                // SAFETY: avx2/fma present; row r holds `cols` values in whole
                // groups; the buffer has room for `cols` floats at this offset.
                unsafe {
                    match bits {
                        2 => dequantize_row::<2>(gs, row, cols, dst),
                        3 => dequantize_row::<3>(gs, row, cols, dst),
                        4 => dequantize_row::<4>(gs, row, cols, dst),
                        5 => dequantize_row::<5>(gs, row, cols, dst),
                        6 => dequantize_row::<6>(gs, row, cols, dst),
                        _ => dequantize_row::<8>(gs, row, cols, dst),
                    }
                }
            }
            let wrow = |r: usize| buf[(r - r0) * cols..].as_ptr().cast::<u8>();
            let mut t = 0;
            while t < n {
                let mut r = r0;
                while r < r1 {
                    // Full 4×3 register tiles where they fit, single rows/columns at the edges.
                    if n - t >= 4 && r1 - r >= 3 {
                        float_block::<4, 3>(optr, w.rows, cols, x, t, r, wrow);
                        r += 3;
                    } else {
                        for i in t..(t + 4).min(n) {
                            float_block::<1, 1>(optr, w.rows, cols, x, i, r, wrow);
                        }
                        r += 1;
                    }
                }
                t += (n - t).min(4);
            }
        });
    });
}

/// Activation rows `t..t+MR` against dequantized rows `r..r+NR` (`wrow(r)`
/// points at row r's `cols` f32 values), written to the output.
#[cfg(target_arch = "x86_64")]
fn float_block<const MR: usize, const NR: usize>(
    out: OutPtr,
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    r: usize,
    wrow: impl Fn(usize) -> *const u8,
) {
    use super::simd::{FloatWeights, float_tile};
    // SAFETY: avx2/fma/f16c present (checked in `matmul`); each weight pointer
    // holds `cols` f32 values and each activation row `cols` floats.
    let v = unsafe {
        float_tile::<MR, NR>(
            FloatWeights::F32,
            std::array::from_fn(|j| wrow(r + j)),
            std::array::from_fn(|i| x[(t + i) * cols..].as_ptr()),
            cols,
        )
    };
    for (i, vi) in v.iter().enumerate() {
        for (j, vij) in vi.iter().enumerate() {
            // SAFETY: (t + i, r + j) belongs to the caller's tile only; in bounds.
            unsafe { *out.get().add((t + i) * rows + r + j) = *vij };
        }
    }
}

/// Without AVX2: a row is dequantized into a thread-local buffer and dotted
/// with every activation row.
fn matmul_portable(x: &[f32], n: usize, w: &AffineMatrix, out: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    let rows_per_tile = w.rows.div_ceil(threads * 8).clamp(1, 64);
    let optr = OutPtr(out.as_mut_ptr());
    for_row_tiles(w.rows, rows_per_tile, w.rows * w.cols * n.max(1), |r0, r1| {
        ROW.with(|buf| {
            let mut row = buf.borrow_mut();
            row.resize(w.cols, 0.0);
            for r in r0..r1 {
                w.decode_row(r, &mut row);
                for t in 0..n {
                    let v = dot(&x[t * w.cols..(t + 1) * w.cols], &row);
                    // SAFETY: (t, r) is written by this tile only; in bounds by the asserts above.
                    unsafe { *optr.get().add(t * w.rows + r) = v };
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::affine::{SUPPORTED_BITS, pack};

    fn matrix(rows: usize, cols: usize, params: AffineParams) -> AffineMatrix {
        let levels = 1u32 << params.bits;
        let q: Vec<u8> = (0..rows * cols).map(|i| ((i * 7 + i / 5) as u32 % levels) as u8).collect();
        let mut packed = Vec::new();
        pack(params.bits, &q, &mut packed);
        let groups = rows * cols / params.group_size;
        AffineMatrix {
            rows,
            cols,
            params,
            packed: Bytes::from_vec(packed),
            scales: (0..groups).map(|i| 0.01 + (i % 7) as f32 * 0.003).collect(),
            biases: (0..groups).map(|i| -0.1 + (i % 5) as f32 * 0.02).collect(),
        }
    }

    /// Levels near the middle (small weights, b ≈ −s·2^(bits−1)) and activations
    /// with a common offset: the per-group split `s·Σx·q + b·Σx` cancels here
    /// (8 bits: 9.5e-6 of Σ|x·w| in an f32 emulation); dequantize-then-dot stays
    /// at the f32 rounding of the products (~1e-7).
    #[test]
    fn matmul_has_no_cancellation() {
        let (rows, cols, gs) = (16, 256, 64);
        for bits in [4u32, 8] {
            let mid = 1u32 << (bits - 1);
            let mut w = matrix(rows, cols, AffineParams { bits, group_size: gs });
            let q: Vec<u8> = (0..rows * cols).map(|i| (mid - 2 + (i * 7 + i / 5) as u32 % 5) as u8).collect();
            let mut packed = Vec::new();
            pack(bits, &q, &mut packed);
            w.packed = Bytes::from_vec(packed);
            let mid = mid as f32;
            w.scales.iter_mut().enumerate().for_each(|(i, s)| *s = 1e-3 * (1.0 + (i % 3) as f32 * 0.1));
            w.biases = w.scales.iter().enumerate().map(|(i, s)| -s * (mid - 0.37 + (i % 4) as f32 * 0.1)).collect();
            let x: Vec<f32> = (0..cols).map(|c| 1.0 + ((c * 29 % 17) as f32 - 8.0) * 0.01).collect();
            let mut out = vec![0f32; rows];
            matmul(&x, 1, &w, &mut out);
            let mut q = vec![0f32; cols];
            for (r, &got) in out.iter().enumerate() {
                w.unpack_row(r, &mut q);
                let (mut exact, mut mag) = (0f64, 0f64);
                for (c, (&xc, &qc)) in x.iter().zip(&q).enumerate() {
                    let j = r * w.groups() + c / gs;
                    let p = xc as f64 * (w.scales[j] as f64 * qc as f64 + w.biases[j] as f64);
                    exact += p;
                    mag += p.abs();
                }
                let err = (got as f64 - exact).abs();
                assert!(err <= 1e-6 * mag, "{bits} bits row {r}: {got} vs {exact} (Σ|x·w| {mag})");
            }
        }
    }

    #[test]
    fn matmul_matches_decoded_rows() {
        for bits in SUPPORTED_BITS {
            for (rows, cols, n, gs) in
                [(37, 128, 3, 32), (5, 64, 1, 64), (70, 256, 9, 128), (9, 96, 1, 16), (6, 160, 4, 16)]
            {
                let w = matrix(rows, cols, AffineParams { bits, group_size: gs });
                let x: Vec<f32> = (0..n * cols).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
                let mut out = vec![f32::NAN; n * rows];
                matmul(&x, n, &w, &mut out);
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    w.decode_row(r, &mut row);
                    for t in 0..n {
                        let want: f32 = (0..cols).map(|c| x[t * cols + c] * row[c]).sum();
                        let got = out[t * rows + r];
                        assert!((got - want).abs() < 1e-4, "{bits} bits {rows}x{cols} ({t},{r}): {got} vs {want}");
                    }
                }
            }
        }
    }
}
