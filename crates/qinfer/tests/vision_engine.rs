//! Requests with images through the engine, against transformers' greedy
//! continuations (`scripts/make_fixtures_vision.py`): several images in one
//! prompt, an image after a long text turn, small images scaled up, and
//! text-only requests batched with them; chunked prefill splitting images;
//! the prefix cache keeping prompts that differ only in their images apart;
//! and decoding requests going on, a token every step, while an image
//! request's images are encoded.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::engine::{config, load, request, run};
use qinfer::engine::core::EngineCore;
use qinfer::engine::prefix::PrefixCacheConfig;
use qinfer::engine::request::Request;
use qinfer::image::{ImageLimits, ImageProcessorConfig, PreparedImage, prepare};
use qinfer::sampling::SamplingParams;
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

fn image(name: &str) -> Arc<PreparedImage> {
    let cfg = ImageProcessorConfig::from_file(&dir().join("qwen3_5/preprocessor_config.json")).unwrap();
    Arc::new(prepare(&std::fs::read(dir().join("images").join(name)).unwrap(), &cfg, &ImageLimits::default()).unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The fixture's prompts as requests, and transformers' greedy tokens.
fn prompts(case: &str) -> Vec<(String, Request, Vec<u32>)> {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join(case).join("reference.json")).unwrap()).unwrap();
    let mut out = Vec::new();
    for (name, p) in r["prompts"].as_object().unwrap() {
        let want = ids(&p["greedy"]);
        let mut req = request(ids(&p["ids"]), want.len(), SamplingParams::default());
        req.images = p["images"].as_array().unwrap().iter().map(|n| image(n.as_str().unwrap())).collect();
        out.push((name.clone(), req, want));
    }
    out
}

#[test]
fn image_and_text_requests_batched_together_match_transformers() {
    for case in ["qwen3_5", "qwen3_5_moe"] {
        let lm = load(&dir().join(case));
        let cases = prompts(case);
        let reqs: Vec<Request> = cases.iter().map(|c| c.1.clone()).collect();
        // Whole prompts in one step, then 64-token chunks (images split
        // across steps), with requests joining while others decode.
        for (budget, joins) in [(1024, vec![0; reqs.len()]), (64, (0..reqs.len()).map(|i| 2 * i).collect())] {
            let mut core = EngineCore::new(lm.clone(), None, config(budget, 8, 64)).unwrap();
            let got = run(&mut core, &reqs, &joins);
            for ((name, _, want), (tokens, _)) in cases.iter().zip(&got) {
                assert_eq!(tokens, want, "{case} {name}, budget {budget}");
            }
        }
    }
}

/// MTP speculation on requests with images (the fixture's head:
/// scripts/mtp_reference_vision.py): after the prompt's step the head
/// proposes the reference's drafts, and every request's greedy tokens equal
/// transformers' (image and text-only requests batched, whole prompts and
/// 64-token chunks).
#[test]
fn mtp_speculation_on_requests_with_images() {
    use qinfer::engine::speculative::SpeculativeConfig;
    let mut m = qinfer::loader::open(&dir().join("qwen3_5")).unwrap();
    m.config.load_mtp = true;
    let lm: Arc<dyn qinfer::models::LanguageModel> = Arc::from(m.load_cpu(false).unwrap());
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(dir().join("qwen3_5/mtp.json")).unwrap()).unwrap();
    let cases = prompts("qwen3_5");
    let (_, two_images, want) = cases.iter().find(|c| c.0 == fx["prompt"].as_str().unwrap()).unwrap();
    let mut cfg = config(1024, 8, 64);
    cfg.speculative = Some(SpeculativeConfig::mtp(3));
    let mut core = EngineCore::new(lm.clone(), None, cfg).unwrap();
    core.add(0, two_images.clone()).unwrap();
    let first = loop {
        let out = core.step().unwrap();
        if let Some(o) = out.into_iter().find(|o| !o.token_ids.is_empty()) {
            break o.token_ids;
        }
    };
    assert_eq!(first, want[..1], "the target's first token");
    assert_eq!(core.proposed_drafts(0), ids(&fx["chain"]["drafts"]), "the head's drafts after the prompt");

    let reqs: Vec<Request> = cases.iter().map(|c| c.1.clone()).collect();
    for (budget, joins) in [(1024, vec![0; reqs.len()]), (64, (0..reqs.len()).map(|i| 2 * i).collect())] {
        let mut cfg = config(budget, 8, 64);
        cfg.speculative = Some(SpeculativeConfig::mtp(3));
        let mut core = EngineCore::new(lm.clone(), None, cfg).unwrap();
        let got = run(&mut core, &reqs, &joins);
        for ((name, _, want), (tokens, _)) in cases.iter().zip(&got) {
            assert_eq!(tokens, want, "{name} with MTP, budget {budget}");
        }
        let stats = core.speculative_stats();
        assert!(stats.verifications > 0 && stats.accepted <= stats.drafted, "{stats:?}");
    }
}

#[test]
fn the_prefix_cache_keeps_prompts_with_other_images_apart() {
    let lm = load(&dir().join("qwen3_5"));
    let (_, with_e, want_e) = prompts("qwen3_5").into_iter().find(|c| c.0 == "later_image").unwrap();
    // Image c has image e's grid: the same placeholder tokens, another picture.
    let with_c = Request { images: vec![image("c.webp")], ..with_e.clone() };
    let fresh = {
        let mut core = EngineCore::new(lm.clone(), None, config(1024, 4, 64)).unwrap();
        run(&mut core, std::slice::from_ref(&with_c), &[0]).remove(0).0
    };
    let mut cfg = config(1024, 4, 64);
    cfg.prefix_cache = Some(PrefixCacheConfig::for_model(lm.as_ref(), 64, 1 << 24, 64 * 16));
    let mut core = EngineCore::new(lm, None, cfg).unwrap();
    let first = run(&mut core, std::slice::from_ref(&with_e), &[0]).remove(0).0;
    assert_eq!(first, want_e);
    let again = run(&mut core, std::slice::from_ref(&with_e), &[0]).remove(0).0;
    assert_eq!(again, want_e, "a cached image prompt");
    let other = run(&mut core, std::slice::from_ref(&with_c), &[0]).remove(0).0;
    assert_eq!(other, fresh, "a prompt with another image must not take the first one's blocks");
    assert_ne!(other, want_e, "the two images should lead to different continuations");
}

#[test]
fn bad_image_requests_are_refused_by_name() {
    let lm = load(&dir().join("qwen3_5"));
    let (_, req, _) = prompts("qwen3_5").into_iter().find(|c| c.0 == "two_images").unwrap();
    let mut core = EngineCore::new(lm, None, config(1024, 4, 64)).unwrap();
    let one_short = Request { images: req.images[..1].to_vec(), ..req.clone() };
    let err = core.add(1, one_short).unwrap_err().to_string();
    assert!(err.contains("more image placeholders"), "{err}");
    let extra = Request { images: [req.images.clone(), vec![image("b.png")]].concat(), ..req.clone() };
    let err = core.add(2, extra).unwrap_err().to_string();
    assert!(err.contains("fewer image placeholders"), "{err}");
    let text_model = load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3"));
    let mut core = EngineCore::new(text_model, None, config(1024, 4, 64)).unwrap();
    let err = core.add(3, Request { images: req.images.clone(), ..request(vec![1, 2], 1, Default::default()) });
    assert!(err.unwrap_err().to_string().contains("text-only"));
}

#[test]
fn decoding_requests_get_a_token_every_step_while_an_image_is_encoded() {
    let lm = load(&dir().join("qwen3_5"));
    let (_, with_image, want) = prompts("qwen3_5").into_iter().find(|c| c.0 == "two_images").unwrap();
    let mut core = EngineCore::new(lm, None, config(1024, 8, 64)).unwrap();
    let decoders: Vec<u64> = (100..104).collect();
    for &id in &decoders {
        core.add(id, request(vec![5, 6, 7, id as u32], 40, SamplingParams::default())).unwrap();
    }
    for _ in 0..3 {
        core.step().unwrap();
    }
    core.add(1, with_image).unwrap();
    assert_eq!(core.num_waiting(), 1, "the image request waits while it is encoded");
    let mut got: Vec<u32> = Vec::new();
    let mut live = decoders.clone();
    while core.num_unfinished() > 0 {
        let outs = core.step().unwrap();
        for &d in &live {
            assert!(outs.iter().any(|o| o.id == d && !o.token_ids.is_empty()), "a step gave decoder {d} no token");
        }
        live.retain(|&d| !outs.iter().any(|o| o.id == d && o.finish.is_some()));
        for o in outs.iter().filter(|o| o.id == 1) {
            got.extend(&o.token_ids);
        }
    }
    assert!(core.take_failed().is_empty());
    assert_eq!(got, want);
}

/// With no time to spare, the queue runs one tower block per call, so an
/// image request's encoding spreads over as many steps as its images have
/// blocks; with time, it runs through.
#[test]
fn the_image_queue_spreads_encoding_over_calls() {
    use qinfer::engine::encoding::ImageQueue;
    use qinfer::runner::media::Media;
    use std::time::Duration;
    let lm = load(&dir().join("qwen3_5"));
    let depth = lm.config().vision.as_ref().unwrap().depth;
    let (_, req, _) = prompts("qwen3_5").into_iter().find(|c| c.0 == "two_images").unwrap();
    let media = Arc::new(Media::new(lm.as_ref(), &req.prompt, &req.images).unwrap());
    let mut queue = ImageQueue::default();
    queue.push(lm.as_ref(), 7, media.clone(), &req.images).unwrap();
    let mut calls = 0;
    loop {
        calls += 1;
        let done = queue.advance(lm.as_ref(), Duration::ZERO);
        assert!(done.failed.is_empty());
        if !done.ready.is_empty() {
            assert_eq!(done.ready, vec![7]);
            break;
        }
        assert!(!media.ready(), "call {calls}");
    }
    assert_eq!(calls, depth * req.images.len());
    assert!(media.ready() && queue.is_empty());
    // The same images again (a conversation's next turn): their tokens are
    // kept, so the request is ready at once, with no tower block run.
    let again = Arc::new(Media::new(lm.as_ref(), &req.prompt, &req.images).unwrap());
    queue.push(lm.as_ref(), 8, again.clone(), &req.images).unwrap();
    assert_eq!(queue.advance(lm.as_ref(), Duration::ZERO).ready, vec![8]);
    assert!(again.ready());
    assert_eq!(queue.reused(), req.images.len() as u64);
    // Another image goes through the tower, straight through with time to spare.
    let (_, other, _) = prompts("qwen3_5").into_iter().find(|c| c.0 == "later_image").unwrap();
    let media = Arc::new(Media::new(lm.as_ref(), &other.prompt, &other.images).unwrap());
    queue.push(lm.as_ref(), 9, media.clone(), &other.images).unwrap();
    assert_eq!(queue.advance(lm.as_ref(), Duration::MAX).ready, vec![9]);
    assert!(media.ready());
    assert_eq!(queue.reused(), req.images.len() as u64);
}
