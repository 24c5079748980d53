//! Routed experts of a prefill on the device. The router's top-k runs on the
//! device (`moe_route`, as for decode); the (token, choice) entries are
//! sorted by expert into contiguous segments (`moe_count`, `moe_offsets`,
//! `moe_scatter_*`, which also narrow x to the GEMM's input type).
//!
//! Where the segments are short (up to a few thousand tokens: dozens of rows
//! an expert), one grouped GEMM launch a projection covers every expert
//! (`moe_gemm_*`, moe_gemm.cu), affine experts dequantized in its shared
//! memory, its segment tiles laid out by `moe_offsets`: no host
//! synchronization. Longer segments take one cuBLAS GEMM per expert, whose
//! sizes the per-expert counts give (one small copy to the host a layer);
//! affine experts are then dequantized to bf16 a chunk of experts at a time
//! by one launch (`moe_{format}_to_bf16`), skipping experts no token chose,
//! and float experts are read where they lie. `moe_gather_combine` sums each
//! token's experts.
//!
//! (Routing and sorting on the host would take a few ms a layer at 8k
//! tokens, single-threaded, and per-expert token lists a stream sync each.)

use cudarc::driver::CudaSlice;

use super::kernels::{blocks, cfg, kernel_args};
use super::linear::FloatType;
use super::moe::{ExpertTables, ProjectionKind, ProjectionTable, RouteArgs};
use super::{AffineSide, CudaAct, CudaBackend, CudaWeight};
use crate::backend::{Backend, ExpertWeights, Routing};
use crate::tensor::DType;

/// Dequantized expert values held at once (bf16: 512 MiB): a layer's
/// experts of one projection in a chunk or a few.
const DEQUANT_VALUES: usize = 1 << 28;

/// Choices per token `moe_gather_combine` orders (`MOE_MAX_TOP_K`).
pub(super) const MAX_TOP_K: usize = 64;

/// Rows of a grouped GEMM block's segment tile (`MG_BM`).
pub(super) const GROUPED_TILE_ROWS: usize = 64;
/// Outputs of a grouped GEMM block (`MG_BN`).
pub(super) const GROUPED_TILE_OUTPUTS: usize = 128;
/// Values of k a grouped GEMM stage takes (`MG_BK`): every GEMM's k is a
/// multiple.
pub(super) const GROUPED_STAGE_K: usize = 64;
/// Dynamic shared memory of a grouped GEMM block (`MG_SHARED`): two stages
/// of its bf16/f16 A and B tiles, rows padded by 8 values.
pub(super) const GROUPED_SHARED: usize = 2 * (GROUPED_TILE_ROWS + GROUPED_TILE_OUTPUTS) * (GROUPED_STAGE_K + 8) * 2;

/// The most rows a chosen expert may average for the grouped GEMM by
/// default: Qwen3-30B-A3B (8 of 128 experts) up to 1024 tokens. Measured on
/// random-weight 30B-A3B q4g64 (H200): pp512 (32 rows) 1.8-2.0x the
/// per-expert GEMMs, pp2048 (128 rows) even, pp8192 (512 rows) 0.67x.
const GROUPED_MAX_MEAN_ROWS: usize = 64;

/// The default grouped-GEMM bound for experts stored as `kind`. GGUF
/// K-quant super-block records stay on the per-expert GEMMs: the grouped
/// kernel decodes each 32-value chunk's scale and bias from the record with
/// byte loads, and 30B-A3B Q4_K_M prefill measured 0.79x at pp512.
fn grouped_rows_default(kind: ProjectionKind) -> usize {
    match kind {
        ProjectionKind::Affine { side: AffineSide::Records, .. } => 0,
        ProjectionKind::Affine { .. } | ProjectionKind::Float(_) => GROUPED_MAX_MEAN_ROWS,
    }
}

impl ProjectionTable {
    /// The type the GEMMs read this projection's experts in: bf16 or f16
    /// as stored, bf16 for affine experts (dequantized); None for f32
    /// experts (the host-routed path keeps them in f32).
    fn gemm_dtype(&self) -> Option<DType> {
        match self.kind {
            ProjectionKind::Affine { .. } => Some(DType::BF16),
            ProjectionKind::Float(FloatType::Bf16) => Some(DType::BF16),
            ProjectionKind::Float(FloatType::F16) => Some(DType::F16),
            ProjectionKind::Float(FloatType::F32) => None,
        }
    }
}

kernel_args! {
    /// `moe_scatter_{bf16,f16}`.
    ScatterArgs { ids: u64, x: u64, cols: i32, top_k: i32, cursors: u64, pos: u64, hi: u64, lo: u64 }
}
kernel_args! {
    /// `moe_gather_combine`.
    GatherCombineArgs { y: u64, ids: u64, pos: u64, weights: u64, out: u64, top_k: i32, cols: i32 }
}
kernel_args! {
    /// `moe_count`.
    CountArgs { ids: u64, entries: i32, counts: u64 }
}
kernel_args! {
    /// `moe_offsets`.
    OffsetsArgs { counts: u64, experts: i32, offsets: u64, cursors: u64, tiles: u64, n_tiles: u64, tile_rows: i32 }
}
kernel_args! {
    /// `moe_{format}_to_bf16` (affine_gemv.cu).
    ExpertsToBf16Args {
        packed: u64, scales: u64, biases: u64, counts: u64, e0: i32, out: u64, rows: i32, in_dim: i32, group: i32,
    }
}
kernel_args! {
    /// `moe_gemm_{bf16,f16}`.
    GemmArgs { weights: u64, tiles: u64, count: u64, hi: u64, lo: u64, y: u64, n: i32, k: i32 }
}
kernel_args! {
    /// `moe_gemm_{affine format}`.
    AffineGemmArgs {
        weights: u64, scales: u64, biases: u64, group: i32, tiles: u64, count: u64, hi: u64, lo: u64, y: u64, n: i32,
        k: i32,
    }
}

/// Where each expert's rows of the sorted entries lie.
struct Segments {
    /// Entries routed to each expert, on the device (the dequantization
    /// launches skip unchosen experts).
    counts_dev: CudaSlice<i32>,
    /// Next free row of each expert's segment, advanced by the scatter.
    cursors: CudaSlice<i32>,
    layout: SegmentLayout,
}

/// How the GEMMs find the segments.
enum SegmentLayout {
    /// The grouped GEMM's segment tiles, (expert, first row, end row, 0)
    /// each, their number (both written by `moe_offsets`), and the most
    /// there can be (its grid).
    Tiles { tiles: CudaSlice<i32>, count: CudaSlice<i32>, bound: usize },
    /// Each expert's entry count and first row, on the host.
    Host { counts: Vec<usize>, offsets: Vec<usize> },
}

impl CudaBackend {
    /// `x` `[rows, hidden]` through the experts the router picks per token,
    /// for prefill-sized batches; None where the experts' storage or shapes
    /// have no such path (f32 experts), for the caller's host-routed one.
    /// With per-expert GEMMs it synchronizes with the host once (the
    /// counts); the grouped GEMMs need no synchronization.
    pub(super) fn moe_prefill(
        &self,
        x: &CudaAct,
        logits: &CudaAct,
        experts: &[ExpertWeights<CudaWeight>],
        t: &ExpertTables,
        routing: Routing,
    ) -> Option<CudaAct> {
        let (gate_ty, down_ty) = (t.gate.gemm_dtype()?, t.down.gemm_dtype()?);
        let (width, hidden) = (t.gate.rows, x.cols);
        let shapes = t.up.gemm_dtype() == Some(gate_ty)
            && (t.gate.cols, t.up.rows, t.up.cols) == (hidden, width, hidden)
            && (t.down.rows, t.down.cols) == (hidden, width);
        if !shapes || routing.top_k > MAX_TOP_K || experts.is_empty() {
            return None;
        }
        let (tokens, k) = (x.rows, routing.top_k);
        let entries = tokens * k;
        let (ids, weights) = self.route_on_device(logits, routing);
        // Grouped where the segments would average at most the bound's rows
        // were every expert chosen (the counts stay on the device), and every
        // GEMM's k is whole stages.
        let bound = self.grouped_moe_rows.unwrap_or_else(|| {
            [&t.gate, &t.up, &t.down].iter().map(|p| grouped_rows_default(p.kind)).min().unwrap_or(0)
        });
        let grouped = entries <= bound.saturating_mul(experts.len().min(entries))
            && hidden.is_multiple_of(GROUPED_STAGE_K)
            && width.is_multiple_of(GROUPED_STAGE_K);
        let (segments, pos) = self.sort_entries(&ids, entries, experts.len(), grouped)?;

        // x's row of each entry, in the sorted order, as the gate/up GEMMs read it.
        let split = self.split_activations;
        let (hi, lo) = (self.uninit::<u16>(entries * hidden), split.then(|| self.uninit::<u16>(entries * hidden)));
        let scatter = &self.k.moe.scatter[usize::from(gate_ty == DType::F16)];
        let args = ScatterArgs {
            ids: self.p(&ids.buf),
            x: self.p(&x.buf),
            cols: hidden as i32,
            top_k: k as i32,
            cursors: self.p(&segments.cursors),
            pos: self.p(&pos),
            hi: self.p(&hi),
            lo: lo.as_ref().map_or(0, |l| self.p(l)),
        };
        self.launch(scatter, cfg((entries as u32, 1, 1), 256, 0), &args);
        let inputs: Vec<u64> = [Some(self.p(&hi)), lo.as_ref().map(|l| self.p(l))].into_iter().flatten().collect();
        let gate = self.act(entries, width);
        let up = self.act(entries, width);
        self.expert_gemms(&t.gate, experts, |e| &e.gate, &segments, &inputs, &gate);
        self.expert_gemms(&t.up, experts, |e| &e.up, &segments, &inputs, &up);
        let h = self.silu_mul(&gate, &up);
        drop((gate, up, hi, lo));
        let h_inputs = self.gemm_inputs(&h, down_ty);
        let h_ptrs: Vec<u64> = h_inputs.iter().map(|p| self.p(p)).collect();
        let y = self.act(entries, hidden);
        self.expert_gemms(&t.down, experts, |e| &e.down, &segments, &h_ptrs, &y);

        let out = self.act(tokens, hidden);
        let args = GatherCombineArgs {
            y: self.p(&y.buf),
            ids: self.p(&ids.buf),
            pos: self.p(&pos),
            weights: self.p(&weights.buf),
            out: self.p(&out.buf),
            top_k: k as i32,
            cols: hidden as i32,
        };
        self.launch(&self.k.moe.gather_combine, cfg((tokens as u32, 1, 1), 256, 0), &args);
        Some(out)
    }

    /// Each token's top-k experts and their weights ([rows, top_k] each; the
    /// ids as i32 in an activation-sized buffer).
    pub(super) fn route_on_device(&self, logits: &CudaAct, routing: Routing) -> (CudaAct, CudaAct) {
        let (rows, k) = (logits.rows, routing.top_k);
        let ids = self.act(rows, k);
        let weights = self.act(rows, k);
        let args = RouteArgs {
            logits: self.p(&logits.buf),
            ids: self.p(&ids.buf),
            weights: self.p(&weights.buf),
            experts: logits.cols as i32,
            top_k: k as i32,
            renormalize: routing.renormalize as i32,
        };
        self.launch(&self.k.moe.route, cfg((rows as u32, 1, 1), 128, 0), &args);
        (ids, weights)
    }

    /// Counts the entries per expert and lays out their segments (as the
    /// grouped GEMM's tiles, or on the host); the segments' cursors and
    /// `pos` (each entry's sorted row) are the scatter's to fill. None after
    /// a device error.
    fn sort_entries(
        &self,
        ids: &CudaAct,
        entries: usize,
        experts: usize,
        grouped: bool,
    ) -> Option<(Segments, CudaSlice<i32>)> {
        let counts_dev = self.zeros::<i32>(experts);
        let (offsets_dev, cursors) = (self.uninit::<i32>(experts + 1), self.uninit::<i32>(experts));
        let args = CountArgs { ids: self.p(&ids.buf), entries: entries as i32, counts: self.p(&counts_dev) };
        self.launch(&self.k.moe.count, cfg(blocks(entries, 256), 256, 0), &args);
        // Each expert's last tile may be partial: at most one more each.
        let bound = entries.div_ceil(GROUPED_TILE_ROWS) + experts.min(entries);
        let tiles = grouped.then(|| (self.uninit::<i32>(4 * bound), self.uninit::<i32>(1)));
        let (tiles_ptr, count_ptr) = tiles.as_ref().map_or((0, 0), |(t, n)| (self.p(t), self.p(n)));
        let args = OffsetsArgs {
            counts: self.p(&counts_dev),
            experts: experts as i32,
            offsets: self.p(&offsets_dev),
            cursors: self.p(&cursors),
            tiles: tiles_ptr,
            n_tiles: count_ptr,
            tile_rows: GROUPED_TILE_ROWS as i32,
        };
        self.launch(&self.k.moe.offsets, cfg((1, 1, 1), 32, 0), &args);
        let pos = self.uninit::<i32>(entries);
        if let Some((tiles, count)) = tiles {
            let layout = SegmentLayout::Tiles { tiles, count, bound };
            return Some((Segments { counts_dev, cursors, layout }, pos));
        }
        let counts: Vec<usize> = match self.stream.clone_dtoh(&counts_dev) {
            Ok(c) => c.iter().map(|&n| n.max(0) as usize).collect(),
            Err(e) => {
                self.record(Err(e), "copying the experts' token counts");
                return None;
            }
        };
        if self.failed() || counts.iter().sum::<usize>() != entries {
            self.record(Err("the routed entries do not add up"), "sorting tokens by expert");
            return None;
        }
        let offsets = counts
            .iter()
            .scan(0, |at, &n| {
                let o = *at;
                *at += n;
                Some(o)
            })
            .collect();
        Some((Segments { counts_dev, cursors, layout: SegmentLayout::Host { counts, offsets } }, pos))
    }

    /// `y[seg_e] = x[seg_e] · W_eᵀ` for each expert e with entries, its
    /// segment of the sorted rows; `inputs` are the rows' base pointers
    /// (one, or split activations' two halves), in the table's GEMM type.
    fn expert_gemms(
        &self,
        table: &ProjectionTable,
        experts: &[ExpertWeights<CudaWeight>],
        pick: fn(&ExpertWeights<CudaWeight>) -> &CudaWeight,
        segments: &Segments,
        inputs: &[u64],
        y: &CudaAct,
    ) {
        let (rows, cols) = (table.rows, table.cols);
        let Some(dtype) = table.gemm_dtype() else { return };
        let (counts, offsets) = match &segments.layout {
            SegmentLayout::Tiles { tiles, count, bound } => {
                return self.grouped_gemm(table, dtype, [tiles, count], *bound, inputs, y);
            }
            SegmentLayout::Host { counts, offsets } => (counts, offsets),
        };
        // (weights, expert) of each GEMM of a batch.
        let run = |batch: &[(u64, usize)]| {
            let problems: Vec<GemmProblem> =
                batch.iter().map(|&(w, e)| GemmProblem { w, first_row: offsets[e], n: counts[e] }).collect();
            self.expert_gemm_batch(dtype, rows, cols, &problems, inputs, self.p(&y.buf));
        };
        let Some((scales, biases, group)) = &table.affine else {
            let mut batch = Vec::new();
            for (e, ex) in experts.iter().enumerate().filter(|(e, _)| counts[*e] > 0) {
                match pick(ex) {
                    CudaWeight::Matrix { buf, .. } => batch.push((self.p(buf), e)),
                    _ => return self.record(Err("an expert stored unlike the first"), "MoE prefill"),
                }
            }
            return run(&batch);
        };
        let per_chunk = (DEQUANT_VALUES / (rows * cols)).clamp(1, experts.len());
        let scratch = self.uninit::<u16>(per_chunk * rows * cols);
        let kernel = match table.kind {
            ProjectionKind::Affine { bits, side, .. } => self.k.affine.storage(bits, side).map(|k| &k.moe_to_bf16),
            ProjectionKind::Float(_) => None,
        };
        for e0 in (0..experts.len()).step_by(per_chunk) {
            let span = per_chunk.min(experts.len() - e0);
            if counts[e0..e0 + span].iter().all(|&n| n == 0) {
                continue;
            }
            let grid = (blocks(rows * cols / 32, 256).0, span as u32, 1);
            let args = ExpertsToBf16Args {
                packed: self.p(&table.weights),
                scales: self.p(scales),
                biases: self.p(biases),
                counts: self.p(&segments.counts_dev),
                e0: e0 as i32,
                out: self.p(&scratch),
                rows: rows as i32,
                in_dim: cols as i32,
                group: *group as i32,
            };
            self.launch_opt(kernel, "expert dequantization", cfg(grid, 256, 0), &args);
            let batch: Vec<(u64, usize)> = (e0..e0 + span)
                .filter(|&e| counts[e] > 0)
                .map(|e| (self.p(&scratch) + ((e - e0) * rows * cols * 2) as u64, e))
                .collect();
            run(&batch);
        }
    }
}

impl CudaBackend {
    /// Every expert's GEMM of one projection in one launch (`moe_gemm_*`):
    /// a block a (segment tile, 128 outputs); affine experts dequantized
    /// in its shared memory.
    fn grouped_gemm(
        &self,
        table: &ProjectionTable,
        dtype: DType,
        [tiles, count]: [&CudaSlice<i32>; 2],
        bound: usize,
        inputs: &[u64],
        y: &CudaAct,
    ) {
        let (rows, cols) = (table.rows, table.cols);
        let grid = (bound as u32, rows.div_ceil(GROUPED_TILE_OUTPUTS) as u32, 1);
        let (hi, lo) = (inputs[0], inputs.get(1).copied().unwrap_or(0));
        let (tiles, count, y, weights) = (self.p(tiles), self.p(count), self.p(&y.buf), self.p(&table.weights));
        let (n, k) = (rows as i32, cols as i32);
        let c = cfg(grid, 128, GROUPED_SHARED as u32);
        match (&table.affine, table.kind) {
            (Some((scales, biases, group)), ProjectionKind::Affine { bits, side, .. }) => {
                let (scales, biases, group) = (self.p(scales), self.p(biases), *group as i32);
                let args = AffineGemmArgs { weights, scales, biases, group, tiles, count, hi, lo, y, n, k };
                self.launch_opt(self.k.moe.gemm_affine(bits, side), "grouped expert GEMM", c, &args);
            }
            _ => {
                let args = GemmArgs { weights, tiles, count, hi, lo, y, n, k };
                self.launch(&self.k.moe.gemm_float[usize::from(dtype == DType::F16)], c, &args);
            }
        }
    }
}

/// One expert's GEMM: weights at `w`, its `n` rows of the sorted entries
/// from `first_row`.
struct GemmProblem {
    w: u64,
    first_row: usize,
    n: usize,
}

impl CudaBackend {
    /// The experts' GEMMs of one projection (`rows × cols` weights of
    /// `dtype`; x rows of `cols` values at each of `inputs`, summed; y rows
    /// of `rows` f32 at `y`), one cuBLAS GEMM per expert. Not one grouped
    /// call (`cublasGemmGroupedBatchedEx`): CUDA 13.0's cuBLAS answers
    /// CUBLAS_STATUS_NOT_SUPPORTED for bf16 inputs with f32 outputs, and bf16
    /// outputs would round the split activations' two products apart.
    fn expert_gemm_batch(
        &self,
        dtype: DType,
        rows: usize,
        cols: usize,
        problems: &[GemmProblem],
        inputs: &[u64],
        y: u64,
    ) {
        for p in problems {
            let x_ptrs: Vec<u64> = inputs.iter().map(|&input| input + (p.first_row * cols * 2) as u64).collect();
            self.gemm_ptrs(dtype, p.w, rows, cols, &x_ptrs, p.n, y + (p.first_row * rows * 4) as u64, rows, false);
        }
    }
}
