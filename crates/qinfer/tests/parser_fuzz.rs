//! A small mutation fuzzer over the model parsers: real fixture files (GGUF
//! with K-quants, MoE GGUF, safetensors, MLX-quantized safetensors) are
//! truncated, bit-flipped and have header integers overwritten with extreme
//! values, then opened, loaded and run for two tokens. Every outcome must be
//! an `Ok` or an `Err`; a panic is a parser bug. Deterministic seeds, so a
//! failure names its case and reproduces.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use qinfer::loader;
use qinfer::models::Logits;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutation of `orig`: most land in the first `header` bytes, where the
/// parsers read lengths, counts, offsets and shapes.
fn mutate(orig: &[u8], header: usize, rng: &mut Rng) -> Vec<u8> {
    let mut b = orig.to_vec();
    let span = header.min(b.len());
    match rng.below(4) {
        0 => b.truncate(rng.below(b.len())),
        1 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(span);
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            // An integer field set to an extreme value.
            let extremes = [u64::MAX, u64::MAX / 2, 1 << 40, u32::MAX as u64, 0, 1 << 31];
            let v = extremes[rng.below(extremes.len())];
            let i = rng.below(span.saturating_sub(8)) & !3;
            b[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        _ => {
            // A byte anywhere (tensor data included) and a truncated tail.
            let i = rng.below(b.len());
            b[i] = rng.next() as u8;
            let keep = b.len() - rng.below(64);
            b.truncate(keep);
        }
    }
    b
}

/// Opens, loads and runs the model at `path`; returns whether it got through.
fn exercise(path: &Path) -> bool {
    let Ok(model) = loader::open(path) else { return false };
    let Ok(lm) = model.load_cpu(false) else { return false };
    let mut seq = lm.new_sequence(8);
    lm.forward(seq.as_mut(), &[1, 2], Logits::Last).is_ok()
}

/// Mutates `file` inside a copy of its model directory `iterations` times.
fn fuzz(dir: &Path, file: &str, header: usize, iterations: u64) {
    let orig = std::fs::read(dir.join(file)).unwrap();
    let model_path = |d: &Path| if file.ends_with(".gguf") { d.join(file) } else { d.to_path_buf() };
    assert!(exercise(&model_path(dir)), "{}: the unmutated model must load", dir.display());
    let work = std::env::temp_dir().join(format!(
        "qinfer-fuzz-{}-{}",
        dir.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, work.join(p.file_name().unwrap())).unwrap();
        }
    }
    let target = model_path(&work);
    let (mut loaded, mut refused) = (0, 0);
    for seed in 1..=iterations {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        std::fs::write(work.join(file), mutate(&orig, header, &mut rng)).unwrap();
        match catch_unwind(AssertUnwindSafe(|| exercise(&target))) {
            Ok(true) => loaded += 1,
            Ok(false) => refused += 1,
            Err(_) => panic!("{}/{file}: mutation seed {seed} panicked the loader", dir.display()),
        }
    }
    println!("{}/{file}: {iterations} mutations, {refused} refused, {loaded} loaded and ran", dir.display());
    assert!(refused > 0, "no mutation was refused: the fuzzer is not reaching the parser");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn mutated_gguf_files_error_without_panicking() {
    fuzz(&fixtures().join("gguf_quant/Q4_K"), "model.gguf", 4096, 150);
    fuzz(&fixtures().join("gguf_arch/qwen3moe"), "model.gguf", 8192, 150);
}

#[test]
fn mutated_safetensors_files_error_without_panicking() {
    fuzz(&fixtures().join("tiny/qwen3"), "model.safetensors", 2048, 150);
    fuzz(&fixtures().join("mlx/qwen3_q4_g64"), "model.safetensors", 4096, 150);
    fuzz(&fixtures().join("tiny/qwen3"), "config.json", 827, 100);
}
