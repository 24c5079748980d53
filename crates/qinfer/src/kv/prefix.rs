//! Prefix-cache keys: each full block of a sequence is named by a SHA-256
//! hash chained through its parent block's hash, so a block's name stands
//! for every token before it and the request's extra keys (its
//! `cache_salt`), never for its own tokens alone. A collision would serve
//! another prompt's keys and values, hence a cryptographic hash.

use sha2::{Digest, Sha256};

/// The name of a full block and of everything before it.
pub type BlockHash = [u8; 32];

/// What a request adds to its chain's root: requests with different roots
/// share no block (tenant isolation through `cache_salt`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixKeys {
    pub cache_salt: Option<String>,
    /// The LoRA adapter the blocks were computed with (its keys and values
    /// differ from the base model's).
    pub adapter: Option<u64>,
}

impl PrefixKeys {
    /// The parent hash of a sequence's first block.
    pub fn root(&self) -> BlockHash {
        let mut h = Sha256::new();
        h.update(b"qinfer prefix cache v1\0");
        match &self.cache_salt {
            Some(salt) => {
                h.update([1u8]);
                h.update((salt.len() as u64).to_le_bytes());
                h.update(salt.as_bytes());
            }
            None => h.update([0u8]),
        }
        if let Some(id) = self.adapter {
            h.update(b"lora\0");
            h.update(id.to_le_bytes());
        }
        h.finalize().into()
    }
}

/// The hash of a block holding `tokens`, after the block named `parent`.
pub fn chain(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent);
    h.update((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Tokens of a sequence that stand for an image: their placeholder ids are
/// all alike, so the blocks holding them are named by the image's hash too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSpan {
    pub start: usize,
    pub len: usize,
    pub hash: [u8; 32],
}

/// The chained hashes of a growing token sequence's full blocks.
#[derive(Debug, Clone)]
pub struct BlockHashes {
    root: BlockHash,
    hashes: Vec<BlockHash>,
    media: Vec<MediaSpan>,
}

impl BlockHashes {
    pub fn new(keys: &PrefixKeys) -> Self {
        BlockHashes { root: keys.root(), hashes: Vec::new(), media: Vec::new() }
    }

    /// The same, for a sequence whose tokens at `media` stand for images.
    pub fn with_media(keys: &PrefixKeys, media: Vec<MediaSpan>) -> Self {
        BlockHashes { media, ..Self::new(keys) }
    }

    /// Hashes every full block of `tokens` not hashed yet (`tokens` only
    /// grows at its end).
    pub fn extend(&mut self, tokens: &[u32], block_size: usize) {
        for i in self.hashes.len()..tokens.len() / block_size {
            let parent = *self.hashes.last().unwrap_or(&self.root);
            let (lo, hi) = (i * block_size, (i + 1) * block_size);
            let mut h = chain(&parent, &tokens[lo..hi]);
            for m in self.media.iter().filter(|m| m.start < hi && m.start + m.len > lo) {
                let mut with = Sha256::new();
                with.update(h);
                with.update(b"image\0");
                with.update((m.start as u64).to_le_bytes());
                with.update((m.len as u64).to_le_bytes());
                with.update(m.hash);
                h = with.finalize().into();
            }
            self.hashes.push(h);
        }
    }

    /// Hashes of the full blocks so far, in order.
    pub fn as_slice(&self) -> &[BlockHash] {
        &self.hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_named_by_all_before_it_and_the_salt() {
        let keys = PrefixKeys::default();
        let (mut a, mut b) = (BlockHashes::new(&keys), BlockHashes::new(&keys));
        a.extend(&[1, 2, 3, 4, 5, 6, 7], 2);
        b.extend(&[1, 2, 3, 4, 9, 6], 2);
        assert_eq!(a.as_slice().len(), 3);
        assert_eq!(b.as_slice().len(), 3);
        assert_eq!(a.as_slice()[..2], b.as_slice()[..2]);
        assert_ne!(a.as_slice()[2], b.as_slice()[2]);
        // The same tokens after a different parent: another name.
        let mut c = BlockHashes::new(&keys);
        c.extend(&[0, 0, 5, 6], 2);
        assert_ne!(c.as_slice()[1], a.as_slice()[2]);
        // Growing one token at a time names the same blocks.
        let mut d = BlockHashes::new(&keys);
        for n in 1..=7 {
            d.extend(&[1, 2, 3, 4, 5, 6, 7][..n], 2);
        }
        assert_eq!(d.as_slice(), a.as_slice());
        let salted = PrefixKeys { cache_salt: Some("tenant-a".into()), adapter: None };
        let mut s = BlockHashes::new(&salted);
        s.extend(&[1, 2], 2);
        assert_ne!(s.as_slice()[0], a.as_slice()[0]);
        assert_ne!(salted.root(), PrefixKeys { cache_salt: Some(String::new()), adapter: None }.root());
        // Each adapter's blocks are its own, salted or not.
        let adapted = PrefixKeys { cache_salt: None, adapter: Some(1) };
        assert_ne!(adapted.root(), keys.root());
        assert_ne!(adapted.root(), PrefixKeys { cache_salt: None, adapter: Some(2) }.root());
        assert_ne!(PrefixKeys { adapter: Some(1), ..salted.clone() }.root(), salted.root());
        assert_ne!(keys.root(), PrefixKeys { cache_salt: Some(String::new()), adapter: None }.root());
    }

    #[test]
    fn blocks_holding_an_image_are_named_by_it_and_the_ones_before_are_not() {
        let keys = PrefixKeys::default();
        let tokens = [1, 2, 9, 9, 9, 9, 3, 4];
        let span = |hash: u8| vec![MediaSpan { start: 2, len: 4, hash: [hash; 32] }];
        let (mut a, mut b, mut text) =
            (BlockHashes::with_media(&keys, span(1)), BlockHashes::with_media(&keys, span(2)), BlockHashes::new(&keys));
        for h in [&mut a, &mut b, &mut text] {
            h.extend(&tokens, 2);
        }
        assert_eq!(a.as_slice()[0], b.as_slice()[0]);
        assert_eq!(a.as_slice()[0], text.as_slice()[0]);
        for i in 1..4 {
            assert_ne!(a.as_slice()[i], b.as_slice()[i], "block {i}");
        }
    }
}
