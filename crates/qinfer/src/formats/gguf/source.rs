//! A GGUF file as a tensor source under Hugging Face names, with llama.cpp's
//! converter changes to hybrid weights undone on read.

use super::file::GgufFile;
use super::hybrid;
use crate::formats::TensorSource;
use crate::tensor::Tensor;
use crate::{Error, Result};

impl TensorSource for GgufFile {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        let hybrid = hybrid::is_hybrid(self.architecture());
        match self.resolve(name) {
            Some(info) if hybrid => hybrid::undo_transform(name, self.load(info, name)?),
            Some(info) => self.load(info, name),
            None if hybrid && hybrid::fused_beta_alpha(self, name).is_some() => hybrid::split_beta_alpha(self, name),
            None => Err(Error::tensor(
                name,
                format!(
                    "not found in {} (GGUF name `{}`)",
                    self.path.display(),
                    self.gguf_names(name).first().map_or(name, String::as_str)
                ),
            )),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.resolve(name).is_some()
            || (hybrid::is_hybrid(self.architecture()) && hybrid::fused_beta_alpha(self, name).is_some())
    }

    fn names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }

    fn raw_tensor(&self, name: &str) -> Result<Tensor> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| Error::tensor(name, format!("not found in {}", self.path.display())))?;
        self.load(info, name)
    }
}
