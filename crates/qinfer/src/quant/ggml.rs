//! Decoding stored values to f32: plain floats, the ggml 32-value blocks
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (see `kquants`). Used per
//! row for embeddings and in whole for small tensors.

use half::f16;

use super::dtype::DType;
use super::kquants::f16_at;

/// Decodes `out.len()` values from `src` (which must hold exactly that many of `dtype`).
pub fn dequantize_into(dtype: DType, src: &[u8], out: &mut [f32]) {
    debug_assert_eq!(dtype.bytes_for(out.len()), Some(src.len()));
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        // The words as numbers (for `inspect`); weights go through `affine`.
        DType::U32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        // Unscaled values (for `inspect`); weights go through `fp8` with their scales.
        DType::F8_E4M3 => {
            for (o, &b) in out.iter_mut().zip(src) {
                *o = super::e4m3::e4m3_to_f32(b);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            // bf16 is the top half of an f32: widening is a shift.
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                for j in 0..16 {
                    o[j] = d * ((qs[j] & 0x0f) as i32 - 8) as f32;
                    o[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let qs = &b[4..20];
                for j in 0..16 {
                    o[j] = d * (qs[j] & 0x0f) as f32 + m;
                    o[j + 16] = d * (qs[j] >> 4) as f32 + m;
                }
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let bb = dtype.block_bytes();
            let (qh_at, qs_at) = if dtype == DType::Q5_1 { (4, 8) } else { (2, 6) };
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                let qs = &b[qs_at..qs_at + 16];
                for j in 0..16 {
                    let lo = (qs[j] & 0x0f) as u32 | (((qh >> j) << 4) & 0x10);
                    let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 12)) & 0x10);
                    if dtype == DType::Q5_1 {
                        let m = f16_at(b, 2);
                        o[j] = lo as f32 * d + m;
                        o[j + 16] = hi as f32 * d + m;
                    } else {
                        o[j] = (lo as i32 - 16) as f32 * d;
                        o[j + 16] = (hi as i32 - 16) as f32 * d;
                    }
                }
            }
        }
        DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            super::kquants::dequantize_k(dtype, src, out)
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = d * (b[2 + j] as i8) as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn q4_1_block_decodes_low_nibbles_first() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x3a; // value 0 = 0xa, value 16 = 0x3
        let mut out = [0f32; 32];
        dequantize_into(DType::Q4_1, &b, &mut out);
        assert_eq!(out[0], 0.5 * 10.0 - 1.0);
        assert_eq!(out[16], 0.5 * 3.0 - 1.0);
        assert_eq!(out[1], -1.0);
    }

    #[test]
    fn q4_0_and_q8_0_are_symmetric() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2] = 0x0f;
        let mut out = [0f32; 32];
        dequantize_into(DType::Q4_0, &b, &mut out);
        assert_eq!((out[0], out[16], out[1]), (14.0, -16.0, -16.0));
        let mut c = vec![0u8; 34];
        c[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        c[2] = (-4i8) as u8;
        dequantize_into(DType::Q8_0, &c, &mut out);
        assert_eq!((out[0], out[1]), (-1.0, 0.0));
    }

    #[test]
    fn bf16_widening_is_exact() {
        let v = bf16::from_f32(1.234375);
        let mut out = [0f32; 1];
        dequantize_into(DType::BF16, &v.to_le_bytes(), &mut out);
        assert_eq!(out[0], v.to_f32());
    }
}
