//! The multi-token-prediction head of Qwen3-Next and Qwen3.5 (dense and
//! MoE) on the CPU against an independent float64 reference written from
//! vLLM's `qwen3_next_mtp` (scripts/mtp_reference.py, fixtures
//! tests/fixtures/tiny/<case>/mtp.json and mtp_logits.npy): the head over
//! every prompt position beside the target's prefill, then three chained
//! greedy drafts, each feeding the head's own output back one position on.
//! Also: a checkpoint without the head is refused by the tensor's name, and
//! a model loaded without it says so.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::engine::ids;
use qinfer::kv::batch::{BatchLayout, BatchSeq};
use qinfer::loader;
use qinfer::models::{BatchState, LanguageModel};
use serde_json::Value;

const CASES: [&str; 3] = ["qwen3_next", "qwen3_5", "qwen3_5_moe"];
const BLOCK: usize = 16;

fn dir(case: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(case)
}

fn load(case: &str, mtp: bool) -> qinfer::Result<Arc<dyn LanguageModel>> {
    load_from(&dir(case), mtp)
}

fn load_from(path: &Path, mtp: bool) -> qinfer::Result<Arc<dyn LanguageModel>> {
    let mut m = loader::open(path)?;
    m.config.load_mtp = mtp;
    Ok(Arc::from(m.load_cpu(false)?))
}

/// llama.cpp's conversions of the three fixtures with their heads
/// (scripts/make_gguf_fixtures.py --only mtp): GGUF case, fixture case.
const GGUF_CASES: [(&str, &str); 3] =
    [("qwen35", "qwen3_5"), ("qwen35moe", "qwen3_5_moe"), ("qwen3next", "qwen3_next")];

fn gguf(case: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_mtp").join(case).join("model.gguf")
}

/// One sequence's rows at positions `start..start + n`, state slot 0.
fn layout(start: usize, n: usize, logits_rows: Vec<usize>) -> BatchLayout {
    let blocks = (start + n).div_ceil(BLOCK) as u32;
    let seq = BatchSeq {
        rows: 0..n,
        start,
        block_table: (0..blocks).collect(),
        state_slot: Some(0),
        prompt: true,
        snapshots: Vec::new(),
        adapter: None,
    };
    BatchLayout::new(vec![seq], BLOCK, logits_rows)
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn max_abs(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).abs()).fold(0.0, f64::max)
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j])).unwrap() as u32
}

/// Logits within this much of the reference's, relative to the largest
/// logit's magnitude: our target runs in f32 (its hidden states differ from
/// the float64 ones by about 1e-5, which moves the head's logits by about
/// 1e-4) and so does the head.
const REL_TOL: f64 = 2e-5;

#[test]
fn the_mtp_head_matches_the_reference() {
    for case in CASES {
        check_head(case, &load(case, true).unwrap());
    }
}

/// The same heads read from GGUF files as llama.cpp's converter writes them
/// (`blk.{layers}.nextn.*` and the head's layer as the block after the
/// main ones, norms stored as 1 + w), against the same references.
#[test]
fn the_mtp_head_of_a_llamacpp_gguf_matches_the_reference() {
    for (file, case) in GGUF_CASES {
        let model = load_from(&gguf(file), true).unwrap();
        assert_eq!(model.config().num_layers, load(case, false).unwrap().config().num_layers, "{file}");
        check_head(case, &model);
    }
}

/// A target converted without its head (`--no-mtp`, tests/fixtures/gguf_arch)
/// with the head from the file the converter's `--mtp` writes, against the
/// same references; a head for another model, or a file without one, is
/// refused by name.
#[test]
fn a_head_from_its_own_gguf_beside_the_target_matches_the_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let target = |file: &str| loader::open(&root.join("gguf_arch").join(file).join("model.gguf")).unwrap();
    let head = |file: &str| root.join("gguf_mtp").join(file).join("mtp-model.gguf");
    for (file, case) in GGUF_CASES {
        let m = target(file).with_mtp_head(&head(file)).unwrap();
        assert!(m.config.load_mtp && m.config.mtp_layers == 1, "{file}");
        check_head(case, &Arc::from(m.load_cpu(false).unwrap()));
    }
    let e = target("qwen35moe").with_mtp_head(&head("qwen35")).err().expect("another model's head").to_string();
    assert!(e.contains("mtp-model.gguf") && e.contains("is no head for"), "{e}");
    let e =
        target("qwen35").with_mtp_head(&root.join("gguf_arch/qwen35/model.gguf")).err().expect("no head").to_string();
    assert!(e.contains("holds no multi-token-prediction head"), "{e}");
}

/// The head over the prompt beside the target's prefill, then chained
/// greedy drafts, against `case`'s float64 reference.
fn check_head(case: &str, model: &Arc<dyn LanguageModel>) {
    {
        let fx: Value = serde_json::from_str(&std::fs::read_to_string(dir(case).join("mtp.json")).unwrap()).unwrap();
        assert!(model.has_mtp(), "{case}");
        let (vocab, h) = (model.config().vocab_size, model.config().hidden_size);
        let input = ids(&fx["input_ids"]);
        let t = input.len();
        let mut state: Box<dyn BatchState> = model.new_batch_state(64, BLOCK, 1).unwrap();
        model.reset_state_slot(state.as_mut(), 0).unwrap();
        // The target's prefill: every row's final normed hidden state.
        let mut prefill = layout(0, t, vec![t - 1]);
        prefill.hidden_rows = (0..t).collect();
        let out = model.forward_batch(state.as_mut(), &input, &prefill, &[]).unwrap();
        let g = argmax(&out.logits);
        assert_eq!(g as u64, fx["target"]["greedy_next_token"].as_u64().unwrap(), "{case}: the target's pick");
        let target_hidden = out.hidden;
        assert_eq!(target_hidden.len(), t * h);

        // The head beside the prefill: row i takes token i + 1 (the pick
        // after the last) and the target's hidden state of row i.
        let next: Vec<u32> = input[1..].iter().copied().chain([g]).collect();
        assert_eq!(next, ids(&fx["mtp_prefill"]["mtp_input_ids"]), "{case}");
        let head =
            model.mtp_forward(state.as_mut(), &next, &target_hidden, &layout(0, t, (0..t).collect()), false).unwrap();
        assert_eq!(head.logits.len(), t * vocab);
        let (_, want) = qinfer::npy::read_f32(&dir(case).join("mtp_logits.npy")).unwrap();
        let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
        let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let err = max_abs(&head.logits, &want);
        println!("{case}: MTP logits over {t} prompt rows: max error {err:.3e} of {scale:.1}");
        assert!(err <= REL_TOL * scale, "{case}: MTP logits off by {err:.3e} (scale {scale:.1})");
        // Full float64 rows, and every row's pick where it is no near-tie.
        let rows = fx["mtp_prefill"]["rows"].as_array().unwrap();
        for (r, (want_row, want_y)) in rows.iter().zip(
            fx["mtp_prefill"]["logits_rows"]
                .as_array()
                .unwrap()
                .iter()
                .zip(fx["mtp_prefill"]["output_rows"].as_array().unwrap()),
        ) {
            let r = r.as_u64().unwrap() as usize;
            let e = max_abs(&head.logits[r * vocab..(r + 1) * vocab], &f64s(want_row));
            let ey = max_abs(&head.hidden[r * h..(r + 1) * h], &f64s(want_y));
            println!("{case}: row {r}: logits error {e:.3e}, output error {ey:.3e}");
            assert!(e <= REL_TOL * scale && ey <= 1e-4, "{case}: row {r}: {e:.3e} / {ey:.3e}");
        }
        let picks = ids(&fx["mtp_prefill"]["argmax"]);
        let margins = f64s(&fx["mtp_prefill"]["top2_margin"]);
        for i in 0..t {
            if margins[i] >= 0.01 {
                assert_eq!(argmax(&head.logits[i * vocab..(i + 1) * vocab]), picks[i], "{case}: row {i}'s pick");
            }
        }

        // Chained drafts: the first is the last prompt row's pick; each
        // next step feeds the previous draft and the head's output.
        let chain = &fx["chain"];
        let want_drafts = ids(&chain["drafts"]);
        let want_logits = chain["logits"].as_array().unwrap();
        let mut drafts = vec![argmax(&head.logits[(t - 1) * vocab..])];
        let mut y = head.hidden[(t - 1) * h..].to_vec();
        let e = max_abs(&head.logits[(t - 1) * vocab..], &f64s(&want_logits[0]));
        assert!(e <= REL_TOL * scale, "{case}: chain step 0: {e:.3e}");
        for j in 1..want_drafts.len() {
            let pos = t - 1 + j;
            let step =
                model.mtp_forward(state.as_mut(), &[drafts[j - 1]], &y, &layout(pos, 1, vec![0]), false).unwrap();
            let e = max_abs(&step.logits, &f64s(&want_logits[j]));
            println!("{case}: chain step {j} (position {pos}): logits error {e:.3e}");
            assert!(e <= REL_TOL * scale, "{case}: chain step {j}: {e:.3e}");
            drafts.push(argmax(&step.logits));
            y = step.hidden;
        }
        assert_eq!(drafts, want_drafts, "{case}: the chained drafts");
    }
}

/// The head over a prompt with two images (Qwen3.5 with its vision tower,
/// tests/fixtures/vision/qwen3_5) against the float64 reference of
/// scripts/mtp_reference_vision.py: a slot whose next token is an image
/// token takes the tower's output for it, every slot the target's three
/// rotary positions of its row, and chained drafts the last row's plus j.
#[test]
fn the_mtp_head_over_a_prompt_with_images_matches_the_reference() {
    use common::vision;
    let path = vision::dir().join("qwen3_5");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path.join("mtp.json")).unwrap()).unwrap();
    let model = load_from(&path, true).unwrap();
    let (vocab, h) = (model.config().vocab_size, model.config().hidden_size);
    let input = ids(&fx["input_ids"]);
    let t = input.len();
    let names: Vec<&str> = fx["images"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    let images: Vec<_> = names.iter().map(|n| vision::processed(n)).collect();
    let mut prefill = vision::prompt_batch(model.as_ref(), &input, &images);
    prefill.logits_rows = vec![t - 1];
    prefill.hidden_rows = (0..t).collect();
    let mut state: Box<dyn BatchState> =
        model.new_batch_state(prefill.seqs[0].block_table.len() + 1, BLOCK, 1).unwrap();
    model.reset_state_slot(state.as_mut(), 0).unwrap();
    let out = model.forward_batch(state.as_mut(), &input, &prefill, &[]).unwrap();
    let g = argmax(&out.logits);
    assert_eq!(g as u64, fx["target"]["greedy_next_token"].as_u64().unwrap(), "the target's pick");

    // Slot i takes token i + 1's input: the image rows' inputs move up one.
    let next: Vec<u32> = input[1..].iter().copied().chain([g]).collect();
    let mut head_batch = layout(0, t, (0..t).collect());
    head_batch.mrope_positions = prefill.mrope_positions.clone();
    head_batch.embeds = prefill
        .embeds
        .iter()
        .map(|e| qinfer::kv::batch::InputEmbeds { row: e.row - 1, values: e.values.clone(), take: e.take.clone() })
        .collect();
    let head = model.mtp_forward(state.as_mut(), &next, &out.hidden, &head_batch, false).unwrap();
    let (_, want) = qinfer::npy::read_f32(&path.join("mtp_logits.npy")).unwrap();
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let err = max_abs(&head.logits, &want);
    println!("MTP logits over {t} rows of a prompt with images: max error {err:.3e} of {scale:.1}");
    // Image rows' inputs are the tower's output (scale ~10, each within
    // 2e-5 of the reference's): the bound of the target's own image rows.
    assert!(err <= 1e-3, "MTP logits off by {err:.3e} (scale {scale:.1})");
    let picks = ids(&fx["mtp_prefill"]["argmax"]);
    let margins = f64s(&fx["mtp_prefill"]["top2_margin"]);
    for i in (0..t).filter(|&i| margins[i] >= 0.01) {
        assert_eq!(argmax(&head.logits[i * vocab..(i + 1) * vocab]), picks[i], "row {i}'s pick");
    }

    // Chained drafts, each one position further on in all three components.
    let want_drafts = ids(&fx["chain"]["drafts"]);
    let want_logits = fx["chain"]["logits"].as_array().unwrap();
    let mut drafts = vec![argmax(&head.logits[(t - 1) * vocab..])];
    let mut y = head.hidden[(t - 1) * h..].to_vec();
    let last = prefill.mrope_positions[t - 1];
    for j in 1..want_drafts.len() {
        let mut step_batch = layout(t - 1 + j, 1, vec![0]);
        step_batch.mrope_positions = vec![last.map(|p| p + j as u32)];
        let step = model.mtp_forward(state.as_mut(), &[drafts[j - 1]], &y, &step_batch, false).unwrap();
        let e = max_abs(&step.logits, &f64s(&want_logits[j]));
        println!("chain step {j}: logits error {e:.3e}");
        assert!(e <= 1e-3, "chain step {j}: {e:.3e}");
        drafts.push(argmax(&step.logits));
        y = step.hidden;
    }
    assert_eq!(drafts, want_drafts, "the chained drafts");
}

#[test]
fn a_missing_or_unloaded_head_is_named() {
    // The dense Qwen3 fixture has no `mtp.*` tensors.
    let e = load("qwen3", true).err().expect("no head to load").to_string();
    assert!(e.contains("mtp.fc.weight") && e.contains("multi-token-prediction"), "{e}");
    // A GGUF converted without the head (`--no-mtp`).
    let no_head = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_arch/qwen35/model.gguf");
    let e = load_from(&no_head, true).err().expect("no head in the file").to_string();
    assert!(e.contains("mtp.fc.weight") && e.contains("multi-token-prediction"), "{e}");
    let model = load("qwen3_5", false).unwrap();
    assert!(!model.has_mtp());
    let mut state = model.new_batch_state(4, BLOCK, 1).unwrap();
    let h = model.config().hidden_size;
    let e =
        model.mtp_forward(state.as_mut(), &[1], &vec![0.0; h], &layout(0, 1, vec![0]), false).unwrap_err().to_string();
    assert!(e.contains("without") && e.contains("multi-token-prediction"), "{e}");
}
