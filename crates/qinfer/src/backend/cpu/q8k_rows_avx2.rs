//! AVX2 dots of one K-quant weight row with several Q8_K activation rows
//! (2–4: the rows a speculative verification or a small batch brings): each
//! super-block is loaded and unpacked once and multiplied with every row's
//! activations, where one-row dots would load and unpack it once per row.
//!
//! Each activation row goes through exactly the integer and float steps of
//! the one-row kernels in `q8k_avx2`, in the same order, so its result equals
//! theirs bit for bit: a sequence's tokens never depend on how many rows it
//! was computed with.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::act_blocks::Q8KBlock;
use super::q8k_avx2::{
    combine, f16_at, hsum_i32, k4_msum, k4_scale, k4_scales_mins, madd_scaled, prefetch_next_row, q8_32, scale_pair,
};

/// Super-blocks that `w` (blocks of `bytes`) and every row of `x` hold.
fn common_blocks<const R: usize>(w: &[u8], bytes: usize, x: &[&[Q8KBlock]; R]) -> usize {
    x.iter().map(|r| r.len()).fold(w.len() / bytes, usize::min)
}

/// [`super::q8k_avx2::dot_q4_k`] of `w` with each row of `x`.
///
/// # Safety
/// avx2, fma and f16c are present. Loads stay within the whole blocks that
/// `w` and every row of `x` hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_k_rows<const R: usize>(w: &[u8], x: [&[Q8KBlock]; R]) -> [f32; R] {
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = [0f32; R];
    for i in 0..common_blocks(w, 144, &x) {
        let b = &w[144 * i..144 * (i + 1)];
        let p = b.as_ptr();
        prefetch_next_row::<144>(p, w.len());
        // SAFETY: `b` is one 144-byte block: f16s at 0 and 2, scales at 4..16.
        let (d, dmin, sm) = unsafe { (f16_at(p), f16_at(p.add(2)), k4_scales_mins(p.add(4))) };
        let mut isum = [_mm256_setzero_si256(); R];
        for pair in 0..4 {
            // SAFETY: bytes 16 + 32·pair .. +32 lie in the block (pair < 4).
            let q = unsafe { _mm256_loadu_si256(p.add(16 + 32 * pair).cast()) };
            let lo = _mm256_and_si256(q, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            let (s_lo, s_hi) = (k4_scale(sm, 2 * pair), k4_scale(sm, 2 * pair + 1));
            for (sum, y) in isum.iter_mut().zip(&x) {
                *sum = madd_scaled(*sum, lo, q8_32(&y[i], 64 * pair), s_lo);
                *sum = madd_scaled(*sum, hi, q8_32(&y[i], 64 * pair + 32), s_hi);
            }
        }
        for ((a, sum), y) in acc.iter_mut().zip(isum).zip(&x) {
            *a = combine(*a, d, dmin, y[i].d, hsum_i32(sum), k4_msum(sm, &y[i]));
        }
    }
    acc
}

/// [`super::q8k_avx2::dot_q6_k`] of `w` with each row of `x`.
///
/// # Safety
/// As [`dot_q4_k_rows`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q6_k_rows<const R: usize>(w: &[u8], x: [&[Q8KBlock]; R]) -> [f32; R] {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = [0f32; R];
    for i in 0..common_blocks(w, 210, &x) {
        let b = &w[210 * i..210 * (i + 1)];
        let p = b.as_ptr();
        prefetch_next_row::<210>(p, w.len());
        // SAFETY: `b` is one 210-byte block: scales at 192..208, d at 208.
        let (sc, d) = unsafe { (_mm_loadu_si128(p.add(192).cast()), f16_at(p.add(208))) };
        let mut isum = [_mm256_setzero_si256(); R];
        for h in 0..2 {
            // SAFETY: ql bytes 64h..64h+64 and qh bytes 128+32h..+32 lie in the block (h < 2).
            let (ql0, ql1, qh) = unsafe {
                (
                    _mm256_loadu_si256(p.add(64 * h).cast()),
                    _mm256_loadu_si256(p.add(64 * h + 32).cast()),
                    _mm256_loadu_si256(p.add(128 + 32 * h).cast()),
                )
            };
            let hb = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, m2));
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), hb(qh)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), hb(_mm256_srli_epi16::<2>(qh))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), hb(_mm256_srli_epi16::<4>(qh))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), hb(_mm256_srli_epi16::<6>(qh))),
            ];
            for (k, qk) in q.into_iter().enumerate() {
                let scales = scale_pair(sc, 8 * h + 2 * k);
                for (sum, y) in isum.iter_mut().zip(&x) {
                    *sum = madd_scaled(*sum, qk, q8_32(&y[i], 128 * h + 32 * k), scales);
                }
            }
        }
        let sc16 = _mm256_cvtepi8_epi16(sc);
        for ((a, sum), y) in acc.iter_mut().zip(isum).zip(&x) {
            // SAFETY: `bsums` is 16 i16 (32 bytes).
            let bs = unsafe { _mm256_loadu_si256(y[i].bsums.as_ptr().cast()) };
            let offset = hsum_i32(_mm256_madd_epi16(sc16, bs));
            *a = combine(*a, d, 0.0, y[i].d, hsum_i32(sum) - 32 * offset, 0);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::super::q8k::dot;
    use super::super::q8k_avx2::tests::{random_activations, random_weights};
    use super::super::test_rng::{avx2_or_skip, fresh_seed};
    use super::*;
    use crate::quant::kquants::QK_K;
    use crate::tensor::DType;

    fn check<const R: usize>(seed: &mut u64, dtype: DType, blocks: usize) {
        let w = random_weights(seed, dtype, blocks);
        let xs: Vec<Vec<Q8KBlock>> = (0..R).map(|_| random_activations(seed, blocks * QK_K)).collect();
        let x: [&[Q8KBlock]; R] = std::array::from_fn(|r| &xs[r][..]);
        // SAFETY: avx2 was checked by the caller; all rows hold `blocks` blocks.
        let got = unsafe {
            match dtype {
                DType::Q4_K => dot_q4_k_rows(&w, x),
                _ => dot_q6_k_rows(&w, x),
            }
        };
        for r in 0..R {
            let want = dot(dtype, &w, x[r]);
            assert_eq!(got[r].to_bits(), want.to_bits(), "{} R={R} row {r}: {} vs {want}", dtype.name(), got[r]);
        }
    }

    #[test]
    fn rows_equal_the_one_row_dots_bit_for_bit() {
        if !avx2_or_skip() {
            return;
        }
        let mut seed = fresh_seed("q8k_rows_avx2");
        for dtype in [DType::Q4_K, DType::Q6_K] {
            for blocks in [1, 2, 5, 12] {
                check::<1>(&mut seed, dtype, blocks);
                check::<2>(&mut seed, dtype, blocks);
                check::<3>(&mut seed, dtype, blocks);
                check::<4>(&mut seed, dtype, blocks);
            }
        }
    }
}
