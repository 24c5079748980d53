//! FP8 linear layers (fp8.cu): the decode GEMV over the E4M3 bytes and their
//! per-row group scales, bf16 tiles of dequantized rows for the prefill's
//! cuBLAS GEMMs, and embedding rows from an FP8 table.

use super::kernels::{Resolve, blocks, cfg, kernel_args};
use super::linear::GEMV_MAX_ROWS;
use super::{CudaAct, CudaBackend, Fp8Weight};
use crate::Result;
use crate::tensor::DType;

/// The kernels of fp8.cu.
pub(super) struct Fp8Kernels<K> {
    /// `gemv_fp8_r4a1` (one activation row, 4 weight rows a block) and
    /// `gemv_fp8_r2a8` (up to [`GEMV_MAX_ROWS`], 2 a block).
    gemv: [K; 2],
    /// The tensor-core GEMV for 1, 2 and 4 activation rows:
    /// `gemv_fp8_mma_a{1,2,4}`, then the same with the swiglu epilogue
    /// (`gemv_fp8_mma_swiglu_a{1,2,4}`).
    mma: [K; 6],
    to_bf16: K,
    embed: K,
}

impl<K> Fp8Kernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "fp8.cu";
        Ok(Fp8Kernels {
            gemv: [get(U, "gemv_fp8_r4a1".into())?, get(U, "gemv_fp8_r2a8".into())?],
            mma: [
                get(U, "gemv_fp8_mma_a1".into())?,
                get(U, "gemv_fp8_mma_a2".into())?,
                get(U, "gemv_fp8_mma_a4".into())?,
                get(U, "gemv_fp8_mma_swiglu_a1".into())?,
                get(U, "gemv_fp8_mma_swiglu_a2".into())?,
                get(U, "gemv_fp8_mma_swiglu_a4".into())?,
            ],
            to_bf16: get(U, "fp8_to_bf16".into())?,
            embed: get(U, "embed_fp8".into())?,
        })
    }
}

impl<K> Fp8Kernels<K> {
    /// The tensor-core GEMVs, which need shared memory past the default.
    pub(super) fn mma_kernels(&self) -> &[K] {
        &self.mma
    }
}

kernel_args! {
    /// `gemv_fp8_r{R}a{A}` and `gemv_fp8_mma_a{A}`.
    Fp8GemvArgs { w: u64, scales: u64, x: u64, bias: u64, y: u64, out_dim: i32, in_dim: i32, group: i32, n_act: i32 }
}
kernel_args! {
    /// `fp8_to_bf16`.
    Fp8ToBf16Args { w: u64, scales: u64, out: u64, lo: u64, row0: i32, rows: i32, in_dim: i32, group: i32 }
}
kernel_args! {
    /// `embed_fp8`.
    Fp8EmbedArgs { w: u64, scales: u64, ids: u64, out: u64, cols: i32, group: i32 }
}

/// Values per prefill tile of dequantized weights (bf16 scratch of 128 MiB).
const FP8_TILE_VALUES: usize = 64 << 20;

/// Threads of a GEMV block.
const GEMV_THREADS: u32 = 256;

/// Warps of a tensor-core FP8 GEMV block (`FP8_MMA_WARPS`).
pub(super) const FP8_MMA_WARPS: usize = 8;
/// Activation rows one tensor-core FP8 launch takes at most.
const FP8_MMA_MAX_ACT: usize = 4;
/// Launches of [`FP8_MMA_MAX_ACT`] rows a GEMV may take before the prefill
/// GEMM is cheaper (each launch reads the weight again).
const FP8_MMA_MAX_LAUNCHES: usize = 4;
/// Shared memory the tensor-core FP8 GEMV may take for its copy of x (two
/// blocks an SM; one x value of one row takes 4 bytes, `FP8_MMA_PAD` halves
/// a copy more).
pub(super) const FP8_MMA_MAX_SHARED: usize = 108 * 1024;
/// Halves between consecutive staged copies of x beyond its width
/// (`FP8_MMA_PAD`): a row's lo copy then lies 16 bytes off its hi copy's
/// banks, and the two are read without a bank conflict.
pub(super) const FP8_MMA_PAD: usize = 8;

/// Activation rows per tensor-core FP8 launch and its shared memory, for
/// `rows` rows through `w`: the most rows (4, 2 or 1) whose copy of x fits
/// shared memory, in at most [`FP8_MMA_MAX_LAUNCHES`] launches. None where
/// the kernel does not apply: a width or group not a multiple of 64, or x
/// too wide or too many rows.
fn fp8_mma_launch(w: &Fp8Weight, rows: usize, max_shared: usize) -> Option<(usize, usize)> {
    if rows == 0 || !w.cols.is_multiple_of(64) || !w.group.is_multiple_of(64) {
        return None;
    }
    let mut act = rows.min(FP8_MMA_MAX_ACT).next_power_of_two();
    loop {
        let shared = act * 2 * (w.cols + FP8_MMA_PAD) * 2;
        if shared <= max_shared {
            return (rows.div_ceil(act) <= FP8_MMA_MAX_LAUNCHES).then_some((act, shared));
        }
        if act == 1 {
            return None;
        }
        act /= 2;
    }
}

impl CudaBackend {
    /// `y = x · wᵀ (+ bias)` for up to [`GEMV_MAX_ROWS`] activation rows, or
    /// as many as the tensor-core GEMV takes; `bias` may be `y` itself with
    /// one row (each output adds its own value).
    pub(super) fn fp8_gemv(&self, x: &CudaAct, w: &Fp8Weight, bias: u64, y: &CudaAct) {
        if let Some(launch) = self.fp8_mma_launch(w, x.rows) {
            self.fp8_mma(x, w, bias, y, launch, false);
            return;
        }
        debug_assert!(x.rows <= GEMV_MAX_ROWS);
        let args = Fp8GemvArgs {
            w: self.p(&w.weight),
            scales: self.p(&w.scales),
            x: self.p(&x.buf),
            bias,
            y: self.p(&y.buf),
            out_dim: w.rows as i32,
            in_dim: w.cols as i32,
            group: w.group as i32,
            n_act: x.rows as i32,
        };
        let (kernel, rows_per_block) = if x.rows == 1 { (&self.k.fp8.gemv[0], 4) } else { (&self.k.fp8.gemv[1], 2) };
        let grid = (w.rows.div_ceil(rows_per_block) as u32, 1, 1);
        self.launch(kernel, cfg(grid, GEMV_THREADS, 0), &args);
    }

    /// silu(gate)·up of a stacked gate|up weight in one tensor-core GEMV,
    /// None where that kernel does not apply (the caller takes the two steps).
    pub(super) fn fp8_swiglu(&self, x: &CudaAct, gate_up: &Fp8Weight) -> Option<CudaAct> {
        if !gate_up.rows.is_multiple_of(2) || x.cols != gate_up.cols {
            return None;
        }
        let launch = self.fp8_mma_launch(gate_up, x.rows)?;
        let y = self.act(x.rows, gate_up.rows / 2);
        self.fp8_mma(x, gate_up, 0, &y, launch, true);
        Some(y)
    }

    /// The tensor-core GEMV in launches of `act` rows (`launch`, from
    /// [`Self::fp8_mma_launch`]); with `swiglu`, `w` is a stacked gate|up
    /// weight and y its silu(gate)·up, half as wide.
    fn fp8_mma(&self, x: &CudaAct, w: &Fp8Weight, bias: u64, y: &CudaAct, launch: (usize, usize), swiglu: bool) {
        let (act, shared) = launch;
        let kernel = &self.k.fp8.mma[act.trailing_zeros() as usize + if swiglu { 3 } else { 0 }];
        let (out_dim, block_rows) = if swiglu { (w.rows / 2, 8) } else { (w.rows, 16) };
        let grid = (out_dim.div_ceil(block_rows) as u32, 1, 1);
        for r0 in (0..x.rows).step_by(act) {
            let args = Fp8GemvArgs {
                w: self.p(&w.weight),
                scales: self.p(&w.scales),
                x: self.p(&x.buf) + (r0 * w.cols * 4) as u64,
                bias,
                y: self.p(&y.buf) + (r0 * out_dim * 4) as u64,
                out_dim: out_dim as i32,
                in_dim: w.cols as i32,
                group: w.group as i32,
                n_act: act.min(x.rows - r0) as i32,
            };
            self.launch(kernel, cfg(grid, (FP8_MMA_WARPS * 32) as u32, shared as u32), &args);
        }
    }

    /// The tensor-core GEMV's launch for `rows` rows (see [`fp8_mma_launch`]),
    /// None where it does not apply here: before compute capability 8.9 (no
    /// E4M3 conversion instruction) or with a fixed GEMV shape (profiling).
    pub(super) fn fp8_mma_launch(&self, w: &Fp8Weight, rows: usize) -> Option<(usize, usize)> {
        let max_shared = self.fp8_mma_max_shared?;
        if self.gemv_shape.is_some() {
            return None;
        }
        fp8_mma_launch(w, rows, max_shared)
    }

    /// Prefill: `y (+)= x · wᵀ` through bf16 tiles of dequantized rows and
    /// cuBLAS. With split activations (the parity configuration) the weights
    /// are split too, `w ≈ hi + lo` in bf16, and a second GEMM adds `x · loᵀ`:
    /// an E4M3 value times an f32 scale has up to 28 significant bits, which
    /// bf16 alone cuts to 8.
    pub(super) fn fp8_gemm(&self, x: &CudaAct, w: &Fp8Weight, y: &mut CudaAct, accumulate: bool) {
        let tile_rows = (FP8_TILE_VALUES / w.cols.max(1)).clamp(1, w.rows);
        let scratch = self.uninit::<u16>(tile_rows * w.cols);
        let lo = self.split_activations.then(|| self.uninit::<u16>(tile_rows * w.cols));
        let inputs = self.gemm_inputs(x, DType::BF16);
        for r0 in (0..w.rows).step_by(tile_rows) {
            let rows = tile_rows.min(w.rows - r0);
            let args = Fp8ToBf16Args {
                w: self.p(&w.weight),
                scales: self.p(&w.scales),
                out: self.p(&scratch),
                lo: lo.as_ref().map_or(0, |l| self.p(l)),
                row0: r0 as i32,
                rows: rows as i32,
                in_dim: w.cols as i32,
                group: w.group as i32,
            };
            let threads = if w.cols.is_multiple_of(16) { rows * w.cols / 16 } else { rows * w.cols };
            self.launch(&self.k.fp8.to_bf16, cfg(blocks(threads, 256), 256, 0), &args);
            let y_ptr = self.p(&y.buf) + (r0 * 4) as u64;
            self.gemm_rows(x, &inputs, DType::BF16, self.p(&scratch), rows, w.cols, y_ptr, w.rows, accumulate);
            if let Some(l) = &lo {
                self.gemm_rows(x, &inputs, DType::BF16, self.p(l), rows, w.cols, y_ptr, w.rows, true);
            }
        }
    }

    /// Embedding rows `ids` (on the device at `ids_ptr`) of an FP8 table.
    pub(super) fn fp8_embed(&self, w: &Fp8Weight, ids: usize, ids_ptr: u64, out: &CudaAct) {
        let args = Fp8EmbedArgs {
            w: self.p(&w.weight),
            scales: self.p(&w.scales),
            ids: ids_ptr,
            out: self.p(&out.buf),
            cols: w.cols as i32,
            group: w.group as i32,
        };
        self.launch(&self.k.fp8.embed, cfg((ids as u32, 1, 1), 128, 0), &args);
    }
}
