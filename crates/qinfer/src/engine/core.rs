//! The continuous-batching step, without threads: requests join and leave
//! between steps; each step the scheduler gives a token budget to running
//! sequences first (decode tokens, unfinished prefills) and then admits
//! waiting ones in arrival order, while blocks and state slots last; the
//! runner runs the step and samples; finished sequences give their blocks
//! back. When blocks run out, the newest running sequence is preempted and
//! recomputed later, so a request that fits alone never fails.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::adaptive::{DraftCost, StepCost, worth};
use super::draft::{DraftWant, Drafter};
use super::encoding::ImageQueue;
use super::mtp;
use super::prefix::{BlockAt, PlannedSnapshot, PrefixCache, PrefixStats, SnapshotAt, register_full_blocks, spill};
use super::request::{FinishReason, Output, Pooling, Request, RequestId, Task};
use super::sequence::Sequence;
use super::speculative::{Proposer, SpeculativeStats, ngram_lookup};
use crate::kv::host_tier::{HostTier, HostTierStats, Kind};
use crate::kv::snapshots::SnapshotCache;
use crate::models::LanguageModel;
use crate::runner::media::Media;
use crate::runner::{HiddenRows, Runner, RunnerConfig, StepSeq};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

use super::config::Checked;
pub use super::config::{EngineConfig, validate};

/// What [`EngineCore::snapshots`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// Snapshots kept, and the state slots that may hold them.
    pub kept: usize,
    pub slots: usize,
    /// Bytes of one snapshot (every recurrent layer's state).
    pub bytes_each: usize,
    /// Snapshots evicted so far.
    pub evicted: u64,
}

pub struct EngineCore {
    runner: Runner,
    tokenizer: Option<Arc<Tokenizer>>,
    cfg: EngineConfig,
    seqs: HashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    /// In admission order: the last is the newest (preempted first).
    running: Vec<RequestId>,
    /// Prefill chunks of recurrent models end at multiples of this, so a
    /// prompt split across steps computes as it does in one piece.
    align: usize,
    vocab: usize,
    preemptions: usize,
    prefix: Option<PrefixCache>,
    speculative: SpeculativeStats,
    /// Decode-only steps' time against their rows (adaptive speculation).
    step_cost: StepCost,
    /// A draft model's seconds a proposed draft (adaptive speculation).
    draft_cost: DraftCost,
    /// The draft model's proposer (with [`Proposer::Draft`]).
    drafter: Option<Drafter>,
    /// Requests whose images are going through the vision tower; each
    /// joins `waiting` once they are through.
    encoding: ImageQueue,
    /// How long recent steps' forwards took (a moving average): the time
    /// the vision tower may take before a step.
    step_time: Option<Duration>,
    /// Requests that ended in an error of their own (an image the tower
    /// failed on), for [`EngineCore::take_failed`].
    failed: Vec<(RequestId, Error)>,
}

impl EngineCore {
    pub fn new(model: Arc<dyn LanguageModel>, tokenizer: Option<Arc<Tokenizer>>, cfg: EngineConfig) -> Result<Self> {
        Self::with_draft(model, tokenizer, cfg, None)
    }

    /// An engine whose speculative decoding drafts with `draft` (which
    /// [`Proposer::Draft`] needs, and no other proposer takes).
    pub fn with_draft(
        model: Arc<dyn LanguageModel>,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: EngineConfig,
        draft: Option<Arc<dyn LanguageModel>>,
    ) -> Result<Self> {
        let drafts_with_model = cfg.speculative.is_some_and(|s| s.proposer == Proposer::Draft);
        if drafts_with_model != draft.is_some() {
            return Err(Error::Invalid(if drafts_with_model {
                "draft-model speculative decoding needs a draft model".into()
            } else {
                "a draft model was given without draft-model speculative decoding".into()
            }));
        }
        let recurrent = model.config().gdn.is_some();
        let Checked { align, snapshot_slots } = cfg.check(model.as_ref())?;
        let vocab = model.config().vocab_size;
        let verify_slots = match cfg.speculative {
            Some(spec) if recurrent => spec.verify_slots(model.config().recurrent_state_values() * 4, cfg.max_num_seqs),
            _ => 0,
        };
        let mut runner = Runner::new(
            model,
            RunnerConfig {
                num_blocks: cfg.num_blocks,
                block_size: cfg.block_size,
                state_slots: cfg.max_num_seqs,
                snapshot_slots,
                verify_slots,
                prefix_cache: cfg.prefix_cache.is_some(),
            },
        )?;
        let prefix = cfg.prefix_cache.map(|p| {
            let host = (p.host_bytes > 0).then(|| HostTier::new(p.host_bytes));
            let mut snapshots =
                recurrent.then(|| SnapshotCache::new(p.snapshot_interval, cfg.max_num_seqs as u32, snapshot_slots));
            runner.blocks.set_spill(host.is_some());
            if let Some(s) = &mut snapshots {
                s.set_spill(host.is_some());
            }
            PrefixCache { snapshots, host, stats: PrefixStats::default() }
        });
        let drafter = match draft {
            Some(d) => {
                Some(Drafter::new(d, runner.model().as_ref(), cfg.num_blocks, cfg.block_size, cfg.max_batched_tokens)?)
            }
            None => None,
        };
        Ok(EngineCore {
            drafter,
            runner,
            tokenizer,
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            align,
            vocab,
            preemptions: 0,
            prefix,
            speculative: SpeculativeStats::default(),
            step_cost: StepCost::default(),
            draft_cost: DraftCost::default(),
            encoding: ImageQueue::default(),
            step_time: None,
            failed: Vec::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn kv_bytes(&self) -> usize {
        self.runner.kv_bytes()
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    /// The drafts the MTP head proposed for request `id`'s next step (empty
    /// when it proposed none).
    pub fn proposed_drafts(&self, id: RequestId) -> &[u32] {
        self.seqs.get(&id).map_or(&[], |s| &s.proposed)
    }

    /// Speculative decoding's counters so far.
    pub fn speculative_stats(&self) -> SpeculativeStats {
        self.speculative
    }

    /// Requests waiting or running.
    pub fn num_unfinished(&self) -> usize {
        self.seqs.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests that failed on their own since the last call, removed from
    /// the engine: each with its error (the other requests go on).
    pub fn take_failed(&mut self) -> Vec<(RequestId, Error)> {
        std::mem::take(&mut self.failed)
    }

    /// Runs the vision tower over queued images: while other requests run,
    /// for about as long as one of their recent steps (each of their tokens
    /// then waits about one step longer, not the whole encoding); all at
    /// once otherwise.
    fn encode_images(&mut self) {
        if self.encoding.is_empty() {
            return;
        }
        let busy = !self.running.is_empty() || !self.waiting.is_empty();
        let budget = if busy { self.step_time.unwrap_or(Duration::ZERO) } else { Duration::MAX };
        let done = self.encoding.advance(self.runner.model().as_ref(), budget);
        self.waiting.extend(done.ready);
        for (id, e) in done.failed {
            self.seqs.remove(&id);
            self.failed.push((id, e));
        }
    }

    /// Requests not yet running: queued, or with images being encoded.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.encoding.len()
    }

    /// KV blocks held by requests, and the pool's size.
    pub fn blocks_used(&self) -> (usize, usize) {
        let pool = &self.runner.blocks;
        (pool.num_held(), pool.num_blocks())
    }

    /// The prefix cache's counters (None when it is off).
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(|p| p.stats)
    }

    /// Blocks kept in the prefix cache, and cached blocks evicted so far.
    pub fn cached_blocks(&self) -> (usize, u64) {
        (self.runner.blocks.num_cached(), self.runner.blocks.evictions())
    }

    /// The host tier's bytes, entries and counters (None without one).
    pub fn host_tier(&self) -> Option<(usize, usize, HostTierStats)> {
        let host = self.prefix.as_ref()?.host.as_ref()?;
        Some((host.bytes(), host.len(), host.stats()))
    }

    /// The recurrent-state snapshots of the prefix cache (all zero without
    /// them).
    pub fn snapshots(&self) -> SnapshotStats {
        match self.prefix.as_ref().and_then(|p| p.snapshots.as_ref()) {
            Some(s) => SnapshotStats {
                kept: s.num_cached(),
                slots: s.num_slots(),
                bytes_each: self.runner.model().config().recurrent_state_values() * 4,
                evicted: s.evictions(),
            },
            None => SnapshotStats::default(),
        }
    }

    /// Every request's id, waiting or running.
    pub fn request_ids(&self) -> Vec<RequestId> {
        self.seqs.keys().copied().collect()
    }

    /// Every block and state slot is free (true once no request is left).
    pub fn pools_whole(&self) -> bool {
        self.runner.blocks.is_whole()
            && self.runner.slots.is_whole()
            && self.runner.verify_slots_whole()
            && self.drafter.as_ref().is_none_or(Drafter::is_whole)
            && self.prefix.as_ref().is_none_or(PrefixCache::is_whole)
    }

    /// Checks `req` against the engine's limits: an error names the limit.
    pub fn validate(&self, req: &Request) -> Result<()> {
        if let Some(id) = req.adapter
            && !self.runner.model().has_adapter(id)
        {
            return Err(Error::Invalid(format!("LoRA adapter {id} is not loaded")));
        }
        validate(req, &self.cfg, self.vocab)
    }

    /// Queues a request; it runs from the next step on.
    pub fn add(&mut self, id: RequestId, req: Request) -> Result<()> {
        self.validate(&req)?;
        if self.seqs.contains_key(&id) {
            return Err(Error::Invalid(format!("request {id} is already queued")));
        }
        let media = match req.images.is_empty() {
            true => None,
            false => Some(Arc::new(Media::new(self.runner.model().as_ref(), &req.prompt, &req.images)?)),
        };
        let images = req.images.clone();
        let seq = Sequence::new(id, req, media.clone())?;
        match media {
            Some(media) => self.encoding.push(self.runner.model().as_ref(), id, media, &images)?,
            None => self.waiting.push_back(id),
        }
        self.seqs.insert(id, seq);
        Ok(())
    }

    /// Ends a request now, its blocks and slot returned: its last output
    /// (finish reason `Abort`), or None when no such request is left.
    pub fn abort(&mut self, id: RequestId) -> Option<Output> {
        let mut seq = self.seqs.remove(&id)?;
        self.waiting.retain(|&w| w != id);
        self.encoding.remove(id);
        self.running.retain(|&r| r != id);
        self.free(&mut seq);
        let tok = self.tokenizer.clone();
        seq.take_output(Some(FinishReason::Abort), tok.as_deref()).ok()
    }

    fn free(&mut self, seq: &mut Sequence) {
        seq.blocks.release(&mut self.runner.blocks);
        if let Some(d) = &mut self.drafter {
            d.release(seq.id);
        }
        seq.registered = 0;
        if let Some(slot) = seq.state_slot.take() {
            self.runner.slots.release(slot);
        }
    }

    /// Takes `id` off the running list and back to the front of the queue,
    /// its cache given up: it is recomputed when it runs again.
    fn preempt(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        let mut seq = self.seqs.remove(&id).expect("running sequences are known");
        self.free(&mut seq);
        seq.computed = 0;
        seq.prefill_len = seq.tokens.len();
        seq.pooled.clear();
        seq.preemptions += 1;
        self.preemptions += 1;
        self.seqs.insert(id, seq);
        self.waiting.push_front(id);
    }

    /// This step's plan: (request, tokens to compute), running ones first.
    fn schedule(&mut self) -> Result<Vec<(RequestId, usize)>> {
        let mut budget = self.cfg.max_batched_tokens;
        let mut plan = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let n = chunk(&self.seqs[&id], budget, self.align);
            if n == 0 {
                i += 1;
                continue;
            }
            // Make room, preempting the newest running sequences (this one last).
            let mut scheduled = true;
            loop {
                let seq = self.seqs.get_mut(&id).expect("running sequences are known");
                let target = seq.computed + n;
                if seq.blocks.grow_to(target, &mut self.runner.blocks) {
                    break;
                }
                let victim = *self.running.last().expect("this sequence is running");
                self.preempt(victim);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            plan.push((id, n));
            budget -= n;
            i += 1;
        }
        // Admit waiting requests in arrival order while everything they need
        // is free, each starting after the longest prefix cached for it.
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            if self.runner.recurrent() && self.runner.slots.num_free() == 0 {
                break;
            }
            if let Some(p) = &mut self.prefix {
                // Blocks evicted so far this step reach the host tier before the lookup.
                spill(p, &mut self.runner)?;
            }
            let seq = self.seqs.get_mut(&id).expect("waiting sequences are known");
            // Mean and first-position pooling need every row computed.
            let every_row = matches!(seq.task, Task::Embed(Pooling::Mean | Pooling::Cls));
            let hit = self.prefix.as_mut().filter(|_| !every_row).and_then(|p| p.find(seq, &self.runner.blocks));
            if let Some(hit) = &hit {
                // Take up the pool's blocks first, so that copying the host's
                // back cannot evict them.
                for b in &hit.blocks {
                    if let BlockAt::Pool(b) = b {
                        self.runner.blocks.retain(*b);
                    }
                }
                let prefix = self.prefix.as_mut().expect("a hit comes from the prefix cache");
                for b in &hit.blocks {
                    let block = match *b {
                        BlockAt::Pool(b) => b,
                        BlockAt::Host(h) => {
                            let b = self.runner.blocks.allocate().expect("find counted the room");
                            // It may have been a cached block: copied out before it is overwritten.
                            spill(prefix, &mut self.runner)?;
                            let host = prefix.host.as_mut().expect("host blocks come from the host tier");
                            let bytes = host.take(Kind::Block, &h).expect("find saw it in the host tier");
                            self.runner.write_block(b, &bytes)?;
                            self.runner.blocks.register(b, h);
                            b
                        }
                    };
                    seq.blocks.blocks.push(block);
                }
                seq.computed = hit.tokens;
                seq.registered = seq.blocks.blocks.len();
            }
            let n = chunk(seq, budget, self.align);
            if n == 0 || !seq.blocks.grow_to(seq.computed + n, &mut self.runner.blocks) {
                seq.blocks.release(&mut self.runner.blocks);
                seq.computed = 0;
                seq.registered = 0;
                break;
            }
            if self.runner.recurrent() {
                let slot = self.runner.take_slot()?.expect("a free slot was counted above");
                seq.state_slot = Some(slot);
                match hit.as_ref().and_then(|h| h.snapshot) {
                    Some(SnapshotAt::Slot(snapshot)) => self.runner.copy_slot(snapshot, slot)?,
                    Some(SnapshotAt::Host(h)) => {
                        let host = self.prefix.as_mut().and_then(|p| p.host.as_mut());
                        let bytes = host.and_then(|t| t.get(Kind::Snapshot, &h)).expect("find saw it in the host tier");
                        self.runner.write_slot(slot, &bytes)?;
                    }
                    None => {}
                }
            }
            if seq.cached_tokens.is_none() {
                let cached = hit.as_ref().map_or(0, |h| h.tokens);
                seq.cached_tokens = Some(cached);
                if let Some(p) = &mut self.prefix {
                    p.count(seq.prompt_len, cached);
                }
            }
            self.waiting.pop_front();
            self.running.push(id);
            plan.push((id, n));
            budget -= n;
        }
        Ok(plan)
    }

    /// Appends draft tokens to the decode steps of `taken` that the
    /// proposer has some for, while the step's token budget, the KV pool's
    /// free blocks and (hybrids) the verification slots last (speculation
    /// never preempts anyone). Returns each sequence's verification slots:
    /// a recurrent model's states after each of its drafts go there, the
    /// one after the last accepted draft becoming the sequence's.
    fn propose_drafts(&mut self, taken: &mut [(Sequence, usize)]) -> Vec<Vec<u32>> {
        let mut verify = vec![Vec::new(); taken.len()];
        let Some(spec) = self.cfg.speculative else { return verify };
        let mut budget = self.cfg.max_batched_tokens.saturating_sub(taken.iter().map(|(_, n)| n).sum());
        let recurrent = self.runner.recurrent();
        let mut free_slots = self.runner.free_verify_slots();
        // The share of this step's time a draft adds (adaptive speculation):
        // its verification row, and a draft model's forward for it.
        let rows = taken.iter().map(|(_, n)| n).sum();
        let per_draft = if spec.proposer == Proposer::Draft { self.draft_cost.per_draft() } else { 0.0 };
        let row_share = self.step_cost.row_share(rows) + self.step_cost.draft_share(rows, per_draft);
        // (index into taken, most drafts it may take).
        let mut wants = Vec::new();
        for (i, (seq, n)) in taken.iter_mut().enumerate() {
            if budget == 0 || (recurrent && free_slots == 0) {
                break;
            }
            let decoding = *n == 1 && seq.pending() == 1 && seq.computed >= seq.prefill_len;
            // A draft model sees no images; the n-gram proposer's drafts would
            // need the image tokens' positions of a verify step it has no rows
            // for. The MTP head runs over the prompt's images as the target does.
            let sees_images = spec.proposer == Proposer::Mtp;
            if !decoding || seq.prompt_only() || seq.constraint.is_some() || (seq.media.is_some() && !sees_images) {
                continue;
            }
            if !seq.backoff.ready() {
                continue;
            }
            // Drafts past the output's or the context's end could never be kept.
            let room = (seq.stop.max_tokens.saturating_sub(seq.generated() + 1))
                .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len() + 1))
                .min(budget)
                .min(spec.draft_tokens)
                .min(if recurrent { free_slots } else { usize::MAX });
            let room = if spec.adaptive { worth(seq.acceptance.rate(), row_share, room) } else { room };
            if room > 0 {
                budget -= room;
                if recurrent {
                    free_slots -= room;
                }
                wants.push((i, room));
            }
        }
        let proposals = match (spec.proposer, &mut self.drafter) {
            (Proposer::Ngram { min, max }, _) => {
                wants.iter().map(|&(i, room)| ngram_lookup(&taken[i].0.tokens, min, max, room)).collect()
            }
            (Proposer::Draft, Some(drafter)) => {
                let asks: Vec<DraftWant<'_>> = (wants.iter())
                    .map(|&(i, k)| DraftWant { id: taken[i].0.id, tokens: &taken[i].0.tokens, k })
                    .collect();
                match drafter.propose(&asks) {
                    Ok(p) => {
                        let (secs, drafted) = drafter.last_draft_rounds();
                        if drafted > 0 {
                            self.draft_cost.observe(secs, drafted);
                        }
                        p
                    }
                    Err(e) => {
                        // The step goes on without drafts.
                        tracing::warn!("the draft model failed: {e}; this step verifies no drafts");
                        drafter.reset(asks.iter().map(|a| a.id));
                        return verify;
                    }
                }
            }
            (Proposer::Draft, None) => unreachable!("with_draft checked that a draft model is given"),
            (Proposer::Mtp, _) => (wants.iter())
                .map(|&(i, room)| {
                    let proposed = &mut taken[i].0.proposed;
                    proposed.truncate(room);
                    std::mem::take(proposed)
                })
                .collect(),
        };
        for (&(i, _), drafts) in wants.iter().zip(proposals) {
            let (seq, n) = &mut taken[i];

            if drafts.is_empty() || !seq.blocks.grow_to(seq.computed + 1 + drafts.len(), &mut self.runner.blocks) {
                continue;
            }
            if recurrent {
                verify[i] = self.runner.take_verify_slots(drafts.len());
                debug_assert_eq!(verify[i].len(), drafts.len(), "the slots were counted");
            }
            *n += drafts.len();
            seq.drafts = drafts.len();
            seq.tokens.extend(drafts);
        }
        verify
    }

    /// Runs one step; returns the outputs it produced (tokens, text, and the
    /// finish of requests that ended).
    pub fn step(&mut self) -> Result<Vec<Output>> {
        // Adapters retired since the last step go once no request holds them.
        let in_use: Vec<_> = self.seqs.values().filter_map(|s| s.adapter).collect();
        self.runner.model().release_adapters(&in_use);
        self.encode_images();
        let started = Instant::now();
        let plan = self.schedule()?;
        if plan.is_empty() {
            if !self.waiting.is_empty() && self.running.is_empty() {
                return Err(Error::Invalid("the waiting requests cannot be scheduled (KV pool too small)".into()));
            }
            return Ok(Vec::new());
        }
        let mut taken: Vec<(Sequence, usize)> =
            plan.iter().map(|&(id, n)| (self.seqs.remove(&id).expect("planned sequences are known"), n)).collect();
        let verify = self.propose_drafts(&mut taken);
        let bs = self.cfg.block_size;
        let snapshots: Vec<Vec<PlannedSnapshot>> = (taken.iter_mut())
            .map(|(seq, n)| self.prefix.as_mut().map_or_else(Vec::new, |p| p.plan_snapshots(seq, *n, bs)))
            .collect();
        // What this step's allocations evicted, copied out before the forward writes over it.
        let spilled = match &mut self.prefix {
            Some(p) => spill(p, &mut self.runner),
            None => Ok(()),
        };
        if let Err(e) = spilled {
            self.runner.release_verify_slots(verify.into_iter().flatten());
            for (mut seq, _) in taken {
                seq.drop_drafts();
                self.seqs.insert(seq.id, seq);
            }
            if let Some(p) = &mut self.prefix {
                for planned in snapshots {
                    p.finish_snapshots(planned, false);
                }
            }
            return Err(e);
        }
        // The MTP proposer's drafts per sequence.
        let mtp = self.cfg.speculative.filter(|s| s.proposer == Proposer::Mtp);
        // A step of decode tokens (and drafts) only: its time fits the step cost.
        let decode_rows = (taken.iter())
            .all(|(seq, n)| seq.computed >= seq.prefill_len && *n == 1 + seq.drafts)
            .then(|| taken.iter().map(|(_, n)| n).sum::<usize>());
        let forward_started = Instant::now();
        let result = {
            let mut step: Vec<StepSeq<'_>> = (taken.iter_mut().zip(&snapshots).zip(&verify))
                .map(|(((seq, n), snaps), verify)| {
                    let (start, n) = (seq.computed, *n);
                    let ends = start + n == seq.tokens.len();
                    let Sequence {
                        tokens,
                        blocks,
                        state_slot,
                        sampler,
                        constraint,
                        prefill_len,
                        task,
                        adapter,
                        drafts,
                        media,
                        ..
                    } = seq;
                    let mtp_rows = mtp.is_some();
                    let task: &Task = task;
                    let (hidden, scores) = match task {
                        Task::Generate if mtp_rows => (HiddenRows::All, None),
                        Task::Generate => (HiddenRows::None, None),
                        Task::Embed(Pooling::Last) if ends => (HiddenRows::Last, None),
                        Task::Embed(Pooling::Mean) => (HiddenRows::All, None),
                        Task::Embed(Pooling::Cls) if start == 0 => (HiddenRows::All, None),
                        Task::Embed(_) => (HiddenRows::None, None),
                        Task::Score(ids) => (HiddenRows::None, ends.then_some(&ids[..])),
                    };
                    let generates = *task == Task::Generate;
                    StepSeq {
                        tokens: &tokens[start..start + n],
                        start,
                        block_table: &blocks.blocks,
                        state_slot: *state_slot,
                        prompt: start < *prefill_len,
                        // The state after the last token and after each draft
                        // but the last (the slot holds the state after that).
                        snapshots: (snaps.iter().map(|p| (p.rows, p.slot)))
                            .chain(verify.iter().enumerate().map(|(j, &slot)| (j + 1, slot)))
                            .collect(),
                        sample: (ends && generates).then_some((sampler, &tokens[..])),
                        constraint: match constraint {
                            Some(c) if ends && generates => Some(c.as_mut()),
                            _ => None,
                        },
                        hidden,
                        scores,
                        adapter: *adapter,
                        media: media.as_deref(),
                        drafts: *drafts,
                    }
                })
                .collect();
            self.runner.step(&mut step)
        };
        if let Some(p) = &mut self.prefix {
            for planned in snapshots {
                p.finish_snapshots(planned, result.is_ok());
            }
        }
        let picks = match result {
            Ok(p) => {
                if let Some(rows) = decode_rows {
                    self.step_cost.observe(rows, forward_started.elapsed().as_secs_f64());
                }
                let took = started.elapsed();
                self.step_time = Some(self.step_time.map_or(took, |t| (t * 3 + took) / 4));
                p
            }
            Err(e) => {
                self.runner.release_verify_slots(verify.into_iter().flatten());
                for (mut seq, _) in taken {
                    seq.drop_drafts();
                    self.seqs.insert(seq.id, seq);
                }
                return Err(e);
            }
        };
        let tok = self.tokenizer.clone();
        let mut outputs = Vec::new();
        let width = self.runner.model().config().hidden_size;
        let mut mtp_rows = Vec::new();
        for (((mut seq, n), mut step), verify) in taken.into_iter().zip(picks).zip(verify) {
            if mtp.is_some() && mtp::follows(&seq) {
                let hidden = std::mem::take(&mut step.hidden);
                mtp_rows.push(mtp::StepRows { id: seq.id, start: seq.computed, hidden });
            }
            // A recurrent state that ran past a rejected draft goes back to
            // the one after the last accepted token.
            let rolled_back = match (verify.get(step.accepted), seq.state_slot) {
                (Some(&at), Some(slot)) => self.runner.copy_slot(at, slot),
                _ => Ok(()),
            };
            self.runner.release_verify_slots(verify);
            if let Err(e) = rolled_back {
                self.running.retain(|&r| r != seq.id);
                self.free(&mut seq);
                self.failed.push((seq.id, e));
                continue;
            }
            let start = seq.computed;
            seq.computed += n;
            // Drafts: the accepted ones stay, as computed tokens; the rows of
            // the rest are written over later. Pushed one by one, so that a
            // stop among them ends the output there.
            let mut finish = None;
            if seq.drafts > 0 {
                let drafted = seq.drafts;
                let drafts = seq.drop_drafts();
                seq.computed = seq.tokens.len();
                self.speculative.verifications += 1;
                self.speculative.drafted += drafted as u64;
                self.speculative.accepted += step.accepted as u64;
                seq.backoff.verified(step.accepted);
                seq.acceptance.verified(step.accepted, drafted);
                for (i, &t) in drafts[..step.accepted.min(drafted)].iter().enumerate() {
                    if let Some(lp) = step.draft_logprobs.get(i) {
                        seq.push_logprob(lp.clone());
                    }
                    finish = seq.push(t, tok.as_deref(), self.cfg.max_model_len)?;
                    seq.computed += 1;
                    if finish.is_some() {
                        break;
                    }
                }
            }
            if self.prefix.is_some() {
                register_full_blocks(&mut seq, &mut self.runner.blocks);
            }
            if seq.prompt_only() {
                seq.pool(start, &step.hidden, width, step.scores);
                if seq.computed == seq.prompt_len {
                    outputs.push(seq.pooled_output());
                    self.running.retain(|&r| r != seq.id);
                    self.free(&mut seq);
                } else {
                    self.seqs.insert(seq.id, seq);
                }
                continue;
            }
            let Some(token) = step.token else {
                self.seqs.insert(seq.id, seq);
                continue;
            };
            if let Some(lp) = step.logprob {
                seq.push_logprob(lp);
            }
            if finish.is_none() {
                finish = seq.push(token, tok.as_deref(), self.cfg.max_model_len)?;
            }
            if let Some(e) = &step.constraint_error {
                // The output can no longer follow its constraint: it ends here.
                tracing::warn!("request {}: {e}; ending it", seq.id);
                finish = finish.or(Some(FinishReason::Stop));
            }
            let out = seq.take_output(finish, tok.as_deref())?;
            if finish.is_some() {
                self.running.retain(|&r| r != seq.id);
                self.free(&mut seq);
            } else {
                self.seqs.insert(seq.id, seq);
            }
            outputs.push(out);
        }
        if let Some(spec) = self.cfg.speculative.filter(|s| s.proposer == Proposer::Mtp) {
            // As many as the next step's verification would take (its decode rows: the running sequences).
            let row_share = self.step_cost.row_share(self.running.len());
            let most = |seq: &Sequence| match spec.adaptive {
                true => worth(seq.acceptance.rate(), row_share, spec.draft_tokens),
                false => spec.draft_tokens,
            };
            mtp::propose(&mut self.runner, &mut self.seqs, mtp_rows, most);
        }
        Ok(outputs)
    }
}

/// Tokens `seq` computes this step out of `budget`: all it has pending if
/// they fit, else a chunk ending at a multiple of `align`.
fn chunk(seq: &Sequence, budget: usize, align: usize) -> usize {
    let pending = seq.pending();
    if pending <= budget {
        return pending;
    }
    let end = (seq.computed + budget) / align * align;
    end.saturating_sub(seq.computed)
}
