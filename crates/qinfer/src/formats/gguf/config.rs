//! GGUF metadata (`{arch}.block_count`, …) → [`ModelConfig`], following the keys
//! llama.cpp's converter writes for llama, qwen2, qwen3, qwen3moe, qwen3next,
//! qwen35 and qwen35moe (experts: `moe_meta`; linear attention: `gdn_meta`).

use super::file::GgufFile;
use super::meta::Meta;
use crate::config::{Architecture, ModelConfig, RopeConfig, RopeScaling, RopeStyle};
use crate::formats::TensorSource;
use crate::tensor::DType;
use crate::{Error, Result};

fn vocab_size(m: &Meta) -> Result<usize> {
    if let Some(n) = m.opt_usize(&m.key("vocab_size"))? {
        return Ok(n);
    }
    if let Some(tokens) = m.get("tokenizer.ggml.tokens") {
        return tokens
            .as_array()
            .map(|a| a.len())
            .ok_or_else(|| Error::config("tokenizer.ggml.tokens", "expected an array of strings"));
    }
    // The embedding is [vocab, hidden] outermost first.
    m.file
        .tensor_info("token_embd.weight")
        .and_then(|t| t.shape.first().copied())
        .ok_or_else(|| Error::config(m.key("vocab_size"), "missing, and no tokenizer.ggml.tokens or token_embd.weight"))
}

/// llama.cpp stores Llama 3 RoPE scaling as per-frequency divisors in a
/// `rope_freqs.weight` tensor instead of metadata. Recover the Llama 3
/// parameters by checking the factors against the published recipe.
fn scaling_from_rope_freqs(m: &Meta, theta: f32, head_dim: usize) -> Result<Option<RopeScaling>> {
    const NAME: &str = "rope_freqs.weight";
    let Some(info) = m.file.tensor_info(NAME) else { return Ok(None) };
    let t = m.file.raw_tensor(NAME)?;
    if t.dtype != DType::F32 || info.shape.iter().product::<usize>() != head_dim / 2 {
        return Err(Error::tensor(
            NAME,
            format!("expected {} F32 values, found {} {:?}", head_dim / 2, info.type_name, info.shape),
        ));
    }
    let factors: Vec<f32> =
        t.data.as_slice().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if factors.iter().all(|&f| f == 1.0) {
        return Ok(None);
    }
    let factor = factors.iter().copied().fold(f32::MIN, f32::max);
    // Meta's recipe for Llama 3.1/3.2; the converter writes these defaults.
    let (low, high, original) = (1.0f64, 4.0f64, 8192usize);
    let low_wavelen = original as f64 / low;
    let high_wavelen = original as f64 / high;
    let matches = factors.iter().enumerate().all(|(i, &f)| {
        let freq = 1.0 / (theta as f64).powf((2 * i) as f64 / head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let expect = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor as f64
        } else {
            let smooth = (original as f64 / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor as f64 + smooth)
        };
        ((f as f64) - expect).abs() <= 1e-3 * expect.abs().max(1.0)
    });
    if !matches {
        return Err(Error::tensor(NAME, "per-frequency RoPE factors that are not Llama 3 scaling are not supported"));
    }
    Ok(Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low as f32,
        high_freq_factor: high as f32,
        original_max_position: original,
    }))
}

/// RoPE settings and the number of rotated dimensions per head.
fn rope(m: &Meta, arch: Architecture, head_dim: usize) -> Result<(RopeConfig, usize)> {
    let theta = m.opt_f32(&m.key("rope.freq_base"))?.unwrap_or(10_000.0);
    let rotary_dim = m.opt_usize(&m.key("rope.dimension_count"))?.unwrap_or(head_dim);
    // Partial rotary is a feature of the hybrid models (Qwen3-Next/3.5). Their
    // `rope.dimension_sections` (multimodal RoPE) give every section the same
    // position for text, which is plain RoPE over `rotary_dim`.
    if rotary_dim != head_dim
        && (!arch.features().partial_rotary || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2))
    {
        return Err(Error::config(
            m.key("rope.dimension_count"),
            format!("partial rotary ({rotary_dim} of {head_dim} head dims) is not supported for {}", m.arch),
        ));
    }
    let scaling_key = m.key("rope.scaling.type");
    let scaling = match m.get(&scaling_key).map(|v| v.as_str()) {
        None | Some(Some("none")) => scaling_from_rope_freqs(m, theta, head_dim)?,
        Some(Some(other)) => {
            return Err(Error::config(
                scaling_key,
                format!("RoPE scaling `{other}` is not supported (supported: none)"),
            ));
        }
        Some(None) => return Err(Error::config(scaling_key, "expected a string")),
    };
    // llama.cpp's converter permutes llama q/k rows so RoPE rotates adjacent
    // pairs; qwen GGUFs keep the Hugging Face (rotate_half) layout.
    let style = match arch {
        Architecture::Llama => RopeStyle::Interleaved,
        Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Qwen3Next
        | Architecture::Qwen35
        | Architecture::Qwen35Moe => RopeStyle::Neox,
    };
    Ok((RopeConfig { theta, style, scaling }, rotary_dim))
}

/// GGUF's names of the architectures qinfer runs (without underscores:
/// `qwen3moe`).
const ARCHITECTURES: [(&str, Architecture); 7] = [
    ("llama", Architecture::Llama),
    ("qwen2", Architecture::Qwen2),
    ("qwen3", Architecture::Qwen3),
    ("qwen3moe", Architecture::Qwen3Moe),
    ("qwen3next", Architecture::Qwen3Next),
    ("qwen35", Architecture::Qwen35),
    ("qwen35moe", Architecture::Qwen35Moe),
];

/// The architecture GGUF names `name` (`general.architecture`).
pub fn architecture_named(name: &str) -> Option<Architecture> {
    ARCHITECTURES.iter().find(|(n, _)| *n == name).map(|&(_, a)| a)
}

pub(super) fn model_config(file: &GgufFile) -> Result<ModelConfig> {
    let arch_name = file
        .metadata()
        .get("general.architecture")
        .ok_or_else(|| Error::config("general.architecture", "missing from GGUF metadata"))?
        .as_str()
        .ok_or_else(|| Error::config("general.architecture", "expected a string"))?;
    let arch = match architecture_named(arch_name) {
        Some(arch) => arch,
        None => {
            return Err(Error::UnknownArchitecture {
                found: arch_name.to_string(),
                supported: "llama, qwen2, qwen3, qwen3moe, qwen3next, qwen35, qwen35moe (GGUF)".to_string(),
            });
        }
    };
    let m = Meta { file, arch: arch_name };

    // block_count includes the multi-token-prediction blocks, which the
    // forward pass does not run.
    let blocks = m.req_usize(&m.key("block_count"))?;
    let nextn = m.opt_usize(&m.key("nextn_predict_layers"))?.unwrap_or(0);
    let num_layers = blocks
        .checked_sub(nextn)
        .ok_or_else(|| Error::config(m.key("nextn_predict_layers"), format!("{nextn} exceeds block_count {blocks}")))?;
    let hidden_size = m.req_usize(&m.key("embedding_length"))?;
    let num_heads = m.req_usize(&m.key("attention.head_count"))?;
    let num_kv_heads = m.opt_usize(&m.key("attention.head_count_kv"))?.unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(Error::config(
            m.key("attention.head_count_kv"),
            format!("{num_kv_heads} does not divide attention.head_count {num_heads}"),
        ));
    }
    let head_dim = match m.opt_usize(&m.key("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(Error::config(
                m.key("attention.key_length"),
                "missing and embedding_length is not divisible by attention.head_count",
            ));
        }
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(Error::config(m.key("attention.key_length"), format!("{head_dim}: RoPE needs an even head_dim")));
    }
    if let Some(v) = m.opt_usize(&m.key("attention.value_length"))?
        && v != head_dim
    {
        return Err(Error::config(
            m.key("attention.value_length"),
            format!("{v} differs from key_length {head_dim}; not supported"),
        ));
    }
    let rms_norm_eps = m
        .opt_f32(&m.key("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| Error::config(m.key("attention.layer_norm_rms_epsilon"), "missing from GGUF metadata"))?;

    let bos_token_id = m.opt_token_id("tokenizer.ggml.bos_token_id")?;
    let mut eos_token_ids: Vec<u32> = m.opt_token_id("tokenizer.ggml.eos_token_id")?.into_iter().collect();
    if let Some(eot) = m.opt_token_id("tokenizer.ggml.eot_token_id")?
        && !eos_token_ids.contains(&eot)
    {
        eos_token_ids.push(eot);
    }

    let attention_bias = match arch {
        Architecture::Qwen2 => true,
        Architecture::Llama
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Qwen3Next
        | Architecture::Qwen35
        | Architecture::Qwen35Moe => m.has_tensor("blk.0.attn_q.bias"),
    };
    let (moe, moe_layers) = super::moe_meta::moe(&m, arch, num_layers)?;
    let (rope, rotary_dim) = rope(&m, arch, head_dim)?;
    // All-MoE files need no dense MLP width.
    let intermediate_size = match m.opt_usize(&m.key("feed_forward_length"))? {
        Some(n) => n,
        None if moe_layers.iter().all(|&x| x) => 0,
        None => return Err(Error::config(m.key("feed_forward_length"), "missing from GGUF metadata")),
    };
    Ok(ModelConfig {
        arch,
        vocab_size: vocab_size(&m)?,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps,
        rope,
        max_position_embeddings: m.req_usize(&m.key("context_length"))?,
        tie_word_embeddings: !m.has_tensor("output.weight"),
        attention_bias,
        o_bias: m.has_tensor("blk.0.attn_output.bias"),
        qk_norm: match arch {
            Architecture::Llama | Architecture::Qwen2 => false,
            Architecture::Qwen3
            | Architecture::Qwen3Moe
            | Architecture::Qwen3Next
            | Architecture::Qwen35
            | Architecture::Qwen35Moe => true,
        },
        layer_windows: vec![None; num_layers],
        bos_token_id,
        eos_token_ids,
        layer_kinds: super::gdn_meta::layer_kinds(&m, arch, num_layers)?,
        moe_layers,
        moe,
        gdn: super::gdn_meta::gdn(&m, arch)?,
        rotary_dim,
        // A GGUF holds the text model only (llama.cpp keeps vision towers in
        // separate projector files), so every position is one-dimensional.
        mrope: None,
        vision: None,
        mtp_layers: m.opt_usize(&m.key("nextn_predict_layers"))?.unwrap_or(0),
        load_mtp: false,
    })
}

impl GgufFile {
    /// The model configuration the metadata describes.
    pub fn model_config(&self) -> Result<ModelConfig> {
        model_config(self)
    }
}
