//! MLX checkpoints (what mlx-lm writes): safetensors with affine-quantized
//! matrices stored as `<module>.weight` (packed u32), `<module>.scales` and
//! `<module>.biases`, described by config.json's `quantization` block:
//! `{group_size, bits, mode}` plus per-module entries keyed by module path
//! (`"model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}`) or `false`.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::quant::affine::AffineParams;
use crate::{Error, Result};

/// One module's entry in the `quantization` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleQuantization {
    Affine(AffineParams),
    /// `false`: the module is stored unquantized.
    Unquantized,
}

#[derive(Debug, Clone, PartialEq)]
pub struct QuantizationConfig {
    /// The block's top-level parameters (what modules without an entry were
    /// quantized with at conversion time).
    pub default: AffineParams,
    pub modules: BTreeMap<String, ModuleQuantization>,
}

fn params(v: &Value, field: &str) -> Result<AffineParams> {
    let mode = match v.get("mode") {
        None | Some(Value::Null) => "affine",
        Some(m) => {
            m.as_str().ok_or_else(|| Error::config(format!("{field}.mode"), format!("expected a string, found {m}")))?
        }
    };
    if mode != "affine" {
        return Err(Error::config(
            format!("{field}.mode"),
            format!("`{mode}` is not supported; qinfer reads MLX affine quantization (mode \"affine\")"),
        ));
    }
    let int = |key: &str| -> Result<u64> {
        let x = v.get(key).ok_or_else(|| Error::config(format!("{field}.{key}"), "missing"))?;
        x.as_u64().ok_or_else(|| Error::config(format!("{field}.{key}"), format!("expected an integer, found {x}")))
    };
    AffineParams::new(int("bits")? as u32, int("group_size")? as usize, field)
}

impl QuantizationConfig {
    /// The `quantization` block of an MLX config.json (or mlx-lm's copy under
    /// `quantization_config`, possibly inside `text_config`). None when the
    /// model is not quantized; an error for quantization schemes qinfer does not read.
    pub fn from_config_json(v: &Value) -> Result<Option<Self>> {
        let text = v.get("text_config");
        let found = [("quantization", Some(v)), ("quantization_config", Some(v)), ("quantization_config", text)]
            .into_iter()
            .find_map(|(key, root)| root?.get(key).filter(|b| !b.is_null()).map(|b| (key, b)));
        let Some((field, block)) = found else { return Ok(None) };
        let obj =
            block.as_object().ok_or_else(|| Error::config(field, format!("expected an object, found {block}")))?;
        if let Some(method) = obj.get("quant_method") {
            return Err(Error::config(
                format!("{field}.quant_method"),
                format!(
                    "{method} is not supported; qinfer reads MLX affine quantization and FP8 (\"fp8\", \"compressed-tensors\")"
                ),
            ));
        }
        let default = params(block, field)?;
        let mut modules = BTreeMap::new();
        for (key, entry) in obj {
            let q = match entry {
                Value::Object(_) => ModuleQuantization::Affine(params(entry, &format!("{field}.{key}"))?),
                Value::Bool(false) => ModuleQuantization::Unquantized,
                // `true` means "quantize with the defaults", as mlx-lm's class predicate reads it.
                Value::Bool(true) => ModuleQuantization::Affine(default),
                _ => continue, // group_size, bits, mode and other scalars
            };
            modules.insert(key.clone(), q);
        }
        Ok(Some(QuantizationConfig { default, modules }))
    }

    /// What the block says about `module` (a weight name without `.weight`):
    /// its own entry when it has one, else None (mlx-lm then infers the
    /// parameters from the stored shapes).
    pub fn module(&self, module: &str) -> Option<ModuleQuantization> {
        self.modules.get(module).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_defaults_and_overrides() {
        let v = json!({"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
            "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}, "lm_head": false}});
        let q = QuantizationConfig::from_config_json(&v).unwrap().unwrap();
        assert_eq!(q.default, AffineParams { bits: 4, group_size: 64 });
        assert_eq!(
            q.module("model.layers.0.mlp.gate"),
            Some(ModuleQuantization::Affine(AffineParams { bits: 8, group_size: 64 }))
        );
        assert_eq!(q.module("lm_head"), Some(ModuleQuantization::Unquantized));
        assert_eq!(q.module("model.layers.1.mlp.gate"), None);
    }

    #[test]
    fn unsupported_schemes_name_the_field() {
        let err = |v: Value| QuantizationConfig::from_config_json(&v).unwrap_err().to_string();
        let e = err(json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}));
        assert!(e.contains("quantization.mode") && e.contains("mxfp4"), "{e}");
        let e = err(json!({"quantization": {"group_size": 64, "bits": 7}}));
        assert!(e.contains("quantization.bits"), "{e}");
        let e = err(json!({"quantization": {"group_size": 48, "bits": 4}}));
        assert!(e.contains("quantization.group_size"), "{e}");
        let e = err(json!({"quantization": {"group_size": 64, "bits": 4, "x.q_proj": {"group_size": 64, "bits": 9}}}));
        assert!(e.contains("quantization.x.q_proj.bits"), "{e}");
        let e = err(json!({"quantization_config": {"quant_method": "gptq", "bits": 4}}));
        assert!(e.contains("quantization_config.quant_method"), "{e}");
        assert!(QuantizationConfig::from_config_json(&json!({"model_type": "qwen3"})).unwrap().is_none());
    }
}
