//! Hugging Face safetensors: a single `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Files are mmap'd; tensors borrow from the maps.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use super::TensorSource;
use crate::tensor::{Bytes, DType, Tensor};
use crate::{Error, Result};

struct Entry {
    file: usize,
    dtype: Result<DType, String>,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

struct MappedFile(Mmap);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

pub struct SafetensorsSource {
    files: Vec<(PathBuf, Arc<MappedFile>)>,
    entries: BTreeMap<String, Entry>,
}

fn map_dtype(d: StDtype) -> Result<DType, String> {
    match d {
        StDtype::F32 => Ok(DType::F32),
        StDtype::F16 => Ok(DType::F16),
        StDtype::BF16 => Ok(DType::BF16),
        other => Err(format!("dtype {other:?} is not supported (expected F32, F16 or BF16)")),
    }
}

impl SafetensorsSource {
    /// Opens `model.safetensors` or the shards named by `model.safetensors.index.json` in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::malformed(&index, e.to_string()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::malformed(&index, "missing `weight_map` object"))?;
            let mut names: Vec<String> = map
                .values()
                .map(|f| {
                    f.as_str().map(str::to_string).ok_or_else(|| Error::malformed(&index, "non-string shard name"))
                })
                .collect::<Result<_>>()?;
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains("..") {
                    return Err(Error::malformed(&index, format!("shard name `{n}` escapes the model directory")));
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(Error::malformed(dir, "no model.safetensors or model.safetensors.index.json"));
        };
        Self::open_files(&paths)
    }

    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::new();
        let mut entries = BTreeMap::new();
        for (fi, path) in paths.iter().enumerate() {
            let f = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the file is opened read-only; qinfer never writes model files
            // while they are mapped. Concurrent external truncation is outside our contract.
            let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| Error::malformed(path, format!("safetensors header: {e}")))?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if entries.contains_key(&name) {
                    return Err(Error::malformed(path, format!("tensor `{name}` appears in more than one shard")));
                }
                entries.insert(
                    name,
                    Entry {
                        file: fi,
                        dtype: map_dtype(info.dtype),
                        shape: info.shape.clone(),
                        start: data_start + s,
                        len: e - s,
                    },
                );
            }
            files.push((path.clone(), Arc::new(MappedFile(map))));
        }
        Ok(SafetensorsSource { files, entries })
    }

    /// File paths and sizes, for `inspect`.
    pub fn files(&self) -> Vec<(PathBuf, u64)> {
        self.files.iter().map(|(p, m)| (p.clone(), m.0.len() as u64)).collect()
    }
}

impl TensorSource for SafetensorsSource {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.raw_tensor(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }
    fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }
    fn raw_tensor(&self, name: &str) -> Result<Tensor> {
        let e = self.entries.get(name).ok_or_else(|| Error::tensor(name, "not found in the checkpoint"))?;
        let dtype = e.dtype.clone().map_err(|r| Error::tensor(name, r))?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.files[e.file].1.clone();
        Tensor::new(name.to_string(), dtype, e.shape.clone(), Bytes::new(owner, e.start, e.len))
    }
}
