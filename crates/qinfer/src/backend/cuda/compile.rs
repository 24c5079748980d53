//! Kernels are CUDA C++ sources embedded in the binary, one translation unit
//! per op family (each `.cu` file `#include`s the headers it uses, given to
//! NVRTC by name), compiled by NVRTC at first use for the device's compute
//! capability and cached on disk, a file per unit keyed by a hash of its
//! source, the headers and the architecture.

use std::ffi::{CStr, CString, c_char};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use cudarc::nvrtc::{Ptx, result, sys};

use crate::{Error, Result};

/// One `.cu` file of the kernels, compiled on its own.
pub struct Unit {
    pub name: &'static str,
    pub source: &'static str,
}

macro_rules! unit {
    ($file:literal) => {
        Unit { name: $file, source: include_str!($file) }
    };
}

/// Every translation unit of the kernels.
pub const UNITS: &[Unit] = &[
    unit!("linear.cu"),
    unit!("affine_gemv.cu"),
    unit!("affine_mma.cu"),
    unit!("affine_gemm.cu"),
    unit!("affine_gemm4.cu"),
    unit!("fp8.cu"),
    unit!("attention.cu"),
    unit!("batch.cu"),
    unit!("kv_coded.cu"),
    unit!("flash.cu"),
    unit!("norm_rope.cu"),
    unit!("elementwise.cu"),
    unit!("gdn.cu"),
    unit!("gdn_chunked.cu"),
    unit!("moe.cu"),
    unit!("moe_gemm.cu"),
    unit!("sampling.cu"),
    unit!("vision.cu"),
];

/// The headers the units may include, by the name they include them by,
/// besides the generated `constants.cuh` (see [`headers`]).
const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("common.cuh")),
    ("affine.cuh", include_str!("affine.cuh")),
    ("gemv.cuh", include_str!("gemv.cuh")),
    ("kv.cuh", include_str!("kv.cuh")),
    ("rope.cuh", include_str!("rope.cuh")),
];

/// Every header the units may include: [`HEADERS`] and the shared
/// constants (constants.rs).
fn headers() -> Vec<(&'static str, String)> {
    let mut all: Vec<(&'static str, String)> = HEADERS.iter().map(|(n, t)| (*n, t.to_string())).collect();
    all.push(("constants.cuh", super::constants::header()));
    all
}

/// NVRTC's options besides the architecture and the include path.
const OPTIONS: &[&str] = &["--std=c++17"];

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

/// The cache file of `unit`'s PTX for `arch`: keyed by a hash of its source,
/// every header (the generated one included), the options and the architecture.
pub fn cache_path(unit: &Unit, arch: &str) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    unit.source.hash(&mut h);
    headers().hash(&mut h);
    OPTIONS.hash(&mut h);
    arch.hash(&mut h);
    let stem = unit.name.trim_end_matches(".cu");
    cache_dir().join(format!("{:016x}-{stem}-{arch}.ptx", h.finish()))
}

/// Whether `arch` names a virtual architecture NVRTC targets:
/// `compute_` and a compute capability of two or three digits, optionally
/// with the architecture-specific `a` suffix (`compute_90a`).
pub fn valid_arch(arch: &str) -> bool {
    let Some(cc) = arch.strip_prefix("compute_") else { return false };
    let digits = cc.strip_suffix('a').unwrap_or(cc);
    (2..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Every unit's PTX for `arch` (e.g. `compute_90a`), in [`UNITS`]' order:
/// from the disk cache where present, the others compiled side by side.
pub fn ptx(arch: &str) -> Result<Vec<Ptx>> {
    let cached: Vec<Option<String>> = UNITS.iter().map(|u| std::fs::read_to_string(cache_path(u, arch)).ok()).collect();
    let compiled = compile_missing(arch, &cached.iter().map(Option::is_none).collect::<Vec<_>>())?;
    let mut out = Vec::with_capacity(UNITS.len());
    for ((unit, text), fresh) in UNITS.iter().zip(cached).zip(compiled) {
        if let Some(ptx) = &fresh {
            // Best effort: a read-only cache only costs a recompile next time.
            let _ = write_cache(&cache_path(unit, arch), ptx);
        }
        out.push(Ptx::from_src(fresh.or(text).expect("a unit is cached or compiled")));
    }
    Ok(out)
}

/// The units `missing` names compiled, each on its own thread; None for
/// the others.
fn compile_missing(arch: &str, missing: &[bool]) -> Result<Vec<Option<String>>> {
    let include = if missing.contains(&true) { include_dir()? } else { String::new() };
    std::thread::scope(|s| {
        let jobs: Vec<_> = UNITS
            .iter()
            .zip(missing)
            .map(|(unit, &missing)| {
                let include = &include;
                s.spawn(move || missing.then(|| compile(unit, arch, include)).transpose())
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().unwrap_or_else(|_| Err(Error::Invalid("NVRTC: a compile panicked".into()))))
            .collect()
    })
}

/// `unit` compiled by NVRTC for `arch`, with [`headers`] as its include
/// files and CUDA's headers under `include`: its PTX.
fn compile(unit: &Unit, arch: &str, include: &str) -> Result<String> {
    let fail = |what: &str, e: &dyn std::fmt::Debug| Error::Invalid(format!("NVRTC: {}: {what}: {e:?}", unit.name));
    let cstr = |s: &str| CString::new(s).expect("kernel sources hold no NUL");
    let source = cstr(unit.source);
    let name = cstr(unit.name);
    let headers = headers();
    let contents: Vec<CString> = headers.iter().map(|(_, text)| cstr(text)).collect();
    let names: Vec<CString> = headers.iter().map(|(n, _)| cstr(n)).collect();
    let content_ptrs: Vec<*const c_char> = contents.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is to a NUL-terminated string that outlives the
    // program, the two header arrays hold `headers.len()` pointers each.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            source.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            content_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| fail("creating the program", &e))?;
    let mut options = vec![format!("--gpu-architecture={arch}"), format!("--include-path={include}")];
    options.extend(OPTIONS.iter().map(|o| o.to_string()));
    // SAFETY: `prog` was created above and is destroyed once, below.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let ptx = match compiled {
        // SAFETY: as above.
        Ok(()) => unsafe { result::get_ptx(prog) }.map_err(|e| fail("reading the PTX", &e)),
        Err(e) => {
            // SAFETY: as above; the log is NUL-terminated.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned())
                .unwrap_or_default();
            Err(Error::Invalid(format!("NVRTC: {}: {e:?}\n{log}", unit.name)))
        }
    };
    // SAFETY: as above.
    let _ = unsafe { result::destroy_program(prog) };
    // SAFETY: NVRTC's PTX is NUL-terminated.
    ptx.map(|p| unsafe { CStr::from_ptr(p.as_ptr()) }.to_string_lossy().into_owned())
}

/// Writes `ptx` to the cache file `path` whole (a temporary file renamed),
/// so a reader never sees part of it.
fn write_cache(path: &std::path::Path, ptx: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(cache_dir())?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, ptx)?;
    std::fs::rename(&tmp, path)
}

/// Compiles the kernels for `arch` into the disk cache (see [`ptx`]) on a
/// machine that need not have a GPU, unless the cache holds them already: a
/// later run on a device of that architecture loads them instead of
/// compiling at first use. Needs NVRTC and CUDA's headers; returns the
/// cache directory.
pub fn prebuild(arch: &str) -> Result<PathBuf> {
    if !valid_arch(arch) {
        return Err(Error::Invalid(format!(
            "--arch {arch}: expected compute_ and a compute capability, e.g. compute_90a (H100, H200) or compute_89"
        )));
    }
    // SAFETY: only tries to open the shared library (cudarc panics on first
    // use of one it cannot load).
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Invalid("NVRTC (libnvrtc) is not installed or not on the library path".into()));
    }
    let missing: Vec<bool> = UNITS.iter().map(|u| !cache_path(u, arch).exists()).collect();
    for (unit, ptx) in UNITS.iter().zip(compile_missing(arch, &missing)?) {
        if let Some(ptx) = ptx {
            let path = cache_path(unit, arch);
            write_cache(&path, &ptx).map_err(|e| Error::Invalid(format!("writing {}: {e}", path.display())))?;
        }
    }
    Ok(cache_dir())
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
