//! `qinfer bench`: llama-bench's two tests. pp: one forward of `-p` tokens from an
//! empty cache; tg: `-n` single-token forwards from an empty cache. Each is
//! run once to warm up, then `-r` times; tok/s is reported as mean ± std.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use qinfer::models::{LanguageModel, Logits};
use serde_json::json;

use crate::common::open_model;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory or .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// Prompt tokens for the pp test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    n_prompt: usize,
    /// Generated tokens for the tg test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    n_gen: usize,
    /// Repetitions.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One llama-bench test: tokens in, tok/s out.
type BenchFn = fn(&dyn LanguageModel, &[u32]) -> Result<f64>;

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

fn pp(lm: &dyn LanguageModel, ids: &[u32]) -> Result<f64> {
    let mut seq = lm.new_sequence(ids.len());
    let t = Instant::now();
    lm.forward(seq.as_mut(), ids, Logits::Last)?;
    Ok(ids.len() as f64 / t.elapsed().as_secs_f64())
}

fn tg(lm: &dyn LanguageModel, ids: &[u32]) -> Result<f64> {
    let mut seq = lm.new_sequence(ids.len());
    let t = Instant::now();
    for id in ids {
        lm.forward(seq.as_mut(), std::slice::from_ref(id), Logits::Last)?;
    }
    Ok(ids.len() as f64 / t.elapsed().as_secs_f64())
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let m = xs.iter().sum::<f64>() / xs.len() as f64;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64 } else { 0.0 };
    (m, var.sqrt())
}

pub fn main(a: Args) -> Result<()> {
    let model = open_model(Some(&a.model))?;
    let lm = model.load_cpu(!a.json)?;
    let vocab = model.config.vocab_size;
    let reps = a.repetitions.max(1);
    let mut rows = Vec::new();
    let tests: [(&str, usize, BenchFn); 2] = [("pp", a.n_prompt, pp), ("tg", a.n_gen, tg)];
    for (name, n, f) in tests {
        if n == 0 {
            continue;
        }
        let ids = tokens(n, vocab);
        f(lm.as_ref(), &ids)?;
        let samples = (0..reps).map(|_| f(lm.as_ref(), &ids)).collect::<Result<Vec<_>>>()?;
        let (m, s) = mean_std(&samples);
        rows.push(
            json!({"test": format!("{name}{n}"), "n_tokens": n, "avg_ts": m, "stddev_ts": s, "samples_ts": samples}),
        );
    }
    let file = model.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
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
