//! The ops of a vision tower beyond the language model's: LayerNorm with a
//! bias, GELU, and bidirectional attention over one image's patches with a
//! 2-D rotary embedding. Every op has a host default (f32, the reference
//! the device kernels are tested against) that moves the activation to the
//! host and back; a device backend overrides them.

use rayon::prelude::*;

use super::Backend;

/// A LayerNorm's weight and bias: on the host for the default ops, and
/// placed on the backend for a device's kernels.
pub struct LayerNormParams<W> {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub placed: (W, W),
}

/// Which GELU: the tanh approximation (`gelu_pytorch_tanh`) or the exact
/// one (`nn.GELU()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    Tanh,
    Erf,
}

/// The heads of a vision attention: `qkv` rows hold `[q | k | v]`, each
/// `heads · head_dim` wide.
#[derive(Debug, Clone, Copy)]
pub struct VisionHeads {
    pub heads: usize,
    pub head_dim: usize,
}

pub trait VisionOps: Backend {
    /// LayerNorm of each row (biased variance, as torch).
    fn layer_norm(&self, x: &Self::Act, p: &LayerNormParams<Self::Weight>, eps: f32) -> Self::Act {
        let cols = self.cols(x);
        let y = host_layer_norm(&self.to_host(x), &p.weight, &p.bias, eps);
        self.act_from_host(y.len() / cols, cols, &y)
    }

    /// GELU of every value, in place.
    fn gelu(&self, x: &mut Self::Act, kind: Gelu) {
        let (rows, cols) = (self.rows(x), self.cols(x));
        let mut v = self.to_host(x);
        host_gelu(&mut v, kind);
        *x = self.act_from_host(rows, cols, &v);
    }

    /// The same values as rows of `cols` (row-major order kept).
    fn regroup(&self, x: Self::Act, cols: usize) -> Self::Act {
        let v = self.to_host(&x);
        self.act_from_host(v.len() / cols, cols, &v)
    }

    /// Bidirectional attention of every head of `qkv` over all its rows,
    /// queries and keys rotated first: `rotary` is `[rows, head_dim]`, each
    /// row the cosines of the row's `head_dim / 2` rotated pairs and then
    /// their sines (pair `j` joins values `j` and `j + head_dim / 2`).
    fn vision_attention(&self, qkv: &Self::Act, rotary: &Self::Act, shape: VisionHeads) -> Self::Act {
        let y = host_vision_attention(&self.to_host(qkv), &self.to_host(rotary), shape);
        self.act_from_host(self.rows(qkv), shape.heads * shape.head_dim, &y)
    }
}

/// [`VisionOps::layer_norm`] on the host.
pub fn host_layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, r)| {
        let mean = r.iter().sum::<f32>() / d as f32;
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            o[i] = (r[i] - mean) * inv * weight[i] + bias[i];
        }
    });
    out
}

/// [`VisionOps::gelu`] on the host.
pub fn host_gelu(x: &mut [f32], kind: Gelu) {
    match kind {
        Gelu::Tanh => {
            let c = (2.0f32 / std::f32::consts::PI).sqrt();
            x.par_iter_mut().for_each(|v| *v = 0.5 * *v * (1.0 + (c * (*v + 0.044715 * *v * *v * *v)).tanh()));
        }
        Gelu::Erf => x.par_iter_mut().for_each(|v| *v = 0.5 * *v * (1.0 + libm::erff(*v / std::f32::consts::SQRT_2))),
    }
}

/// [`VisionOps::vision_attention`] on the host.
pub fn host_vision_attention(qkv: &[f32], rotary: &[f32], shape: VisionHeads) -> Vec<f32> {
    let VisionHeads { heads, head_dim: hd } = shape;
    let d = heads * hd;
    let n = qkv.len() / (3 * d);
    let half = hd / 2;
    let rotated = |part: usize| -> Vec<f32> {
        let mut out = vec![0f32; n * d];
        out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
            let src = &qkv[i * 3 * d + part * d..][..d];
            let (cs, sn) = (&rotary[i * hd..][..half], &rotary[i * hd + half..][..half]);
            for h in 0..heads {
                let (x, y) = (&src[h * hd..][..hd], &mut o[h * hd..][..hd]);
                for j in 0..half {
                    y[j] = x[j] * cs[j] - x[j + half] * sn[j];
                    y[j + half] = x[j + half] * cs[j] + x[j] * sn[j];
                }
            }
        });
        out
    };
    let (q, k) = (rotated(0), rotated(1));
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * d];
    out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
        let mut scores = vec![0f32; n];
        for h in 0..heads {
            let qi = &q[i * d + h * hd..][..hd];
            for (j, s) in scores.iter_mut().enumerate() {
                let kj = &k[j * d + h * hd..][..hd];
                *s = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
            let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            let oh = &mut o[h * hd..][..hd];
            for (j, &p) in scores.iter().enumerate() {
                let vj = &qkv[j * 3 * d + 2 * d + h * hd..][..hd];
                for (x, v) in oh.iter_mut().zip(vj) {
                    *x += p / total * v;
                }
            }
        }
    });
    out
}
