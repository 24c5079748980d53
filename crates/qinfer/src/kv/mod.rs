//! Key/value caches, host side: the cache formats and the bookkeeping.
//! `contiguous` is the plain f32 cache of the CPU backend's one-sequence
//! path and `paged` its block-paged storage; `blocks` hands out blocks and
//! state slots, `batch` describes a step over many sequences. A device
//! backend keeps its storage itself, sized from [`KvPrecision`].

pub mod batch;
pub mod blocks;
pub mod codecs;
pub mod coded;
pub mod contiguous;
pub mod format;
pub mod host_tier;
pub mod paged;
pub mod prefix;
pub mod snapshots;

pub use format::{KvFormat, KvSide};

/// The shape of a model's KV cache: its attention layers, each storing
/// `num_kv_heads` vectors of `head_dim` per position for keys and for values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// Per-sequence key/value storage for every layer. Positions `[0, len())` are
/// committed; a forward writes rows past `len()` and then commits them.
pub trait KvCache: Send {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Marks positions `[0, len)` as valid (commit after a forward, or roll back).
    fn set_len(&mut self, len: usize);
    /// Positions this cache can hold.
    fn capacity(&self) -> usize;
}

/// How a device KV cache stores keys and values (the CPU backend's is f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvPrecision {
    /// Half the memory of f32, and half the bytes a decode step reads from a
    /// long cache. Keys and values are rounded once, when written (11
    /// significant bits, finer than the bf16 the reference models keep
    /// them in); the attention's arithmetic stays f32.
    #[default]
    F16,
    /// Keys and values as computed.
    F32,
}

impl KvPrecision {
    /// Bytes of one stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvPrecision::F16 => 2,
            KvPrecision::F32 => 4,
        }
    }
}

impl std::str::FromStr for KvPrecision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f16" => Ok(KvPrecision::F16),
            "f32" => Ok(KvPrecision::F32),
            _ => Err(format!("unknown KV cache precision `{s}` (expected f16 or f32)")),
        }
    }
}
