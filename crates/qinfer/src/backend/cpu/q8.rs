//! Activations quantized to 8 bits per 32-value block, and dot products of those
//! blocks with ggml block weights (Q4_0, Q4_1, Q8_0) in integer arithmetic.
//!
//! This is how llama.cpp multiplies quantized weights (x is quantized to
//! `Q8_0`/`Q8_1` first), so GGUF models reproduce llama.cpp's numbers, and it
//! is the fast path: 8-bit products summed exactly in i32.

use half::f16;

use crate::tensor::DType;

/// One block of 32 activations: x ≈ d·q. `s` = d·Σq (needed by Q4_1's min term).
/// `d` and `s` are rounded through f16 as llama.cpp stores them.
#[derive(Debug, Clone, Copy)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

#[inline]
fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Quantizes `x` (length a multiple of 32) into `out`, as ggml's AVX2
/// `quantize_row_q8_1`: scale 127/amax, round half to even.
pub fn quantize_row(x: &[f32], out: &mut Vec<Q8Block>) {
    out.clear();
    for chunk in x.chunks_exact(32) {
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
        out.push(Q8Block { d: f16_round(d), s: f16_round(d * sum as f32), qs });
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Σ over blocks of weight row `w` (stored as `dtype`) times quantized activations `x`.
pub fn dot(dtype: DType, w: &[u8], x: &[Q8Block]) -> f32 {
    match dtype {
        DType::Q4_0 => {
            let mut acc = 0f32;
            for (b, y) in w.chunks_exact(18).zip(x) {
                let qs = &b[2..18];
                let mut s = 0i32;
                for j in 0..16 {
                    s += ((qs[j] & 0x0f) as i32 - 8) * y.qs[j] as i32;
                    s += ((qs[j] >> 4) as i32 - 8) * y.qs[j + 16] as i32;
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
                for j in 0..16 {
                    s += (qs[j] & 0x0f) as i32 * y.qs[j] as i32;
                    s += (qs[j] >> 4) as i32 * y.qs[j + 16] as i32;
                }
                acc += f16_at(b, 0) * y.d * s as f32;
                mins += f16_at(b, 2) * y.s;
            }
            acc + mins
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
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("float weights use the f32 path"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::quant::dequantize_into;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// The integer dot equals the f32 dot of dequantized weights with dequantized activations.
    #[test]
    fn integer_dot_matches_dequantized_dot() {
        let mut seed = 7;
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let n = 128;
            let w: Vec<u8> = (0..dtype.bytes_for(n).unwrap())
                .map(|i| {
                    // Keep f16 scales finite and small: bytes 0..2 (and 2..4) of each block.
                    let off = i % dtype.block_bytes();
                    if off < 4 && !(dtype == DType::Q8_0 && off >= 2) && !(dtype == DType::Q4_0 && off >= 2) {
                        [0x66, 0x2e, 0x00, 0xb0][off]
                    } else {
                        (lcg(&mut seed) * 127.0 + 128.0) as u8
                    }
                })
                .collect();
            let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 3.0).collect();
            let mut xq = Vec::new();
            quantize_row(&x, &mut xq);
            let mut wf = vec![0f32; n];
            dequantize_into(dtype, &w, &mut wf);
            let xf: Vec<f32> = xq.iter().flat_map(|b| b.qs.iter().map(move |q| *q as f32 * b.d)).collect();
            let want: f32 = wf.iter().zip(&xf).map(|(a, b)| a * b).sum();
            let got = dot(dtype, &w, &xq);
            // Q4_1's min term uses the f16-rounded block sum, hence the looser bound.
            assert!((got - want).abs() <= 2e-2 * (1.0 + want.abs()), "{dtype:?}: {got} vs {want}");
        }
    }

    #[test]
    fn quantization_is_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let mut q = Vec::new();
        quantize_row(&x, &mut q);
        for (b, chunk) in q.iter().zip(x.chunks(32)) {
            for (qv, xv) in b.qs.iter().zip(chunk) {
                assert!((*qv as f32 * b.d - xv).abs() <= 0.51 * b.d + 1e-3 * xv.abs());
            }
        }
    }
}
