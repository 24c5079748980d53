//! The kernels the backend launches: each op family's table of functions,
//! resolved by name once when the backend starts (a family's `load` is the
//! only place its names are spelled, besides the .cu file that defines
//! them), and typed argument lists (one struct per kernel signature, its
//! fields in the kernel's parameter order).

use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig};

use super::CudaBackend;
use crate::{Error, Result};

/// A kernel resolved from its module.
pub(super) struct Kernel {
    f: CudaFunction,
    /// Whether it is one of the attention kernels that stream no weights
    /// (see [`CudaBackend::after_attention`]).
    attention: bool,
    name: String,
}

impl Kernel {
    /// The function, for setting its attributes.
    pub(super) fn function(&self) -> &CudaFunction {
        &self.f
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }
}

/// What resolves kernel `name` of translation unit `unit` (a .cu file): the
/// device's modules, or a listing of the names (tests).
pub(super) type Resolve<'a, K> = dyn FnMut(&'static str, String) -> Result<K> + 'a;

/// `N` kernels resolved by `name(i)`.
pub(super) fn resolve_n<K, const N: usize>(
    get: &mut Resolve<'_, K>,
    unit: &'static str,
    mut name: impl FnMut(usize) -> String,
) -> Result<[K; N]> {
    let v: Vec<K> = (0..N).map(|i| get(unit, name(i))).collect::<Result<_>>()?;
    v.try_into().map_err(|_| Error::Invalid("kernel table size".into()))
}

/// `R × C` kernels resolved by `name(r, c)`.
pub(super) fn resolve_table<K, const R: usize, const C: usize>(
    get: &mut Resolve<'_, K>,
    unit: &'static str,
    mut name: impl FnMut(usize, usize) -> String,
) -> Result<[[K; C]; R]> {
    let rows: Vec<[K; C]> = (0..R).map(|r| resolve_n(get, unit, |c| name(r, c))).collect::<Result<_>>()?;
    rows.try_into().map_err(|_| Error::Invalid("kernel table size".into()))
}

/// The kernels of the device's modules, one module per unit of
/// [`super::compile::UNITS`] in that order.
pub(super) fn module_resolver(
    modules: &[std::sync::Arc<CudaModule>],
    ordinal: usize,
) -> impl FnMut(&'static str, String) -> Result<Kernel> + '_ {
    move |unit, name| {
        let i = super::compile::UNITS.iter().position(|u| u.name == unit).expect("a unit of UNITS");
        let f = modules[i]
            .load_function(&name)
            .map_err(|e| Error::Invalid(format!("cuda:{ordinal}: kernel {name} of {unit}: {e}")))?;
        let attention = name.starts_with("attention_");
        Ok(Kernel { f, attention, name })
    }
}

/// A kernel argument: a device pointer or a scalar.
#[derive(Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl From<u64> for Arg {
    fn from(v: u64) -> Self {
        Arg::Ptr(v)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}

/// The most parameters a kernel takes.
const MAX_ARGS: usize = 32;

/// The arguments of one kernel signature, in its parameter order.
pub(super) trait KernelArgs {
    /// Each argument in turn.
    fn each(&self, f: &mut dyn FnMut(Arg));
}

/// A struct of a kernel signature's arguments (fields in parameter order,
/// each `u64` for a device pointer, `i32`, `i64` or `f32`) and its
/// [`KernelArgs`].
macro_rules! kernel_args {
    ($(#[$m:meta])* $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$m])*
        pub(super) struct $name {
            $(pub(super) $field: $ty),*
        }
        impl $crate::backend::cuda::kernels::KernelArgs for $name {
            fn each(&self, f: &mut dyn FnMut($crate::backend::cuda::kernels::Arg)) {
                $(f(self.$field.into());)*
            }
        }
    };
}
pub(super) use kernel_args;

impl CudaBackend {
    /// Launches `kernel` with `cfg` and `args`, unless an earlier call
    /// failed; records a failure.
    pub(super) fn launch(&self, kernel: &Kernel, cfg: LaunchConfig, args: &dyn KernelArgs) {
        if self.failed() {
            return;
        }
        self.after_attention.store(kernel.attention, Ordering::Relaxed);
        // Each argument in an 8-byte slot, its value in the first bytes (as
        // the driver reads a parameter of that size through the slot's address).
        let mut slots = [[0u8; 8]; MAX_ARGS];
        let mut count = 0;
        args.each(&mut |a| {
            let slot = &mut slots[count];
            match a {
                Arg::Ptr(p) => slot.copy_from_slice(&p.to_ne_bytes()),
                Arg::I32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                Arg::I64(v) => slot.copy_from_slice(&v.to_ne_bytes()),
                Arg::F32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
            }
            count += 1;
        });
        let mut params: Vec<*mut std::ffi::c_void> = slots[..count].iter_mut().map(|s| s.as_mut_ptr().cast()).collect();
        // Programmatic stream serialization: the kernel may be scheduled while
        // the one before it finishes; it waits for it in `grid_dependency_wait`
        // (common.cuh), which every kernel calls before touching activations.
        let mut attrs = [sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        }];
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: u32::from(self.overlap_launches && !self.after_step_write.swap(false, Ordering::Relaxed)),
        };
        let bound = self.stream.context().bind_to_thread();
        self.record(bound, "binding the CUDA context");
        // SAFETY: every pointer argument points into a live allocation of at
        // least the size the kernel indexes, which the calling op's shapes
        // ensure; `params` holds one pointer per kernel parameter (the
        // argument struct's fields, in the kernel's order), each to a slot
        // that outlives the call, and the function belongs to this stream's
        // context.
        let r = unsafe {
            sys::cuLaunchKernelEx(&config, kernel.f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut())
        };
        self.record(r.result(), &kernel.name);
    }

    /// Launches the kernel `kernel` names, recording an error where there
    /// is none (a weight format without that kernel).
    pub(super) fn launch_opt(&self, kernel: Option<&Kernel>, what: &str, cfg: LaunchConfig, args: &dyn KernelArgs) {
        match kernel {
            Some(k) => self.launch(k, cfg, args),
            None => self.record(Err("no kernel for this weight format"), what),
        }
    }
}

pub(super) fn cfg(grid: (u32, u32, u32), threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared }
}

/// Blocks of `threads` covering `n` items (at least one).
pub(super) fn blocks(n: usize, threads: u32) -> (u32, u32, u32) {
    (n.div_ceil(threads as usize).max(1) as u32, 1, 1)
}

/// One thread per item, blocks of 256.
pub(super) fn elementwise_cfg(n: usize) -> LaunchConfig {
    cfg(blocks(n, 256), 256, 0)
}

/// Every kernel of every op family.
pub(super) struct Kernels<K> {
    pub(super) linear: super::linear::LinearKernels<K>,
    pub(super) affine: super::affine::AffineKernels<K>,
    pub(super) affine_gemm: super::affine_gemm::AffineGemmKernels<K>,
    pub(super) affine_gemm4: super::affine_gemm4::AffineGemm4Kernels<K>,
    pub(super) fp8: super::fp8::Fp8Kernels<K>,
    pub(super) attention: super::attention::AttentionKernels<K>,
    pub(super) batch: super::batch::BatchKernels<K>,
    pub(super) coded: super::kv_coded::CodedKernels<K>,
    pub(super) norm_rope: super::norm_rope::NormRopeKernels<K>,
    pub(super) elementwise: super::elementwise::ElementwiseKernels<K>,
    pub(super) gdn: super::gdn::GdnKernels<K>,
    pub(super) moe: super::moe::MoeKernels<K>,
    pub(super) sampling: super::sampling::SamplingKernels<K>,
    pub(super) vision: super::vision::VisionKernels<K>,
}

impl<K> Kernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        Ok(Kernels {
            linear: super::linear::LinearKernels::load(get)?,
            affine: super::affine::AffineKernels::load(get)?,
            affine_gemm: super::affine_gemm::AffineGemmKernels::load(get)?,
            affine_gemm4: super::affine_gemm4::AffineGemm4Kernels::load(get)?,
            fp8: super::fp8::Fp8Kernels::load(get)?,
            attention: super::attention::AttentionKernels::load(get)?,
            batch: super::batch::BatchKernels::load(get)?,
            coded: super::kv_coded::CodedKernels::load(get)?,
            norm_rope: super::norm_rope::NormRopeKernels::load(get)?,
            elementwise: super::elementwise::ElementwiseKernels::load(get)?,
            gdn: super::gdn::GdnKernels::load(get)?,
            moe: super::moe::MoeKernels::load(get)?,
            sampling: super::sampling::SamplingKernels::load(get)?,
            vision: super::vision::VisionKernels::load(get)?,
        })
    }
}

/// Every kernel the backend resolves, as (translation unit, name): what
/// tests compare with the kernels the .cu files define.
pub fn kernel_names() -> Vec<(&'static str, String)> {
    let mut names = Vec::new();
    Kernels::<()>::load(&mut |unit, name| {
        names.push((unit, name));
        Ok(())
    })
    .expect("listing names cannot fail");
    names
}

/// Each translation unit's name and PTX for `arch` (from the kernel cache,
/// else compiled by NVRTC): what tests read the defined kernels from.
pub fn unit_ptx(arch: &str) -> Result<Vec<(&'static str, String)>> {
    // SAFETY: only tries to open the shared library (cudarc panics on first
    // use of one it cannot load).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Invalid("NVRTC (libnvrtc) is not installed or not on the library path".into()));
    }
    let ptx = super::compile::ptx(arch)?;
    Ok(super::compile::UNITS.iter().zip(ptx).map(|(u, p)| (u.name, p.to_src())).collect())
}
