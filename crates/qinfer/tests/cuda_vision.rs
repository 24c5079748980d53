//! Images on CUDA against transformers (`scripts/make_fixtures_vision.py`),
//! in the parity configuration (split activations, f32 KV cache): each
//! image's tokens, the logits of a prompt with two images at every position
//! (multimodal positions through the paged rotary kernel), and greedy
//! engine requests with images batched with text-only ones; then the same
//! tokens in the default configuration (the tensor-core attention), and
//! each vision op against the CPU's on random inputs. Without a CUDA
//! device the tests print why and pass (they fail under `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common;
mod common_cuda;

use std::sync::Arc;

use common::engine::{config, request, run};
use common::vision::{dir, ids, image, max_diff, npy, processed, prompt_logits, reference};
use common_cuda::{F16_CACHE_TOL, Rng, gpu, pair, tensor};
use qinfer::backend::Backend;
use qinfer::backend::cuda::CudaBackend;
use qinfer::backend::vision_ops::{Gelu, LayerNormParams, VisionHeads, VisionOps};
use qinfer::engine::core::EngineCore;
use qinfer::image::PreparedImage;
use qinfer::kv::KvPrecision;
use qinfer::loader;
use qinfer::models::LanguageModel;
use qinfer::models::decoder::DecoderModel;
use qinfer::sampling::SamplingParams;
use qinfer::tensor::DType;

/// The fixture's model on the GPU, in the parity configuration or the default one.
fn load_with(case: &str, parity: bool) -> Arc<dyn LanguageModel> {
    let m = loader::open(&dir().join(case)).unwrap();
    let backend = CudaBackend::new(0).unwrap();
    let backend = if parity { backend.with_split_activations().with_kv_precision(KvPrecision::F32) } else { backend };
    Arc::new(DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap())
}

fn load(case: &str) -> Arc<dyn LanguageModel> {
    load_with(case, true)
}

/// Three images' tokens against transformers', within `bound` of their scale.
fn check_tokens(lm: &dyn LanguageModel, case: &str, config: &str, bound: f32) {
    for name in ["a.png", "c.webp", "e.png"] {
        let got = lm.encode_image(&image(name)).unwrap();
        let want = npy(dir().join(case).join(format!("vision_{}.npy", name.split('.').next().unwrap())));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_diff(&got, &want);
        println!("{case} {name} ({config}): vision tokens max |Δ| {d:.2e} (up to {scale:.1})");
        assert!(d <= bound * scale, "{case} {name} ({config}): {d}");
    }
}

#[test]
fn images_on_cuda_match_transformers() {
    if gpu().is_none() {
        return;
    }
    for case in ["qwen3_5", "qwen3_5_moe"] {
        let lm = load(case);
        assert!(lm.takes_images(), "{case}");
        check_tokens(lm.as_ref(), case, "parity", 2e-3);
        let r = &reference(case)["prompts"]["two_images"];
        let names: Vec<&str> = r["images"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
        let images: Vec<PreparedImage> = names.iter().map(|n| processed(n)).collect();
        let got = prompt_logits(lm.as_ref(), &ids(&r["ids"]), &images);
        let want = npy(dir().join(case).join("logits_two_images.npy"));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_diff(&got, &want);
        println!("{case}: two-image prompt max |Δlogit| {d:.2e} (up to {scale:.1})");
        assert!(d <= 2e-3 * scale, "{case}: {d}");

        // Every fixture prompt through the engine on the GPU, batched together.
        let prompts = reference(case)["prompts"].as_object().unwrap().clone();
        let mut reqs = Vec::new();
        let mut wants = Vec::new();
        for (_, p) in &prompts {
            let want = ids(&p["greedy"]);
            let mut req = request(ids(&p["ids"]), want.len(), SamplingParams::default());
            req.images =
                (p["images"].as_array().unwrap().iter()).map(|n| Arc::new(image(n.as_str().unwrap()))).collect();
            reqs.push(req);
            wants.push(want);
        }
        let mut core = EngineCore::new(lm.clone(), None, config(1024, 8, 64)).unwrap();
        let got = run(&mut core, &reqs, &vec![0; reqs.len()]);
        for (((name, _), want), (tokens, _)) in prompts.iter().zip(&wants).zip(&got) {
            assert_eq!(tokens, want, "{case} {name}");
        }
    }
}

/// The default configuration runs the tower's attention on the tensor cores
/// (f16 operands) and its matmuls on bf16 activations: its tokens stay
/// within bf16's rounding of transformers' (the attention kernel alone is
/// bounded tightly in `vision_ops_match_the_host`).
#[test]
fn images_on_the_tensor_cores_match_transformers() {
    if gpu().is_none() {
        return;
    }
    for case in ["qwen3_5", "qwen3_5_moe"] {
        check_tokens(load_with(case, false).as_ref(), case, "tensor cores", 2.5e-2);
    }
}

/// LayerNorm, both GELUs, regrouping and the bidirectional rotary attention
/// on the device against the host defaults, over head dims with a kernel
/// (64, 128), padded ones (16, 72) and patch counts off the tiles.
#[test]
fn vision_ops_match_the_host() {
    let Some(p) = pair() else { return };
    let mut r = Rng::fresh();
    for (rows, cols) in [(7, 32), (300, 1152), (33, 1024)] {
        let x: Vec<f32> = r.vec(rows * cols).iter().map(|v| 3.0 * v + 0.5).collect();
        let (w, b) = (r.vec(cols), r.vec(cols));
        let (wt, bt) = (tensor("w", DType::F32, vec![cols], &w), tensor("b", DType::F32, vec![cols], &b));
        let cpu_norm = LayerNormParams {
            weight: w.clone(),
            bias: b.clone(),
            placed: (p.cpu.upload(&wt).unwrap(), p.cpu.upload(&bt).unwrap()),
        };
        let gpu_norm = LayerNormParams {
            weight: w.clone(),
            bias: b.clone(),
            placed: (p.gpu.upload(&wt).unwrap(), p.gpu.upload(&bt).unwrap()),
        };
        let (cx, gx) = p.acts(rows, cols, &x);
        p.check(
            &format!("layer_norm {rows}x{cols}"),
            &p.cpu.layer_norm(&cx, &cpu_norm, 1e-6),
            &p.gpu.layer_norm(&gx, &gpu_norm, 1e-6),
            1e-5,
        );
        for kind in [Gelu::Tanh, Gelu::Erf] {
            let (mut cx, mut gx) = p.acts(rows, cols, &x);
            p.cpu.gelu(&mut cx, kind);
            p.gpu.gelu(&mut gx, kind);
            p.check(&format!("gelu {kind:?} {rows}x{cols}"), &cx, &gx, 1e-6);
        }
        let (cx, gx) = p.acts(rows, cols, &x);
        let (cx, gx) = (p.cpu.regroup(cx, cols / 2), p.gpu.regroup(gx, cols / 2));
        assert_eq!((p.gpu.rows(&gx), p.gpu.cols(&gx)), (2 * rows, cols / 2));
        p.check("regroup", &cx, &gx, 0.0);
    }
    for (n, heads, hd) in
        [(1, 2, 16), (37, 2, 16), (300, 3, 64), (257, 2, 72), (1100, 4, 72), (130, 2, 128), (4096, 16, 64)]
    {
        let qkv = r.vec(n * 3 * heads * hd);
        // Angles of real patch grids: rows and columns up to 64.
        let mut rotary = vec![0f32; n * hd];
        for (i, row) in rotary.chunks_mut(hd).enumerate() {
            for j in 0..hd / 2 {
                let a = ((i % 64) as f32 + (i / 64) as f32) * (1e4f32).powf(-(j as f32) / (hd / 2) as f32);
                (row[j], row[hd / 2 + j]) = (a.cos(), a.sin());
            }
        }
        let shape = VisionHeads { heads, head_dim: hd };
        let (cq, gq) = p.acts(n, 3 * heads * hd, &qkv);
        let (cr, gr) = p.acts(n, hd, &rotary);
        let want = p.cpu.vision_attention(&cq, &cr, shape);
        let got = p.gpu.vision_attention(&gq, &gr, shape);
        assert_eq!(p.gpu.cols(&got), heads * hd);
        p.check(&format!("vision attention n={n} heads={heads} hd={hd}"), &want, &got, F16_CACHE_TOL);
        // The parity configuration computes it exactly.
        let sq = p.split.act_from_host(n, 3 * heads * hd, &qkv);
        let sr = p.split.act_from_host(n, hd, &rotary);
        let exact = p.split.to_host(&p.split.vision_attention(&sq, &sr, shape));
        let e = common_cuda::rel(&exact, &p.cpu.to_host(&want));
        assert!(e <= 1e-6, "exact vision attention n={n} hd={hd}: {e}");
    }
}
