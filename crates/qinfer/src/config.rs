//! Model configuration, read from a Hugging Face `config.json` (classic hub keys
//! and transformers-5 keys both) or built from GGUF metadata.

use serde_json::Value;

use crate::{Error, Result};

/// Architectures qinfer runs. Matched exhaustively wherever behaviour differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3";

    pub fn from_model_type(s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            other => {
                Err(Error::UnknownArchitecture { found: other.to_string(), supported: Self::SUPPORTED.to_string() })
            }
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }
}

/// How RoPE pairs dimensions within a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// transformers' `rotate_half`: dimension i pairs with i + d/2.
    Neox,
    /// Adjacent pairs (2i, 2i+1): what llama.cpp uses for `llama` GGUFs, whose
    /// q/k rows the converter permuted to match.
    Interleaved,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.x frequency-dependent scaling.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub style: RopeStyle,
    pub scaling: Option<RopeScaling>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2; optional for Llama).
    pub attention_bias: bool,
    /// o_proj carries a bias (some Llama variants: `attention_bias` covers it there).
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Per layer: Some(window) where the layer attends only to the last `window` positions.
    pub layer_windows: Vec<Option<usize>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    let x = get(v, key).ok_or_else(|| Error::config(key, "missing"))?;
    x.as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {x}")))
}

fn opt_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {x}"))),
    }
}

fn opt_f32(v: &Value, key: &str) -> Result<Option<f32>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_f64()
            .map(|n| Some(n as f32))
            .ok_or_else(|| Error::config(key, format!("expected a number, found {x}"))),
    }
}

fn opt_bool(v: &Value, key: &str) -> Result<Option<bool>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x.as_bool().map(Some).ok_or_else(|| Error::config(key, format!("expected a boolean, found {x}"))),
    }
}

/// Token ids given as an int or a list of ints (`eos_token_id` in both forms).
pub fn token_id_list(v: &Value, key: &str) -> Result<Vec<u32>> {
    match get(v, key) {
        None => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64().map(|n| n as u32).ok_or_else(|| Error::config(key, format!("expected token ids, found {x}")))
            })
            .collect(),
        Some(x) => x
            .as_u64()
            .map(|n| vec![n as u32])
            .ok_or_else(|| Error::config(key, format!("expected a token id, found {x}"))),
    }
}

fn parse_rope(v: &Value) -> Result<RopeConfig> {
    // transformers 5 nests theta and scaling in `rope_parameters`; hub configs
    // use `rope_theta` + `rope_scaling`.
    let params = get(v, "rope_parameters");
    let theta = params
        .map(|p| opt_f32(p, "rope_theta"))
        .transpose()?
        .flatten()
        .or(opt_f32(v, "rope_theta")?)
        .unwrap_or(10_000.0);
    let scaling_obj = get(v, "rope_scaling").or(params);
    let scaling = match scaling_obj {
        None => None,
        Some(s) => {
            let kind = get(s, "rope_type").or(get(s, "type")).and_then(|t| t.as_str()).unwrap_or("default");
            match kind {
                "default" => None,
                "llama3" => Some(RopeScaling::Llama3 {
                    factor: opt_f32(s, "factor")?.ok_or_else(|| Error::config("rope_scaling.factor", "missing"))?,
                    low_freq_factor: opt_f32(s, "low_freq_factor")?
                        .ok_or_else(|| Error::config("rope_scaling.low_freq_factor", "missing"))?,
                    high_freq_factor: opt_f32(s, "high_freq_factor")?
                        .ok_or_else(|| Error::config("rope_scaling.high_freq_factor", "missing"))?,
                    original_max_position: opt_usize(s, "original_max_position_embeddings")?
                        .ok_or_else(|| Error::config("rope_scaling.original_max_position_embeddings", "missing"))?,
                }),
                other => {
                    return Err(Error::config(
                        "rope_scaling.rope_type",
                        format!("`{other}` is not supported (supported: default, llama3)"),
                    ));
                }
            }
        }
    };
    Ok(RopeConfig { theta, style: RopeStyle::Neox, scaling })
}

/// Which layers use sliding-window attention. transformers-5 configs list
/// `layer_types`; Qwen2 hub configs say `use_sliding_window` with the window
/// applying to layers at index >= `max_window_layers`.
fn parse_layer_windows(v: &Value, arch: Architecture, num_layers: usize) -> Result<Vec<Option<usize>>> {
    let window = opt_usize(v, "sliding_window")?;
    if let Some(types) = get(v, "layer_types") {
        let types = types.as_array().ok_or_else(|| Error::config("layer_types", "expected a list"))?;
        if types.len() != num_layers {
            return Err(Error::config("layer_types", format!("has {} entries for {num_layers} layers", types.len())));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(None),
                Some("sliding_attention") => window
                    .map(Some)
                    .ok_or_else(|| Error::config("sliding_window", "missing for sliding_attention layers")),
                _ => Err(Error::config("layer_types", format!("unsupported layer type {t}"))),
            })
            .collect();
    }
    let use_sliding = opt_bool(v, "use_sliding_window")?.unwrap_or(false);
    match arch {
        Architecture::Qwen2 | Architecture::Qwen3 if use_sliding => {
            let w =
                window.ok_or_else(|| Error::config("sliding_window", "missing while use_sliding_window is true"))?;
            let max_window_layers = opt_usize(v, "max_window_layers")?.unwrap_or(num_layers);
            Ok((0..num_layers).map(|i| (i >= max_window_layers).then_some(w)).collect())
        }
        Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3 => Ok(vec![None; num_layers]),
    }
}

impl ModelConfig {
    /// Parses a Hugging Face config.json value. `generation` (generation_config.json),
    /// when present, overrides eos/bos ids.
    pub fn from_hf_json(v: &Value, generation: Option<&Value>) -> Result<Self> {
        // Multimodal wrappers nest the text model.
        let v = get(v, "text_config").unwrap_or(v);
        let model_type =
            get(v, "model_type").and_then(|x| x.as_str()).ok_or_else(|| Error::config("model_type", "missing"))?;
        let arch = Architecture::from_model_type(model_type)?;
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_heads = req_usize(v, "num_attention_heads")?;
        let num_layers = req_usize(v, "num_hidden_layers")?;
        let num_kv_heads = opt_usize(v, "num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::config(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match opt_usize(v, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(Error::config(
                        "head_dim",
                        "missing and hidden_size is not divisible by num_attention_heads",
                    ));
                }
                hidden_size / num_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(Error::config("head_dim", format!("{head_dim} is odd; RoPE needs an even head_dim")));
        }
        let attention_bias = match arch {
            Architecture::Qwen2 => true,
            Architecture::Llama | Architecture::Qwen3 => opt_bool(v, "attention_bias")?.unwrap_or(false),
        };
        let o_bias = match arch {
            Architecture::Llama | Architecture::Qwen3 => attention_bias,
            Architecture::Qwen2 => false,
        };
        if opt_bool(v, "mlp_bias")?.unwrap_or(false) {
            return Err(Error::config("mlp_bias", "true is not supported"));
        }
        let mut eos = token_id_list(v, "eos_token_id")?;
        let mut bos = opt_usize(v, "bos_token_id")?.map(|x| x as u32);
        if let Some(g) = generation {
            let g_eos = token_id_list(g, "eos_token_id")?;
            if !g_eos.is_empty() {
                eos = g_eos;
            }
            if let Some(b) = opt_usize(g, "bos_token_id")? {
                bos = Some(b as u32);
            }
        }
        Ok(ModelConfig {
            arch,
            vocab_size: req_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(v, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: opt_f32(v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope: parse_rope(v)?,
            max_position_embeddings: opt_usize(v, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            o_bias,
            qk_norm: matches!(arch, Architecture::Qwen3),
            layer_windows: parse_layer_windows(v, arch, num_layers)?,
            bos_token_id: bos,
            eos_token_ids: eos,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type":"qwen3","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
               "num_hidden_layers":2,"intermediate_size":128,"vocab_size":256,"head_dim":32,
               "rope_theta":1000000.0,"eos_token_id":5,"tie_word_embeddings":true})
    }

    #[test]
    fn classic_and_transformers5_rope_keys_agree() {
        let a = ModelConfig::from_hf_json(&base(), None).unwrap();
        let mut v = base();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = json!({"rope_type":"default","rope_theta":1000000.0});
        let b = ModelConfig::from_hf_json(&v, None).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.rope.theta, 1e6);
        assert!(a.qk_norm);
    }

    #[test]
    fn unknown_model_type_lists_supported() {
        let mut v = base();
        v["model_type"] = json!("gpt_neox");
        let e = ModelConfig::from_hf_json(&v, None).unwrap_err().to_string();
        assert!(e.contains("gpt_neox") && e.contains("qwen3"), "{e}");
    }

    #[test]
    fn generation_config_eos_list_overrides() {
        let g = json!({"eos_token_id":[7,8]});
        let c = ModelConfig::from_hf_json(&base(), Some(&g)).unwrap();
        assert_eq!(c.eos_token_ids, vec![7, 8]);
    }

    #[test]
    fn qwen2_sliding_window_applies_from_max_window_layers() {
        let mut v = base();
        v["model_type"] = json!("qwen2");
        v["num_hidden_layers"] = json!(4);
        v["use_sliding_window"] = json!(true);
        v["sliding_window"] = json!(16);
        v["max_window_layers"] = json!(2);
        let c = ModelConfig::from_hf_json(&v, None).unwrap();
        assert_eq!(c.layer_windows, vec![None, None, Some(16), Some(16)]);
        assert!(c.attention_bias);
    }

    #[test]
    fn bad_field_types_name_the_field() {
        let mut v = base();
        v["hidden_size"] = json!("big");
        let e = ModelConfig::from_hf_json(&v, None).unwrap_err().to_string();
        assert!(e.contains("hidden_size"), "{e}");
    }
}
