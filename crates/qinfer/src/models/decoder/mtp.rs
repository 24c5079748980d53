//! The multi-token-prediction head of Qwen3-Next and Qwen3.5 checkpoints
//! (`mtp.*`), as vLLM's `qwen3_next_mtp` runs it for speculative decoding.
//! A row joins the next token's embedding and the target's hidden state
//! after its final norm: each is normed, the two are concatenated
//! (embedding first) and `fc` projects them back to the hidden width. One
//! full-attention decoder layer follows, with its own keys and values (the
//! pool's last layer, through the target's block tables), then `mtp.norm`
//! and the target's own head. A chained draft feeds the head's output
//! (after `mtp.norm`) back as the hidden state, one position further on.

use super::batch::DecoderBatchState;
use super::{DecoderLayer, DecoderModel, FeedForward, Mixer};
use crate::backend::ops::ModelBackend;
use crate::config::{LayerKind, ModelConfig};
use crate::kv::batch::BatchLayout;
use crate::layers::block::BlockInput;
use crate::models::spec::FeedForwardKind;
use crate::weights::WeightLoader;
use crate::{Error, Result};

pub(super) struct MtpHead<B: ModelBackend> {
    /// `[hidden, 2·hidden]`: the joined halves back to the hidden width.
    fc: B::Weight,
    norm_embedding: B::Weight,
    norm_hidden: B::Weight,
    layer: DecoderLayer<B>,
    norm: B::Weight,
}

impl<B: ModelBackend> MtpHead<B> {
    /// The head's weights; its feed-forward block is of kind `ffn` (vLLM
    /// decides it as for the model's layer 0).
    pub(super) fn load(ld: &WeightLoader<B>, cfg: &ModelConfig, ffn: FeedForwardKind) -> Result<Self> {
        if ld.random.is_none() && !ld.src.contains("mtp.fc.weight") {
            return Err(Error::tensor(
                "mtp.fc.weight",
                format!("missing: this {} checkpoint has no multi-token-prediction head", cfg.arch.name()),
            ));
        }
        // The layer takes a full-attention layer's window and rotary.
        let full = (cfg.layer_kinds.iter().position(|k| *k == LayerKind::Attention))
            .ok_or_else(|| Error::config("layer_types", "no full-attention layer for the MTP head to follow"))?;
        let h = cfg.hidden_size;
        let unit_offset = cfg.arch.features().unit_offset_norms;
        Ok(MtpHead {
            fc: ld.get("mtp.fc.weight", &[h, 2 * h])?,
            norm_embedding: ld.norm("mtp.pre_fc_norm_embedding.weight", h, unit_offset)?,
            norm_hidden: ld.norm("mtp.pre_fc_norm_hidden.weight", h, unit_offset)?,
            layer: DecoderLayer::load(ld, cfg, "mtp.layers.0", LayerKind::Attention, ffn, full)?,
            norm: ld.norm("mtp.norm.weight", h, unit_offset)?,
        })
    }
}

impl<B: ModelBackend + 'static> DecoderModel<B> {
    /// The head over `batch`: the logits of `batch.logits_rows` and those
    /// rows' output after `mtp.norm` (None when it names no row).
    pub(super) fn mtp_forward_of(
        &self,
        state: &mut DecoderBatchState<B>,
        tokens: &[u32],
        hidden: &[f32],
        batch: &BatchLayout,
    ) -> Result<Option<(B::Act, B::Act)>> {
        let name = self.cfg.arch.name();
        let Some(mtp) = &self.mtp else {
            return Err(Error::Invalid(format!("{name} was loaded without its multi-token-prediction head")));
        };
        self.check_batch(state, tokens, batch)?;
        let h = self.cfg.hidden_size;
        if hidden.len() != tokens.len() * h {
            return Err(Error::Invalid(format!(
                "MTP head: {} hidden values for {} rows of {h}",
                hidden.len(),
                tokens.len()
            )));
        }
        let (pool, pool_layer) = state.mtp_pool().ok_or_else(|| {
            Error::Invalid(format!("MTP head: this batch state of {name} was made before the head was loaded"))
        })?;
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        // Rows whose next token is an image's take that image token's
        // input, as the target's rows do (vLLM's Qwen3_5MTP merges the
        // multimodal embeddings the same way).
        let embedded = b.rms_norm(&self.embed_batch(tokens, batch)?, &mtp.norm_embedding, eps);
        let given = b.rms_norm(&b.act_from_host(tokens.len(), h, hidden), &mtp.norm_hidden, eps);
        let mut x = b.linear(&b.concat_columns(&[&embedded, &given]), &mtp.fc, None);
        let layer = &mtp.layer;
        let Mixer::Attention(at) = &layer.mixer else { unreachable!("the head's layer is loaded as attention") };
        let none = super::adapters::Active::none();
        let input = BlockInput::new(&x, None, &layer.input_layernorm, eps);
        let out = at.forward_batch(b, &self.cfg, &self.rope, input, pool, pool_layer, batch, &none.mixer(0));
        let normed = out.add_into(b, &mut x, &layer.post_attention_layernorm, eps);
        let input = BlockInput::new(&x, normed.as_ref(), &layer.post_attention_layernorm, eps);
        let out = match &layer.ffn {
            FeedForward::Dense(mlp) => mlp.forward_block(b, input, &none.ffn(0)),
            FeedForward::Sparse(moe) => moe.forward(b, input),
        };
        let normed = out.add_into(b, &mut x, &mtp.norm, eps);
        let y = normed.unwrap_or_else(|| b.rms_norm(&x, &mtp.norm, eps));
        if batch.logits_rows.is_empty() {
            return Ok(None);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let y = b.gather_rows(&y, &batch.logits_rows);
        Ok(Some((b.linear(&y, head, None), y)))
    }
}
