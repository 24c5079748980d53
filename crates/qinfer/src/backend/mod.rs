//! The boundary between model code and hardware. Model files call these ops
//! on opaque activation and weight handles; a backend (CPU now, CUDA later)
//! decides layout, precision of intermediates and parallelism.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ops;
pub mod vision_ops;

use crate::Result;
use crate::config::rope::Rope;
use crate::kv::{KvCache, KvShape};
use crate::quant::affine::AffineTensor;
use crate::quant::fp8::Fp8Tensor;
use crate::tensor::Tensor;

/// Shape of one attention call: `q` holds `num_heads` heads of `head_dim` per
/// row; the cache holds `num_kv_heads` heads (GQA when fewer).
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Attend only to the last `window` positions (including the current one).
    pub window: Option<usize>,
    pub scale: f32,
}

/// The attention heads a stacked q|k|v projection holds.
#[derive(Debug, Clone, Copy)]
pub struct QkvShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// q_proj emits `[query(head_dim), gate(head_dim)]` per head.
    pub output_gate: bool,
}

/// One expert's SwiGLU weights: `down(silu(gate(x)) ⊙ up(x))`.
pub struct ExpertWeights<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
}

/// A Gated DeltaNet layer's weights between its input and output projections.
pub struct GdnWeights<'a, W> {
    /// `[conv_dim, kernel]`.
    pub conv: &'a W,
    pub a_log: &'a W,
    pub dt_bias: &'a W,
    /// The gated RMSNorm's weight over each value head.
    pub norm: &'a W,
}

/// How a mixture-of-experts block routes each token (transformers' `TopKRouter`).
#[derive(Debug, Clone, Copy)]
pub struct Routing {
    pub top_k: usize,
    /// Rescale the chosen probabilities to sum to 1.
    pub renormalize: bool,
}

/// The token of a one-token pass that feeds the pick of the last
/// [`crate::backend::ops::SamplingOps::sample_ahead`], which only the device holds.
pub const DEVICE_PICK: u32 = u32::MAX;

/// What a backend runs beyond the dense-Llama ops of [`Backend`], and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Layers should stack projections that share an input (q|k|v, gate|up)
    /// into one weight: one matmul instead of several, which pays where each
    /// launch costs (devices).
    pub fused_projections: bool,
    /// [`ops::SamplingOps::sample_ahead`] works here.
    pub sample_ahead: bool,
    /// A dropped sequence's cache and states are worth keeping for the next
    /// sequence of the same capacity: where [`Backend::run_step`] records
    /// steps over them, reusing them replays those recordings instead of
    /// recording each new sequence's steps again.
    pub reuse_sequences: bool,
    /// [`ops::MoeOps::moe`] decides a decode step's routing without the host, so
    /// steps of MoE models can be recorded (see [`Backend::run_step`]).
    pub device_routing: bool,
    /// The [`ops::GdnOps`] (Gated DeltaNet layers of the hybrids) run here.
    pub gated_delta_net: bool,
    /// [`ops::MoeOps::moe`] runs here.
    pub mixture_of_experts: bool,
    /// The [`ops::BatchOps`] (many sequences in one forward, paged KV) run here.
    pub batched: bool,
    /// [`ops::BatchOps::rope_multimodal`] runs here (image tokens' positions).
    pub multimodal_positions: bool,
}

/// What a backend computes with, and the ops a dense Llama needs. The fused
/// forms, Gated DeltaNet, mixture of experts and device sampling are the
/// op-family traits of [`ops`]; a backend says which of them it runs in
/// [`Backend::capabilities`], and a model whose layers need one the backend
/// lacks fails at load with an error naming it.
pub trait Backend: Send + Sync {
    /// Activations: `rows × cols` values, one row per token.
    type Act: Send;
    /// A weight placed where this backend computes.
    type Weight: Send + Sync;
    /// Default: an empty cache of no layers (what a dropped sequence leaves).
    type Cache: KvCache + Default + 'static;
    /// What a backend keeps per sequence to run its decode steps faster (CUDA:
    /// the recorded graphs); `()` where every pass simply runs.
    type Step: Default + Send + 'static;

    /// What this backend runs, and how (see [`Capabilities`]).
    fn capabilities(&self) -> Capabilities;

    fn name(&self) -> String;
    /// Runs one whole forward pass where this backend's work is dispatched
    /// from. The CPU backend moves it onto a worker of its thread pool, so each
    /// op's parallel loop forks from there instead of waking the pool from an
    /// outside thread and sleeping until it finishes (twice per op).
    fn run_pass<R: Send>(&self, pass: impl FnOnce() -> R + Send) -> R {
        pass()
    }
    /// Runs one forward pass of `tokens` at positions `start..`: `body` issues
    /// its work and returns the pass's output activations, which `finish`
    /// turns into the result (host logits, a sampled token). With
    /// `replayable` (one token, and `body` issues the same device work at
    /// every position of the same step shape), a backend may record the pass
    /// once and replay the recording for later tokens of `step`'s sequence
    /// instead of calling `body`; `finish` runs after every pass, outside
    /// the recording.
    fn run_step<R>(
        &self,
        step: &mut Self::Step,
        start: usize,
        tokens: &[u32],
        replayable: bool,
        body: &mut dyn FnMut() -> Result<Self::Act>,
        finish: &mut dyn FnMut(&Self::Act) -> Result<R>,
    ) -> Result<R> {
        let _ = (step, start, tokens, replayable);
        let out = body()?;
        finish(&out)
    }
    /// The rows a batched step of `rows` decode rows (one a sequence) runs
    /// with where this backend records such steps ([`Backend::run_batch_step`]):
    /// `rows` padded up to the recorded size that serves it. None: such steps
    /// run as they come (`moe`: the model has experts, which are recorded
    /// only where the backend routes that many rows on the device).
    fn batch_step_rows(&self, rows: usize, moe: bool) -> Option<usize> {
        let _ = (rows, moe);
        None
    }
    /// Runs one batched decode step over `batch` (padded to
    /// [`Backend::batch_step_rows`]'s size): `body` issues its device work,
    /// which must depend on the step only through `tokens` and `batch`'s
    /// table (the positions, slots and block tables), and returns the
    /// activations `finish` turns into the result. A backend may record
    /// `body` once per size and attention plan in `steps` and replay the
    /// recording with each later step's inputs instead of calling it;
    /// `finish` runs after every step, outside the recording.
    fn run_batch_step<R>(
        &self,
        steps: &mut Self::Step,
        tokens: &[u32],
        batch: &crate::kv::batch::BatchLayout,
        body: &mut dyn FnMut() -> Result<Self::Act>,
        finish: &mut dyn FnMut(&Self::Act) -> Result<R>,
    ) -> Result<R> {
        let _ = (steps, tokens, batch);
        let out = body()?;
        finish(&out)
    }
    /// Reports a failure of earlier asynchronous work (device backends), after
    /// waiting for it to finish.
    fn check(&self) -> Result<()> {
        Ok(())
    }
    /// Places a stored tensor (1-D vectors or 2-D `[out, in]` matrices).
    fn upload(&self, t: &Tensor) -> Result<Self::Weight>;
    /// Places an affine-quantized `[out, in]` matrix, kept packed.
    fn upload_affine(&self, t: &AffineTensor) -> Result<Self::Weight>;
    /// Places an FP8 `[out, in]` matrix, kept one byte per value with its scales.
    fn upload_fp8(&self, t: &Fp8Tensor) -> Result<Self::Weight>;
    /// Readies KV storage for a model whose caches have `shape` (every
    /// layer of the model; `attention[l]` tells the layers that keep keys
    /// and values): a backend that encodes them builds its codecs here, and
    /// rejects a shape its format cannot hold.
    fn prepare_kv(&self, shape: KvShape, attention: &[bool]) -> Result<()> {
        let _ = (shape, attention);
        Ok(())
    }
    fn new_cache(&self, num_layers: usize, kv_dim: usize, capacity: usize) -> Self::Cache;

    /// Activations from host values (tests, and inputs that start on the host).
    fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Act;
    /// Rows of an embedding table `[vocab, dim]`.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Act>;
    /// `x · Wᵀ (+ bias)`.
    fn linear(&self, x: &Self::Act, w: &Self::Weight, bias: Option<&Self::Weight>) -> Self::Act;
    /// RMSNorm over each contiguous group of `w.len()` values (a whole row, or per head).
    fn rms_norm(&self, x: &Self::Act, w: &Self::Weight, eps: f32) -> Self::Act;
    /// Rotates every head of width `head_dim` in place; `positions[i]` is row i's position.
    fn rope(&self, x: &mut Self::Act, head_dim: usize, positions: &[usize], rope: &Rope);
    /// Writes this layer's k/v rows at positions `[cache.len(), cache.len() + rows)`.
    fn write_kv(&self, cache: &mut Self::Cache, layer: usize, k: &Self::Act, v: &Self::Act);
    /// Causal attention of `q` rows (positions `cache.len()..`) over the cache including the new rows.
    fn attention(&self, q: &Self::Act, cache: &Self::Cache, layer: usize, shape: &AttentionShape) -> Self::Act;
    /// silu(gate) ⊙ up.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act);
    /// The last row only (decode and generation need only the last logits).
    fn last_row(&self, x: &Self::Act) -> Self::Act;
    fn rows(&self, x: &Self::Act) -> usize;
    fn cols(&self, x: &Self::Act) -> usize;
    fn to_host(&self, x: &Self::Act) -> Vec<f32>;

    /// From each row, columns `[offset, offset + len)` of every consecutive group
    /// of `group` columns, concatenated (splits fused projections; `group` =
    /// row width for a plain column slice).
    fn gather_columns(&self, x: &Self::Act, group: usize, offset: usize, len: usize) -> Self::Act;
    /// Rows side by side: `[rows, Σ cols]`.
    fn concat_columns(&self, parts: &[&Self::Act]) -> Self::Act;
    /// `x ⊙ sigmoid(gate)`; `gate` is as wide as `x` or one column (a per-row scalar).
    fn mul_sigmoid(&self, x: &mut Self::Act, gate: &Self::Act);
}
