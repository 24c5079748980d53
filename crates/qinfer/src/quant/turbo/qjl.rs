//! The 1-bit Quantized Johnson–Lindenstrauss sketch of TurboQuant_prod: a
//! residual `r` is kept as the signs of `S·r` (S: `d×d`, independent N(0, 1)
//! entries from a seed) and its norm; then for any query `y`,
//! `‖r‖·√(π/2)/d · ⟨S·y, sign(S·r)⟩` is an unbiased estimate of `⟨y, r⟩`
//! (for a Gaussian row `s`, E[sign(⟨s, r⟩)·⟨s, y⟩] = √(2/π)·⟨r, y⟩/‖r‖).

use super::rotation::SplitMix;

#[derive(Debug, Clone)]
pub struct Sketch {
    dim: usize,
    /// Row-major `d×d`.
    matrix: Vec<f32>,
}

impl Sketch {
    pub fn seeded(dim: usize, seed: u64) -> Self {
        let mut rng = SplitMix::new(seed);
        let mut matrix = Vec::with_capacity(dim * dim);
        while matrix.len() < dim * dim {
            // Box–Muller: two independent standard normals per pair of uniforms.
            let (u, v) = (rng.next_open01(), rng.next_open01());
            let r = (-2.0 * u.ln()).sqrt();
            let t = 2.0 * std::f64::consts::PI * v;
            matrix.push((r * t.cos()) as f32);
            if matrix.len() < dim * dim {
                matrix.push((r * t.sin()) as f32);
            }
        }
        Sketch { dim, matrix }
    }

    /// `out ← S·y`.
    pub fn project(&self, y: &[f32], out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(self.matrix.chunks_exact(self.dim)) {
            *o = row.iter().zip(y).map(|(a, b)| a * b).sum();
        }
    }

    /// The weight each sign carries in the estimate, per unit of residual norm.
    pub fn sign_weight(&self) -> f32 {
        (std::f32::consts::PI / 2.0).sqrt() / self.dim as f32
    }
}
