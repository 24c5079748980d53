//! `quantize` writes what mlx-lm writes: the packed words equal mlx-lm's own
//! conversion of the same model (tests/fixtures/mlx, converted from f32-widened
//! weights as our quantizer reads them), and the result loads and runs close to
//! the unquantized model.

use std::path::{Path, PathBuf};

use qinfer::loader;
use qinfer::models::Logits;
use qinfer::quantize::{QuantizeOptions, Recipe, quantize};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn out_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qinfer-quantize-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn run(tag: &str, bits: u32, group_size: usize, recipe: Option<Recipe>) -> PathBuf {
    let out = out_dir(tag);
    let opts = QuantizeOptions { bits, group_size, recipe, dtype: None, force: false };
    quantize(&fixtures().join("tiny/qwen3"), &out, &opts, &|_, _| {}).unwrap();
    out
}

#[test]
fn packed_words_equal_mlx_lm_conversion() {
    for (tag, bits, gs, recipe) in [
        ("qwen3_q8_g32", 8, 32, None),
        ("qwen3_q3_g32", 3, 32, None),
        ("qwen3_mixed_3_6", 3, 32, Some(Recipe::Mixed3_6)),
    ] {
        let ours = loader::open(&run(tag, bits, gs, recipe)).unwrap();
        let theirs = loader::open(&fixtures().join("mlx").join(tag)).unwrap();
        let mut compared = 0;
        for name in theirs.source.names() {
            let t = theirs.source.tensor(&name).unwrap();
            if name.ends_with(".weight") && t.dtype == qinfer::tensor::DType::U32 {
                let o = ours.source.tensor(&name).unwrap_or_else(|e| panic!("{tag}: {e}"));
                assert_eq!(o.shape, t.shape, "{tag} {name}");
                assert!(o.data.as_slice() == t.data.as_slice(), "{tag} {name}: packed words differ");
                compared += 1;
            }
        }
        assert!(compared >= 15, "{tag}: {compared}");
    }
}

#[test]
fn quantized_model_runs_close_to_the_original() {
    let dir = fixtures().join("tiny/qwen3");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let input: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
    for (bits, bound) in [(8, 0.5), (4, 5.0)] {
        let out = run(&format!("close{bits}"), bits, 64, None);
        let lm = loader::open(&out).unwrap().load_cpu(false).unwrap();
        let mut seq = lm.new_sequence(input.len());
        let got = lm.forward(seq.as_mut(), &input, Logits::All).unwrap();
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{bits}-bit: max |Δlogit| vs unquantized = {d:.3}");
        assert!(d < bound, "{bits}-bit: {d}");
    }
}

#[test]
fn existing_output_is_refused_unless_forced() {
    let out = run("force", 4, 64, None);
    let opts = QuantizeOptions { bits: 4, group_size: 64, recipe: None, dtype: None, force: false };
    let e = quantize(&fixtures().join("tiny/qwen3"), &out, &opts, &|_, _| {}).unwrap_err().to_string();
    assert!(e.contains("--force"), "{e}");
    let opts = QuantizeOptions { force: true, ..opts };
    quantize(&fixtures().join("tiny/qwen3"), &out, &opts, &|_, _| {}).unwrap();
    let bad = QuantizeOptions { bits: 7, ..opts };
    let e = quantize(&fixtures().join("tiny/qwen3"), &out_dir("bad"), &bad, &|_, _| {}).unwrap_err().to_string();
    assert!(e.contains("bits"), "{e}");
    assert!(!out_dir("bad").exists());
}
