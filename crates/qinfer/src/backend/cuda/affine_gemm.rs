//! The tensor-core affine GEMM (affine_gemm.cu): a batch's decode rows
//! through affine weights of any bit width and storage, levels dequantized in
//! registers (read once per 64 activation rows), where the prefill path wrote
//! and read a bf16 copy of every weight.

use cudarc::driver::CudaSlice;

use super::kernels::{Resolve, cfg, elementwise_cfg, kernel_args, resolve_n};
use super::{AffineWeight, CudaAct, CudaBackend, affine};
use crate::Result;
use crate::tensor::DType;

/// Warps of a block (`AGEMM_WARPS`): 16 weight rows each.
pub(super) const AFFINE_GEMM_WARPS: usize = 4;

/// Stages of a block's ring of 64-column units (`AGEMM_STAGES`).
pub(super) const AFFINE_GEMM_STAGES: usize = 4;

/// Activation rows of a block, one kernel each (`gemm_{format}_mma_a{rows}`).
const ACT_TILES: [usize; 3] = [16, 32, 64];

/// The most activation rows the GEMM takes; more take the prefill path,
/// whose cuBLAS GEMM outruns this kernel once the multiply-adds, not the
/// weights' bytes, bound the time. On an H100 at the 8B's q4g64 shapes, a
/// layer's q|k|v, gate|up and down took 389 µs here against 455 at 128
/// rows, 708 against 523 at 256.
pub(super) const AFFINE_GEMM_MAX_ROWS: usize = 128;

/// Launches of the tensor-core affine GEMV (each over as many rows as it
/// takes at once, each reading the weights again) that still beat this
/// GEMM; more rows take the GEMM. On an H100 at the 8B's q|k|v, gate|up and
/// down shapes, 4-bit groups of 64 (4 rows a launch): two launches (8 rows)
/// took 19-48 µs against the GEMM's 23-81, four (16 rows) 39-94 against
/// 23-77; Q4_K (2 rows a launch): three launches (5 rows) 23-65 against
/// 24-87, four (8 rows) 32-88 against 24-81.
const MMA_GEMV_LAUNCHES: usize = 3;

/// Blocks per streaming multiprocessor the split of K aims for: enough
/// stages in flight to keep HBM busy.
const BLOCKS_PER_SM: usize = 4;

/// Units (64 columns) a split of K keeps at least: the ring's depth.
const MIN_SPLIT_UNITS: usize = 2 * AFFINE_GEMM_STAGES;

kernel_args! {
    /// `gemm_{format}_mma_a{rows}`.
    AffineGemmArgs {
        w: u64, scales: u64, biases: u64, x: u64, bias: u64, y: u64, part: u64, out_dim: i32, in_dim: i32,
        group: i32, n_act: i32, per_split: i32, accumulate: i32,
    }
}
kernel_args! {
    /// `affine_gemm_reduce`.
    AffineGemmReduceArgs { part: u64, bias: u64, y: u64, splits: i32, n_act: i32, out_dim: i32, accumulate: i32 }
}

/// The GEMM kernels of every affine storage, by [`affine::storage_slot`].
pub(super) struct AffineGemmKernels<K> {
    by_storage: Vec<Option<[K; ACT_TILES.len()]>>,
    reduce: K,
}

impl<K> AffineGemmKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "affine_gemm.cu";
        let mut by_storage: Vec<Option<[K; ACT_TILES.len()]>> = (0..affine::STORAGES).map(|_| None).collect();
        for (slot, bits, side) in affine::storages() {
            let f = affine::storage_name(bits, side);
            by_storage[slot] = Some(resolve_n(get, U, |t| format!("gemm_{f}_mma_a{}", ACT_TILES[t]))?);
        }
        Ok(AffineGemmKernels { by_storage, reduce: get(U, "affine_gemm_reduce".into())? })
    }

    fn of(&self, w: &AffineWeight) -> Option<&[K; ACT_TILES.len()]> {
        self.by_storage.get(affine::storage_slot(w.params.bits, w.side)?)?.as_ref()
    }
}

/// Shared memory of a block: its stages of levels and activations.
fn shared_bytes(bits: usize, act: usize) -> usize {
    AFFINE_GEMM_STAGES * (AFFINE_GEMM_WARPS * 16 * bits * 8 + act * 128)
}

impl CudaBackend {
    /// Whether `rows` activation rows through `w` take the tensor-core GEMM:
    /// more than the tensor-core GEMV takes in [`MMA_GEMV_LAUNCHES`]
    /// launches where `w` has one, else more than one (the CUDA-core GEMV
    /// does each row's arithmetic per weight: Q6_K at the 8B's shapes took
    /// 59-237 µs for 4 rows there, 23-86 for 5 here), up to
    /// [`AFFINE_GEMM_MAX_ROWS`]; rows of whole 64-column units, groups of
    /// whole 16-column slices, and bf16 activations (not the parity
    /// configuration's split ones).
    pub(super) fn affine_gemm_takes(&self, w: &AffineWeight, rows: usize) -> bool {
        let gemv_rows = self.affine_mma_rows(w).map_or(1, |per_launch| per_launch * MMA_GEMV_LAUNCHES);
        self.affine_gemm
            && !self.split_activations
            && self.gemv_shape.is_none()
            && (gemv_rows + 1..=AFFINE_GEMM_MAX_ROWS).contains(&rows)
            && w.cols.is_multiple_of(64)
            && w.params.group_size.is_multiple_of(16)
            && self.k.affine_gemm.of(w).is_some()
    }

    /// `y (+)= x·wᵀ (+ bias)` on the tensor cores ([`Self::affine_gemm_takes`]).
    pub(super) fn affine_tc_gemm(&self, x: &CudaAct, w: &AffineWeight, bias_ptr: u64, y: &CudaAct, accumulate: bool) {
        if self.affine_gemm4_takes(w, x.rows) {
            self.affine_gemm4(x, w, bias_ptr, y, accumulate);
            return;
        }
        let tile = ACT_TILES.iter().position(|&t| x.rows <= t).unwrap_or(ACT_TILES.len() - 1);
        let act = ACT_TILES[tile];
        let kernel = self.k.affine_gemm.of(w).map(|k| &k[tile]);
        let inputs = self.gemm_inputs(x, DType::BF16);
        let Some(x16) = inputs.first() else {
            self.record(Err("no bf16 activations"), "tensor-core affine GEMM");
            return;
        };
        let (row_blocks, act_blocks) = (w.rows.div_ceil(AFFINE_GEMM_WARPS * 16), x.rows.div_ceil(act));
        let units = w.cols / 64;
        let per_split = self.affine_gemm_split(row_blocks * act_blocks, BLOCKS_PER_SM, units, MIN_SPLIT_UNITS);
        let splits = units.div_ceil(per_split);
        let part = (splits > 1).then(|| self.uninit::<f32>(splits * x.rows * w.rows));
        let shared = shared_bytes(w.params.bits as usize, act) as u32;
        let threads = (AFFINE_GEMM_WARPS * 32) as u32;
        let grid = (row_blocks as u32, act_blocks as u32, splits as u32);
        let args = AffineGemmArgs {
            w: self.p(&w.packed),
            scales: self.p(&w.scales),
            biases: self.p(&w.biases),
            x: self.p(x16),
            bias: if part.is_some() { 0 } else { bias_ptr },
            y: self.p(&y.buf),
            part: part.as_ref().map_or(0, |p| self.p(p)),
            out_dim: w.rows as i32,
            in_dim: w.cols as i32,
            group: w.params.group_size as i32,
            n_act: x.rows as i32,
            per_split: per_split as i32,
            accumulate: accumulate as i32,
        };
        self.launch_opt(kernel, "tensor-core affine GEMM", cfg(grid, threads, shared), &args);
        if let Some(part) = &part {
            self.affine_gemm_reduce(part, splits, x.rows, w.rows, bias_ptr, y, accumulate);
        }
    }

    /// Items (units or stages of K) a split takes, splitting K while a grid
    /// of `blocks` would leave SMs idle at `per_sm` blocks each, each split
    /// at least `min_items` long.
    pub(super) fn affine_gemm_split(&self, blocks: usize, per_sm: usize, items: usize, min_items: usize) -> usize {
        let wanted = (per_sm * self.sm_count).div_ceil(blocks);
        let splits = wanted.min(items / min_items).max(1);
        items.div_ceil(splits)
    }

    /// y (=, or += with `accumulate`) the sum of the `splits` partial
    /// products in `part` ([splits][n_act][out_dim]), in order, plus the bias.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn affine_gemm_reduce(
        &self,
        part: &CudaSlice<f32>,
        splits: usize,
        n_act: usize,
        out_dim: usize,
        bias_ptr: u64,
        y: &CudaAct,
        accumulate: bool,
    ) {
        let args = AffineGemmReduceArgs {
            part: self.p(part),
            bias: bias_ptr,
            y: self.p(&y.buf),
            splits: splits as i32,
            n_act: n_act as i32,
            out_dim: out_dim as i32,
            accumulate: accumulate as i32,
        };
        self.launch(&self.k.affine_gemm.reduce, elementwise_cfg(n_act * out_dim), &args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block's stages fit the 48 KiB a kernel may take without asking.
    #[test]
    fn stages_fit_the_default_shared_memory() {
        for bits in affine::AFFINE_BITS {
            for act in ACT_TILES {
                assert!(shared_bytes(bits as usize, act) <= 48 * 1024, "{bits} bits, {act} rows");
            }
        }
    }
}
