//! The paged KV cache's bookkeeping: a pool of fixed-size blocks with
//! reference counts and a free list, and each sequence's block table (the
//! blocks that hold its positions, in order). The storage itself belongs to
//! the backend, indexed by the slots this hands out (`block · block_size +
//! offset`).

/// Tokens per block unless configured otherwise (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Fixed-size blocks, each free or held by one or more sequences (a shared
/// prefix holds a block more than once).
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Free blocks, the last one handed out first: the most recently freed
    /// block is reused before any untouched one, so the memory a pool
    /// commits follows the most it has held at once, not its size.
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "a block holds at least one token");
        let num_blocks = u32::try_from(num_blocks).expect("fewer than 2^32 blocks");
        BlockPool { block_size, ref_counts: vec![0; num_blocks as usize], free: (0..num_blocks).rev().collect() }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks that hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// A free block, now held once; None when every block is held.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.ref_counts[b as usize] = 1;
        Some(b)
    }

    /// Holds `block` once more (a second sequence sharing it).
    pub fn retain(&mut self, block: u32) {
        let rc = &mut self.ref_counts[block as usize];
        assert!(*rc > 0, "retaining free block {block}");
        *rc += 1;
    }

    /// Lets go of `block` once; it is free again when nothing holds it.
    pub fn release(&mut self, block: u32) {
        let rc = &mut self.ref_counts[block as usize];
        assert!(*rc > 0, "releasing free block {block}");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(block);
        }
    }

    /// How many holders `block` has.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Every block is free and listed once: what the pool must be again
    /// after every sequence has finished, been aborted or preempted.
    pub fn is_whole(&self) -> bool {
        let mut listed = vec![false; self.ref_counts.len()];
        for &b in &self.free {
            if std::mem::replace(&mut listed[b as usize], true) {
                return false;
            }
        }
        self.ref_counts.iter().all(|&rc| rc == 0) && listed.iter().all(|&l| l)
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

    /// Returns every block to `pool`.
    pub fn release(&mut self, pool: &mut BlockPool) {
        for b in self.blocks.drain(..) {
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
