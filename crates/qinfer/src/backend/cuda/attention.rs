//! Attention over the KV cache (attention.cu, flash.cu): the q|k|v prologue
//! and the KV append, the split-K decode attention (the prologue folded in
//! where it pays) and its combine, the prefill's tensor-core kernel, and the
//! exact f32 kernel of the parity configuration. attention_plan.rs decides
//! how the kernels cover a cache.

use super::attention_plan::{
    ATTENTION_CHUNK, COMBINE_DIMS, COMBINE_THREADS, DECODE_FUSED_HEADS, DECODE_HEADS, DECODE_THREADS, combine_shared,
    decode_plan, decode_shared, decode_whole_shared, flash_tile, folds_prologue, kv_slot, kv_suffix, split_count,
};
use super::kernels::{KernelArgs, Resolve, cfg, elementwise_cfg, kernel_args, resolve_n, resolve_table};
use super::linear::GEMV_MAX_ROWS;
use super::norm_rope::rope_style;
use super::{CudaAct, CudaBackend, CudaKv, CudaWeight, STATIC_SHARED_ROOM};
use crate::Result;
use crate::backend::{AttentionShape, QkvShape};
use crate::config::rope::Rope;
use crate::kv::{KvCache, KvPrecision};

/// Head dims with kernels of their own (decode and prefill).
pub(super) const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Cache precisions in [`kv_slot`]'s order.
pub(super) const KV_PRECISIONS: [KvPrecision; 2] = [KvPrecision::F16, KvPrecision::F32];

/// The kernels of attention.cu and flash.cu; per-precision tables by
/// [`kv_slot`], per-head-dim ones by [`HEAD_DIMS`].
pub(super) struct AttentionKernels<K> {
    /// `attention{kv}`.
    exact: [K; 2],
    /// `attention_split{kv}`.
    split: [K; 2],
    /// `attention_decode{head_dim}{_prologue|_paged}{kv}`: by precision,
    /// head dim, then the plain form, the one folding the prologue and the
    /// one reading a paged pool (batch.rs).
    pub(super) decode: [[[K; 3]; 3]; 2],
    pub(super) combine: K,
    kv_append: [K; 2],
    qkv_prologue: [K; 2],
    /// `qkv_prologue{kv}_paged` (for batch.rs).
    pub(super) qkv_prologue_paged: [K; 2],
    /// `flash_prefill{head_dim}` (flash.cu).
    pub(super) flash: [K; 3],
    /// `flash_prefill{head_dim}_paged` (flash.cu, for batch.rs).
    pub(super) flash_paged: [K; 3],
    kv_to_half: K,
}

impl<K> AttentionKernels<K> {
    /// The exact kernel for a cache of `kv`.
    pub(super) fn exact(&self, kv: KvPrecision) -> &K {
        &self.exact[kv_slot(kv)]
    }

    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "attention.cu";
        let kv = |i: usize| kv_suffix(KV_PRECISIONS[i]);
        let mut decode = Vec::new();
        for p in 0..2 {
            decode.push(resolve_table(get, U, |h, f| {
                format!("attention_decode{}{}{}", HEAD_DIMS[h], ["", "_prologue", "_paged"][f], kv(p))
            })?);
        }
        Ok(AttentionKernels {
            exact: resolve_n(get, U, |i| format!("attention{}", kv(i)))?,
            split: resolve_n(get, U, |i| format!("attention_split{}", kv(i)))?,
            decode: decode.try_into().map_err(|_| crate::Error::Invalid("kernel table size".into()))?,
            combine: get(U, "attention_combine".into())?,
            kv_append: resolve_n(get, U, |i| format!("kv_append{}", kv(i)))?,
            qkv_prologue: resolve_n(get, U, |i| format!("qkv_prologue{}", kv(i)))?,
            qkv_prologue_paged: resolve_n(get, U, |i| format!("qkv_prologue{}_paged", kv(i)))?,
            flash: resolve_n(get, "flash.cu", |h| format!("flash_prefill{}", HEAD_DIMS[h]))?,
            flash_paged: resolve_n(get, "flash.cu", |h| format!("flash_prefill{}_paged", HEAD_DIMS[h]))?,
            kv_to_half: get("flash.cu", "kv_to_half".into())?,
        })
    }
}

kernel_args! {
    /// `attention_decode{head_dim}{kv}`.
    DecodeArgs {
        q: u64, keys: u64, values: u64, part_o: u64, part_ml: u64, direct: u64, step: u64, heads: i32,
        kv_heads: i32, window: i32, scale: f32, splits: i32, chunk: i32,
    }
}
kernel_args! {
    /// What `attention_decode{head_dim}_prologue{kv}` takes after
    /// [`DecodeArgs`]: the q|k|v prologue's inputs.
    DecodePrologue {
        q_norm: u64, k_norm: u64, inv_freq: u64, gate: u64, eps: f32, output_gate: i32, rotary_dim: i32, style: i32,
    }
}

/// `attention_decode{head_dim}_prologue{kv}`.
struct DecodePrologueArgs<'a>(&'a DecodeArgs, &'a DecodePrologue);

impl KernelArgs for DecodePrologueArgs<'_> {
    fn each(&self, f: &mut dyn FnMut(super::kernels::Arg)) {
        self.0.each(f);
        self.1.each(f);
    }
}

kernel_args! {
    /// `attention_split{kv}`.
    SplitArgs {
        q: u64, keys: u64, values: u64, part_o: u64, part_ml: u64, direct: u64, step: u64, heads: i32,
        kv_heads: i32, head_dim: i32, window: i32, scale: f32, splits: i32,
    }
}
kernel_args! {
    /// `attention_combine`.
    CombineArgs { part_o: u64, part_ml: u64, out: u64, head_dim: i32, splits: i32 }
}
kernel_args! {
    /// `kv_append{kv}`.
    KvAppendArgs { k: u64, v: u64, keys: u64, values: u64, step: u64, rows: i32, cols: i32 }
}
kernel_args! {
    /// `kv_to_half`.
    KvToHalfArgs { keys: u64, values: u64, keys_half: u64, values_half: u64, n: i64 }
}
kernel_args! {
    /// `flash_prefill{head_dim}`.
    FlashArgs {
        q: u64, keys: u64, values: u64, out: u64, step: u64, rows: i32, heads: i32, kv_heads: i32, window: i32,
        scale: f32,
    }
}
kernel_args! {
    /// `attention{kv}`.
    ExactArgs {
        q: u64, keys: u64, values: u64, out: u64, step: u64, heads: i32, kv_heads: i32, head_dim: i32, window: i32,
        scale: f32,
    }
}
kernel_args! {
    /// `qkv_prologue{kv}`.
    QkvPrologueArgs {
        qkv: u64, q: u64, gate: u64, keys: u64, values: u64, q_norm: u64, k_norm: u64, inv_freq: u64, step: u64,
        heads: i32, kv_heads: i32, head_dim: i32, output_gate: i32, eps: f32, rotary_dim: i32, style: i32,
    }
}

/// Device pointers of a q|k|v prologue ([`CudaBackend::prologue_inputs`]).
struct PrologueInputs {
    kv: KvRows,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
}

/// A layer's key and value rows on the device, and how they are stored.
#[derive(Clone, Copy)]
struct KvRows {
    keys: u64,
    values: u64,
    precision: KvPrecision,
}

impl CudaBackend {
    /// Index of a head dim with its own kernels (64, 128, 256).
    pub(super) fn head_dim_slot(head_dim: usize) -> Option<usize> {
        HEAD_DIMS.iter().position(|&h| h == head_dim)
    }

    /// The keys one `attention_decode{head_dim}` block holds on this device;
    /// None where that kernel does not apply.
    pub(super) fn decode_whole_keys(&self, head_dim: usize, kv: KvPrecision) -> Option<usize> {
        Self::head_dim_slot(head_dim).and_then(|i| self.decode_whole[kv_slot(kv)][i])
    }

    /// Whether `flash_prefill{head_dim}` exists and its tiles fit a block here.
    pub(super) fn flash_fits(&self, head_dim: usize) -> bool {
        Self::head_dim_slot(head_dim).is_some_and(|i| self.flash[i])
    }

    /// What the q|k|v prologue of a pass needs, after checking that its
    /// positions continue the cache and reserving the cache's rows: the
    /// layer's key and value rows, the norm weights (0 when absent) and the
    /// rotation's frequencies. None (with the error recorded) when a check fails.
    #[allow(clippy::too_many_arguments)]
    fn prologue_inputs(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
    ) -> Option<PrologueInputs> {
        let q_rows = shape.num_heads * shape.head_dim * if shape.output_gate { 2 } else { 1 };
        if qkv.cols != q_rows + 2 * shape.num_kv_heads * shape.head_dim || positions.len() != qkv.rows {
            self.record(Err("q|k|v columns or positions do not match the shape"), "qkv_prologue");
            return None;
        }
        let start = positions.first().copied().unwrap_or(0);
        if start != cache.len() || positions.iter().enumerate().any(|(i, &p)| p != start + i) {
            self.record(Err("positions must continue the cache"), "qkv_prologue");
            return None;
        }
        let r = cache.reserve(&self.stream, layer, qkv.rows);
        self.record(r, "KV cache allocation");
        let (Some(kv), Some(inv_freq)) = (self.kv_rows(cache, layer), self.rope_table(rope)) else {
            return None;
        };
        let norm_ptr = |w: &CudaWeight| match w {
            CudaWeight::Vector(v) => self.p(v),
            _ => 0,
        };
        let (q_norm, k_norm) = norms.map(|(a, b)| (norm_ptr(a), norm_ptr(b))).unwrap_or((0, 0));
        self.ensure_step(start, None);
        Some(PrologueInputs { kv, q_norm, k_norm, inv_freq })
    }

    /// The device rows of `layer`'s keys and values in `cache`, None before
    /// the layer's first write.
    fn kv_rows(&self, cache: &CudaKv, layer: usize) -> Option<KvRows> {
        let (keys, values) = cache.layer(layer)?;
        Some(KvRows { keys: self.p(keys), values: self.p(values), precision: cache.precision() })
    }

    /// Decode attention split over chunks of keys so every SM has work, the
    /// chunks merged by `attention_combine` (with one chunk the kernel writes
    /// the output itself). Head dims of 64/128/256 take `attention_decode`,
    /// blocks over (row·KV head, chunk, group of query heads) sharing each
    /// key and value row; others `attention_split`, a block per (row·head,
    /// chunk).
    /// With `prologue`, `q` is a one-row stacked q|k|v projection and the
    /// decode kernel makes the queries and this pass's key and value rows
    /// itself (`attention_decode{head_dim}_prologue`; the caller checks that
    /// the head dim has a decode kernel here).
    fn attention_split(
        &self,
        q: &CudaAct,
        kv: KvRows,
        n_keys: usize,
        s: &AttentionShape,
        out: &CudaAct,
        prologue: Option<&DecodePrologue>,
    ) {
        let whole = self.decode_whole_keys(s.head_dim, kv.precision);
        let (chunk, splits) = match whole {
            Some(whole) => decode_plan(n_keys, whole, kv.precision),
            None => (ATTENTION_CHUNK, split_count(n_keys)),
        };
        let row_heads = q.rows * s.num_heads;
        let parts = (splits > 1).then(|| (self.act(row_heads * splits, s.head_dim), self.act(row_heads * splits, 2)));
        let (part_o, part_ml, direct) = match &parts {
            Some((o, ml)) => (self.p(&o.buf), self.p(&ml.buf), 0u64),
            None => (0, 0, self.p(&out.buf)),
        };
        let (window, step) = (s.window.unwrap_or(0) as i32, self.p(&self.step));
        let (heads, kv_heads) = (s.num_heads as i32, s.num_kv_heads as i32);
        let (qp, keys, values) = (self.p(&q.buf), kv.keys, kv.values);
        let slot = kv_slot(kv.precision);
        if let (Some(_), Some(hd)) = (whole, Self::head_dim_slot(s.head_dim)) {
            let group = s.num_heads / s.num_kv_heads;
            let per_block = if prologue.is_some() { DECODE_FUSED_HEADS } else { DECODE_HEADS };
            let grid = ((q.rows * s.num_kv_heads) as u32, splits as u32, group.div_ceil(per_block) as u32);
            let args = DecodeArgs {
                q: qp,
                keys,
                values,
                part_o,
                part_ml,
                direct,
                step,
                heads,
                kv_heads,
                window,
                scale: s.scale,
                splits: splits as i32,
                chunk: chunk as i32,
            };
            // One block a head (splits == 1: `chunk` is the whole-cache block's keys).
            let shared = if splits == 1 {
                // The device's opt-in maximum, as at the kernel's attribute.
                let max_shared = self.max_block_shared + STATIC_SHARED_ROOM;
                decode_whole_shared(chunk, s.head_dim, kv.precision, max_shared)
            } else {
                decode_shared(chunk, s.head_dim, kv.precision)
            };
            let c = cfg(grid, DECODE_THREADS as u32, shared as u32);
            let kernels = &self.k.attention.decode[slot][hd];
            match prologue {
                Some(p) => self.launch(&kernels[1], c, &DecodePrologueArgs(&args, p)),
                None => self.launch(&kernels[0], c, &args),
            }
        } else {
            let grid = (row_heads as u32, splits as u32, 1);
            let args = SplitArgs {
                q: qp,
                keys,
                values,
                part_o,
                part_ml,
                direct,
                step,
                heads,
                kv_heads,
                head_dim: s.head_dim as i32,
                window,
                scale: s.scale,
                splits: splits as i32,
            };
            self.launch(&self.k.attention.split[slot], cfg(grid, 128, 0), &args);
        }
        if let Some((o, ml)) = &parts {
            self.combine_splits(o, ml, out, row_heads, s.head_dim, splits);
        }
    }

    /// `out` (`row_heads` heads of `head_dim`) from the split-K parts
    /// `part_o` and `part_ml` of `splits` splits each.
    pub(super) fn combine_splits(
        &self,
        part_o: &CudaAct,
        part_ml: &CudaAct,
        out: &CudaAct,
        row_heads: usize,
        head_dim: usize,
        splits: usize,
    ) {
        let grid = (row_heads as u32, head_dim.div_ceil(COMBINE_DIMS) as u32, 1);
        let c = cfg(grid, COMBINE_THREADS as u32, combine_shared(splits) as u32);
        let args = CombineArgs {
            part_o: self.p(&part_o.buf),
            part_ml: self.p(&part_ml.buf),
            out: self.p(&out.buf),
            head_dim: head_dim as i32,
            splits: splits as i32,
        };
        self.launch(&self.k.attention.combine, c, &args);
    }

    /// [`crate::backend::Backend::write_kv`].
    pub(super) fn write_kv_op(&self, cache: &mut CudaKv, layer: usize, k: &CudaAct, v: &CudaAct) {
        let r = cache.reserve(&self.stream, layer, k.rows);
        self.record(r, "KV cache allocation");
        let Some(kv) = self.kv_rows(cache, layer) else { return };
        self.ensure_step(cache.len(), None);
        let n = k.rows * k.cols;
        let args = KvAppendArgs {
            k: self.p(&k.buf),
            v: self.p(&v.buf),
            keys: kv.keys,
            values: kv.values,
            step: self.p(&self.step),
            rows: k.rows as i32,
            cols: k.cols as i32,
        };
        self.launch(&self.k.attention.kv_append[kv_slot(kv.precision)], elementwise_cfg(n), &args);
    }

    /// [`crate::backend::Backend::attention`].
    pub(super) fn attention_op(&self, q: &CudaAct, cache: &CudaKv, layer: usize, s: &AttentionShape) -> CudaAct {
        let out = self.act(q.rows, s.num_heads * s.head_dim);
        let Some(kv) = self.kv_rows(cache, layer) else {
            self.record(Err("attention before any KV write"), "attention");
            return out;
        };
        let n_keys = cache.len() + q.rows;
        self.ensure_step(cache.len(), None);
        if q.rows <= GEMV_MAX_ROWS {
            self.attention_split(q, kv, n_keys, s, &out, None);
            return out;
        }
        if let Some(hd) =
            Self::head_dim_slot(s.head_dim).filter(|_| !self.split_activations && self.flash_fits(s.head_dim))
        {
            // The kernel reads f16 keys and values: an f16 cache as it is,
            // an f32 one converted once per call.
            let kv_dim = s.num_kv_heads * s.head_dim;
            let converted = (kv.precision == KvPrecision::F32).then(|| {
                let (keys_half, values_half) = (self.act(n_keys, kv_dim / 2), self.act(n_keys, kv_dim / 2));
                let n = n_keys * kv_dim;
                let args = KvToHalfArgs {
                    keys: kv.keys,
                    values: kv.values,
                    keys_half: self.p(&keys_half.buf),
                    values_half: self.p(&values_half.buf),
                    n: n as i64,
                };
                let c = cfg(((n / 4).div_ceil(256).min(4096) as u32, 1, 1), 256, 0);
                self.launch(&self.k.attention.kv_to_half, c, &args);
                (keys_half, values_half)
            });
            let (keys_half, values_half) =
                converted.as_ref().map_or((kv.keys, kv.values), |(k, v)| (self.p(&k.buf), self.p(&v.buf)));
            let tile = flash_tile(s.head_dim);
            let grid = (s.num_heads as u32, q.rows.div_ceil(tile.rows) as u32, 1);
            let args = FlashArgs {
                q: self.p(&q.buf),
                keys: keys_half,
                values: values_half,
                out: self.p(&out.buf),
                step: self.p(&self.step),
                rows: q.rows as i32,
                heads: s.num_heads as i32,
                kv_heads: s.num_kv_heads as i32,
                window: s.window.unwrap_or(0) as i32,
                scale: s.scale,
            };
            self.launch(&self.k.attention.flash[hd], cfg(grid, tile.threads as u32, tile.shared as u32), &args);
            return out;
        }
        // f32 arithmetic on the cache as stored (the parity configuration,
        // and other head dims).
        let shared = (n_keys * 4) as u32;
        if n_keys > self.max_attention_keys {
            self.record(
                Err(format!("{n_keys} keys exceed this attention kernel's {}-key limit", self.max_attention_keys)),
                "attention",
            );
            return out;
        }
        let args = ExactArgs {
            q: self.p(&q.buf),
            keys: kv.keys,
            values: kv.values,
            out: self.p(&out.buf),
            step: self.p(&self.step),
            heads: s.num_heads as i32,
            kv_heads: s.num_kv_heads as i32,
            head_dim: s.head_dim as i32,
            window: s.window.unwrap_or(0) as i32,
            scale: s.scale,
        };
        let c = cfg(((q.rows * s.num_heads) as u32, 1, 1), 128, shared);
        self.launch(&self.k.attention.exact[kv_slot(kv.precision)], c, &args);
        out
    }

    /// [`crate::backend::ops::FusedOps::qkv_prologue`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_prologue_op(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
    ) -> (CudaAct, Option<CudaAct>) {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let q = self.act(qkv.rows, nh * hd);
        let gate = shape.output_gate.then(|| self.act(qkv.rows, nh * hd));
        let Some(p) = self.prologue_inputs(qkv, shape, norms, positions, rope, cache, layer) else {
            return (q, gate);
        };
        let threads = (hd.div_ceil(32) * 32).min(256) as u32;
        let args = QkvPrologueArgs {
            qkv: self.p(&qkv.buf),
            q: self.p(&q.buf),
            gate: gate.as_ref().map(|g| self.p(&g.buf)).unwrap_or(0),
            keys: p.kv.keys,
            values: p.kv.values,
            q_norm: p.q_norm,
            k_norm: p.k_norm,
            inv_freq: p.inv_freq,
            step: self.p(&self.step),
            heads: nh as i32,
            kv_heads: nkv as i32,
            head_dim: hd as i32,
            output_gate: shape.output_gate as i32,
            eps,
            rotary_dim: rope.rotary_dim as i32,
            style: rope_style(rope),
        };
        let c = cfg((qkv.rows as u32, (nh + nkv) as u32, 1), threads, (hd * 4) as u32);
        self.launch(&self.k.attention.qkv_prologue[kv_slot(p.kv.precision)], c, &args);
        (q, gate)
    }

    /// [`crate::backend::ops::FusedOps::qkv_attention`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_attention_op(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
        attention: &AttentionShape,
    ) -> (CudaAct, Option<CudaAct>) {
        let hd = shape.head_dim;
        let same_heads = (attention.num_heads, attention.num_kv_heads, attention.head_dim)
            == (shape.num_heads, shape.num_kv_heads, hd);
        let n_keys = cache.len() + 1;
        let fold = self.decode_whole_keys(hd, cache.precision()).is_some_and(|whole| {
            folds_prologue(n_keys, whole, cache.precision(), shape, self.sm_count, self.fold_split_prologue)
        });
        if qkv.rows != 1 || !same_heads || !fold {
            let (q, gate) = self.qkv_prologue_op(qkv, shape, norms, eps, positions, rope, cache, layer);
            return (self.attention_op(&q, cache, layer, attention), gate);
        }
        let out = self.act(1, shape.num_heads * hd);
        let gate = shape.output_gate.then(|| self.act(1, shape.num_heads * hd));
        let Some(p) = self.prologue_inputs(qkv, shape, norms, positions, rope, cache, layer) else {
            return (out, gate);
        };
        let prologue = DecodePrologue {
            q_norm: p.q_norm,
            k_norm: p.k_norm,
            inv_freq: p.inv_freq,
            gate: gate.as_ref().map(|g| self.p(&g.buf)).unwrap_or(0),
            eps,
            output_gate: shape.output_gate as i32,
            rotary_dim: rope.rotary_dim as i32,
            style: rope_style(rope),
        };
        self.attention_split(qkv, p.kv, n_keys, attention, &out, Some(&prologue));
        (out, gate)
    }
}
