//! f32 dot products and axpy, compiled twice: once for AVX2+FMA (chosen at run
//! time when the CPU has it) and once portable. The bodies are plain loops over
//! 16-wide chunks with independent accumulators so LLVM vectorizes both.

use std::sync::OnceLock;

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

#[inline(always)]
fn fused(x: f32, y: f32, acc: f32) -> f32 {
    x.mul_add(y, acc)
}
#[inline(always)]
fn unfused(x: f32, y: f32, acc: f32) -> f32 {
    acc + x * y
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, fused)
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, unfused)
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

/// Whether the AVX2 kernels may run: AVX2, FMA and F16C (every AVX2 CPU in
/// practice has all three).
pub(super) fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
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
}
