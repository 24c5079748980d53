//! Opening a model from a path: a Hugging Face directory (safetensors, single
//! or sharded) or a single `.gguf` file; then placing it on a device.

mod device;
mod mmproj;
mod mtp_head;
mod routed;

pub use device::{CudaOptions, Device};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::config::ModelConfig;
use crate::formats::TensorSource;
use crate::formats::gguf::GgufFile;
use crate::formats::hf_dir::{HfDirectory, read_json};
use crate::image::ImageProcessorConfig;
use crate::models::LanguageModel;
use crate::sampling::SamplingParams;
use crate::tensor::Tensor;
use crate::tokenizer::Tokenizer;
use crate::weights::random::{RandomWeights, WeightStorage};
use crate::{Error, Result};
use device::{Weights, place};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Safetensors,
    Gguf,
}

pub struct LoadedModel {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub config: ModelConfig,
    pub source: Box<dyn TensorSource>,
    pub tokenizer: Option<Tokenizer>,
    /// Sampling defaults from generation_config.json (greedy when absent, as transformers).
    pub sampling_defaults: SamplingParams,
    /// Weight files and their sizes in bytes.
    pub files: Vec<(PathBuf, u64)>,
    /// A GGUF's `{arch}.pooling_type` (llama.cpp's: 0 none, 1 mean, 2 cls,
    /// 3 last, 4 rank), as embedding models converted by llama.cpp declare it.
    pub gguf_pooling_type: Option<u64>,
    /// How images are prepared for the vision tower (`preprocessor_config.json`),
    /// for multimodal checkpoints.
    pub image_processor: Option<ImageProcessorConfig>,
}

/// The image processor of a multimodal checkpoint directory: its
/// `preprocessor_config.json`, or Qwen's published settings with the
/// vision tower's patch sizes where the file is missing; it must cut the
/// patches the tower takes.
fn image_processor(dir: &Path, cfg: &ModelConfig) -> Result<Option<ImageProcessorConfig>> {
    let Some(v) = &cfg.vision else { return Ok(None) };
    let path = dir.join("preprocessor_config.json");
    let p = if path.is_file() {
        ImageProcessorConfig::from_file(&path)?
    } else {
        ImageProcessorConfig {
            patch_size: v.patch_size,
            temporal_patch_size: v.temporal_patch_size,
            merge_size: v.spatial_merge_size,
            ..Default::default()
        }
    };
    let pairs = [
        ("patch_size", p.patch_size, v.patch_size),
        ("temporal_patch_size", p.temporal_patch_size, v.temporal_patch_size),
        ("merge_size", p.merge_size, v.spatial_merge_size),
    ];
    if let Some((field, got, want)) = pairs.into_iter().find(|(_, a, b)| a != b) {
        return Err(Error::malformed(path, format!("`{field}` is {got}, but the vision tower's is {want}")));
    }
    Ok(Some(p))
}

/// transformers' `GenerationConfig` semantics: sampling only when `do_sample` is true.
fn sampling_from_generation_config(g: &Value) -> SamplingParams {
    let f = |k: &str| g.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let mut p = SamplingParams::default();
    if let Some(r) = f("repetition_penalty") {
        p.repetition_penalty = r;
    }
    if g.get("do_sample").and_then(Value::as_bool) == Some(true) {
        p.temperature = f("temperature").unwrap_or(1.0);
        p.top_k = g.get("top_k").and_then(Value::as_u64).unwrap_or(50) as usize;
        p.top_p = f("top_p").unwrap_or(1.0);
        p.min_p = f("min_p").unwrap_or(0.0);
    }
    p
}

/// Opens a model directory or `.gguf` file. Reads configuration and maps the
/// weights; nothing is placed on a device yet.
pub fn open(path: &Path) -> Result<LoadedModel> {
    if path.is_dir() {
        let dir = HfDirectory::open(path)?;
        let files = dir.source.files();
        let tokenizer = Tokenizer::from_dir(path)?;
        let sampling_defaults = dir.generation_json.as_ref().map(sampling_from_generation_config).unwrap_or_default();
        let image_processor = image_processor(path, &dir.config)?;
        Ok(LoadedModel {
            path: path.to_path_buf(),
            format: ModelFormat::Safetensors,
            config: dir.config,
            source: Box::new(dir.source),
            tokenizer,
            sampling_defaults,
            files,
            gguf_pooling_type: None,
            image_processor,
        })
    } else if path.is_file() {
        let gguf = GgufFile::open(path)?;
        let config = gguf.model_config()?;
        let tokenizer = crate::tokenizer::gguf::from_file(&gguf)?;
        let size = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
        let gguf_pooling_type = (gguf.architecture())
            .and_then(|arch| gguf.metadata().get(&format!("{arch}.pooling_type")))
            .and_then(|v| v.as_u64());
        Ok(LoadedModel {
            path: path.to_path_buf(),
            format: ModelFormat::Gguf,
            config,
            source: Box::new(gguf),
            tokenizer,
            sampling_defaults: SamplingParams::default(),
            files: vec![(path.to_path_buf(), size)],
            gguf_pooling_type,
            image_processor: None,
        })
    } else {
        Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no such model file or directory")))
    }
}

/// A model of the shape `config.json` describes, with random weights stored as
/// `storage` (see [`RandomWeights`]), on `device`.
pub fn random_model(
    config_path: &Path,
    storage: WeightStorage,
    device: Device,
) -> Result<(ModelConfig, Box<dyn LanguageModel>)> {
    let cfg = model_config(config_path)?;
    let model = random_model_of(cfg.clone(), storage, device)?;
    Ok((cfg, model))
}

/// The model configuration a `config.json` describes.
pub fn model_config(config_path: &Path) -> Result<ModelConfig> {
    let json = read_json(config_path)?;
    ModelConfig::from_hf_json(&json, None).map_err(|e| Error::malformed(config_path, e.to_string()))
}

/// A model of `cfg`'s shape with made-up weights on `device` (see [`random_model`]).
pub fn random_model_of(cfg: ModelConfig, storage: WeightStorage, device: Device) -> Result<Box<dyn LanguageModel>> {
    let layers = cfg.num_layers;
    place(cfg, Weights::Random(RandomWeights::new(storage, layers, 0)), device)
}

impl LoadedModel {
    /// Names of the multi-token-prediction head's tensors (`mtp.*`, Qwen3.5 and
    /// Qwen3-Next checkpoints), read from `source` when speculative decoding uses them.
    pub fn mtp_tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.source.names().into_iter().filter(|n| n.starts_with("mtp.")).collect();
        names.sort();
        names
    }

    /// Places the weights on the CPU backend (see [`LoadedModel::load`]).
    pub fn load_cpu(&self, show_progress: bool) -> Result<Box<dyn LanguageModel>> {
        self.load(Device::CPU, show_progress)
    }

    /// Places the weights on `device`, with a progress bar on stderr when
    /// loading takes more than a moment.
    pub fn load(&self, device: Device, show_progress: bool) -> Result<Box<dyn LanguageModel>> {
        let total: u64 = self.files.iter().map(|f| f.1).sum();
        let bar = indicatif::ProgressBar::hidden();
        bar.set_length(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {elapsed}")
                .expect("static template"),
        );
        let start = Instant::now();
        let on_tensor = |t: &Tensor| {
            // Touch the bytes so page faults happen here, under the bar, not in the first forward.
            let s = t.data.as_slice();
            let mut acc = 0u8;
            for i in (0..s.len()).step_by(4096) {
                acc ^= s[i];
            }
            std::hint::black_box(acc);
            bar.inc(s.len() as u64);
            if show_progress && bar.is_hidden() && start.elapsed() > Duration::from_millis(300) {
                bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            }
        };
        let model = place(self.config.clone(), Weights::Files(self.source.as_ref(), &on_tensor), device)?;
        bar.finish_and_clear();
        Ok(model)
    }
}
