//! The continuous-batching engine on the CPU, on every tiny model of
//! tests/fixtures/tiny (each architecture, transformers' greedy continuation
//! as the oracle): a request's output in any batch mix (joins and leaves
//! mid-run, chunked prefills, preemption and recompute) equals its output run
//! alone, exactly, and the greedy one equals transformers'; the block pool
//! and state slots are whole again afterwards; bad requests get errors
//! naming the limit.

mod common;

use common::engine::{config, fixtures, ids, load, reference, request, requests, run};
use qinfer::engine::core::EngineCore;
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::handle::Engine;
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::{FinishReason, Request};
use qinfer::sampling::SamplingParams;

/// Without the prefix cache: the tests of that cache compare against this.
#[test]
fn batched_outputs_equal_alone_and_transformers() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let r = reference(&dir);
        let model = load(&dir);
        let reqs = requests(&r);
        // Alone: one request at a time, the whole prompt in one step.
        let alone: Vec<_> = reqs
            .iter()
            .map(|q| {
                let mut core = EngineCore::new(model.clone(), None, config(512, 1, 64)).unwrap();
                run(&mut core, std::slice::from_ref(q), &[0]).remove(0)
            })
            .collect();
        assert_eq!(alone[0].0, ids(&r["greedy"]["new_tokens"]), "{name}: greedy vs transformers");
        for (q, (tokens, finish)) in reqs.iter().zip(&alone) {
            assert_eq!(tokens.len(), q.stop.max_tokens, "{name}");
            assert_eq!(*finish, FinishReason::Length);
        }
        // The one-sequence path (its own parity tests) agrees on the greedy ones.
        for (q, (tokens, _)) in reqs.iter().zip(&alone).filter(|(q, _)| q.sampling == SamplingParams::default()) {
            let opts = GenerateOptions {
                max_new_tokens: q.stop.max_tokens,
                stop_tokens: vec![],
                prefill_chunk: 512,
                adapter: None,
            };
            let (want, _) = generate(model.as_ref(), &q.prompt, &q.sampling, &opts, |_| Ok(true)).unwrap();
            assert_eq!(tokens, &want, "{name}: engine alone vs generate, prompt of {}", q.prompt.len());
        }
        // Mixed: 80-token steps (chunked prefills; 64-token chunks on the
        // hybrids), four at a time, joining at different steps, and a pool
        // too small for all four (preemption).
        let mut core = EngineCore::new(model.clone(), None, config(80, 4, 9)).unwrap();
        // The pool holds keys and values of the attention layers only.
        let cfg = model.config();
        let attention = cfg.layer_kinds.iter().filter(|k| **k == qinfer::config::LayerKind::Attention).count();
        assert_eq!(core.kv_bytes(), 9 * 16 * 2 * attention * cfg.kv_dim() * 4, "{name}: KV pool bytes");
        let mixed = run(&mut core, &reqs, &[0, 0, 1, 1, 3, 6, 9]);
        for (i, (a, m)) in alone.iter().zip(&mixed).enumerate() {
            assert_eq!(a, m, "{name}: request {i} (prompt of {}) alone vs mixed", reqs[i].prompt.len());
        }
        assert!(core.preemptions() > 0, "{name}: the small pool should have forced a preemption");
        // The same with the prefix cache on (recomputes after preemption hit it).
        let mut cached = config(80, 4, 9);
        cached.prefix_cache = Some(PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 4, host_bytes: 0 });
        let mut core_cached = EngineCore::new(model.clone(), None, cached).unwrap();
        let mixed_cached = run(&mut core_cached, &reqs, &[0, 0, 1, 1, 3, 6, 9]);
        assert_eq!(alone, mixed_cached, "{name}: alone vs mixed with the prefix cache");
        println!(
            "{name}: {} requests equal alone and mixed, {} preemptions ({} with the prefix cache, {:?})",
            reqs.len(),
            core.preemptions(),
            core_cached.preemptions(),
            core_cached.prefix_stats().unwrap()
        );
    }
}

#[test]
fn aborts_and_bad_requests_leave_the_rest_running() {
    let dir = fixtures().into_iter().find(|d| d.ends_with("qwen3_next")).unwrap();
    let r = reference(&dir);
    let model = load(&dir);
    let reqs = requests(&r);
    let mut core = EngineCore::new(model.clone(), None, config(64, 8, 40)).unwrap();
    let alone = {
        let mut c = EngineCore::new(model.clone(), None, config(64, 8, 40)).unwrap();
        run(&mut c, &reqs[..1], &[0]).remove(0)
    };
    // Bad requests: each error names the limit, and nothing is queued.
    let mut err = |q: Request| core.add(99, q).unwrap_err().to_string();
    assert!(err(request(vec![1; 1024], 4, SamplingParams::default())).contains("1024"));
    assert!(err(request(vec![1; 10], 800, SamplingParams::default())).contains("40 blocks"));
    assert!(err(request(vec![100_000], 4, SamplingParams::default())).contains("vocabulary"));
    assert!(err(request(vec![], 4, SamplingParams::default())).contains("empty"));
    assert!(err(request(vec![1], 4, SamplingParams { top_p: 0.0, ..Default::default() })).contains("top_p"));
    assert_eq!(core.num_unfinished(), 0);
    // Abort one request mid-prefill and one mid-decode; the first runs on.
    for (i, q) in reqs.iter().enumerate().take(4) {
        core.add(i as u64, q.clone()).unwrap();
    }
    let mut tokens = Vec::new();
    let mut aborted = Vec::new();
    for step in 0.. {
        if step == 1 {
            aborted.push(core.abort(2).unwrap().finish);
        }
        if step == 4 {
            aborted.push(core.abort(3).unwrap().finish);
        }
        for out in core.step().unwrap() {
            if out.id == 0 {
                tokens.extend(out.token_ids);
            }
        }
        if core.num_unfinished() == 0 {
            break;
        }
    }
    assert_eq!(aborted, vec![Some(FinishReason::Abort); 2]);
    assert!(core.abort(2).is_none(), "an aborted request is gone");
    assert_eq!(tokens, alone.0);
    assert!(core.pools_whole());
}

#[test]
fn the_engine_thread_streams_aborts_dropped_clients_and_stops() {
    let dir = fixtures().into_iter().find(|d| d.ends_with("qwen3")).unwrap();
    let r = reference(&dir);
    let model = load(&dir);
    let reqs = requests(&r);
    let engine = Engine::start(model.clone(), None, config(64, 4, 64)).unwrap();
    let streams: Vec<_> = reqs.iter().map(|q| engine.add(q.clone()).unwrap()).collect();
    // A client that goes away: its request is aborted, its blocks return.
    let (_, gone) = engine.add(request(vec![5; 40], 200, SamplingParams::default())).unwrap();
    drop(gone);
    // A request refused at the door names the limit.
    let e = engine.add(request(vec![1; 2000], 4, SamplingParams::default())).unwrap_err();
    assert!(e.to_string().contains("2000"), "{e}");
    for ((_, rx), q) in streams.into_iter().zip(&reqs) {
        let mut n = 0;
        let mut finish = None;
        for item in rx.iter() {
            let out = item.unwrap();
            n += out.token_ids.len();
            finish = out.finish;
        }
        assert_eq!((n, finish), (q.stop.max_tokens, Some(FinishReason::Length)));
    }
    let stats = engine.shutdown();
    assert!(stats.pools_whole, "blocks or slots leaked");
}

/// Log probabilities: each tiny model's prompts of every length up to the
/// fixture's, batched together with logprobs asked for (top 5): the picked
/// token's and the alternatives' log probabilities are log-softmax of
/// transformers' logits at that position (logits.npy), before any
/// temperature or penalty; requests that ask for none get none.
#[test]
fn logprobs_are_log_softmax_of_transformers_logits() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let r = reference(&dir);
        let model = load(&dir);
        let (shape, logits) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let vocab = shape[shape.len() - 1];
        let input = ids(&r["input_ids"]);
        let mut core = EngineCore::new(model.clone(), None, config(512, 32, 128)).unwrap();
        let top = 5;
        // Sampled with a penalty: the reported numbers are still the model's own.
        let sampling = SamplingParams {
            temperature: 0.7,
            repetition_penalty: 1.5,
            seed: 3,
            logprobs: Some(top),
            ..Default::default()
        };
        for n in 1..=input.len() {
            let s = if n % 2 == 0 {
                sampling.clone()
            } else {
                SamplingParams { logprobs: Some(top), ..Default::default() }
            };
            core.add(n as u64, request(input[..n].to_vec(), 1, s)).unwrap();
        }
        core.add(0, request(input.clone(), 1, SamplingParams::default())).unwrap();
        let mut seen = 0;
        while core.num_unfinished() > 0 {
            for out in core.step().unwrap() {
                if out.id == 0 {
                    assert!(out.logprobs.is_empty(), "{name}: logprobs not asked for");
                    continue;
                }
                let row = &logits[(out.id as usize - 1) * vocab..out.id as usize * vocab];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
                let want = |t: u32| (row[t as usize] as f64 - lse) as f32;
                let [lp] = &out.logprobs[..] else { panic!("{name}: one logprob per token, got {:?}", out.logprobs) };
                assert_eq!(lp.token, out.token_ids[0]);
                assert!(
                    (lp.logprob - want(lp.token)).abs() < 2e-3,
                    "{name} n={}: {} vs {}",
                    out.id,
                    lp.logprob,
                    want(lp.token)
                );
                let mut order: Vec<u32> = (0..vocab as u32).collect();
                order.sort_by(|a, b| row[*b as usize].total_cmp(&row[*a as usize]));
                assert_eq!(lp.top.len(), top);
                for (k, &(t, l)) in lp.top.iter().enumerate() {
                    assert!((l - want(t)).abs() < 2e-3, "{name} n={}: top {k}", out.id);
                    // The same rank as transformers', up to near-ties.
                    assert!(
                        (want(t) - want(order[k])).abs() < 2e-3,
                        "{name} n={}: top {k} is {t}, not {}",
                        out.id,
                        order[k]
                    );
                }
                seen += 1;
            }
        }
        assert_eq!(seen, input.len(), "{name}");
    }
}
