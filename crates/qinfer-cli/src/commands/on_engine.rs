//! One request through the continuous-batching engine, for `run` and
//! `generate` when they take images or speculate: the model loaded with
//! what the proposer needs, the request run to its end, each output handed
//! on as it comes, and what the run measured.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::request::{Output, Request};
use qinfer::loader::LoadedModel;
use qinfer::models::LanguageModel;
use qinfer::tokenizer::Tokenizer;

use crate::common::SpeculativeKind;

/// `run`'s and `generate`'s speculation flags (the engine commands take
/// theirs with `EngineArgs`).
#[derive(clap::Args)]
pub struct SpeculationArgs {
    /// Speculative decoding (`ngram`, `draft:PATH` or `mtp`), as on the
    /// engine commands; the output is the same, greedy or in distribution.
    #[arg(long, value_parser = crate::common::parse_speculative, value_name = "ngram|draft:PATH|mtp[:PATH]")]
    pub speculative: Option<SpeculativeKind>,
    /// Most draft tokens a step (with --speculative).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub draft_tokens: u16,
    /// Verify every proposed draft up to --draft-tokens (by default only
    /// those the measured step costs say pay).
    #[arg(long, requires = "speculative")]
    pub fixed_draft_tokens: bool,
}

impl SpeculationArgs {
    pub fn speculation(&self) -> Speculation<'_> {
        Speculation {
            kind: self.speculative.as_ref(),
            draft_tokens: self.draft_tokens as usize,
            fixed: self.fixed_draft_tokens,
        }
    }
}

/// How the request speculates (None: plain decoding).
pub struct Speculation<'a> {
    pub kind: Option<&'a SpeculativeKind>,
    pub draft_tokens: usize,
    /// Verify every proposed draft, not only those the step costs say pay.
    pub fixed: bool,
}

/// What one engine run measured.
pub struct EngineRun {
    pub device: String,
    pub prompt_tokens: usize,
    pub generated: usize,
    /// From the request's start to its first output.
    pub first: Duration,
    /// Generated tokens after the first, a second.
    pub decode_tok_s: f64,
    /// Drafts accepted and proposed (with speculation).
    pub accepted: u64,
    pub drafted: u64,
}

impl EngineRun {
    /// The drafts' part of the stderr summary (empty without speculation).
    pub fn drafts(&self, spec: &Speculation<'_>) -> String {
        match spec.kind {
            Some(_) => format!(" | {} of {} drafts accepted", self.accepted, self.drafted),
            None => String::new(),
        }
    }
}

/// Loads `model` on `device` (with its multi-token-prediction head where
/// `spec` proposes with it) and runs the request `request` makes of the
/// loaded model, handing each output to `on_output` until the request ends.
pub fn run_one(
    model: LoadedModel,
    tok: Option<Arc<Tokenizer>>,
    device: qinfer::loader::Device,
    spec: &Speculation<'_>,
    request: impl FnOnce(&dyn LanguageModel) -> Result<Request>,
    mut on_output: impl FnMut(&Output) -> Result<()>,
) -> Result<EngineRun> {
    let model = SpeculativeKind::target(spec.kind, model)?;
    let lm: Arc<dyn LanguageModel> = Arc::from(model.load(device, true)?);
    let req = request(lm.as_ref())?;
    let prompt_tokens = req.prompt.len();
    let len = prompt_tokens + req.stop.max_tokens;
    let mut cfg = EngineConfig::for_model(lm.as_ref(), 2048, 1, Some(len), usize::MAX);
    cfg.speculative = spec.kind.map(|k| k.config(spec.draft_tokens, !spec.fixed));
    let draft = match spec.kind {
        Some(kind) => kind.load_draft(device, tok.as_deref())?,
        None => None,
    };
    let mut core = EngineCore::with_draft(lm.clone(), tok, cfg, draft)?;
    let t0 = Instant::now();
    core.add(0, req)?;
    let (mut first, mut generated) = (None, 0);
    'steps: loop {
        for out in core.step()? {
            first.get_or_insert_with(|| t0.elapsed());
            generated += out.token_ids.len();
            on_output(&out)?;
            if out.finish.is_some() {
                break 'steps;
            }
        }
    }
    let first = first.unwrap_or_default();
    let decode = t0.elapsed().saturating_sub(first).as_secs_f64().max(1e-9);
    let stats = core.speculative_stats();
    Ok(EngineRun {
        device: lm.device(),
        prompt_tokens,
        generated,
        first,
        decode_tok_s: generated.saturating_sub(1) as f64 / decode,
        accepted: stats.accepted,
        drafted: stats.drafted,
    })
}
