//! Routed experts on the device for decode-sized batches: the router's top-k
//! by `moe_route`, then each (token, chosen expert) pair's silu(gate)·up by
//! one GEMV kernel that picks the expert's weights from tables of device
//! pointers, and the down projection with the weighted sum folded in by
//! another (moe.cu). Experts whose rows are not whole 16-byte chunks take
//! separate gate, up and down GEMVs and `moe_combine` (kernels.cu). No host
//! synchronization, so a decode step of an MoE model can be recorded as a
//! CUDA graph.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::{Arg, CudaAct, CudaBackend, CudaWeight, GemvShape, cfg, float_format};
use crate::backend::{ExpertWeights, Routing};

/// Experts per MoE layer the routing kernel holds (`probs[1024]`).
pub(super) const MAX_DEVICE_EXPERTS: usize = 1024;

/// One projection (gate, up or down) of every expert of a layer, as device
/// pointer tables; all experts stored alike.
pub(super) struct ProjectionTable {
    /// The kernels' format suffix: `bf16`, `f16`, `f32` or
    /// `affine{bits}[_bf16|_g16]` (`moe_gemv_{format}` and the fused
    /// `moe_swiglu_{format}`, `moe_down_{format}`).
    pub(super) format: String,
    /// The storage's own format (`AffineWeight::format`, without `_g16`):
    /// the dequantization kernels' suffix, which take every group size.
    pub(super) storage: String,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Matrices, or the packed levels of affine weights.
    pub(super) weights: CudaSlice<u64>,
    /// Affine scales and biases, and the group size.
    pub(super) affine: Option<(CudaSlice<u64>, CudaSlice<u64>, usize)>,
    /// Values per 16-byte chunk (GEMV launch shape).
    vec: usize,
}

impl ProjectionTable {
    /// Values per chunk of the fused kernels: 32 affine levels, or a 16-byte
    /// chunk of floats.
    fn chunk(&self) -> usize {
        if self.affine.is_some() { 32 } else { self.vec }
    }
}

/// A layer's gate, up and down tables.
pub(super) struct ExpertTables {
    pub(super) gate: ProjectionTable,
    pub(super) up: ProjectionTable,
    pub(super) down: ProjectionTable,
}

/// An expert's projections: gate, up, down.
fn projections(e: &ExpertWeights<CudaWeight>) -> [&CudaWeight; 3] {
    [&e.gate, &e.up, &e.down]
}

/// Output rows a block of the fused kernels computes (`MOE_ROWS`).
const MOE_ROWS: usize = 4;

impl ExpertTables {
    /// Whether the fused kernels take these experts for inputs `hidden`
    /// wide: gate and up stored alike, down their transpose's shape, and
    /// every row whole chunks.
    fn fused(&self, hidden: usize) -> bool {
        let (g, u, d) = (&self.gate, &self.up, &self.down);
        let same_kind = |a: &ProjectionTable, b: &ProjectionTable| {
            a.format == b.format && a.affine.as_ref().map(|x| x.2) == b.affine.as_ref().map(|x| x.2)
        };
        same_kind(g, u)
            && (g.rows, g.cols) == (u.rows, u.cols)
            && g.cols == hidden
            && (d.rows, d.cols) == (hidden, g.rows)
            && g.cols.is_multiple_of(g.chunk())
            && d.cols.is_multiple_of(d.chunk())
    }
}

impl CudaBackend {
    /// The layer's pointer tables, built on first use and kept by what they
    /// hold: every expert's device pointers and the first one's storage (the
    /// slice's own address would name the tables of a dropped model to a
    /// later one allocated in its place); `None` when the experts are not
    /// all stored alike.
    pub(super) fn expert_tables(&self, experts: &[ExpertWeights<CudaWeight>]) -> Option<Arc<ExpertTables>> {
        let key = self.expert_key(experts);
        if let Some(t) = self.moe_tables.lock().ok()?.get(&key) {
            return Some(t.clone());
        }
        let build = |pick: fn(&ExpertWeights<CudaWeight>) -> &CudaWeight| self.projection_table(experts, pick);
        let tables =
            Arc::new(ExpertTables { gate: build(|e| &e.gate)?, up: build(|e| &e.up)?, down: build(|e| &e.down)? });
        self.moe_tables.lock().ok()?.insert(key, tables.clone());
        Some(tables)
    }

    /// Per projection of each expert its buffers' device pointers, then the
    /// first expert's shapes and storage kinds.
    fn expert_key(&self, experts: &[ExpertWeights<CudaWeight>]) -> Vec<u64> {
        let mut key = Vec::with_capacity(experts.len() * 9 + 12);
        for e in experts {
            for w in projections(e) {
                match w {
                    CudaWeight::Matrix { buf, .. } => key.push(self.p(buf)),
                    CudaWeight::Affine(a) => key.extend([self.p(&a.packed), self.p(&a.scales), self.p(&a.biases)]),
                    CudaWeight::Vector(v) => key.push(self.p(v)),
                }
            }
        }
        for w in experts.first().map(projections).into_iter().flatten() {
            key.extend(match w {
                CudaWeight::Matrix { dtype, rows, cols, .. } => [0, *dtype as u64, *rows as u64, *cols as u64],
                CudaWeight::Affine(a) => [
                    1 + a.side as u64,
                    (a.params.bits as u64) << 32 | a.params.group_size as u64,
                    a.rows as u64,
                    a.cols as u64,
                ],
                CudaWeight::Vector(v) => [3, v.len() as u64, 0, 0],
            });
        }
        key
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
                    format: name.to_string(),
                    storage: name.to_string(),
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
                    if a.params != first.params || a.rows != first.rows || a.cols != first.cols || a.side != first.side
                    {
                        return None;
                    }
                    tables.0.push(self.p(&a.packed));
                    tables.1.push(self.p(&a.scales));
                    tables.2.push(self.p(&a.biases));
                }
                Some(ProjectionTable {
                    format: first.gemv_format(),
                    storage: first.format(),
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
        let (ids, weights) = self.route_on_device(logits, routing);
        if t.fused(x.cols) {
            return self.moe_fused(x, t, &ids, &weights, k);
        }
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

    /// [`Self::moe_on_device`]'s experts in two kernels (moe.cu): silu(gate)·up
    /// per entry, then the down projection summed over each token's experts
    /// by their routing weights.
    fn moe_fused(&self, x: &CudaAct, t: &ExpertTables, ids: &CudaAct, weights: &CudaAct, k: usize) -> CudaAct {
        let (rows, width, hidden) = (x.rows, t.gate.rows, t.down.rows);
        let threads = |items: usize| items.next_multiple_of(32).clamp(32, 256) as u32;
        // A table's pointers as kernel arguments: the weights, and for affine
        // storage the scales and biases.
        let tables = |p: &ProjectionTable| {
            let mut args = vec![Arg::from(self.p(&p.weights))];
            if let Some((scales, biases, _)) = &p.affine {
                args.extend([self.p(scales), self.p(biases)].map(Arg::from));
            }
            args
        };
        // Affine kernels take the group size before the choices per token.
        let tail = |p: &ProjectionTable| {
            let group = p.affine.as_ref().map(|a| Arg::from(a.2 as i32));
            group.into_iter().chain([Arg::from(k as i32)])
        };
        let act = self.act(rows * k, width);
        let mut args = tables(&t.gate);
        args.extend(tables(&t.up));
        args.extend([self.p(&ids.buf), self.p(&x.buf), self.p(&act.buf)].map(Arg::from));
        args.extend([width as i32, x.cols as i32].map(Arg::from));
        args.extend(tail(&t.gate));
        let c = cfg((width.div_ceil(MOE_ROWS) as u32, (rows * k) as u32, 1), threads(x.cols / t.gate.chunk()), 0);
        self.launch_args(&format!("moe_swiglu_{}", t.gate.format), c, &args);
        let out = self.act(rows, hidden);
        let mut args = tables(&t.down);
        args.extend([self.p(&ids.buf), self.p(&weights.buf), self.p(&act.buf), self.p(&out.buf)].map(Arg::from));
        args.extend([hidden as i32, width as i32].map(Arg::from));
        args.extend(tail(&t.down));
        let c = cfg((hidden.div_ceil(MOE_ROWS) as u32, rows as u32, 1), threads(k * width / t.down.chunk()), 0);
        self.launch_args(&format!("moe_down_{}", t.down.format), c, &args);
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
                &format!("moe_gemv_{}", t.format),
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
                &format!("moe_gemv_{}", t.format),
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
