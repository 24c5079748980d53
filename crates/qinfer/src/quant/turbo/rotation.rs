//! The randomized Walsh–Hadamard rotation `R = H·D/√d`: random signs `D`
//! (derived from a seed, never stored), then the Sylvester Hadamard matrix
//! `H`. It is orthogonal, costs d·log₂d additions, and spreads a vector's
//! energy (outlier channels included) evenly over its coordinates, so that
//! each rotated coordinate of a unit vector follows the distribution the
//! codebooks are built for.

/// A deterministic stream of 64-bit words (splitmix64): the same seed gives
/// the same signs and sketches on every backend and machine.
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    pub fn next_open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// The seed of one (layer, head, use) triple: `use` tells keys, values and
/// sketches apart, so none shares its randomness with another.
pub fn seed_of(model_seed: u64, layer: usize, head: usize, purpose: u64) -> u64 {
    let mut s = SplitMix::new(model_seed ^ (layer as u64) << 40 ^ (head as u64) << 20 ^ purpose);
    s.next_u64()
}

#[derive(Debug, Clone)]
pub struct Rotation {
    signs: Vec<f32>,
    inv_sqrt_d: f32,
}

impl Rotation {
    /// The rotation of `dim` coordinates (a power of two) for `seed`.
    pub fn seeded(dim: usize, seed: u64) -> Self {
        assert!(dim.is_power_of_two(), "a Walsh–Hadamard rotation needs a power-of-two dimension, not {dim}");
        let mut rng = SplitMix::new(seed);
        let mut signs = Vec::with_capacity(dim);
        while signs.len() < dim {
            let word = rng.next_u64();
            signs.extend((0..64.min(dim - signs.len())).map(|b| if word >> b & 1 == 1 { -1.0 } else { 1.0 }));
        }
        Rotation { signs, inv_sqrt_d: 1.0 / (dim as f32).sqrt() }
    }

    pub fn dim(&self) -> usize {
        self.signs.len()
    }

    /// The random signs `D` (±1), which a device applies as the CPU does.
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    /// `x ← R·x`.
    pub fn forward(&self, x: &mut [f32]) {
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht(x);
        for v in x.iter_mut() {
            *v *= self.inv_sqrt_d;
        }
    }

    /// `x ← Rᵀ·x`, the inverse.
    pub fn inverse(&self, x: &mut [f32]) {
        fwht(x);
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s * self.inv_sqrt_d;
        }
    }
}

/// The unnormalized fast Walsh–Hadamard transform, in place.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, t) = (*u + *v, *u - *v);
                *u = s;
                *v = t;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// R is orthogonal (norms and inner products kept, inverse undoes it) and
    /// matches the dense definition H·D/√d.
    #[test]
    fn rotation_is_the_orthogonal_matrix_it_claims() {
        let d = 16;
        let r = Rotation::seeded(d, 7);
        let mut rng = SplitMix::new(1);
        let x: Vec<f32> = (0..d).map(|_| rng.next_open01() as f32 - 0.5).collect();
        let mut y = x.clone();
        r.forward(&mut y);
        for (i, yi) in y.iter().enumerate() {
            // H[i][j] = (−1)^popcount(i & j).
            let want: f32 =
                (0..d).map(|j| if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 } * r.signs[j] * x[j]).sum::<f32>()
                    / (d as f32).sqrt();
            assert!((yi - want).abs() < 1e-5);
        }
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&y)).abs() < 1e-5);
        r.inverse(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-6);
        }
        assert!(r.signs.iter().any(|&s| s < 0.0) && r.signs.iter().any(|&s| s > 0.0));
        assert_ne!(Rotation::seeded(d, 8).signs, r.signs);
    }
}
