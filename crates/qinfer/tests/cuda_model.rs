//! Whole models on the GPU: random affine models, the tiny transformers
//! fixtures and GGUF files against the CPU, recorded decode steps against
//! eager ones, decoding ahead, and sequences reusing recorded steps.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common;
mod common_cuda;

use std::path::Path;

use common::DecodedBlocks;
use common_cuda::ties::{ROUTER_TIE, TieWatch, take_least_gap};
use common_cuda::*;
use qinfer::backend::cpu::CpuBackend;
use qinfer::backend::cuda::CudaBackend;
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::kv::KvPrecision;
use qinfer::loader::{self, Device};
use qinfer::models::decoder::DecoderModel;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::{Sampler, SamplingParams};

/// Whole random-weight models (the shapes `bench --random-weights` builds,
/// scaled down), affine-quantized: decode on the GPU, GEMVs handing their
/// rows on quantized and steps replayed as graphs, against the CPU.
#[test]
fn random_affine_models_decode_like_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("qinfer-random-affine-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dense = r#"{"model_type": "qwen3", "vocab_size": 3000, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "max_position_embeddings": 4096, "tie_word_embeddings": false}"#;
    let hybrid = r#"{"model_type": "qwen3_5_text", "vocab_size": 3000, "hidden_size": 768, "intermediate_size": 2048,
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-06, "max_position_embeddings": 4096, "tie_word_embeddings": true}"#;
    for (name, json) in [("dense", dense), ("hybrid", hybrid)] {
        let config = dir.join(format!("{name}.json"));
        std::fs::write(&config, json).unwrap();
        for (storage, kv) in [("q4g64", KvPrecision::F16), ("q8g32", KvPrecision::F16), ("q4g128", KvPrecision::F32)] {
            let storage = storage.parse().unwrap();
            let (_, cpu) = loader::random_model(&config, storage, Device::CPU).unwrap();
            let cuda = Device::Cuda { ordinal: 0, options: loader::CudaOptions { kv, ..Default::default() } };
            let (_, gpu) = loader::random_model(&config, storage, cuda).unwrap();
            let (mut sc, mut sg) = (cpu.new_sequence(64), gpu.new_sequence(64));
            let prompt = [11u32, 250, 7, 1999, 42, 5];
            let mut worst = rel(
                &gpu.forward(sg.as_mut(), &prompt, Logits::Last).unwrap(),
                &cpu.forward(sc.as_mut(), &prompt, Logits::Last).unwrap(),
            );
            for i in 0..12u32 {
                let t = (i * 241 + 3) % 3000;
                let g = gpu.forward(sg.as_mut(), &[t], Logits::Last).unwrap();
                let c = cpu.forward(sc.as_mut(), &[t], Logits::Last).unwrap();
                worst = worst.max(rel(&g, &c));
            }
            println!("{name} {storage} {kv:?} cache: logits rel to the CPU at most {worst:.2e}");
            assert!(worst < 2e-3, "{name} {storage} {kv:?} cache: logits rel {worst} to the CPU");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tiny_models_on_cuda_match_transformers_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    for dir in fixtures() {
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let input = ids(&r["input_ids"]);
        let m = loader::open(&dir).unwrap();
        let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Default precision (prefill activations rounded to bf16): reported, not asserted.
        let fast = m.load("cuda".parse().unwrap(), false).unwrap();
        let mut seq = fast.new_sequence(input.len());
        let d_fast = max_abs(&fast.forward(seq.as_mut(), &input, Logits::All).unwrap(), &want);
        // Split activations and an f32 KV cache: the parity configuration.
        let backend = CudaBackend::new(0).unwrap().with_split_activations().with_kv_precision(KvPrecision::F32);
        let lm = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap();
        let mut seq = lm.new_sequence(input.len());
        let d = max_abs(&lm.forward(seq.as_mut(), &input, Logits::All).unwrap(), &want);
        println!(
            "{}: prefill max |Δlogit| {d:.2e} split, {d_fast:.2e} bf16 activations (logits up to {scale:.1})",
            dir.display()
        );
        assert!(d <= 2e-3 * scale, "{}: {d}", dir.display());
        // Decode one token at a time (the GEMV path, f32 math) against the CPU.
        let cpu = m.load_cpu(false).unwrap();
        let mut sg = lm.new_sequence(input.len());
        let mut sc = cpu.new_sequence(input.len());
        for (i, t) in input.iter().take(12).enumerate() {
            let g = lm.forward(sg.as_mut(), &[*t], Logits::Last).unwrap();
            let c = cpu.forward(sc.as_mut(), &[*t], Logits::Last).unwrap();
            let e = rel(&g, &c);
            assert!(e < 1e-3, "{} decode step {i}: rel {e}", dir.display());
        }
        let prompt = ids(&r["greedy"]["prompt"]);
        let want_greedy = ids(&r["greedy"]["new_tokens"]);
        let opts = GenerateOptions {
            max_new_tokens: want_greedy.len(),
            stop_tokens: vec![],
            prefill_chunk: 512,
            adapter: None,
        };
        let (got_greedy, _) = generate(&lm, &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(got_greedy, want_greedy, "{}: greedy on CUDA", dir.display());
        // The default configuration (bf16 prefill activations, f16 KV cache) too.
        let (fast_greedy, _) =
            generate(fast.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(fast_greedy, want_greedy, "{}: greedy on CUDA, default precision", dir.display());
    }
}

/// GGUF files of every block type on CUDA (tests/fixtures/gguf_quant: a
/// hidden-256 Qwen3, every matrix in the type): 32-value block types become
/// affine weights, Q2_K/Q3_K/Q6_K f32 ones. Against the same model on the
/// CPU with the blocks decoded to f32: decode steps (the GEMV path, f32 math
/// on the exact weights) within f32 rounding, and the prefill (whose GEMMs
/// read affine weights through bf16 tiles) within that rounding of the weights.
#[test]
fn gguf_block_types_on_cuda_match_their_decoded_weights() {
    if gpu().is_none() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_quant");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let input = ids(&r["input_ids"]);
    for name in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"] {
        let m = loader::open(&dir.join(name).join("model.gguf")).unwrap();
        let decoded = DecodedBlocks(m.source.as_ref());
        let cpu = DecoderModel::load(m.config.clone(), &decoded, CpuBackend::new(), &|_| {}).unwrap();
        let backend = CudaBackend::new(0).unwrap().with_split_activations();
        let lm = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {})
            .unwrap_or_else(|e| panic!("{name} on CUDA: {e}"));
        let (mut sc, mut sg) = (cpu.new_sequence(input.len()), lm.new_sequence(input.len()));
        let want = cpu.forward(sc.as_mut(), &input, Logits::All).unwrap();
        let got = lm.forward(sg.as_mut(), &input, Logits::All).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d_prefill = max_abs(&got, &want);
        let (mut sc, mut sg) = (cpu.new_sequence(input.len()), lm.new_sequence(input.len()));
        let mut e_decode = 0f32;
        for &t in input.iter().take(12) {
            let c = cpu.forward(sc.as_mut(), &[t], Logits::Last).unwrap();
            let g = lm.forward(sg.as_mut(), &[t], Logits::Last).unwrap();
            e_decode = e_decode.max(rel(&g, &c));
        }
        println!(
            "{name} on CUDA: decode rel {e_decode:.2e}, prefill max |Δlogit| {d_prefill:.2e} (logits up to {scale:.1})"
        );
        assert!(e_decode < 1e-3, "{name}: decode rel {e_decode}");
        // bf16 weight tiles: 2^-9 of each weight, far below the distance of
        // a wrong decoding (the logits' own scale).
        assert!(d_prefill <= 1e-2 * scale, "{name}: prefill {d_prefill} (scale {scale})");
    }
}

/// Decode steps replayed from recorded CUDA graphs give what running each step
/// eagerly gives, across the attention-chunk boundaries where a new step is
/// recorded, for dense, sliding-window, hybrid and MoE (routed on the device)
/// models; and stay within f32 reach of the CPU. A routed model's prompt is
/// drawn again where the CPU finds a router near-tie in it (the GPU may
/// route such a token otherwise, and its state stays in the cache), and the
/// comparison with the CPU ends at a decode step with one.
#[test]
fn recorded_decode_steps_replay_what_eager_steps_compute() {
    if gpu().is_none() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    for name in ["qwen3", "qwen2_sliding", "qwen3_5", "qwen3_5_gdn128", "qwen3_moe", "qwen3_5_moe"] {
        let m = loader::open(&root.join(name)).unwrap();
        let vocab = m.config.vocab_size;
        let mut r = Rng::fresh();
        let (watch, gaps) = TieWatch::new();
        let cpu = DecoderModel::load(m.config.clone(), m.source.as_ref(), watch, &|_| {}).unwrap();
        let mut sc = cpu.new_sequence(600);
        let mut prompt: Vec<u32>;
        let mut draws = 0;
        loop {
            prompt = (0..250).map(|_| ((r.f().abs() * 1e6) as usize % vocab) as u32).collect();
            cpu.forward(sc.as_mut(), &prompt, Logits::Last).unwrap();
            let gap = take_least_gap(&gaps);
            draws += 1;
            if gap >= ROUTER_TIE {
                break;
            }
            println!("{name}: router near-tie in the prompt (gap {gap:.1e}): drawn again");
            assert!(draws < 10, "{name}: 10 prompts in a row hold a router near-tie");
            sc = cpu.new_sequence(600);
        }
        // Split activations and an f32 cache: the prefill's GEMMs close to
        // f32, like the CPU's (the f16 cache's recorded steps replay in
        // new_sequences_replay_the_steps_a_dropped_one_recorded).
        let parity = || CudaBackend::new(0).unwrap().with_split_activations().with_kv_precision(KvPrecision::F32);
        let backend = parity();
        let replays = backend.replay_counter();
        let graphs = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {});
        let eager = DecoderModel::load(m.config.clone(), m.source.as_ref(), parity().without_graphs(), &|_| {});
        let (graphs, eager) = (graphs.unwrap(), eager.unwrap());
        let (mut sg, mut se) = (graphs.new_sequence(600), eager.new_sequence(600));
        graphs.forward(sg.as_mut(), &prompt, Logits::Last).unwrap();
        eager.forward(se.as_mut(), &prompt, Logits::Last).unwrap();
        let mut worst = 0f32;
        // The decode step from which a router near-tie voids the comparison with the CPU.
        let mut tie_at = None;
        for i in 0..280 {
            let t = (i * 37 % vocab) as u32;
            let g = graphs.forward(sg.as_mut(), &[t], Logits::Last).unwrap();
            let e = eager.forward(se.as_mut(), &[t], Logits::Last).unwrap();
            let c = cpu.forward(sc.as_mut(), &[t], Logits::Last).unwrap();
            assert_eq!(g, e, "{name}: step {i} at {} keys, replayed vs eager", 251 + i);
            if tie_at.is_none() && take_least_gap(&gaps) < ROUTER_TIE {
                tie_at = Some(i);
            }
            if tie_at.is_none() {
                worst = worst.max(rel(&g, &c));
            }
        }
        // Steps that end in a greedy pick on the device: replayed and eager
        // steps pick alike, and the pick is a maximum of the CPU's logits.
        let mut greedy = Sampler::new(SamplingParams::default()).unwrap();
        for i in 0..8 {
            let t = (i * 53 % vocab) as u32;
            let a = graphs.forward_sample(sg.as_mut(), &[t], &mut greedy, &[]).unwrap();
            let b = eager.forward_sample(se.as_mut(), &[t], &mut greedy, &[]).unwrap();
            let c = cpu.forward(sc.as_mut(), &[t], Logits::Last).unwrap();
            let top = c.iter().fold(f32::MIN, |m, v| m.max(*v));
            assert_eq!(a, b, "{name}: greedy step {i}, replayed vs eager");
            if tie_at.is_none() && take_least_gap(&gaps) < ROUTER_TIE {
                tie_at = Some(280 + i);
            }
            if tie_at.is_none() {
                assert!(top - c[a as usize] <= 1e-3 * top.abs().max(1.0), "{name}: greedy step {i} picked {a}");
            }
        }
        let replayed = replays.load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "{name}: {replayed} of 288 decode steps replayed, equal to eager ones; rel to CPU at most {worst:.1e}{}",
            tie_at.map(|i| format!(" (up to step {i}, a router near-tie)")).unwrap_or_default()
        );
        // Three recordings (1, 2 and 4 key chunks), each after a warm-up pass.
        assert!(replayed >= 274, "{name}: only {replayed} steps replayed");
        assert!(worst < 1e-3, "{name}: rel {worst} to the CPU");
    }
}

/// Decoding that starts each step before the host has read the pick it feeds
/// (the device feeds it) picks what one step at a time picks, greedy and
/// sampled; a stop leaves the step started after it out of the sequence, so
/// the sequence goes on from the last accepted pick as one never run ahead.
#[test]
fn decoding_ahead_picks_what_step_by_step_decoding_does() {
    if gpu().is_none() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    for name in ["qwen3", "qwen2_sliding", "qwen3_moe"] {
        let m = loader::open(&root.join(name)).unwrap();
        let vocab = m.config.vocab_size;
        let mut r = Rng::fresh();
        let prompt: Vec<u32> = (0..30).map(|_| ((r.f().abs() * 1e6) as usize % vocab) as u32).collect();
        let model = DecoderModel::load(m.config.clone(), m.source.as_ref(), CudaBackend::new(0).unwrap(), &|_| {});
        let model = model.unwrap();
        let sampled = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 7, ..Default::default() };
        for params in [SamplingParams::default(), sampled] {
            // Step by step: each pick read before the next step.
            let mut seq = model.new_sequence(200);
            let mut sampler = Sampler::new(params.clone()).unwrap();
            let mut context = prompt.clone();
            let mut t = model.forward_sample(seq.as_mut(), &prompt, &mut sampler, &context).unwrap();
            let mut by_step = vec![t];
            for _ in 0..60 {
                context.push(t);
                t = model.forward_sample(seq.as_mut(), &[t], &mut sampler, &context).unwrap();
                by_step.push(t);
            }
            drop(seq);
            // Ahead, stopped after 40 picks: then 20 more fed one at a time.
            let mut seq = model.new_sequence(200);
            let mut sampler = Sampler::new(params.clone()).unwrap();
            let mut context = prompt.clone();
            let first = model.forward_sample(seq.as_mut(), &prompt, &mut sampler, &context).unwrap();
            context.push(first);
            let mut ahead = vec![first];
            let on_pick = &mut |p: u32| {
                ahead.push(p);
                Ok(ahead.len() < 41)
            };
            model.decode(seq.as_mut(), first, 60, &mut sampler, &mut context, on_pick).unwrap();
            assert_eq!(ahead.len(), 41, "{name}: the stop ends the picks");
            assert_eq!(seq.len(), prompt.len() + 40, "{name}: the step past the stop is left out");
            let mut t = ahead[40];
            for _ in 0..20 {
                t = model.forward_sample(seq.as_mut(), &[t], &mut sampler, &context).unwrap();
                context.push(t);
                ahead.push(t);
            }
            assert_eq!(ahead, by_step, "{name}: {params:?}");
        }
    }
}

/// A dropped sequence's buffers and recorded steps serve the next sequence of
/// the same capacity: its decode steps all replay, its Gated DeltaNet states
/// start from zeros again (same logits as the first sequence, bit for bit),
/// and a sequence of another capacity still computes the same.
#[test]
fn new_sequences_replay_the_steps_a_dropped_one_recorded() {
    if gpu().is_none() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    for name in ["qwen3", "qwen3_5", "qwen3_5_moe"] {
        let m = loader::open(&root.join(name)).unwrap();
        let vocab = m.config.vocab_size;
        let mut r = Rng::fresh();
        let prompt: Vec<u32> = (0..20).map(|_| ((r.f().abs() * 1e6) as usize % vocab) as u32).collect();
        let backend = CudaBackend::new(0).unwrap();
        let replays = backend.replay_counter();
        let model = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap();
        let run = |capacity: usize| {
            let mut seq = model.new_sequence(capacity);
            let mut out = vec![model.forward(seq.as_mut(), &prompt, Logits::Last).unwrap()];
            for i in 0..40 {
                let t = (i * 37 % vocab) as u32;
                out.push(model.forward(seq.as_mut(), &[t], Logits::Last).unwrap());
            }
            out
        };
        let count = || replays.load(std::sync::atomic::Ordering::Relaxed);
        let first = run(100);
        let before = count();
        let second = run(100);
        assert_eq!(count() - before, 40, "{name}: every step of the second sequence replays");
        assert!(first == second, "{name}: the reused sequence computes what the first did");
        let before = count();
        let other = run(120);
        assert!(count() - before < 40, "{name}: another capacity records its own steps");
        assert!(first == other, "{name}: a sequence of another capacity computes the same");
    }
}

/// The near-tie watch measures the gap between each token's k-th and
/// (k+1)-th router logits (checked on any machine).
#[test]
fn router_gaps_are_between_the_last_chosen_and_the_first_left_out() {
    use common_cuda::ties::least_routing_gap;
    // Two tokens of 4 experts, top 2: gaps 0.5 (0.9 vs 0.4) and 1e-5.
    let logits = [0.1, 0.9, 1.2, 0.4, 2.0, -1.0, 0.30001, 0.3];
    assert!((least_routing_gap(&logits[..4], 4, 2) - 0.5).abs() < 1e-6);
    assert!(least_routing_gap(&logits, 4, 2) < ROUTER_TIE);
    // Every expert chosen: nothing left out, no gap.
    assert_eq!(least_routing_gap(&logits, 4, 4), f32::INFINITY);
}
