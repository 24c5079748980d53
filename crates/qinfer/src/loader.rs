//! Opening a model from a path: a Hugging Face directory (safetensors, single
//! or sharded) or a single `.gguf` file; then placing it on a backend.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::backend::cpu::CpuBackend;
use crate::config::ModelConfig;
use crate::formats::TensorSource;
use crate::formats::gguf::GgufFile;
use crate::formats::mlx::QuantizationConfig;
use crate::formats::safetensors::SafetensorsSource;
use crate::kv::KvPrecision;
use crate::models::LanguageModel;
use crate::models::decoder::DecoderModel;
use crate::models::random::{RandomWeights, WeightStorage};
use crate::sampling::SamplingParams;
use crate::tensor::Tensor;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// CUDA device by ordinal (builds with the `cuda` feature); `graphs`:
    /// record decode steps as CUDA graphs and replay them (the default);
    /// `overlap`: let each kernel be scheduled while the one before it
    /// finishes (programmatic dependent launch, compute capability 9.0 and
    /// later; the default); `kv`: how KV caches store keys and values
    /// (f16 by default).
    Cuda {
        ordinal: usize,
        graphs: bool,
        overlap: bool,
        kv: KvPrecision,
    },
}

impl Device {
    /// The same device, running every decode step as it comes instead of
    /// replaying recorded graphs (debugging; the results are the same).
    pub fn without_graphs(self) -> std::result::Result<Self, String> {
        match self {
            Device::Cuda { ordinal, overlap, kv, .. } => Ok(Device::Cuda { ordinal, graphs: false, overlap, kv }),
            Device::Cpu => Err("turning CUDA graphs off needs a CUDA device (--device cuda[:N])".into()),
        }
    }

    /// The same device, launching each kernel only once the one before it
    /// has finished (measuring what the overlap gains; the results are the same).
    pub fn without_overlapped_launches(self) -> std::result::Result<Self, String> {
        match self {
            Device::Cuda { ordinal, graphs, kv, .. } => Ok(Device::Cuda { ordinal, graphs, overlap: false, kv }),
            Device::Cpu => Err("overlapped kernel launches are a CUDA option (--device cuda[:N])".into()),
        }
    }

    /// The same device, its KV caches storing keys and values as `kv`.
    pub fn with_kv_precision(self, kv: KvPrecision) -> std::result::Result<Self, String> {
        match self {
            Device::Cuda { ordinal, graphs, overlap, .. } => Ok(Device::Cuda { ordinal, graphs, overlap, kv }),
            Device::Cpu => Err("the KV cache's precision is a CUDA option (the CPU's cache is f32)".into()),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda { ordinal: 0, graphs: true, overlap: true, kv: KvPrecision::default() }),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda { ordinal: n, graphs: true, overlap: true, kv: KvPrecision::default() }),
                _ => Err(format!("unknown device `{s}` (expected cpu, cuda or cuda:N)")),
            },
        }
    }
}

/// Where a model's weights come from.
enum Weights<'a> {
    Files(&'a dyn TensorSource, &'a dyn Fn(&Tensor)),
    Random(RandomWeights),
}

/// A model of `cfg` on `device`.
fn place(cfg: ModelConfig, weights: Weights, device: Device) -> Result<Box<dyn LanguageModel>> {
    fn build<B: crate::backend::Backend + 'static>(
        cfg: ModelConfig,
        weights: Weights,
        backend: B,
    ) -> Result<Box<dyn LanguageModel>> {
        Ok(Box::new(match weights {
            Weights::Files(src, on_tensor) => DecoderModel::load(cfg, src, backend, on_tensor)?,
            Weights::Random(r) => DecoderModel::random(cfg, backend, r)?,
        }))
    }
    match device {
        Device::Cpu => build(cfg, weights, CpuBackend::new()),
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal, graphs, overlap, kv } => {
            let mut backend = crate::backend::cuda::CudaBackend::new(ordinal)?.with_kv_precision(kv);
            if !graphs {
                backend = backend.without_graphs();
            }
            if !overlap {
                backend = backend.without_overlapped_launches();
            }
            build(cfg, weights, backend)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => {
            Err(Error::Invalid("this build has no CUDA support: rebuild with `--features cuda`".into()))
        }
    }
}

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
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::malformed(path, format!("invalid JSON: {e}")))
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
        let cfg_path = path.join("config.json");
        let cfg_json = read_json(&cfg_path)?;
        let gen_path = path.join("generation_config.json");
        let gen_json = if gen_path.exists() { Some(read_json(&gen_path)?) } else { None };
        let config = ModelConfig::from_hf_json(&cfg_json, gen_json.as_ref())
            .map_err(|e| Error::malformed(&cfg_path, e.to_string()))?;
        let mut st = SafetensorsSource::open_dir(path)?;
        st.set_quantization(
            QuantizationConfig::from_config_json(&cfg_json).map_err(|e| Error::malformed(&cfg_path, e.to_string()))?,
        );
        let files = st.files();
        let tokenizer = Tokenizer::from_dir(path)?;
        let sampling_defaults = gen_json.as_ref().map(sampling_from_generation_config).unwrap_or_default();
        Ok(LoadedModel {
            path: path.to_path_buf(),
            format: ModelFormat::Safetensors,
            config,
            source: Box::new(st),
            tokenizer,
            sampling_defaults,
            files,
        })
    } else if path.is_file() {
        let gguf = GgufFile::open(path)?;
        let config = gguf.model_config()?;
        let tokenizer = crate::tokenizer::gguf::from_file(&gguf)?;
        let size = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
        Ok(LoadedModel {
            path: path.to_path_buf(),
            format: ModelFormat::Gguf,
            config,
            source: Box::new(gguf),
            tokenizer,
            sampling_defaults: SamplingParams::default(),
            files: vec![(path.to_path_buf(), size)],
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
    let json = read_json(config_path)?;
    let cfg = ModelConfig::from_hf_json(&json, None).map_err(|e| Error::malformed(config_path, e.to_string()))?;
    let model = place(cfg.clone(), Weights::Random(RandomWeights::new(storage, cfg.num_layers, 0)), device)?;
    Ok((cfg, model))
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
        self.load(Device::Cpu, show_progress)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_with_their_defaults_and_options_apply_to_cuda_only() {
        let cuda: Device = "cuda:1".parse().unwrap();
        assert_eq!(cuda, Device::Cuda { ordinal: 1, graphs: true, overlap: true, kv: KvPrecision::F16 });
        let f32_cache = cuda.with_kv_precision("f32".parse().unwrap()).unwrap();
        assert_eq!(f32_cache, Device::Cuda { ordinal: 1, graphs: true, overlap: true, kv: KvPrecision::F32 });
        // Each option keeps the others.
        let plain = f32_cache.without_graphs().unwrap().without_overlapped_launches().unwrap();
        assert_eq!(plain, Device::Cuda { ordinal: 1, graphs: false, overlap: false, kv: KvPrecision::F32 });
        assert!(Device::Cpu.with_kv_precision(KvPrecision::F16).unwrap_err().contains("CUDA option"));
        assert!("bf16".parse::<KvPrecision>().unwrap_err().contains("expected f16 or f32"));
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
