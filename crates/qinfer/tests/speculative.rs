//! Speculative decoding in the engine, on the tiny fixture models (CPU):
//! greedy outputs equal plain decoding's exactly with either proposer
//! (n-gram lookup, a draft model) in batch mixes with chunked prefills,
//! preemption and the prefix cache; a model drafting for itself has every
//! draft accepted (its draft cache follows the accepted tokens); sampled
//! outputs follow the target's distribution (chi-square against the exact
//! probabilities computed from the model's logits). Hybrid targets roll
//! their Gated DeltaNet states back past rejected drafts; a hybrid draft
//! model is refused.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::engine::{config, fixtures, ids, load, reference, request, requests, run};
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::FinishReason;
use qinfer::engine::speculative::SpeculativeConfig;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;

/// Every fixture: (name, model, reference).
fn all_models() -> Vec<(String, Arc<dyn LanguageModel>, serde_json::Value)> {
    fixtures()
        .into_iter()
        .map(|dir| (dir.file_name().unwrap().to_string_lossy().into_owned(), load(&dir), reference(&dir)))
        .collect()
}

fn hybrid(m: &Arc<dyn LanguageModel>) -> bool {
    m.config().gdn.is_some()
}

fn greedy(r: &qinfer::engine::request::Request) -> bool {
    r.sampling.temperature == 0.0
}

/// The requests of the batch-mix tests plus prompts that repeat themselves
/// (which lookup finds drafts in) and a long output (the tiny models fall
/// into loops, where lookup is right and then wrong where they leave them),
/// and when each joins.
fn mix(r: &serde_json::Value) -> (Vec<qinfer::engine::request::Request>, [usize; 10]) {
    let mut reqs = requests(r);
    let input = ids(&r["input_ids"]);
    let phrase: Vec<u32> = input.iter().copied().cycle().skip(2).take(9).collect();
    reqs.push(request(phrase.repeat(4), 40, SamplingParams::default()));
    reqs.push(request([input.clone(), input.clone()].concat(), 24, SamplingParams::default()));
    reqs.push(request(input.clone(), 200, SamplingParams::default()));
    (reqs, [0, 0, 1, 1, 3, 6, 9, 0, 2, 4])
}

/// `config(tokens, seqs, blocks)`, with the pool grown where the longest of
/// `reqs` needs more blocks (a small pool is there to force preemption).
fn config_for(reqs: &[qinfer::engine::request::Request], tokens: usize, seqs: usize, blocks: usize) -> EngineConfig {
    let longest = reqs.iter().map(|r| r.prompt.len() + r.stop.max_tokens).max().unwrap_or(0);
    config(tokens, seqs, blocks.max(longest.div_ceil(16)))
}

/// Every greedy request's tokens and finish equal `plain`'s; sampled ones
/// finish within their budget.
fn check_against(
    name: &str,
    reqs: &[qinfer::engine::request::Request],
    plain: &[(Vec<u32>, FinishReason)],
    got: &[(Vec<u32>, FinishReason)],
) {
    for (i, ((a, b), r)) in plain.iter().zip(got).zip(reqs).enumerate() {
        if greedy(r) {
            assert_eq!(a, b, "{name}: request {i}: plain vs speculative");
        } else {
            assert!(!b.0.is_empty() && b.0.len() <= r.stop.max_tokens, "{name}: request {i}: {b:?}");
        }
    }
}

#[test]
fn ngram_speculation_changes_no_greedy_token() {
    let (mut accepted_anywhere, mut rolled_back_hybrids) = (0, 0);
    for (name, model, r) in all_models() {
        let spec = |k, mut cfg: EngineConfig| {
            cfg.speculative = Some(SpeculativeConfig::ngram(k));
            EngineCore::new(model.clone(), None, cfg).unwrap()
        };
        let (reqs, joins) = mix(&r);
        let cfg = |tokens, seqs, blocks| config_for(&reqs, tokens, seqs, blocks);
        let plain = run(&mut EngineCore::new(model.clone(), None, cfg(80, 4, 12)).unwrap(), &reqs, &joins);
        // A stop token among the greedy outputs: the eighth request's sixth token.
        let mut stopped = reqs.clone();
        stopped[7].stop.stop_token_ids = vec![plain[7].0[5]];
        let plain_stopped = run(&mut EngineCore::new(model.clone(), None, cfg(80, 4, 12)).unwrap(), &stopped, &joins);
        assert_eq!(plain_stopped[7].1, FinishReason::Stop, "{name}");
        for (k, mut cfg, cached) in [(4, cfg(80, 4, 12), false), (2, cfg(80, 4, 9), true), (7, cfg(512, 8, 64), false)]
        {
            if cached {
                cfg.prefix_cache = Some(PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 0, host_bytes: 0 });
            }
            let mut core = spec(k, cfg);
            check_against(&name, &reqs, &plain, &run(&mut core, &reqs, &joins));
            let stats = core.speculative_stats();
            check_against(&name, &stopped, &plain_stopped, &run(&mut spec(k, cfg), &stopped, &joins));
            println!("{name}: {k} draft tokens, {stats:?}");
            assert!(stats.accepted <= stats.drafted && stats.verifications > 0, "{name}: {stats:?}");
            accepted_anywhere += stats.accepted;
            if hybrid(&model) && stats.accepted > 0 && stats.accepted < stats.drafted {
                rolled_back_hybrids += 1;
            }
            assert!(core.pools_whole(), "{name}: a block or state slot was not given back");
        }
    }
    assert!(accepted_anywhere > 0, "no draft token was ever accepted: the verification path went untested");
    assert!(rolled_back_hybrids > 0, "no hybrid both kept and rejected drafts: its rollback went untested");
}

#[test]
fn adaptive_speculation_changes_no_greedy_token() {
    // How many drafts each step verifies follows measured times here, so
    // only the outputs are compared (and the counters' sense).
    for (name, model, r) in all_models() {
        let (reqs, joins) = mix(&r);
        let cfg = |tokens, seqs, blocks| config_for(&reqs, tokens, seqs, blocks);
        let plain = run(&mut EngineCore::new(model.clone(), None, cfg(80, 4, 12)).unwrap(), &reqs, &joins);
        let mut config = cfg(80, 4, 12);
        config.speculative = Some(SpeculativeConfig::ngram(4).adaptive());
        let mut core = EngineCore::new(model.clone(), None, config).unwrap();
        check_against(&format!("{name}, adaptive"), &reqs, &plain, &run(&mut core, &reqs, &joins));
        let stats = core.speculative_stats();
        println!("{name}, adaptive: {stats:?}");
        assert!(stats.accepted <= stats.drafted, "{name}: {stats:?}");
    }
}

#[test]
fn draft_model_speculation_changes_no_greedy_token() {
    let models = all_models();
    let drafts: Vec<_> = models.iter().filter(|m| !hybrid(&m.1)).collect();
    for (t, (name, model, r)) in models.iter().enumerate() {
        let (reqs, joins) = mix(r);
        let cfg = |tokens, seqs, blocks| config_for(&reqs, tokens, seqs, blocks);
        let plain = run(&mut EngineCore::new(model.clone(), None, cfg(80, 4, 12)).unwrap(), &reqs, &joins);
        // Itself as the draft (every greedy draft right; an attention-only
        // target), and another fixture of the same vocabulary (mostly wrong).
        let other = drafts[t % drafts.len()];
        let other = if other.0 == *name { drafts[(t + 1) % drafts.len()] } else { other };
        let itself = (!hybrid(model)).then_some((name.as_str(), model));
        for (draft_name, draft) in itself.into_iter().chain([(other.0.as_str(), &other.1)]) {
            for (k, mut cfg, cached) in
                [(3, cfg(80, 4, 12), false), (5, cfg(80, 4, 10), true), (2, cfg(512, 8, 64), false)]
            {
                if cached {
                    cfg.prefix_cache =
                        Some(PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 0, host_bytes: 0 });
                }
                cfg.speculative = Some(SpeculativeConfig::draft_model(k));
                let mut core = EngineCore::with_draft(model.clone(), None, cfg, Some(draft.clone())).unwrap();
                let got = run(&mut core, &reqs, &joins);
                check_against(&format!("{name} drafted by {draft_name}"), &reqs, &plain, &got);
                let stats = core.speculative_stats();
                println!("{name} drafted by {draft_name}, k={k}: {stats:?}, {} preemptions", core.preemptions());
                assert!(stats.verifications > 0 && stats.accepted <= stats.drafted, "{name}: {stats:?}");
                if draft_name == name {
                    // Greedy drafts of the target itself are all kept where the
                    // target picks greedily without penalties too.
                    let only: Vec<_> =
                        reqs.iter().filter(|r| r.sampling == SamplingParams::default()).cloned().collect();
                    let mut core = EngineCore::with_draft(model.clone(), None, cfg, Some(draft.clone())).unwrap();
                    run(&mut core, &only, &joins[..only.len()]);
                    let stats = core.speculative_stats();
                    assert!(
                        stats.drafted > 0 && stats.accepted == stats.drafted,
                        "{name} drafting for itself: {stats:?} (its draft cache lost track of the tokens?)"
                    );
                }
            }
        }
    }
}

/// A fixture with its multi-token-prediction head loaded.
fn with_mtp(case: &str) -> (std::path::PathBuf, Arc<dyn LanguageModel>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(case);
    let mut m = qinfer::loader::open(&dir).unwrap();
    m.config.load_mtp = true;
    let model = Arc::from(m.load_cpu(false).unwrap());
    (dir, model)
}

#[test]
fn mtp_speculation_proposes_the_reference_drafts_and_changes_no_greedy_token() {
    for case in ["qwen3_next", "qwen3_5", "qwen3_5_moe"] {
        let (dir, model) = with_mtp(case);
        // After the prompt's step, the head's chain from the last prompt
        // position equals the reference's (scripts/mtp_reference.py).
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("mtp.json")).unwrap()).unwrap();
        let mut cfg = config(512, 4, 64);
        cfg.speculative = Some(SpeculativeConfig::mtp(3));
        let mut core = EngineCore::new(model.clone(), None, cfg).unwrap();
        core.add(0, request(ids(&fx["input_ids"]), 8, SamplingParams::default())).unwrap();
        let first = core.step().unwrap();
        assert_eq!(first[0].token_ids, vec![fx["target"]["greedy_next_token"].as_u64().unwrap() as u32], "{case}");
        assert_eq!(core.proposed_drafts(0), ids(&fx["chain"]["drafts"]), "{case}: the head's drafts");
        // In the batch mixes (chunked prefills, preemption, the prefix
        // cache, stop tokens among kept drafts) greedy outputs equal plain
        // decoding's.
        let r = reference(&dir);
        let (reqs, joins) = mix(&r);
        let cfg = |tokens, seqs, blocks| config_for(&reqs, tokens, seqs, blocks);
        let plain = run(&mut EngineCore::new(model.clone(), None, cfg(80, 4, 12)).unwrap(), &reqs, &joins);
        for (k, mut cfg, cached) in [(3, cfg(80, 4, 12), false), (2, cfg(80, 4, 9), true), (5, cfg(512, 8, 64), false)]
        {
            if cached {
                cfg.prefix_cache = Some(PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 4, host_bytes: 0 });
            }
            cfg.speculative = Some(SpeculativeConfig::mtp(k));
            let mut core = EngineCore::new(model.clone(), None, cfg).unwrap();
            check_against(&format!("{case} with MTP, k={k}"), &reqs, &plain, &run(&mut core, &reqs, &joins));
            let stats = core.speculative_stats();
            println!("{case} with MTP, k={k}: {stats:?}, {} preemptions", core.preemptions());
            assert!(stats.verifications > 0 && stats.accepted <= stats.drafted, "{case}: {stats:?}");
        }
    }
    // Without its head loaded, the proposer is refused by name.
    let plain = load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3_5"));
    let mut cfg = config(512, 4, 64);
    cfg.speculative = Some(SpeculativeConfig::mtp(3));
    let e = EngineCore::new(plain, None, cfg).err().expect("no head").to_string();
    assert!(e.contains("multi-token-prediction head"), "{e}");
}

/// The heads of llama.cpp's GGUF conversions of the same fixtures
/// (tests/fixtures/gguf_mtp: `blk.{layers}.nextn.*`) in the engine: the
/// reference's drafts after the prompt, and greedy outputs equal plain
/// decoding's on the same file, with requests joining mid-run.
#[test]
fn mtp_speculation_from_a_llamacpp_gguf_head() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for (file, case) in [("qwen3next", "qwen3_next"), ("qwen35", "qwen3_5"), ("qwen35moe", "qwen3_5_moe")] {
        let mut m = qinfer::loader::open(&root.join("gguf_mtp").join(file).join("model.gguf")).unwrap();
        m.config.load_mtp = true;
        let model: Arc<dyn LanguageModel> = Arc::from(m.load_cpu(false).unwrap());
        let dir = root.join("tiny").join(case);
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("mtp.json")).unwrap()).unwrap();
        let mut cfg = config(512, 4, 64);
        cfg.speculative = Some(SpeculativeConfig::mtp(3));
        let mut core = EngineCore::new(model.clone(), None, cfg).unwrap();
        core.add(0, request(ids(&fx["input_ids"]), 8, SamplingParams::default())).unwrap();
        let first = core.step().unwrap();
        assert_eq!(first[0].token_ids, vec![fx["target"]["greedy_next_token"].as_u64().unwrap() as u32], "{file}");
        assert_eq!(core.proposed_drafts(0), ids(&fx["chain"]["drafts"]), "{file}: the head's drafts");

        let r = reference(&dir);
        let (reqs, joins) = mix(&r);
        let plain =
            run(&mut EngineCore::new(model.clone(), None, config_for(&reqs, 512, 8, 64)).unwrap(), &reqs, &joins);
        let mut cfg = config_for(&reqs, 512, 8, 64);
        cfg.speculative = Some(SpeculativeConfig::mtp(3));
        let mut core = EngineCore::new(model.clone(), None, cfg).unwrap();
        check_against(&format!("{file} GGUF with MTP"), &reqs, &plain, &run(&mut core, &reqs, &joins));
        let stats = core.speculative_stats();
        assert!(stats.verifications > 0 && stats.accepted <= stats.drafted, "{file}: {stats:?}");
    }
}

/// The head's `k` greedy drafts after `tokens` computed afresh: the target
/// over all but the last token, the head over every row, then the chain.
fn fresh_mtp_drafts(model: &Arc<dyn LanguageModel>, tokens: &[u32], k: usize) -> Vec<u32> {
    use qinfer::kv::batch::{BatchLayout, BatchSeq};
    let (n, vocab) = (tokens.len() - 1, model.config().vocab_size);
    let mut state = model.new_batch_state(64, 16, 1).unwrap();
    model.reset_state_slot(state.as_mut(), 0).unwrap();
    let layout = |start: usize, rows: usize, logits: Vec<usize>| {
        let seq = BatchSeq {
            rows: 0..rows,
            start,
            block_table: (0..64).collect(),
            state_slot: Some(0),
            prompt: true,
            snapshots: Vec::new(),
            adapter: None,
        };
        BatchLayout::new(vec![seq], 16, logits)
    };
    let mut prefill = layout(0, n, vec![]);
    prefill.hidden_rows = (0..n).collect();
    let hidden = model.forward_batch(state.as_mut(), &tokens[..n], &prefill, &[]).unwrap().hidden;
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&i, &j| l[i].total_cmp(&l[j])).unwrap() as u32;
    let out = model.mtp_forward(state.as_mut(), &tokens[1..], &hidden, &layout(0, n, vec![n - 1]), false).unwrap();
    let mut drafts = vec![argmax(&out.logits)];
    let mut y = out.hidden;
    for j in 1..k {
        let out =
            model.mtp_forward(state.as_mut(), &[drafts[j - 1]], &y, &layout(n - 1 + j, 1, vec![0]), false).unwrap();
        drafts.push(argmax(&out.logits[..vocab]));
        y = out.hidden;
    }
    drafts
}

#[test]
fn the_engines_mtp_cache_follows_the_kept_tokens() {
    // Step by step, the drafts the engine's head proposes (its cache filled
    // a step's kept rows at a time, rejected drafts' rows left out) equal
    // the head's drafts computed afresh over the same tokens.
    for case in ["qwen3_next", "qwen3_5", "qwen3_5_moe"] {
        let (dir, model) = with_mtp(case);
        let prompt: Vec<u32> = ids(&reference(&dir)["input_ids"]).into_iter().take(20).collect();
        let mut cfg = config(512, 4, 64);
        cfg.speculative = Some(SpeculativeConfig::mtp(3));
        let mut core = EngineCore::new(model.clone(), None, cfg).unwrap();
        core.add(0, request(prompt.clone(), 30, SamplingParams::default())).unwrap();
        let mut tokens = prompt;
        let mut compared = 0;
        while core.num_unfinished() > 0 {
            for out in core.step().unwrap() {
                tokens.extend(&out.token_ids);
            }
            let proposed = core.proposed_drafts(0).to_vec();
            if !proposed.is_empty() {
                assert_eq!(
                    proposed,
                    fresh_mtp_drafts(&model, &tokens, proposed.len()),
                    "{case} at {} tokens",
                    tokens.len()
                );
                compared += 1;
            }
        }
        println!("{case}: {compared} steps' drafts compared, {:?}", core.speculative_stats());
        assert!(compared >= 5, "{case}: only {compared} steps proposed");
    }
}

#[test]
fn hybrid_drafts_and_missing_drafts_are_refused() {
    let all: Vec<_> = fixtures().into_iter().map(|d| load(&d)).collect();
    let hybrid = all.iter().find(|m| m.config().gdn.is_some()).expect("a hybrid fixture").clone();
    let plain = all.iter().find(|m| m.config().gdn.is_none()).expect("an attention-only fixture").clone();
    let mut cfg = config(512, 4, 64);
    cfg.speculative = Some(SpeculativeConfig::draft_model(4));
    let e = EngineCore::with_draft(plain.clone(), None, cfg, Some(hybrid.clone()))
        .err()
        .expect("a hybrid draft is refused")
        .to_string();
    assert!(e.contains("draft model") && e.contains("Gated DeltaNet"), "{e}");
    let e = EngineCore::with_draft(plain.clone(), None, cfg, None).err().expect("no draft model").to_string();
    assert!(e.contains("needs a draft model"), "{e}");
}

/// softmax(logits / t).
fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| f64::from((l - max) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// Pearson's chi-square of `counts` against `probs` over `n` samples, bins
/// with fewer than 5 expected merged into one; and its degrees of freedom.
fn chi_square(counts: &HashMap<u32, usize>, probs: &[f64], n: usize) -> (f64, usize) {
    let (mut stat, mut bins) = (0.0, 0);
    let (mut rest_e, mut rest_o) = (0.0, 0.0);
    for (t, &p) in probs.iter().enumerate() {
        let e = p * n as f64;
        let o = counts.get(&(t as u32)).copied().unwrap_or(0) as f64;
        if e >= 5.0 {
            stat += (o - e).powi(2) / e;
            bins += 1;
        } else {
            rest_e += e;
            rest_o += o;
        }
    }
    if rest_e > 0.0 {
        stat += (rest_o - rest_e).powi(2) / rest_e.max(1e-9);
        bins += 1;
    }
    (stat, bins - 1)
}

/// Chi-square critical values at p = 0.001 (Wilson–Hilferty).
fn critical_001(df: usize) -> f64 {
    let d = df as f64;
    d * (1.0 - 2.0 / (9.0 * d) + 3.0902 * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

#[test]
fn sampled_outputs_follow_the_target_distribution() {
    let models: Vec<_> = all_models().into_iter().filter(|m| !hybrid(&m.1)).collect();
    let (name, model, r) = &models[0];
    let draft = &models[1].1;
    let prompt: Vec<u32> = ids(&r["input_ids"]).into_iter().take(6).collect();
    let temperature = 1.0;
    // The exact distributions of the first and second new token.
    let first = {
        let mut seq = model.new_sequence(64);
        softmax(&model.forward(seq.as_mut(), &prompt, Logits::Last).unwrap(), temperature)
    };
    let mut second = vec![0.0; first.len()];
    for (t1, &p1) in first.iter().enumerate() {
        if p1 < 1e-7 {
            continue;
        }
        let mut seq = model.new_sequence(64);
        let mut with = prompt.clone();
        with.push(t1 as u32);
        let p2 = softmax(&model.forward(seq.as_mut(), &with, Logits::Last).unwrap(), temperature);
        second.iter_mut().zip(p2).for_each(|(s, q)| *s += p1 * q);
    }
    let samples: usize = 3000;
    for (label, spec, draft) in [
        ("draft model", SpeculativeConfig::draft_model(3), Some(draft.clone())),
        ("itself as draft", SpeculativeConfig::draft_model(2), Some(model.clone())),
    ] {
        let mut cfg = config(4096, 64, 2048);
        cfg.speculative = Some(spec);
        let mut core = EngineCore::with_draft(model.clone(), None, cfg, draft).unwrap();
        let reqs: Vec<_> = (0..samples)
            .map(|seed| {
                request(prompt.clone(), 3, SamplingParams { temperature, seed: seed as u64, ..Default::default() })
            })
            .collect();
        let got = run(&mut core, &reqs, &vec![0; samples]);
        let stats = core.speculative_stats();
        assert!(stats.drafted > 0 && stats.accepted > 0, "{label}: {stats:?}");
        for (pos, probs) in [(0, &first), (1, &second)] {
            let mut counts = HashMap::new();
            for (tokens, _) in &got {
                *counts.entry(tokens[pos]).or_insert(0) += 1;
            }
            let (stat, df) = chi_square(&counts, probs, samples);
            println!("{name}, {label}: token {pos}: chi-square {stat:.1} over {df} dof, {stats:?}");
            assert!(stat < critical_001(df), "{name}, {label}: token {pos}: chi-square {stat:.1} over {df} dof");
        }
    }
}
