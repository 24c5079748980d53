//! The architectures qinfer runs and the features that set each apart. Config
//! parsing (HF and GGUF), the layers and the model files ask for a feature by
//! name rather than for an architecture, so a new architecture is one entry
//! here plus its model file.

use crate::{Error, Result};

/// Architectures qinfer runs. Matched exhaustively wherever behaviour differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    /// Qwen3-Next: Gated DeltaNet hybrid with fused `in_proj_qkvz` / `in_proj_ba`, MoE with a shared expert.
    Qwen3Next,
    /// Qwen3.5 dense: Gated DeltaNet hybrid with split `in_proj_qkv` / `_z` / `_b` / `_a`.
    Qwen35,
    /// Qwen3.5 MoE: the Qwen3.5 hybrid with MoE layers (top-k always renormalized) and a shared expert.
    Qwen35Moe,
}

impl Architecture {
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3, qwen3_moe, qwen3_next, qwen3_5, qwen3_5_moe";

    pub fn from_model_type(s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "qwen3_moe" => Ok(Architecture::Qwen3Moe),
            "qwen3_next" => Ok(Architecture::Qwen3Next),
            // Multimodal wrappers name the text model `*_text`.
            "qwen3_5" | "qwen3_5_text" => Ok(Architecture::Qwen35),
            "qwen3_5_moe" | "qwen3_5_moe_text" => Ok(Architecture::Qwen35Moe),
            other => {
                Err(Error::UnknownArchitecture { found: other.to_string(), supported: Self::SUPPORTED.to_string() })
            }
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen3Next => "qwen3_next",
            Architecture::Qwen35 => "qwen3_5",
            Architecture::Qwen35Moe => "qwen3_5_moe",
        }
    }
    /// What sets this architecture apart, feature by feature.
    pub fn features(self) -> Features {
        const PLAIN: Features = Features {
            unit_offset_norms: false,
            attention_output_gate: false,
            default_partial_rotary: 1.0,
            partial_rotary: false,
            linear_attention: None,
            moe: None,
            sliding_window_by_layer_index: false,
        };
        const HYBRID: Features = Features {
            unit_offset_norms: true,
            attention_output_gate: true,
            default_partial_rotary: 0.25,
            partial_rotary: true,
            linear_attention: Some(GdnProjections::Split),
            moe: None,
            sliding_window_by_layer_index: false,
        };
        match self {
            Architecture::Llama => PLAIN,
            Architecture::Qwen2 | Architecture::Qwen3 => Features { sliding_window_by_layer_index: true, ..PLAIN },
            Architecture::Qwen3Moe => Features {
                sliding_window_by_layer_index: true,
                moe: Some(MoeFeatures {
                    shared_expert: false,
                    renormalize_default: false,
                    always_renormalize: false,
                    every_layer_sparse: false,
                }),
                ..PLAIN
            },
            Architecture::Qwen3Next => Features {
                linear_attention: Some(GdnProjections::FusedPerKeyHead),
                moe: Some(MoeFeatures {
                    shared_expert: true,
                    renormalize_default: true,
                    always_renormalize: false,
                    every_layer_sparse: false,
                }),
                ..HYBRID
            },
            Architecture::Qwen35 => HYBRID,
            Architecture::Qwen35Moe => Features {
                moe: Some(MoeFeatures {
                    shared_expert: true,
                    renormalize_default: true,
                    always_renormalize: true,
                    every_layer_sparse: true,
                }),
                ..HYBRID
            },
        }
    }
}

/// What an architecture's layers do beyond the plain Llama decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Features {
    /// RMSNorms compute x̂·(1+w) (the hybrids), not x̂·w.
    pub unit_offset_norms: bool,
    /// q_proj emits a query and a sigmoid output gate per head, applied to
    /// the attention's output before o_proj.
    pub attention_output_gate: bool,
    /// `partial_rotary_factor` when the config gives none (transformers'
    /// default for the architecture).
    pub default_partial_rotary: f32,
    /// RoPE may rotate only part of each head.
    pub partial_rotary: bool,
    /// Gated DeltaNet linear-attention layers (by `layer_types` or
    /// `full_attention_interval`), and how their input projections are stored.
    pub linear_attention: Option<GdnProjections>,
    /// Sparse mixture-of-experts layers, and the router's conventions.
    pub moe: Option<MoeFeatures>,
    /// Qwen2-style `use_sliding_window` with `max_window_layers`.
    pub sliding_window_by_layer_index: bool,
}

/// How a checkpoint stores a Gated DeltaNet layer's input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdnProjections {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped per key head (or
    /// split, as llama.cpp's GGUFs of it store them).
    FusedPerKeyHead,
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
}

/// A mixture-of-experts architecture's conventions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeFeatures {
    /// A sigmoid-gated shared expert beside the routed ones.
    pub shared_expert: bool,
    /// `norm_topk_prob` when the config does not say.
    pub renormalize_default: bool,
    /// The top-k probabilities are renormalized whatever the config says.
    pub always_renormalize: bool,
    /// Every layer is sparse (no `decoder_sparse_step` / `mlp_only_layers`).
    pub every_layer_sparse: bool,
}
