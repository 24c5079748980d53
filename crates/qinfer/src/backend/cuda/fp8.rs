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
    to_bf16: K,
    embed: K,
}

impl<K> Fp8Kernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "fp8.cu";
        Ok(Fp8Kernels {
            gemv: [get(U, "gemv_fp8_r4a1".into())?, get(U, "gemv_fp8_r2a8".into())?],
            to_bf16: get(U, "fp8_to_bf16".into())?,
            embed: get(U, "embed_fp8".into())?,
        })
    }
}

kernel_args! {
    /// `gemv_fp8_r{R}a{A}`.
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

impl CudaBackend {
    /// `y = x · wᵀ (+ bias)` for up to [`GEMV_MAX_ROWS`] activation rows;
    /// `bias` may be `y` itself (each output adds its own value).
    pub(super) fn fp8_gemv(&self, x: &CudaAct, w: &Fp8Weight, bias: u64, y: &CudaAct) {
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
