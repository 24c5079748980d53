//! Timings of the CPU matmul on SmolLM2-135M's shapes and of the quantized
//! register tiles, with random weights:
//!
//! `cargo bench -p qinfer --bench cpu_matmul -- [--bf16] [--detail] [--threads N] [--all-tiles]`
//!
//! `--bf16` adds bf16 weights, `--detail` per-matrix times, `--threads` the
//! pool size (2 by default), `--all-tiles` every register-tile shape.

use std::time::Instant;

use qinfer::backend::cpu::matmul::{CpuMatrix, matmul};
use qinfer::backend::cpu::q8::{Q8Block, dot_tile};
use qinfer::tensor::{Bytes, DType};
use rayon::prelude::*;

struct Options {
    bf16: bool,
    detail: bool,
    threads: usize,
    all_tiles: bool,
}

fn main() {
    let mut opts = Options { bf16: false, detail: false, threads: 2, all_tiles: false };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bf16" => opts.bf16 = true,
            "--detail" => opts.detail = true,
            "--all-tiles" => opts.all_tiles = true,
            "--threads" => {
                opts.threads = args.next().and_then(|v| v.parse().ok()).expect("--threads takes a number");
            }
            // `cargo bench` passes `--bench` to every bench program.
            "--bench" => {}
            other => {
                eprintln!("unknown option `{other}` (expected --bf16, --detail, --threads N, --all-tiles)");
                std::process::exit(2);
            }
        }
    }
    read_bandwidth();
    rayon_overhead();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(opts.threads).build().expect("a thread pool");
    pool.install(|| shapes(&opts));
    kernel_ns_per_block(&opts);
}

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

fn shapes(opts: &Options) {
    let (h, kv, inter, layers, vocab) = (576, 192, 1536, 30, 49152);
    let mut seed = 1;
    let mut kinds = vec![(DType::Q4_1, DType::Q8_0)];
    if opts.bf16 {
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
            if !opts.detail {
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

fn kernel_ns_per_block(opts: &Options) {
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q5_1] {
        run::<4, 2>(dtype);
        run::<1, 4>(dtype);
    }
    if !opts.all_tiles {
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
