//! Token sampling, in the order transformers applies its logits processors:
//! repetition penalty, then temperature, top-k, top-p, min-p. The OpenAI
//! API's logit bias and presence and frequency penalties come before them,
//! as vLLM applies them: the bias added to the logits, then each token this
//! sampler has picked lowered by `presence_penalty` once and
//! `frequency_penalty` per pick (generated tokens only, not the prompt's).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

pub mod verify;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables; >1 discourages tokens already in the context.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of each token already generated
    /// (0 disables; OpenAI's range is [-2, 2]).
    pub presence_penalty: f32,
    /// Subtracted from the logit of each generated token once per time it
    /// was generated (0 disables; [-2, 2]).
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids ([-100, 100] each).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
    /// Report each picked token's log probability and this many most likely
    /// alternatives (None: no log probabilities).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &str, r: &str| Err(Error::Invalid(format!("{f}: {r}")));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", "must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", "must be a finite number > 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", "must be between -2 and 2");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", "must be between -2 and 2");
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(Error::Invalid(format!(
                "logit_bias: the bias of token {t} must be between -100 and 100, got {b}"
            )));
        }
        Ok(())
    }

    /// Whether picking needs what only the host sampler keeps (the logit
    /// bias and the counts of generated tokens): device pickers then read
    /// the logits back instead.
    pub fn host_only(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.logprobs.is_some()
    }

    /// Whether draft tokens are verified where the logits are (greedy
    /// acceptance by device picks: temperature 0, nothing kept on the host);
    /// other parameters verify on the host ([`Sampler::verify`]).
    pub fn verifies_on_device(&self) -> bool {
        self.temperature == 0.0 && !self.host_only()
    }
}

/// One row's pick where the logits are: what [`Sampler::sample`] would do
/// with parameters that need nothing kept on the host
/// ([`SamplingParams::host_only`] false), its draw already taken.
#[derive(Debug, Clone)]
pub struct RowPick {
    pub params: SamplingParams,
    /// The distinct context tokens the repetition penalty applies to.
    pub penalized: Vec<u32>,
    /// The sampler's uniform draw.
    pub u: f32,
}

#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// How often each token was picked (with presence or frequency
    /// penalties only).
    picked: std::collections::HashMap<u32, u32>,
}

/// Index of the largest value; the first one on ties (as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = StdRng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng, picked: Default::default() })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The uniform number in [0, 1) the next sample uses: one per non-greedy
    /// sample and none for greedy, so the host and a device that samples
    /// draw the seed's stream alike.
    pub fn draw(&mut self) -> f32 {
        if self.params.temperature == 0.0 { 0.0 } else { self.rng.random::<f32>() }
    }

    /// The distinct tokens of `context` that the repetition penalty applies
    /// to, in order of first appearance (none when the penalty is off).
    pub fn penalized(&self, context: &[u32]) -> Vec<u32> {
        if self.params.repetition_penalty == 1.0 {
            return Vec::new();
        }
        let mut seen = std::collections::HashSet::new();
        context.iter().copied().filter(|t| seen.insert(*t)).collect()
    }

    /// Picks the next token from `logits`, given the tokens of the context so far.
    /// This pick made elsewhere (the device), where the parameters allow
    /// it: the same draw and penalized tokens [`Sampler::sample`] would use.
    /// None for parameters that need the host.
    pub fn row_pick(&mut self, context: &[u32]) -> Option<RowPick> {
        if self.params.host_only() {
            return None;
        }
        let penalized = self.penalized(context);
        let u = self.draw();
        Some(RowPick { params: self.params.clone(), penalized, u })
    }

    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        self.adjust(logits);
        let penalized = self.penalized(context);
        let u = self.draw();
        let token = pick(&self.params, logits, &penalized, u);
        self.record(token);
        token
    }

    /// Applies the logit bias, then the presence and frequency penalties of
    /// the tokens picked so far.
    fn adjust(&self, logits: &mut [f32]) {
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        for (&t, &n) in &self.picked {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.params.frequency_penalty * n as f32 + self.params.presence_penalty;
            }
        }
    }

    /// Counts a pick for the presence and frequency penalties (kept only
    /// when one is set; parameters with either always pick on the host,
    /// [`SamplingParams::host_only`]).
    fn record(&mut self, token: u32) {
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.picked.entry(token).or_insert(0) += 1;
        }
    }
}

/// What may come next, decided outside the model (a grammar, say): asked
/// before each pick of its sequence and told each pick.
pub trait TokenConstraint: Send {
    /// The token ids allowed next, as a bit set (bit `t % 32` of word
    /// `t / 32`); None when any token may come.
    fn allowed(&mut self) -> std::result::Result<Option<Vec<u32>>, String>;
    /// The token picked.
    fn accept(&mut self, token: u32) -> std::result::Result<(), String>;
}

/// Makes a request's constraint, once per sequence (each of `n` choices,
/// and again should the request be resubmitted).
pub trait ConstraintFactory: Send + Sync + std::fmt::Debug {
    fn start(&self) -> std::result::Result<Box<dyn TokenConstraint>, String>;
}

/// Sets the logits of tokens outside `mask` (a bit set as
/// [`TokenConstraint::allowed`] gives it) to minus infinity; false when the
/// mask allows none of them.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) -> bool {
    let mut any = false;
    for (t, l) in logits.iter_mut().enumerate() {
        let on = mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
        if on {
            any = true;
        } else {
            *l = f32::NEG_INFINITY;
        }
    }
    any
}

/// A picked token's log probability and the most likely alternatives'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The `top` most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log probability under `logits` (the model's own distribution,
/// before penalties, bias and temperature, as vLLM reports by default) and
/// the `top` most likely tokens'.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |t: u32| (f64::from(logits[t as usize]) - log_z) as f32;
    let top = top.min(logits.len());
    let mut best: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if top > 0 && top < best.len() {
        best.select_nth_unstable_by(top - 1, order);
    }
    best.truncate(top);
    best.sort_by(order);
    TokenLogprob { token, logprob: lp(token), top: best.into_iter().map(|t| (t, lp(t))).collect() }
}

/// Divides positive logits of `penalized` tokens by the penalty and
/// multiplies negative ones (as transformers' repetition penalty does).
pub fn apply_repetition_penalty(penalty: f32, logits: &mut [f32], penalized: &[u32]) {
    for &t in penalized {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// The token `params` choose from `logits` after penalizing the distinct
/// tokens `penalized`, with `u` the sampler's uniform draw (unused when
/// greedy). The host's reference for device samplers.
pub fn pick(p: &SamplingParams, logits: &mut [f32], penalized: &[u32], u: f32) -> u32 {
    if p.repetition_penalty != 1.0 {
        apply_repetition_penalty(p.repetition_penalty, logits, penalized);
    }
    if p.temperature == 0.0 {
        return argmax(logits);
    }
    Candidates::new(p, logits).draw(u)
}

/// What a non-greedy pick chooses among (penalties already applied): the
/// kept tokens, most likely first, and their probabilities before the
/// renormalization that top-p and min-p imply (`total` is their sum).
pub struct Candidates {
    pub tokens: Vec<u32>,
    pub probs: Vec<f32>,
    pub total: f64,
}

impl Candidates {
    /// Temperature, top-k, top-p and min-p over `logits`.
    pub fn new(p: &SamplingParams, logits: &[f32]) -> Self {
        // Candidates sorted by logit, descending; ties keep the lower id first.
        // With top-k, only the k kept are sorted (a total order: the same k).
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, l)| (i as u32, l / p.temperature)).collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
        }
        cand.sort_by(order);
        let max = cand[0].1;
        // Probabilities in f32, their running sums in f64: over 150k candidates
        // an f32 running sum drifts by up to ~1e-3, enough to move the top-p cut
        // or the draw by a candidate.
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f64 = probs.iter().map(|&x| f64::from(x)).sum();
        probs.iter_mut().for_each(|x| *x = (f64::from(*x) / sum) as f32);
        if p.top_p < 1.0 {
            // Keep the smallest prefix whose mass reaches top_p (always at least one).
            let mut acc = 0.0f64;
            let mut keep = probs.len();
            for (i, pr) in probs.iter().enumerate() {
                acc += f64::from(*pr);
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let cut = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|x| **x >= cut).count().max(1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().map(|&x| f64::from(x)).sum();
        let tokens = cand[..probs.len()].iter().map(|c| c.0).collect();
        Candidates { tokens, probs, total }
    }

    /// The candidate the uniform draw `u` lands on.
    pub fn draw(&self, u: f32) -> u32 {
        let mut r = f64::from(u) * self.total;
        for (i, pr) in self.probs.iter().enumerate() {
            r -= f64::from(*pr);
            if r <= 0.0 {
                return self.tokens[i];
            }
        }
        self.tokens[self.probs.len() - 1]
    }

    /// `token`'s probability under the pick (0 when it is not kept).
    pub fn prob(&self, token: u32) -> f64 {
        match self.tokens.iter().position(|&t| t == token) {
            Some(i) => f64::from(self.probs[i]) / self.total,
            None => 0.0,
        }
    }

    /// The same pick with `token` taken out (the others renormalized); None
    /// when nothing else is left.
    pub fn without(mut self, token: u32) -> Option<Self> {
        if let Some(i) = self.tokens.iter().position(|&t| t == token) {
            self.tokens.remove(i);
            self.probs.remove(i);
            self.total = self.probs.iter().map(|&x| f64::from(x)).sum();
        }
        (!self.tokens.is_empty() && self.total > 0.0).then_some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The OpenAI penalties as vLLM applies them, written out: the logit
    /// minus frequency × count minus presence × (count > 0), over the
    /// tokens generated so far, after the bias.
    fn reference_adjust(logits: &[f32], p: &SamplingParams, generated: &[u32]) -> Vec<f32> {
        let mut out = logits.to_vec();
        for &(t, b) in &p.logit_bias {
            out[t as usize] += b;
        }
        for (t, l) in out.iter_mut().enumerate() {
            let n = generated.iter().filter(|&&g| g as usize == t).count() as f32;
            *l -= p.frequency_penalty * n + p.presence_penalty * if n > 0.0 { 1.0 } else { 0.0 };
        }
        out
    }

    #[test]
    fn presence_and_frequency_penalties_lower_generated_tokens() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.75,
            logit_bias: vec![(2, 1.5), (4, -3.0)],
            ..Default::default()
        };
        let mut s = Sampler::new(p.clone()).unwrap();
        let base = [2.0f32, 1.0, -0.5, 0.25, 3.0, 1.9];
        let mut generated = Vec::new();
        for _ in 0..8 {
            let want_logits = reference_adjust(&base, &p, &generated);
            let mut got_logits = base.to_vec();
            s.adjust(&mut got_logits);
            assert_eq!(got_logits, want_logits, "after {generated:?}");
            let t = s.sample(&mut base.to_vec(), &[]);
            assert_eq!(t, argmax(&want_logits), "after {generated:?}");
            generated.push(t);
        }
        // The greedy picks rotate as each pick is penalized.
        assert!(generated.iter().collect::<std::collections::HashSet<_>>().len() > 1, "{generated:?}");
        // The prompt's tokens are not penalized: only the sampler's picks.
        let mut fresh = Sampler::new(p.clone()).unwrap();
        assert_eq!(fresh.sample(&mut base.to_vec(), &[0, 0, 0, 5]), argmax(&reference_adjust(&base, &p, &[])));
    }

    #[test]
    fn a_large_logit_bias_forces_its_token() {
        let p = SamplingParams { temperature: 1.0, logit_bias: vec![(3, 100.0)], seed: 9, ..Default::default() };
        let mut s = Sampler::new(p).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [5.0, 4.0, 6.0, -2.0], &[]), 3);
        }
    }

    #[test]
    fn penalties_and_biases_out_of_range_are_refused() {
        for p in [
            SamplingParams { presence_penalty: 2.5, ..Default::default() },
            SamplingParams { frequency_penalty: -2.01, ..Default::default() },
            SamplingParams { frequency_penalty: f32::NAN, ..Default::default() },
            SamplingParams { logit_bias: vec![(1, 101.0)], ..Default::default() },
        ] {
            assert!(Sampler::new(p.clone()).is_err(), "{p:?}");
        }
    }

    #[test]
    fn greedy_takes_first_max() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&mut [0.0, 3.0, 3.0, 1.0], &[]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams { temperature: 5.0, top_k: 1, seed: 7, ..Default::default() }).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [0.1, 0.0, 2.0, 1.9], &[]), 2);
        }
    }

    #[test]
    fn repetition_penalty_can_change_the_argmax() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() }).unwrap();
        assert_eq!(s.sample(&mut [1.0, 1.5, -1.0], &[1]), 0);
    }

    #[test]
    fn min_p_excludes_unlikely_tokens() {
        let mut s =
            Sampler::new(SamplingParams { temperature: 1.0, min_p: 0.5, seed: 1, ..Default::default() }).unwrap();
        for _ in 0..50 {
            assert_ne!(s.sample(&mut [5.0, 0.0, 4.9, -3.0], &[]), 1);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, seed: 3, ..Default::default() }).unwrap();
        let logits = [0.0f32, (3.0f32).ln()];
        let n = 4000;
        let ones = (0..n).filter(|_| s.sample(&mut logits.clone(), &[]) == 1).count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.03, "{frac}");
    }

    #[test]
    fn seeds_reproduce() {
        let p = SamplingParams { temperature: 1.0, seed: 42, ..Default::default() };
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut a = Sampler::new(p.clone()).unwrap();
        let mut b = Sampler::new(p).unwrap();
        for _ in 0..10 {
            assert_eq!(a.sample(&mut logits.clone(), &[]), b.sample(&mut logits.clone(), &[]));
        }
    }

    #[test]
    fn top_k_by_selection_keeps_the_sorted_prefix() {
        // Logits on a coarse grid, so many tie; the top k by a full sort
        // (logit descending, lower id first) is what must be kept.
        let logits: Vec<f32> = (0..997u32).map(|i| ((i * 7919 % 61) as f32 * 0.25).floor()).collect();
        for k in [1, 2, 5, 17, 300, 996, 997, 2000] {
            let mut want: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, l)| (i as u32, *l)).collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(k);
            let p = SamplingParams { temperature: 1.0, top_k: k, ..Default::default() };
            // Draws spread over the kept mass pick each kept token in order.
            let picked: std::collections::BTreeSet<u32> =
                (0..4000).map(|i| pick(&p, &mut logits.clone(), &[], i as f32 / 4000.0)).collect();
            let kept: std::collections::BTreeSet<u32> = want.iter().map(|c| c.0).collect();
            assert!(picked.is_subset(&kept), "top-{k}: picked a token outside the top k");
            assert!(picked.contains(&want[0].0), "top-{k}: never picked the most likely token");
        }
    }

    #[test]
    fn invalid_params_are_errors() {
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { temperature: -1.0, ..Default::default() }).is_err());
    }
}
