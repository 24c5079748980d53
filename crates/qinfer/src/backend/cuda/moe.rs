//! Routed experts on the device for decode-sized batches: the router's top-k
//! by `moe_route`, each (token, chosen expert) pair's SwiGLU by GEMVs that
//! pick the expert's weights from a table of device pointers, and the
//! weighted sum by `moe_combine` (kernels.cu). No host synchronization, so a
//! decode step of an MoE model can be recorded as a CUDA graph.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::{Arg, CudaAct, CudaBackend, CudaWeight, GemvShape, cfg, float_format};
use crate::backend::{ExpertWeights, Routing};

/// Experts per MoE layer the routing kernel holds (`probs[1024]`).
pub(super) const MAX_DEVICE_EXPERTS: usize = 1024;

/// One projection (gate, up or down) of every expert of a layer, as device
/// pointer tables; all experts stored alike.
pub(super) struct ProjectionTable {
    /// `moe_gemv_{bf16,f16,f32}` or `moe_gemv_affine{bits}[_bf16]`.
    kernel: String,
    rows: usize,
    cols: usize,
    /// Matrices, or the packed levels of affine weights.
    weights: CudaSlice<u64>,
    /// Affine scales and biases, and the group size.
    affine: Option<(CudaSlice<u64>, CudaSlice<u64>, usize)>,
    /// Values per 16-byte chunk (GEMV launch shape).
    vec: usize,
}

/// A layer's gate, up and down tables.
pub(super) struct ExpertTables {
    gate: ProjectionTable,
    up: ProjectionTable,
    down: ProjectionTable,
}

impl CudaBackend {
    /// The layer's pointer tables, built on first use and kept by the
    /// experts' address (they live as long as the model); `None` when the
    /// experts are not all stored alike.
    pub(super) fn expert_tables(&self, experts: &[ExpertWeights<CudaWeight>]) -> Option<Arc<ExpertTables>> {
        let key = (experts.as_ptr() as usize, experts.len());
        if let Some(t) = self.moe_tables.lock().ok()?.get(&key) {
            return Some(t.clone());
        }
        let build = |pick: fn(&ExpertWeights<CudaWeight>) -> &CudaWeight| self.projection_table(experts, pick);
        let tables =
            Arc::new(ExpertTables { gate: build(|e| &e.gate)?, up: build(|e| &e.up)?, down: build(|e| &e.down)? });
        self.moe_tables.lock().ok()?.insert(key, tables.clone());
        Some(tables)
    }

    fn projection_table(
        &self,
        experts: &[ExpertWeights<CudaWeight>],
        pick: fn(&ExpertWeights<CudaWeight>) -> &CudaWeight,
    ) -> Option<ProjectionTable> {
        match pick(experts.first()?) {
            CudaWeight::Matrix { dtype, rows, cols, .. } => {
                let (name, vec) = float_format(*dtype);
                let ptrs = experts
                    .iter()
                    .map(|e| match pick(e) {
                        CudaWeight::Matrix { dtype: d, rows: r, cols: c, buf }
                            if d == dtype && r == rows && c == cols =>
                        {
                            Some(self.p(buf))
                        }
                        _ => None,
                    })
                    .collect::<Option<Vec<u64>>>()?;
                Some(ProjectionTable {
                    kernel: format!("moe_gemv_{name}"),
                    rows: *rows,
                    cols: *cols,
                    weights: self.upload_slice(&ptrs),
                    affine: None,
                    vec,
                })
            }
            CudaWeight::Affine(first) => {
                let mut tables = (Vec::new(), Vec::new(), Vec::new());
                for e in experts {
                    let CudaWeight::Affine(a) = pick(e) else { return None };
                    if a.params != first.params
                        || a.rows != first.rows
                        || a.cols != first.cols
                        || a.bf16_scales != first.bf16_scales
                    {
                        return None;
                    }
                    tables.0.push(self.p(&a.packed));
                    tables.1.push(self.p(&a.scales));
                    tables.2.push(self.p(&a.biases));
                }
                Some(ProjectionTable {
                    kernel: format!("moe_gemv_{}", first.gemv_format()),
                    rows: first.rows,
                    cols: first.cols,
                    weights: self.upload_slice(&tables.0),
                    affine: Some((self.upload_slice(&tables.1), self.upload_slice(&tables.2), first.params.group_size)),
                    vec: 32,
                })
            }
            CudaWeight::Vector(_) => None,
        }
    }

    /// `x` `[rows, hidden]` through the experts the router picks per token.
    pub(super) fn moe_on_device(&self, x: &CudaAct, logits: &CudaAct, t: &ExpertTables, routing: Routing) -> CudaAct {
        let (rows, k) = (x.rows, routing.top_k);
        let entries = rows * k;
        // Expert ids as i32 in an activation-sized buffer (4 bytes each).
        let ids = self.act(rows, k);
        let weights = self.act(rows, k);
        launch!(
            self,
            "moe_route",
            cfg((rows as u32, 1, 1), 128, 0),
            self.p(&logits.buf),
            self.p(&ids.buf),
            self.p(&weights.buf),
            logits.cols as i32,
            k as i32,
            routing.renormalize as i32
        );
        let gate = self.grouped_gemv(&t.gate, &ids, x, entries, k);
        let up = self.grouped_gemv(&t.up, &ids, x, entries, k);
        let h = crate::backend::Backend::silu_mul(self, &gate, &up);
        let y = self.grouped_gemv(&t.down, &ids, &h, entries, 1);
        let out = self.act(rows, t.down.rows);
        launch!(
            self,
            "moe_combine",
            cfg((rows as u32, 1, 1), 256, 0),
            self.p(&y.buf),
            self.p(&weights.buf),
            self.p(&out.buf),
            k as i32,
            t.down.rows as i32
        );
        out
    }

    /// One GEMV per entry: expert `ids[b]` on row `b / x_div` of `x`.
    fn grouped_gemv(&self, t: &ProjectionTable, ids: &CudaAct, x: &CudaAct, entries: usize, x_div: usize) -> CudaAct {
        let y = self.act(entries, t.rows);
        let shape = GemvShape::choose(t.rows, t.cols, t.vec, 1);
        let grid = (t.rows.div_ceil(2) as u32, entries as u32, 1);
        let c = cfg(grid, shape.threads, 0);
        let (dims, div) = ([t.rows as i32, t.cols as i32], x_div as i32);
        match &t.affine {
            None => launch!(
                self,
                &t.kernel,
                c,
                self.p(&t.weights),
                self.p(&ids.buf),
                self.p(&x.buf),
                self.p(&y.buf),
                dims[0],
                dims[1],
                div
            ),
            Some((scales, biases, group)) => launch!(
                self,
                &t.kernel,
                c,
                self.p(&t.weights),
                self.p(scales),
                self.p(biases),
                self.p(&ids.buf),
                self.p(&x.buf),
                self.p(&y.buf),
                dims[0],
                dims[1],
                *group as i32,
                div
            ),
        }
        y
    }
}
