//! The prefix cache's second tier: KV blocks and recurrent-state snapshots
//! evicted from the device's pools are copied to host memory, under the
//! same hashes, within a byte budget (least recently stored or used
//! dropped first), and copied back when a later request's prefix needs
//! them.

use std::collections::{BTreeMap, HashMap};

use super::prefix::BlockHash;

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A KV block: every attention layer's keys and values.
    Block,
    /// A recurrent-state snapshot: every Gated DeltaNet layer's state.
    Snapshot,
}

/// Counters since the tier was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostTierStats {
    /// Entries copied in from the device, and back out to it.
    pub stored: u64,
    pub restored: u64,
    /// Entries dropped for room.
    pub dropped: u64,
}

pub struct HostTier {
    capacity: usize,
    bytes: usize,
    entries: HashMap<(Kind, BlockHash), (Vec<u8>, u64)>,
    lru: BTreeMap<u64, (Kind, BlockHash)>,
    clock: u64,
    stats: HostTierStats,
}

impl HostTier {
    /// A tier holding at most `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        HostTier {
            capacity,
            bytes: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            stats: HostTierStats::default(),
        }
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn stats(&self) -> HostTierStats {
        self.stats
    }

    pub fn contains(&self, kind: Kind, hash: &BlockHash) -> bool {
        self.entries.contains_key(&(kind, *hash))
    }

    /// Keeps `bytes` under `hash`, dropping the least recently used entries
    /// for room; an entry larger than the whole tier is not kept.
    pub fn store(&mut self, kind: Kind, hash: BlockHash, bytes: Vec<u8>) {
        if bytes.len() > self.capacity {
            return;
        }
        self.remove(kind, &hash);
        while self.bytes + bytes.len() > self.capacity {
            let (_, key) = self.lru.pop_first().expect("bytes held means entries held");
            let (old, _) = self.entries.remove(&key).expect("listed entries are held");
            self.bytes -= old.len();
            self.stats.dropped += 1;
        }
        self.clock += 1;
        self.bytes += bytes.len();
        self.lru.insert(self.clock, (kind, hash));
        self.entries.insert((kind, hash), (bytes, self.clock));
        self.stats.stored += 1;
    }

    /// The entry under `hash`, taken out of the tier (it goes back to the device).
    pub fn take(&mut self, kind: Kind, hash: &BlockHash) -> Option<Vec<u8>> {
        let bytes = self.remove(kind, hash)?;
        self.stats.restored += 1;
        Some(bytes)
    }

    /// A copy of the entry under `hash`, which stays (now the most recently used).
    pub fn get(&mut self, kind: Kind, hash: &BlockHash) -> Option<Vec<u8>> {
        let (bytes, at) = self.entries.get_mut(&(kind, *hash))?;
        self.lru.remove(at);
        self.clock += 1;
        *at = self.clock;
        self.lru.insert(self.clock, (kind, *hash));
        self.stats.restored += 1;
        Some(bytes.clone())
    }

    fn remove(&mut self, kind: Kind, hash: &BlockHash) -> Option<Vec<u8>> {
        let (bytes, at) = self.entries.remove(&(kind, *hash))?;
        self.lru.remove(&at);
        self.bytes -= bytes.len();
        Some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_stay_within_the_budget_least_recently_used_dropped() {
        let h = |i: u8| [i; 32];
        let mut tier = HostTier::new(10);
        tier.store(Kind::Block, h(1), vec![1; 4]);
        tier.store(Kind::Snapshot, h(1), vec![2; 4]);
        assert_eq!((tier.len(), tier.bytes()), (2, 8));
        assert_eq!(tier.get(Kind::Block, &h(1)), Some(vec![1; 4])); // the snapshot is now the oldest
        tier.store(Kind::Block, h(2), vec![3; 4]);
        assert!(!tier.contains(Kind::Snapshot, &h(1)) && tier.contains(Kind::Block, &h(1)));
        assert_eq!(tier.take(Kind::Block, &h(2)), Some(vec![3; 4]));
        assert_eq!((tier.len(), tier.bytes()), (1, 4));
        tier.store(Kind::Block, h(3), vec![0; 11]); // larger than the tier: not kept
        assert_eq!((tier.len(), tier.stats().dropped), (1, 1));
    }
}
