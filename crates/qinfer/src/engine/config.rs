//! How an engine batches ([`EngineConfig`]), and a request checked against
//! those limits before it is queued.

use super::prefix::PrefixCacheConfig;
use super::request::{Request, Task};
use super::speculative::{Proposer, SpeculativeConfig};
use crate::config::GdnConfig;
use crate::models::LanguageModel;
use crate::{Error, Result};

/// How an engine batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens one step computes, decode tokens first, prefill chunks after.
    pub max_batched_tokens: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    /// Most positions one sequence may hold (prompt and generated).
    pub max_model_len: usize,
    /// Share computed prefixes between requests (None: off).
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// Propose draft tokens for greedy decode steps and verify them in the
    /// step's forward (None: off).
    pub speculative: Option<SpeculativeConfig>,
}

impl EngineConfig {
    /// Defaults for `model`: `max_model_len` from its config (at most
    /// `max_model_len` when given), and enough blocks for `max_num_seqs`
    /// sequences of that length or `kv_bytes` of KV storage, whichever is
    /// less (but at least one full-length sequence); the prefix cache on,
    /// hybrids snapshotting every recurrent chunk into up to
    /// [`PrefixCacheConfig::DEFAULT_SNAPSHOT_BYTES`].
    pub fn for_model(
        model: &dyn LanguageModel,
        max_batched_tokens: usize,
        max_num_seqs: usize,
        max_model_len: Option<usize>,
        kv_bytes: usize,
    ) -> Self {
        let cfg = model.config();
        let max_model_len = max_model_len.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        let block_size = crate::kv::blocks::DEFAULT_BLOCK_SIZE;
        let per_token = model.kv_bytes_per_token().max(1);
        let per_seq = max_model_len.div_ceil(block_size);
        let by_memory = kv_bytes / (per_token * block_size);
        let num_blocks = (per_seq * max_num_seqs).min(by_memory).max(per_seq);
        let prefix_cache = Some(PrefixCacheConfig::for_model(
            model,
            GdnConfig::CHUNK_SIZE,
            PrefixCacheConfig::DEFAULT_SNAPSHOT_BYTES,
            num_blocks * block_size,
        ));
        EngineConfig {
            max_batched_tokens,
            max_num_seqs,
            block_size,
            num_blocks,
            max_model_len,
            prefix_cache,
            speculative: None,
        }
    }
}

/// What [`EngineConfig::check`] derives for a model.
pub(super) struct Checked {
    /// Prefill chunks end at multiples of this (the recurrent layers' chunk).
    pub align: usize,
    /// State slots kept for prefix-cache snapshots.
    pub snapshot_slots: usize,
}

impl EngineConfig {
    /// Checks the configuration against `model`: an error names the limit.
    pub(super) fn check(&self, model: &dyn LanguageModel) -> Result<Checked> {
        if self.max_batched_tokens == 0 || self.max_num_seqs == 0 || self.block_size == 0 {
            return Err(Error::Invalid(
                "max_batched_tokens, max_num_seqs and block_size must all be at least 1".into(),
            ));
        }
        let recurrent = model.config().gdn.is_some();
        let align = if recurrent { GdnConfig::CHUNK_SIZE } else { 1 };
        if self.max_batched_tokens < align {
            return Err(Error::Invalid(format!(
                "max_batched_tokens {} is below {align}, the chunk of this model's recurrent layers",
                self.max_batched_tokens
            )));
        }
        if self.speculative.is_some_and(|s| s.draft_tokens == 0) {
            return Err(Error::Invalid("speculative decoding needs at least 1 draft token".into()));
        }
        if self.speculative.is_some_and(|s| s.proposer == Proposer::Mtp) && !model.has_mtp() {
            return Err(Error::Invalid(format!(
                "MTP speculative decoding needs the model's multi-token-prediction head: load {} with it \
                 (ModelConfig::load_mtp)",
                model.config().arch.name()
            )));
        }
        let snapshot_slots = match self.prefix_cache {
            Some(p) if recurrent => {
                let every = lcm(self.block_size, align);
                if p.snapshot_interval == 0 || p.snapshot_interval % every != 0 {
                    return Err(Error::Invalid(format!(
                        "the state snapshot interval {} is not a multiple of {every} (the block size {} and the \
                         recurrent chunk {align})",
                        p.snapshot_interval, self.block_size
                    )));
                }
                p.snapshot_slots
            }
            _ => 0,
        };
        Ok(Checked { align, snapshot_slots })
    }
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

/// `req` against `cfg`'s limits and the vocabulary.
pub fn validate(req: &Request, cfg: &EngineConfig, vocab: usize) -> Result<()> {
    let n = req.prompt.len();
    if n == 0 {
        return Err(Error::Invalid("the prompt is empty".into()));
    }
    if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Invalid(format!("prompt token id {t} is out of range for a vocabulary of {vocab}")));
    }
    if let Task::Score(ids) = &req.task
        && let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab)
    {
        return Err(Error::Invalid(format!("score token id {t} is out of range for a vocabulary of {vocab}")));
    }
    let longest = if req.task == Task::Generate {
        if req.stop.max_tokens == 0 {
            return Err(Error::Invalid("max_tokens must be at least 1".into()));
        }
        if n >= cfg.max_model_len {
            return Err(Error::Invalid(format!(
                "the prompt has {n} tokens; the context holds {} (prompt and at least one new token)",
                cfg.max_model_len
            )));
        }
        (n + req.stop.max_tokens).min(cfg.max_model_len)
    } else {
        if n > cfg.max_model_len {
            return Err(Error::Invalid(format!("the input has {n} tokens; the context holds {}", cfg.max_model_len)));
        }
        n
    };
    let blocks = longest.div_ceil(cfg.block_size);
    if blocks > cfg.num_blocks {
        return Err(Error::Invalid(format!(
            "the request needs up to {longest} positions ({blocks} blocks); the KV pool holds {} blocks of {}",
            cfg.num_blocks, cfg.block_size
        )));
    }
    req.sampling.validate()
}
