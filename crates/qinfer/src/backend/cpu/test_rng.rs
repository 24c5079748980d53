//! Random inputs for the CPU kernels' tests: a xorshift generator seeded
//! fresh each run (the seed printed, so a failure can be replayed) and the
//! f16 fields of quantized blocks.

/// A fresh seed per run, printed under `label`, so repeated runs cover new inputs.
pub fn fresh_seed(label: &str) -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let seed = t.as_nanos() as u64 | 1;
    eprintln!("{label} seed {seed}");
    seed
}

/// The next xorshift64 value of `seed`.
pub fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// Any finite f16 of either sign, subnormals included.
pub fn finite_f16(seed: &mut u64) -> half::f16 {
    loop {
        let v = half::f16::from_bits(next(seed) as u16);
        if v.is_finite() {
            return v;
        }
    }
}
