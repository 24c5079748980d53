//! A Hugging Face model directory: `config.json` (with its `quantization`
//! block for MLX checkpoints), `generation_config.json` when present, and the
//! safetensors weights, single or sharded.

use std::path::Path;

use serde_json::Value;

use super::fp8_config::Fp8Config;
use super::mlx::QuantizationConfig;
use super::safetensors::SafetensorsSource;
use crate::config::ModelConfig;
use crate::{Error, Result};

pub struct HfDirectory {
    pub config: ModelConfig,
    /// `config.json` as written.
    pub config_json: Value,
    /// `generation_config.json`, when the directory has one.
    pub generation_json: Option<Value>,
    pub source: SafetensorsSource,
}

/// A JSON file, with errors naming it.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::malformed(path, format!("invalid JSON: {e}")))
}

/// The FP8 `quantization_config` (top level, or inside `text_config` as
/// multimodal checkpoints put it), when the checkpoint has one.
fn fp8_config(v: &Value) -> Result<Option<Fp8Config>> {
    let text = v.get("text_config");
    for (root, field) in [(Some(v), "quantization_config"), (text, "text_config.quantization_config")] {
        if let Some(block) = root.and_then(|r| r.get("quantization_config")).filter(|b| !b.is_null()) {
            return Fp8Config::from_quantization_config(block, field);
        }
    }
    Ok(None)
}

impl HfDirectory {
    /// Reads the configuration and maps the weights of the directory `path`;
    /// an unknown architecture or a malformed file is an error naming the file.
    pub fn open(path: &Path) -> Result<HfDirectory> {
        let cfg_path = path.join("config.json");
        let config_json = read_json(&cfg_path)?;
        let gen_path = path.join("generation_config.json");
        let generation_json = if gen_path.exists() { Some(read_json(&gen_path)?) } else { None };
        let config = ModelConfig::from_hf_json(&config_json, generation_json.as_ref())
            .map_err(|e| Error::malformed(&cfg_path, e.to_string()))?;
        let mut source = SafetensorsSource::open_dir(path)?;
        let bad = |e: Error| Error::malformed(&cfg_path, e.to_string());
        let fp8 = fp8_config(&config_json).map_err(bad)?;
        if fp8.is_none() {
            source.set_quantization(QuantizationConfig::from_config_json(&config_json).map_err(bad)?);
        }
        source.set_fp8(fp8);
        Ok(HfDirectory { config, config_json, generation_json, source })
    }
}
