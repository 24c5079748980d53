//! `qinfer score`: teacher-forced logits for every position, as float32 .npy.

use std::path::PathBuf;

use anyhow::{Context, Result};
use qinfer::models::Logits;

use crate::common::{InputArgs, open_model};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (`Qwen/Qwen3-0.6B[:REVISION or :FILE.gguf]`).
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Output file: float32 [n_tokens, vocab].
    #[arg(long)]
    logits_out: PathBuf,
    /// Tokens per forward (bounds memory on long inputs).
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    #[command(flatten)]
    lora: crate::common::LoraArgs,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let model = open_model(Some(&a.model))?;
    let ids = a.input.token_ids(&model)?;
    let lm = model.load(device, true)?;
    let mut seq = lm.new_sequence(ids.len());
    lm.set_adapter(seq.as_mut(), a.lora.place(lm.as_ref())?)?;
    let mut logits = Vec::with_capacity(ids.len() * model.config.vocab_size);
    for part in ids.chunks(a.chunk.max(1)) {
        logits.extend(lm.forward(seq.as_mut(), part, Logits::All)?);
    }
    qinfer::npy::write_f32(&a.logits_out, &[ids.len(), model.config.vocab_size], &logits)
        .with_context(|| format!("writing {}", a.logits_out.display()))?;
    eprintln!("wrote {} × {} logits to {}", ids.len(), model.config.vocab_size, a.logits_out.display());
    Ok(())
}
