//! The CPU backend's paged KV storage: per layer, keys and values one row
//! per slot (`block · block_size + offset`), as f32 rows of `kv_dim` or as
//! encoded rows.

use std::sync::Arc;

use super::batch::BatchLayout;
use super::codecs::KvCodecs;
use super::coded::CodedRows;
use super::contiguous::LayerRows;

enum Storage {
    F32 { keys: Vec<Vec<f32>>, values: Vec<Vec<f32>> },
    Coded(CodedRows),
}

/// Keys and values of every layer for `num_blocks · block_size` slots.
pub struct PagedKv {
    kv_dim: usize,
    block_size: usize,
    num_slots: usize,
    num_layers: usize,
    storage: Storage,
}

impl PagedKv {
    /// f32 rows.
    pub fn new(num_layers: usize, kv_dim: usize, num_blocks: usize, block_size: usize) -> Self {
        let num_slots = num_blocks * block_size;
        // One zeroed allocation per layer (not clones of one, which would
        // touch every page): memory is committed as blocks are written.
        let storage = Storage::F32 {
            keys: (0..num_layers).map(|_| vec![0.0; num_slots * kv_dim]).collect(),
            values: (0..num_layers).map(|_| vec![0.0; num_slots * kv_dim]).collect(),
        };
        PagedKv { kv_dim, block_size, num_slots, num_layers, storage }
    }

    /// Rows as `codecs` encode them, one pool layer per attention layer.
    pub fn coded(codecs: Arc<KvCodecs>, num_blocks: usize, block_size: usize) -> Self {
        let num_slots = num_blocks * block_size;
        let (kv_dim, num_layers) = (codecs.shape.kv_dim(), codecs.shape.num_layers);
        let storage = Storage::Coded(CodedRows::new(codecs, (0..num_layers).collect(), num_slots));
        PagedKv { kv_dim, block_size, num_slots, num_layers, storage }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Writes each sequence's rows of `k` and `v` to its slots: encoded rows
    /// relative to the sequence's anchor (its first block's).
    pub fn write_batch(&mut self, layer: usize, k: &[f32], v: &[f32], batch: &BatchLayout) {
        let d = self.kv_dim;
        match &mut self.storage {
            Storage::F32 { .. } => self.write(layer, k, v, &batch.slots),
            Storage::Coded(rows) => {
                for seq in &batch.seqs {
                    let r = seq.rows.clone();
                    let (k, v, slots) = (&k[r.start * d..r.end * d], &v[r.start * d..r.end * d], &batch.slots[r]);
                    rows.write_slots(layer, k, v, slots, seq.start, seq.block_table[0]);
                }
            }
        }
    }

    /// Writes row `i` of `k` and `v` to slot `slots[i]` of `layer` (f32
    /// rows; encoded ones need their sequences, [`PagedKv::write_batch`]).
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let d = self.kv_dim;
        assert_eq!(k.len(), slots.len() * d, "one key row per slot");
        match &mut self.storage {
            Storage::F32 { keys, values } => {
                for (i, &s) in slots.iter().enumerate() {
                    let s = s as usize;
                    assert!(s < self.num_slots, "slot {s} is past the pool's {} slots", self.num_slots);
                    keys[layer][s * d..(s + 1) * d].copy_from_slice(&k[i * d..(i + 1) * d]);
                    values[layer][s * d..(s + 1) * d].copy_from_slice(&v[i * d..(i + 1) * d]);
                }
            }
            Storage::Coded(_) => panic!("encoded rows are written per sequence (write_batch)"),
        }
    }

    /// Keys and values of `layer`, one row per slot.
    pub fn layer(&self, layer: usize) -> LayerRows<'_> {
        match &self.storage {
            Storage::F32 { keys, values } => LayerRows::F32 { keys: &keys[layer], values: &values[layer] },
            Storage::Coded(rows) => LayerRows::Coded(rows.layer(layer)),
        }
    }

    /// Bytes one block holds over every layer.
    pub fn block_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32 { .. } => 2 * self.num_layers * self.block_size * self.kv_dim * 4,
            Storage::Coded(rows) => rows.block_bytes(self.block_size),
        }
    }

    /// Every layer's keys and values of `block`, layer by layer (keys, then values).
    pub fn read_block(&self, block: u32) -> Vec<u8> {
        match &self.storage {
            Storage::F32 { keys, values } => {
                let n = self.block_size * self.kv_dim;
                let at = block as usize * n;
                let mut out = Vec::with_capacity(self.block_bytes());
                for (k, v) in keys.iter().zip(values) {
                    out.extend_from_slice(bytemuck::cast_slice(&k[at..at + n]));
                    out.extend_from_slice(bytemuck::cast_slice(&v[at..at + n]));
                }
                out
            }
            Storage::Coded(rows) => rows.read_block(block, self.block_size),
        }
    }

    /// Writes what [`PagedKv::read_block`] read back into `block`.
    pub fn write_block(&mut self, block: u32, data: &[u8]) {
        assert_eq!(data.len(), self.block_bytes(), "one block's keys and values");
        let block_size = self.block_size;
        match &mut self.storage {
            Storage::F32 { keys, values } => {
                let n = block_size * self.kv_dim;
                let at = block as usize * n;
                let f: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect();
                for (l, (k, v)) in keys.iter_mut().zip(values.iter_mut()).enumerate() {
                    k[at..at + n].copy_from_slice(&f[2 * l * n..(2 * l + 1) * n]);
                    v[at..at + n].copy_from_slice(&f[(2 * l + 1) * n..(2 * l + 2) * n]);
                }
            }
            Storage::Coded(rows) => rows.write_block(block, block_size, data),
        }
    }

    /// Bytes the storage holds.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32 { .. } => 2 * self.num_layers * self.num_slots * self.kv_dim * 4,
            Storage::Coded(rows) => rows.bytes(),
        }
    }
}
