//! AVX2 versions of `q8`'s activation quantization and block dots.
//!
//! The integer block sums are exact and equal the scalar reference's; only the
//! order of the f32 accumulation differs. That order is ggml's AVX2
//! `ggml_vec_dot_{q4_0_q8_0,q4_1_q8_1,q8_0_q8_0}`, step for step: per block, the
//! 8 i32 lanes of `madd(maddubs(..), 1)` are converted and FMA'd with the
//! broadcast `d_w·d_x` into 8 lane accumulators, reduced at the end as
//! `hsum_float_8`; Q4_1's `m·s` terms are summed apart and added last. Keep it:
//! the activations are re-quantized after every layer, so a last-bit
//! difference can flip a rounding and, through 30 layers, a greedy token (an
//! earlier kernel that summed each block horizontally in integers was 10–15%
//! faster in prefill and lost token-for-token agreement with llama.cpp).
//!
//! Weights are multiplied as unsigned bytes with `maddubs(w, x)` (the
//! activations are signed): Q4_1 nibbles are already unsigned, Q4_0 subtracts
//! `8·Σx` per pair (the same i16 lanes as ggml's sign trick), Q8_0 moves the
//! weight sign onto x as ggml does. Tiles of `MR` activation rows × `NR` weight
//! rows unpack each weight block once per tile and keep `MR·NR` accumulators in
//! registers; the tile shape does not change any output's arithmetic.
//!
//! Q5_0 and Q5_1 are the exception ([`tile_q5_0`], [`tile_q5_1`]): they return
//! the scalar [`super::q8::dot`]'s value bit for bit (each block's exact i32 sum,
//! then the scalar's float step in its order, with no FMA), so taking the AVX2
//! path never changes a token for these types.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::act_blocks::{Q8Block, f16_round};

/// [`super::q8::quantize_row_scalar`], 32 values at a time, bit for bit.
///
/// # Safety
/// The CPU must support avx2, fma and f16c; `x.len() == 32 * out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    debug_assert_eq!(x.len(), out.len() * 32);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (chunk, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let p = chunk.as_ptr();
        // SAFETY: `chunk` holds 32 floats.
        let v = unsafe {
            [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))]
        };
        // max_ps returns its second operand when either is NaN, as f32::max skips NaN.
        let a01 = _mm256_max_ps(_mm256_and_ps(v[1], abs_mask), _mm256_and_ps(v[0], abs_mask));
        let a23 = _mm256_max_ps(_mm256_and_ps(v[3], abs_mask), _mm256_and_ps(v[2], abs_mask));
        let a = _mm256_max_ps(a01, a23);
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(a), _mm256_castps256_ps128(a));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2))).max(0.0);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        // round() already yields integers, so the conversion is exact.
        let q = v.map(|vk| {
            _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                vk, idv,
            )))
        });
        let s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(_mm256_extracti128_si256::<1>(s8), _mm256_castsi256_si128(s8));
        let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2)));
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let packed = _mm256_permutevar8x32_epi32(packed, perm);
        // SAFETY: `qs` is 32 bytes.
        unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr().cast(), packed) };
        o.d = f16_round(d);
        o.s = f16_round(d * sum as f32);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// The f16 at `p` widened, broadcast to 8 lanes.
///
/// # Safety
/// `p` points at 2 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_splat(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 2 readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
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

/// As [`nibbles`], without a cross-lane shuffle: the 16 bytes loaded into both
/// halves, the upper half shifted right by 4 (per 64-bit lane: the bits shifted
/// in from the next byte land in the high nibble, which the mask clears).
///
/// # Safety
/// `p` points at 16 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles_srlv(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes.
    let q = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast())) };
    _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0f))
}

/// Decode (one activation row) streams each weight once and waits on memory:
/// prefetch the same block of the rows `PREFETCH_GROUPS` tiles ahead (rows are
/// contiguous, so that is `NR·PREFETCH_GROUPS` rows further on). One tile
/// measured best (7.7 → 12 GB/s on SmolLM2-135M's layers; 2 or 4 were no better).
const PREFETCH_GROUPS: usize = 1;

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn prefetch_ahead<const MR: usize, const NR: usize>(w: &[*const u8; NR], at: usize, row_bytes: usize) {
    if MR == 1 {
        for p in w {
            // A prefetch never faults, so the address may lie past the matrix.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at + NR * PREFETCH_GROUPS * row_bytes).cast());
        }
    }
}

/// Sums the i16 pair products to i32 lanes and adds `scale·sum` to `acc`.
#[target_feature(enable = "avx2,fma,f16c")]
fn accumulate(acc: __m256, scale: __m256, p16: __m256i) -> __m256 {
    let p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p32), acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn reduce<const MR: usize, const NR: usize>(acc: [[__m256; NR]; MR]) -> [[f32; NR]; MR] {
    let mut out = [[0f32; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            out[i][j] = hsum(acc[i][j]);
        }
    }
    out
}

/// Q4_0 weights (`d`, 16 nibble bytes; w = d·(q − 8)) against `Q8Block`s.
///
/// # Safety
/// avx2, fma and f16c are present; each `w[j]` points at `blocks` Q4_0 blocks
/// and each `x[i]` at `blocks` `Q8Block`s.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_q4_0<const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const Q8Block; MR],
    blocks: usize,
) -> [[f32; NR]; MR] {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let eights = _mm256_set1_epi8(8);
    for b in 0..blocks {
        let mut wq = [_mm256_setzero_si256(); NR];
        let mut dw = [_mm256_setzero_ps(); NR];
        prefetch_ahead::<MR, NR>(&w, b * 18, blocks * 18);
        for j in 0..NR {
            // SAFETY: block `b` of row `j` is in bounds (caller's contract).
            unsafe {
                let p = w[j].add(b * 18);
                dw[j] = f16_splat(p);
                wq[j] = nibbles(p.add(2));
            }
        }
        for i in 0..MR {
            // SAFETY: block `b` of activation row `i` is in bounds.
            let y = unsafe { &*x[i].add(b) };
            // SAFETY: `qs` is 32 bytes.
            let xq = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            let dx = _mm256_set1_ps(y.d);
            // Σ(q − 8)·x = Σq·x − 8·Σx, per pair of bytes, exact in i16.
            let x8 = _mm256_maddubs_epi16(eights, xq);
            for j in 0..NR {
                let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(wq[j], xq), x8);
                acc[i][j] = accumulate(acc[i][j], _mm256_mul_ps(dw[j], dx), p16);
            }
        }
    }
    reduce(acc)
}

/// Q4_1 weights (`d`, `m`, 16 nibble bytes; w = d·q + m) against `Q8Block`s.
///
/// # Safety
/// As [`tile_q4_0`], with Q4_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_q4_1<const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const Q8Block; MR],
    blocks: usize,
) -> [[f32; NR]; MR] {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let mut mins = [[0f32; NR]; MR];
    for b in 0..blocks {
        let mut wq = [_mm256_setzero_si256(); NR];
        let mut dw = [_mm256_setzero_ps(); NR];
        let mut mw = [0f32; NR];
        prefetch_ahead::<MR, NR>(&w, b * 20, blocks * 20);
        for j in 0..NR {
            // SAFETY: block `b` of row `j` is in bounds (caller's contract).
            unsafe {
                let p = w[j].add(b * 20);
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
                dw[j] = _mm256_broadcastss_ps(dm);
                mw[j] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
                wq[j] = nibbles(p.add(4));
            }
        }
        for i in 0..MR {
            // SAFETY: block `b` of activation row `i` is in bounds.
            let y = unsafe { &*x[i].add(b) };
            // SAFETY: `qs` is 32 bytes.
            let xq = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            let dx = _mm256_set1_ps(y.d);
            for j in 0..NR {
                acc[i][j] = accumulate(acc[i][j], _mm256_mul_ps(dw[j], dx), _mm256_maddubs_epi16(wq[j], xq));
                mins[i][j] += mw[j] * y.s;
            }
        }
    }
    let mut out = reduce(acc);
    for i in 0..MR {
        for j in 0..NR {
            out[i][j] += mins[i][j];
        }
    }
    out
}

/// Q8_0 weights (`d`, 32 signed bytes; w = d·q) against `Q8Block`s.
///
/// # Safety
/// As [`tile_q4_0`], with Q8_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_q8_0<const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const Q8Block; MR],
    blocks: usize,
) -> [[f32; NR]; MR] {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    for b in 0..blocks {
        let mut wq = [_mm256_setzero_si256(); NR];
        let mut wa = [_mm256_setzero_si256(); NR];
        let mut dw = [_mm256_setzero_ps(); NR];
        prefetch_ahead::<MR, NR>(&w, b * 34, blocks * 34);
        for j in 0..NR {
            // SAFETY: block `b` of row `j` is in bounds (caller's contract).
            unsafe {
                let p = w[j].add(b * 34);
                dw[j] = f16_splat(p);
                wq[j] = _mm256_loadu_si256(p.add(2).cast());
            }
            wa[j] = _mm256_abs_epi8(wq[j]);
        }
        for i in 0..MR {
            // SAFETY: block `b` of activation row `i` is in bounds.
            let y = unsafe { &*x[i].add(b) };
            // SAFETY: `qs` is 32 bytes.
            let xq = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            let dx = _mm256_set1_ps(y.d);
            for j in 0..NR {
                // |w|·(x·sign w) = w·x; |x| ≤ 127 so the pair sums fit i16.
                let p16 = _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xq, wq[j]));
                acc[i][j] = accumulate(acc[i][j], _mm256_mul_ps(dw[j], dx), p16);
            }
        }
    }
    reduce(acc)
}

/// Bit `k` of `qh` as byte `k`: 0xff where set, 0 where clear (ggml's
/// `bytes_from_bits_32`: byte `k` takes byte `k/8` of `qh`, ORed with a mask
/// of every bit but `k % 8`, and is all ones exactly when that bit is set).
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes_from_bits(qh: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// The exact i32 sums of four 8-lane vectors, in that order.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum4_i32(v: [__m256i; 4]) -> __m128i {
    // Within each 128-bit half: [Σa, Σb, Σc, Σd] of that half's lanes.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// `f(i, j)` for the 4 pairs of lane group `g` (pair k = 4g + lane: activation
/// row k / NR, weight row k % NR); 0 in lanes past the last pair.
#[inline(always)]
fn group_lanes<const MR: usize, const NR: usize>(g: usize, f: impl Fn(usize, usize) -> f32) -> __m128 {
    let v: [f32; 4] = std::array::from_fn(|l| {
        let k = 4 * g + l;
        if k < MR * NR { f(k / NR, k % NR) } else { 0.0 }
    });
    // SAFETY: `v` holds 4 floats; SSE is part of x86_64.
    unsafe { _mm_loadu_ps(v.as_ptr()) }
}

/// Per-weight-row lanes `v` (lane j = row j) spread over lane group `g` as
/// [`group_lanes`] lays the pairs out.
#[target_feature(enable = "avx2,fma,f16c")]
fn weight_lanes<const MR: usize, const NR: usize>(g: usize, v: __m128) -> __m128 {
    match NR {
        4 => v,
        2 => _mm_movelh_ps(v, v),
        1 => _mm_shuffle_ps::<0>(v, v),
        _ => {
            let mut a = [0f32; 4];
            // SAFETY: `a` holds 4 floats.
            unsafe { _mm_storeu_ps(a.as_mut_ptr(), v) };
            group_lanes::<MR, NR>(g, |_, j| a[j])
        }
    }
}

/// The f16 `d` (and for `AFFINE`, the `m` after it) at byte `at` of each
/// weight row, widened: lane j = row j (lanes past `NR` hold 0).
///
/// # Safety
/// Each `w[j]` has 4 readable bytes at `at`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_scales<const AFFINE: bool, const NR: usize>(w: &[*const u8; NR], at: usize) -> (__m128, __m128) {
    const { assert!(NR <= 4, "row_scales: at most 4 rows") };
    let r: [__m128i; 4] = std::array::from_fn(|j| {
        if j < NR {
            // SAFETY: the caller guarantees 4 readable bytes.
            _mm_cvtsi32_si128(unsafe { w[j].add(at).cast::<i32>().read_unaligned() })
        } else {
            _mm_setzero_si128()
        }
    });
    if AFFINE {
        // [d0 m0 d1 m1 d2 m2 d3 m3] → [d0 d1 d2 d3 m0 m1 m2 m3].
        let dm = _mm_unpacklo_epi64(_mm_unpacklo_epi32(r[0], r[1]), _mm_unpacklo_epi32(r[2], r[3]));
        let dm = _mm_shuffle_epi8(dm, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        let f = _mm256_cvtph_ps(dm);
        (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f))
    } else {
        // Only the low f16 of each word is `d`.
        let d = _mm_unpacklo_epi32(_mm_unpacklo_epi16(r[0], r[1]), _mm_unpacklo_epi16(r[2], r[3]));
        (_mm_cvtph_ps(d), _mm_setzero_ps())
    }
}

/// Q5_0 weights (`d`, 4 bytes `qh`, 16 nibble bytes; w = d·(q − 16)) against `Q8Block`s.
///
/// Unlike the kernels above, this returns [`super::q8::dot`]'s value bit for
/// bit: see [`tile_q5`].
///
/// # Safety
/// As [`tile_q4_0`], with Q5_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_q5_0<const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const Q8Block; MR],
    blocks: usize,
) -> [[f32; NR]; MR] {
    // SAFETY: the caller's contract is `tile_q5`'s.
    unsafe { tile_q5::<false, MR, NR>(w, x, blocks) }
}

/// Q5_1 weights (`d`, `m`, 4 bytes `qh`, 16 nibble bytes; w = d·q + m) against
/// `Q8Block`s, equal to [`super::q8::dot`] bit for bit as [`tile_q5_0`].
///
/// # Safety
/// As [`tile_q4_0`], with Q5_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_q5_1<const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const Q8Block; MR],
    blocks: usize,
) -> [[f32; NR]; MR] {
    // SAFETY: the caller's contract is `tile_q5`'s.
    unsafe { tile_q5::<true, MR, NR>(w, x, blocks) }
}

/// Q5_0 (`AFFINE` false) or Q5_1 weights: per block, the 5-bit levels (low
/// nibbles first, bit `k` of `qh` as bit 4 of value `k`) times the activations
/// summed exactly in i32, then the scalar [`super::q8::dot`]'s float step in its
/// order, `acc + ((d_w·d_x)·s + m_w·s_x)` (`+ 0.0` for Q5_0), with no fused
/// multiply-add. The float step runs 4 (activation row, weight row) pairs at a
/// time in the lanes of an `__m128`: each lane rounds exactly as the scalar does.
///
/// # Safety
/// As [`tile_q4_0`], with Q5_0 or Q5_1 blocks. (`NR ≤ 4` and `MR·NR ≤ 16` are
/// checked at compile time.)
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q5<const AFFINE: bool, const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const Q8Block; MR],
    blocks: usize,
) -> [[f32; NR]; MR] {
    const { assert!(MR * NR <= 16, "tile_q5: at most 16 pairs (4 lane groups)") };
    let (bb, qh_at, qs_at) = if AFFINE { (24, 4, 8) } else { (22, 2, 6) };
    let groups = (MR * NR).div_ceil(4);
    // Lane `l` of group `g` holds pair k = 4g + l: activation row k / NR, weight row k % NR.
    let mut acc = [_mm_setzero_ps(); 4];
    let sixteen = _mm256_set1_epi8(16);
    let ones = _mm256_set1_epi16(1);
    for b in 0..blocks {
        let mut wq = [_mm256_setzero_si256(); NR];
        prefetch_ahead::<MR, NR>(&w, b * bb, blocks * bb);
        // SAFETY: block `b` of every row is in bounds (caller's contract) and
        // starts with 4 bytes: `d` and `m` (Q5_1) or `d` and half of `qh` (Q5_0).
        let (dw, mw) = unsafe { row_scales::<AFFINE, NR>(&w, b * bb) };
        for j in 0..NR {
            // SAFETY: block `b` of row `j` is in bounds (caller's contract):
            // `qh` at `qh_at`, nibbles at `qs_at..qs_at + 16`.
            unsafe {
                let p = w[j].add(b * bb);
                let qh = p.add(qh_at).cast::<u32>().read_unaligned();
                // Levels 0..32 as unsigned bytes.
                wq[j] = _mm256_or_si256(nibbles_srlv(p.add(qs_at)), _mm256_and_si256(bytes_from_bits(qh), sixteen));
            }
        }
        let mut sums = [_mm256_setzero_si256(); 16];
        let mut dx = [0f32; MR];
        let mut sx = [0f32; MR];
        for i in 0..MR {
            // SAFETY: block `b` of activation row `i` is in bounds.
            let y = unsafe { &*x[i].add(b) };
            (dx[i], sx[i]) = (y.d, y.s);
            // SAFETY: `qs` is 32 bytes.
            let xq = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            // Σ(q − 16)·x = Σq·x − 16·Σx per pair of bytes, exact in i16 (|x| ≤ 127).
            let x16 = if AFFINE { _mm256_setzero_si256() } else { _mm256_maddubs_epi16(sixteen, xq) };
            for j in 0..NR {
                let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(wq[j], xq), x16);
                sums[i * NR + j] = _mm256_madd_epi16(p16, ones);
            }
        }
        for g in 0..groups {
            let s = _mm_cvtepi32_ps(hsum4_i32([sums[4 * g], sums[4 * g + 1], sums[4 * g + 2], sums[4 * g + 3]]));
            let d = _mm_mul_ps(weight_lanes::<MR, NR>(g, dw), group_lanes::<MR, NR>(g, |i, _| dx[i]));
            let min = if AFFINE {
                _mm_mul_ps(weight_lanes::<MR, NR>(g, mw), group_lanes::<MR, NR>(g, |i, _| sx[i]))
            } else {
                _mm_setzero_ps()
            };
            acc[g] = _mm_add_ps(acc[g], _mm_add_ps(_mm_mul_ps(d, s), min));
        }
    }
    let mut flat = [0f32; 16];
    for (f, a) in flat.chunks_exact_mut(4).zip(&acc) {
        // SAFETY: `f` holds 4 floats.
        unsafe { _mm_storeu_ps(f.as_mut_ptr(), *a) };
    }
    std::array::from_fn(|i| std::array::from_fn(|j| flat[i * NR + j]))
}

#[cfg(test)]
mod tests {
    use super::super::q8::{self, dot, dot_tile, quantize_row_scalar};
    use super::super::test_rng::{finite_f16, fresh_seed, next};
    use super::*;
    use crate::quant::ggml::dequantize_into;
    use crate::tensor::DType;

    fn has_avx2() -> bool {
        super::super::test_rng::avx2_or_skip()
    }

    fn uniform(seed: &mut u64) -> f32 {
        (next(seed) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn random_activations(seed: &mut u64, n: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n).map(|_| uniform(seed) * 4.0).collect();
        for (k, chunk) in x.chunks_mut(32).enumerate() {
            match k % 5 {
                // A zero block, and one where many values scale to exact halves (ties).
                1 => chunk.fill(0.0),
                3 => {
                    for (i, v) in chunk.iter_mut().enumerate() {
                        *v = if i == 0 { 127.0 } else { (next(seed) % 254) as f32 - 127.0 + 0.5 * (i % 2) as f32 };
                    }
                }
                _ => {}
            }
        }
        x
    }

    /// Random weight blocks with finite f16 scales (mins for Q4_1) of either sign.
    fn random_weights(seed: &mut u64, dtype: DType, blocks: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(blocks * dtype.block_bytes());
        for _ in 0..blocks {
            let scales = if dtype == DType::Q4_1 { 2 } else { 1 };
            for _ in 0..scales {
                let v = half::f16::from_f32(uniform(seed) * 0.05);
                w.extend_from_slice(&v.to_le_bytes());
            }
            while !w.len().is_multiple_of(dtype.block_bytes()) {
                w.push(next(seed) as u8);
            }
        }
        w
    }

    #[test]
    fn quantize_row_matches_scalar_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let mut seed = fresh_seed("q8_avx2");
        let start = seed;
        for blocks in [1usize, 7, 18, 49] {
            let x = random_activations(&mut seed, blocks * 32);
            let (mut want, mut got) = (vec![Q8Block::ZERO; blocks], vec![Q8Block::ZERO; blocks]);
            quantize_row_scalar(&x, &mut want);
            // SAFETY: avx2 is present (checked above); lengths match.
            unsafe { quantize_row(&x, &mut got) };
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.qs, b.qs, "block {k}, seed {start}");
                assert_eq!(a.d.to_bits(), b.d.to_bits(), "block {k}, seed {start}");
                assert_eq!(a.s.to_bits(), b.s.to_bits(), "block {k}, seed {start}");
            }
        }
    }

    /// `got[i][j]` against the scalar `dot`: within 1e-5 relative, the
    /// reference being |want| or, when the sum nearly cancels, a tenth of Σ|w·x|.
    fn assert_close<const MR: usize, const NR: usize>(
        what: &str,
        dtype: DType,
        ws: &[Vec<u8>],
        xs: &[Vec<Q8Block>],
        got: [[f32; NR]; MR],
    ) {
        for i in 0..MR {
            for j in 0..NR {
                let want = dot(dtype, &ws[j], &xs[i]);
                let mut wf = vec![0f32; xs[i].len() * 32];
                dequantize_into(dtype, &ws[j], &mut wf);
                let xf = xs[i].iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d));
                let mag: f32 = wf.iter().zip(xf).map(|(a, b)| (a * b).abs()).sum();
                let err = (got[i][j] - want).abs();
                assert!(err <= 1e-5 * want.abs().max(mag * 0.1), "{what} ({i},{j}): {} vs {want}", got[i][j]);
            }
        }
    }

    fn random_rows(seed: &mut u64, dtype: DType, rows: usize, blocks: usize) -> (Vec<Vec<u8>>, Vec<Vec<Q8Block>>) {
        let ws = (0..rows).map(|_| random_weights(seed, dtype, blocks)).collect();
        let xs = (0..4)
            .map(|_| {
                let mut q = vec![Q8Block::ZERO; blocks];
                q8::quantize_row(&random_activations(seed, blocks * 32), &mut q);
                q
            })
            .collect();
        (ws, xs)
    }

    fn check_tile<const MR: usize, const NR: usize>(seed: &mut u64, dtype: DType, blocks: usize) {
        let what = format!("{dtype:?} {MR}x{NR} blocks {blocks} seed {seed}");
        let (ws, xs) = random_rows(seed, dtype, NR, blocks);
        let got = dot_tile::<MR, NR>(dtype, std::array::from_fn(|j| &ws[j][..]), std::array::from_fn(|i| &xs[i][..]));
        assert_close(&what, dtype, &ws, &xs, got);
    }

    /// Saturated weights and activations: the largest block sums the i16 steps must hold.
    #[test]
    fn extreme_blocks_match_scalar_dot() {
        if !has_avx2() {
            return;
        }
        let blocks = 5;
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            for (byte, sign) in [(0x00u8, 1.0f32), (0xff, 1.0), (0x80, -1.0), (0x7f, -1.0), (0x0f, 1.0)] {
                let ws: Vec<Vec<u8>> = (0..4)
                    .map(|j| {
                        let mut w = vec![byte ^ ((j as u8 & 1) * 0xff); blocks * dtype.block_bytes()];
                        for blk in w.chunks_mut(dtype.block_bytes()) {
                            blk[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                            if dtype == DType::Q4_1 {
                                blk[2..4].copy_from_slice(&half::f16::from_f32(-0.25).to_le_bytes());
                            }
                        }
                        w
                    })
                    .collect();
                let xs: Vec<Vec<Q8Block>> = (0..4)
                    .map(|i| {
                        let x: Vec<f32> =
                            (0..blocks * 32).map(|k| if i == 3 && k % 2 == 1 { -sign } else { sign }).collect();
                        let mut q = vec![Q8Block::ZERO; blocks];
                        q8::quantize_row(&x, &mut q);
                        q
                    })
                    .collect();
                let what = format!("{dtype:?} extremes {byte:#x} {sign}");
                let tile =
                    dot_tile::<4, 4>(dtype, std::array::from_fn(|j| &ws[j][..]), std::array::from_fn(|i| &xs[i][..]));
                assert_close(&what, dtype, &ws, &xs, tile);
            }
        }
    }

    #[test]
    fn dot_tiles_match_scalar_dot() {
        if !has_avx2() {
            return;
        }
        let mut seed = fresh_seed("q8_avx2");
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            for blocks in [1usize, 3, 17, 49] {
                check_tile::<1, 1>(&mut seed, dtype, blocks);
                check_tile::<1, 4>(&mut seed, dtype, blocks);
                check_tile::<2, 2>(&mut seed, dtype, blocks);
                check_tile::<3, 1>(&mut seed, dtype, blocks);
                check_tile::<4, 2>(&mut seed, dtype, blocks);
            }
        }
    }
    /// Random Q5_0/Q5_1 blocks: random `qh` and nibble bytes, random finite `d` (and `m`).
    fn random_q5(seed: &mut u64, dtype: DType, blocks: usize) -> Vec<u8> {
        let mut w: Vec<u8> = (0..blocks * dtype.block_bytes()).map(|_| next(seed) as u8).collect();
        let scales = if dtype == DType::Q5_1 { 2 } else { 1 };
        for blk in w.chunks_exact_mut(dtype.block_bytes()) {
            for k in 0..scales {
                blk[2 * k..2 * k + 2].copy_from_slice(&finite_f16(seed).to_le_bytes());
            }
        }
        w
    }

    /// Every output of the `MR`×`NR` Q5 tile (`dot_tile`, which takes the
    /// AVX2 kernel where the callers checked it present) equals the scalar
    /// `dot`'s bits.
    fn assert_q5_bits<const MR: usize, const NR: usize>(what: &str, dtype: DType, ws: &[Vec<u8>], xs: &[Vec<Q8Block>]) {
        let got = dot_tile::<MR, NR>(dtype, std::array::from_fn(|j| &ws[j][..]), std::array::from_fn(|i| &xs[i][..]));
        for i in 0..MR {
            for j in 0..NR {
                let want = dot(dtype, &ws[j], &xs[i]);
                assert_eq!(got[i][j].to_bits(), want.to_bits(), "{what} {MR}x{NR} ({i},{j}): {} vs {want}", got[i][j]);
            }
        }
    }

    fn assert_q5_tiles(what: &str, dtype: DType, ws: &[Vec<u8>], xs: &[Vec<Q8Block>]) {
        assert_q5_bits::<1, 1>(what, dtype, ws, xs);
        assert_q5_bits::<1, 4>(what, dtype, ws, xs);
        assert_q5_bits::<2, 2>(what, dtype, ws, xs);
        assert_q5_bits::<3, 1>(what, dtype, ws, xs);
        assert_q5_bits::<3, 2>(what, dtype, ws, xs);
        assert_q5_bits::<4, 2>(what, dtype, ws, xs);
        assert_q5_bits::<4, 4>(what, dtype, ws, xs);
    }

    /// Random Q5 rows against activations of several magnitudes quantized by
    /// `q8::quantize_row`: the AVX2 tiles return the scalar `dot` bit for bit.
    #[test]
    fn q5_tiles_match_scalar_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let mut seed = fresh_seed("q5");
        let start = seed;
        for dtype in [DType::Q5_0, DType::Q5_1] {
            for n in [32usize, 256, 4096, 12288] {
                let blocks = n / 32;
                let ws: Vec<Vec<u8>> = (0..4).map(|_| random_q5(&mut seed, dtype, blocks)).collect();
                let xs: Vec<Vec<Q8Block>> = [1.0f32, 1e-3, 300.0, 1.0]
                    .iter()
                    .map(|scale| {
                        let x: Vec<f32> = random_activations(&mut seed, n).iter().map(|v| v * scale).collect();
                        let mut q = vec![Q8Block::ZERO; blocks];
                        q8::quantize_row(&x, &mut q);
                        q
                    })
                    .collect();
                assert_q5_tiles(&format!("{dtype:?} n {n} seed {start}"), dtype, &ws, &xs);
            }
        }
    }

    /// Saturated and patterned bytes (levels 0 and 31, alternating `qh` bits)
    /// against ±1 activations (every value quantizing to ±127).
    #[test]
    fn q5_extreme_blocks_match_scalar_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let blocks = 3;
        for dtype in [DType::Q5_0, DType::Q5_1] {
            for byte in [0x00u8, 0xff, 0x80, 0x7f, 0x55, 0xaa] {
                for sign in [1.0f32, -1.0] {
                    let ws: Vec<Vec<u8>> = (0..4)
                        .map(|j| {
                            let mut w = vec![if j == 3 { !byte } else { byte }; blocks * dtype.block_bytes()];
                            for blk in w.chunks_exact_mut(dtype.block_bytes()) {
                                blk[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                                if dtype == DType::Q5_1 {
                                    blk[2..4].copy_from_slice(&half::f16::from_f32(-0.25).to_le_bytes());
                                }
                            }
                            w
                        })
                        .collect();
                    let xs: Vec<Vec<Q8Block>> = (0..4)
                        .map(|i| {
                            let x: Vec<f32> = (0..blocks * 32)
                                .map(|k| if (i == 3 && k % 2 == 1) || (i == 2 && k % 3 == 2) { -sign } else { sign })
                                .collect();
                            let mut q = vec![Q8Block::ZERO; blocks];
                            q8::quantize_row(&x, &mut q);
                            q
                        })
                        .collect();
                    assert_q5_tiles(&format!("{dtype:?} byte {byte:#x} sign {sign}"), dtype, &ws, &xs);
                }
            }
        }
    }
}
