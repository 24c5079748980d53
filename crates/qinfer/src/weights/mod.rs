//! Weights by name and shape: [`WeightLoader`] fetches each tensor a layer
//! asks for from a file's [`TensorSource`] (or makes it up, for benchmarks of
//! real shapes: [`random`]), checks its shape and places it on the backend.

pub mod random;

use crate::backend::Backend;
use crate::formats::TensorSource;
use crate::quant::affine::AffineTensor;
use crate::tensor::Tensor;
use crate::{Error, Result};
use random::RandomWeights;

/// Fetches tensors by name, checks their shapes and places them on the backend.
pub struct WeightLoader<'a, B: Backend> {
    pub src: &'a dyn TensorSource,
    pub backend: &'a B,
    /// Sees each tensor as it is placed (progress reporting).
    pub on_tensor: &'a dyn Fn(&Tensor),
    /// Make every tensor up instead of reading `src` (benchmarks of real shapes).
    pub random: Option<RandomWeights>,
    /// The checkpoint stores x̂·(1+w) norm weights already shifted (MLX's
    /// conversion of Qwen3-Next / Qwen3.5 adds the 1 in `sanitize`).
    pub norms_shifted: bool,
}

impl<B: Backend> WeightLoader<'_, B> {
    /// The stored tensor, which must have one of `shapes`.
    pub fn tensor(&self, name: &str, shapes: &[&[usize]]) -> Result<Tensor> {
        if let Some(r) = &self.random {
            return r.tensor(name, shapes[0]);
        }
        let t = self.src.tensor(name)?;
        if !shapes.iter().any(|s| t.shape == *s) {
            let want = shapes.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(" or ");
            return Err(Error::tensor(name, format!("expected shape {want}, found {:?}", t.shape)));
        }
        Ok(t)
    }

    pub fn place(&self, t: &Tensor) -> Result<B::Weight> {
        (self.on_tensor)(t);
        self.backend.upload(t)
    }

    /// A vector or matrix, plain or affine-quantized (`shape` is the logical `[out, in]`).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        if let Some(a) = self.affine(name, shape)? {
            return self.place_affine(&a);
        }
        self.place(&self.tensor(name, &[shape])?)
    }

    /// The weight `name` when stored affine-quantized, checked against the
    /// logical `shape` (`[…, out, in]`).
    pub fn affine(&self, name: &str, shape: &[usize]) -> Result<Option<AffineTensor>> {
        if let Some(r) = &self.random {
            return r.affine_tensor(name, shape);
        }
        let Some(parts) = self.src.affine_parts(name)? else { return Ok(None) };
        let a = AffineTensor::new(parts, *shape.last().unwrap_or(&0))?;
        if a.shape != shape {
            return Err(Error::tensor(name, format!("expected shape {shape:?}, found {:?} (quantized)", a.shape)));
        }
        Ok(Some(a))
    }

    pub fn place_affine(&self, a: &AffineTensor) -> Result<B::Weight> {
        for t in [&a.packed, &a.scales, &a.biases] {
            (self.on_tensor)(t);
        }
        self.backend.upload_affine(a)
    }

    /// A stacked `[E, out, in]` weight (MLX's `switch_mlp.*`), one matrix per
    /// entry, each a view into the stored bytes.
    pub fn stacked(&self, name: &str, shape: [usize; 3]) -> Result<Vec<B::Weight>> {
        let [e_n, rows, cols] = shape;
        if let Some(a) = self.affine(name, &shape)? {
            return (0..e_n).map(|e| self.place_affine(&a.narrow(e, 1)?.squeeze_outer()?)).collect();
        }
        let t = self.tensor(name, &[&shape])?;
        (0..e_n).map(|e| self.place(&t.narrow(e, 1)?.reshape(vec![rows, cols])?)).collect()
    }

    /// Matrices that one matmul can compute together (q|k|v, gate|up), by
    /// name and logical `[out, in]` shape: one weight of their rows stacked
    /// when the backend takes fused projections and all are stored alike
    /// (same dtype, or same affine parameters); else one weight each.
    pub fn stacked_rows(&self, names: &[String], shapes: &[[usize; 2]]) -> Result<Vec<B::Weight>> {
        let fused = format!("{}(stacked)", names.join("+"));
        if self.backend.capabilities().fused_projections {
            let mut affine = Vec::new();
            for (n, s) in names.iter().zip(shapes) {
                affine.push(self.affine(n, s)?);
            }
            if affine.iter().all(Option::is_some) {
                let parts: Vec<&AffineTensor> = affine.iter().flatten().collect();
                if let Some(a) = AffineTensor::concat_rows(&fused, &parts)? {
                    return Ok(vec![self.place_affine(&a)?]);
                }
            } else if affine.iter().all(Option::is_none) {
                let mut plain = Vec::new();
                for (n, s) in names.iter().zip(shapes) {
                    plain.push(self.tensor(n, &[s])?);
                }
                if let Some(t) = Tensor::concat_rows(&fused, &plain.iter().collect::<Vec<_>>())? {
                    return Ok(vec![self.place(&t)?]);
                }
            }
        }
        names.iter().zip(shapes).map(|(n, s)| self.get(n, s)).collect()
    }

    pub fn opt(&self, name: &str, shape: &[usize], present: bool) -> Result<Option<B::Weight>> {
        if present { self.get(name, shape).map(Some) } else { Ok(None) }
    }

    /// An RMSNorm weight. `unit_offset`: the model computes x̂·(1+w) (Qwen3-Next,
    /// Qwen3.5), so 1+w is formed once here, in f32 as the reference does.
    pub fn norm(&self, name: &str, dim: usize, unit_offset: bool) -> Result<B::Weight> {
        let t = self.tensor(name, &[&[dim]])?;
        if !unit_offset || self.norms_shifted {
            return self.place(&t);
        }
        let shifted: Vec<f32> = t.to_f32_vec().iter().map(|w| 1.0 + w).collect();
        (self.on_tensor)(&t);
        self.backend.upload(&Tensor::from_f32(name, vec![dim], &shifted)?)
    }
}
