//! `qinfer bench`: llama-bench's two tests. pp: one forward of `-p` tokens from an
//! empty cache; tg: `-n` single-token forwards from an empty cache. Each is
//! run once to warm up, then `-r` times; tok/s is reported as mean ± std.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use qinfer::models::{LanguageModel, Logits};
use qinfer::sampling::{Sampler, SamplingParams};
use qinfer::weights::random::WeightStorage;
use serde_json::json;

use crate::common::open_model;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory or .gguf file.
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
}

/// One llama-bench test: context tokens first (untimed), then the timed tokens; tok/s out.
type BenchFn = fn(&dyn LanguageModel, &[u32], &[u32]) -> Result<f64>;

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    // A fixed pseudo-random sequence: content does not change the work done.
    let mut x = 0x9e37_79b9u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % vocab as u32
        })
        .collect()
}

fn context(lm: &dyn LanguageModel, ctx: &[u32], extra: usize) -> Result<Box<dyn qinfer::models::SequenceState>> {
    let mut seq = lm.new_sequence(ctx.len() + extra);
    for chunk in ctx.chunks(2048) {
        lm.forward(seq.as_mut(), chunk, Logits::Last)?;
    }
    Ok(seq)
}

fn pp(lm: &dyn LanguageModel, ctx: &[u32], ids: &[u32]) -> Result<f64> {
    let mut seq = context(lm, ctx, ids.len())?;
    let t = Instant::now();
    lm.forward(seq.as_mut(), ids, Logits::Last)?;
    Ok(ids.len() as f64 / t.elapsed().as_secs_f64())
}

fn tg(lm: &dyn LanguageModel, ctx: &[u32], ids: &[u32]) -> Result<f64> {
    let mut seq = context(lm, ctx, ids.len())?;
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

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let (file, vocab, lm) = match (&a.model, &a.config) {
        (Some(path), _) => {
            let model = open_model(Some(path))?;
            let lm = model.load(device, !a.json)?;
            let file = model.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            (file, model.config.vocab_size, lm)
        }
        (None, Some(cfg_path)) => {
            let (cfg, lm) = qinfer::loader::random_model(cfg_path, a.dtype, device)?;
            let name = format!("{} (random {})", cfg_path.display(), a.dtype);
            (name, cfg.vocab_size, lm)
        }
        (None, None) => bail!("pass --model, or --config with --random-weights"),
    };
    let reps = a.repetitions.max(1);
    let mut rows = Vec::new();
    let mut tests: Vec<(&str, usize, BenchFn)> = a.n_prompt.iter().map(|&n| ("pp", n, pp as BenchFn)).collect();
    tests.push(("tg", a.n_gen, tg));
    for (name, n, f) in tests {
        if n == 0 {
            continue;
        }
        let all = tokens(a.depth + n, vocab);
        let (ctx, ids) = all.split_at(a.depth);
        f(lm.as_ref(), ctx, ids)?;
        let samples = (0..reps).map(|_| f(lm.as_ref(), ctx, ids)).collect::<Result<Vec<_>>>()?;
        let (m, s) = mean_std(&samples);
        let test = if a.depth > 0 { format!("{name}{n} @ d{}", a.depth) } else { format!("{name}{n}") };
        rows.push(
            json!({"test": test, "n_tokens": n, "depth": a.depth, "avg_ts": m, "stddev_ts": s, "samples_ts": samples}),
        );
    }
    if a.json {
        let out = json!({
            "model": file,
            "backend": lm.device(),
            "threads": rayon::current_num_threads(),
            "repetitions": reps,
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("| model | backend | test | t/s |");
        println!("| --- | --- | ---: | ---: |");
        for r in &rows {
            println!(
                "| {file} | {} | {} | {:.2} ± {:.2} |",
                lm.device(),
                r["test"].as_str().unwrap_or(""),
                r["avg_ts"].as_f64().unwrap_or(0.0),
                r["stddev_ts"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
