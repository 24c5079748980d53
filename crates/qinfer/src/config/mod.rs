//! Model configuration, read from a Hugging Face `config.json` (classic hub keys
//! and transformers-5 keys both) or built from GGUF metadata.

mod arch;
pub mod rope;
pub mod vision;

pub use arch::{Architecture, Features, GdnProjections, MoeFeatures};

use serde_json::Value;

use crate::{Error, Result};

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention over a KV cache (sliding when the layer has a window).
    Attention,
    /// Gated DeltaNet linear attention with conv + recurrent state.
    LinearAttention,
}

/// Gated DeltaNet shape (`linear_*` keys).
#[derive(Debug, Clone, PartialEq)]
pub struct GdnConfig {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    /// Order of the value heads in every value-sized weight: false for
    /// transformers' grouped order (the `r = nv/nk` heads of key head g are
    /// g·r..g·r+r), true for llama.cpp's Qwen3.5 GGUFs, which store them tiled
    /// (value head j uses key head j mod nk) so that ggml can broadcast.
    pub v_heads_tiled: bool,
}

impl GdnConfig {
    /// Tokens per chunk of the delta rule's chunked form (the reference's
    /// `chunk_size`): a prompt split across forwards at multiples of it
    /// computes as it does in one piece.
    pub const CHUNK_SIZE: usize = 64;

    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    /// The key head that value head `v` attends with.
    pub fn k_head_of(&self, v: usize) -> usize {
        if self.v_heads_tiled { v % self.num_k_heads } else { v / (self.num_v_heads / self.num_k_heads) }
    }
    /// Channels through the depthwise conv: q, k and v concatenated.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Mixture-of-experts shape.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    /// Per-expert SwiGLU width.
    pub intermediate_size: usize,
    /// Renormalize the top-k probabilities to sum to 1.
    pub norm_topk_prob: bool,
    /// Width of the sigmoid-gated shared expert, when the layer has one.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// How RoPE pairs dimensions within a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// transformers' `rotate_half`: dimension i pairs with i + d/2.
    Neox,
    /// Adjacent pairs (2i, 2i+1): what llama.cpp uses for `llama` GGUFs, whose
    /// q/k rows the converter permuted to match.
    Interleaved,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.x frequency-dependent scaling.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub style: RopeStyle,
    pub scaling: Option<RopeScaling>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2; optional for Llama).
    pub attention_bias: bool,
    /// o_proj carries a bias (some Llama variants: `attention_bias` covers it there).
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Per layer: Some(window) where the layer attends only to the last `window` positions.
    pub layer_windows: Vec<Option<usize>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Per layer: which token mixer it uses.
    pub layer_kinds: Vec<LayerKind>,
    /// Per layer: true where the feed-forward block is a mixture of experts.
    pub moe_layers: Vec<bool>,
    pub moe: Option<MoeConfig>,
    pub gdn: Option<GdnConfig>,
    /// Leading dimensions of each head that RoPE rotates (`partial_rotary_factor`).
    pub rotary_dim: usize,
    /// Multimodal RoPE sections (Qwen3.5): where a token's three positions go.
    pub mrope: Option<vision::Mrope>,
    /// The vision tower of a multimodal checkpoint.
    pub vision: Option<vision::VisionConfig>,
    /// Multi-token-prediction layers the checkpoint declares
    /// (`mtp_num_hidden_layers`, `num_nextn_predict_layers`; 0 without).
    pub mtp_layers: usize,
    /// Load the multi-token-prediction head beside the model (speculative
    /// decoding asks for it; it costs a layer's memory, so it is off
    /// otherwise).
    pub load_mtp: bool,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    let x = get(v, key).ok_or_else(|| Error::config(key, "missing"))?;
    x.as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {x}")))
}

fn opt_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {x}"))),
    }
}

fn opt_f32(v: &Value, key: &str) -> Result<Option<f32>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_f64()
            .map(|n| Some(n as f32))
            .ok_or_else(|| Error::config(key, format!("expected a number, found {x}"))),
    }
}

fn opt_bool(v: &Value, key: &str) -> Result<Option<bool>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x.as_bool().map(Some).ok_or_else(|| Error::config(key, format!("expected a boolean, found {x}"))),
    }
}

/// Token ids given as an int or a list of ints (`eos_token_id` in both forms).
pub fn token_id_list(v: &Value, key: &str) -> Result<Vec<u32>> {
    match get(v, key) {
        None => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64().map(|n| n as u32).ok_or_else(|| Error::config(key, format!("expected token ids, found {x}")))
            })
            .collect(),
        Some(x) => x
            .as_u64()
            .map(|n| vec![n as u32])
            .ok_or_else(|| Error::config(key, format!("expected a token id, found {x}"))),
    }
}

fn parse_rope(v: &Value) -> Result<RopeConfig> {
    // transformers 5 nests theta and scaling in `rope_parameters`; hub configs
    // use `rope_theta` + `rope_scaling`.
    let params = get(v, "rope_parameters");
    let theta = params
        .map(|p| opt_f32(p, "rope_theta"))
        .transpose()?
        .flatten()
        .or(opt_f32(v, "rope_theta")?)
        .unwrap_or(10_000.0);
    let scaling_obj = get(v, "rope_scaling").or(params);
    let scaling = match scaling_obj {
        None => None,
        Some(s) => {
            let kind = get(s, "rope_type").or(get(s, "type")).and_then(|t| t.as_str()).unwrap_or("default");
            match kind {
                "default" => None,
                "llama3" => Some(RopeScaling::Llama3 {
                    factor: opt_f32(s, "factor")?.ok_or_else(|| Error::config("rope_scaling.factor", "missing"))?,
                    low_freq_factor: opt_f32(s, "low_freq_factor")?
                        .ok_or_else(|| Error::config("rope_scaling.low_freq_factor", "missing"))?,
                    high_freq_factor: opt_f32(s, "high_freq_factor")?
                        .ok_or_else(|| Error::config("rope_scaling.high_freq_factor", "missing"))?,
                    original_max_position: opt_usize(s, "original_max_position_embeddings")?
                        .ok_or_else(|| Error::config("rope_scaling.original_max_position_embeddings", "missing"))?,
                }),
                other => {
                    return Err(Error::config(
                        "rope_scaling.rope_type",
                        format!("`{other}` is not supported (supported: default, llama3)"),
                    ));
                }
            }
        }
    };
    Ok(RopeConfig { theta, style: RopeStyle::Neox, scaling })
}

/// Per layer: the token mixer and, for sliding-window attention layers, the
/// window. transformers-5 configs list `layer_types`; hybrid hub configs may say
/// `full_attention_interval` instead; Qwen2 hub configs say `use_sliding_window`
/// with the window applying to layers at index >= `max_window_layers`.
fn parse_layers(v: &Value, arch: Architecture, num_layers: usize) -> Result<Vec<(LayerKind, Option<usize>)>> {
    let window = opt_usize(v, "sliding_window")?;
    if let Some(types) = get(v, "layer_types") {
        let types = types.as_array().ok_or_else(|| Error::config("layer_types", "expected a list"))?;
        if types.len() != num_layers {
            return Err(Error::config("layer_types", format!("has {} entries for {num_layers} layers", types.len())));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok((LayerKind::Attention, None)),
                Some("sliding_attention") => window
                    .map(|w| (LayerKind::Attention, Some(w)))
                    .ok_or_else(|| Error::config("sliding_window", "missing for sliding_attention layers")),
                Some("linear_attention") if arch.features().linear_attention.is_some() => {
                    Ok((LayerKind::LinearAttention, None))
                }
                _ => Err(Error::config("layer_types", format!("unsupported layer type {t} for {}", arch.name()))),
            })
            .collect();
    }
    if arch.features().linear_attention.is_some() {
        let interval = opt_usize(v, "full_attention_interval")?.unwrap_or(4);
        if interval == 0 {
            return Err(Error::config("full_attention_interval", "must be at least 1"));
        }
        return Ok((0..num_layers)
            .map(|i| {
                let kind = if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::LinearAttention };
                (kind, None)
            })
            .collect());
    }
    let use_sliding = opt_bool(v, "use_sliding_window")?.unwrap_or(false);
    let windows = if use_sliding && arch.features().sliding_window_by_layer_index {
        let w = window.ok_or_else(|| Error::config("sliding_window", "missing while use_sliding_window is true"))?;
        let max_window_layers = opt_usize(v, "max_window_layers")?.unwrap_or(num_layers);
        (0..num_layers).map(|i| (i >= max_window_layers).then_some(w)).collect()
    } else {
        vec![None; num_layers]
    };
    Ok(windows.into_iter().map(|w| (LayerKind::Attention, w)).collect())
}

fn req_usize_any(v: &Value, keys: &[&str]) -> Result<usize> {
    for k in keys {
        if let Some(n) = opt_usize(v, k)? {
            return Ok(n);
        }
    }
    Err(Error::config(keys[0], "missing"))
}

/// Mixture-of-experts settings and which layers use them, following each
/// reference's decoder-layer rule.
fn parse_moe(v: &Value, arch: Architecture, num_layers: usize) -> Result<(Option<MoeConfig>, Vec<bool>)> {
    let sparse_rule = |num_experts: usize| -> Result<Vec<bool>> {
        let step = opt_usize(v, "decoder_sparse_step")?.unwrap_or(1);
        if step == 0 {
            return Err(Error::config("decoder_sparse_step", "must be at least 1"));
        }
        let mlp_only: Vec<usize> = match get(v, "mlp_only_layers") {
            None => vec![],
            Some(x) => serde_json::from_value(x.clone()).map_err(|_| {
                Error::config("mlp_only_layers", format!("expected a list of layer indices, found {x}"))
            })?,
        };
        Ok((0..num_layers).map(|i| !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % step == 0).collect())
    };
    let Some(features) = arch.features().moe else { return Ok((None, vec![false; num_layers])) };
    let num_experts = req_usize_any(v, &["num_experts", "num_local_experts"])?;
    let top_k = req_usize(v, "num_experts_per_tok")?;
    if top_k == 0 || top_k > num_experts {
        return Err(Error::config("num_experts_per_tok", format!("{top_k} is not in 1..={num_experts}")));
    }
    let layers = if features.every_layer_sparse { vec![true; num_layers] } else { sparse_rule(num_experts)? };
    let norm_topk_prob =
        features.always_renormalize || opt_bool(v, "norm_topk_prob")?.unwrap_or(features.renormalize_default);
    let shared_expert_intermediate_size =
        if features.shared_expert { Some(req_usize(v, "shared_expert_intermediate_size")?) } else { None };
    let moe = MoeConfig {
        num_experts,
        top_k,
        intermediate_size: req_usize(v, "moe_intermediate_size")?,
        norm_topk_prob,
        shared_expert_intermediate_size,
    };
    Ok((Some(moe), layers))
}

fn parse_gdn(v: &Value, arch: Architecture) -> Result<Option<GdnConfig>> {
    if arch.features().linear_attention.is_none() {
        return Ok(None);
    }
    let g = GdnConfig {
        num_k_heads: req_usize(v, "linear_num_key_heads")?,
        num_v_heads: req_usize(v, "linear_num_value_heads")?,
        k_head_dim: req_usize(v, "linear_key_head_dim")?,
        v_head_dim: req_usize(v, "linear_value_head_dim")?,
        conv_kernel: opt_usize(v, "linear_conv_kernel_dim")?.unwrap_or(4),
        v_heads_tiled: false,
    };
    if g.num_k_heads == 0 || !g.num_v_heads.is_multiple_of(g.num_k_heads) {
        return Err(Error::config(
            "linear_num_value_heads",
            format!("{} is not a multiple of linear_num_key_heads {}", g.num_v_heads, g.num_k_heads),
        ));
    }
    if g.conv_kernel == 0 || g.k_head_dim == 0 || g.v_head_dim == 0 {
        return Err(Error::config("linear_conv_kernel_dim", "GDN dimensions must be non-zero"));
    }
    Ok(Some(g))
}

/// Dimensions RoPE rotates: `head_dim · partial_rotary_factor` (in
/// `rope_parameters` or at top level; the hybrids default to 0.25 as transformers does).
fn parse_rotary_dim(v: &Value, arch: Architecture, head_dim: usize) -> Result<usize> {
    let factor = match get(v, "rope_parameters").map(|p| opt_f32(p, "partial_rotary_factor")).transpose()?.flatten() {
        Some(f) => Some(f),
        None => opt_f32(v, "partial_rotary_factor")?,
    };
    let factor = factor.unwrap_or(arch.features().default_partial_rotary);
    let dim = (head_dim as f64 * factor as f64) as usize;
    if dim == 0 || dim > head_dim || !dim.is_multiple_of(2) {
        return Err(Error::config(
            "partial_rotary_factor",
            format!("{factor} gives rotary dim {dim} for head_dim {head_dim}; need an even value in 2..=head_dim"),
        ));
    }
    Ok(dim)
}

impl ModelConfig {
    /// Parses a Hugging Face config.json value. `generation` (generation_config.json),
    /// when present, overrides eos/bos ids.
    pub fn from_hf_json(v: &Value, generation: Option<&Value>) -> Result<Self> {
        // Multimodal wrappers nest the text model.
        let outer = v;
        let v = get(v, "text_config").unwrap_or(v);
        let model_type =
            get(v, "model_type").and_then(|x| x.as_str()).ok_or_else(|| Error::config("model_type", "missing"))?;
        let arch = Architecture::from_model_type(model_type)?;
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_heads = req_usize(v, "num_attention_heads")?;
        let num_layers = req_usize(v, "num_hidden_layers")?;
        let num_kv_heads = opt_usize(v, "num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::config(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match opt_usize(v, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(Error::config(
                        "head_dim",
                        "missing and hidden_size is not divisible by num_attention_heads",
                    ));
                }
                hidden_size / num_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(Error::config("head_dim", format!("{head_dim} is odd; RoPE needs an even head_dim")));
        }
        let attention_bias = match arch {
            Architecture::Qwen2 => true,
            Architecture::Llama
            | Architecture::Qwen3
            | Architecture::Qwen3Moe
            | Architecture::Qwen3Next
            | Architecture::Qwen35
            | Architecture::Qwen35Moe => opt_bool(v, "attention_bias")?.unwrap_or(false),
        };
        let o_bias = match arch {
            Architecture::Qwen2 => false,
            Architecture::Llama
            | Architecture::Qwen3
            | Architecture::Qwen3Moe
            | Architecture::Qwen3Next
            | Architecture::Qwen35
            | Architecture::Qwen35Moe => attention_bias,
        };
        let layers = parse_layers(v, arch, num_layers)?;
        let (moe, moe_layers) = parse_moe(v, arch, num_layers)?;
        // All-MoE models (Qwen3.5-MoE) have no dense MLP width.
        let intermediate_size = match opt_usize(v, "intermediate_size")? {
            Some(n) => n,
            None if moe_layers.iter().all(|&m| m) => 0,
            None => return Err(Error::config("intermediate_size", "missing")),
        };
        if opt_bool(v, "mlp_bias")?.unwrap_or(false) {
            return Err(Error::config("mlp_bias", "true is not supported"));
        }
        let mut eos = token_id_list(v, "eos_token_id")?;
        let mut bos = opt_usize(v, "bos_token_id")?.map(|x| x as u32);
        if let Some(g) = generation {
            let g_eos = token_id_list(g, "eos_token_id")?;
            if !g_eos.is_empty() {
                eos = g_eos;
            }
            if let Some(b) = opt_usize(g, "bos_token_id")? {
                bos = Some(b as u32);
            }
        }
        let rotary_dim = parse_rotary_dim(v, arch, head_dim)?;
        // Qwen3.5's text rotary embedding always interleaves the sections,
        // and takes [11, 11, 10] where the config names none.
        let (mrope, vision) = match arch {
            Architecture::Qwen35 | Architecture::Qwen35Moe => {
                let m = vision::Mrope::parse(v, rotary_dim)?
                    .unwrap_or(vision::Mrope { section: [11, 11, 10], interleaved: true });
                (Some(vision::Mrope { interleaved: true, ..m }), vision::VisionConfig::parse(outer)?)
            }
            Architecture::Llama
            | Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Qwen3Moe
            | Architecture::Qwen3Next => (None, None),
        };
        Ok(ModelConfig {
            arch,
            vocab_size: req_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: opt_f32(v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope: parse_rope(v)?,
            max_position_embeddings: opt_usize(v, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            o_bias,
            qk_norm: match arch {
                Architecture::Llama | Architecture::Qwen2 => false,
                Architecture::Qwen3
                | Architecture::Qwen3Moe
                | Architecture::Qwen3Next
                | Architecture::Qwen35
                | Architecture::Qwen35Moe => true,
            },
            layer_windows: layers.iter().map(|l| l.1).collect(),
            bos_token_id: bos,
            eos_token_ids: eos,
            layer_kinds: layers.iter().map(|l| l.0).collect(),
            moe_layers,
            moe,
            gdn: parse_gdn(v, arch)?,
            rotary_dim,
            mrope,
            vision,
            mtp_layers: opt_usize(v, "mtp_num_hidden_layers")?
                .or(opt_usize(v, "num_nextn_predict_layers")?)
                .unwrap_or(0),
            load_mtp: false,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Layers with softmax attention (the ones a KV cache holds).
    pub fn num_attention_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == LayerKind::Attention).count()
    }

    /// Values one sequence's recurrent state holds over every Gated DeltaNet
    /// layer: the last `kernel - 1` conv inputs and a `[dk, dv]` matrix per
    /// value head (0 for models without such layers).
    pub fn recurrent_state_values(&self) -> usize {
        let Some(g) = &self.gdn else { return 0 };
        let linear = self.layer_kinds.iter().filter(|k| **k == LayerKind::LinearAttention).count();
        linear * (g.conv_dim() * (g.conv_kernel - 1) + g.num_v_heads * g.k_head_dim * g.v_head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type":"qwen3","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
               "num_hidden_layers":2,"intermediate_size":128,"vocab_size":256,"head_dim":32,
               "rope_theta":1000000.0,"eos_token_id":5,"tie_word_embeddings":true})
    }

    #[test]
    fn classic_and_transformers5_rope_keys_agree() {
        let a = ModelConfig::from_hf_json(&base(), None).unwrap();
        let mut v = base();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = json!({"rope_type":"default","rope_theta":1000000.0});
        let b = ModelConfig::from_hf_json(&v, None).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.rope.theta, 1e6);
        assert!(a.qk_norm);
    }

    #[test]
    fn unknown_model_type_lists_supported() {
        let mut v = base();
        v["model_type"] = json!("gpt_neox");
        let e = ModelConfig::from_hf_json(&v, None).unwrap_err().to_string();
        assert!(e.contains("gpt_neox") && e.contains("qwen3"), "{e}");
    }

    #[test]
    fn generation_config_eos_list_overrides() {
        let g = json!({"eos_token_id":[7,8]});
        let c = ModelConfig::from_hf_json(&base(), Some(&g)).unwrap();
        assert_eq!(c.eos_token_ids, vec![7, 8]);
    }

    #[test]
    fn qwen2_sliding_window_applies_from_max_window_layers() {
        let mut v = base();
        v["model_type"] = json!("qwen2");
        v["num_hidden_layers"] = json!(4);
        v["use_sliding_window"] = json!(true);
        v["sliding_window"] = json!(16);
        v["max_window_layers"] = json!(2);
        let c = ModelConfig::from_hf_json(&v, None).unwrap();
        assert_eq!(c.layer_windows, vec![None, None, Some(16), Some(16)]);
        assert!(c.attention_bias);
    }

    #[test]
    fn bad_field_types_name_the_field() {
        let mut v = base();
        v["hidden_size"] = json!("big");
        let e = ModelConfig::from_hf_json(&v, None).unwrap_err().to_string();
        assert!(e.contains("hidden_size"), "{e}");
    }
}
