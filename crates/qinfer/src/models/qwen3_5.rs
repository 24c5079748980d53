//! Qwen3.5, dense and MoE (transformers' `Qwen3_5ForConditionalGeneration`
//! and `Qwen3_5MoeForConditionalGeneration`, text part): Qwen3-Next's hybrid
//! with the GDN input projections split (`in_proj_qkv`, `_z`, `_b`, `_a`); the
//! MoE variant routes every layer and always renormalizes the top-k.
//! Hub checkpoints are multimodal: the text model sits under
//! `model.language_model.` (mlx-lm's conversions: `language_model.model.`),
//! beside a vision tower (`model.visual.*`, [`super::vision`]).

use super::qwen3_next;
use super::spec::{ModelSpec, TEXT_MODEL, TextRoot, all_dense};

const LAYOUTS: &[TextRoot] = &[
    TextRoot { root: "model.language_model.", lm_head: "lm_head.weight" },
    TextRoot { root: "language_model.model.", lm_head: "language_model.lm_head.weight" },
    TEXT_MODEL,
];

const UNUSED: &[(&str, &str)] = &[
    ("vision_tower.", "an MLX conversion's vision tower: images need the Hugging Face checkpoint"),
    ("mtp.", "the multi-token-prediction head, loaded only for MTP speculative decoding"),
];

pub const SPEC: ModelSpec = ModelSpec {
    reference: "Qwen3_5ForConditionalGeneration",
    text_roots: LAYOUTS,
    unused: UNUSED,
    feed_forward: all_dense,
};

pub const SPEC_MOE: ModelSpec = ModelSpec {
    reference: "Qwen3_5MoeForConditionalGeneration",
    text_roots: LAYOUTS,
    unused: UNUSED,
    ..qwen3_next::SPEC
};
