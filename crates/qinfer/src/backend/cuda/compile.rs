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

/// PTX for `arch` (e.g. `compute_90a`), from the disk cache when present.
pub fn ptx(arch: &'static str) -> Result<Ptx> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    KERNELS.hash(&mut h);
    arch.hash(&mut h);
    let path = cache_dir().join(format!("{:016x}-{arch}.ptx", h.finish()));
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(Ptx::from_src(text));
    }
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths: vec![include_dir()?],
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(KERNELS, opts).map_err(|e| Error::Invalid(format!("NVRTC: {e}")))?;
    // Best effort: a read-only cache only costs a recompile next time.
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}
