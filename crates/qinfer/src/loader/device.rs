//! Where a model runs, with every device option parsed once into typed
//! fields, and placing a model's weights there.

use crate::Result;
use crate::backend::cpu::CpuBackend;
use crate::backend::ops::ModelBackend;
use crate::config::ModelConfig;
use crate::formats::TensorSource;
use crate::kv::{KvFormat, KvPrecision};
use crate::models::LanguageModel;
use crate::models::decoder::DecoderModel;
use crate::tensor::Tensor;
use crate::weights::random::RandomWeights;

/// How the CUDA backend runs. Each field is a CLI flag; the defaults are
/// what is fastest, the alternatives give the same results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Record decode steps as CUDA graphs and replay them (`--no-cuda-graphs`
    /// runs each step as it comes, for debugging).
    pub graphs: bool,
    /// Let each kernel be scheduled while the one before it finishes
    /// (programmatic dependent launch, compute capability 9.0 and later;
    /// `--no-overlapped-launches` measures what it gains).
    pub overlapped_launches: bool,
    /// How KV caches store keys and values (`--kv-cache f16|f32` on CUDA).
    pub kv: KvPrecision,
    /// An encoded format of the paged pool (`--kv-cache turbo4`, `fp8`, …):
    /// the batching engine's cache; one sequence's contiguous cache stays `kv`.
    pub coded_kv: Option<KvFormat>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { graphs: true, overlapped_launches: true, kv: KvPrecision::default(), coded_kv: None }
    }
}

impl CudaOptions {
    /// The CLI flags that set these options away from their defaults.
    fn flags_set(&self) -> Vec<&'static str> {
        let d = CudaOptions::default();
        let mut set = Vec::new();
        if self.graphs != d.graphs {
            set.push("--no-cuda-graphs");
        }
        if self.overlapped_launches != d.overlapped_launches {
            set.push("--no-overlapped-launches");
        }
        set
    }
}

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU, its KV caches in `kv` (f32 unless `--kv-cache` says otherwise).
    Cpu { kv: KvFormat },
    /// CUDA device by ordinal (builds with the `cuda` feature).
    Cuda { ordinal: usize, options: CudaOptions },
}

impl Device {
    /// The CPU with an f32 KV cache.
    pub const CPU: Device = Device::Cpu { kv: KvFormat::F32 };

    /// The same device with `options`; an error naming the flags when they
    /// are set on the CPU, which has none of them.
    pub fn with_cuda_options(self, options: CudaOptions) -> std::result::Result<Self, String> {
        match self {
            Device::Cuda { ordinal, .. } => Ok(Device::Cuda { ordinal, options }),
            Device::Cpu { .. } if options == CudaOptions::default() => Ok(self),
            Device::Cpu { .. } => Err(format!(
                "{} {} CUDA options (--device cuda[:N])",
                options.flags_set().join(", "),
                if options.flags_set().len() == 1 { "is a" } else { "are" }
            )),
        }
    }
}

impl Device {
    /// The same device storing KV caches in `format` (its default when
    /// `None`); an error naming the formats the device takes otherwise.
    pub fn with_kv_format(self, format: Option<KvFormat>) -> std::result::Result<Self, String> {
        match self {
            Device::Cpu { .. } => Ok(Device::Cpu { kv: format.unwrap_or(KvFormat::F32) }),
            Device::Cuda { ordinal, mut options } => {
                // Encoded formats are checked against the CUDA kernels when
                // the backend is made (`CudaBackend::with_coded_kv`).
                (options.kv, options.coded_kv) = match format {
                    None => (KvPrecision::default(), None),
                    Some(KvFormat::F16) => (KvPrecision::F16, None),
                    Some(KvFormat::F32) => (KvPrecision::F32, None),
                    Some(f) => (KvPrecision::default(), Some(f)),
                };
                Ok(Device::Cuda { ordinal, options })
            }
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let options = CudaOptions::default();
        match s {
            "cpu" => Ok(Device::CPU),
            "cuda" => Ok(Device::Cuda { ordinal: 0, options }),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Ok(Device::Cuda { ordinal, options }),
                _ => Err(format!("unknown device `{s}` (expected cpu, cuda or cuda:N)")),
            },
        }
    }
}

/// Where a model's weights come from.
pub(crate) enum Weights<'a> {
    Files(&'a dyn TensorSource, &'a dyn Fn(&Tensor)),
    Random(RandomWeights),
}

/// A model of `cfg` on `device`.
pub(crate) fn place(cfg: ModelConfig, weights: Weights, device: Device) -> Result<Box<dyn LanguageModel>> {
    fn build<B: ModelBackend + 'static>(
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
        Device::Cpu { kv } => build(cfg, weights, CpuBackend::with_kv_format(kv)),
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal, options } => {
            let mut backend = crate::backend::cuda::CudaBackend::new(ordinal)?.with_kv_precision(options.kv);
            if let Some(f) = options.coded_kv {
                backend = backend.with_coded_kv(f)?;
            }
            if !options.graphs {
                backend = backend.without_graphs();
            }
            if !options.overlapped_launches {
                backend = backend.without_overlapped_launches();
            }
            build(cfg, weights, backend)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => {
            Err(crate::Error::Invalid("this build has no CUDA support: rebuild with `--features cuda`".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_with_their_defaults_and_options_apply_to_cuda_only() {
        let cuda: Device = "cuda:1".parse().unwrap();
        assert_eq!(cuda, Device::Cuda { ordinal: 1, options: CudaOptions::default() });
        assert_eq!(CudaOptions::default().kv, KvPrecision::F16);
        let plain =
            CudaOptions { graphs: false, overlapped_launches: false, kv: "f32".parse().unwrap(), coded_kv: None };
        assert_eq!(cuda.with_cuda_options(plain).unwrap(), Device::Cuda { ordinal: 1, options: plain });
        assert_eq!(Device::CPU.with_cuda_options(CudaOptions::default()).unwrap(), Device::CPU);
        let e = Device::CPU.with_cuda_options(CudaOptions { graphs: false, ..Default::default() }).unwrap_err();
        assert!(e.contains("--no-cuda-graphs is a CUDA option"), "{e}");
        let e = Device::CPU.with_cuda_options(plain).unwrap_err();
        assert!(e.contains("--no-cuda-graphs, --no-overlapped-launches are CUDA options"), "{e}");
        assert!("bf16".parse::<KvPrecision>().unwrap_err().contains("expected f16 or f32"));
        assert!("cuda:x".parse::<Device>().is_err());
    }

    #[test]
    fn kv_formats_apply_per_device() {
        let turbo4: KvFormat = "turbo4".parse().unwrap();
        assert_eq!(Device::CPU.with_kv_format(Some(turbo4)).unwrap(), Device::Cpu { kv: turbo4 });
        assert_eq!(Device::CPU.with_kv_format(None).unwrap(), Device::CPU);
        let cuda: Device = "cuda".parse().unwrap();
        let Device::Cuda { options, .. } = cuda.with_kv_format(Some(KvFormat::F32)).unwrap() else { unreachable!() };
        assert_eq!(options.kv, KvPrecision::F32);
        let Device::Cuda { options, .. } = cuda.with_kv_format(Some(turbo4)).unwrap() else { unreachable!() };
        assert_eq!((options.kv, options.coded_kv), (KvPrecision::F16, Some(turbo4)));
    }
}
