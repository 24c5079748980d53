//! Every GGUF tensor type qinfer computes with, against llama.cpp: a tiny
//! hidden-256 Qwen3 converted by convert_hf_to_gguf.py and quantized by
//! llama-quantize --pure (every matrix, embedding included, in the type), with
//! llama.cpp's teacher-forced logits (tests/fixtures/gguf_quant, made by
//! scripts/make_gguf_fixtures.py).

use std::path::{Path, PathBuf};

use qinfer::loader;
use qinfer::models::Logits;
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_quant")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

/// qinfer's teacher-forced logits for the fixture's ids, and llama.cpp's
/// (default settings).
fn logits(name: &str, ids: &[u32]) -> (Vec<f32>, Vec<f32>, usize) {
    let m = loader::open(&dir().join(name).join("model.gguf")).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = m.config.vocab_size;
    let lm = m.load_cpu(false).unwrap();
    let mut seq = lm.new_sequence(ids.len());
    let got = lm.forward(seq.as_mut(), ids, Logits::All).unwrap();
    let (shape, want) = qinfer::npy::read_f32(&dir().join(name).join("logits_repack.npy")).unwrap();
    assert_eq!(shape, vec![ids.len(), vocab], "{name}");
    (got, want, vocab)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Mean negative log-likelihood of each next token: the perplexity's logarithm.
fn mean_nll(logits: &[f32], vocab: usize, ids: &[u32]) -> f64 {
    let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
    let n = ids.len() - 1;
    (0..n)
        .map(|t| {
            let row = rows[t];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            lse - row[ids[t + 1] as usize] as f64
        })
        .sum::<f64>()
        / n as f64
}

fn argmax_and_margin(row: &[f32]) -> (usize, f32) {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    (idx[0], row[idx[0]] - row[idx[1]])
}

/// Bound on max |Δlogit| against llama.cpp per type, with llama.cpp's default
/// CPU settings (weights repacked where llama.cpp does so; here only Q4_0).
/// For quantized types both engines quantize activations the same way
/// (Q8_0/Q8_1 blocks of 32, Q8_K blocks of 256) and sum the same integer
/// products; only the order of a few float additions differs (≈1e-7
/// relative on logits of magnitude ≤ 83): measured ≤ 2.3e-5, bound 1e-3,
/// still four orders below each type's distance from the F16 model's logits
/// (≥ 2, printed), which is what a wrong kernel would show. For F16 llama.cpp
/// rounds activations to f16 before the dot (ggml's vec_dot_type for F16) and
/// qinfer keeps them f32: 2⁻¹¹ relative of logits ≤ 80 is 0.04, measured 0.042.
const CASES: &[(&str, f32)] = &[
    ("F16", 0.1),
    ("Q8_0", 1e-3),
    ("Q4_0", 1e-3),
    ("Q4_1", 1e-3),
    ("Q5_0", 1e-3),
    ("Q5_1", 1e-3),
    ("Q2_K", 1e-3),
    ("Q3_K", 1e-3),
    ("Q4_K", 1e-3),
    ("Q5_K", 1e-3),
    ("Q6_K", 1e-3),
];

fn read_logits(name: &str, file: &str) -> Vec<f32> {
    qinfer::npy::read_f32(&dir().join(name).join(file)).unwrap().1
}

#[test]
fn logits_match_llama_cpp_for_every_type() {
    let r = reference();
    let ids: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let (f16_logits, _, _) = logits("F16", &ids);
    let mut failures = Vec::new();
    for &(name, bound) in CASES {
        let case = &r["cases"][name];
        // The fixture's files hold the type in every matrix (llama-quantize --pure).
        let types = case["tensor_types"].as_object().unwrap();
        assert!(types.values().all(|t| t == name || t == "F32"), "{name}: {types:?}");
        let (got, want, vocab) = logits(name, &ids);
        let d = max_abs_diff(&got, &want);
        // llama.cpp's plain (not repacked) kernels: the same numbers, except for
        // Q4_0, whose two llama.cpp kernels differ from each other by 0.68 here.
        let plain = max_abs_diff(&got, &read_logits(name, "logits.npy"));
        let plain_bound = if name == "Q4_0" { 1.0 } else { bound };
        if plain > plain_bound {
            failures.push(format!("{name}: max |Δlogit| vs llama.cpp -norepack {plain} > {plain_bound}"));
        }
        let from_f16 = max_abs_diff(&want, &f16_logits);
        let (nll_q, nll_l) = (mean_nll(&got, vocab, &ids), mean_nll(&want, vocab, &ids));
        // Greedy choices must agree wherever llama.cpp's top-2 gap exceeds twice the bound.
        let mut checked = 0;
        for (t, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
            let (wi, margin) = argmax_and_margin(w);
            if margin > 2.0 * bound {
                checked += 1;
                if argmax_and_margin(g).0 != wi {
                    failures.push(format!("{name}: argmax differs at position {t}"));
                }
            }
        }
        println!(
            "{name}: max |Δlogit| vs llama.cpp {d:.2e} (bound {bound:.0e}), vs -norepack {plain:.2e}; \
             llama.cpp vs F16 {from_f16:.2e}; log-ppl qinfer {nll_q:.5} llama.cpp {nll_l:.5}; \
             argmax checked at {checked}/{} positions",
            ids.len()
        );
        if d > bound {
            failures.push(format!("{name}: max |Δlogit| {d} > {bound}"));
        }
        if (nll_q - nll_l).abs() > bound as f64 {
            failures.push(format!("{name}: log-perplexity {nll_q} vs llama.cpp {nll_l}"));
        }
        if name != "F16" && d * 100.0 > from_f16 {
            failures.push(format!("{name}: Δ vs llama.cpp {d} is not small next to the quantization error {from_f16}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
