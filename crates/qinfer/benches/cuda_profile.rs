//! Device times of the decode step's ops on the GPU machine (not a test: it
//! asserts nothing). Each op is issued 50 times inside one recorded decode
//! step and the step replayed and timed, so host launch costs drop out;
//! GEMVs cycle through copies of their weight that add up past the L2
//! cache, so their GB/s is HBM bandwidth.
//!
//! `cargo bench -p qinfer --features cuda --bench cuda_profile -- [8b] [chain] [hybrid] [moe] [moe-prefill] [batch-gemm]`
//!
//! (every profile when none is named; the built binary takes the same names).
//! `8b`: each op at Qwen3-8B's shapes; `chain`: whole decode layers at the
//! 8B's shapes with parts left out; `hybrid`: the Qwen3.5-4B-shaped hybrid's
//! ops; `moe`: the routed experts of a decode step at Qwen3-30B-A3B's
//! shapes; `moe-prefill`: its MoE prefill layers, grouped GEMM against one
//! cuBLAS GEMM per expert; `batch-gemm`: a batch's decode rows through
//! affine weights at the 8B's shapes, the tensor-core GEMM against the GEMVs
//! and the bf16 tiles for cuBLAS it replaced; `gemm4`: 16 rows through the
//! 8B's q4g64 weights, the 4-bit GEMM against the general one (gate|up
//! first, so that a profiler's first launches are its largest).

#[path = "../tests/common_cuda/mod.rs"]
mod common_cuda;

use common_cuda::*;
use qinfer::backend::cuda::{CudaBackend, CudaWeight};
use qinfer::backend::ops::{FusedOps, GdnOps, MoeOps, SamplingOps};
use qinfer::backend::{AttentionShape, Backend, ExpertWeights, GdnWeights, QkvShape, Routing};
use qinfer::config::rope::Rope;
use qinfer::config::{GdnConfig, RopeConfig, RopeStyle};
use qinfer::kv::KvCache;
use qinfer::sampling::SamplingParams;
use qinfer::tensor::DType;

const PROFILES: [(&str, fn()); 7] = [
    ("8b", profile_decode_ops_at_8b_shapes),
    ("chain", profile_decode_layer_chain_at_8b_shapes),
    ("hybrid", profile_decode_ops_at_hybrid_shapes),
    ("moe", profile_decode_ops_at_moe_shapes),
    ("moe-prefill", profile_moe_prefill_at_30b_shapes),
    ("batch-gemm", profile_batch_gemm_at_8b_shapes),
    ("gemm4", profile_gemm4_at_8b_shapes),
];

fn main() {
    // `cargo bench` passes `--bench` to every bench program.
    let names: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    for name in &names {
        if !PROFILES.iter().any(|(p, _)| p == name) {
            let known: Vec<&str> = PROFILES.iter().map(|(p, _)| *p).collect();
            eprintln!("unknown profile `{name}` (expected some of {})", known.join(", "));
            std::process::exit(2);
        }
    }
    if gpu().is_none() {
        return;
    }
    for (name, profile) in PROFILES {
        if names.is_empty() || names.iter().any(|n| n == name) {
            println!("== {name}");
            profile();
        }
    }
}

/// Bytes of distinct weights a GEMV is timed over, in turn: well past the
/// H200's 50 MB of L2, so that each launch reads its weight from HBM (one
/// weight reused stays in L2, and read above the HBM peak).
const PAST_L2_BYTES: usize = 256 << 20;

/// Copies of a weight of `bytes` (each made by `upload`) adding up to at
/// least [`PAST_L2_BYTES`]; at most 50, the launches of one timed step.
fn weight_copies<W>(bytes: usize, mut upload: impl FnMut() -> W) -> Vec<W> {
    (0..PAST_L2_BYTES.div_ceil(bytes.max(1)).clamp(1, 50)).map(|_| upload()).collect()
}

/// The next of `ws` in turn (`i` the turn).
fn next<'w, W>(ws: &'w [W], i: &mut usize) -> &'w W {
    *i = (*i + 1) % ws.len();
    &ws[*i]
}

/// Prints the device time of `op`: issued 50 times inside one recorded step
/// at position `start`, the step replayed 5 times (host launch costs drop
/// out), and GB/s when `bytes` is the data one call must read.
fn time_replayed(
    b: &CudaBackend,
    what: &str,
    bytes: usize,
    start: usize,
    op: &mut dyn FnMut() -> qinfer::backend::cuda::CudaAct,
) -> f64 {
    let (reps, n) = (50, 5);
    let mut step = Default::default();
    let mut body = || {
        let mut last = op();
        for _ in 1..reps {
            last = op();
        }
        Ok(last)
    };
    // Each replay ends with its output copied to the host (a synchronization).
    let mut finish = |out: &qinfer::backend::cuda::CudaAct| Ok(b.to_host(out).len());
    // Warm-up and recording, then one replay before the timed ones.
    b.run_step(&mut step, start, &[0], true, &mut body, &mut finish).unwrap();
    b.run_step(&mut step, start, &[0], true, &mut body, &mut finish).unwrap();
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        b.run_step(&mut step, start, &[0], true, &mut body, &mut finish).unwrap();
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / (n * reps) as f64;
    let gbs = if bytes > 0 { format!("{:.0} GB/s", bytes as f64 / us / 1e3) } else { String::new() };
    println!("{what:<40} {us:8.2} µs  {gbs}");
    us
}

/// Device time of the decode step's ops at the shapes of the Qwen3.5-4B-shaped
/// hybrid (bench/configs/qwen3_5-4b-hybrid.json), as the 8B profile: which
/// ops keep its decode from the dense models' share of the roofline.
fn profile_decode_ops_at_hybrid_shapes() {
    let Some(_) = gpu() else { return };
    let b = CudaBackend::new(0).unwrap();
    let mut r = Rng::fresh();
    let (h, inter, vocab) = (2560, 9216, 248320);
    let cfg = GdnConfig {
        num_k_heads: 16,
        num_v_heads: 32,
        k_head_dim: 128,
        v_head_dim: 128,
        conv_kernel: 4,
        v_heads_tiled: false,
    };
    let (cd, vd, nv) = (cfg.conv_dim(), cfg.value_dim(), cfg.num_v_heads);
    for (name, rows, cols) in [
        ("gdn in_proj qkv|z|b|a", cd + vd + 2 * nv, h),
        ("gdn out_proj", h, vd),
        ("attn q|gate|k|v", 2 * 16 * 256 + 2 * 4 * 256, h),
        ("attn o", h, 16 * 256),
        ("gate_up", 2 * inter, h),
        ("down", h, inter),
        ("lm_head", vocab, h),
    ] {
        let t = tensor("w", DType::BF16, vec![rows, cols], &r.vec(rows * cols));
        let ws = weight_copies(rows * cols * 2, || b.upload(&t).unwrap());
        let x = b.act_from_host(1, cols, &r.vec(cols));
        let mut i = 0;
        time_replayed(&b, &format!("gemv bf16 {name} {rows}x{cols}"), rows * cols * 2, 0, &mut || {
            b.linear(&x, next(&ws, &mut i), None)
        });
    }
    // Launch shapes for the GEMVs of 2560 outputs (rows per block, threads).
    for (rows_per_block, threads) in [(2, 256), (4, 256), (4, 128), (8, 256)] {
        let Ok(shape) = qinfer::backend::cuda::GemvShape::new(rows_per_block, threads) else { continue };
        let fixed = CudaBackend::new(0).unwrap().with_gemv_shape(shape);
        for (name, rows, cols) in [("down", h, inter), ("gdn out_proj", h, vd)] {
            let t = tensor("w", DType::BF16, vec![rows, cols], &r.vec(rows * cols));
            let ws = weight_copies(rows * cols * 2, || fixed.upload(&t).unwrap());
            let x = fixed.act_from_host(1, cols, &r.vec(cols));
            let what = format!("{shape:?} gemv bf16 {name} {rows}x{cols}");
            let mut i = 0;
            time_replayed(&fixed, &what, rows * cols * 2, 0, &mut || fixed.linear(&x, next(&ws, &mut i), None));
        }
    }
    let conv = b.upload(&tensor("conv", DType::BF16, vec![cd, 4], &r.vec(cd * 4))).unwrap();
    let a_log = b.upload(&tensor("A_log", DType::F32, vec![nv], &r.vec(nv))).unwrap();
    let dt = b.upload(&tensor("dt_bias", DType::F32, vec![nv], &r.vec(nv))).unwrap();
    let norm = b.upload(&tensor("norm", DType::F32, vec![128], &r.vec(128))).unwrap();
    let weights = GdnWeights { conv: &conv, a_log: &a_log, dt_bias: &dt, norm: &norm };
    let mixed = b.act_from_host(1, cd + vd + 2 * nv, &r.vec(cd + vd + 2 * nv));
    let mut state = b.new_gdn_state(&cfg);
    // The recurrent state is read and written once per step.
    let state_bytes = 2 * nv * 128 * 128 * 4;
    time_replayed(&b, "gdn_mix (conv + fused step)", state_bytes, 0, &mut || {
        b.gdn_mix(&mixed, &weights, 1e-6, &mut state).unwrap()
    });
    let qkv = b.act_from_host(1, cd, &r.vec(cd));
    time_replayed(&b, "gdn_conv alone", 0, 0, &mut || b.gdn_conv(&qkv, &conv, &mut state));
    let nw = b.upload(&tensor("n", DType::F32, vec![h], &r.vec(h))).unwrap();
    let x = b.act_from_host(1, h, &r.vec(h));
    time_replayed(&b, "rms_norm 2560", 0, 0, &mut || b.rms_norm(&x, &nw, 1e-6));
    let g = b.act_from_host(1, 2 * inter, &r.vec(2 * inter));
    time_replayed(&b, "swiglu 9216", 0, 0, &mut || b.swiglu(&g));
}

/// Device time of the routed experts of one decode step at Qwen3-30B-A3B's
/// shapes (bench/configs/qwen3-30b-a3b.json: hidden 2048, 128 experts of 768,
/// top 8), q4g64 with bf16 scales: the router, and the experts as a whole
/// (routing, gate, up, down, combine). Each call routes by other logits, so
/// that its experts are mostly not in L2 from the call before.
fn profile_decode_ops_at_moe_shapes() {
    let Some(_) = gpu() else { return };
    let b = CudaBackend::new(0).unwrap();
    let mut r = Rng::fresh();
    let (h, inter, n_exp, top_k) = (2048, 768, 128, 8);
    // 32 random experts, each uploaded 4 times: 128 experts in distinct memory.
    let host: Vec<[qinfer::quant::affine::AffineTensor; 3]> = (0..32)
        .map(|_| {
            [
                affine_tensor_centered(&mut r, 4, 64, inter, h, DType::BF16, true),
                affine_tensor_centered(&mut r, 4, 64, inter, h, DType::BF16, true),
                affine_tensor_centered(&mut r, 4, 64, h, inter, DType::BF16, true),
            ]
        })
        .collect();
    let experts: Vec<ExpertWeights<_>> = (0..n_exp)
        .map(|e| {
            let [g, u, d] = &host[e % 32];
            ExpertWeights {
                gate: b.upload_affine(g).unwrap(),
                up: b.upload_affine(u).unwrap(),
                down: b.upload_affine(d).unwrap(),
            }
        })
        .collect();
    let router = b.upload_affine(&affine_tensor(&mut r, 4, 64, n_exp, h, DType::BF16)).unwrap();
    let x = b.act_from_host(1, h, &r.vec(h));
    let logits: Vec<_> = (0..50).map(|_| b.act_from_host(1, n_exp, &r.vec(n_exp))).collect();
    let expert_bytes = top_k * 3 * inter * h * 9 / 16;
    time_replayed(&b, "router q4g64 128x2048", n_exp * h * 9 / 16, 0, &mut || b.linear(&x, &router, None));
    let mut call = 0;
    time_replayed(&b, "moe q4g64 8 of 128 experts", expert_bytes, 0, &mut || {
        call += 1;
        b.moe(&x, &logits[call % logits.len()], &experts, Routing { top_k, renormalize: true })
    });
}

/// Wall time of MoE prefill layers at Qwen3-30B-A3B's shapes (q4g64 and bf16
/// experts, 8 of 128, hidden 2048, expert width 768) for 512 to 8192 tokens,
/// through the grouped expert GEMM and through one cuBLAS GEMM per expert:
/// where the default crossover (`with_grouped_moe_rows`) belongs.
fn profile_moe_prefill_at_30b_shapes() {
    let Some(_) = gpu() else { return };
    let mut r = Rng::fresh();
    let (h, inter, n_exp, top_k) = (2048, 768, 128, 8);
    let routing = Routing { top_k, renormalize: true };
    let inputs: Vec<(usize, Vec<f32>, Vec<f32>)> =
        [512, 1024, 2048, 4096, 8192].map(|t| (t, r.vec(t * h), r.vec(t * n_exp))).into();
    for what in ["q4g64", "bf16"] {
        // 16 random experts, each uploaded 8 times: 128 experts in distinct memory.
        let host: Vec<[Stored; 3]> = (0..16)
            .map(|_| {
                [(inter, h), (inter, h), (h, inter)].map(|(rows, cols)| match what {
                    "bf16" => Stored::Tensor(tensor("w", DType::BF16, vec![rows, cols], &r.vec(rows * cols))),
                    _ => Stored::Affine(Box::new(affine_tensor_centered(&mut r, 4, 64, rows, cols, DType::BF16, true))),
                })
            })
            .collect();
        for (path, rows) in [("grouped", usize::MAX), ("per-expert", 0)] {
            let b = CudaBackend::new(0).unwrap().with_grouped_moe_rows(rows);
            let up = |w: &Stored| match w {
                Stored::Tensor(t) => b.upload(t).unwrap(),
                Stored::Affine(a) => b.upload_affine(a).unwrap(),
            };
            let experts: Vec<ExpertWeights<_>> = (0..n_exp)
                .map(|e| {
                    let [g, u, d] = &host[e % 16];
                    ExpertWeights { gate: up(g), up: up(u), down: up(d) }
                })
                .collect();
            for (tokens, x, l) in &inputs {
                let (x, l) = (b.act_from_host(*tokens, h, x), b.act_from_host(*tokens, n_exp, l));
                // Synchronized after each layer (the per-expert path waits for
                // the experts' counts once a layer anyway), the output left on
                // the device.
                let run = || {
                    drop(b.moe(&x, &l, &experts, routing));
                    b.check().unwrap();
                };
                run();
                let reps = 10;
                let t0 = std::time::Instant::now();
                for _ in 0..reps {
                    run();
                }
                let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
                println!(
                    "moe prefill {what} {tokens:>5} tokens {path:<10} {ms:8.3} ms a layer ({:.0} tok/s)",
                    *tokens as f64 / ms * 1e3
                );
            }
        }
    }
}

/// Device time of the decode step's ops at Qwen3-8B's shapes: each op issued
/// 50 times inside one recorded step, the step replayed and timed, so host
/// launch costs drop out. Prints µs per op and, for GEMVs, GB/s.
fn profile_decode_ops_at_8b_shapes() {
    let Some(_) = gpu() else { return };
    let mut r = Rng::fresh();
    for (rows_per_block, threads) in [(2, 128), (4, 256)] {
        let shape = qinfer::backend::cuda::GemvShape::new(rows_per_block, threads).unwrap();
        let b = CudaBackend::new(0).unwrap().with_gemv_shape(shape);
        for (name, rows, cols) in
            [("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
        {
            let t = tensor("w", DType::BF16, vec![rows, cols], &r.vec(rows * cols));
            let ws = weight_copies(rows * cols * 2, || b.upload(&t).unwrap());
            let x = b.act_from_host(1, cols, &r.vec(cols));
            let what = format!("{shape:?} gemv bf16 {name} {rows}x{cols}");
            let mut i = 0;
            time_replayed(&b, &what, rows * cols * 2, 0, &mut || b.linear(&x, next(&ws, &mut i), None));
        }
    }
    let b = CudaBackend::new(0).unwrap();
    let (h, q, kv, inter) = (4096, 4096, 1024, 12288);
    for (name, rows, cols) in [
        ("q/o", q, h),
        ("k/v", kv, h),
        ("qkv", q + 2 * kv, h),
        ("gate/up", inter, h),
        ("gate_up", 2 * inter, h),
        ("down", h, inter),
        ("lm_head", 151936, h),
    ] {
        let t = tensor("w", DType::BF16, vec![rows, cols], &r.vec(rows * cols));
        let ws = weight_copies(rows * cols * 2, || b.upload(&t).unwrap());
        let x = b.act_from_host(1, cols, &r.vec(cols));
        let mut i = 0;
        time_replayed(&b, &format!("gemv bf16 {name} {rows}x{cols}"), rows * cols * 2, 0, &mut || {
            b.linear(&x, next(&ws, &mut i), None)
        });
    }
    // The affine GEMVs: the default kernel (x in registers, 8 rows a block)
    // and, with a fixed launch shape, the block-per-rows one.
    let fixed = CudaBackend::new(0).unwrap().with_gemv_shape(qinfer::backend::cuda::GemvShape::new(4, 64).unwrap());
    let norm = b.upload(&tensor("n", DType::F32, vec![h], &r.vec(h))).unwrap();
    for (name, rows, cols) in [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * inter, h), ("down", h, inter)] {
        for bits in [4u32, 8] {
            let t = affine_tensor(&mut r, bits, 64, rows, cols, DType::BF16);
            for (kernel, b) in [("default", &b), ("r4×64", &fixed)] {
                // Packed levels plus bf16 scales and biases per group of 64.
                let bytes = rows * cols * bits as usize / 8 + rows * cols / 64 * 4;
                let ws = weight_copies(bytes, || b.upload_affine(&t).unwrap());
                let x = b.act_from_host(1, cols, &r.vec(cols));
                let mut i = 0;
                time_replayed(b, &format!("gemv q{bits}g64 {kernel} {name} {rows}x{cols}"), bytes, 0, &mut || {
                    b.linear(&x, next(&ws, &mut i), None)
                });
                if name == "gate_up" {
                    time_replayed(b, &format!("gemv q{bits}g64 {kernel} {name} swiglu"), bytes, 0, &mut || {
                        b.linear_swiglu(&x, next(&ws, &mut i))
                    });
                }
                // As a block's first projection: RMSNorm(x) folded in.
                if kernel == "default" && cols == h {
                    let what = format!("gemv q{bits}g64 {kernel} {name} normed");
                    time_replayed(b, &what, bytes, 0, &mut || {
                        b.linear_normed(&x, &norm, 1e-6, next(&ws, &mut i), None)
                    });
                }
            }
        }
    }
    // ggml's Q4_0/Q4_1 as an affine weight: 4 bits, groups of 32, f32 scales
    // and biases, on the CUDA-core GEMV (the tensor-core one takes groups of
    // 64 and 128; Q4_K's super-block records have their own).
    for (name, rows, cols) in [("qkv", q + 2 * kv, h), ("down", h, inter)] {
        let t = affine_tensor(&mut r, 4, 32, rows, cols, DType::F32);
        let bytes = rows * cols / 2 + rows * cols / 32 * 8;
        let ws = weight_copies(bytes, || b.upload_affine(&t).unwrap());
        let x = b.act_from_host(1, cols, &r.vec(cols));
        let mut i = 0;
        time_replayed(&b, &format!("gemv q4g32 {name} {rows}x{cols}"), bytes, 0, &mut || {
            b.linear(&x, next(&ws, &mut i), None)
        });
    }
    // ggml's Q6_K as an affine weight (6 bits, groups of 16, f32 scales and
    // biases: 10 bits a weight) against the f32 matrix it decoded to before.
    for (name, rows, cols) in [("down", h, inter), ("lm_head", 151936, h)] {
        let t = affine_tensor(&mut r, 6, 16, rows, cols, DType::F32);
        let bytes = rows * cols * 6 / 8 + rows * cols / 16 * 8;
        let ws = weight_copies(bytes, || b.upload_affine(&t).unwrap());
        let x = b.act_from_host(1, cols, &r.vec(cols));
        let mut i = 0;
        time_replayed(&b, &format!("gemv q6g16 {name} {rows}x{cols}"), bytes, 0, &mut || {
            b.linear(&x, next(&ws, &mut i), None)
        });
        if name == "down" {
            let t = tensor("w", DType::F32, vec![rows, cols], &r.vec(rows * cols));
            let dense = weight_copies(rows * cols * 4, || b.upload(&t).unwrap());
            time_replayed(&b, &format!("gemv f32 {name} {rows}x{cols}"), rows * cols * 4, 0, &mut || {
                b.linear(&x, next(&dense, &mut i), None)
            });
        }
    }
    // Sampling from Qwen3's 151,936 logits, each call ending with the token
    // id on the host (what a decode step adds after its graph). Flat logits
    // (uniform in [-8, 8)), and peaked ones (20 tokens 12 to 20 above that
    // bulk, as a model's next token mostly is): without a top-k, the flat
    // ones leave the filters' cut in the bulk, the peaked ones among the
    // cut-down candidates.
    let flat: Vec<f32> = r.vec(151_936).iter().map(|v| v * 8.0).collect();
    let mut peaked = flat.clone();
    for i in 0..20 {
        peaked[i * 7_577] += 16.0 + 4.0 * r.f();
    }
    let base = SamplingParams::default();
    let no_top_k = [
        ("temperature 0.7, top-p 0.9", SamplingParams { temperature: 0.7, top_p: 0.9, ..base.clone() }),
        ("temperature 1.0, min-p 0.05", SamplingParams { temperature: 1.0, min_p: 0.05, ..base.clone() }),
        ("temperature 1.0", SamplingParams { temperature: 1.0, ..base.clone() }),
    ];
    let peaked_rows = no_top_k.iter().map(|(what, p)| (format!("{what}, peaked"), p.clone(), &peaked));
    for (what, p, logits) in [
        ("greedy", base.clone()),
        ("temperature 0.7, top-k 20", SamplingParams { temperature: 0.7, top_k: 20, ..base.clone() }),
        (
            "temperature 0.6, top-k 20, top-p 0.95 (Qwen3)",
            SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..base.clone() },
        ),
        (
            "top-k 20, top-p 0.8, min-p 0.05, penalty 1.1",
            SamplingParams {
                temperature: 0.7,
                top_k: 20,
                top_p: 0.8,
                min_p: 0.05,
                repetition_penalty: 1.1,
                ..base.clone()
            },
        ),
    ]
    .into_iter()
    .chain(no_top_k.iter().cloned())
    .map(|(what, p)| (what.to_string(), p, &flat))
    .chain(peaked_rows)
    {
        let logits = b.act_from_host(1, 151_936, logits);
        let context: Vec<u32> = (0..512).map(|i| i * 97 % 151_936).collect();
        b.sample(&logits, &p, &context, 0.5).unwrap();
        let t0 = std::time::Instant::now();
        for i in 0..200 {
            b.sample(&logits, &p, &context, i as f32 / 200.0).unwrap();
        }
        println!("sample {what:<44} {:8.2} µs", t0.elapsed().as_secs_f64() * 1e6 / 200.0);
    }
    // Prefill of 512 tokens, timed eagerly (each op is long enough).
    let eager = |what: &str, flops: f64, op: &mut dyn FnMut() -> qinfer::backend::cuda::CudaAct| {
        drop(op());
        b.check().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            drop(op());
        }
        b.check().unwrap();
        let us = t0.elapsed().as_secs_f64() * 1e6 / 10.0;
        println!("{what:<40} {us:8.1} µs  {:.0} TFLOP/s", flops / us / 1e6);
    };
    let t = 512;
    for (name, rows, cols) in [("qkv", q + 2 * kv, h), ("gate_up", 2 * inter, h), ("down", h, inter)] {
        let w = b.upload(&tensor("w", DType::BF16, vec![rows, cols], &r.vec(rows * cols))).unwrap();
        let x = b.act_from_host(t, cols, &r.vec(t * cols));
        let flops = 2.0 * (t * rows * cols) as f64;
        eager(&format!("gemm bf16 {name} {t}x{cols}->{rows}"), flops, &mut || b.linear(&x, &w, None));
    }
    for keys in [512usize, 8192] {
        let shape = AttentionShape { num_heads: 32, num_kv_heads: 8, head_dim: 128, window: None, scale: 0.088 };
        let mut cache = b.new_cache(1, kv, keys);
        let kvs = b.act_from_host(keys, kv, &r.vec(keys * kv));
        b.write_kv(&mut cache, 0, &kvs, &kvs);
        let qa = b.act_from_host(keys, q, &r.vec(keys * q));
        // Causal: half the score matrix, QKᵀ and PV.
        let flops = 2.0 * 2.0 * (keys * keys / 2 * 32 * 128) as f64;
        eager(&format!("attention prefill {keys} rows"), flops, &mut || b.attention(&qa, &cache, 0, &shape));
    }
    let x = b.act_from_host(1, h, &r.vec(h));
    let nw = b.upload(&tensor("n", DType::F32, vec![h], &r.vec(h))).unwrap();
    time_replayed(&b, "rms_norm 4096", 0, 0, &mut || b.rms_norm(&x, &nw, 1e-6));
    let qn = b.upload(&tensor("qn", DType::F32, vec![128], &r.vec(128))).unwrap();
    let xq = b.act_from_host(1, q, &r.vec(q));
    time_replayed(&b, "rms_norm per head 32x128", 0, 0, &mut || b.rms_norm(&xq, &qn, 1e-6));
    let g = b.act_from_host(1, inter, &r.vec(inter));
    time_replayed(&b, "silu_mul 12288", 0, 0, &mut || b.silu_mul(&g, &g));
    for keys in [128usize, 1024, 8192] {
        let shape = AttentionShape { num_heads: 32, num_kv_heads: 8, head_dim: 128, window: None, scale: 0.088 };
        let mut cache = b.new_cache(1, kv, keys + 1);
        let kvs = b.act_from_host(keys, kv, &r.vec(keys * kv));
        b.write_kv(&mut cache, 0, &kvs, &kvs);
        cache.set_len(keys);
        let k1 = b.act_from_host(1, kv, &r.vec(kv));
        b.write_kv(&mut cache, 0, &k1, &k1);
        let qa = b.act_from_host(1, q, &r.vec(q));
        time_replayed(&b, &format!("attention 32/8 heads, {keys} keys"), 2 * keys * kv * 4, keys, &mut || {
            b.attention(&qa, &cache, 0, &shape)
        });
    }
}

/// Device time of whole decode layers at Qwen3-8B's shapes (q4g64, bf16
/// scales, f16 cache), as the decode step chains them: one recorded step of
/// 50 layers cycling over 8 distinct weight sets (870 MB, so no layer's
/// weights are still in L2), and the same chain with parts left out. The
/// differences are what each part costs in the chain, with the launches
/// overlapped as the step overlaps them; the bytes are the weights the
/// variant reads. At 64 keys one attention block holds a head's whole cache
/// (the q|k|v prologue folded in); at 512 the cache is split in 4, the
/// prologue folded too unless the backend runs it apart.
fn profile_decode_layer_chain_at_8b_shapes() {
    let Some(b) = gpu() else { return };
    let mut r = Rng::fresh();
    let (h, q, kv, inter) = (4096, 4096, 1024, 12288);
    let host: Vec<_> = (0..8)
        .map(|_| {
            [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
                .map(|(rows, cols)| affine_tensor_centered(&mut r, 4, 64, rows, cols, DType::BF16, true))
        })
        .collect();
    // The decode step as it is, and with the q|k|v prologue of split caches
    // as its own kernel.
    for (fold, b) in [("", b), (", prologue apart", gpu().unwrap().without_split_prologue_folding())] {
        let w: Vec<_> = host.iter().map(|t| t.each_ref().map(|t| b.upload_affine(t).unwrap())).collect();
        profile_layer_chain(&b, &w, fold, &mut r);
    }
}

/// [`profile_decode_layer_chain_at_8b_shapes`] on one backend: its layers'
/// weights `w` (q|k|v, o, gate|up, down), `fold` naming the backend's
/// options.
fn profile_layer_chain(b: &CudaBackend, w: &[[CudaWeight; 4]], fold: &str, r: &mut Rng) {
    let (h, nh, nkv, hd, inter) = (4096, 32, 8, 128, 12288);
    let (q, kv) = (nh * hd, nkv * hd);
    let layers = w.len();
    let shape = QkvShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, output_gate: false };
    let attn = AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, window: None, scale: 0.088 };
    let rope = Rope::new(&RopeConfig { theta: 1e6, style: RopeStyle::Neox, scaling: None }, hd);
    let bytes = |rows: usize, cols: usize| rows * cols / 2 + rows * cols / 64 * 4;
    let (qkv_b, o_b, gu_b, d_b) = (bytes(q + 2 * kv, h), bytes(h, q), bytes(2 * inter, h), bytes(h, inter));
    let n1 = b.upload(&tensor("n1", DType::F32, vec![h], &r.vec(h))).unwrap();
    let n2 = b.upload(&tensor("n2", DType::F32, vec![h], &r.vec(h))).unwrap();
    let qn = b.upload(&tensor("qn", DType::F32, vec![hd], &r.vec(hd))).unwrap();
    let kn = b.upload(&tensor("kn", DType::F32, vec![hd], &r.vec(hd))).unwrap();
    let mut h_act = b.act_from_host(1, h, &r.vec(h));
    let att_fixed = b.act_from_host(1, q, &r.vec(q));
    let qkv_fixed = b.act_from_host(1, q + 2 * kv, &r.vec(q + 2 * kv));
    for keys in [63, 511] {
        let mut cache = b.new_cache(layers, kv, keys + 1);
        for l in 0..layers {
            let kvs = b.act_from_host(keys, kv, &r.vec(keys * kv));
            b.write_kv(&mut cache, l, &kvs, &kvs);
        }
        cache.set_len(keys);
        let positions = [keys];
        let mut layer = 0;
        // Parts: the q|k|v GEMV, the attention (of the GEMV's row, or of a
        // fixed one), the o projection (of the attention, or of a fixed row),
        // the MLP.
        let variants: &[(&str, usize, [bool; 4])] = &[
            ("layer", qkv_b + o_b + gu_b + d_b, [true, true, true, true]),
            ("layer without qkv+attention", o_b + gu_b + d_b, [false, false, true, true]),
            ("gate_up + down", gu_b + d_b, [false, false, false, true]),
            ("qkv + attention", qkv_b, [true, true, false, false]),
            ("qkv", qkv_b, [true, false, false, false]),
            ("attention (fixed q|k|v row)", 0, [false, true, false, false]),
        ];
        for &(what, weight_bytes, [qkv_gemv, attention, o, mlp]) in variants {
            // The attention's own costs alone where the backends differ.
            if (keys > 64 || !fold.is_empty()) && !attention {
                continue;
            }
            time_replayed(b, &format!("{} keys{fold}: {what}", keys + 1), weight_bytes, keys, &mut || {
                let l = layer % layers;
                layer += 1;
                let [wqkv, wo, wgu, wd] = &w[l];
                // The op's result: the last activation it made.
                let mut last = None;
                if qkv_gemv {
                    last = Some(b.linear_normed(&h_act, &n1, 1e-6, wqkv, None));
                }
                if attention {
                    let qkv = last.as_ref().unwrap_or(&qkv_fixed);
                    let rows =
                        b.qkv_attention(qkv, &shape, Some((&qn, &kn)), 1e-6, &positions, &rope, &mut cache, l, &attn);
                    last = Some(rows.0);
                }
                if o {
                    let x = if attention { last.as_ref().unwrap() } else { &att_fixed };
                    b.linear_add_for_norm(&mut h_act, x, wo, None, &n2);
                }
                if mlp {
                    let g = b.linear_swiglu_normed(&h_act, &n2, 1e-6, wgu);
                    b.linear_add_for_norm(&mut h_act, &g, wd, None, &n1);
                    last = Some(g);
                }
                last.expect("every variant makes an activation")
            });
        }
    }
}

/// A batch's decode rows through affine weights at Qwen3-8B's shapes: the
/// default dispatch (the tensor-core GEMM where it takes the rows) against
/// the same backend without that GEMM (the GEMVs, then bf16 tiles and cuBLAS), for
/// mlx's 4-bit groups of 64 and GGUF's Q4_K and Q6_K records. GB/s
/// counts the weight's bytes once a call.
fn profile_batch_gemm_at_8b_shapes() {
    let Some(_) = gpu() else { return };
    let mut r = Rng::fresh();
    let new = CudaBackend::new(0).unwrap();
    let old = CudaBackend::new(0).unwrap().without_affine_gemm();
    let (h, q, kv, inter) = (4096, 4096, 1024, 12288);
    for (name, rows, cols) in [("qkv", q + 2 * kv, h), ("gate_up", 2 * inter, h), ("down", h, inter)] {
        let formats: [(&str, usize); 3] = [("q4g64", 4 * 64 + 32), ("Q4_K", 144 * 2), ("Q6_K", 210 * 2)];
        for (format, bits_per_64) in formats {
            let t = match format {
                "q4g64" => Stored::Affine(Box::new(affine_tensor(&mut r, 4, 64, rows, cols, DType::BF16))),
                "Q4_K" => Stored::Tensor(kquant_tensor(&mut r, DType::Q4_K, rows, cols)),
                _ => Stored::Tensor(kquant_tensor(&mut r, DType::Q6_K, rows, cols)),
            };
            let bytes = rows * cols / 64 * bits_per_64 / 8;
            for (path, b) in [("tc-gemm", &new), ("before", &old)] {
                let ws = weight_copies(bytes, || match &t {
                    Stored::Tensor(t) => b.upload(t).unwrap(),
                    Stored::Affine(a) => b.upload_affine(a).unwrap(),
                });
                for n in [1, 4, 5, 8, 16, 32, 64, 128, 256] {
                    let x = b.act_from_host(n, cols, &r.vec(n * cols));
                    let mut i = 0;
                    let what = format!("{format} {path} {name} {rows}x{cols} rows {n}");
                    let tflops = 2.0 * (rows * cols * n) as f64;
                    time_replayed_flops(b, &what, bytes, tflops, &mut || b.linear(&x, next(&ws, &mut i), None));
                }
            }
        }
    }
}

fn profile_gemm4_at_8b_shapes() {
    let Some(_) = gpu() else { return };
    let mut r = Rng::fresh();
    let four = CudaBackend::new(0).unwrap();
    let general = CudaBackend::new(0).unwrap().without_affine_gemm4();
    let (h, q, kv, inter) = (4096, 4096, 1024, 12288);
    for (name, rows, cols) in [("gate_up", 2 * inter, h), ("qkv", q + 2 * kv, h), ("down", h, inter)] {
        let t = affine_tensor(&mut r, 4, 64, rows, cols, DType::BF16);
        let bytes = rows * cols / 64 * (4 * 64 + 32) / 8;
        for (path, b) in [("gemm4", &four), ("general", &general)] {
            let ws = weight_copies(bytes, || b.upload_affine(&t).unwrap());
            for n in [13, 16] {
                let x = b.act_from_host(n, cols, &r.vec(n * cols));
                let mut i = 0;
                let what = format!("q4g64 {path} {name} {rows}x{cols} rows {n}");
                let flops = 2.0 * (rows * cols * n) as f64;
                time_replayed_flops(b, &what, bytes, flops, &mut || b.linear(&x, next(&ws, &mut i), None));
            }
        }
    }
}

/// [`time_replayed`] at position 0, with the TFLOP/s of `flops` a call.
fn time_replayed_flops(
    b: &CudaBackend,
    what: &str,
    bytes: usize,
    flops: f64,
    op: &mut dyn FnMut() -> qinfer::backend::cuda::CudaAct,
) {
    let us = time_replayed(b, what, bytes, 0, op);
    println!("{:<40} {:8.1} TFLOP/s", "", flops / us / 1e6);
}
