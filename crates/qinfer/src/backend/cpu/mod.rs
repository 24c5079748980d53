//! The CPU backend: f32 activations, weights consumed in their stored type,
//! rayon for threads.

pub mod act_blocks;
pub mod affine;
#[cfg(target_arch = "x86_64")]
mod affine_avx2;
pub mod attention;
pub mod attention_coded;
mod batch;
pub mod fp8;
pub mod gdn;
pub mod matmul;
pub mod moe;
mod out_ptr;
mod panel_vnni;
pub mod q8;
pub mod q8_avx2;
mod q8_avx512;
pub mod q8k;
mod q8k_avx2;
pub mod simd;
#[cfg(test)]
mod test_rng;

use rayon::prelude::*;

use super::ops::{FusedOps, GdnOps, MoeOps, SamplingOps};
use super::{AttentionShape, Backend, Capabilities, ExpertWeights, Routing};
use crate::config::GdnConfig;
use crate::config::rope::Rope;
use std::sync::{Arc, Mutex};

use crate::kv::codecs::KvCodecs;
use crate::kv::contiguous::{ContiguousKv, LayerRows};
use crate::kv::{KvCache, KvFormat, KvShape};
use crate::quant::affine::AffineTensor;
use crate::quant::fp8::Fp8Tensor;
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};
use gdn::CpuGdnState;
use matmul::{CpuMatrix, matmul};

/// Row-major f32 activations.
#[derive(Debug, Clone)]
pub struct CpuAct {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuAct {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuAct { rows, cols, data: vec![0.0; rows * cols] }
    }
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(rows * cols, data.len());
        CpuAct { rows, cols, data }
    }
}

/// A weight on the CPU: matrices stay in their stored bytes; vectors (norms,
/// biases) are tiny and decoded once to f32.
#[derive(Debug, Clone)]
pub enum CpuWeight {
    Matrix(CpuMatrix),
    /// MLX affine-quantized matrix, kept packed.
    Affine(affine::AffineMatrix),
    /// FP8 matrix, one byte per value with its scales.
    Fp8(fp8::Fp8Matrix),
    Vector(Vec<f32>),
}

impl CpuWeight {
    fn matrix(&self) -> &CpuMatrix {
        match self {
            CpuWeight::Matrix(m) => m,
            CpuWeight::Affine(_) => panic!("expected a float or ggml-block matrix, found an affine-quantized one"),
            CpuWeight::Fp8(_) => panic!("expected a float or ggml-block matrix, found an FP8 one"),
            CpuWeight::Vector(_) => panic!("expected a matrix weight, found a vector"),
        }
    }
    fn vector(&self) -> &[f32] {
        match self {
            CpuWeight::Vector(v) => v,
            CpuWeight::Matrix(_) | CpuWeight::Affine(_) | CpuWeight::Fp8(_) => {
                panic!("expected a vector weight, found a matrix")
            }
        }
    }
}

/// Below this many values an elementwise op runs on the calling thread: a rayon
/// dispatch costs more than the work (decode calls these ~10× per layer per token).
const PAR_MIN_VALUES: usize = 1 << 15;

/// The CPU backend. Its KV caches store keys and values as `kv` says (f32
/// unless asked otherwise); the codecs of an encoded format are built once
/// the model's cache shape is known ([`Backend::prepare_kv`]).
#[derive(Default, Clone)]
pub struct CpuBackend {
    kv: KvFormat,
    codecs: Arc<Mutex<Option<PreparedKv>>>,
}

/// The codecs of a model's attention layers and where its layers keep them.
#[derive(Clone)]
struct PreparedKv {
    codecs: Arc<KvCodecs>,
    /// Per model layer, its attention layer (`None`: it keeps no KV).
    attention_index: Vec<Option<usize>>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBackend {{ kv: {} }}", self.kv)
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// A backend whose KV caches store keys and values in `kv`.
    pub fn with_kv_format(kv: KvFormat) -> Self {
        CpuBackend { kv, codecs: Default::default() }
    }

    pub fn kv_format(&self) -> KvFormat {
        self.kv
    }

    /// The codecs of an encoded KV format (none for f32).
    fn kv_codecs(&self) -> Option<PreparedKv> {
        if self.kv == KvFormat::F32 {
            return None;
        }
        let codecs = self.codecs.lock().expect("KV codecs").clone();
        Some(codecs.expect("prepare_kv builds the KV codecs before the first cache"))
    }
}

fn rms_normalize(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    // Accumulate in f64: the reference computes the mean square in f32 over
    // few values, and f64 keeps us on its rounding for any width.
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let inv = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * inv);
    }
}

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Weight = CpuWeight;
    type Cache = ContiguousKv;
    type Step = ();

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fused_projections: true,
            sample_ahead: false,
            reuse_sequences: false,
            device_routing: false,
            gated_delta_net: true,
            mixture_of_experts: true,
            batched: true,
            multimodal_positions: true,
        }
    }

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn run_pass<R: Send>(&self, pass: impl FnOnce() -> R + Send) -> R {
        rayon::scope(|_| pass())
    }

    fn upload(&self, t: &Tensor) -> Result<CpuWeight> {
        if t.dtype == DType::U32 {
            return Err(Error::tensor(&t.name, "packed u32 words need their `.scales` and `.biases` (MLX affine)"));
        }
        if t.dtype == DType::F8_E4M3 {
            return Err(Error::tensor(&t.name, "FP8 values need their scales (`weight_scale_inv` or `weight_scale`)"));
        }
        match t.shape.len() {
            1 => Ok(CpuWeight::Vector(t.to_f32_vec())),
            2 => Ok(CpuWeight::Matrix(CpuMatrix {
                dtype: t.dtype,
                rows: t.shape[0],
                cols: t.shape[1],
                data: t.data.clone(),
            })),
            _ => Err(Error::tensor(&t.name, format!("expected 1-D or 2-D, found shape {:?}", t.shape))),
        }
    }

    fn upload_affine(&self, t: &AffineTensor) -> Result<CpuWeight> {
        Ok(CpuWeight::Affine(affine::AffineMatrix::from_tensor(t)?))
    }

    fn upload_fp8(&self, t: &Fp8Tensor) -> Result<CpuWeight> {
        Ok(CpuWeight::Fp8(fp8::Fp8Matrix::from_tensor(t)?))
    }

    fn prepare_kv(&self, shape: KvShape, attention: &[bool]) -> Result<()> {
        if self.kv != KvFormat::F32 {
            let mut n = 0;
            let attention_index = (attention.iter())
                .map(|&a| {
                    n += a as usize;
                    if a { Some(n - 1) } else { None }
                })
                .collect();
            let codecs = Arc::new(KvCodecs::new(self.kv, KvShape { num_layers: n, ..shape })?);
            *self.codecs.lock().expect("KV codecs") = Some(PreparedKv { codecs, attention_index });
        }
        Ok(())
    }

    fn new_cache(&self, num_layers: usize, kv_dim: usize, capacity: usize) -> ContiguousKv {
        match self.kv_codecs() {
            Some(p) => {
                assert_eq!(
                    (p.attention_index.len(), p.codecs.shape.kv_dim()),
                    (num_layers, kv_dim),
                    "the prepared KV shape"
                );
                ContiguousKv::coded(p.codecs, &p.attention_index, capacity)
            }
            None => ContiguousKv::new(num_layers, kv_dim, capacity),
        }
    }

    fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CpuAct {
        CpuAct::from_vec(rows, cols, data.to_vec())
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuAct> {
        let (rows, cols) = match table {
            CpuWeight::Matrix(m) => (m.rows, m.cols),
            CpuWeight::Affine(m) => (m.rows, m.cols),
            CpuWeight::Fp8(m) => (m.rows, m.cols),
            CpuWeight::Vector(_) => return Err(Error::Invalid("the embedding table is a vector".into())),
        };
        let mut out = CpuAct::zeros(ids.len(), cols);
        for (row, &id) in out.data.chunks_exact_mut(cols).zip(ids) {
            if id as usize >= rows {
                return Err(Error::Invalid(format!("token id {id} is out of range for a vocabulary of {rows}")));
            }
            match table {
                CpuWeight::Matrix(m) => m.decode_row(id as usize, row),
                CpuWeight::Affine(m) => m.decode_row(id as usize, row),
                CpuWeight::Fp8(m) => m.decode_row(id as usize, row),
                CpuWeight::Vector(_) => unreachable!("rejected above"),
            }
        }
        Ok(out)
    }

    fn linear(&self, x: &CpuAct, w: &CpuWeight, bias: Option<&CpuWeight>) -> CpuAct {
        let out_cols = match w {
            CpuWeight::Matrix(m) => m.rows,
            CpuWeight::Affine(m) => m.rows,
            CpuWeight::Fp8(m) => m.rows,
            CpuWeight::Vector(_) => panic!("linear: expected a matrix weight, found a vector"),
        };
        let mut out = CpuAct::zeros(x.rows, out_cols);
        match w {
            CpuWeight::Matrix(m) => matmul(&x.data, x.rows, m, &mut out.data),
            CpuWeight::Affine(m) => affine::matmul(&x.data, x.rows, m, &mut out.data),
            CpuWeight::Fp8(m) => fp8::matmul(&x.data, x.rows, m, &mut out.data),
            CpuWeight::Vector(_) => unreachable!("rejected above"),
        }
        if let Some(b) = bias {
            let b = b.vector();
            for row in out.data.chunks_exact_mut(out_cols) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
        out
    }

    fn rms_norm(&self, x: &CpuAct, w: &CpuWeight, eps: f32) -> CpuAct {
        let w = w.vector();
        let mut out = CpuAct::zeros(x.rows, x.cols);
        assert_eq!(x.cols % w.len(), 0, "rms_norm: width {} not a multiple of weight {}", x.cols, w.len());
        if x.data.len() < PAR_MIN_VALUES {
            out.data.chunks_mut(w.len()).zip(x.data.chunks(w.len())).for_each(|(o, xi)| rms_normalize(xi, w, eps, o));
        } else {
            out.data
                .par_chunks_mut(w.len())
                .zip(x.data.par_chunks(w.len()))
                .for_each(|(o, xi)| rms_normalize(xi, w, eps, o));
        }
        out
    }

    fn rope(&self, x: &mut CpuAct, head_dim: usize, positions: &[usize], rope: &Rope) {
        assert_eq!(positions.len(), x.rows);
        let cols = x.cols;
        let rotate_row = |(row, &pos): (&mut [f32], &usize)| {
            let half = rope.rotary_dim / 2;
            let mut cos = vec![0f32; half];
            let mut sin = vec![0f32; half];
            rope.cos_sin(pos, &mut cos, &mut sin);
            for head in row.chunks_exact_mut(head_dim) {
                rope.apply(head, &cos, &sin);
            }
        };
        if x.data.len() < PAR_MIN_VALUES {
            x.data.chunks_mut(cols).zip(positions.iter()).for_each(rotate_row);
        } else {
            x.data.par_chunks_mut(cols).zip(positions.par_iter()).for_each(rotate_row);
        }
    }

    fn write_kv(&self, cache: &mut ContiguousKv, layer: usize, k: &CpuAct, v: &CpuAct) {
        cache.write(layer, &k.data, &v.data);
    }

    fn attention(&self, q: &CpuAct, cache: &ContiguousKv, layer: usize, shape: &AttentionShape) -> CpuAct {
        let start = cache.len();
        let mut out = CpuAct::zeros(q.rows, shape.num_heads * shape.head_dim);
        match cache.layer(layer, start + q.rows) {
            LayerRows::F32 { keys, values } => {
                attention::causal_attention(&q.data, q.rows, start, keys, values, shape, &mut out.data)
            }
            LayerRows::Coded(kv) => {
                attention_coded::causal_attention(&q.data, q.rows, start, &kv, shape, &mut out.data)
            }
        }
        out
    }

    fn silu_mul(&self, gate: &CpuAct, up: &CpuAct) -> CpuAct {
        let mut out = CpuAct::zeros(gate.rows, gate.cols);
        let silu_mul = |(o, (g, u)): (&mut [f32], (&[f32], &[f32]))| silu_mul_into(o, g, u);
        if out.data.len() < PAR_MIN_VALUES {
            silu_mul((&mut out.data, (&gate.data, &up.data)));
        } else {
            out.data
                .par_chunks_mut(4096)
                .zip(gate.data.par_chunks(4096).zip(up.data.par_chunks(4096)))
                .for_each(silu_mul);
        }
        out
    }

    fn add_assign(&self, x: &mut CpuAct, y: &CpuAct) {
        assert_eq!(x.data.len(), y.data.len());
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn last_row(&self, x: &CpuAct) -> CpuAct {
        CpuAct::from_vec(1, x.cols, x.data[(x.rows - 1) * x.cols..].to_vec())
    }

    fn rows(&self, x: &CpuAct) -> usize {
        x.rows
    }

    fn cols(&self, x: &CpuAct) -> usize {
        x.cols
    }

    fn to_host(&self, x: &CpuAct) -> Vec<f32> {
        x.data.clone()
    }

    fn gather_columns(&self, x: &CpuAct, group: usize, offset: usize, len: usize) -> CpuAct {
        assert!(
            x.cols.is_multiple_of(group) && offset + len <= group,
            "gather_columns: bad split of {} columns",
            x.cols
        );
        let groups = x.cols / group;
        let mut out = CpuAct::zeros(x.rows, groups * len);
        for (o, row) in out.data.chunks_exact_mut(groups * len).zip(x.data.chunks_exact(x.cols)) {
            for (og, g) in o.chunks_exact_mut(len).zip(row.chunks_exact(group)) {
                og.copy_from_slice(&g[offset..offset + len]);
            }
        }
        out
    }

    fn concat_columns(&self, parts: &[&CpuAct]) -> CpuAct {
        let rows = parts[0].rows;
        let cols = parts.iter().map(|p| p.cols).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for p in parts {
                assert_eq!(p.rows, rows, "concat_columns: row counts differ");
                data.extend_from_slice(&p.data[r * p.cols..(r + 1) * p.cols]);
            }
        }
        CpuAct::from_vec(rows, cols, data)
    }

    fn mul_sigmoid(&self, x: &mut CpuAct, gate: &CpuAct) {
        assert_eq!(x.rows, gate.rows);
        let sigmoid = |g: f32| 1.0 / (1.0 + (-g).exp());
        if gate.cols == x.cols {
            for (v, g) in x.data.iter_mut().zip(&gate.data) {
                *v *= sigmoid(*g);
            }
        } else {
            assert_eq!(gate.cols, 1, "mul_sigmoid: gate must be as wide as x or one column");
            for (row, g) in x.data.chunks_exact_mut(x.cols).zip(&gate.data) {
                let s = sigmoid(*g);
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
    }
}

/// `o = silu(g)·u`, element by element (one expression for every SwiGLU form).
fn silu_mul_into(o: &mut [f32], g: &[f32], u: &[f32]) {
    for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

impl FusedOps for CpuBackend {
    /// silu(gate) ⊙ up read in place from the stacked rows (no copies of the
    /// two halves).
    fn swiglu(&self, gate_up: &CpuAct) -> CpuAct {
        let width = gate_up.cols / 2;
        let mut out = CpuAct::zeros(gate_up.rows, width);
        let row = |(o, gu): (&mut [f32], &[f32])| {
            let (g, u) = gu.split_at(width);
            silu_mul_into(o, g, u);
        };
        if out.data.len() < PAR_MIN_VALUES {
            out.data.chunks_mut(width).zip(gate_up.data.chunks(2 * width)).for_each(row);
        } else {
            out.data.par_chunks_mut(width).zip(gate_up.data.par_chunks(2 * width)).for_each(row);
        }
        out
    }
}

impl GdnOps for CpuBackend {
    type GdnState = CpuGdnState;

    fn rms_norm_gated(&self, x: &CpuAct, z: &CpuAct, w: &CpuWeight, eps: f32) -> CpuAct {
        let mut out = self.rms_norm(x, w, eps);
        assert_eq!(out.data.len(), z.data.len());
        for (o, g) in out.data.iter_mut().zip(&z.data) {
            *o *= g / (1.0 + (-g).exp());
        }
        out
    }

    fn new_gdn_state(&self, cfg: &GdnConfig) -> CpuGdnState {
        CpuGdnState::new(cfg)
    }

    fn clear_gdn_state(&self, state: &mut CpuGdnState) {
        state.conv.fill(0.0);
        state.recurrent.fill(0.0);
    }

    fn gdn_state_to_host(&self, state: &CpuGdnState) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 * (state.conv.len() + state.recurrent.len()));
        for x in state.conv.iter().chain(&state.recurrent) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out
    }

    fn gdn_state_from_host(&self, state: &mut CpuGdnState, bytes: &[u8]) -> Result<()> {
        let n = state.conv.len() + state.recurrent.len();
        if bytes.len() != 4 * n {
            return Err(crate::Error::Invalid(format!(
                "a Gated DeltaNet state of {} bytes for a layer whose state holds {}",
                bytes.len(),
                4 * n
            )));
        }
        let mut values = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        for x in state.conv.iter_mut().chain(state.recurrent.iter_mut()) {
            *x = values.next().expect("counted above");
        }
        Ok(())
    }

    fn gdn_conv(&self, x: &CpuAct, weight: &CpuWeight, state: &mut CpuGdnState) -> CpuAct {
        let m = weight.matrix();
        assert_eq!(m.rows, x.cols, "gdn_conv: {} channels for a weight of {} rows", x.cols, m.rows);
        let mut w = vec![0f32; m.rows * m.cols];
        for (r, row) in w.chunks_exact_mut(m.cols).enumerate() {
            m.decode_row(r, row);
        }
        let out = gdn::causal_conv1d_silu(&x.data, x.cols, &w, &mut state.conv);
        CpuAct::from_vec(x.rows, x.cols, out)
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
        state: &mut CpuGdnState,
    ) -> CpuAct {
        // The reference steps token by token only for single-token decode.
        delta_rule(q, k, v, a, b, a_log, dt_bias, state, v.rows != 1)
    }

    fn gated_delta_rule_prompt(
        &self,
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        a: &CpuAct,
        b: &CpuAct,
        a_log: &CpuWeight,
        dt_bias: &CpuWeight,
        state: &mut CpuGdnState,
    ) -> CpuAct {
        delta_rule(q, k, v, a, b, a_log, dt_bias, state, true)
    }
}

impl MoeOps for CpuBackend {
    fn moe(
        &self,
        x: &CpuAct,
        router_logits: &CpuAct,
        experts: &[ExpertWeights<CpuWeight>],
        routing: Routing,
    ) -> CpuAct {
        let routes = moe::route(&router_logits.data, experts.len(), routing);
        let mut out = CpuAct::zeros(x.rows, x.cols);
        // Experts in index order, each over all of its tokens at once, adding
        // into the output as the reference's `index_add_` does.
        for (e, tokens) in moe::group_by_expert(&routes, experts.len()).iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let mut xs = CpuAct::zeros(tokens.len(), x.cols);
            for (row, &(t, _)) in xs.data.chunks_exact_mut(x.cols).zip(tokens) {
                row.copy_from_slice(&x.data[t * x.cols..(t + 1) * x.cols]);
            }
            let ex = &experts[e];
            let h = self.silu_mul(&self.linear(&xs, &ex.gate, None), &self.linear(&xs, &ex.up, None));
            let y = self.linear(&h, &ex.down, None);
            for (row, &(t, w)) in y.data.chunks_exact(x.cols).zip(tokens) {
                axpy_into(&mut out.data[t * x.cols..(t + 1) * x.cols], row, w);
            }
        }
        out
    }
}

impl SamplingOps for CpuBackend {}

impl crate::backend::vision_ops::VisionOps for CpuBackend {}

/// The gated delta rule in its chunked form (prompts) or its recurrent one
/// (one decode token at a time).
#[allow(clippy::too_many_arguments)]
fn delta_rule(
    q: &CpuAct,
    k: &CpuAct,
    v: &CpuAct,
    a: &CpuAct,
    b: &CpuAct,
    a_log: &CpuWeight,
    dt_bias: &CpuWeight,
    state: &mut CpuGdnState,
    chunked: bool,
) -> CpuAct {
    let cfg = &state.cfg;
    let x = gdn::prepare(cfg, &q.data, &k.data, &a.data, &b.data, a_log.vector(), dt_bias.vector());
    let out = if chunked {
        gdn::chunked(cfg, &x, &v.data, &mut state.recurrent)
    } else {
        gdn::recurrent(cfg, &x, &v.data, &mut state.recurrent)
    };
    CpuAct::from_vec(v.rows, cfg.value_dim(), out)
}

fn axpy_into(dst: &mut [f32], src: &[f32], w: f32) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s * w;
    }
}
