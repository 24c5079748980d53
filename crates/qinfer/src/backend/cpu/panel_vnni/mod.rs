//! Matmuls of several activation rows (prompts, batched steps) with ggml
//! block weights on AVX-512 VNNI, in panels of 16 weight rows.
//!
//! A panel is 16 weight rows unpacked once into unsigned byte levels and
//! interleaved by 4-value chunks: chunk `k` of the 16 rows fills one 512-bit
//! register, so a single `vpdpbusd` against chunk `k` of an activation row
//! (4 signed bytes, broadcast) adds 4 products to each of the 16 rows' sums.
//! Each lane thus holds one weight row's exact i32 sum over a block (or a
//! K-quant scale group) with no horizontal reduction, and the panel is
//! unpacked once for all the activation rows of the call.
//!
//! Level offsets (Q5_0's −16, Q6_K's −32, Q3_K's −4) are taken out as integers
//! (`off·Σx`), K-quant scales multiply the group sums in i32 and the mins term
//! is a `vpdpwssd` of the mins with the activations' 16-value sums. So every
//! block yields exactly the integers of the scalar reference
//! ([`super::q8::dot`], [`super::q8k::dot_scalar`]), and the float step is the
//! scalar's expression in its order, lane by lane (no fused multiply-add): the
//! outputs equal the scalar dots bit for bit, as the AVX2 kernels of these
//! types do. Q4_0, Q4_1 and Q8_0 instead follow ggml's float order, as their
//! AVX2 kernels do (see `q8_avx2`): each 4-value chunk's exact sum is one of
//! 8 float lanes, so their outputs equal those kernels' bit for bit.

#![cfg(target_arch = "x86_64")]

mod b32;
mod kquant;
mod panel;

pub(super) use b32::matmul_b32;
pub(super) use kquant::matmul_k;
pub(super) use panel::available;

#[cfg(test)]
mod tests {
    use super::super::act_blocks::{Q8Block, Q8KBlock};
    use super::super::out_ptr::OutPtr;
    use super::super::test_rng::{avx512_vnni_or_skip, finite_f16, fresh_seed, next};
    use super::super::{q8, q8k};
    use super::b32::ggml_order;
    use super::*;
    use crate::quant::kquants::{QK_K, f16_field_offsets};
    use crate::tensor::DType;

    /// Random level and scale bytes with random finite f16 fields, or every
    /// byte `fill` (saturated levels) with f16 fields of 0.5.
    fn weights(seed: &mut u64, dtype: DType, rows: usize, blocks: usize, fill: Option<u8>) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut w: Vec<u8> = (0..rows * blocks * bb).map(|_| fill.unwrap_or(next(seed) as u8)).collect();
        let f16_at: &[usize] = match dtype {
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
            DType::Q4_1 | DType::Q5_1 => &[0, 2],
            _ => f16_field_offsets(dtype),
        };
        for blk in w.chunks_exact_mut(bb) {
            for &off in f16_at {
                let v = if fill.is_some() { half::f16::from_f32(0.5) } else { finite_f16(seed) };
                blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    /// Activation rows of mixed magnitudes: a zero row part, ±1 only (every
    /// value quantizing to ±127), tiny and large values.
    fn activations(seed: &mut u64, n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols)
            .map(|i| {
                let u = (next(seed) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                match (i / 32) % 6 {
                    1 => 0.0,
                    3 => u.signum(),
                    4 => u * 1e-3,
                    5 => u * 40.0,
                    _ => u,
                }
            })
            .collect()
    }

    /// Every output of the panel matmul equals the bits of the scalar
    /// reference dot, or for the types whose AVX2 kernels follow ggml's float
    /// order (Q4_0, Q4_1, Q8_0) those kernels' bits.
    fn check(dtype: DType, rows: usize, cols: usize, n: usize, seed: &mut u64, fill: Option<u8>, start: u64) {
        let w = weights(seed, dtype, rows, cols / dtype.block_len(), fill);
        let x = activations(seed, n, cols);
        let rb = w.len() / rows;
        let mut out = vec![f32::NAN; n * rows];
        let optr = OutPtr::new(&mut out);
        if dtype.is_k_quant() {
            let blocks = cols / QK_K;
            let mut xq = vec![Q8KBlock::ZERO; n * blocks];
            for (q, row) in xq.chunks_mut(blocks).zip(x.chunks(cols)) {
                q8k::quantize_row(row, q);
            }
            matmul_k(dtype, &w, rows, blocks, &xq, n, optr);
            for t in 0..n {
                for r in 0..rows {
                    let want = q8k::dot_scalar(dtype, &w[r * rb..(r + 1) * rb], &xq[t * blocks..(t + 1) * blocks]);
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{dtype:?} {rows}x{cols} n {n} ({t},{r}): {got} vs {want}, seed {start}"
                    );
                }
            }
        } else {
            let blocks = cols / 32;
            let mut xq = vec![Q8Block::ZERO; n * blocks];
            for (q, row) in xq.chunks_mut(blocks).zip(x.chunks(cols)) {
                q8::quantize_row_scalar(row, q);
            }
            matmul_b32(dtype, &w, rows, blocks, &xq, n, optr);
            for t in 0..n {
                for r in 0..rows {
                    let (wr, xr) = (&w[r * rb..(r + 1) * rb], &xq[t * blocks..(t + 1) * blocks]);
                    // Q4_0, Q4_1 and Q8_0 follow the AVX2 kernels' (ggml's) order, the rest the scalar dot's.
                    let want = if ggml_order(dtype) {
                        q8::dot_tile::<1, 1>(dtype, [wr], [xr])[0][0]
                    } else {
                        q8::dot(dtype, wr, xr)
                    };
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{dtype:?} {rows}x{cols} n {n} ({t},{r}): {got} vs {want}, seed {start}"
                    );
                }
            }
        }
    }

    const TYPES: [DType; 7] =
        [DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K];

    /// Partial panels (rows not a multiple of 16), every remainder of the
    /// 4-row activation groups, one and several blocks.
    #[test]
    fn random_panels_match_scalar_bit_for_bit() {
        if !avx512_vnni_or_skip() {
            return;
        }
        let mut seed = fresh_seed("panel_vnni");
        let start = seed;
        for dtype in TYPES {
            let unit = dtype.block_len().max(256);
            for (rows, cols, n) in [(37, unit, 7), (16, 2 * unit, 4), (5, 3 * unit, 6), (48, unit, 1)] {
                check(dtype, rows, cols, n, &mut seed, None, start);
            }
        }
    }

    /// Saturated levels and scales against ±127 activations: the largest
    /// integer sums the kernels form.
    #[test]
    fn extreme_panels_match_scalar_bit_for_bit() {
        if !avx512_vnni_or_skip() {
            return;
        }
        let mut seed = 1;
        for dtype in TYPES {
            for byte in [0x00u8, 0xff, 0x80, 0x7f, 0x55, 0xaa] {
                check(dtype, 19, 512, 5, &mut seed, Some(byte), 0);
            }
        }
    }
}
