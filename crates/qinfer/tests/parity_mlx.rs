//! Parity against mlx-lm on MLX affine-quantized checkpoints: the tiny models
//! of tests/fixtures/tiny converted and run by mlx-lm (scripts/make_fixtures_mlx.py),
//! fixtures in tests/fixtures/mlx.

use std::path::{Path, PathBuf};

use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::sampler::SamplingParams;
use qinfer::loader;
use qinfer::models::{LanguageModel, Logits};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mlx")
}

fn fixtures() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root())
        .expect("tests/fixtures/mlx exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 10, "expected the MLX fixtures, found {dirs:?}");
    dirs
}

fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load(dir: &Path) -> Box<dyn LanguageModel> {
    let m = loader::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    m.load_cpu(false).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Logit tolerance. Attention-only models: 1e-4. Gated-DeltaNet hybrids: two
/// f32 computations of the delta rule in different orders (mlx-lm steps the
/// recurrence token by token; qinfer's prefill is chunked) drift further apart
/// on these models, whose tied logits reach ±38 (measured: 0.7–3.7e-4 against
/// mlx-lm, up to 5.2e-4 between qinfer's own chunked and recurrent paths, while
/// mlx-lm and transformers agree to 1e-4 on the unquantized f32 hub models).
/// Greedy continuations must still be identical. Returns (vs mlx-lm, cached vs full).
fn tolerance(lm: &dyn LanguageModel) -> (f32, f32) {
    if lm.config().arch.is_hybrid() { (5e-4, 6e-4) } else { (1e-4, 1e-4) }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn teacher_forced_logits_match_mlx_lm() {
    let mut worst = Vec::new();
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let (shape, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let lm = load(&dir);
        assert_eq!(shape, vec![input.len(), lm.config().vocab_size]);
        let mut seq = lm.new_sequence(input.len());
        let got = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        let d = max_abs_diff(&got, &want);
        let peak = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        println!("{}: max |Δlogit| = {d:.2e} (max |logit| {peak:.1})", dir.file_name().unwrap().to_string_lossy());
        if d > tolerance(lm.as_ref()).0 {
            worst.push((dir, d));
        }
    }
    assert!(worst.is_empty(), "{worst:?}");
}

#[test]
fn greedy_continuations_match_mlx_lm() {
    for dir in fixtures() {
        let r = reference(&dir);
        let prompt = ids(&r["greedy"]["prompt"]);
        let want = ids(&r["greedy"]["new_tokens"]);
        let lm = load(&dir);
        let opts = GenerateOptions { max_new_tokens: want.len(), stop_tokens: vec![], prefill_chunk: 512 };
        let (got, _) = generate(lm.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(got, want, "{}", dir.display());
    }
}

/// One token per forward (the recurrent Gated-DeltaNet path, as mlx-lm runs
/// every forward) against mlx-lm's logits.
#[test]
fn token_by_token_logits_match_mlx_lm() {
    let mut worst = Vec::new();
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let lm = load(&dir);
        let v = lm.config().vocab_size;
        let mut seq = lm.new_sequence(input.len());
        let mut d = 0f32;
        for (i, t) in input.iter().enumerate() {
            let got = lm.forward(seq.as_mut(), &[*t], Logits::Last).unwrap();
            d = d.max(max_abs_diff(&got, &want[i * v..(i + 1) * v]));
        }
        println!("{}: token by token, max |Δlogit| = {d:.2e}", dir.file_name().unwrap().to_string_lossy());
        if d > tolerance(lm.as_ref()).0 {
            worst.push((dir, d));
        }
    }
    assert!(worst.is_empty(), "{worst:?}");
}

#[test]
fn cached_decode_equals_full_recompute() {
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let lm = load(&dir);
        let v = lm.config().vocab_size;
        let mut seq = lm.new_sequence(input.len());
        let full = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        let mut step = lm.new_sequence(input.len());
        for (i, t) in input.iter().enumerate() {
            let got = lm.forward(step.as_mut(), &[*t], Logits::Last).unwrap();
            let d = max_abs_diff(&got, &full[i * v..(i + 1) * v]);
            assert!(d < tolerance(lm.as_ref()).1, "{} position {i}: {d}", dir.display());
        }
    }
}
