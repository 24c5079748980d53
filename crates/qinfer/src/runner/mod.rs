//! One forward over a batch: the one place scheduled sequences become the
//! model's batch description (positions, slot mapping, block tables, state
//! slots), and each row that ends a sequence's known tokens is sampled with
//! that sequence's own sampler. Owns the model's batch storage (the paged
//! KV pool, the recurrent-state slots) and their bookkeeping.

pub mod media;
pub mod mtp;

use std::sync::Arc;

use self::media::Media;
use crate::kv::batch::{BatchLayout, BatchSeq};
use crate::kv::blocks::{BlockPool, SlotPool};
use crate::models::{BatchState, LanguageModel};
use crate::sampling::{RowPick, Sampler, TokenConstraint, TokenLogprob, apply_mask, token_logprob};
use crate::{Error, Result};

/// How much a runner holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Recurrent-state slots for running sequences (models with Gated
    /// DeltaNet layers; ignored otherwise).
    pub state_slots: usize,
    /// Further state slots for prefix-cache snapshots, numbered after the
    /// sequences' (ignored without recurrent layers).
    pub snapshot_slots: usize,
    /// Further state slots for the states after each draft token of a
    /// verification (speculative decoding), numbered after the snapshots'
    /// (ignored without recurrent layers).
    pub verify_slots: usize,
    /// Keep full blocks cached under their prefix hashes.
    pub prefix_cache: bool,
}

/// One sequence's part of a step.
pub struct StepSeq<'a> {
    /// Its new rows: tokens at positions `start..`.
    pub tokens: &'a [u32],
    pub start: usize,
    /// Blocks holding positions `[0, start + tokens.len())`.
    pub block_table: &'a [u32],
    pub state_slot: Option<u32>,
    /// The rows are part of a prompt (or a recompute), not a decode step.
    pub prompt: bool,
    /// Copy its recurrent states into these slots after so many of its rows.
    pub snapshots: Vec<(usize, u32)>,
    /// Pick the token after these rows with this sampler, given the
    /// sequence's tokens so far (for the repetition penalty).
    pub sample: Option<(&'a mut Sampler, &'a [u32])>,
    /// Pick only among the tokens this allows (told the pick).
    pub constraint: Option<&'a mut dyn TokenConstraint>,
    /// Return the final normed hidden states of these rows (pooling).
    pub hidden: HiddenRows,
    /// Return the last row's logits of these token ids (scoring).
    pub scores: Option<&'a [u32]>,
    /// The LoRA adapter its rows run with.
    pub adapter: Option<u64>,
    /// Its prompt's images: their tokens' inputs and everyone's positions.
    pub media: Option<&'a Media>,
    /// Its last rows are this many draft tokens to verify (speculative
    /// decoding): every row from the one before them on is picked by its
    /// sampler's acceptance rule ([`Sampler::verify`]; greedy ones where the
    /// logits are, keeping the drafts while they equal the picks).
    pub drafts: usize,
}

/// Which of a sequence's rows a step returns hidden states of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenRows {
    None,
    Last,
    All,
}

/// What a step returns for one sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOut {
    /// The token its sampler picked.
    pub token: Option<u32>,
    /// `[rows, hidden_size]`, the rows its `hidden` named.
    pub hidden: Vec<f32>,
    /// The logits of its `scores` ids.
    pub scores: Vec<f32>,
    /// The picked token's log probability, when its sampler asks for them.
    pub logprob: Option<TokenLogprob>,
    /// The constraint failed (or allowed nothing): the pick was made
    /// without it and the sequence should end.
    pub constraint_error: Option<String>,
    /// Of its drafts, how many were accepted: they come before `token`,
    /// which is the pick after the last of them.
    pub accepted: usize,
    /// The log probabilities of the accepted drafts (when asked for).
    pub draft_logprobs: Vec<TokenLogprob>,
}

pub struct Runner {
    model: Arc<dyn LanguageModel>,
    state: Box<dyn BatchState>,
    pub blocks: BlockPool,
    pub slots: SlotPool,
    /// Slots for the states after each draft token (numbered from `verify_base`).
    verify: SlotPool,
    verify_base: u32,
    recurrent: bool,
}

impl Runner {
    pub fn new(model: Arc<dyn LanguageModel>, cfg: RunnerConfig) -> Result<Self> {
        let recurrent = model.config().gdn.is_some();
        let (state_slots, snapshot_slots, verify_slots) =
            if recurrent { (cfg.state_slots, cfg.snapshot_slots, cfg.verify_slots) } else { (0, 0, 0) };
        let all = state_slots + snapshot_slots + verify_slots;
        let state = model.new_batch_state(cfg.num_blocks, cfg.block_size, all)?;
        Ok(Runner {
            model,
            state,
            blocks: BlockPool::with_cache(cfg.num_blocks, cfg.block_size, cfg.prefix_cache),
            slots: SlotPool::new(state_slots),
            verify: SlotPool::new(verify_slots),
            verify_base: u32::try_from(state_slots + snapshot_slots).expect("fewer than 2^32 state slots"),
            recurrent,
        })
    }

    pub fn model(&self) -> &Arc<dyn LanguageModel> {
        &self.model
    }

    /// Whether sequences need a recurrent-state slot.
    pub fn recurrent(&self) -> bool {
        self.recurrent
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> usize {
        self.state.kv_bytes()
    }

    /// A free recurrent-state slot, zeroed for a new sequence.
    pub fn take_slot(&mut self) -> Result<Option<u32>> {
        let Some(slot) = self.slots.allocate() else { return Ok(None) };
        self.model.reset_state_slot(self.state.as_mut(), slot)?;
        Ok(Some(slot))
    }

    /// Up to `n` free verification slots, now held (fewer when fewer are free).
    pub fn take_verify_slots(&mut self, n: usize) -> Vec<u32> {
        (0..n).map_while(|_| self.verify.allocate()).map(|s| self.verify_base + s).collect()
    }

    /// Free verification slots.
    pub fn free_verify_slots(&self) -> usize {
        self.verify.num_free()
    }

    /// Gives verification slots back.
    pub fn release_verify_slots(&mut self, slots: impl IntoIterator<Item = u32>) {
        for s in slots {
            self.verify.release(s - self.verify_base);
        }
    }

    /// Every verification slot is free.
    pub fn verify_slots_whole(&self) -> bool {
        self.verify.is_whole()
    }

    /// Copies slot `from`'s recurrent states into slot `to` (a snapshot of a
    /// sequence's state, for prefix caching and speculation).
    pub fn copy_slot(&mut self, from: u32, to: u32) -> Result<()> {
        self.model.copy_state_slot(self.state.as_mut(), from, to)
    }

    /// KV block `block` copied to host memory, and back.
    pub fn read_block(&mut self, block: u32) -> Result<Vec<u8>> {
        self.model.read_kv_block(self.state.as_mut(), block)
    }
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<()> {
        self.model.write_kv_block(self.state.as_mut(), block, bytes)
    }

    /// State slot `slot` copied to host memory, and back.
    pub fn read_slot(&mut self, slot: u32) -> Result<Vec<u8>> {
        self.model.read_state_slot(self.state.as_mut(), slot)
    }
    pub fn write_slot(&mut self, slot: u32, bytes: &[u8]) -> Result<()> {
        self.model.write_state_slot(self.state.as_mut(), slot, bytes)
    }

    /// Runs one forward over `seqs` and returns, for each, the token its
    /// sampler picked, the hidden states and the scores it asked for.
    pub fn step(&mut self, seqs: &mut [StepSeq<'_>]) -> Result<Vec<StepOut>> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut tokens = Vec::with_capacity(seqs.iter().map(|s| s.tokens.len()).sum());
        let mut parts = Vec::with_capacity(seqs.len());
        let (mut logits_rows, mut hidden_rows) = (Vec::new(), Vec::new());
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(Error::Invalid("a scheduled sequence has no new tokens".into()));
            }
            let rows = tokens.len()..tokens.len() + s.tokens.len();
            tokens.extend_from_slice(s.tokens);
            if s.drafts > 0 {
                check_drafts(s)?;
                logits_rows.extend(rows.end - 1 - s.drafts..rows.end);
            } else if s.sample.is_some() || s.scores.is_some() {
                logits_rows.push(rows.end - 1);
            }
            match s.hidden {
                HiddenRows::None => {}
                HiddenRows::Last => hidden_rows.push(rows.end - 1),
                HiddenRows::All => hidden_rows.extend(rows.clone()),
            }
            parts.push(BatchSeq {
                rows,
                start: s.start,
                block_table: s.block_table.to_vec(),
                state_slot: s.state_slot,
                prompt: s.prompt,
                snapshots: s.snapshots.clone(),
                adapter: s.adapter,
            });
        }
        let mut batch = BatchLayout::new(parts, self.blocks.block_size(), logits_rows);
        batch.hidden_rows = hidden_rows;
        if seqs.iter().any(|s| s.media.is_some()) {
            for (s, part) in seqs.iter().zip(&batch.seqs) {
                let at = s.start..s.start + s.tokens.len();
                media::place_rows(s.media, at, 0, part.rows.start, &mut batch.mrope_positions, &mut batch.embeds);
            }
        }
        // Picks that need no host state (no constraint, scores, logprobs,
        // bias or counted penalties) are made where the logits are; the
        // draws are taken from the samplers now, in batch order.
        let mut picks: Vec<Option<RowPick>> = Vec::with_capacity(batch.logits_rows.len());
        for s in seqs.iter_mut().filter(|s| s.sample.is_some() || s.scores.is_some()) {
            match (&mut s.sample, &s.constraint, s.scores) {
                (Some((sampler, context)), None, None) if s.drafts > 0 && sampler.params().verifies_on_device() => {
                    // Row i picks after the drafts before it (greedy: no draw).
                    let known = context.len() - s.drafts;
                    for i in 0..=s.drafts {
                        picks.push(Some(sampler.row_pick(&context[..known + i]).ok_or_else(|| {
                            Error::Invalid("draft tokens need a sampler that picks without host state".into())
                        })?));
                    }
                }
                (Some((sampler, context)), None, None) if s.drafts == 0 => picks.push(sampler.row_pick(context)),
                // Drafts verified on the host: every row's logits come back.
                _ => picks.extend((0..=s.drafts).map(|_| None)),
            }
        }
        let out = self.model.forward_batch(self.state.as_mut(), &tokens, &batch, &picks)?;
        let on_host = picks.iter().filter(|p| p.is_none()).count();
        let vocab = out.logits.len().checked_div(on_host).unwrap_or(0);
        let width = if batch.hidden_rows.is_empty() { 0 } else { out.hidden.len() / batch.hidden_rows.len() };
        let mut logit_rows = out.logits.chunks_exact(vocab.max(1));
        let mut picked = out.picks.iter().copied();
        let mut row_picks = picks.iter();
        let mut hidden_at = 0;
        let mut outs = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            let mut o = StepOut::default();
            let logits_row = s.sample.is_some() || s.scores.is_some();
            // Its logits rows (the drafts' too) and how many were picked where
            // the logits are: every draft row, or its one row's pick.
            let rows = if s.drafts > 0 { s.drafts + 1 } else { usize::from(logits_row) };
            let on_device = row_picks.by_ref().take(rows).filter(|p| p.is_some()).count();
            if on_device > 0 {
                let got: Vec<u32> = picked.by_ref().take(on_device).collect();
                if got.len() != on_device || (s.drafts > 0 && on_device != rows) {
                    return Err(Error::Invalid("the forward returned too few picks".into()));
                }
                let drafts = &s.tokens[s.tokens.len() - s.drafts..];
                o.accepted = drafts.iter().zip(&got).take_while(|(d, p)| d == p).count();
                o.token = Some(got[o.accepted]);
            } else if s.drafts > 0 {
                let rows: Vec<&[f32]> = logit_rows.by_ref().take(rows).collect();
                let (sampler, context) = s.sample.as_mut().expect("check_drafts saw a sampler");
                let known = context.len() - s.drafts;
                let mut v = sampler.verify(&rows, &context[known..], &context[..known]);
                o.accepted = v.accepted;
                o.token = Some(v.token);
                if sampler.params().logprobs.is_some() {
                    o.logprob = v.logprobs.pop();
                    o.draft_logprobs = v.logprobs;
                }
            } else if logits_row {
                let row = logit_rows.next().expect("one logits row per sampling or scoring sequence");
                if let Some(ids) = s.scores {
                    o.scores = ids.iter().map(|&t| row.get(t as usize).copied().unwrap_or(f32::NAN)).collect();
                }
                if let Some((sampler, context)) = &mut s.sample {
                    let mut logits = row.to_vec();
                    if let Some(c) = &mut s.constraint {
                        match c.allowed() {
                            Ok(Some(mask)) => {
                                if !apply_mask(&mut logits, &mask) {
                                    logits.copy_from_slice(row);
                                    o.constraint_error = Some("the constraint allows no token".into());
                                }
                            }
                            Ok(None) => {}
                            Err(e) => o.constraint_error = Some(e),
                        }
                    }
                    let token = sampler.sample(&mut logits, context);
                    if let Some(c) = &mut s.constraint
                        && o.constraint_error.is_none()
                        && let Err(e) = c.accept(token)
                    {
                        o.constraint_error = Some(e);
                    }
                    o.token = Some(token);
                    o.logprob = sampler.params().logprobs.map(|k| token_logprob(row, token, k));
                }
            }
            let n = match s.hidden {
                HiddenRows::None => 0,
                HiddenRows::Last => 1,
                HiddenRows::All => s.tokens.len(),
            };
            o.hidden = out.hidden[hidden_at * width..(hidden_at + n) * width].to_vec();
            hidden_at += n;
            outs.push(o);
        }
        Ok(outs)
    }
}

/// Drafts are verified by the sequence's sampler: a sequence with drafts
/// samples, without a constraint or scores, and its context ends with them.
fn check_drafts(s: &StepSeq<'_>) -> Result<()> {
    let ok = match &s.sample {
        Some((_, context)) => context.len() >= s.drafts && s.tokens.len() > s.drafts,
        None => false,
    };
    if !ok || s.constraint.is_some() || s.scores.is_some() {
        return Err(Error::Invalid(
            "draft tokens are verified only for sampling sequences without constraints or scores".into(),
        ));
    }
    Ok(())
}
