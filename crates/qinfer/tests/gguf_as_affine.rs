//! ggml block types as affine weights (how the CUDA backend takes GGUF
//! matrices): the affine form decodes to gguf-py's `gguf.quants.dequantize`
//! of the same blocks (tests/fixtures/gguf_kquants, made by
//! scripts/make_kquant_fixtures.py), value for value, whatever the rows'
//! length; types whose scales cover 16 values have no affine form.

use std::path::PathBuf;

use qinfer::affine::unpack;
use qinfer::formats::gguf::{affine_bits, as_affine};
use qinfer::tensor::{Bytes, DType, Tensor};

fn fixture(dtype: DType) -> (Vec<u8>, Vec<f32>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_kquants");
    let blocks = std::fs::read(dir.join(format!("{}.blocks", dtype.name()))).unwrap();
    let values = std::fs::read(dir.join(format!("{}.f32", dtype.name()))).unwrap();
    let values = values.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (blocks, values)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.data.as_slice().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn affine_form_decodes_as_gguf_py() {
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K, DType::Q5_K] {
        let (blocks, want) = fixture(dtype);
        let n_blocks = blocks.len() / dtype.block_bytes();
        // The six blocks as one row, as six rows, and as two rows of three.
        for rows in [1, n_blocks, 2] {
            let cols = want.len() / rows;
            let t = Tensor::new("w".into(), dtype, vec![rows, cols], Bytes::from_vec(blocks.clone())).unwrap();
            let a = as_affine(&t).expect("an affine form").unwrap();
            let bits = affine_bits(dtype).unwrap();
            assert_eq!((a.params.bits, a.params.group_size, a.shape.clone()), (bits, 32, vec![rows, cols]));
            let (scales, biases) = (f32s(&a.scales), f32s(&a.biases));
            let row_bytes = a.params.row_bytes(cols);
            let mut q = vec![0f32; cols];
            for r in 0..rows {
                unpack(bits, &a.packed.data.as_slice()[r * row_bytes..(r + 1) * row_bytes], &mut q);
                for (c, &level) in q.iter().enumerate() {
                    let g = r * cols / 32 + c / 32;
                    let got = scales[g] * level + biases[g];
                    let w = want[r * cols + c];
                    // Equal as numbers (a zero may differ in sign: d·(q − 8)
                    // against d·q − 8d).
                    assert!(got == w, "{dtype:?} {rows} rows: value ({r}, {c}) {got} vs gguf-py {w}");
                }
            }
        }
    }
}

#[test]
fn sixteen_value_scales_have_no_affine_form() {
    for dtype in [DType::Q2_K, DType::Q3_K, DType::Q6_K] {
        let (blocks, want) = fixture(dtype);
        let t = Tensor::new("w".into(), dtype, vec![1, want.len()], Bytes::from_vec(blocks)).unwrap();
        assert!(affine_bits(dtype).is_none() && as_affine(&t).is_none(), "{dtype:?}");
    }
}

#[test]
fn a_vector_is_refused_by_name() {
    let (blocks, want) = fixture(DType::Q8_0);
    let t = Tensor::new("blk.0.v".into(), DType::Q8_0, vec![want.len()], Bytes::from_vec(blocks)).unwrap();
    let e = as_affine(&t).unwrap().unwrap_err().to_string();
    assert!(e.contains("blk.0.v") && e.contains("2-D"), "{e}");
}
