//! Sampling on the device against the host's sampler.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use common_cuda::*;
use qinfer::backend::Backend;
use qinfer::backend::ops::SamplingOps;
use qinfer::sampling::SamplingParams;

/// How close `pick`'s choice came to flipping, recomputed in f64: the least
/// distance of top_p, of min_p (relative to the top probability) and of the
/// draw u·total from a boundary of the sorted candidates' running mass. f32
/// sums in another order may decide differently within such a distance.
fn sampling_margin(p: &SamplingParams, logits: &[f32], u: f32) -> f64 {
    if p.temperature == 0.0 {
        return f64::INFINITY;
    }
    let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, l)| (i as u32, l / p.temperature)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k);
    }
    let max = cand[0].1 as f64;
    let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 as f64 - max).exp()).collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    let mut margin = f64::INFINITY;
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, pr) in probs.iter().enumerate() {
            acc += pr;
            margin = margin.min((acc - p.top_p as f64).abs());
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    if p.min_p > 0.0 {
        let cut = probs[0] * p.min_p as f64;
        probs.iter().for_each(|x| margin = margin.min((x - cut).abs() / probs[0]));
        let keep = probs.iter().take_while(|x| **x >= cut).count().max(1);
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let r = u as f64 * total;
    let mut acc = 0.0;
    for pr in &probs {
        acc += pr;
        margin = margin.min((acc - r).abs() / total);
    }
    margin
}

/// Device sampling picks what the host's `pick` picks: greedy (first of equal
/// maxima), the repetition penalty, and temperature with top-k, top-p and
/// min-p, on vocabularies of 5 to 151,936 with tied logits among them. Draws
/// within 1e-4 of a boundary of the running mass are skipped (and counted).
#[test]
fn device_sampling_matches_the_host_sampler() {
    let Some(g) = gpu() else { return };
    let mut r = Rng::fresh();
    let base = SamplingParams::default();
    let combos = [
        SamplingParams { ..base.clone() },
        SamplingParams { repetition_penalty: 1.5, ..base.clone() },
        SamplingParams { temperature: 0.7, top_k: 40, ..base.clone() },
        SamplingParams { temperature: 1.0, top_p: 0.9, ..base.clone() },
        SamplingParams { temperature: 1.3, min_p: 0.05, ..base.clone() },
        SamplingParams { temperature: 0.8, top_k: 50, top_p: 0.95, min_p: 0.02, ..base.clone() },
        SamplingParams { temperature: 1.0, ..base.clone() },
        SamplingParams { temperature: 0.9, top_p: 0.8, repetition_penalty: 1.3, ..base.clone() },
        SamplingParams { temperature: 2.0, top_k: 3, ..base.clone() },
        // Qwen3's generation config; then the largest top-k the cut-down
        // kernel takes, one past it, and a single candidate.
        SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..base.clone() },
        SamplingParams { temperature: 1.0, top_k: 64, top_p: 0.9, min_p: 0.01, ..base.clone() },
        SamplingParams { temperature: 1.0, top_k: 65, ..base.clone() },
        SamplingParams { temperature: 0.5, top_k: 1, ..base.clone() },
        // No top-k (or one past the vocabulary): the cut-down candidates
        // decide, or the kernel falls back to the whole vocabulary.
        SamplingParams { temperature: 0.7, top_p: 0.95, min_p: 0.05, ..base.clone() },
        SamplingParams { temperature: 0.8, top_k: 1_000_000, top_p: 0.9, ..base.clone() },
    ];
    let (mut fast_draws, mut fallback_draws) = (0, 0);
    for p in &combos {
        let (mut checked, mut skipped) = (0, 0);
        for vocab in [5, 1000, 151_936] {
            for trial in 0..20 {
                // A bulk of logits in [-8, 8) and a few spikes above it, of a
                // height that decides how much mass the bulk keeps; every
                // other trial on a grid of 0.5, so that many logits tie.
                let mut logits: Vec<f32> = r.vec(vocab).iter().map(|x| x * 8.0).collect();
                // Every third trial peaked (spikes 16 to 28 above the bulk):
                // the mass of the candidates the kernels cut the vocabulary
                // to decides; the other trials leave much of it in the bulk.
                let height = 10.0 + 6.0 * r.f() + if trial % 3 == 2 { 12.0 } else { 0.0 };
                for _ in 0..vocab.min(8) {
                    let i = ((r.f().abs() * 1e6) as usize) % vocab;
                    logits[i] += height + r.f();
                }
                if trial % 2 == 1 {
                    logits.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0);
                }
                // Over Qwen's vocabulary, every third trial (another third
                // than the peaked ones) crowds 100 high logits into the first
                // of the 64 slices the cut-down kernel takes: more than the 64
                // it keeps of a slice, so a cut or a draw past the 64th of
                // them needs the whole vocabulary.
                if vocab > 64 * 64 && trial % 3 == 1 {
                    for j in 0..100 {
                        logits[j * 23] = 20.0 + 0.013 * j as f32;
                    }
                }
                let top = qinfer::sampling::argmax(&logits);
                // A second equal maximum after the first, for greedy's tie rule.
                if vocab > 5 && trial % 4 == 0 {
                    logits[vocab - 1] = logits[top as usize];
                }
                let penalized: Vec<u32> = if p.repetition_penalty != 1.0 {
                    let mut ids: Vec<u32> = (0..20).map(|_| ((r.f().abs() * 1e6) as usize % vocab) as u32).collect();
                    ids.push(top);
                    ids.sort();
                    ids.dedup();
                    ids
                } else {
                    Vec::new()
                };
                let u = (r.f() + 1.0) / 2.0;
                let mut host = logits.clone();
                let want = qinfer::sampling::pick(p, &mut host, &penalized, u);
                if sampling_margin(p, &host, u) < 1e-4 {
                    skipped += 1;
                    continue;
                }
                // Two rows: the sampler reads the last one.
                let mut rows = r.vec(vocab);
                rows.extend_from_slice(&logits);
                let act = g.act_from_host(2, vocab, &rows);
                let fallbacks = g.sampling_fallbacks().unwrap();
                let got = g.sample(&act, p, &penalized, u).unwrap();
                assert_eq!(got, want, "{p:?} vocab {vocab} trial {trial} u {u}");
                checked += 1;
                let no_top_k = p.top_k == 0 || p.top_k >= vocab;
                if p.temperature > 0.0 && no_top_k && vocab >= 4096 {
                    match g.sampling_fallbacks().unwrap() - fallbacks {
                        0 => fast_draws += 1,
                        _ => fallback_draws += 1,
                    }
                }
            }
        }
        println!("{p:?}: {checked} picks equal to the host's, {skipped} skipped at a boundary");
        assert!(checked >= 40, "{p:?}: only {checked} of 60 draws clear of a boundary");
    }
    // Without a top-k over Qwen's vocabulary, both ways ran and matched.
    println!("no top-k, 151,936 logits: {fast_draws} draws from the cut-down candidates, {fallback_draws} from all");
    assert!(fast_draws >= 20 && fallback_draws >= 5, "{fast_draws} cut-down draws, {fallback_draws} fallbacks");
}

/// A batch's picks in one call: rows with their own parameters, penalties
/// and draws, some rows left out, picked as the host's `pick` picks each
/// row (draws within 1e-4 of a boundary are left out of the call).
#[test]
fn batched_device_sampling_picks_each_row_as_the_host_does() {
    let Some(g) = gpu() else { return };
    let mut r = Rng::fresh();
    let base = SamplingParams::default();
    let kinds = [
        SamplingParams { ..base.clone() },
        SamplingParams { repetition_penalty: 1.4, ..base.clone() },
        SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..base.clone() },
        SamplingParams { temperature: 1.0, top_p: 0.9, min_p: 0.02, ..base.clone() },
        SamplingParams { temperature: 0.9, top_k: 200, repetition_penalty: 1.2, ..base.clone() },
    ];
    let (rows, vocab) = (48, 151_936);
    let mut logits = Vec::with_capacity(rows * vocab);
    for _ in 0..rows {
        let mut row: Vec<f32> = r.vec(vocab).iter().map(|x| x * 6.0).collect();
        for _ in 0..6 {
            let i = ((r.f().abs() * 1e6) as usize) % vocab;
            row[i] += 12.0 + 4.0 * r.f();
        }
        logits.extend(row);
    }
    let act = g.act_from_host(rows, vocab, &logits);
    let mut picks = Vec::new();
    let mut want = Vec::new();
    for row in 0..rows {
        if row % 7 == 3 {
            continue; // a row another way picks (a constraint's, say)
        }
        let params = kinds[row % kinds.len()].clone();
        let penalized: Vec<u32> = match params.repetition_penalty != 1.0 {
            true => (0..30)
                .map(|_| ((r.f().abs() * 1e6) as usize % vocab) as u32)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect(),
            false => Vec::new(),
        };
        let u = (r.f() + 1.0) / 2.0;
        let mut host = logits[row * vocab..(row + 1) * vocab].to_vec();
        let pick = qinfer::sampling::pick(&params, &mut host, &penalized, u);
        if sampling_margin(&params, &host, u) < 1e-4 {
            continue;
        }
        want.push(pick);
        picks.push((row, qinfer::sampling::RowPick { params, penalized, u }));
    }
    assert!(picks.len() >= 30, "only {} rows clear of a boundary", picks.len());
    let refs: Vec<(usize, &qinfer::sampling::RowPick)> = picks.iter().map(|(row, p)| (*row, p)).collect();
    let got = g.sample_rows(&act, &refs).unwrap();
    assert_eq!(got, want);
    // The same rows once more in another order: each pick is its row's.
    let reversed: Vec<_> = refs.iter().rev().copied().collect();
    let mut again = g.sample_rows(&act, &reversed).unwrap();
    again.reverse();
    assert_eq!(again, want);
    // A row past the logits is an error, not a read out of bounds.
    assert!(g.sample_rows(&act, &[(rows, refs[0].1)]).is_err());
    println!("{} rows picked in one call as the host picks them", got.len());
}
