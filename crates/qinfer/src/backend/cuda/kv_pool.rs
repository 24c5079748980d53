//! The batched forward's paged KV pool on the device: its buffers (plain
//! f32/f16 rows or an encoded format's parts), made whole at start, and
//! its blocks copied to the host and back (the prefix cache's host tier).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::CudaBackend;
use super::kv_coded::CudaCodecs;
use crate::kv::KvPrecision;
use crate::{Error, Result};

/// Every layer's keys and values for `num_blocks · block_size` slots on the
/// device. Plainly stored ([`KvPrecision`], the backend's, as its contiguous
/// caches store them): per layer a key and a value buffer of `[slots,
/// kv_dim]` values, slot `block · block_size + offset`. Encoded (a coded
/// format, kv_coded.rs): per layer the buffers [`CudaCodecs::part_bytes`]
/// lists, each holding its blocks one after another.
pub struct CudaKvPool {
    pub(super) kv_dim: usize,
    block_size: usize,
    pub(super) num_blocks: usize,
    pub(super) precision: KvPrecision,
    pub(super) coded: Option<Arc<CudaCodecs>>,
    /// Per layer its buffers, and the bytes each gives one block.
    pub(super) layers: Vec<Vec<CudaSlice<u8>>>,
    part_bytes: Vec<usize>,
}

impl CudaKvPool {
    pub fn precision(&self) -> KvPrecision {
        self.precision
    }

    /// The codecs of an encoded pool.
    pub fn codecs(&self) -> Option<&CudaCodecs> {
        self.coded.as_deref()
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// The key and value buffers of `layer` of a plain pool.
    pub(super) fn plain(&self, layer: usize) -> (&CudaSlice<u8>, &CudaSlice<u8>) {
        (&self.layers[layer][0], &self.layers[layer][1])
    }

    /// Every buffer of `layer`.
    pub(super) fn layer_parts(&self, layer: usize) -> &[CudaSlice<u8>] {
        &self.layers[layer]
    }

    /// The byte range of `block` in each buffer of a layer.
    fn block_ranges(&self, block: u32) -> Vec<Range<usize>> {
        assert!((block as usize) < self.num_blocks, "block {block} of a pool of {}", self.num_blocks);
        self.part_bytes.iter().map(|&n| block as usize * n..(block as usize + 1) * n).collect()
    }

    /// Bytes the pool holds on the device.
    pub fn bytes(&self) -> usize {
        self.layers.len() * self.num_blocks * self.part_bytes.iter().sum::<usize>()
    }
}

impl CudaBackend {
    /// [`crate::backend::ops::BatchOps::new_kv_pool`]: the whole pool
    /// allocated (and zeroed) now, so that a pool too large for the device
    /// fails here and not in the middle of a forward.
    pub(super) fn new_kv_pool_op(
        &self,
        num_layers: usize,
        kv_dim: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CudaKvPool> {
        let precision = self.kv_precision;
        let err = |e: String| Error::Invalid(format!("cuda:{}: KV pool: {e}", self.ordinal));
        let slots = num_blocks.checked_mul(block_size).filter(|&s| s <= i32::MAX as usize);
        if slots.is_none() {
            return Err(err(format!("{num_blocks} blocks of {block_size} slots exceed 2^31 slots")));
        }
        let coded = self.kv_coded_codecs()?;
        let part_bytes = match &coded {
            Some(c) => {
                if (c.shape().num_layers, c.shape().kv_dim()) != (num_layers, kv_dim) {
                    return Err(err(format!(
                        "{num_layers} layers of {kv_dim} KV dims for codecs of {} layers of {}",
                        c.shape().num_layers,
                        c.shape().kv_dim()
                    )));
                }
                c.part_bytes(block_size)
            }
            None => vec![block_size * kv_dim * precision.bytes(); 2],
        };
        let mut layers = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            let mut parts = Vec::with_capacity(part_bytes.len());
            for &n in &part_bytes {
                let buf = self.stream.alloc_zeros::<u8>((n * num_blocks).max(4)).map_err(|e| {
                    let total: usize = part_bytes.iter().sum::<usize>() * num_blocks * num_layers;
                    err(format!("allocating {total} bytes: {e}"))
                })?;
                parts.push(buf);
            }
            layers.push(parts);
        }
        Ok(CudaKvPool { kv_dim, block_size, num_blocks, precision, coded, layers, part_bytes })
    }

    /// [`crate::backend::ops::BatchOps::read_kv_block`]: per layer the
    /// block's keys then its values, in the pool's storage; empty, the error
    /// recorded, when a copy fails.
    pub(super) fn read_kv_block_op(&self, pool: &CudaKvPool, block: u32) -> Vec<u8> {
        let ranges = pool.block_ranges(block);
        let mut out = Vec::with_capacity(pool.layers.len() * pool.part_bytes.iter().sum::<usize>());
        for parts in &pool.layers {
            for (buf, range) in parts.iter().zip(&ranges) {
                match self.stream.clone_dtoh(&buf.slice(range.clone())) {
                    Ok(bytes) => out.extend_from_slice(&bytes),
                    Err(e) => {
                        self.record(Err(e), "copying a KV block to the host");
                        return Vec::new();
                    }
                }
            }
        }
        out
    }

    /// [`crate::backend::ops::BatchOps::write_kv_block`].
    pub(super) fn write_kv_block_op(&self, pool: &mut CudaKvPool, block: u32, bytes: &[u8]) -> Result<()> {
        let ranges = pool.block_ranges(block);
        let want = pool.layers.len() * pool.part_bytes.iter().sum::<usize>();
        if bytes.len() != want {
            return Err(Error::Invalid(format!(
                "a KV block of {} bytes for a pool whose blocks hold {want}",
                bytes.len()
            )));
        }
        let mut at = 0;
        for parts in &mut pool.layers {
            for (buf, range) in parts.iter_mut().zip(&ranges) {
                let part = &bytes[at..at + range.len()];
                at += range.len();
                self.stream
                    .memcpy_htod(part, &mut buf.slice_mut(range.clone()))
                    .map_err(|e| Error::Invalid(format!("cuda:{}: restoring a KV block: {e}", self.ordinal)))?;
            }
        }
        Ok(())
    }

    /// Keys and values of `layer` in `pool` as f32, `[slots, kv_dim]` each
    /// (tests read back what was written).
    pub fn kv_pool_to_host(&self, pool: &CudaKvPool, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_op()?;
        if pool.coded.is_some() {
            return Err(Error::Invalid("an encoded KV pool holds no f32 rows to read back".into()));
        }
        let (keys, values) = pool.plain(layer);
        let n = pool.num_slots() * pool.kv_dim;
        let read = |buf: &CudaSlice<u8>| -> Result<Vec<f32>> {
            let bytes = self.stream.clone_dtoh(buf).map_err(|e| Error::Invalid(format!("KV pool read: {e}")))?;
            Ok(match pool.precision {
                KvPrecision::F32 => {
                    bytes[..n * 4].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
                }
                KvPrecision::F16 => {
                    bytes[..n * 2].chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
                }
            })
        };
        Ok((read(keys)?, read(values)?))
    }
}
