//! ggml's K-quant super-blocks (256 values): layouts, scale unpacking and
//! decoding to f32 in ggml's float order (`dequantize_row_q*_K` in
//! ggml-quants.c), so decoded values equal llama.cpp's and gguf-py's bit for bit.
//!
//! Every type is also unpacked to small integers plus per-16-value scales
//! ([`Unpacked`]): the integer dot with Q8_K activations (see `q8k`) and the
//! decoder both start from it, so the bit layouts live in one place.

use half::f16;

use super::dtype::DType;

pub const QK_K: usize = 256;

/// The little-endian f16 at byte `i` of a block, widened (exactly).
#[inline(always)]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// One super-block as integers: value `i` is
/// `d·scales[i/16]·q[i] − dmin·mins[i/16]`.
pub struct Unpacked {
    pub d: f32,
    pub dmin: f32,
    pub q: [i8; QK_K],
    pub scales: [i32; 16],
    /// Zero for the symmetric types (Q3_K, Q6_K).
    pub mins: [i32; 16],
}

impl Unpacked {
    const ZERO: Unpacked = Unpacked { d: 0.0, dmin: 0.0, q: [0; QK_K], scales: [0; 16], mins: [0; 16] };
}

/// The 6-bit scale and min of group `j` (0..8) of Q4_K/Q5_K (`get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The 16 6-bit scales of Q3_K, unbiased (−32..31).
pub fn q3_k_scales(s: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (j, o) in out.iter_mut().enumerate() {
        // Low 4 bits: nibble j%8 of bytes 0..8; high 2 bits: 2-bit field j/8 of bytes 8..12.
        let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i32 - 32;
    }
    out
}

/// Unpacks one super-block of a K-quant `dtype` (`b` holds exactly one block).
pub fn unpack(dtype: DType, b: &[u8]) -> Unpacked {
    let mut u = Unpacked::ZERO;
    match dtype {
        DType::Q2_K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            u.d = f16_at(b, 80);
            u.dmin = f16_at(b, 82);
            for (g, &s) in sc.iter().enumerate() {
                u.scales[g] = (s & 0x0f) as i32;
                u.mins[g] = (s >> 4) as i32;
            }
            for (i, q) in u.q.iter_mut().enumerate() {
                let (half, j, l) = (i / 128, (i / 32) % 4, i % 32);
                *q = ((qs[half * 32 + l] >> (2 * j)) & 3) as i8;
            }
        }
        DType::Q3_K => {
            let (hm, qs) = (&b[0..32], &b[32..96]);
            u.scales = q3_k_scales(&b[96..108]);
            u.d = f16_at(b, 108);
            for (i, q) in u.q.iter_mut().enumerate() {
                let (half, j, l) = (i / 128, (i / 32) % 4, i % 32);
                let low = ((qs[half * 32 + l] >> (2 * j)) & 3) as i8;
                let high_set = hm[l] & (1 << (4 * half + j)) != 0;
                *q = low - if high_set { 0 } else { 4 };
            }
        }
        DType::Q4_K | DType::Q5_K => {
            u.d = f16_at(b, 0);
            u.dmin = f16_at(b, 2);
            let sc = &b[4..16];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, sc);
                u.scales[2 * j] = s as i32;
                u.scales[2 * j + 1] = s as i32;
                u.mins[2 * j] = m as i32;
                u.mins[2 * j + 1] = m as i32;
            }
            let (qh, qs) = if dtype == DType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for (i, q) in u.q.iter_mut().enumerate() {
                // 64 values per 32 bytes: low nibbles, then high nibbles.
                let (pair, hi, l) = (i / 64, (i / 32) % 2, i % 32);
                let byte = qs[pair * 32 + l];
                let mut v = if hi == 0 { byte & 0x0f } else { byte >> 4 };
                if let Some(qh) = qh {
                    v |= ((qh[l] >> (2 * pair + hi)) & 1) << 4;
                }
                *q = v as i8;
            }
        }
        DType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            u.d = f16_at(b, 208);
            for (o, &s) in u.scales.iter_mut().zip(sc) {
                *o = s as i8 as i32;
            }
            for (i, q) in u.q.iter_mut().enumerate() {
                let (half, quarter, l) = (i / 128, (i / 32) % 4, i % 32);
                // Quarters 0, 1 take low nibbles of ql[l], ql[l+32]; 2, 3 the high ones.
                let byte = ql[half * 64 + (quarter % 2) * 32 + l];
                let low = if quarter < 2 { byte & 0x0f } else { byte >> 4 };
                let high = (qh[half * 32 + l] >> (2 * quarter)) & 3;
                *q = (low | (high << 4)) as i8 - 32;
            }
        }
        DType::F32
        | DType::F16
        | DType::BF16
        | DType::U32
        | DType::F8_E4M3
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q8_0 => {
            unreachable!("{} is not a K-quant", dtype.name())
        }
    }
    u
}

/// Decodes whole super-blocks of a K-quant `dtype` from `src` into `out`.
pub fn dequantize_k(dtype: DType, src: &[u8], out: &mut [f32]) {
    let bb = dtype.block_bytes();
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(bb)) {
        let u = unpack(dtype, b);
        for g in 0..16 {
            let vals = &u.q[g * 16..(g + 1) * 16];
            let dst = &mut o[g * 16..(g + 1) * 16];
            // The same products, in the same order, as ggml's decoder for each type.
            match dtype {
                DType::Q2_K | DType::Q4_K | DType::Q5_K => {
                    let dl = u.d * u.scales[g] as f32;
                    let ml = u.dmin * u.mins[g] as f32;
                    for (y, &q) in dst.iter_mut().zip(vals) {
                        *y = dl * q as f32 - ml;
                    }
                }
                DType::Q3_K | DType::Q6_K => {
                    let dl = u.d * u.scales[g] as f32;
                    for (y, &q) in dst.iter_mut().zip(vals) {
                        *y = dl * q as f32;
                    }
                }
                DType::F32
                | DType::F16
                | DType::BF16
                | DType::U32
                | DType::F8_E4M3
                | DType::Q4_0
                | DType::Q4_1
                | DType::Q5_0
                | DType::Q5_1
                | DType::Q8_0 => unreachable!("{} is not a K-quant", dtype.name()),
            }
        }
    }
}

/// Byte offsets of the f16 fields of one block of any quantized `dtype`
/// (scales and mins): random test and bench weights set these to finite values.
pub fn f16_field_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::U32 | DType::F8_E4M3 => &[],
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scales_unpack_as_ggml() {
        // Groups 0..4: low 6 bits of bytes 0..4 (scales) and 4..8 (mins);
        // groups 4..8: nibbles of bytes 8..12 plus the top 2 bits of bytes 0..8.
        let s = [0xc1u8, 2, 3, 4, 0x45, 6, 7, 8, 0x9a, 0, 0, 0];
        assert_eq!(scale_min_k4(0, &s), (1, 5));
        assert_eq!(scale_min_k4(4, &s), (0x0a | (3 << 4), 0x09 | (1 << 4)));
    }

    #[test]
    fn q3_k_scales_match_ggml_bit_shuffle() {
        // ggml's kmask version on u32 words, for comparison.
        let s: [u8; 12] = [0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x1b, 0x2c, 0x3d, 0x4e];
        let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
        let (k1, k2) = (0x03030303u32, 0x0f0f0f0fu32);
        let (a0, a1, tmp) = (w(0), w(1), w(2));
        let aux = [
            (a0 & k2) | ((tmp & k1) << 4),
            (a1 & k2) | (((tmp >> 2) & k1) << 4),
            ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
            ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
        ];
        let want: Vec<i32> = aux.iter().flat_map(|a| a.to_le_bytes()).map(|b| b as i8 as i32 - 32).collect();
        assert_eq!(q3_k_scales(&s).to_vec(), want);
    }
}
