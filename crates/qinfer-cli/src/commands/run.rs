//! `qinfer run`: chat template (when the model has one), streamed answer, speed on stderr.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use std::sync::Arc;

use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::engine::request::{Request, StopConditions};
use qinfer::image::{ImageLimits, PreparedImage, prepare};
use qinfer::loader::LoadedModel;
use qinfer::models::vision::expand_placeholders;
use qinfer::tokenizer::{ChatMessage, ChatOptions, ContentPart, Tokenizer};

use super::on_engine::{SpeculationArgs, run_one};
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
    /// An image the user message shows, before its text (repeatable; JPEG,
    /// PNG or WebP). Needs a multimodal checkpoint (Qwen3.5 with its vision tower).
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
    /// The vision projector llama.cpp publishes beside a Qwen3.5 GGUF
    /// (`mmproj-*.gguf`): the GGUF takes images with it.
    #[arg(long, value_name = "PATH")]
    mmproj: Option<PathBuf>,
    #[command(flatten)]
    speculation: SpeculationArgs,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let model = crate::common::with_mmproj(open_model(a.model.as_ref())?, a.mmproj.as_deref())?;
    if !a.images.is_empty() || a.speculation.speculative.is_some() {
        return run_on_engine(a, model, device);
    }
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

/// `run` through the engine, for images or speculative decoding: the
/// user message (its images, then its text) through the chat template,
/// each image marker widened to the image's tokens; the engine runs the
/// vision tower and the proposer.
fn run_on_engine(mut a: Args, mut model: LoadedModel, device: qinfer::loader::Device) -> Result<()> {
    let name = model.path.display().to_string();
    let stops = stop_tokens(&model, None);
    let tok = model.tokenizer.take();
    let (images, per_image, prompt) = if a.images.is_empty() {
        let tok = tok.as_ref().with_context(|| format!("`run` needs a tokenizer; {name} has none"))?;
        let text = if tok.has_chat_template() {
            let mut messages = Vec::new();
            if let Some(s) = a.system.take() {
                messages.push(ChatMessage::new("system", s));
            }
            messages.push(ChatMessage::new("user", a.prompt.clone()));
            let opts =
                ChatOptions { add_generation_prompt: true, enable_thinking: a.enable_thinking, ..Default::default() };
            tok.apply_chat_template(&messages, &opts)?
        } else {
            a.prompt.clone()
        };
        (Vec::new(), Vec::new(), tok.encode(&text, !tok.has_chat_template())?)
    } else {
        with_images(&mut a, &model, tok.as_ref())?
    };
    let tok = tok.expect("both kinds of prompt needed the tokenizer");
    let sampling = a.sampling.resolve(&model.sampling_defaults);
    let spec = a.speculation.speculation();
    let mut stdout = std::io::stdout().lock();
    let lora = &a.lora;
    let request = |lm: &dyn qinfer::models::LanguageModel| -> Result<Request> {
        anyhow::ensure!(images.is_empty() || lm.takes_images(), "images are not supported on {} yet", lm.device());
        Ok(Request {
            prompt,
            sampling,
            stop: StopConditions { max_tokens: a.max_tokens, stop_token_ids: stops, ..Default::default() },
            images,
            adapter: lora.place(lm)?,
            ..Default::default()
        })
    };
    let run = run_one(model, Some(Arc::new(tok)), device, &spec, request, |out| {
        stdout.write_all(out.text.as_bytes()).map_err(stdout_error)?;
        stdout.flush().map_err(stdout_error)?;
        Ok(())
    })?;
    writeln!(stdout)?;
    let shown = match per_image.len() {
        0 => String::new(),
        n => format!(" ({n} images)"),
    };
    eprintln!(
        "prompt: {} tokens{shown}, first token after {:.2} s | decode: {} tokens, {:.1} tok/s{} | {}",
        run.prompt_tokens,
        run.first.as_secs_f64(),
        run.generated,
        run.decode_tok_s,
        run.drafts(&spec),
        run.device
    );
    Ok(())
}

/// A prompt's images, each one's token count, and its token ids.
type Prompt = (Vec<Arc<PreparedImage>>, Vec<usize>, Vec<u32>);

/// The images of `a` prepared, each one's token count, and the prompt: the
/// user message's images then its text through the chat template, each
/// image marker widened to the image's tokens.
fn with_images(a: &mut Args, model: &LoadedModel, tok: Option<&Tokenizer>) -> Result<Prompt> {
    let name = model.path.display().to_string();
    let (Some(vision), Some(processor)) = (model.config.vision.clone(), model.image_processor.clone()) else {
        anyhow::bail!(
            "{name} takes no images: `--image` needs a multimodal checkpoint (Qwen3.5 with its vision tower; \
             a GGUF with llama.cpp's projector file, `--mmproj PATH`)"
        );
    };
    let images = (a.images.iter())
        .map(|p| {
            let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            let img = prepare(&bytes, &processor, &ImageLimits::default()).with_context(|| p.display().to_string())?;
            Ok(Arc::new(img))
        })
        .collect::<Result<Vec<_>>>()?;
    let tok = tok.with_context(|| format!("{name} has no tokenizer"))?;
    anyhow::ensure!(tok.has_chat_template(), "{name} has no chat template to place the images with");
    let mut messages = Vec::new();
    if let Some(s) = a.system.take() {
        messages.push(ChatMessage::new("system", s));
    }
    let mut user = ChatMessage::new("user", a.prompt.clone());
    user.parts = images.iter().map(|_| ContentPart::Image).chain([ContentPart::Text(a.prompt.clone())]).collect();
    messages.push(user);
    let opts = ChatOptions { add_generation_prompt: true, enable_thinking: a.enable_thinking, ..Default::default() };
    let text = tok.apply_chat_template(&messages, &opts)?;
    let per_image: Vec<usize> = images.iter().map(|i| i.tokens(vision.spatial_merge_size)).collect();
    let prompt = expand_placeholders(&tok.encode(&text, false)?, vision.image_token_id, &per_image)?;
    Ok((images, per_image, prompt))
}
