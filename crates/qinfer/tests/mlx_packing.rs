//! Affine packing against mlx itself: tests/fixtures/mlx/packing.json holds
//! what `mx.quantize` / `mx.dequantize` (mlx 0.32) give for one 3×128 matrix at
//! every bit width and group size (scripts/make_fixtures_mlx.py).

use std::path::Path;

use qinfer::quant::affine::{pack, quantize_group, unpack};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn fixture() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mlx/packing.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn unpacking_every_width_matches_mx_dequantize() {
    let f = fixture();
    let (rows, cols) = (f["rows"].as_u64().unwrap() as usize, f["cols"].as_u64().unwrap() as usize);
    let cases = f["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 18);
    for c in cases {
        let bits = c["bits"].as_u64().unwrap() as u32;
        let gs = c["group_size"].as_u64().unwrap() as usize;
        let words: Vec<u8> =
            c["packed"].as_array().unwrap().iter().flat_map(|w| (w.as_u64().unwrap() as u32).to_le_bytes()).collect();
        assert_eq!(words.len(), rows * cols * bits as usize / 8);
        let (scales, biases, want) = (floats(&c["scales"]), floats(&c["biases"]), floats(&c["dequantized"]));
        let mut q = vec![0f32; rows * cols];
        unpack(bits, &words, &mut q);
        for (i, (qi, wi)) in q.iter().zip(&want).enumerate() {
            let g = i / gs;
            let got = scales[g] * qi + biases[g];
            assert!((got - wi).abs() <= 1e-6 * (1.0 + wi.abs()), "{bits} bits g{gs} value {i}: {got} vs {wi}");
        }
    }
}

#[test]
fn quantizing_matches_mx_quantize_bit_for_bit() {
    let f = fixture();
    let w = floats(&f["weights"]);
    for c in f["cases"].as_array().unwrap() {
        let bits = c["bits"].as_u64().unwrap() as u32;
        let gs = c["group_size"].as_u64().unwrap() as usize;
        let mut levels = vec![0u8; w.len()];
        let mut scales = Vec::new();
        let mut biases = Vec::new();
        for (g, q) in w.chunks_exact(gs).zip(levels.chunks_exact_mut(gs)) {
            let (s, b) = quantize_group(g, bits, q);
            scales.push(s);
            biases.push(b);
        }
        let mut packed = Vec::new();
        pack(bits, &levels, &mut packed);
        let want: Vec<u8> =
            c["packed"].as_array().unwrap().iter().flat_map(|w| (w.as_u64().unwrap() as u32).to_le_bytes()).collect();
        assert_eq!(scales, floats(&c["scales"]), "{bits} bits g{gs}: scales");
        assert_eq!(biases, floats(&c["biases"]), "{bits} bits g{gs}: biases");
        assert_eq!(packed, want, "{bits} bits g{gs}: packed words");
    }
}
