//! llama.cpp's converter changes some Qwen3-Next / Qwen3.5 weights on the way
//! into GGUF (`Qwen3NextModel.modify_tensors` in convert_hf_to_gguf.py); the
//! model code follows transformers, so the reader undoes each change here:
//!
//! - `A_log` is stored as `ssm_a` = −exp(A_log): read back as ln(−ssm_a);
//! - RMSNorm weights other than the gated GDN norm (the MTP head's among
//!   them) are stored as 1 + w (the multiplier itself): read back as
//!   stored − 1, exact for stored values in [0.5, 2] (Sterbenz), within an
//!   f32 rounding elsewhere;
//! - Next's `in_proj_qkvz` is split into `attn_qkv` + `attn_gate`, which are
//!   Qwen3.5's `in_proj_qkv` + `in_proj_z` (the layer takes the split form);
//!   its `in_proj_ba` (per key head: r rows of b, then r of a) stays fused as
//!   `ssm_ba` and is read as `in_proj_b` / `in_proj_a` by gathering rows;
//! - Qwen3.5 files store value heads tiled rather than grouped by key head
//!   (`_LinearAttentionVReorderBase`) in every value-sized weight alike: not
//!   undone (that would copy matrices) but declared in `GdnConfig::v_heads_tiled`.
//!
//! All copies are vectors or the small `[2·nv, hidden]` beta/alpha rows.

use super::file::GgufFile;
use crate::formats::TensorSource;
use crate::tensor::{Bytes, Tensor};
use crate::{Error, Result};

/// GGUF architectures whose tensors went through the converter's hybrid transforms.
pub(super) fn is_hybrid(arch: Option<&str>) -> bool {
    matches!(arch, Some("qwen3next" | "qwen35" | "qwen35moe"))
}

/// The HF-semantics version of `t`, loaded under the HF name `name`.
pub(super) fn undo_transform(name: &str, t: Tensor) -> Result<Tensor> {
    if name.ends_with(".A_log") {
        let v: Vec<f32> = t.to_f32_vec().iter().map(|a| (-a).ln()).collect();
        if let Some(bad) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::tensor(name, format!("ssm_a[{bad}] must be negative (it stores −exp(A_log))")));
        }
        return Tensor::from_f32(name, t.shape.clone(), &v);
    }
    if stored_as_one_plus(name) {
        let v: Vec<f32> = t.to_f32_vec().iter().map(|w| w - 1.0).collect();
        return Tensor::from_f32(name, t.shape.clone(), &v);
    }
    Ok(t)
}

/// Whether the converter stored the RMSNorm weight `name` (a Hugging Face
/// name) as 1 + w: every name ending in `norm.weight` as the converter sees
/// it, except the gated GDN norm. It sees the MTP head's input norms
/// renamed first (`mtp.pre_fc_norm_embedding` → `enorm`, `…_hidden` →
/// `hnorm`), so they are among them.
fn stored_as_one_plus(name: &str) -> bool {
    (name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight"))
        || matches!(name, "mtp.pre_fc_norm_embedding.weight" | "mtp.pre_fc_norm_hidden.weight")
}

/// For `…in_proj_b.weight` / `…in_proj_a.weight` in a file that has the fused
/// `…in_proj_ba.weight` instead (Qwen3-Next): the fused name and 0 (b) or 1 (a).
pub(super) fn fused_beta_alpha(file: &GgufFile, name: &str) -> Option<(String, usize)> {
    let (prefix, which) = if let Some(p) = name.strip_suffix(".in_proj_b.weight") {
        (p, 0)
    } else {
        (name.strip_suffix(".in_proj_a.weight")?, 1)
    };
    let fused = format!("{prefix}.in_proj_ba.weight");
    file.resolve(&fused).is_some().then_some((fused, which))
}

/// `in_proj_b` / `in_proj_a` of a Qwen3-Next file, gathered from its fused `ssm_ba`.
pub(super) fn split_beta_alpha(file: &GgufFile, name: &str) -> Result<Tensor> {
    let (fused_name, which) =
        fused_beta_alpha(file, name).ok_or_else(|| Error::tensor(name, "no fused ssm_ba to split"))?;
    let ba = file.tensor(&fused_name)?;
    let key = |k: &str| format!("{}.ssm.{k}", file.architecture().unwrap_or_default());
    let meta = |k: &str| {
        file.metadata()
            .get(&key(k))
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| Error::config(key(k), "missing from GGUF metadata (needed to split ssm_ba)"))
    };
    let (nk, nv) = (meta("group_count")?, meta("time_step_rank")?);
    if nk == 0 || !nv.is_multiple_of(nk) || ba.shape.len() != 2 || ba.shape[0] != 2 * nv {
        return Err(Error::tensor(&fused_name, format!("{:?} is not [2·{nv}, hidden] in {nk} groups", ba.shape)));
    }
    let r = nv / nk;
    let rb = ba.dtype.bytes_for(ba.shape[1]).ok_or_else(|| Error::tensor(&fused_name, "size overflow"))?;
    let src = ba.data.as_slice();
    let mut out = Vec::with_capacity(nv * rb);
    for g in 0..nk {
        let first = g * 2 * r + which * r;
        out.extend_from_slice(&src[first * rb..(first + r) * rb]);
    }
    Tensor::new(name.to_string(), ba.dtype, vec![nv, ba.shape[1]], Bytes::from_vec(out))
}
