//! Softmax attention over the KV cache: transformers' `LlamaAttention`,
//! `Qwen2Attention` (q/k/v bias), `Qwen3Attention` (per-head q/k RMSNorm before
//! RoPE) and the gated attention of Qwen3-Next / Qwen3.5 (`Qwen3NextAttention`:
//! q_proj emits a query and an output gate per head, partial RoPE, output ×
//! sigmoid(gate) before o_proj).

use super::block::{BlockInput, BlockOutput};
use super::lora::{self, LoraSite, Pending, Segments, Sites};
use crate::Result;
use crate::backend::ops::ModelBackend;
use crate::backend::{AttentionShape, QkvShape};
use crate::config::rope::Rope;
use crate::config::{ModelConfig, RopeStyle};
use crate::kv::batch::BatchLayout;
use crate::tensor::Tensor;
use crate::weights::WeightLoader;

/// The q, k and v projections: one weight of their rows stacked (backends
/// that fuse projections), or one each.
enum QkvProj<W> {
    Stacked { w: W, bias: Option<W> },
    Separate { q: W, k: W, v: W, q_bias: Option<W>, k_bias: Option<W>, v_bias: Option<W> },
}

pub struct Attention<B: ModelBackend> {
    proj: QkvProj<B::Weight>,
    o_proj: B::Weight,
    o_bias: Option<B::Weight>,
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
    /// q_proj rows are `[query(head_dim), gate(head_dim)]` per head.
    output_gate: bool,
    window: Option<usize>,
    /// This layer's slot in the KV cache.
    layer: usize,
}

impl<B: ModelBackend> Attention<B> {
    /// `p` is the module prefix, e.g. `model.layers.3.self_attn`.
    pub fn load(ld: &WeightLoader<B>, p: &str, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let (h, q, kv, hd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let features = cfg.arch.features();
        let output_gate = features.attention_output_gate;
        let q_rows = if output_gate { 2 * q } else { q };
        let bias = cfg.attention_bias;
        let unit_offset = features.unit_offset_norms;
        let norm = |name: &str| -> Result<Option<B::Weight>> {
            if cfg.qk_norm { ld.norm(&format!("{p}.{name}.weight"), hd, unit_offset).map(Some) } else { Ok(None) }
        };
        let names = ["q_proj", "k_proj", "v_proj"].map(|n| format!("{p}.{n}.weight"));
        let mut stacked = ld.stacked_rows(&names, &[[q_rows, h], [kv, h], [kv, h]])?;
        let proj = match (stacked.pop(), stacked.pop(), stacked.pop()) {
            (Some(w), None, None) => {
                // Biases are f32 vectors on every backend: stack their values.
                let bias = if bias {
                    let mut values = Vec::with_capacity(q_rows + 2 * kv);
                    for (n, len) in [("q_proj", q_rows), ("k_proj", kv), ("v_proj", kv)] {
                        values.extend(ld.tensor(&format!("{p}.{n}.bias"), &[&[len]])?.to_f32_vec());
                    }
                    let name = format!("{p}.qkv_proj.bias(stacked)");
                    Some(ld.place(&Tensor::from_f32(&name, vec![values.len()], &values)?)?)
                } else {
                    None
                };
                QkvProj::Stacked { w, bias }
            }
            (Some(v), Some(k), Some(q)) => QkvProj::Separate {
                q,
                k,
                v,
                q_bias: ld.opt(&format!("{p}.q_proj.bias"), &[q_rows], bias)?,
                k_bias: ld.opt(&format!("{p}.k_proj.bias"), &[kv], bias)?,
                v_bias: ld.opt(&format!("{p}.v_proj.bias"), &[kv], bias)?,
            },
            _ => unreachable!("stacked_rows returns one weight or one per name"),
        };
        Ok(Attention {
            proj,
            o_proj: ld.get(&format!("{p}.o_proj.weight"), &[h, q])?,
            o_bias: ld.opt(&format!("{p}.o_proj.bias"), &[h], cfg.o_bias)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            output_gate,
            window: cfg.layer_windows[layer],
            layer,
        })
    }

    /// An adapter's sites for this layer (`layer` in the model), taken
    /// from `pending`: q|k|v (one site when stacked, else q, k, v), then o.
    pub fn lora(&self, b: &B, pending: &mut Pending, cfg: &ModelConfig, layer: usize) -> Result<Sites<B::Weight>> {
        let (h, kv) = (cfg.hidden_size, cfg.kv_dim());
        let q_rows = if self.output_gate { 2 * cfg.q_dim() } else { cfg.q_dim() };
        let parts = [("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)];
        if cfg.rope.style == RopeStyle::Interleaved {
            for path in ["self_attn.q_proj", "self_attn.k_proj"] {
                lora::interleave_head_rows(pending, layer, path, cfg.head_dim);
            }
        }
        let qkv = match &self.proj {
            QkvProj::Stacked { .. } => vec![LoraSite::take(b, pending, layer, &parts, h)?],
            QkvProj::Separate { .. } => parts
                .iter()
                .map(|p| LoraSite::take(b, pending, layer, std::slice::from_ref(p), h))
                .collect::<Result<_>>()?,
        };
        let o = LoraSite::take(b, pending, layer, &[("self_attn.o_proj", h)], cfg.q_dim())?;
        Ok(Sites::new(qkv, o))
    }

    /// The projection's heads and the attention's shape for this layer.
    fn shapes(&self, cfg: &ModelConfig) -> (QkvShape, AttentionShape) {
        let hd = cfg.head_dim;
        let shape = QkvShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            output_gate: self.output_gate,
        };
        let attention = AttentionShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            window: self.window,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        (shape, attention)
    }

    /// Attends from `input`; the o projection is left for the caller to add
    /// into the residual stream.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        b: &B,
        cfg: &ModelConfig,
        rope: &Rope,
        input: BlockInput<'_, B>,
        cache: &mut B::Cache,
        positions: &[usize],
        lora: &Segments<'_, Sites<B::Weight>>,
    ) -> BlockOutput<'_, B> {
        let eps = cfg.rms_norm_eps;
        let norms = self.q_norm.as_ref().zip(self.k_norm.as_ref());
        let (shape, attention) = self.shapes(cfg);
        let (mut o, gate) = match &self.proj {
            QkvProj::Stacked { w, bias } => {
                let qkv = lora::input_linear(b, &input, w, bias.as_ref(), lora, 0);
                b.qkv_attention(&qkv, &shape, norms, eps, positions, rope, cache, self.layer, &attention)
            }
            QkvProj::Separate { q, k, v, q_bias, k_bias, v_bias } => {
                let (q, gate) = input.with_normed(b, |x| {
                    let projected = lora::linear(b, x, q, q_bias.as_ref(), lora, |l| l.input(0));
                    let k = lora::linear(b, x, k, k_bias.as_ref(), lora, |l| l.input(1));
                    let v = lora::linear(b, x, v, v_bias.as_ref(), lora, |l| l.input(2));
                    b.attention_prologue(projected, k, &v, &shape, norms, eps, positions, rope, cache, self.layer)
                });
                (b.attention(&q, cache, self.layer, &attention), gate)
            }
        };
        if let Some(g) = &gate {
            b.mul_sigmoid(&mut o, g);
        }
        lora::output(b, o, &self.o_proj, self.o_bias.as_ref(), lora)
    }

    /// [`Attention::forward`] over a ragged batch of sequences: keys and
    /// values go to `pool` through the batch's slot mapping, each sequence's
    /// rows attend over its context through its block table. `pool_layer`
    /// is this layer's place in the pool, which holds attention layers only.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch(
        &self,
        b: &B,
        cfg: &ModelConfig,
        rope: &Rope,
        input: BlockInput<'_, B>,
        pool: &mut B::KvPool,
        pool_layer: usize,
        batch: &BatchLayout,
        lora: &Segments<'_, Sites<B::Weight>>,
    ) -> BlockOutput<'_, B> {
        let eps = cfg.rms_norm_eps;
        let norms = self.q_norm.as_ref().zip(self.k_norm.as_ref());
        let (shape, attention) = self.shapes(cfg);
        let (q, gate) = match &self.proj {
            QkvProj::Stacked { w, bias } => {
                let qkv = lora::input_linear(b, &input, w, bias.as_ref(), lora, 0);
                b.paged_qkv_prologue(&qkv, &shape, norms, eps, rope, pool, pool_layer, batch)
            }
            QkvProj::Separate { q, k, v, q_bias, k_bias, v_bias } => input.with_normed(b, |x| {
                let projected = lora::linear(b, x, q, q_bias.as_ref(), lora, |l| l.input(0));
                let k = lora::linear(b, x, k, k_bias.as_ref(), lora, |l| l.input(1));
                let v = lora::linear(b, x, v, v_bias.as_ref(), lora, |l| l.input(2));
                b.paged_prologue(projected, k, &v, &shape, norms, eps, rope, pool, pool_layer, batch)
            }),
        };
        let mut o = b.paged_attention(&q, pool, pool_layer, &attention, batch);
        if let Some(g) = &gate {
            b.mul_sigmoid(&mut o, g);
        }
        lora::output(b, o, &self.o_proj, self.o_bias.as_ref(), lora)
    }
}
