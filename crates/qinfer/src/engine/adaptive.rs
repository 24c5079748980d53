//! How many drafts a sequence's step verifies, from measured costs. A
//! step's time is fit as `fixed + per_row · rows` over recent steps that
//! only decode (the rows there are decode tokens and drafts). One more
//! draft row costs `per_row`; it is kept, and gives a token, with the
//! probability that every draft before it and itself are accepted, about
//! `α^k` for the k-th draft at a per-draft acceptance rate `α`. Against a
//! step that yields a token per sequence, a row pays where
//! `α^k > per_row · n / (fixed + per_row · n)` (n the step's plain rows):
//! the share of a plain step's time that grows with its rows. One
//! sequence on a GPU, where a step is read-bound, gets the full K; a large
//! batch, where a step is compute-bound, gets none; a CPU, where every row
//! costs nearly a step, only drafts that are nearly always right. A draft
//! model's own forwards count too: each draft also costs its share of the
//! drafter's time (`DraftCost`), which a drafter as large as the target
//! makes as dear as a step.

/// Step time against rows, fit over recent decode-only steps (weighted
/// sums, older steps fading).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepCost {
    w: f64,
    r: f64,
    t: f64,
    rr: f64,
    rt: f64,
}

/// Each new step's weight against the ones before (steps fade by this).
const FADE: f64 = 0.95;

/// The same for a sequence's verifications: its text changes faster (a
/// quoted passage ends), so they fade faster.
const ACCEPTANCE_FADE: f64 = 0.8;

impl StepCost {
    /// Notes a decode-only step of `rows` rows that took `secs`.
    pub fn observe(&mut self, rows: usize, secs: f64) {
        let r = rows as f64;
        let s = self;
        (s.w, s.r, s.t) = (s.w * FADE + 1.0, s.r * FADE + r, s.t * FADE + secs);
        (s.rr, s.rt) = (s.rr * FADE + r * r, s.rt * FADE + r * secs);
    }

    /// `(fixed, per_row)` in seconds; None until the steps seen differ
    /// enough in their rows to tell the two apart.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.w < 4.0 {
            return None;
        }
        let (mr, mt) = (self.r / self.w, self.t / self.w);
        let var = self.rr / self.w - mr * mr;
        // Rows must vary by about half a row or more.
        if var < 0.25 {
            return None;
        }
        let per_row = ((self.rt / self.w - mr * mt) / var).max(0.0);
        Some(((mt - per_row * mr).max(0.0), per_row))
    }

    /// The share of a step of `rows` plain rows that grows with its rows
    /// (0 when unknown: drafts then look free, as before any measurement).
    pub fn row_share(&self, rows: usize) -> f64 {
        match self.fit() {
            Some((fixed, per_row)) if fixed + per_row * rows as f64 > 0.0 => {
                per_row * rows as f64 / (fixed + per_row * rows as f64)
            }
            _ => 0.0,
        }
    }
}

impl StepCost {
    /// What a draft that costs `per_draft` seconds to propose (a draft
    /// model's forward, shared by the sequences it drafts for) adds to a
    /// step of `rows` plain rows, as a share of it; with no fit yet,
    /// against the mean time of a step's row.
    pub fn draft_share(&self, rows: usize, per_draft: f64) -> f64 {
        if per_draft <= 0.0 {
            return 0.0;
        }
        match self.fit() {
            Some((fixed, per_row)) if fixed + per_row * rows as f64 > 0.0 => {
                per_draft * rows as f64 / (fixed + per_row * rows as f64)
            }
            _ if self.t > 0.0 && self.r > 0.0 => per_draft * self.r / self.t,
            _ => 0.0,
        }
    }
}

/// Seconds a proposer spends on a draft token (a draft model's forwards
/// over the drafts it proposed), recent steps weighing more.
#[derive(Debug, Clone, Copy, Default)]
pub struct DraftCost {
    secs: f64,
    drafts: f64,
}

impl DraftCost {
    /// Notes proposals of `drafts` tokens that took `secs`.
    pub fn observe(&mut self, secs: f64, drafts: usize) {
        self.secs = self.secs * FADE + secs;
        self.drafts = self.drafts * FADE + drafts as f64;
    }

    /// Seconds a draft token costs (0 before any was proposed).
    pub fn per_draft(&self) -> f64 {
        if self.drafts > 0.0 { self.secs / self.drafts } else { 0.0 }
    }
}

/// A sequence's acceptance so far: accepted drafts and rejections (a
/// verification that did not keep all its drafts ends in one), recent
/// ones weighing more.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    accepted: f64,
    rejected: f64,
}

impl Acceptance {
    /// Notes a verification that kept `accepted` of `drafted` drafts.
    pub fn verified(&mut self, accepted: usize, drafted: usize) {
        self.accepted = self.accepted * ACCEPTANCE_FADE + accepted as f64;
        self.rejected = self.rejected * ACCEPTANCE_FADE + f64::from(accepted < drafted);
    }

    /// Each draft's chance to be accepted after the ones before it were
    /// (a half before any verification).
    pub fn rate(&self) -> f64 {
        (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)
    }
}

/// The drafts worth verifying, at most `most`: the k-th while `rate^k`
/// exceeds `row_share`.
pub fn worth(rate: f64, row_share: f64, most: usize) -> usize {
    let mut p = 1.0;
    for k in 1..=most {
        p *= rate;
        if p <= row_share {
            return k - 1;
        }
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_finds_fixed_and_per_row_costs() {
        let mut c = StepCost::default();
        assert_eq!(c.row_share(4), 0.0, "nothing measured: drafts look free");
        // 5 ms a step and 0.1 ms a row, rows 1 to 5 and back.
        for i in 0..40 {
            let rows = 1 + i % 5;
            c.observe(rows, 0.005 + 0.0001 * rows as f64);
        }
        let (fixed, per_row) = c.fit().unwrap();
        assert!((fixed - 0.005).abs() < 1e-9 && (per_row - 0.0001).abs() < 1e-9, "{fixed} {per_row}");
        assert!((c.row_share(10) - 0.001 / 0.006).abs() < 1e-9);
        // The same rows every step: no fit.
        let mut c = StepCost::default();
        (0..20).for_each(|_| c.observe(16, 0.01));
        assert!(c.fit().is_none());
    }

    #[test]
    fn drafts_are_worth_their_rows_while_likely_enough() {
        // A read-bound step: every draft of a good proposer.
        assert_eq!(worth(0.8, 0.02, 4), 4);
        // A CPU, rows nearly a step each: the first draft only if very likely.
        assert_eq!(worth(0.8, 0.7, 4), 1);
        assert_eq!(worth(0.5, 0.7, 4), 0);
        // Compute-bound: none.
        assert_eq!(worth(0.95, 0.99, 8), 0);
        let mut a = Acceptance::default();
        assert_eq!(a.rate(), 0.5);
        (0..10).for_each(|_| a.verified(4, 4));
        assert!(a.rate() > 0.9, "{}", a.rate());
        (0..15).for_each(|_| a.verified(0, 4));
        assert!(a.rate() < 0.25, "{}", a.rate());
    }

    #[test]
    fn a_drafters_time_counts_against_its_drafts() {
        let mut c = StepCost::default();
        for i in 0..40 {
            let rows = 1 + i % 5;
            c.observe(rows, 0.005 + 0.0001 * rows as f64);
        }
        // A drafter taking 2.5 ms a draft, against a 6 ms step of 10 rows.
        let mut d = DraftCost::default();
        assert_eq!(d.per_draft(), 0.0);
        (0..10).for_each(|_| d.observe(0.01, 4));
        assert!((d.per_draft() - 0.0025).abs() < 1e-12);
        let share = c.draft_share(10, d.per_draft());
        assert!((share - 0.025 / 0.006).abs() < 1e-9, "{share}");
        // Dearer than the token it may give: no draft, however likely.
        assert_eq!(worth(0.99, c.row_share(10) + share, 4), 0);
        // No fit yet: against the mean time of a row.
        let mut c = StepCost::default();
        (0..3).for_each(|_| c.observe(1, 0.01));
        assert!((c.draft_share(1, 0.005) - 0.5).abs() < 1e-9);
    }
}
