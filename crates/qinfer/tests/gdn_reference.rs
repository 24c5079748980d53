//! The CPU Gated DeltaNet core against an independent float64 numpy reference
//! (tests/fixtures/gdn, made by scripts/gdn_reference.py): both the recurrent
//! and the chunked form, from a fresh state and continuing from a carried one.

use std::path::{Path, PathBuf};

use qinfer::backend::cpu::gdn::{self, DeltaInputs};
use qinfer::config::GdnConfig;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gdn")
}

fn load(name: &str) -> Vec<f32> {
    qinfer::npy::read_f32(&dir().join(format!("{name}.npy"))).unwrap().1
}

fn cfg() -> GdnConfig {
    GdnConfig { num_k_heads: 2, num_v_heads: 4, k_head_dim: 16, v_head_dim: 24, conv_kernel: 4, v_heads_tiled: false }
}

struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
}

impl Case {
    fn load() -> Self {
        Case {
            q: load("q"),
            k: load("k"),
            v: load("v"),
            a: load("a"),
            b: load("b"),
            a_log: load("A_log"),
            dt_bias: load("dt_bias"),
        }
    }
    /// Inputs of tokens `[t0, t1)`.
    fn prepare(&self, t0: usize, t1: usize) -> (DeltaInputs, &[f32]) {
        let c = cfg();
        let (kd, vd, nv) = (c.key_dim(), c.value_dim(), c.num_v_heads);
        let x = gdn::prepare(
            &c,
            &self.q[t0 * kd..t1 * kd],
            &self.k[t0 * kd..t1 * kd],
            &self.a[t0 * nv..t1 * nv],
            &self.b[t0 * nv..t1 * nv],
            &self.a_log,
            &self.dt_bias,
        );
        (x, &self.v[t0 * vd..t1 * vd])
    }
}

/// max |a − b| relative to max |b|.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn gates_match_the_float64_reference() {
    let case = Case::load();
    let (x, _) = case.prepare(0, 300);
    assert!(rel(&x.g, &load("g")) < 1e-6, "g: {}", rel(&x.g, &load("g")));
    assert!(rel(&x.beta, &load("beta")) < 1e-6);
}

#[test]
fn both_forms_match_the_float64_reference_for_any_split() {
    let case = Case::load();
    let (want_o, want_state, want_mid) = (load("o"), load("final_state"), load("state_t150"));
    let c = cfg();
    type Form = fn(&GdnConfig, &DeltaInputs, &[f32], &mut [f32]) -> Vec<f32>;
    let splits: [(&str, Vec<usize>, Form); 5] = [
        ("chunked, one call", vec![300], gdn::chunked),
        ("recurrent, one call", vec![300], gdn::recurrent),
        ("chunked, 150 + 150", vec![150, 150], gdn::chunked),
        ("chunked, 1/63/64/65/107", vec![1, 63, 64, 65, 107], gdn::chunked),
        ("recurrent, 150 + 150", vec![150, 150], gdn::recurrent),
    ];
    for (name, parts, form) in splits {
        let mut state = vec![0f32; c.num_v_heads * c.k_head_dim * c.v_head_dim];
        let mut o = Vec::new();
        let mut t = 0;
        for len in parts {
            let (x, v) = case.prepare(t, t + len);
            o.extend(form(&c, &x, v, &mut state));
            t += len;
            if t == 150 {
                assert!(rel(&state, &want_mid) < 1e-5, "{name}: state at 150: {}", rel(&state, &want_mid));
            }
        }
        let (eo, es) = (rel(&o, &want_o), rel(&state, &want_state));
        println!("{name}: output {eo:.1e}, state {es:.1e}");
        assert!(eo < 1e-5 && es < 1e-5, "{name}: output {eo}, state {es}");
    }
}
