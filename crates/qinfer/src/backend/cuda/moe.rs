//! Routed experts on the device for decode-sized batches: the router's top-k
//! by `moe_route`, then each (token, chosen expert) pair's silu(gate)·up by
//! one GEMV kernel that picks the expert's weights from tables of device
//! pointers, and the down projection with the weighted sum folded in by
//! another (moe.cu). Experts whose rows are not whole 16-byte chunks take
//! separate gate, up and down GEMVs and `moe_combine`. No host
//! synchronization, so a decode step of an MoE model can be recorded as a
//! CUDA graph.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::affine::{STORAGES, storage_groups, storage_name, storage_slot, storages};
use super::kernels::{Resolve, cfg, kernel_args, resolve_n};
use super::linear::{FloatType, GemvShape};
use super::{AffineSide, CudaAct, CudaBackend, CudaWeight};
use crate::Result;
use crate::backend::{ExpertWeights, Routing};

/// Experts per MoE layer the routing kernel holds (`MOE_MAX_EXPERTS`).
pub(super) const MAX_DEVICE_EXPERTS: usize = 1024;

/// How one projection of a layer's experts is stored, as its kernels are
/// named: floats, or affine levels (`g16`: groups of 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProjectionKind {
    Float(FloatType),
    Affine { bits: u32, side: AffineSide, g16: bool },
}

/// One projection (gate, up or down) of every expert of a layer, as device
/// pointer tables; all experts stored alike.
pub(super) struct ProjectionTable {
    pub(super) kind: ProjectionKind,
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

/// The routed-expert kernels of one kind of storage: `moe_gemv_{kind}`,
/// `moe_swiglu_{kind}`, `moe_down_{kind}`.
pub(super) struct ExpertKernels<K> {
    gemv: K,
    swiglu: K,
    down: K,
}

impl<K> ExpertKernels<K> {
    fn load(get: &mut Resolve<'_, K>, kind: &str) -> Result<Self> {
        let [gemv, swiglu, down] =
            resolve_n(get, "moe.cu", |i| format!("moe_{}_{kind}", ["gemv", "swiglu", "down"][i]))?;
        Ok(ExpertKernels { gemv, swiglu, down })
    }
}

/// The kernels of moe.cu and moe_gemm.cu.
pub(super) struct MoeKernels<K> {
    pub(super) route: K,
    pub(super) count: K,
    pub(super) offsets: K,
    /// `moe_scatter_{bf16,f16}`.
    pub(super) scatter: [K; 2],
    pub(super) gather_combine: K,
    combine: K,
    /// Float experts by [`FloatType`].
    float: [ExpertKernels<K>; 3],
    /// Affine experts by storage slot, then groups of 32 and more, of 16.
    affine: Vec<[Option<ExpertKernels<K>>; 2]>,
    /// `moe_gemm_{bf16,f16}`, and `moe_gemm_{storage}` by storage slot (moe_gemm.cu).
    pub(super) gemm_float: [K; 2],
    gemm_affine: Vec<Option<K>>,
}

impl<K> MoeKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "moe.cu";
        let halves = ["bf16", "f16"];
        let [a, b, c] = FloatType::ALL;
        let float = [
            ExpertKernels::load(get, a.name())?,
            ExpertKernels::load(get, b.name())?,
            ExpertKernels::load(get, c.name())?,
        ];
        let mut affine: Vec<[Option<ExpertKernels<K>>; 2]> = (0..STORAGES).map(|_| [None, None]).collect();
        let mut gemm_affine: Vec<Option<K>> = (0..STORAGES).map(|_| None).collect();
        for (slot, bits, side) in storages() {
            let f = storage_name(bits, side);
            let (g32, g16) = storage_groups(bits, side);
            if g32 {
                affine[slot][0] = Some(ExpertKernels::load(get, &f)?);
            }
            if g16 {
                affine[slot][1] = Some(ExpertKernels::load(get, &format!("{f}_g16"))?);
            }
            gemm_affine[slot] = Some(get("moe_gemm.cu", format!("moe_gemm_{f}"))?);
        }
        Ok(MoeKernels {
            route: get(U, "moe_route".into())?,
            count: get(U, "moe_count".into())?,
            offsets: get(U, "moe_offsets".into())?,
            scatter: resolve_n(get, U, |i| format!("moe_scatter_{}", halves[i]))?,
            gather_combine: get(U, "moe_gather_combine".into())?,
            combine: get(U, "moe_combine".into())?,
            float,
            affine,
            gemm_float: resolve_n(get, "moe_gemm.cu", |i| format!("moe_gemm_{}", halves[i]))?,
            gemm_affine,
        })
    }

    /// The GEMV kernels of experts stored as `kind`.
    fn experts(&self, kind: ProjectionKind) -> Option<&ExpertKernels<K>> {
        match kind {
            ProjectionKind::Float(t) => Some(&self.float[t.index()]),
            ProjectionKind::Affine { bits, side, g16 } => {
                self.affine.get(storage_slot(bits, side)?)?[g16 as usize].as_ref()
            }
        }
    }

    /// Every grouped expert GEMM (moe_gemm.cu).
    pub(super) fn grouped_gemms(&self) -> impl Iterator<Item = &K> {
        self.gemm_float.iter().chain(self.gemm_affine.iter().flatten())
    }

    /// The grouped GEMM of affine experts stored as (`bits`, `side`).
    pub(super) fn gemm_affine(&self, bits: u32, side: AffineSide) -> Option<&K> {
        self.gemm_affine.get(storage_slot(bits, side)?)?.as_ref()
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
pub(super) const MOE_ROWS: usize = 4;

impl ExpertTables {
    /// Whether the fused kernels take these experts for inputs `hidden`
    /// wide: gate and up stored alike, down their transpose's shape, and
    /// every row whole chunks.
    fn fused(&self, hidden: usize) -> bool {
        let (g, u, d) = (&self.gate, &self.up, &self.down);
        let same_kind = |a: &ProjectionTable, b: &ProjectionTable| {
            a.kind == b.kind && a.affine.as_ref().map(|x| x.2) == b.affine.as_ref().map(|x| x.2)
        };
        same_kind(g, u)
            && (g.rows, g.cols) == (u.rows, u.cols)
            && g.cols == hidden
            && (d.rows, d.cols) == (hidden, g.rows)
            && g.cols.is_multiple_of(g.chunk())
            && d.cols.is_multiple_of(d.chunk())
    }
}

kernel_args! {
    /// `moe_route`.
    RouteArgs { logits: u64, ids: u64, weights: u64, experts: i32, top_k: i32, renormalize: i32 }
}
kernel_args! {
    /// `moe_combine`.
    CombineArgs { y: u64, weights: u64, out: u64, top_k: i32, cols: i32 }
}
kernel_args! {
    /// `moe_gemv_{float type}`.
    ExpertGemvArgs { table: u64, ids: u64, x: u64, y: u64, out_dim: i32, in_dim: i32, x_div: i32 }
}
kernel_args! {
    /// `moe_gemv_{affine format}`.
    AffineExpertGemvArgs {
        packed: u64, scales: u64, biases: u64, ids: u64, x: u64, y: u64, out_dim: i32, in_dim: i32, group: i32,
        x_div: i32,
    }
}

kernel_args! {
    /// `moe_swiglu_{float type}`.
    SwigluArgs { gate: u64, up: u64, ids: u64, x: u64, act: u64, width: i32, in_dim: i32, top_k: i32 }
}
kernel_args! {
    /// `moe_swiglu_{affine format}`.
    AffineSwigluArgs {
        gate: u64, gate_scales: u64, gate_biases: u64, up: u64, up_scales: u64, up_biases: u64, ids: u64, x: u64,
        act: u64, width: i32, in_dim: i32, group: i32, top_k: i32,
    }
}
kernel_args! {
    /// `moe_down_{float type}`.
    DownArgs { table: u64, ids: u64, weights: u64, h: u64, out: u64, hidden: i32, width: i32, top_k: i32 }
}
kernel_args! {
    /// `moe_down_{affine format}`.
    AffineDownArgs {
        table: u64, scales: u64, biases: u64, ids: u64, weights: u64, h: u64, out: u64, hidden: i32, width: i32,
        group: i32, top_k: i32,
    }
}

impl CudaBackend {
    /// [`crate::backend::ops::MoeOps::moe`].
    pub(super) fn moe_op(
        &self,
        x: &CudaAct,
        router_logits: &CudaAct,
        experts: &[ExpertWeights<CudaWeight>],
        routing: Routing,
    ) -> CudaAct {
        // Decode-sized batches route on the device; their steps can be recorded.
        if x.rows <= super::linear::GEMV_MAX_ROWS
            && experts.len() <= MAX_DEVICE_EXPERTS
            && routing.top_k <= experts.len()
            && let Some(tables) = self.expert_tables(experts)
        {
            return self.moe_on_device(x, router_logits, &tables, routing);
        }
        if self.capturing() {
            self.record(Err("experts that cannot be routed on the device"), "recording a decode step");
        } else if experts.len() <= MAX_DEVICE_EXPERTS
            && routing.top_k <= experts.len()
            && let Some(tables) = self.expert_tables(experts)
            && let Some(out) = self.moe_prefill(x, router_logits, experts, &tables, routing)
        {
            return out;
        }
        // Otherwise routing is decided on the host (T×E floats cross the bus, one
        // sync per MoE layer); each routed expert then runs once over all its tokens.
        // An accumulator: zeroed even when outputs are poisoned.
        let out = CudaAct::new(x.rows, x.cols, self.zeros(x.rows * x.cols), None);
        let logits = self.to_host_op(router_logits);
        let routes = crate::backend::cpu::moe::route(&logits, experts.len(), routing);
        for (e, tokens) in crate::backend::cpu::moe::group_by_expert(&routes, experts.len()).iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let idx: Vec<i32> = tokens.iter().map(|t| t.0 as i32).collect();
            let weights: Vec<f32> = tokens.iter().map(|t| t.1).collect();
            let xs = self.gather_rows(x, &idx);
            let ex = &experts[e];
            let h = self.silu_mul_op(&self.linear_op(&xs, &ex.gate, None), &self.linear_op(&xs, &ex.up, None));
            let y = self.linear_op(&h, &ex.down, None);
            let (d_idx, d_w) = (self.upload_slice(&idx), self.upload_slice(&weights));
            self.scatter_add_rows(&y, &d_idx, &d_w, &out);
        }
        out
    }

    /// [`crate::backend::ops::MoeOps::routes_on_device`]: experts the
    /// device kernels take (float and affine storage; FP8 experts run per
    /// expert with the routing read back).
    pub(super) fn routes_on_device_op(&self, experts: &[ExpertWeights<CudaWeight>]) -> bool {
        experts.len() <= MAX_DEVICE_EXPERTS && self.expert_tables(experts).is_some()
    }

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
                    CudaWeight::Fp8(f) => key.extend([self.p(&f.weight), self.p(&f.scales)]),
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
                CudaWeight::Fp8(f) => [5, f.group as u64, f.rows as u64, f.cols as u64],
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
                let ty = FloatType::of(*dtype);
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
                    kind: ProjectionKind::Float(ty),
                    rows: *rows,
                    cols: *cols,
                    weights: self.upload_slice(&ptrs),
                    affine: None,
                    vec: ty.vec(),
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
                    kind: ProjectionKind::Affine {
                        bits: first.params.bits,
                        side: first.side,
                        g16: first.params.group_size == 16,
                    },
                    rows: first.rows,
                    cols: first.cols,
                    weights: self.upload_slice(&tables.0),
                    affine: Some((self.upload_slice(&tables.1), self.upload_slice(&tables.2), first.params.group_size)),
                    vec: 32,
                })
            }
            CudaWeight::Vector(_) | CudaWeight::Fp8(_) => None,
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
        let h = self.silu_mul_op(&gate, &up);
        let y = self.grouped_gemv(&t.down, &ids, &h, entries, 1);
        let out = self.act(rows, t.down.rows);
        let args = CombineArgs {
            y: self.p(&y.buf),
            weights: self.p(&weights.buf),
            out: self.p(&out.buf),
            top_k: k as i32,
            cols: t.down.rows as i32,
        };
        self.launch(&self.k.moe.combine, cfg((rows as u32, 1, 1), 256, 0), &args);
        out
    }

    /// [`Self::moe_on_device`]'s experts in two kernels (moe.cu): silu(gate)·up
    /// per entry, then the down projection summed over each token's experts
    /// by their routing weights.
    fn moe_fused(&self, x: &CudaAct, t: &ExpertTables, ids: &CudaAct, weights: &CudaAct, k: usize) -> CudaAct {
        let (rows, width, hidden) = (x.rows, t.gate.rows, t.down.rows);
        let threads = |items: usize| items.next_multiple_of(32).clamp(32, 256) as u32;
        let (ids, x_ptr, top_k) = (self.p(&ids.buf), self.p(&x.buf), k as i32);
        let act = self.act(rows * k, width);
        let c = cfg((width.div_ceil(MOE_ROWS) as u32, (rows * k) as u32, 1), threads(x.cols / t.gate.chunk()), 0);
        let kernel = self.k.moe.experts(t.gate.kind).map(|k| &k.swiglu);
        let (gate, up, act_ptr, in_dim) =
            (self.p(&t.gate.weights), self.p(&t.up.weights), self.p(&act.buf), x.cols as i32);
        match (&t.gate.affine, &t.up.affine) {
            (Some((gate_scales, gate_biases, group)), Some((up_scales, up_biases, _))) => {
                let args = AffineSwigluArgs {
                    gate,
                    gate_scales: self.p(gate_scales),
                    gate_biases: self.p(gate_biases),
                    up,
                    up_scales: self.p(up_scales),
                    up_biases: self.p(up_biases),
                    ids,
                    x: x_ptr,
                    act: act_ptr,
                    width: width as i32,
                    in_dim,
                    group: *group as i32,
                    top_k,
                };
                self.launch_opt(kernel, "routed experts", c, &args);
            }
            _ => {
                let args = SwigluArgs { gate, up, ids, x: x_ptr, act: act_ptr, width: width as i32, in_dim, top_k };
                self.launch_opt(kernel, "routed experts", c, &args);
            }
        }
        let out = self.act(rows, hidden);
        let c = cfg((hidden.div_ceil(MOE_ROWS) as u32, rows as u32, 1), threads(k * width / t.down.chunk()), 0);
        let kernel = self.k.moe.experts(t.down.kind).map(|k| &k.down);
        let (table, weights, out_ptr) = (self.p(&t.down.weights), self.p(&weights.buf), self.p(&out.buf));
        let (hidden, width) = (hidden as i32, width as i32);
        match &t.down.affine {
            Some((scales, biases, group)) => {
                let args = AffineDownArgs {
                    table,
                    scales: self.p(scales),
                    biases: self.p(biases),
                    ids,
                    weights,
                    h: act_ptr,
                    out: out_ptr,
                    hidden,
                    width,
                    group: *group as i32,
                    top_k,
                };
                self.launch_opt(kernel, "routed experts", c, &args);
            }
            None => {
                let args = DownArgs { table, ids, weights, h: act_ptr, out: out_ptr, hidden, width, top_k };
                self.launch_opt(kernel, "routed experts", c, &args);
            }
        }
        out
    }

    /// One GEMV per entry: expert `ids[b]` on row `b / x_div` of `x`.
    fn grouped_gemv(&self, t: &ProjectionTable, ids: &CudaAct, x: &CudaAct, entries: usize, x_div: usize) -> CudaAct {
        let y = self.act(entries, t.rows);
        let shape = GemvShape::choose(t.rows, t.cols, t.vec, 1);
        let grid = (t.rows.div_ceil(2) as u32, entries as u32, 1);
        let c = cfg(grid, shape.threads, 0);
        let kernel = self.k.moe.experts(t.kind).map(|k| &k.gemv);
        let (out_dim, in_dim, x_div) = (t.rows as i32, t.cols as i32, x_div as i32);
        let (table, ids, x, y_ptr) = (self.p(&t.weights), self.p(&ids.buf), self.p(&x.buf), self.p(&y.buf));
        match &t.affine {
            None => {
                let args = ExpertGemvArgs { table, ids, x, y: y_ptr, out_dim, in_dim, x_div };
                self.launch_opt(kernel, "routed experts", c, &args);
            }
            Some((scales, biases, group)) => {
                let args = AffineExpertGemvArgs {
                    packed: table,
                    scales: self.p(scales),
                    biases: self.p(biases),
                    ids,
                    x,
                    y: y_ptr,
                    out_dim,
                    in_dim,
                    group: *group as i32,
                    x_div,
                };
                self.launch_opt(kernel, "routed experts", c, &args);
            }
        }
        y
    }
}
