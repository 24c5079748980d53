//! Elementwise ops, RMSNorm, RoPE and the column ops on the GPU against the CPU.
//! Without a CUDA device the tests print why and pass (they fail under
//! `QINFER_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common_cuda;

use common_cuda::*;
use qinfer::backend::Backend;
use qinfer::backend::ops::{FusedOps, GdnOps};
use qinfer::config::rope::Rope;
use qinfer::config::{RopeConfig, RopeStyle};
use qinfer::tensor::DType;

#[test]
fn elementwise_norm_rope_and_column_ops_match_cpu() {
    let Some(p) = pair() else { return };
    let mut r = Rng::fresh();
    let (rows, cols) = (5, 128);
    let xv = r.vec(rows * cols);
    let (xc, xg) = p.acts(rows, cols, &xv);
    let (yc, yg) = p.acts(rows, cols, &r.vec(rows * cols));
    for group in [128, 32] {
        let (wc, wg) = p.weights(&tensor("n", DType::F32, vec![group], &r.vec(group)));
        p.check(&format!("rms_norm /{group}"), &p.cpu.rms_norm(&xc, &wc, 1e-6), &p.gpu.rms_norm(&xg, &wg, 1e-6), 1e-5);
        p.check(
            &format!("rms_norm_gated /{group}"),
            &p.cpu.rms_norm_gated(&xc, &yc, &wc, 1e-6),
            &p.gpu.rms_norm_gated(&xg, &yg, &wg, 1e-6),
            1e-5,
        );
    }
    // Wide rows: float4 groups held in registers (5000), past what the
    // registers hold (20000), and groups not a multiple of 4 (1001); with and
    // without the fused residual add.
    for group in [5000, 20000, 1001] {
        let n = 2 * group;
        let (wc, wg) = p.weights(&tensor("n", DType::F32, vec![group], &r.vec(group)));
        let hv = r.vec(n);
        let (hc, hg) = p.acts(2, group, &hv);
        p.check(&format!("rms_norm /{group}"), &p.cpu.rms_norm(&hc, &wc, 1e-6), &p.gpu.rms_norm(&hg, &wg, 1e-6), 1e-5);
        let (mut hc, mut hg) = p.acts(2, group, &hv);
        let (dc, dg) = p.acts(2, group, &r.vec(n));
        let (oc, og) = (p.cpu.add_rms_norm(&mut hc, &dc, &wc, 1e-6), p.gpu.add_rms_norm(&mut hg, &dg, &wg, 1e-6));
        p.check(&format!("add_rms_norm /{group}"), &oc, &og, 1e-5);
        p.check(&format!("add_rms_norm /{group} residual"), &hc, &hg, 1e-7);
    }
    p.check("silu_mul", &p.cpu.silu_mul(&xc, &yc), &p.gpu.silu_mul(&xg, &yg), 1e-6);
    let (mut ac, mut ag) = p.acts(rows, cols, &xv);
    p.cpu.add_assign(&mut ac, &yc);
    p.gpu.add_assign(&mut ag, &yg);
    p.check("add_assign", &ac, &ag, 1e-7);
    let (gc, gg) = p.acts(rows, 1, &r.vec(rows));
    for (name, gate_c, gate_g) in [("full", &yc, &yg), ("per-row", &gc, &gg)] {
        let (mut mc, mut mg) = p.acts(rows, cols, &xv);
        p.cpu.mul_sigmoid(&mut mc, gate_c);
        p.gpu.mul_sigmoid(&mut mg, gate_g);
        p.check(&format!("mul_sigmoid {name}"), &mc, &mg, 1e-6);
    }
    for (group, off, len) in [(128, 0, 128), (64, 16, 32), (32, 24, 8)] {
        p.check(
            &format!("gather_columns {group}/{off}/{len}"),
            &p.cpu.gather_columns(&xc, group, off, len),
            &p.gpu.gather_columns(&xg, group, off, len),
            0.0,
        );
    }
    let (zc, zg) = p.acts(rows, 24, &r.vec(rows * 24));
    p.check("concat_columns", &p.cpu.concat_columns(&[&xc, &zc, &yc]), &p.gpu.concat_columns(&[&xg, &zg, &yg]), 0.0);
    p.check("last_row", &p.cpu.last_row(&xc), &p.gpu.last_row(&xg), 0.0);
    let positions = [4091usize, 4092, 4093, 4094, 4095];
    for (style, rot) in [(RopeStyle::Neox, 32), (RopeStyle::Neox, 8), (RopeStyle::Interleaved, 32)] {
        let rope = Rope::new(&RopeConfig { theta: 1e6, style, scaling: None }, rot);
        let (mut rc, mut rg) = p.acts(rows, cols, &xv);
        p.cpu.rope(&mut rc, 32, &positions, &rope);
        p.gpu.rope(&mut rg, 32, &positions, &rope);
        p.check(&format!("rope {style:?} {rot}/32"), &rc, &rg, 1e-5);
    }
    for dtype in [DType::BF16, DType::F32] {
        let (tc, tg) = p.weights(&tensor("e", dtype, vec![50, cols], &r.vec(50 * cols)));
        let ids = [3u32, 0, 49, 3];
        p.check(&format!("embed {dtype:?}"), &p.cpu.embed(&tc, &ids).unwrap(), &p.gpu.embed(&tg, &ids).unwrap(), 0.0);
        assert!(p.gpu.embed(&tg, &[50]).is_err());
    }
}
