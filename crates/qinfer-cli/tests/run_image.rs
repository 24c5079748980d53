//! `qinfer run --image` end to end on the tiny Qwen3.5 with a vision tower
//! (`scripts/make_fixtures_vision.py`): its chat template places the image,
//! and the answer is transformers' greedy continuation of the same chat.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

fn qinfer(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qinfer")).args(args).output().unwrap()
}

#[test]
fn run_with_an_image_answers_as_transformers() {
    let model = fixture().join("qwen3_5");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(model.join("reference.json")).unwrap()).unwrap();
    let chat = &r["chat"];
    let image = fixture().join("images").join(chat["image"].as_str().unwrap());
    let out = qinfer(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--image",
        image.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        chat["text"].as_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim(), chat["greedy_text"].as_str().unwrap(), "{stderr}");
    assert!(stderr.contains("(1 images)"), "{stderr}");
}

#[test]
fn images_for_a_text_only_model_or_undecodable_files_are_refused() {
    let text_model = fixture().join("../tiny/qwen3");
    let image = fixture().join("images/a.png");
    let out = qinfer(&["run", "--model", text_model.to_str().unwrap(), "--image", image.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("takes no images"));
    let not_image = fixture().join("qwen3_5/config.json");
    let model = fixture().join("qwen3_5");
    let out = qinfer(&["run", "--model", model.to_str().unwrap(), "--image", not_image.to_str().unwrap(), "hi"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("config.json") && stderr.contains("cannot decode the image"), "{stderr}");
}

/// A Qwen3.5 GGUF takes images with llama.cpp's projector file beside it
/// (`--mmproj`; tests/fixtures/gguf_vision, whose tower and logits are
/// checked against transformers in crates/qinfer/tests/vision_model.rs),
/// and without it says where the tower would come from.
#[test]
fn a_gguf_takes_images_with_its_projector() {
    let d = fixture().join("../gguf_vision/qwen35");
    let (model, mmproj) = (d.join("model.gguf"), d.join("mmproj.gguf"));
    let image = fixture().join("images/a.png");
    let args = ["run", "--model", model.to_str().unwrap(), "--image", image.to_str().unwrap(), "--max-tokens", "4"];
    let out = qinfer(&[&args[..], &["--mmproj", mmproj.to_str().unwrap(), "w5 w17"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("(1 images)"), "{stderr}");
    let out = qinfer(&[&args[..], &["w5 w17"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("takes no images") && stderr.contains("--mmproj"), "{stderr}");
}
