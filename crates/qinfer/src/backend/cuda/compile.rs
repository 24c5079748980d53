//! Kernels are CUDA C++ sources embedded in the binary, compiled by NVRTC at
//! first use for the device's compute capability and cached on disk keyed by
//! a hash of the source and the architecture.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use crate::{Error, Result};

pub const KERNELS: &str = concat!(
    include_str!("kernels.cu"),
    "\n",
    include_str!("flash.cu"),
    "\n",
    include_str!("gdn.cu"),
    "\n",
    include_str!("gdn_chunked.cu"),
    "\n",
    include_str!("affine_mma.cu"),
    "\n",
    include_str!("moe.cu"),
    "\n",
    include_str!("moe_gemm.cu"),
    "\n",
    include_str!("sampling.cu")
);

/// CUDA's headers (cuda_bf16.h): `CUDA_HOME`/`CUDA_PATH`, else /usr/local/cuda.
fn include_dir() -> Result<String> {
    let candidates = [std::env::var("CUDA_HOME").ok(), std::env::var("CUDA_PATH").ok(), Some("/usr/local/cuda".into())];
    for root in candidates.into_iter().flatten() {
        let dir = PathBuf::from(&root).join("include");
        if dir.join("cuda_bf16.h").exists() {
            return Ok(dir.to_string_lossy().into_owned());
        }
    }
    Err(Error::Invalid(
        "CUDA headers not found: set CUDA_HOME to the CUDA toolkit (its include/ must hold cuda_bf16.h)".into(),
    ))
}

fn cache_dir() -> PathBuf {
    let base = std::env::var_os("QINFER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/qinfer")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("kernels")
}

/// The cache file of the kernels' PTX for `arch`: keyed by a hash of the
/// source and the architecture.
pub fn cache_path(arch: &str) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    KERNELS.hash(&mut h);
    arch.hash(&mut h);
    cache_dir().join(format!("{:016x}-{arch}.ptx", h.finish()))
}

/// Whether `arch` names a virtual architecture NVRTC targets:
/// `compute_` and a compute capability of two or three digits, optionally
/// with the architecture-specific `a` suffix (`compute_90a`).
pub fn valid_arch(arch: &str) -> bool {
    let Some(cc) = arch.strip_prefix("compute_") else { return false };
    let digits = cc.strip_suffix('a').unwrap_or(cc);
    (2..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit())
}

/// PTX for `arch` (e.g. `compute_90a`), from the disk cache when present.
pub fn ptx(arch: &'static str) -> Result<Ptx> {
    let path = cache_path(arch);
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile(arch)?;
    // Best effort: a read-only cache only costs a recompile next time.
    let _ = write_cache(&path, &ptx);
    Ok(ptx)
}

/// The kernels compiled by NVRTC for `arch`.
fn compile(arch: &'static str) -> Result<Ptx> {
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths: vec![include_dir()?],
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(KERNELS, opts).map_err(|e| Error::Invalid(format!("NVRTC: {e}")))
}

/// Writes `ptx` to the cache file `path` whole (a temporary file renamed),
/// so a reader never sees part of it.
fn write_cache(path: &std::path::Path, ptx: &Ptx) -> std::io::Result<()> {
    std::fs::create_dir_all(cache_dir())?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, ptx.to_src())?;
    std::fs::rename(&tmp, path)
}

/// Compiles the kernels for `arch` into the disk cache (see [`ptx`]) on a
/// machine that need not have a GPU, unless the cache holds them already: a
/// later run on a device of that architecture loads them instead of
/// compiling at first use. Needs NVRTC and CUDA's headers; returns the
/// cache file.
pub fn prebuild(arch: &str) -> Result<PathBuf> {
    if !valid_arch(arch) {
        return Err(Error::Invalid(format!(
            "--arch {arch}: expected compute_ and a compute capability, e.g. compute_90a (H100, H200) or compute_89"
        )));
    }
    // SAFETY: only tries to open the shared library (cudarc panics on first
    // use of one it cannot load).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Invalid("NVRTC (libnvrtc) is not installed or not on the library path".into()));
    }
    let path = cache_path(arch);
    if !path.exists() {
        let ptx = compile(Box::leak(arch.to_string().into_boxed_str()))?;
        write_cache(&path, &ptx).map_err(|e| Error::Invalid(format!("writing {}: {e}", path.display())))?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_are_compute_capabilities() {
        for ok in ["compute_90a", "compute_90", "compute_89", "compute_100a", "compute_120"] {
            assert!(valid_arch(ok), "{ok}");
        }
        for bad in ["sm_90a", "compute_", "compute_9", "compute_9x", "compute_1000", "90a", "compute_90b"] {
            assert!(!valid_arch(bad), "{bad}");
        }
    }
}
