//! The paged KV cache's bookkeeping: a pool of fixed-size blocks with
//! reference counts and a free list, and each sequence's block table (the
//! blocks that hold its positions, in order). The storage itself belongs to
//! the backend, indexed by the slots this hands out (`block · block_size +
//! offset`).

use std::collections::{BTreeMap, HashMap};

use super::prefix::BlockHash;

/// Tokens per block unless configured otherwise (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Fixed-size blocks, each free, held by one or more sequences (a shared
/// prefix holds a block more than once), or cached: held by none but kept
/// under its prefix hash for a later request, until a block is needed and
/// none is free (then the least recently released cached block is reused).
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Free blocks, the last one handed out first: the most recently freed
    /// block is reused before any untouched one, so the memory a pool
    /// commits follows the most it has held at once, not its size.
    free: Vec<u32>,
    /// Whether released blocks with a hash stay cached.
    caching: bool,
    hashes: Vec<Option<BlockHash>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Cached blocks nobody holds, by when they were released (oldest first).
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    clock: u64,
    evictions: u64,
    /// Keep a list of the cached blocks evicted (for a host tier to copy
    /// before they are overwritten).
    spill: bool,
    evicted: Vec<(u32, BlockHash)>,
}

impl BlockPool {
    /// A pool without a prefix cache.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_cache(num_blocks, block_size, false)
    }

    /// A pool that keeps released blocks cached under their hashes when
    /// `caching`.
    pub fn with_cache(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        assert!(block_size > 0, "a block holds at least one token");
        let n = u32::try_from(num_blocks).expect("fewer than 2^32 blocks");
        BlockPool {
            block_size,
            ref_counts: vec![0; num_blocks],
            free: (0..n).rev().collect(),
            caching,
            hashes: vec![None; num_blocks],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            clock: 0,
            evictions: 0,
            spill: false,
            evicted: Vec::new(),
        }
    }

    /// From now on, lists each cached block it evicts (see
    /// [`BlockPool::take_evicted`]).
    pub fn set_spill(&mut self, spill: bool) {
        self.spill = spill;
    }

    /// The cached blocks evicted since the last call, with the hashes they
    /// had: their contents are intact until the next forward writes them.
    pub fn take_evicted(&mut self) -> Vec<(u32, BlockHash)> {
        std::mem::take(&mut self.evicted)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks an allocation can take: free ones and cached ones nobody holds.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks held by at least one sequence.
    pub fn num_held(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Blocks kept under a prefix hash (held or not).
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    /// Cached blocks given up to make room, so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Blocks that hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// A block, now held once: a free one, else the least recently released
    /// cached one (its hash forgotten); None when every block is held.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                let hash = self.hashes[b as usize].take().expect("evictable blocks are cached");
                self.by_hash.remove(&hash);
                self.evictions += 1;
                if self.spill {
                    self.evicted.push((b, hash));
                }
                b
            }
        };
        self.ref_counts[b as usize] = 1;
        Some(b)
    }

    /// Holds `block` once more: a second sequence sharing it, or a cached
    /// block taken up again by a request with the same prefix.
    pub fn retain(&mut self, block: u32) {
        let b = block as usize;
        if self.ref_counts[b] == 0 {
            let was_cached = self.evictable.remove(&self.released_at[b]).is_some();
            assert!(was_cached, "retaining free block {block}");
        }
        self.ref_counts[b] += 1;
    }

    /// Lets go of `block` once; when nothing holds it, it stays cached if it
    /// has a hash, else it is free.
    pub fn release(&mut self, block: u32) {
        let b = block as usize;
        let rc = &mut self.ref_counts[b];
        assert!(*rc > 0, "releasing free block {block}");
        *rc -= 1;
        if *rc == 0 {
            if self.hashes[b].is_some() {
                self.clock += 1;
                self.released_at[b] = self.clock;
                self.evictable.insert(self.clock, block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// How many holders `block` has.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Names held block `block` by `hash`, its contents now complete, so a
    /// later request with this prefix can share it. A no-op without a cache,
    /// or when another block already has this hash (two requests computed
    /// the same prefix at once: the first one stays cached).
    pub fn register(&mut self, block: u32, hash: BlockHash) {
        let b = block as usize;
        assert!(self.ref_counts[b] > 0, "registering free block {block}");
        if !self.caching || self.hashes[b].is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        self.hashes[b] = Some(hash);
        self.by_hash.insert(hash, block);
    }

    /// The block cached under `hash`, if any.
    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.by_hash.get(hash).copied()
    }

    /// Every block is held by none and listed once, free or cached: what the
    /// pool must be again after every sequence has finished, been aborted
    /// or preempted.
    pub fn is_whole(&self) -> bool {
        let mut listed = vec![false; self.ref_counts.len()];
        for &b in self.free.iter().chain(self.evictable.values()) {
            if std::mem::replace(&mut listed[b as usize], true) {
                return false;
            }
        }
        let cached_consistent = self.by_hash.iter().all(|(h, &b)| self.hashes[b as usize] == Some(*h))
            && self.hashes.iter().filter(|h| h.is_some()).count() == self.by_hash.len();
        self.ref_counts.iter().all(|&rc| rc == 0)
            && listed.iter().all(|&l| l)
            && cached_consistent
            && self.evicted.is_empty()
    }
}

/// The blocks of one sequence, position `p` in `blocks[p / block_size]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
}

impl BlockTable {
    /// Positions the table has room for.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Grows the table from `pool` until it holds `tokens` positions. On
    /// failure (the pool ran dry) the table keeps what it had and returns
    /// false; nothing is taken.
    pub fn grow_to(&mut self, tokens: usize, pool: &mut BlockPool) -> bool {
        let need = pool.blocks_for(tokens).saturating_sub(self.blocks.len());
        if need > pool.num_free() {
            return false;
        }
        for _ in 0..need {
            self.blocks.push(pool.allocate().expect("counted free blocks above"));
        }
        true
    }

    /// Returns every block to `pool`, the last first: cached blocks are
    /// evicted oldest first, so a prefix loses its tail before its head
    /// (a shorter prefix stays usable).
    pub fn release(&mut self, pool: &mut BlockPool) {
        for b in self.blocks.drain(..).rev() {
            pool.release(b);
        }
    }

    /// The storage slot of position `pos`.
    pub fn slot(&self, pos: usize, block_size: usize) -> u32 {
        self.blocks[pos / block_size] * block_size as u32 + (pos % block_size) as u32
    }
}

/// Fixed slots for per-sequence state that does not grow with the context
/// (the Gated DeltaNet conv and recurrent states), handed out and returned.
#[derive(Debug, Clone)]
pub struct SlotPool {
    held: Vec<bool>,
    free: Vec<u32>,
}

impl SlotPool {
    pub fn new(num_slots: usize) -> Self {
        let n = u32::try_from(num_slots).expect("fewer than 2^32 slots");
        SlotPool { held: vec![false; num_slots], free: (0..n).rev().collect() }
    }

    pub fn num_slots(&self) -> usize {
        self.held.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// A free slot (lowest first), now held; None when all are held.
    pub fn allocate(&mut self) -> Option<u32> {
        let s = self.free.pop()?;
        self.held[s as usize] = true;
        Some(s)
    }

    pub fn release(&mut self, slot: u32) {
        assert!(std::mem::replace(&mut self.held[slot as usize], false), "releasing free slot {slot}");
        self.free.push(slot);
    }

    /// Every slot is free.
    pub fn is_whole(&self) -> bool {
        self.free.len() == self.held.len() && self.held.iter().all(|h| !h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_shared_and_come_back() {
        let mut pool = BlockPool::new(4, 16);
        let mut a = BlockTable::default();
        assert!(a.grow_to(17, &mut pool));
        assert_eq!(a.blocks.len(), 2);
        assert_eq!(a.slot(17, 16), a.blocks[1] * 16 + 1);
        let mut b = BlockTable { blocks: vec![a.blocks[0]] };
        pool.retain(a.blocks[0]);
        assert_eq!(pool.ref_count(a.blocks[0]), 2);
        assert!(!b.grow_to(16 * 5, &mut pool), "more than the pool holds");
        assert_eq!(b.blocks.len(), 1, "a failed grow takes nothing");
        a.release(&mut pool);
        assert!(!pool.is_whole());
        b.release(&mut pool);
        assert!(pool.is_whole());
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn cached_blocks_outlive_their_sequence_until_needed() {
        let h = |i: u8| [i; 32];
        let mut pool = BlockPool::with_cache(3, 4, true);
        let (a, b, c) = (pool.allocate().unwrap(), pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, h(1));
        pool.register(b, h(2));
        pool.register(c, h(2)); // the same prefix computed twice: the first stays
        assert_eq!(pool.lookup(&h(2)), Some(b));
        pool.release(b);
        pool.release(a);
        pool.release(c);
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.num_cached(), 2);
        assert!(pool.is_whole());
        // A hit takes a cached block back out of reach of eviction.
        pool.retain(pool.lookup(&h(1)).unwrap());
        assert_eq!(pool.num_free(), 2);
        // The uncached block goes first, then the least recently released cached one.
        assert_eq!(pool.allocate(), Some(c));
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!((pool.lookup(&h(2)), pool.evictions()), (None, 1));
        assert_eq!(pool.allocate(), None);
        for x in [a, b, c] {
            pool.release(x);
        }
        assert!(pool.is_whole());
        assert_eq!(pool.lookup(&h(1)), Some(a));
        // Without a cache a hash is ignored.
        let mut plain = BlockPool::new(1, 4);
        let x = plain.allocate().unwrap();
        plain.register(x, h(1));
        assert_eq!(plain.lookup(&h(1)), None);
    }

    #[test]
    fn slots_come_back() {
        let mut slots = SlotPool::new(2);
        let (x, y) = (slots.allocate().unwrap(), slots.allocate().unwrap());
        assert_eq!((x, y), (0, 1));
        assert!(slots.allocate().is_none());
        slots.release(x);
        slots.release(y);
        assert!(slots.is_whole());
    }
}
