//! Embedding and reranking through the engine on the CPU, against
//! sentence-transformers and transformers (tests/fixtures/pooling, made by
//! scripts/make_fixtures_pooling.py): tiny Qwen3 checkpoints in
//! Qwen3-Embedding's layout with last-token, mean and first-token pooling,
//! and a Qwen3-Reranker-style model scored with the model card's prompt.
//! Pooling requests run alongside a generating one in the same engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::pooling::{PoolingConfig, RerankFormat, finish_embedding};
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::{Output, Request, StopConditions, Task};
use qinfer::loader;
use qinfer::models::LanguageModel;
use qinfer::tokenizer::Tokenizer;
use serde_json::Value;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/pooling").join(name)
}

fn reference(d: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn load(d: &Path) -> (Arc<dyn LanguageModel>, Tokenizer) {
    let mut m = loader::open(d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    let tok = m.tokenizer.take().expect("a tokenizer");
    (Arc::from(m.load_cpu(false).unwrap()), tok)
}

fn engine(model: &Arc<dyn LanguageModel>) -> EngineCore {
    let cfg = EngineConfig {
        max_batched_tokens: 64,
        max_num_seqs: 8,
        block_size: 16,
        num_blocks: 64,
        max_model_len: 512,
        prefix_cache: Some(PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 0, host_bytes: 0 }),
        speculative: None,
    };
    EngineCore::new(model.clone(), None, cfg).unwrap()
}

/// Runs `reqs` with one generating request beside them; each one's single output.
fn run(core: &mut EngineCore, reqs: Vec<Request>) -> Vec<Output> {
    let n = reqs.len() as u64;
    let generating = Request {
        prompt: vec![5, 6, 7, 8, 9],
        stop: StopConditions { max_tokens: 20, ..Default::default() },
        ..Default::default()
    };
    core.add(n, generating).unwrap();
    for (i, r) in reqs.into_iter().enumerate() {
        core.add(i as u64, r).unwrap();
    }
    let mut got: Vec<Option<Output>> = vec![None; n as usize];
    let mut generated = 0;
    while core.num_unfinished() > 0 {
        for out in core.step().unwrap() {
            if out.id == n {
                generated += out.token_ids.len();
                continue;
            }
            assert!(out.finish.is_some() && out.token_ids.is_empty(), "a pooling request's one output");
            let id = out.id as usize;
            got[id] = Some(out);
        }
    }
    assert_eq!(generated, 20, "the generating request ran beside them");
    assert!(core.pools_whole(), "pooling requests keep no blocks");
    got.into_iter().map(|o| o.expect("every request answered")).collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: dimensions");
    let dot: f64 = got.iter().zip(want).map(|(a, b)| *a as f64 * *b as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let cos = dot / (norm(got) * norm(want));
    let max = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(cos >= 0.99999 && max <= 1e-5, "{what}: cosine {cos}, max abs difference {max}");
}

#[test]
fn embeddings_match_sentence_transformers() {
    for name in ["qwen3_embedding_last", "qwen3_embedding_mean", "qwen3_embedding_cls"] {
        let d = dir(name);
        let r = reference(&d);
        let (model, tok) = load(&d);
        let cfg = PoolingConfig::from_dir(&d).unwrap().expect("a sentence-transformers checkpoint");
        assert!(cfg.normalize, "{name}: a Normalize module");
        let texts: Vec<String> =
            r["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
        let queries: Vec<String> =
            r["queries"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
        let mut inputs: Vec<String> = texts.iter().map(|t| cfg.input_text(t, None, None).unwrap()).collect();
        inputs.extend(queries.iter().map(|q| cfg.input_text(q, Some("query"), None).unwrap()));
        let ids: Vec<Vec<u32>> = inputs.iter().map(|t| tok.encode(t, true).unwrap()).collect();
        for (i, want) in r["input_ids"].as_array().unwrap().iter().enumerate() {
            let want: Vec<u32> = want.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            assert_eq!(ids[i], want, "{name}: text {i}'s tokens (the end-of-text token appended)");
        }
        let reqs = ids
            .iter()
            .map(|p| Request { prompt: p.clone(), task: Task::Embed(cfg.pooling), ..Default::default() })
            .collect();
        let outs = run(&mut engine(&model), reqs);
        let want: Vec<Vec<f32>> = (r["embeddings"].as_array().unwrap().iter())
            .chain(r["query_embeddings"].as_array().unwrap())
            .map(floats)
            .collect();
        for (i, (out, want)) in outs.iter().zip(&want).enumerate() {
            assert_eq!(out.usage.prompt_tokens, ids[i].len());
            let pooled = out.pooled.clone().unwrap();
            assert_close(&finish_embedding(pooled.clone(), true, None).unwrap(), want, &format!("{name} input {i}"));
            // Matryoshka: the first 16 values, renormalized.
            let short = finish_embedding(pooled, true, Some(16)).unwrap();
            assert_close(
                &short,
                &finish_embedding(want[..16].to_vec(), true, None).unwrap(),
                &format!("{name} input {i} at 16"),
            );
        }
    }
}

#[test]
fn reranker_scores_match_transformers() {
    let d = dir("qwen3_reranker");
    let r = reference(&d);
    let (model, tok) = load(&d);
    let format = RerankFormat::for_tokenizer(&tok).unwrap();
    assert_eq!((format.yes as u64, format.no as u64), (r["yes_id"].as_u64().unwrap(), r["no_id"].as_u64().unwrap()));
    let pairs = r["pairs"].as_array().unwrap();
    let mut reqs = Vec::new();
    for (i, p) in pairs.iter().enumerate() {
        let text = format.prompt(p["query"].as_str().unwrap(), p["document"].as_str().unwrap(), None);
        let ids = tok.encode(&text, true).unwrap();
        let want: Vec<u32> = r["input_ids"][i].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, want, "pair {i}'s tokens");
        reqs.push(Request { prompt: ids, task: Task::Score(format.score_ids()), ..Default::default() });
    }
    let outs = run(&mut engine(&model), reqs);
    for (i, (out, want)) in outs.iter().zip(floats(&r["scores"])).enumerate() {
        let got = RerankFormat::relevance(out.pooled.as_ref().unwrap());
        assert!((got - want).abs() <= 1e-5, "pair {i}: {got} against {want}");
    }
}

#[test]
fn a_checkpoint_without_sentence_transformers_files_has_no_pooling_config() {
    assert!(PoolingConfig::from_dir(&dir("qwen3_reranker")).unwrap().is_none());
}
