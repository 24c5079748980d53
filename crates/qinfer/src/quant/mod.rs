//! Quantized storage, independent of where it is computed: MLX's affine
//! groups, ggml's blocks and K-quant super-blocks (decoding them to f32, and
//! rewriting them as affine groups), and mlx-lm's mixed-precision recipes.

pub mod affine;
pub mod dtype;
pub mod e4m3;
pub mod fp8;
pub mod ggml;
pub mod gguf_affine;
pub mod kquants;
pub mod recipe;
pub mod turbo;
