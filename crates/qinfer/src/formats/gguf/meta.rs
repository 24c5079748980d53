//! Typed reads of one architecture's GGUF metadata keys (`{arch}.{suffix}`),
//! with errors naming the key.

use super::file::GgufFile;
use super::value::GgufValue;
use crate::{Error, Result};

pub(super) struct Meta<'a> {
    pub(super) file: &'a GgufFile,
    pub(super) arch: &'a str,
}

impl Meta<'_> {
    pub(super) fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }
    pub(super) fn get(&self, key: &str) -> Option<&GgufValue> {
        self.file.metadata().get(key)
    }
    pub(super) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(_)) => Err(Error::config(key, "per-layer values (an array) are not supported")),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| Error::config(key, format!("expected a non-negative integer, found {v}"))),
        }
    }
    pub(super) fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| Error::config(key, "missing from GGUF metadata"))
    }
    pub(super) fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| Error::config(key, format!("expected a number, found {v}"))),
        }
    }
    pub(super) fn opt_token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| Error::config(key, format!("expected a token id, found {v}"))),
        }
    }
    pub(super) fn has_tensor(&self, name: &str) -> bool {
        self.file.tensor_info(name).is_some()
    }
}
