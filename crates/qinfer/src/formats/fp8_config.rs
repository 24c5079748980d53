//! config.json's `quantization_config` for FP8 checkpoints: Qwen's own
//! (`quant_method: "fp8"`, E4M3 values with a `weight_scale_inv` per
//! `weight_block_size` block) and the compressed-tensors repackagings
//! (`quant_method: "compressed-tensors"`, format `float-quantized`, a
//! `weight_scale` per channel, tensor or block).
//!
//! Which matrices are FP8 is read from the weights themselves (an F8_E4M3
//! `.weight` with its scale beside it); the ignore lists only say why the
//! others are not.

use serde_json::Value;

use crate::quant::fp8::Fp8Scaling;
use crate::{Error, Result};

/// How the FP8 weights of a checkpoint are stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Config {
    /// The scalings its matrices may use (compressed-tensors' config groups
    /// may differ per module); each matrix's scale shape picks one.
    pub scalings: Vec<Fp8Scaling>,
    /// The scale tensor beside `X.weight`: `X.weight_scale_inv` (Qwen's
    /// block layout, the inverse of the quantizer's scale: dequantized =
    /// value × it) or `X.weight_scale` (compressed-tensors and per-tensor
    /// `fp8`, the same meaning).
    pub scale_suffix: &'static str,
    /// Activations quantized with scales stored beside the weights
    /// (`input_scale`) rather than per token at run time. The CPU keeps
    /// activations in f32 either way.
    pub static_activations: bool,
    /// Modules the checkpoint leaves unquantized, as listed.
    pub not_converted: Vec<String>,
}

fn str_field<'a>(v: &'a Value, key: &str, field: &str) -> Result<Option<&'a str>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(Error::config(format!("{field}.{key}"), format!("expected a string, found {other}"))),
    }
}

fn string_list(v: &Value, key: &str, field: &str) -> Result<Vec<String>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(str::to_string).ok_or_else(|| {
                    Error::config(format!("{field}.{key}"), format!("expected a list of strings, found {x}"))
                })
            })
            .collect(),
        Some(other) => Err(Error::config(format!("{field}.{key}"), format!("expected a list, found {other}"))),
    }
}

fn block_size(v: &Value, field: &str) -> Result<Fp8Scaling> {
    let bad = || Error::config(field, format!("expected two positive integers [rows, cols], found {v}"));
    let a = v.as_array().ok_or_else(bad)?;
    let dims: Vec<usize> =
        a.iter().map(|x| x.as_u64().filter(|&d| d > 0).map(|d| d as usize)).collect::<Option<_>>().ok_or_else(bad)?;
    match dims.as_slice() {
        &[rows, cols] => Ok(Fp8Scaling::Block { rows, cols }),
        _ => Err(bad()),
    }
}

impl Fp8Config {
    /// The FP8 description in `block` (config.json's `quantization_config`,
    /// found at `field`), or None when its `quant_method` is not an FP8 one.
    pub fn from_quantization_config(block: &Value, field: &str) -> Result<Option<Self>> {
        match str_field(block, "quant_method", field)? {
            Some("fp8") => Self::qwen_fp8(block, field).map(Some),
            Some("compressed-tensors") => Self::compressed_tensors(block, field).map(Some),
            _ => Ok(None),
        }
    }

    fn qwen_fp8(block: &Value, field: &str) -> Result<Self> {
        if let Some(fmt) = str_field(block, "fmt", field)?
            && fmt != "e4m3"
        {
            return Err(Error::config(
                format!("{field}.fmt"),
                format!("`{fmt}` is not supported; qinfer reads e4m3 FP8"),
            ));
        }
        if let Some(fmt) = str_field(block, "scale_fmt", field)?
            && fmt != "float"
        {
            return Err(Error::config(
                format!("{field}.scale_fmt"),
                format!("`{fmt}` is not supported; qinfer reads float (f32, f16 or bf16) scales"),
            ));
        }
        let static_activations = match str_field(block, "activation_scheme", field)? {
            None | Some("dynamic") => false,
            Some("static") => true,
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.activation_scheme"),
                    format!("`{other}` is not one of \"dynamic\", \"static\""),
                ));
            }
        };
        let (scalings, scale_suffix) = match block.get("weight_block_size") {
            None | Some(Value::Null) => (vec![Fp8Scaling::Tensor, Fp8Scaling::Channel], "weight_scale"),
            Some(v) => (vec![block_size(v, &format!("{field}.weight_block_size"))?], "weight_scale_inv"),
        };
        let mut not_converted = string_list(block, "modules_to_not_convert", field)?;
        not_converted.extend(string_list(block, "ignored_layers", field)?);
        Ok(Fp8Config { scalings, scale_suffix, static_activations, not_converted })
    }

    fn compressed_tensors(block: &Value, field: &str) -> Result<Self> {
        match str_field(block, "format", field)? {
            None | Some("float-quantized") | Some("naive-quantized") => {}
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.format"),
                    format!("`{other}` is not supported; qinfer reads compressed-tensors FP8 (\"float-quantized\")"),
                ));
            }
        }
        let groups = block
            .get("config_groups")
            .and_then(Value::as_object)
            .filter(|g| !g.is_empty())
            .ok_or_else(|| Error::config(format!("{field}.config_groups"), "missing or empty"))?;
        let mut scalings = Vec::new();
        let mut static_activations = false;
        for (name, g) in groups {
            let gf = format!("{field}.config_groups.{name}");
            let w = g
                .get("weights")
                .filter(|w| !w.is_null())
                .ok_or_else(|| Error::config(format!("{gf}.weights"), "missing"))?;
            let wf = format!("{gf}.weights");
            let bits = w.get("num_bits").and_then(Value::as_u64);
            let kind = str_field(w, "type", &wf)?;
            if bits != Some(8) || kind != Some("float") {
                return Err(Error::config(
                    wf,
                    format!(
                        "num_bits {} type {}: qinfer reads FP8 weights (num_bits 8, type \"float\")",
                        bits.map_or("missing".into(), |b| b.to_string()),
                        kind.unwrap_or("missing")
                    ),
                ));
            }
            if w.get("symmetric").and_then(Value::as_bool) == Some(false) {
                return Err(Error::config(format!("{wf}.symmetric"), "asymmetric FP8 weights are not supported"));
            }
            let scaling = match str_field(w, "strategy", &wf)? {
                Some("tensor") => Fp8Scaling::Tensor,
                Some("channel") => Fp8Scaling::Channel,
                Some("block") => match w.get("block_structure") {
                    Some(v) if !v.is_null() => block_size(v, &format!("{wf}.block_structure"))?,
                    _ => return Err(Error::config(format!("{wf}.block_structure"), "missing for strategy \"block\"")),
                },
                Some(other) => {
                    return Err(Error::config(
                        format!("{wf}.strategy"),
                        format!("`{other}` is not supported for FP8 weights (tensor, channel or block)"),
                    ));
                }
                None => return Err(Error::config(format!("{wf}.strategy"), "missing")),
            };
            if !scalings.contains(&scaling) {
                scalings.push(scaling);
            }
            if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
                static_activations |= a.get("dynamic").and_then(Value::as_bool) == Some(false);
            }
        }
        Ok(Fp8Config {
            scalings,
            scale_suffix: "weight_scale",
            static_activations,
            not_converted: string_list(block, "ignore", field)?,
        })
    }

    /// The scaling a matrix of `weight` shape with a scale of `scale` shape
    /// uses, among those this checkpoint declares.
    pub fn scaling_for(&self, weight: &[usize], scale: &[usize]) -> Option<Fp8Scaling> {
        let (&cols, outer) = weight.split_last()?;
        let (&rows, lead) = outer.split_last()?;
        let fits = |s: &Fp8Scaling| match *s {
            Fp8Scaling::Block { rows: bm, cols: bn } => {
                scale == [lead, &[rows.div_ceil(bm), cols.div_ceil(bn)]].concat()
            }
            Fp8Scaling::Channel => scale == [lead, &[rows, 1]].concat() || scale == [lead, &[rows]].concat(),
            Fp8Scaling::Tensor => {
                scale.iter().product::<usize>() == lead.iter().product::<usize>()
                    && scale.iter().skip(lead.len()).all(|&d| d == 1)
            }
        };
        // The declared order decides where shapes fit two (a one-row matrix).
        self.scalings.iter().copied().find(fits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<Fp8Config>> {
        Fp8Config::from_quantization_config(&v, "quantization_config")
    }

    #[test]
    fn reads_qwens_block_layout() {
        let c = parse(json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
            "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "mlp.gate"]}))
        .unwrap()
        .unwrap();
        assert_eq!(c.scalings, [Fp8Scaling::Block { rows: 128, cols: 128 }]);
        assert_eq!((c.scale_suffix, c.static_activations), ("weight_scale_inv", false));
        assert_eq!(c.not_converted, ["lm_head", "mlp.gate"]);
        assert_eq!(c.scaling_for(&[300, 200], &[3, 2]), Some(Fp8Scaling::Block { rows: 128, cols: 128 }));
        assert_eq!(c.scaling_for(&[4, 300, 200], &[4, 3, 2]), Some(Fp8Scaling::Block { rows: 128, cols: 128 }));
        assert_eq!(c.scaling_for(&[300, 200], &[2, 2]), None);
        assert!(parse(json!({"quant_method": "awq"})).unwrap().is_none());
    }

    #[test]
    fn reads_compressed_tensors_strategies() {
        let group = |strategy: &str, extra: Value| {
            let mut w = json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": strategy});
            w.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            json!({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": false, "strategy": "tensor"}}}})
        };
        let c = parse(group("channel", json!({}))).unwrap().unwrap();
        assert_eq!(
            (c.scalings.clone(), c.scale_suffix, c.static_activations),
            (vec![Fp8Scaling::Channel], "weight_scale", true)
        );
        assert_eq!(c.scaling_for(&[6, 4], &[6, 1]), Some(Fp8Scaling::Channel));
        let c = parse(group("tensor", json!({}))).unwrap().unwrap();
        assert_eq!(c.scaling_for(&[6, 4], &[]), Some(Fp8Scaling::Tensor));
        assert_eq!(c.scaling_for(&[6, 4], &[1]), Some(Fp8Scaling::Tensor));
        let c = parse(group("block", json!({"block_structure": [128, 128]}))).unwrap().unwrap();
        assert_eq!(c.scalings, [Fp8Scaling::Block { rows: 128, cols: 128 }]);
    }

    #[test]
    fn unsupported_values_name_their_field() {
        let err = |v: Value| parse(v).unwrap_err().to_string();
        let e = err(json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}));
        assert!(e.contains("quantization_config.fmt") && e.contains("e5m2"), "{e}");
        let e = err(json!({"quant_method": "fp8", "weight_block_size": [128]}));
        assert!(e.contains("quantization_config.weight_block_size"), "{e}");
        let e = err(json!({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}));
        assert!(e.contains("quantization_config.scale_fmt") && e.contains("ue8m0"), "{e}");
        let e = err(json!({"quant_method": "fp8", "activation_scheme": "weird"}));
        assert!(e.contains("quantization_config.activation_scheme"), "{e}");
        let e = err(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}));
        assert!(e.contains("quantization_config.format") && e.contains("pack-quantized"), "{e}");
        let e = err(json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}));
        assert!(e.contains("quantization_config.config_groups.g.weights"), "{e}");
        let e = err(json!({"quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "token"}}}}));
        assert!(e.contains("config_groups.g.weights.strategy"), "{e}");
    }
}
