//! Encoded KV caches (`--kv-cache`: FP8, TurboQuant) on the tiny models of
//! tests/fixtures/tiny: logits stay within each format's bound of
//! transformers', and at every width a request's output is the same
//! run alone, mixed with others (chunked prefills, preemption, the prefix
//! cache) and through the one-sequence path: encoding depends only on a
//! sequence's own rows.

mod common;

use common::engine::{fixtures, ids, reference, run};
use std::path::Path;
use std::sync::Arc;

use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::{Request, StopConditions};
use qinfer::kv::KvFormat;
use qinfer::loader::{self, Device};
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;

fn load(dir: &Path, kv: &str) -> Arc<dyn LanguageModel> {
    let m = loader::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let kv: KvFormat = kv.parse().unwrap();
    Arc::from(m.load(Device::Cpu { kv }, false).unwrap())
}

fn greedy(model: &dyn LanguageModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_new_tokens: n, stop_tokens: vec![], prefill_chunk: 512, adapter: None };
    generate(model, prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap().0
}

/// Teacher-forced logits against transformers' (f32 cache) on every tiny
/// model, as max |Δlogit| over the logits' standard deviation. These random
/// O(1)-weight models amplify any perturbation (f16 rounding alone moves
/// logits by up to 1.5% of their spread, and MoE routing flips), so the
/// bound is on the median over models, and fewer bits must cost more; how
/// much of transformers' greedy continuation survives is printed. Quality
/// on a real model is measured by `qinfer perplexity --kv-cache`.
#[test]
fn encoded_caches_stay_near_transformers_logits() {
    // Median bound per format, in standard deviations of the logits.
    let formats = [("f16", 0.02), ("turbo8", 0.3), ("fp8", 1.0), ("k8v4", 2.0), ("turbo4", 3.0)];
    let mut errors: Vec<Vec<f32>> = vec![Vec::new(); formats.len()];
    for dir in fixtures() {
        let r = reference(&dir);
        let input = ids(&r["input_ids"]);
        let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let mean = want.iter().sum::<f32>() / want.len() as f32;
        let std = (want.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / want.len() as f32).sqrt();
        let prompt = ids(&r["greedy"]["prompt"]);
        let tokens = ids(&r["greedy"]["new_tokens"]);
        for (f, (kv, _)) in formats.iter().enumerate() {
            let model = load(&dir, kv);
            let mut seq = model.new_sequence(input.len());
            let got = model.forward(seq.as_mut(), &input, Logits::All).unwrap();
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / std;
            let out = greedy(model.as_ref(), &prompt, tokens.len());
            let same = out.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
            println!("{}: {kv}: max |Δlogit| = {d:.4} std; greedy keeps {same} of {}", dir.display(), tokens.len());
            errors[f].push(d);
        }
    }
    let medians: Vec<f32> = errors
        .iter_mut()
        .map(|e| {
            e.sort_by(f32::total_cmp);
            e[e.len() / 2]
        })
        .collect();
    println!("medians: {medians:?}");
    for ((kv, bound), m) in formats.iter().zip(&medians) {
        assert!(m <= bound, "{kv}: median max |Δlogit| {m} std > {bound}");
    }
    assert!(medians.windows(2).all(|w| w[0] < w[1]), "fewer bits, more error: {medians:?}");
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    let stop = StopConditions { max_tokens, ..Default::default() };
    Request { prompt, sampling: SamplingParams::default(), stop, ..Default::default() }
}

fn config(max_batched_tokens: usize, max_num_seqs: usize, num_blocks: usize, cache: bool) -> EngineConfig {
    EngineConfig {
        max_batched_tokens,
        max_num_seqs,
        block_size: 16,
        num_blocks,
        max_model_len: 1024,
        prefix_cache: cache.then_some(PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 4, host_bytes: 0 }),
        speculative: None,
    }
}

#[test]
fn encoded_caches_give_each_request_the_same_output_in_any_batch() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let r = reference(&dir);
        let input: Vec<u32> = ids(&r["input_ids"]).into_iter().cycle().take(80).collect();
        // Two prompts share their first 40 tokens (the prefix cache hands
        // the second the first's blocks, anchors included).
        let reqs = vec![
            request(input[..1].to_vec(), 9),
            request(input[..40].to_vec(), 12),
            request([&input[..40], &input[50..75]].concat(), 10),
            request(input.clone(), 6),
            request(input[5..70].to_vec(), 14),
        ];
        for kv in ["turbo4", "k4pv3", "fp8"] {
            let model = load(&dir, kv);
            let alone: Vec<Vec<u32>> = reqs
                .iter()
                .map(|q| {
                    let mut core = EngineCore::new(model.clone(), None, config(512, 1, 64, false)).unwrap();
                    run(&mut core, std::slice::from_ref(q), &[0]).remove(0).0
                })
                .collect();
            for (q, tokens) in reqs.iter().zip(&alone) {
                let want = greedy(model.as_ref(), &q.prompt, q.stop.max_tokens);
                assert_eq!(tokens, &want, "{name} {kv}: engine alone vs generate, prompt of {}", q.prompt.len());
            }
            for cache in [false, true] {
                let mut core = EngineCore::new(model.clone(), None, config(64, 3, 12, cache)).unwrap();
                let mixed: Vec<Vec<u32>> =
                    run(&mut core, &reqs, &[0, 0, 2, 3, 5]).into_iter().map(|(tokens, _)| tokens).collect();
                assert_eq!(alone, mixed, "{name} {kv}: alone vs mixed (prefix cache {cache})");
            }
        }
    }
}
