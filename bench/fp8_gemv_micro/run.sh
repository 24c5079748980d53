#!/usr/bin/env bash
# On the GPU machine (nvcc there): build and run the FP8 GEMV micro benchmark.
# Usage: bash bench/fp8_gemv_micro/run.sh
set -euo pipefail
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
nvcc -O3 -arch=sm_90 -std=c++17 -I. -I../../crates/qinfer/src/backend/cuda -o /tmp/fp8_gemv_micro micro.cu
/tmp/fp8_gemv_micro
