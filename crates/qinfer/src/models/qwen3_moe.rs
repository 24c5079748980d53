//! Qwen3-MoE (transformers' `Qwen3MoeForCausalLM`): Qwen3's attention with a
//! sparse mixture of experts in place of the MLP (softmax router in f32,
//! top-k, optionally renormalized), dense MLPs on the layers
//! `mlp_only_layers` / `decoder_sparse_step` leave out. Experts load from
//! per-expert, fused or stacked (MLX `switch_mlp`) tensors.

use super::qwen3;
use super::spec::{ModelSpec, sparse_where_configured};

pub const SPEC: ModelSpec =
    ModelSpec { reference: "Qwen3MoeForCausalLM", feed_forward: sparse_where_configured, ..qwen3::SPEC };
