//! The multi-token-prediction head on CUDA against the float64 reference
//! (scripts/mtp_reference.py; the CPU's test is tests/mtp_head.rs): the
//! head over every prompt row beside the target's batched prefill, then
//! three chained drafts. Asserted in the parity configuration (split
//! activations, an f32 KV pool); the default configuration is reported.
#![cfg(feature = "cuda")]

mod common_cuda;

use std::path::Path;

use common_cuda::*;
use qinfer::backend::cuda::CudaBackend;
use qinfer::kv::KvPrecision;
use qinfer::kv::batch::{BatchLayout, BatchSeq};
use qinfer::loader;
use qinfer::models::LanguageModel;
use qinfer::models::decoder::DecoderModel;
use serde_json::Value;

const BLOCK: usize = 16;

fn layout(start: usize, n: usize, logits_rows: Vec<usize>) -> BatchLayout {
    let seq = BatchSeq {
        rows: 0..n,
        start,
        block_table: (0..(start + n).div_ceil(BLOCK) as u32).collect(),
        state_slot: Some(0),
        prompt: true,
        snapshots: Vec::new(),
        adapter: None,
    };
    BatchLayout::new(vec![seq], BLOCK, logits_rows)
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j])).unwrap() as u32
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The head's prompt-row logits and its chained drafts on `lm`.
fn run(lm: &dyn LanguageModel, input: &[u32], k: usize) -> (Vec<f32>, Vec<u32>) {
    let (t, h, vocab) = (input.len(), lm.config().hidden_size, lm.config().vocab_size);
    let mut state = lm.new_batch_state(64, BLOCK, 1).unwrap();
    lm.reset_state_slot(state.as_mut(), 0).unwrap();
    let mut prefill = layout(0, t, vec![t - 1]);
    prefill.hidden_rows = (0..t).collect();
    let out = lm.forward_batch(state.as_mut(), input, &prefill, &[]).unwrap();
    let next: Vec<u32> = input[1..].iter().copied().chain([argmax(&out.logits)]).collect();
    let head = lm.mtp_forward(state.as_mut(), &next, &out.hidden, &layout(0, t, (0..t).collect()), false).unwrap();
    let mut drafts = vec![argmax(&head.logits[(t - 1) * vocab..])];
    let mut y = head.hidden[(t - 1) * h..].to_vec();
    for j in 1..k {
        let step = lm.mtp_forward(state.as_mut(), &[drafts[j - 1]], &y, &layout(t - 1 + j, 1, vec![0]), false).unwrap();
        drafts.push(argmax(&step.logits));
        y = step.hidden;
    }
    (head.logits, drafts)
}

#[test]
fn the_mtp_head_on_cuda_matches_the_reference() {
    if gpu().is_none() {
        return;
    }
    for case in ["qwen3_next", "qwen3_5", "qwen3_5_moe"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(case);
        let fx: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("mtp.json")).unwrap()).unwrap();
        let input = ids(&fx["input_ids"]);
        let (_, want) = qinfer::npy::read_f32(&dir.join("mtp_logits.npy")).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut m = loader::open(&dir).unwrap();
        m.config.load_mtp = true;
        let fast = m.load("cuda".parse().unwrap(), false).unwrap();
        let (logits, drafts) = run(fast.as_ref(), &input, 3);
        println!(
            "{case}: default precision: max |Δlogit| {:.2e} (of {scale:.1}), drafts {drafts:?}",
            max_abs(&logits, &want)
        );
        let backend = CudaBackend::new(0).unwrap().with_split_activations().with_kv_precision(KvPrecision::F32);
        let lm = DecoderModel::load(m.config.clone(), m.source.as_ref(), backend, &|_| {}).unwrap();
        let (logits, drafts) = run(&lm, &input, 3);
        let d = max_abs(&logits, &want);
        println!("{case}: parity configuration: max |Δlogit| {d:.2e} (of {scale:.1}), drafts {drafts:?}");
        assert!(d <= 2e-3 * scale, "{case}: {d}");
        assert_eq!(drafts, ids(&fx["chain"]["drafts"]), "{case}: the chained drafts");
    }
}
