//! Prefix caching in the scheduler: a request admitted takes the longest
//! prefix of its tokens whose blocks are cached (for hybrid models, ending
//! where a recurrent-state snapshot was kept) and computes only the rest;
//! full blocks are named in the cache as they are computed, and prompt
//! steps of hybrid models keep snapshots at every snapshot interval.

use super::sequence::Sequence;
use crate::Result;
use crate::kv::blocks::BlockPool;
use crate::kv::host_tier::{HostTier, Kind};
use crate::kv::prefix::BlockHash;
use crate::kv::snapshots::SnapshotCache;
use crate::models::LanguageModel;
use crate::runner::Runner;

/// How the prefix cache works for a model with recurrent layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// Positions between recurrent-state snapshots: a multiple of the block
    /// size and of the recurrent layers' chunk (hybrid models only).
    pub snapshot_interval: usize,
    /// Snapshots kept at most (hybrid models only).
    pub snapshot_slots: usize,
    /// Host memory for blocks and snapshots evicted from the device's
    /// pools, in bytes (0: none; evicted ones are dropped).
    pub host_bytes: usize,
}

impl PrefixCacheConfig {
    /// Recurrent-state snapshot memory unless configured otherwise.
    pub const DEFAULT_SNAPSHOT_BYTES: usize = 1 << 30;

    /// A snapshot every `interval` positions, as many as `snapshot_bytes`
    /// hold for `model` (but no more than a pool of `cached_tokens` could
    /// use).
    pub fn for_model(model: &dyn LanguageModel, interval: usize, snapshot_bytes: usize, cached_tokens: usize) -> Self {
        let per = model.config().recurrent_state_values() * 4;
        let slots = snapshot_bytes.checked_div(per).map_or(0, |n| n.min(cached_tokens / interval.max(1)));
        PrefixCacheConfig { snapshot_interval: interval, snapshot_slots: slots, host_bytes: 0 }
    }
}

/// Counters since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens of admitted requests (looked up in the cache).
    pub queried_tokens: u64,
    /// Of those, tokens served from the cache.
    pub hit_tokens: u64,
    /// Requests admitted, and those with a hit.
    pub queries: u64,
    pub hits: u64,
}

/// Where a hit's recurrent-state snapshot is.
#[derive(Debug, Clone, Copy)]
pub(super) enum SnapshotAt {
    /// In this state slot.
    Slot(u32),
    /// In the host tier, under this hash.
    Host(BlockHash),
}

/// Where one block of a hit is.
#[derive(Debug, Clone, Copy)]
pub(super) enum BlockAt {
    Pool(u32),
    /// In the host tier, under this hash (to copy back).
    Host(BlockHash),
}

/// A usable cached prefix: its length, where each of its blocks is, and
/// (hybrids) the snapshot at its end.
pub(super) struct Hit {
    pub tokens: usize,
    pub blocks: Vec<BlockAt>,
    pub snapshot: Option<SnapshotAt>,
}

/// What a step will snapshot for one sequence: after `rows` of its rows,
/// into `slot`, named `hash`.
pub(super) struct PlannedSnapshot {
    pub rows: usize,
    pub slot: u32,
    pub hash: BlockHash,
    /// The prompt's last snapshot (where its next turn would resume).
    pub last: bool,
}

pub(super) struct PrefixCache {
    /// Hybrid models: the snapshots.
    pub snapshots: Option<SnapshotCache>,
    /// Blocks and snapshots evicted to host memory (when configured).
    pub host: Option<HostTier>,
    pub stats: PrefixStats,
}

impl PrefixCache {
    /// The longest cached prefix of `seq`'s tokens that leaves at least one
    /// token to compute (its logits are needed): whole blocks, and for
    /// hybrid models a prefix ending at a kept snapshot.
    pub fn find(&mut self, seq: &mut Sequence, pool: &BlockPool) -> Option<Hit> {
        let bs = pool.block_size();
        seq.hashes.extend(&seq.tokens, bs);
        let hashes = seq.hashes.as_slice();
        let usable = (seq.tokens.len() - 1) / bs;
        // Blocks the pool holds, or else the host tier while the pool has
        // room to take them back (cached blocks this hit takes up are no room).
        let mut room = pool.num_free();
        let mut blocks = Vec::new();
        for h in &hashes[..usable] {
            if let Some(b) = pool.lookup(h) {
                if pool.ref_count(b) == 0 {
                    room -= 1;
                }
                blocks.push(BlockAt::Pool(b));
            } else if self.host.as_ref().is_some_and(|host| host.contains(Kind::Block, h)) {
                blocks.push(BlockAt::Host(*h));
            } else {
                break;
            }
        }
        let mut restores = 0;
        for (i, b) in blocks.iter().enumerate() {
            if matches!(b, BlockAt::Host(_)) {
                if restores == room {
                    blocks.truncate(i);
                    break;
                }
                restores += 1;
            }
        }
        let mut snapshot = None;
        if let Some(snaps) = &mut self.snapshots {
            let per = snaps.interval() / bs;
            let mut n = blocks.len() / per * per;
            while n > 0 {
                let h = &hashes[n - 1];
                if let Some(slot) = snaps.lookup(h) {
                    snapshot = Some(SnapshotAt::Slot(slot));
                    break;
                }
                if self.host.as_ref().is_some_and(|host| host.contains(Kind::Snapshot, h)) {
                    snapshot = Some(SnapshotAt::Host(*h));
                    break;
                }
                n -= per;
            }
            blocks.truncate(n);
        }
        let tokens = blocks.len() * bs;
        (tokens > 0).then_some(Hit { tokens, blocks, snapshot })
    }

    /// Counts an admission that found `hit` cached tokens.
    pub fn count(&mut self, prompt_tokens: usize, hit: usize) {
        self.stats.queries += 1;
        self.stats.queried_tokens += prompt_tokens as u64;
        if hit > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += hit as u64;
        }
    }

    /// Snapshots `seq`'s prompt step of `n` rows will keep: at each multiple
    /// of the interval it passes that no snapshot holds yet, while slots last.
    pub fn plan_snapshots(&mut self, seq: &mut Sequence, n: usize, block_size: usize) -> Vec<PlannedSnapshot> {
        let Some(snaps) = &mut self.snapshots else { return Vec::new() };
        let start = seq.computed;
        if start >= seq.prefill_len {
            return Vec::new();
        }
        seq.hashes.extend(&seq.tokens, block_size);
        let every = snaps.interval();
        let mut planned = Vec::new();
        let mut at = (start / every + 1) * every;
        while at <= start + n {
            let hash = seq.hashes.as_slice()[at / block_size - 1];
            if !snaps.contains(&hash) {
                let Some(slot) = snaps.reserve() else { break };
                let last = at + every > seq.prefill_len;
                planned.push(PlannedSnapshot { rows: at - start, slot, hash, last });
            }
            at += every;
        }
        planned
    }

    /// Keeps the snapshots a step wrote (`ok`), or gives their slots back.
    pub fn finish_snapshots(&mut self, planned: Vec<PlannedSnapshot>, ok: bool) {
        let Some(snaps) = &mut self.snapshots else { return };
        for p in planned {
            if ok {
                snaps.commit(p.slot, p.hash, p.last);
            } else {
                snaps.cancel(p.slot);
            }
        }
    }

    pub fn is_whole(&self) -> bool {
        self.snapshots.as_ref().is_none_or(SnapshotCache::is_whole)
    }
}

/// Copies the blocks and snapshots the pools evicted since the last call
/// into the host tier (before anything overwrites them); without a host
/// tier there is nothing to do.
pub(super) fn spill(prefix: &mut PrefixCache, runner: &mut Runner) -> Result<()> {
    let Some(host) = &mut prefix.host else { return Ok(()) };
    for (block, hash) in runner.blocks.take_evicted() {
        host.store(Kind::Block, hash, runner.read_block(block)?);
    }
    if let Some(snaps) = &mut prefix.snapshots {
        for (slot, hash) in snaps.take_evicted() {
            host.store(Kind::Snapshot, hash, runner.read_slot(slot)?);
        }
    }
    Ok(())
}

/// Names `seq`'s blocks that its computed tokens now fill.
pub(super) fn register_full_blocks(seq: &mut Sequence, pool: &mut BlockPool) {
    let bs = pool.block_size();
    let full = seq.computed / bs;
    if full <= seq.registered {
        return;
    }
    seq.hashes.extend(&seq.tokens, bs);
    for i in seq.registered..full {
        pool.register(seq.blocks.blocks[i], seq.hashes.as_slice()[i]);
    }
    seq.registered = full;
}
