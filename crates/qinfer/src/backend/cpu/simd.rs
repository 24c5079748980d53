//! f32 dot products and axpy, compiled twice: once for AVX2+FMA (chosen at run
//! time when the CPU has it) and once portable. The bodies are plain loops over
//! 16-wide chunks with independent accumulators so LLVM vectorizes both.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

macro_rules! dot_body {
    ($a:expr, $b:expr, $fma:expr) => {{
        let (a, b) = ($a, $b);
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let mut acc = [0f32; 16];
        let mut ca = a.chunks_exact(16);
        let mut cb = b.chunks_exact(16);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for j in 0..16 {
                acc[j] = $fma(x[j], y[j], acc[j]);
            }
        }
        let mut tail = 0f32;
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            tail += x * y;
        }
        let mut s8 = [0f32; 8];
        for j in 0..8 {
            s8[j] = acc[j] + acc[j + 8];
        }
        (s8[0] + s8[4]) + (s8[1] + s8[5]) + (s8[2] + s8[6]) + (s8[3] + s8[7]) + tail
    }};
}

/// The loop form of [`dot_avx2`] (its test compares the two).
#[cfg(all(test, target_arch = "x86_64"))]
#[inline(always)]
fn fused(x: f32, y: f32, acc: f32) -> f32 {
    x.mul_add(y, acc)
}
#[inline(always)]
fn unfused(x: f32, y: f32, acc: f32) -> f32 {
    acc + x * y
}

/// [`dot_body`]'s arithmetic in registers: the 16 accumulators as two
/// 8-lane vectors (LLVM leaves the array form scalar), then the same
/// reduction in the same order, so the bits are those of the loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let whole = n / 16 * 16;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < whole {
        // SAFETY: i + 16 <= n, within both slices.
        unsafe {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), hi);
        }
        i += 16;
    }
    let mut tail = 0f32;
    for j in whole..n {
        tail += a[j] * b[j];
    }
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let mut t = [0f32; 4];
    // SAFETY: t holds 4 floats.
    unsafe { _mm_storeu_ps(t.as_mut_ptr(), s4) };
    t[0] + t[1] + t[2] + t[3] + tail
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, unfused)
}

/// [`dot`]'s AVX2 arithmetic, inlined into the caller: for kernels that are
/// themselves compiled for AVX2+FMA (bit-identical to [`dot`] there).
///
/// # Safety
/// The CPU supports avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dot_fused(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller's CPU supports avx2 and fma.
    unsafe { dot_avx2(a, b) }
}

/// [`axpy`]'s AVX2 arithmetic, inlined into the caller (see [`dot_fused`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn axpy_fused(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

fn axpy_portable(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// The widest family of CPU kernels qinfer may use: the best the CPU has by
/// default; lower it (`--cpu-kernels`) to run and measure a narrower path
/// on a CPU that has a wider one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum CpuKernels {
    /// Plain Rust, no SIMD intrinsics.
    Portable,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512 (F, BW, VL, VNNI) where the CPU has it, else AVX2.
    #[default]
    Avx512,
}

impl std::str::FromStr for CpuKernels {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "avx512" => Ok(CpuKernels::Avx512),
            "avx2" => Ok(CpuKernels::Avx2),
            "portable" => Ok(CpuKernels::Portable),
            _ => Err(format!("unknown CPU kernel family `{s}` (expected auto, avx512, avx2 or portable)")),
        }
    }
}

static KERNEL_LIMIT: AtomicU8 = AtomicU8::new(CpuKernels::Avx512 as u8);

/// Caps the CPU kernels at `limit` for the rest of the process (set it before
/// the first forward pass).
pub fn limit_cpu_kernels(limit: CpuKernels) {
    KERNEL_LIMIT.store(limit as u8, Ordering::Relaxed);
}

fn allowed(k: CpuKernels) -> bool {
    KERNEL_LIMIT.load(Ordering::Relaxed) >= k as u8
}

/// Whether the AVX2 kernels may run: AVX2, FMA and F16C (every AVX2 CPU in
/// practice has all three). Always false elsewhere, where nothing asks.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    allowed(CpuKernels::Avx2)
        && *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
}

/// Whether the AVX-512 VNNI kernels may run: AVX-512 F, BW, VL and VNNI, on top
/// of what [`has_avx2`] needs.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn has_avx512_vnni() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    allowed(CpuKernels::Avx512)
        && has_avx2()
        && *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
}

/// Σ a[i]·b[i] over the shorter length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
}

/// y += alpha·x.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked above).
        return unsafe { axpy_avx2(alpha, x, y) };
    }
    axpy_portable(alpha, x, y)
}

/// Float weights for [`float_tile`]: the stored widths LLVM cannot widen for us.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatWeights {
    F32,
    F16,
    BF16,
}

/// `out[i][j]` = Σ_c `x[i][c]`·`w[j][c]` for weight rows stored as `kind`,
/// widened 8 at a time in registers: each widened vector serves `MR` activation
/// rows and the `MR·NR` sums stay in registers.
///
/// # Safety
/// The CPU supports avx2, fma and f16c ([`has_avx2`]); every `x[i]` points at
/// `cols` floats and every `w[j]` at `cols` values of `kind`.
/// Every tile shape does the same arithmetic per output (8 lane sums, then
/// the tail in order), so a row's result never depends on how many rows
/// share its batch.
#[cfg(target_arch = "x86_64")]
pub unsafe fn float_tile<const MR: usize, const NR: usize>(
    kind: FloatWeights,
    w: [*const u8; NR],
    x: [*const f32; MR],
    cols: usize,
) -> [[f32; NR]; MR] {
    // bf16 decode only: f16's 512-bit conversion measured no faster.
    if MR == 1 && NR == 4 && kind == FloatWeights::BF16 && has_avx512_vnni() {
        // SAFETY: the caller's contract; AVX-512 F is present (checked above).
        let v = unsafe { bf16_rows4_avx512([w[0], w[1], w[2], w[3]], x[0], cols) };
        let mut out = [[0f32; NR]; MR];
        out[0].copy_from_slice(&v);
        return out;
    }
    // SAFETY: the caller's contract.
    unsafe { float_tile_avx2::<MR, NR>(kind, w, x, cols) }
}

/// One activation row against 4 bf16 weight rows, two rows a 512-bit
/// register: each row's 8 lanes take the FMAs [`float_tile_avx2`] gives them,
/// in the same order, and are summed the same way, so the sums are equal bit
/// for bit.
///
/// # Safety
/// As [`float_tile`] with bf16 rows, and the CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn bf16_rows4_avx512(w: [*const u8; 4], x: *const f32, cols: usize) -> [f32; 4] {
    use std::arch::x86_64::*;
    // Rows a and b at column c, 8 values each: bf16 is the top half of an f32.
    // SAFETY (all loads below): c + 8 <= cols, within every row (caller's contract).
    let pair = |a: *const u8, b: *const u8, c: usize| unsafe {
        let both = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(a.add(2 * c).cast())),
            _mm_loadu_si128(b.add(2 * c).cast()),
        );
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(both)))
    };
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut c = 0;
    while c + 8 <= cols {
        // SAFETY: as above.
        let x8 = unsafe { _mm256_loadu_ps(x.add(c)) };
        let xv = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(x8)),
            _mm256_castps_pd(x8),
        ));
        acc[0] = _mm512_fmadd_ps(xv, pair(w[0], w[1], c), acc[0]);
        acc[1] = _mm512_fmadd_ps(xv, pair(w[2], w[3], c), acc[1]);
        c += 8;
    }
    let halves = [
        _mm512_castps512_ps256(acc[0]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[0]))),
        _mm512_castps512_ps256(acc[1]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[1]))),
    ];
    // SAFETY: the same contract, for the tails the AVX2 tile sums.
    std::array::from_fn(|j| unsafe { float_lanes_and_tail(FloatWeights::BF16, halves[j], w[j], x, c, cols) })
}

/// [`float_tile`] on AVX2: 8 values a step.
///
/// # Safety
/// As [`float_tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_tile_avx2<const MR: usize, const NR: usize>(
    kind: FloatWeights,
    w: [*const u8; NR],
    x: [*const f32; MR],
    cols: usize,
) -> [[f32; NR]; MR] {
    use std::arch::x86_64::*;
    // SAFETY (all loads below): c + 8 <= cols, within every row (caller's contract).
    let load = |p: *const u8, c: usize| unsafe {
        match kind {
            FloatWeights::F32 => _mm256_loadu_ps(p.add(4 * c).cast()),
            FloatWeights::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * c).cast())),
            // bf16 is the top half of an f32.
            FloatWeights::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                p.add(2 * c).cast(),
            )))),
        }
    };
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let mut c = 0;
    while c + 8 <= cols {
        let wv: [__m256; NR] = std::array::from_fn(|j| load(w[j], c));
        for i in 0..MR {
            // SAFETY: as above.
            let xv = unsafe { _mm256_loadu_ps(x[i].add(c)) };
            for j in 0..NR {
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
        c += 8;
    }
    let mut out = [[0f32; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            // SAFETY: the caller's contract.
            out[i][j] = unsafe { float_lanes_and_tail(kind, acc[i][j], w[j], x[i], c, cols) };
        }
    }
    out
}

/// The 8 lane sums of one output added up as [`super::q8_avx2::hsum`] does,
/// plus the columns `c..cols` past the last whole step in order.
///
/// # Safety
/// `x` points at `cols` floats and `w` at `cols` values of `kind`; AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_lanes_and_tail(
    kind: FloatWeights,
    v: std::arch::x86_64::__m256,
    w: *const u8,
    x: *const f32,
    c: usize,
    cols: usize,
) -> f32 {
    let mut sum = super::q8_avx2::hsum(v);
    for k in c..cols {
        // SAFETY: k < cols, so `x[k]` and the value at `w` + its width · k are readable.
        let (xk, wk) = unsafe {
            let wk = match kind {
                FloatWeights::F32 => w.add(4 * k).cast::<f32>().read_unaligned(),
                FloatWeights::F16 => half::f16::from_bits(w.add(2 * k).cast::<u16>().read_unaligned()).to_f32(),
                FloatWeights::BF16 => f32::from_bits((w.add(2 * k).cast::<u16>().read_unaligned() as u32) << 16),
            };
            (*x.add(k), wk)
        };
        sum += xk * wk;
    }
    sum
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_matches_f64_reference() {
        for n in [0usize, 1, 15, 16, 17, 64, 100, 577] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2).collect();
            let r: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((super::dot(&a, &b) as f64 - r).abs() < 1e-4 * (1.0 + r.abs()), "n={n}");
            assert!((super::dot_portable(&a, &b) as f64 - r).abs() < 1e-4 * (1.0 + r.abs()), "n={n}");
        }
    }

    /// bf16 decode on AVX-512 against the AVX2 tile, bit for bit, at column
    /// counts with and without a tail past the vector width.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_decode_rows_equal_the_avx2_tile_bit_for_bit() {
        use super::super::test_rng::{avx512_vnni_or_skip, fresh_seed, next};
        use super::FloatWeights;
        if !avx512_vnni_or_skip() {
            return;
        }
        let mut seed = fresh_seed("bf16_rows4_avx512");
        let start = seed;
        // Values of any sign and a wide range of magnitudes.
        let value = |seed: &mut u64| {
            let r = next(seed);
            let m = ((r % 2001) as f32 - 1000.0) / 256.0;
            let e = ((r >> 16) % 24) as i32 - 12;
            m * 2f32.powi(e)
        };
        for cols in [1, 7, 8, 9, 16, 33, 100, 896, 1000] {
            let x: Vec<f32> = (0..cols).map(|_| value(&mut seed)).collect();
            let bytes: Vec<Vec<u8>> = (0..4)
                .map(|_| (0..cols).flat_map(|_| half::bf16::from_f32(value(&mut seed)).to_le_bytes()).collect())
                .collect();
            let w: [*const u8; 4] = std::array::from_fn(|j| bytes[j].as_ptr());
            // SAFETY: AVX-512 F and AVX2 are present (checked above); rows hold `cols` values.
            let (wide, narrow) = unsafe {
                (
                    super::bf16_rows4_avx512(w, x.as_ptr(), cols),
                    super::float_tile_avx2::<1, 4>(FloatWeights::BF16, w, [x.as_ptr()], cols)[0],
                )
            };
            for j in 0..4 {
                assert_eq!(wide[j].to_bits(), narrow[j].to_bits(), "cols {cols} row {j} (seed {start})");
            }
        }
    }

    /// The AVX2 float tile against an f64 sum, for every stored width, tile shape remainders and column
    /// counts with and without a tail past the vector width.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn float_tiles_match_f64_reference() {
        use super::FloatWeights;
        if !super::has_avx2() {
            return;
        }
        fn check<const MR: usize, const NR: usize>(kind: FloatWeights, cols: usize) {
            let xs: Vec<Vec<f32>> =
                (0..MR).map(|i| (0..cols).map(|c| ((c * 7 + i * 3) % 13) as f32 * 0.25 - 1.5).collect()).collect();
            let wf: Vec<Vec<f32>> =
                (0..NR).map(|j| (0..cols).map(|c| ((c * 5 + j * 11) % 17) as f32 * 0.125 - 1.0).collect()).collect();
            // Every value is exact in bf16 and f16.
            let bytes: Vec<Vec<u8>> = wf
                .iter()
                .map(|r| {
                    r.iter()
                        .flat_map(|v| match kind {
                            FloatWeights::F32 => v.to_le_bytes().to_vec(),
                            FloatWeights::F16 => half::f16::from_f32(*v).to_le_bytes().to_vec(),
                            FloatWeights::BF16 => half::bf16::from_f32(*v).to_le_bytes().to_vec(),
                        })
                        .collect()
                })
                .collect();
            let w: [*const u8; NR] = std::array::from_fn(|j| bytes[j].as_ptr());
            let x: [*const f32; MR] = std::array::from_fn(|i| xs[i].as_ptr());
            // SAFETY: avx2 is present (checked by the caller); rows hold `cols` values.
            let got = vec![unsafe { super::float_tile_avx2::<MR, NR>(kind, w, x, cols) }];
            for g in got {
                for i in 0..MR {
                    for j in 0..NR {
                        let want: f64 = (0..cols).map(|c| xs[i][c] as f64 * wf[j][c] as f64).sum();
                        assert!((g[i][j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "{MR}x{NR} cols {cols}");
                    }
                }
            }
        }
        for kind in [FloatWeights::F32, FloatWeights::F16, FloatWeights::BF16] {
            for cols in [1, 7, 16, 33, 100, 896] {
                check::<1, 1>(kind, cols);
                check::<1, 4>(kind, cols);
                check::<2, 3>(kind, cols);
                check::<4, 3>(kind, cols);
            }
        }
    }

    /// The register form gives the bits of the loop it stands for.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn dot_in_registers_matches_the_loop() {
        if !super::has_avx2() {
            return;
        }
        let mut x = 0x2545_f491u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20001) as f32 / 7000.0 - 1.3
        };
        for n in [0, 1, 15, 16, 17, 64, 100, 128, 131] {
            let a: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let b: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let want: f32 = dot_body!(&a[..], &b[..], super::fused);
            // SAFETY: avx2 and fma are present (checked above).
            let got = unsafe { super::dot_avx2(&a, &b) };
            assert_eq!(got.to_bits(), want.to_bits(), "n = {n}");
        }
    }
}
