//! Hugging Face safetensors: a single `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Files are mmap'd; tensors borrow from the maps.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use super::TensorSource;
use super::fp8_config::Fp8Config;
use super::mlx::{ModuleQuantization, QuantizationConfig};
use crate::quant::affine::AffineParts;
use crate::quant::fp8::Fp8Tensor;
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
    /// config.json's `quantization` block (MLX checkpoints).
    quantization: Option<QuantizationConfig>,
    /// config.json's FP8 `quantization_config` (Qwen's FP8 editions, compressed-tensors).
    fp8: Option<Fp8Config>,
}

fn map_dtype(d: StDtype) -> Result<DType, String> {
    match d {
        StDtype::F32 => Ok(DType::F32),
        StDtype::F16 => Ok(DType::F16),
        StDtype::BF16 => Ok(DType::BF16),
        StDtype::U32 => Ok(DType::U32),
        StDtype::F8_E4M3 => Ok(DType::F8_E4M3),
        other => Err(format!(
            "dtype {other:?} is not supported (expected F32, F16, BF16, U32 for packed quantized weights, or \
             F8_E4M3 for FP8 weights)"
        )),
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
        Ok(SafetensorsSource { files, entries, quantization: None, fp8: None })
    }

    /// Reads quantized weights as config.json's `quantization` block describes.
    pub fn set_quantization(&mut self, q: Option<QuantizationConfig>) {
        self.quantization = q;
    }

    pub fn quantization(&self) -> Option<&QuantizationConfig> {
        self.quantization.as_ref()
    }

    /// Reads FP8 weights as config.json's FP8 `quantization_config` describes.
    pub fn set_fp8(&mut self, c: Option<Fp8Config>) {
        self.fp8 = c;
    }

    pub fn fp8_config(&self) -> Option<&Fp8Config> {
        self.fp8.as_ref()
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
    fn fp8(&self, name: &str) -> Result<Option<Fp8Tensor>> {
        if !self.entries.get(name).is_some_and(|e| e.dtype == Ok(DType::F8_E4M3)) {
            return Ok(None);
        }
        let Some(cfg) = &self.fp8 else {
            return Err(Error::tensor(name, "stored as F8_E4M3, but config.json has no FP8 `quantization_config`"));
        };
        // `X.weight` → `X.weight_scale_inv`; a fused expert stack `….gate_up_proj`
        // (no `.weight`) → `….gate_up_proj_scale_inv`, or `_scales_inv` as
        // transformers' FP8 experts name it.
        let candidates: Vec<String> = match name.strip_suffix(".weight") {
            Some(module) => vec![format!("{module}.{}", cfg.scale_suffix)],
            None => {
                let s = cfg.scale_suffix.strip_prefix("weight").unwrap_or(cfg.scale_suffix);
                vec![format!("{name}{s}"), format!("{name}{}", s.replacen("_scale", "_scales", 1))]
            }
        };
        let Some(scale_name) = candidates.iter().find(|c| self.contains(c)) else {
            return Err(Error::tensor(name, format!("FP8 weight without its scale `{}`", candidates[0])));
        };
        let weight = self.raw_tensor(name)?;
        let scale = self.raw_tensor(scale_name)?;
        let scaling = cfg.scaling_for(&weight.shape, &scale.shape).ok_or_else(|| {
            Error::tensor(
                scale_name,
                format!(
                    "shape {:?} fits none of the scalings config.json declares ({:?}) for a weight of shape {:?}",
                    scale.shape, cfg.scalings, weight.shape
                ),
            )
        })?;
        Fp8Tensor::from_stored(weight, scale, scaling).map(Some)
    }

    fn affine_parts(&self, name: &str) -> Result<Option<AffineParts>> {
        let Some(module) = name.strip_suffix(".weight") else { return Ok(None) };
        let (scales, biases) = (format!("{module}.scales"), format!("{module}.biases"));
        if !self.contains(&scales) {
            if self.entries.get(name).is_some_and(|e| e.dtype == Ok(DType::U32)) {
                return Err(Error::tensor(name, format!("packed u32 weight without `{scales}`")));
            }
            return Ok(None);
        }
        if !self.contains(&biases) {
            return Err(Error::tensor(
                &biases,
                format!("missing (`{scales}` is present; affine quantization needs both)"),
            ));
        }
        let Some(q) = &self.quantization else {
            return Err(Error::tensor(name, "stored quantized, but config.json has no `quantization` block"));
        };
        let declared = match q.module(module) {
            Some(ModuleQuantization::Affine(p)) => Some(p),
            Some(ModuleQuantization::Unquantized) => {
                return Err(Error::tensor(
                    name,
                    format!("stored quantized, but config.json's quantization.{module} is false"),
                ));
            }
            None => None,
        };
        Ok(Some(AffineParts {
            packed: self.raw_tensor(name)?,
            scales: self.raw_tensor(&scales)?,
            biases: self.raw_tensor(&biases)?,
            declared,
        }))
    }
}
