//! Malformed MLX checkpoints: errors that name the tensor or config field, never panics.

use std::path::{Path, PathBuf};

use qinfer::loader;
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mlx/qwen3_q4_g64")
}

/// A copy of the fixture whose config.json and safetensors header pass through the edits.
fn variant(
    tag: &str,
    edit_config: impl Fn(&mut Value),
    edit_header: impl Fn(&mut serde_json::Map<String, Value>),
) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qinfer-mlx-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    edit_config(&mut cfg);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit_header(&mut header);
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(d.join("model.safetensors"), out).unwrap();
    d
}

fn load_error(dir: &Path) -> String {
    match loader::open(dir) {
        Err(e) => e.to_string(),
        Ok(m) => match m.load_cpu(false) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{} loaded", dir.display()),
        },
    }
}

const Q: &str = "model.layers.0.self_attn.q_proj";
const K: &str = "model.layers.0.self_attn.k_proj";

#[test]
fn unsupported_mode_names_the_field() {
    let d = variant("mode", |c| c["quantization"]["mode"] = "mxfp4".into(), |_| {});
    let e = load_error(&d);
    assert!(e.contains("config.json") && e.contains("quantization.mode") && e.contains("mxfp4"), "{e}");
}

#[test]
fn missing_biases_name_the_tensor() {
    let d = variant(
        "biases",
        |_| {},
        |h| {
            let v = h.remove(&format!("{Q}.biases")).unwrap();
            h.insert(format!("{Q}.unused"), v);
        },
    );
    let e = load_error(&d);
    assert!(e.contains(&format!("{Q}.biases")) && e.contains("missing"), "{e}");
}

#[test]
fn scales_of_the_wrong_shape_name_the_tensor() {
    let d = variant(
        "scales",
        |_| {},
        |h| {
            let q = h.remove(&format!("{Q}.scales")).unwrap();
            let k = h.remove(&format!("{K}.scales")).unwrap();
            h.insert(format!("{Q}.scales"), k);
            h.insert(format!("{K}.scales"), q);
        },
    );
    let e = load_error(&d);
    assert!(e.contains(&format!("{Q}.scales")) && e.contains("does not match"), "{e}");
}

#[test]
fn declared_bits_that_disagree_with_the_shapes_are_errors() {
    let d = variant("declared", |c| c["quantization"][Q] = serde_json::json!({"group_size": 64, "bits": 8}), |_| {});
    let e = load_error(&d);
    assert!(e.contains(&format!("{Q}.weight")) && e.contains("declares 8 bits"), "{e}");
}

#[test]
fn quantized_tensors_without_a_quantization_block_are_errors() {
    let d = variant(
        "noblock",
        |c| {
            let o = c.as_object_mut().unwrap();
            o.remove("quantization");
            o.remove("quantization_config");
        },
        |_| {},
    );
    let e = load_error(&d);
    assert!(e.contains("no `quantization` block"), "{e}");
}
