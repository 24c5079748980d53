//! Timings of the matmul on SmolLM2-135M's shapes and of the quantized register
//! tiles, with random weights. Ignored by default; run with
//! `cargo test --release -p qinfer --lib backend::cpu::matmul::timing -- --ignored --nocapture`
//! (`SHAPES_BF16=1` adds bf16 weights, `SHAPES_DETAIL=1` per-matrix times,
//! `SHAPES_THREADS=n` the pool size, `ALL_TILES=1` every tile shape).

use super::super::q8::dot_tile;
use super::*;
use std::time::Instant;

fn random_matrix(dtype: DType, rows: usize, cols: usize, seed: &mut u64) -> CpuMatrix {
    let bb = dtype.block_bytes();
    let bytes: Vec<u8> = (0..dtype.bytes_for(rows * cols).unwrap())
        .map(|i| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Small finite f16 scales at the start of each block.
            if dtype.is_quantized() && i % bb < 4 && (i % bb < 2 || dtype == DType::Q4_1) {
                [0x66, 0x1e, 0x00, 0x90][i % bb]
            } else if !dtype.is_quantized() && i % 2 == 1 {
                0x3c
            } else {
                (*seed >> 56) as u8
            }
        })
        .collect();
    CpuMatrix { dtype, rows, cols, data: Bytes::from_vec(bytes) }
}

#[test]
#[ignore]
fn read_bandwidth() {
    let buf: Vec<u64> = (0..96usize << 17).map(|i| i as u64).collect();
    for threads in [1usize, 2] {
        let t = Instant::now();
        let reps = 10;
        for _ in 0..reps {
            let s: u64 = buf
                .par_chunks(buf.len() / threads)
                .map(|c| c.chunks_exact(8).fold(0u64, |a, v| a ^ v[0] ^ v[3] ^ v[7]))
                .sum();
            std::hint::black_box(s);
        }
        let gbs = (buf.len() * 8 * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!("read bandwidth, {threads} threads: {gbs:.2} GB/s");
    }
}

#[test]
#[ignore]
fn rayon_overhead() {
    let reps = 2000;
    let t = Instant::now();
    for _ in 0..reps {
        (0..16).into_par_iter().for_each(|i| {
            std::hint::black_box(i);
        });
    }
    println!("par_iter from outside the pool: {:.2} us", t.elapsed().as_secs_f64() * 1e6 / reps as f64);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let t = Instant::now();
        for _ in 0..reps {
            (0..16).into_par_iter().for_each(|i| {
                std::hint::black_box(i);
            });
        }
        println!("par_iter inside install: {:.2} us", t.elapsed().as_secs_f64() * 1e6 / reps as f64);
    });
}

#[test]
#[ignore]
fn smollm2_shapes() {
    let threads: usize = std::env::var("SHAPES_THREADS").map(|v| v.parse().unwrap()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(shapes);
}

fn shapes() {
    let (h, kv, inter, layers, vocab) = (576, 192, 1536, 30, 49152);
    let mut seed = 1;
    let mut kinds = vec![(DType::Q4_1, DType::Q8_0)];
    if std::env::var("SHAPES_BF16").is_ok() {
        kinds.push((DType::BF16, DType::BF16));
    }
    for (wd, hd) in kinds {
        let shapes = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)];
        let ws: Vec<Vec<CpuMatrix>> =
            (0..layers).map(|_| shapes.iter().map(|&(r, c)| random_matrix(wd, r, c, &mut seed)).collect()).collect();
        let head = random_matrix(hd, vocab, h, &mut seed);
        for n in [1usize, 128] {
            let x: Vec<f32> = (0..n * inter).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
            let mut out = vec![0f32; n * vocab];
            // Minimum over repetitions: other processes share this machine.
            let reps = if n == 1 { 30 } else { 4 };
            let mut t_layers = f64::MAX;
            let mut t_head = f64::MAX;
            for _ in 0..reps {
                let t0 = Instant::now();
                for lw in &ws {
                    for m in lw {
                        matmul(&x[..n * m.cols], n, m, &mut out[..n * m.rows]);
                    }
                }
                let t1 = Instant::now();
                matmul(&x[..h], 1, &head, &mut out[..vocab]);
                t_layers = t_layers.min((t1 - t0).as_secs_f64());
                t_head = t_head.min(t1.elapsed().as_secs_f64());
            }
            let (tl, th) = (t_layers * 1e3, t_head * 1e3);
            println!(
                "{wd:?}/{hd:?} n={n}: layers {tl:.2} ms, head {th:.2} ms → {:.1} tok/s (matmul only)",
                n as f64 / ((tl + th) / 1e3)
            );
            if std::env::var("SHAPES_DETAIL").is_err() {
                continue;
            }
            for m in &ws[0] {
                let t0 = Instant::now();
                for _ in 0..reps * 5 {
                    matmul(&x[..n * m.cols], n, m, &mut out[..n * m.rows]);
                }
                let ns = t0.elapsed().as_secs_f64() * 1e9 / (reps * 5) as f64;
                let pairs = (n * m.rows * m.cols / 32) as f64;
                println!(
                    "  [{}x{}] n={n}: {:.1} us, {:.3} ns/block-pair/thread",
                    m.rows,
                    m.cols,
                    ns / 1e3,
                    ns * 2.0 / pairs
                );
            }
        }
    }
}

fn run<const MR: usize, const NR: usize>(dtype: DType) {
    let blocks = 48;
    let w: Vec<Vec<u8>> = (0..NR)
        .map(|j| (0..blocks * dtype.block_bytes()).map(|i| ((i * 7 + j) % 251) as u8 & 0x3f).collect())
        .collect();
    let x: Vec<Vec<Q8Block>> = (0..MR)
        .map(|i| vec![Q8Block { d: 0.01, s: 0.1, qs: std::array::from_fn(|k| (k as i8) - i as i8) }; blocks])
        .collect();
    let iters = 200_000;
    let t = Instant::now();
    let mut acc = 0f32;
    for _ in 0..iters {
        let v = dot_tile::<MR, NR>(
            dtype,
            std::array::from_fn(|j| std::hint::black_box(&w[j][..])),
            std::array::from_fn(|i| &x[i][..]),
        );
        acc += v[0][0];
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / (iters * blocks * MR * NR) as f64;
    println!("{dtype:?} {MR}x{NR}: {ns:.3} ns per block pair ({acc})");
}

#[test]
#[ignore]
fn kernel_ns_per_block() {
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q5_1] {
        run::<4, 2>(dtype);
        run::<1, 4>(dtype);
    }
    if std::env::var("ALL_TILES").is_err() {
        return;
    }
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q5_1] {
        run::<1, 1>(dtype);
        run::<1, 4>(dtype);
        run::<2, 2>(dtype);
        run::<4, 1>(dtype);
        run::<4, 2>(dtype);
        run::<3, 4>(dtype);
        run::<4, 4>(dtype);
    }
}

/// The default model's real weights through the tiled matmul against the scalar dot.
#[test]
#[ignore]
fn real_weights_match_scalar_dot() {
    use crate::formats::TensorSource;
    let path = std::path::PathBuf::from(std::env::var("HOME").unwrap())
        .join(".cache/qinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let Ok(f) = crate::formats::gguf::GgufFile::open(&path) else { return };
    for name in f.names().iter().filter(|n| n.starts_with("blk.0.") || n.starts_with("token_embd")) {
        let t = f.raw_tensor(name).unwrap();
        if t.shape.len() != 2 || !t.dtype.is_quantized() {
            continue;
        }
        let w = CpuMatrix { dtype: t.dtype, rows: t.shape[0], cols: t.shape[1], data: t.data.clone() };
        let rows = w.rows.min(2048);
        let w = CpuMatrix { rows, data: Bytes::from_vec(t.data.as_slice()[..rows * w.row_bytes()].to_vec()), ..w };
        let n = 37;
        let mut seed = 5u64;
        let x: Vec<f32> = (0..n * w.cols)
            .map(|i| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if i % 97 == 0 { u * 40.0 } else { u }
            })
            .collect();
        let mut out = vec![0f32; n * rows];
        matmul(&x, n, &w, &mut out);
        let rb = w.row_bytes();
        let mut xq = vec![Q8Block::ZERO; w.cols / 32];
        let mut worst = 0f32;
        for tt in 0..n {
            q8::quantize_row_scalar(&x[tt * w.cols..(tt + 1) * w.cols], &mut xq);
            for r in 0..rows {
                let want = q8::dot(w.dtype, &w.data.as_slice()[r * rb..(r + 1) * rb], &xq);
                let err = (out[tt * rows + r] - want).abs() / (1e-3 + want.abs());
                if err > worst {
                    worst = err;
                    println!("  ({tt},{r}) got {} want {want}", out[tt * rows + r]);
                }
            }
        }
        println!("{name} {:?} [{}x{}]: worst relative error {worst:e}", w.dtype, rows, w.cols);
    }
}
