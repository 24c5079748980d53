//! Qwen2 / Qwen2.5 (transformers' `Qwen2ForCausalLM`): Llama's layers with
//! biases on the q, k and v projections (`attention_bias`), and sliding-window
//! attention on the layers the config names (`use_sliding_window` with
//! `max_window_layers`, or `layer_types`).

use super::llama;
use super::spec::ModelSpec;

pub const SPEC: ModelSpec = ModelSpec { reference: "Qwen2ForCausalLM", ..llama::SPEC };
