//! LoRA adapters on the GPU: the peft references of tests/fixtures/lora
//! (teacher-forced logits, greedy continuations, decode steps against the
//! CPU), and the batched engine mixing adapters. Without a CUDA device the
//! tests print why and pass (they fail under `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common_cuda::*;
use qinfer::backend::cuda::CudaBackend;
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::request::{Request, StopConditions};
use qinfer::kv::KvPrecision;
use qinfer::loader;
use qinfer::lora::LoraAdapter;
use qinfer::models::decoder::DecoderModel;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn reference(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

/// The case's base on the GPU in the parity configuration (split
/// activations, f32 KV), and on the CPU.
fn bases(case: &Path) -> (Box<dyn LanguageModel>, Box<dyn LanguageModel>) {
    let base = root().join(reference(case)["base"].as_str().unwrap());
    let m = loader::open(&base).unwrap();
    let backend = CudaBackend::new(0).unwrap().with_split_activations().with_kv_precision(KvPrecision::F32);
    let gpu = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap();
    (Box::new(gpu), m.load_cpu(false).unwrap())
}

#[test]
fn adapters_on_cuda_match_peft_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    for name in ["qwen3_all", "qwen3_partial", "qwen2_bf16", "qwen3_moe_attn", "qwen3_5_hybrid", "qwen3_next_hybrid"] {
        let dir = root().join("lora").join(name);
        let r = reference(&dir);
        let input = ids(&r["input_ids"]);
        let (lm, cpu) = bases(&dir);
        let adapter = LoraAdapter::load(&dir).unwrap();
        let (id, cid) = (lm.add_adapter(&adapter).unwrap(), cpu.add_adapter(&adapter).unwrap());
        let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut seq = lm.new_sequence(input.len());
        lm.set_adapter(seq.as_mut(), Some(id)).unwrap();
        let d = max_abs(&lm.forward(seq.as_mut(), &input, Logits::All).unwrap(), &want);
        println!("{name}: prefill max |Δlogit| {d:.2e} (logits up to {scale:.1})");
        assert!(d <= 2e-3 * scale, "{name}: {d}");
        // Decode steps (one row, not recorded as graphs) against the CPU.
        let (mut sg, mut sc) = (lm.new_sequence(input.len()), cpu.new_sequence(input.len()));
        lm.set_adapter(sg.as_mut(), Some(id)).unwrap();
        cpu.set_adapter(sc.as_mut(), Some(cid)).unwrap();
        for (i, t) in input.iter().take(12).enumerate() {
            let g = lm.forward(sg.as_mut(), &[*t], Logits::Last).unwrap();
            let c = cpu.forward(sc.as_mut(), &[*t], Logits::Last).unwrap();
            let e = rel(&g, &c);
            assert!(e < 1e-3, "{name} decode step {i}: rel {e}");
        }
        let want_greedy = ids(&r["greedy"]["new_tokens"]);
        let opts = GenerateOptions {
            max_new_tokens: want_greedy.len(),
            stop_tokens: vec![],
            prefill_chunk: 512,
            adapter: Some(id),
        };
        let prompt = ids(&r["greedy"]["prompt"]);
        let (got, _) = generate(lm.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(
            got, want_greedy,
            "{name}: greedy on CUDA (smallest top-2 margin {})",
            r["greedy"]["min_top2_margin"]
        );
    }
}

#[test]
fn the_cuda_engine_mixes_adapters_in_one_batch() {
    if gpu().is_none() {
        return;
    }
    let (all, partial) = (root().join("lora/qwen3_all"), root().join("lora/qwen3_partial"));
    let (lm, _) = bases(&all);
    let lm: Arc<dyn LanguageModel> = lm.into();
    let a = lm.add_adapter(&LoraAdapter::load(&all).unwrap()).unwrap();
    let b = lm.add_adapter(&LoraAdapter::load(&partial).unwrap()).unwrap();
    let prompt = ids(&reference(&all)["greedy"]["prompt"]);
    let long: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    let reqs = [
        (prompt.clone(), Some(a)),
        (prompt.clone(), None),
        (prompt.clone(), Some(b)),
        (long.clone(), Some(b)),
        (long.clone(), None),
        (long.clone(), Some(a)),
    ];
    let run = |reqs: &[(Vec<u32>, Option<u64>)]| {
        let cfg = EngineConfig::for_model(lm.as_ref(), 64, 8, Some(256), 64 << 20);
        let mut engine = EngineCore::new(lm.clone(), None, cfg).unwrap();
        for (i, (prompt, adapter)) in reqs.iter().enumerate() {
            let stop = StopConditions { max_tokens: 12, ..Default::default() };
            let req = Request { prompt: prompt.clone(), stop, adapter: *adapter, ..Default::default() };
            engine.add(i as u64, req).unwrap();
        }
        let mut out = vec![Vec::new(); reqs.len()];
        while engine.num_unfinished() > 0 {
            for o in engine.step().unwrap() {
                out[o.id as usize].extend(o.token_ids);
            }
        }
        out
    };
    let mixed = run(&reqs);
    for (i, req) in reqs.iter().enumerate() {
        assert_eq!(mixed[i], run(std::slice::from_ref(req))[0], "request {i} mixed vs alone");
    }
    assert_eq!(mixed[0], ids(&reference(&all)["greedy"]["new_tokens"])[..12]);
    assert_eq!(mixed[2], ids(&reference(&partial)["greedy"]["new_tokens"])[..12]);
}
