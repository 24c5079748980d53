//! One growable f32 buffer per layer for keys and one for values, rows of
//! `kv_dim` per position.

use super::KvCache;

#[derive(Default)]
pub struct ContiguousKv {
    kv_dim: usize,
    capacity: usize,
    len: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl ContiguousKv {
    pub fn new(num_layers: usize, kv_dim: usize, capacity: usize) -> Self {
        ContiguousKv {
            kv_dim,
            capacity,
            len: 0,
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Writes rows for positions `[self.len, self.len + n)` of `layer`.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let n = k.len() / self.kv_dim;
        assert!(self.len + n <= self.capacity, "KV cache overflow: {} + {n} > {}", self.len, self.capacity);
        let start = self.len * self.kv_dim;
        for (buf, src) in [(&mut self.keys[layer], k), (&mut self.values[layer], v)] {
            buf.truncate(start);
            buf.extend_from_slice(src);
        }
    }

    /// Keys and values of positions `[0, end)`, `[end, kv_dim]` row-major.
    pub fn layer(&self, layer: usize, end: usize) -> (&[f32], &[f32]) {
        let n = end * self.kv_dim;
        (&self.keys[layer][..n], &self.values[layer][..n])
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
