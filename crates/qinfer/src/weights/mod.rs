//! Weights by name and shape: [`WeightLoader`] fetches each tensor a layer
//! asks for from a file's [`TensorSource`] (or makes it up, for benchmarks of
//! real shapes: [`random`]), checks its shape and places it on the backend.

pub mod random;

use crate::backend::Backend;
use crate::formats::TensorSource;
use crate::quant::affine::AffineTensor;
use crate::quant::fp8::Fp8Tensor;
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

    /// A vector or matrix, plain, affine-quantized or FP8 (`shape` is the logical `[out, in]`).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        if let Some(a) = self.affine(name, shape)? {
            return self.place_affine(&a);
        }
        if let Some(f) = self.fp8(name, shape)? {
            return self.place_fp8(&f);
        }
        self.place(&self.tensor(name, &[shape])?)
    }

    /// The weight `name` when stored as FP8, checked against the logical `shape`.
    pub fn fp8(&self, name: &str, shape: &[usize]) -> Result<Option<Fp8Tensor>> {
        if let Some(r) = &self.random {
            return r.fp8_tensor(name, shape);
        }
        let Some(f) = self.src.fp8(name)? else { return Ok(None) };
        if f.shape() != shape {
            return Err(Error::tensor(name, format!("expected shape {shape:?}, found {:?} (FP8)", f.shape())));
        }
        Ok(Some(f))
    }

    pub fn place_fp8(&self, f: &Fp8Tensor) -> Result<B::Weight> {
        (self.on_tensor)(&f.weight);
        self.backend.upload_fp8(f)
    }

    /// A weight as stored (plain or FP8) and not yet placed, for layers that
    /// cut it up first (fused expert stacks).
    pub fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored> {
        match self.fp8(name, shape)? {
            Some(f) => Ok(Stored::Fp8(f)),
            None => self.tensor(name, &[shape]).map(Stored::Plain),
        }
    }

    pub fn place_stored(&self, s: &Stored) -> Result<B::Weight> {
        match s {
            Stored::Plain(t) => self.place(t),
            Stored::Fp8(f) => self.place_fp8(f),
        }
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
                let mut fp8 = Vec::new();
                for (n, s) in names.iter().zip(shapes) {
                    fp8.push(self.fp8(n, s)?);
                }
                if fp8.iter().all(Option::is_some) {
                    let parts: Vec<&Fp8Tensor> = fp8.iter().flatten().collect();
                    if let Some(f) = Fp8Tensor::concat_rows(&fused, &parts)? {
                        return Ok(vec![self.place_fp8(&f)?]);
                    }
                    return names.iter().zip(shapes).map(|(n, s)| self.get(n, s)).collect();
                }
                if fp8.iter().any(Option::is_some) {
                    return names.iter().zip(shapes).map(|(n, s)| self.get(n, s)).collect();
                }
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

/// A weight as stored, before placement: plain (float or ggml blocks) or FP8.
#[derive(Debug, Clone)]
pub enum Stored {
    Plain(Tensor),
    Fp8(Fp8Tensor),
}

impl Stored {
    /// Entries `[start, start + len)` along the outermost dimension (no copy).
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(match self {
            Stored::Plain(t) => Stored::Plain(t.narrow(start, len)?),
            Stored::Fp8(f) => Stored::Fp8(f.narrow(start, len)?),
        })
    }

    /// Drops a leading dimension of 1 (one expert of a stack).
    pub fn squeeze_outer(&self) -> Result<Self> {
        Ok(match self {
            Stored::Plain(t) => Stored::Plain(t.reshape(t.shape[1..].to_vec())?),
            Stored::Fp8(f) => Stored::Fp8(f.squeeze_outer()?),
        })
    }
}
