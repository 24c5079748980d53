//! AVX2 dots of one K-quant weight row (Q2_K…Q6_K) with Q8_K activations,
//! reading the packed super-blocks directly, in the manner of ggml's AVX2
//! `ggml_vec_dot_q*_K_q8_K`; Q4_K and Q6_K also with several activation
//! rows at once (the one-row dot is their one-row case).
//!
//! Weight levels are made unsigned bytes and multiplied with the signed
//! activations by `maddubs` (i16 pair sums, which never saturate for these
//! level ranges), then by the per-group scales with `madd` into i32 lanes.
//! Level offsets (Q3_K's −4, Q6_K's −32) are subtracted as integers, and the
//! mins term is `madd(mins, bsums)`. So each super-block yields the same exact
//! integers `isum` and `msum` as the scalar [`super::q8k::dot_scalar`], and
//! [`combine`] scales them with the same float expression in the same order:
//! the results are equal bit for bit (unlike ggml's kernels, which accumulate
//! in float lanes), so swapping kernels never changes a generated token.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::act_blocks::Q8KBlock;

/// The scalar path's per-super-block float step, verbatim: any other order or
/// a fused multiply-add would round differently.
#[inline(always)]
fn combine(acc: f32, d: f32, dmin: f32, yd: f32, isum: i32, msum: i32) -> f32 {
    acc + (d * yd * isum as f32 - dmin * yd * msum as f32)
}

/// The f16 at `p`, widened (exact, as `half`'s conversion in the scalar path).
///
/// # Safety
/// `p` points at 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_i32(v: __m256i) -> i32 {
    let s4 = _mm_add_epi32(_mm256_extracti128_si256::<1>(v), _mm256_castsi256_si128(v));
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_i32_128(v: __m128i) -> i32 {
    let s2 = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2)))
}

/// Signed bytes `lo` and `hi` of `sc` as i16 lanes: lanes 0..8 take `sc[lo]`,
/// lanes 8..16 `sc[hi]`, matching the `maddubs` pair sums of 32 consecutive
/// values (16 per lane half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_lanes(sc: __m128i, lo: usize, hi: usize) -> __m256i {
    let splat = |i: usize| (0x0101_0101_0101_0101u64 * i as u64) as i64;
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(splat(hi), splat(lo))))
}

/// The scales of 16-value groups `g` and `g + 1` for 32 consecutive values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(sc: __m128i, g: usize) -> __m256i {
    scale_lanes(sc, g, g + 1)
}

/// The 32 activations of `y` starting at `at` (a multiple of 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_32(y: &Q8KBlock, at: usize) -> __m256i {
    let s = &y.qs[at..at + 32];
    // SAFETY: `s` holds 32 bytes.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// `isum += Σ_pairs scale·(w·x)` for 32 weight levels `w` (unsigned bytes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn madd_scaled(isum: __m256i, w: __m256i, x: __m256i, scales: __m256i) -> __m256i {
    _mm256_add_epi32(isum, _mm256_madd_epi16(scales, _mm256_maddubs_epi16(w, x)))
}

/// Q4_K/Q5_K's 12 scale bytes as ggml's `utmp` shuffle unpacks them: bytes
/// 0..8 the eight 6-bit scales, bytes 8..16 the eight 6-bit mins (each as
/// `kquants::scale_min_k4`).
///
/// # Safety
/// `p` points at 12 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_scales_mins(p: *const u8) -> __m128i {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    // SAFETY: the caller guarantees 12 readable bytes.
    let u = unsafe { [0, 4, 8].map(|o| p.add(o).cast::<u32>().read_unaligned()) };
    let scales_hi = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    let mins_hi = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    _mm_setr_epi32((u[0] & KMASK1) as i32, scales_hi as i32, (u[1] & KMASK1) as i32, mins_hi as i32)
}

/// `Σ_j min_j·(bsums[2j] + bsums[2j+1])` for the 8 mins in bytes 8..16 of `sm`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_msum(sm: __m128i, y: &Q8KBlock) -> i32 {
    // SAFETY: `bsums` is 16 i16 (32 bytes).
    let bs = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
    // Sums of adjacent groups: |Σ| ≤ 2·16·128, no i16 overflow.
    let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
    hsum_i32_128(_mm_madd_epi16(_mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm)), pairs))
}

/// Q4_K/Q5_K's scale of 32-value group `j` (byte `j` of `sm`) in all 16 i16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_scale(sm: __m128i, j: usize) -> __m256i {
    scale_lanes(sm, j, j)
}

/// Decode streams every weight once and waits on memory, so each block step
/// prefetches the same block `PREFETCH_ROWS` rows on (matmul rows are
/// contiguous), as `q8_avx2` does for Q4_0. Qwen3-0.6B tg on 2 cores, Q4_K /
/// Q6_K tok/s: none 24.6 / 19.9, 1 row 30.4 / 25.5, 2 rows 35.2 / 28.3,
/// 4 rows 37.1 / 27.1, 8 rows 37.7 / 27.2.
const PREFETCH_ROWS: usize = 4;

/// Prefetches the `BLOCK` bytes at `p` + `PREFETCH_ROWS`·`row_bytes`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_next_row<const BLOCK: usize>(p: *const u8, row_bytes: usize) {
    let next = p.wrapping_add(PREFETCH_ROWS * row_bytes);
    let mut at = 0;
    while at < BLOCK {
        // A prefetch never faults, so the address may lie past the matrix.
        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(at).cast());
        at += 64;
    }
}

/// Q4_K: `d`, `dmin` (f16), 12 scale bytes, 128 nibble bytes; 32-byte run `p`
/// holds values 64p..64p+32 (low nibbles) and 64p+32..64p+64 (high nibbles).
///
/// # Safety
/// avx2, fma and f16c are present. Loads stay within whole blocks of `w`, paired
/// with `x` as far as both go (as in the scalar dot), so any lengths are sound.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    // SAFETY: as this function's.
    unsafe { dot_q4_k_rows(w, [x])[0] }
}

/// Q5_K: as Q4_K plus 32 `qh` bytes before the nibbles: bit `2p` of `qh[l]`
/// is bit 4 of low-nibble value 64p+l, bit `2p+1` that of high-nibble 64p+32+l.
///
/// # Safety
/// avx2, fma and f16c are present. Loads stay within whole blocks of `w`, paired
/// with `x` as far as both go (as in the scalar dot), so any lengths are sound.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0f);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = 0f32;
    for (b, y) in w.chunks_exact(176).zip(x) {
        let p = b.as_ptr();
        prefetch_next_row::<176>(p, w.len());
        // SAFETY: `b` is one 176-byte block: f16s at 0 and 2, scales at 4..16, qh at 16..48.
        let (d, dmin, sm, qh) =
            unsafe { (f16_at(p), f16_at(p.add(2)), k4_scales_mins(p.add(4)), _mm256_loadu_si256(p.add(16).cast())) };
        // The 5th bit of each value as 0 or 16; `bit` walks 1, 2, 4 … 128 (never crossing a byte).
        let mut bit = _mm256_set1_epi8(1);
        let mut high = || {
            let h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), sixteen);
            bit = _mm256_slli_epi16::<1>(bit);
            h
        };
        let mut isum = _mm256_setzero_si256();
        for pair in 0..4 {
            // SAFETY: bytes 48 + 32·pair .. +32 lie in the block (pair < 4).
            let q = unsafe { _mm256_loadu_si256(p.add(48 + 32 * pair).cast()) };
            let lo = _mm256_or_si256(_mm256_and_si256(q, m4), high());
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), high());
            isum = madd_scaled(isum, lo, q8_32(y, 64 * pair), k4_scale(sm, 2 * pair));
            isum = madd_scaled(isum, hi, q8_32(y, 64 * pair + 32), k4_scale(sm, 2 * pair + 1));
        }
        acc = combine(acc, d, dmin, y.d, hsum_i32(isum), k4_msum(sm, y));
    }
    acc
}

/// Q6_K: 128 `ql` nibble bytes, 64 `qh` bytes, 16 signed scales, `d` (f16).
/// In half `h`, value 128h+32k+l takes the low (k < 2) or high nibble of
/// `ql[64h + 32(k%2) + l]` and bits `2k..2k+2` of `qh[32h + l]` on top; the
/// level is that minus 32. The −32 is taken out once as `32·Σ_g sc_g·bsums_g`.
///
/// # Safety
/// avx2, fma and f16c are present. Loads stay within whole blocks of `w`, paired
/// with `x` as far as both go (as in the scalar dot), so any lengths are sound.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q6_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    // SAFETY: as this function's.
    unsafe { dot_q6_k_rows(w, [x])[0] }
}

/// Super-blocks that `w` (blocks of `bytes`) and every row of `x` hold.
fn common_blocks<const R: usize>(w: &[u8], bytes: usize, x: &[&[Q8KBlock]; R]) -> usize {
    x.iter().map(|r| r.len()).fold(w.len() / bytes, usize::min)
}

/// [`dot_q4_k`] of `w` with each of `R` activation rows: each super-block
/// is loaded and unpacked once for all of them (speculative verification and
/// small batches). Every row goes through the same integer and float steps
/// in the same order whatever `R`, so its result does not depend on the
/// rows beside it.
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

/// [`dot_q6_k`] of `w` with each of `R` activation rows, as [`dot_q4_k_rows`].
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

/// Q2_K: 16 scale bytes (low nibble scale, high nibble min, per 16 values),
/// 64 bytes of 2-bit levels, `d`, `dmin` (f16). In half `h`, value 128h+32j+l
/// is bits `2j..2j+2` of `qs[32h + l]`.
///
/// # Safety
/// avx2, fma and f16c are present. Loads stay within whole blocks of `w`, paired
/// with `x` as far as both go (as in the scalar dot), so any lengths are sound.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q2_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let m3 = _mm256_set1_epi8(0x03);
    let m4 = _mm_set1_epi8(0x0f);
    let mut acc = 0f32;
    for (b, y) in w.chunks_exact(84).zip(x) {
        let p = b.as_ptr();
        prefetch_next_row::<84>(p, w.len());
        // SAFETY: `b` is one 84-byte block: scales at 0..16, f16s at 80 and 82.
        let (sm, d, dmin) = unsafe { (_mm_loadu_si128(p.cast()), f16_at(p.add(80)), f16_at(p.add(82))) };
        let sc = _mm_and_si128(sm, m4);
        let mut isum = _mm256_setzero_si256();
        for h in 0..2 {
            // SAFETY: bytes 16 + 32h .. +32 lie in the block (h < 2).
            let q = unsafe { _mm256_loadu_si256(p.add(16 + 32 * h).cast()) };
            let levels = [q, _mm256_srli_epi16::<2>(q), _mm256_srli_epi16::<4>(q), _mm256_srli_epi16::<6>(q)];
            for (j, l) in levels.into_iter().enumerate() {
                let l = _mm256_and_si256(l, m3);
                isum = madd_scaled(isum, l, q8_32(y, 128 * h + 32 * j), scale_pair(sc, 8 * h + 2 * j));
            }
        }
        // SAFETY: `bsums` is 16 i16 (32 bytes).
        let bs = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sm), m4));
        acc = combine(acc, d, dmin, y.d, hsum_i32(isum), hsum_i32(_mm256_madd_epi16(mins, bs)));
    }
    acc
}

/// Q3_K's 16 6-bit scales, unbiased (−32..31) as signed bytes, by ggml's
/// u32-word shuffle (the same values as `kquants`' per-scale unpacking).
///
/// # Safety
/// `p` points at 12 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k_scales(p: *const u8) -> __m128i {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    // SAFETY: the caller guarantees 12 readable bytes.
    let [a0, a1, t] = unsafe { [0, 4, 8].map(|o| p.add(o).cast::<u32>().read_unaligned()) };
    let aux = _mm_setr_epi32(
        ((a0 & K2) | ((t & K1) << 4)) as i32,
        ((a1 & K2) | (((t >> 2) & K1) << 4)) as i32,
        (((a0 >> 4) & K2) | (((t >> 4) & K1) << 4)) as i32,
        (((a1 >> 4) & K2) | (((t >> 6) & K1) << 4)) as i32,
    );
    _mm_sub_epi8(aux, _mm_set1_epi8(32))
}

/// Q3_K: 32 `hmask` bytes, 64 bytes of 2-bit levels, 12 scale bytes, `d`.
/// In half `h`, value 128h+32j+l is bits `2j..2j+2` of `qs[32h + l]`, less 4
/// unless bit `4h + j` of `hmask[l]` is set. The −4 is a second `maddubs`.
///
/// # Safety
/// avx2, fma and f16c are present. Loads stay within whole blocks of `w`, paired
/// with `x` as far as both go (as in the scalar dot), so any lengths are sound.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q3_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let m3 = _mm256_set1_epi8(0x03);
    let four = _mm256_set1_epi8(4);
    let mut acc = 0f32;
    for (b, y) in w.chunks_exact(110).zip(x) {
        let p = b.as_ptr();
        prefetch_next_row::<110>(p, w.len());
        // SAFETY: `b` is one 110-byte block: hmask at 0..32, scales at 96..108, d at 108.
        let (hm, sc, d) = unsafe { (_mm256_loadu_si256(p.cast()), q3_k_scales(p.add(96)), f16_at(p.add(108))) };
        // `bit` walks 1, 2, 4 … 128 across both halves (never crossing a byte).
        let mut bit = _mm256_set1_epi8(1);
        let mut isum = _mm256_setzero_si256();
        for h in 0..2 {
            // SAFETY: bytes 32 + 32h .. +32 lie in the block (h < 2).
            let q = unsafe { _mm256_loadu_si256(p.add(32 + 32 * h).cast()) };
            let levels = [q, _mm256_srli_epi16::<2>(q), _mm256_srli_epi16::<4>(q), _mm256_srli_epi16::<6>(q)];
            for (j, l) in levels.into_iter().enumerate() {
                let l = _mm256_and_si256(l, m3);
                // 4 where the high bit is clear, else 0.
                let sub = _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four);
                bit = _mm256_slli_epi16::<1>(bit);
                let xq = q8_32(y, 128 * h + 32 * j);
                // Pair sums of (level − sub)·x: |·| ≤ 2·4·128, exact in i16.
                let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(l, xq), _mm256_maddubs_epi16(sub, xq));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(scale_pair(sc, 8 * h + 2 * j), p16));
            }
        }
        acc = combine(acc, d, 0.0, y.d, hsum_i32(isum), 0);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::super::q8k::{dot, dot_scalar, quantize_row};
    use super::super::test_rng::{finite_f16, fresh_seed, next};
    use super::*;
    use crate::quant::kquants::{QK_K, f16_field_offsets};
    use crate::tensor::DType;

    const TYPES: [DType; 5] = [DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K];

    fn has_avx2() -> bool {
        super::super::test_rng::avx2_or_skip()
    }

    /// Random bytes for levels and packed scales, finite random f16 `d`/`dmin`.
    fn random_weights(seed: &mut u64, dtype: DType, blocks: usize) -> Vec<u8> {
        let mut w: Vec<u8> = (0..blocks * dtype.block_bytes()).map(|_| next(seed) as u8).collect();
        for blk in w.chunks_exact_mut(dtype.block_bytes()) {
            for &off in f16_field_offsets(dtype) {
                blk[off..off + 2].copy_from_slice(&finite_f16(seed).to_le_bytes());
            }
        }
        w
    }

    /// Activations of mixed magnitudes, with an all-zero super-block and one of
    /// ±1 only (every value quantizing to ±127).
    fn random_activations(seed: &mut u64, n: usize) -> Vec<Q8KBlock> {
        let mut x: Vec<f32> = Vec::with_capacity(n);
        for k in 0..n / QK_K {
            let scale = [1.0, 1e-3, 40.0, 0.0, 1.0][k % 5];
            for _ in 0..QK_K {
                let u = (next(seed) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                x.push(if k % 7 == 4 { u.signum() } else { u * scale });
            }
        }
        let mut q = vec![Q8KBlock::ZERO; n / QK_K];
        quantize_row(&x, &mut q);
        q
    }

    #[test]
    fn random_rows_match_scalar_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let mut seed = fresh_seed("q8k_avx2");
        let start = seed;
        for dtype in TYPES {
            for n in [256usize, 512, 4096, 12288] {
                for rep in 0..4 {
                    let w = random_weights(&mut seed, dtype, n / QK_K);
                    let x = random_activations(&mut seed, n);
                    let (got, want) = (dot(dtype, &w, &x), dot_scalar(dtype, &w, &x));
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{dtype:?} n {n} rep {rep}: {got} vs {want}, seed {start}"
                    );
                }
            }
        }
    }

    /// Saturated levels and activations: the largest i16 pair sums the kernels
    /// form must not clip.
    #[test]
    fn extreme_blocks_match_scalar_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let blocks = 3;
        for dtype in TYPES {
            for byte in [0x00u8, 0xff, 0x80, 0x7f, 0x55, 0xaa] {
                for sign in [1.0f32, -1.0] {
                    let mut w = vec![byte; blocks * dtype.block_bytes()];
                    for blk in w.chunks_exact_mut(dtype.block_bytes()) {
                        for &off in f16_field_offsets(dtype) {
                            blk[off..off + 2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                        }
                    }
                    let xf: Vec<f32> = (0..blocks * QK_K).map(|i| if i % 3 == 2 { -sign } else { sign }).collect();
                    let mut x = vec![Q8KBlock::ZERO; blocks];
                    quantize_row(&xf, &mut x);
                    let (got, want) = (dot(dtype, &w, &x), dot_scalar(dtype, &w, &x));
                    assert_eq!(got.to_bits(), want.to_bits(), "{dtype:?} byte {byte:#x} sign {sign}: {got} vs {want}");
                }
            }
        }
    }

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
            let want = super::super::q8k::dot_scalar(dtype, &w, x[r]);
            assert_eq!(got[r].to_bits(), want.to_bits(), "{} R={R} row {r}: {} vs {want}", dtype.name(), got[r]);
        }
    }

    #[test]
    fn rows_match_scalar_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let mut seed = fresh_seed("q8k_avx2 rows");
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
