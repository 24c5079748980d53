//! What parity_mlx.rs and quantize_mlx.rs hold qinfer's logits to on the MLX
//! fixtures (tests/fixtures/mlx/<case>): mlx-lm's f32 logits and, for the
//! Gated-DeltaNet hybrids, the float64 truth of the same quantized model.

use std::path::Path;

use qinfer::models::LanguageModel;

/// The tolerance: qinfer's logits within 1e-4 of the exact answer.
pub const TOL: f32 = 1e-4;

/// Allowance over mlx-lm's own error, for a case where even mlx-lm's f32 logits
/// are more than [`TOL`] from the float64 truth (none at present): on these
/// fixtures the distance to the truth of qinfer's f32 logits (chunked or
/// recurrent) and of mlx-lm's differ by at most 3.1e-5 either way.
pub const MARGIN: f32 = 5e-5;

/// What a fixture's logits are checked against: mlx-lm's f32 logits
/// (logits.npy) and, for the Gated-DeltaNet hybrids, the float64 truth of the
/// same quantized model (logits_f64.npy from scripts/mlx_f64_truth.py:
/// weights dequantized in f64, independent numpy f64 forward, cross-checked
/// against transformers in f64). On the hybrids, whose logits reach ±38,
/// mlx-lm's f32 logits are themselves 3.7e-5..8.6e-5 from the truth, so two
/// correct f32 implementations can be 1e-4 from the truth each and up to
/// ~1.7e-4 apart: qinfer is held to the truth, and to mlx-lm only through the
/// triangle inequality.
pub struct Reference {
    pub name: String,
    pub mlx: Vec<f32>,
    /// Float64 truth (read rounded to f32: at most 1.9e-6 off at |logit| 38).
    pub truth: Option<Vec<f32>>,
    /// max |mlx-lm − truth|.
    pub mlx_err: f32,
    /// Who computed logits.npy, for messages ("mlx-lm" unless set).
    pub peer: &'static str,
}

impl Reference {
    pub fn load(dir: &Path, lm: &dyn LanguageModel) -> Self {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (_, mlx) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let f64_path = dir.join("logits_f64.npy");
        let truth = f64_path.exists().then(|| qinfer::npy::read_f32(&f64_path).unwrap().1);
        assert!(
            truth.is_some() || lm.config().arch.features().linear_attention.is_none(),
            "{name}: hybrid fixture without logits_f64.npy (run scripts/mlx_f64_truth.py)"
        );
        let mlx_err = truth.as_ref().map_or(0.0, |t| max_abs_diff(&mlx, t));
        Reference { name, mlx, truth, mlx_err, peer: "mlx-lm" }
    }

    /// The same checks with logits.npy computed by `peer`.
    pub fn computed_by(self, peer: &'static str) -> Self {
        Reference { peer, ..self }
    }

    /// Bound on |qinfer − truth|: the 1e-4 where mlx-lm's f32 reference
    /// achieves it, else at most MARGIN worse than mlx-lm.
    pub fn truth_tol(&self) -> f32 {
        if self.mlx_err <= TOL { TOL } else { self.mlx_err + MARGIN }
    }

    /// Bound on |qinfer − mlx-lm|: 1e-4 without a truth (dense and MoE
    /// models, where it holds with room: ≤ 2e-5 measured); with one,
    /// |qinfer − truth| + |truth − mlx-lm|.
    pub fn mlx_tol(&self) -> f32 {
        if self.truth.is_some() { self.truth_tol() + self.mlx_err } else { TOL }
    }

    /// Bound between qinfer's own chunked and recurrent paths: both are held
    /// to the truth where there is one.
    pub fn self_tol(&self) -> f32 {
        if self.truth.is_some() { 2.0 * self.truth_tol() } else { TOL }
    }

    /// Checks logits `got` (all positions, `[T, vocab]`); returns the failures.
    pub fn check(&self, how: &str, got: &[f32]) -> Vec<String> {
        let mut bad = Vec::new();
        let d = max_abs_diff(got, &self.mlx);
        let peak = self.mlx.iter().fold(0f32, |m, x| m.max(x.abs()));
        let peer = self.peer;
        let mut line = format!("{} {how}: |qinfer − {peer}| {d:.2e} (≤ {:.2e})", self.name, self.mlx_tol());
        if d > self.mlx_tol() {
            bad.push(format!("{} {how}: {d:.2e} from {peer}", self.name));
        }
        if let Some(truth) = &self.truth {
            let e = max_abs_diff(got, truth);
            line +=
                &format!(", |qinfer − f64| {e:.2e} (≤ {:.2e}), |{peer} − f64| {:.2e}", self.truth_tol(), self.mlx_err);
            if e > self.truth_tol() {
                bad.push(format!("{} {how}: {e:.2e} from the float64 truth", self.name));
            }
        }
        println!("{line}; max |logit| {peak:.1}");
        bad
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
