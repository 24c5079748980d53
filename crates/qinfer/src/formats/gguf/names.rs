//! Tensor names: Hugging Face (`model.layers.3.self_attn.q_proj.weight`) ↔
//! llama.cpp GGUF (`blk.3.attn_q.weight`), for the dense Llama/Qwen layouts
//! and Qwen3-MoE (names from llama.cpp's gguf-py `tensor_mapping.py`).
//!
//! llama.cpp stacks experts into one tensor per projection
//! (`blk.N.ffn_gate_exps.weight`, `[E, I, H]` outermost first); that is the
//! MLX `switch_mlp` layout, which the MoE layer loads with `Tensor::narrow`.

/// Whole-model tensors.
const GLOBAL: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Per-layer tensors, without the layer prefix and the `.weight`/`.bias` suffix.
const LAYER: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    // Mixture of experts: router, stacked experts, shared expert and its gate.
    ("mlp.gate", "ffn_gate_inp"),
    ("mlp.switch_mlp.gate_proj", "ffn_gate_exps"),
    ("mlp.switch_mlp.up_proj", "ffn_up_exps"),
    ("mlp.switch_mlp.down_proj", "ffn_down_exps"),
    ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
    ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
    ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
    // Qwen3-Next / Qwen3.5: hybrid models name the post-attention norm so.
    ("post_attention_layernorm", "post_attention_norm"),
    // Gated DeltaNet (llama.cpp's converter splits Next's fused in_proj_qkvz
    // into these two, and keeps its in_proj_ba as ssm_ba).
    ("linear_attn.in_proj_qkv", "attn_qkv"),
    ("linear_attn.in_proj_z", "attn_gate"),
    ("linear_attn.in_proj_ba", "ssm_ba"),
    ("linear_attn.in_proj_b", "ssm_beta"),
    ("linear_attn.in_proj_a", "ssm_alpha"),
    ("linear_attn.conv1d", "ssm_conv1d"),
    ("linear_attn.norm", "ssm_norm"),
    ("linear_attn.out_proj", "ssm_out"),
];

/// Per-layer tensors without a `.weight`/`.bias` suffix in one of the two namings.
const LAYER_BARE: &[(&str, &str)] = &[("linear_attn.A_log", "ssm_a"), ("linear_attn.dt_bias", "ssm_dt.bias")];

const SUFFIXES: &[&str] = &["weight", "bias"];

/// Splits `{prefix}{layer}.{module}.{suffix}` into (layer, module, suffix).
fn split_layer<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let (layer, rest) = rest.split_once('.')?;
    // Reject "01" and the like so the mapping stays one-to-one.
    if layer.is_empty() || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    SUFFIXES.contains(&suffix).then_some((layer, module, suffix))
}

/// Splits `{prefix}{layer}.{rest}` into (layer, rest).
fn split_layer_bare<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let (layer, rest) = name.strip_prefix(prefix)?.split_once('.')?;
    if layer.is_empty() || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    Some((layer.parse().ok()?, rest))
}

/// The GGUF name for a Hugging Face name, or None when there is no mapping.
/// Where llama.cpp uses two names for one module (the post-attention norm),
/// this is the first; [`hf_to_gguf_all`] lists both.
pub fn hf_to_gguf(name: &str) -> Option<String> {
    hf_to_gguf_all(name).into_iter().next()
}

/// Every GGUF name a Hugging Face name may have, most common first.
pub fn hf_to_gguf_all(name: &str) -> Vec<String> {
    if let Some((_, g)) = GLOBAL.iter().find(|(h, _)| *h == name) {
        return vec![(*g).to_string()];
    }
    if let Some((layer, rest)) = split_layer_bare(name, "model.layers.")
        && let Some((_, g)) = LAYER_BARE.iter().find(|(h, _)| *h == rest)
    {
        return vec![format!("blk.{layer}.{g}")];
    }
    let Some((layer, module, suffix)) = split_layer(name, "model.layers.") else { return Vec::new() };
    LAYER.iter().filter(|(h, _)| *h == module).map(|(_, g)| format!("blk.{layer}.{g}.{suffix}")).collect()
}

/// The multi-token-prediction head's own tensors (`mtp.{name}.weight`) and
/// their llama.cpp names within the first MTP block (`blk.{N}.nextn.*`).
const NEXTN: &[(&str, &str)] = &[
    ("fc", "eh_proj"),
    ("pre_fc_norm_embedding", "enorm"),
    ("pre_fc_norm_hidden", "hnorm"),
    ("norm", "shared_head_norm"),
];

/// Every GGUF name a multi-token-prediction tensor (`mtp.*`) may have in a
/// file whose main model has `main_layers` blocks. llama.cpp's converter
/// (conversion/qwen.py `_QwenMtpMixin`) appends MTP layer i as block
/// `main_layers + i`, under the names of any other block, and puts the
/// head's projection and norms in the first of them as `nextn.*`.
pub fn mtp_to_gguf_all(name: &str, main_layers: usize) -> Vec<String> {
    if let Some(module) = name.strip_prefix("mtp.").and_then(|m| m.strip_suffix(".weight"))
        && let Some((_, g)) = NEXTN.iter().find(|(h, _)| *h == module)
    {
        return vec![format!("blk.{main_layers}.nextn.{g}.weight")];
    }
    match split_layer_bare(name, "mtp.layers.") {
        Some((i, rest)) => hf_to_gguf_all(&format!("model.layers.{}.{rest}", main_layers + i)),
        None => Vec::new(),
    }
}

/// The Hugging Face name for a GGUF name, or None when there is no mapping.
pub fn gguf_to_hf(name: &str) -> Option<String> {
    if let Some((h, _)) = GLOBAL.iter().find(|(_, g)| *g == name) {
        return Some((*h).to_string());
    }
    if let Some((layer, rest)) = split_layer_bare(name, "blk.")
        && let Some((h, _)) = LAYER_BARE.iter().find(|(_, g)| *g == rest)
    {
        return Some(format!("model.layers.{layer}.{h}"));
    }
    let (layer, module, suffix) = split_layer(name, "blk.")?;
    let (h, _) = LAYER.iter().find(|(_, g)| *g == module)?;
    Some(format!("model.layers.{layer}.{h}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_both_ways() {
        let pairs = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
            ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
            ("model.layers.12.post_attention_layernorm.weight", "blk.12.ffn_norm.weight"),
            ("model.layers.3.self_attn.q_proj.bias", "blk.3.attn_q.bias"),
            ("model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"),
            ("model.layers.3.self_attn.k_norm.weight", "blk.3.attn_k_norm.weight"),
            ("model.layers.29.mlp.down_proj.weight", "blk.29.ffn_down.weight"),
            ("model.layers.1.mlp.gate.weight", "blk.1.ffn_gate_inp.weight"),
            ("model.layers.1.mlp.switch_mlp.gate_proj.weight", "blk.1.ffn_gate_exps.weight"),
            ("model.layers.1.mlp.switch_mlp.down_proj.weight", "blk.1.ffn_down_exps.weight"),
            ("model.layers.2.mlp.shared_expert.up_proj.weight", "blk.2.ffn_up_shexp.weight"),
            ("model.layers.2.mlp.shared_expert_gate.weight", "blk.2.ffn_gate_inp_shexp.weight"),
            ("model.layers.0.linear_attn.A_log", "blk.0.ssm_a"),
            ("model.layers.0.linear_attn.dt_bias", "blk.0.ssm_dt.bias"),
            ("model.layers.0.linear_attn.in_proj_qkv.weight", "blk.0.attn_qkv.weight"),
            ("model.layers.0.linear_attn.conv1d.weight", "blk.0.ssm_conv1d.weight"),
        ];
        for (h, g) in pairs {
            assert_eq!(hf_to_gguf(h).as_deref(), Some(g), "{h}");
            assert_eq!(gguf_to_hf(g).as_deref(), Some(h), "{g}");
        }
        assert_eq!(
            hf_to_gguf_all("model.layers.1.post_attention_layernorm.weight"),
            ["blk.1.ffn_norm.weight", "blk.1.post_attention_norm.weight"]
        );
        assert_eq!(
            gguf_to_hf("blk.1.post_attention_norm.weight").unwrap(),
            "model.layers.1.post_attention_layernorm.weight"
        );
    }

    /// As llama.cpp's converter names a head after 40 main blocks.
    #[test]
    fn mtp_tensors_map_to_the_blocks_after_the_main_ones() {
        let pairs = [
            ("mtp.fc.weight", "blk.40.nextn.eh_proj.weight"),
            ("mtp.pre_fc_norm_embedding.weight", "blk.40.nextn.enorm.weight"),
            ("mtp.pre_fc_norm_hidden.weight", "blk.40.nextn.hnorm.weight"),
            ("mtp.norm.weight", "blk.40.nextn.shared_head_norm.weight"),
            ("mtp.layers.0.self_attn.q_proj.weight", "blk.40.attn_q.weight"),
            ("mtp.layers.0.input_layernorm.weight", "blk.40.attn_norm.weight"),
            ("mtp.layers.0.mlp.switch_mlp.up_proj.weight", "blk.40.ffn_up_exps.weight"),
            ("mtp.layers.1.mlp.down_proj.weight", "blk.41.ffn_down.weight"),
        ];
        for (h, g) in pairs {
            assert_eq!(mtp_to_gguf_all(h, 40).first().map(String::as_str), Some(g), "{h}");
        }
        for n in ["mtp.fc.bias", "mtp.layers.x.mlp.up_proj.weight", "mtp.unknown.weight", "model.norm.weight"] {
            assert!(mtp_to_gguf_all(n, 40).is_empty(), "{n}");
        }
    }

    #[test]
    fn unknown_names_have_no_mapping() {
        for n in [
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.01.mlp.up_proj.weight",
            "blk.0.foo.weight",
            "rope_freqs.weight",
            "model.layers.0.mlp.up_proj.scales",
        ] {
            assert!(hf_to_gguf(n).is_none() && gguf_to_hf(n).is_none(), "{n}");
        }
    }
}
