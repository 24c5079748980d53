//! Parity against transformers (fp32 reference from bf16 weights) on the tiny
//! random models in tests/fixtures/tiny, made by scripts/make_fixtures.py.

mod common;

use std::path::{Path, PathBuf};

use qinfer::config::ModelConfig;
use qinfer::config::rope::Rope;
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::loader;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;
use serde_json::Value;

fn fixtures() -> Vec<PathBuf> {
    common::exact_fixture_dirs("tiny", &common::TINY_FIXTURES, "reference.json")
}

fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load(dir: &Path) -> (ModelConfig, Box<dyn LanguageModel>) {
    let m = loader::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let lm = m.load_cpu(false).unwrap();
    (m.config, lm)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn teacher_forced_logits_match_transformers() {
    for dir in fixtures() {
        let r = reference(&dir);
        let input = ids(&r["input_ids"]);
        let (shape, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let (cfg, lm) = load(&dir);
        assert_eq!(shape, vec![input.len(), cfg.vocab_size]);
        let mut seq = lm.new_sequence(input.len());
        let got = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        let d = max_abs_diff(&got, &want);
        println!("{}: max |Δlogit| = {d:.2e}", dir.display());
        assert!(d <= 1e-3, "{}: max |Δlogit| = {d}", dir.display());
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for dir in fixtures() {
        let r = reference(&dir);
        let prompt = ids(&r["greedy"]["prompt"]);
        let want = ids(&r["greedy"]["new_tokens"]);
        let (_, lm) = load(&dir);
        let opts =
            GenerateOptions { max_new_tokens: want.len(), stop_tokens: vec![], prefill_chunk: 512, adapter: None };
        let (got, _) = generate(lm.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(got, want, "{}", dir.display());
    }
}

#[test]
fn cached_decode_equals_full_recompute() {
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let (cfg, lm) = load(&dir);
        let v = cfg.vocab_size;
        let mut seq = lm.new_sequence(input.len());
        let full = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        // f32 sums in another order (chunked vs recurrent delta rule, one
        // query row vs many): a relative bound of 1e-5 of the logits' scale,
        // 1e-4 at the least. (transformers' own step-vs-full difference on
        // qwen3_5_gdn128, logits up to ~36, is 8.0e-5.)
        let tol = 1e-5 * full.iter().fold(10f32, |m, x| m.max(x.abs()));
        // One token at a time, and in uneven chunks.
        let mut step = lm.new_sequence(input.len());
        for (i, t) in input.iter().enumerate() {
            let got = lm.forward(step.as_mut(), &[*t], Logits::Last).unwrap();
            let d = max_abs_diff(&got, &full[i * v..(i + 1) * v]);
            assert!(d < tol, "{} position {i}: {d} (tolerance {tol})", dir.display());
        }
        let mut chunked = lm.new_sequence(input.len());
        let mut pos = 0;
        for len in [5, 1, 7, 100] {
            let end = (pos + len).min(input.len());
            let got = lm.forward(chunked.as_mut(), &input[pos..end], Logits::All).unwrap();
            let d = max_abs_diff(&got, &full[pos * v..end * v]);
            assert!(d < tol, "{} chunk {pos}..{end}: {d} (tolerance {tol})", dir.display());
            pos = end;
        }
    }
}

#[test]
fn snapshot_restore_then_recompute_is_identical() {
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let n = input.len();
        let (_, lm) = load(&dir);
        let mut seq = lm.new_sequence(n);
        lm.forward(seq.as_mut(), &input[..n - 3], Logits::Last).unwrap();
        let snap = seq.snapshot();
        let first = lm.forward(seq.as_mut(), &input[n - 3..], Logits::All).unwrap();
        for _ in 0..2 {
            seq.restore(&snap).unwrap();
            assert_eq!(seq.len(), n - 3);
            let again = lm.forward(seq.as_mut(), &input[n - 3..], Logits::All).unwrap();
            assert_eq!(first, again, "{}", dir.display());
        }
        // A snapshot past a point the sequence was later rolled back below is stale.
        let late = seq.snapshot();
        seq.restore(&snap).unwrap();
        lm.forward(seq.as_mut(), &input[n - 3..n - 2], Logits::Last).unwrap();
        let e = seq.restore(&late).unwrap_err();
        assert!(e.to_string().contains("no longer valid"), "{e}");
    }
}

#[test]
fn rope_frequencies_match_transformers() {
    for dir in fixtures() {
        let r = reference(&dir);
        let want: Vec<f64> = r["rope"]["inv_freq"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let cfg = loader::open(&dir).unwrap().config;
        let rope = Rope::new(&cfg.rope, cfg.rotary_dim);
        assert_eq!(rope.inv_freq.len(), want.len());
        for (g, w) in rope.inv_freq.iter().zip(&want) {
            assert!(((*g as f64) - w).abs() <= 1e-6 * w.abs(), "{}: {g} vs {w}", dir.display());
        }
    }
}

#[test]
fn sequences_longer_than_capacity_are_errors() {
    let dir = fixtures().into_iter().next().unwrap();
    let (_, lm) = load(&dir);
    let mut seq = lm.new_sequence(4);
    let e = lm.forward(seq.as_mut(), &[1, 2, 3, 4, 5], Logits::Last).unwrap_err();
    assert!(e.to_string().contains("capacity"), "{e}");
    let e = lm.forward(seq.as_mut(), &[100_000], Logits::Last).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
}

#[test]
fn qwen3_5_hub_checkpoint_keeps_mtp_reachable_and_skips_the_vision_tower() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3_5");
    let m = loader::open(&dir).unwrap();
    let mtp = m.mtp_tensor_names();
    assert!(mtp.iter().any(|n| n == "mtp.fc.weight"), "{mtp:?}");
    let t = m.source.tensor("mtp.fc.weight").unwrap();
    assert_eq!(t.shape.len(), 2);
    assert!(m.source.names().iter().any(|n| n.starts_with("model.visual.")));
    m.load_cpu(false).unwrap();
}
