//! GGUF files of the MoE and hybrid architectures, converted from transformers
//! models by llama.cpp's convert_hf_to_gguf.py (tests/fixtures/gguf_arch, made
//! by scripts/make_gguf_fixtures.py): F32 weights, so qinfer must match both
//! transformers' float32 logits and llama.cpp's to float32 rounding.

use std::path::{Path, PathBuf};

use qinfer::config::Architecture;
use qinfer::loader;
use qinfer::models::Logits;
use serde_json::Value;

fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_arch").join(case)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// qinfer's logits for the case's ids, with transformers' and llama.cpp's.
fn run(case: &str, arch: Architecture) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(dir(case).join("reference.json")).unwrap()).unwrap();
    let ids: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let m = loader::open(&dir(case).join("model.gguf")).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_eq!(m.config.arch, arch);
    let lm = m.load_cpu(false).unwrap();
    let mut seq = lm.new_sequence(ids.len());
    let got = lm.forward(seq.as_mut(), &ids, Logits::All).unwrap();
    let read = |f: &str| qinfer::npy::read_f32(&dir(case).join(f)).unwrap().1;
    (got, read("transformers_logits.npy"), read("llamacpp_logits.npy"))
}

#[test]
fn qwen3moe_matches_transformers_and_llama_cpp() {
    let (got, hf, llama) = run("qwen3moe", Architecture::Qwen3Moe);
    let (d_hf, d_llama) = (max_abs_diff(&got, &hf), max_abs_diff(&got, &llama));
    println!("qwen3moe: max |Δlogit| vs transformers {d_hf:.2e}, vs llama.cpp {d_llama:.2e}");
    assert!(d_hf <= 1e-3 && d_llama <= 1e-3, "vs transformers {d_hf}, vs llama.cpp {d_llama}");
}

#[test]
fn qwen3moe_config_from_metadata() {
    let m = loader::open(&dir("qwen3moe").join("model.gguf")).unwrap();
    let c = &m.config;
    let moe = c.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.top_k, moe.intermediate_size), (8, 2, 32));
    assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none());
    assert_eq!(c.moe_layers, vec![true, true]);
    assert!(c.qk_norm && !c.tie_word_embeddings);
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim), (4, 2, 16, 16));
}
