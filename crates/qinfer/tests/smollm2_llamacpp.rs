//! The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against llama.cpp:
//! greedy continuations and perplexity recorded by scripts/llamacpp_reference.sh.
//! Skips with a message when the model has not been fetched (fails under
//! `QINFER_CI=1`).

mod common;

use std::path::Path;

use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::perplexity::perplexity;
use qinfer::loader::{self, LoadedModel};
use qinfer::sampling::SamplingParams;
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn open() -> Option<LoadedModel> {
    common::default_model().map(|p| loader::open(&p).unwrap())
}

/// llama.cpp with flash attention off and an f32 KV cache does the arithmetic our CPU
/// backend does (8-bit activation blocks into the Q4_1/Q8_0 dots, f32 attention), so
/// greedy ids must agree token for token: for 32 tokens, or up to the first step where
/// llama.cpp's own top-2 logit gap is under 0.1 (a near-tie that summation order alone
/// can flip). At least two of the three cases must be checked over all 32 tokens.
#[test]
fn greedy_matches_llama_cpp_for_32_tokens() {
    let Some(m) = open() else { return };
    let lm = m.load_cpu(false).unwrap();
    let mut full = 0;
    for case in fixture("greedy_fa_off_kv_f32.json")["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["new_ids"]);
        let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let n = margins.iter().position(|m| *m < 0.1).unwrap_or(want.len()).min(32);
        let opts = GenerateOptions { max_new_tokens: 32, stop_tokens: vec![], prefill_chunk: 512, adapter: None };
        let (got, _) = generate(lm.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        println!("{}: checked {n} tokens", case["name"]);
        assert_eq!(got[..n], want[..n], "case {}", case["name"]);
        full += usize::from(n == 32);
    }
    assert!(full >= 2, "only {full} cases were checked over 32 tokens");
}

/// qinfer's perplexity within 0.05% of llama-perplexity's: measured 0.014%
/// (the same 8-bit activation arithmetic; what differs is attention), so
/// 0.05% is 3.5× that, while a 1% bound would let a real regression through.
#[test]
fn perplexity_within_0_05_percent_of_llama_cpp() {
    let Some(m) = open() else { return };
    let r = fixture("perplexity.json");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(r["text_file"].as_str().unwrap());
    let mut text = std::fs::read_to_string(path).unwrap();
    text.pop(); // llama.cpp's -f drops one trailing newline
    let tok = m.tokenizer.as_ref().unwrap();
    let tokens = tok.encode_with(&text, true, false).unwrap();
    assert_eq!(tokens, ids(&r["tokens"]), "tokenization differs from llama-perplexity's");
    let lm = m.load_cpu(false).unwrap();
    let ctx = r["n_ctx"].as_u64().unwrap() as usize;
    let got = perplexity(lm.as_ref(), &tokens, ctx, None, |_, _| {}).unwrap();
    let want = r["ppl"].as_f64().unwrap();
    println!("perplexity: qinfer {:.4}, llama.cpp {want:.4}", got.ppl);
    assert_eq!(got.scored_tokens, r["scored_tokens_total"].as_u64().unwrap() as usize);
    let rel = (got.ppl / want - 1.0).abs();
    println!("perplexity: relative difference {:.4}%", rel * 100.0);
    assert!(rel < 5e-4, "qinfer {} vs llama.cpp {want}: {:.4}% apart", got.ppl, rel * 100.0);
}

// Bounds on qinfer vs llama.cpp's teacher-forced logits, over both cases.
// Measured: max |Δlogit| 1.52 (fox) / 1.20 (chat), mean 0.184 / 0.223, KL
// max 0.032 / 0.0052 nats, one argmax differing per case, where llama.cpp's
// own top-2 gap is 0.18 / 0.005 logit. For scale: llama.cpp's
// logits here are max 1.8 / mean 0.24 from exact f32 math on the same
// weights (logits.json, vs_exact_f32), and a wrong layer or RoPE moves them
// by whole logits on average. Margins: 1.3× on max and mean, 1.6× on KL.
const MAX_ABS: f64 = 2.0;
const MEAN_ABS: f64 = 0.3;
const KL_MAX: f64 = 0.05;
/// An argmax may differ only where llama.cpp's top-2 gap is below this
/// (near-ties that rounding order can flip; measured gaps 0.18 and 0.005,
/// against logit differences up to 1.5).
const TIE_GAP: f64 = 0.25;

/// Per-position comparison of two logit rows: |Δ| max and sum, whether the
/// argmaxes agree, and KL(reference ‖ got) in nats.
fn compare_row(reference: &[f32], got: &[f32]) -> (f64, f64, bool, f64) {
    let lse = |r: &[f32]| {
        let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + r.iter().map(|x| (*x as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lr, lg) = (lse(reference), lse(got));
    let (mut max, mut sum, mut kl) = (0f64, 0f64, 0f64);
    for (r, g) in reference.iter().zip(got) {
        let d = (*r as f64 - *g as f64).abs();
        max = max.max(d);
        sum += d;
        let (pr, pg) = (*r as f64 - lr, *g as f64 - lg);
        kl += pr.exp() * (pr - pg);
    }
    let argmax = |r: &[f32]| qinfer::sampling::argmax(r);
    (max, sum, argmax(reference) == argmax(got), kl)
}

/// The gap between the largest and second-largest logit of a row.
fn top2_gap(row: &[f32]) -> f64 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    f64::from(a - b)
}

/// qinfer's teacher-forced logits (all positions of one forward) against
/// llama.cpp's on the same ids (tests/fixtures/smollm2/logits_*.npy:
/// llama.cpp with its default flash attention and f16 KV cache, one batch).
/// Both round activations to 8-bit blocks before the quantized matmuls, but
/// llama.cpp's attention path (flash attention, f16 KV) differs from
/// qinfer's f32 one, so logits are not bit-equal; the fixture itself shows
/// llama.cpp moving by as much between its own attention settings.
#[test]
fn teacher_forced_logits_match_llama_cpp() {
    let Some(m) = open() else { return };
    let lm = m.load_cpu(false).unwrap();
    let meta = fixture("logits.json");
    let cases = meta["cases"].as_array().unwrap();
    let names: Vec<&str> = cases.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["fox", "chat"], "logits.json cases");
    let vocab = lm.config().vocab_size;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let ids = ids(&case["ids"]);
        let npy = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/smollm2")
            .join(case["file"].as_str().unwrap());
        let (shape, want) = qinfer::npy::read_f32(&npy).unwrap();
        assert_eq!(shape, [ids.len(), vocab], "{name}");
        let mut seq = lm.new_sequence(ids.len());
        let got = lm.forward(seq.as_mut(), &ids, qinfer::models::Logits::All).unwrap();
        let (mut max, mut sum, mut agree, mut kl_max, mut kl_sum) = (0f64, 0f64, 0, 0f64, 0f64);
        for (r, g) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)) {
            let (m, s, a, kl) = compare_row(r, g);
            max = max.max(m);
            sum += s;
            agree += usize::from(a);
            if !a {
                let gap = top2_gap(r);
                println!("{name}: argmax differs where llama.cpp's top-2 gap is {gap:.4}");
                assert!(gap < TIE_GAP, "{name}: argmax differs where llama.cpp's top-2 gap is {gap}");
            }
            kl_max = kl_max.max(kl);
            kl_sum += kl;
        }
        let n = ids.len();
        let mean = sum / want.len() as f64;
        println!(
            "{name}: max |Δlogit| {max:.4}, mean {mean:.5}, argmax agree {agree}/{n}, KL mean {:.2e} max {kl_max:.2e}",
            kl_sum / n as f64
        );
        assert!(max < MAX_ABS, "{name}: max |Δlogit| {max}");
        assert!(mean < MEAN_ABS, "{name}: mean |Δlogit| {mean}");
        assert!(kl_max < KL_MAX, "{name}: KL {kl_max}");
    }
}
