//! Gated DeltaNet metadata of GGUF files (`{arch}.ssm.*`, recurrent layers),
//! as llama.cpp's converter writes it for qwen3next, qwen35 and qwen35moe.

use super::meta::Meta;
use super::value::{GgufArray, GgufValue};
use crate::config::{Architecture, GdnConfig, LayerKind};
use crate::{Error, Result};

/// The GDN shape, or None for architectures without linear attention.
/// `ssm.group_count` = key heads, `ssm.time_step_rank` = value heads,
/// `ssm.state_size` = key head dim, `ssm.inner_size` = value heads × value head dim.
pub(super) fn gdn(m: &Meta, arch: Architecture) -> Result<Option<GdnConfig>> {
    if arch.features().linear_attention.is_none() {
        return Ok(None);
    }
    let num_k_heads = m.req_usize(&m.key("ssm.group_count"))?;
    let num_v_heads = m.req_usize(&m.key("ssm.time_step_rank"))?;
    let inner = m.req_usize(&m.key("ssm.inner_size"))?;
    if num_k_heads == 0 || num_v_heads == 0 || !num_v_heads.is_multiple_of(num_k_heads) {
        return Err(Error::config(
            m.key("ssm.time_step_rank"),
            format!("{num_v_heads} value heads are not a multiple of ssm.group_count {num_k_heads}"),
        ));
    }
    if !inner.is_multiple_of(num_v_heads) {
        return Err(Error::config(
            m.key("ssm.inner_size"),
            format!("{inner} is not a multiple of {num_v_heads} heads"),
        ));
    }
    let g = GdnConfig {
        num_k_heads,
        num_v_heads,
        k_head_dim: m.req_usize(&m.key("ssm.state_size"))?,
        v_head_dim: inner / num_v_heads,
        conv_kernel: m.req_usize(&m.key("ssm.conv_kernel"))?,
        // convert_hf_to_gguf.py's `_LinearAttentionVReorderBase` (Qwen3.5 only).
        v_heads_tiled: matches!(arch, Architecture::Qwen35 | Architecture::Qwen35Moe),
    };
    if g.k_head_dim == 0 || g.v_head_dim == 0 || g.conv_kernel == 0 {
        return Err(Error::config(m.key("ssm.state_size"), "GDN dimensions must be non-zero"));
    }
    Ok(Some(g))
}

/// Which layers are linear attention: `attention.recurrent_layers` (one bool
/// per block) when present, else every `full_attention_interval`-th layer is
/// softmax attention.
pub(super) fn layer_kinds(m: &Meta, arch: Architecture, num_layers: usize) -> Result<Vec<LayerKind>> {
    if arch.features().linear_attention.is_none() {
        return Ok(vec![LayerKind::Attention; num_layers]);
    }
    let key = m.key("attention.recurrent_layers");
    if let Some(v) = m.get(&key) {
        let flags = match v {
            GgufValue::Array(GgufArray::Bool(b)) => b,
            _ => return Err(Error::config(&key, format!("expected an array of bools, found {v}"))),
        };
        if flags.len() < num_layers {
            return Err(Error::config(&key, format!("{} entries for {num_layers} layers", flags.len())));
        }
        let kind = |r: bool| if r { LayerKind::LinearAttention } else { LayerKind::Attention };
        return Ok(flags[..num_layers].iter().map(|&r| kind(r)).collect());
    }
    let interval = m.opt_usize(&m.key("full_attention_interval"))?.unwrap_or(4);
    if interval == 0 {
        return Err(Error::config(m.key("full_attention_interval"), "must be at least 1"));
    }
    Ok((0..num_layers)
        .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::LinearAttention })
        .collect())
}
