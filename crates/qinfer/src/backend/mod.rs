//! The boundary between model code and hardware. Model files call these ops
//! on opaque activation and weight handles; a backend (CPU now, CUDA later)
//! decides layout, precision of intermediates and parallelism.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::config::GdnConfig;
use crate::config::rope::Rope;
use crate::kv::KvCache;
use crate::quant::affine::AffineTensor;
use crate::sampling::{SamplingParams, pick};
use crate::tensor::Tensor;
use crate::{Error, Result};

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
/// [`Backend::sample_ahead`], which only the device holds.
pub const DEVICE_PICK: u32 = u32::MAX;

pub trait Backend: Send + Sync {
    /// Activations: `rows × cols` values, one row per token.
    type Act: Send;
    /// A weight placed where this backend computes.
    type Weight: Send + Sync;
    /// Default: an empty cache of no layers (what a dropped sequence leaves).
    type Cache: KvCache + Default + 'static;
    /// Gated DeltaNet state of one layer for one sequence (conv window and the
    /// f32 recurrent state). Cloning it is a snapshot.
    type GdnState: Clone + Send + 'static;
    /// What a backend keeps per sequence to run its decode steps faster (CUDA:
    /// the recorded graphs); `()` where every pass simply runs.
    type Step: Default + Send + 'static;

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
    /// The next token from the last row of `logits`, chosen as
    /// [`crate::sampling::pick`] chooses: `penalized` are the distinct
    /// context tokens the repetition penalty applies to, `u` the sampler's
    /// uniform draw. Device backends override this so that only the token
    /// id crosses to the host.
    fn sample(&self, logits: &Self::Act, params: &SamplingParams, penalized: &[u32], u: f32) -> Result<u32> {
        let host = self.to_host(logits);
        let cols = self.cols(logits);
        let mut row = host[host.len() - cols..].to_vec();
        Ok(pick(params, &mut row, penalized, u))
    }
    /// Whether [`Backend::sample_ahead`] works here.
    fn samples_ahead(&self) -> bool {
        false
    }
    /// Picks as [`Backend::sample`] does (no repetition penalty) without
    /// waiting for the pick: it stays on the device as the token of the next
    /// one-token pass, at position `next_start`, which names it
    /// [`DEVICE_PICK`], so that pass can start before the host has read it.
    /// Returns the ticket [`Backend::picked`] reads it with; two tickets may
    /// be outstanding at once.
    fn sample_ahead(&self, logits: &Self::Act, params: &SamplingParams, u: f32, next_start: usize) -> Result<usize> {
        let _ = (logits, params, u, next_start);
        Err(Error::Invalid(format!("{} does not pick ahead", self.name())))
    }
    /// The pick of a [`Backend::sample_ahead`], once the device has made it.
    fn picked(&self, ticket: usize) -> Result<u32> {
        let _ = ticket;
        Err(Error::Invalid(format!("{} does not pick ahead", self.name())))
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
    fn new_cache(&self, num_layers: usize, kv_dim: usize, capacity: usize) -> Self::Cache;

    /// Activations from host values (tests, and inputs that start on the host).
    fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Act;
    /// Rows of an embedding table `[vocab, dim]`.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Act>;
    /// `x · Wᵀ (+ bias)`.
    fn linear(&self, x: &Self::Act, w: &Self::Weight, bias: Option<&Self::Weight>) -> Self::Act;
    /// RMSNorm over each contiguous group of `w.len()` values (a whole row, or per head).
    fn rms_norm(&self, x: &Self::Act, w: &Self::Weight, eps: f32) -> Self::Act;
    /// `h += y`, then the RMSNorm of the new `h` (a residual add feeding the
    /// next norm: one pass over the row on a device).
    fn add_rms_norm(&self, h: &mut Self::Act, y: &Self::Act, w: &Self::Weight, eps: f32) -> Self::Act {
        self.add_assign(h, y);
        self.rms_norm(h, w, eps)
    }
    /// `linear(rms_norm(h, norm, eps), w, bias)`: the first projection of a
    /// pre-norm block, which a backend may compute without writing the
    /// normed rows out (the norm folded into the matmul's input).
    fn linear_normed(
        &self,
        h: &Self::Act,
        norm: &Self::Weight,
        eps: f32,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
    ) -> Self::Act {
        self.linear(&self.rms_norm(h, norm, eps), w, bias)
    }
    /// `linear_swiglu(rms_norm(h, norm, eps), gate_up)` (see [`Backend::linear_normed`]).
    fn linear_swiglu_normed(&self, h: &Self::Act, norm: &Self::Weight, eps: f32, gate_up: &Self::Weight) -> Self::Act {
        self.linear_swiglu(&self.rms_norm(h, norm, eps), gate_up)
    }
    /// `h += linear(x, w, bias)`: a block's last projection adding into the
    /// residual stream, which a backend may do in the matmul's epilogue.
    fn linear_add(&self, h: &mut Self::Act, x: &Self::Act, w: &Self::Weight, bias: Option<&Self::Weight>) {
        let y = self.linear(x, w, bias);
        self.add_assign(h, &y);
    }
    /// [`Backend::linear_add`] where the next op reads `h` as
    /// `RMSNorm(h)·next_norm` (the next block's first projection): a backend
    /// may prepare that input as it writes `h`.
    fn linear_add_for_norm(
        &self,
        h: &mut Self::Act,
        x: &Self::Act,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        next_norm: &Self::Weight,
    ) {
        let _ = next_norm;
        self.linear_add(h, x, w, bias)
    }
    /// Rotates every head of width `head_dim` in place; `positions[i]` is row i's position.
    fn rope(&self, x: &mut Self::Act, head_dim: usize, positions: &[usize], rope: &Rope);
    /// Writes this layer's k/v rows at positions `[cache.len(), cache.len() + rows)`.
    fn write_kv(&self, cache: &mut Self::Cache, layer: usize, k: &Self::Act, v: &Self::Act);
    /// Causal attention of `q` rows (positions `cache.len()..`) over the cache including the new rows.
    fn attention(&self, q: &Self::Act, cache: &Self::Cache, layer: usize, shape: &AttentionShape) -> Self::Act;
    /// silu(gate) ⊙ up.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;

    /// Whether layers should stack projections that share an input (q|k|v,
    /// gate|up) into one weight: one matmul instead of several, which pays
    /// where each launch costs (devices).
    fn fuses_projections(&self) -> bool {
        false
    }
    /// silu(gate) ⊙ up from a stacked gate|up projection `[T, 2·width]`.
    fn swiglu(&self, gate_up: &Self::Act) -> Self::Act {
        let width = self.cols(gate_up) / 2;
        let all = 2 * width;
        self.silu_mul(&self.gather_columns(gate_up, all, 0, width), &self.gather_columns(gate_up, all, width, width))
    }
    /// silu(gate) ⊙ up of `x` through a stacked gate|up weight `[2·width, in]`:
    /// `swiglu(linear(x, gate_up))`, which a backend may do in one pass.
    fn linear_swiglu(&self, x: &Self::Act, gate_up: &Self::Weight) -> Self::Act {
        self.swiglu(&self.linear(x, gate_up, None))
    }
    /// The attention inputs from a stacked q|k|v projection `qkv` (`[T, q_rows
    /// + 2·kv]`, `q_rows` holding a gate after each query head when
    /// `shape.output_gate`): queries and keys RMS-normed per head with
    /// `norms` (when given) and rotated at `positions`, keys and values
    /// appended to `cache` at layer `layer`. Returns the queries and the gate.
    #[allow(clippy::too_many_arguments)]
    fn qkv_prologue(
        &self,
        qkv: &Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut Self::Cache,
        layer: usize,
    ) -> (Self::Act, Option<Self::Act>) {
        let (q, kv) = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim);
        let q_rows = if shape.output_gate { 2 * q } else { q };
        let all = q_rows + 2 * kv;
        let projected = self.gather_columns(qkv, all, 0, q_rows);
        let k = self.gather_columns(qkv, all, q_rows, kv);
        let v = self.gather_columns(qkv, all, q_rows + kv, kv);
        self.attention_prologue(projected, k, &v, shape, norms, eps, positions, rope, cache, layer)
    }
    /// [`Backend::qkv_prologue`], then [`Backend::attention`] of its queries
    /// over the cache: the attention's output and the gate. A backend may
    /// fold the prologue into the attention kernel (one-row decode steps).
    #[allow(clippy::too_many_arguments)]
    fn qkv_attention(
        &self,
        qkv: &Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut Self::Cache,
        layer: usize,
        attention: &AttentionShape,
    ) -> (Self::Act, Option<Self::Act>) {
        let (q, gate) = self.qkv_prologue(qkv, shape, norms, eps, positions, rope, cache, layer);
        (self.attention(&q, cache, layer, attention), gate)
    }
    /// [`Backend::qkv_prologue`] from separate projections: `projected` is
    /// q_proj's output (queries, with a gate after each head when
    /// `shape.output_gate`), `k` and `v` the key and value projections.
    #[allow(clippy::too_many_arguments)]
    fn attention_prologue(
        &self,
        projected: Self::Act,
        mut k: Self::Act,
        v: &Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut Self::Cache,
        layer: usize,
    ) -> (Self::Act, Option<Self::Act>) {
        let hd = shape.head_dim;
        let (mut q, gate) = if shape.output_gate {
            (self.gather_columns(&projected, 2 * hd, 0, hd), Some(self.gather_columns(&projected, 2 * hd, hd, hd)))
        } else {
            (projected, None)
        };
        if let Some((qn, kn)) = norms {
            q = self.rms_norm(&q, qn, eps);
            k = self.rms_norm(&k, kn, eps);
        }
        self.rope(&mut q, hd, positions, rope);
        self.rope(&mut k, hd, positions, rope);
        self.write_kv(cache, layer, &k, v);
        (q, gate)
    }
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
    /// `rms(x)·w·silu(z)` over each group of `w.len()` values (the Gated DeltaNet output norm).
    fn rms_norm_gated(&self, x: &Self::Act, z: &Self::Act, w: &Self::Weight, eps: f32) -> Self::Act;

    fn new_gdn_state(&self, cfg: &GdnConfig) -> Self::GdnState;
    /// Zeroes `state` in place, as [`Backend::new_gdn_state`] makes it, on
    /// the buffers it has (a reused sequence's recorded steps address them).
    fn clear_gdn_state(&self, state: &mut Self::GdnState);
    /// Whether a dropped sequence's cache and states are worth keeping for the
    /// next sequence of the same capacity: where [`Backend::run_step`]
    /// records steps over them, reusing them replays those recordings
    /// instead of recording each new sequence's steps again.
    fn reuses_sequences(&self) -> bool {
        false
    }
    /// Depthwise causal conv1d over time (rows) with SiLU, `weight` `[channels, kernel]`,
    /// continuing from and then updating the state's conv window.
    fn gdn_conv(&self, x: &Self::Act, weight: &Self::Weight, state: &mut Self::GdnState) -> Self::Act;
    /// The gated delta rule over `q`, `k` `[T, nk·dk]`, `v` `[T, nv·dv]` and the
    /// gate inputs `a`, `b` `[T, nv]`; returns `[T, nv·dv]` and advances the state.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        a: &Self::Act,
        b: &Self::Act,
        a_log: &Self::Weight,
        dt_bias: &Self::Weight,
        state: &mut Self::GdnState,
    ) -> Self::Act;
    /// The layer between its projections as one step, from the stacked
    /// projection `mixed` `[T, conv_dim + value_dim + 2·nv]` (the conv
    /// channels q|k|v, then z, b and a): conv + SiLU, the gated delta rule
    /// and the gated RMSNorm, `[T, value_dim]`; the state advances. `None`
    /// where the backend has no fused form for this shape: the caller then
    /// composes [`Backend::gdn_conv`], [`Backend::gated_delta_rule`] and
    /// [`Backend::rms_norm_gated`], the reference this must match.
    fn gdn_mix(
        &self,
        _mixed: &Self::Act,
        _weights: &GdnWeights<'_, Self::Weight>,
        _eps: f32,
        _state: &mut Self::GdnState,
    ) -> Option<Self::Act> {
        None
    }
    /// Whether [`Backend::moe`] decides a decode step's routing without the
    /// host, so steps of MoE models can be recorded (see `run_step`).
    fn routes_on_device(&self) -> bool {
        false
    }
    /// Routed experts: softmax over `router_logits` `[T, E]`, top-k, then the
    /// weighted sum of the chosen experts' SwiGLU outputs.
    fn moe(
        &self,
        x: &Self::Act,
        router_logits: &Self::Act,
        experts: &[ExpertWeights<Self::Weight>],
        routing: Routing,
    ) -> Self::Act;
}
