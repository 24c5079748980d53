//! Lloyd–Max scalar codebooks for one coordinate of a randomly rotated unit
//! vector. A uniformly random unit vector in `d` dimensions has coordinates
//! with density ∝ (1 − x²)^((d−3)/2) on [−1, 1]; the codebook minimizes the
//! expected squared error under that density (for large `d` it tends to the
//! Gaussian Lloyd–Max quantizer of variance 1/d). Everything here is in units
//! of `x·√d`, so the levels are O(1) and nearly independent of `d`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `2^bits` levels in increasing order and the `2^bits − 1` decision
/// thresholds between them (midpoints), in units of `x·√d`.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    pub levels: Vec<f32>,
    pub thresholds: Vec<f32>,
    /// Expected squared error per coordinate in units of `x·√d`: the mean
    /// squared error of a unit vector quantized coordinate by coordinate.
    pub distortion: f64,
}

impl Codebook {
    /// Index of the level nearest to `z`.
    #[inline]
    pub fn index(&self, z: f32) -> usize {
        self.thresholds.partition_point(|&t| t < z)
    }
}

/// Points of the integration grid over [−z_max, z_max].
const GRID: usize = 1 << 16;

/// The codebook for `dim`-dimensional unit vectors at `bits` bits per
/// coordinate (1 to 6), computed once per process and shared.
pub fn lloyd_max(dim: usize, bits: u32) -> Arc<Codebook> {
    type Cache = Mutex<HashMap<(usize, u32), Arc<Codebook>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = cache.lock().expect("codebook cache").get(&(dim, bits)) {
        return c.clone();
    }
    let c = Arc::new(compute(dim, bits));
    cache.lock().expect("codebook cache").insert((dim, bits), c.clone());
    c
}

fn compute(dim: usize, bits: u32) -> Codebook {
    assert!(dim >= 4, "codebooks are for vectors of 4 or more coordinates, not {dim}");
    assert!((1..=6).contains(&bits), "Lloyd–Max codebooks of 1 to 6 bits, not {bits}");
    let d = dim as f64;
    // Beyond 12 standard deviations the mass is below 1e-30.
    let z_max = d.sqrt().min(12.0);
    let h = 2.0 * z_max / GRID as f64;
    // Prefix sums of the density's mass, first and second moments over the
    // grid's cells (midpoint rule), so each iteration costs O(levels·log GRID).
    let (mut m0, mut m1, mut m2) = (vec![0f64; GRID + 1], vec![0f64; GRID + 1], vec![0f64; GRID + 1]);
    let exponent = (d - 3.0) / 2.0;
    for i in 0..GRID {
        let z = -z_max + (i as f64 + 0.5) * h;
        let w = (1.0 - z * z / d).max(0.0).powf(exponent) * h;
        m0[i + 1] = m0[i] + w;
        m1[i + 1] = m1[i] + w * z;
        m2[i + 1] = m2[i] + w * z * z;
    }
    let total = m0[GRID];
    let cell = |z: f64| (((z + z_max) / h).round().max(0.0) as usize).min(GRID);
    let n = 1usize << bits;
    // Start from levels evenly spread over ±2.5 standard deviations.
    let mut levels: Vec<f64> = (0..n).map(|i| -2.5 + 5.0 * (i as f64 + 0.5) / n as f64).collect();
    let mut thresholds = vec![0f64; n - 1];
    for _ in 0..10_000 {
        for (t, w) in thresholds.iter_mut().zip(levels.windows(2)) {
            *t = 0.5 * (w[0] + w[1]);
        }
        let mut moved = 0f64;
        for (i, level) in levels.iter_mut().enumerate() {
            let lo = if i == 0 { 0 } else { cell(thresholds[i - 1]) };
            let hi = if i == n - 1 { GRID } else { cell(thresholds[i]) };
            let mass = m0[hi] - m0[lo];
            if mass > 0.0 {
                let mean = (m1[hi] - m1[lo]) / mass;
                moved = moved.max((mean - *level).abs());
                *level = mean;
            }
        }
        if moved < 1e-12 {
            break;
        }
    }
    for (t, w) in thresholds.iter_mut().zip(levels.windows(2)) {
        *t = 0.5 * (w[0] + w[1]);
    }
    // E[(z − q(z))²] = Σ over cells of (m2 − 2·c·m1 + c²·m0).
    let mut err = 0f64;
    for (i, &c) in levels.iter().enumerate() {
        let lo = if i == 0 { 0 } else { cell(thresholds[i - 1]) };
        let hi = if i == n - 1 { GRID } else { cell(thresholds[i]) };
        err += (m2[hi] - m2[lo]) - 2.0 * c * (m1[hi] - m1[lo]) + c * c * (m0[hi] - m0[lo]);
    }
    Codebook {
        levels: levels.iter().map(|&x| x as f32).collect(),
        thresholds: thresholds.iter().map(|&x| x as f32).collect(),
        distortion: err / total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For large dimensions the codebook is the Gaussian Lloyd–Max quantizer,
    /// whose levels and distortions are textbook values (Max 1960): 1 bit
    /// ±0.7979 (0.3634), 2 bits ±0.4528 ±1.510 (0.1175), 3 bits distortion
    /// 0.03455, 4 bits 0.009497.
    #[test]
    fn large_dimensions_give_the_gaussian_quantizer() {
        let c1 = lloyd_max(4096, 1);
        assert!((c1.levels[1] - 0.7979).abs() < 2e-3, "{:?}", c1.levels);
        assert!((c1.distortion - 0.3634).abs() < 2e-3, "{}", c1.distortion);
        let c2 = lloyd_max(4096, 2);
        assert!((c2.levels[2] - 0.4528).abs() < 2e-3 && (c2.levels[3] - 1.510).abs() < 3e-3, "{:?}", c2.levels);
        assert!((c2.distortion - 0.1175).abs() < 1e-3, "{}", c2.distortion);
        assert!((lloyd_max(4096, 3).distortion - 0.03455).abs() < 3e-4);
        assert!((lloyd_max(4096, 4).distortion - 0.009497).abs() < 1e-4);
    }

    /// The codebooks of head dimensions are symmetric, increasing, and no
    /// worse than the Gaussian's distortion (the Beta density is lighter-tailed).
    #[test]
    fn head_dimension_codebooks_are_symmetric_and_sorted() {
        for dim in [64, 128, 256] {
            for bits in 1..=4 {
                let c = lloyd_max(dim, bits);
                let n = c.levels.len();
                assert_eq!(n, 1 << bits);
                for i in 0..n {
                    assert!((c.levels[i] + c.levels[n - 1 - i]).abs() < 1e-5, "{dim} {bits}: {:?}", c.levels);
                }
                assert!(c.levels.windows(2).all(|w| w[0] < w[1]));
                assert!(c.distortion < [0.3634, 0.1175, 0.03455, 0.009497][bits as usize - 1] * 1.001);
                assert_eq!(c.index(c.levels[0] - 1.0), 0);
                assert_eq!(c.index(c.levels[n - 1] + 1.0), n - 1);
            }
        }
    }
}
