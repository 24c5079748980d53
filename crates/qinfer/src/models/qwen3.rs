//! Qwen3 (transformers' `Qwen3ForCausalLM`): Llama's layers with a per-head
//! RMSNorm on queries and keys before RoPE, and a head dimension independent
//! of hidden size / heads.

use super::llama;
use super::spec::ModelSpec;

pub const SPEC: ModelSpec = ModelSpec { reference: "Qwen3ForCausalLM", ..llama::SPEC };
