//! The paged KV pool in an encoded format (kv_coded.cu): the codecs'
//! rotations and codebooks on the device (the CPU's, so both backends give
//! the same numbers), the pool's per-layer buffers, quantize-on-write,
//! the split-K decode attention over packed rows, and prompt chunks through
//! the tensor-core attention over their sequences' blocks decoded to f16.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::attention_plan::flash_tile;
use super::batch::{PagedFlashArgs, batch_table, seq_rows_at};
use super::kernels::{Resolve, cfg, kernel_args, resolve_n};
use super::kv_pool::CudaKvPool;
use super::linear::GEMV_MAX_ROWS;
use super::{CudaAct, CudaBackend};
use crate::backend::AttentionShape;
use crate::kv::batch::{BatchLayout, BatchSeq};
use crate::kv::codecs::KvCodecs;
use crate::kv::{KvFormat, KvShape, KvSide};
use crate::{Error, Result};

/// Threads of a `coded_attention` block (`CODED_THREADS`).
pub(super) const CODED_THREADS: usize = 128;
/// Query heads one `coded_attention` block serves (`CODED_HEADS`).
pub(super) const CODED_HEADS: usize = 4;
/// Most keys of one `coded_attention` split (`CODED_CHUNK`).
pub(super) const CODED_CHUNK: usize = 1024;
/// Blocks per multiprocessor the split plan aims for: four. Splits of at
/// most 256 keys and sixteen blocks made one sequence at 32k keys 8% slower
/// (each block's fixed work, the query's rotation, the softmax, the
/// reduction and the value's rotation back, weighs more), 16 sequences 2%
/// faster (bench/NOTES.md).
const BLOCKS_PER_SM: usize = 4;

const HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// The kernels' id of FP8 E4M3 (2, 3, 4 are Lloyd–Max bits, 8 uniform int8).
const FMT_FP8: u8 = 9;
/// (key, value) side formats with a decode attention kernel.
const CODED_PAIRS: [(u8, u8); 11] =
    [(2, 2), (3, 3), (4, 4), (8, 8), (9, 9), (8, 4), (8, 3), (8, 2), (4, 3), (4, 2), (3, 2)];

/// Anchor values per `kv_dim` (kv/coded.rs): key offsets, value offsets, key scales.
const ANCHOR_VALUES: usize = 3;
/// Block size the pool's per-token cost assumes for its anchors
/// (the engine's default).
const ANCHOR_BLOCK: usize = 16;

fn side_id(side: KvSide) -> Option<u8> {
    match side {
        KvSide::Turbo(b @ (2 | 3 | 4 | 8)) => Some(b),
        KvSide::Fp8 => Some(FMT_FP8),
        _ => None,
    }
}

fn side_bits(id: u8) -> usize {
    if id == FMT_FP8 { 8 } else { id as usize }
}

/// The pair index of an encoded `format` on CUDA; an error listing the
/// formats CUDA stores otherwise.
pub fn coded_pair(format: KvFormat) -> std::result::Result<usize, String> {
    let pair = side_id(format.keys).zip(side_id(format.values));
    pair.and_then(|p| CODED_PAIRS.iter().position(|&c| c == p)).ok_or_else(|| {
        format!(
            "the CUDA backend stores KV caches as f16, f32, fp8, turbo8, turbo4, turbo3, turbo2, k8v4, k8v3, k8v2, \
             k4v3, k4v2 or k3v2, not {format} (the CPU takes every format)"
        )
    })
}

/// The kernels of kv_coded.cu, per head dim 64, 128, 256.
pub(super) struct CodedKernels<K> {
    anchor: [K; 3],
    encode: [K; 3],
    dequant: [K; 3],
    /// Per head dim, per [`CODED_PAIRS`] entry.
    attention: [[K; 11]; 3],
}

impl<K> CodedKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "kv_coded.cu";
        Ok(CodedKernels {
            anchor: resolve_n(get, U, |h| format!("coded_kv_anchor{}", HEAD_DIMS[h]))?,
            encode: resolve_n(get, U, |h| format!("coded_kv_encode{}", HEAD_DIMS[h]))?,
            dequant: resolve_n(get, U, |h| format!("coded_kv_dequant{}", HEAD_DIMS[h]))?,
            attention: super::kernels::resolve_table(get, U, |h, p| {
                let (kf, vf) = CODED_PAIRS[p];
                format!("coded_attention{}_k{kf}v{vf}", HEAD_DIMS[h])
            })?,
        })
    }
}

kernel_args! {
    /// `coded_kv_anchor{hd}`.
    AnchorArgs { k: u64, v: u64, anchors: u64, table: u64, rows: i32, kv_heads: i32 }
}
kernel_args! {
    /// `coded_kv_encode{hd}`.
    EncodeArgs {
        k: u64, v: u64, kcodes: u64, kscales: u64, vcodes: u64, vscales: u64, anchors: u64, ksigns: u64, vsigns: u64,
        books: u64, table: u64, rows: i32, kv_heads: i32, block_size: i32, kfmt: i32, vfmt: i32,
    }
}
kernel_args! {
    /// `coded_attention{hd}_k{K}v{V}`.
    CodedAttentionArgs {
        q: u64, kcodes: u64, kscales: u64, vcodes: u64, vscales: u64, anchors: u64, ksigns: u64, vsigns: u64,
        kbook: u64, vbook: u64, part_o: u64, part_ml: u64, direct: u64, table: u64, rows: i32, heads: i32,
        kv_heads: i32, block_size: i32, window: i32, scale: f32, splits: i32, chunk: i32,
    }
}
kernel_args! {
    /// `coded_kv_dequant{hd}`.
    DequantArgs {
        codes: u64, scales: u64, anchors: u64, signs: u64, book: u64, map: u64, out: u64, n_blocks: i32,
        kv_heads: i32, block_size: i32, fmt: i32, side: i32,
    }
}

/// An encoded format's codecs on the device: per attention layer, side and
/// KV head the rotation's signs, and per side the codebook (16 levels, then
/// the thresholds).
pub struct CudaCodecs {
    pub format: KvFormat,
    shape: KvShape,
    /// Slot of the head dim in the kernel tables, and of the format pair.
    hd_slot: usize,
    pair: usize,
    /// Side format ids (keys, values).
    ids: [u8; 2],
    signs: CudaSlice<f32>,
    books: CudaSlice<f32>,
}

/// Buffers of one layer of a coded pool, in this order.
const KEY_CODES: usize = 0;
const KEY_SCALES: usize = 1;
const VALUE_CODES: usize = 2;
const VALUE_SCALES: usize = 3;
const ANCHORS: usize = 4;

impl CudaCodecs {
    /// The attention layers' cache shape these codecs encode.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Bytes of one vector's codes on `side` (0 keys, 1 values).
    fn code_bytes(&self, side: usize) -> usize {
        self.shape.head_dim * side_bits(self.ids[side]) / 8
    }

    /// Bytes per pool block of each of a layer's buffers.
    pub(super) fn part_bytes(&self, block_size: usize) -> Vec<usize> {
        let vectors = self.shape.num_kv_heads * block_size;
        vec![
            vectors * self.code_bytes(0),
            vectors * 4,
            vectors * self.code_bytes(1),
            vectors * 4,
            ANCHOR_VALUES * self.shape.kv_dim() * 2,
        ]
    }

    /// Bytes a token takes over `layers` layers, its block's anchor shared
    /// over [`ANCHOR_BLOCK`] tokens.
    pub(super) fn bytes_per_token(&self, layers: usize) -> usize {
        let per_block: usize = self.part_bytes(ANCHOR_BLOCK).iter().sum();
        layers * per_block.div_ceil(ANCHOR_BLOCK)
    }

    fn signs_ptr(&self, b: &CudaBackend, layer: usize, side: usize) -> u64 {
        let per = self.shape.num_kv_heads * self.shape.head_dim;
        b.p(&self.signs) + ((2 * layer + side) * per * 4) as u64
    }

    fn book_ptr(&self, b: &CudaBackend, side: usize) -> u64 {
        b.p(&self.books) + (side * 32 * 4) as u64
    }
}

impl CudaBackend {
    /// [`crate::backend::Backend::prepare_kv`] for an encoded format:
    /// the codecs of `shape.num_layers` attention layers on the device.
    pub(super) fn prepare_coded(&self, format: KvFormat, shape: KvShape) -> Result<Arc<CudaCodecs>> {
        let pair = coded_pair(format).map_err(Error::Invalid)?;
        let hd_slot = HEAD_DIMS.iter().position(|&h| h == shape.head_dim).ok_or_else(|| {
            Error::Invalid(format!(
                "KV cache format {format} on CUDA takes head dims of 64, 128 or 256; this model's is {}",
                shape.head_dim
            ))
        })?;
        let codecs = KvCodecs::new(format, shape)?;
        let (d, heads) = (shape.head_dim, shape.num_kv_heads);
        let mut signs = Vec::with_capacity(shape.num_layers * 2 * heads * d);
        for l in 0..shape.num_layers {
            for keys in [true, false] {
                for h in 0..heads {
                    let c = if keys { codecs.key(l, h) } else { codecs.value(l, h) };
                    match c.rotation() {
                        Some(r) => signs.extend_from_slice(r.signs()),
                        None => signs.extend(std::iter::repeat_n(1.0f32, d)),
                    }
                }
            }
        }
        let mut books = vec![0f32; 64];
        for (side, c) in [codecs.key(0, 0), codecs.value(0, 0)].into_iter().enumerate() {
            if let Some(book) = c.codebook() {
                books[side * 32..side * 32 + book.levels.len()].copy_from_slice(&book.levels);
                books[side * 32 + 16..side * 32 + 16 + book.thresholds.len()].copy_from_slice(&book.thresholds);
            }
        }
        let ids = [CODED_PAIRS[pair].0, CODED_PAIRS[pair].1];
        let up = |v: &[f32]| {
            self.stream.clone_htod(v).map_err(|e| Error::Invalid(format!("cuda:{}: KV codecs: {e}", self.ordinal)))
        };
        Ok(Arc::new(CudaCodecs { format, shape, hd_slot, pair, ids, signs: up(&signs)?, books: up(&books)? }))
    }

    /// [`crate::backend::ops::BatchOps::write_kv_batch`] into a coded pool:
    /// the anchors of sequences starting in this batch, then every row's
    /// key and value encoded at its slot.
    pub(super) fn write_coded(&self, pool: &CudaKvPool, layer: usize, k: &CudaAct, v: &CudaAct, batch: &BatchLayout) {
        let Some(c) = pool.codecs() else { return };
        let (heads, d) = (c.shape.num_kv_heads, c.shape.head_dim);
        if (k.rows, k.cols, v.rows, v.cols) != (batch.rows(), heads * d, batch.rows(), heads * d) {
            let e = format!(
                "k {}×{} and v {}×{} for {} rows of {}",
                k.rows,
                k.cols,
                v.rows,
                v.cols,
                batch.rows(),
                heads * d
            );
            return self.record(Err(e), "write_kv_batch");
        }
        if batch.rows() == 0 {
            return;
        }
        let Some(table) = self.batch_table_ptr(batch) else { return };
        let parts = pool.layer_parts(layer);
        let anchors = self.p(&parts[ANCHORS]);
        let rows = batch.rows() as i32;
        if batch.seqs.iter().any(|s| s.start == 0 && !s.rows.is_empty()) {
            let args =
                AnchorArgs { k: self.p(&k.buf), v: self.p(&v.buf), anchors, table, rows, kv_heads: heads as i32 };
            self.launch(&self.k.coded.anchor[c.hd_slot], cfg((rows as u32, heads as u32, 1), d as u32, 0), &args);
        }
        let warps = batch.rows() * heads;
        let args = EncodeArgs {
            k: self.p(&k.buf),
            v: self.p(&v.buf),
            kcodes: self.p(&parts[KEY_CODES]),
            kscales: self.p(&parts[KEY_SCALES]),
            vcodes: self.p(&parts[VALUE_CODES]),
            vscales: self.p(&parts[VALUE_SCALES]),
            anchors,
            ksigns: c.signs_ptr(self, layer, 0),
            vsigns: c.signs_ptr(self, layer, 1),
            books: c.book_ptr(self, 0),
            table,
            rows,
            kv_heads: heads as i32,
            block_size: pool.block_size() as i32,
            kfmt: c.ids[0] as i32,
            vfmt: c.ids[1] as i32,
        };
        self.launch(&self.k.coded.encode[c.hd_slot], cfg((warps.div_ceil(4) as u32, 2, 1), 128, 0), &args);
    }

    /// [`crate::backend::ops::BatchOps::paged_attention`] over a coded
    /// pool: prompt chunks through the tensor-core attention over their
    /// context decoded to f16 where that kernel fits, everything else
    /// through the split-K decode attention over the packed rows.
    pub(super) fn coded_attention_op(
        &self,
        q: &CudaAct,
        pool: &CudaKvPool,
        layer: usize,
        s: &AttentionShape,
        batch: &BatchLayout,
        out: &CudaAct,
    ) {
        let Some(c) = pool.codecs() else { return };
        let longest = batch.seqs.iter().map(|q| q.rows.len()).max().unwrap_or(0);
        if longest > GEMV_MAX_ROWS && self.flash_fits(s.head_dim) {
            return self.coded_prefill(c, q, pool, layer, s, batch, out);
        }
        let Some(table) = self.batch_table_ptr(batch) else { return };
        let n_keys = batch.seqs.iter().map(|q| q.start + q.rows.len()).max().unwrap_or(0);
        let group = s.num_heads / s.num_kv_heads;
        let items = q.rows * s.num_kv_heads * group.div_ceil(CODED_HEADS);
        let (chunk, splits) = coded_plan(n_keys, items, self.sm_count);
        let row_heads = q.rows * s.num_heads;
        let parts = (splits > 1).then(|| (self.act(row_heads * splits, s.head_dim), self.act(row_heads * splits, 2)));
        let (part_o, part_ml, direct) = match &parts {
            Some((o, ml)) => (self.p(&o.buf), self.p(&ml.buf), 0u64),
            None => (0, 0, self.p(&out.buf)),
        };
        let p = pool.layer_parts(layer);
        let args = CodedAttentionArgs {
            q: self.p(&q.buf),
            kcodes: self.p(&p[KEY_CODES]),
            kscales: self.p(&p[KEY_SCALES]),
            vcodes: self.p(&p[VALUE_CODES]),
            vscales: self.p(&p[VALUE_SCALES]),
            anchors: self.p(&p[ANCHORS]),
            ksigns: c.signs_ptr(self, layer, 0),
            vsigns: c.signs_ptr(self, layer, 1),
            kbook: c.book_ptr(self, 0),
            vbook: c.book_ptr(self, 1),
            part_o,
            part_ml,
            direct,
            table,
            rows: q.rows as i32,
            heads: s.num_heads as i32,
            kv_heads: s.num_kv_heads as i32,
            block_size: pool.block_size() as i32,
            window: s.window.unwrap_or(0) as i32,
            scale: s.scale,
            splits: splits as i32,
            chunk: chunk as i32,
        };
        let grid = ((q.rows * s.num_kv_heads) as u32, splits as u32, group.div_ceil(CODED_HEADS) as u32);
        self.launch(&self.k.coded.attention[c.hd_slot][c.pair], cfg(grid, CODED_THREADS as u32, 0), &args);
        if let Some((o, ml)) = &parts {
            self.combine_splits(o, ml, out, row_heads, s.head_dim, splits);
        }
    }

    /// Prompt chunks: every block of the batch's sequences decoded (rotated
    /// back, anchors added) into an f16 scratch pool, the sequences' block
    /// tables renumbered into it, and the paged tensor-core attention over
    /// that. The scratch lives for this layer's attention only.
    #[allow(clippy::too_many_arguments)]
    fn coded_prefill(
        &self,
        c: &CudaCodecs,
        q: &CudaAct,
        pool: &CudaKvPool,
        layer: usize,
        s: &AttentionShape,
        batch: &BatchLayout,
        out: &CudaAct,
    ) {
        let bs = pool.block_size();
        let mut map = Vec::new();
        let mut seqs = Vec::with_capacity(batch.seqs.len());
        for seq in &batch.seqs {
            let n = seq.context_len().div_ceil(bs);
            let base = (map.len() / 2) as u32;
            for &b in &seq.block_table[..n] {
                map.extend([b as i32, seq.block_table[0] as i32]);
            }
            seqs.push(BatchSeq { block_table: (base..base + n as u32).collect(), ..seq.clone() });
        }
        let n_blocks = map.len() / 2;
        let scratch = BatchLayout::new(seqs, bs, Vec::new());
        let table = match batch_table(&scratch) {
            Ok(t) => self.upload_slice(&t),
            Err(e) => return self.record(Err(e), "coded prefill table"),
        };
        let map = self.upload_slice(&map);
        let kv_dim = c.shape.kv_dim();
        let halves = n_blocks * bs * kv_dim;
        let alloc = || self.stream.alloc_zeros::<u16>(halves.max(1));
        let (keys, values) = match alloc().and_then(|k| alloc().map(|v| (k, v))) {
            Ok(kv) => kv,
            Err(e) => return self.record(Err(e), "coded prefill scratch"),
        };
        let p = pool.layer_parts(layer);
        let warps = n_blocks * bs * c.shape.num_kv_heads;
        for (side, codes, scales, dst) in [(0, KEY_CODES, KEY_SCALES, &keys), (1, VALUE_CODES, VALUE_SCALES, &values)] {
            let args = DequantArgs {
                codes: self.p(&p[codes]),
                scales: self.p(&p[scales]),
                anchors: self.p(&p[ANCHORS]),
                signs: c.signs_ptr(self, layer, side),
                book: c.book_ptr(self, side),
                map: self.p(&map),
                out: self.p(dst),
                n_blocks: n_blocks as i32,
                kv_heads: c.shape.num_kv_heads as i32,
                block_size: bs as i32,
                fmt: c.ids[side] as i32,
                side: side as i32,
            };
            self.launch(&self.k.coded.dequant[c.hd_slot], cfg((warps.div_ceil(4) as u32, 1, 1), 128, 0), &args);
        }
        let longest = batch.seqs.iter().map(|q| q.rows.len()).max().unwrap_or(0);
        let tile = flash_tile(s.head_dim);
        let grid = (s.num_heads as u32, longest.div_ceil(tile.rows) as u32, batch.seqs.len() as u32);
        let args = PagedFlashArgs {
            q: self.p(&q.buf),
            keys: self.p(&keys),
            values: self.p(&values),
            out: self.p(&out.buf),
            table: self.p(&table),
            rows: q.rows as i32,
            heads: s.num_heads as i32,
            kv_heads: s.num_kv_heads as i32,
            window: s.window.unwrap_or(0) as i32,
            scale: s.scale,
            block_size: bs as i32,
            seq_rows: seq_rows_at(&scratch) as i32,
        };
        let hd = HEAD_DIMS.iter().position(|&h| h == s.head_dim).expect("flash_fits checked the head dim");
        self.launch(&self.k.attention.flash_paged[hd], cfg(grid, tile.threads as u32, tile.shared as u32), &args);
    }
}

/// Keys per split and splits for `items` blocks of rows × KV heads × head
/// groups over `n_keys` keys at most: enough splits to give each of the
/// device's `sms` multiprocessors about [`BLOCKS_PER_SM`] blocks, each split
/// at least 64 keys and at most [`CODED_CHUNK`].
fn coded_plan(n_keys: usize, items: usize, sms: usize) -> (usize, usize) {
    let want = (BLOCKS_PER_SM * sms.max(1)).div_ceil(items.max(1)).max(1);
    let chunk = n_keys.div_ceil(want).next_multiple_of(64).clamp(64, CODED_CHUNK);
    (chunk, n_keys.div_ceil(chunk).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cuda_format_has_a_kernel_pair_and_others_are_refused_by_name() {
        for name in ["turbo2", "turbo3", "turbo4", "turbo8", "fp8", "k8v4", "k8v3", "k8v2", "k4v3", "k4v2", "k3v2"] {
            assert!(coded_pair(name.parse().unwrap()).is_ok(), "{name}");
        }
        for name in ["k4v8", "k4pv3", "kf16v4", "k2v4"] {
            let e = coded_pair(name.parse().unwrap()).unwrap_err();
            assert!(e.contains(&format!("not {name}")) && e.contains("the CPU takes every format"), "{e}");
        }
    }

    #[test]
    fn splits_cover_the_keys_within_the_chunk_bounds() {
        for (n, items) in [(1, 1), (63, 8), (32768, 8), (32768, 128), (2048, 4096), (100_000, 1)] {
            let (chunk, splits) = coded_plan(n, items, 132);
            assert!((64..=CODED_CHUNK).contains(&chunk) && chunk % 64 == 0, "{n} {items}: {chunk}");
            assert!(chunk * splits >= n && chunk * (splits - 1) < n.max(1), "{n} {items}: {chunk} × {splits}");
        }
    }
}
