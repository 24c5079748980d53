//! `qinfer perplexity`: llama-perplexity's chunking, final PPL on stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use qinfer::engine::perplexity::{kl_divergence, perplexity};

use crate::common::open_model;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (`Qwen/Qwen3-0.6B[:REVISION or :FILE.gguf]`).
    #[arg(long)]
    model: PathBuf,
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Also run the model with its KV cache in FORMAT (e.g. f32 or f16) and
    /// report the KL divergence of this run's next-token distributions from
    /// that one's (as llama-perplexity's --kl-divergence).
    #[arg(long, value_name = "FORMAT")]
    kl_base_kv_cache: Option<qinfer::kv::KvFormat>,
    /// Write the result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let model = open_model(Some(&a.model))?;
    let tok = model.tokenizer.as_ref().context("perplexity needs a tokenizer; this model has none")?;
    let mut text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    // llama.cpp's -f drops one trailing newline; do the same so token counts agree.
    if text.ends_with('\n') {
        text.pop();
    }
    // As llama-perplexity: special-token text in the file is not parsed as special tokens.
    let tokens = tok.encode_with(&text, true, false)?;
    // As llama-perplexity: the vocabulary's add-BOS setting decides whether each chunk starts with BOS.
    let bos = tok.encode("", true)?.first().copied();
    eprintln!("{} tokens, {} chunks of {}", tokens.len(), tokens.len() / a.ctx, a.ctx);
    let lm = model.load(device, true)?;
    if let Some(base_kv) = a.kl_base_kv_cache {
        let base_device = device.with_kv_format(Some(base_kv)).map_err(anyhow::Error::msg)?;
        let base = model.load(base_device, false)?;
        let r = kl_divergence(lm.as_ref(), base.as_ref(), &tokens, a.ctx, bos, |i, kl| {
            eprint!("[{}]{:.6},", i + 1, kl);
            std::io::stderr().flush().ok();
        })?;
        eprintln!();
        println!(
            "PPL = {:.4} (base {base_kv}: {:.4}, ratio {:.4}); mean KL = {:.6}, p99 {:.6}, max {:.6}; same top token {:.2}% ({} scored tokens)",
            r.ppl,
            r.ppl_base,
            r.ppl / r.ppl_base,
            r.mean_kl,
            r.kl_p99,
            r.max_kl,
            100.0 * r.same_top,
            r.scored_tokens
        );
        if let Some(path) = &a.json {
            let j = serde_json::json!({"ppl": r.ppl, "ppl_base": r.ppl_base, "base_kv_cache": base_kv.to_string(),
                "mean_kl": r.mean_kl, "kl_p99": r.kl_p99, "max_kl": r.max_kl, "same_top": r.same_top,
                "scored_tokens": r.scored_tokens, "ctx": a.ctx});
            std::fs::write(path, serde_json::to_string_pretty(&j)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let r = perplexity(lm.as_ref(), &tokens, a.ctx, bos, |i, p| {
        eprint!("[{}]{:.4},", i + 1, p);
        std::io::stderr().flush().ok();
    })?;
    eprintln!();
    println!("Final estimate: PPL = {:.4} ({} chunks, {} scored tokens)", r.ppl, r.chunks, r.scored_tokens);
    if let Some(path) = &a.json {
        let j = serde_json::json!({"ppl": r.ppl, "chunks": r.chunks, "scored_tokens": r.scored_tokens, "ctx": a.ctx});
        std::fs::write(path, serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
