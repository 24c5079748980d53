//! A Hugging Face model directory: `config.json` (with its `quantization`
//! block for MLX checkpoints), `generation_config.json` when present, and the
//! safetensors weights, single or sharded.

use std::path::Path;

use serde_json::Value;

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
        source.set_quantization(
            QuantizationConfig::from_config_json(&config_json)
                .map_err(|e| Error::malformed(&cfg_path, e.to_string()))?,
        );
        Ok(HfDirectory { config, config_json, generation_json, source })
    }
}
