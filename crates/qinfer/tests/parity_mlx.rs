//! Parity against mlx-lm on MLX affine-quantized checkpoints: the tiny models
//! of tests/fixtures/tiny converted and run by mlx-lm (scripts/make_fixtures_mlx.py),
//! fixtures in tests/fixtures/mlx.

mod common;

use std::path::{Path, PathBuf};

use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::loader;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;
use serde_json::Value;

use common::mlx::{Reference, max_abs_diff};

/// Every mlx-lm conversion scripts/make_fixtures_mlx.py writes.
const FIXTURES: [&str; 13] = [
    "qwen3_5_moe_q4_g32",
    "qwen3_5_q4_g32",
    "qwen3_5_q8_g64",
    "qwen3_mixed_3_6",
    "qwen3_moe_mixed",
    "qwen3_moe_q4_g64",
    "qwen3_moe_q8_g32",
    "qwen3_next_q4_g32",
    "qwen3_q3_g32",
    "qwen3_q4_g32_bf16",
    "qwen3_q4_g64",
    "qwen3_q6_g32",
    "qwen3_q8_g32",
];

fn fixtures() -> Vec<PathBuf> {
    common::exact_fixture_dirs("mlx", &FIXTURES, "reference.json")
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

#[test]
fn teacher_forced_logits_match_mlx_lm_and_f64_truth() {
    let mut bad = Vec::new();
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let lm = load(&dir);
        let r = Reference::load(&dir, lm.as_ref());
        assert_eq!(r.mlx.len(), input.len() * lm.config().vocab_size);
        let mut seq = lm.new_sequence(input.len());
        let got = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        bad.extend(r.check("full sequence", &got));
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn greedy_continuations_match_mlx_lm() {
    for dir in fixtures() {
        let r = reference(&dir);
        let prompt = ids(&r["greedy"]["prompt"]);
        let want = ids(&r["greedy"]["new_tokens"]);
        let lm = load(&dir);
        let opts =
            GenerateOptions { max_new_tokens: want.len(), stop_tokens: vec![], prefill_chunk: 512, adapter: None };
        let (got, _) = generate(lm.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(got, want, "{}", dir.display());
    }
}

/// One token per forward (the recurrent Gated-DeltaNet path, as mlx-lm runs
/// every forward on the CPU) against the same references.
#[test]
fn token_by_token_logits_match_mlx_lm_and_f64_truth() {
    let mut bad = Vec::new();
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let lm = load(&dir);
        let r = Reference::load(&dir, lm.as_ref());
        let mut seq = lm.new_sequence(input.len());
        let mut got = Vec::with_capacity(r.mlx.len());
        for t in &input {
            got.extend(lm.forward(seq.as_mut(), &[*t], Logits::Last).unwrap());
        }
        bad.extend(r.check("token by token", &got));
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn cached_decode_equals_full_recompute() {
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let lm = load(&dir);
        let tol = Reference::load(&dir, lm.as_ref()).self_tol();
        let v = lm.config().vocab_size;
        let mut seq = lm.new_sequence(input.len());
        let full = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        let mut step = lm.new_sequence(input.len());
        let mut worst = 0f32;
        for (i, t) in input.iter().enumerate() {
            let got = lm.forward(step.as_mut(), &[*t], Logits::Last).unwrap();
            let d = max_abs_diff(&got, &full[i * v..(i + 1) * v]);
            assert!(d <= tol, "{} position {i}: {d:.2e} > {tol:.2e}", dir.display());
            worst = worst.max(d);
        }
        println!("{}: cached vs full {worst:.2e} (≤ {tol:.2e})", dir.file_name().unwrap().to_string_lossy());
    }
}
