//! PEFT's adapter layout: `adapter_config.json` and
//! `adapter_model.safetensors` holding `<module>.lora_A.weight` `[r, in]`
//! and `<module>.lora_B.weight` `[out, r]`; the update is
//! `scaling · B·A·x` with `scaling = alpha / r` (`alpha / √r` with
//! `use_rslora`), `r` and `alpha` per module through `rank_pattern` and
//! `alpha_pattern`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{LoraPair, layer_module, scaled};
use crate::formats::TensorSource;
use crate::formats::safetensors::SafetensorsSource;
use crate::{Error, Result};

/// Config fields naming variants that are more than a low-rank update of
/// the projections, each refused with its name when set.
const REFUSED: &[(&str, &str)] = &[
    ("use_dora", "DoRA (weight-decomposed LoRA)"),
    ("lora_bias", "a bias on lora_B"),
    ("use_qalora", "QA-LoRA"),
    ("layer_replication", "layer replication"),
    ("trainable_token_indices", "trainable token embeddings"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA)"),
    ("target_parameters", "LoRA on parameters (fused expert tensors)"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights"),
];

pub(super) fn read(dir: &Path, config: &Value) -> Result<BTreeMap<(usize, String), LoraPair>> {
    let config_path = dir.join("adapter_config.json");
    let bad = |what: String| Err(Error::malformed(&config_path, what));
    match config.get("peft_type").and_then(Value::as_str) {
        Some("LORA") | None => {}
        Some(other) => return bad(format!("peft_type {other:?}: only LORA adapters are supported")),
    }
    for (field, what) in REFUSED {
        let set = match config.get(*field) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
        };
        if set {
            return bad(format!("`{field}`: {what} is not supported"));
        }
    }
    match config.get("bias").and_then(Value::as_str) {
        None | Some("none") => {}
        Some(b) => return bad(format!("`bias: {b:?}`: adapters that train biases are not supported")),
    }
    if let Some(m) = config.get("modules_to_save").and_then(Value::as_array).filter(|m| !m.is_empty()) {
        return bad(format!("`modules_to_save` {m:?}: adapters that replace whole modules are not supported"));
    }
    let number = |v: &Value, field: &str| -> Result<f64> {
        v.as_f64().ok_or_else(|| Error::malformed(&config_path, format!("`{field}` is not a number")))
    };
    let alpha = number(config.get("lora_alpha").unwrap_or(&Value::from(8)), "lora_alpha")?;
    let rslora = config.get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    let mut alpha_pattern = Vec::new();
    if let Some(Value::Object(p)) = config.get("alpha_pattern") {
        for (key, v) in p {
            let re = regex::Regex::new(&format!(r"^(.*\.)?({key})$"))
                .map_err(|e| Error::malformed(&config_path, format!("alpha_pattern key {key:?}: {e}")))?;
            alpha_pattern.push((re, number(v, &format!("alpha_pattern.{key}"))?));
        }
    }

    let file = dir.join("adapter_model.safetensors");
    let src = SafetensorsSource::open_files(std::slice::from_ref(&file))?;
    let mut modules = BTreeMap::new();
    let mut names = src.names();
    names.sort();
    for name in &names {
        let Some(module) = name.strip_suffix(".lora_A.weight") else {
            if name.ends_with(".lora_B.weight") {
                continue;
            }
            let what = if name.contains("lora_embedding") {
                "LoRA on the embeddings"
            } else if name.contains("lora_magnitude_vector") {
                "DoRA"
            } else {
                "a tensor that is not a lora_A/lora_B pair"
            };
            return Err(Error::tensor(name, format!("in {}: {what} is not supported", file.display())));
        };
        let a = src.tensor(name)?;
        let b_name = format!("{module}.lora_B.weight");
        let b = src.tensor(&b_name).map_err(|_| Error::tensor(&b_name, format!("missing ({name} is present)")))?;
        let (rank, in_dim) = match a.shape[..] {
            [r, i] => (r, i),
            _ => return Err(Error::tensor(name, format!("shape {:?}, expected [r, in]", a.shape))),
        };
        let out_dim = match b.shape[..] {
            [o, r] if r == rank => o,
            _ => return Err(Error::tensor(&b_name, format!("shape {:?}, expected [out, {rank}]", b.shape))),
        };
        if rank == 0 {
            return Err(Error::tensor(name, "rank 0"));
        }
        let Some(key) = layer_module(module) else {
            return Err(Error::tensor(
                name,
                "adapts a module outside the decoder layers (embeddings, head, vision tower or MTP head), which is not supported",
            ));
        };
        let plain = module.strip_prefix("base_model.model.").unwrap_or(module);
        let alpha = alpha_pattern.iter().find(|(re, _)| re.is_match(plain)).map_or(alpha, |(_, a)| *a);
        let scale = if rslora { alpha / (rank as f64).sqrt() } else { alpha / rank as f64 };
        let pair = LoraPair { rank, in_dim, out_dim, a: a.to_f32_vec(), b: scaled(b.to_f32_vec(), scale as f32) };
        modules.insert(key, pair);
    }
    Ok(modules)
}
