//! LoRA adapters as they are published: PEFT's directory
//! (`adapter_config.json` + `adapter_model.safetensors`) and mlx-lm's
//! (`adapter_config.json` + `adapters.safetensors`). Read into one host form:
//! per decoder layer and projection, `A` `[r, in]` and `B` `[out, r]` with
//! the adapter's scaling folded into `B`, so that a projection computes
//! `y = W·x + B·(A·x)`. The model places these beside its base weights; it
//! never rewrites them.

mod mlx;
mod peft;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// A loaded adapter's number within one model; never reused after an
/// adapter is removed, so prefix-cache blocks of a removed adapter never
/// serve a new one.
pub type AdapterId = u64;

/// One projection's low-rank update.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPair {
    pub rank: usize,
    pub in_dim: usize,
    pub out_dim: usize,
    /// `[rank, in_dim]`, row-major.
    pub a: Vec<f32>,
    /// `[out_dim, rank]`, row-major, times the adapter's scaling.
    pub b: Vec<f32>,
}

/// An adapter read from its files.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    pub path: PathBuf,
    /// Keyed by decoder layer and projection path inside it
    /// (`self_attn.q_proj`, `mlp.down_proj`, `linear_attn.in_proj_qkvz`, …).
    pub modules: BTreeMap<(usize, String), LoraPair>,
}

impl LoraAdapter {
    /// Reads the adapter in `path`: a directory in PEFT's or mlx-lm's
    /// layout. Variants that change more than a low-rank update of the
    /// projections are refused by name.
    pub fn load(path: &Path) -> Result<Self> {
        let config_path = path.join("adapter_config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::malformed(&config_path, format!("not JSON: {e}")))?;
        let modules = if path.join("adapter_model.safetensors").exists() {
            peft::read(path, &config)?
        } else if path.join("adapters.safetensors").exists() {
            mlx::read(path, &config)?
        } else if path.join("adapter_model.bin").exists() {
            return Err(Error::malformed(
                path,
                "adapter_model.bin (a pickle) is not read; save the adapter with safe_serialization=True",
            ));
        } else {
            return Err(Error::malformed(path, "no adapter_model.safetensors (PEFT) or adapters.safetensors (mlx-lm)"));
        };
        if modules.is_empty() {
            return Err(Error::malformed(path, "the adapter holds no LoRA weights"));
        }
        Ok(LoraAdapter { path: path.to_path_buf(), modules })
    }
}

/// The decoder layer and the projection path of a module name, which may
/// carry the wrapper prefixes of PEFT (`base_model.model.`) and of the
/// multimodal checkpoints (`model.language_model.`). None for a module
/// outside the decoder layers (the vision tower, the MTP head, the
/// embeddings, the head).
fn layer_module(name: &str) -> Option<(usize, String)> {
    let name = name.strip_prefix("base_model.model.").unwrap_or(name);
    let rest = ["model.language_model.layers.", "language_model.model.layers.", "model.layers.", "layers."]
        .iter()
        .find_map(|p| name.strip_prefix(p))?;
    let (layer, module) = rest.split_once('.')?;
    Some((layer.parse().ok()?, module.to_string()))
}

/// `B` scaled: PEFT's `lora_alpha / r` (or `/ √r` with rsLoRA), mlx-lm's `scale`.
fn scaled(mut b: Vec<f32>, scale: f32) -> Vec<f32> {
    b.iter_mut().for_each(|v| *v *= scale);
    b
}

#[cfg(test)]
mod tests {
    use super::layer_module;

    #[test]
    fn module_names_lose_their_wrappers() {
        let want = Some((3, "self_attn.q_proj".to_string()));
        assert_eq!(layer_module("base_model.model.model.layers.3.self_attn.q_proj"), want);
        assert_eq!(layer_module("base_model.model.model.language_model.layers.3.self_attn.q_proj"), want);
        assert_eq!(layer_module("model.layers.3.self_attn.q_proj"), want);
        assert_eq!(layer_module("base_model.model.model.visual.blocks.0.attn.qkv"), None);
        assert_eq!(layer_module("base_model.model.mtp.layers.0.self_attn.q_proj"), None);
        assert_eq!(layer_module("base_model.model.lm_head"), None);
    }
}
