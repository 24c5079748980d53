//! How an engine batches ([`EngineConfig`]), and a request checked against
//! those limits before it is queued.

use super::prefix::PrefixCacheConfig;
use super::request::{Request, Task};
use super::speculative::SpeculativeConfig;
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
