//! `qinfer generate`: raw continuation, no template.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use qinfer::engine::generate::{GenerateOptions, generate};

use crate::common::{InputArgs, LoraArgs, SamplingArgs, open_model, stdout_error, stop_tokens};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (`Qwen/Qwen3-0.6B[:REVISION or :FILE.gguf]`).
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print {"tokens":[new ids],"text":"..."} instead of streaming text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    lora: LoraArgs,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let model = open_model(Some(&a.model))?;
    let ids = a.input.token_ids(&model)?;
    let lm = model.load(device, !a.json)?;
    let sampling = a.sampling.resolve(&model.sampling_defaults);
    let stops = if a.ignore_eos { vec![] } else { stop_tokens(&model, None) };
    let opts = GenerateOptions {
        max_new_tokens: a.max_tokens,
        stop_tokens: stops,
        prefill_chunk: 512,
        adapter: a.lora.place(lm.as_ref())?,
    };
    let tok = model.tokenizer.as_ref();
    let mut stream = if a.json { None } else { tok.map(|t| t.stream_decoder()) };
    let mut stdout = std::io::stdout().lock();
    let (new, stats) = generate(lm.as_ref(), &ids, &sampling, &opts, |t| {
        match stream.as_mut() {
            Some(s) => {
                if let Some(piece) = s.push(t)? {
                    stdout.write_all(piece.as_bytes()).map_err(stdout_error)?;
                }
            }
            None if !a.json => write!(stdout, "{t} ").map_err(stdout_error)?,
            None => {}
        }
        stdout.flush().map_err(stdout_error)?;
        Ok(true)
    })?;
    if a.json {
        let text = match tok {
            Some(t) => t.decode(&new, false)?,
            None => String::new(),
        };
        writeln!(stdout, "{}", serde_json::json!({ "tokens": new, "text": text }))?;
    } else {
        if let Some(rest) = stream.as_mut().map(|s| s.finish()).transpose()?.flatten() {
            stdout.write_all(rest.as_bytes())?;
        }
        writeln!(stdout)?;
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
            stats.prompt_tokens,
            stats.prefill_tok_s(),
            stats.decode_tokens,
            stats.decode_tok_s()
        );
    }
    Ok(())
}
