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

/// A model against a base model (the same weights with another KV cache
/// format, say) over the same chunks, as llama-perplexity's
/// `--kl-divergence`: per scored token the KL divergence of the model's next-
/// token distribution from the base's, and whether their top tokens agree.
#[derive(Debug, Clone)]
pub struct KlResult {
    pub ppl_base: f64,
    pub ppl: f64,
    pub mean_kl: f64,
    /// The 99th percentile of the per-token KL.
    pub kl_p99: f64,
    pub max_kl: f64,
    /// Fraction of scored tokens whose most likely next token is the same.
    pub same_top: f64,
    pub scored_tokens: usize,
}

/// Log-softmax in f64 (for the KL divergence; perplexity keeps [`log_prob`]'s rounding).
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln() + max;
    logits.iter().map(|&l| l as f64 - lse).collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold(0, |best, (i, v)| if *v > x[best] { i } else { best })
}

/// [`perplexity`]'s chunks scored by `model` and `base`; `on_chunk(i, mean KL so far)`.
pub fn kl_divergence(
    model: &dyn LanguageModel,
    base: &dyn LanguageModel,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut on_chunk: impl FnMut(usize, f64),
) -> Result<KlResult> {
    check_chunks(tokens, ctx)?;
    let vocab = model.config().vocab_size;
    let (mut nll, mut nll_base, mut kls, mut same) = (0f64, 0f64, Vec::new(), 0usize);
    for c in 0..tokens.len() / ctx {
        let chunk = chunk_of(tokens, c, ctx, bos);
        let mut seq = model.new_sequence(ctx);
        let logits = model.forward(seq.as_mut(), &chunk, Logits::All)?;
        let mut seq = base.new_sequence(ctx);
        let base_logits = base.forward(seq.as_mut(), &chunk, Logits::All)?;
        for j in ctx / 2..ctx - 1 {
            let (l, b) = (&logits[j * vocab..(j + 1) * vocab], &base_logits[j * vocab..(j + 1) * vocab]);
            let (lp, bp) = (log_softmax(l), log_softmax(b));
            let next = tokens[c * ctx + j + 1];
            nll -= log_prob(l, next);
            nll_base -= log_prob(b, next);
            kls.push(bp.iter().zip(&lp).map(|(b, l)| b.exp() * (b - l)).sum::<f64>().max(0.0));
            same += (argmax(l) == argmax(b)) as usize;
        }
        on_chunk(c, kls.iter().sum::<f64>() / kls.len() as f64);
    }
    let n = kls.len();
    let mean_kl = kls.iter().sum::<f64>() / n as f64;
    kls.sort_by(f64::total_cmp);
    Ok(KlResult {
        ppl_base: (nll_base / n as f64).exp(),
        ppl: (nll / n as f64).exp(),
        mean_kl,
        kl_p99: kls[(n * 99 / 100).min(n - 1)],
        max_kl: kls[n - 1],
        same_top: same as f64 / n as f64,
        scored_tokens: n,
    })
}

/// Chunk `c` of `ctx` tokens, its first replaced by BOS when the vocabulary adds one.
fn chunk_of(tokens: &[u32], c: usize, ctx: usize, bos: Option<u32>) -> Vec<u32> {
    let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
    if let Some(b) = bos {
        chunk[0] = b;
    }
    chunk
}

fn check_chunks(tokens: &[u32], ctx: usize) -> Result<()> {
    if ctx < 4 {
        return Err(Error::Invalid(format!("--ctx {ctx} is too small")));
    }
    if tokens.len() < 2 * ctx {
        return Err(Error::Invalid(format!(
            "need at least {} tokens for --ctx {ctx} (as llama-perplexity), the text has {}",
            2 * ctx,
            tokens.len()
        )));
    }
    Ok(())
}

pub fn perplexity(
    model: &dyn LanguageModel,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut on_chunk: impl FnMut(usize, f64),
) -> Result<PerplexityResult> {
    check_chunks(tokens, ctx)?;
    let chunks = tokens.len() / ctx;
    let vocab = model.config().vocab_size;
    let first = ctx / 2;
    let (mut nll, mut count) = (0f64, 0usize);
    let mut running = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let chunk = chunk_of(tokens, c, ctx, bos);
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
