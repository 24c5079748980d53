//! What mlx-lm's conversion does to config.json and the index metadata,
//! besides the quantization block: its config reads and writes (including the
//! mutations its model-argument classes make to the dict they are given) and
//! its parameter count.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use crate::config::Architecture;
use crate::tensor::DType;
use crate::{Error, Result};

/// The dtype mlx-lm's `convert` casts to: `--dtype`, else config.json's
/// `torch_dtype`, else `text_config.dtype` (transformers 5's top-level `dtype`
/// is not read: mlx-lm does not read it either).
pub fn conversion_dtype(requested: Option<DType>, cfg: &Value) -> Option<DType> {
    if requested.is_some() {
        return requested;
    }
    let named = cfg.get("torch_dtype").filter(|v| !v.is_null()).or_else(|| cfg.get("text_config")?.get("dtype"));
    parse_dtype(named?.as_str()?).ok()
}

/// mlx-lm's `load_config` (generation_config's `eos_token_id` wins), its
/// `save_config` (`_name_or_path` and `vision_config` go: the vision tower is
/// dropped) and Qwen3.5's `TextModelArgs.__post_init__`, which renames
/// `rope_parameters.rope_type` to `type` in the dict it was built from.
pub fn finish_config(cfg: &mut Value, src: &Path, arch: Architecture) -> Result<()> {
    let gen_path = src.join("generation_config.json");
    if gen_path.exists() {
        let text = std::fs::read_to_string(&gen_path).map_err(|e| Error::io(&gen_path, e))?;
        // mlx-lm ignores a generation config it cannot parse.
        if let Ok(generation) = serde_json::from_str::<Value>(&text)
            && let Some(eos) = generation.get("eos_token_id").filter(|v| python_truthy(v))
        {
            cfg["eos_token_id"] = eos.clone();
        }
    }
    match arch {
        Architecture::Qwen35 | Architecture::Qwen35Moe => {
            let text = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut *cfg };
            if let Some(rope) = text.get_mut("rope_parameters").and_then(Value::as_object_mut)
                && !rope.contains_key("type")
                && let Some(kind) = rope.remove("rope_type")
            {
                rope.insert("type".into(), kind);
            }
        }
        Architecture::Llama
        | Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Qwen3Next => {}
    }
    if let Some(obj) = cfg.as_object_mut() {
        obj.remove("_name_or_path");
        obj.remove("vision_config");
    }
    Ok(())
}

fn python_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// mlx-lm's `get_total_parameters`: it sums over leaf modules only, so a
/// parameter held directly by a module with submodules (Gated DeltaNet's
/// `A_log` and `dt_bias`) is not counted. `tensors`: (name, logical shape).
pub fn total_parameters<'a>(tensors: impl Iterator<Item = (&'a str, &'a [usize])> + Clone) -> usize {
    // Modules that own a submodule: every proper prefix of a parameter's owner.
    let mut parents = BTreeSet::new();
    for (name, _) in tensors.clone() {
        let parts: Vec<&str> = name.split('.').collect();
        for end in 1..parts.len().saturating_sub(1) {
            parents.insert(parts[..end].join("."));
        }
    }
    tensors
        .filter(|(name, _)| name.rsplit_once('.').is_none_or(|(owner, _)| !parents.contains(owner)))
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum()
}

/// `float16`, `bfloat16` or `float32`, as mlx-lm's `--dtype` names them.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "float16" => Ok(DType::F16),
        "bfloat16" => Ok(DType::BF16),
        "float32" => Ok(DType::F32),
        other => Err(Error::Invalid(format!("unknown dtype `{other}`; expected float16, bfloat16 or float32"))),
    }
}
