//! Latency histograms as Prometheus reads them (`_bucket{le=...}`, `_sum`,
//! `_count`), with vLLM's bucket bounds: time to first token, time per
//! output token after the first, and end-to-end request latency. Measured
//! where outputs leave the engine for the client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
const ITL: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const E2E: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last counts what is above every bound.
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        let at = self.bounds.iter().position(|&b| secs <= b).unwrap_or(self.bounds.len());
        self.counts[at].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(out, "# HELP qinfer:{name} {help}\n# TYPE qinfer:{name} histogram");
        let mut total = 0;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "qinfer:{name}_bucket{{le=\"{le}\"}} {total}");
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "qinfer:{name}_sum {sum}\nqinfer:{name}_count {total}");
    }
}

pub struct Latency {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Default for Latency {
    fn default() -> Self {
        Latency { ttft: Histogram::new(TTFT), itl: Histogram::new(ITL), e2e: Histogram::new(E2E) }
    }
}

impl Latency {
    pub fn render(&self, out: &mut String) {
        self.ttft.render("time_to_first_token_seconds", "Time from a request's arrival to its first token.", out);
        self.itl.render("inter_token_latency_seconds", "Time between a request's output tokens.", out);
        self.e2e.render("e2e_request_latency_seconds", "Time from a request's arrival to its end.", out);
    }
}

/// One request's clock: observes its outputs as they leave the engine.
pub struct RequestClock {
    start: Instant,
    last: Option<Instant>,
}

impl RequestClock {
    pub fn new() -> Self {
        RequestClock { start: Instant::now(), last: None }
    }

    /// An output of `tokens` new tokens; `finished` on the last.
    pub fn output(&mut self, m: &Latency, tokens: usize, finished: bool) {
        let now = Instant::now();
        if tokens > 0 {
            match self.last {
                None => m.ttft.observe((now - self.start).as_secs_f64()),
                Some(t) => {
                    let each = (now - t).as_secs_f64() / tokens as f64;
                    for _ in 0..tokens {
                        m.itl.observe(each);
                    }
                }
            }
            self.last = Some(now);
        }
        if finished {
            m.e2e.observe((now - self.start).as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_count_everything() {
        let h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 3.0] {
            h.observe(s);
        }
        let mut out = String::new();
        h.render("x", "h", &mut out);
        assert!(out.contains("qinfer:x_bucket{le=\"0.1\"} 2\n"), "{out}");
        assert!(out.contains("qinfer:x_bucket{le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("qinfer:x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("qinfer:x_count 4\n") && out.contains("qinfer:x_sum 3.65"), "{out}");
    }
}
