//! Parity against transformers on FP8 checkpoints in Qwen's block layout: the
//! tiny models of tests/fixtures/tiny converted by scripts/make_fixtures_fp8.py
//! (transformers' own `Fp8Quantize`, and partial edge blocks as Qwen's
//! checkpoints have them), references from transformers in float32 on the
//! dequantized weights and the float64 truth of the same weights
//! (tests/fixtures/fp8). Two cases are compressed-tensors repackagings
//! (`weight_scale` per channel and per tensor).

mod common;

use std::path::{Path, PathBuf};

use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::loader;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;
use serde_json::Value;

use common::mlx::Reference;

const FIXTURES: [&str; 8] = [
    "qwen3_5_b32",
    "qwen3_5_moe_b48x32_edge",
    "qwen3_b128_edge",
    "qwen3_b32",
    "qwen3_ct_tensor",
    "qwen3_moe_b16x32",
    "qwen3_moe_ct_channel",
    "qwen3_next_b48_edge",
];

fn fixtures() -> Vec<PathBuf> {
    common::exact_fixture_dirs("fp8", &FIXTURES, "reference.json")
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

/// Every tensor the fixture script quantized is stored as FP8 and read as FP8
/// (a loader that silently fell back to something else would fail here).
#[test]
fn fixtures_are_read_as_fp8() {
    for dir in fixtures() {
        let r = reference(&dir);
        let m = loader::open(&dir).unwrap();
        let names: Vec<String> =
            r["checks"]["quantized_tensors"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().into()).collect();
        assert!(!names.is_empty());
        for n in names {
            let t = m.source.fp8(&n).unwrap().unwrap_or_else(|| panic!("{}: {n} not read as FP8", dir.display()));
            assert_eq!(t.weight.dtype, qinfer::tensor::DType::F8_E4M3);
        }
    }
}

#[test]
fn teacher_forced_logits_match_transformers() {
    let mut bad = Vec::new();
    for dir in fixtures() {
        let input = ids(&reference(&dir)["input_ids"]);
        let lm = load(&dir);
        let r = Reference::load(&dir, lm.as_ref()).computed_by("transformers");
        let mut seq = lm.new_sequence(input.len());
        let got = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        bad.extend(r.check("full sequence", &got));
        let mut step = lm.new_sequence(input.len());
        let mut one = Vec::new();
        for t in &input {
            one.extend(lm.forward(step.as_mut(), &[*t], Logits::Last).unwrap());
        }
        bad.extend(r.check("token by token", &one));
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn greedy_continuations_match_transformers() {
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

/// A copy of the qwen3_b32 fixture whose config.json `edit` rewrites; the
/// error `loader::open` + `load_cpu` gives.
fn error_with_config(edit: impl Fn(&mut Value)) -> String {
    let src = fixtures().into_iter().find(|d| d.ends_with("qwen3_b32")).unwrap();
    let dir = std::env::temp_dir().join(format!("qinfer-fp8-bad-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    let err = match loader::open(&dir) {
        Err(e) => e.to_string(),
        Ok(m) => m.load_cpu(false).err().map(|e| e.to_string()).unwrap_or_default(),
    };
    std::fs::remove_dir_all(&dir).unwrap();
    err
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

#[test]
fn bad_fp8_configs_name_the_field_or_tensor() {
    let e = error_with_config(|c| c["quantization_config"]["fmt"] = "e5m2".into());
    assert!(e.contains("config.json") && e.contains("quantization_config.fmt") && e.contains("e5m2"), "{e}");
    let e = error_with_config(|c| c["quantization_config"]["quant_method"] = "gptq".into());
    assert!(e.contains("quant_method") && e.contains("gptq"), "{e}");
    let e = error_with_config(|c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    assert!(e.contains("F8_E4M3") && e.contains("self_attn"), "{e}");
    // A block size the stored scales do not fit.
    let e = error_with_config(|c| c["quantization_config"]["weight_block_size"] = serde_json::json!([16, 16]));
    assert!(e.contains("weight_scale_inv") && e.contains("fits none"), "{e}");
}
