//! The CPU backend's paged KV storage: per layer, keys and values as f32
//! rows of `kv_dim`, one row per slot (`block · block_size + offset`).

/// Keys and values of every layer for `num_blocks · block_size` slots.
pub struct PagedKv {
    kv_dim: usize,
    block_size: usize,
    num_slots: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl PagedKv {
    pub fn new(num_layers: usize, kv_dim: usize, num_blocks: usize, block_size: usize) -> Self {
        let num_slots = num_blocks * block_size;
        PagedKv {
            kv_dim,
            block_size,
            num_slots,
            // One zeroed allocation per layer (not clones of one, which would
            // touch every page): memory is committed as blocks are written.
            keys: (0..num_layers).map(|_| vec![0.0; num_slots * kv_dim]).collect(),
            values: (0..num_layers).map(|_| vec![0.0; num_slots * kv_dim]).collect(),
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Writes row `i` of `k` and `v` to slot `slots[i]` of `layer`.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let d = self.kv_dim;
        assert_eq!(k.len(), slots.len() * d, "one key row per slot");
        for (i, &s) in slots.iter().enumerate() {
            let s = s as usize;
            assert!(s < self.num_slots, "slot {s} is past the pool's {} slots", self.num_slots);
            self.keys[layer][s * d..(s + 1) * d].copy_from_slice(&k[i * d..(i + 1) * d]);
            self.values[layer][s * d..(s + 1) * d].copy_from_slice(&v[i * d..(i + 1) * d]);
        }
    }

    /// Keys and values of `layer`, `[slots, kv_dim]` row-major.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Values one block holds over every layer (keys, then values, per layer).
    pub fn block_values(&self) -> usize {
        2 * self.keys.len() * self.block_size * self.kv_dim
    }

    /// Every layer's keys and values of `block`, layer by layer.
    pub fn read_block(&self, block: u32) -> Vec<f32> {
        let n = self.block_size * self.kv_dim;
        let at = block as usize * n;
        let mut out = Vec::with_capacity(self.block_values());
        for (k, v) in self.keys.iter().zip(&self.values) {
            out.extend_from_slice(&k[at..at + n]);
            out.extend_from_slice(&v[at..at + n]);
        }
        out
    }

    /// Writes what [`PagedKv::read_block`] read back into `block`.
    pub fn write_block(&mut self, block: u32, data: &[f32]) {
        assert_eq!(data.len(), self.block_values(), "one block's keys and values");
        let n = self.block_size * self.kv_dim;
        let at = block as usize * n;
        for (l, (k, v)) in self.keys.iter_mut().zip(self.values.iter_mut()).enumerate() {
            k[at..at + n].copy_from_slice(&data[2 * l * n..(2 * l + 1) * n]);
            v[at..at + n].copy_from_slice(&data[(2 * l + 1) * n..(2 * l + 2) * n]);
        }
    }

    /// Bytes the storage holds.
    pub fn bytes(&self) -> usize {
        2 * self.keys.len() * self.num_slots * self.kv_dim * 4
    }
}
