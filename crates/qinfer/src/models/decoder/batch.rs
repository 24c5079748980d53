//! The decoder over a ragged batch of sequences: token-wise work (embedding,
//! projections, MLPs, experts, the head) over every row at once, attention
//! through the paged KV pool, Gated DeltaNet per sequence from its state slot.

use std::any::Any;

use super::{DecoderModel, FeedForward, Mixer};
use crate::backend::ops::ModelBackend;
use crate::config::LayerKind;
use crate::kv::batch::{BatchLayout, BatchSeq};
use crate::layers::block::BlockInput;
use crate::models::BatchState;
use crate::sampling::RowPick;
use crate::{Error, Result};

/// The paged KV pool (attention layers only, in order) and, per
/// recurrent-state slot, the Gated DeltaNet state of every linear-attention
/// layer (None for attention layers).
pub(super) struct DecoderBatchState<B: ModelBackend> {
    pool: B::KvPool,
    /// Each model layer's place in the pool (attention layers).
    pool_layers: Vec<Option<usize>>,
    kv_bytes: usize,
    block_size: usize,
    num_blocks: usize,
    states: Vec<Vec<Option<B::GdnState>>>,
    /// The multi-token-prediction layer's place in the pool (after the
    /// model's attention layers), where the model has the head loaded.
    mtp_layer: Option<usize>,
    /// The backend's recordings of batched decode steps over this state.
    steps: B::Step,
}

impl<B: ModelBackend + 'static> BatchState for DecoderBatchState<B> {
    fn kv_bytes(&self) -> usize {
        self.kv_bytes
    }
    fn state_slots(&self) -> usize {
        self.states.len()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// What a batched forward hands back, on the device: the logits of the
/// rows the batch asks logits of, and the final normed hidden states of the
/// rows it asks those of (None where it asks none).
pub(super) struct BatchHeads<A> {
    pub logits: Option<A>,
    pub hidden: Option<A>,
}

impl<B: ModelBackend + 'static> DecoderBatchState<B> {
    /// `state` as this model's batch state, or an error naming the mix-up.
    pub(super) fn of(state: &mut dyn BatchState) -> Result<&mut Self> {
        state
            .as_any_mut()
            .downcast_mut::<Self>()
            .ok_or_else(|| Error::Invalid("batch state belongs to another model".into()))
    }

    fn slot(&self, slot: u32) -> Result<usize> {
        let s = slot as usize;
        if s >= self.states.len() {
            return Err(Error::Invalid(format!("state slot {slot} is past the {} slots", self.states.len())));
        }
        Ok(s)
    }

    pub(super) fn reset_slot(&mut self, backend: &B, slot: u32) -> Result<()> {
        let s = self.slot(slot)?;
        for state in self.states[s].iter_mut().flatten() {
            backend.clear_gdn_state(state);
        }
        Ok(())
    }

    fn block(&self, block: u32) -> Result<()> {
        if block as usize >= self.num_blocks {
            return Err(Error::Invalid(format!("KV block {block} is past the pool's {}", self.num_blocks)));
        }
        Ok(())
    }

    pub(super) fn read_block(&self, backend: &B, block: u32) -> Result<Vec<u8>> {
        self.block(block)?;
        Ok(backend.read_kv_block(&self.pool, block))
    }

    pub(super) fn write_block(&mut self, backend: &B, block: u32, bytes: &[u8]) -> Result<()> {
        self.block(block)?;
        backend.write_kv_block(&mut self.pool, block, bytes)
    }

    /// Every recurrent layer's state in `slot`, layer after layer.
    pub(super) fn read_slot(&self, backend: &B, slot: u32) -> Result<Vec<u8>> {
        let s = self.slot(slot)?;
        Ok(self.states[s].iter().flatten().flat_map(|st| backend.gdn_state_to_host(st)).collect())
    }

    pub(super) fn write_slot(&mut self, backend: &B, slot: u32, bytes: &[u8]) -> Result<()> {
        let s = self.slot(slot)?;
        let layers: Vec<&mut B::GdnState> = self.states[s].iter_mut().flatten().collect();
        let per = bytes.len() / layers.len().max(1);
        if layers.is_empty() || per * layers.len() != bytes.len() {
            return Err(Error::Invalid(format!(
                "recurrent states of {} bytes for {} layers",
                bytes.len(),
                layers.len()
            )));
        }
        for (state, part) in layers.into_iter().zip(bytes.chunks_exact(per)) {
            backend.gdn_state_from_host(state, part)?;
        }
        Ok(())
    }

    /// The pool and the multi-token-prediction layer's place in it (None
    /// where the model was loaded without the head).
    pub(super) fn mtp_pool(&mut self) -> Option<(&mut B::KvPool, usize)> {
        Some((&mut self.pool, self.mtp_layer?))
    }

    pub(super) fn copy_slot(&mut self, from: u32, to: u32) -> Result<()> {
        let (f, t) = (self.slot(from)?, self.slot(to)?);
        if f != t {
            let src = self.states[f].clone();
            self.states[t].clone_from(&src);
        }
        Ok(())
    }
}

impl<B: ModelBackend + 'static> DecoderModel<B> {
    pub(super) fn new_batch_state_of(
        &self,
        num_blocks: usize,
        block_size: usize,
        state_slots: usize,
    ) -> Result<DecoderBatchState<B>> {
        let b = &self.backend;
        if !b.capabilities().batched {
            return Err(Error::Invalid(format!("the {} backend does not run batched forwards yet", b.name())));
        }
        let mut attention_layers = 0;
        let pool_layers = (self.cfg.layer_kinds.iter())
            .map(|k| {
                (*k == LayerKind::Attention).then(|| {
                    attention_layers += 1;
                    attention_layers - 1
                })
            })
            .collect();
        let mtp_layer = self.mtp.is_some().then_some(attention_layers);
        let pool_size = attention_layers + usize::from(mtp_layer.is_some());
        // Where the backend records batched steps, one block past the
        // sequences' for the rows that pad them (`pad_rows`): their keys and
        // values go there.
        let spare = usize::from(b.batch_step_rows(1, false).is_some());
        let pool = b.new_kv_pool(pool_size, self.cfg.kv_dim(), num_blocks + spare, block_size)?;
        let kv_bytes = b.kv_pool_bytes(&pool);
        let recurrent = self.cfg.layer_kinds.contains(&LayerKind::LinearAttention);
        let states = (0..if recurrent { state_slots } else { 0 })
            .map(|_| {
                self.cfg
                    .layer_kinds
                    .iter()
                    .map(|k| match (k, &self.cfg.gdn) {
                        (LayerKind::LinearAttention, Some(g)) => Some(b.new_gdn_state(g)),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        let steps = B::Step::default();
        Ok(DecoderBatchState { pool, pool_layers, kv_bytes, block_size, num_blocks, states, mtp_layer, steps })
    }

    /// Checks `batch` against the pool and the model before any work: rows
    /// back to back, block tables long enough and inside the pool, state
    /// slots where the model has recurrent layers, token ids in the vocabulary.
    pub(super) fn check_batch(&self, state: &DecoderBatchState<B>, tokens: &[u32], batch: &BatchLayout) -> Result<()> {
        let bad = |what: String| Err(Error::Invalid(format!("batch: {what}")));
        if batch.block_size != state.block_size {
            return bad(format!("block size {} for a pool of {}", batch.block_size, state.block_size));
        }
        if tokens.is_empty() || tokens.len() != batch.rows() {
            return bad(format!("{} tokens for {} rows", tokens.len(), batch.rows()));
        }
        let recurrent = !state.states.is_empty();
        let mut next = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.rows.start != next || s.is_empty() {
                return bad(format!("sequence {i}'s rows {:?} do not follow row {next}", s.rows));
            }
            next = s.rows.end;
            if s.block_table.len() * batch.block_size < s.context_len() {
                return bad(format!("sequence {i}: {} blocks for {} positions", s.block_table.len(), s.context_len()));
            }
            if let Some(&b) = s.block_table.iter().find(|&&b| b as usize >= state.num_blocks) {
                return bad(format!("sequence {i}: block {b} is past the pool's {}", state.num_blocks));
            }
            match s.state_slot {
                Some(slot) if recurrent => {
                    state.slot(slot)?;
                }
                None if recurrent => return bad(format!("sequence {i} has no recurrent-state slot")),
                _ => {}
            }
            let mut last = 0;
            for &(n, slot) in &s.snapshots {
                if !recurrent || n <= last || n > s.len() {
                    return bad(format!(
                        "sequence {i}: snapshot after {n} rows of {} (increasing, within its rows)",
                        s.len()
                    ));
                }
                if s.state_slot == Some(slot) || batch.seqs.iter().any(|o| o.state_slot == Some(slot)) {
                    return bad(format!("sequence {i}: snapshot slot {slot} is a running sequence's"));
                }
                state.slot(slot)?;
                last = n;
            }
            let max = self.cfg.max_position_embeddings;
            if s.context_len() > max {
                return bad(format!("sequence {i}: {} positions exceed the model's {max}", s.context_len()));
            }
        }
        if let Some(&r) = batch.logits_rows.iter().chain(&batch.hidden_rows).find(|&&r| r >= batch.rows()) {
            return bad(format!("logits or hidden row {r} of {} rows", batch.rows()));
        }
        if !batch.mrope_positions.is_empty() {
            if batch.mrope_positions.len() != batch.rows() {
                return bad(format!("{} multimodal positions for {} rows", batch.mrope_positions.len(), batch.rows()));
            }
            if !self.backend.capabilities().multimodal_positions {
                return bad(format!("images are not supported on the {} backend yet", self.backend.name()));
            }
        }
        let h = self.cfg.hidden_size;
        let mut next = 0;
        for e in &batch.embeds {
            let n = e.take.len();
            if e.row < next || e.row + n > batch.rows() || e.take.end * h > e.values.len() || n == 0 {
                return bad(format!(
                    "input embeddings for rows {}..{} (of {}) from {} values of width {h}",
                    e.row,
                    e.row + n,
                    batch.rows(),
                    e.values.len()
                ));
            }
            next = e.row + n;
        }
        Ok(())
    }

    /// Embedding, every layer, the final norm and the head over the batch's
    /// rows: the logits of `batch.logits_rows` (None when it names no row:
    /// a step of prompt chunks only runs no zero-row head on a device), and
    /// the final normed hidden states of `batch.hidden_rows` (None when it
    /// names none).
    pub(super) fn forward_batch_of(
        &self,
        state: &mut DecoderBatchState<B>,
        tokens: &[u32],
        batch: &BatchLayout,
    ) -> Result<BatchHeads<B::Act>> {
        self.check_batch(state, tokens, batch)?;
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let active = self.adapters.active(batch.seqs.iter().map(|s| (s.rows.clone(), s.adapter)))?;
        let (h, normed) = self.layers_batch(state, tokens, batch, &active)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let rows = &batch.logits_rows;
        let hidden = (!batch.hidden_rows.is_empty()).then(|| match &normed {
            Some(x) => b.gather_rows(x, &batch.hidden_rows),
            None => b.rms_norm(&b.gather_rows(&h, &batch.hidden_rows), &self.norm, eps),
        });
        let logits = (!rows.is_empty()).then(|| match normed {
            Some(x) => b.linear(&b.gather_rows(&x, rows), head, None),
            None => b.linear_normed(&b.gather_rows(&h, rows), &self.norm, eps, head, None),
        });
        Ok(BatchHeads { logits, hidden })
    }

    /// The rows a decode step of `batch` is recorded with, where the backend
    /// records it ([`crate::backend::Backend::batch_step_rows`]) and its work
    /// depends on the step only through the tokens and the batch table: one
    /// row a sequence, no recurrent states (each sequence's lives in its own
    /// slot), adapters, images, snapshots or hidden states, and every row
    /// picked where the logits are. None: the step runs as it comes.
    pub(super) fn recorded_rows(
        &self,
        state: &DecoderBatchState<B>,
        batch: &BatchLayout,
        picks: &[Option<RowPick>],
    ) -> Option<usize> {
        let rows = batch.rows();
        let plain = batch.seqs.iter().all(|s| s.len() == 1 && s.snapshots.is_empty() && s.adapter.is_none());
        let every_row_picked =
            batch.logits_rows.iter().copied().eq(0..rows) && picks.len() == rows && picks.iter().all(Option::is_some);
        let moe = self.layers.iter().any(|l| matches!(l.ffn, FeedForward::Sparse(_)));
        let routed_on_device = self.layers.iter().all(|l| match &l.ffn {
            FeedForward::Sparse(moe) => moe.routes_on_device(&self.backend),
            _ => true,
        });
        let ok = plain
            && every_row_picked
            && routed_on_device
            && state.states.is_empty()
            && batch.hidden_rows.is_empty()
            && batch.mrope_positions.is_empty()
            && batch.embeds.is_empty();
        ok.then(|| self.backend.batch_step_rows(rows, moe)).flatten()
    }

    /// A decode step's picks through the backend's recording of its size
    /// (`padded` rows, from [`Self::recorded_rows`]): the rows past the
    /// batch's are one-token sequences at position 0 in the pool's spare
    /// block, whose logits nobody reads.
    pub(super) fn forward_batch_recorded(
        &self,
        state: &mut DecoderBatchState<B>,
        tokens: &[u32],
        batch: &BatchLayout,
        picks: &[Option<RowPick>],
        padded: usize,
    ) -> Result<Vec<u32>> {
        self.check_batch(state, tokens, batch)?;
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let rows = batch.rows();
        let (all_tokens, layout) = pad_rows(tokens, batch, padded, state.num_blocks as u32);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let none = super::adapters::Active::none();
        let mut steps = std::mem::take(&mut state.steps);
        let out = b.run_batch_step(
            &mut steps,
            &all_tokens,
            &layout,
            &mut || {
                let (h, normed) = self.layers_batch(state, &all_tokens, &layout, &none)?;
                Ok(normed.unwrap_or_else(|| b.rms_norm(&h, &self.norm, eps)))
            },
            &mut |normed| {
                let real = (rows < padded).then(|| b.slice_rows(normed, 0..rows));
                let logits = b.linear(real.as_ref().unwrap_or(normed), head, None);
                Ok(pick_rows(b, &logits, picks)?.0)
            },
        );
        state.steps = steps;
        out
    }

    /// Embedding and every layer over the batch's rows: the residual stream
    /// after the last layer, and its final norm where the last layer's
    /// output was added with it fused.
    fn layers_batch(
        &self,
        state: &mut DecoderBatchState<B>,
        tokens: &[u32],
        batch: &BatchLayout,
        active: &super::adapters::Active<B::Weight>,
    ) -> Result<(B::Act, Option<B::Act>)> {
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let DecoderBatchState { pool, pool_layers, states, .. } = state;
        // Each sequence's slot, in batch order (slots are distinct).
        let slots: Vec<usize> = batch.seqs.iter().filter_map(|s| s.state_slot.map(|x| x as usize)).collect();
        let mut h = self.embed_batch(tokens, batch)?;
        let mut normed: Option<B::Act> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = BlockInput::new(&h, normed.as_ref(), &layer.input_layernorm, eps);
            let out = match &layer.mixer {
                Mixer::Attention(at) => {
                    let pool_layer = pool_layers[l].expect("attention layers have a place in the pool");
                    at.forward_batch(b, &self.cfg, &self.rope, x, pool, pool_layer, batch, &active.mixer(l))
                }
                Mixer::Linear(net) => {
                    let mut layer_states = slot_states(states, &slots, l)?;
                    let mut snapshots = Vec::new();
                    let out = net.forward_batch(b, x, &mut layer_states, batch, &mut snapshots, &active.mixer(l));
                    for (slot, snapshot) in snapshots {
                        states[slot as usize][l] = Some(snapshot);
                    }
                    out
                }
            };
            normed = out.add_into(b, &mut h, &layer.post_attention_layernorm, eps);
            let x = BlockInput::new(&h, normed.as_ref(), &layer.post_attention_layernorm, eps);
            let out = match &layer.ffn {
                FeedForward::Dense(mlp) => mlp.forward_block(b, x, &active.ffn(l)),
                FeedForward::Sparse(moe) => moe.forward(b, x),
            };
            let next_norm = self.layers.get(l + 1).map_or(&self.norm, |n| &n.input_layernorm);
            normed = out.add_into(b, &mut h, next_norm, eps);
        }
        Ok((h, normed))
    }
}

/// `tokens` and `batch` with `padded - rows` more one-token sequences after
/// the batch's: each at position 0 with block `spare` (outside every
/// sequence's blocks) for its context, so their keys and values go there.
fn pad_rows(tokens: &[u32], batch: &BatchLayout, padded: usize, spare: u32) -> (Vec<u32>, BatchLayout) {
    let rows = batch.rows();
    let mut all_tokens = tokens.to_vec();
    all_tokens.resize(padded, tokens.first().copied().unwrap_or(0));
    let mut seqs = batch.seqs.clone();
    seqs.extend((rows..padded).map(|r| BatchSeq {
        rows: r..r + 1,
        start: 0,
        block_table: vec![spare],
        state_slot: None,
        prompt: false,
        snapshots: Vec::new(),
        adapter: None,
    }));
    (all_tokens, BatchLayout::new(seqs, batch.block_size, (0..padded).collect()))
}

impl<B: ModelBackend + 'static> DecoderModel<B> {
    /// The rows' input embeddings: looked up by token id, except the rows
    /// the batch gives embeddings of (image tokens).
    pub(super) fn embed_batch(&self, tokens: &[u32], batch: &BatchLayout) -> Result<B::Act> {
        let b = &self.backend;
        let h = b.embed(&self.embed_tokens, tokens)?;
        if batch.embeds.is_empty() {
            return Ok(h);
        }
        let d = self.cfg.hidden_size;
        let mut parts = Vec::with_capacity(2 * batch.embeds.len() + 1);
        let mut next = 0;
        for e in &batch.embeds {
            if e.row > next {
                parts.push(b.slice_rows(&h, next..e.row));
            }
            let values = &e.values[e.take.start * d..e.take.end * d];
            parts.push(b.act_from_host(e.take.len(), d, values));
            next = e.row + e.take.len();
        }
        if next < tokens.len() {
            parts.push(b.slice_rows(&h, next..tokens.len()));
        }
        Ok(b.concat_rows(&parts))
    }
}

/// Layer `layer`'s state in each of `slots`, in that order: distinct slots
/// give disjoint borrows.
fn slot_states<'a, S>(states: &'a mut [Vec<Option<S>>], slots: &[usize], layer: usize) -> Result<Vec<&'a mut S>> {
    let mut by_slot: Vec<Option<&'a mut S>> = states.iter_mut().map(|per_layer| per_layer[layer].as_mut()).collect();
    slots
        .iter()
        .map(|&s| {
            by_slot
                .get_mut(s)
                .and_then(Option::take)
                .ok_or_else(|| Error::Invalid(format!("batch: state slot {s} is used twice or holds no state")))
        })
        .collect()
}

/// The picks of the rows of `logits` that have one in `picks` (made by the
/// backend where the logits are), and the host logits of the others, each
/// in row order. No picks: every row's logits.
pub(super) fn pick_rows<B: ModelBackend>(
    b: &B,
    logits: &B::Act,
    picks: &[Option<RowPick>],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let picked: Vec<(usize, &RowPick)> = picks.iter().enumerate().filter_map(|(r, p)| Some((r, p.as_ref()?))).collect();
    let rest: Vec<usize> = (0..b.rows(logits)).filter(|&r| picks.get(r).is_none_or(Option::is_none)).collect();
    let ids = b.sample_rows(logits, &picked)?;
    let host = match rest.len() {
        0 => Vec::new(),
        n if n == b.rows(logits) => b.to_host(logits),
        _ => b.to_host(&b.gather_rows(logits, &rest)),
    };
    Ok((ids, host))
}
