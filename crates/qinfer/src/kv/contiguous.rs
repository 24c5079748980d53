//! One sequence's cache as growable rows per layer: f32 rows of `kv_dim`
//! per position, or encoded rows (any other [`super::KvFormat`]).

use std::sync::Arc;

use super::KvCache;
use super::codecs::KvCodecs;
use super::coded::{CodedLayer, CodedRows};

/// One layer's keys and values as a cache stores them.
pub enum LayerRows<'a> {
    /// `[positions, kv_dim]` row-major.
    F32 { keys: &'a [f32], values: &'a [f32] },
    /// Encoded rows (the anchor of a contiguous cache's one sequence is 0;
    /// a paged pool's sequence's is its first block).
    Coded(CodedLayer<'a>),
}

enum Storage {
    F32 { keys: Vec<Vec<f32>>, values: Vec<Vec<f32>> },
    Coded(CodedRows),
}

pub struct ContiguousKv {
    kv_dim: usize,
    capacity: usize,
    len: usize,
    storage: Storage,
}

impl Default for ContiguousKv {
    fn default() -> Self {
        ContiguousKv::new(0, 0, 0)
    }
}

impl ContiguousKv {
    /// An f32 cache.
    pub fn new(num_layers: usize, kv_dim: usize, capacity: usize) -> Self {
        let storage = Storage::F32 { keys: vec![Vec::new(); num_layers], values: vec![Vec::new(); num_layers] };
        ContiguousKv { kv_dim, capacity, len: 0, storage }
    }

    /// A cache storing rows as `codecs` encode them, for a model whose
    /// layer `l` is attention layer `attention_index[l]` (`None` for layers
    /// that keep no KV).
    pub fn coded(codecs: Arc<KvCodecs>, attention_index: &[Option<usize>], capacity: usize) -> Self {
        let kv_dim = codecs.shape.kv_dim();
        let codec_layers = attention_index.iter().map(|a| a.unwrap_or(usize::MAX)).collect();
        ContiguousKv { kv_dim, capacity, len: 0, storage: Storage::Coded(CodedRows::new(codecs, codec_layers, 0)) }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Writes rows for positions `[self.len, self.len + n)` of `layer`.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let n = k.len() / self.kv_dim;
        assert!(self.len + n <= self.capacity, "KV cache overflow: {} + {n} > {}", self.len, self.capacity);
        match &mut self.storage {
            Storage::F32 { keys, values } => {
                let start = self.len * self.kv_dim;
                for (buf, src) in [(&mut keys[layer], k), (&mut values[layer], v)] {
                    buf.truncate(start);
                    buf.extend_from_slice(src);
                }
            }
            Storage::Coded(rows) => rows.append(layer, self.len, k, v),
        }
    }

    /// Keys and values of `layer` (positions `[0, end)` for f32 rows; coded
    /// rows are returned whole).
    pub fn layer(&self, layer: usize, end: usize) -> LayerRows<'_> {
        match &self.storage {
            Storage::F32 { keys, values } => {
                let n = end * self.kv_dim;
                LayerRows::F32 { keys: &keys[layer][..n], values: &values[layer][..n] }
            }
            Storage::Coded(rows) => LayerRows::Coded(rows.layer(layer)),
        }
    }
}

impl KvCache for ContiguousKv {
    fn len(&self) -> usize {
        self.len
    }
    fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity);
        self.len = len;
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
}
