//! Decode dots (one activation row) of Q4_0, Q4_1, Q5_0 and Q8_0 weights on
//! AVX-512 VNNI: two weight rows share each 512-bit register.
//!
//! The AVX2 kernels (`q8_avx2`) follow ggml's float order: per block, 8 i32
//! lanes (lane k: the exact sum of values 4k..4k+4 of one 128-bit half) are
//! converted and fused-multiply-added with the broadcast `d_w·d_x` into 8
//! float lanes, reduced at the end by `hsum`. Here the low 256 bits of a
//! register carry one weight row's 8 lanes and the high 256 bits the next
//! row's, in the same positions, and every lane sees the same operations in
//! the same order, so each row's result equals the AVX2 kernel's bit for bit.
//! What changes is the cost per block: one `vpdpbusd` replaces
//! `maddubs`/`madd` (and the offsets of Q4_0 and Q8_0 become a per-block bias
//! computed once for all rows), and the unpacking, conversion and FMA are
//! shared by two rows.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::act_blocks::Q8Block;
// The AVX2 tiles' reduction (ggml's `hsum_float_8`) and decode prefetch,
// shared so that the two kernel families cannot drift apart.
use super::q8_avx2::{hsum, prefetch_ahead};

/// The 16 nibble bytes at `a` and at `b` as 64 levels: the 128-bit quarters
/// hold a's low nibbles, a's high nibbles, b's low, b's high (each row's half
/// laid out as `q8_avx2`'s nibble unpacking lays out its 256 bits).
///
/// # Safety
/// `a` and `b` point at 16 readable bytes each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
unsafe fn nibble_pair(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes at each.
    let ab = unsafe {
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(a.cast())), _mm_loadu_si128(b.cast()))
    };
    let wide = _mm512_castsi256_si512(ab);
    let aabb = _mm512_shuffle_i64x2::<0b01_01_00_00>(wide, wide);
    _mm512_and_si512(_mm512_srlv_epi64(aabb, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0x0f))
}

/// The 32 bytes at `a` and at `b` in the low and high halves.
///
/// # Safety
/// `a` and `b` point at 32 readable bytes each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
unsafe fn bytes_pair(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 32 readable bytes at each.
    unsafe {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(a.cast())), _mm256_loadu_si256(b.cast()))
    }
}

/// Lanes 0–7 from lane `lo` of `v`, lanes 8–15 from lane `hi`: one scale per
/// row of a pair.
#[target_feature(enable = "avx512f,avx512vl,avx2")]
#[inline]
fn spread(v: __m256, lo: i32, hi: i32) -> __m512 {
    let idx = _mm512_set_epi32(hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo);
    _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v))
}

/// The four f16 scales at `w[j] + at` (one per row) times `dx`, in lanes
/// 0–3 (lanes 4–7 zero).
///
/// # Safety
/// Each `w[j] + at` points at 2 readable bytes.
#[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
#[inline]
unsafe fn row_scales<const NR: usize>(w: &[*const u8; NR], at: usize, dx: f32) -> __m256 {
    // Built in registers (element inserts): a store of the halves and a
    // vector load of them would stall on store forwarding every block.
    // SAFETY: the caller guarantees 2 readable bytes at each row's offset.
    let h = |j: usize| if j < NR { unsafe { w[j].add(at).cast::<i16>().read_unaligned() } } else { 0 };
    let d = _mm256_cvtph_ps(_mm_set_epi16(h(7), h(6), h(5), h(4), h(3), h(2), h(1), h(0)));
    _mm256_mul_ps(d, _mm256_set1_ps(dx))
}

/// The lanes of `acc` reduced per row: row `2p` from the low half of
/// `acc[p]`, row `2p + 1` from the high half.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
#[inline]
fn reduce_pairs<const NR: usize>(acc: &[__m512; NR]) -> [f32; NR] {
    std::array::from_fn(|j| {
        let v = acc[j / 2];
        hsum(if j % 2 == 0 {
            _mm512_castps512_ps256(v)
        } else {
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
        })
    })
}

/// Q4_0 weight rows `w` (`NR` even, at most 8) against one row of `blocks`
/// `Q8Block`s: equal to `q8_avx2::tile_q4_0::<1, NR>` bit for bit.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; each `w[j]` points at
/// `blocks` Q4_0 blocks and `x` at `blocks` `Q8Block`s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows_q4_0<const NR: usize>(w: [*const u8; NR], x: *const Q8Block, blocks: usize) -> [f32; NR] {
    debug_assert!(NR.is_multiple_of(2) && NR <= 8);
    let mut acc = [_mm512_setzero_ps(); NR];
    for b in 0..blocks {
        prefetch_ahead::<1, NR>(&w, b * 18, blocks * 18);
        // SAFETY: block `b` of `x` is in bounds (caller's contract).
        let y = unsafe { &*x.add(b) };
        // SAFETY: `qs` is 32 bytes.
        let xq = _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) });
        // Σ(q − 8)·x per 4-value chunk = Σq·x − 8·Σx: the bias is the same for every row.
        let bias = _mm512_sub_epi32(
            _mm512_setzero_si512(),
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), xq),
        );
        // SAFETY: every row's block `b` starts with its f16 scale.
        let d = unsafe { row_scales(&w, b * 18, y.d) };
        for p in 0..NR / 2 {
            // SAFETY: block `b` of rows 2p and 2p + 1 is in bounds.
            let q = unsafe { nibble_pair(w[2 * p].add(b * 18 + 2), w[2 * p + 1].add(b * 18 + 2)) };
            let sum = _mm512_dpbusd_epi32(bias, q, xq);
            acc[p] = _mm512_fmadd_ps(spread(d, 2 * p as i32, 2 * p as i32 + 1), _mm512_cvtepi32_ps(sum), acc[p]);
        }
    }
    reduce_pairs(&acc)
}

/// Q4_1 weight rows (`d`, `m`, 16 nibble bytes; w = d·q + m) against one row
/// of `Q8Block`s: equal to `q8_avx2::tile_q4_1::<1, NR>` bit for bit (the
/// `m·s` terms summed per row in block order, added after the reduction).
///
/// # Safety
/// As [`rows_q4_0`], with Q4_1 blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows_q4_1<const NR: usize>(w: [*const u8; NR], x: *const Q8Block, blocks: usize) -> [f32; NR] {
    debug_assert!(NR.is_multiple_of(2) && NR <= 4);
    let mut acc = [_mm512_setzero_ps(); NR];
    // Lanes 2j and 2j + 1: row j's d·d_x (unused) and its running Σ m·s.
    let mut mins = _mm256_setzero_ps();
    for b in 0..blocks {
        prefetch_ahead::<1, NR>(&w, b * 20, blocks * 20);
        // SAFETY: block `b` of `x` is in bounds (caller's contract).
        let y = unsafe { &*x.add(b) };
        // SAFETY: `qs` is 32 bytes.
        let xq = _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) });
        // SAFETY: block `b` of each row starts with its f16 `d` and `m`.
        let dm = |j: usize| if j < NR { unsafe { w[j].add(b * 20).cast::<i32>().read_unaligned() } } else { 0 };
        // [d0, m0, d1, m1, ...] times [d_x, s_x, ...]: the scales and this block's
        // min terms (built in registers, not through memory: see `row_scales`).
        let dmv = _mm256_cvtph_ps(_mm_set_epi32(dm(3), dm(2), dm(1), dm(0)));
        let prod = _mm256_mul_ps(
            dmv,
            _mm256_castsi256_ps(_mm256_set1_epi64x((y.d.to_bits() as u64 | (y.s.to_bits() as u64) << 32) as i64)),
        );
        mins = _mm256_add_ps(mins, prod);
        for p in 0..NR / 2 {
            // SAFETY: block `b` of rows 2p and 2p + 1 is in bounds.
            let q = unsafe { nibble_pair(w[2 * p].add(b * 20 + 4), w[2 * p + 1].add(b * 20 + 4)) };
            let sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq);
            let scale = spread(prod, 4 * p as i32, 4 * p as i32 + 2);
            acc[p] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[p]);
        }
    }
    let mut m = [0f32; 8];
    // SAFETY: `m` holds 8 floats.
    unsafe { _mm256_storeu_ps(m.as_mut_ptr(), mins) };
    let mut out = reduce_pairs(&acc);
    for (j, o) in out.iter_mut().enumerate() {
        *o += m[2 * j + 1];
    }
    out
}

/// Q5_0 weight rows (`d`, 4 bytes `qh`, 16 nibble bytes; w = d·(q − 16),
/// bit `k` of `qh` the 5th bit of value `k`) against one row of `Q8Block`s:
/// equal to `q8_avx2::tile_q5_0::<1, NR>`, and so to the scalar dot, bit for
/// bit. Each block's sums are exact integers (the order of the lanes does not
/// matter), then the scalar's float step `acc + ((d_w·d_x)·s + 0)` per row.
///
/// # Safety
/// As [`rows_q4_0`], with Q5_0 blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows_q5_0<const NR: usize>(w: [*const u8; NR], x: *const Q8Block, blocks: usize) -> [f32; NR] {
    debug_assert!(NR.is_multiple_of(2) && NR <= 4);
    let mut acc = _mm_setzero_ps();
    let sixteen = _mm512_set1_epi8(16);
    for b in 0..blocks {
        prefetch_ahead::<1, NR>(&w, b * 22, blocks * 22);
        // SAFETY: block `b` of `x` is in bounds (caller's contract).
        let y = unsafe { &*x.add(b) };
        // SAFETY: `qs` is 32 bytes.
        let xq = _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) });
        // Σ(q − 16)·x per 4-value chunk = Σq·x − 16·Σx: the bias is the same for every row.
        let bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), sixteen, xq));
        let mut sums = [_mm256_setzero_si256(); 4];
        for p in 0..NR / 2 {
            // SAFETY: block `b` of rows 2p and 2p + 1 is in bounds: `qh` at byte 2,
            // the nibbles at bytes 6..22.
            let (lo, hi, q) = unsafe {
                let (a, c) = (w[2 * p].add(b * 22), w[2 * p + 1].add(b * 22));
                let qh = |r: *const u8| r.add(2).cast::<u32>().read_unaligned() as u64;
                (qh(a), qh(c), nibble_pair(a.add(6), c.add(6)))
            };
            // Byte k of each half is value k: the 5th bits of both rows as one byte mask.
            let q = _mm512_mask_add_epi8(q, lo | hi << 32, q, sixteen);
            let sum = _mm512_dpbusd_epi32(bias, q, xq);
            sums[2 * p] = _mm512_castsi512_si256(sum);
            sums[2 * p + 1] = _mm512_extracti64x4_epi64::<1>(sum);
        }
        let s = _mm_cvtepi32_ps(super::q8_avx2::hsum4_i32(sums));
        // SAFETY: every row's block `b` starts with its f16 scale.
        let d = _mm256_castps256_ps128(unsafe { row_scales(&w, b * 22, y.d) });
        acc = _mm_add_ps(acc, _mm_add_ps(_mm_mul_ps(d, s), _mm_setzero_ps()));
    }
    let mut out = [0f32; 4];
    // SAFETY: `out` holds 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), acc) };
    std::array::from_fn(|j| out[j])
}

/// Q8_0 weight rows (`d`, 32 signed bytes) against one row of `Q8Block`s:
/// equal to `q8_avx2::tile_q8_0::<1, NR>` bit for bit.
///
/// # Safety
/// As [`rows_q4_0`], with Q8_0 blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows_q8_0<const NR: usize>(w: [*const u8; NR], x: *const Q8Block, blocks: usize) -> [f32; NR] {
    debug_assert!(NR.is_multiple_of(2) && NR <= 8);
    let mut acc = [_mm512_setzero_ps(); NR];
    let flip = _mm512_set1_epi8(-128);
    for b in 0..blocks {
        prefetch_ahead::<1, NR>(&w, b * 34, blocks * 34);
        // SAFETY: block `b` of `x` is in bounds (caller's contract).
        let y = unsafe { &*x.add(b) };
        // SAFETY: `qs` is 32 bytes.
        let xq = _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) });
        // Signed weights as unsigned w + 128: Σw·x = Σ(w + 128)·x − 128·Σx per chunk.
        let bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, xq));
        // SAFETY: every row's block `b` starts with its f16 scale.
        let d = unsafe { row_scales(&w, b * 34, y.d) };
        for p in 0..NR / 2 {
            // SAFETY: block `b` of rows 2p and 2p + 1 is in bounds.
            let q = unsafe { bytes_pair(w[2 * p].add(b * 34 + 2), w[2 * p + 1].add(b * 34 + 2)) };
            let sum = _mm512_dpbusd_epi32(bias, _mm512_xor_si512(q, flip), xq);
            acc[p] = _mm512_fmadd_ps(spread(d, 2 * p as i32, 2 * p as i32 + 1), _mm512_cvtepi32_ps(sum), acc[p]);
        }
    }
    reduce_pairs(&acc)
}

#[cfg(test)]
mod tests {
    use super::super::q8_avx2;
    use super::super::test_rng::{avx512_vnni_or_skip, finite_f16, fresh_seed, next};
    use super::*;
    use crate::tensor::DType;

    /// `rows` rows of `blocks` random blocks (any finite f16 scales), or with
    /// every level byte `fill` (saturated levels) and scales of 0.5.
    fn weights(seed: &mut u64, dtype: DType, rows: usize, blocks: usize, fill: Option<u8>) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut w: Vec<u8> = (0..rows * blocks * bb).map(|_| fill.unwrap_or(next(seed) as u8)).collect();
        let f16s = if dtype == DType::Q4_1 { 2 } else { 1 };
        for blk in w.chunks_exact_mut(bb) {
            for k in 0..f16s {
                let v = if fill.is_some() { half::f16::from_f32(0.5) } else { finite_f16(seed) };
                blk[2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    /// Random activation blocks, or every level `fill` (±127 saturates the sums).
    fn activations(seed: &mut u64, blocks: usize, fill: Option<i8>) -> Vec<Q8Block> {
        (0..blocks)
            .map(|_| Q8Block {
                d: half::f16::from_bits(next(seed) as u16 & 0x7bff).to_f32(),
                s: finite_f16(seed).to_f32(),
                qs: std::array::from_fn(|_| fill.unwrap_or(((next(seed) % 255) as i32 - 127) as i8)),
            })
            .collect()
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn check<const NR: usize>(dtype: DType, w: &[u8], x: &[Q8Block], blocks: usize, what: &str) {
        let rb = blocks * dtype.block_bytes();
        let rows: [*const u8; NR] = std::array::from_fn(|j| w[j * rb..].as_ptr());
        // SAFETY: AVX-512 VNNI is present (the caller checked), and so AVX2, FMA
        // and F16C; every row and `x` hold `blocks` blocks.
        let (got, want) = unsafe {
            match dtype {
                DType::Q4_0 => (
                    rows_q4_0::<NR>(rows, x.as_ptr(), blocks),
                    q8_avx2::tile_q4_0::<1, NR>(rows, [x.as_ptr()], blocks)[0],
                ),
                DType::Q4_1 => (
                    rows_q4_1::<NR>(rows, x.as_ptr(), blocks),
                    q8_avx2::tile_q4_1::<1, NR>(rows, [x.as_ptr()], blocks)[0],
                ),
                DType::Q5_0 => (
                    rows_q5_0::<NR>(rows, x.as_ptr(), blocks),
                    q8_avx2::tile_q5_0::<1, NR>(rows, [x.as_ptr()], blocks)[0],
                ),
                _ => (
                    rows_q8_0::<NR>(rows, x.as_ptr(), blocks),
                    q8_avx2::tile_q8_0::<1, NR>(rows, [x.as_ptr()], blocks)[0],
                ),
            }
        };
        for j in 0..NR {
            assert!(
                same(got[j], want[j]),
                "{} {what}, {blocks} blocks, row {j}/{NR}: {} vs AVX2 {}",
                dtype.name(),
                got[j],
                want[j]
            );
        }
    }

    #[test]
    fn decode_rows_equal_the_avx2_tiles_bit_for_bit() {
        if !avx512_vnni_or_skip() {
            return;
        }
        let mut seed = fresh_seed("q8_avx512");
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q8_0] {
            for blocks in [1usize, 2, 18, 48] {
                for _ in 0..20 {
                    let w = weights(&mut seed, dtype, 4, blocks, None);
                    let x = activations(&mut seed, blocks, None);
                    check::<2>(dtype, &w, &x, blocks, "random");
                    check::<4>(dtype, &w, &x, blocks, "random");
                }
                for (wf, xf) in [(0xffu8, 127i8), (0xff, -127), (0x00, 127), (0x80, -127), (0x7f, 127)] {
                    let w = weights(&mut seed, dtype, 4, blocks, Some(wf));
                    let x = activations(&mut seed, blocks, Some(xf));
                    check::<4>(dtype, &w, &x, blocks, &format!("levels {wf:#x}, activations {xf}"));
                }
            }
        }
    }
}
