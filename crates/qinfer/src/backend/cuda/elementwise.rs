//! Elementwise and row ops (elementwise.cu): embedding rows, the step
//! inputs' writer, SwiGLU, adds and gates, column and row copies.

use cudarc::driver::CudaSlice;

use super::kernels::{Resolve, cfg, elementwise_cfg, kernel_args, resolve_n};
use super::linear::FloatType;
use super::{CudaAct, CudaBackend, CudaWeight};
use crate::backend::DEVICE_PICK;
use crate::{Error, Result};

/// The kernels of elementwise.cu.
pub(super) struct ElementwiseKernels<K> {
    /// `embed_{type}` by [`FloatType`].
    embed: [K; 3],
    pub(super) set_step: K,
    silu_mul: K,
    swiglu: K,
    add_assign: K,
    mul_sigmoid: K,
    copy_columns: K,
    gather_rows: K,
    scatter_add_rows: K,
}

impl<K> ElementwiseKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "elementwise.cu";
        Ok(ElementwiseKernels {
            embed: resolve_n(get, U, |i| format!("embed_{}", FloatType::ALL[i].name()))?,
            set_step: get(U, "set_step".into())?,
            silu_mul: get(U, "silu_mul".into())?,
            swiglu: get(U, "swiglu".into())?,
            add_assign: get(U, "add_assign".into())?,
            mul_sigmoid: get(U, "mul_sigmoid".into())?,
            copy_columns: get(U, "copy_columns".into())?,
            gather_rows: get(U, "gather_rows".into())?,
            scatter_add_rows: get(U, "scatter_add_rows".into())?,
        })
    }
}

kernel_args! {
    /// `embed_{type}`.
    EmbedArgs { table: u64, ids: u64, out: u64, cols: i32 }
}
kernel_args! {
    /// `set_step`.
    SetStepArgs { step: u64, start: i32, id: i32 }
}
kernel_args! {
    /// `silu_mul`.
    SiluMulArgs { gate: u64, up: u64, out: u64, n: i64 }
}
kernel_args! {
    /// `swiglu`.
    SwigluArgs { gate_up: u64, out: u64, width: i32, n: i64 }
}
kernel_args! {
    /// `add_assign`.
    AddAssignArgs { x: u64, y: u64, n: i64 }
}
kernel_args! {
    /// `mul_sigmoid`.
    MulSigmoidArgs { x: u64, gate: u64, cols: i32, gate_cols: i32, n: i64 }
}
kernel_args! {
    /// `copy_columns`.
    CopyColumnsArgs {
        src: u64, dst: u64, rows: i32, src_cols: i32, group: i32, offset: i32, len: i32, dst_cols: i32, dst_off: i32,
    }
}
kernel_args! {
    /// `gather_rows`.
    GatherRowsArgs { x: u64, idx: u64, out: u64, cols: i32 }
}
kernel_args! {
    /// `scatter_add_rows`.
    ScatterAddRowsArgs { y: u64, idx: u64, weights: u64, out: u64, cols: i32 }
}

/// Every id of `ids` names a row of a `rows`-row embedding table, except a
/// one-token pass's [`DEVICE_PICK`] (the step inputs hold its id).
fn check_token_ids(ids: &[u32], rows: usize) -> Result<()> {
    let device_pick = ids == [DEVICE_PICK];
    match ids.iter().find(|&&id| id as usize >= rows && !device_pick) {
        Some(id) => Err(Error::Invalid(format!("token id {id} is out of range for a vocabulary of {rows}"))),
        None => Ok(()),
    }
}

impl CudaBackend {
    /// [`crate::backend::Backend::embed`].
    pub(super) fn embed_op(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaAct> {
        if let CudaWeight::Affine(w) = table {
            check_token_ids(ids, w.rows)?;
            let out = self.act(ids.len(), w.cols);
            let (d_ids, ids_ptr) = self.device_ids(ids);
            self.affine_embed(w, ids.len(), ids_ptr, &out);
            drop(d_ids);
            return Ok(out);
        }
        if let CudaWeight::Fp8(w) = table {
            check_token_ids(ids, w.rows)?;
            let out = self.act(ids.len(), w.cols);
            let (d_ids, ids_ptr) = self.device_ids(ids);
            self.fp8_embed(w, ids.len(), ids_ptr, &out);
            drop(d_ids);
            return Ok(out);
        }
        let CudaWeight::Matrix { dtype, rows, cols, buf } = table else {
            return Err(Error::Invalid("embedding table must be a matrix".into()));
        };
        check_token_ids(ids, *rows)?;
        let out = self.act(ids.len(), *cols);
        let (d_ids, ids_ptr) = self.device_ids(ids);
        let args = EmbedArgs { table: self.p(buf), ids: ids_ptr, out: self.p(&out.buf), cols: *cols as i32 };
        let kernel = &self.k.elementwise.embed[FloatType::of(*dtype).index()];
        self.launch(kernel, cfg((ids.len() as u32, 1, 1), 256, 0), &args);
        drop(d_ids);
        Ok(out)
    }

    /// The token ids on the device: a staged batched step's (batch_graph.rs),
    /// or a one-token pass's step inputs (so a recorded step replays with the
    /// next token), or else a copy.
    fn device_ids(&self, ids: &[u32]) -> (Option<CudaSlice<u32>>, u64) {
        if let Some(staged) = self.staged_ids(ids) {
            return (None, staged);
        }
        if let [id] = ids {
            let start = self.step_inputs().map(|w| w[0] as usize).unwrap_or(0);
            self.ensure_step(start, Some(*id));
            return (None, self.p(&self.step) + 4);
        }
        let d = self.upload_slice(ids);
        let p = self.p(&d);
        (Some(d), p)
    }

    /// [`crate::backend::Backend::silu_mul`].
    pub(super) fn silu_mul_op(&self, gate: &CudaAct, up: &CudaAct) -> CudaAct {
        let out = self.act(gate.rows, gate.cols);
        let n = gate.rows * gate.cols;
        let args = SiluMulArgs { gate: self.p(&gate.buf), up: self.p(&up.buf), out: self.p(&out.buf), n: n as i64 };
        self.launch(&self.k.elementwise.silu_mul, elementwise_cfg(n), &args);
        out
    }

    /// [`crate::backend::ops::FusedOps::swiglu`].
    pub(super) fn swiglu_op(&self, gate_up: &CudaAct) -> CudaAct {
        let width = gate_up.cols / 2;
        let out = self.act(gate_up.rows, width);
        let n = gate_up.rows * width;
        let args =
            SwigluArgs { gate_up: self.p(&gate_up.buf), out: self.p(&out.buf), width: width as i32, n: n as i64 };
        self.launch(&self.k.elementwise.swiglu, elementwise_cfg(n), &args);
        out
    }

    /// [`crate::backend::Backend::add_assign`].
    pub(super) fn add_assign_op(&self, x: &mut CudaAct, y: &CudaAct) {
        x.quantized = None;
        let n = x.rows * x.cols;
        let args = AddAssignArgs { x: self.p(&x.buf), y: self.p(&y.buf), n: n as i64 };
        self.launch(&self.k.elementwise.add_assign, elementwise_cfg(n), &args);
    }

    /// [`crate::backend::Backend::mul_sigmoid`].
    pub(super) fn mul_sigmoid_op(&self, x: &mut CudaAct, gate: &CudaAct) {
        x.quantized = None;
        let n = x.rows * x.cols;
        let args = MulSigmoidArgs {
            x: self.p(&x.buf),
            gate: self.p(&gate.buf),
            cols: x.cols as i32,
            gate_cols: gate.cols as i32,
            n: n as i64,
        };
        self.launch(&self.k.elementwise.mul_sigmoid, elementwise_cfg(n), &args);
    }

    /// [`crate::backend::Backend::last_row`].
    pub(super) fn last_row_op(&self, x: &CudaAct) -> CudaAct {
        let out = self.act(1, x.cols);
        if !self.failed() {
            let src = self.p(&x.buf) + ((x.rows - 1) * x.cols * 4) as u64;
            // SAFETY: one row inside both allocations.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(self.p(&out.buf), src, x.cols * 4, self.stream.cu_stream())
            };
            self.record(r, "last row");
        }
        out
    }

    /// A copy of `x` in a new activation buffer.
    pub(super) fn copy(&self, x: &CudaAct) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        if !self.failed() {
            // SAFETY: both buffers hold at least rows × cols values.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    self.p(&out.buf),
                    self.p(&x.buf),
                    x.rows * x.cols * 4,
                    self.stream.cu_stream(),
                )
            };
            self.record(r, "copy");
        }
        out
    }

    /// [`crate::backend::Backend::gather_columns`].
    pub(super) fn gather_columns_op(&self, x: &CudaAct, group: usize, offset: usize, len: usize) -> CudaAct {
        let groups = x.cols / group;
        let out = self.act(x.rows, groups * len);
        self.copy_columns(x, &out, group, offset, len, 0);
        out
    }

    /// [`crate::backend::Backend::concat_columns`].
    pub(super) fn concat_columns_op(&self, parts: &[&CudaAct]) -> CudaAct {
        let rows = parts[0].rows;
        let out = self.act(rows, parts.iter().map(|p| p.cols).sum());
        let mut off = 0;
        for p in parts {
            self.copy_columns(p, &out, p.cols, 0, p.cols, off);
            off += p.cols;
        }
        out
    }

    fn copy_columns(&self, src: &CudaAct, dst: &CudaAct, group: usize, offset: usize, len: usize, dst_off: usize) {
        let n = src.rows * (src.cols / group) * len;
        let args = CopyColumnsArgs {
            src: self.p(&src.buf),
            dst: self.p(&dst.buf),
            rows: src.rows as i32,
            src_cols: src.cols as i32,
            group: group as i32,
            offset: offset as i32,
            len: len as i32,
            dst_cols: dst.cols as i32,
            dst_off: dst_off as i32,
        };
        self.launch(&self.k.elementwise.copy_columns, elementwise_cfg(n), &args);
    }

    /// Rows `idx` of `x`.
    pub(super) fn gather_rows(&self, x: &CudaAct, idx: &[i32]) -> CudaAct {
        let out = self.act(idx.len(), x.cols);
        let d_idx = self.upload_slice(idx);
        let args =
            GatherRowsArgs { x: self.p(&x.buf), idx: self.p(&d_idx), out: self.p(&out.buf), cols: x.cols as i32 };
        self.launch(&self.k.elementwise.gather_rows, cfg((idx.len() as u32, 1, 1), 256, 0), &args);
        out
    }

    /// `out[idx[r]] += weights[r] · y[r]` for each row r of `y`.
    pub(super) fn scatter_add_rows(&self, y: &CudaAct, idx: &CudaSlice<i32>, weights: &CudaSlice<f32>, out: &CudaAct) {
        let args = ScatterAddRowsArgs {
            y: self.p(&y.buf),
            idx: self.p(idx),
            weights: self.p(weights),
            out: self.p(&out.buf),
            cols: out.cols as i32,
        };
        self.launch(&self.k.elementwise.scatter_add_rows, cfg((idx.len() as u32, 1, 1), 256, 0), &args);
    }
}
