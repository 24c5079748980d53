//! The multi-token-prediction head's part of a step: after the target's
//! forward, the head runs over the rows the target kept (its cache follows
//! the target's), then proposes chained greedy drafts after each
//! sequence's last row.

use super::Runner;
use super::media::{Media, place_rows};
use crate::kv::batch::{BatchLayout, BatchSeq};
use crate::{Error, Result};

/// One sequence's rows for the head after a step.
pub struct MtpRows<'a> {
    /// The token after each row's token (its successor in the sequence).
    pub next: &'a [u32],
    /// The rows' positions are `start..start + next.len()`.
    pub start: usize,
    /// `[next.len(), hidden_size]`: the target's final normed hidden state
    /// of each row.
    pub hidden: &'a [f32],
    /// Blocks holding the positions the head writes (the rows' and the
    /// chained drafts' but the last).
    pub block_table: &'a [u32],
    pub state_slot: Option<u32>,
    /// Draft tokens to propose after the last row (0: only keep the head's
    /// cache up to date).
    pub drafts: usize,
    /// The sequence's images: a row whose next token is an image token
    /// takes that token's input, and every row the target's three rotary
    /// positions at its own index.
    pub media: Option<&'a Media>,
}

impl Runner {
    /// Runs the head over `seqs`' rows and returns each one's drafts: the
    /// pick after its last row, then each next pick from the last draft
    /// and the head's own output, while its block table has room.
    pub fn mtp_propose(&mut self, seqs: &[MtpRows<'_>]) -> Result<Vec<Vec<u32>>> {
        let h = self.model.config().hidden_size;
        let bs = self.blocks.block_size();
        let mut drafts = vec![Vec::new(); seqs.len()];
        let seqs_in: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].next.is_empty()).collect();
        if seqs_in.is_empty() {
            return Ok(drafts);
        }
        let (mut tokens, mut hidden, mut parts, mut logits_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &i in &seqs_in {
            let s = &seqs[i];
            if s.hidden.len() != s.next.len() * h {
                return Err(Error::Invalid(format!(
                    "MTP rows: {} hidden values for {} rows",
                    s.hidden.len(),
                    s.next.len()
                )));
            }
            let rows = tokens.len()..tokens.len() + s.next.len();
            if s.drafts > 0 {
                logits_rows.push(rows.end - 1);
            }
            tokens.extend_from_slice(s.next);
            hidden.extend_from_slice(s.hidden);
            parts.push(row_seq(rows, s.start, s));
        }
        let mut layout = BatchLayout::new(parts, bs, logits_rows);
        if seqs_in.iter().any(|&i| seqs[i].media.is_some()) {
            for (&i, part) in seqs_in.iter().zip(&layout.seqs) {
                let s = &seqs[i];
                let at = s.start..s.start + s.next.len();
                place_rows(s.media, at, 1, part.rows.start, &mut layout.mrope_positions, &mut layout.embeds);
            }
        }
        let out = self.model.mtp_forward(self.state.as_mut(), &tokens, &hidden, &layout, true)?;
        // (sequence, its last position, the head's output there), one per
        // logits row, in order.
        let mut chains = Vec::new();
        let proposing = seqs_in.iter().filter(|&&i| seqs[i].drafts > 0);
        for (n, (&i, &pick)) in proposing.zip(&out.picks).enumerate() {
            let s = &seqs[i];
            drafts[i].push(pick);
            chains.push((i, s.start + s.next.len() - 1, out.hidden[n * h..(n + 1) * h].to_vec()));
        }
        for j in 1.. {
            // Sequences wanting a further draft whose next position has a block.
            chains.retain(|&(i, last, _)| seqs[i].drafts > j && last + j < seqs[i].block_table.len() * bs);
            if chains.is_empty() {
                break;
            }
            let (mut tokens, mut hidden, mut parts) = (Vec::new(), Vec::new(), Vec::new());
            for (n, (i, last, y)) in chains.iter().enumerate() {
                tokens.push(*drafts[*i].last().expect("chains start from a draft"));
                hidden.extend_from_slice(y);
                parts.push(row_seq(n..n + 1, last + j, &seqs[*i]));
            }
            let mut layout = BatchLayout::new(parts, bs, (0..chains.len()).collect());
            if chains.iter().any(|(i, _, _)| seqs[*i].media.is_some()) {
                for (n, (i, last, _)) in chains.iter().enumerate() {
                    let at = last + j..last + j + 1;
                    place_rows(seqs[*i].media, at, 1, n, &mut layout.mrope_positions, &mut layout.embeds);
                }
            }
            let out = self.model.mtp_forward(self.state.as_mut(), &tokens, &hidden, &layout, true)?;
            for (n, ((i, _, y), &pick)) in chains.iter_mut().zip(&out.picks).enumerate() {
                drafts[*i].push(pick);
                y.copy_from_slice(&out.hidden[n * h..(n + 1) * h]);
            }
        }
        Ok(drafts)
    }
}

fn row_seq(rows: std::ops::Range<usize>, start: usize, s: &MtpRows<'_>) -> BatchSeq {
    BatchSeq {
        rows,
        start,
        block_table: s.block_table.to_vec(),
        state_slot: s.state_slot,
        prompt: false,
        snapshots: Vec::new(),
        adapter: None,
    }
}
