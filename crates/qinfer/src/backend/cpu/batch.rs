//! The CPU backend's batched forward: a paged f32 KV pool, attention read
//! through block tables, and row slicing.

use std::ops::Range;

use super::{CpuAct, CpuBackend, attention, attention_coded};
use crate::backend::AttentionShape;
use rayon::prelude::*;

use crate::backend::ops::BatchOps;
use crate::config::rope::Rope;
use crate::kv::batch::BatchLayout;
use crate::kv::contiguous::LayerRows;
use crate::kv::paged::PagedKv;
use crate::{Error, Result};

impl BatchOps for CpuBackend {
    type KvPool = PagedKv;

    fn new_kv_pool(&self, num_layers: usize, kv_dim: usize, num_blocks: usize, block_size: usize) -> Result<PagedKv> {
        Ok(match self.kv_codecs() {
            Some(p) => {
                assert_eq!(
                    (p.codecs.shape.num_layers, p.codecs.shape.kv_dim()),
                    (num_layers, kv_dim),
                    "the prepared KV shape"
                );
                PagedKv::coded(p.codecs, num_blocks, block_size)
            }
            None => PagedKv::new(num_layers, kv_dim, num_blocks, block_size),
        })
    }

    fn kv_bytes_per_token(&self, attention_layers: usize, kv_dim: usize) -> usize {
        match self.kv_codecs() {
            Some(p) => attention_layers * (p.codecs.key_row_bytes() + p.codecs.value_row_bytes()),
            None => 2 * attention_layers * kv_dim * 4,
        }
    }

    fn kv_pool_bytes(&self, pool: &PagedKv) -> usize {
        pool.bytes()
    }

    fn rope_multimodal(&self, x: &mut CpuAct, head_dim: usize, positions: &[[u32; 3]], rope: &Rope) {
        assert_eq!(positions.len(), x.rows);
        let half = rope.rotary_dim / 2;
        let cols = x.cols;
        x.data.par_chunks_mut(cols).zip(positions.par_iter()).for_each(|(row, &pos)| {
            let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
            rope.cos_sin_multimodal(pos, &mut cos, &mut sin);
            for head in row.chunks_exact_mut(head_dim) {
                rope.apply(head, &cos, &sin);
            }
        });
    }

    fn read_kv_block(&self, pool: &PagedKv, block: u32) -> Vec<u8> {
        pool.read_block(block)
    }

    fn write_kv_block(&self, pool: &mut PagedKv, block: u32, bytes: &[u8]) -> Result<()> {
        if bytes.len() != pool.block_bytes() {
            return Err(Error::Invalid(format!(
                "a KV block of {} bytes for a pool whose blocks hold {}",
                bytes.len(),
                pool.block_bytes()
            )));
        }
        pool.write_block(block, bytes);
        Ok(())
    }

    fn write_kv_batch(&self, pool: &mut PagedKv, layer: usize, k: &CpuAct, v: &CpuAct, batch: &BatchLayout) {
        pool.write_batch(layer, &k.data, &v.data, batch);
    }

    fn write_kv_paged(&self, pool: &mut PagedKv, layer: usize, k: &CpuAct, v: &CpuAct, slots: &[u32]) {
        pool.write(layer, &k.data, &v.data, slots);
    }

    fn paged_attention(
        &self,
        q: &CpuAct,
        pool: &PagedKv,
        layer: usize,
        shape: &AttentionShape,
        batch: &BatchLayout,
    ) -> CpuAct {
        assert_eq!(q.rows, batch.rows(), "paged_attention: one query row per batch row");
        let mut out = CpuAct::zeros(q.rows, shape.num_heads * shape.head_dim);
        match pool.layer(layer) {
            LayerRows::F32 { keys, values } => {
                attention::paged_attention(&q.data, keys, values, batch, shape, &mut out.data)
            }
            LayerRows::Coded(kv) => attention_coded::paged_attention(&q.data, &kv, batch, shape, &mut out.data),
        }
        out
    }

    fn slice_rows(&self, x: &CpuAct, rows: Range<usize>) -> CpuAct {
        CpuAct::from_vec(rows.len(), x.cols, x.data[rows.start * x.cols..rows.end * x.cols].to_vec())
    }

    fn concat_rows(&self, parts: &[CpuAct]) -> CpuAct {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            assert_eq!(p.cols, cols, "concat_rows: widths differ");
            data.extend_from_slice(&p.data);
        }
        CpuAct::from_vec(data.len() / cols.max(1), cols, data)
    }

    fn add_rows(&self, y: &mut CpuAct, start: usize, d: &CpuAct) {
        assert_eq!(y.cols, d.cols, "add_rows: widths differ");
        let at = start * y.cols;
        for (a, b) in y.data[at..at + d.data.len()].iter_mut().zip(&d.data) {
            *a += b;
        }
    }

    fn gather_rows(&self, x: &CpuAct, rows: &[usize]) -> CpuAct {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        CpuAct::from_vec(rows.len(), x.cols, data)
    }
}
