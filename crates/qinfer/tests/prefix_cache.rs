//! The prefix cache on the CPU, on every tiny model of tests/fixtures/tiny:
//! each request's tokens with the cache equal its tokens without it, exactly
//! (the oracle: the engine with the cache off, itself checked against
//! transformers in engine_batch.rs), and each request reports the cached
//! share of its prompt that the cache's rules give: whole blocks of a prefix
//! another request computed, for hybrid models ending at a recurrent-state
//! snapshot (every 64 positions here). Covered: multi-turn reuse, a prefix
//! that diverges mid-block, a hit on blocks a running request holds,
//! eviction while requests wait, and salts that keep tenants apart; pools,
//! block caches and snapshots whole after every run.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::{Request, StopConditions};
use qinfer::loader;
use qinfer::models::LanguageModel;
use qinfer::sampling::SamplingParams;

const BLOCK: usize = 16;
const SNAPSHOT_EVERY: usize = 64;

fn fixtures() -> Vec<PathBuf> {
    common::exact_fixture_dirs("tiny", &common::TINY_FIXTURES, "reference.json")
}

fn load(dir: &std::path::Path) -> Arc<dyn LanguageModel> {
    let m = loader::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    Arc::from(m.load_cpu(false).unwrap())
}

/// `n` pseudo-random token ids below 256 (every tiny model's vocabulary), from `seed`.
fn tokens(n: usize, seed: u32) -> Vec<u32> {
    let mut x = 0x9e37_79b9u32 ^ seed.wrapping_mul(0x85eb_ca6b);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 256
        })
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, salt: Option<&str>) -> Request {
    Request {
        prompt,
        sampling: SamplingParams::default(),
        stop: StopConditions { max_tokens, ..Default::default() },
        cache_salt: salt.map(str::to_string),
        ..Default::default()
    }
}

fn config(num_blocks: usize, cache: bool) -> EngineConfig {
    EngineConfig {
        max_batched_tokens: 128,
        max_num_seqs: 4,
        block_size: BLOCK,
        num_blocks,
        max_model_len: 512,
        prefix_cache: cache.then_some(PrefixCacheConfig {
            snapshot_interval: SNAPSHOT_EVERY,
            snapshot_slots: 8,
            host_bytes: 0,
        }),
        speculative: None,
    }
}

/// A request's result: its new tokens and the prompt tokens it found cached.
type Got = (Vec<u32>, usize);

/// Runs `reqs` through `core`, request `i` joining before step `joins[i]`.
fn run(core: &mut EngineCore, reqs: &[Request], joins: &[usize]) -> Vec<Got> {
    let base = 1_000_000 * (core.prefix_stats().map_or(0, |s| s.queries) + 1);
    let mut got: HashMap<u64, Got> = HashMap::new();
    let mut step = 0;
    loop {
        for (i, r) in reqs.iter().enumerate() {
            if joins[i] == step {
                core.add(base + i as u64, r.clone()).unwrap();
            }
        }
        if core.num_unfinished() == 0 && joins.iter().all(|&j| j < step) {
            break;
        }
        for out in core.step().unwrap() {
            let e = got.entry(out.id).or_default();
            e.0.extend(&out.token_ids);
            e.1 = out.usage.cached_tokens;
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    assert!(core.pools_whole(), "blocks, state slots or snapshots leaked");
    (0..reqs.len() as u64).map(|i| got.remove(&(base + i)).unwrap()).collect()
}

/// Each request alone, without the cache: the oracle.
fn alone(model: &Arc<dyn LanguageModel>, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            let mut core = EngineCore::new(model.clone(), None, config(64, false)).unwrap();
            run(&mut core, std::slice::from_ref(r), &[0]).remove(0).0
        })
        .collect()
}

/// The cached share the rules give a prompt of `len` tokens whose first
/// `shared` tokens another request computed (and whose snapshots, for a
/// hybrid, were taken while computing them as a prompt up to `snapshotted`).
fn expected_hit(len: usize, shared: usize, hybrid: bool, snapshotted: usize) -> usize {
    let blocks = shared.min(len - 1) / BLOCK * BLOCK;
    if hybrid { blocks.min(snapshotted) / SNAPSHOT_EVERY * SNAPSHOT_EVERY } else { blocks }
}

#[test]
fn cached_prefixes_change_no_token_and_hit_as_the_rules_say() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let model = load(&dir);
        let hybrid = model.config().gdn.is_some();
        let mut core = EngineCore::new(model.clone(), None, config(64, true)).unwrap();
        let system = tokens(150, 1);

        // Turn one.
        let a = request([system.clone(), tokens(20, 2)].concat(), 6, None);
        let got_a = run(&mut core, std::slice::from_ref(&a), &[0]);
        assert_eq!(got_a[0], (alone(&model, std::slice::from_ref(&a))[0].clone(), 0), "{name}: turn one");

        // Turn two (the whole first turn and more), a prompt that leaves the
        // shared prefix mid-block, and the same prompt under another salt.
        let turn = [a.prompt.clone(), got_a[0].0.clone(), tokens(30, 3)].concat();
        let reqs = vec![
            request(turn.clone(), 8, None),
            request([&system[..100], &tokens(40, 4)[..]].concat(), 5, None),
            request(a.prompt.clone(), 4, Some("tenant b")),
        ];
        let got = run(&mut core, &reqs, &[0, 0, 0]);
        let want = alone(&model, &reqs);
        // Turn one computed its prompt and all but its last token.
        let computed = a.prompt.len() + got_a[0].0.len() - 1;
        let hits = [
            expected_hit(turn.len(), computed, hybrid, a.prompt.len()),
            expected_hit(reqs[1].prompt.len(), 100, hybrid, a.prompt.len()),
            0,
        ];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, &(w.clone(), hits[i]), "{name}: request {i} of turn two");
        }
        assert!(hits[0] > 0 && hits[1] > 0, "{name}: the test must hit");

        // The salted prompt again under its salt: it hits its own blocks only.
        let salted = request([a.prompt.clone(), tokens(5, 5)].concat(), 3, Some("tenant b"));
        let got = run(&mut core, std::slice::from_ref(&salted), &[0]);
        let hit = expected_hit(salted.prompt.len(), a.prompt.len(), hybrid, a.prompt.len());
        assert_eq!(got[0], (alone(&model, std::slice::from_ref(&salted))[0].clone(), hit), "{name}: salted");

        // A 128-token shared prefix hits on every architecture (hybrids included).
        let short = request([&system[..128], &tokens(9, 6)[..]].concat(), 3, Some("short"));
        let first = request([&system[..128], &tokens(7, 7)[..]].concat(), 3, Some("short"));
        let got = run(&mut core, &[first.clone(), short.clone()], &[0, 40]);
        assert_eq!(got[1].1, 128, "{name}: a 128-token shared prefix");
        assert_eq!(vec![got[0].0.clone(), got[1].0.clone()], alone(&model, &[first, short]), "{name}: short prefix");
        println!(
            "{name}: {:?}, {:?} cached blocks, {:?} snapshots",
            core.prefix_stats(),
            core.cached_blocks(),
            core.snapshots()
        );
    }
}

#[test]
fn a_hit_on_blocks_a_running_request_holds() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let model = load(&dir);
        let hybrid = model.config().gdn.is_some();
        let mut core = EngineCore::new(model.clone(), None, config(64, true)).unwrap();
        let shared = tokens(140, 11);
        let reqs = vec![
            request([shared.clone(), tokens(3, 12)].concat(), 40, None),
            request([shared.clone(), tokens(20, 13)].concat(), 5, None),
        ];
        // The second joins once the first has its prompt computed and decodes.
        let got = run(&mut core, &reqs, &[0, 5]);
        let want = alone(&model, &reqs);
        let hit = expected_hit(reqs[1].prompt.len(), 140, hybrid, reqs[0].prompt.len());
        assert_eq!(got[0].0, want[0], "{name}: the running request");
        assert_eq!(got[1], (want[1].clone(), hit), "{name}: the request that shares its blocks");
    }
}

#[test]
fn evicted_prefixes_are_recomputed_and_requests_wait_for_blocks() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let model = load(&dir);
        // 20 blocks: one 150-token request holds 10 of them.
        let mut core = EngineCore::new(model.clone(), None, config(20, true)).unwrap();
        let a = request(tokens(150, 21), 4, None);
        run(&mut core, std::slice::from_ref(&a), &[0]);
        // Three others that do not fit at once: they wait, and take A's cached blocks.
        let others: Vec<Request> = (0..3).map(|i| request(tokens(140, 30 + i), 20, None)).collect();
        let got = run(&mut core, &others, &[0, 0, 0]);
        assert_eq!(got.iter().map(|g| g.0.clone()).collect::<Vec<_>>(), alone(&model, &others), "{name}: the others");
        let (_, evicted) = core.cached_blocks();
        assert!(evicted > 0, "{name}: the pool should have evicted cached blocks");
        // A again: what is left of its prefix (possibly nothing) is reused, the rest recomputed.
        let again = run(&mut core, std::slice::from_ref(&a), &[0]);
        assert_eq!(again[0].0, alone(&model, std::slice::from_ref(&a))[0], "{name}: A after eviction");
        assert!(again[0].1 < 144, "{name}: A's prefix should have been evicted in part");
    }
}

#[test]
fn evicted_prefixes_come_back_from_the_host_tier() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let model = load(&dir);
        let hybrid = model.config().gdn.is_some();
        // A pool of 20 blocks and 2 snapshot slots, and a host tier for everything evicted.
        let mut cfg = config(20, true);
        cfg.prefix_cache =
            Some(PrefixCacheConfig { snapshot_interval: SNAPSHOT_EVERY, snapshot_slots: 2, host_bytes: 1 << 30 });
        let mut core = EngineCore::new(model.clone(), None, cfg).unwrap();
        let a = request(tokens(150, 21), 4, None);
        run(&mut core, std::slice::from_ref(&a), &[0]);
        let others: Vec<Request> = (0..3).map(|i| request(tokens(140, 30 + i), 20, None)).collect();
        run(&mut core, &others, &[0, 0, 0]);
        let (_, evicted) = core.cached_blocks();
        let (_, stored, stats) = core.host_tier().unwrap();
        assert!(evicted > 0 && stored > 0, "{name}: blocks should have gone to the host tier");
        // A again, longer: its whole prefix hits, part of it copied back from the host.
        let again = request([a.prompt.clone(), tokens(20, 22)].concat(), 4, None);
        let got = run(&mut core, std::slice::from_ref(&again), &[0]);
        let hit = expected_hit(again.prompt.len(), a.prompt.len(), hybrid, a.prompt.len());
        assert_eq!(
            got[0],
            (alone(&model, std::slice::from_ref(&again))[0].clone(), hit),
            "{name}: after the round trip"
        );
        let restored = core.host_tier().unwrap().2.restored - stats.restored;
        assert!(restored > 0, "{name}: nothing came back from the host tier");
        if hybrid {
            assert!(core.snapshots().evicted > 0, "{name}: the two snapshot slots should have evicted");
        }
    }
}

#[test]
fn snapshot_intervals_off_the_chunk_are_refused() {
    let dir = fixtures().into_iter().find(|d| d.ends_with("qwen3_5")).expect("the qwen3_5 fixture");
    let mut cfg = config(64, true);
    cfg.prefix_cache = Some(PrefixCacheConfig { snapshot_interval: 48, snapshot_slots: 4, host_bytes: 0 });
    let err = EngineCore::new(load(&dir), None, cfg).err().expect("an interval of 48 is refused").to_string();
    assert!(err.contains("snapshot interval 48") && err.contains("64"), "{err}");
}
