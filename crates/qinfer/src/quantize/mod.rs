//! `qinfer quantize`: a Hugging Face safetensors model → the MLX affine-quantized
//! model `mlx_lm.convert -q` writes for it, tensor for tensor.
//!
//! The steps are mlx-lm's: `sanitize` (expert stacking, fused-expert splits,
//! norm and conv conventions, `language_model.` prefixes; see [`sanitize`]),
//! the `--dtype` cast (all floating tensors but those the model's
//! `cast_predicate` excludes), then `quantize_model`: every linear, embedding
//! and stacked-expert weight whose rows are a multiple of the group size is
//! quantized as `mx.quantize` does ([`quantize_group`]), routers at 8 bits
//! group 64 (the model's `quant_predicate`) unless a [`Recipe`] decides;
//! everything else is stored as is. Scales and biases take the weight's dtype.

mod encode;
mod fp8;
mod metadata;

pub use fp8::{Fp8QuantizeOptions, quantize_fp8};
pub use metadata::parse_dtype;
mod sanitize;
mod writer;

use std::path::Path;

use rayon::prelude::*;
use serde_json::{Value, json};

use self::encode::encode;
use self::sanitize::Planned;
use self::writer::{Entry, SafetensorsWriter};
use crate::config::{Architecture, ModelConfig};
use crate::formats::TensorSource;
use crate::formats::hf_dir::HfDirectory;
use crate::quant::affine::{AffineParams, pack, quantize_group};
pub use crate::quant::recipe::Recipe;
use crate::tensor::{Bytes, DType, Tensor};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    pub bits: u32,
    pub group_size: usize,
    pub recipe: Option<Recipe>,
    /// mlx-lm's `--dtype`: what the unquantized tensors (and the scales and
    /// biases) are stored as. None: config.json's `torch_dtype` (or
    /// `text_config.dtype`) as mlx-lm reads it, else each tensor's own dtype.
    pub dtype: Option<DType>,
    /// Replace an existing output directory.
    pub force: bool,
}

fn st_dtype(d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("F32"),
        DType::F16 => Ok("F16"),
        DType::BF16 => Ok("BF16"),
        DType::U32 => Ok("U32"),
        DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q8_0
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::F8_E4M3 => Err(Error::Invalid(format!("{} input cannot be requantized", d.name()))),
    }
}

/// The model's `cast_predicate`: Qwen3.5 keeps `A_log` in its stored dtype.
fn casts(arch: Architecture, name: &str) -> bool {
    match arch {
        Architecture::Qwen35 | Architecture::Qwen35Moe => !name.ends_with("A_log"),
        Architecture::Llama
        | Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Qwen3Next => true,
    }
}

/// The model's `quant_predicate` naming `module` for 8 bits, group 64: the
/// MoE routers (and Qwen3-Next / 3.5's shared-expert gates).
fn is_router(cfg: &ModelConfig, module: &str) -> bool {
    let gate = module.ends_with("mlp.gate");
    let shared = module.ends_with("shared_expert_gate");
    match cfg.arch {
        Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3 => false,
        Architecture::Qwen3Moe => gate,
        Architecture::Qwen3Next | Architecture::Qwen35Moe => gate || shared,
        // qwen3_5.py returns no predicate when the text model has no experts.
        Architecture::Qwen35 => cfg.moe.is_some() && (gate || shared),
    }
}

/// How one planned tensor is written.
struct Job {
    planned: Planned,
    dtype: DType,
    quant: Option<AffineParams>,
}

impl Job {
    fn entries(&self) -> Result<Vec<Entry>> {
        let p = &self.planned;
        let dt = st_dtype(self.dtype)?;
        let Some(q) = self.quant else {
            let len = self.dtype.bytes_for(p.shape.iter().product()).unwrap_or(0);
            return Ok(vec![Entry { name: p.name.clone(), dtype: dt, shape: p.shape.clone(), len }]);
        };
        let (outer, cols) = p.shape.split_at(p.shape.len() - 1);
        let rows: usize = outer.iter().product();
        let module = p.name.strip_suffix(".weight").unwrap_or(&p.name);
        let with_last = |last: usize| [outer, &[last]].concat();
        let groups = rows * cols[0] / q.group_size;
        let side_len = self.dtype.bytes_for(groups).unwrap_or(0);
        Ok(vec![
            Entry {
                name: p.name.clone(),
                dtype: "U32",
                shape: with_last(cols[0] * q.bits as usize / 32),
                len: rows * q.row_bytes(cols[0]),
            },
            Entry {
                name: format!("{module}.scales"),
                dtype: dt,
                shape: with_last(cols[0] / q.group_size),
                len: side_len,
            },
            Entry {
                name: format!("{module}.biases"),
                dtype: dt,
                shape: with_last(cols[0] / q.group_size),
                len: side_len,
            },
        ])
    }

    /// The tensors' bytes, in [`Job::entries`] order.
    fn produce(&self, src: &dyn TensorSource) -> Result<Vec<Vec<u8>>> {
        let t = self.planned.materialize(src)?;
        if self.quant.is_none() && self.dtype == t.dtype {
            return Ok(vec![t.data.as_slice().to_vec()]);
        }
        let mut w = t.to_f32_vec();
        if self.dtype != t.dtype {
            // The cast happens before quantization: the weight is rounded to the target dtype first.
            w = Tensor::new(t.name.clone(), self.dtype, t.shape.clone(), Bytes::from_vec(encode(&w, self.dtype)))?
                .to_f32_vec();
        }
        let Some(q) = self.quant else { return Ok(vec![encode(&w, self.dtype)]) };
        let mut levels = vec![0u8; w.len()];
        let (scales, biases): (Vec<f32>, Vec<f32>) = w
            .par_chunks_exact(q.group_size)
            .zip(levels.par_chunks_exact_mut(q.group_size))
            .map(|(g, l)| quantize_group(g, q.bits, l))
            .unzip();
        let mut packed = Vec::with_capacity(w.len() * q.bits as usize / 8);
        pack(q.bits, &levels, &mut packed);
        Ok(vec![packed, encode(&scales, self.dtype), encode(&biases, self.dtype)])
    }
}

/// Quantizes the model in `src` into a new directory `out`. `progress` is
/// called with (tensors done, total) as the work advances.
pub fn quantize(src: &Path, out: &Path, opts: &QuantizeOptions, progress: &dyn Fn(usize, usize)) -> Result<()> {
    if !crate::quant::affine::MLX_GROUP_SIZES.contains(&opts.group_size) {
        // Groups of 16 are qinfer's form of ggml blocks; mlx reads none.
        return Err(Error::config(
            "--group-size",
            format!("{} is not one of mlx's {:?}", opts.group_size, crate::quant::affine::MLX_GROUP_SIZES),
        ));
    }
    if out.exists() && !opts.force {
        return Err(Error::Invalid(format!("{} exists; pass --force to replace it", out.display())));
    }
    // Unknown architectures stop here, named by the config reader.
    if !src.is_dir() {
        return Err(Error::Invalid(format!(
            "{}: quantize reads a Hugging Face model directory (config.json and safetensors)",
            src.display()
        )));
    }
    let model = HfDirectory::open(src)?;
    if model.source.names().iter().any(|n| n.ends_with(".scales")) {
        return Err(Error::Invalid(format!("{} is already quantized", src.display())));
    }
    let default = AffineParams::new(opts.bits, opts.group_size, "--bits/--group-size")?;
    let mut cfg: Value = model.config_json.clone();
    let target = metadata::conversion_dtype(opts.dtype, &cfg);

    let mut quant = json!({"group_size": opts.group_size, "bits": opts.bits, "mode": "affine"});
    let mut jobs = Vec::new();
    for planned in sanitize::plan(&model.config, &model.source)?.into_values() {
        let dtype = match target {
            Some(t) if casts(model.config.arch, &planned.name) => t,
            _ => planned.dtype,
        };
        let params = match planned.name.strip_suffix(".weight") {
            Some(module) => module_params(&model.config, module, &planned.shape, opts, default, &mut quant)?,
            None => None,
        };
        jobs.push(Job { planned, dtype, quant: params });
    }
    cfg["quantization"] = quant.clone();
    cfg["quantization_config"] = quant;
    metadata::finish_config(&mut cfg, src, model.config.arch)?;

    writer::write_model_dir(out, src, &cfg, |dir| write_dir(dir, &jobs, &model.source, progress))
}

/// mlx-lm's `quantize_model` for one weight: None when it stays unquantized
/// (not a linear, embedding or stacked-expert weight, or rows not a multiple
/// of the group size). Per-module entries go into `quant` as mlx-lm records
/// them: the predicate's own dict (routers: no `mode` key).
fn module_params(
    cfg: &ModelConfig,
    module: &str,
    shape: &[usize],
    opts: &QuantizeOptions,
    default: AffineParams,
    quant: &mut Value,
) -> Result<Option<AffineParams>> {
    let linear = shape.len() == 2 || (shape.len() == 3 && module.contains(".switch_mlp."));
    let cols = shape.last().copied().unwrap_or(0);
    if !linear || !cols.is_multiple_of(opts.group_size) {
        return Ok(None);
    }
    let (params, entry) = if let Some(r) = opts.recipe {
        let p = AffineParams::new(r.bits_for(module, cfg.num_layers), opts.group_size, "--mixed")?;
        (p, Some(json!({"group_size": p.group_size, "bits": p.bits, "mode": "affine"})))
    } else if is_router(cfg, module) {
        let p = AffineParams { bits: 8, group_size: 64 };
        if !cols.is_multiple_of(64) {
            return Err(Error::tensor(
                format!("{module}.weight"),
                format!("mlx-lm quantizes routers with group size 64; rows of {cols} values do not divide"),
            ));
        }
        (p, Some(json!({"group_size": 64, "bits": 8})))
    } else {
        (default, None)
    };
    if let Some(e) = entry {
        quant[module] = e;
    }
    Ok(Some(params))
}

fn write_dir(dir: &Path, jobs: &[Job], source: &dyn TensorSource, progress: &dyn Fn(usize, usize)) -> Result<()> {
    let mut entries = Vec::new();
    for j in jobs {
        entries.extend(j.entries()?);
    }
    let total_parameters =
        metadata::total_parameters(jobs.iter().map(|j| (j.planned.name.as_str(), &j.planned.shape[..])));
    writer::write_index(dir, &entries, total_parameters)?;
    let mut st = SafetensorsWriter::create(&dir.join("model.safetensors"), entries, "mlx")?;
    for (i, job) in jobs.iter().enumerate() {
        for (e, bytes) in job.entries()?.iter().zip(job.produce(source)?) {
            st.write(&e.name, &bytes)?;
        }
        progress(i + 1, jobs.len());
    }
    st.finish()
}
