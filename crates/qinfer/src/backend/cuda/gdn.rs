//! Gated DeltaNet (gdn.cu, gdn_chunked.cu): the depthwise conv, g and β,
//! the delta rule over a prompt (chunked on the tensor cores, or a scan) or
//! a decode step (one fused kernel with the conv's output, the rule and the
//! gated norm).

use cudarc::driver::CudaSlice;

use super::kernels::{Resolve, blocks, cfg, kernel_args, resolve_n};
use super::linear::{FloatType, GEMV_MAX_ROWS};
use super::{CudaAct, CudaBackend, CudaGdnState, CudaWeight};
use crate::backend::GdnWeights;
use crate::config::GdnConfig;
use crate::{Error, Result};

/// Device addresses of the gated delta rule's inputs: rows of q and k
/// `qk_stride` floats apart, of v `v_stride`, of a and b `ab_stride` (each
/// may be columns of wider stacked rows). q and k are normalized in place.
struct DeltaRuleInputs {
    q: u64,
    k: u64,
    v: u64,
    a: u64,
    b: u64,
    qk_stride: usize,
    v_stride: usize,
    ab_stride: usize,
}

/// Value columns per block of `gdn_scan128` (`GDN_SCAN_COLS`).
pub(super) const GDN_SCAN_COLS: usize = 16;

/// Tokens per chunk of the chunked delta rule (`GDN_CHUNK`):
/// prompts of at least this many tokens take it (key heads of 128).
pub(super) const GDN_CHUNK: usize = 64;

/// Value columns per block of `gdn_chunk_state` (`GDN_CHUNK_COLS`).
pub(super) const GDN_CHUNK_COLS: usize = 32;

/// Tokens per launch pair of the chunked delta rule. Its per-chunk operands
/// take 160 KB a chunk and value head at dv = 128 (84 MB for 1024 tokens of
/// the 4B hybrid's 32 value heads); longer prompts reuse them slice by slice.
const GDN_CHUNK_SLICE: usize = 1024;

/// Floats a row of the state or V' of `gdn_chunk_state` takes in shared
/// memory past the block's value columns (`GCK_SP_PAD`).
pub(super) const GDN_CHUNK_STATE_PAD: usize = 8;

/// Dynamic shared memory of a `gdn_chunk_state` block, as the kernel carves
/// it: two chunks' A fragments (3 × 32 KB each), the state's and V''s rows.
pub(super) const GDN_CHUNK_STATE_SHARED: usize =
    2 * 3 * 2048 * 16 + (128 + GDN_CHUNK) * (GDN_CHUNK_COLS + GDN_CHUNK_STATE_PAD) * 4;

/// Floats a q or k row of `gdn_chunk_prep` takes in shared memory (`GCK_PITCH`).
pub(super) const GDN_CHUNK_QK_PITCH: usize = 132;

/// Floats a row of A or P of `gdn_chunk_prep` takes in shared memory (`GCK_TRI`).
pub(super) const GDN_CHUNK_TRI_PITCH: usize = 68;

/// Columns a U | W row of `gdn_chunk_prep` is rounded up to (`GCK_X_ALIGN`).
pub(super) const GDN_CHUNK_X_ALIGN: usize = 32;

/// Floats a U | W row of `gdn_chunk_prep` takes past that rounding (`GCK_X_PAD`).
pub(super) const GDN_CHUNK_X_PAD: usize = 8;

/// Floats a U | W row of `gdn_chunk_prep` takes (the kernel's `gck_x_pitch`):
/// value and key columns, rounded up, then padded.
fn gdn_chunk_x_pitch(dv: usize) -> usize {
    (dv + 128).div_ceil(GDN_CHUNK_X_ALIGN) * GDN_CHUNK_X_ALIGN + GDN_CHUNK_X_PAD
}

/// Dynamic shared memory of a `gdn_chunk_prep` block, as the kernel carves
/// it: q and k rows, U | W rows (`gck_x_pitch`), A and P rows, four scalars
/// a token.
fn gdn_chunk_prep_shared(dv: usize) -> usize {
    let floats = 2 * GDN_CHUNK * GDN_CHUNK_QK_PITCH
        + GDN_CHUNK * gdn_chunk_x_pitch(dv)
        + 2 * GDN_CHUNK * GDN_CHUNK_TRI_PITCH
        + 4 * GDN_CHUNK;
    floats * 4
}

/// Rows per thread of `gdn_conv_rows` (`GDN_CONV_RUN`).
pub(super) const GDN_CONV_RUN: usize = 16;

/// Rows up to which the GDN conv walks the rows in one launch (decode); longer
/// inputs take every row at once and a second launch for the window.
const GDN_CONV_WALKED_ROWS: usize = 8;

/// The kernels of gdn.cu and gdn_chunked.cu.
pub(super) struct GdnKernels<K> {
    /// `gdn_conv_{type}`, `gdn_conv_rows_{type}` by [`FloatType`].
    conv: [K; 3],
    conv_rows: [K; 3],
    conv_window: K,
    prepare: K,
    recurrent: K,
    scan128: K,
    decode128: K,
    /// `gdn_conv_seqs_{type}` by [`FloatType`], `gdn_decode128_seqs`: many
    /// sequences' decode rows in one launch each.
    conv_seqs: [K; 3],
    decode128_seqs: K,
    pub(super) chunk_prep: K,
    pub(super) chunk_state: K,
}

impl<K> GdnKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "gdn.cu";
        Ok(GdnKernels {
            conv: resolve_n(get, U, |i| format!("gdn_conv_{}", FloatType::ALL[i].name()))?,
            conv_rows: resolve_n(get, U, |i| format!("gdn_conv_rows_{}", FloatType::ALL[i].name()))?,
            conv_window: get(U, "gdn_conv_window".into())?,
            prepare: get(U, "gdn_prepare".into())?,
            recurrent: get(U, "gdn_recurrent".into())?,
            scan128: get(U, "gdn_scan128".into())?,
            decode128: get(U, "gdn_decode128".into())?,
            conv_seqs: resolve_n(get, U, |i| format!("gdn_conv_seqs_{}", FloatType::ALL[i].name()))?,
            decode128_seqs: get(U, "gdn_decode128_seqs".into())?,
            chunk_prep: get("gdn_chunked.cu", "gdn_chunk_prep".into())?,
            chunk_state: get("gdn_chunked.cu", "gdn_chunk_state".into())?,
        })
    }
}

kernel_args! {
    /// `gdn_conv_{type}`, `gdn_conv_rows_{type}`.
    ConvArgs { x: u64, w: u64, window: u64, out: u64, rows: i32, channels: i32, kernel: i32, stride: i32 }
}
kernel_args! {
    /// `gdn_conv_window`.
    ConvWindowArgs { x: u64, window: u64, rows: i32, channels: i32, kernel: i32, stride: i32 }
}
kernel_args! {
    /// `gdn_prepare`.
    PrepareArgs {
        q: u64, k: u64, a: u64, b: u64, a_log: u64, dt_bias: u64, g: u64, beta: u64, nk: i32, nv: i32, dk: i32,
        qk_stride: i32, ab_stride: i32,
    }
}
kernel_args! {
    /// `gdn_recurrent`, `gdn_scan128`.
    RecurrentArgs {
        q: u64, k: u64, v: u64, g: u64, beta: u64, state: u64, out: u64, rows: i32, nk: i32, nv: i32, dk: i32,
        dv: i32, tiled: i32, qk_stride: i32, v_stride: i32,
    }
}
kernel_args! {
    /// `gdn_chunk_prep`.
    ChunkPrepArgs {
        q: u64, k: u64, v: u64, g: u64, beta: u64, wf: u64, qf: u64, kf: u64, u: u64, o0: u64, last: u64, rows: i32,
        nk: i32, nv: i32, dv: i32, tiled: i32, qk_stride: i32, v_stride: i32,
    }
}
kernel_args! {
    /// `gdn_chunk_state`.
    ChunkStateArgs {
        wf: u64, qf: u64, kf: u64, u: u64, o0: u64, last: u64, state: u64, out: u64, rows: i32, nv: i32, dv: i32,
    }
}
kernel_args! {
    /// `gdn_decode128`.
    Decode128Args {
        conv: u64, mixed: u64, stride: i32, z_at: i32, b_at: i32, a_at: i32, a_log: u64, dt_bias: u64, norm_w: u64,
        state: u64, out: u64, rows: i32, nk: i32, nv: i32, dv: i32, tiled: i32, eps: f32,
    }
}

kernel_args! {
    /// `gdn_conv_seqs_{type}`.
    ConvSeqsArgs { x: u64, w: u64, windows: u64, out: u64, channels: i32, kernel: i32, stride: i32 }
}
kernel_args! {
    /// `gdn_decode128_seqs`.
    Decode128SeqsArgs {
        conv: u64, mixed: u64, stride: i32, z_at: i32, b_at: i32, a_at: i32, a_log: u64, dt_bias: u64, norm_w: u64,
        states: u64, out: u64, nk: i32, nv: i32, dv: i32, tiled: i32, eps: f32,
    }
}

impl CudaBackend {
    /// [`crate::backend::ops::GdnOps::new_gdn_state`].
    pub(super) fn new_gdn_state_op(&self, cfg: &GdnConfig) -> CudaGdnState {
        CudaGdnState {
            cfg: cfg.clone(),
            conv: self.zeros((cfg.conv_kernel - 1) * cfg.conv_dim()),
            recurrent: self.zeros(cfg.num_v_heads * cfg.k_head_dim * cfg.v_head_dim),
        }
    }

    /// [`crate::backend::ops::GdnOps::clear_gdn_state`].
    pub(super) fn clear_gdn_state_op(&self, state: &mut CudaGdnState) {
        let conv = self.stream.memset_zeros(&mut state.conv);
        self.record(conv, "clearing a Gated DeltaNet state");
        let recurrent = self.stream.memset_zeros(&mut state.recurrent);
        self.record(recurrent, "clearing a Gated DeltaNet state");
    }

    /// [`crate::backend::ops::GdnOps::gdn_state_to_host`]: the conv window
    /// then the recurrent state, f32 little-endian (as the CPU's); empty,
    /// the error recorded, when the copy fails.
    pub(super) fn gdn_state_to_host_op(&self, state: &CudaGdnState) -> Vec<u8> {
        let read = |buf: &CudaSlice<f32>| self.stream.clone_dtoh(buf);
        match read(&state.conv).and_then(|c| read(&state.recurrent).map(|r| (c, r))) {
            Ok((conv, recurrent)) => conv.iter().chain(&recurrent).flat_map(|x| x.to_le_bytes()).collect(),
            Err(e) => {
                self.record(Err(e), "copying a Gated DeltaNet state to the host");
                Vec::new()
            }
        }
    }

    /// [`crate::backend::ops::GdnOps::gdn_state_from_host`].
    pub(super) fn gdn_state_from_host_op(&self, state: &mut CudaGdnState, bytes: &[u8]) -> Result<()> {
        let (nc, nr) = (state.conv.len(), state.recurrent.len());
        if bytes.len() != 4 * (nc + nr) {
            return Err(Error::Invalid(format!(
                "a Gated DeltaNet state of {} bytes for a layer whose state holds {}",
                bytes.len(),
                4 * (nc + nr)
            )));
        }
        let values: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let copy = |e: cudarc::driver::DriverError| {
            Error::Invalid(format!("cuda:{}: restoring a Gated DeltaNet state: {e}", self.ordinal))
        };
        self.stream.memcpy_htod(&values[..nc], &mut state.conv).map_err(copy)?;
        self.stream.memcpy_htod(&values[nc..], &mut state.recurrent).map_err(copy)?;
        Ok(())
    }

    /// [`crate::backend::ops::GdnOps::gated_delta_rule`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_delta_rule_op(
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
        let c = state.cfg.clone();
        let t = v.rows;
        let out = self.act(t, c.value_dim());
        if c.v_head_dim > 1024 {
            self.record(Err("linear_value_head_dim above 1024"), "gated_delta_rule");
            return out;
        }
        let (CudaWeight::Vector(al), CudaWeight::Vector(dt)) = (a_log, dt_bias) else {
            self.record(Err("A_log and dt_bias must be vectors"), "gated_delta_rule");
            return out;
        };
        // Normalized copies of q and k (the rule normalizes them in place).
        let (qn, kn) = (self.copy(q), self.copy(k));
        let (kd, vd, nv) = (c.key_dim(), c.value_dim(), c.num_v_heads);
        let inputs = DeltaRuleInputs {
            q: self.p(&qn.buf),
            k: self.p(&kn.buf),
            v: self.p(&v.buf),
            a: self.p(&a.buf),
            b: self.p(&b.buf),
            qk_stride: kd,
            v_stride: vd,
            ab_stride: nv,
        };
        self.delta_rule(&inputs, t, al, dt, state, &out);
        out
    }

    /// [`crate::backend::ops::GdnOps::gdn_mix`].
    pub(super) fn gdn_mix_op(
        &self,
        mixed: &CudaAct,
        weights: &GdnWeights<'_, CudaWeight>,
        eps: f32,
        state: &mut CudaGdnState,
    ) -> Option<CudaAct> {
        let c = state.cfg.clone();
        let (t, cd, vd, nv) = (mixed.rows, c.conv_dim(), c.value_dim(), c.num_v_heads);
        // Key heads of 128: decode-sized steps with value heads of at most
        // 128 (one block of 8 warps per value head) in one fused kernel;
        // prompts through the conv, the rule and the gated norm, each reading
        // its columns of the stacked rows in place. Other shapes compose the
        // separate kernels.
        let prompt = t > GEMV_MAX_ROWS;
        if c.k_head_dim != 128 || (!prompt && c.v_head_dim > 128) {
            return None;
        }
        let (CudaWeight::Vector(al), CudaWeight::Vector(dt), CudaWeight::Vector(nw)) =
            (weights.a_log, weights.dt_bias, weights.norm)
        else {
            return None;
        };
        let out = self.act(t, vd);
        if mixed.cols != cd + vd + 2 * nv {
            self.record(Err(format!("{} columns, expected {}", mixed.cols, cd + vd + 2 * nv)), "gdn_mix");
            return Some(out);
        }
        let conv = self.act(t, cd);
        self.conv_columns(mixed, weights.conv, state, &conv);
        if prompt {
            let (at, kd, f32s) = (self.p(&mixed.buf), c.key_dim(), std::mem::size_of::<f32>() as u64);
            let conv_at = self.p(&conv.buf);
            let inputs = DeltaRuleInputs {
                q: conv_at,
                k: conv_at + (kd as u64) * f32s,
                v: conv_at + (2 * kd) as u64 * f32s,
                a: at + (cd + vd + nv) as u64 * f32s,
                b: at + (cd + vd) as u64 * f32s,
                qk_stride: cd,
                v_stride: cd,
                ab_stride: mixed.cols,
            };
            self.delta_rule(&inputs, t, al, dt, state, &out);
            let z = self.gather_columns_op(mixed, mixed.cols, cd, vd);
            return Some(self.norm(&out, None, weights.norm, Some(&z), eps));
        }
        let args = Decode128Args {
            conv: self.p(&conv.buf),
            mixed: self.p(&mixed.buf),
            stride: mixed.cols as i32,
            z_at: cd as i32,
            b_at: (cd + vd) as i32,
            a_at: (cd + vd + nv) as i32,
            a_log: self.p(al),
            dt_bias: self.p(dt),
            norm_w: self.p(nw),
            state: self.p(&state.recurrent),
            out: self.p(&out.buf),
            rows: t as i32,
            nk: c.num_k_heads as i32,
            nv: nv as i32,
            dv: c.v_head_dim as i32,
            tiled: c.v_heads_tiled as i32,
            eps,
        };
        let threads = 32 * c.v_head_dim.div_ceil(16) as u32;
        self.launch(&self.k.gdn.decode128, cfg((nv as u32, 1, 1), threads, 0), &args);
        Some(out)
    }

    /// [`crate::backend::ops::GdnOps::gdn_mix_rows`]: [`Self::gdn_mix_op`]'s
    /// decode step for every row at once, row r with `states[r]`, in two
    /// launches (the conv, then the rule with the gated norm), each block
    /// finding its sequence's state through a table of device pointers.
    pub(super) fn gdn_mix_rows_op(
        &self,
        mixed: &CudaAct,
        weights: &GdnWeights<'_, CudaWeight>,
        eps: f32,
        states: &mut [&mut CudaGdnState],
    ) -> Option<CudaAct> {
        let c = states.first()?.cfg.clone();
        let (t, cd, vd, nv) = (mixed.rows, c.conv_dim(), c.value_dim(), c.num_v_heads);
        if c.k_head_dim != 128 || c.v_head_dim > 128 || c.conv_kernel > 9 || states.iter().any(|s| s.cfg != c) {
            return None;
        }
        let (CudaWeight::Vector(al), CudaWeight::Vector(dt), CudaWeight::Vector(nw)) =
            (weights.a_log, weights.dt_bias, weights.norm)
        else {
            return None;
        };
        let (ty, w) = self.conv_weight(weights.conv)?;
        let out = self.act(t, vd);
        if mixed.cols != cd + vd + 2 * nv || states.len() != t {
            let e =
                format!("{t}×{} rows for {} states, expected {} columns", mixed.cols, states.len(), cd + vd + 2 * nv);
            self.record(Err(e), "gdn_mix_rows");
            return Some(out);
        }
        // Each row's conv window, then each row's recurrent state.
        let mut table: Vec<u64> = states.iter().map(|s| self.p(&s.conv)).collect();
        table.extend(states.iter().map(|s| self.p(&s.recurrent)));
        let table = self.upload_slice(&table);
        let (windows, recurrent) = (self.p(&table), self.p(&table) + 8 * t as u64);
        let conv = self.act(t, cd);
        let args = ConvSeqsArgs {
            x: self.p(&mixed.buf),
            w,
            windows,
            out: self.p(&conv.buf),
            channels: cd as i32,
            kernel: c.conv_kernel as i32,
            stride: mixed.cols as i32,
        };
        let grid = (cd.div_ceil(128) as u32, t as u32, 1);
        self.launch(&self.k.gdn.conv_seqs[ty.index()], cfg(grid, 128, 0), &args);
        let args = Decode128SeqsArgs {
            conv: self.p(&conv.buf),
            mixed: self.p(&mixed.buf),
            stride: mixed.cols as i32,
            z_at: cd as i32,
            b_at: (cd + vd) as i32,
            a_at: (cd + vd + nv) as i32,
            a_log: self.p(al),
            dt_bias: self.p(dt),
            norm_w: self.p(nw),
            states: recurrent,
            out: self.p(&out.buf),
            nk: c.num_k_heads as i32,
            nv: nv as i32,
            dv: c.v_head_dim as i32,
            tiled: c.v_heads_tiled as i32,
            eps,
        };
        let threads = 32 * c.v_head_dim.div_ceil(16) as u32;
        self.launch(&self.k.gdn.decode128_seqs, cfg((nv as u32, t as u32, 1), threads, 0), &args);
        // Dropping `table` frees it in stream order, after the launches.
        drop(table);
        Some(out)
    }

    /// A conv weight's float type and device address (None for storage the
    /// conv kernels do not read).
    fn conv_weight(&self, weight: &CudaWeight) -> Option<(FloatType, u64)> {
        match weight {
            CudaWeight::Matrix { dtype, buf, .. } => Some((FloatType::of(*dtype), self.p(buf))),
            CudaWeight::Vector(v) => Some((FloatType::F32, self.p(v))),
            CudaWeight::Affine(_) | CudaWeight::Fp8(_) => None,
        }
    }

    /// The depthwise conv + SiLU over the first `out.cols` columns of `x`
    /// (all of them, or the conv channels of a stacked projection) into `out`.
    pub(super) fn conv_columns(&self, x: &CudaAct, weight: &CudaWeight, state: &mut CudaGdnState, out: &CudaAct) {
        let kernel = state.cfg.conv_kernel;
        if kernel > 9 {
            self.record(Err(format!("conv kernel {kernel} > 9 is not supported on CUDA")), "gdn_conv");
            return;
        }
        let Some((ty, w)) = self.conv_weight(weight) else {
            self.record(Err("conv weights must be bf16, f16 or f32"), "gdn_conv");
            return;
        };
        let (rows, channels, stride) = (x.rows as i32, out.cols as i32, x.cols as i32);
        // Decode: one launch walks the rows. A prompt: every run of rows at
        // once, then the window advanced.
        let walked = x.rows <= GDN_CONV_WALKED_ROWS;
        let (kernels, grid) = match walked {
            true => (&self.k.gdn.conv, blocks(out.cols, 128)),
            false => (&self.k.gdn.conv_rows, (out.cols.div_ceil(128) as u32, x.rows.div_ceil(GDN_CONV_RUN) as u32, 1)),
        };
        let (xp, window) = (self.p(&x.buf), self.p(&state.conv));
        let args = ConvArgs { x: xp, w, window, out: self.p(&out.buf), rows, channels, kernel: kernel as i32, stride };
        self.launch(&kernels[ty.index()], cfg(grid, 128, 0), &args);
        if walked {
            return;
        }
        let args = ConvWindowArgs { x: xp, window, rows, channels, kernel: kernel as i32, stride };
        self.launch(&self.k.gdn.conv_window, cfg(blocks(out.cols, 128), 128, 0), &args);
    }

    /// The gated delta rule over `rows` tokens into `out` ([rows, value
    /// dim]): g and β from a and b, q and k L2-normalized in place, then the
    /// recurrence, advancing the state.
    fn delta_rule(
        &self,
        x: &DeltaRuleInputs,
        rows: usize,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        state: &mut CudaGdnState,
        out: &CudaAct,
    ) {
        let c = &state.cfg;
        let g = self.act(rows, c.num_v_heads);
        let beta = self.act(rows, c.num_v_heads);
        let args = PrepareArgs {
            q: x.q,
            k: x.k,
            a: x.a,
            b: x.b,
            a_log: self.p(a_log),
            dt_bias: self.p(dt_bias),
            g: self.p(&g.buf),
            beta: self.p(&beta.buf),
            nk: c.num_k_heads as i32,
            nv: c.num_v_heads as i32,
            dk: c.k_head_dim as i32,
            qk_stride: x.qk_stride as i32,
            ab_stride: x.ab_stride as i32,
        };
        self.launch(&self.k.gdn.prepare, cfg((rows as u32, 1, 1), 128, 0), &args);
        // The chunked form and gdn_scan128 copy q and k rows in 16-byte
        // pieces: rows must start 16-byte aligned (a stacked projection's
        // rows are, unless its width is not a multiple of 4).
        let aligned = x.qk_stride.is_multiple_of(4) && x.q.is_multiple_of(16) && x.k.is_multiple_of(16);
        let chunked = aligned
            && c.k_head_dim == 128
            && rows >= GDN_CHUNK
            && gdn_chunk_prep_shared(c.v_head_dim).max(GDN_CHUNK_STATE_SHARED) <= self.max_block_shared;
        if chunked {
            return self.delta_rule_chunked(x, rows, &g, &beta, state, out);
        }
        // Key heads of 128: the state held in registers (16 value columns per
        // block), the inputs staged ahead; other sizes: one thread per value
        // column, state in memory.
        let (kernel, grid, threads) = if c.k_head_dim == 128 && aligned {
            (&self.k.gdn.scan128, (c.num_v_heads as u32, c.v_head_dim.div_ceil(GDN_SCAN_COLS) as u32, 1), 128)
        } else {
            (&self.k.gdn.recurrent, (c.num_v_heads as u32, 1, 1), c.v_head_dim.div_ceil(32) as u32 * 32)
        };
        let args = RecurrentArgs {
            q: x.q,
            k: x.k,
            v: x.v,
            g: self.p(&g.buf),
            beta: self.p(&beta.buf),
            state: self.p(&state.recurrent),
            out: self.p(&out.buf),
            rows: rows as i32,
            nk: c.num_k_heads as i32,
            nv: c.num_v_heads as i32,
            dk: c.k_head_dim as i32,
            dv: c.v_head_dim as i32,
            tiled: c.v_heads_tiled as i32,
            qk_stride: x.qk_stride as i32,
            v_stride: x.v_stride as i32,
        };
        self.launch(kernel, cfg(grid, threads, 0), &args);
    }

    /// The recurrence of `delta_rule` in chunks of 64 tokens (gdn_chunked.cu):
    /// per slice of up to `GDN_CHUNK_SLICE` tokens, the chunks' operands in
    /// parallel, then the state through them in order.
    fn delta_rule_chunked(
        &self,
        x: &DeltaRuleInputs,
        rows: usize,
        g: &CudaAct,
        beta: &CudaAct,
        state: &mut CudaGdnState,
        out: &CudaAct,
    ) {
        let c = &state.cfg;
        let (nv, dv) = (c.num_v_heads, c.v_head_dim);
        let slots = rows.min(GDN_CHUNK_SLICE).div_ceil(GDN_CHUNK) * nv;
        // A-fragment operands: 64×128 f32 each per chunk and head.
        let (wf, qf, kf) = (self.act(slots, 8192), self.act(slots, 8192), self.act(slots, 8192));
        let (u, o0, last) = (self.act(slots, GDN_CHUNK * dv), self.act(slots, GDN_CHUNK * dv), self.act(slots, 1));
        let (wf, qf, kf, u, o0, last) =
            (self.p(&wf.buf), self.p(&qf.buf), self.p(&kf.buf), self.p(&u.buf), self.p(&o0.buf), self.p(&last.buf));
        for t0 in (0..rows).step_by(GDN_CHUNK_SLICE) {
            let n = (rows - t0).min(GDN_CHUNK_SLICE);
            let at = |base: u64, stride: usize| base + (t0 * stride * 4) as u64;
            let args = ChunkPrepArgs {
                q: at(x.q, x.qk_stride),
                k: at(x.k, x.qk_stride),
                v: at(x.v, x.v_stride),
                g: at(self.p(&g.buf), nv),
                beta: at(self.p(&beta.buf), nv),
                wf,
                qf,
                kf,
                u,
                o0,
                last,
                rows: n as i32,
                nk: c.num_k_heads as i32,
                nv: nv as i32,
                dv: dv as i32,
                tiled: c.v_heads_tiled as i32,
                qk_stride: x.qk_stride as i32,
                v_stride: x.v_stride as i32,
            };
            let grid = (n.div_ceil(GDN_CHUNK) as u32, nv as u32, 1);
            self.launch(&self.k.gdn.chunk_prep, cfg(grid, 256, gdn_chunk_prep_shared(dv) as u32), &args);
            let args = ChunkStateArgs {
                wf,
                qf,
                kf,
                u,
                o0,
                last,
                state: self.p(&state.recurrent),
                out: at(self.p(&out.buf), nv * dv),
                rows: n as i32,
                nv: nv as i32,
                dv: dv as i32,
            };
            let grid = (nv as u32, dv.div_ceil(GDN_CHUNK_COLS) as u32, 1);
            self.launch(&self.k.gdn.chunk_state, cfg(grid, 512, GDN_CHUNK_STATE_SHARED as u32), &args);
        }
    }
}
