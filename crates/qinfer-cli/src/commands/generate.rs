//! `qinfer generate`: raw continuation, no template.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use qinfer::engine::generate::{GenerateOptions, generate};

use qinfer::engine::request::{Request, StopConditions};
use qinfer::loader::LoadedModel;
use qinfer::tokenizer::Tokenizer;
use qinfer::tokenizer::stream::StreamDecoder;

use super::on_engine::{SpeculationArgs, run_one};
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
    #[command(flatten)]
    speculation: SpeculationArgs,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let model = open_model(Some(&a.model))?;
    let ids = a.input.token_ids(&model)?;
    if a.speculation.speculative.is_some() {
        return generate_on_engine(a, model, ids, device);
    }
    let lm = model.load(device, !a.json)?;
    let sampling = a.sampling.resolve(&model.sampling_defaults);
    let stops = if a.ignore_eos { vec![] } else { stop_tokens(&model, None) };
    let opts = GenerateOptions {
        max_new_tokens: a.max_tokens,
        stop_tokens: stops,
        prefill_chunk: 512,
        adapter: a.lora.place(lm.as_ref())?,
    };
    let mut out = Printer::new(model.tokenizer.as_ref(), a.json);
    let (new, stats) = generate(lm.as_ref(), &ids, &sampling, &opts, |t| {
        out.token(t)?;
        Ok(true)
    })?;
    let summary = format!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.decode_tokens,
        stats.decode_tok_s()
    );
    out.finish(&new, &summary)
}

/// `generate` through the engine, for speculative decoding: the same
/// output as the one-sequence path, streamed or as JSON.
fn generate_on_engine(
    mut a: Args,
    mut model: LoadedModel,
    ids: Vec<u32>,
    device: qinfer::loader::Device,
) -> Result<()> {
    let stops = if a.ignore_eos { vec![] } else { stop_tokens(&model, None) };
    let sampling = a.sampling.resolve(&model.sampling_defaults);
    let tok = model.tokenizer.take().map(Arc::new);
    let spec = a.speculation.speculation();
    let lora = std::mem::take(&mut a.lora);
    let request = |lm: &dyn qinfer::models::LanguageModel| -> Result<Request> {
        Ok(Request {
            prompt: ids,
            sampling,
            stop: StopConditions { max_tokens: a.max_tokens, stop_token_ids: stops, ..Default::default() },
            adapter: lora.place(lm)?,
            ..Default::default()
        })
    };
    let tok_ref = tok.clone();
    let mut out = Printer::new(tok_ref.as_deref(), a.json);
    let mut tokens = Vec::new();
    let run = run_one(model, tok, device, &spec, request, |o| {
        tokens.extend_from_slice(&o.token_ids);
        Ok(o.token_ids.iter().try_for_each(|&t| out.token(t))?)
    })?;
    let summary = format!(
        "prompt: {} tokens, first token after {:.2} s | decode: {} tokens, {:.1} tok/s{} | {}",
        run.prompt_tokens,
        run.first.as_secs_f64(),
        run.generated,
        run.decode_tok_s,
        run.drafts(&spec),
        run.device
    );
    out.finish(&tokens, &summary)
}

/// `generate`'s output: each new token streamed as text (as ids without a
/// tokenizer), or with `--json` one object at the end.
struct Printer<'a> {
    tok: Option<&'a Tokenizer>,
    stream: Option<StreamDecoder<'a>>,
    json: bool,
    stdout: std::io::StdoutLock<'static>,
}

impl<'a> Printer<'a> {
    fn new(tok: Option<&'a Tokenizer>, json: bool) -> Self {
        let stream = if json { None } else { tok.map(|t| t.stream_decoder()) };
        Printer { tok, stream, json, stdout: std::io::stdout().lock() }
    }

    fn token(&mut self, t: u32) -> qinfer::Result<()> {
        match self.stream.as_mut() {
            Some(s) => {
                if let Some(piece) = s.push(t)? {
                    self.stdout.write_all(piece.as_bytes()).map_err(stdout_error)?;
                }
            }
            None if !self.json => write!(self.stdout, "{t} ").map_err(stdout_error)?,
            None => {}
        }
        self.stdout.flush().map_err(stdout_error)?;
        Ok(())
    }

    /// The JSON object of `new`, or the rest of the text and `summary` on stderr.
    fn finish(mut self, new: &[u32], summary: &str) -> Result<()> {
        if self.json {
            let text = match self.tok {
                Some(t) => t.decode(new, false)?,
                None => String::new(),
            };
            writeln!(self.stdout, "{}", serde_json::json!({ "tokens": new, "text": text }))?;
        } else {
            if let Some(rest) = self.stream.as_mut().map(|s| s.finish()).transpose()?.flatten() {
                self.stdout.write_all(rest.as_bytes())?;
            }
            writeln!(self.stdout)?;
            eprintln!("{summary}");
        }
        Ok(())
    }
}
