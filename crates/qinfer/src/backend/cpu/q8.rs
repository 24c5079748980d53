//! Activations quantized to 8 bits per 32-value block, and dot products of those
//! blocks with ggml block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in integer
//! arithmetic (the K-quants take 256-value Q8_K activations instead: `q8k`).
//!
//! This is how llama.cpp multiplies quantized weights (x is quantized to
//! `Q8_0`/`Q8_1` first), so GGUF models reproduce llama.cpp's numbers, and it
//! is the fast path: 8-bit products summed exactly in i32.

use crate::quant::kquants::f16_at;
use crate::tensor::DType;

pub use super::act_blocks::Q8Block;
use super::act_blocks::f16_round;

/// Quantizes `x` (length a multiple of 32) into `out` (one block per 32
/// values), as ggml's AVX2 `quantize_row_q8_1`: scale 127/amax, round half to even.
pub fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), out.len() * 32, "quantize_row: {} values for {} blocks", x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked above).
        return unsafe { super::q8_avx2::quantize_row(x, out) };
    }
    quantize_row_scalar(x, out)
}

/// The reference quantization (and the fallback without AVX2).
pub fn quantize_row_scalar(x: &[f32], out: &mut [Q8Block]) {
    for (chunk, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut qs = [0i8; 32];
        let mut sum = 0i32;
        for (q, v) in qs.iter_mut().zip(chunk) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        *o = Q8Block { d: f16_round(d), s: f16_round(d * sum as f32), qs };
    }
}

/// `out[i][j]` = [`dot`] of weight row `w[j]` with activation row `x[i]`: a
/// register tile, so each weight block is unpacked once for `MR` activation rows.
/// Every `x[i]` has the same number of blocks and every `w[j]` holds that many.
#[inline]
pub fn dot_tile<const MR: usize, const NR: usize>(
    dtype: DType,
    w: [&[u8]; NR],
    x: [&[Q8Block]; MR],
) -> [[f32; NR]; MR] {
    let blocks = x[0].len();
    assert!(x.iter().all(|r| r.len() == blocks), "dot_tile: activation rows differ in length");
    assert!(
        w.iter().all(|r| r.len() == blocks * dtype.block_bytes()),
        "dot_tile: weight rows do not match {blocks} blocks"
    );
    #[cfg(target_arch = "x86_64")]
    if MR == 1 && NR.is_multiple_of(2) && NR <= 4 && super::simd::has_avx512_vnni() {
        use super::q8_avx512 as k;
        let (wp, xp) = (w.map(|r| r.as_ptr()), x[0].as_ptr());
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are present (checked
        // above); every row holds `blocks` blocks (asserted above).
        let row = match dtype {
            DType::Q4_0 => Some(unsafe { k::rows_q4_0(wp, xp, blocks) }),
            DType::Q4_1 => Some(unsafe { k::rows_q4_1(wp, xp, blocks) }),
            DType::Q5_0 => Some(unsafe { k::rows_q5_0(wp, xp, blocks) }),
            DType::Q8_0 => Some(unsafe { k::rows_q8_0(wp, xp, blocks) }),
            _ => None,
        };
        if let Some(row) = row {
            return std::array::from_fn(|_| row);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        use super::q8_avx2 as k;
        let (wp, xp) = (w.map(|r| r.as_ptr()), x.map(|r| r.as_ptr()));
        // SAFETY: avx2, fma and f16c are present (checked above); every row
        // holds `blocks` blocks (asserted above).
        match dtype {
            DType::Q4_0 => return unsafe { k::tile_q4_0(wp, xp, blocks) },
            DType::Q4_1 => return unsafe { k::tile_q4_1(wp, xp, blocks) },
            DType::Q8_0 => return unsafe { k::tile_q8_0(wp, xp, blocks) },
            DType::Q5_0 => return unsafe { k::tile_q5_0(wp, xp, blocks) },
            DType::Q5_1 => return unsafe { k::tile_q5_1(wp, xp, blocks) },
            DType::F32
            | DType::F16
            | DType::BF16
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::U32
            | DType::F8_E4M3 => unreachable!("{} does not take Q8_0 activations", dtype.name()),
        }
    }
    let mut out = [[0f32; NR]; MR];
    for (o, xr) in out.iter_mut().zip(x) {
        for (v, wr) in o.iter_mut().zip(w) {
            *v = dot(dtype, wr, xr);
        }
    }
    out
}

/// Σ over blocks of weight row `w` (stored as `dtype`) times quantized activations `x`.
/// The scalar reference (and the fallback without AVX2).
pub fn dot(dtype: DType, w: &[u8], x: &[Q8Block]) -> f32 {
    match dtype {
        DType::Q4_0 => {
            let mut acc = 0f32;
            for (b, y) in w.chunks_exact(18).zip(x) {
                let qs = &b[2..18];
                let mut s = 0i32;
                for (j, q) in qs.iter().enumerate() {
                    s += ((q & 0x0f) as i32 - 8) * y.qs[j] as i32;
                    s += ((q >> 4) as i32 - 8) * y.qs[j + 16] as i32;
                }
                acc += f16_at(b, 0) * y.d * s as f32;
            }
            acc
        }
        DType::Q4_1 => {
            let mut acc = 0f32;
            let mut mins = 0f32;
            for (b, y) in w.chunks_exact(20).zip(x) {
                let qs = &b[4..20];
                let mut s = 0i32;
                for (j, q) in qs.iter().enumerate() {
                    s += (q & 0x0f) as i32 * y.qs[j] as i32;
                    s += (q >> 4) as i32 * y.qs[j + 16] as i32;
                }
                acc += f16_at(b, 0) * y.d * s as f32;
                mins += f16_at(b, 2) * y.s;
            }
            acc + mins
        }
        DType::Q5_0 | DType::Q5_1 => {
            // As ggml_vec_dot_q5_0_q8_0 / q5_1_q8_1: 5-bit values, the 5th bit from `qh`.
            let affine = dtype == DType::Q5_1;
            let (qh_at, qs_at) = if affine { (4, 8) } else { (2, 6) };
            let offset = if affine { 0 } else { 16 };
            let mut acc = 0f32;
            for (b, y) in w.chunks_exact(dtype.block_bytes()).zip(x) {
                let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                let mut s = 0i32;
                for j in 0..16 {
                    let q = b[qs_at + j];
                    let lo = ((q & 0x0f) as u32 | (((qh >> j) << 4) & 0x10)) as i32 - offset;
                    let hi = ((q >> 4) as u32 | ((qh >> (j + 12)) & 0x10)) as i32 - offset;
                    s += lo * y.qs[j] as i32 + hi * y.qs[j + 16] as i32;
                }
                let min = if affine { f16_at(b, 2) * y.s } else { 0.0 };
                acc += f16_at(b, 0) * y.d * s as f32 + min;
            }
            acc
        }
        DType::Q8_0 => {
            let mut acc = 0f32;
            for (b, y) in w.chunks_exact(34).zip(x) {
                let mut s = 0i32;
                for j in 0..32 {
                    s += (b[2 + j] as i8) as i32 * y.qs[j] as i32;
                }
                acc += f16_at(b, 0) * y.d * s as f32;
            }
            acc
        }
        DType::F32
        | DType::F16
        | DType::BF16
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::U32
        | DType::F8_E4M3 => {
            unreachable!("{} does not take Q8_0 activations", dtype.name())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::ggml::dequantize_into;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// The integer dot equals the dot of dequantized weights with dequantized
    /// activations, taken in f64, but for one deliberate difference: Q4_1's
    /// and Q5_1's min term uses the activation block's sum `s` rounded to f16
    /// (as llama.cpp's Q8_1), i.e. Σ_b m_b·(s_b − d_b·Σq_b) is added. What is
    /// left is f32 rounding: per block two products and two sums in the dot,
    /// one rounding of each dequantized weight, < 8·2⁻²⁴ ≈ 4.8e-7 of Σ|terms|
    /// (the bound, rounded up to 5e-7); measured at most 1.2e-8 of it.
    #[test]
    fn integer_dot_matches_dequantized_dot() {
        let mut seed = 7;
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0] {
            let n = 128;
            let two_scales = matches!(dtype, DType::Q4_1 | DType::Q5_1);
            let w: Vec<u8> = (0..dtype.bytes_for(n).unwrap())
                .map(|i| {
                    // Keep f16 scales finite and small: bytes 0..2 (and 2..4) of each block.
                    let off = i % dtype.block_bytes();
                    if off < 4 && (off < 2 || two_scales) {
                        [0x66, 0x2e, 0x00, 0xb0][off]
                    } else {
                        (lcg(&mut seed) * 127.0 + 128.0) as u8
                    }
                })
                .collect();
            let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 3.0).collect();
            let mut xq = vec![Q8Block::ZERO; n / 32];
            quantize_row(&x, &mut xq);
            let mut wf = vec![0f32; n];
            dequantize_into(dtype, &w, &mut wf);
            let xf: Vec<f32> = xq.iter().flat_map(|b| b.qs.iter().map(move |q| *q as f32 * b.d)).collect();
            let mut want: f64 = wf.iter().zip(&xf).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            let mut mag: f64 = wf.iter().zip(&xf).map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs()).sum();
            if two_scales {
                for (blk, y) in w.chunks_exact(dtype.block_bytes()).zip(&xq) {
                    let m = f64::from(f16_at(blk, 2));
                    let sum: i32 = y.qs.iter().map(|q| *q as i32).sum();
                    want += m * (f64::from(y.s) - f64::from(y.d) * f64::from(sum));
                    mag += (m * f64::from(y.s)).abs();
                }
            }
            let got = f64::from(dot(dtype, &w, &xq));
            eprintln!("{dtype:?}: |got − want| = {:.2e} of Σ|terms| {mag:.3}", (got - want).abs() / mag);
            assert!((got - want).abs() <= 5e-7 * mag, "{dtype:?}: {got} vs {want} (Σ|terms| {mag})");
        }
    }

    #[test]
    fn quantization_is_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let mut q = vec![Q8Block::ZERO; 2];
        quantize_row(&x, &mut q);
        for (b, chunk) in q.iter().zip(x.chunks(32)) {
            for (qv, xv) in b.qs.iter().zip(chunk) {
                assert!((*qv as f32 * b.d - xv).abs() <= 0.51 * b.d + 1e-3 * xv.abs());
            }
        }
    }
}
