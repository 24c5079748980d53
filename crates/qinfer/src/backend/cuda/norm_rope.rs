//! RMSNorm (plain, after the residual add, gated by silu(z)) and RoPE
//! (norm_rope.cu), with the rotation's frequencies uploaded once per table.

use super::kernels::{Resolve, cfg, elementwise_cfg, kernel_args};
use super::{CudaAct, CudaBackend, CudaWeight};
use crate::Result;
use crate::config::RopeStyle;
use crate::config::rope::Rope;

/// The kernels of norm_rope.cu.
pub(super) struct NormRopeKernels<K> {
    rms_norm: K,
    rope: K,
}

impl<K> NormRopeKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "norm_rope.cu";
        Ok(NormRopeKernels { rms_norm: get(U, "rms_norm".into())?, rope: get(U, "rope".into())? })
    }
}

kernel_args! {
    /// `rms_norm`.
    RmsNormArgs { x: u64, y: u64, w: u64, z: u64, out: u64, group: i32, eps: f32 }
}
kernel_args! {
    /// `rope`.
    RopeArgs { x: u64, step: u64, inv_freq: u64, rows: i32, cols: i32, head_dim: i32, rotary_dim: i32, style: i32 }
}

/// The kernels' code for the rotation's pairs: 0 rotate_half, 1 adjacent.
pub(super) fn rope_style(rope: &Rope) -> i32 {
    match rope.style {
        RopeStyle::Neox => 0,
        RopeStyle::Interleaved => 1,
    }
}

impl CudaBackend {
    /// The RoPE inverse frequencies on the device, uploaded on first use.
    pub(super) fn rope_table(&self, rope: &Rope) -> Option<u64> {
        let key: Vec<u32> = rope.inv_freq.iter().map(|f| f.to_bits()).collect();
        let Ok(mut tables) = self.rope_tables.lock() else {
            self.record(Err("rope table lock poisoned"), "rope");
            return None;
        };
        if !tables.contains_key(&key) {
            tables.insert(key.clone(), self.upload_slice(&rope.inv_freq));
        }
        Some(self.p(&tables[&key]))
    }

    /// RMSNorm of `x` (after `x += y` when given, written back), gated by
    /// silu(`z`) when given.
    pub(super) fn norm(
        &self,
        x: &CudaAct,
        y: Option<&CudaAct>,
        w: &CudaWeight,
        z: Option<&CudaAct>,
        eps: f32,
    ) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        let CudaWeight::Vector(wv) = w else {
            self.record(Err("norm weight must be a vector"), "rms_norm");
            return out;
        };
        let group = wv.len();
        let groups = x.rows * x.cols / group;
        // About two float4 per thread, whole warps, at most 1024.
        let threads = (group.div_ceil(8).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let args = RmsNormArgs {
            x: self.p(&x.buf),
            y: y.map(|y| self.p(&y.buf)).unwrap_or(0),
            w: self.p(wv),
            z: z.map(|z| self.p(&z.buf)).unwrap_or(0),
            out: self.p(&out.buf),
            group: group as i32,
            eps,
        };
        self.launch(&self.k.norm_rope.rms_norm, cfg((groups as u32, 1, 1), threads, 0), &args);
        out
    }

    /// [`crate::backend::Backend::rope`].
    pub(super) fn rope_op(&self, x: &mut CudaAct, head_dim: usize, positions: &[usize], rope: &Rope) {
        x.quantized = None;
        // Positions are consecutive in every forward: pass the first, not a table.
        let start = positions.first().copied().unwrap_or(0);
        if positions.iter().enumerate().any(|(i, &p)| p != start + i) {
            self.record(Err("positions must be consecutive"), "rope");
            return;
        }
        let Some(inv_freq) = self.rope_table(rope) else { return };
        self.ensure_step(start, None);
        let pairs = x.rows * (x.cols / head_dim) * (rope.rotary_dim / 2);
        let args = RopeArgs {
            x: self.p(&x.buf),
            step: self.p(&self.step),
            inv_freq,
            rows: x.rows as i32,
            cols: x.cols as i32,
            head_dim: head_dim as i32,
            rotary_dim: rope.rotary_dim as i32,
            style: rope_style(rope),
        };
        self.launch(&self.k.norm_rope.rope, elementwise_cfg(pairs), &args);
    }
}
