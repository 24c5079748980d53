//! The op families beyond the dense-Llama ops of [`Backend`]: fused forms of
//! its ops (every one with a default that composes them), Gated DeltaNet,
//! mixture of experts and device-side sampling. A backend that lacks GDN or
//! MoE says so in its [`super::Capabilities`]; their defaults then stand for
//! ops that model loading has already refused with a clear error.

use std::ops::Range;

use super::vision_ops::VisionOps;
use super::{AttentionShape, Backend, ExpertWeights, GdnWeights, QkvShape, Routing};
use crate::config::GdnConfig;
use crate::config::rope::Rope;
use crate::kv::batch::BatchLayout;
use crate::sampling::{RowPick, SamplingParams, pick};
use crate::{Error, Result};

/// What a model needs of a backend: every op family.
pub trait ModelBackend: Backend + FusedOps + GdnOps + MoeOps + SamplingOps + BatchOps + VisionOps {}

impl<B: Backend + FusedOps + GdnOps + MoeOps + SamplingOps + BatchOps + VisionOps> ModelBackend for B {}

/// Fused forms of the core ops, which a backend may compute in fewer passes
/// over memory; each default composes the core ops and is the reference.
pub trait FusedOps: Backend {
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
    /// `linear_swiglu(rms_norm(h, norm, eps), gate_up)` (see [`FusedOps::linear_normed`]).
    fn linear_swiglu_normed(&self, h: &Self::Act, norm: &Self::Weight, eps: f32, gate_up: &Self::Weight) -> Self::Act {
        self.linear_swiglu(&self.rms_norm(h, norm, eps), gate_up)
    }
    /// `h += linear(x, w, bias)`: a block's last projection adding into the
    /// residual stream, which a backend may do in the matmul's epilogue.
    fn linear_add(&self, h: &mut Self::Act, x: &Self::Act, w: &Self::Weight, bias: Option<&Self::Weight>) {
        let y = self.linear(x, w, bias);
        self.add_assign(h, &y);
    }
    /// [`FusedOps::linear_add`] where the next op reads `h` as
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
        let (projected, k, v) = self.split_qkv(qkv, shape);
        self.attention_prologue(projected, k, &v, shape, norms, eps, positions, rope, cache, layer)
    }
    /// A stacked q|k|v projection's three parts: the queries (with their
    /// gates when `shape.output_gate`), the keys and the values.
    fn split_qkv(&self, qkv: &Self::Act, shape: &QkvShape) -> (Self::Act, Self::Act, Self::Act) {
        let (q, kv) = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim);
        let q_rows = if shape.output_gate { 2 * q } else { q };
        let all = q_rows + 2 * kv;
        (
            self.gather_columns(qkv, all, 0, q_rows),
            self.gather_columns(qkv, all, q_rows, kv),
            self.gather_columns(qkv, all, q_rows + kv, kv),
        )
    }
    /// [`FusedOps::qkv_prologue`], then [`Backend::attention`] of its queries
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
    /// [`FusedOps::qkv_prologue`] from separate projections: `projected` is
    /// q_proj's output (queries, with a gate after each head when
    /// `shape.output_gate`), `k` and `v` the key and value projections.
    #[allow(clippy::too_many_arguments)]
    fn attention_prologue(
        &self,
        projected: Self::Act,
        k: Self::Act,
        v: &Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut Self::Cache,
        layer: usize,
    ) -> (Self::Act, Option<Self::Act>) {
        let (q, k, gate) = self.split_norm_rope(projected, k, shape, norms, eps, positions, rope);
        self.write_kv(cache, layer, &k, v);
        (q, gate)
    }
    /// The part of a prologue before the keys and values are stored: the
    /// gate split off the queries, queries and keys RMS-normed per head
    /// (when `norms` are given) and rotated at `positions`. Returns the
    /// queries, the keys and the gate.
    #[allow(clippy::too_many_arguments)]
    fn split_norm_rope(
        &self,
        projected: Self::Act,
        k: Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
    ) -> (Self::Act, Self::Act, Option<Self::Act>) {
        let (mut q, mut k, gate) = self.split_norm(projected, k, shape, norms, eps);
        self.rope(&mut q, shape.head_dim, positions, rope);
        self.rope(&mut k, shape.head_dim, positions, rope);
        (q, k, gate)
    }
    /// [`FusedOps::split_norm_rope`] before the rotation.
    fn split_norm(
        &self,
        projected: Self::Act,
        mut k: Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
    ) -> (Self::Act, Self::Act, Option<Self::Act>) {
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
        (q, k, gate)
    }
}

/// The Gated DeltaNet layers of Qwen3-Next and Qwen3.5. A backend without
/// them implements this with only `type GdnState = ();` and leaves
/// [`super::Capabilities::gated_delta_net`] false.
pub trait GdnOps: Backend {
    /// Gated DeltaNet state of one layer for one sequence (conv window and the
    /// f32 recurrent state). Cloning it is a snapshot.
    type GdnState: Clone + Send + 'static;
    /// `rms(x)·w·silu(z)` over each group of `w.len()` values (the Gated DeltaNet output norm).
    fn rms_norm_gated(&self, x: &Self::Act, z: &Self::Act, w: &Self::Weight, eps: f32) -> Self::Act {
        let _ = (x, z, w, eps);
        unsupported(self, "Gated DeltaNet layers")
    }

    fn new_gdn_state(&self, cfg: &GdnConfig) -> Self::GdnState {
        let _ = cfg;
        unsupported(self, "Gated DeltaNet layers")
    }
    /// `state` copied to host memory (a snapshot leaving for the host tier).
    fn gdn_state_to_host(&self, state: &Self::GdnState) -> Vec<u8> {
        let _ = state;
        unsupported(self, "Gated DeltaNet layers")
    }
    /// Overwrites `state` with bytes [`GdnOps::gdn_state_to_host`] returned.
    fn gdn_state_from_host(&self, state: &mut Self::GdnState, bytes: &[u8]) -> crate::Result<()> {
        let _ = (state, bytes);
        unsupported(self, "Gated DeltaNet layers")
    }
    /// Zeroes `state` in place, as [`GdnOps::new_gdn_state`] makes it, on
    /// the buffers it has (a reused sequence's recorded steps address them).
    fn clear_gdn_state(&self, state: &mut Self::GdnState) {
        let _ = state;
        unsupported(self, "Gated DeltaNet layers")
    }
    /// Depthwise causal conv1d over time (rows) with SiLU, `weight` `[channels, kernel]`,
    /// continuing from and then updating the state's conv window.
    fn gdn_conv(&self, x: &Self::Act, weight: &Self::Weight, state: &mut Self::GdnState) -> Self::Act {
        let _ = (x, weight, state);
        unsupported(self, "Gated DeltaNet layers")
    }
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
    ) -> Self::Act {
        let _ = (q, k, v, a, b, a_log, dt_bias, state);
        unsupported(self, "Gated DeltaNet layers")
    }
    /// The layer between its projections as one step, from the stacked
    /// projection `mixed` `[T, conv_dim + value_dim + 2·nv]` (the conv
    /// channels q|k|v, then z, b and a): conv + SiLU, the gated delta rule
    /// and the gated RMSNorm, `[T, value_dim]`; the state advances. `None`
    /// where the backend has no fused form for this shape: the caller then
    /// composes [`GdnOps::gdn_conv`], [`GdnOps::gated_delta_rule`] and
    /// [`GdnOps::rms_norm_gated`], the reference this must match.
    fn gdn_mix(
        &self,
        _mixed: &Self::Act,
        _weights: &GdnWeights<'_, Self::Weight>,
        _eps: f32,
        _state: &mut Self::GdnState,
    ) -> Option<Self::Act> {
        None
    }
    /// [`GdnOps::gdn_mix`]'s decode step for many sequences at once: row r
    /// of `mixed` is one decode token of the sequence whose state is
    /// `states[r]`. `None` where the backend has no such form: the caller
    /// then steps each sequence apart, the reference this must match.
    fn gdn_mix_rows(
        &self,
        _mixed: &Self::Act,
        _weights: &GdnWeights<'_, Self::Weight>,
        _eps: f32,
        _states: &mut [&mut Self::GdnState],
    ) -> Option<Self::Act> {
        None
    }
    /// [`GdnOps::gated_delta_rule`] over rows of a prompt, in the chunked
    /// form however few they are: a prompt split across steps then computes
    /// as it does in one piece (the chunked form's chunks start where the
    /// prompt does). The default is the plain op, for backends whose one
    /// form serves both.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_prompt(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        a: &Self::Act,
        b: &Self::Act,
        a_log: &Self::Weight,
        dt_bias: &Self::Weight,
        state: &mut Self::GdnState,
    ) -> Self::Act {
        self.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state)
    }
}

/// One forward over many sequences (the batched engine): keys and values
/// in a pool of fixed-size blocks, written through the batch's slot mapping
/// and read through each sequence's block table, and the row slicing that
/// per-sequence ops (Gated DeltaNet's recurrence) need. A backend without
/// it implements `type KvPool = ();` and leaves
/// [`super::Capabilities::batched`] false.
pub trait BatchOps: FusedOps {
    /// Every layer's keys and values for `num_blocks · block_size` slots.
    type KvPool: Send + 'static;

    fn new_kv_pool(
        &self,
        num_layers: usize,
        kv_dim: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> crate::Result<Self::KvPool> {
        let _ = (num_layers, kv_dim, num_blocks, block_size);
        unsupported(self, "batched forwards")
    }
    /// Bytes of pool one token takes: the keys and values of
    /// `attention_layers` layers of `kv_dim` (f32 unless a backend stores
    /// them narrower).
    fn kv_bytes_per_token(&self, attention_layers: usize, kv_dim: usize) -> usize {
        2 * attention_layers * kv_dim * 4
    }
    /// Bytes `pool` holds on its device.
    fn kv_pool_bytes(&self, pool: &Self::KvPool) -> usize {
        let _ = pool;
        0
    }
    /// The attention inputs of a batch (see [`FusedOps::qkv_prologue`]):
    /// queries and keys normed and rotated at `batch.positions`, keys and
    /// values written to `pool` at `batch.slots`. Returns the queries and
    /// the gate.
    #[allow(clippy::too_many_arguments)]
    fn paged_prologue(
        &self,
        projected: Self::Act,
        k: Self::Act,
        v: &Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        rope: &Rope,
        pool: &mut Self::KvPool,
        layer: usize,
        batch: &BatchLayout,
    ) -> (Self::Act, Option<Self::Act>) {
        let (q, k, gate) = if batch.mrope_positions.is_empty() {
            self.split_norm_rope(projected, k, shape, norms, eps, &batch.positions, rope)
        } else {
            self.split_norm_rope_multimodal(projected, k, shape, norms, eps, &batch.mrope_positions, rope)
        };
        self.write_kv_batch(pool, layer, &k, v, batch);
        (q, gate)
    }
    /// [`BatchOps::paged_prologue`] from a stacked q|k|v projection (the
    /// columns [`FusedOps::split_qkv`] splits). A backend may do it in one
    /// pass.
    #[allow(clippy::too_many_arguments)]
    fn paged_qkv_prologue(
        &self,
        qkv: &Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        rope: &Rope,
        pool: &mut Self::KvPool,
        layer: usize,
        batch: &BatchLayout,
    ) -> (Self::Act, Option<Self::Act>) {
        let (projected, k, v) = self.split_qkv(qkv, shape);
        self.paged_prologue(projected, k, &v, shape, norms, eps, rope, pool, layer, batch)
    }
    /// [`FusedOps::split_norm_rope`] with each row rotated at its temporal,
    /// height and width positions ([`BatchOps::rope_multimodal`]).
    #[allow(clippy::too_many_arguments)]
    fn split_norm_rope_multimodal(
        &self,
        projected: Self::Act,
        k: Self::Act,
        shape: &QkvShape,
        norms: Option<(&Self::Weight, &Self::Weight)>,
        eps: f32,
        positions: &[[u32; 3]],
        rope: &Rope,
    ) -> (Self::Act, Self::Act, Option<Self::Act>) {
        let (mut q, mut k, gate) = self.split_norm(projected, k, shape, norms, eps);
        self.rope_multimodal(&mut q, shape.head_dim, positions, rope);
        self.rope_multimodal(&mut k, shape.head_dim, positions, rope);
        (q, k, gate)
    }
    /// Rotates each head of each row at its temporal, height and width
    /// positions, as [`Rope::cos_sin_multimodal`] assigns them to pairs.
    fn rope_multimodal(&self, x: &mut Self::Act, head_dim: usize, positions: &[[u32; 3]], rope: &Rope) {
        let _ = (x, head_dim, positions, rope);
        unsupported(self, "multimodal rotary positions")
    }
    /// Writes a batch's rows of `k` and `v` to their slots (`batch.slots`)
    /// of `layer`; a backend that encodes rows per sequence sees the sequences.
    fn write_kv_batch(&self, pool: &mut Self::KvPool, layer: usize, k: &Self::Act, v: &Self::Act, batch: &BatchLayout) {
        self.write_kv_paged(pool, layer, k, v, &batch.slots)
    }
    /// Writes row `i` of `k` and `v` to slot `slots[i]` of `layer`.
    fn write_kv_paged(&self, pool: &mut Self::KvPool, layer: usize, k: &Self::Act, v: &Self::Act, slots: &[u32]) {
        let _ = (pool, layer, k, v, slots);
        unsupported(self, "batched forwards")
    }
    /// Causal attention of each sequence's query rows over its context,
    /// read through its block table (its new rows already written).
    fn paged_attention(
        &self,
        q: &Self::Act,
        pool: &Self::KvPool,
        layer: usize,
        shape: &AttentionShape,
        batch: &BatchLayout,
    ) -> Self::Act {
        let _ = (q, pool, layer, shape, batch);
        unsupported(self, "batched forwards")
    }
    /// Every layer's keys and values of `block`, copied to host memory (a
    /// prefix-cache block leaving the pool for the host tier).
    fn read_kv_block(&self, pool: &Self::KvPool, block: u32) -> Vec<u8> {
        let _ = (pool, block);
        unsupported(self, "batched forwards")
    }
    /// Writes bytes that [`BatchOps::read_kv_block`] returned back into `block`.
    fn write_kv_block(&self, pool: &mut Self::KvPool, block: u32, bytes: &[u8]) -> crate::Result<()> {
        let _ = (pool, block, bytes);
        unsupported(self, "batched forwards")
    }
    /// Rows `rows` of `x`.
    fn slice_rows(&self, x: &Self::Act, rows: Range<usize>) -> Self::Act {
        let _ = (x, rows);
        unsupported(self, "batched forwards")
    }
    /// Parts stacked row after row (equal widths).
    fn concat_rows(&self, parts: &[Self::Act]) -> Self::Act {
        let _ = parts;
        unsupported(self, "batched forwards")
    }
    /// Rows `rows` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Act, rows: &[usize]) -> Self::Act {
        let _ = (x, rows);
        unsupported(self, "batched forwards")
    }
    /// `y[start + i] += d[i]` for each row `i` of `d` (a low-rank update of
    /// some rows of a projection's output).
    fn add_rows(&self, y: &mut Self::Act, start: usize, d: &Self::Act) {
        let (n, k) = (self.rows(y), self.rows(d));
        let mut mid = self.slice_rows(y, start..start + k);
        self.add_assign(&mut mid, d);
        let mut parts = Vec::with_capacity(3);
        if start > 0 {
            parts.push(self.slice_rows(y, 0..start));
        }
        parts.push(mid);
        if start + k < n {
            parts.push(self.slice_rows(y, start + k..n));
        }
        *y = self.concat_rows(&parts);
    }
}

/// Routed experts (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE). A backend without
/// them implements this empty and leaves
/// [`super::Capabilities::mixture_of_experts`] false.
pub trait MoeOps: Backend {
    /// Routed experts: softmax over `router_logits` `[T, E]`, top-k, then the
    /// weighted sum of the chosen experts' SwiGLU outputs.
    fn moe(
        &self,
        x: &Self::Act,
        router_logits: &Self::Act,
        experts: &[ExpertWeights<Self::Weight>],
        routing: Routing,
    ) -> Self::Act {
        let _ = (x, router_logits, experts, routing);
        unsupported(self, "mixture-of-experts layers")
    }

    /// Whether [`MoeOps::moe`] routes these experts without the host (so a
    /// decode step over them can be recorded): the backend's
    /// [`crate::backend::Capabilities::device_routing`], unless it cannot for
    /// how these experts are stored.
    fn routes_on_device(&self, experts: &[ExpertWeights<Self::Weight>]) -> bool {
        let _ = experts;
        self.capabilities().device_routing
    }
}

/// Picking the next token where the logits are, so only its id crosses to
/// the host; the default reads the logits back and picks on the host.
pub trait SamplingOps: Backend {
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
    /// The picks of rows of `logits`, each `(row, pick)` as
    /// [`SamplingOps::sample`] picks from that row, in the order given.
    /// Device backends override this so that only the token ids cross to
    /// the host, all at once.
    fn sample_rows(&self, logits: &Self::Act, picks: &[(usize, &RowPick)]) -> Result<Vec<u32>> {
        if picks.is_empty() {
            return Ok(Vec::new());
        }
        let host = self.to_host(logits);
        let cols = self.cols(logits);
        picks
            .iter()
            .map(|&(r, p)| {
                let row = host.get(r * cols..(r + 1) * cols).ok_or_else(|| {
                    Error::Invalid(format!("sample_rows: row {r} of {} rows", host.len() / cols.max(1)))
                })?;
                Ok(pick(&p.params, &mut row.to_vec(), &p.penalized, p.u))
            })
            .collect()
    }
    /// Picks as [`SamplingOps::sample`] does (no repetition penalty) without
    /// waiting for the pick: it stays on the device as the token of the next
    /// one-token pass, at position `next_start`, which names it
    /// [`super::DEVICE_PICK`], so that pass can start before the host has read it.
    /// Returns the ticket [`SamplingOps::picked`] reads it with; two tickets may
    /// be outstanding at once.
    fn sample_ahead(&self, logits: &Self::Act, params: &SamplingParams, u: f32, next_start: usize) -> Result<usize> {
        let _ = (logits, params, u, next_start);
        Err(Error::Invalid(format!("{} does not pick ahead", self.name())))
    }
    /// The pick of a [`SamplingOps::sample_ahead`], once the device has made it.
    fn picked(&self, ticket: usize) -> Result<u32> {
        let _ = ticket;
        Err(Error::Invalid(format!("{} does not pick ahead", self.name())))
    }
}

/// The defaults of an op family a backend does not run: loading a model
/// checks [`super::Capabilities`] first and refuses it with an error, so
/// reaching one is a bug in the caller, not a user's mistake.
fn unsupported<B: Backend + ?Sized>(backend: &B, what: &str) -> ! {
    panic!(
        "{what} are not supported by the {} backend (its capabilities say so; model loading checks them)",
        backend.name()
    )
}
