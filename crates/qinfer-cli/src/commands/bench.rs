//! `qinfer bench`: llama-bench's two tests. pp: one forward of `-p` tokens from an
//! empty cache; tg: `-n` single-token forwards from an empty cache. Each is
//! run once to warm up, then `-r` times; tok/s is reported as mean ± std.

use std::path::PathBuf;
use std::time::Instant;

use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::{Pooling, Request, StopConditions, Task};
use qinfer::loader::Device;
use qinfer::lora::AdapterId;
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::{Sampler, SamplingParams};
use qinfer::weights::random::WeightStorage;
use serde_json::{Value, json};

use crate::commands::bench_images;
use crate::commands::multiturn::{self, Shape};
use crate::common::open_model;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (`Qwen/Qwen3-0.6B[:REVISION or :FILE.gguf]`).
    #[arg(long, required_unless_present = "config", conflicts_with = "config")]
    model: Option<PathBuf>,
    /// A config.json: benchmark a model of its shape with random weights
    /// (requires --random-weights; real checkpoints need not be present).
    #[arg(long, requires = "random_weights")]
    config: Option<PathBuf>,
    /// Make the weights up (with --config).
    #[arg(long, requires = "config")]
    random_weights: bool,
    /// Storage of the random weights' matrices: f32, f16, bf16, a ggml type
    /// (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k … q6_k), llama.cpp's q4_k_m or
    /// q5_k_m mix, or MLX affine groups q<bits>g<group> (q4g64, q8g64, …).
    #[arg(long, default_value = "bf16")]
    dtype: WeightStorage,
    /// Prompt lengths for the pp tests, comma-separated (0 skips it).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "128")]
    n_prompt: Vec<usize>,
    /// Generated tokens for the tg test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    n_gen: usize,
    /// Tokens already in the context before each test (llama-bench's -d):
    /// decode and prefill then attend over this many earlier positions.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Repetitions.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Run C sequences at once through the continuous-batching engine, for
    /// each C given (comma-separated), like llama-batched-bench: each gets
    /// its own `-p` token prompt (pp: all prompts' tokens over the time
    /// until every sequence has its first token), then `-n` new tokens (tg:
    /// the aggregate tok/s of all sequences, and per sequence).
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Tokens one engine step computes (with --concurrency; default 8192 on
    /// CUDA, 2048 on the CPU).
    #[arg(long)]
    max_batched_tokens: Option<usize>,
    /// With --concurrency: run the engine without its prefix cache (it is
    /// on otherwise, each run's prompts salted apart so nothing hits: the
    /// cost of its bookkeeping alone).
    #[arg(long)]
    no_prefix_cache: bool,
    /// With --concurrency: last-token embedding requests of -p tokens
    /// (prompt only, as an embedding model runs them): embedded tok/s.
    #[arg(long, requires = "concurrency")]
    embed: bool,
    /// With --concurrency: speculative decoding of the greedy requests, as
    /// the engine commands' `--speculative` (the tg rows count accepted
    /// drafts as generated tokens and report the acceptance).
    #[arg(long, value_parser = crate::common::parse_speculative, value_name = "ngram|draft:PATH|mtp[:PATH]", requires = "concurrency")]
    speculative: Option<crate::common::SpeculativeKind>,
    /// Most draft tokens per sequence and step (with --speculative).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    draft_tokens: u16,
    /// Verify every proposed draft up to --draft-tokens (by default only
    /// the drafts measured costs say pay, as the engine commands do).
    #[arg(long, requires = "speculative")]
    fixed_draft_tokens: bool,
    /// Multi-turn conversations through the engine, with the prefix cache
    /// and without: --conversations at once, each --turns turns, sharing a
    /// --system-tokens prompt, each turn adding --turn-tokens and an answer
    /// of -n tokens (time to first token and the share served from cache).
    #[arg(long, conflicts_with = "concurrency")]
    multi_turn: bool,
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    #[arg(long, default_value_t = 8)]
    turns: usize,
    #[arg(long, default_value_t = 2000)]
    system_tokens: usize,
    #[arg(long, default_value_t = 200)]
    turn_tokens: usize,
    /// A multimodal model's image costs for a square image of this many
    /// pixels a side: the vision tower's encode, time to first token of the
    /// image and `-p` text tokens against text alone, and the stall of
    /// --image-decoders decoding requests when an image request arrives.
    #[arg(long, conflicts_with_all = ["concurrency", "multi_turn"])]
    image_size: Option<usize>,
    #[arg(long, default_value_t = 16, requires = "image_size")]
    image_decoders: usize,
    #[command(flatten)]
    lora: crate::common::LoraArgs,
}

/// One llama-bench test: context tokens first (untimed), then the timed tokens; tok/s out.
type BenchFn = fn(&dyn LanguageModel, Option<AdapterId>, &[u32], &[u32]) -> Result<f64>;

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    seeded_tokens(n, vocab, 0)
}

/// A fixed pseudo-random sequence for each seed: content does not change
/// the work done.
pub(crate) fn seeded_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = 0x9e37_79b9u32 ^ (seed as u32).wrapping_mul(0x85eb_ca6b) ^ ((seed >> 32) as u32);
    if x == 0 {
        x = 1;
    }
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % vocab as u32
        })
        .collect()
}

fn context(
    lm: &dyn LanguageModel,
    adapter: Option<AdapterId>,
    ctx: &[u32],
    extra: usize,
) -> Result<Box<dyn qinfer::models::SequenceState>> {
    let mut seq = lm.new_sequence(ctx.len() + extra);
    lm.set_adapter(seq.as_mut(), adapter)?;
    for chunk in ctx.chunks(2048) {
        lm.forward(seq.as_mut(), chunk, Logits::Last)?;
    }
    Ok(seq)
}

fn pp(lm: &dyn LanguageModel, adapter: Option<AdapterId>, ctx: &[u32], ids: &[u32]) -> Result<f64> {
    let mut seq = context(lm, adapter, ctx, ids.len())?;
    let t = Instant::now();
    lm.forward(seq.as_mut(), ids, Logits::Last)?;
    Ok(ids.len() as f64 / t.elapsed().as_secs_f64())
}

fn tg(lm: &dyn LanguageModel, adapter: Option<AdapterId>, ctx: &[u32], ids: &[u32]) -> Result<f64> {
    let mut seq = context(lm, adapter, ctx, ids.len())?;
    // Greedy decoding as generation runs it: the first fixed token, then
    // each pick (on the device for GPU models), every pick read on the host.
    // The picks of a model and context are the same every run, so every run
    // does the same work.
    let mut greedy = Sampler::new(SamplingParams::default())?;
    let mut picks = ctx.to_vec();
    let t = Instant::now();
    lm.decode(seq.as_mut(), ids[0], ids.len(), &mut greedy, &mut picks, &mut |_| Ok(true))?;
    Ok(ids.len() as f64 / t.elapsed().as_secs_f64())
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let m = xs.iter().sum::<f64>() / xs.len() as f64;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64 } else { 0.0 };
    (m, var.sqrt())
}

/// One run of `c` sequences of `p` prompt tokens and `n` new tokens through
/// the engine: (prefill tok/s, aggregate decode tok/s).
/// Each run's requests carry a salt of their own, so a run finds nothing
/// of the runs before it in the prefix cache.
/// With `embed`, the requests are last-token pooling requests instead
/// (prompt only): (embedded tok/s, 0).
fn concurrent(
    core: &mut EngineCore,
    (c, p, n): (usize, usize, usize),
    vocab: usize,
    run: usize,
    embed: bool,
    adapter: Option<AdapterId>,
) -> Result<(f64, f64)> {
    let all = tokens(c * p, vocab);
    let task = if embed { Task::Embed(Pooling::Last) } else { Task::Generate };
    for (i, prompt) in all.chunks(p).enumerate() {
        let stop = StopConditions { max_tokens: n, ..Default::default() };
        let cache_salt = Some(format!("run {run}"));
        let req =
            Request { prompt: prompt.to_vec(), stop, cache_salt, task: task.clone(), adapter, ..Default::default() };
        core.add(i as u64, req)?;
    }
    if embed {
        let t0 = Instant::now();
        while core.num_unfinished() > 0 {
            core.step()?;
        }
        return Ok(((c * p) as f64 / t0.elapsed().as_secs_f64().max(1e-9), 0.0));
    }
    let t0 = Instant::now();
    let (mut first, mut t_first) = (0, None);
    let mut generated = 0;
    while core.num_unfinished() > 0 {
        for out in core.step()? {
            generated += out.token_ids.len();
            if out.usage.completion_tokens == out.token_ids.len() {
                first += 1;
            }
        }
        if first == c && t_first.is_none() {
            t_first = Some(t0.elapsed());
        }
    }
    let (total, t_first) = (t0.elapsed(), t_first.unwrap_or_default());
    let decode = (generated - c) as f64 / (total - t_first).as_secs_f64().max(1e-9);
    Ok(((c * p) as f64 / t_first.as_secs_f64().max(1e-9), decode))
}

/// `--concurrency`: pp and tg rows for each C.
fn concurrency_rows(
    a: &Args,
    lm: &Arc<dyn LanguageModel>,
    vocab: usize,
    device: &Device,
    adapter: Option<AdapterId>,
) -> Result<Vec<Value>> {
    let (p, n) = (a.n_prompt.first().copied().unwrap_or(0).max(1), a.n_gen.max(2));
    let mut rows = Vec::new();
    for &c in &a.concurrency {
        if c == 0 {
            bail!("--concurrency values must be at least 1");
        }
        let gpu = !matches!(device, Device::Cpu { .. });
        let budget = a.max_batched_tokens.unwrap_or(if gpu { 8192 } else { 2048 });
        let block = qinfer::kv::blocks::DEFAULT_BLOCK_SIZE;
        let cfg = EngineConfig {
            max_batched_tokens: budget,
            max_num_seqs: c,
            block_size: block,
            num_blocks: c * (p + n).div_ceil(block),
            max_model_len: lm.config().max_position_embeddings,
            prefix_cache: (!a.no_prefix_cache).then(|| {
                PrefixCacheConfig::for_model(lm.as_ref(), 64, PrefixCacheConfig::DEFAULT_SNAPSHOT_BYTES, c * (p + n))
            }),
            speculative: a.speculative.as_ref().map(|kind| kind.config(a.draft_tokens as usize, !a.fixed_draft_tokens)),
        };
        let draft = match &a.speculative {
            Some(kind) => kind.load_draft(*device, None)?,
            None => None,
        };
        let mut core = EngineCore::with_draft(lm.clone(), None, cfg, draft)?;
        concurrent(&mut core, (c, p, n), vocab, 0, a.embed, adapter)?;
        let runs = (1..=a.repetitions.max(1))
            .map(|run| concurrent(&mut core, (c, p, n), vocab, run, a.embed, adapter))
            .collect::<Result<Vec<_>>>()?;
        if let Some(stats) = core.prefix_stats() {
            ensure!(stats.hit_tokens == 0, "benchmark runs must not find each other's prompts in the prefix cache");
        }
        let kv = core.kv_bytes();
        let tests = if a.embed {
            vec![(format!("embed{p}"), runs.iter().map(|r| r.0).collect::<Vec<_>>())]
        } else {
            vec![
                (format!("pp{p}"), runs.iter().map(|r| r.0).collect::<Vec<_>>()),
                (format!("tg{n}"), runs.iter().map(|r| r.1).collect()),
            ]
        };
        for (test, samples) in tests {
            let (m, s) = mean_std(&samples);
            let mut row = json!({"test": test, "concurrency": c, "n_prompt": p, "n_gen": n, "avg_ts": m,
                "stddev_ts": s, "samples_ts": samples, "kv_cache_bytes": kv, "max_batched_tokens": budget});
            if test.starts_with("tg") {
                row["per_seq_ts"] = json!(m / c as f64);
                let spec = core.speculative_stats();
                if a.speculative.is_some() {
                    row["draft_tokens"] = json!(a.draft_tokens);
                    row["drafted"] = json!(spec.drafted);
                    row["accepted"] = json!(spec.accepted);
                    row["acceptance"] = json!(spec.acceptance());
                }
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// `--multi-turn`: the conversations with the prefix cache, then without.
fn multi_turn_rows(a: &Args, lm: &Arc<dyn LanguageModel>, vocab: usize, device: &Device) -> Result<Vec<Value>> {
    let shape = Shape {
        conversations: a.conversations.max(1),
        turns: a.turns.max(1),
        system_tokens: a.system_tokens,
        turn_tokens: a.turn_tokens.max(1),
        answer_tokens: a.n_gen.max(1),
    };
    let gpu = !matches!(device, Device::Cpu { .. });
    let budget = a.max_batched_tokens.unwrap_or(if gpu { 8192 } else { 2048 });
    let longest = shape.system_tokens + shape.turns * (shape.turn_tokens + shape.answer_tokens);
    ensure!(
        longest < lm.config().max_position_embeddings,
        "the conversations grow to {longest} tokens; the model holds {}",
        lm.config().max_position_embeddings
    );
    // Room for every conversation at its longest, and as much again for the cache.
    let block = qinfer::kv::blocks::DEFAULT_BLOCK_SIZE;
    let num_blocks = 2 * shape.conversations * longest.div_ceil(block);
    let mut rows = Vec::new();
    for cache in [true, false] {
        let cfg = EngineConfig {
            max_batched_tokens: budget,
            max_num_seqs: shape.conversations,
            block_size: block,
            num_blocks,
            max_model_len: longest + 1,
            prefix_cache: cache.then(|| {
                PrefixCacheConfig::for_model(
                    lm.as_ref(),
                    64,
                    PrefixCacheConfig::DEFAULT_SNAPSHOT_BYTES,
                    num_blocks * block,
                )
            }),
            speculative: None,
        };
        let mut row = multiturn::run(lm, cfg, shape, &|n, seed| seeded_tokens(n, vocab, seed))?;
        row["test"] = json!(format!(
            "{}×{} turns, system {} +{}/turn, answer {}{}",
            shape.conversations,
            shape.turns,
            shape.system_tokens,
            shape.turn_tokens,
            shape.answer_tokens,
            if cache { "" } else { ", no prefix cache" }
        ));
        rows.push(row);
    }
    Ok(rows)
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let mut processor = None;
    let (file, vocab, lm) = match (&a.model, &a.config) {
        (Some(path), _) => {
            let model = crate::common::SpeculativeKind::target(a.speculative.as_ref(), open_model(Some(path))?)?;
            let lm = model.load(device, !a.json)?;
            let file = model.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            processor = model.image_processor.clone();
            (file, model.config.vocab_size, lm)
        }
        (None, Some(cfg_path)) => {
            let mut cfg = qinfer::loader::model_config(cfg_path)?;
            if let Some(crate::common::SpeculativeKind::Mtp(Some(path))) = &a.speculative {
                bail!("--speculative mtp:{}: a head from its own file needs --model", path.display());
            }
            cfg.load_mtp = crate::common::SpeculativeKind::needs_mtp(a.speculative.as_ref());
            let lm = qinfer::loader::random_model_of(cfg.clone(), a.dtype, device)?;
            let name = format!("{} (random {})", cfg_path.display(), a.dtype);
            (name, cfg.vocab_size, lm)
        }
        (None, None) => bail!("pass --model, or --config with --random-weights"),
    };
    let reps = a.repetitions.max(1);
    let adapter = a.lora.place(lm.as_ref())?;
    if a.multi_turn {
        ensure!(adapter.is_none(), "--multi-turn does not take --lora");
        let lm: Arc<dyn LanguageModel> = Arc::from(lm);
        let rows = multi_turn_rows(&a, &lm, vocab, &device)?;
        return print_rows(&a, &file, lm.as_ref(), 1, rows);
    }
    if let Some(side) = a.image_size {
        ensure!(adapter.is_none(), "--image-size does not take --lora");
        let gpu = !matches!(device, Device::Cpu { .. });
        let bench = bench_images::ImageBench {
            side,
            text_tokens: a.n_prompt.first().copied().unwrap_or(100),
            decoders: a.image_decoders.max(1),
            repetitions: reps,
            max_batched_tokens: a.max_batched_tokens.unwrap_or(if gpu { 8192 } else { 2048 }),
        };
        let lm: Arc<dyn LanguageModel> = Arc::from(lm);
        let rows = bench_images::rows(&lm, &bench, processor.as_ref())?;
        return print_rows(&a, &file, lm.as_ref(), reps, rows);
    }
    if !a.concurrency.is_empty() {
        let lm: Arc<dyn LanguageModel> = Arc::from(lm);
        let rows = concurrency_rows(&a, &lm, vocab, &device, adapter)?;
        return print_rows(&a, &file, lm.as_ref(), reps, rows);
    }
    let mut rows = Vec::new();
    let mut tests: Vec<(&str, usize, BenchFn)> = a.n_prompt.iter().map(|&n| ("pp", n, pp as BenchFn)).collect();
    tests.push(("tg", a.n_gen, tg));
    for (name, n, f) in tests {
        if n == 0 {
            continue;
        }
        let all = tokens(a.depth + n, vocab);
        let (ctx, ids) = all.split_at(a.depth);
        f(lm.as_ref(), adapter, ctx, ids)?;
        let samples = (0..reps).map(|_| f(lm.as_ref(), adapter, ctx, ids)).collect::<Result<Vec<_>>>()?;
        let (m, s) = mean_std(&samples);
        let test = if a.depth > 0 { format!("{name}{n} @ d{}", a.depth) } else { format!("{name}{n}") };
        rows.push(
            json!({"test": test, "n_tokens": n, "depth": a.depth, "avg_ts": m, "stddev_ts": s, "samples_ts": samples}),
        );
    }
    print_rows(&a, &file, lm.as_ref(), reps, rows)
}

fn print_rows(a: &Args, file: &str, lm: &dyn LanguageModel, reps: usize, rows: Vec<Value>) -> Result<()> {
    if a.json {
        let out = json!({
            "model": file,
            "backend": lm.device(),
            "threads": rayon::current_num_threads(),
            "repetitions": reps,
            "lora": a.lora.lora.as_ref().map(|p| p.display().to_string()),
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if a.image_size.is_some() {
        bench_images::print(file, &lm.device(), &rows);
    } else if a.multi_turn {
        println!("| model | backend | test | TTFT turn 1 ms | TTFT turns 2+ ms | ratio | cached / reusable |");
        println!("| --- | --- | --- | ---: | ---: | ---: | ---: |");
        for r in &rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            println!(
                "| {file} | {} | {} | {:.1} | {:.1} | {:.3} | {:.3} |",
                lm.device(),
                r["test"].as_str().unwrap_or(""),
                f("ttft_turn1_median_ms"),
                f("ttft_later_turns_median_ms"),
                f("later_over_first"),
                f("cached_share_of_reusable")
            );
        }
    } else {
        println!("| model | backend | test | t/s |");
        println!("| --- | --- | ---: | ---: |");
        for r in &rows {
            let test = match r["concurrency"].as_u64() {
                Some(c) => format!("{} × {c}", r["test"].as_str().unwrap_or("")),
                None => r["test"].as_str().unwrap_or("").to_string(),
            };
            println!(
                "| {file} | {} | {} | {:.2} ± {:.2} |",
                lm.device(),
                test,
                r["avg_ts"].as_f64().unwrap_or(0.0),
                r["stddev_ts"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
