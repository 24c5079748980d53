//! Building blocks that model files compose: each loads its weights by
//! Hugging Face name and runs on any [`Backend`] through its ops.

pub mod attention;
pub mod gdn;
pub mod mlp;
pub mod moe;

use crate::backend::Backend;
use crate::formats::TensorSource;
use crate::models::random::RandomWeights;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Fetches tensors by name, checks their shapes and places them on the backend.
pub struct WeightLoader<'a, B: Backend> {
    pub src: &'a dyn TensorSource,
    pub backend: &'a B,
    /// Sees each tensor as it is placed (progress reporting).
    pub on_tensor: &'a dyn Fn(&Tensor),
    /// Make every tensor up instead of reading `src` (benchmarks of real shapes).
    pub random: Option<RandomWeights>,
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

    pub fn get(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        self.place(&self.tensor(name, &[shape])?)
    }

    pub fn opt(&self, name: &str, shape: &[usize], present: bool) -> Result<Option<B::Weight>> {
        if present { self.get(name, shape).map(Some) } else { Ok(None) }
    }

    /// An RMSNorm weight. `unit_offset`: the model computes x̂·(1+w) (Qwen3-Next,
    /// Qwen3.5), so 1+w is formed once here, in f32 as the reference does.
    pub fn norm(&self, name: &str, dim: usize, unit_offset: bool) -> Result<B::Weight> {
        let t = self.tensor(name, &[&[dim]])?;
        if !unit_offset {
            return self.place(&t);
        }
        let shifted: Vec<f32> = t.to_f32_vec().iter().map(|w| 1.0 + w).collect();
        (self.on_tensor)(&t);
        self.backend.upload(&Tensor::from_f32(name, vec![dim], &shifted)?)
    }
}
