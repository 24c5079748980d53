//! Random inputs for the CPU kernels' tests: a xorshift generator seeded
//! fresh each run (the seed printed, so a failure can be replayed) and the
//! f16 fields of quantized blocks; and the SIMD tests' CPU checks.

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

/// Whether the AVX2 kernels can be tested here. Without AVX2/FMA/F16C the
/// caller skips, saying so; under `QINFER_CI=1` (`.ci/run`, whose machine
/// has AVX2) it fails instead, so the kernels cannot go untested unnoticed.
pub fn avx2_or_skip() -> bool {
    if super::simd::has_avx2() {
        return true;
    }
    let ci = std::env::var_os("QINFER_CI").is_some_and(|v| v == "1");
    assert!(!ci, "QINFER_CI=1 forbids skipping: no avx2/fma/f16c on this CPU");
    eprintln!("skipped: no avx2/fma/f16c on this CPU");
    false
}

/// Whether the AVX-512 VNNI kernels can be tested here; the caller skips,
/// saying so, where the CPU lacks them (CI's machines need not have them).
pub fn avx512_vnni_or_skip() -> bool {
    if super::simd::has_avx512_vnni() {
        return true;
    }
    eprintln!("skipped: no AVX-512 F/BW/VL/VNNI on this CPU");
    false
}
