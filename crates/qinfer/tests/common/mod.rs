//! Pieces several test binaries share (each uses a part of them).
#![allow(dead_code)]

pub mod engine;
pub mod mlx;
pub mod vision;

use std::path::PathBuf;

use qinfer::formats::TensorSource;
use qinfer::tensor::{DType, Tensor};

/// Every ggml block type qinfer reads, in the order the fixtures list them.
pub const BLOCK_TYPES: [DType; 10] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

/// Six random blocks of a ggml block type and gguf-py's decoding of them
/// (tests/fixtures/gguf_kquants, made by scripts/make_kquant_fixtures.py).
pub fn kquant_fixture(dtype: DType) -> (Vec<u8>, Vec<f32>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_kquants");
    let blocks = std::fs::read(dir.join(format!("{}.blocks", dtype.name()))).unwrap();
    let values = std::fs::read(dir.join(format!("{}.f32", dtype.name()))).unwrap();
    let values = values.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (blocks, values)
}

/// A GGUF file's tensors with every ggml block type decoded to f32 (as
/// ggml decodes them): the exact weights, for a reference that computes with
/// them in f32.
pub struct DecodedBlocks<'a>(pub &'a dyn TensorSource);

impl TensorSource for DecodedBlocks<'_> {
    fn tensor(&self, name: &str) -> qinfer::Result<Tensor> {
        let t = self.0.tensor(name)?;
        match t.dtype {
            DType::F32 | DType::F16 | DType::BF16 | DType::U32 => Ok(t),
            _ => Tensor::from_f32(&t.name, t.shape.clone(), &t.to_f32_vec()),
        }
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn names(&self) -> Vec<String> {
        self.0.names()
    }
    fn raw_tensor(&self, name: &str) -> qinfer::Result<Tensor> {
        self.0.raw_tensor(name)
    }
}

/// Whether this run must not skip anything: `.ci/run` sets `QINFER_CI=1`,
/// so a test that cannot find what it needs fails there instead of passing.
pub fn must_not_skip() -> bool {
    std::env::var_os("QINFER_CI").is_some_and(|v| v == "1")
}

/// Skips the calling test with `reason`, or fails it under CI.
pub fn skip(reason: &str) {
    assert!(!must_not_skip(), "QINFER_CI=1 forbids skipping: {reason}");
    eprintln!("skipping: {reason}");
}

/// The default model (SmolLM2-135M-Instruct Q4_1) where
/// `scripts/fetch_default_model.sh` puts it: `$QINFER_CACHE/models`, else
/// `~/.cache/qinfer/models`. None (after [`skip`]) when it is absent.
pub fn default_model() -> Option<PathBuf> {
    let cache = std::env::var_os("QINFER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/qinfer")))?;
    let p = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        skip(&format!("{} not found (run scripts/fetch_default_model.sh)", p.display()));
        None
    }
}

/// The fixture directories under `tests/fixtures/<under>`, which must be
/// exactly `expected` (sorted), each holding `file`: a missing, extra or
/// incomplete fixture fails instead of shrinking what is checked.
/// Every tiny model scripts/make_fixtures.py and make_fixtures_hybrid.py
/// write under tests/fixtures/tiny.
pub const TINY_FIXTURES: [&str; 12] = [
    "llama",
    "llama3_rope_mha",
    "qwen2",
    "qwen2_sliding",
    "qwen3",
    "qwen3_5",
    "qwen3_5_gdn128",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_moe_norm",
    "qwen3_mqa",
    "qwen3_next",
];

pub fn exact_fixture_dirs(under: &str, expected: &[&str], file: &str) -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(under);
    let mut found: Vec<String> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    found.sort();
    assert_eq!(found, expected, "fixture directories under {}", root.display());
    expected
        .iter()
        .map(|name| {
            let dir = root.join(name);
            assert!(dir.join(file).is_file(), "{} lacks {file}", dir.display());
            dir
        })
        .collect()
}
