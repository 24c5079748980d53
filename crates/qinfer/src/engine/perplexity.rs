//! Perplexity with llama.cpp's `llama-perplexity` conventions, so numbers are
//! comparable: non-overlapping chunks of `ctx` tokens, each evaluated from an
//! empty cache (first token replaced by BOS when the vocabulary adds one), and
//! only the second half of each chunk scored.

use crate::models::{LanguageModel, Logits};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct PerplexityResult {
    pub ppl: f64,
    pub chunks: usize,
    pub scored_tokens: usize,
    /// Running PPL after each chunk (what llama-perplexity prints as `[i]x`).
    pub running: Vec<f64>,
}

/// log p(tok) from logits, as llama.cpp's `log_softmax`: f32 max, f64 sum of exps.
fn log_prob(logits: &[f32], tok: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|l| (l - max).exp() as f64).sum();
    (logits[tok as usize] - max) as f64 - sum.ln()
}

pub fn perplexity(
    model: &dyn LanguageModel,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut on_chunk: impl FnMut(usize, f64),
) -> Result<PerplexityResult> {
    if ctx < 4 {
        return Err(Error::Invalid(format!("--ctx {ctx} is too small")));
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 || tokens.len() < 2 * ctx {
        return Err(Error::Invalid(format!(
            "need at least {} tokens for --ctx {ctx} (as llama-perplexity), the text has {}",
            2 * ctx,
            tokens.len()
        )));
    }
    let vocab = model.config().vocab_size;
    let first = ctx / 2;
    let (mut nll, mut count) = (0f64, 0usize);
    let mut running = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let mut seq = model.new_sequence(ctx);
        let logits = model.forward(seq.as_mut(), &chunk, Logits::All)?;
        for j in first..ctx - 1 {
            nll -= log_prob(&logits[j * vocab..(j + 1) * vocab], tokens[c * ctx + j + 1]);
            count += 1;
        }
        let ppl = (nll / count as f64).exp();
        running.push(ppl);
        on_chunk(c, ppl);
    }
    Ok(PerplexityResult { ppl: *running.last().expect("at least one chunk"), chunks, scored_tokens: count, running })
}
