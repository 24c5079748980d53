//! Gated DeltaNet on the GPU against the CPU: the conv, the delta rule and
//! the fused decode step.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use common_cuda::*;
use qinfer::backend::ops::GdnOps;
use qinfer::backend::{Backend, GdnWeights};
use qinfer::config::GdnConfig;
use qinfer::tensor::DType;

/// The conv (general and decode forms), g and β, and the delta rule (state
/// in memory, in registers, chunked) one op at a time, then the fused decode
/// step and the prompt form of a stacked projection, against the CPU.
#[test]
fn gated_deltanet_matches_cpu() {
    let Some(p) = pair() else { return };
    let mut r = Rng::fresh();
    // Key heads of 16 (state in memory) and 128 (state held in registers,
    // value heads of 40 to cover a partial warp of columns).
    // A conv kernel of 3 covers the conv's general form (4 is compiled apart).
    for (v_heads_tiled, dk, dv, kernel) in
        [(false, 16, 24, 4), (true, 16, 24, 3), (false, 128, 40, 4), (true, 128, 128, 4)]
    {
        let cfg = GdnConfig {
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: dk,
            v_head_dim: dv,
            conv_kernel: kernel,
            v_heads_tiled,
        };
        let (cd, kd, vd, nv) = (cfg.conv_dim(), cfg.key_dim(), cfg.value_dim(), cfg.num_v_heads);
        let (convc, convg) = p.weights(&tensor("conv", DType::BF16, vec![cd, kernel], &r.vec(cd * kernel)));
        let (alc, alg) = p.weights(&tensor("A_log", DType::F32, vec![nv], &r.vec(nv)));
        let (dtc, dtg) = p.weights(&tensor("dt_bias", DType::F32, vec![nv], &r.vec(nv)));
        let mut sc = p.cpu.new_gdn_state(&cfg);
        let mut sg = p.gpu.new_gdn_state(&cfg);
        // A 70-token prompt (chunked on both for key heads of 128), decode
        // steps, a second prompt continuing from the state, and one longer
        // than a slice of the GPU's chunked form (1024 tokens) ending in a
        // partial chunk.
        for t in [70usize, 1, 1, 3, 41, 1100] {
            let (xc, xg) = p.acts(t, cd, &r.vec(t * cd));
            let mc = p.cpu.gdn_conv(&xc, &convc, &mut sc);
            let mg = p.gpu.gdn_conv(&xg, &convg, &mut sg);
            p.check(&format!("gdn_conv T={t}"), &mc, &mg, 1e-5);
            let (qc, qg) = p.acts(t, kd, &r.vec(t * kd));
            let (kc, kg) = p.acts(t, kd, &r.vec(t * kd));
            let (vc, vg) = p.acts(t, vd, &r.vec(t * vd));
            let (ac, ag) = p.acts(t, nv, &r.vec(t * nv));
            let (bc, bg) = p.acts(t, nv, &r.vec(t * nv));
            let oc = p.cpu.gated_delta_rule(&qc, &kc, &vc, &ac, &bc, &alc, &dtc, &mut sc);
            let og = p.gpu.gated_delta_rule(&qg, &kg, &vg, &ag, &bg, &alg, &dtg, &mut sg);
            p.check(&format!("gated_delta_rule T={t} tiled {v_heads_tiled} dk {dk} dv {dv}"), &oc, &og, 1e-4);
        }
        let snapshot = sg.clone();
        let (_, xg) = p.acts(1, cd, &r.vec(cd));
        let after = p.gpu.gdn_conv(&xg, &convg, &mut sg);
        let mut restored = snapshot.clone();
        let again = p.gpu.gdn_conv(&xg, &convg, &mut restored);
        assert_eq!(p.gpu.to_host(&after), p.gpu.to_host(&again), "a cloned state is an independent snapshot");
    }

    // The fused decode step (one stacked projection in: conv, delta rule and
    // gated norm in two launches) and the prompt form (each kernel reading
    // its columns of the stacked rows in place) against the CPU's
    // composition of the ops; value heads of 40 cover a partial warp of
    // columns, 200 of them more than a decode block holds; 3 heads of 33
    // make the conv's rows 355 floats wide, so q and k rows are not 16-byte
    // aligned (the per-token kernel with plain loads takes those prompts).
    for (v_heads_tiled, nk, nv, dv) in [
        (false, 2, 4, 128),
        (true, 2, 4, 128),
        (false, 2, 6, 40),
        (false, 4, 4, 128),
        (false, 2, 4, 200),
        (false, 1, 3, 33),
    ] {
        let cfg = GdnConfig {
            num_k_heads: nk,
            num_v_heads: nv,
            k_head_dim: 128,
            v_head_dim: dv,
            conv_kernel: 4,
            v_heads_tiled,
        };
        let (cd, kd, vd) = (cfg.conv_dim(), cfg.key_dim(), cfg.value_dim());
        let all = cd + vd + 2 * nv;
        let (convc, convg) = p.weights(&tensor("conv", DType::BF16, vec![cd, 4], &r.vec(cd * 4)));
        let (alc, alg) = p.weights(&tensor("A_log", DType::F32, vec![nv], &r.vec(nv)));
        let (dtc, dtg) = p.weights(&tensor("dt_bias", DType::F32, vec![nv], &r.vec(nv)));
        let (nc, ng) = p.weights(&tensor("norm", DType::F32, vec![dv], &r.vec(dv)));
        let wg = GdnWeights { conv: &convg, a_log: &alg, dt_bias: &dtg, norm: &ng };
        let mut sc = p.cpu.new_gdn_state(&cfg);
        let mut sg = p.gpu.new_gdn_state(&cfg);
        let steps: &[usize] = if dv > 128 { &[37, 9, 50, 130] } else { &[1, 1, 3, 8, 1, 2, 37, 1, 9, 2, 200] };
        for &t in steps {
            let (mc, mg) = p.acts(t, all, &r.vec(t * all));
            let og = p.gpu.gdn_mix(&mg, &wg, 1e-6, &mut sg).expect("a fused form for key heads of 128");
            let cols = |at, len| p.cpu.gather_columns(&mc, all, at, len);
            let conv = p.cpu.gdn_conv(&cols(0, cd), &convc, &mut sc);
            let (q, k, v) = (
                p.cpu.gather_columns(&conv, cd, 0, kd),
                p.cpu.gather_columns(&conv, cd, kd, kd),
                p.cpu.gather_columns(&conv, cd, 2 * kd, vd),
            );
            let (z, b, a) = (cols(cd, vd), cols(cd + vd, nv), cols(cd + vd + nv, nv));
            let o = p.cpu.gated_delta_rule(&q, &k, &v, &a, &b, &alc, &dtc, &mut sc);
            let oc = p.cpu.rms_norm_gated(&o, &z, &nc, 1e-6);
            p.check(&format!("gdn_mix T={t} {nk}/{nv} heads dv {dv} tiled {v_heads_tiled}"), &oc, &og, 1e-4);
        }
        if dv > 128 {
            // Decode steps of value heads past 128 are left to the composed kernels.
            let (_, mg) = p.acts(1, all, &r.vec(all));
            assert!(p.gpu.gdn_mix(&mg, &wg, 1e-6, &mut sg).is_none());
        }
    }
}

/// The decode step of many sequences in one launch pair (`gdn_mix_rows`,
/// each row with its own state) against the CPU's composition of the ops
/// per sequence, and bit for bit against the GPU's one-sequence step: five
/// sequences whose states have advanced apart, over several steps.
#[test]
fn gdn_mix_rows_steps_each_sequence_as_alone() {
    let Some(p) = pair() else { return };
    let mut r = Rng::fresh();
    for (v_heads_tiled, nk, nv, dv) in [(false, 2, 4, 128), (true, 2, 4, 128), (false, 2, 6, 40), (false, 4, 4, 128)] {
        let cfg = GdnConfig {
            num_k_heads: nk,
            num_v_heads: nv,
            k_head_dim: 128,
            v_head_dim: dv,
            conv_kernel: 4,
            v_heads_tiled,
        };
        let (cd, kd, vd) = (cfg.conv_dim(), cfg.key_dim(), cfg.value_dim());
        let all = cd + vd + 2 * nv;
        let (convc, convg) = p.weights(&tensor("conv", DType::BF16, vec![cd, 4], &r.vec(cd * 4)));
        let (alc, alg) = p.weights(&tensor("A_log", DType::F32, vec![nv], &r.vec(nv)));
        let (dtc, dtg) = p.weights(&tensor("dt_bias", DType::F32, vec![nv], &r.vec(nv)));
        let (nc, ng) = p.weights(&tensor("norm", DType::F32, vec![dv], &r.vec(dv)));
        let wg = GdnWeights { conv: &convg, a_log: &alg, dt_bias: &dtg, norm: &ng };
        let seqs = 5;
        let mut sc: Vec<_> = (0..seqs).map(|_| p.cpu.new_gdn_state(&cfg)).collect();
        let mut sg: Vec<_> = (0..seqs).map(|_| p.gpu.new_gdn_state(&cfg)).collect();
        // The CPU's composition of one sequence's step over rows `mc`.
        let cpu_step = |mc: &qinfer::backend::cpu::CpuAct, state: &mut _| {
            let cols = |at, len| p.cpu.gather_columns(mc, all, at, len);
            let conv = p.cpu.gdn_conv(&cols(0, cd), &convc, state);
            let (q, k, v) = (
                p.cpu.gather_columns(&conv, cd, 0, kd),
                p.cpu.gather_columns(&conv, cd, kd, kd),
                p.cpu.gather_columns(&conv, cd, 2 * kd, vd),
            );
            let (z, b, a) = (cols(cd, vd), cols(cd + vd, nv), cols(cd + vd + nv, nv));
            let o = p.cpu.gated_delta_rule(&q, &k, &v, &a, &b, &alc, &dtc, state);
            p.cpu.rms_norm_gated(&o, &z, &nc, 1e-6)
        };
        // Sequence i first takes a prompt of 3·i + 1 rows, so the states differ.
        for i in 0..seqs {
            let t = 3 * i + 1;
            let (mc, mg) = p.acts(t, all, &r.vec(t * all));
            cpu_step(&mc, &mut sc[i]);
            p.gpu.gdn_mix(&mg, &wg, 1e-6, &mut sg[i]).unwrap();
        }
        for step in 0..4 {
            let x = r.vec(seqs * all);
            let (_, mg) = p.acts(seqs, all, &x);
            let mut alone: Vec<_> = sg.clone();
            let mut refs: Vec<_> = sg.iter_mut().collect();
            let og = p.gpu.gdn_mix_rows(&mg, &wg, 1e-6, &mut refs).expect("a many-sequence form for key heads of 128");
            let got = p.gpu.to_host(&og);
            p.gpu.check().unwrap();
            for i in 0..seqs {
                let row = &x[i * all..(i + 1) * all];
                let (mc, mgi) = p.acts(1, all, row);
                let oc = p.cpu.to_host(&cpu_step(&mc, &mut sc[i]));
                let want_gpu = p.gpu.to_host(&p.gpu.gdn_mix(&mgi, &wg, 1e-6, &mut alone[i]).unwrap());
                let mine = &got[i * vd..(i + 1) * vd];
                assert_eq!(mine, &want_gpu[..], "step {step}, sequence {i}: the one-sequence step on the GPU");
                let e = rel(mine, &oc);
                println!(
                    "gdn_mix_rows {nk}/{nv} heads dv {dv} tiled {v_heads_tiled} step {step} seq {i}: rel err {e:.2e}"
                );
                assert!(e <= 1e-4, "step {step}, sequence {i}: rel err {e} against the CPU");
            }
        }
    }
}
