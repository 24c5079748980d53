//! The single-sequence generation loop: chunked prefill, then one token per
//! forward until a stop token or the token budget.

use std::time::{Duration, Instant};

use crate::models::{LanguageModel, Logits, SequenceState};
use crate::sampling::{Sampler, SamplingParams};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Generation stops after emitting any of these (the stop token is included in the output).
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens per forward during prefill (bounds activation memory).
    pub prefill_chunk: usize,
    /// The LoRA adapter to run with (an id from
    /// [`LanguageModel::add_adapter`]).
    pub adapter: Option<crate::lora::AdapterId>,
}

#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    /// Prompt tokens run through the model (none when no token was asked for).
    pub prompt_tokens: usize,
    pub prefill_time: Duration,
    /// Tokens produced by decode forwards (all but the first generated token).
    pub decode_tokens: usize,
    pub decode_time: Duration,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Feeds `tokens` into `seq` in chunks; the last chunk's forward returns
/// the token `sampler` picks after them (`context` is the whole sequence).
fn prefill_sample(
    model: &dyn LanguageModel,
    seq: &mut dyn SequenceState,
    tokens: &[u32],
    chunk: usize,
    sampler: &mut Sampler,
    context: &[u32],
) -> Result<u32> {
    let chunks: Vec<&[u32]> = tokens.chunks(chunk.max(1)).collect();
    let Some((last, head)) = chunks.split_last() else {
        return Err(Error::Invalid("the prompt is empty".into()));
    };
    for part in head {
        model.forward(seq, part, Logits::Last)?;
    }
    model.forward_sample(seq, last, sampler, context)
}

/// Generates up to `opts.max_new_tokens` after `prompt`. `on_token` sees each new
/// token as it is produced and may stop generation early by returning false.
pub fn generate(
    model: &dyn LanguageModel,
    prompt: &[u32],
    sampling: &SamplingParams,
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Result<bool>,
) -> Result<(Vec<u32>, GenerationStats)> {
    let mut sampler = Sampler::new(sampling.clone())?;
    let capacity = prompt.len() + opts.max_new_tokens;
    let max_ctx = model.config().max_position_embeddings;
    if capacity > max_ctx {
        tracing::warn!("{capacity} tokens exceed the model's max_position_embeddings ({max_ctx})");
    }
    if opts.max_new_tokens == 0 {
        return Ok((Vec::new(), GenerationStats::default()));
    }
    let mut seq = model.new_sequence(capacity);
    model.set_adapter(seq.as_mut(), opts.adapter)?;
    let mut context: Vec<u32> = prompt.to_vec();
    let mut out = Vec::new();
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let t0 = Instant::now();
    let next = prefill_sample(model, seq.as_mut(), prompt, opts.prefill_chunk, &mut sampler, &context)?;
    stats.prefill_time = t0.elapsed();
    let t1 = Instant::now();
    out.push(next);
    context.push(next);
    let mut go_on = |t: u32| Ok(on_token(t)? && !opts.stop_tokens.contains(&t));
    if go_on(next)? {
        // Each feed picks one more token.
        let feeds = opts.max_new_tokens - 1;
        let on_pick = &mut |t: u32| {
            out.push(t);
            stats.decode_tokens += 1;
            go_on(t)
        };
        model.decode(seq.as_mut(), next, feeds, &mut sampler, &mut context, on_pick)?;
    }
    stats.decode_time = t1.elapsed();
    Ok((out, stats))
}
