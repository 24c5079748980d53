//! An open GGUF file: its metadata and tensor infos, parsed once, and the
//! tensor data borrowed from an mmap.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::ggml_type::GgmlType;
use super::names;
use super::reader::{self, GgufTensorInfo};
use super::value::GgufValue;
use crate::tensor::{Bytes, Tensor};
use crate::{Error, Result};

struct MappedFile(Mmap);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

pub struct GgufFile {
    pub(super) path: PathBuf,
    map: Arc<MappedFile>,
    pub(super) version: u32,
    pub(super) metadata: BTreeMap<String, GgufValue>,
    pub(super) tensors: Vec<GgufTensorInfo>,
    pub(super) by_name: HashMap<String, usize>,
    pub(super) alignment: usize,
    pub(super) data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len < 4 + 4 + 8 + 8 {
            return Err(Error::malformed(path, format!("{len} bytes is too short for a GGUF header")));
        }
        // SAFETY: the map is read-only; like every mmap-based loader we rely on
        // the file not being truncated underneath us while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let parsed = reader::parse(&map, path)?;
        let by_name = parsed.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            map: Arc::new(MappedFile(map)),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }
    /// `general.alignment`, or the default 32.
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// Absolute file offset where tensor data begins.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }
    /// Tensors in file order, with GGUF names.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }
    pub fn tensor_info(&self, gguf_name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(gguf_name).map(|&i| &self.tensors[i])
    }
    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata.get("general.architecture").and_then(|v| v.as_str())
    }

    /// The GGUF names a Hugging Face name may have in this file, most
    /// common first. Multi-token-prediction tensors (`mtp.*`) sit in the
    /// blocks after the main model's (`{arch}.nextn_predict_layers` of
    /// `{arch}.block_count`).
    pub(super) fn gguf_names(&self, name: &str) -> Vec<String> {
        if !name.starts_with("mtp.") {
            return names::hf_to_gguf_all(name);
        }
        let arch = self.architecture().unwrap_or_default();
        let count = |key: &str| self.metadata.get(&format!("{arch}.{key}")).and_then(|v| v.as_u64());
        match (count("block_count"), count("nextn_predict_layers")) {
            (Some(blocks), Some(nextn)) if nextn > 0 && nextn <= blocks => {
                names::mtp_to_gguf_all(name, (blocks - nextn) as usize)
            }
            _ => Vec::new(),
        }
    }

    /// The GGUF name a lookup resolves to: the mapped Hugging Face name when
    /// the file has it, else the name itself when the file has that.
    pub(super) fn resolve(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.gguf_names(name).iter().find_map(|g| self.tensor_info(g)).or_else(|| self.tensor_info(name))
    }

    pub(super) fn load(&self, info: &GgufTensorInfo, name: &str) -> Result<Tensor> {
        let ty = GgmlType::from_id(info.ggml_type)
            .ok_or_else(|| Error::tensor(name, format!("unknown ggml type id {}", info.ggml_type)))?;
        let dtype = ty.dtype().ok_or_else(|| {
            Error::tensor(
                name,
                format!(
                    "ggml type {} (GGUF tensor `{}` in {}) is not supported; supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K",
                    ty.name,
                    info.name,
                    self.path.display()
                ),
            )
        })?;
        let data = Bytes::new(self.map.clone(), info.offset, info.n_bytes);
        Tensor::new(name.to_string(), dtype, info.shape.clone(), data)
    }
}
