//! Decoding of every ggml block type qinfer reads, bit for bit against gguf-py's
//! `gguf.quants.dequantize` on random blocks (tests/fixtures/gguf_kquants,
//! made by scripts/make_kquant_fixtures.py), and the Q8_0/Q8_K integer dots
//! against the f64 dot of the decoded weights.

mod common;

use common::kquant_fixture as fixture;
use qinfer::backend::cpu::matmul::{CpuMatrix, matmul};
use qinfer::quant::ggml::dequantize_into;
use qinfer::tensor::Bytes;

#[test]
fn decoding_matches_gguf_py_bit_for_bit() {
    for dtype in common::BLOCK_TYPES {
        let (blocks, want) = fixture(dtype);
        assert_eq!(dtype.bytes_for(want.len()), Some(blocks.len()), "{dtype:?}");
        let mut got = vec![f32::NAN; want.len()];
        dequantize_into(dtype, &blocks, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{dtype:?} value {i}: {g} vs gguf-py {w}");
        }
    }
}

/// One weight row per fixture: the integer matmul against 8-bit activations
/// stays within the activation quantization error of the exact f64 dot.
#[test]
fn integer_matmul_tracks_the_decoded_dot() {
    for dtype in common::BLOCK_TYPES {
        let (blocks, wf) = fixture(dtype);
        let cols = wf.len();
        let w = CpuMatrix { dtype, rows: 1, cols, data: Bytes::from_vec(blocks) };
        let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let mut out = [f32::NAN];
        matmul(&x, 1, &w, &mut out);
        let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        // Each activation moves by at most half a step, amax/254, so the dot
        // moves by at most Σ|w|·amax/254.
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let bound = wf.iter().map(|v| v.abs() as f64).sum::<f64>() * amax / 254.0 + 1e-4;
        assert!((out[0] as f64 - exact).abs() <= bound, "{dtype:?}: {} vs {exact} (bound {bound})", out[0]);
    }
}
