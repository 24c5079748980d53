//! FP8 weights on the GPU against the CPU: the decode GEMV (every activation
//! row count it takes, groups that are and are not multiples of 16, rows with
//! a tail), the prefill's dequantized bf16 tiles, embeddings, and the FP8
//! fixture models (tests/fixtures/fp8) against transformers and the CPU.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use std::path::PathBuf;

use common_cuda::*;
use qinfer::backend::Backend;
use qinfer::backend::cuda::CudaBackend;
use qinfer::backend::ops::FusedOps;
use qinfer::engine::generate::{GenerateOptions, generate};
use qinfer::kv::KvPrecision;
use qinfer::loader;
use qinfer::models::decoder::DecoderModel;
use qinfer::models::{LanguageModel, Logits};
use qinfer::quant::fp8::{Fp8Scaling, Fp8Tensor};
use qinfer::sampling::SamplingParams;
use qinfer::tensor::{Bytes, DType, Tensor};

/// A random FP8 `[rows, cols]` weight with `scaling`'s scales.
fn fp8_tensor(r: &mut Rng, rows: usize, cols: usize, scaling: Fp8Scaling) -> Fp8Tensor {
    // Finite bytes (0x7F/0xFF are NaN): clear bit 3, the exponent's lowest.
    let bytes: Vec<u8> = (0..rows * cols).map(|_| ((r.f() * 1e6) as i64 as u8) & 0xF7).collect();
    let weight = Tensor::new("w".into(), DType::F8_E4M3, vec![rows, cols], Bytes::from_vec(bytes)).unwrap();
    let shape = match scaling {
        Fp8Scaling::Block { rows: bm, cols: bn } => vec![rows.div_ceil(bm), cols.div_ceil(bn)],
        Fp8Scaling::Channel => vec![rows, 1],
        Fp8Scaling::Tensor => vec![1],
    };
    let n: usize = shape.iter().product();
    let s: Vec<f32> = (0..n).map(|_| 1e-3 * (1.5 + r.f())).collect();
    Fp8Tensor::from_stored(weight, Tensor::from_f32("s", shape, &s).unwrap(), scaling).unwrap()
}

#[test]
fn fp8_linear_matches_cpu() {
    let Some(p) = pair() else { return };
    let mut r = Rng::fresh();
    let cases = [
        (4096, 96, Fp8Scaling::Block { rows: 128, cols: 128 }),
        (12288, 40, Fp8Scaling::Block { rows: 128, cols: 128 }), // x too wide for 4 rows a launch
        (1024, 48, Fp8Scaling::Block { rows: 16, cols: 64 }),
        (200, 70, Fp8Scaling::Block { rows: 128, cols: 128 }), // partial edge blocks
        (96, 40, Fp8Scaling::Block { rows: 16, cols: 24 }),    // groups not a multiple of 16
        (100, 33, Fp8Scaling::Channel),                        // rows with a tail
        (512, 64, Fp8Scaling::Tensor),
    ];
    for (inp, out, scaling) in cases {
        let w = fp8_tensor(&mut r, out, inp, scaling);
        let wc = p.cpu.upload_fp8(&w).unwrap();
        let wg = p.gpu.upload_fp8(&w).unwrap();
        let ws = p.split.upload_fp8(&w).unwrap();
        let b = tensor("b", DType::F32, vec![out], &r.vec(out));
        let (bc, bg) = p.weights(&b);
        // The tensor-core GEMV (widths and groups multiples of 64, up to 16
        // rows where x fits its shared memory) splits x in two f16 and sums
        // in f32; the CUDA-core GEMV is f32 math; both on the exact weights.
        // The GEMM path rounds weights and activations to bf16.
        let group = match scaling {
            Fp8Scaling::Block { cols, .. } => cols,
            _ => inp,
        };
        let mma_rows = if inp % 64 == 0 && group % 64 == 0 { if inp > 6000 { 8 } else { 16 } } else { 0 };
        for rows in [1, 2, 3, 8, 9, 16, 40] {
            // Large activations take the kernels' path for values past f16.
            let scale = if rows == 3 { 1e5 } else { 1.0 };
            let x: Vec<f32> = r.vec(rows * inp).iter().map(|v| v * scale).collect();
            let (xc, xg) = p.acts(rows, inp, &x);
            let with_bias = rows % 2 == 1;
            let yc = p.cpu.linear(&xc, &wc, with_bias.then_some(&bc));
            let yg = p.gpu.linear(&xg, &wg, with_bias.then_some(&bg));
            let tol = if rows > 8 && rows > mma_rows { 2e-2 } else { 1e-5 };
            p.check(&format!("fp8 linear {scaling:?} {rows}x{inp}->{out}"), &yc, &yg, tol);
            // The weight as a stacked gate|up: the tensor-core GEMV's swiglu
            // epilogue, or the GEMV and the swiglu kernel.
            if out % 2 == 0 {
                let (sc, sg) = (p.cpu.linear_swiglu(&xc, &wc), p.gpu.linear_swiglu(&xg, &wg));
                p.check(&format!("fp8 linear_swiglu {scaling:?} {rows}x{inp}->2x{}", out / 2), &sc, &sg, tol);
            }
            if rows > 8 {
                let xs = p.split.act_from_host(rows, inp, &p.cpu.to_host(&xc));
                let ys = p.split.linear(&xs, &ws, None);
                let e = rel(&p.split.to_host(&ys), &p.cpu.to_host(&p.cpu.linear(&xc, &wc, None)));
                println!("fp8 linear {scaling:?} {rows}x{inp}->{out} split activations: rel err {e:.2e}");
                assert!(e <= 1e-2, "split activations: {e}");
            }
        }
        let ids = [0u32, (out - 1) as u32, 5];
        let ec = p.cpu.to_host(&p.cpu.embed(&wc, &ids).unwrap());
        let eg = p.gpu.to_host(&p.gpu.embed(&wg, &ids).unwrap());
        assert_eq!(ec, eg, "fp8 embedding rows {scaling:?}");
    }
}

fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/fp8");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "{}", root.display());
    dirs
}

#[test]
fn fp8_models_on_cuda_match_transformers_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    for dir in fixtures() {
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let input = ids(&r["input_ids"]);
        let m = loader::open(&dir).unwrap();
        let (_, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let backend = CudaBackend::new(0).unwrap().with_split_activations().with_kv_precision(KvPrecision::F32);
        let lm = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap();
        let mut seq = lm.new_sequence(input.len());
        let d = max_abs(&lm.forward(seq.as_mut(), &input, Logits::All).unwrap(), &want);
        println!("{}: prefill max |Δlogit| {d:.2e} (logits up to {scale:.1})", dir.display());
        assert!(d <= 2e-3 * scale, "{}: {d}", dir.display());
        let cpu = m.load_cpu(false).unwrap();
        let mut sg = lm.new_sequence(input.len());
        let mut sc = cpu.new_sequence(input.len());
        for (i, t) in input.iter().take(12).enumerate() {
            let g = lm.forward(sg.as_mut(), &[*t], Logits::Last).unwrap();
            let c = cpu.forward(sc.as_mut(), &[*t], Logits::Last).unwrap();
            let e = rel(&g, &c);
            assert!(e < 1e-3, "{} decode step {i}: rel {e}", dir.display());
        }
        let prompt = ids(&r["greedy"]["prompt"]);
        let want_greedy = ids(&r["greedy"]["new_tokens"]);
        let opts = GenerateOptions {
            max_new_tokens: want_greedy.len(),
            stop_tokens: vec![],
            prefill_chunk: 512,
            adapter: None,
        };
        let (got, _) = generate(&lm, &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(got, want_greedy, "{}: greedy on CUDA", dir.display());
        let fast = m.load("cuda".parse().unwrap(), false).unwrap();
        let (got, _) = generate(fast.as_ref(), &prompt, &SamplingParams::default(), &opts, |_| Ok(true)).unwrap();
        assert_eq!(got, want_greedy, "{}: greedy on CUDA, default precision", dir.display());
    }
}
