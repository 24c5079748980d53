//! The multi-token-prediction proposer's engine side. After each step the
//! head runs over the rows every continuing generation kept (so its cache
//! follows the target's) and, for a sequence that decodes next, chains its
//! drafts for the next step: `Sequence::proposed`, which the next step's
//! verification takes.

use std::collections::HashMap;

use super::request::{RequestId, Task};
use super::sequence::Sequence;
use crate::runner::Runner;
use crate::runner::mtp::MtpRows;

/// A sequence's rows in a step, for the head: where they start and the
/// target's final normed hidden state of each.
pub(super) struct StepRows {
    pub id: RequestId,
    pub start: usize,
    pub hidden: Vec<f32>,
}

/// Whether `seq`'s steps give the head rows: generations (with or without
/// images).
pub(super) fn follows(seq: &Sequence) -> bool {
    seq.task == Task::Generate
}

/// Runs the head over the rows each sequence of `rows` kept (those still
/// in `seqs`) and stores up to `most(seq)` drafts for the ones that decode
/// next (each draft reads the whole head: none is chained that the next
/// step would not verify).
/// A failed head forward leaves every sequence without drafts (logged):
/// drafts only ever cost time.
pub(super) fn propose(
    runner: &mut Runner,
    seqs: &mut HashMap<RequestId, Sequence>,
    rows: Vec<StepRows>,
    most: impl Fn(&Sequence) -> usize,
) {
    let h = runner.model().config().hidden_size;
    let mut wants = Vec::with_capacity(rows.len());
    for r in rows {
        let Some(seq) = seqs.get_mut(&r.id) else { continue };
        seq.proposed.clear();
        // Rows kept: those computed (the rejected drafts' are not).
        let kept = seq.computed.saturating_sub(r.start).min(r.hidden.len() / h);
        if kept == 0 || seq.tokens.len() < r.start + kept + 1 {
            continue;
        }
        let decodes = seq.computed + 1 == seq.tokens.len() && seq.computed >= seq.prefill_len;
        let drafts = if decodes && seq.constraint.is_none() && !seq.backoff.waiting() { most(seq) } else { 0 };
        if drafts > 1 {
            // The chained drafts' positions (all but the last) need blocks;
            // short of them, the chain stops early.
            let _ = seq.blocks.grow_to(seq.computed + drafts - 1, &mut runner.blocks);
        }
        wants.push((r, kept, drafts));
    }
    let asks: Vec<MtpRows<'_>> = wants
        .iter()
        .map(|(r, kept, drafts)| {
            let seq = &seqs[&r.id];
            MtpRows {
                next: &seq.tokens[r.start + 1..r.start + kept + 1],
                start: r.start,
                hidden: &r.hidden[..kept * h],
                block_table: &seq.blocks.blocks,
                state_slot: seq.state_slot,
                drafts: *drafts,
                media: seq.media.as_deref(),
            }
        })
        .collect();
    match runner.mtp_propose(&asks) {
        Ok(proposals) => {
            for ((r, _, _), drafts) in wants.iter().zip(proposals) {
                if let Some(seq) = seqs.get_mut(&r.id) {
                    seq.proposed = drafts;
                }
            }
        }
        Err(e) => tracing::warn!("the MTP head failed: {e}; the next step verifies no drafts from it"),
    }
}
