//! Gated DeltaNet linear attention: transformers' `Qwen3NextGatedDeltaNet`
//! (fused `in_proj_qkvz` / `in_proj_ba`, grouped per key head) and
//! `Qwen3_5GatedDeltaNet` (split `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
//! `in_proj_a`). The backend runs the conv, the delta rule and the gated norm.

use super::block::{BlockInput, BlockOutput};
use super::lora::{self, LoraSite, Pending, Segments, Sites};
use crate::Result;
use crate::backend::GdnWeights;
use crate::backend::ops::ModelBackend;
use crate::config::{GdnConfig, GdnProjections, ModelConfig};
use crate::kv::batch::BatchLayout;
use crate::weights::WeightLoader;

enum Projections<W> {
    /// Qwen3-Next: per key head, `[q(dk), k(dk), v(r·dv), z(r·dv)]` and `[b(r), a(r)]`
    /// with r = value heads per key head.
    Fused { qkvz: W, ba: W },
    /// Qwen3.5: `[q, k, v]` already in conv-channel order; z, b, a separate.
    Split { qkv: W, z: W, b: W, a: W },
    /// Qwen3.5's four stacked into one matrix `[q, k, v, z, b, a]`, where the
    /// backend fuses projections and all four are stored alike.
    Stacked { all: W },
}

pub struct GatedDeltaNet<B: ModelBackend> {
    proj: Projections<B::Weight>,
    /// `[conv_dim, kernel]` (stored as `[conv_dim, 1, kernel]` by transformers,
    /// `[conv_dim, kernel, 1]` by MLX: the same bytes either way).
    conv1d: B::Weight,
    a_log: B::Weight,
    dt_bias: B::Weight,
    /// Gated RMSNorm over each value head (plain w, not 1+w).
    norm: B::Weight,
    out_proj: B::Weight,
    cfg: GdnConfig,
    eps: f32,
    hidden: usize,
}

impl<B: ModelBackend> GatedDeltaNet<B> {
    /// `p` is the module prefix, e.g. `model.layers.0.linear_attn`.
    pub fn load(ld: &WeightLoader<B>, p: &str, cfg: &ModelConfig, g: &GdnConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let (kd, vd, nv) = (g.key_dim(), g.value_dim(), g.num_v_heads);
        // Next's checkpoints fuse the projections per key head; Qwen3.5's split
        // them, and so do llama.cpp's GGUFs of both (the GGUF reader presents
        // them under the split names).
        let layout = cfg.arch.features().linear_attention;
        let fused = ld.src.contains(&format!("{p}.in_proj_qkvz.weight")) || ld.random.is_some();
        let proj = match layout {
            Some(GdnProjections::FusedPerKeyHead) if fused => Projections::Fused {
                qkvz: ld.get(&format!("{p}.in_proj_qkvz.weight"), &[2 * kd + 2 * vd, h])?,
                ba: ld.get(&format!("{p}.in_proj_ba.weight"), &[2 * nv, h])?,
            },
            Some(GdnProjections::FusedPerKeyHead | GdnProjections::Split) => {
                let names = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"].map(|n| format!("{p}.{n}.weight"));
                let mut w = ld.stacked_rows(&names, &[[2 * kd + vd, h], [vd, h], [nv, h], [nv, h]])?.into_iter();
                match (w.next(), w.next(), w.next(), w.next()) {
                    (Some(all), None, None, None) => Projections::Stacked { all },
                    (Some(qkv), Some(z), Some(b), Some(a)) => Projections::Split { qkv, z, b, a },
                    _ => unreachable!("stacked_rows returns one weight or one per name"),
                }
            }
            None => {
                return Err(crate::Error::config(
                    "layer_types",
                    format!("{} has no linear-attention layers", cfg.arch.name()),
                ));
            }
        };
        let cd = g.conv_dim();
        let conv_name = format!("{p}.conv1d.weight");
        let k = g.conv_kernel;
        let conv = ld.tensor(&conv_name, &[&[cd, 1, k], &[cd, k, 1], &[cd, k]])?;
        Ok(GatedDeltaNet {
            proj,
            conv1d: ld.place(&conv.reshape(vec![cd, g.conv_kernel])?)?,
            a_log: ld.get(&format!("{p}.A_log"), &[nv])?,
            dt_bias: ld.get(&format!("{p}.dt_bias"), &[nv])?,
            norm: ld.get(&format!("{p}.norm.weight"), &[g.v_head_dim])?,
            out_proj: ld.get(&format!("{p}.out_proj.weight"), &[h, vd])?,
            cfg: g.clone(),
            eps: cfg.rms_norm_eps,
            hidden: h,
        })
    }

    /// An adapter's sites for this layer (`layer` in the model), taken
    /// from `pending`: the input projections in the layer's form, then out.
    pub fn lora(&self, bk: &B, pending: &mut Pending, layer: usize) -> Result<Sites<B::Weight>> {
        let g = &self.cfg;
        let (h, kd, vd, nv) = (self.hidden, g.key_dim(), g.value_dim(), g.num_v_heads);
        let split = [
            ("linear_attn.in_proj_qkv", 2 * kd + vd),
            ("linear_attn.in_proj_z", vd),
            ("linear_attn.in_proj_b", nv),
            ("linear_attn.in_proj_a", nv),
        ];
        let mut take = |parts: &[(&str, usize)]| LoraSite::take(bk, pending, layer, parts, h);
        let inputs = match &self.proj {
            Projections::Fused { .. } => vec![
                take(&[("linear_attn.in_proj_qkvz", 2 * kd + 2 * vd)])?,
                take(&[("linear_attn.in_proj_ba", 2 * nv)])?,
            ],
            Projections::Split { .. } => split.iter().map(|p| take(std::slice::from_ref(p))).collect::<Result<_>>()?,
            Projections::Stacked { .. } => vec![take(&split)?],
        };
        let out = LoraSite::take(bk, pending, layer, &[("linear_attn.out_proj", h)], vd)?;
        Ok(Sites::new(inputs, out))
    }

    /// The layer's output for `input`, advancing `state`; the out projection
    /// is left for the caller to add into the residual stream.
    pub fn forward(
        &self,
        bk: &B,
        input: BlockInput<'_, B>,
        state: &mut B::GdnState,
        lora: &Segments<'_, Sites<B::Weight>>,
    ) -> BlockOutput<'_, B> {
        let projected = self.project(bk, input, lora);
        let o = self.mix(bk, &projected, state, false);
        lora::output(bk, o, &self.out_proj, None, lora)
    }

    /// [`GatedDeltaNet::forward`] over a ragged batch: the projections over
    /// every row at once, the recurrence per sequence from the state in its
    /// slot (`states[slot]`).
    pub fn forward_batch(
        &self,
        bk: &B,
        input: BlockInput<'_, B>,
        states: &mut [&mut B::GdnState],
        batch: &BatchLayout,
        snapshots: &mut Vec<(u32, B::GdnState)>,
        lora: &Segments<'_, Sites<B::Weight>>,
    ) -> BlockOutput<'_, B> {
        let projected = self.project(bk, input, lora);
        let decode_rows = batch.seqs.iter().all(|s| s.len() == 1 && !s.prompt && s.snapshots.is_empty());
        let weights = GdnWeights { conv: &self.conv1d, a_log: &self.a_log, dt_bias: &self.dt_bias, norm: &self.norm };
        let o = if let [seq] = batch.seqs.as_slice()
            && seq.snapshots.is_empty()
        {
            self.mix(bk, &projected, states[0], seq.prompt)
        } else if let (true, Projected::Mixed(mixed)) = (decode_rows, &projected)
            && let Some(o) = bk.gdn_mix_rows(mixed, &weights, self.eps, states)
        {
            // Every sequence's one decode row in one step of the backend's.
            o
        } else {
            let mut parts: Vec<B::Act> = Vec::with_capacity(batch.seqs.len());
            for (seq, state) in batch.seqs.iter().zip(states.iter_mut()) {
                // Split at each snapshot: prompt segments start at multiples
                // of the chunk and decode rows step one at a time either
                // way, so the parts compute as the whole would.
                let mut from = 0;
                let ends = seq.snapshots.iter().map(|&(n, slot)| (n, Some(slot)));
                for (to, slot) in ends.chain(std::iter::once((seq.len(), None))) {
                    if to > from {
                        let rows = seq.rows.start + from..seq.rows.start + to;
                        parts.push(self.mix(bk, &projected.rows(bk, rows), state, seq.prompt));
                    }
                    if let Some(slot) = slot {
                        snapshots.push((slot, (**state).clone()));
                    }
                    from = to;
                }
            }
            bk.concat_rows(&parts)
        };
        lora::output(bk, o, &self.out_proj, None, lora)
    }

    /// The input projections of every row.
    fn project(&self, bk: &B, input: BlockInput<'_, B>, lora: &Segments<'_, Sites<B::Weight>>) -> Projected<B> {
        let g = &self.cfg;
        let (dk, dv) = (g.k_head_dim, g.v_head_dim);
        match &self.proj {
            Projections::Fused { qkvz, ba } => input.with_normed(bk, |x| {
                // `fix_query_key_value_ordering`: split each key head's group.
                let r = g.num_v_heads / g.num_k_heads;
                let mixed = lora::linear(bk, x, qkvz, None, lora, |l| l.input(0));
                let group = 2 * dk + 2 * r * dv;
                let q = bk.gather_columns(&mixed, group, 0, dk);
                let k = bk.gather_columns(&mixed, group, dk, dk);
                let v = bk.gather_columns(&mixed, group, 2 * dk, r * dv);
                let z = bk.gather_columns(&mixed, group, 2 * dk + r * dv, r * dv);
                let mixed_ba = lora::linear(bk, x, ba, None, lora, |l| l.input(1));
                let b = bk.gather_columns(&mixed_ba, 2 * r, 0, r);
                let a = bk.gather_columns(&mixed_ba, 2 * r, r, r);
                Projected::Parts { qkv: bk.concat_columns(&[&q, &k, &v]), z, b, a }
            }),
            Projections::Split { qkv, z, b, a } => input.with_normed(bk, |x| Projected::Parts {
                qkv: lora::linear(bk, x, qkv, None, lora, |l| l.input(0)),
                z: lora::linear(bk, x, z, None, lora, |l| l.input(1)),
                b: lora::linear(bk, x, b, None, lora, |l| l.input(2)),
                a: lora::linear(bk, x, a, None, lora, |l| l.input(3)),
            }),
            Projections::Stacked { all } => Projected::Mixed(lora::input_linear(bk, &input, all, None, lora, 0)),
        }
    }

    /// Conv, the gated delta rule and the gated norm over one sequence's
    /// projected rows, advancing its state; `prompt` rows take the chunked
    /// form however few they are.
    fn mix(&self, bk: &B, projected: &Projected<B>, state: &mut B::GdnState, prompt: bool) -> B::Act {
        let g = &self.cfg;
        let (kd, vd) = (g.key_dim(), g.value_dim());
        let (qkv, z, b, a) = match projected {
            Projected::Parts { qkv, z, b, a } => (qkv, z, b, a),
            Projected::Mixed(mixed) => {
                let weights =
                    GdnWeights { conv: &self.conv1d, a_log: &self.a_log, dt_bias: &self.dt_bias, norm: &self.norm };
                if !prompt && let Some(o) = bk.gdn_mix(mixed, &weights, self.eps, state) {
                    return o;
                }
                let (cd, nv) = (g.conv_dim(), g.num_v_heads);
                let all = cd + vd + 2 * nv;
                let parts = Projected::Parts {
                    qkv: bk.gather_columns(mixed, all, 0, cd),
                    z: bk.gather_columns(mixed, all, cd, vd),
                    b: bk.gather_columns(mixed, all, cd + vd, nv),
                    a: bk.gather_columns(mixed, all, cd + vd + nv, nv),
                };
                return self.mix(bk, &parts, state, prompt);
            }
        };
        let mixed = bk.gdn_conv(qkv, &self.conv1d, state);
        let cd = g.conv_dim();
        let q = bk.gather_columns(&mixed, cd, 0, kd);
        let k = bk.gather_columns(&mixed, cd, kd, kd);
        let v = bk.gather_columns(&mixed, cd, 2 * kd, vd);
        let o = if prompt {
            bk.gated_delta_rule_prompt(&q, &k, &v, a, b, &self.a_log, &self.dt_bias, state)
        } else {
            bk.gated_delta_rule(&q, &k, &v, a, b, &self.a_log, &self.dt_bias, state)
        };
        bk.rms_norm_gated(&o, z, &self.norm, self.eps)
    }
}

/// A layer's input projections: stacked as one (the fused form's input), or apart.
enum Projected<B: ModelBackend> {
    Mixed(B::Act),
    Parts { qkv: B::Act, z: B::Act, b: B::Act, a: B::Act },
}

impl<B: ModelBackend> Projected<B> {
    /// These rows of every projection.
    fn rows(&self, bk: &B, rows: std::ops::Range<usize>) -> Self {
        let r = |x: &B::Act| bk.slice_rows(x, rows.clone());
        match self {
            Projected::Mixed(m) => Projected::Mixed(r(m)),
            Projected::Parts { qkv, z, b, a } => Projected::Parts { qkv: r(qkv), z: r(z), b: r(b), a: r(a) },
        }
    }
}
