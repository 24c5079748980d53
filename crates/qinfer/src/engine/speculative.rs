//! Speculative decoding's engine side: proposing draft tokens for a decode
//! step (n-gram prompt lookup here; a draft model in `draft`), the
//! per-sequence backoff that stops proposing where drafts keep being
//! rejected, and the counters. The verification itself is the runner's (one
//! batched forward over the last token and the drafts, each sequence's
//! sampler accepting them).

/// Where draft tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proposer {
    /// Prompt lookup: the longest of the last `max`..`min` tokens that
    /// occurred before in the prompt or the output proposes what followed
    /// its latest earlier occurrence.
    Ngram { min: usize, max: usize },
    /// A draft model (given to the engine beside the target) proposes
    /// greedily.
    Draft,
    /// The model's own multi-token-prediction head (Qwen3-Next, Qwen3.5)
    /// proposes greedily, chained, after each step.
    Mtp,
}

/// Speculative decoding for an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub proposer: Proposer,
    /// Most draft tokens verified per sequence and step.
    pub draft_tokens: usize,
    /// Verify only as many drafts as measured step costs and each
    /// sequence's acceptance say pay ([`super::adaptive`]); otherwise every
    /// proposal up to `draft_tokens`.
    pub adaptive: bool,
}

impl SpeculativeConfig {
    /// Bytes of recurrent states kept for verification (hybrid models: the
    /// state after each draft token, to roll back to).
    pub const VERIFY_STATE_BYTES: usize = 1 << 30;

    /// Verification slots for a model whose recurrent states take
    /// `state_bytes` a sequence: enough for `max_num_seqs` sequences' drafts
    /// where [`Self::VERIFY_STATE_BYTES`] holds them, and for one
    /// sequence's at least.
    pub fn verify_slots(&self, state_bytes: usize, max_num_seqs: usize) -> usize {
        let fit = Self::VERIFY_STATE_BYTES / state_bytes.max(1);
        fit.min(max_num_seqs * self.draft_tokens).max(self.draft_tokens)
    }

    /// N-gram lookup over 4- down to 2-token suffixes, `draft_tokens` at a time.
    pub fn ngram(draft_tokens: usize) -> Self {
        SpeculativeConfig { proposer: Proposer::Ngram { min: 2, max: 4 }, draft_tokens, adaptive: false }
    }

    /// Speculation with the model's multi-token-prediction head,
    /// `draft_tokens` at a time.
    pub fn mtp(draft_tokens: usize) -> Self {
        SpeculativeConfig { proposer: Proposer::Mtp, draft_tokens, adaptive: false }
    }

    /// The same, verifying only the drafts measured costs say pay.
    pub fn adaptive(self) -> Self {
        SpeculativeConfig { adaptive: true, ..self }
    }

    /// Draft-model speculation, `draft_tokens` at a time.
    pub fn draft_model(draft_tokens: usize) -> Self {
        SpeculativeConfig { proposer: Proposer::Draft, draft_tokens, adaptive: false }
    }
}

/// Up to `k` tokens that followed the latest earlier occurrence of the
/// longest suffix of `tokens` (from `max` down to `min` tokens long) that
/// occurred before; none when no such suffix did.
pub fn ngram_lookup(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || min == 0 {
        return Vec::new();
    }
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Latest start of an earlier occurrence (not the suffix itself).
        if let Some(at) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
            let from = at + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// A sequence's speculation history: after a step whose drafts were all
/// rejected it stops proposing for 1, 2, 4 … 32 steps (doubling with each
/// such step in a row), so that text the proposer cannot predict costs
/// next to nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backoff {
    misses: u32,
    wait: u32,
}

impl Backoff {
    /// Whether to propose this step (counts a step waited).
    pub fn ready(&mut self) -> bool {
        if self.wait > 0 {
            self.wait -= 1;
            return false;
        }
        true
    }

    /// Whether the next [`Backoff::ready`] will say no.
    pub fn waiting(&self) -> bool {
        self.wait > 0
    }

    /// Notes a verification that accepted `accepted` drafts.
    pub fn verified(&mut self, accepted: usize) {
        if accepted > 0 {
            self.misses = 0;
        } else {
            self.misses = (self.misses + 1).min(6);
            self.wait = 1 << (self.misses - 1);
        }
    }
}

/// Speculation counters of an engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculativeStats {
    /// Sequence steps that verified drafts.
    pub verifications: u64,
    /// Draft tokens verified, and those accepted.
    pub drafted: u64,
    pub accepted: u64,
}

impl SpeculativeStats {
    /// Accepted drafts over drafted ones (0 before any).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 { 0.0 } else { self.accepted as f64 / self.drafted as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_proposes_what_followed_the_latest_longest_match() {
        // "1 2 3 4 9 | 1 2 3 5 6 | 1 2 3": the 3-token suffix last occurred
        // before 5 6.
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        assert_eq!(ngram_lookup(&t, 2, 4, 3), vec![5, 6, 1]);
        assert_eq!(ngram_lookup(&t, 2, 4, 1), vec![5]);
        // A longer suffix wins over a later shorter match.
        let t = [7, 8, 9, 1, 0, 8, 9, 2, 7, 8, 9];
        assert_eq!(ngram_lookup(&t, 2, 4, 2), vec![1, 0]);
        // Proposals stop at the end of the known tokens.
        let t = [5, 6, 5, 6];
        assert_eq!(ngram_lookup(&t, 2, 4, 8), vec![5, 6]);
        // No earlier occurrence of any suffix of at least `min` tokens.
        assert!(ngram_lookup(&[1, 2, 3, 4], 2, 4, 4).is_empty());
        assert!(ngram_lookup(&[1, 2, 1], 2, 4, 4).is_empty());
        assert_eq!(ngram_lookup(&[1, 2, 1], 1, 4, 4), vec![2, 1]);
        assert!(ngram_lookup(&[], 1, 4, 4).is_empty());
        assert!(ngram_lookup(&[3, 3, 3], 2, 4, 0).is_empty());
    }

    #[test]
    fn backoff_doubles_while_every_draft_is_rejected() {
        let mut b = Backoff::default();
        assert!(b.ready());
        let waits: Vec<usize> = (0..8)
            .map(|_| {
                b.verified(0);
                let mut waited = 0;
                while !b.ready() {
                    waited += 1;
                }
                waited
            })
            .collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 32, 32, 32]);
        b.verified(2);
        assert!(b.ready());
    }
}
