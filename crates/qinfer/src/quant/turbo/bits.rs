//! Codes of `b` bits (1 to 8) packed least-significant bit first: code `i`
//! occupies bits `[i·b, (i+1)·b)` of the little-endian byte string, so every
//! 8 codes fill exactly `b` bytes (the 3-bit case packs 8 codes in 3 bytes).

/// Packs `codes` (each below `2^bits`; a multiple of 8 of them) into `out`
/// (`codes.len()·bits/8` bytes).
pub fn pack(codes: &[u8], bits: u32, out: &mut [u8]) {
    let b = bits as usize;
    debug_assert_eq!(out.len(), codes.len() * b / 8);
    for (eight, bytes) in codes.chunks_exact(8).zip(out.chunks_exact_mut(b)) {
        let mut word = 0u64;
        for (i, &c) in eight.iter().enumerate() {
            word |= (c as u64) << (i * b);
        }
        bytes.copy_from_slice(&word.to_le_bytes()[..b]);
    }
}

/// Calls `f(i, code)` for every code packed in `bytes`, in order.
#[inline(always)]
pub fn for_each(bytes: &[u8], bits: u32, mut f: impl FnMut(usize, usize)) {
    let b = bits as usize;
    let mask = (1u64 << b) - 1;
    for (g, chunk) in bytes.chunks_exact(b).enumerate() {
        let mut word = [0u8; 8];
        word[..b].copy_from_slice(chunk);
        let word = u64::from_le_bytes(word);
        for i in 0..8 {
            f(g * 8 + i, (word >> (i * b) & mask) as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_at_every_width() {
        for bits in 1..=8u32 {
            let codes: Vec<u8> = (0..64u32).map(|i| ((i * 37 + 11) % (1 << bits)) as u8).collect();
            let mut packed = vec![0u8; 64 * bits as usize / 8];
            pack(&codes, bits, &mut packed);
            let mut back = vec![0u8; 64];
            for_each(&packed, bits, |i, c| back[i] = c as u8);
            assert_eq!(back, codes, "{bits} bits");
        }
        // Three bits: codes 0..8 fill 3 bytes as 0b…_010_001_000.
        let mut packed = [0u8; 3];
        pack(&[0, 1, 2, 3, 4, 5, 6, 7], 3, &mut packed);
        assert_eq!(u32::from_le_bytes([packed[0], packed[1], packed[2], 0]), 0o76543210);
    }
}
