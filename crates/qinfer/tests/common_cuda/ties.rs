//! The CPU backend with a watch on routing: how close each MoE layer's
//! top-k choice came to taking another expert. Where the k-th and the
//! (k+1)-th router logits of a token lie within f32 rounding of each other,
//! the GPU may route that token otherwise than the CPU, and the comparison of
//! the two is then void from that token on (its state stays in the cache).

use std::sync::{Arc, Mutex};

use qinfer::Result;
use qinfer::backend::cpu::{CpuAct, CpuBackend, CpuWeight};
use qinfer::backend::ops::{BatchOps, FusedOps, GdnOps, MoeOps, SamplingOps};
use qinfer::backend::{AttentionShape, Backend, Capabilities, ExpertWeights, GdnWeights, QkvShape, Routing};
use qinfer::config::GdnConfig;
use qinfer::config::rope::Rope;
use qinfer::quant::affine::AffineTensor;
use qinfer::sampling::SamplingParams;
use qinfer::tensor::Tensor;

/// Router logits closer than this between the k-th and the (k+1)-th choice
/// make a near-tie: the GPU's logits differ from the CPU's by about 1e-6.
pub const ROUTER_TIE: f32 = 1e-4;

/// [`CpuBackend`], noting the least gap between a token's k-th and
/// (k+1)-th router logits since the watch was last read.
pub struct TieWatch {
    cpu: CpuBackend,
    least_gap: Arc<Mutex<f32>>,
}

impl TieWatch {
    /// The backend, and the handle that reads (and resets) its least gap.
    pub fn new() -> (Self, Arc<Mutex<f32>>) {
        let least_gap = Arc::new(Mutex::new(f32::INFINITY));
        (TieWatch { cpu: CpuBackend::new(), least_gap: least_gap.clone() }, least_gap)
    }
}

/// The least gap noted since the last call, which resets it.
pub fn take_least_gap(gap: &Mutex<f32>) -> f32 {
    std::mem::replace(&mut *gap.lock().unwrap(), f32::INFINITY)
}

/// Per row of `logits` (`experts` wide), the gap between its k-th and
/// (k+1)-th largest value; the least of them.
pub fn least_routing_gap(logits: &[f32], experts: usize, top_k: usize) -> f32 {
    logits
        .chunks_exact(experts)
        .filter(|_| top_k < experts)
        .map(|row| {
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted[top_k - 1] - sorted[top_k]
        })
        .fold(f32::INFINITY, f32::min)
}

impl Backend for TieWatch {
    type Act = CpuAct;
    type Weight = CpuWeight;
    type Cache = <CpuBackend as Backend>::Cache;
    type Step = <CpuBackend as Backend>::Step;

    fn capabilities(&self) -> Capabilities {
        // The watch sees the one-sequence path only.
        Capabilities { batched: false, ..self.cpu.capabilities() }
    }

    fn name(&self) -> String {
        self.cpu.name()
    }

    fn run_pass<R: Send>(&self, pass: impl FnOnce() -> R + Send) -> R {
        self.cpu.run_pass(pass)
    }

    fn run_step<R>(
        &self,
        step: &mut <CpuBackend as Backend>::Step,
        start: usize,
        tokens: &[u32],
        replayable: bool,
        body: &mut dyn FnMut() -> Result<CpuAct>,
        finish: &mut dyn FnMut(&CpuAct) -> Result<R>,
    ) -> Result<R> {
        self.cpu.run_step(step, start, tokens, replayable, body, finish)
    }

    fn check(&self) -> Result<()> {
        self.cpu.check()
    }

    fn upload(&self, t: &Tensor) -> Result<CpuWeight> {
        self.cpu.upload(t)
    }

    fn upload_affine(&self, t: &AffineTensor) -> Result<CpuWeight> {
        self.cpu.upload_affine(t)
    }
    fn upload_fp8(&self, t: &qinfer::quant::fp8::Fp8Tensor) -> Result<CpuWeight> {
        self.cpu.upload_fp8(t)
    }

    fn new_cache(&self, num_layers: usize, kv_dim: usize, capacity: usize) -> <CpuBackend as Backend>::Cache {
        self.cpu.new_cache(num_layers, kv_dim, capacity)
    }

    fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CpuAct {
        self.cpu.act_from_host(rows, cols, data)
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuAct> {
        self.cpu.embed(table, ids)
    }

    fn linear(&self, x: &CpuAct, w: &CpuWeight, bias: Option<&CpuWeight>) -> CpuAct {
        self.cpu.linear(x, w, bias)
    }

    fn rms_norm(&self, x: &CpuAct, w: &CpuWeight, eps: f32) -> CpuAct {
        self.cpu.rms_norm(x, w, eps)
    }

    fn rope(&self, x: &mut CpuAct, head_dim: usize, positions: &[usize], rope: &Rope) {
        self.cpu.rope(x, head_dim, positions, rope)
    }

    fn write_kv(&self, cache: &mut <CpuBackend as Backend>::Cache, layer: usize, k: &CpuAct, v: &CpuAct) {
        self.cpu.write_kv(cache, layer, k, v)
    }

    fn attention(
        &self,
        q: &CpuAct,
        cache: &<CpuBackend as Backend>::Cache,
        layer: usize,
        shape: &AttentionShape,
    ) -> CpuAct {
        self.cpu.attention(q, cache, layer, shape)
    }

    fn silu_mul(&self, gate: &CpuAct, up: &CpuAct) -> CpuAct {
        self.cpu.silu_mul(gate, up)
    }

    fn add_assign(&self, x: &mut CpuAct, y: &CpuAct) {
        self.cpu.add_assign(x, y)
    }

    fn last_row(&self, x: &CpuAct) -> CpuAct {
        self.cpu.last_row(x)
    }

    fn rows(&self, x: &CpuAct) -> usize {
        self.cpu.rows(x)
    }

    fn cols(&self, x: &CpuAct) -> usize {
        self.cpu.cols(x)
    }

    fn to_host(&self, x: &CpuAct) -> Vec<f32> {
        self.cpu.to_host(x)
    }

    fn gather_columns(&self, x: &CpuAct, group: usize, offset: usize, len: usize) -> CpuAct {
        self.cpu.gather_columns(x, group, offset, len)
    }

    fn concat_columns(&self, parts: &[&CpuAct]) -> CpuAct {
        self.cpu.concat_columns(parts)
    }

    fn mul_sigmoid(&self, x: &mut CpuAct, gate: &CpuAct) {
        self.cpu.mul_sigmoid(x, gate)
    }
}

impl FusedOps for TieWatch {
    fn add_rms_norm(&self, h: &mut CpuAct, y: &CpuAct, w: &CpuWeight, eps: f32) -> CpuAct {
        self.cpu.add_rms_norm(h, y, w, eps)
    }

    fn linear_normed(&self, h: &CpuAct, norm: &CpuWeight, eps: f32, w: &CpuWeight, bias: Option<&CpuWeight>) -> CpuAct {
        self.cpu.linear_normed(h, norm, eps, w, bias)
    }

    fn linear_swiglu_normed(&self, h: &CpuAct, norm: &CpuWeight, eps: f32, gate_up: &CpuWeight) -> CpuAct {
        self.cpu.linear_swiglu_normed(h, norm, eps, gate_up)
    }

    fn linear_add(&self, h: &mut CpuAct, x: &CpuAct, w: &CpuWeight, bias: Option<&CpuWeight>) {
        self.cpu.linear_add(h, x, w, bias)
    }

    fn linear_add_for_norm(
        &self,
        h: &mut CpuAct,
        x: &CpuAct,
        w: &CpuWeight,
        bias: Option<&CpuWeight>,
        next_norm: &CpuWeight,
    ) {
        self.cpu.linear_add_for_norm(h, x, w, bias, next_norm)
    }

    fn swiglu(&self, gate_up: &CpuAct) -> CpuAct {
        self.cpu.swiglu(gate_up)
    }

    fn linear_swiglu(&self, x: &CpuAct, gate_up: &CpuWeight) -> CpuAct {
        self.cpu.linear_swiglu(x, gate_up)
    }

    fn qkv_prologue(
        &self,
        qkv: &CpuAct,
        shape: &QkvShape,
        norms: Option<(&CpuWeight, &CpuWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut <CpuBackend as Backend>::Cache,
        layer: usize,
    ) -> (CpuAct, Option<CpuAct>) {
        self.cpu.qkv_prologue(qkv, shape, norms, eps, positions, rope, cache, layer)
    }

    fn qkv_attention(
        &self,
        qkv: &CpuAct,
        shape: &QkvShape,
        norms: Option<(&CpuWeight, &CpuWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut <CpuBackend as Backend>::Cache,
        layer: usize,
        attention: &AttentionShape,
    ) -> (CpuAct, Option<CpuAct>) {
        self.cpu.qkv_attention(qkv, shape, norms, eps, positions, rope, cache, layer, attention)
    }

    fn attention_prologue(
        &self,
        projected: CpuAct,
        k: CpuAct,
        v: &CpuAct,
        shape: &QkvShape,
        norms: Option<(&CpuWeight, &CpuWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut <CpuBackend as Backend>::Cache,
        layer: usize,
    ) -> (CpuAct, Option<CpuAct>) {
        self.cpu.attention_prologue(projected, k, v, shape, norms, eps, positions, rope, cache, layer)
    }
}

impl GdnOps for TieWatch {
    type GdnState = <CpuBackend as GdnOps>::GdnState;

    fn rms_norm_gated(&self, x: &CpuAct, z: &CpuAct, w: &CpuWeight, eps: f32) -> CpuAct {
        self.cpu.rms_norm_gated(x, z, w, eps)
    }

    fn new_gdn_state(&self, cfg: &GdnConfig) -> <CpuBackend as GdnOps>::GdnState {
        self.cpu.new_gdn_state(cfg)
    }

    fn clear_gdn_state(&self, state: &mut <CpuBackend as GdnOps>::GdnState) {
        self.cpu.clear_gdn_state(state)
    }

    fn gdn_conv(&self, x: &CpuAct, weight: &CpuWeight, state: &mut <CpuBackend as GdnOps>::GdnState) -> CpuAct {
        self.cpu.gdn_conv(x, weight, state)
    }

    fn gated_delta_rule(
        &self,
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        a: &CpuAct,
        b: &CpuAct,
        a_log: &CpuWeight,
        dt_bias: &CpuWeight,
        state: &mut <CpuBackend as GdnOps>::GdnState,
    ) -> CpuAct {
        self.cpu.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state)
    }

    fn gdn_mix(
        &self,
        _mixed: &CpuAct,
        _weights: &GdnWeights<'_, CpuWeight>,
        _eps: f32,
        _state: &mut <CpuBackend as GdnOps>::GdnState,
    ) -> Option<CpuAct> {
        self.cpu.gdn_mix(_mixed, _weights, _eps, _state)
    }
}

impl MoeOps for TieWatch {
    fn moe(
        &self,
        x: &CpuAct,
        router_logits: &CpuAct,
        experts: &[ExpertWeights<CpuWeight>],
        routing: Routing,
    ) -> CpuAct {
        let logits = self.cpu.to_host(router_logits);
        let gap = least_routing_gap(&logits, experts.len(), routing.top_k);
        let mut least = self.least_gap.lock().unwrap();
        *least = least.min(gap);
        drop(least);
        self.cpu.moe(x, router_logits, experts, routing)
    }
}

/// Batched forwards are not watched (see `capabilities`).
impl BatchOps for TieWatch {
    type KvPool = ();
}

impl qinfer::backend::vision_ops::VisionOps for TieWatch {}

impl SamplingOps for TieWatch {
    fn sample(&self, logits: &CpuAct, params: &SamplingParams, penalized: &[u32], u: f32) -> Result<u32> {
        self.cpu.sample(logits, params, penalized, u)
    }

    fn sample_ahead(&self, logits: &CpuAct, params: &SamplingParams, u: f32, next_start: usize) -> Result<usize> {
        self.cpu.sample_ahead(logits, params, u, next_start)
    }

    fn picked(&self, ticket: usize) -> Result<u32> {
        self.cpu.picked(ticket)
    }
}
