//! A model's tensors with the names under one prefix read from another
//! file: the multi-token-prediction head (`mtp.`, mtp_head.rs) or the
//! vision tower (`model.visual.`, mmproj.rs) published beside a model.

use crate::Result;
use crate::formats::TensorSource;
use crate::quant::affine::AffineParts;
use crate::quant::fp8::Fp8Tensor;
use crate::tensor::Tensor;

pub(super) struct Routed {
    pub model: Box<dyn TensorSource>,
    /// Where names under `prefix` are read.
    pub other: Box<dyn TensorSource>,
    pub prefix: &'static str,
}

impl Routed {
    fn of(&self, name: &str) -> &dyn TensorSource {
        if name.starts_with(self.prefix) { self.other.as_ref() } else { self.model.as_ref() }
    }
}

impl TensorSource for Routed {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.of(name).tensor(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.of(name).contains(name)
    }
    /// The model's own names, for `inspect`.
    fn names(&self) -> Vec<String> {
        self.model.names()
    }
    fn raw_tensor(&self, name: &str) -> Result<Tensor> {
        self.model.raw_tensor(name)
    }
    fn affine_parts(&self, name: &str) -> Result<Option<AffineParts>> {
        self.of(name).affine_parts(name)
    }
    fn fp8(&self, name: &str) -> Result<Option<Fp8Tensor>> {
        self.of(name).fp8(name)
    }
}
