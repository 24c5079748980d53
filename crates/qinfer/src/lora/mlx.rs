//! mlx-lm's adapter layout (`mlx_lm.lora` writes it): `adapter_config.json`
//! with `fine_tune_type` and `lora_parameters.scale`, and
//! `adapters.safetensors` holding `<module>.lora_a` `[in, r]` and
//! `<module>.lora_b` `[r, out]`; the update is `scale · (x·lora_a)·lora_b`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{LoraPair, layer_module, scaled};
use crate::formats::TensorSource;
use crate::formats::safetensors::SafetensorsSource;
use crate::{Error, Result};

/// `[rows, cols]` row-major, transposed.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = v[r * cols + c];
        }
    }
    t
}

pub(super) fn read(dir: &Path, config: &Value) -> Result<BTreeMap<(usize, String), LoraPair>> {
    let config_path = dir.join("adapter_config.json");
    match config.get("fine_tune_type").and_then(Value::as_str) {
        Some("lora") | None => {}
        Some(other) => {
            return Err(Error::malformed(
                &config_path,
                format!("fine_tune_type {other:?}: only LoRA adapters are supported"),
            ));
        }
    }
    let scale = config
        .get("lora_parameters")
        .and_then(|p| p.get("scale"))
        .and_then(Value::as_f64)
        .ok_or_else(|| Error::malformed(&config_path, "no number at lora_parameters.scale"))?;
    let file = dir.join("adapters.safetensors");
    let src = SafetensorsSource::open_files(std::slice::from_ref(&file))?;
    let mut modules = BTreeMap::new();
    for name in src.names() {
        let Some(module) = name.strip_suffix(".lora_a") else {
            if name.ends_with(".lora_b") {
                continue;
            }
            let what = if name.ends_with(".m") { "DoRA" } else { "a tensor that is not a lora_a/lora_b pair" };
            return Err(Error::tensor(&name, format!("in {}: {what} is not supported", file.display())));
        };
        let a = src.tensor(&name)?;
        let b_name = format!("{module}.lora_b");
        let b = src.tensor(&b_name).map_err(|_| Error::tensor(&b_name, format!("missing ({name} is present)")))?;
        let (in_dim, rank) = match a.shape[..] {
            [i, r] if r > 0 => (i, r),
            _ => {
                return Err(Error::tensor(
                    &name,
                    format!("shape {:?}, expected [in, r] (per-expert adapters are not supported)", a.shape),
                ));
            }
        };
        let out_dim = match b.shape[..] {
            [r, o] if r == rank => o,
            _ => return Err(Error::tensor(&b_name, format!("shape {:?}, expected [{rank}, out]", b.shape))),
        };
        let key = layer_module(module).ok_or_else(|| {
            Error::tensor(&name, "adapts a module outside the decoder layers, which is not supported")
        })?;
        let pair = LoraPair {
            rank,
            in_dim,
            out_dim,
            a: transpose(&a.to_f32_vec(), in_dim, rank),
            b: scaled(transpose(&b.to_f32_vec(), rank, out_dim), scale as f32),
        };
        modules.insert(key, pair);
    }
    Ok(modules)
}
