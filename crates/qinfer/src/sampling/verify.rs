//! Speculative decoding's acceptance rule on the host: draft tokens checked
//! against the target model's rows with the request's own sampler.
//!
//! The proposers (prompt lookup, a greedy draft model) propose
//! deterministically, so the draft distribution of each position is a point
//! mass q = δ(d). Rejection sampling then accepts d with probability
//! min(1, p(d)/q(d)) = p(d), and after a rejection draws from the residual
//! max(p − q, 0), normalized: p with d taken out. Every emitted token so
//! follows the target distribution p exactly, whatever was proposed.

use super::{Candidates, Sampler, TokenLogprob, apply_repetition_penalty, argmax, token_logprob};

/// What a verification keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// The drafts kept, from the first on.
    pub accepted: usize,
    /// The token after the last kept draft (the correction after a
    /// rejection, or the next token when every draft was kept).
    pub token: u32,
    /// Log probabilities of the kept drafts, then of `token` (when the
    /// sampler's parameters ask for them).
    pub logprobs: Vec<TokenLogprob>,
}

impl Sampler {
    /// Verifies `drafts`, proposed after `context`: `rows[i]` holds the
    /// target's logits after `context` and the first `i` drafts
    /// (`drafts.len() + 1` rows). Penalties and the logit bias apply to each
    /// row as they would have, had the kept drafts been sampled one by one.
    pub fn verify(&mut self, rows: &[&[f32]], drafts: &[u32], context: &[u32]) -> Verified {
        assert_eq!(rows.len(), drafts.len() + 1, "one logits row per draft, and one after them");
        let mut logprobs = Vec::new();
        // The context the repetition penalty sees (kept only with one).
        let penalizes = self.params.repetition_penalty != 1.0;
        let mut seen: Vec<u32> = if penalizes { context.to_vec() } else { Vec::new() };
        for (i, row) in rows.iter().enumerate() {
            let mut logits = row.to_vec();
            self.adjust(&mut logits);
            if penalizes {
                let penalized = self.penalized(&seen);
                apply_repetition_penalty(self.params.repetition_penalty, &mut logits, &penalized);
            }
            let greedy = self.params.temperature == 0.0;
            let candidates = (!greedy).then(|| Candidates::new(&self.params, &logits));
            let draft = drafts.get(i).copied();
            let kept = match (draft, &candidates) {
                (None, _) => None,
                (Some(d), None) => (argmax(&logits) == d).then_some(d),
                (Some(d), Some(c)) => (f64::from(self.draw()) < c.prob(d)).then_some(d),
            };
            let token = match (kept, candidates) {
                (Some(d), _) => d,
                (None, None) => argmax(&logits),
                (None, Some(c)) => match draft {
                    None => c.draw(self.draw()),
                    // A rejected draft: the residual distribution, p without it.
                    Some(d) => c.without(d).expect("a draft holding all the mass is always kept").draw(self.draw()),
                },
            };
            self.record(token);
            if let Some(k) = self.params.logprobs {
                logprobs.push(token_logprob(row, token, k));
            }
            if kept.is_none() {
                return Verified { accepted: i, token, logprobs };
            }
            if penalizes {
                seen.push(token);
            }
        }
        unreachable!("the last row keeps no draft")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    const VOCAB: usize = 4;

    /// A toy language model: the next token's logits given the context
    /// (its last two tokens matter).
    fn toy_logits(context: &[u32]) -> Vec<f32> {
        let a = context.last().copied().unwrap_or(0) as f32;
        let b = context.len().checked_sub(2).map_or(0, |i| context[i]) as f32;
        (0..VOCAB).map(|t| ((t as f32 + 1.0) * (0.7 * a + 0.3 * b + 1.1)).sin() * 1.5).collect()
    }

    /// The first `n` tokens after `prompt`, sampled one at a time.
    fn plain(s: &mut Sampler, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut ctx = prompt.to_vec();
        while ctx.len() < prompt.len() + n {
            let t = s.sample(&mut toy_logits(&ctx), &ctx);
            ctx.push(t);
        }
        ctx[prompt.len()..].to_vec()
    }

    /// The same with speculation: `propose` gives up to `k` drafts, which
    /// are verified against the toy model's rows.
    fn speculative(s: &mut Sampler, prompt: &[u32], n: usize, k: usize, propose: impl Fn(&[u32]) -> u32) -> Vec<u32> {
        let mut ctx = prompt.to_vec();
        while ctx.len() < prompt.len() + n {
            let mut drafts = Vec::new();
            for _ in 0..k {
                let mut with = ctx.clone();
                with.extend(&drafts);
                drafts.push(propose(&with));
            }
            let rows: Vec<Vec<f32>> = (0..=k)
                .map(|i| {
                    let mut with = ctx.clone();
                    with.extend(&drafts[..i]);
                    toy_logits(&with)
                })
                .collect();
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let v = s.verify(&refs, &drafts, &ctx);
            ctx.extend(&drafts[..v.accepted]);
            ctx.push(v.token);
        }
        ctx[prompt.len()..prompt.len() + n].to_vec()
    }

    /// The exact probability of each continuation of `n` tokens under `p`.
    fn exact(p: &SamplingParams, prompt: &[u32], n: usize) -> std::collections::HashMap<Vec<u32>, f64> {
        let mut out = std::collections::HashMap::from([(Vec::new(), 1.0)]);
        for _ in 0..n {
            let mut next = std::collections::HashMap::new();
            for (seq, pr) in out {
                let mut ctx = prompt.to_vec();
                ctx.extend(&seq);
                let s = Sampler::new(p.clone()).unwrap();
                let mut logits = toy_logits(&ctx);
                if p.repetition_penalty != 1.0 {
                    apply_repetition_penalty(p.repetition_penalty, &mut logits, &s.penalized(&ctx));
                }
                let c = Candidates::new(p, &logits);
                for t in 0..VOCAB as u32 {
                    let q = c.prob(t);
                    if q > 0.0 {
                        let mut longer = seq.clone();
                        longer.push(t);
                        next.insert(longer, pr * q);
                    }
                }
            }
            out = next;
        }
        out
    }

    /// Pearson's chi-square of `counts` against the `exact` probabilities,
    /// and its degrees of freedom.
    fn chi_square(
        counts: &std::collections::HashMap<Vec<u32>, usize>,
        exact: &std::collections::HashMap<Vec<u32>, f64>,
        n: usize,
    ) -> (f64, usize) {
        assert!(counts.keys().all(|k| exact.contains_key(k)), "sampled a continuation of probability 0");
        let stat = exact
            .iter()
            .map(|(k, &p)| {
                let e = p * n as f64;
                let o = counts.get(k).copied().unwrap_or(0) as f64;
                (o - e).powi(2) / e
            })
            .sum();
        (stat, exact.len() - 1)
    }

    /// Chi-square critical values at p = 0.001 (Wilson–Hilferty).
    fn critical_001(df: usize) -> f64 {
        let d = df as f64;
        let z = 3.0902; // the standard normal's 0.999 quantile
        d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
    }

    #[test]
    fn speculation_keeps_the_target_distribution() {
        let prompt = [1u32, 3];
        let n = 3;
        let samples = 30_000;
        for p in [
            SamplingParams { temperature: 1.0, ..Default::default() },
            SamplingParams { temperature: 0.7, top_p: 0.9, repetition_penalty: 1.3, ..Default::default() },
            SamplingParams { temperature: 1.3, top_k: 3, min_p: 0.05, ..Default::default() },
        ] {
            let want = exact(&p, &prompt, n);
            // A proposer that is often right, and one that is mostly wrong.
            for (name, k, propose) in [
                ("likely", 3, (|c: &[u32]| argmax(&toy_logits(c))) as fn(&[u32]) -> u32),
                ("unlikely", 2, |c: &[u32]| (argmax(&toy_logits(c)) + 1) % VOCAB as u32),
            ] {
                let mut counts = std::collections::HashMap::new();
                let mut s = Sampler::new(SamplingParams { seed: 11, ..p.clone() }).unwrap();
                for _ in 0..samples {
                    *counts.entry(speculative(&mut s, &prompt, n, k, propose)).or_insert(0) += 1;
                }
                let (stat, df) = chi_square(&counts, &want, samples);
                assert!(stat < critical_001(df), "{p:?}, {name} proposer: chi-square {stat:.1} over {df} dof");
                // The test can fail: plain sampling from a perturbed
                // distribution (temperature off by 10%) is rejected.
                if name == "likely" && p.top_k == 0 {
                    let mut off =
                        Sampler::new(SamplingParams { temperature: p.temperature * 1.1, ..p.clone() }).unwrap();
                    let mut counts = std::collections::HashMap::new();
                    for _ in 0..samples {
                        *counts.entry(plain(&mut off, &prompt, n)).or_insert(0) += 1;
                    }
                    let (stat, df) = chi_square(&counts, &want, samples);
                    assert!(stat > critical_001(df), "{p:?}: a 10% temperature error went unseen ({stat:.1})");
                }
            }
        }
    }

    #[test]
    fn greedy_verification_keeps_the_argmax_prefix() {
        let prompt = [2u32, 0];
        for params in [
            SamplingParams::default(),
            SamplingParams { repetition_penalty: 1.5, logit_bias: vec![(1, 0.4)], ..Default::default() },
            SamplingParams { presence_penalty: 0.8, frequency_penalty: 0.3, ..Default::default() },
        ] {
            let want = plain(&mut Sampler::new(params.clone()).unwrap(), &prompt, 12);
            for k in 1..5 {
                let oracle = |c: &[u32]| {
                    // Right for the first tokens, then wrong every third position.
                    let i = c.len() - prompt.len();
                    let t = want.get(i).copied().unwrap_or(0);
                    if i % 3 == 2 { (t + 1) % VOCAB as u32 } else { t }
                };
                let got = speculative(&mut Sampler::new(params.clone()).unwrap(), &prompt, 12, k, oracle);
                assert_eq!(got, want, "{params:?}, {k} drafts");
            }
        }
    }

    #[test]
    fn logprobs_cover_the_kept_drafts_and_the_token() {
        let p = SamplingParams { temperature: 0.0, logprobs: Some(2), ..Default::default() };
        let ctx = [1u32, 2];
        let d0 = argmax(&toy_logits(&ctx));
        let after = [1, 2, d0];
        let wrong = (argmax(&toy_logits(&after)) + 1) % VOCAB as u32;
        let rows = [toy_logits(&ctx), toy_logits(&after), toy_logits(&[1, 2, d0, wrong])];
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let v = Sampler::new(p).unwrap().verify(&refs, &[d0, wrong], &ctx);
        assert_eq!(v.accepted, 1);
        assert_eq!(v.token, argmax(&rows[1]));
        assert_eq!(v.logprobs, vec![token_logprob(&rows[0], d0, 2), token_logprob(&rows[1], v.token, 2)]);
    }
}
