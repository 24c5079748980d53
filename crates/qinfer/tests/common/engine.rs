//! The engine tests' shared pieces: loading a fixture model on the CPU,
//! requests, engine configurations, and running requests through an engine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use std::sync::Arc;

use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::request::{FinishReason, Request, StopConditions};
use qinfer::loader;
use qinfer::models::LanguageModel;
use qinfer::sampling::SamplingParams;

pub fn load(dir: &Path) -> Arc<dyn LanguageModel> {
    let m = loader::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    Arc::from(m.load_cpu(false).unwrap())
}

pub fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Request {
    Request { prompt, sampling, stop: StopConditions { max_tokens, ..Default::default() }, ..Default::default() }
}

pub fn config(max_batched_tokens: usize, max_num_seqs: usize, num_blocks: usize) -> EngineConfig {
    EngineConfig {
        max_batched_tokens,
        max_num_seqs,
        block_size: 16,
        num_blocks,
        max_model_len: 1024,
        prefix_cache: None,
        speculative: None,
    }
}

/// Runs `reqs` through `core`, request `i` joining before step `joins[i]`;
/// returns each one's tokens and finish reason.
pub fn run(core: &mut EngineCore, reqs: &[Request], joins: &[usize]) -> Vec<(Vec<u32>, FinishReason)> {
    let mut got: HashMap<u64, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    let mut step = 0;
    loop {
        for (i, r) in reqs.iter().enumerate() {
            if joins[i] == step {
                core.add(i as u64, r.clone()).unwrap();
            }
        }
        if core.num_unfinished() == 0 && joins.iter().all(|&j| j < step) {
            break;
        }
        for out in core.step().unwrap() {
            let e = got.entry(out.id).or_default();
            e.0.extend(&out.token_ids);
            assert!(e.1.is_none(), "output after the finish");
            e.1 = out.finish;
            assert_eq!(out.usage.completion_tokens, e.0.len());
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    assert!(core.pools_whole(), "blocks or state slots leaked");
    (0..reqs.len() as u64).map(|i| got.remove(&i).map(|(t, f)| (t, f.expect("finished"))).unwrap()).collect()
}

/// The tiny fixture models, each architecture.
pub fn fixtures() -> Vec<PathBuf> {
    super::exact_fixture_dirs("tiny", &super::TINY_FIXTURES, "reference.json")
}

pub fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The requests each test mixes: transformers' greedy prompt first, then
/// prompts of 1 to 80 tokens cut from the fixture's input (some past a
/// 64-token chunk), greedy and seeded sampling, short and long budgets.
pub fn requests(r: &Value) -> Vec<Request> {
    // The fixture's input, repeated where it is shorter than 80 tokens.
    let input: Vec<u32> = ids(&r["input_ids"]).into_iter().cycle().take(80).collect();
    let want = ids(&r["greedy"]["new_tokens"]);
    let sampled = |seed| SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.9, seed, ..Default::default() };
    vec![
        request(ids(&r["greedy"]["prompt"]), want.len(), SamplingParams::default()),
        request(input[..1].to_vec(), 9, SamplingParams::default()),
        request(input[3..74].to_vec(), 12, SamplingParams::default()),
        request(input[10..17].to_vec(), 30, sampled(7)),
        request(input.clone(), 5, SamplingParams::default()),
        request(input[20..53].to_vec(), 16, sampled(11)),
        request(input[5..70].to_vec(), 20, SamplingParams { repetition_penalty: 1.3, ..Default::default() }),
    ]
}
