//! Activations quantized to Q8_K (256 values, f32 scale, sums of 16-value
//! groups) and their integer dot products with K-quant weights, as llama.cpp
//! multiplies Q2_K…Q6_K (`quantize_row_q8_K_ref`, `ggml_vec_dot_q*_K_q8_K`).
//!
//! Per super-block the products are summed exactly in i32 and scaled once:
//! `d_w·d_x·Σ sc·Σ q·x − dmin_w·d_x·Σ m·bsum`. ggml sums the same integers;
//! only the order of the few float additions across blocks differs.

use crate::quant::kquants::{self, QK_K};
use crate::tensor::DType;

pub use super::act_blocks::Q8KBlock;

/// Quantizes `x` (length a multiple of 256) as ggml's `quantize_row_q8_K_ref`:
/// the value of largest magnitude maps to −127, rounding half to even.
pub fn quantize_row(x: &[f32], out: &mut [Q8KBlock]) {
    assert_eq!(x.len(), out.len() * QK_K, "q8k::quantize_row: {} values for {} blocks", x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: avx2 and fma are present (checked above).
        return unsafe { quantize_row_avx2(x, out) };
    }
    quantize_blocks(x, out)
}

/// [`quantize_blocks`] compiled with AVX2, where rounding half to even is one
/// instruction (without SSE4.1 it is a libm call per value) and the loops vectorize.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [Q8KBlock]) {
    quantize_blocks(x, out)
}

#[inline(always)]
fn quantize_blocks(x: &[f32], out: &mut [Q8KBlock]) {
    for (chunk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        // The first value of largest magnitude (NaN never compares larger).
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            *o = Q8KBlock::ZERO;
            continue;
        }
        let max = *chunk.iter().find(|v| v.abs() == amax).expect("amax is one of the values");
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(chunk) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, g) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
        o.d = 1.0 / iscale;
    }
}

/// Σ over super-blocks of weight row `w` (a K-quant `dtype`) times activations `x`.
/// The AVX2 kernels return [`dot_scalar`]'s value bit for bit.
pub fn dot(dtype: DType, w: &[u8], x: &[Q8KBlock]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * dtype.block_bytes());
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        use super::q8k_avx2 as k;
        // SAFETY: avx2, fma and f16c are present (checked above); the kernels
        // read whole blocks only, as `dtype`'s block size splits `w`.
        unsafe {
            match dtype {
                DType::Q2_K => return k::dot_q2_k(w, x),
                DType::Q3_K => return k::dot_q3_k(w, x),
                DType::Q4_K => return k::dot_q4_k(w, x),
                DType::Q5_K => return k::dot_q5_k(w, x),
                DType::Q6_K => return k::dot_q6_k(w, x),
                _ => {}
            }
        }
    }
    dot_scalar(dtype, w, x)
}

/// [`dot`] of one weight row with `R` activation rows, equal to it bit for
/// bit; the row is read once for all of them where a multi-row kernel
/// exists (Q4_K and Q6_K on AVX2).
pub fn dot_rows<const R: usize>(dtype: DType, w: &[u8], x: [&[Q8KBlock]; R]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        use super::q8k_avx2 as k;
        // SAFETY: avx2, fma and f16c are present (checked above); the kernels
        // read the whole blocks that `w` and every row hold.
        unsafe {
            match dtype {
                DType::Q4_K => return k::dot_q4_k_rows(w, x),
                DType::Q6_K => return k::dot_q6_k_rows(w, x),
                _ => {}
            }
        }
    }
    x.map(|xr| dot(dtype, w, xr))
}

/// The reference: each super-block unpacked to integers, then summed exactly
/// in i32 (and the fallback without AVX2).
pub fn dot_scalar(dtype: DType, w: &[u8], x: &[Q8KBlock]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * dtype.block_bytes());
    let mut acc = 0f32;
    for (b, y) in w.chunks_exact(dtype.block_bytes()).zip(x) {
        let u = kquants::unpack(dtype, b);
        let mut isum = 0i32;
        let mut msum = 0i32;
        for g in 0..16 {
            let qw = &u.q[g * 16..(g + 1) * 16];
            let qx = &y.qs[g * 16..(g + 1) * 16];
            let s: i32 = qw.iter().zip(qx).map(|(&a, &b)| a as i32 * b as i32).sum();
            isum += u.scales[g] * s;
            msum += u.mins[g] * y.bsums[g] as i32;
        }
        acc += u.d * y.d * isum as f32 - u.dmin * y.d * msum as f32;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::ggml::dequantize_into;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *seed >> 33
    }

    /// Random super-blocks with small finite f16 scales.
    pub(crate) fn random_blocks(seed: &mut u64, dtype: DType, blocks: usize) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut w: Vec<u8> = (0..blocks * bb).map(|_| lcg(seed) as u8).collect();
        for blk in w.chunks_exact_mut(bb) {
            for &off in kquants::f16_field_offsets(dtype) {
                let v = half::f16::from_f32((lcg(seed) % 1000) as f32 / 1000.0 * 0.02 + 0.001);
                blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    #[test]
    fn integer_dot_matches_dequantized_dot() {
        let mut seed = 11;
        for dtype in [DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K] {
            let n = 3 * QK_K;
            let w = random_blocks(&mut seed, dtype, 3);
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let mut xq = vec![Q8KBlock::ZERO; 3];
            quantize_row(&x, &mut xq);
            let mut wf = vec![0f32; n];
            dequantize_into(dtype, &w, &mut wf);
            let xf: Vec<f32> = xq.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect();
            let want: f64 = wf.iter().zip(&xf).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f64 = wf.iter().zip(&xf).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let got = dot(dtype, &w, &xq) as f64;
            assert!((got - want).abs() <= 1e-5 * scale, "{dtype:?}: {got} vs {want}");
        }
    }

    /// ggml's `quantize_row_q8_K_ref` loop as written there: the first value
    /// of largest magnitude by a strict comparison.
    fn quantize_ref(x: &[f32]) -> Q8KBlock {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            return Q8KBlock::ZERO;
        }
        let iscale = -127.0 / max;
        let mut o = Q8KBlock::ZERO;
        for (q, &v) in o.qs.iter_mut().zip(x) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, g) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
        o.d = 1.0 / iscale;
        o
    }

    /// The vectorized quantization equals the reference loop: ties (values on
    /// exact halves), repeated maxima of both signs, zero blocks.
    #[test]
    fn quantization_equals_the_reference_loop() {
        let mut seed = 7u64;
        let mut x = Vec::new();
        for k in 0..24 {
            for i in 0..QK_K {
                let u = (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0;
                x.push(match k % 4 {
                    0 => u,
                    1 => ((lcg(&mut seed) % 255) as f32 - 127.0) + 0.5 * (i % 2) as f32,
                    2 if i % 50 == 3 => {
                        if i % 100 == 3 {
                            -2.0
                        } else {
                            2.0
                        }
                    }
                    2 => u,
                    _ => 0.0,
                });
            }
        }
        let mut got = vec![Q8KBlock::ZERO; x.len() / QK_K];
        quantize_row(&x, &mut got);
        for (b, (g, chunk)) in got.iter().zip(x.chunks_exact(QK_K)).enumerate() {
            let want = quantize_ref(chunk);
            assert_eq!(g.qs, want.qs, "block {b}");
            assert_eq!(g.bsums, want.bsums, "block {b}");
            assert_eq!(g.d.to_bits(), want.d.to_bits(), "block {b}");
        }
    }

    #[test]
    fn quantization_maps_largest_magnitude_to_minus_127() {
        let mut x: Vec<f32> = (0..QK_K).map(|i| (i as f32 * 0.37).sin()).collect();
        x[5] = -3.0;
        let mut q = [Q8KBlock::ZERO];
        quantize_row(&x, &mut q);
        assert_eq!(q[0].qs[5], -127);
        assert_eq!(q[0].d, 1.0 / (127.0 / 3.0));
        assert_eq!(q[0].bsums[0], q[0].qs[..16].iter().map(|&v| v as i16).sum::<i16>());
        for (qv, xv) in q[0].qs.iter().zip(&x) {
            assert!((*qv as f32 * q[0].d - xv).abs() <= 0.51 * q[0].d.abs());
        }
    }
}
