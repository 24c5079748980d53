//! Qwen3-Next (transformers' `Qwen3NextForCausalLM`): a hybrid of Gated
//! DeltaNet linear-attention layers and gated softmax attention (an output
//! gate per head from q_proj, partial RoPE), x̂·(1+w) RMSNorms, and sparse
//! experts with a sigmoid-gated shared expert. Its checkpoints fuse the GDN
//! input projections per key head (`in_proj_qkvz`, `in_proj_ba`). The
//! multi-token-prediction head (`mtp.*`) is loaded for MTP speculative
//! decoding only (`ModelConfig::load_mtp`).

use super::spec::{ModelSpec, TEXT_MODEL, sparse_where_configured};

pub const SPEC: ModelSpec = ModelSpec {
    reference: "Qwen3NextForCausalLM",
    text_roots: &[TEXT_MODEL],
    unused: &[("mtp.", "the multi-token-prediction head, loaded only for MTP speculative decoding")],
    feed_forward: sparse_where_configured,
};
