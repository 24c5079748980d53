//! The affine (MLX) decode dot of `affine_avx2` on AVX-512: two weight rows
//! share each 512-bit register, row `j` in the low 256 bits and row `j + 1`
//! in the high 256 bits. Every lane sees the AVX2 kernel's operations in its
//! order (levels, `s·q + b` rounded twice, FMA into the even- and odd-run
//! accumulators, the same reduction), so each row's result equals
//! [`super::affine_avx2::dot_rows`]'s bit for bit; the conversion, the
//! dequantization and the FMAs are shared by the two rows.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::affine_avx2::{AffineRow, levels, run_bits};

/// Row 0's 8 values in the low half, row 1's in the high half.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The levels of run `run` of both rows, as floats.
///
/// # Safety
/// Both rows hold at least `run + 1` runs.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn levels_pair<const BITS: u32>(rows: [AffineRow; 2], run: usize) -> __m512 {
    // SAFETY: in bounds by the caller's contract.
    let (r0, r1) = unsafe {
        (
            run_bits(BITS, rows[0].packed.add(run * BITS as usize)),
            run_bits(BITS, rows[1].packed.add(run * BITS as usize)),
        )
    };
    let q = if BITS <= 4 {
        // 8 values fit 32 bits: lane k of each half shifted right by (k mod 8)·bits.
        let b = BITS as i32;
        let shifts = _mm512_setr_epi32(
            0,
            b,
            2 * b,
            3 * b,
            4 * b,
            5 * b,
            6 * b,
            7 * b,
            0,
            b,
            2 * b,
            3 * b,
            4 * b,
            5 * b,
            6 * b,
            7 * b,
        );
        let both = join(_mm256_set1_epi32(r0 as u32 as i32), _mm256_set1_epi32(r1 as u32 as i32));
        _mm512_and_si512(_mm512_srlv_epi32(both, shifts), _mm512_set1_epi32((1 << BITS) - 1))
    } else {
        join(levels(BITS, r0), levels(BITS, r1))
    };
    _mm512_cvtepi32_ps(q)
}

/// Group `g`'s scales and biases of both rows, each over its half.
///
/// # Safety
/// Both rows hold at least `g + 1` groups.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn scale_bias_pair(rows: [AffineRow; 2], g: usize) -> (__m512, __m512) {
    let half = |v0: f32, v1: f32| {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(v0))),
            _mm256_castps_pd(_mm256_set1_ps(v1)),
        ))
    };
    // SAFETY: in bounds by the caller's contract.
    unsafe {
        (half(*rows[0].scales.add(g), *rows[1].scales.add(g)), half(*rows[0].biases.add(g), *rows[1].biases.add(g)))
    }
}

/// 8 activations at `p`, in both halves.
///
/// # Safety
/// `p` points at 8 readable floats.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn x_pair(p: *const f32) -> __m512 {
    // SAFETY: the caller guarantees 8 floats.
    _mm512_castpd_ps(_mm512_broadcast_f64x4(unsafe { _mm256_loadu_pd(p.cast()) }))
}

/// ggml's `hsum_float_8` order, as `affine_avx2`'s reduction.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// `[Σ_c x[c]·W_0[c], Σ_c x[c]·W_1[c]]`, equal to
/// `affine_avx2::dot_rows::<BITS, 2>` bit for bit.
///
/// # Safety
/// The CPU has AVX-512 F, AVX2 and FMA; both rows hold `cols` values in
/// groups of `group_size` (a multiple of 32); `x` points at `cols` floats.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_row_pair<const BITS: u32>(
    group_size: usize,
    rows: [AffineRow; 2],
    x: *const f32,
    cols: usize,
) -> [f32; 2] {
    let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let runs_per_group = group_size / 8;
    for g in 0..cols / group_size {
        // SAFETY: g < cols/group_size (caller's contract).
        let (s, b) = unsafe { scale_bias_pair(rows, g) };
        let mut run = g * runs_per_group;
        while run < (g + 1) * runs_per_group {
            // SAFETY: run + 1 < cols/8 (caller's contract).
            unsafe {
                let (x0, x1) = (x_pair(x.add(8 * run)), x_pair(x.add(8 * run + 8)));
                let (q0, q1) = (levels_pair::<BITS>(rows, run), levels_pair::<BITS>(rows, run + 1));
                even = _mm512_fmadd_ps(x0, _mm512_add_ps(_mm512_mul_ps(q0, s), b), even);
                odd = _mm512_fmadd_ps(x1, _mm512_add_ps(_mm512_mul_ps(q1, s), b), odd);
            }
            run += 2;
        }
    }
    let sum = _mm512_add_ps(even, odd);
    let lo = _mm512_castps512_ps256(sum);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sum)));
    [hsum(lo), hsum(hi)]
}

#[cfg(test)]
mod tests {
    use super::super::affine_avx2::dot_rows;
    use super::super::test_rng::{fresh_seed, next};
    use super::*;

    fn uniform(seed: &mut u64) -> f32 {
        (next(seed) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    #[test]
    fn row_pairs_equal_the_avx2_dot_bit_for_bit() {
        if !super::super::simd::has_avx512_vnni() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut seed = fresh_seed("affine_avx512");
        for bits in crate::quant::affine::SUPPORTED_BITS {
            for (group_size, cols) in [(32usize, 256usize), (64, 576), (128, 1024), (64, 64)] {
                let rb = cols * bits as usize / 8;
                // Every byte pattern, including runs whose last value is all ones.
                let packed: Vec<u8> = (0..2 * rb).map(|_| next(&mut seed) as u8).collect();
                let groups = cols / group_size;
                let scales: Vec<f32> = (0..2 * groups).map(|_| uniform(&mut seed) * 0.05).collect();
                let biases: Vec<f32> = (0..2 * groups).map(|_| uniform(&mut seed) * 0.3).collect();
                let x: Vec<f32> = (0..cols).map(|_| uniform(&mut seed) * 4.0).collect();
                let row = |j: usize| AffineRow {
                    packed: packed[j * rb..].as_ptr(),
                    scales: scales[j * groups..].as_ptr(),
                    biases: biases[j * groups..].as_ptr(),
                };
                let (got, want) = both_kernels(bits, group_size, [row(0), row(1)], &x);
                for j in 0..2 {
                    assert_eq!(
                        got[j].to_bits(),
                        want[j].to_bits(),
                        "{bits} bits, groups of {group_size}, {cols} columns, row {j}: {} vs AVX2 {}",
                        got[j],
                        want[j]
                    );
                }
            }
        }
    }

    /// Both kernels at the run-time width `bits`.
    fn both_kernels(bits: u32, gs: usize, rows: [AffineRow; 2], x: &[f32]) -> ([f32; 2], [f32; 2]) {
        let cols = x.len();
        // SAFETY: AVX-512 F, AVX2 and FMA are present (checked by the caller);
        // both rows hold `cols` values in whole groups; x holds `cols` floats.
        unsafe {
            match bits {
                2 => (dot_row_pair::<2>(gs, rows, x.as_ptr(), cols), dot_rows::<2, 2>(gs, rows, x.as_ptr(), cols)),
                3 => (dot_row_pair::<3>(gs, rows, x.as_ptr(), cols), dot_rows::<3, 2>(gs, rows, x.as_ptr(), cols)),
                4 => (dot_row_pair::<4>(gs, rows, x.as_ptr(), cols), dot_rows::<4, 2>(gs, rows, x.as_ptr(), cols)),
                5 => (dot_row_pair::<5>(gs, rows, x.as_ptr(), cols), dot_rows::<5, 2>(gs, rows, x.as_ptr(), cols)),
                6 => (dot_row_pair::<6>(gs, rows, x.as_ptr(), cols), dot_rows::<6, 2>(gs, rows, x.as_ptr(), cols)),
                _ => (dot_row_pair::<8>(gs, rows, x.as_ptr(), cols), dot_rows::<8, 2>(gs, rows, x.as_ptr(), cols)),
            }
        }
    }
}
