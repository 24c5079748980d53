//! AVX2 kernels for affine-quantized weights (MLX layout, see [`crate::quant::affine`]).
//!
//! Every run of 8 values fills exactly `bits` bytes, so each kernel step reads
//! those bytes as one integer, shifts every value into its own 32-bit lane and
//! dequantizes all 8 at once as `scale·q + bias`, the arithmetic mlx itself
//! uses. Activations stay f32: MLX models are compared against mlx-lm, which
//! does not quantize activations.

use std::arch::x86_64::*;

/// Reads the `bits` bytes that hold 8 packed values, without reading past them
/// (the last run of a matrix may end the mapped file).
///
/// # Safety
/// `p` points at `bits` readable bytes.
#[inline(always)]
unsafe fn run_bits(bits: u32, p: *const u8) -> u64 {
    // SAFETY: each arm reads exactly `bits` bytes from `p` (caller's contract).
    unsafe {
        let u16_at = |o: usize| p.add(o).cast::<u16>().read_unaligned() as u64;
        let u32_at = |o: usize| p.add(o).cast::<u32>().read_unaligned() as u64;
        match bits {
            2 => u16_at(0),
            3 => u16_at(0) | (*p.add(2) as u64) << 16,
            4 => u32_at(0),
            5 => u32_at(0) | (*p.add(4) as u64) << 32,
            6 => u32_at(0) | u16_at(4) << 32,
            _ => p.cast::<u64>().read_unaligned(),
        }
    }
}

/// The 8 levels of one run as i32 lanes, value `k` in lane `k`.
#[inline]
#[target_feature(enable = "avx2")]
fn levels(bits: u32, run: u64) -> __m256i {
    let mask = _mm256_set1_epi32((1i32 << bits) - 1);
    if bits <= 4 {
        // 8 values fit 32 bits: shift lane k right by k·bits.
        let b = bits as i32;
        let shifts = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
        return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(run as u32 as i32), shifts), mask);
    }
    if bits == 8 {
        return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(run as i64));
    }
    // 5 or 6 bits: shift 64-bit lanes, then keep each lane's low half.
    let b = bits as i64;
    let all = _mm256_set1_epi64x(run as i64);
    let lo = _mm256_srlv_epi64(all, _mm256_setr_epi64x(0, b, 2 * b, 3 * b));
    let hi = _mm256_srlv_epi64(all, _mm256_setr_epi64x(4 * b, 5 * b, 6 * b, 7 * b));
    // Low halves of lo and hi: [0, 1, 4, 5 | 2, 3, 6, 7] per 128-bit half, then reorder.
    let mixed =
        _mm256_castps_si256(_mm256_shuffle_ps::<0b10_00_10_00>(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)));
    _mm256_and_si256(_mm256_permute4x64_epi64::<0b11_01_10_00>(mixed), mask)
}

/// One weight row: packed bytes and its per-group scales and biases.
#[derive(Clone, Copy)]
pub struct AffineRow {
    pub packed: *const u8,
    pub scales: *const f32,
    pub biases: *const f32,
}

/// The levels of run `run_index` of `row`, as floats.
///
/// # Safety
/// `row` holds at least `run_index + 1` runs.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn levels8<const BITS: u32>(row: AffineRow, run_index: usize) -> __m256 {
    // SAFETY: in bounds by the caller's contract.
    let run = unsafe { run_bits(BITS, row.packed.add(run_index * BITS as usize)) };
    _mm256_cvtepi32_ps(levels(BITS, run))
}

/// `s·q + b`, rounded after the product and after the sum as `mx.dequantize`
/// rounds it (a fused multiply-add would round once and drift from mlx-lm).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dequantize8(q: __m256, s: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(_mm256_mul_ps(q, s), b)
}

/// Group `g`'s scale and bias of `row`, broadcast.
///
/// # Safety
/// `row` holds at least `g + 1` groups.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scale_bias(row: AffineRow, g: usize) -> (__m256, __m256) {
    // SAFETY: in bounds by the caller's contract.
    unsafe { (_mm256_set1_ps(*row.scales.add(g)), _mm256_set1_ps(*row.biases.add(g))) }
}

/// Dequantizes one row of `cols` values into `out`.
///
/// # Safety
/// The CPU supports avx2 and fma; `row` holds `cols` values in groups of
/// `group_size` (a multiple of 32); `out` has room for `cols` floats.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dequantize_row<const BITS: u32>(group_size: usize, row: AffineRow, cols: usize, out: *mut f32) {
    let runs_per_group = group_size / 8;
    for g in 0..cols / group_size {
        // SAFETY: g < cols/group_size (caller's contract).
        let (s, b) = unsafe { scale_bias(row, g) };
        for run in g * runs_per_group..(g + 1) * runs_per_group {
            // SAFETY: run < cols/8 (caller's contract); out holds cols floats.
            unsafe { _mm256_storeu_ps(out.add(8 * run), dequantize8(levels8::<BITS>(row, run), s, b)) };
        }
    }
}

/// `out[j]` = Σ_c `x[c]`·`W_j[c]` for `NR` rows: one activation row (decode)
/// against rows dequantized in registers, 8 values at a time.
///
/// # Safety
/// As [`dequantize_row`] for every row; `x` points at `cols` floats.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_rows<const BITS: u32, const NR: usize>(
    group_size: usize,
    rows: [AffineRow; NR],
    x: *const f32,
    cols: usize,
) -> [f32; NR] {
    // Two accumulators per row (even and odd runs) so consecutive FMAs do not
    // wait on each other; groups hold a multiple of 4 runs.
    let mut even = [_mm256_setzero_ps(); NR];
    let mut odd = [_mm256_setzero_ps(); NR];
    let runs_per_group = group_size / 8;
    for g in 0..cols / group_size {
        // SAFETY: g < cols/group_size (caller's contract).
        let sb: [(__m256, __m256); NR] = std::array::from_fn(|j| unsafe { scale_bias(rows[j], g) });
        let mut run = g * runs_per_group;
        while run < (g + 1) * runs_per_group {
            // SAFETY: run + 1 < cols/8 (caller's contract).
            let (x0, x1) = unsafe { (_mm256_loadu_ps(x.add(8 * run)), _mm256_loadu_ps(x.add(8 * run + 8))) };
            for j in 0..NR {
                let (s, b) = sb[j];
                // SAFETY: as above.
                let (q0, q1) = unsafe { (levels8::<BITS>(rows[j], run), levels8::<BITS>(rows[j], run + 1)) };
                even[j] = _mm256_fmadd_ps(x0, dequantize8(q0, s, b), even[j]);
                odd[j] = _mm256_fmadd_ps(x1, dequantize8(q1, s, b), odd[j]);
            }
            run += 2;
        }
    }
    std::array::from_fn(|j| hsum(_mm256_add_ps(even[j], odd[j])))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}
