//! The FP8 E4M3 ("fn") number format: no infinities, one NaN pattern per
//! sign, largest finite value ±448. Decoding by table, encoding as torch
//! rounds.

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an E4M3 byte (0x7F and 0xFF are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// Every byte's value, for decoding by table.
pub static E4M3_TABLE: [f32; 256] = build_table();

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let b = i as u32;
        let exp = (b >> 3) & 0xF;
        let man = b & 0x7;
        let mag = if exp == 0xF && man == 0x7 {
            f32::NAN
        } else if exp == 0 {
            // Subnormal: man/8 · 2^-6 = man · 2^-9.
            man as f32 / 512.0
        } else {
            // (1 + man/8) · 2^(exp − 7), built from its f32 bits: exact.
            f32::from_bits(((exp + 127 - 7) << 23) | (man << 20))
        };
        t[i] = if b & 0x80 != 0 { -mag } else { mag };
        i += 1;
    }
    t
}

/// `x` rounded to the nearest E4M3 value, ties to even, as torch's
/// `.to(torch.float8_e4m3fn)` does: magnitudes past 464 (which would round
/// up to 480) become NaN, since the format has no infinity; quantizers clamp
/// to ±448 first.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() || a > 464.0 {
        return sign | 0x7F;
    }
    if a < 1.0 / 64.0 {
        // Subnormals step by 2^-9; 8 steps is the smallest normal (0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let mut exp = ((bits >> 23) as i32) - 127;
    let mant = bits & 0x7F_FFFF;
    let (top, rest) = (mant >> 20, mant & 0xF_FFFF);
    let half = 0x8_0000;
    let mut m = top + u32::from(rest > half || (rest == half && top & 1 == 1));
    if m == 8 {
        m = 0;
        exp += 1;
    }
    sign | (((exp + 7) as u8) << 3) | m as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_the_e4m3fn_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    /// Rounding against an exhaustive nearest-value search over the finite
    /// bytes (ties to the even byte), on every byte's value, the midpoints
    /// between neighbours and points just off them.
    #[test]
    fn rounding_is_nearest_ties_to_even() {
        let finite: Vec<(u8, f32)> = (0u8..=0x7E).map(|b| (b, e4m3_to_f32(b))).collect();
        let nearest = |a: f32| -> u8 {
            let mut best = (f32::INFINITY, 0u8);
            for &(b, v) in &finite {
                let d = (v - a).abs();
                if d < best.0 || (d == best.0 && b & 1 == 0) {
                    best = (d, b);
                }
            }
            best.1
        };
        let mut probes = Vec::new();
        for w in finite.windows(2) {
            let (a, b) = (w[0].1, w[1].1);
            let mid = (a + b) / 2.0;
            probes.extend([a, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)]);
        }
        probes.extend([448.0, 460.0, 464.0]);
        for a in probes {
            for x in [a, -a] {
                let want = nearest(a) | if x.is_sign_negative() { 0x80 } else { 0 };
                assert_eq!(f32_to_e4m3(x), want, "{x}");
            }
        }
        assert_eq!(f32_to_e4m3(465.0), 0x7F);
        assert_eq!(f32_to_e4m3(-1000.0), 0xFF);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7F, 0x7F);
    }
}
