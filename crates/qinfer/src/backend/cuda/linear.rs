//! Linear layers: the float GEMVs of decode (linear.cu, gemv.cuh), cuBLAS
//! GEMMs for prefill, and the fused forms the decoder asks for (bias,
//! silu(gate)·up, the residual add, a folded RMSNorm). Affine weights take
//! affine.rs's kernels from here.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::CudaSlice;

use super::kernels::{Resolve, cfg, elementwise_cfg, kernel_args, resolve_n, resolve_table};
use super::{CudaAct, CudaBackend, CudaWeight};
use crate::backend::Backend;
use crate::backend::ops::FusedOps;
use crate::tensor::DType;
use crate::{Error, Result};

/// Rows at or below this go through the GEMV kernel; above, cuBLAS.
pub(super) const GEMV_MAX_ROWS: usize = 8;

/// Float weights go through the GEMV up to this many rows, cuBLAS above:
/// the GEMV's multiply-adds grow with the rows while cuBLAS reads the weights
/// once at any of these counts. On an H100, a Qwen3-8B bf16 decode step took
/// 5.7 ms for 1 sequence and 7.3 ms for 2 through the GEMV, 9.2 ms for 4 and
/// 13.4 ms for 8; through cuBLAS, 7.2 ms for 5 and 7.6 ms for 8.
pub(super) const FLOAT_GEMV_MAX_ROWS: usize = 2;

/// Float weights of fewer values than this keep the GEMV up to
/// [`GEMV_MAX_ROWS`] rows: reading them costs next to nothing either way, and
/// the GEMV's f32 math keeps what cuBLAS would round to bf16 (a MoE router's
/// expert choice, a Gated DeltaNet gate over a short prompt).
const FLOAT_GEMM_MIN_VALUES: usize = 1 << 20;

/// Whether `rows` activation rows through a float `[out_dim, in_dim]` weight
/// take the GEMV rather than cuBLAS.
fn float_takes_gemv(rows: usize, out_dim: usize, in_dim: usize) -> bool {
    rows <= FLOAT_GEMV_MAX_ROWS || (rows <= GEMV_MAX_ROWS && out_dim * in_dim < FLOAT_GEMM_MIN_VALUES)
}

/// The GEMV kernels compiled: (weight rows per block, activation-row bound).
pub(super) const GEMV_SHAPES: [(usize, usize); 5] = [(1, 1), (2, 1), (4, 1), (1, 8), (2, 8)];
/// The shapes of the float GEMVs' gate|up → silu·up form (`{kernel}_swiglu`).
const GEMV_SWIGLU_SHAPES: [(usize, usize); 3] = [(2, 1), (4, 1), (2, 8)];

/// The name suffix of a GEMV kernel of `shape` (`_r{rows}a{act}`).
pub(super) fn gemv_shape_suffix((rows_per_block, act): (usize, usize)) -> String {
    format!("_r{rows_per_block}a{act}")
}

/// How floats are stored: the kernels' name suffix for each, and the
/// values in one 16-byte load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FloatType {
    Bf16,
    F16,
    F32,
}

impl FloatType {
    pub(super) const ALL: [FloatType; 3] = [FloatType::Bf16, FloatType::F16, FloatType::F32];

    /// Matrices stored as `dtype` (`upload` keeps them as bf16, f16 or f32 only).
    pub(super) fn of(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => FloatType::Bf16,
            DType::F16 => FloatType::F16,
            _ => FloatType::F32,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            FloatType::Bf16 => "bf16",
            FloatType::F16 => "f16",
            FloatType::F32 => "f32",
        }
    }

    /// Values in one 16-byte load.
    pub(super) fn vec(self) -> usize {
        match self {
            FloatType::Bf16 | FloatType::F16 => 8,
            FloatType::F32 => 4,
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// The 16-bit types GEMM inputs are narrowed to.
const HALVES: [&str; 2] = ["bf16", "f16"];

/// The kernels of linear.cu.
pub(super) struct LinearKernels<K> {
    /// `gemv_{type}_r{R}a{A}`: by [`FloatType`], then [`GEMV_SHAPES`].
    gemv: [[K; GEMV_SHAPES.len()]; 3],
    /// `gemv_{type}_r{R}a{A}_swiglu`: by [`FloatType`], then [`GEMV_SWIGLU_SHAPES`].
    gemv_swiglu: [[K; GEMV_SWIGLU_SHAPES.len()]; 3],
    /// `f32_to_{bf16,f16}`, `f32_split_{bf16,f16}`.
    narrow: [K; 2],
    split: [K; 2],
    pub(super) add_bias: K,
}

impl<K> LinearKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "linear.cu";
        let name =
            |t: usize, shape, suffix| format!("gemv_{}{}{suffix}", FloatType::ALL[t].name(), gemv_shape_suffix(shape));
        Ok(LinearKernels {
            gemv: resolve_table(get, U, |t, s| name(t, GEMV_SHAPES[s], ""))?,
            gemv_swiglu: resolve_table(get, U, |t, s| name(t, GEMV_SWIGLU_SHAPES[s], "_swiglu"))?,
            narrow: resolve_n(get, U, |i| format!("f32_to_{}", HALVES[i]))?,
            split: resolve_n(get, U, |i| format!("f32_split_{}", HALVES[i]))?,
            add_bias: get(U, "add_bias".into())?,
        })
    }

    /// The float GEMV of `ty` for `shape` ((rows per block, act)), None
    /// where none was compiled.
    fn gemv(&self, ty: FloatType, shape: (usize, usize), swiglu: bool) -> Option<&K> {
        match swiglu {
            false => GEMV_SHAPES.iter().position(|&s| s == shape).map(|i| &self.gemv[ty.index()][i]),
            true => GEMV_SWIGLU_SHAPES.iter().position(|&s| s == shape).map(|i| &self.gemv_swiglu[ty.index()][i]),
        }
    }
}

kernel_args! {
    /// `gemv_{type}_r{R}a{A}[_swiglu]`.
    FloatGemvArgs { w: u64, x: u64, bias: u64, y: u64, out_dim: i32, in_dim: i32, n_act: i32 }
}
kernel_args! {
    /// `f32_to_{bf16,f16}`.
    NarrowArgs { x: u64, y: u64, n: i64 }
}
kernel_args! {
    /// `f32_split_{bf16,f16}`.
    SplitArgs { x: u64, hi: u64, lo: u64, n: i64 }
}
kernel_args! {
    /// `add_bias`.
    AddBiasArgs { y: u64, bias: u64, cols: i32, n: i64 }
}

/// How a GEMV is launched: output rows per block and threads per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvShape {
    pub(super) rows_per_block: usize,
    pub(super) threads: u32,
}

impl GemvShape {
    /// 1, 2 or 4 rows per block (at most 2 for several activation rows);
    /// whole warps, at most 256 threads (the kernels' launch bound).
    pub fn new(rows_per_block: usize, threads: u32) -> Result<Self> {
        if !matches!(rows_per_block, 1 | 2 | 4) || !threads.is_multiple_of(32) || !(32..=256).contains(&threads) {
            return Err(Error::Invalid(format!(
                "GEMV launch shape {rows_per_block} rows × {threads} threads: rows must be 1, 2 or 4, threads \
                 a multiple of 32 from 32 to 256"
            )));
        }
        Ok(GemvShape { rows_per_block, threads })
    }

    /// The shape for `out_dim × in_dim` weights of 16-byte chunks of `vec`
    /// values and `act` activation rows.
    pub(crate) fn choose(out_dim: usize, in_dim: usize, vec: usize, act: usize) -> Self {
        let chunks = in_dim.div_ceil(vec);
        // Every thread takes at least two chunks of each row; at most 256 threads.
        let threads = (chunks.div_ceil(2).div_ceil(32) * 32).clamp(32, 256) as u32;
        let rows_per_block = if act > 1 {
            2
        } else if out_dim >= 4096 {
            4
        } else {
            2
        };
        GemvShape { rows_per_block, threads }
    }
}

/// The bias's device pointer, 0 for none.
pub(super) fn bias_ptr(b: &CudaBackend, bias: Option<&CudaWeight>) -> u64 {
    match bias {
        Some(CudaWeight::Vector(v)) => b.p(v),
        _ => 0u64,
    }
}

impl CudaBackend {
    /// The GEMV launch for `out_dim × in_dim` weights read in chunks of `vec`
    /// values with `act` activation rows: the fixed shape when one is set.
    pub(super) fn gemv_launch_shape(&self, out_dim: usize, in_dim: usize, vec: usize, act: usize) -> GemvShape {
        let mut shape = self.gemv_shape.unwrap_or_else(|| GemvShape::choose(out_dim, in_dim, vec, act));
        if act > 1 {
            shape.rows_per_block = shape.rows_per_block.min(2);
        }
        shape
    }

    /// y = x·wᵀ (+ bias) for a float `[rows, in_dim]` weight and at most
    /// GEMV_MAX_ROWS activation rows. `swiglu`: the weight is a stacked
    /// gate|up and y = silu(gate)·up, rows/2 wide (`gemv_*_swiglu`, blocks of
    /// at least one gate row and its up row).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn float_gemv(
        &self,
        buf: &CudaSlice<u8>,
        dtype: DType,
        rows: usize,
        in_dim: usize,
        x: &CudaAct,
        bias_ptr: u64,
        y: &CudaAct,
        swiglu: bool,
    ) {
        let ty = FloatType::of(dtype);
        let act = if x.rows == 1 { 1 } else { GEMV_MAX_ROWS };
        let mut shape = self.gemv_launch_shape(rows, in_dim, ty.vec(), act);
        let (outputs, per_block) = if swiglu {
            shape.rows_per_block = shape.rows_per_block.max(2);
            (rows / 2, shape.rows_per_block / 2)
        } else {
            (rows, shape.rows_per_block)
        };
        let kernel = self.k.linear.gemv(ty, (shape.rows_per_block, act), swiglu);
        self.launch_opt(
            kernel,
            "float GEMV launch shape",
            cfg((outputs.div_ceil(per_block) as u32, 1, 1), shape.threads, 0),
            &FloatGemvArgs {
                w: self.p(buf),
                x: self.p(&x.buf),
                bias: bias_ptr,
                y: self.p(&y.buf),
                out_dim: outputs as i32,
                in_dim: in_dim as i32,
                n_act: x.rows as i32,
            },
        );
    }

    /// y += bias, broadcast over y's rows (a pointer of 0: no bias).
    pub(super) fn add_bias(&self, y: &CudaAct, bias_ptr: u64) {
        if bias_ptr != 0 {
            let n = y.rows * y.cols;
            let args = AddBiasArgs { y: self.p(&y.buf), bias: bias_ptr, cols: y.cols as i32, n: n as i64 };
            self.launch(&self.k.linear.add_bias, elementwise_cfg(n), &args);
        }
    }

    /// cuBLAS: y[n, out] = x[n, in] · W[out, in]ᵀ with x converted to W's type
    /// (once, or as hi + lo halves), f32 accumulation and output.
    fn gemm(&self, x: &CudaAct, w: &CudaWeight, y: &mut CudaAct) {
        let CudaWeight::Matrix { dtype, rows: out_dim, cols: in_dim, buf } = w else {
            self.record(Err("expected a matrix weight"), "linear");
            return;
        };
        let inputs = self.gemm_inputs(x, *dtype);
        self.gemm_rows(x, &inputs, *dtype, self.p(buf), *out_dim, *in_dim, self.p(&y.buf), *out_dim, false);
    }

    /// The activations as the GEMM reads them for weights of `dtype`.
    pub(super) fn gemm_inputs(&self, x: &CudaAct, dtype: DType) -> Vec<CudaSlice<u16>> {
        let count = x.rows * x.cols;
        let half = match dtype {
            DType::BF16 => 0,
            DType::F16 => 1,
            _ => return vec![],
        };
        if self.split_activations {
            let (hi, lo) = (self.uninit::<u16>(count), self.uninit::<u16>(count));
            let args = SplitArgs { x: self.p(&x.buf), hi: self.p(&hi), lo: self.p(&lo), n: count as i64 };
            self.launch(&self.k.linear.split[half], elementwise_cfg(count), &args);
            vec![hi, lo]
        } else {
            let conv = self.uninit::<u16>(count);
            let args = NarrowArgs { x: self.p(&x.buf), y: self.p(&conv), n: count as i64 };
            self.launch(&self.k.linear.narrow[half], elementwise_cfg(count), &args);
            vec![conv]
        }
    }

    /// Output columns `[0, rows)` of `y` (row stride `ldy`, at `y_ptr`) from a
    /// weight of `rows × in_dim` values of `dtype` at `w_ptr`; added to what
    /// `y` holds with `accumulate`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_rows(
        &self,
        x: &CudaAct,
        inputs: &[CudaSlice<u16>],
        dtype: DType,
        w_ptr: u64,
        rows: usize,
        in_dim: usize,
        y_ptr: u64,
        ldy: usize,
        accumulate: bool,
    ) {
        let x_ptrs: Vec<u64> =
            if inputs.is_empty() { vec![self.p(&x.buf)] } else { inputs.iter().map(|p| self.p(p)).collect() };
        self.gemm_ptrs(dtype, w_ptr, rows, in_dim, &x_ptrs, x.rows, y_ptr, ldy, accumulate);
    }

    /// `y[n, rows] (+)= x[n, in_dim] · Wᵀ` with W `rows × in_dim` values of
    /// `dtype` at `w_ptr` and x at each of `x_ptrs` in turn (one, or the
    /// high and low halves of split activations, summed), f32 out with row
    /// stride `ldy`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_ptrs(
        &self,
        dtype: DType,
        w_ptr: u64,
        rows: usize,
        in_dim: usize,
        x_ptrs: &[u64],
        n: usize,
        y_ptr: u64,
        ldy: usize,
        accumulate: bool,
    ) {
        let ty = match dtype {
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
            _ => cudaDataType::CUDA_R_32F,
        };
        let (m, n, k) = (rows as i32, n as i32, in_dim as i32);
        for (i, x_ptr) in x_ptrs.iter().enumerate() {
            if self.failed() {
                return;
            }
            let alpha = 1.0f32;
            let beta = if i == 0 && !accumulate { 0.0f32 } else { 1.0f32 };
            // Column-major view: Yᵀ[out, n] = W[out, in] (row-major = Wᵀ column-major) · Xᵀ.
            // SAFETY: the pointers hold the m×k, k×n and (ldy)×n values cuBLAS reads and writes.
            let r = unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast(),
                    w_ptr as *const _,
                    ty,
                    k,
                    *x_ptr as *const _,
                    ty,
                    k,
                    (&beta as *const f32).cast(),
                    y_ptr as *mut _,
                    cudaDataType::CUDA_R_32F,
                    ldy as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            self.record(r, "cuBLAS GEMM");
        }
    }

    /// Whether `rows` activation rows through `w` take the prefill GEMM
    /// (cuBLAS) rather than a GEMV: the one place `linear` and `linear_add`
    /// decide it.
    fn takes_gemm(&self, w: &CudaWeight, rows: usize) -> bool {
        match w {
            CudaWeight::Affine(a) => {
                self.affine_gemm_takes(a, rows) || (rows > GEMV_MAX_ROWS && self.affine_mma_shared(a, rows).is_none())
            }
            CudaWeight::Matrix { rows: out_dim, cols: in_dim, .. } => !float_takes_gemv(rows, *out_dim, *in_dim),
            CudaWeight::Fp8(f) => rows > GEMV_MAX_ROWS && self.fp8_mma_launch(f, rows).is_none(),
            CudaWeight::Vector(_) => rows > GEMV_MAX_ROWS,
        }
    }

    /// [`Backend::linear`].
    pub(super) fn linear_op(&self, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>) -> CudaAct {
        let bias_ptr = bias_ptr(self, bias);
        if let CudaWeight::Affine(a) = w {
            let mut y = self.act(x.rows, a.rows);
            if x.cols != a.cols {
                self.record(Err(format!("input width {} for a weight of {} columns", x.cols, a.cols)), "linear");
            } else if !self.takes_gemm(w, x.rows) {
                self.affine_gemv(x, a, bias_ptr, &mut y, None);
            } else {
                self.affine_gemm(x, a, bias_ptr, &mut y, false);
            }
            return y;
        }
        if let CudaWeight::Fp8(f) = w {
            let mut y = self.act(x.rows, f.rows);
            if x.cols != f.cols {
                self.record(Err(format!("input width {} for a weight of {} columns", x.cols, f.cols)), "linear");
            } else if !self.takes_gemm(w, x.rows) {
                self.fp8_gemv(x, f, bias_ptr, &y);
            } else {
                self.fp8_gemm(x, f, &mut y, false);
                self.add_bias(&y, bias_ptr);
            }
            return y;
        }
        let CudaWeight::Matrix { dtype, rows: out_dim, cols: in_dim, buf } = w else {
            self.record(Err("expected a matrix weight, found a vector"), "linear");
            return self.act(x.rows, 1);
        };
        let mut y = self.act(x.rows, *out_dim);
        if x.cols != *in_dim {
            self.record(Err(format!("input width {} for a weight of {in_dim} columns", x.cols)), "linear");
            return y;
        }
        if !self.takes_gemm(w, x.rows) {
            self.float_gemv(buf, *dtype, *out_dim, *in_dim, x, bias_ptr, &y, false);
        } else {
            self.gemm(x, w, &mut y);
            self.add_bias(&y, bias_ptr);
        }
        y
    }

    /// `h += linear(x, w, bias)`; with `next_norm` (the next op reads
    /// RMSNorm(h)·next_norm), a tensor-core affine GEMV also hands h on
    /// quantized times that weight ([`super::QuantizedRow`]).
    pub(super) fn linear_add_into(
        &self,
        h: &mut CudaAct,
        x: &CudaAct,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        next_norm: Option<u64>,
    ) {
        h.quantized = None;
        let (rows, cols) = match w {
            CudaWeight::Affine(a) => (a.rows, a.cols),
            CudaWeight::Fp8(f) => (f.rows, f.cols),
            CudaWeight::Matrix { rows, cols, .. } => (*rows, *cols),
            CudaWeight::Vector(_) => (0, 0),
        };
        let fits = rows > 0 && x.cols == cols && h.rows == x.rows && h.cols == rows;
        if fits && bias.is_none() && x.rows == 1 {
            // The GEMV's bias operand is h and its output h itself: each
            // output adds its own value just before writing it.
            let h_ptr = self.p(&h.buf);
            match w {
                CudaWeight::Affine(a) => self.affine_gemv(x, a, h_ptr, h, next_norm),
                CudaWeight::Fp8(f) => self.fp8_gemv(x, f, h_ptr, h),
                CudaWeight::Matrix { dtype, buf, .. } => self.float_gemv(buf, *dtype, rows, cols, x, h_ptr, h, false),
                CudaWeight::Vector(_) => unreachable!("`fits` excludes vectors"),
            }
            return;
        }
        if fits && bias.is_none() && self.takes_gemm(w, x.rows) {
            // Prefill: cuBLAS accumulates into h (beta = 1).
            match w {
                CudaWeight::Affine(a) => self.affine_gemm(x, a, 0, h, true),
                CudaWeight::Fp8(f) => self.fp8_gemm(x, f, h, true),
                CudaWeight::Matrix { dtype, buf, .. } => {
                    let inputs = self.gemm_inputs(x, *dtype);
                    self.gemm_rows(x, &inputs, *dtype, self.p(buf), rows, cols, self.p(&h.buf), rows, true);
                }
                CudaWeight::Vector(_) => unreachable!("`fits` excludes vectors"),
            }
            return;
        }
        let y = self.linear_op(x, w, bias);
        self.add_assign(h, &y);
    }

    /// [`FusedOps::linear_swiglu`].
    pub(super) fn linear_swiglu_op(&self, x: &CudaAct, gate_up: &CudaWeight) -> CudaAct {
        // Decode: the GEMV's epilogue forms silu(gate)·up from a block's gate
        // rows and the matching up rows (`gemv_*_swiglu`): no [T, 2·width]
        // intermediate and one launch fewer. Otherwise the two steps.
        let CudaWeight::Matrix { dtype, rows, cols: in_dim, buf } = gate_up else {
            if let CudaWeight::Affine(w) = gate_up
                && let Some(y) = self.affine_swiglu(x, None, w)
            {
                return y;
            }
            if let CudaWeight::Fp8(w) = gate_up
                && let Some(y) = self.fp8_swiglu(x, w)
            {
                return y;
            }
            return self.swiglu(&self.linear_op(x, gate_up, None));
        };
        if !float_takes_gemv(x.rows, *rows, *in_dim) || x.cols != *in_dim || rows % 2 != 0 {
            return self.swiglu(&self.linear_op(x, gate_up, None));
        }
        let y = self.act(x.rows, rows / 2);
        self.float_gemv(buf, *dtype, *rows, *in_dim, x, 0, &y, true);
        y
    }

    /// [`FusedOps::linear_normed`].
    pub(super) fn linear_normed_op(
        &self,
        h: &CudaAct,
        norm: &CudaWeight,
        eps: f32,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
    ) -> CudaAct {
        // Decode through the tensor-core affine GEMV: it stages RMSNorm(h)·norm
        // itself (see affine_mma.cu), so no norm kernel runs before it.
        if let Some((a, folded)) = self.foldable_norm(h, norm, eps, w)
            && let Some(shared) = self.affine_mma_shared(a, h.rows)
        {
            let mut y = self.act(h.rows, a.rows);
            self.affine_mma(h, Some(folded), a, bias_ptr(self, bias), &mut y, false, shared, None);
            return y;
        }
        self.linear_op(&self.rms_norm(h, norm, eps), w, bias)
    }

    /// [`FusedOps::linear_swiglu_normed`].
    pub(super) fn linear_swiglu_normed_op(
        &self,
        h: &CudaAct,
        norm: &CudaWeight,
        eps: f32,
        gate_up: &CudaWeight,
    ) -> CudaAct {
        if let Some((a, folded)) = self.foldable_norm(h, norm, eps, gate_up)
            && let Some(y) = self.affine_swiglu(h, Some(folded), a)
        {
            return y;
        }
        self.linear_swiglu_op(&self.rms_norm(h, norm, eps), gate_up)
    }
}
