//! Qwen3.5's vision tower and multimodal positions against transformers
//! (float32, `scripts/make_fixtures_vision.py`): each image's merged
//! tokens, the prompt's three rotary positions, and the logits of a prompt
//! with two images at every position, through the batched forward.

use std::path::PathBuf;
use std::sync::Arc;

use qinfer::image::{ImageLimits, ImageProcessorConfig, PreparedImage, prepare};
use qinfer::kv::batch::{BatchLayout, BatchSeq, InputEmbeds};
use qinfer::models::LanguageModel;
use qinfer::models::vision::rope_positions;
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

fn load(case: &str) -> Box<dyn LanguageModel> {
    qinfer::loader::open(&dir().join(case)).unwrap().load_cpu(false).unwrap()
}

fn image(name: &str) -> PreparedImage {
    let cfg = ImageProcessorConfig::from_file(&dir().join("qwen3_5/preprocessor_config.json")).unwrap();
    prepare(&std::fs::read(dir().join("images").join(name)).unwrap(), &cfg, &ImageLimits::default()).unwrap()
}

fn processed(name: &str) -> PreparedImage {
    let mine = image(name);
    let stem = name.split('.').next().unwrap();
    PreparedImage { pixels: npy(dir().join(format!("images/{stem}.pixels.npy"))), ..mine }
}

fn npy(path: PathBuf) -> Vec<f32> {
    qinfer::npy::read_f32(&path).unwrap().1
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn reference(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(case).join("reference.json")).unwrap()).unwrap()
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
        }
    }
}

#[test]
fn positions_and_logits_of_a_prompt_with_two_images_match_transformers() {
    for case in ["qwen3_5", "qwen3_5_moe"] {
        let lm = load(case);
        let r = &reference(case)["prompts"]["two_images"];
        let ids: Vec<u32> = r["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
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

        let block_size = 16;
        let blocks = ids.len().div_ceil(block_size);
        let mut state = lm.new_batch_state(blocks, block_size, 1).unwrap();
        lm.reset_state_slot(state.as_mut(), 0).unwrap();
        let seq = BatchSeq {
            rows: 0..ids.len(),
            start: 0,
            block_table: (0..blocks as u32).collect(),
            state_slot: Some(0),
            prompt: true,
            snapshots: vec![],
            adapter: None,
        };
        let mut batch = BatchLayout::new(vec![seq], block_size, (0..ids.len()).collect());
        batch.mrope_positions = pos;
        let mut row = 0;
        for img in &images {
            let values = Arc::new(lm.encode_image(img).unwrap());
            let start = row + ids[row..].iter().position(|&t| t == vision.image_token_id).unwrap();
            let n = img.tokens(vision.spatial_merge_size);
            batch.embeds.push(InputEmbeds { row: start, values, take: 0..n });
            row = start + n;
        }
        let out = lm.forward_batch(state.as_mut(), &ids, &batch, &[]).unwrap();
        let want = npy(dir().join(case).join("logits_two_images.npy"));
        let d = max_diff(&out.logits, &want);
        // Image tokens' inputs are the tower's output (scale ~10, each
        // within 2e-5 of the reference's), so their rows carry more rounding
        // than text rows: the tiny-model bound of tests/parity_tiny.rs for
        // every row, and the text rows' own at text rows.
        let v = lm.config().vocab_size;
        let text = (0..ids.len()).filter(|&i| ids[i] != vision.image_token_id);
        let d_text = text.map(|i| max_diff(&out.logits[i * v..][..v], &want[i * v..][..v])).fold(0.0, f32::max);
        assert!(d_text < 2e-4, "{case}: text rows' logits differ by {d_text}");
        assert!(d < 1e-3, "{case}: logits differ by {d}");
    }
}
