//! Mixture-of-experts metadata of GGUF files (`{arch}.expert_count`, …), as
//! llama.cpp's converter writes it for qwen3moe (and qwen2moe-style shared
//! experts).

use super::meta::Meta;
use crate::config::{Architecture, MoeConfig};
use crate::{Error, Result};

/// The experts' shape and which layers route through them. A layer is sparse
/// when the file has its router (`blk.N.ffn_gate_inp.weight`), so files that
/// keep some layers dense (transformers' `mlp_only_layers`,
/// `decoder_sparse_step`) load as written.
pub(super) fn moe(m: &Meta, arch: Architecture, num_layers: usize) -> Result<(Option<MoeConfig>, Vec<bool>)> {
    let layers: Vec<bool> = (0..num_layers).map(|i| m.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight"))).collect();
    match arch {
        Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen35 => {
            if let Some(i) = layers.iter().position(|&x| x) {
                return Err(Error::tensor(
                    format!("blk.{i}.ffn_gate_inp.weight"),
                    format!("an expert router in a dense `{}` file", m.arch),
                ));
            }
            return Ok((None, layers));
        }
        Architecture::Qwen3Moe | Architecture::Qwen3Next | Architecture::Qwen35Moe => {}
    }
    let num_experts = m.req_usize(&m.key("expert_count"))?;
    let top_k = m.req_usize(&m.key("expert_used_count"))?;
    if num_experts == 0 || top_k == 0 || top_k > num_experts {
        return Err(Error::config(
            m.key("expert_used_count"),
            format!("{top_k} experts per token of {num_experts} is not a valid routing"),
        ));
    }
    let intermediate_size = match m.opt_usize(&m.key("expert_feed_forward_length"))? {
        Some(n) => n,
        // Older files: the experts' width is the stacked gate's middle dimension.
        None => layers
            .iter()
            .position(|&x| x)
            .and_then(|i| m.file.tensor_info(&format!("blk.{i}.ffn_gate_exps.weight")))
            .and_then(|t| (t.shape.len() == 3).then(|| t.shape[1]))
            .ok_or_else(|| Error::config(m.key("expert_feed_forward_length"), "missing from GGUF metadata"))?,
    };
    // llama.cpp renormalizes the top-k weights of qwen3moe, qwen3next and
    // qwen35moe unconditionally; a file may say otherwise explicitly.
    let norm_key = m.key("expert_weights_norm");
    let norm_topk_prob = match m.get(&norm_key) {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| Error::config(&norm_key, format!("expected a bool, found {v}")))?,
    };
    let shared_expert_intermediate_size = m.opt_usize(&m.key("expert_shared_feed_forward_length"))?;
    let moe = MoeConfig { num_experts, top_k, intermediate_size, norm_topk_prob, shared_expert_intermediate_size };
    Ok((Some(moe), layers))
}
