//! Recurrent-state snapshots for prefix caching of hybrid models. A Gated
//! DeltaNet layer's state after position `p` stands for every token before
//! it and cannot be rebuilt from cached keys and values, so a prefix of a
//! hybrid model is reusable only where a copy of that state was kept. While
//! a prompt is computed, its states are copied at every multiple of the
//! snapshot interval into snapshot slots (state slots of their own), named
//! by the hash of the block ending there; a later request with that prefix
//! copies the snapshot into its own slot and computes only the rest. Slots
//! are few (a state is large), so one is reused when none is free: first
//! the least recently used of the snapshots nobody has used yet that end
//! inside a prompt, then of the rest (a prompt's last snapshot, where its
//! next turn resumes, and every snapshot that has served a hit).

use std::collections::{BTreeMap, HashMap};

use super::prefix::BlockHash;

pub struct SnapshotCache {
    /// Positions between snapshots (a multiple of the block size and of the
    /// recurrent layers' chunk).
    interval: usize,
    /// The first state slot that holds snapshots; they take `num_slots` from it.
    first_slot: u32,
    hashes: Vec<Option<BlockHash>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Snapshots by when they were last written or used (oldest first):
    /// those evicted first, and the rest.
    lru: [BTreeMap<u64, u32>; 2],
    keep: Vec<bool>,
    used_at: Vec<u64>,
    clock: u64,
    free: Vec<u32>,
    /// Slots handed out for a step and not yet named or given back.
    reserved: usize,
    evictions: u64,
    /// Keep a list of the snapshots evicted (for a host tier).
    spill: bool,
    evicted: Vec<(u32, BlockHash)>,
}

impl SnapshotCache {
    pub fn new(interval: usize, first_slot: u32, num_slots: usize) -> Self {
        assert!(interval > 0, "a snapshot interval of at least one position");
        let n = u32::try_from(num_slots).expect("fewer than 2^32 snapshots");
        SnapshotCache {
            interval,
            first_slot,
            hashes: vec![None; num_slots],
            by_hash: HashMap::new(),
            lru: [BTreeMap::new(), BTreeMap::new()],
            keep: vec![false; num_slots],
            used_at: vec![0; num_slots],
            clock: 0,
            free: (0..n).rev().collect(),
            reserved: 0,
            evictions: 0,
            spill: false,
            evicted: Vec::new(),
        }
    }

    /// From now on, lists each snapshot it evicts (see
    /// [`SnapshotCache::take_evicted`]).
    pub fn set_spill(&mut self, spill: bool) {
        self.spill = spill;
    }

    /// The state slots of the snapshots evicted since the last call, with
    /// their hashes: intact until the next forward writes them.
    pub fn take_evicted(&mut self) -> Vec<(u32, BlockHash)> {
        std::mem::take(&mut self.evicted)
    }

    pub fn interval(&self) -> usize {
        self.interval
    }

    pub fn num_slots(&self) -> usize {
        self.hashes.len()
    }

    /// Snapshots kept.
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    /// Snapshots given up to make room, so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Marks snapshot `i` used now, kept longer from now on when `keep`.
    fn touch(&mut self, i: u32, keep: bool) {
        let s = i as usize;
        self.lru[self.keep[s] as usize].remove(&self.used_at[s]);
        self.keep[s] |= keep;
        self.clock += 1;
        self.used_at[s] = self.clock;
        self.lru[self.keep[s] as usize].insert(self.clock, i);
    }

    /// Whether a snapshot named `hash` is kept (without using it).
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.by_hash.contains_key(hash)
    }

    /// The state slot of the snapshot named `hash`, now the most recently
    /// used and kept longer (it has served a hit).
    pub fn lookup(&mut self, hash: &BlockHash) -> Option<u32> {
        let i = *self.by_hash.get(hash)?;
        self.touch(i, true);
        Some(self.first_slot + i)
    }

    /// A state slot to write a snapshot into during the next step: a free
    /// one, else the least recently used snapshot's (forgotten now). None
    /// when every slot is reserved.
    pub fn reserve(&mut self) -> Option<u32> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let (_, i) = self.lru[0].pop_first().or_else(|| self.lru[1].pop_first())?;
                self.keep[i as usize] = false;
                let hash = self.hashes[i as usize].take().expect("listed snapshots are named");
                self.by_hash.remove(&hash);
                self.evictions += 1;
                if self.spill {
                    self.evicted.push((self.first_slot + i, hash));
                }
                i
            }
        };
        self.reserved += 1;
        Some(self.first_slot + i)
    }

    /// Names the reserved `slot`, now written, by `hash` (kept longer when
    /// `keep`); a slot whose hash is already kept goes back to the free list.
    pub fn commit(&mut self, slot: u32, hash: BlockHash, keep: bool) {
        let i = self.index(slot);
        self.reserved -= 1;
        if self.by_hash.contains_key(&hash) {
            self.free.push(i);
            return;
        }
        self.hashes[i as usize] = Some(hash);
        self.by_hash.insert(hash, i);
        self.touch(i, keep);
    }

    /// Gives a reserved `slot` back unwritten (its step failed).
    pub fn cancel(&mut self, slot: u32) {
        let i = self.index(slot);
        self.reserved -= 1;
        self.free.push(i);
    }

    fn index(&self, slot: u32) -> u32 {
        let i = slot.checked_sub(self.first_slot).expect("a snapshot slot");
        assert!((i as usize) < self.hashes.len(), "a snapshot slot");
        i
    }

    /// No slot is reserved and every slot is free or kept once.
    pub fn is_whole(&self) -> bool {
        let mut listed = vec![false; self.hashes.len()];
        for &i in self.free.iter().chain(self.lru[0].values()).chain(self.lru[1].values()) {
            if std::mem::replace(&mut listed[i as usize], true) {
                return false;
            }
        }
        self.reserved == 0
            && listed.iter().all(|&l| l)
            && self.lru[0].len() + self.lru[1].len() == self.by_hash.len()
            && self.evicted.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_are_kept_and_the_least_recently_used_reused() {
        let h = |i: u8| [i; 32];
        let mut snaps = SnapshotCache::new(64, 10, 2);
        let (a, b) = (snaps.reserve().unwrap(), snaps.reserve().unwrap());
        assert_eq!((a, b), (10, 11));
        assert!(snaps.reserve().is_none(), "both slots are reserved");
        assert!(!snaps.is_whole());
        snaps.commit(a, h(1), false);
        snaps.commit(b, h(2), false);
        assert!(snaps.is_whole());
        assert_eq!(snaps.lookup(&h(1)), Some(a)); // now h(2) is the oldest
        let c = snaps.reserve().unwrap();
        assert_eq!((c, snaps.contains(&h(2)), snaps.evictions()), (b, false, 1));
        snaps.cancel(c);
        assert!(snaps.is_whole());
        let d = snaps.reserve().unwrap();
        snaps.commit(d, h(1), false); // already kept: the slot is free again
        assert_eq!((snaps.num_cached(), snaps.lookup(&h(1))), (1, Some(a)));
        assert!(snaps.is_whole());
        // A snapshot inside a prompt goes before an older one kept longer.
        let e = snaps.reserve().unwrap();
        snaps.commit(e, h(3), false);
        let f = snaps.reserve().unwrap();
        assert_eq!((f, snaps.contains(&h(1)), snaps.contains(&h(3))), (e, true, false));
        snaps.commit(f, h(4), true);
        let g = snaps.reserve().unwrap();
        assert_eq!((g, snaps.contains(&h(1)), snaps.contains(&h(4))), (a, false, true));
        snaps.cancel(g);
        assert!(snaps.is_whole());
    }
}
