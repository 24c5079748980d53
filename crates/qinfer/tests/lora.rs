//! LoRA adapters against peft + transformers (float32) on the tiny models:
//! random non-zero adapters in PEFT's and mlx-lm's formats
//! (tests/fixtures/lora, made by scripts/make_fixtures_lora.py), alone and
//! mixed in one batch, and what is refused.

mod common;

use std::path::{Path, PathBuf};

use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::request::{Request, StopConditions};
use qinfer::loader;
use qinfer::lora::LoraAdapter;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;
use serde_json::Value;

const CASES: [&str; 6] =
    ["qwen2_bf16", "qwen3_5_hybrid", "qwen3_all", "qwen3_moe_attn", "qwen3_next_hybrid", "qwen3_partial"];

fn fixtures() -> Vec<PathBuf> {
    common::exact_fixture_dirs("lora", &CASES, "reference.json")
}

fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn base_of(dir: &Path) -> Box<dyn LanguageModel> {
    let base = reference(dir)["base"].as_str().unwrap().to_string();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(base);
    loader::open(&path).unwrap().load_cpu(false).unwrap()
}

/// Tolerance on the logits: 1e-4, and 2e-4 on the Gated DeltaNet hybrids,
/// whose base models alone already sit ~1e-4 from transformers in float32
/// (parity_tiny) with logits of magnitude ~50.
fn tolerance(dir: &Path) -> f32 {
    if dir.to_string_lossy().contains("hybrid") { 2e-4 } else { 1e-4 }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Teacher-forced logits of the adapter in `adapter_dir` on `dir`'s base.
fn adapted_logits(lm: &dyn LanguageModel, dir: &Path, adapter_dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let input = ids(&reference(dir)["input_ids"]);
    let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
    let adapter = LoraAdapter::load(adapter_dir).unwrap_or_else(|e| panic!("{}: {e}", adapter_dir.display()));
    let id = lm.add_adapter(&adapter).unwrap_or_else(|e| panic!("{}: {e}", adapter_dir.display()));
    let mut seq = lm.new_sequence(input.len());
    lm.set_adapter(seq.as_mut(), Some(id)).unwrap();
    let got = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
    (got, want)
}

#[test]
fn peft_adapters_match_peft_logits_on_every_architecture() {
    for dir in fixtures() {
        let lm = base_of(&dir);
        let (got, want) = adapted_logits(lm.as_ref(), &dir, &dir);
        let d = max_abs_diff(&got, &want);
        // Without the adapter the logits are far off: the adapter is not a no-op.
        let input = ids(&reference(&dir)["input_ids"]);
        let mut plain = lm.new_sequence(input.len());
        let base = lm.forward(plain.as_mut(), &input, Logits::All).unwrap();
        let off = max_abs_diff(&base, &want);
        println!("{}: max |Δlogit| = {d:.2e} (the base alone: {off:.2e})", dir.display());
        assert!(d <= tolerance(&dir), "{}: max |Δlogit| = {d}", dir.display());
        assert!(off > 0.05, "{}: the adapter barely changes the logits ({off})", dir.display());
    }
}

#[test]
fn mlx_adapters_match_the_same_weights_in_peft_form() {
    let mut seen = 0;
    for dir in fixtures() {
        let mlx = dir.join("mlx");
        if !mlx.exists() {
            continue;
        }
        let lm = base_of(&dir);
        let (got, want) = adapted_logits(lm.as_ref(), &dir, &mlx);
        let d = max_abs_diff(&got, &want);
        println!("{} (mlx-lm form): max |Δlogit| = {d:.2e}", dir.display());
        assert!(d <= tolerance(&dir), "{}: max |Δlogit| = {d}", mlx.display());
        seen += 1;
    }
    assert_eq!(seen, 5, "mlx-lm forms among the fixtures");
}

#[test]
fn greedy_continuations_with_adapters_match_peft() {
    for dir in fixtures() {
        let r = reference(&dir);
        let lm = base_of(&dir);
        let id = lm.add_adapter(&LoraAdapter::load(&dir).unwrap()).unwrap();
        let want = ids(&r["greedy"]["new_tokens"]);
        let opts =
            GenerateOptions { max_new_tokens: want.len(), stop_tokens: vec![], prefill_chunk: 3, adapter: Some(id) };
        let (got, _) =
            generate(lm.as_ref(), &ids(&r["greedy"]["prompt"]), &SamplingParams::default(), &opts, |_| Ok(true))
                .unwrap();
        assert_eq!(got, want, "{} (smallest top-2 margin {})", dir.display(), r["greedy"]["min_top2_margin"]);
    }
}

/// Greedy outputs of `reqs` (prompt, adapter) through the engine, all at
/// once, with the prefix cache on.
fn engine_outputs(lm: std::sync::Arc<dyn LanguageModel>, reqs: &[(Vec<u32>, Option<u64>)], n: usize) -> Vec<Vec<u32>> {
    let cfg = EngineConfig::for_model(lm.as_ref(), 64, 8, Some(256), 64 << 20);
    let mut engine = EngineCore::new(lm, None, cfg).unwrap();
    for (i, (prompt, adapter)) in reqs.iter().enumerate() {
        let req = Request {
            prompt: prompt.clone(),
            sampling: SamplingParams::default(),
            stop: StopConditions { max_tokens: n, ..Default::default() },
            adapter: *adapter,
            ..Default::default()
        };
        engine.add(i as u64, req).unwrap();
    }
    let mut out = vec![Vec::new(); reqs.len()];
    while engine.num_unfinished() > 0 {
        for o in engine.step().unwrap() {
            out[o.id as usize].extend(&o.token_ids);
        }
    }
    assert!(engine.pools_whole());
    out
}

#[test]
fn a_batch_mixing_adapters_gives_each_row_what_it_gets_alone() {
    let lora = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora");
    let (all, partial) = (lora.join("qwen3_all"), lora.join("qwen3_partial"));
    let lm: std::sync::Arc<dyn LanguageModel> = base_of(&all).into();
    let a = lm.add_adapter(&LoraAdapter::load(&all).unwrap()).unwrap();
    let b = lm.add_adapter(&LoraAdapter::load(&partial).unwrap()).unwrap();
    let (ra, rb) = (reference(&all), reference(&partial));
    let prompt = ids(&ra["greedy"]["prompt"]);
    assert_eq!(prompt, ids(&rb["greedy"]["prompt"]));
    let n = 12;
    // The same prompt under each adapter and none, twice over, plus longer
    // prompts: rows of different adapters side by side in every step, and
    // prefixes that must not be shared across adapters.
    let long: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    let reqs = vec![
        (prompt.clone(), Some(a)),
        (prompt.clone(), None),
        (prompt.clone(), Some(b)),
        (long.clone(), Some(b)),
        (prompt.clone(), Some(a)),
        (long.clone(), None),
        (long.clone(), Some(a)),
    ];
    let mixed = engine_outputs(lm.clone(), &reqs, n);
    for (i, req) in reqs.iter().enumerate() {
        let alone = engine_outputs(lm.clone(), std::slice::from_ref(req), n);
        assert_eq!(mixed[i], alone[0], "request {i} ({:?}) mixed vs alone", req.1);
    }
    // And each equals peft's continuation.
    assert_eq!(mixed[0], ids(&ra["greedy"]["new_tokens"])[..n]);
    assert_eq!(mixed[2], ids(&rb["greedy"]["new_tokens"])[..n]);
    assert_ne!(mixed[0], mixed[1]);
    // A removed adapter is gone; its id is not given out again.
    lm.remove_adapter(b).unwrap();
    assert!(lm.remove_adapter(b).is_err());
    let c = lm.add_adapter(&LoraAdapter::load(&partial).unwrap()).unwrap();
    assert!(c != a && c != b);
    let mut seq = lm.new_sequence(8);
    let err = lm.set_adapter(seq.as_mut(), Some(b)).unwrap_err().to_string();
    assert!(err.contains("no LoRA adapter"), "{err}");
}

fn copy_adapter(from: &Path, to: &Path, edit: impl FnOnce(&mut Value)) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from.join("adapter_model.safetensors"), to.join("adapter_model.safetensors")).unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("adapter_config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(to.join("adapter_config.json"), cfg.to_string()).unwrap();
}

#[test]
fn unsupported_adapters_are_refused_by_name() {
    let lora = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora");
    let tmp = std::env::temp_dir().join(format!("qinfer-lora-{}", std::process::id()));
    let src = lora.join("qwen3_all");
    for (field, value, says) in [
        ("use_dora", Value::Bool(true), "DoRA"),
        ("modules_to_save", serde_json::json!(["lm_head"]), "modules_to_save"),
        ("bias", Value::from("lora_only"), "bias"),
        ("peft_type", Value::from("IA3"), "IA3"),
    ] {
        let dir = tmp.join(field);
        copy_adapter(&src, &dir, |c| c[field] = value);
        let err = LoraAdapter::load(&dir).unwrap_err().to_string();
        assert!(err.contains(says), "{field}: {err}");
    }
    // An adapter made for another base: its shapes name the projection.
    let qwen2 = base_of(&lora.join("qwen2_bf16"));
    let err = qwen2.add_adapter(&LoraAdapter::load(&src).unwrap()).unwrap_err().to_string();
    assert!(err.contains("layers.0.self_attn.q_proj") || err.contains("maps"), "{err}");
    // Projections the model does not have (Qwen3-Next's fused names on a
    // Qwen3 base).
    let qwen3 = base_of(&src);
    let err = qwen3.add_adapter(&LoraAdapter::load(&lora.join("qwen3_next_hybrid")).unwrap()).unwrap_err().to_string();
    assert!(err.contains("cannot be applied"), "{err}");
    // A directory without an adapter.
    let err = LoraAdapter::load(&tmp.join("nothing-here")).unwrap_err().to_string();
    assert!(err.contains("adapter_config.json"), "{err}");
    std::fs::remove_dir_all(&tmp).ok();
}

/// One projection's pair: module path, A's shape and values, B's.
type Pair = (String, Vec<usize>, Vec<f32>, Vec<usize>, Vec<f32>);

/// Writes a PEFT adapter of `pairs` to `dir`.
fn write_peft(dir: &Path, r: usize, alpha: f32, pairs: &[Pair]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    let mut put = |name: String, shape: &[usize], v: &[f32]| {
        let start = data.len();
        data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        header.insert(name, serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}));
    };
    for (module, a_shape, a, b_shape, b) in pairs {
        put(format!("base_model.model.{module}.lora_A.weight"), a_shape, a);
        put(format!("base_model.model.{module}.lora_B.weight"), b_shape, b);
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    file.extend(data);
    std::fs::write(dir.join("adapter_model.safetensors"), file).unwrap();
    let cfg =
        serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none", "use_rslora": false});
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
}

/// GGUF bases in block formats (tests/fixtures/gguf_quant: a hidden-256
/// Qwen3 whose every matrix is in the type): the adapter adds no error of
/// its own beyond what the format's arithmetic gives the base, measured
/// against the same model with its blocks decoded to f32.
#[test]
fn adapters_on_quantized_bases_match_their_decoded_weights() {
    use qinfer::backend::cpu::CpuBackend;
    use qinfer::models::decoder::DecoderModel;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_quant");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(root.join("reference.json")).unwrap()).unwrap();
    let input = ids(&r["input_ids"]);
    let tmp = std::env::temp_dir().join(format!("qinfer-lora-gguf-{}", std::process::id()));
    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut rand = move |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                ((rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    };
    let rank = 8;
    let (h, i, q, kv) = (256, 512, 256, 128);
    let mut pairs = Vec::new();
    for (module, out, inp) in [
        ("self_attn.q_proj", q, h),
        ("self_attn.k_proj", kv, h),
        ("self_attn.v_proj", kv, h),
        ("self_attn.o_proj", h, q),
        ("mlp.gate_proj", i, h),
        ("mlp.up_proj", i, h),
        ("mlp.down_proj", h, i),
    ] {
        let a = rand(rank * inp, 1.0 / (inp as f32).sqrt());
        let b = rand(out * rank, 0.3);
        pairs.push((format!("model.layers.0.{module}"), vec![rank, inp], a, vec![out, rank], b));
    }
    write_peft(&tmp, rank, 16.0, &pairs);
    let adapter = LoraAdapter::load(&tmp).unwrap();
    let logits = |lm: &dyn LanguageModel, id: Option<u64>| {
        let mut seq = lm.new_sequence(input.len());
        lm.set_adapter(seq.as_mut(), id).unwrap();
        lm.forward(seq.as_mut(), &input, Logits::All).unwrap()
    };
    for name in ["Q8_0", "Q4_0", "Q4_K", "Q6_K"] {
        let m = loader::open(&root.join(name).join("model.gguf")).unwrap();
        let decoded = common::DecodedBlocks(m.source.as_ref());
        let exact = DecoderModel::load(m.config.clone(), &decoded, CpuBackend::new(), &|_| {}).unwrap();
        let quant = m.load_cpu(false).unwrap();
        let (ie, iq) = (exact.add_adapter(&adapter).unwrap(), quant.add_adapter(&adapter).unwrap());
        let (base_e, base_q) = (logits(&exact, None), logits(quant.as_ref(), None));
        let (lora_e, lora_q) = (logits(&exact, Some(ie)), logits(quant.as_ref(), Some(iq)));
        let base_gap = max_abs_diff(&base_q, &base_e);
        let lora_gap = max_abs_diff(&lora_q, &lora_e);
        let moved = max_abs_diff(&lora_e, &base_e);
        let scale = lora_e.iter().fold(0f32, |m, v| m.max(v.abs()));
        println!(
            "{name}: base vs decoded {base_gap:.2e}, adapted vs decoded {lora_gap:.2e} (the adapter moves logits by {moved:.2e}, max |logit| {scale:.1})"
        );
        assert!(moved > 0.1 * scale.max(1.0), "{name}: the adapter barely changes the logits");
        assert!(lora_gap <= 2.0 * base_gap + 1e-5 * scale, "{name}: adapted {lora_gap} vs base {base_gap}");
    }
    std::fs::remove_dir_all(&tmp).ok();
}

/// An adapter on a llama GGUF, whose q/k rows llama.cpp's converter
/// permuted for its interleaved RoPE: the adapter's q/k rows follow (peft
/// applied it in Hugging Face's order on the blocks decoded by
/// transformers; tests/fixtures/lora_gguf). The GGUF's blocks are decoded
/// to f32 here too, so both sides compute the same float32 model.
#[test]
fn adapters_follow_the_q_k_permutation_of_llama_ggufs() {
    use qinfer::backend::cpu::CpuBackend;
    use qinfer::models::decoder::DecoderModel;
    let Some(gguf) = common::default_model() else {
        common::skip("the default model (SmolLM2-135M-Instruct Q4_1) is not fetched");
        return;
    };
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora_gguf/smollm2_q4_1");
    let r = reference(&dir);
    let input = ids(&r["input_ids"]);
    let rows: Vec<usize> = r["rows"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let m = loader::open(&gguf).unwrap();
    let decoded = common::DecodedBlocks(m.source.as_ref());
    let lm = DecoderModel::load(m.config.clone(), &decoded, CpuBackend::new(), &|_| {}).unwrap();
    let id = lm.add_adapter(&LoraAdapter::load(&dir).unwrap()).unwrap();
    let vocab = m.config.vocab_size;
    let pick =
        |all: Vec<f32>| -> Vec<f32> { rows.iter().flat_map(|&i| all[i * vocab..(i + 1) * vocab].to_vec()).collect() };
    let run = |adapter: Option<u64>| {
        let mut seq = lm.new_sequence(input.len());
        lm.set_adapter(seq.as_mut(), adapter).unwrap();
        pick(lm.forward(seq.as_mut(), &input, Logits::All).unwrap())
    };
    let (_, want_base) = qinfer::npy::read_f32(&dir.join("base_logits.npy")).unwrap();
    let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
    let base_gap = max_abs_diff(&run(None), &want_base);
    let gap = max_abs_diff(&run(Some(id)), &want);
    let moved = max_abs_diff(&want, &want_base);
    println!("SmolLM2 GGUF: base {base_gap:.2e}, adapted {gap:.2e} (the adapter moves logits by {moved:.2})");
    assert!(base_gap <= 2e-3, "the decoded base differs from transformers by {base_gap}");
    assert!(gap <= 2.0 * base_gap + 1e-4, "adapted logits differ by {gap} (base {base_gap})");
}

/// Removing an adapter while a request runs with it: that request goes on
/// to its end with the adapter's weights, new requests naming it are
/// refused.
#[test]
fn an_adapter_removed_mid_request_serves_that_request_to_its_end() {
    let all = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora/qwen3_all");
    let lm: std::sync::Arc<dyn LanguageModel> = base_of(&all).into();
    let a = lm.add_adapter(&LoraAdapter::load(&all).unwrap()).unwrap();
    let prompt = ids(&reference(&all)["greedy"]["prompt"]);
    let n = 12;
    let alone = engine_outputs(lm.clone(), &[(prompt.clone(), Some(a))], n);
    let cfg = EngineConfig::for_model(lm.as_ref(), 64, 8, Some(256), 64 << 20);
    let mut engine = EngineCore::new(lm.clone(), None, cfg).unwrap();
    let req = |adapter| Request {
        prompt: prompt.clone(),
        sampling: SamplingParams::default(),
        stop: StopConditions { max_tokens: n, ..Default::default() },
        adapter,
        ..Default::default()
    };
    engine.add(0, req(Some(a))).unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        for o in engine.step().unwrap() {
            got.extend(o.token_ids);
        }
    }
    lm.remove_adapter(a).unwrap();
    assert!(!lm.has_adapter(a));
    let err = engine.add(1, req(Some(a))).unwrap_err().to_string();
    assert!(err.contains("not loaded"), "{err}");
    while engine.num_unfinished() > 0 {
        for o in engine.step().unwrap() {
            got.extend(o.token_ids);
        }
    }
    assert_eq!(got, alone[0]);
    assert!(lm.remove_adapter(a).is_err());
}

/// mlx-lm's own reading of the mlx-lm form (`mlx_lm.load(adapter_path=…)`)
/// on an MLX-quantized base whose mixed bits keep q, k and v apart
/// (tests/fixtures/lora_mlx): qinfer with the adapter is as close to mlx-lm
/// with it as the bases are to each other, in either of the adapter's forms.
#[test]
fn adapters_on_an_mlx_quantized_base_match_mlx_lm() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let dir = root.join("lora_mlx/qwen3_mixed_3_6");
    let input = ids(&reference(&dir)["input_ids"]);
    let lm = loader::open(&root.join("mlx/qwen3_mixed_3_6")).unwrap().load_cpu(false).unwrap();
    let run = |id: Option<u64>| {
        let mut seq = lm.new_sequence(input.len());
        lm.set_adapter(seq.as_mut(), id).unwrap();
        lm.forward(seq.as_mut(), &input, Logits::All).unwrap()
    };
    let (_, want_base) = qinfer::npy::read_f32(&dir.join("base_logits.npy")).unwrap();
    let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
    let base_gap = max_abs_diff(&run(None), &want_base);
    for form in [root.join("lora/qwen3_all/mlx"), root.join("lora/qwen3_all")] {
        let id = lm.add_adapter(&LoraAdapter::load(&form).unwrap()).unwrap();
        let gap = max_abs_diff(&run(Some(id)), &want);
        println!("{}: base vs mlx-lm {base_gap:.2e}, adapted {gap:.2e}", form.display());
        assert!(gap <= 2.0 * base_gap + 1e-4, "{}: adapted {gap} vs base {base_gap}", form.display());
    }
    assert!(max_abs_diff(&want, &want_base) > 1.0, "mlx-lm's adapter barely moved the logits");
}
