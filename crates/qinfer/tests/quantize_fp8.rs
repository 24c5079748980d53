//! `qinfer quantize --format fp8` against transformers' FP8 quantizer: the
//! tiny models of tests/fixtures/tiny quantized by transformers' own
//! `Fp8Quantize` (scripts/make_fixtures_fp8.py, the cases whose blocks divide
//! every quantized matrix) must come out tensor for tensor, byte for byte.

use std::path::{Path, PathBuf};

use qinfer::formats::TensorSource;
use qinfer::formats::safetensors::SafetensorsSource;
use qinfer::quantize::{Fp8QuantizeOptions, quantize_fp8};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn out_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qinfer-fp8-quantize-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn output_equals_transformers_fp8_quantizer() {
    for (tiny, block, case) in [
        ("qwen3", [32, 32], "qwen3_b32"),
        ("qwen3_moe", [16, 32], "qwen3_moe_b16x32"),
        ("qwen3_5", [32, 32], "qwen3_5_b32"),
    ] {
        let out = out_dir(case);
        let opts = Fp8QuantizeOptions { block, force: false };
        quantize_fp8(&fixtures().join("tiny").join(tiny), &out, &opts, &|_, _| {}).unwrap();
        let want_dir = fixtures().join("fp8").join(case);
        let got = SafetensorsSource::open_dir(&out).unwrap();
        let want = SafetensorsSource::open_dir(&want_dir).unwrap();
        let (mut gn, mut wn) = (got.names(), want.names());
        gn.sort();
        wn.sort();
        assert_eq!(gn, wn, "{case}: tensor names");
        let mut fp8 = 0;
        for n in &wn {
            let (g, w) = (got.raw_tensor(n).unwrap(), want.raw_tensor(n).unwrap());
            assert_eq!((g.dtype, &g.shape), (w.dtype, &w.shape), "{case}: {n}");
            assert!(g.data.as_slice() == w.data.as_slice(), "{case}: {n} bytes differ");
            fp8 += usize::from(g.dtype == qinfer::tensor::DType::F8_E4M3);
        }
        assert!(fp8 > 0, "{case}: nothing quantized");
        assert_eq!(config(&out)["quantization_config"], config(&want_dir)["quantization_config"], "{case}");
        // The result loads and runs (parity itself is tests/parity_fp8.rs on the same files).
        qinfer::loader::open(&out).unwrap().load_cpu(false).unwrap();
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn refuses_existing_output_quantized_input_and_bad_blocks() {
    let src = fixtures().join("tiny").join("qwen3");
    let out = out_dir("refuse");
    std::fs::create_dir_all(&out).unwrap();
    let opts = Fp8QuantizeOptions { block: [32, 32], force: false };
    let e = quantize_fp8(&src, &out, &opts, &|_, _| {}).unwrap_err().to_string();
    assert!(e.contains("--force"), "{e}");
    assert!(std::fs::read_dir(&out).unwrap().next().is_none(), "refused output was touched");
    quantize_fp8(&src, &out, &Fp8QuantizeOptions { force: true, ..opts.clone() }, &|_, _| {}).unwrap();
    let again = out_dir("again");
    let e = quantize_fp8(&out, &again, &opts, &|_, _| {}).unwrap_err().to_string();
    assert!(e.contains("already quantized"), "{e}");
    assert!(!again.exists());
    let e = quantize_fp8(&src, &again, &Fp8QuantizeOptions { block: [0, 32], force: false }, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("--block-size"), "{e}");
    std::fs::remove_dir_all(&out).unwrap();
}
