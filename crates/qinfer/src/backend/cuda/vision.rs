//! A vision tower's ops on the device (vision.cu): LayerNorm with a bias,
//! GELU, and the bidirectional attention over one image's patches, run by
//! flash.cu's tensor-core kernel without its causal mask (`flash_bidir`)
//! after a kernel that rotates queries and keys and pads each head to a
//! head dim that kernel has.

use super::attention_plan::flash_bidir_tile;
use super::kernels::{Resolve, cfg, elementwise_cfg, kernel_args, resolve_n};
use super::{CudaAct, CudaBackend, CudaWeight};
use crate::Result;
use crate::backend::Backend;
use crate::backend::vision_ops::{Gelu, LayerNormParams, VisionHeads, VisionOps, host_vision_attention};

/// Head dims `flash_bidir` has; a head is padded with zeros to the first
/// that holds it (72, of the larger Qwen3.5 towers, to 80).
pub(super) const BIDIR_HEAD_DIMS: [usize; 3] = [64, 80, 128];

/// The kernels of vision.cu, and flash.cu's `flash_bidir{head_dim}`.
pub(super) struct VisionKernels<K> {
    layer_norm: K,
    gelu: [K; 2],
    qkv: K,
    pub(super) flash_bidir: [K; 3],
}

impl<K> VisionKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "vision.cu";
        Ok(VisionKernels {
            layer_norm: get(U, "layer_norm".into())?,
            gelu: [get(U, "gelu_tanh".into())?, get(U, "gelu_erf".into())?],
            qkv: get(U, "vision_qkv".into())?,
            flash_bidir: resolve_n(get, "flash.cu", |i| format!("flash_bidir{}", BIDIR_HEAD_DIMS[i]))?,
        })
    }
}

kernel_args! {
    /// `layer_norm`.
    LayerNormArgs { x: u64, w: u64, b: u64, out: u64, cols: i32, eps: f32 }
}
kernel_args! {
    /// `gelu_tanh`, `gelu_erf`.
    GeluArgs { x: u64, n: i64 }
}
kernel_args! {
    /// `vision_qkv`.
    VisionQkvArgs { qkv: u64, rotary: u64, q: u64, k: u64, v: u64, heads: i32, hd: i32, hdp: i32 }
}
kernel_args! {
    /// `flash_bidir{head_dim}`.
    FlashBidirArgs { q: u64, k: u64, v: u64, out: u64, rows: i32, heads: i32, scale: f32 }
}

impl CudaBackend {
    /// The `flash_bidir` slot that holds heads of `head_dim`, where its
    /// tiles fit a block here.
    fn bidir_slot(&self, head_dim: usize) -> Option<usize> {
        BIDIR_HEAD_DIMS.iter().position(|&h| h >= head_dim).filter(|&i| self.flash_bidir[i])
    }
}

impl VisionOps for CudaBackend {
    fn layer_norm(&self, x: &CudaAct, p: &LayerNormParams<CudaWeight>, eps: f32) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        let (CudaWeight::Vector(w), CudaWeight::Vector(b)) = &p.placed else {
            self.record(Err("LayerNorm weight and bias must be vectors"), "layer_norm");
            return out;
        };
        if w.len() != x.cols || b.len() != x.cols {
            self.record(Err("LayerNorm width differs from the activation's"), "layer_norm");
            return out;
        }
        let args = LayerNormArgs {
            x: self.p(&x.buf),
            w: self.p(w),
            b: self.p(b),
            out: self.p(&out.buf),
            cols: x.cols as i32,
            eps,
        };
        self.launch(&self.k.vision.layer_norm, cfg((x.rows as u32, 1, 1), 256, 0), &args);
        out
    }

    fn gelu(&self, x: &mut CudaAct, kind: Gelu) {
        x.quantized = None;
        let n = x.rows * x.cols;
        let kernel = &self.k.vision.gelu[match kind {
            Gelu::Tanh => 0,
            Gelu::Erf => 1,
        }];
        self.launch(kernel, elementwise_cfg(n), &GeluArgs { x: self.p(&x.buf), n: n as i64 });
    }

    fn regroup(&self, mut x: CudaAct, cols: usize) -> CudaAct {
        let n = x.rows * x.cols;
        if cols == 0 || !n.is_multiple_of(cols) {
            self.record(Err("regrouped width does not divide the activation"), "regroup");
            return x;
        }
        x.quantized = None;
        (x.rows, x.cols) = (n / cols, cols);
        x
    }

    fn vision_attention(&self, qkv: &CudaAct, rotary: &CudaAct, shape: VisionHeads) -> CudaAct {
        let VisionHeads { heads, head_dim: hd } = shape;
        let slot = self.bidir_slot(hd).filter(|_| !self.split_activations && hd % 2 == 0);
        let Some(slot) = slot else {
            // The parity configuration (f32 throughout) and head dims without
            // a kernel: the host's exact attention.
            let y = host_vision_attention(&self.to_host(qkv), &self.to_host(rotary), shape);
            return self.act_from_host(qkv.rows, heads * hd, &y);
        };
        let (n, hdp) = (qkv.rows, BIDIR_HEAD_DIMS[slot]);
        if qkv.cols != 3 * heads * hd || rotary.rows != n || rotary.cols != hd {
            self.record(Err("q|k|v or rotary table do not match the heads"), "vision_attention");
            return self.act(n, heads * hd);
        }
        let wide = heads * hdp;
        // Keys and values in f16: half as many f32 slots.
        let (q, k, v) = (self.act(n, wide), self.act(n, wide / 2), self.act(n, wide / 2));
        let args = VisionQkvArgs {
            qkv: self.p(&qkv.buf),
            rotary: self.p(&rotary.buf),
            q: self.p(&q.buf),
            k: self.p(&k.buf),
            v: self.p(&v.buf),
            heads: heads as i32,
            hd: hd as i32,
            hdp: hdp as i32,
        };
        self.launch(&self.k.vision.qkv, cfg((n as u32, 1, 1), 256, 0), &args);
        let out = self.act(n, wide);
        let tile = flash_bidir_tile(hdp);
        let args = FlashBidirArgs {
            q: self.p(&q.buf),
            k: self.p(&k.buf),
            v: self.p(&v.buf),
            out: self.p(&out.buf),
            rows: n as i32,
            heads: heads as i32,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let grid = (heads as u32, n.div_ceil(tile.rows) as u32, 1);
        self.launch(&self.k.vision.flash_bidir[slot], cfg(grid, tile.threads as u32, tile.shared as u32), &args);
        if hdp == hd { out } else { self.gather_columns(&out, hdp, 0, hd) }
    }
}
