//! mlx-lm's `sanitize`, per architecture: how Hugging Face tensor names and
//! layouts become the ones an mlx-lm model loads, and so the ones
//! `mlx_lm.convert` saves. Each function ports the mlx-lm method it names,
//! quirks included (an output that differs from mlx-lm's is a bug here).
//!
//! Nothing is read: the plan records where each output tensor comes from, and
//! [`Planned::materialize`] builds it when the writer gets to it, so stacking
//! the experts of a large model never holds more than one tensor in memory.

use std::collections::BTreeMap;

use crate::config::{Architecture, ModelConfig};
use crate::formats::TensorSource;
use crate::tensor::{Bytes, DType, Tensor};
use crate::{Error, Result};

/// How one output tensor is made from source tensors.
#[derive(Debug, Clone)]
pub enum Origin {
    Copy(String),
    /// Experts `[rows, cols]` stacked along a new leading axis (`mx.stack`).
    Stack(Vec<String>),
    /// The first or second half of a fused `[…, 2I, H]` tensor's rows
    /// (`gate_up[..., :mid, :]` / `[..., mid:, :]`).
    RowHalf {
        name: String,
        second: bool,
    },
    /// A 1-D norm weight plus one, rounded in its own dtype (`v + 1.0` on a
    /// bf16 array is a bf16 add in mlx).
    PlusOne(String),
    /// conv1d `[C, 1, K]` → `[C, K, 1]` (`v.moveaxis(2, 1)`).
    SwapLastAxes(String),
}

#[derive(Debug, Clone)]
pub struct Planned {
    pub name: String,
    pub origin: Origin,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Planned {
    fn copy(src: &dyn TensorSource, name: &str) -> Result<Self> {
        let t = src.tensor(name)?;
        Ok(Planned { name: name.to_string(), origin: Origin::Copy(name.to_string()), dtype: t.dtype, shape: t.shape })
    }

    fn source_name(&self) -> &str {
        match &self.origin {
            Origin::Copy(n) | Origin::RowHalf { name: n, .. } | Origin::PlusOne(n) | Origin::SwapLastAxes(n) => n,
            Origin::Stack(parts) => &parts[0],
        }
    }

    /// The tensor's values in its source dtype.
    pub fn materialize(&self, src: &dyn TensorSource) -> Result<Tensor> {
        let bytes = match &self.origin {
            Origin::Copy(n) => return Ok(Tensor { name: self.name.clone(), ..src.tensor(n)? }),
            Origin::Stack(parts) => {
                let mut out = Vec::new();
                for p in parts {
                    out.extend_from_slice(src.tensor(p)?.data.as_slice());
                }
                out
            }
            Origin::RowHalf { name, second } => {
                let t = src.tensor(name)?;
                let slab = t.data.len() / leading(&t.shape, 2);
                let half = slab / 2;
                let skip = if *second { half } else { 0 };
                t.data.as_slice().chunks_exact(slab).flat_map(|s| &s[skip..skip + half]).copied().collect()
            }
            Origin::PlusOne(n) => {
                let t = src.tensor(n)?;
                let values: Vec<f32> = t.to_f32_vec().iter().map(|v| v + 1.0).collect();
                super::encode::encode(&values, t.dtype)
            }
            Origin::SwapLastAxes(n) => {
                let t = src.tensor(n)?;
                let (a, b) = (t.shape[1], t.shape[2]);
                let es = t.data.len() / t.numel();
                let s = t.data.as_slice();
                let mut out = Vec::with_capacity(s.len());
                for slab in s.chunks_exact(a * b * es) {
                    for j in 0..b {
                        for i in 0..a {
                            out.extend_from_slice(&slab[(i * b + j) * es..][..es]);
                        }
                    }
                }
                out
            }
        };
        Tensor::new(self.name.clone(), self.dtype, self.shape.clone(), Bytes::from_vec(bytes))
    }
}

/// Product of all but the last `inner` dimensions.
fn leading(shape: &[usize], inner: usize) -> usize {
    shape[..shape.len().saturating_sub(inner)].iter().product()
}

type Plan = BTreeMap<String, Planned>;

/// The tensors `mlx_lm.convert` would save for this model, before
/// quantization and the dtype cast, keyed by their MLX names.
pub fn plan(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Plan> {
    let mut w = Plan::new();
    for name in src.names() {
        w.insert(name.clone(), Planned::copy(src, &name)?);
    }
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    match cfg.arch {
        // llama.py / qwen2.py: precomputed rotary tables are dropped; qwen3.py keeps all.
        Architecture::Llama | Architecture::Qwen2 => {
            w.retain(|k, _| !k.contains("self_attn.rotary_emb.inv_freq"));
            drop_tied_head(&mut w, cfg, "lm_head.weight");
        }
        Architecture::Qwen3 => drop_tied_head(&mut w, cfg, "lm_head.weight"),
        // qwen3_moe.py `Model.sanitize`.
        Architecture::Qwen3Moe => {
            drop_tied_head(&mut w, cfg, "lm_head.weight");
            stack_experts(&mut w, "model.layers.", experts)?;
        }
        // qwen3_next.py `Model.sanitize`: a checkpoint without expert layers is
        // returned untouched (no mtp filter, no norm shift, conv kept as is).
        Architecture::Qwen3Next => {
            if moe_layers(&w, "model.layers.").is_empty() {
                return Ok(w);
            }
            w.retain(|k, _| !k.contains("mtp."));
            drop_tied_head(&mut w, cfg, "lm_head.weight");
            stack_experts(&mut w, "model.layers.", experts)?;
            shift_norms_and_conv(&mut w, true)?;
        }
        // qwen3_5.py `Model.sanitize` → `TextModel.sanitize`.
        Architecture::Qwen35 => {
            w = to_language_model(w);
            text_model_sanitize(&mut w, cfg)?;
        }
        // qwen3_5_moe.py `Model.sanitize`: fused experts split, then as Qwen3.5.
        Architecture::Qwen35Moe => {
            w = to_language_model(w);
            split_fused_experts(&mut w, cfg.num_layers)?;
            text_model_sanitize(&mut w, cfg)?;
        }
    }
    Ok(w)
}

fn drop_tied_head(w: &mut Plan, cfg: &ModelConfig, head: &str) {
    if cfg.tie_word_embeddings {
        w.remove(head);
    }
}

/// Layers with per-expert weights (`….mlp.experts.0.up_proj.weight`), sorted.
fn moe_layers(w: &Plan, prefix: &str) -> Vec<usize> {
    let mut layers: Vec<usize> = w
        .keys()
        .filter_map(|k| k.strip_prefix(prefix)?.strip_suffix(".mlp.experts.0.up_proj.weight")?.parse().ok())
        .collect();
    layers.sort_unstable();
    layers
}

/// `experts.{e}.{n}_proj.weight` for e in 0..num_experts → `switch_mlp.{n}_proj.weight` `[E, rows, cols]`.
fn stack_experts(w: &mut Plan, prefix: &str, num_experts: usize) -> Result<()> {
    for l in moe_layers(w, prefix) {
        for n in ["up_proj", "down_proj", "gate_proj"] {
            let mut parts = Vec::with_capacity(num_experts);
            for e in 0..num_experts {
                let key = format!("{prefix}{l}.mlp.experts.{e}.{n}.weight");
                let p = w.remove(&key).ok_or_else(|| Error::tensor(&key, "missing: needed to stack the experts"))?;
                if let Some(first) = parts.first().map(|f: &Planned| (f.dtype, &f.shape))
                    && (p.dtype, &p.shape) != first
                {
                    return Err(Error::tensor(&key, format!("{:?} differs from expert 0's {:?}", p.shape, first.1)));
                }
                parts.push(p);
            }
            let Some(first) = parts.first() else { continue };
            let name = format!("{prefix}{l}.mlp.switch_mlp.{n}.weight");
            let mut shape = vec![num_experts];
            shape.extend_from_slice(&first.shape);
            let dtype = first.dtype;
            let origin = Origin::Stack(parts.iter().map(|p| p.source_name().to_string()).collect());
            w.insert(name.clone(), Planned { name, origin, dtype, shape });
        }
    }
    Ok(())
}

/// Qwen3.5's wrapper: vision tower dropped, text weights under `language_model.`.
fn to_language_model(w: Plan) -> Plan {
    w.into_values()
        .filter(|p| !(p.name.starts_with("vision_tower") || p.name.starts_with("model.visual")))
        .map(|mut p| {
            p.name = if p.name.starts_with("model.language_model") {
                p.name.replace("model.language_model", "language_model.model")
            } else if p.name.starts_with("language_model.") {
                p.name
            } else {
                format!("language_model.{}", p.name)
            };
            (p.name.clone(), p)
        })
        .collect()
}

/// `experts.gate_up_proj` `[E, 2I, H]` → `switch_mlp.{gate,up}_proj.weight`;
/// `experts.down_proj` → `switch_mlp.down_proj.weight`.
fn split_fused_experts(w: &mut Plan, num_layers: usize) -> Result<()> {
    for l in 0..num_layers {
        let prefix = format!("language_model.model.layers.{l}.mlp");
        let Some(gate_up) = w.remove(&format!("{prefix}.experts.gate_up_proj")) else { continue };
        if gate_up.shape.len() < 2 || gate_up.shape[gate_up.shape.len() - 2] % 2 != 0 {
            return Err(Error::tensor(
                gate_up.source_name(),
                format!("cannot split {:?} into gate and up", gate_up.shape),
            ));
        }
        let mut shape = gate_up.shape.clone();
        let rows = shape.len() - 2;
        shape[rows] /= 2;
        for (n, second) in [("gate_proj", false), ("up_proj", true)] {
            let name = format!("{prefix}.switch_mlp.{n}.weight");
            let origin = Origin::RowHalf { name: gate_up.source_name().to_string(), second };
            w.insert(name.clone(), Planned { name, origin, dtype: gate_up.dtype, shape: shape.clone() });
        }
        let down_key = format!("{prefix}.experts.down_proj");
        let mut down =
            w.remove(&down_key).ok_or_else(|| Error::tensor(&down_key, "missing beside experts.gate_up_proj"))?;
        down.name = format!("{prefix}.switch_mlp.down_proj.weight");
        w.insert(down.name.clone(), down);
    }
    Ok(())
}

/// qwen3_5.py `TextModel.sanitize`. Its tied-head pop looks for the bare
/// `lm_head.weight`, which the wrapper has already renamed, so it never fires.
fn text_model_sanitize(w: &mut Plan, cfg: &ModelConfig) -> Result<()> {
    let unsanitized_conv = w.values().any(|p| p.name.contains("conv1d.weight") && p.shape.last() != Some(&1));
    w.retain(|k, _| !k.contains("mtp."));
    drop_tied_head(w, cfg, "lm_head.weight");
    shift_norms_and_conv(w, unsanitized_conv)
}

/// The x̂·(1+w) norms stored as 1+w, the conv kernel moved to MLX's layout.
fn shift_norms_and_conv(w: &mut Plan, shift_norms: bool) -> Result<()> {
    const NORMS: [&str; 5] = [
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    ];
    for p in w.values_mut() {
        let src = p.source_name().to_string();
        if p.name.contains("conv1d.weight") && p.shape.last() != Some(&1) {
            let Origin::Copy(_) = p.origin else {
                return Err(Error::tensor(&src, "conv1d weight built from several tensors"));
            };
            if p.shape.len() != 3 {
                return Err(Error::tensor(&src, format!("expected a [C, 1, K] conv1d kernel, found {:?}", p.shape)));
            }
            p.shape.swap(1, 2);
            p.origin = Origin::SwapLastAxes(src);
        } else if shift_norms && p.shape.len() == 1 && NORMS.iter().any(|s| p.name.ends_with(s)) {
            p.origin = Origin::PlusOne(src);
        }
    }
    Ok(())
}
