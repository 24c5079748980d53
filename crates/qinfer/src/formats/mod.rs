//! File formats: each turns files into named [`Tensor`]s (Hugging Face names)
//! plus configuration.

pub mod fp8_config;
pub mod gguf;
pub mod hf_dir;
pub mod mlx;
pub mod safetensors;

use crate::Result;
use crate::quant::affine::AffineParts;
use crate::quant::fp8::Fp8Tensor;
use crate::tensor::Tensor;

/// Weights by Hugging Face tensor name (`model.layers.0.self_attn.q_proj.weight`).
/// Formats with other naming (GGUF) translate on lookup.
pub trait TensorSource: Send + Sync {
    /// The tensor, or an error naming it when absent or malformed.
    fn tensor(&self, name: &str) -> Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    /// All names in this source's own naming, for `inspect`.
    fn names(&self) -> Vec<String>;
    /// The stored tensor under its own (file) name, for `inspect`.
    fn raw_tensor(&self, name: &str) -> Result<Tensor>;
    /// The weight `name` (`….weight`) when it is stored affine-quantized
    /// (MLX: `….scales` and `….biases` beside it); None when stored plainly.
    fn affine_parts(&self, _name: &str) -> Result<Option<AffineParts>> {
        Ok(None)
    }
    /// The weight `name` when it is stored as FP8 with its scales (see
    /// [`crate::quant::fp8`]); None when stored otherwise.
    fn fp8(&self, _name: &str) -> Result<Option<Fp8Tensor>> {
        Ok(None)
    }
}
