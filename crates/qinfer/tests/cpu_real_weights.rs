//! The CPU matmul on the default model's real quantized weights agrees with
//! the scalar reference dot product.

mod common;

use qinfer::backend::cpu::matmul::{CpuMatrix, matmul};
use qinfer::backend::cpu::q8::{self, Q8Block};
use qinfer::formats::TensorSource;
use qinfer::formats::gguf::GgufFile;
use qinfer::tensor::Bytes;

/// The default model's real weights through the tiled (and SIMD) matmul
/// against the scalar dot product of each row with the same Q8_0 activations.
#[test]
fn real_weights_match_scalar_dot() {
    let Some(path) = common::default_model() else { return };
    let f = GgufFile::open(&path).unwrap();
    let mut checked = 0;
    for name in f.names().iter().filter(|n| n.starts_with("blk.0.") || n.starts_with("token_embd")) {
        let t = f.raw_tensor(name).unwrap();
        if t.shape.len() != 2 || !t.dtype.is_quantized() {
            continue;
        }
        let w = CpuMatrix { dtype: t.dtype, rows: t.shape[0], cols: t.shape[1], data: t.data.clone() };
        let rows = w.rows.min(2048);
        let w = CpuMatrix { rows, data: Bytes::from_vec(t.data.as_slice()[..rows * w.row_bytes()].to_vec()), ..w };
        let n = 37;
        let mut seed = 5u64;
        let x: Vec<f32> = (0..n * w.cols)
            .map(|i| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if i % 97 == 0 { u * 40.0 } else { u }
            })
            .collect();
        let mut out = vec![0f32; n * rows];
        matmul(&x, n, &w, &mut out);
        let rb = w.row_bytes();
        let mut xq = vec![Q8Block::ZERO; w.cols / 32];
        let mut worst = 0f32;
        for tt in 0..n {
            q8::quantize_row_scalar(&x[tt * w.cols..(tt + 1) * w.cols], &mut xq);
            let want: Vec<f32> =
                (0..rows).map(|r| q8::dot(w.dtype, &w.data.as_slice()[r * rb..(r + 1) * rb], &xq)).collect();
            // Relative to the token's largest output, so that outputs near 0
            // (where any summation order cancels differently) do not dominate.
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (r, want) in want.iter().enumerate() {
                worst = worst.max((out[tt * rows + r] - want).abs() / scale);
            }
        }
        println!("{name} {:?} [{}x{}]: worst error {worst:e} of the largest output", w.dtype, rows, w.cols);
        // Both sum the same integer products per block; only the f32 order
        // of the per-block scale products differs.
        assert!(worst < 1e-5, "{name}: worst error {worst:e} of the largest output against the scalar dot");
        checked += 1;
    }
    assert!(checked >= 7, "only {checked} quantized matrices of layer 0 and the embedding checked");
}
