//! Batched forwards over many sequences (batch.cu): the paged KV pool on the
//! device, the batch's description uploaded once per forward, RoPE at each
//! row's own position, the slot-mapped KV write, attention through block
//! tables, and the row copies that per-sequence ops (Gated DeltaNet) need.

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::STATIC_SHARED_ROOM;
use super::attention::KV_PRECISIONS;
use super::attention_plan::{
    DECODE_HEADS, DECODE_THREADS, batch_decode_plan, decode_plan, decode_shared, decode_whole_shared, flash_tile,
    kv_slot, kv_suffix,
};
use super::kernels::{Resolve, cfg, elementwise_cfg, kernel_args, resolve_n};
use super::kv_pool::CudaKvPool;
use super::linear::GEMV_MAX_ROWS;
use super::norm_rope::rope_style;
use super::{CudaAct, CudaBackend, CudaWeight};
use crate::Result;
use crate::backend::{AttentionShape, QkvShape};
use crate::config::rope::Rope;
use crate::kv::KvPrecision;
use crate::kv::batch::BatchLayout;

/// Threads of a `paged_attention` block (`PAGED_THREADS`): four warps, each
/// taking every fourth key of the row's context.
pub(super) const PAGED_THREADS: usize = 128;

/// Head dims each lane of a `paged_attention` warp holds
/// (`PAGED_LANE_DIMS`): head dims up to 32 times this (256).
pub(super) const PAGED_LANE_DIMS: usize = 8;

/// The kernels of batch.cu; per-precision tables by [`kv_slot`].
pub(super) struct BatchKernels<K> {
    rope: K,
    /// `paged_kv_write{kv}`.
    kv_write: [K; 2],
    /// `paged_attention{kv}`.
    attention: [K; 2],
}

impl<K> BatchKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "batch.cu";
        let kv = |i: usize| kv_suffix(KV_PRECISIONS[i]);
        Ok(BatchKernels {
            rope: get(U, "paged_rope".into())?,
            kv_write: resolve_n(get, U, |i| format!("paged_kv_write{}", kv(i)))?,
            attention: resolve_n(get, U, |i| format!("paged_attention{}", kv(i)))?,
        })
    }
}

kernel_args! {
    /// `paged_rope`.
    PagedRopeArgs { x: u64, positions: u64, inv_freq: u64, rows: i32, cols: i32, head_dim: i32, rotary_dim: i32, style: i32 }
}
kernel_args! {
    /// `paged_kv_write{kv}`.
    PagedKvWriteArgs { k: u64, v: u64, keys: u64, values: u64, slots: u64, rows: i32, kv_dim: i32 }
}
kernel_args! {
    /// `attention_decode{head_dim}_paged{kv}` (attention.cu).
    PagedDecodeArgs {
        q: u64, keys: u64, values: u64, part_o: u64, part_ml: u64, direct: u64, table: u64, heads: i32,
        kv_heads: i32, window: i32, scale: f32, splits: i32, chunk: i32, rows: i32, block_size: i32,
    }
}
kernel_args! {
    /// `flash_prefill{head_dim}_paged` (flash.cu).
    PagedFlashArgs {
        q: u64, keys: u64, values: u64, out: u64, table: u64, rows: i32, heads: i32, kv_heads: i32, window: i32,
        scale: f32, block_size: i32, seq_rows: i32,
    }
}
kernel_args! {
    /// `qkv_prologue{kv}_paged` (attention.cu).
    PagedQkvPrologueArgs {
        qkv: u64, q: u64, gate: u64, keys: u64, values: u64, q_norm: u64, k_norm: u64, inv_freq: u64, table: u64,
        heads: i32, kv_heads: i32, head_dim: i32, output_gate: i32, eps: f32, rotary_dim: i32, style: i32, rows: i32,
    }
}
kernel_args! {
    /// `paged_attention{kv}`.
    PagedAttentionArgs {
        q: u64, keys: u64, values: u64, out: u64, table: u64, rows: i32, heads: i32, kv_heads: i32, head_dim: i32,
        block_size: i32, window: i32, scale: f32,
    }
}

/// The batch table the kernels read (see batch.cu), for `layout`: per row
/// its position, its sequence and its slot, per sequence the index in the
/// table where its block table starts, then the block tables back to back,
/// then per sequence its first row and after them the number of rows (at
/// [`seq_rows_at`]). i32 throughout: the pool's slots are bounded to fit
/// (`new_kv_pool_op`).
pub(super) fn batch_table(layout: &BatchLayout) -> std::result::Result<Vec<i32>, String> {
    let rows = layout.rows();
    let len = seq_rows_at(layout) + layout.seqs.len() + 1;
    let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| format!("{what} {v} does not fit an i32"));
    int(len, "a batch table of length")?;
    let mut t = Vec::with_capacity(len);
    for &p in &layout.positions {
        t.push(int(p, "position")?);
    }
    for (i, s) in layout.seqs.iter().enumerate() {
        if s.rows.start != t.len() - rows || s.rows.end > rows {
            return Err(format!("sequence {i}'s rows {:?} are not back to back in {rows} rows", s.rows));
        }
        t.extend(std::iter::repeat_n(i as i32, s.rows.len()));
    }
    if t.len() != 2 * rows {
        return Err(format!("the sequences hold {} of the batch's {rows} rows", t.len() - rows));
    }
    t.extend(layout.slots.iter().map(|&s| s as i32));
    let mut start = 3 * rows + layout.seqs.len();
    for s in &layout.seqs {
        t.push(start as i32);
        start += s.block_table.len();
    }
    for s in &layout.seqs {
        t.extend(s.block_table.iter().map(|&b| b as i32));
    }
    t.extend(layout.seqs.iter().map(|s| s.rows.start as i32));
    t.push(rows as i32);
    Ok(t)
}

/// Where the batch table's first rows of the sequences start.
pub(super) fn seq_rows_at(layout: &BatchLayout) -> usize {
    3 * layout.rows() + layout.seqs.len() + layout.seqs.iter().map(|s| s.block_table.len()).sum::<usize>()
}

/// The last batch table uploaded, and the layout it was made from: the
/// layers of one forward share it, so it crosses to the device once.
pub(super) struct BatchTableCache {
    layout: BatchLayout,
    table: CudaSlice<i32>,
}

impl CudaBackend {
    /// The device table of `batch` (see [`batch_table`]), uploaded unless
    /// it is the last one's; None (the error recorded) when it cannot be
    /// made. The pointer stays valid for every launch issued before the next
    /// table replaces it: the old buffer is freed in stream order.
    pub(super) fn batch_table_ptr(&self, batch: &BatchLayout) -> Option<u64> {
        if let Some(staged) = self.staged_table(batch) {
            return Some(staged);
        }
        let Ok(mut cache) = self.batch_table.lock() else {
            self.record(Err("batch table lock poisoned"), "batch table");
            return None;
        };
        if let Some(c) = cache.as_ref().filter(|c| c.layout == *batch) {
            return Some(self.p(&c.table));
        }
        let table = match batch_table(batch) {
            Ok(t) => t,
            Err(e) => {
                self.record(Err(e), "batch table");
                return None;
            }
        };
        let table = self.upload_slice(&table);
        let p = self.p(&table);
        *cache = Some(BatchTableCache { layout: batch.clone(), table });
        Some(p)
    }

    /// The batch table of `batch` with row r's slot set to r (the q|k|v
    /// prologue then writes keys and values as rows of a scratch), uploaded
    /// once per batch as [`CudaBackend::batch_table_ptr`] is.
    pub(super) fn row_slot_table_ptr(&self, batch: &BatchLayout) -> Option<u64> {
        let Ok(mut cache) = self.row_slot_table.lock() else {
            self.record(Err("batch table lock poisoned"), "row-slot table");
            return None;
        };
        if let Some(c) = cache.as_ref().filter(|c| c.layout == *batch) {
            return Some(self.p(&c.table));
        }
        let mut table = match batch_table(batch) {
            Ok(t) => t,
            Err(e) => {
                self.record(Err(e), "row-slot table");
                return None;
            }
        };
        let rows = batch.rows();
        for (r, slot) in table[2 * rows..3 * rows].iter_mut().enumerate() {
            *slot = r as i32;
        }
        let table = self.upload_slice(&table);
        let p = self.p(&table);
        *cache = Some(BatchTableCache { layout: batch.clone(), table });
        Some(p)
    }

    /// The slots `slots` on the device: the current batch table's when they
    /// are its slot mapping, else a copy (returned, to be kept until the
    /// launch that reads it has been issued).
    fn slots_ptr(&self, slots: &[u32]) -> (Option<CudaSlice<i32>>, u64) {
        if let Some(staged) = self.staged_slots(slots) {
            return (None, staged);
        }
        if let Ok(cache) = self.batch_table.lock()
            && let Some(c) = cache.as_ref().filter(|c| c.layout.slots == slots)
        {
            return (None, self.p(&c.table) + (2 * slots.len() * 4) as u64);
        }
        let d = self.upload_slice(&slots.iter().map(|&s| s as i32).collect::<Vec<_>>());
        let p = self.p(&d);
        (Some(d), p)
    }

    /// [`crate::backend::ops::BatchOps::paged_prologue`]: the composition
    /// of the default (gate split, per-head norms, RoPE, KV write), with
    /// RoPE at the rows' own positions from the batch table.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged_prologue_op(
        &self,
        projected: CudaAct,
        mut k: CudaAct,
        v: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        rope: &Rope,
        pool: &mut CudaKvPool,
        layer: usize,
        batch: &BatchLayout,
    ) -> (CudaAct, Option<CudaAct>) {
        let hd = shape.head_dim;
        let (mut q, gate) = if shape.output_gate {
            let g = self.gather_columns_op(&projected, 2 * hd, hd, hd);
            (self.gather_columns_op(&projected, 2 * hd, 0, hd), Some(g))
        } else {
            (projected, None)
        };
        if let Some((qn, kn)) = norms {
            q = self.norm(&q, None, qn, None, eps);
            k = self.norm(&k, None, kn, None, eps);
        }
        if q.rows != batch.rows() || k.rows != batch.rows() {
            self.record(Err(format!("{} rows for a batch of {}", q.rows, batch.rows())), "paged_prologue");
            return (q, gate);
        }
        let Some(table) = self.batch_table_ptr(batch) else { return (q, gate) };
        self.rope_at(&mut q, hd, table, rope);
        self.rope_at(&mut k, hd, table, rope);
        if pool.coded.is_some() {
            self.write_coded(pool, layer, &k, v, batch);
        } else {
            self.write_kv_slots(pool, layer, &k, v, table + (2 * batch.rows() * 4) as u64, &batch.slots);
        }
        (q, gate)
    }

    /// [`crate::backend::ops::BatchOps::paged_qkv_prologue`] in one kernel
    /// (`qkv_prologue{kv}_paged`, a block per row and head): the gate split,
    /// the per-head norms and RoPE at the rows' positions, the queries out
    /// and the keys and values to their slots.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged_qkv_prologue_op(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        rope: &Rope,
        pool: &mut CudaKvPool,
        layer: usize,
        batch: &BatchLayout,
    ) -> (CudaAct, Option<CudaAct>) {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let q = self.act(qkv.rows, nh * hd);
        let gate = shape.output_gate.then(|| self.act(qkv.rows, nh * hd));
        let q_cols = nh * hd * if shape.output_gate { 2 } else { 1 };
        let bad = if qkv.cols != q_cols + 2 * nkv * hd || qkv.rows != batch.rows() {
            Some(format!("q|k|v of {}×{} for {} rows of shape {shape:?}", qkv.rows, qkv.cols, batch.rows()))
        } else if layer >= pool.layers.len() || pool.kv_dim != nkv * hd {
            Some(format!(
                "layer {layer} of {} KV dims {} in a pool of {} dims",
                pool.layers.len(),
                nkv * hd,
                pool.kv_dim
            ))
        } else {
            batch
                .slots
                .iter()
                .find(|&&s| s as usize >= pool.num_slots())
                .map(|s| format!("slot {s} of {}", pool.num_slots()))
        };
        if let Some(e) = bad {
            self.record(Err(e), "paged_qkv_prologue");
            return (q, gate);
        }
        if qkv.rows == 0 {
            return (q, gate);
        }
        // An encoded pool: the keys and values land as f32 rows of a scratch
        // (a table whose slot of row r is r), then are encoded as a batch.
        let coded = pool.coded.is_some();
        let table = if coded { self.row_slot_table_ptr(batch) } else { self.batch_table_ptr(batch) };
        let (Some(table), Some(inv_freq)) = (table, self.rope_table(rope)) else {
            return (q, gate);
        };
        let rows = coded.then(|| (self.act(qkv.rows, nkv * hd), self.act(qkv.rows, nkv * hd)));
        let norm_ptr = |w: &CudaWeight| match w {
            CudaWeight::Vector(v) => self.p(v),
            _ => 0,
        };
        let (q_norm, k_norm) = norms.map(|(a, b)| (norm_ptr(a), norm_ptr(b))).unwrap_or((0, 0));
        let (keys, values, precision) = match &rows {
            Some((k, v)) => (self.p(&k.buf), self.p(&v.buf), KvPrecision::F32),
            None => {
                let (k, v) = pool.plain(layer);
                (self.p(k), self.p(v), pool.precision)
            }
        };
        let args = PagedQkvPrologueArgs {
            qkv: self.p(&qkv.buf),
            q: self.p(&q.buf),
            gate: gate.as_ref().map(|g| self.p(&g.buf)).unwrap_or(0),
            keys,
            values,
            q_norm,
            k_norm,
            inv_freq,
            table,
            heads: nh as i32,
            kv_heads: nkv as i32,
            head_dim: hd as i32,
            output_gate: shape.output_gate as i32,
            eps,
            rotary_dim: rope.rotary_dim as i32,
            style: rope_style(rope),
            rows: qkv.rows as i32,
        };
        let threads = (hd.div_ceil(32) * 32).min(256) as u32;
        let c = cfg((qkv.rows as u32, (nh + nkv) as u32, 1), threads, (hd * 4) as u32);
        self.launch(&self.k.attention.qkv_prologue_paged[kv_slot(precision)], c, &args);
        if let Some((k, v)) = &rows {
            self.write_coded(pool, layer, k, v, batch);
        }
        (q, gate)
    }

    /// RoPE of every head of `x`, row r at `positions[r]` (a device array).
    fn rope_at(&self, x: &mut CudaAct, head_dim: usize, positions: u64, rope: &Rope) {
        x.quantized = None;
        let pairs = x.rows * (x.cols / head_dim) * (rope.rotary_dim / 2);
        if pairs == 0 {
            return;
        }
        let Some(inv_freq) = self.rope_table(rope) else { return };
        let args = PagedRopeArgs {
            x: self.p(&x.buf),
            positions,
            inv_freq,
            rows: x.rows as i32,
            cols: x.cols as i32,
            head_dim: head_dim as i32,
            rotary_dim: rope.rotary_dim as i32,
            style: rope_style(rope),
        };
        self.launch(&self.k.batch.rope, elementwise_cfg(pairs), &args);
    }

    /// [`crate::backend::ops::BatchOps::rope_multimodal`] as three rotations
    /// with the paged rotary kernel: by the temporal, the height and the
    /// width positions, each with the frequencies of the other components'
    /// pairs zeroed. A pair's rotations by zero are exact identities, and
    /// rotations of one pair compose by adding angles, so each pair turns
    /// once, by its own component's position times its frequency.
    pub(super) fn rope_multimodal_op(&self, x: &mut CudaAct, head_dim: usize, positions: &[[u32; 3]], rope: &Rope) {
        if positions.len() != x.rows {
            self.record(
                Err(format!("{} multimodal positions for {} rows", positions.len(), x.rows)),
                "rope_multimodal",
            );
            return;
        }
        let mut table = Vec::with_capacity(3 * positions.len());
        for c in 0..3 {
            table.extend(positions.iter().map(|p| p[c] as i32));
        }
        let table = self.upload_slice(&table);
        let base = self.p(&table);
        for c in 0..3 {
            let only = |i: usize| rope.mrope.map_or(c == 0, |m| m.component(i) == c);
            let inv_freq = rope.inv_freq.iter().enumerate().map(|(i, &f)| if only(i) { f } else { 0.0 }).collect();
            let part = Rope { inv_freq, mrope: None, ..rope.clone() };
            self.rope_at(x, head_dim, base + (c * positions.len() * 4) as u64, &part);
        }
        // Dropping `table` frees it in stream order, after the launches.
        drop(table);
    }

    /// [`crate::backend::ops::BatchOps::write_kv_paged`].
    pub(super) fn write_kv_paged_op(
        &self,
        pool: &mut CudaKvPool,
        layer: usize,
        k: &CudaAct,
        v: &CudaAct,
        slots: &[u32],
    ) {
        let (kept, ptr) = self.slots_ptr(slots);
        self.write_kv_slots(pool, layer, k, v, ptr, slots);
        drop(kept);
    }

    /// Row i of `k` and `v` to slot `slots[i]` of `layer`, the slots on the
    /// device at `slots_ptr` (checked on the host's copy, `slots`).
    fn write_kv_slots(&self, pool: &mut CudaKvPool, layer: usize, k: &CudaAct, v: &CudaAct, ptr: u64, slots: &[u32]) {
        let d = pool.kv_dim;
        let bad = if pool.coded.is_some() {
            Some(
                "an encoded KV pool is written a batch at a time (write_kv_batch), relative to each sequence's anchor"
                    .into(),
            )
        } else if layer >= pool.layers.len() {
            Some(format!("layer {layer} of a pool of {}", pool.layers.len()))
        } else if (k.rows, k.cols, v.rows, v.cols) != (slots.len(), d, slots.len(), d) {
            Some(format!("k {}×{} and v {}×{} for {} slots of {d}", k.rows, k.cols, v.rows, v.cols, slots.len()))
        } else {
            slots.iter().find(|&&s| s as usize >= pool.num_slots()).map(|s| format!("slot {s} of {}", pool.num_slots()))
        };
        if let Some(e) = bad {
            return self.record(Err(e), "write_kv_paged");
        }
        let n = slots.len() * d;
        if n == 0 {
            return;
        }
        let (keys, values) = pool.plain(layer);
        let args = PagedKvWriteArgs {
            k: self.p(&k.buf),
            v: self.p(&v.buf),
            keys: self.p(keys),
            values: self.p(values),
            slots: ptr,
            rows: slots.len() as i32,
            kv_dim: d as i32,
        };
        self.launch(&self.k.batch.kv_write[kv_slot(pool.precision)], elementwise_cfg(n), &args);
    }

    /// [`crate::backend::ops::BatchOps::paged_attention`].
    pub(super) fn paged_attention_op(
        &self,
        q: &CudaAct,
        pool: &CudaKvPool,
        layer: usize,
        s: &AttentionShape,
        batch: &BatchLayout,
    ) -> CudaAct {
        let out = self.act(q.rows, s.num_heads * s.head_dim);
        if let Err(e) = check_attention(q, pool, layer, s, batch) {
            self.record(Err(e), "paged_attention");
            return out;
        }
        if q.rows == 0 {
            return out;
        }
        if pool.coded.is_some() {
            self.coded_attention_op(q, pool, layer, s, batch, &out);
            return out;
        }
        let Some(table) = self.batch_table_ptr(batch) else { return out };
        if self.paged_attention_tiled(q, pool, layer, s, batch, table, &out) {
            return out;
        }
        let (keys, values) = pool.plain(layer);
        let args = PagedAttentionArgs {
            q: self.p(&q.buf),
            keys: self.p(keys),
            values: self.p(values),
            out: self.p(&out.buf),
            table,
            rows: q.rows as i32,
            heads: s.num_heads as i32,
            kv_heads: s.num_kv_heads as i32,
            head_dim: s.head_dim as i32,
            block_size: pool.block_size() as i32,
            window: s.window.unwrap_or(0) as i32,
            scale: s.scale,
        };
        let grid = (q.rows as u32, s.num_heads as u32, 1);
        self.launch(&self.k.batch.attention[kv_slot(pool.precision)], cfg(grid, PAGED_THREADS as u32, 0), &args);
        out
    }

    /// Copies rows `[from, from + n)` of `src` to rows `[to, to + n)` of
    /// `dst` (same widths) on the stream.
    /// Attention of the batch through the one-sequence kernels' paged
    /// forms, where they apply (head dims of 64, 128, 256): batches of
    /// decode rows (at most [`GEMV_MAX_ROWS`] a sequence) take the split-K
    /// GQA decode attention, each key and value row read once for a
    /// block's query heads; batches with prompt chunks take the tensor-core
    /// flash attention over an f16 pool. False where neither applies (the
    /// plain kernel then).
    #[allow(clippy::too_many_arguments)]
    fn paged_attention_tiled(
        &self,
        q: &CudaAct,
        pool: &CudaKvPool,
        layer: usize,
        s: &AttentionShape,
        batch: &BatchLayout,
        table: u64,
        out: &CudaAct,
    ) -> bool {
        let Some(hd) = Self::head_dim_slot(s.head_dim) else { return false };
        let (keys, values) = pool.plain(layer);
        let (keys, values) = (self.p(keys), self.p(values));
        let longest = batch.seqs.iter().map(|q| q.rows.len()).max().unwrap_or(0);
        let n_keys = batch.seqs.iter().map(|q| q.start + q.rows.len()).max().unwrap_or(0);
        let (window, heads, kv_heads) = (s.window.unwrap_or(0) as i32, s.num_heads as i32, s.num_kv_heads as i32);
        if longest <= GEMV_MAX_ROWS
            && let Some(whole) = self.decode_whole_keys(s.head_dim, pool.precision)
        {
            // A recorded step serves every cache of its key's range.
            let (chunk, splits) = match self.batch_staged() {
                true => decode_plan(n_keys, whole, pool.precision),
                false => batch_decode_plan(n_keys, whole, pool.precision),
            };
            let row_heads = q.rows * s.num_heads;
            let parts =
                (splits > 1).then(|| (self.act(row_heads * splits, s.head_dim), self.act(row_heads * splits, 2)));
            let (part_o, part_ml, direct) = match &parts {
                Some((o, ml)) => (self.p(&o.buf), self.p(&ml.buf), 0u64),
                None => (0, 0, self.p(&out.buf)),
            };
            let group = s.num_heads / s.num_kv_heads;
            let grid = ((q.rows * s.num_kv_heads) as u32, splits as u32, group.div_ceil(DECODE_HEADS) as u32);
            let shared = if splits == 1 {
                decode_whole_shared(chunk, s.head_dim, pool.precision, self.max_block_shared + STATIC_SHARED_ROOM)
            } else {
                decode_shared(chunk, s.head_dim, pool.precision)
            };
            let args = PagedDecodeArgs {
                q: self.p(&q.buf),
                keys,
                values,
                part_o,
                part_ml,
                direct,
                table,
                heads,
                kv_heads,
                window,
                scale: s.scale,
                splits: splits as i32,
                chunk: chunk as i32,
                rows: q.rows as i32,
                block_size: pool.block_size() as i32,
            };
            let kernel = &self.k.attention.decode[kv_slot(pool.precision)][hd][2];
            self.launch(kernel, cfg(grid, DECODE_THREADS as u32, shared as u32), &args);
            if let Some((o, ml)) = &parts {
                self.combine_splits(o, ml, out, row_heads, s.head_dim, splits);
            }
            return true;
        }
        if pool.precision != KvPrecision::F16 || !self.flash_fits(s.head_dim) {
            return false;
        }
        let tile = flash_tile(s.head_dim);
        let grid = (s.num_heads as u32, longest.div_ceil(tile.rows) as u32, batch.seqs.len() as u32);
        let args = PagedFlashArgs {
            q: self.p(&q.buf),
            keys,
            values,
            out: self.p(&out.buf),
            table,
            rows: q.rows as i32,
            heads,
            kv_heads,
            window,
            scale: s.scale,
            block_size: pool.block_size() as i32,
            seq_rows: seq_rows_at(batch) as i32,
        };
        self.launch(&self.k.attention.flash_paged[hd], cfg(grid, tile.threads as u32, tile.shared as u32), &args);
        true
    }

    fn copy_rows(&self, src: &CudaAct, from: usize, dst: &CudaAct, to: usize, n: usize) {
        let bytes = n * src.cols * 4;
        if bytes == 0 || self.failed() {
            return;
        }
        let row = (src.cols * 4) as u64;
        // SAFETY: the callers keep both ranges inside their activations
        // (rows × cols values each, of the same width).
        let r = unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                self.p(&dst.buf) + to as u64 * row,
                self.p(&src.buf) + from as u64 * row,
                bytes,
                self.stream.cu_stream(),
            )
        };
        self.record(r, "copying rows");
    }

    /// [`crate::backend::ops::BatchOps::slice_rows`].
    pub(super) fn slice_rows_op(&self, x: &CudaAct, rows: Range<usize>) -> CudaAct {
        let out = self.act(rows.len(), x.cols);
        if rows.end > x.rows {
            self.record(Err(format!("rows {rows:?} of {}", x.rows)), "slice_rows");
            return out;
        }
        self.copy_rows(x, rows.start, &out, 0, rows.len());
        out
    }

    /// [`crate::backend::ops::BatchOps::concat_rows`].
    pub(super) fn concat_rows_op(&self, parts: &[CudaAct]) -> CudaAct {
        let cols = parts.first().map_or(0, |p| p.cols);
        let out = self.act(parts.iter().map(|p| p.rows).sum(), cols);
        if parts.iter().any(|p| p.cols != cols) {
            self.record(Err("widths differ"), "concat_rows");
            return out;
        }
        let mut at = 0;
        for p in parts {
            self.copy_rows(p, 0, &out, at, p.rows);
            at += p.rows;
        }
        out
    }

    /// [`crate::backend::ops::BatchOps::gather_rows`].
    pub(super) fn gather_rows_op(&self, x: &CudaAct, rows: &[usize]) -> CudaAct {
        if let Some(r) = rows.iter().find(|&&r| r >= x.rows) {
            self.record(Err(format!("row {r} of {}", x.rows)), "gather_rows");
            return self.act(rows.len(), x.cols);
        }
        if rows.is_empty() {
            return self.act(0, x.cols);
        }
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        self.gather_rows(x, &idx)
    }
}

/// What `paged_attention` needs of its inputs: shapes that agree, head dims
/// the kernel holds, and block tables inside the pool that cover each
/// sequence's context (the kernel reads through them unchecked).
fn check_attention(
    q: &CudaAct,
    pool: &CudaKvPool,
    layer: usize,
    s: &AttentionShape,
    batch: &BatchLayout,
) -> std::result::Result<(), String> {
    let (nh, nkv, hd) = (s.num_heads, s.num_kv_heads, s.head_dim);
    if nkv == 0 || nh % nkv != 0 || hd == 0 || hd > 32 * PAGED_LANE_DIMS {
        return Err(format!("{nh} heads over {nkv} KV heads of {hd} dims (at most {})", 32 * PAGED_LANE_DIMS));
    }
    if (q.rows, q.cols) != (batch.rows(), nh * hd) || pool.kv_dim != nkv * hd || layer >= pool.layers.len() {
        return Err(format!(
            "q {}×{} for {} rows of {nh}×{hd}, a pool of {} layers × {} for layer {layer} of {nkv}×{hd}",
            q.rows,
            q.cols,
            batch.rows(),
            pool.layers.len(),
            pool.kv_dim
        ));
    }
    if batch.block_size != pool.block_size() {
        return Err(format!("block size {} for a pool of {}", batch.block_size, pool.block_size()));
    }
    for (i, seq) in batch.seqs.iter().enumerate() {
        if seq.block_table.len() * pool.block_size() < seq.context_len() {
            return Err(format!("sequence {i}: {} blocks for {} positions", seq.block_table.len(), seq.context_len()));
        }
        if let Some(b) = seq.block_table.iter().find(|&&b| b as usize >= pool.num_blocks) {
            return Err(format!("sequence {i}: block {b} of a pool of {}", pool.num_blocks));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::batch::BatchSeq;

    fn seq(rows: Range<usize>, start: usize, block_table: Vec<u32>) -> BatchSeq {
        BatchSeq { rows, start, block_table, state_slot: None, prompt: false, snapshots: Vec::new(), adapter: None }
    }

    /// The table lays out positions, sequences, slots, block-table starts
    /// and block tables as batch.cu reads them.
    #[test]
    fn batch_table_is_laid_out_as_the_kernels_read_it() {
        let layout = BatchLayout::new(vec![seq(0..2, 3, vec![5, 1]), seq(2..3, 0, vec![7])], 4, vec![1, 2]);
        let t = batch_table(&layout).unwrap();
        let rows = 3;
        assert_eq!(&t[..rows], &[3, 4, 0]);
        assert_eq!(&t[rows..2 * rows], &[0, 0, 1]);
        assert_eq!(&t[2 * rows..3 * rows], &[23, 4, 28]);
        let (s0, s1) = (t[3 * rows] as usize, t[3 * rows + 1] as usize);
        assert_eq!((&t[s0..s0 + 2], &t[s1..s1 + 1]), (&[5, 1][..], &[7][..]));
        let at = seq_rows_at(&layout);
        assert_eq!(at, 3 * rows + 2 + 3);
        assert_eq!(&t[at..], &[0, 2, 3]);
    }

    #[test]
    fn batch_table_refuses_rows_out_of_order() {
        let mut layout = BatchLayout::new(vec![seq(0..2, 0, vec![0]), seq(2..3, 0, vec![1])], 4, vec![]);
        layout.seqs.swap(0, 1);
        assert!(batch_table(&layout).is_err());
    }
}
