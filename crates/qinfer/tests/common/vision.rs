//! The vision fixtures (`scripts/make_fixtures_vision.py`): images prepared
//! by qinfer or by the reference processor, the references, and the batch
//! of a prompt with images as the engine lays it out.

use std::path::PathBuf;
use std::sync::Arc;

use qinfer::image::{ImageLimits, ImageProcessorConfig, PreparedImage, prepare};
use qinfer::kv::batch::{BatchLayout, BatchSeq, InputEmbeds};
use qinfer::models::LanguageModel;
use qinfer::models::vision::rope_positions;
use serde_json::Value;

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

/// An image of the fixture as qinfer prepares it.
pub fn image(name: &str) -> PreparedImage {
    let cfg = ImageProcessorConfig::from_file(&dir().join("qwen3_5/preprocessor_config.json")).unwrap();
    prepare(&std::fs::read(dir().join("images").join(name)).unwrap(), &cfg, &ImageLimits::default()).unwrap()
}

/// An image with the reference processor's own pixel values.
pub fn processed(name: &str) -> PreparedImage {
    let mine = image(name);
    let stem = name.split('.').next().unwrap();
    PreparedImage { pixels: npy(dir().join(format!("images/{stem}.pixels.npy"))), ..mine }
}

pub fn npy(path: PathBuf) -> Vec<f32> {
    qinfer::npy::read_f32(&path).unwrap().1
}

pub fn reference(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(case).join("reference.json")).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A fixture prompt's whole batch (one sequence, logits at every row): its
/// images' tokens through `lm`'s tower, and every row's three positions.
pub fn prompt_batch(lm: &dyn LanguageModel, ids: &[u32], images: &[PreparedImage]) -> BatchLayout {
    let vision = lm.config().vision.clone().unwrap();
    let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid).collect();
    let (pos, _) = rope_positions(ids, &grids, &vision).unwrap();
    let block_size = 16;
    let blocks = ids.len().div_ceil(block_size);
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
    for img in images {
        let values = Arc::new(lm.encode_image(img).unwrap());
        let start = row + ids[row..].iter().position(|&t| t == vision.image_token_id).unwrap();
        let n = img.tokens(vision.spatial_merge_size);
        batch.embeds.push(InputEmbeds { row: start, values, take: 0..n });
        row = start + n;
    }
    batch
}

/// The logits of every row of a fixture prompt with images.
pub fn prompt_logits(lm: &dyn LanguageModel, ids: &[u32], images: &[PreparedImage]) -> Vec<f32> {
    let batch = prompt_batch(lm, ids, images);
    let mut state = lm.new_batch_state(batch.seqs[0].block_table.len(), batch.block_size, 1).unwrap();
    lm.reset_state_slot(state.as_mut(), 0).unwrap();
    lm.forward_batch(state.as_mut(), ids, &batch, &[]).unwrap().logits
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
