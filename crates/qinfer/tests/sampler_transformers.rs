//! qinfer's sampler against transformers' logits processors: for random
//! logits, contexts and parameter sets, the distribution `sampling::pick`
//! draws from equals the one transformers' `generate` samples from
//! (repetition penalty, temperature, top-k, top-p, min-p, in transformers'
//! order), recorded by scripts/make_sampler_fixtures.py in
//! tests/fixtures/sampler/cases.json.
//!
//! `pick` maps its uniform draw `u` to a token by walking the kept candidates
//! in a fixed order, so each token owns one interval of `u` whose length is
//! its probability. The intervals are found exactly, by bisection on `u`
//! over f32 values, and a sweep of evenly spaced draws checks that every
//! draw lands in the interval found for it.

use std::collections::BTreeMap;
use std::path::Path;

use qinfer::sampling::{SamplingParams, pick};
use serde_json::Value;

fn cases() -> Vec<Value> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/sampler/cases.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn params(c: &Value) -> SamplingParams {
    let p = &c["params"];
    let f = |k: &str| p[k].as_f64().unwrap() as f32;
    SamplingParams {
        temperature: f("temperature"),
        top_k: p["top_k"].as_u64().unwrap() as usize,
        top_p: f("top_p"),
        min_p: f("min_p"),
        repetition_penalty: f("repetition_penalty"),
        seed: 0,
        ..Default::default()
    }
}

/// The distinct tokens of the context, as `Sampler::penalized` gives them
/// (transformers penalizes each token in the context once, repeats or not).
fn penalized(p: &SamplingParams, context: &[u32]) -> Vec<u32> {
    if p.repetition_penalty == 1.0 {
        return Vec::new();
    }
    let mut seen = std::collections::HashSet::new();
    context.iter().copied().filter(|t| seen.insert(*t)).collect()
}

/// The intervals of draws in [0, 1) that pick each token, in draw order:
/// (token, first draw, end of its interval). Each end is found by bisecting
/// f32 bit patterns, assuming a token's draws are contiguous (the test's
/// sweep checks that).
fn pick_intervals(p: &SamplingParams, logits: &[f32], penalized: &[u32]) -> Vec<(u32, f32, f32)> {
    let at = |u: f32| pick(p, &mut logits.to_vec(), penalized, u);
    let one = 1.0f32.to_bits();
    let mut out: Vec<(u32, f32, f32)> = Vec::new();
    let mut start = 0u32; // bits of the first draw of the current token's interval
    while start < one {
        let tok = at(f32::from_bits(start));
        // Largest bits in [start, one) that still pick `tok`.
        let (mut lo, mut hi) = (start, one);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if at(f32::from_bits(mid)) == tok {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        assert!(out.iter().all(|o| o.0 != tok), "token {tok} owns two intervals of the draw");
        out.push((tok, f32::from_bits(start), f32::from_bits(hi)));
        start = hi;
    }
    out
}

/// Largest |qinfer − transformers| over a token's probability: measured at
/// most 6.0e-8 over the 14 cases (the f32 spacing of draws near 1 is 6e-8,
/// and both sides round exp and the normalization in f32); 2e-7 is 3.3×
/// that, and far below what a wrong cut moves (a kept token's whole
/// probability, ≥ 1e-4 in these cases).
const TOL: f64 = 2e-7;

#[test]
fn pick_draws_from_transformers_distribution() {
    let cases = cases();
    assert_eq!(cases.len(), 14, "tests/fixtures/sampler/cases.json holds the 14 cases of the script");
    for c in &cases {
        let name = c["name"].as_str().unwrap();
        let p = params(c);
        let logits: Vec<f32> = c["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let context: Vec<u32> = c["context"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let want: BTreeMap<u32, f64> = c["support"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap()))
            .collect();
        let pen = penalized(&p, &context);
        let intervals = pick_intervals(&p, &logits, &pen);

        // Every draw of a sweep picks the token whose interval holds it.
        for u in (0..4096).map(|i| (i as f32 + 0.5) / 4096.0) {
            let t = pick(&p, &mut logits.clone(), &pen, u);
            let owner = intervals.iter().find(|iv| iv.1 <= u && u < iv.2).map(|iv| iv.0);
            assert_eq!(owner, Some(t), "{name}: draw {u} picked {t}, not its interval's token");
        }
        let got: BTreeMap<u32, f64> = intervals.iter().map(|iv| (iv.0, f64::from(iv.2) - f64::from(iv.1))).collect();

        let kept_only_by_qinfer: Vec<u32> = got.keys().filter(|t| !want.contains_key(t)).copied().collect();
        assert!(kept_only_by_qinfer.is_empty(), "{name}: transformers removes {kept_only_by_qinfer:?}");
        let mut worst = 0f64;
        for (t, w) in &want {
            let g = got.get(t).copied().unwrap_or(0.0);
            assert!((g - w).abs() <= TOL, "{name}: token {t}: qinfer {g:.9}, transformers {w:.9}");
            worst = worst.max((g - w).abs());
        }
        println!("{name}: {} tokens kept as transformers keeps them, max |Δp| {worst:.2e}", got.len());
    }
}
