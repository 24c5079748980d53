//! Qwen3.5's vision tower and multimodal positions against transformers
//! (float32, `scripts/make_fixtures_vision.py`): each image's merged
//! tokens, the prompt's three rotary positions, and the logits of a prompt
//! with two images at every position, through the batched forward.

mod common;

use common::vision::{dir, ids, image, max_diff, npy, processed, prompt_logits, reference};
use qinfer::image::PreparedImage;
use qinfer::models::LanguageModel;
use qinfer::models::vision::rope_positions;

fn load(case: &str) -> Box<dyn LanguageModel> {
    qinfer::loader::open(&dir().join(case)).unwrap().load_cpu(false).unwrap()
}

#[test]
fn vision_tokens_match_transformers() {
    for case in ["qwen3_5", "qwen3_5_moe"] {
        let lm = load(case);
        assert!(lm.takes_images());
        for name in ["a.png", "b.png", "c.webp", "e.png"] {
            let got = lm.encode_image(&image(name)).unwrap();
            let want = npy(dir().join(case).join(format!("vision_{}.npy", name.split('.').next().unwrap())));
            let d = max_diff(&got, &want);
            assert!(d < 1e-4, "{case} {name}: vision tokens differ by {d}");
            // A block at a time (as the engine runs it) computes the same.
            let mut enc = lm.begin_image(std::sync::Arc::new(image(name))).unwrap();
            let depth = enc.blocks_left;
            let mut steps = 0;
            let stepped = loop {
                steps += 1;
                if let Some(tokens) = lm.advance_image(&mut enc, 1).unwrap() {
                    break tokens;
                }
                assert_eq!(enc.blocks_left, depth - steps, "{case} {name}");
            };
            assert_eq!(steps, depth, "{case} {name}: one block per call");
            assert_eq!(stepped, got, "{case} {name}: block by block");
        }
    }
}

#[test]
fn positions_and_logits_of_a_prompt_with_two_images_match_transformers() {
    for case in ["qwen3_5", "qwen3_5_moe"] {
        let lm = load(case);
        let r = &reference(case)["prompts"]["two_images"];
        let ids = ids(&r["ids"]);
        let names: Vec<&str> = r["images"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
        // The processor's own pixel values: this test is about the model
        // (tests/vision_preprocess.rs checks ours against them).
        let images: Vec<PreparedImage> = names.iter().map(|n| processed(n)).collect();
        let vision = lm.config().vision.clone().unwrap();
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid).collect();
        let (pos, delta) = rope_positions(&ids, &grids, &vision).unwrap();
        let want: Vec<Vec<u64>> = serde_json::from_value(r["positions"].clone()).unwrap();
        for (i, p) in pos.iter().enumerate() {
            assert_eq!([0, 1, 2].map(|c| p[c] as u64), [0, 1, 2].map(|c| want[c][i]), "position of token {i}");
        }
        assert_eq!(delta, r["rope_delta"].as_i64().unwrap());

        let got = prompt_logits(lm.as_ref(), &ids, &images);
        let want = npy(dir().join(case).join("logits_two_images.npy"));
        // Image tokens' inputs are the tower's output (scale ~10, each
        // within 2e-5 of the reference's), so their rows carry more rounding
        // than text rows: the tiny-model bound of tests/parity_tiny.rs for
        // every row, and the text rows' own at text rows.
        let v = lm.config().vocab_size;
        let text = (0..ids.len()).filter(|&i| ids[i] != vision.image_token_id);
        let d_text = text.map(|i| max_diff(&got[i * v..][..v], &want[i * v..][..v])).fold(0.0, f32::max);
        assert!(d_text < 2e-4, "{case}: text rows' logits differ by {d_text}");
        let d = max_diff(&got, &want);
        assert!(d < 1e-3, "{case}: logits differ by {d}");
    }
}

/// A Qwen3.5 GGUF with the vision projector llama.cpp's converter writes
/// beside it (`--mmproj`; tests/fixtures/gguf_vision,
/// scripts/make_gguf_vision_fixtures.py) against transformers on the same
/// checkpoint: each image's tower output, and the logits of a prompt with
/// two images at every position (the projector's tower and the text
/// model's multimodal RoPE sections from the GGUF).
#[test]
fn a_gguf_with_its_vision_projector_matches_transformers() {
    let d = dir().join("../gguf_vision/qwen35");
    let m = qinfer::loader::open(&d.join("model.gguf")).unwrap().with_mmproj(&d.join("mmproj.gguf")).unwrap();
    assert!(m.image_processor.is_some());
    let lm = m.load_cpu(false).unwrap();
    assert!(lm.takes_images());
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    let names: Vec<&str> = r["images"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    for name in &names {
        let got = lm.encode_image(&processed(name)).unwrap();
        let want = npy(d.join(format!("vision_{}.npy", name.split('.').next().unwrap())));
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-4, "{name}: vision tokens differ by {diff}");
    }
    let ids = ids(&r["ids"]);
    let images: Vec<PreparedImage> = names.iter().map(|n| processed(n)).collect();
    let got = prompt_logits(lm.as_ref(), &ids, &images);
    let want = npy(d.join("logits_two_images.npy"));
    let diff = max_diff(&got, &want);
    assert!(diff < 1e-3, "logits differ by {diff}");

    // Refused by name: a model whose tokenizer has no image marker, a model
    // of another architecture, and a text model given as the projector.
    let bad = qinfer::loader::open(&dir().join("../gguf_arch/qwen35moe/model.gguf")).unwrap();
    let e = bad.with_mmproj(&d.join("mmproj.gguf")).err().expect("no image marker").to_string();
    assert!(e.contains("has no `<|image_pad|>`"), "{e}");
    let bad = qinfer::loader::open(&dir().join("../gguf_arch/qwen3moe/model.gguf")).unwrap();
    let e = bad.with_mmproj(&d.join("mmproj.gguf")).err().expect("not Qwen3.5").to_string();
    assert!(e.contains("is for Qwen3.5 models"), "{e}");
    let e = (qinfer::loader::open(&d.join("model.gguf")).unwrap().with_mmproj(&d.join("model.gguf")))
        .err()
        .expect("no projector")
        .to_string();
    assert!(e.contains("is no vision projector"), "{e}");
}
