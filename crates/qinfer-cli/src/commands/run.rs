//! `qinfer run`: chat template (when the model has one), streamed answer, speed on stderr.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::tokenizer::{ChatMessage, ChatOptions};

use crate::common::{LoraArgs, SamplingArgs, open_model, stdout_error, stop_tokens};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory or .gguf file (default: SmolLM2-135M-Instruct from the cache).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The user message.
    prompt: String,
    /// Optional system message.
    #[arg(long)]
    system: Option<String>,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Pass enable_thinking=true/false to templates that support it (Qwen3).
    #[arg(long)]
    enable_thinking: Option<bool>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    lora: LoraArgs,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let model = open_model(a.model.as_ref())?;
    let tok =
        model.tokenizer.as_ref().context("`run` needs a tokenizer; this model has none (use `generate --tokens`)")?;
    let text = if tok.has_chat_template() {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        messages.push(ChatMessage::new("user", a.prompt.clone()));
        tok.apply_chat_template(
            &messages,
            &ChatOptions { add_generation_prompt: true, enable_thinking: a.enable_thinking, ..Default::default() },
        )?
    } else {
        a.prompt.clone()
    };
    // The template already wrote any BOS it wants.
    let ids = tok.encode(&text, !tok.has_chat_template())?;
    let lm = model.load(device, true)?;
    let sampling = a.sampling.resolve(&model.sampling_defaults);
    let opts = GenerateOptions {
        max_new_tokens: a.max_tokens,
        stop_tokens: stop_tokens(&model, None),
        prefill_chunk: 512,
        adapter: a.lora.place(lm.as_ref())?,
    };
    let mut stream = tok.stream_decoder();
    let mut stdout = std::io::stdout().lock();
    let stops = opts.stop_tokens.clone();
    let (_, stats) = generate(lm.as_ref(), &ids, &sampling, &opts, |t| {
        if !stops.contains(&t)
            && let Some(piece) = stream.push(t)?
        {
            stdout.write_all(piece.as_bytes()).map_err(stdout_error)?;
            stdout.flush().map_err(stdout_error)?;
        }
        Ok(true)
    })?;
    if let Some(rest) = stream.finish()? {
        stdout.write_all(rest.as_bytes())?;
    }
    writeln!(stdout)?;
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | {}",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.decode_tokens,
        stats.decode_tok_s(),
        lm.device()
    );
    Ok(())
}
