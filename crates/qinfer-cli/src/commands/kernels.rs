//! `qinfer kernels`: compile the CUDA kernels into the kernel cache ahead of
//! time, on a machine that need not have a GPU (a container build, say), so
//! that the first run on the device does not spend its start compiling.

use anyhow::Result;
use clap::Parser;

#[derive(Parser)]
pub struct Args {
    /// The GPU architecture as NVRTC names it: compute_90a for H100 and
    /// H200, compute_89 for L4 and L40S, compute_80 for A100.
    #[arg(long)]
    arch: String,
}

#[cfg(feature = "cuda")]
pub fn main(a: Args) -> Result<()> {
    let path = qinfer::backend::cuda::prebuild_kernels(&a.arch)?;
    println!("{}", path.display());
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn main(a: Args) -> Result<()> {
    anyhow::bail!("kernels for {}: this build has no CUDA support: rebuild with `--features cuda`", a.arch)
}
