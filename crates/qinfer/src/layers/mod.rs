//! Building blocks that model files compose: each loads its weights by
//! Hugging Face name and runs on any [`crate::backend::Backend`] through its ops.

pub mod attention;
pub mod block;
pub mod gdn;
pub mod lora;
pub mod mlp;
pub mod moe;
