//! Images on CUDA against transformers (`scripts/make_fixtures_vision.py`),
//! in the parity configuration (split activations, f32 KV cache): each
//! image's tokens, the logits of a prompt with two images at every position
//! (multimodal positions through the paged rotary kernel), and greedy
//! engine requests with images batched with text-only ones. Without a CUDA
//! device the tests print why and pass (they fail under `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common;
mod common_cuda;

use std::sync::Arc;

use common::engine::{config, request, run};
use common::vision::{dir, ids, image, max_diff, npy, processed, prompt_logits, reference};
use common_cuda::gpu;
use qinfer::backend::cuda::CudaBackend;
use qinfer::engine::core::EngineCore;
use qinfer::image::PreparedImage;
use qinfer::kv::KvPrecision;
use qinfer::loader;
use qinfer::models::LanguageModel;
use qinfer::models::decoder::DecoderModel;
use qinfer::sampling::SamplingParams;

fn load(case: &str) -> Arc<dyn LanguageModel> {
    let m = loader::open(&dir().join(case)).unwrap();
    let backend = CudaBackend::new(0).unwrap().with_split_activations().with_kv_precision(KvPrecision::F32);
    Arc::new(DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap())
}

#[test]
fn images_on_cuda_match_transformers() {
    if gpu().is_none() {
        return;
    }
    for case in ["qwen3_5", "qwen3_5_moe"] {
        let lm = load(case);
        assert!(lm.takes_images(), "{case}");
        for name in ["a.png", "c.webp", "e.png"] {
            let got = lm.encode_image(&image(name)).unwrap();
            let want = npy(dir().join(case).join(format!("vision_{}.npy", name.split('.').next().unwrap())));
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = max_diff(&got, &want);
            println!("{case} {name}: vision tokens max |Δ| {d:.2e} (up to {scale:.1})");
            assert!(d <= 2e-3 * scale, "{case} {name}: {d}");
        }
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
