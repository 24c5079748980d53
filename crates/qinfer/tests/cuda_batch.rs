//! The batched forward on the GPU against the CPU: attention of ragged
//! batches through shuffled block tables (decode rows and prefill chunks,
//! GQA, sliding windows, f16 and f32 pools), the slot-mapped KV write read
//! back, the batch's q|k|v prologue (RoPE at each row's position), the row
//! copies, and the continuous-batching engine on random-weight dense, hybrid
//! and MoE models against the same engine on the CPU, with its decode steps
//! replayed from recorded graphs too.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use std::collections::HashMap;
use std::sync::Arc;

use common_cuda::*;
use qinfer::backend::cpu::{CpuBackend, attention};
use qinfer::backend::ops::BatchOps;
use qinfer::backend::{AttentionShape, Backend, QkvShape};
use qinfer::config::rope::Rope;
use qinfer::config::{RopeConfig, RopeStyle};
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::{Request, StopConditions};
use qinfer::engine::speculative::SpeculativeConfig;
use qinfer::kv::KvPrecision;
use qinfer::kv::batch::{BatchLayout, BatchSeq};
use qinfer::kv::contiguous::LayerRows;
use qinfer::loader::{self, CudaOptions, Device};
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::SamplingParams;
use qinfer::tensor::DType;

/// Fisher–Yates with the test's generator.
fn shuffle(r: &mut Rng, v: &mut [u32]) {
    for i in (1..v.len()).rev() {
        let j = (((r.f() + 1.0) * 0.5 * (i + 1) as f32) as usize).min(i);
        v.swap(i, j);
    }
}

/// A batch of `parts` (each sequence's new rows and the positions already
/// in its cache), each sequence's blocks taken in turn from a shuffled list
/// of every block id of a pool with `spare` blocks more than they need.
/// Returns the layout and the pool's blocks.
fn shuffled_layout(r: &mut Rng, parts: &[(usize, usize)], block_size: usize, spare: usize) -> (BatchLayout, usize) {
    let need: Vec<usize> = parts.iter().map(|&(n, start)| (start + n).div_ceil(block_size)).collect();
    let num_blocks = need.iter().sum::<usize>() + spare;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    shuffle(r, &mut ids);
    let (mut at, mut row) = (0, 0);
    let mut seqs = Vec::new();
    for (&(n, start), &k) in parts.iter().zip(&need) {
        let block_table = ids[at..at + k].to_vec();
        seqs.push(BatchSeq {
            rows: row..row + n,
            start,
            block_table,
            state_slot: None,
            prompt: n > 1,
            snapshots: Vec::new(),
            adapter: None,
        });
        at += k;
        row += n;
    }
    (BatchLayout::new(seqs, block_size, vec![]), num_blocks)
}

/// Every slot of every sequence's context (new rows included), in order.
fn context_slots(layout: &BatchLayout) -> Vec<u32> {
    let bs = layout.block_size;
    let mut slots = Vec::new();
    for s in &layout.seqs {
        for p in 0..s.context_len() {
            slots.push(s.block_table[p / bs] * bs as u32 + (p % bs) as u32);
        }
    }
    slots
}

fn to_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// `rows` of `kv_dim` values scattered to `slots` of a host pool of `num_slots`.
fn scatter(rows: &[f32], slots: &[u32], kv_dim: usize, num_slots: usize) -> Vec<f32> {
    let mut pool = vec![0.0; num_slots * kv_dim];
    for (i, &s) in slots.iter().enumerate() {
        let s = s as usize;
        pool[s * kv_dim..(s + 1) * kv_dim].copy_from_slice(&rows[i * kv_dim..(i + 1) * kv_dim]);
    }
    pool
}

/// Paged attention over ragged batches against the CPU's
/// (`backend::cpu::attention::paged_attention`): decode rows at contexts of
/// 1 to 300 (within one block, at block edges, over many), prefill chunks of
/// 17 and 64 rows after earlier context and a fresh 64-row prompt, each
/// sequence's blocks shuffled through the pool (block sizes 16 and 5); GQA
/// groups of 1 to 16, head dims 32 to 256 (80: lanes partly idle), sliding
/// windows shorter than a block, than a context and longer. The f32 pool
/// against the CPU over the same values, the f16 pool against the CPU over
/// the values rounded as it stores them (the same arithmetic in another
/// order: f32 bounds) and over the values themselves (`F16_CACHE_TOL`).
#[test]
fn paged_attention_matches_cpu() {
    let Some(g32) = gpu().map(|g| g.with_kv_precision(KvPrecision::F32)) else { return };
    let g16 = gpu().unwrap().with_kv_precision(KvPrecision::F16);
    let mut r = Rng::fresh();
    // Decode rows (and a few rows a sequence: the split-K decode kernel
    // where the head dim has one), then prompt chunks among them (the
    // tensor-core kernel over an f16 pool where the head dim has one; a
    // context past one decode block's keys: splits).
    let mut decode: Vec<(usize, usize)> = [1, 2, 5, 16, 17, 100, 255, 300, 1500].iter().map(|&c| (1, c - 1)).collect();
    decode.extend([(3, 14), (8, 70)]);
    let mut mixed = decode.clone();
    mixed.extend([(17, 40), (64, 129), (64, 0), (200, 31)]);
    let shapes = [
        (8, 2, 128, None),
        (8, 2, 128, Some(37)),
        (4, 4, 64, None),
        (14, 2, 64, Some(100)),
        (16, 1, 256, None),
        (6, 3, 80, Some(5)),
        (4, 2, 32, Some(1000)),
    ];
    for (nh, nkv, hd, window) in shapes {
        for (block_size, parts) in [(16, &decode), (5, &decode), (16, &mixed), (5, &mixed)] {
            let prompts = parts.iter().any(|p| p.0 > 8);
            let shape = AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, window, scale: 0.3 };
            let kv_dim = nkv * hd;
            // Sequences in a different order each time (rows back to back).
            let mut idx: Vec<u32> = (0..parts.len() as u32).collect();
            shuffle(&mut r, &mut idx);
            let order: Vec<(usize, usize)> = idx.iter().map(|&i| parts[i as usize]).collect();
            let (layout, num_blocks) = shuffled_layout(&mut r, &order, block_size, 3);
            let slots = context_slots(&layout);
            let num_slots = num_blocks * block_size;
            let (k, v) = (r.vec(slots.len() * kv_dim), r.vec(slots.len() * kv_dim));
            let q = r.vec(layout.rows() * nh * hd);
            let reference = |k: &[f32], v: &[f32]| {
                let (keys, values) = (scatter(k, &slots, kv_dim, num_slots), scatter(v, &slots, kv_dim, num_slots));
                let mut out = vec![f32::NAN; q.len()];
                attention::paged_attention(&q, &keys, &values, &layout, &shape, &mut out);
                out
            };
            let want = reference(&k, &v);
            let want16 = reference(&to_f16(&k), &to_f16(&v));
            for (g, kv) in [(&g32, KvPrecision::F32), (&g16, KvPrecision::F16)] {
                let mut pool = g.new_kv_pool(2, kv_dim, num_blocks, block_size).unwrap();
                let rows = slots.len();
                g.write_kv_paged(
                    &mut pool,
                    1,
                    &g.act_from_host(rows, kv_dim, &k),
                    &g.act_from_host(rows, kv_dim, &v),
                    &slots,
                );
                let out = g.paged_attention(&g.act_from_host(layout.rows(), nh * hd, &q), &pool, 1, &shape, &layout);
                let got = g.to_host(&out);
                g.check().unwrap();
                let what = format!(
                    "paged attention {nh}/{nkv}×{hd} window {window:?} blocks of {block_size} {kv:?}{}",
                    if prompts { " with prompt chunks" } else { "" }
                );
                // f32 sums in another order than the CPU's (online softmax);
                // the tensor-core kernel rounds q and the probabilities to f16.
                let flash = prompts && kv == KvPrecision::F16 && matches!(hd, 64 | 128 | 256);
                let tol = if flash { F16_CACHE_TOL } else { 1e-4 };
                let e = rel(&got, if kv == KvPrecision::F32 { &want } else { &want16 });
                println!("{what}: rel err {e:.2e}");
                assert!(e <= tol, "{what}: rel err {e} > {tol}");
                if kv == KvPrecision::F16 {
                    let e = rel(&got, &want);
                    assert!(e <= F16_CACHE_TOL, "{what} against unrounded values: rel err {e} > {F16_CACHE_TOL}");
                }
            }
        }
    }
}

/// `write_kv_paged` then the pool read back: each row at its slot (f32 as
/// written, f16 rounded to nearest even as `half` rounds), every other slot
/// and every other layer still zero; rows written again replace the old.
#[test]
fn write_kv_paged_lands_at_its_slots() {
    let Some(g) = gpu() else { return };
    let mut r = Rng::fresh();
    for kv in [KvPrecision::F32, KvPrecision::F16] {
        let g = gpu().unwrap().with_kv_precision(kv);
        let (kv_dim, num_blocks, block_size) = (96, 11, 8);
        let num_slots = num_blocks * block_size;
        let mut pool = g.new_kv_pool(3, kv_dim, num_blocks, block_size).unwrap();
        assert_eq!(g.kv_pool_bytes(&pool), 2 * 3 * num_slots * kv_dim * kv.bytes());
        let mut all: Vec<u32> = (0..num_slots as u32).collect();
        shuffle(&mut r, &mut all);
        let round = |v: &[f32]| if kv == KvPrecision::F16 { to_f16(v) } else { v.to_vec() };
        let (mut want_k, mut want_v) = (vec![0.0; num_slots * kv_dim], vec![0.0; num_slots * kv_dim]);
        // 37 slots, then 5 of them and 20 others.
        for slots in [all[..37].to_vec(), [&all[30..35], &all[50..70]].concat()] {
            let (k, v) = (r.vec(slots.len() * kv_dim), r.vec(slots.len() * kv_dim));
            let n = slots.len();
            g.write_kv_paged(&mut pool, 2, &g.act_from_host(n, kv_dim, &k), &g.act_from_host(n, kv_dim, &v), &slots);
            for (i, &s) in slots.iter().enumerate() {
                let (s, row) = (s as usize * kv_dim, i * kv_dim..(i + 1) * kv_dim);
                want_k[s..s + kv_dim].copy_from_slice(&round(&k[row.clone()]));
                want_v[s..s + kv_dim].copy_from_slice(&round(&v[row]));
            }
            let (keys, values) = g.kv_pool_to_host(&pool, 2).unwrap();
            assert!(keys == want_k && values == want_v, "{kv:?}: the pool after writing {n} rows");
        }
        for layer in [0, 1] {
            let (keys, values) = g.kv_pool_to_host(&pool, layer).unwrap();
            assert!(keys.iter().chain(&values).all(|&x| x == 0.0), "{kv:?}: layer {layer} was written");
        }
    }
    // The row copies the batched layers use, against the CPU's (exact).
    let cpu = CpuBackend::new();
    let x = r.vec(13 * 7);
    let (xc, xg) = (cpu.act_from_host(13, 7, &x), g.act_from_host(13, 7, &x));
    for rows in [0..13, 4..5, 2..11] {
        assert_eq!(g.to_host(&g.slice_rows(&xg, rows.clone())), cpu.to_host(&cpu.slice_rows(&xc, rows)));
    }
    let parts_g = [g.slice_rows(&xg, 3..5), g.slice_rows(&xg, 0..1), g.slice_rows(&xg, 6..13)];
    let parts_c = [cpu.slice_rows(&xc, 3..5), cpu.slice_rows(&xc, 0..1), cpu.slice_rows(&xc, 6..13)];
    assert_eq!(g.to_host(&g.concat_rows(&parts_g)), cpu.to_host(&cpu.concat_rows(&parts_c)));
    let pick = [12, 0, 5, 5, 3];
    assert_eq!(g.to_host(&g.gather_rows(&xg, &pick)), cpu.to_host(&cpu.gather_rows(&xc, &pick)));
    assert_eq!(g.rows(&g.gather_rows(&xg, &[])), 0);
    g.check().unwrap();
}

/// The batch's attention inputs (`paged_prologue`: gate split, per-head
/// norms, RoPE at each row's own position, keys and values to their
/// slots) against the CPU's composition, for rows of sequences at unrelated
/// positions: queries, gates and the pool read back.
#[test]
fn paged_prologue_matches_cpu() {
    for kv in [KvPrecision::F32, KvPrecision::F16] {
        let Some(p) = pair_kv(kv) else { return };
        let mut r = Rng::fresh();
        let configs = [
            (4, 2, 64, true, true, 16, RopeStyle::Neox),
            (6, 3, 128, false, false, 128, RopeStyle::Interleaved),
            (8, 2, 256, true, true, 64, RopeStyle::Neox),
        ];
        for (nh, nkv, hd, output_gate, with_norms, rot, style) in configs {
            let shape = QkvShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, output_gate };
            let rope = Rope::new(&RopeConfig { theta: 1e6, style, scaling: None }, rot);
            let (qnc, qng) = p.weights(&tensor("qn", DType::F32, vec![hd], &r.vec(hd)));
            let (knc, kng) = p.weights(&tensor("kn", DType::F32, vec![hd], &r.vec(hd)));
            let (norms_c, norms_g) = (with_norms.then_some((&qnc, &knc)), with_norms.then_some((&qng, &kng)));
            let (layout, num_blocks) = shuffled_layout(&mut r, &[(1, 700), (5, 3), (1, 0), (9, 40)], 16, 2);
            let (rows, q_cols, kv_dim) = (layout.rows(), nh * hd * if output_gate { 2 } else { 1 }, nkv * hd);
            let (pq, k, v) = (r.vec(rows * q_cols), r.vec(rows * kv_dim), r.vec(rows * kv_dim));
            let mut pool_c = p.cpu.new_kv_pool(2, kv_dim, num_blocks, 16).unwrap();
            let mut pool_g = p.gpu.new_kv_pool(2, kv_dim, num_blocks, 16).unwrap();
            let (qc, gc) = p.cpu.paged_prologue(
                p.cpu.act_from_host(rows, q_cols, &pq),
                p.cpu.act_from_host(rows, kv_dim, &k),
                &p.cpu.act_from_host(rows, kv_dim, &v),
                &shape,
                norms_c,
                1e-6,
                &rope,
                &mut pool_c,
                1,
                &layout,
            );
            let (qg, gg) = p.gpu.paged_prologue(
                p.gpu.act_from_host(rows, q_cols, &pq),
                p.gpu.act_from_host(rows, kv_dim, &k),
                &p.gpu.act_from_host(rows, kv_dim, &v),
                &shape,
                norms_g,
                1e-6,
                &rope,
                &mut pool_g,
                1,
                &layout,
            );
            // The same from the stacked q|k|v projection in one kernel.
            let stacked: Vec<f32> = (0..rows)
                .flat_map(|i| {
                    let row = |x: &[f32], w: usize| x[i * w..(i + 1) * w].to_vec();
                    [row(&pq, q_cols), row(&k, kv_dim), row(&v, kv_dim)].concat()
                })
                .collect();
            let mut pool_s = p.gpu.new_kv_pool(2, kv_dim, num_blocks, 16).unwrap();
            let (qs, gs) = p.gpu.paged_qkv_prologue(
                &p.gpu.act_from_host(rows, q_cols + 2 * kv_dim, &stacked),
                &shape,
                norms_g,
                1e-6,
                &rope,
                &mut pool_s,
                1,
                &layout,
            );
            for (form, qg, gg, pool_g) in [("", qg, gg, &pool_g), (" (stacked)", qs, gs, &pool_s)] {
                let what =
                    format!("paged_prologue{form} {nh}/{nkv}×{hd} gate {output_gate} rot {rot} {style:?} {kv:?}");
                p.check(&what, &qc, &qg, 1e-5);
                assert_eq!(gc.is_some(), gg.is_some(), "{what}: gate");
                if let (Some(gc), Some(gg)) = (&gc, gg) {
                    p.check(&format!("{what} gate"), gc, &gg, 0.0);
                }
                // The rows written: f32 as computed; f16 within its rounding.
                let (keys_g, values_g) = p.gpu.kv_pool_to_host(pool_g, 1).unwrap();
                let LayerRows::F32 { keys: keys_c, values: values_c } = pool_c.layer(1) else {
                    panic!("the CPU pool stores f32 rows")
                };
                let tol = if kv == KvPrecision::F16 { 1e-3 } else { 1e-5 };
                for (name, got, want) in [("keys", &keys_g, keys_c), ("values", &values_g, values_c)] {
                    let e = rel(got, want);
                    assert!(e <= tol, "{what}: {name} in the pool: rel err {e} > {tol}");
                }
            }
        }
    }
}

/// A request: greedy, `max_tokens` new tokens.
fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        sampling: SamplingParams::default(),
        stop: StopConditions { max_tokens, ..Default::default() },
        ..Default::default()
    }
}

/// Runs `reqs` through `core`, request `i` joining before step `joins[i]`;
/// returns each one's tokens.
fn run(core: &mut EngineCore, reqs: &[Request], joins: &[usize]) -> Vec<Vec<u32>> {
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut step = 0;
    loop {
        for (i, q) in reqs.iter().enumerate() {
            if joins[i] == step {
                core.add(i as u64, q.clone()).unwrap();
            }
        }
        if core.num_unfinished() == 0 && joins.iter().all(|&j| j < step) {
            break;
        }
        for out in core.step().unwrap() {
            got.entry(out.id).or_default().extend(&out.token_ids);
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    assert!(core.pools_whole(), "blocks or state slots leaked");
    (0..reqs.len() as u64).map(|i| got.remove(&i).unwrap_or_default()).collect()
}

/// The largest logit's index and its lead over the second.
fn top2(logits: &[f32]) -> (usize, f32) {
    let (mut best, mut second) = ((0, f32::NEG_INFINITY), f32::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if x > best.1 {
            second = best.1;
            best = (i, x);
        } else if x > second {
            second = x;
        }
    }
    (best.0, best.1 - second)
}

/// Where the GPU engine's greedy pick differs from the CPU's, and the CPU's
/// logits there prefer its pick by at most this many times the GPU's
/// measured logit error, the pick was a near-tie: the error is measured on
/// the one-sequence path at the same context (one prefill of it, whose
/// attention runs on f16 tensor cores), and the batched forward (its f16 KV
/// pool, GEMMs of other row counts) departs from the CPU by about as much.
const TIE_FACTOR: f32 = 4.0;

/// The bench's small configurations (bench/configs) with a vocabulary of
/// 32768 instead of 248320 (the CPU's reference run and the random tables'
/// making stay short) and, for the dense Qwen3-0.6B, 4 of its 28 layers;
/// weights f32, so prefill GEMMs on the GPU keep f32 activations and the
/// greedy picks are rarely near-ties.
#[test]
fn the_engine_on_cuda_matches_the_cpu_engine() {
    if gpu().is_none() {
        return;
    }
    let configs = [
        ("dense", include_str!("../../../bench/configs/qwen3-0.6b.json"), Some(4)),
        ("hybrid", include_str!("../../../bench/configs/cpu-hybrid-small.json"), None),
        ("moe", include_str!("../../../bench/configs/cpu-moe-small.json"), None),
    ];
    let dir = std::env::temp_dir().join(format!("qinfer-cuda-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vocab = 32768u32;
    for (name, json, layers) in configs {
        let path = config_file(&dir, name, json, vocab, layers);
        let storage = "f32".parse().unwrap();
        let (_, cpu) = loader::random_model(&path, storage, Device::CPU).unwrap();
        let cuda = Device::Cuda { ordinal: 0, options: CudaOptions::default() };
        let (_, gpu) = loader::random_model(&path, storage, cuda).unwrap();
        let (cpu, gpu): (Arc<dyn LanguageModel>, Arc<dyn LanguageModel>) = (Arc::from(cpu), Arc::from(gpu));
        // Prompts of 1 to 150 tokens (past a 64-token chunk, and past the
        // 80-token step budget: chunked prefills), 5 to 30 new tokens,
        // joining at different steps, four running at once.
        let text: Vec<u32> = (0..160u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let reqs = vec![
            greedy(text[..1].to_vec(), 9),
            greedy(text[3..74].to_vec(), 12),
            greedy(text[10..17].to_vec(), 30),
            greedy(text[..150].to_vec(), 5),
            greedy(text[20..53].to_vec(), 16),
            greedy(text[5..70].to_vec(), 20),
            // Joins after the 150-token prompt is in: with the prefix cache
            // on, its first 128 positions come from there (a snapshot at 128
            // on the hybrid).
            greedy(text[..140].to_vec(), 6),
        ];
        let joins = [0, 0, 1, 1, 3, 6, 9];
        // A pool of 16 blocks of 16 (two sequences' worth): preemptions.
        // Without and with the prefix cache (snapshots every 64 positions
        // on the hybrid).
        // A host tier takes what the small pool evicts: blocks and snapshots
        // cross to the host and back.
        let cache = PrefixCacheConfig { snapshot_interval: 64, snapshot_slots: 2, host_bytes: 64 << 20 };
        for prefix_cache in [None, Some(cache)] {
            let config = EngineConfig {
                max_batched_tokens: 80,
                max_num_seqs: 4,
                block_size: 16,
                num_blocks: 16,
                max_model_len: 512,
                prefix_cache,
                speculative: None,
            };
            let name = if prefix_cache.is_some() { format!("{name} (prefix cache)") } else { name.to_string() };
            let mut core_c = EngineCore::new(cpu.clone(), None, config).unwrap();
            let want = run(&mut core_c, &reqs, &joins);
            let mut core_g = EngineCore::new(gpu.clone(), None, config).unwrap();
            let got = run(&mut core_g, &reqs, &joins);
            println!("{name}: {} preemptions on the GPU, {} on the CPU", core_g.preemptions(), core_c.preemptions());
            if prefix_cache.is_some() {
                println!(
                    "{name}: prefix cache on the GPU {:?}, its host tier {:?}; on the CPU {:?}",
                    core_g.prefix_stats(),
                    core_g.host_tier(),
                    core_c.prefix_stats()
                );
            }
            same_or_near_ties(&name, &reqs, &want, &got, &cpu, &gpu);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Decode-only steps replay CUDA graphs recorded per padded batch size and
/// attention plan (batch_graph.rs): the engine's greedy tokens on the GPU
/// with recorded steps equal the CPU engine's up to near-ties, for float and
/// affine weights and experts (routed on the device), with batches of 1 to 8 decode rows (padded to
/// 1, 2, 4, 8) and caches past one attention block's keys (split plans),
/// and the steps did replay.
#[test]
fn recorded_batch_steps_keep_the_greedy_tokens() {
    if gpu().is_none() {
        return;
    }
    use qinfer::backend::cuda::CudaBackend;
    use qinfer::models::decoder::DecoderModel;
    use qinfer::weights::random::RandomWeights;
    let dir = std::env::temp_dir().join(format!("qinfer-cuda-graphs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vocab = 32768u32;
    let configs = [
        ("dense f32", include_str!("../../../bench/configs/qwen3-0.6b.json"), Some(4), "f32"),
        ("dense q4g64", include_str!("../../../bench/configs/qwen3-0.6b.json"), Some(4), "q4g64"),
        // Qwen3-30B-A3B's architecture at a small size (the small MoE bench
        // configuration is a hybrid, whose steps are not recorded).
        ("moe f32", include_str!("../../../bench/configs/qwen3-30b-a3b.json"), Some(2), "f32"),
    ];
    let text: Vec<u32> = (0..400u32).map(|i| (i * 7919 + 13) % vocab).collect();
    // Up to 8 at once, joining and finishing at different steps; one prompt
    // of 330 tokens (past the 256 keys an f16 decode block holds).
    let mut reqs = Vec::new();
    let mut joins = Vec::new();
    for i in 0..11usize {
        let len = [1, 40, 7, 330, 19, 66, 3, 120, 25, 90, 12][i];
        reqs.push(greedy(text[i..i + len].to_vec(), 12 + 7 * (i % 4)));
        joins.push([0, 0, 0, 1, 2, 2, 5, 9, 14, 20, 30][i]);
    }
    for (name, json, layers, storage) in configs {
        let path = config_file(&dir, name.split(' ').next().unwrap(), json, vocab, layers);
        if name.starts_with("moe") {
            let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for (key, value) in [("hidden_size", 512), ("num_experts", 16), ("moe_intermediate_size", 128)] {
                cfg[key] = value.into();
            }
            std::fs::write(&path, cfg.to_string()).unwrap();
        }
        let storage = storage.parse().unwrap();
        let cfg = loader::model_config(&path).unwrap();
        let (_, cpu) = loader::random_model(&path, storage, Device::CPU).unwrap();
        let backend = CudaBackend::new(0).unwrap();
        let replays = backend.replay_counter();
        let weights = RandomWeights::new(storage, cfg.num_layers, 0);
        let gpu = DecoderModel::random(cfg.clone(), backend, weights).unwrap();
        let (cpu, gpu): (Arc<dyn LanguageModel>, Arc<dyn LanguageModel>) = (Arc::from(cpu), Arc::new(gpu));
        let config = EngineConfig {
            max_batched_tokens: 512,
            max_num_seqs: 8,
            block_size: 16,
            num_blocks: 256,
            max_model_len: 512,
            prefix_cache: None,
            speculative: None,
        };
        let want = run(&mut EngineCore::new(cpu.clone(), None, config).unwrap(), &reqs, &joins);
        let got = run(&mut EngineCore::new(gpu.clone(), None, config).unwrap(), &reqs, &joins);
        let replayed = replays.load(std::sync::atomic::Ordering::Relaxed);
        println!("{name}: {replayed} batched steps replayed");
        assert!(replayed >= 10, "{name}: only {replayed} batched steps replayed");
        same_or_near_ties(name, &reqs, &want, &got, &cpu, &gpu);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Speculative decoding on the hybrid (its Gated DeltaNet states rolled
/// back past rejected drafts) gives plain decoding's greedy tokens on the
/// GPU, up to near-ties: the verify rows run as one batched forward. A
/// random dense model of the same vocabulary drafts (its drafts are nearly
/// all rejected, so nearly every verification rolls the states back), and
/// prompt lookup too.
#[test]
fn hybrid_speculation_on_cuda_keeps_plain_greedy_tokens() {
    if gpu().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("qinfer-cuda-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vocab = 32768u32;
    let cuda = Device::Cuda { ordinal: 0, options: CudaOptions::default() };
    let storage = "f32".parse().unwrap();
    let models = [
        config_file(&dir, "hybrid", include_str!("../../../bench/configs/cpu-hybrid-small.json"), vocab, None),
        config_file(&dir, "draft", include_str!("../../../bench/configs/qwen3-0.6b.json"), vocab, Some(2)),
    ];
    let (_, cpu) = loader::random_model(&models[0], storage, Device::CPU).unwrap();
    let (_, gpu) = loader::random_model(&models[0], storage, cuda).unwrap();
    let (_, draft) = loader::random_model(&models[1], storage, cuda).unwrap();
    let (cpu, gpu, draft): (Arc<dyn LanguageModel>, Arc<dyn LanguageModel>, Arc<dyn LanguageModel>) =
        (Arc::from(cpu), Arc::from(gpu), Arc::from(draft));
    let text: Vec<u32> = (0..160u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let reqs = vec![
        greedy(text[..9].repeat(4), 40),
        greedy(text[3..74].to_vec(), 60),
        greedy(text[10..17].to_vec(), 80),
        greedy([&text[20..40], &text[20..40]].concat(), 30),
    ];
    let joins = [0, 0, 1, 3];
    let mut config = EngineConfig {
        max_batched_tokens: 80,
        max_num_seqs: 4,
        block_size: 16,
        num_blocks: 64,
        max_model_len: 512,
        prefix_cache: None,
        speculative: None,
    };
    let want = run(&mut EngineCore::new(gpu.clone(), None, config).unwrap(), &reqs, &joins);
    for (label, spec, drafter) in [
        ("draft model, k=3", SpeculativeConfig::draft_model(3), Some(draft.clone())),
        ("ngram, k=4", SpeculativeConfig::ngram(4), None),
    ] {
        config.speculative = Some(spec);
        let mut core = EngineCore::with_draft(gpu.clone(), None, config, drafter).unwrap();
        let got = run(&mut core, &reqs, &joins);
        let stats = core.speculative_stats();
        println!("hybrid, {label}: {stats:?}");
        if label.starts_with("draft") {
            assert!(stats.verifications > 0 && stats.drafted > stats.accepted, "{label}: {stats:?}");
        }
        same_or_near_ties(&format!("hybrid, {label}"), &reqs, &want, &got, &cpu, &gpu);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Every request's tokens in `got` equal `want`'s, but where they part the
/// pick was a near-tie: the CPU's logits prefer one pick to the other by at
/// most [`TIE_FACTOR`] times the GPU's logit error at that context.
fn same_or_near_ties(
    name: &str,
    reqs: &[Request],
    want: &[Vec<u32>],
    got: &[Vec<u32>],
    cpu: &Arc<dyn LanguageModel>,
    gpu: &Arc<dyn LanguageModel>,
) {
    for (i, ((q, w), g)) in reqs.iter().zip(want).zip(got).enumerate() {
        assert_eq!((w.len(), g.len()), (q.stop.max_tokens, q.stop.max_tokens), "{name}: request {i}'s lengths");
        let Some(at) = w.iter().zip(g).position(|(a, b)| a != b) else {
            println!("{name}: request {i} (prompt of {}): {} tokens equal", q.prompt.len(), w.len());
            continue;
        };
        // The first divergence: the CPU's margin there, and the GPU's
        // logit error at the same context on the one-sequence path.
        let context = [&q.prompt[..], &w[..at]].concat();
        let logits = |m: &Arc<dyn LanguageModel>| {
            let mut s = m.new_sequence(context.len() + 1);
            m.forward(s.as_mut(), &context, Logits::Last).unwrap()
        };
        let (lc, lg) = (logits(cpu), logits(gpu));
        let (top, top_margin) = top2(&lc);
        // How much the CPU prefers its pick to the GPU's there.
        let margin = lc[w[at] as usize] - lc[g[at] as usize];
        let err = max_abs(&lg, &lc);
        println!(
            "{name}: request {i} (prompt of {}): the first {at} of {} tokens equal, then CPU {} GPU {}: \
         the CPU's logits there: top-2 margin {top_margin:.3e} (top {top}), CPU pick over GPU pick \
         {margin:.3e}; the GPU's logit error there {err:.3e}",
            q.prompt.len(),
            w.len(),
            w[at],
            g[at]
        );
        assert!(
            margin.abs() <= TIE_FACTOR * err,
            "{name}: request {i} (prompt of {}): only the first {at} tokens compared equal; the pick after them \
         differs (CPU {}, GPU {}) although the CPU prefers its pick by {margin:.3e} (top-2 margin \
         {top_margin:.3e}), more than {TIE_FACTOR}× the GPU's logit error {err:.3e} there: not a near-tie",
            q.prompt.len(),
            w[at],
            g[at]
        );
    }
}
