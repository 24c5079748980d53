//! Sparse mixture-of-experts feed-forward: transformers' `Qwen3MoeSparseMoeBlock`
//! (router → softmax → top-k → optional renormalization → experts), plus the
//! sigmoid-gated shared expert of Qwen3-Next / Qwen3.5-MoE
//! (`Qwen3NextSparseMoeBlock`).

use super::block::{BlockInput, BlockOutput};
use super::mlp::Mlp;
use crate::backend::ops::ModelBackend;
use crate::backend::{ExpertWeights, Routing};
use crate::config::MoeConfig;
use crate::weights::WeightLoader;
use crate::{Error, Result};

pub struct SparseMoe<B: ModelBackend> {
    router: B::Weight,
    experts: Vec<ExpertWeights<B::Weight>>,
    routing: Routing,
    shared_expert: Option<Mlp<B>>,
    /// `[1, hidden]`: the shared expert's output is scaled by sigmoid(gate·x).
    shared_expert_gate: Option<B::Weight>,
}

/// The name under which a stacked tensor is stored, with or without `.weight`.
fn stacked_name(ld_has: impl Fn(&str) -> bool, base: &str) -> Option<String> {
    [base.to_string(), format!("{base}.weight")].into_iter().find(|n| ld_has(n))
}

impl<B: ModelBackend> SparseMoe<B> {
    /// Whether `b` routes this layer's experts without the host.
    pub fn routes_on_device(&self, b: &B) -> bool {
        b.routes_on_device(&self.experts)
    }

    /// `p` is the module prefix, e.g. `model.layers.3.mlp`. Experts may be stored
    /// one tensor per expert (`experts.N.gate_proj.weight`, the Qwen3-MoE and
    /// Qwen3-Next hub layout), fused (`experts.gate_up_proj` `[E, 2I, H]` with the
    /// gate rows first and `experts.down_proj` `[E, H, I]`, Qwen3.5-MoE), or
    /// stacked per projection (`switch_mlp.gate_proj.weight` `[E, I, H]`, MLX).
    pub fn load(ld: &WeightLoader<B>, p: &str, hidden: usize, m: &MoeConfig) -> Result<Self> {
        let (e_n, i) = (m.num_experts, m.intermediate_size);
        let has = |n: &str| ld.src.contains(n);
        let mut experts = Vec::with_capacity(e_n);
        if let Some(gate_up) = stacked_name(has, &format!("{p}.experts.gate_up_proj")) {
            let down_name = stacked_name(has, &format!("{p}.experts.down_proj"))
                .ok_or_else(|| Error::tensor(format!("{p}.experts.down_proj"), "missing (gate_up_proj is present)"))?;
            let gu = ld.stored(&gate_up, &[e_n, 2 * i, hidden])?;
            let down = ld.stored(&down_name, &[e_n, hidden, i])?;
            for e in 0..e_n {
                let gu_e = gu.narrow(e, 1)?.squeeze_outer()?;
                experts.push(ExpertWeights {
                    gate: ld.place_stored(&gu_e.narrow(0, i)?)?,
                    up: ld.place_stored(&gu_e.narrow(i, i)?)?,
                    down: ld.place_stored(&down.narrow(e, 1)?.squeeze_outer()?)?,
                });
            }
        } else if has(&format!("{p}.switch_mlp.gate_proj.weight")) {
            // Each projection may be quantized or not on its own (mlx-lm skips
            // matrices whose input width is not a multiple of the group size).
            let get = |proj: &str, shape: [usize; 3]| ld.stacked(&format!("{p}.switch_mlp.{proj}.weight"), shape);
            let gate = get("gate_proj", [e_n, i, hidden])?;
            let up = get("up_proj", [e_n, i, hidden])?;
            let down = get("down_proj", [e_n, hidden, i])?;
            for ((gate, up), down) in gate.into_iter().zip(up).zip(down) {
                experts.push(ExpertWeights { gate, up, down });
            }
        } else {
            for e in 0..e_n {
                let x = format!("{p}.experts.{e}");
                experts.push(ExpertWeights {
                    gate: ld.get(&format!("{x}.gate_proj.weight"), &[i, hidden])?,
                    up: ld.get(&format!("{x}.up_proj.weight"), &[i, hidden])?,
                    down: ld.get(&format!("{x}.down_proj.weight"), &[hidden, i])?,
                });
            }
        }
        let (shared_expert, shared_expert_gate) = match m.shared_expert_intermediate_size {
            Some(width) => (
                Some(Mlp::load(ld, &format!("{p}.shared_expert"), hidden, width)?),
                Some(ld.get(&format!("{p}.shared_expert_gate.weight"), &[1, hidden])?),
            ),
            None => (None, None),
        };
        Ok(SparseMoe {
            router: ld.get(&format!("{p}.gate.weight"), &[e_n, hidden])?,
            experts,
            routing: Routing { top_k: m.top_k, renormalize: m.norm_topk_prob },
            shared_expert,
            shared_expert_gate,
        })
    }

    /// The block's output for `input` (a sum over experts, for the caller to add).
    pub fn forward(&self, b: &B, input: BlockInput<'_, B>) -> BlockOutput<'_, B> {
        BlockOutput::Done(input.with_normed(b, |x| {
            let logits = b.linear(x, &self.router, None);
            let mut out = b.moe(x, &logits, &self.experts, self.routing);
            if let (Some(shared), Some(gate)) = (&self.shared_expert, &self.shared_expert_gate) {
                let mut s = shared.forward(b, x);
                b.mul_sigmoid(&mut s, &b.linear(x, gate, None));
                b.add_assign(&mut out, &s);
            }
            out
        }))
    }
}
