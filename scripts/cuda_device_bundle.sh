#!/usr/bin/env bash
# Builds what one call on the GPU machine needs into .device/ (git-ignored):
# the stripped `qinfer` CLI, the CUDA test binaries (.device/cuda_*,
# .device/kernel_sources) and the GPU profile (.device/cuda_profile), built
# here with the `cuda` feature, and the kernels compiled to PTX for compute_90a (H100/H200)
# in ptx.tar.xz, so the GPU machine's first launch loads them instead of
# spending a minute in NVRTC. bench/cuda_h200.sh unpacks it.
# PTX needs NVRTC here: CUDA_HOME pointing at a CUDA toolkit, or at the pip
# wheels' root (python -m pip install "nvidia-cuda-nvrtc==13.0.*"
# "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"; CUDA_HOME is then
# site-packages/nvidia/cu13). Without it the bundle has no PTX and the GPU
# machine compiles the kernels at first use.
# Usage: scripts/cuda_device_bundle.sh [arch]   (default compute_90a)
set -euo pipefail
cd "$(dirname "$0")/.."
arch="${1:-compute_90a}"
mkdir -p .device
cargo build --release --features cuda --bin qinfer
# The CUDA test binaries (tests/cuda_*.rs, and kernel_sources, which checks
# the kernels against the PTX there) and the GPU profile (benches/cuda_profile.rs).
artifacts() {
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}
rm -f .device/cuda_* .device/kernel_sources
{
  cargo test --release --features cuda -p qinfer --test 'cuda_*' --test kernel_sources --no-run --message-format=json 2>/dev/null
  cargo bench --features cuda -p qinfer --bench cuda_profile --no-run --message-format=json 2>/dev/null
} | artifacts | while read -r name exe; do cp "$exe" ".device/$name"; strip ".device/$name"; done
# Where cargo put the build (CARGO_TARGET_DIR when set).
bin="${CARGO_TARGET_DIR:-target}/release/qinfer"
cp "$bin" .device/qinfer
strip .device/qinfer
rm -f .device/ptx.tar.xz
if [ -n "${CUDA_HOME:-}" ] && { [ -d "$CUDA_HOME/lib" ] || [ -d "$CUDA_HOME/lib64" ]; }; then
  cache=$(mktemp -d)
  LD_LIBRARY_PATH="$CUDA_HOME/lib:$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}" QINFER_CACHE="$cache" \
    "$bin" kernels --arch "$arch"
  tar -C "$cache" -cJf .device/ptx.tar.xz kernels
  rm -rf "$cache"
else
  echo "no CUDA_HOME with NVRTC: the bundle has no PTX (the GPU machine compiles the kernels at first use)" >&2
fi
du -sh .device/*
