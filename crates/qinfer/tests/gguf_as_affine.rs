//! ggml block types as affine weights (how the CUDA backend takes GGUF
//! matrices): the affine form decodes to gguf-py's `gguf.quants.dequantize`
//! of the same blocks (tests/fixtures/gguf_kquants, made by
//! scripts/make_kquant_fixtures.py), value for value, whatever the rows'
//! length, with groups of 16 values for the types whose scales cover 16
//! (Q2_K, Q3_K, Q6_K) and of 32 for the others.

use std::path::PathBuf;

mod common;

use common::{DecodedBlocks, kquant_fixture as fixture};
use qinfer::backend::cpu::CpuBackend;
use qinfer::formats::TensorSource;
use qinfer::loader;
use qinfer::models::decoder::DecoderModel;
use qinfer::models::{LanguageModel, Logits};
use qinfer::quant::affine::{AffineParts, unpack};
use qinfer::quant::gguf_affine::{
    SUPERBLOCK_RECORD, SUPERBLOCK_RECORD_Q2K, SUPERBLOCK_RECORD_Q6K, affine_bits, affine_group_size, affine_levels,
    as_affine, record_scale_bias, superblock_record_bytes, superblock_records,
};
use qinfer::tensor::{Bytes, DType, Tensor};

fn f32s(t: &Tensor) -> Vec<f32> {
    t.data.as_slice().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn affine_form_decodes_as_gguf_py() {
    for dtype in common::BLOCK_TYPES {
        let (blocks, want) = fixture(dtype);
        let n_blocks = blocks.len() / dtype.block_bytes();
        // The six blocks as one row, as six rows, and as two rows of three.
        for rows in [1, n_blocks, 2] {
            let cols = want.len() / rows;
            let t = Tensor::new("w".into(), dtype, vec![rows, cols], Bytes::from_vec(blocks.clone())).unwrap();
            let a = as_affine(&t).expect("an affine form").unwrap();
            let (bits, group) = (affine_bits(dtype).unwrap(), affine_group_size(dtype));
            let sixteen = matches!(dtype, DType::Q2_K | DType::Q3_K | DType::Q6_K);
            assert_eq!(group, if sixteen { 16 } else { 32 }, "{dtype:?}");
            assert_eq!((a.params.bits, a.params.group_size, a.shape.clone()), (bits, group, vec![rows, cols]));
            let (scales, biases) = (f32s(&a.scales), f32s(&a.biases));
            let row_bytes = a.params.row_bytes(cols);
            let mut q = vec![0f32; cols];
            for r in 0..rows {
                unpack(bits, &a.packed.data.as_slice()[r * row_bytes..(r + 1) * row_bytes], &mut q);
                for (c, &level) in q.iter().enumerate() {
                    let g = r * cols / group + c / group;
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

/// The GPU's compact K-quant scales (16-, 18- and 20-byte records per
/// super-block) hold exactly the affine form's scales and biases, so the
/// levels decode through them to gguf-py's values too.
#[test]
fn superblock_records_decode_as_gguf_py() {
    for dtype in common::BLOCK_TYPES {
        let (blocks, want) = fixture(dtype);
        let n_blocks = blocks.len() / dtype.block_bytes();
        let t = Tensor::new("w".into(), dtype, vec![1, want.len()], Bytes::from_vec(blocks.clone())).unwrap();
        let Some(records) = superblock_records(&t) else {
            assert!(!dtype.name().ends_with("_K"), "{dtype:?} has records");
            continue;
        };
        let t = Tensor::new("w".into(), dtype, vec![n_blocks, 256], Bytes::from_vec(blocks.clone())).unwrap();
        let records = records.unwrap();
        let size = superblock_record_bytes(affine_bits(dtype).unwrap()).unwrap();
        let expected = match dtype {
            DType::Q2_K => SUPERBLOCK_RECORD_Q2K,
            DType::Q3_K | DType::Q6_K => SUPERBLOCK_RECORD_Q6K,
            _ => SUPERBLOCK_RECORD,
        };
        assert_eq!(size, expected, "{dtype:?}");
        assert_eq!(records.len(), n_blocks * size);
        let a = as_affine(&t).unwrap().unwrap();
        // The GPU copy's levels come without the f32 sides: the same bytes.
        let levels = affine_levels(&t).unwrap().unwrap();
        assert_eq!((levels.params, levels.rows, levels.cols), (a.params, n_blocks, 256), "{dtype:?}");
        assert!(levels.packed == a.packed.data.as_slice(), "{dtype:?} levels differ from the affine form's");
        let (scales, biases) = (f32s(&a.scales), f32s(&a.biases));
        let row_bytes = a.params.row_bytes(256);
        let mut q = vec![0f32; 256];
        let group = affine_group_size(dtype);
        let groups = 256 / group;
        for b in 0..n_blocks {
            let record = &records[b * size..(b + 1) * size];
            unpack(a.params.bits, &levels.packed[b * row_bytes..(b + 1) * row_bytes], &mut q);
            for j in 0..groups {
                let (scale, bias) = record_scale_bias(dtype, record, j);
                assert_eq!(
                    (scale.to_bits(), bias.to_bits()),
                    (scales[b * groups + j].to_bits(), biases[b * groups + j].to_bits())
                );
                for c in group * j..group * (j + 1) {
                    let w = want[b * 256 + c];
                    assert!(scale * q[c] + bias == w, "{dtype:?} block {b} value {c}");
                }
            }
        }
    }
}

#[test]
fn float_types_have_no_affine_form() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let t = Tensor::new("w".into(), dtype, vec![1, 32], Bytes::from_vec(vec![0u8; dtype.bytes_for(32).unwrap()]))
            .unwrap();
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

/// A GGUF file's matrices as the affine weights `as_affine` makes of them
/// (what the CUDA backend computes with).
struct AffineBlocks<'a>(&'a dyn TensorSource);

impl TensorSource for AffineBlocks<'_> {
    fn tensor(&self, name: &str) -> qinfer::Result<Tensor> {
        self.0.tensor(name)
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
    fn affine_parts(&self, name: &str) -> qinfer::Result<Option<AffineParts>> {
        if !self.0.contains(name) {
            return Ok(None);
        }
        let t = self.0.tensor(name)?;
        match (t.shape.len(), as_affine(&t)) {
            (2, Some(a)) => {
                let a = a?;
                Ok(Some(AffineParts { packed: a.packed, scales: a.scales, biases: a.biases, declared: Some(a.params) }))
            }
            _ => Ok(None),
        }
    }
}

/// The llama.cpp-quantized fixtures (tests/fixtures/gguf_quant, every matrix
/// in the type) with their matrices rewritten as affine weights, run by the
/// CPU's affine kernels, against the same model with the blocks decoded to
/// f32: the rewrite holds at the level of a whole model (embedding, stacked
/// projections, head). Measured equal (the CPU's affine kernels decode and
/// sum in the f32 path's order); scaling one type's biases by 1 + 1e-4 moves
/// the logits by 5.7e-2, far past the bound.
#[test]
fn models_run_on_their_affine_form() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_quant");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let ids: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    for name in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"] {
        let m = loader::open(&dir.join(name).join("model.gguf")).unwrap();
        let logits = |src: &dyn TensorSource| {
            let lm = DecoderModel::load(m.config.clone(), src, CpuBackend::new(), &|_| {}).unwrap();
            let mut seq = lm.new_sequence(ids.len());
            lm.forward(seq.as_mut(), &ids, Logits::All).unwrap()
        };
        let want = logits(&DecodedBlocks(m.source.as_ref()));
        let got = logits(&AffineBlocks(m.source.as_ref()));
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        println!("{name} as affine: max |Δlogit| {d:.2e} against the decoded weights (logits up to {scale:.1})");
        assert!(d <= 1e-4 * scale, "{name}: {d}");
    }
}
