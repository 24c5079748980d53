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
        #[cfg(target_arch = "x86_64")]
        if super::simd::has_avx2() && self.group.is_multiple_of(8) {
            // SAFETY: avx2 and f16c are present; `q` and `out` hold `cols`
            // values and `scales` one per `group` of them.
            return unsafe { decode_row_avx2(q, scales, self.group, out) };
        }
        for ((o, q), s) in out.chunks_mut(self.group).zip(q.chunks(self.group)).zip(scales) {
            for (o, &b) in o.iter_mut().zip(q) {
                *o = E4M3_TABLE[b as usize] * s;
            }
        }
    }
}

/// Eight E4M3 bytes at `p` times `scale`: each byte's sign, exponent and
/// mantissa moved into an f16's fields give its value times 2^-8 exactly
/// (E4M3's exponent bias is 7, f16's 15; subnormals included), widened by
/// F16C and multiplied by scale·2^8: the same f32 product as the table.
///
/// # Safety
/// avx2 and f16c are present; 8 bytes are readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn decode8(p: *const u8, scale: f32) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    let b = _mm_cvtepu8_epi16(unsafe { _mm_loadl_epi64(p.cast()) });
    let sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    let mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, mag)), _mm256_set1_ps(scale * 256.0))
}

/// [`Fp8Matrix::decode_row`] 8 values a step: a byte's sign, exponent and
/// mantissa moved into an f16's fields give its value times 2^-8 exactly
/// (E4M3's exponent bias is 7, f16's 15; subnormals included), widened by
/// F16C and multiplied by scale·2^8: the same f32 product as the table.
///
/// # Safety
/// avx2 and f16c are present; `q` and `out` have the same length, `group` is a
/// multiple of 8 and `scales` holds one scale per `group` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode_row_avx2(q: &[u8], scales: &[f32], group: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = q.len();
    let mut c = 0;
    while c + 8 <= n {
        // SAFETY: c + 8 ≤ n for both slices.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr().add(c), decode8(q.as_ptr().add(c), scales[c / group]));
        }
        c += 8;
    }
    for i in c..n {
        out[i] = E4M3_TABLE[q[i] as usize] * scales[i / group];
    }
}

/// Rows `r..r + NR` against one activation row, each decoded 8 values at a
/// time in registers as [`decode_row_avx2`] decodes them and summed in
/// `simd::float_tile`'s order (8 lanes, then the halves, then the tail), so
/// the result equals the decoded-tile path bit for bit.
///
/// # Safety
/// avx2, fma and f16c are present; rows `r..r + NR` exist; `x` holds `cols`
/// values; `w.group` is a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_dot_avx2<const NR: usize>(w: &Fp8Matrix, r: usize, x: &[f32]) -> [f32; NR] {
    use std::arch::x86_64::*;
    let (cols, groups, group) = (w.cols, w.groups(), w.group);
    let bytes = w.weight.as_slice();
    let q: [&[u8]; NR] = std::array::from_fn(|j| &bytes[(r + j) * cols..(r + j + 1) * cols]);
    let s: [&[f32]; NR] = std::array::from_fn(|j| &w.scales[(r + j) * groups..(r + j + 1) * groups]);
    let mut acc = [_mm256_setzero_ps(); NR];
    let mut c = 0;
    while c + 8 <= cols {
        // SAFETY: c + 8 <= cols for x and every row.
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(c));
            for j in 0..NR {
                acc[j] = _mm256_fmadd_ps(xv, decode8(q[j].as_ptr().add(c), s[j][c / group]), acc[j]);
            }
        }
        c += 8;
    }
    let mut out = [0f32; NR];
    for j in 0..NR {
        let v = acc[j];
        let s4 = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let mut sum = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
        for k in c..cols {
            sum += x[k] * (E4M3_TABLE[q[j][k] as usize] * s[j][k / group]);
        }
        out[j] = sum;
    }
    out
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
    #[cfg(target_arch = "x86_64")]
    if n == 1 && w.group.is_multiple_of(8) && super::simd::has_avx2() {
        // Decode: rows decoded in registers and dotted at once (one read of
        // the bytes), in the same order as the tiles below.
        let per = w.rows.div_ceil(threads * 8).next_multiple_of(4).max(4);
        (0..w.rows.div_ceil(per)).into_par_iter().for_each(|tile| {
            let (r0, r1) = (tile * per, ((tile + 1) * per).min(w.rows));
            let mut r = r0;
            while r < r1 {
                let take = if r + 4 <= r1 { 4 } else { 1 };
                // SAFETY: avx2, fma and f16c are present; rows r..r + take
                // exist; x holds `cols` values; group is a multiple of 8.
                let v: [f32; 4] = unsafe {
                    if take == 4 {
                        decode_dot_avx2::<4>(w, r, x)
                    } else {
                        let [a] = decode_dot_avx2::<1>(w, r, x);
                        [a, 0.0, 0.0, 0.0]
                    }
                };
                for (j, vj) in v.iter().take(take).enumerate() {
                    // SAFETY: row r + j is this task's and in bounds.
                    unsafe { *optr.get().add(r + j) = *vj };
                }
                r += take;
            }
        });
        return;
    }
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

    /// The vector decoder gives the table's value times the scale for every
    /// byte but the two NaNs, bit for bit.
    #[test]
    fn decode_row_equals_the_table() {
        let bytes: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
        // 240 of the 254 finite bytes in groups of 48 (the vector path needs
        // groups of a multiple of 8), then the other 14 in a row of their own.
        let cols = 240;
        let q = bytes[..cols].to_vec();
        let scales = [0.37f32, 1.0, 3.0e-3, 250.0, 1.5e-7];
        let group = cols / scales.len();
        assert_eq!(group % 8, 0);
        let m = Fp8Matrix { rows: 1, cols, group, weight: Bytes::from_vec(q.clone()), scales: scales.to_vec() };
        let mut out = vec![0f32; cols];
        m.decode_row(0, &mut out);
        for (c, (&o, &b)) in out.iter().zip(&q).enumerate() {
            assert_eq!(o.to_bits(), (e4m3_to_f32(b) * scales[c / group]).to_bits(), "byte {b:#x}");
        }
        let rest = bytes[cols..].to_vec();
        let m = Fp8Matrix {
            rows: 1,
            cols: 16,
            group: 8,
            weight: Bytes::from_vec([rest.clone(), vec![0x38, 0xB8]].concat()),
            scales: vec![0.5, 2.0],
        };
        let mut out = vec![0f32; 16];
        m.decode_row(0, &mut out);
        for (c, (&o, &b)) in out.iter().zip(rest.iter().chain(&[0x38, 0xB8])).enumerate() {
            assert_eq!(o.to_bits(), (e4m3_to_f32(b) * m.scales[c / 8]).to_bits(), "byte {b:#x}");
        }
    }

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
