//! The draft-model proposer of speculative decoding: a smaller model with
//! the target's vocabulary runs ahead of each speculating sequence,
//! greedily, in batched forwards of its own over its own paged KV cache.
//!
//! Its cache follows the target's tokens lazily: before proposing, each
//! sequence's draft cache is cut back to the longest prefix it shares with
//! the sequence's tokens (after a verification that is the accepted
//! drafts), and the rest (the correction token, or the prompt the first
//! time) is computed in the first of the `k` forwards that propose `k`
//! tokens. The last draft is never fed, so a sequence whose drafts were all
//! accepted has one accepted token and the next to catch up.

use std::collections::HashMap;
use std::sync::Arc;

use super::request::RequestId;
use crate::kv::blocks::BlockTable;
use crate::models::LanguageModel;
use crate::runner::{HiddenRows, Runner, RunnerConfig, StepSeq};
use crate::sampling::{Sampler, SamplingParams};
use crate::{Error, Result};

/// One sequence's state in the draft model's cache.
struct DraftSeq {
    blocks: BlockTable,
    /// The tokens whose keys and values the draft cache holds, in order.
    fed: Vec<u32>,
    sampler: Sampler,
}

/// What one sequence asks of [`Drafter::propose`].
pub struct DraftWant<'a> {
    pub id: RequestId,
    /// The sequence's tokens (prompt and output so far).
    pub tokens: &'a [u32],
    /// Most drafts to propose.
    pub k: usize,
}

pub struct Drafter {
    runner: Runner,
    seqs: HashMap<RequestId, DraftSeq>,
    /// Most tokens one sequence's catch-up computes in a step (a longer
    /// one is computed over several steps, proposing nothing meanwhile).
    max_catch_up: usize,
    /// The last proposal's forwards after the catch-up: their seconds and
    /// the drafts they picked (what a further draft costs, without the
    /// catch-up's prompt-sized forwards).
    last_draft_rounds: (f64, usize),
}

impl Drafter {
    /// A drafter running `draft` for `target`'s sequences, with a KV pool of
    /// `num_blocks` blocks of `block_size` positions.
    pub fn new(
        draft: Arc<dyn LanguageModel>,
        target: &dyn LanguageModel,
        num_blocks: usize,
        block_size: usize,
        max_catch_up: usize,
    ) -> Result<Self> {
        let (d, t) = (draft.config(), target.config());
        if d.gdn.is_some() {
            return Err(Error::Invalid(format!(
                "the draft model ({}) has Gated DeltaNet layers, whose states cannot be cut back to the accepted \
                 tokens; draft with an attention-only model",
                d.arch.name()
            )));
        }
        if d.vocab_size != t.vocab_size {
            return Err(Error::Invalid(format!(
                "the draft model's vocabulary has {} entries and the target's {}: a draft model must share the \
                 target's vocabulary",
                d.vocab_size, t.vocab_size
            )));
        }
        let runner = Runner::new(
            draft,
            RunnerConfig {
                num_blocks,
                block_size,
                state_slots: 0,
                snapshot_slots: 0,
                verify_slots: 0,
                prefix_cache: false,
            },
        )?;
        Ok(Drafter { runner, seqs: HashMap::new(), max_catch_up: max_catch_up.max(1), last_draft_rounds: (0.0, 0) })
    }

    /// Forgets sequence `id` (finished, aborted or preempted): its draft
    /// blocks go back to the pool.
    pub fn release(&mut self, id: RequestId) {
        if let Some(mut s) = self.seqs.remove(&id) {
            s.blocks.release(&mut self.runner.blocks);
        }
    }

    /// Every draft block is free (true once no sequence is left).
    pub fn is_whole(&self) -> bool {
        self.runner.blocks.is_whole()
    }

    /// Up to `want.k` greedy draft tokens for each sequence of `wants`, in
    /// `k` batched forwards of the draft model. A sequence gets none while
    /// its catch-up is longer than a step computes, or when the draft pool
    /// has no room for it.
    pub fn propose(&mut self, wants: &[DraftWant<'_>]) -> Result<Vec<Vec<u32>>> {
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); wants.len()];
        // The proposing sequences' states, out of the map for the forwards.
        let mut active = Vec::new();
        for (want, w) in wants.iter().enumerate() {
            if w.k == 0 || w.tokens.is_empty() {
                continue;
            }
            let mut seq = self.seqs.remove(&w.id).unwrap_or_else(|| DraftSeq {
                blocks: BlockTable::default(),
                fed: Vec::new(),
                sampler: Sampler::new(SamplingParams::default()).expect("greedy parameters are valid"),
            });
            // Keep what the cache shares with the tokens; the last token is
            // always computed again, since its row proposes the first draft.
            let shared = seq.fed.iter().zip(w.tokens).take_while(|(a, b)| a == b).count();
            seq.fed.truncate(shared.min(w.tokens.len() - 1));
            let from = seq.fed.len();
            let end = (from + self.max_catch_up).min(w.tokens.len());
            // Room for the catch-up and the k - 1 drafts fed after it.
            let room = if end == w.tokens.len() { end + w.k - 1 } else { end };
            if seq.blocks.grow_to(room, &mut self.runner.blocks) {
                active.push(Active { want, seq, from, end, going: true });
            } else {
                self.seqs.insert(w.id, seq);
            }
        }
        let done = rounds(&mut self.runner, wants, &mut active, &mut drafts);
        for a in active {
            self.seqs.insert(wants[a.want].id, a.seq);
        }
        self.last_draft_rounds = done?;
        Ok(drafts)
    }

    /// The last proposal's forwards after the catch-up: seconds, drafts.
    pub fn last_draft_rounds(&self) -> (f64, usize) {
        self.last_draft_rounds
    }

    /// Forgets the draft caches of sequences `ids` after a failed draft
    /// forward (what it wrote is no longer known to match).
    pub fn reset(&mut self, ids: impl IntoIterator<Item = RequestId>) {
        for id in ids {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.fed.clear();
            }
        }
    }
}

/// A proposing sequence during [`Drafter::propose`].
struct Active {
    /// Its index in the wants.
    want: usize,
    seq: DraftSeq,
    /// The catch-up: its tokens `from..end`.
    from: usize,
    end: usize,
    /// Still proposing.
    going: bool,
}

/// The draft forwards of one proposal: first each sequence's catch-up
/// (picking its first draft where the catch-up reaches the end of its
/// tokens), then one token a forward, the last draft in and the next one
/// out, until each has its `k`. Returns the seconds of the forwards after
/// the catch-up and the drafts they picked.
fn rounds(
    runner: &mut Runner,
    wants: &[DraftWant<'_>],
    active: &mut [Active],
    drafts: &mut [Vec<u32>],
) -> Result<(f64, usize)> {
    let mut timed = (0.0, 0);
    for round in 0.. {
        let started = std::time::Instant::now();
        let picks = {
            let mut step = Vec::new();
            for a in active.iter_mut().filter(|a| a.going) {
                let w = &wants[a.want];
                let (tokens, start, pick) = if round == 0 {
                    (&w.tokens[a.from..a.end], a.from, a.end == w.tokens.len())
                } else {
                    let d = &drafts[a.want];
                    (&d[d.len() - 1..], a.seq.fed.len(), true)
                };
                step.push(StepSeq {
                    tokens,
                    start,
                    block_table: &a.seq.blocks.blocks,
                    state_slot: None,
                    prompt: tokens.len() > 1,
                    snapshots: Vec::new(),
                    // Greedy without penalties: the context is not read.
                    sample: pick.then_some((&mut a.seq.sampler, tokens)),
                    constraint: None,
                    hidden: HiddenRows::None,
                    scores: None,
                    adapter: None,
                    media: None,
                    drafts: 0,
                });
            }
            if step.is_empty() {
                return Ok(timed);
            }
            forward(runner, &mut step)?
        };
        if round > 0 {
            timed.0 += started.elapsed().as_secs_f64();
            timed.1 += picks.iter().filter(|p| p.is_some()).count();
        }
        for (a, pick) in active.iter_mut().filter(|a| a.going).zip(picks) {
            let w = &wants[a.want];
            if round == 0 {
                a.seq.fed.extend_from_slice(&w.tokens[a.from..a.end]);
            } else {
                a.seq.fed.push(*drafts[a.want].last().expect("a later round follows a draft"));
            }
            match pick {
                Some(t) => drafts[a.want].push(t),
                None if round == 0 => {}
                None => return Err(Error::Invalid("the draft model picked no token".into())),
            }
            a.going = pick.is_some() && drafts[a.want].len() < w.k;
        }
    }
    unreachable!("the rounds end when no sequence is going")
}

/// One draft forward; each sequence's pick (None where it asked none).
fn forward(runner: &mut Runner, step: &mut [StepSeq<'_>]) -> Result<Vec<Option<u32>>> {
    Ok(runner.step(step)?.into_iter().map(|o| o.token).collect())
}
