//! `qinfer perplexity`: llama-perplexity's chunking, final PPL on stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use qinfer::engine::perplexity::perplexity;

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
    let r = perplexity(lm.as_ref(), &tokens, a.ctx, bos, |i, p| {
        eprint!("[{}]{:.4},", i + 1, p);
        std::io::stderr().flush().ok();
    })?;
    eprintln!();
    println!("Final estimate: PPL = {:.4} ({} chunks, {} scored tokens)", r.ppl, r.chunks, r.scored_tokens);
    Ok(())
}
