//! Prefill kernels: four activation rows interleaved per block ([`Q8x4`])
//! against pairs of weight rows, with AVX2.
//!
//! A block of 4 activation rows × 2 weight rows gives 8 integer block sums.
//! They are reduced horizontally in integers into one vector (lane `4·j + i`),
//! so the block's scales cost one convert and one FMA per 8 outputs instead of
//! per output. The sums are exact and equal the scalar reference's; only the
//! f32 accumulation order differs.
//!
//! 4-bit weights reduce in i16: a lane then holds 16 products of at most
//! 15·127 (Q4_1) or 8·127 (Q4_0), below 2¹⁵. Q8_0 products need i32.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::q8::Q8x4;

/// Block sums of 8 vectors of i16 pair sums (`maddubs` output), lane k = vector k.
/// Every sum of 16 products must fit i16.
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_i16(v: [__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi16(v[0], v[1]);
    let b = _mm256_hadd_epi16(v[2], v[3]);
    let c = _mm256_hadd_epi16(v[4], v[5]);
    let d = _mm256_hadd_epi16(v[6], v[7]);
    // Each 128-bit half now holds lane k = half of vector k's sum.
    let h = _mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d));
    _mm256_add_epi32(
        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)),
        _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(h)),
    )
}

/// Block sums of 8 vectors of i32 partial sums, lane k = vector k.
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_i32(v: [__m256i; 8]) -> __m256i {
    let ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(ab, cd), _mm256_permute2x128_si256::<0x31>(ab, cd))
}

/// `[a, a, a, a, b, b, b, b]` from lane `L` of `lo` (a) and of `hi` (b).
#[target_feature(enable = "avx2,fma,f16c")]
fn splat_pair<const L: i32>(lo: __m128, hi: __m128) -> __m256 {
    _mm256_set_m128(_mm_permute_ps::<L>(hi), _mm_permute_ps::<L>(lo))
}

/// Two f16 at `p` widened: `[p[0], p[1], 0, 0]`.
///
/// # Safety
/// `p` points at 4 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> __m128 {
    // SAFETY: the caller guarantees 4 readable bytes.
    _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe { p.cast::<i32>().read_unaligned() }))
}

/// 32 nibbles of a 16-byte block as bytes: low nibbles (values 0..16) first.
///
/// # Safety
/// `p` points at 16 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes.
    let q = unsafe { _mm_loadu_si128(p.cast()) };
    let low = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), low), _mm_and_si128(q, low))
}

/// `[v, v]`: the 4 activation rows' scales for both weight rows of a pair.
#[target_feature(enable = "avx2,fma,f16c")]
fn twice(v: &[f32; 4]) -> __m256 {
    // SAFETY: `v` is 4 floats.
    let q = unsafe { _mm_loadu_ps(v.as_ptr()) };
    _mm256_set_m128(q, q)
}

/// The 4 activation rows' quantized values of one block.
#[target_feature(enable = "avx2,fma,f16c")]
fn load_x(y: &Q8x4) -> [__m256i; 4] {
    // SAFETY: each `qs[i]` is 32 bytes.
    std::array::from_fn(|i| unsafe { _mm256_loadu_si256(y.qs[i].as_ptr().cast()) })
}

/// Spreads the pair accumulators (lane `4·j + i`) into `out[i][j]`, adding `extra` likewise.
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack<const NP: usize, const NR: usize>(acc: [__m256; NP], extra: Option<[__m256; NP]>) -> [[f32; NR]; 4] {
    let mut out = [[0f32; NR]; 4];
    for p in 0..NP {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` is 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[p]) };
        let mut more = [0f32; 8];
        if let Some(e) = extra {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(more.as_mut_ptr(), e[p]) };
        }
        for i in 0..4 {
            out[i][2 * p] = lanes[i] + more[i];
            out[i][2 * p + 1] = lanes[4 + i] + more[4 + i];
        }
    }
    out
}

/// Q4_1 weight rows `w` (NR = 2·NP) against 4 activation rows: `out[i][j]`.
///
/// # Safety
/// avx2, fma and f16c are present; each `w[j]` points at `blocks` Q4_1 blocks
/// and `x` at `blocks` [`Q8x4`]s.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quad_q4_1<const NP: usize, const NR: usize>(
    w: [*const u8; NR],
    x: *const Q8x4,
    blocks: usize,
) -> [[f32; NR]; 4] {
    let mut acc = [_mm256_setzero_ps(); NP];
    let mut mins = [_mm256_setzero_ps(); NP];
    for b in 0..blocks {
        // SAFETY: block `b` is in bounds of `x` and of every `w[j]` (caller's contract).
        let y = unsafe { &*x.add(b) };
        let xq = load_x(y);
        let dx = twice(&y.d);
        let sx = twice(&y.s);
        for p in 0..NP {
            // SAFETY: as above.
            let (p0, p1) = unsafe { (w[2 * p].add(b * 20), w[2 * p + 1].add(b * 20)) };
            // SAFETY: a Q4_1 block is 4 bytes of f16 `d`, `m`, then 16 bytes of nibbles.
            let (dm0, dm1, q0, q1) = unsafe { (f16x2(p0), f16x2(p1), nibbles(p0.add(4)), nibbles(p1.add(4))) };
            let v = std::array::from_fn(|k| _mm256_maddubs_epi16(if k < 4 { q0 } else { q1 }, xq[k % 4]));
            let sums = _mm256_cvtepi32_ps(reduce_i16(v));
            acc[p] = _mm256_fmadd_ps(_mm256_mul_ps(splat_pair::<0x00>(dm0, dm1), dx), sums, acc[p]);
            mins[p] = _mm256_fmadd_ps(splat_pair::<0x55>(dm0, dm1), sx, mins[p]);
        }
    }
    unpack(acc, Some(mins))
}

/// Q4_0 weight rows against 4 activation rows; see [`quad_q4_1`].
///
/// # Safety
/// As [`quad_q4_1`], with Q4_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quad_q4_0<const NP: usize, const NR: usize>(
    w: [*const u8; NR],
    x: *const Q8x4,
    blocks: usize,
) -> [[f32; NR]; 4] {
    let mut acc = [_mm256_setzero_ps(); NP];
    let eights = _mm256_set1_epi8(8);
    for b in 0..blocks {
        // SAFETY: block `b` is in bounds of `x` and of every `w[j]` (caller's contract).
        let y = unsafe { &*x.add(b) };
        let xq = load_x(y);
        // Σ(q − 8)·x = Σq·x − 8·Σx, per pair of bytes.
        let x8 = xq.map(|v| _mm256_maddubs_epi16(eights, v));
        let dx = twice(&y.d);
        for p in 0..NP {
            // SAFETY: as above.
            let (p0, p1) = unsafe { (w[2 * p].add(b * 18), w[2 * p + 1].add(b * 18)) };
            // SAFETY: a Q4_0 block is 2 bytes of f16 `d`, then 16 bytes of nibbles.
            let (d0, d1, q0, q1) = unsafe { (f16x2(p0), f16x2(p1), nibbles(p0.add(2)), nibbles(p1.add(2))) };
            let v = std::array::from_fn(|k| {
                _mm256_sub_epi16(_mm256_maddubs_epi16(if k < 4 { q0 } else { q1 }, xq[k % 4]), x8[k % 4])
            });
            let sums = _mm256_cvtepi32_ps(reduce_i16(v));
            acc[p] = _mm256_fmadd_ps(_mm256_mul_ps(splat_pair::<0x00>(d0, d1), dx), sums, acc[p]);
        }
    }
    unpack(acc, None)
}

/// Q8_0 weight rows against 4 activation rows; see [`quad_q4_1`].
///
/// # Safety
/// As [`quad_q4_1`], with Q8_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quad_q8_0<const NP: usize, const NR: usize>(
    w: [*const u8; NR],
    x: *const Q8x4,
    blocks: usize,
) -> [[f32; NR]; 4] {
    let mut acc = [_mm256_setzero_ps(); NP];
    let ones = _mm256_set1_epi16(1);
    for b in 0..blocks {
        // SAFETY: block `b` is in bounds of `x` and of every `w[j]` (caller's contract).
        let y = unsafe { &*x.add(b) };
        let xq = load_x(y);
        let dx = twice(&y.d);
        for p in 0..NP {
            // SAFETY: as above.
            let (p0, p1) = unsafe { (w[2 * p].add(b * 34), w[2 * p + 1].add(b * 34)) };
            // SAFETY: a Q8_0 block is 2 bytes of f16 `d`, then 32 signed bytes
            // (reading 4 bytes at `p` for `d` stays inside the block).
            let (d0, d1, q0, q1) = unsafe {
                (f16x2(p0), f16x2(p1), _mm256_loadu_si256(p0.add(2).cast()), _mm256_loadu_si256(p1.add(2).cast()))
            };
            let (a0, a1) = (_mm256_abs_epi8(q0), _mm256_abs_epi8(q1));
            // |w|·(x·sign w) = w·x; |x| ≤ 127 so the pair sums fit i16.
            let v = std::array::from_fn(|k| {
                let (a, q) = if k < 4 { (a0, q0) } else { (a1, q1) };
                _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xq[k % 4], q)), ones)
            });
            let sums = _mm256_cvtepi32_ps(reduce_i32(v));
            acc[p] = _mm256_fmadd_ps(_mm256_mul_ps(splat_pair::<0x00>(d0, d1), dx), sums, acc[p]);
        }
    }
    unpack(acc, None)
}
