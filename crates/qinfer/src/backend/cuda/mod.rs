//! The CUDA backend: f32 activations on the device, weights kept in their
//! stored type (bf16, f16, f32, affine levels) in device memory, kernels from
//! the .cu files (NVRTC, see compile.rs), cuBLAS for multi-row GEMMs.
//! Everything stays on one stream. The CUDA libraries load at run time, so
//! this builds without CUDA.
//!
//! The `Backend` ops are infallible by signature; a failing CUDA call records a
//! sticky error, later launches are skipped, and the model's forward returns
//! the error through [`Backend::check`].
//!
//! One file per op family, each with its kernels' table and launchers:
//! linear.rs (float GEMVs, cuBLAS GEMMs), affine.rs (affine GEMVs on CUDA and
//! tensor cores, dequantized prefill tiles) and affine_gemm.rs (a batch's
//! rows through affine weights on the tensor cores; affine_gemm4.rs its
//! 4-bit kernels), attention.rs (and its plans in
//! attention_plan.rs), batch.rs (the batched forward's paged KV pool and
//! attention through block tables), norm_rope.rs, elementwise.rs, gdn.rs,
//! moe.rs and moe_prefill.rs, sampling.rs; device.rs opens the device and holds its
//! buffers, graph.rs records and replays decode steps (batch_graph.rs batched
//! ones), kernels.rs resolves
//! the kernels and launches them with typed arguments.

mod affine;
mod affine_gemm;
mod affine_gemm4;
mod attention;
mod attention_plan;
mod batch;
mod batch_graph;
mod compile;
mod constants;
mod device;
mod elementwise;
mod fp8;
mod gdn;
mod graph;
mod kernels;
mod kv_coded;
mod kv_pool;
mod linear;
mod moe;
mod moe_prefill;
mod norm_rope;
mod sampling;
mod types;
mod vision;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};

use super::ops::{BatchOps, FusedOps, GdnOps, MoeOps, SamplingOps};
use super::{AttentionShape, Backend, Capabilities, ExpertWeights, GdnWeights, QkvShape, Routing};
use crate::config::GdnConfig;
use crate::config::rope::Rope;
use crate::kv::batch::BatchLayout;
use crate::kv::{KvPrecision, KvShape};
use crate::sampling::{RowPick, SamplingParams};
use crate::tensor::Tensor;
use crate::{Error, Result};
pub use compile::prebuild as prebuild_kernels;
#[doc(hidden)]
pub use constants::kernel_constants;
pub use graph::CudaStep;
use kernels::{Kernel, Kernels};
#[doc(hidden)]
pub use kernels::{kernel_names, unit_ptx};
pub use kv_coded::coded_pair;
pub use kv_pool::CudaKvPool;
pub use linear::GemvShape;
pub use types::{
    AffineSide, AffineWeight, BufferPool, CudaAct, CudaGdnState, CudaKv, CudaWeight, Fp8Weight, QuantizedRow,
};

/// Shared memory left out of a kernel's dynamic allowance (the device's
/// opt-in maximum per block, which counts static and dynamic together): room
/// for the static arrays (block reductions' scratch) of the kernels that take
/// the whole allowance.
const STATIC_SHARED_ROOM: usize = 1024;

pub struct CudaBackend {
    ordinal: usize,
    device_name: String,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Every kernel, resolved at start (kernels.rs).
    k: Kernels<Kernel>,
    error: Mutex<Option<String>>,
    /// Fill every new activation with NaN (kernel tests: unwritten outputs show).
    poison: bool,
    /// Multi-row GEMMs see activations as two bf16/f16 halves (two GEMMs)
    /// instead of one rounding: twice the FLOPs, ~16-bit activations.
    split_activations: bool,
    /// MoE prefill: the most rows a chosen expert may average for the
    /// grouped expert GEMM, for every storage (moe_prefill.rs); None for the
    /// measured default (`grouped_rows_default`).
    grouped_moe_rows: Option<usize>,
    /// Whether one-row decode steps over a split cache fold the q|k|v
    /// prologue into the decode attention where its blocks fit one wave.
    fold_split_prologue: bool,
    /// How new KV caches store keys and values.
    kv_precision: KvPrecision,
    /// An encoded format for the paged pool (kv_coded.rs), and its codecs
    /// once the model's cache shape is known ([`Backend::prepare_kv`]).
    kv_coded: Option<crate::kv::KvFormat>,
    kv_codecs: Mutex<Option<Arc<kv_coded::CudaCodecs>>>,
    /// Record decode steps as CUDA graphs and replay them.
    graphs: bool,
    /// Launch kernels with programmatic stream serialization (compute
    /// capability 9.0 and later): each may be scheduled, and read weights,
    /// while the one before it finishes (see `grid_dependency_wait`).
    overlap_launches: bool,
    /// A fixed GEMV launch shape instead of the per-shape choice (profiling).
    gemv_shape: Option<GemvShape>,
    /// Decode steps replayed so far (shared with whoever asked to watch).
    replays: Arc<AtomicUsize>,
    /// Keys the attention kernel's shared memory holds.
    max_attention_keys: usize,
    /// Per cache precision (`kv_slot`) and head dim 64, 128, 256: the keys
    /// one decode attention block holds (attention_plan.rs `decode_whole_keys`); per head
    /// dim, whether the prefill's tensor-core tiles fit a block.
    decode_whole: [[Option<usize>; 3]; 2],
    flash: [bool; 3],
    /// Per `vision::BIDIR_HEAD_DIMS`, whether `flash_bidir`'s tiles fit a block.
    flash_bidir: [bool; 3],
    /// Whether affine weights take the tensor-core GEMM (affine_gemm.rs)
    /// for the rows it outruns the GEMVs and the prefill path at.
    affine_gemm: bool,
    /// Whether 4-bit affine weights take affine_gemm4.rs's kernel for the
    /// rows it beats the general GEMM at.
    affine_gemm4: bool,
    /// Dynamic shared memory a tensor-core affine GEMV block may take here.
    affine_mma_max_shared: usize,
    /// Dynamic shared memory a tensor-core FP8 GEMV block may take here;
    /// None before compute capability 8.9 (no E4M3 conversion instruction).
    fp8_mma_max_shared: Option<usize>,
    /// Dynamic shared memory any block may opt into on this device.
    max_block_shared: usize,
    /// Streaming multiprocessors: grid size of the kernels that loop over
    /// their work (the tensor-core affine GEMV).
    sm_count: usize,
    /// RoPE inverse frequencies on the device, by their bits: uploaded once,
    /// not on every call (a host-to-device copy would stall the stream).
    rope_tables: Mutex<HashMap<Vec<u32>, CudaSlice<f32>>>,
    /// Activation buffers for reuse (see [`BufferPool`]).
    pool: Arc<BufferPool>,
    /// The pass's first position and one-token id on the device (`set_step`
    /// in elementwise.cu), and the host's record of what was last written there.
    step: CudaSlice<i32>,
    step_written: Mutex<Option<[i32; 2]>>,
    /// Set when `set_step` was the last launch: the next kernel is launched
    /// without overlap, so every kernel may read the step inputs before its
    /// wait (they were written at least two launches before it, or the
    /// launch before it had finished when it started).
    after_step_write: AtomicBool,
    /// Whether the last kernel launched was an attention kernel.
    after_attention: AtomicBool,
    /// While a decode step is recorded: the arena its buffers come from, and
    /// whether the stream is capturing (nothing may be allocated then).
    recording: Mutex<Option<(Arc<BufferPool>, bool)>>,
    /// Held for the length of each [`Backend::run_step`].
    pass: Mutex<()>,
    /// The sampling kernels' buffers (see sampling.rs).
    sampling: Mutex<sampling::SampleScratch>,
    /// Device pointer tables of MoE layers' experts (see moe.rs).
    moe_tables: Mutex<HashMap<Vec<u64>, Arc<moe::ExpertTables>>>,
    /// The batched forward's last batch table on the device (see batch.rs).
    batch_table: Mutex<Option<batch::BatchTableCache>>,
    /// The same with each row's slot its own index (an encoded pool's prologue).
    row_slot_table: Mutex<Option<batch::BatchTableCache>>,
    /// The batched step being recorded or run from staged inputs (see batch_graph.rs).
    staged: Mutex<Option<batch_graph::Staged>>,
    /// Set when a batched step could not be recorded: later ones run as they come.
    batch_graphs_off: AtomicBool,
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Cache = CudaKv;
    type Step = CudaStep;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fused_projections: true,
            sample_ahead: true,
            reuse_sequences: self.graphs,
            device_routing: true,
            gated_delta_net: true,
            mixture_of_experts: true,
            batched: true,
            multimodal_positions: true,
        }
    }

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.device_name)
    }

    fn run_step<R>(
        &self,
        step: &mut CudaStep,
        start: usize,
        tokens: &[u32],
        replayable: bool,
        body: &mut dyn FnMut() -> Result<CudaAct>,
        finish: &mut dyn FnMut(&CudaAct) -> Result<R>,
    ) -> Result<R> {
        self.run_step_op(step, start, tokens, replayable, body, finish)
    }

    fn batch_step_rows(&self, rows: usize, moe: bool) -> Option<usize> {
        self.batch_step_rows_op(rows, moe)
    }

    fn run_batch_step<R>(
        &self,
        steps: &mut CudaStep,
        tokens: &[u32],
        batch: &BatchLayout,
        body: &mut dyn FnMut() -> Result<CudaAct>,
        finish: &mut dyn FnMut(&CudaAct) -> Result<R>,
    ) -> Result<R> {
        self.run_batch_step_op(steps, tokens, batch, body, finish)
    }

    fn check(&self) -> Result<()> {
        self.check_op()
    }

    fn upload(&self, t: &Tensor) -> Result<CudaWeight> {
        self.upload_op(t)
    }

    fn upload_affine(&self, t: &crate::quant::affine::AffineTensor) -> Result<CudaWeight> {
        self.upload_affine_op(t)
    }

    fn upload_fp8(&self, t: &crate::quant::fp8::Fp8Tensor) -> Result<CudaWeight> {
        self.upload_fp8_op(t)
    }

    fn prepare_kv(&self, shape: KvShape, attention: &[bool]) -> Result<()> {
        if let Some(format) = self.kv_coded {
            let layers = attention.iter().filter(|&&a| a).count();
            let codecs = self.prepare_coded(format, KvShape { num_layers: layers, ..shape })?;
            *self.kv_codecs.lock().map_err(|_| Error::Invalid("KV codecs lock poisoned".into()))? = Some(codecs);
        }
        Ok(())
    }

    fn new_cache(&self, num_layers: usize, kv_dim: usize, capacity: usize) -> CudaKv {
        if let Some(format) = self.kv_coded {
            // One sequence's contiguous cache (run, generate) is plain on
            // CUDA: say so at its first use rather than store another format.
            self.record(
                Err(format!(
                    "--kv-cache {format} on CUDA is a paged-pool format: it serves the batching engine (batch, \
                     serve, bench --concurrency); one sequence's cache here stores f16 or f32"
                )),
                "a sequence's KV cache",
            );
        }
        CudaKv::new(num_layers, kv_dim, capacity, self.kv_precision)
    }

    fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CudaAct {
        assert_eq!(rows * cols, data.len());
        CudaAct::new(rows, cols, self.upload_slice(data), None)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaAct> {
        self.embed_op(table, ids)
    }

    fn linear(&self, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>) -> CudaAct {
        self.linear_op(x, w, bias)
    }

    fn rms_norm(&self, x: &CudaAct, w: &CudaWeight, eps: f32) -> CudaAct {
        self.norm(x, None, w, None, eps)
    }

    fn rope(&self, x: &mut CudaAct, head_dim: usize, positions: &[usize], rope: &Rope) {
        self.rope_op(x, head_dim, positions, rope)
    }

    fn write_kv(&self, cache: &mut CudaKv, layer: usize, k: &CudaAct, v: &CudaAct) {
        self.write_kv_op(cache, layer, k, v)
    }

    fn attention(&self, q: &CudaAct, cache: &CudaKv, layer: usize, s: &AttentionShape) -> CudaAct {
        self.attention_op(q, cache, layer, s)
    }

    fn silu_mul(&self, gate: &CudaAct, up: &CudaAct) -> CudaAct {
        self.silu_mul_op(gate, up)
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct) {
        self.add_assign_op(x, y)
    }

    fn last_row(&self, x: &CudaAct) -> CudaAct {
        self.last_row_op(x)
    }

    fn rows(&self, x: &CudaAct) -> usize {
        x.rows
    }

    fn cols(&self, x: &CudaAct) -> usize {
        x.cols
    }

    fn to_host(&self, x: &CudaAct) -> Vec<f32> {
        self.to_host_op(x)
    }

    fn gather_columns(&self, x: &CudaAct, group: usize, offset: usize, len: usize) -> CudaAct {
        self.gather_columns_op(x, group, offset, len)
    }

    fn concat_columns(&self, parts: &[&CudaAct]) -> CudaAct {
        self.concat_columns_op(parts)
    }

    fn mul_sigmoid(&self, x: &mut CudaAct, gate: &CudaAct) {
        self.mul_sigmoid_op(x, gate)
    }
}

impl FusedOps for CudaBackend {
    fn add_rms_norm(&self, h: &mut CudaAct, y: &CudaAct, w: &CudaWeight, eps: f32) -> CudaAct {
        h.quantized = None;
        self.norm(h, Some(y), w, None, eps)
    }

    fn linear_swiglu(&self, x: &CudaAct, gate_up: &CudaWeight) -> CudaAct {
        self.linear_swiglu_op(x, gate_up)
    }

    fn linear_normed(
        &self,
        h: &CudaAct,
        norm: &CudaWeight,
        eps: f32,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
    ) -> CudaAct {
        self.linear_normed_op(h, norm, eps, w, bias)
    }

    fn linear_swiglu_normed(&self, h: &CudaAct, norm: &CudaWeight, eps: f32, gate_up: &CudaWeight) -> CudaAct {
        self.linear_swiglu_normed_op(h, norm, eps, gate_up)
    }

    fn linear_add(&self, h: &mut CudaAct, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>) {
        self.linear_add_into(h, x, w, bias, None);
    }

    fn linear_add_for_norm(
        &self,
        h: &mut CudaAct,
        x: &CudaAct,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        next_norm: &CudaWeight,
    ) {
        let norm = match next_norm {
            CudaWeight::Vector(n) if n.len() == h.cols => Some(self.p(n)),
            _ => None,
        };
        self.linear_add_into(h, x, w, bias, norm);
    }

    fn swiglu(&self, gate_up: &CudaAct) -> CudaAct {
        self.swiglu_op(gate_up)
    }

    fn qkv_prologue(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
    ) -> (CudaAct, Option<CudaAct>) {
        self.qkv_prologue_op(qkv, shape, norms, eps, positions, rope, cache, layer)
    }

    fn qkv_attention(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
        attention: &AttentionShape,
    ) -> (CudaAct, Option<CudaAct>) {
        self.qkv_attention_op(qkv, shape, norms, eps, positions, rope, cache, layer, attention)
    }
}

impl GdnOps for CudaBackend {
    type GdnState = CudaGdnState;

    fn rms_norm_gated(&self, x: &CudaAct, z: &CudaAct, w: &CudaWeight, eps: f32) -> CudaAct {
        self.norm(x, None, w, Some(z), eps)
    }

    fn new_gdn_state(&self, cfg: &GdnConfig) -> CudaGdnState {
        self.new_gdn_state_op(cfg)
    }

    fn clear_gdn_state(&self, state: &mut CudaGdnState) {
        self.clear_gdn_state_op(state)
    }

    fn gdn_state_to_host(&self, state: &CudaGdnState) -> Vec<u8> {
        self.gdn_state_to_host_op(state)
    }

    fn gdn_state_from_host(&self, state: &mut CudaGdnState, bytes: &[u8]) -> Result<()> {
        self.gdn_state_from_host_op(state, bytes)
    }

    fn gdn_conv(&self, x: &CudaAct, weight: &CudaWeight, state: &mut CudaGdnState) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        self.conv_columns(x, weight, state, &out);
        out
    }

    fn gated_delta_rule(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        a: &CudaAct,
        b: &CudaAct,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
        state: &mut CudaGdnState,
    ) -> CudaAct {
        self.gated_delta_rule_op(q, k, v, a, b, a_log, dt_bias, state)
    }

    fn gdn_mix(
        &self,
        mixed: &CudaAct,
        weights: &GdnWeights<'_, CudaWeight>,
        eps: f32,
        state: &mut CudaGdnState,
    ) -> Option<CudaAct> {
        self.gdn_mix_op(mixed, weights, eps, state)
    }

    fn gdn_mix_rows(
        &self,
        mixed: &CudaAct,
        weights: &GdnWeights<'_, CudaWeight>,
        eps: f32,
        states: &mut [&mut CudaGdnState],
    ) -> Option<CudaAct> {
        self.gdn_mix_rows_op(mixed, weights, eps, states)
    }
}

impl MoeOps for CudaBackend {
    fn moe(
        &self,
        x: &CudaAct,
        router_logits: &CudaAct,
        experts: &[ExpertWeights<CudaWeight>],
        routing: Routing,
    ) -> CudaAct {
        self.moe_op(x, router_logits, experts, routing)
    }

    fn routes_on_device(&self, experts: &[ExpertWeights<CudaWeight>]) -> bool {
        self.routes_on_device_op(experts)
    }
}

impl BatchOps for CudaBackend {
    type KvPool = CudaKvPool;

    fn new_kv_pool(
        &self,
        num_layers: usize,
        kv_dim: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CudaKvPool> {
        self.new_kv_pool_op(num_layers, kv_dim, num_blocks, block_size)
    }

    fn kv_pool_bytes(&self, pool: &CudaKvPool) -> usize {
        pool.bytes()
    }

    fn kv_bytes_per_token(&self, attention_layers: usize, kv_dim: usize) -> usize {
        match self.kv_codecs.lock().ok().and_then(|c| c.clone()) {
            Some(c) => c.bytes_per_token(attention_layers),
            None => 2 * attention_layers * kv_dim * self.kv_precision.bytes(),
        }
    }

    fn write_kv_batch(&self, pool: &mut CudaKvPool, layer: usize, k: &CudaAct, v: &CudaAct, batch: &BatchLayout) {
        if pool.codecs().is_some() {
            self.write_coded(pool, layer, k, v, batch)
        } else {
            self.write_kv_paged_op(pool, layer, k, v, &batch.slots)
        }
    }

    fn read_kv_block(&self, pool: &CudaKvPool, block: u32) -> Vec<u8> {
        self.read_kv_block_op(pool, block)
    }

    fn write_kv_block(&self, pool: &mut CudaKvPool, block: u32, bytes: &[u8]) -> Result<()> {
        self.write_kv_block_op(pool, block, bytes)
    }

    fn paged_prologue(
        &self,
        projected: CudaAct,
        k: CudaAct,
        v: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        rope: &Rope,
        pool: &mut CudaKvPool,
        layer: usize,
        batch: &BatchLayout,
    ) -> (CudaAct, Option<CudaAct>) {
        if !batch.mrope_positions.is_empty() {
            let (q, k, gate) =
                self.split_norm_rope_multimodal(projected, k, shape, norms, eps, &batch.mrope_positions, rope);
            self.write_kv_batch(pool, layer, &k, v, batch);
            return (q, gate);
        }
        self.paged_prologue_op(projected, k, v, shape, norms, eps, rope, pool, layer, batch)
    }

    fn paged_qkv_prologue(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        rope: &Rope,
        pool: &mut CudaKvPool,
        layer: usize,
        batch: &BatchLayout,
    ) -> (CudaAct, Option<CudaAct>) {
        if !batch.mrope_positions.is_empty() {
            let (projected, k, v) = self.split_qkv(qkv, shape);
            return self.paged_prologue(projected, k, &v, shape, norms, eps, rope, pool, layer, batch);
        }
        self.paged_qkv_prologue_op(qkv, shape, norms, eps, rope, pool, layer, batch)
    }

    fn rope_multimodal(&self, x: &mut CudaAct, head_dim: usize, positions: &[[u32; 3]], rope: &Rope) {
        self.rope_multimodal_op(x, head_dim, positions, rope)
    }

    fn write_kv_paged(&self, pool: &mut CudaKvPool, layer: usize, k: &CudaAct, v: &CudaAct, slots: &[u32]) {
        self.write_kv_paged_op(pool, layer, k, v, slots)
    }

    fn paged_attention(
        &self,
        q: &CudaAct,
        pool: &CudaKvPool,
        layer: usize,
        shape: &AttentionShape,
        batch: &BatchLayout,
    ) -> CudaAct {
        self.paged_attention_op(q, pool, layer, shape, batch)
    }

    fn slice_rows(&self, x: &CudaAct, rows: std::ops::Range<usize>) -> CudaAct {
        self.slice_rows_op(x, rows)
    }

    fn concat_rows(&self, parts: &[CudaAct]) -> CudaAct {
        self.concat_rows_op(parts)
    }

    fn gather_rows(&self, x: &CudaAct, rows: &[usize]) -> CudaAct {
        self.gather_rows_op(x, rows)
    }
}

impl SamplingOps for CudaBackend {
    fn sample(&self, logits: &CudaAct, params: &SamplingParams, penalized: &[u32], u: f32) -> Result<u32> {
        self.sample_on_device(logits, params, penalized, u)
    }

    fn sample_rows(&self, logits: &CudaAct, picks: &[(usize, &RowPick)]) -> Result<Vec<u32>> {
        self.sample_rows_on_device(logits, picks)
    }

    fn sample_ahead(&self, logits: &CudaAct, params: &SamplingParams, u: f32, next_start: usize) -> Result<usize> {
        self.sample_ahead_on_device(logits, params, u, next_start)
    }

    fn picked(&self, ticket: usize) -> Result<u32> {
        self.picked_on_device(ticket)
    }
}
