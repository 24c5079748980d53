//! Attention on the GPU against the CPU: over the cache (decode, split,
//! prefill), the fused q|k|v prologue, and the prologue folded into decode.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use common_cuda::*;
use qinfer::backend::ops::FusedOps;
use qinfer::backend::{AttentionShape, Backend, QkvShape};
use qinfer::config::rope::Rope;
use qinfer::config::{RopeConfig, RopeStyle};
use qinfer::kv::{KvCache, KvPrecision};
use qinfer::tensor::DType;

#[test]
fn attention_over_the_cache_matches_cpu() {
    let Some(p) = pair() else { return };
    let mut r = Rng::fresh();
    // Decode steps (≤ 8 rows) take the split-K kernels: the GQA-sharing one
    // for head dims 64/128/256 (groups of 1 to 8 query heads per KV head, more
    // than one block of heads for 7 and 8), the plain split one for others.
    // Steps of 1, 3 and 8 rows at up to 1400 keys (one chunk and several),
    // windows shorter and longer than a chunk; longer steps take the
    // one-block-per-head kernel.
    // The f16 cache (the default) against the CPU over keys and values
    // rounded to f16 as it stores them: the same arithmetic, so f32 bounds.
    // An f32 cache, and the split-activation backend's (f32 too), against
    // the CPU over the values themselves.
    let gpu32 = gpu().unwrap().with_kv_precision(KvPrecision::F32);
    let to_f16 = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect::<Vec<_>>();
    for (nh, nkv, hd) in [(4, 2, 32), (8, 2, 128), (14, 2, 64), (4, 4, 256), (16, 2, 128), (6, 3, 128)] {
        for window in [None, Some(5), Some(300)] {
            let shape = AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, window, scale: 0.2 };
            let mut cc = p.cpu.new_cache(2, nkv * hd, 1500);
            let mut c16 = p.cpu.new_cache(2, nkv * hd, 1500);
            let mut cg = p.gpu.new_cache(2, nkv * hd, 1500);
            let mut c32 = gpu32.new_cache(2, nkv * hd, 1500);
            let mut cs = p.split.new_cache(2, nkv * hd, 1500);
            for step in [9usize, 1, 3, 8, 1, 20, 600, 1, 3, 8, 700, 1, 8] {
                let qv = r.vec(step * nh * hd);
                let (qc, qg) = p.acts(step, nh * hd, &qv);
                let kv = r.vec(step * nkv * hd);
                let vv = r.vec(step * nkv * hd);
                let (kc, kg) = p.acts(step, nkv * hd, &kv);
                let (vc, vg) = p.acts(step, nkv * hd, &vv);
                p.cpu.write_kv(&mut cc, 1, &kc, &vc);
                let (k16, v16) = (to_f16(&kv), to_f16(&vv));
                p.cpu.write_kv(
                    &mut c16,
                    1,
                    &p.cpu.act_from_host(step, nkv * hd, &k16),
                    &p.cpu.act_from_host(step, nkv * hd, &v16),
                );
                p.gpu.write_kv(&mut cg, 1, &kg, &vg);
                let oc = p.cpu.attention(&qc, &cc, 1, &shape);
                let o16 = p.cpu.attention(&qc, &c16, 1, &shape);
                let og = p.gpu.attention(&qg, &cg, 1, &shape);
                let what = format!("attention {nh}/{nkv}×{hd} window {window:?} at {} + {step}", cc.len());
                // Prefill steps of head dims 64/128/256 run on the tensor
                // cores with f16 inputs; the split-activation backend keeps
                // them exact.
                let flash = step > 8 && matches!(hd, 64 | 128 | 256);
                let tol = if flash { 3e-3 } else { 1e-5 };
                p.check(&format!("{what} f16 cache"), &o16, &og, tol);
                let g32 = |v: &[f32]| gpu32.act_from_host(step, v.len() / step, v);
                gpu32.write_kv(&mut c32, 1, &g32(&kv), &g32(&vv));
                let o32 = gpu32.attention(&g32(&qv), &c32, 1, &shape);
                let e = rel(&gpu32.to_host(&o32), &p.cpu.to_host(&oc));
                assert!(e <= tol, "{what} f32 cache: rel {e} > {tol}");
                let (ks, vs) = (p.split.act_from_host(step, nkv * hd, &kv), p.split.act_from_host(step, nkv * hd, &vv));
                p.split.write_kv(&mut cs, 1, &ks, &vs);
                let os = p.split.attention(&p.split.act_from_host(step, nh * hd, &qv), &cs, 1, &shape);
                let e = rel(&p.split.to_host(&os), &p.cpu.to_host(&oc));
                assert!(e <= 1e-5, "{what} split activations: rel {e}");
                let n = cc.len() + step;
                for c in [&mut cc, &mut c16] {
                    c.set_len(n);
                }
                for c in [&mut cg, &mut c32, &mut cs] {
                    c.set_len(n);
                }
            }
        }
    }
}

/// The fused q|k|v prologue (per-head norms, RoPE full or partial, output
/// gates, the KV append) and SwiGLU on a stacked gate|up, against the CPU's
/// composition of the separate ops; the caches compared through attention.
#[test]
fn qkv_prologue_and_swiglu_match_cpu() {
    for kv in [KvPrecision::F32, KvPrecision::F16] {
        qkv_prologue_and_swiglu_with(kv);
    }
}

fn qkv_prologue_and_swiglu_with(kv: KvPrecision) {
    let Some(p) = pair_kv(kv) else { return };
    let cache_tol = if kv == KvPrecision::F16 { F16_CACHE_TOL } else { 1e-5 };
    let mut r = Rng::fresh();
    let configs = [
        (4, 2, 32, false, true, 32, RopeStyle::Neox),
        (4, 2, 64, true, true, 16, RopeStyle::Neox),
        (6, 3, 128, false, false, 128, RopeStyle::Interleaved),
        (8, 2, 256, true, true, 64, RopeStyle::Neox),
    ];
    for (nh, nkv, hd, output_gate, with_norms, rot, style) in configs {
        let shape = QkvShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, output_gate };
        let rope = Rope::new(&RopeConfig { theta: 1e6, style, scaling: None }, rot);
        let (qn, kn) = (r.vec(hd), r.vec(hd));
        let (qnc, qng) = p.weights(&tensor("qn", DType::F32, vec![hd], &qn));
        let (knc, kng) = p.weights(&tensor("kn", DType::F32, vec![hd], &kn));
        let width = nh * hd * if output_gate { 2 } else { 1 } + 2 * nkv * hd;
        let mut cc = p.cpu.new_cache(1, nkv * hd, 64);
        let mut cg = p.gpu.new_cache(1, nkv * hd, 64);
        let attn = AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, window: None, scale: 0.1 };
        for rows in [5usize, 1, 3] {
            let start = cc.len();
            let positions: Vec<usize> = (start..start + rows).collect();
            let (xc, xg) = p.acts(rows, width, &r.vec(rows * width));
            let what =
                format!("qkv_prologue {nh}/{nkv}×{hd} gate {output_gate} rot {rot} {style:?} at {start}+{rows} {kv:?}");
            let norms_c = with_norms.then_some((&qnc, &knc));
            let norms_g = with_norms.then_some((&qng, &kng));
            let (qc, gc) = p.cpu.qkv_prologue(&xc, &shape, norms_c, 1e-6, &positions, &rope, &mut cc, 0);
            let (qg, gg) = p.gpu.qkv_prologue(&xg, &shape, norms_g, 1e-6, &positions, &rope, &mut cg, 0);
            p.check(&what, &qc, &qg, 1e-5);
            assert_eq!(gc.is_some(), gg.is_some());
            if let (Some(gc), Some(gg)) = (gc, gg) {
                p.check(&format!("{what} gate"), &gc, &gg, 0.0);
            }
            let (oc, og) = (p.cpu.attention(&qc, &cc, 0, &attn), p.gpu.attention(&qg, &cg, 0, &attn));
            p.check(&format!("{what} cache"), &oc, &og, cache_tol);
            cc.set_len(start + rows);
            cg.set_len(start + rows);
        }
    }
    for (rows, width) in [(1, 12288), (5, 100)] {
        let (xc, xg) = p.acts(rows, 2 * width, &r.vec(rows * 2 * width));
        p.check(&format!("swiglu {rows}x{width}"), &p.cpu.swiglu(&xc), &p.gpu.swiglu(&xg), 1e-6);
    }
    // gate|up GEMVs with the swiglu epilogue (decode rows, bf16 and f16),
    // and the GEMM then swiglu above 8 rows.
    for dtype in [DType::BF16, DType::F16] {
        for (rows, inp, width) in [(1, 4096, 6144), (1, 2560, 4608), (3, 1000, 50), (8, 256, 7), (12, 256, 64)] {
            let w = tensor("gate_up", dtype, vec![2 * width, inp], &r.vec(2 * width * inp));
            let (wc, wg) = p.weights(&w);
            let (xc, xg) = p.acts(rows, inp, &r.vec(rows * inp));
            let tol = if rows > 8 { 2e-2 } else { 1e-4 };
            let what = format!("linear_swiglu {dtype:?} {rows}x{inp}->2x{width}");
            p.check(&what, &p.cpu.linear_swiglu(&xc, &wc), &p.gpu.linear_swiglu(&xg, &wg), tol);
        }
    }
}

/// The q|k|v prologue folded into one-row decode attention (CUDA's
/// `attention_decode{hd}_prologue`) against the CPU's prologue then
/// attention: outputs, gates, and the cache rows it wrote (read back by the
/// plain attention of the next steps). Head dims 64/128/256, groups of 1 to
/// 8 query heads (8: two blocks of heads a KV head), partial rotation, both
/// rope styles and windows; one-row steps over caches longer than a decode
/// block (and prompts) take the composed path, checked the same way.
#[test]
fn qkv_attention_folds_the_prologue_into_decode() {
    for kv in [KvPrecision::F32, KvPrecision::F16] {
        qkv_attention_folds_with(kv);
    }
}

fn qkv_attention_folds_with(kv: KvPrecision) {
    let Some(p) = pair_kv(kv) else { return };
    let cache_tol = if kv == KvPrecision::F16 { F16_CACHE_TOL } else { 1e-5 };
    let mut r = Rng::fresh();
    let configs = [
        (4, 4, 64, false, true, 64, RopeStyle::Neox, None),
        (8, 2, 128, false, true, 128, RopeStyle::Neox, None),
        (16, 2, 128, true, true, 128, RopeStyle::Neox, Some(40)),
        (6, 3, 128, false, false, 128, RopeStyle::Interleaved, None),
        (8, 2, 256, true, true, 64, RopeStyle::Neox, None),
        (14, 2, 64, false, true, 32, RopeStyle::Interleaved, Some(300)),
    ];
    for (nh, nkv, hd, output_gate, with_norms, rot, style, window) in configs {
        let shape = QkvShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, output_gate };
        let attn = AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, window, scale: 0.1 };
        let rope = Rope::new(&RopeConfig { theta: 1e6, style, scaling: None }, rot);
        let (qnc, qng) = p.weights(&tensor("qn", DType::F32, vec![hd], &r.vec(hd)));
        let (knc, kng) = p.weights(&tensor("kn", DType::F32, vec![hd], &r.vec(hd)));
        let (norms_c, norms_g) = (with_norms.then_some((&qnc, &knc)), with_norms.then_some((&qng, &kng)));
        let width = nh * hd * if output_gate { 2 } else { 1 } + 2 * nkv * hd;
        let mut cc = p.cpu.new_cache(2, nkv * hd, 800);
        let mut cg = p.gpu.new_cache(2, nkv * hd, 800);
        // A prompt (the composed path), then one-row steps past one chunk.
        for rows in [1usize, 1, 37, 1, 1, 400, 1, 1, 1] {
            let start = cc.len();
            let positions: Vec<usize> = (start..start + rows).collect();
            let (xc, xg) = p.acts(rows, width, &r.vec(rows * width));
            let what = format!(
                "qkv_attention {nh}/{nkv}x{hd} gate {output_gate} rot {rot} {style:?} {window:?} at {start}+{rows} {kv:?}"
            );
            let (oc, gc) = p.cpu.qkv_attention(&xc, &shape, norms_c, 1e-6, &positions, &rope, &mut cc, 1, &attn);
            let (og, gg) = p.gpu.qkv_attention(&xg, &shape, norms_g, 1e-6, &positions, &rope, &mut cg, 1, &attn);
            let flash = rows > 8;
            p.check(&what, &oc, &og, if flash { 3e-3 } else { cache_tol });
            assert_eq!(gc.is_some(), gg.is_some(), "{what}: gate");
            if let (Some(gc), Some(gg)) = (gc, gg) {
                p.check(&format!("{what} gate"), &gc, &gg, 0.0);
            }
            cc.set_len(start + rows);
            cg.set_len(start + rows);
        }
        // Every row the steps wrote, through the plain attention of 8 rows.
        let q = r.vec(8 * nh * hd);
        let (qc, qg) = p.acts(8, nh * hd, &q);
        let (kc, kg) = p.acts(8, nkv * hd, &r.vec(8 * nkv * hd));
        p.cpu.write_kv(&mut cc, 1, &kc, &kc);
        p.gpu.write_kv(&mut cg, 1, &kg, &kg);
        let wide = AttentionShape { window: None, ..attn };
        let what = format!("qkv_attention {nh}/{nkv}x{hd} cache {kv:?}");
        p.check(&what, &p.cpu.attention(&qc, &cc, 1, &wide), &p.gpu.attention(&qg, &cg, 1, &wide), cache_tol);
    }
}
