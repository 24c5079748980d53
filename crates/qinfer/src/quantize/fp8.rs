//! `qinfer quantize --format fp8`: a Hugging Face bf16/f16/f32 model → the
//! block-FP8 checkpoint Qwen publishes (and transformers' FP8 quantizer
//! writes): E4M3 weights with an f32 `weight_scale_inv` per block and
//! `quantization_config` `{"quant_method": "fp8", "fmt": "e4m3",
//! "weight_block_size": [bm, bn], "activation_scheme": "dynamic",
//! "modules_to_not_convert": […]}`.
//!
//! Quantized: every 2-D `.weight` of a linear layer of the decoder (and MTP)
//! layers and the fused expert stacks (`experts.gate_up_proj`,
//! `experts.down_proj`), with rows and columns divisible by the block, as
//! transformers' `Fp8Quantize` requires; values as it computes them
//! ([`quantize_blocks`]). Kept as stored: embeddings, `lm_head`, norms, MoE
//! routers, shared-expert gates, Gated DeltaNet's `in_proj_a/b/ba`, conv1d,
//! the vision tower, and matrices the block does not divide. Tensor names and
//! everything else are copied unchanged.

use std::path::Path;

use rayon::prelude::*;
use serde_json::json;

use super::writer::{Entry, SafetensorsWriter, write_model_dir};
use crate::formats::TensorSource;
use crate::formats::hf_dir::HfDirectory;
use crate::quant::fp8::quantize_blocks;
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct Fp8QuantizeOptions {
    /// `weight_block_size`: rows and columns per scale.
    pub block: [usize; 2],
    /// Replace an existing output directory.
    pub force: bool,
}

/// Module-name parts of the matrices the recipe leaves unquantized.
const KEPT: [&str; 13] = [
    "embed_tokens",
    "lm_head",
    "norm",
    "mlp.gate.weight",
    "shared_expert_gate",
    "in_proj_a.",
    "in_proj_b.",
    "in_proj_ba.",
    "conv1d",
    "visual.",
    "A_log",
    "dt_bias",
    "mtp.fc.",
];

/// Whether the recipe quantizes `name` of `shape` with blocks `[bm, bn]`.
fn quantized(name: &str, shape: &[usize], [bm, bn]: [usize; 2]) -> bool {
    if KEPT.iter().any(|k| name.contains(k)) {
        return false;
    }
    let kind = (name.ends_with(".weight") && shape.len() == 2)
        || (shape.len() == 3 && (name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj")));
    kind && shape[shape.len() - 2].is_multiple_of(bm) && shape[shape.len() - 1].is_multiple_of(bn)
}

/// The scale tensor's name beside `name` (transformers' naming).
fn scale_name(name: &str) -> String {
    match name.strip_suffix(".weight") {
        Some(module) => format!("{module}.weight_scale_inv"),
        None => format!("{name}_scale_inv"),
    }
}

fn st_dtype(d: DType, name: &str) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("F32"),
        DType::F16 => Ok("F16"),
        DType::BF16 => Ok("BF16"),
        other => Err(Error::tensor(name, format!("{} input cannot be quantized to FP8", other.name()))),
    }
}

/// Quantizes the model in `src` into a new directory `out`. `progress` is
/// called with (tensors done, total).
pub fn quantize_fp8(src: &Path, out: &Path, opts: &Fp8QuantizeOptions, progress: &dyn Fn(usize, usize)) -> Result<()> {
    let [bm, bn] = opts.block;
    if bm == 0 || bn == 0 {
        return Err(Error::config("--block-size", "rows and columns must be positive"));
    }
    if out.exists() && !opts.force {
        return Err(Error::Invalid(format!("{} exists; pass --force to replace it", out.display())));
    }
    if !src.is_dir() {
        return Err(Error::Invalid(format!(
            "{}: quantize reads a Hugging Face model directory (config.json and safetensors)",
            src.display()
        )));
    }
    let model = HfDirectory::open(src)?;
    let root_quant = model.config_json.get("quantization_config").or_else(|| model.config_json.get("quantization"));
    if root_quant.is_some_and(|q| !q.is_null()) {
        return Err(Error::Invalid(format!(
            "{} is already quantized (config.json has a quantization block)",
            src.display()
        )));
    }
    let mut names = model.source.names();
    names.sort();
    let mut plan = Vec::new();
    let mut not_converted = std::collections::BTreeSet::new();
    for name in &names {
        let t = model.source.raw_tensor(name)?;
        let q = quantized(name, &t.shape, opts.block);
        st_dtype(t.dtype, name)?;
        if !q
            && t.shape.len() >= 2
            && let Some(module) = name.strip_suffix(".weight")
        {
            not_converted.insert(module.to_string());
        }
        plan.push((name.clone(), t.shape.clone(), t.dtype, q));
    }
    let mut entries = Vec::new();
    for (name, shape, dtype, q) in &plan {
        let n: usize = shape.iter().product();
        if *q {
            entries.push(Entry { name: name.clone(), dtype: "F8_E4M3", shape: shape.clone(), len: n });
            let mut s = shape.clone();
            let k = s.len();
            s[k - 2] /= bm;
            s[k - 1] /= bn;
            let len = 4 * s.iter().product::<usize>();
            entries.push(Entry { name: scale_name(name), dtype: "F32", shape: s, len });
        } else {
            let len = dtype.bytes_for(n).ok_or_else(|| Error::tensor(name, "size overflow"))?;
            entries.push(Entry { name: name.clone(), dtype: st_dtype(*dtype, name)?, shape: shape.clone(), len });
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let mut cfg = model.config_json.clone();
    cfg["quantization_config"] = json!({
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [bm, bn],
        "modules_to_not_convert": not_converted.into_iter().collect::<Vec<_>>(),
    });

    write_model_dir(out, src, &cfg, |dir| write(dir, entries, &plan, &model.source, opts.block, progress))
}

type Planned = (String, Vec<usize>, DType, bool);

fn write(
    dir: &Path,
    entries: Vec<Entry>,
    plan: &[Planned],
    source: &dyn TensorSource,
    block: [usize; 2],
    progress: &dyn Fn(usize, usize),
) -> Result<()> {
    // Produce in the file's (sorted) order.
    let order: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let mut st = SafetensorsWriter::create(&dir.join("model.safetensors"), entries.clone(), "pt")?;
    let by_name: std::collections::HashMap<&str, &Planned> = plan.iter().map(|p| (p.0.as_str(), p)).collect();
    let mut pending: std::collections::HashMap<String, Vec<u8>> = std::collections::HashMap::new();
    let mut done = 0;
    for name in order {
        if let Some(bytes) = pending.remove(name) {
            st.write(name, &bytes)?;
            continue;
        }
        let (_, _, _, q) = by_name.get(name).ok_or_else(|| Error::tensor(name, "not planned"))?;
        let t = source.raw_tensor(name)?;
        if !q {
            st.write(name, t.data.as_slice())?;
        } else {
            let (values, scales) = quantize_tensor(&t, block);
            st.write(name, &values)?;
            pending.insert(scale_name(name), scales.iter().flat_map(|s| s.to_le_bytes()).collect());
        }
        done += 1;
        progress(done, plan.len());
    }
    st.finish()
}

/// One stored matrix (or stack of them) in E4M3 and its block scales.
fn quantize_tensor(t: &Tensor, [bm, bn]: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    let k = t.shape.len();
    let (rows, cols) = (t.shape[k - 2], t.shape[k - 1]);
    let w = t.to_f32_vec();
    let parts: Vec<(Vec<u8>, Vec<f32>)> =
        w.par_chunks(rows * cols).map(|m| quantize_blocks(m, rows, cols, bm, bn)).collect();
    let mut values = Vec::with_capacity(w.len());
    let mut scales = Vec::new();
    for (v, s) in parts {
        values.extend(v);
        scales.extend(s);
    }
    (values, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipe_picks_linear_layers_that_divide() {
        let b = [32, 32];
        assert!(quantized("model.layers.0.self_attn.q_proj.weight", &[128, 64], b));
        assert!(quantized("model.layers.0.mlp.experts.gate_up_proj", &[8, 64, 64], b));
        assert!(quantized("mtp.layers.0.mlp.down_proj.weight", &[64, 96], b));
        assert!(!quantized("model.layers.0.self_attn.q_proj.weight", &[128, 48], b));
        assert!(!quantized("model.embed_tokens.weight", &[256, 64], b));
        assert!(!quantized("lm_head.weight", &[256, 64], b));
        assert!(!quantized("model.layers.0.mlp.gate.weight", &[8, 64], b));
        assert!(!quantized("model.layers.0.mlp.shared_expert_gate.weight", &[1, 64], b));
        assert!(!quantized("model.layers.0.linear_attn.in_proj_ba.weight", &[8, 64], b));
        assert!(!quantized("model.layers.0.input_layernorm.weight", &[64], b));
        assert!(!quantized("model.visual.blocks.0.attn.qkv.weight", &[96, 32], b));
        assert_eq!(scale_name("a.q_proj.weight"), "a.q_proj.weight_scale_inv");
        assert_eq!(scale_name("a.experts.down_proj"), "a.experts.down_proj_scale_inv");
    }
}
