//! What a model file declares: where its text weights live in the
//! checkpoints people download, what else those checkpoints carry that qinfer
//! does not run, and its layer plan. The shared decoder ([`super::decoder`])
//! builds any of them; config keys and feature flags are
//! [`crate::config::Features`], which config parsing below this layer reads.

use crate::config::ModelConfig;
use crate::formats::TensorSource;

/// Where a checkpoint layout keeps the text model: the prefix of its
/// decoder's tensors (`{root}embed_tokens.weight`, `{root}layers.N.…`) and
/// the name of its output head.
#[derive(Debug, Clone, Copy)]
pub struct TextRoot {
    pub root: &'static str,
    pub lm_head: &'static str,
}

/// Transformers' text checkpoints (and GGUFs, whose names read as these).
pub const TEXT_MODEL: TextRoot = TextRoot { root: "model.", lm_head: "lm_head.weight" };

/// The base model saved alone (transformers' `Qwen3Model`, as
/// sentence-transformers writes embedding checkpoints such as
/// Qwen3-Embedding): no prefix, and no head unless tied.
pub const BARE_MODEL: TextRoot = TextRoot { root: "", lm_head: "lm_head.weight" };

/// The feed-forward block of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedForwardKind {
    /// SwiGLU MLP.
    Dense,
    /// Routed experts (with a shared expert where the architecture has one).
    Sparse,
}

pub struct ModelSpec {
    /// The transformers class the model file follows.
    pub reference: &'static str,
    /// Layouts to probe in order, by their embedding's name; the last is the
    /// default (and the one random weights take).
    pub text_roots: &'static [TextRoot],
    /// Tensors of checkpoints of this architecture that belong to parts qinfer
    /// does not run: a name prefix and what they are, said once at load.
    pub unused: &'static [(&'static str, &'static str)],
    /// The feed-forward block of layer `l` (the token mixer follows
    /// `ModelConfig::layer_kinds`).
    pub feed_forward: fn(&ModelConfig, usize) -> FeedForwardKind,
}

impl ModelSpec {
    /// The layout `src` uses.
    pub fn text_root(&self, src: &dyn TensorSource) -> TextRoot {
        let last = *self.text_roots.last().expect("every model declares a layout");
        self.text_roots
            .iter()
            .copied()
            .find(|r| src.contains(&format!("{}embed_tokens.weight", r.root)))
            .unwrap_or(last)
    }

    /// Says once which tensors of `src` stay unused.
    pub fn note_unused(&self, src: &dyn TensorSource) {
        let names = src.names();
        for (prefix, what) in self.unused {
            let n = names.iter().filter(|n| n.starts_with(prefix)).count();
            if n > 0 {
                tracing::info!("ignoring {n} tensors of {what} ({prefix}*)");
            }
        }
    }
}

/// Every layer dense.
pub fn all_dense(_: &ModelConfig, _: usize) -> FeedForwardKind {
    FeedForwardKind::Dense
}

/// Sparse where the config's MoE layer rule says so.
pub fn sparse_where_configured(cfg: &ModelConfig, l: usize) -> FeedForwardKind {
    match (&cfg.moe, cfg.moe_layers.get(l)) {
        (Some(_), Some(true)) => FeedForwardKind::Sparse,
        _ => FeedForwardKind::Dense,
    }
}
