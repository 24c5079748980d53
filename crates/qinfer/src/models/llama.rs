//! Llama (transformers' `LlamaForCausalLM`): pre-norm decoder layers of
//! grouped-query softmax attention with RoPE (llama3 frequency scaling where
//! configured) and a SwiGLU MLP; embeddings tied or not. The base every other
//! model file extends.

use super::spec::{BARE_MODEL, ModelSpec, TEXT_MODEL, all_dense};

pub const SPEC: ModelSpec = ModelSpec {
    reference: "LlamaForCausalLM",
    text_roots: &[BARE_MODEL, TEXT_MODEL],
    unused: &[],
    feed_forward: all_dense,
};
