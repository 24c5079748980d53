//! What the CUDA test binaries (cuda_*.rs) and the GPU profile
//! (benches/cuda_profile.rs) share: the device or a skip, random inputs,
//! the CUDA and CPU backends side by side, and the error measure.
#![allow(dead_code)]

pub mod ties;

use std::path::{Path, PathBuf};

use qinfer::backend::Backend;
use qinfer::backend::cpu::CpuBackend;
use qinfer::backend::cuda::CudaBackend;
use qinfer::kv::KvPrecision;
use qinfer::tensor::{Bytes, DType, Tensor};

/// Whether a missing CUDA driver or device must fail the test instead of
/// skipping it: bench/cuda_h200.sh sets `QINFER_REQUIRE_GPU=1` on the GPU
/// machine. (CI sets `QINFER_CI=1` on a machine without a GPU, where these
/// tests skip.)
pub fn require_gpu() -> bool {
    std::env::var_os("QINFER_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// The device, its outputs NaN-poisoned; None (after printing why) on a
/// machine without CUDA, a failure there under [`require_gpu`].
pub fn gpu() -> Option<CudaBackend> {
    if !CudaBackend::available() {
        let reason = "no CUDA driver/libraries or no device on this machine";
        assert!(!require_gpu(), "QINFER_REQUIRE_GPU=1, but {reason}");
        println!("skipping: {reason}");
        return None;
    }
    Some(CudaBackend::new(0).expect("a CUDA device is present, so the backend must start").with_poisoned_outputs())
}

pub struct Rng(u64);

impl Rng {
    pub fn fresh() -> Self {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        println!("seed {seed}");
        Rng(seed | 1)
    }
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

pub fn tensor(name: &str, dtype: DType, shape: Vec<usize>, v: &[f32]) -> Tensor {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        other => panic!("{other:?}"),
    };
    Tensor::new(name.into(), dtype, shape, Bytes::from_vec(bytes)).unwrap()
}

/// max |got − want| / max |want|; NaN fails.
pub fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let bad: Vec<usize> = (0..got.len()).filter(|&i| !got[i].is_finite()).collect();
    assert!(
        bad.is_empty(),
        "{} non-finite outputs of {} (unwritten elements?), first at {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(8)]
    );
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// Both backends with the same inputs.
pub struct Pair {
    pub cpu: CpuBackend,
    pub gpu: CudaBackend,
    /// The same device with prefill GEMMs on split (hi + lo) activations.
    pub split: CudaBackend,
}

impl Pair {
    pub fn acts(
        &self,
        rows: usize,
        cols: usize,
        v: &[f32],
    ) -> (qinfer::backend::cpu::CpuAct, qinfer::backend::cuda::CudaAct) {
        (self.cpu.act_from_host(rows, cols, v), self.gpu.act_from_host(rows, cols, v))
    }
    pub fn weights(&self, t: &Tensor) -> (qinfer::backend::cpu::CpuWeight, qinfer::backend::cuda::CudaWeight) {
        (self.cpu.upload(t).unwrap(), self.gpu.upload(t).unwrap())
    }
    pub fn check(&self, what: &str, c: &qinfer::backend::cpu::CpuAct, g: &qinfer::backend::cuda::CudaAct, tol: f32) {
        let got = self.gpu.to_host(g);
        self.gpu.check().unwrap();
        let e = rel(&got, &self.cpu.to_host(c));
        println!("{what}: rel err {e:.2e}");
        assert!(e <= tol, "{what}: rel err {e} > {tol}");
    }
}

/// Attention over an f16 cache against the CPU's over the f32 values (where
/// the test cannot round the CPU's rows as the cache does): keys and values
/// each off by at most 2^-11 of themselves move the softmax weights and the
/// weighted sum by a few 2^-11 of the output's largest value. The same bound
/// as the prefill's tensor cores, which round q and the weights to f16 too.
pub const F16_CACHE_TOL: f32 = 3e-3;

/// [`pair`] with the fast backend's KV cache stored as `kv`.
pub fn pair_kv(kv: KvPrecision) -> Option<Pair> {
    let mut p = pair()?;
    p.gpu = p.gpu.with_kv_precision(kv);
    Some(p)
}

pub fn pair() -> Option<Pair> {
    // The parity configuration: prefill GEMMs near f32, and an f32 KV cache.
    let split = gpu()?.with_split_activations().with_kv_precision(KvPrecision::F32);
    gpu().map(|g| Pair { cpu: CpuBackend::new(), gpu: g, split })
}

/// A random affine-quantized `[rows, cols]` weight in MLX's layout, with bf16
/// scales and biases stored as `biases` (bf16: the GPU keeps both as bf16;
/// f32: as f32).
pub fn affine_tensor(
    r: &mut Rng,
    bits: u32,
    group_size: usize,
    rows: usize,
    cols: usize,
    biases: DType,
) -> qinfer::quant::affine::AffineTensor {
    affine_tensor_centered(r, bits, group_size, rows, cols, biases, false)
}

/// As [`affine_tensor`]; `centered`: each group's biases near −scale·(levels − 1)/2,
/// as quantizers set them, so the weights' mean is near 0 (chains of GEMVs
/// then keep their outputs' scale instead of saturating silu).
pub fn affine_tensor_centered(
    r: &mut Rng,
    bits: u32,
    group_size: usize,
    rows: usize,
    cols: usize,
    bias_dtype: DType,
    centered: bool,
) -> qinfer::quant::affine::AffineTensor {
    let levels = 1u32 << bits;
    let q: Vec<u8> = (0..rows * cols).map(|_| (((r.f() + 1.0) * 0.5 * levels as f32) as u32 % levels) as u8).collect();
    let mut packed = Vec::new();
    qinfer::quant::affine::pack(bits, &q, &mut packed);
    let groups = rows * cols / group_size;
    let scales: Vec<f32> = r.vec(groups).iter().map(|v| 0.02 + 0.01 * v).collect();
    let half = (levels - 1) as f32 / 2.0;
    let biases: Vec<f32> = r
        .vec(groups)
        .iter()
        .zip(&scales)
        .map(|(v, s)| if centered { -s * half * (1.0 + 0.05 * v) } else { 0.1 * v })
        .collect();
    qinfer::quant::affine::AffineTensor {
        name: "w.weight".into(),
        shape: vec![rows, cols],
        params: qinfer::quant::affine::AffineParams::new(bits, group_size, "test").unwrap(),
        packed: Tensor::new(
            "w.weight".into(),
            DType::U32,
            vec![rows, cols * bits as usize / 32],
            Bytes::from_vec(packed),
        )
        .unwrap(),
        scales: tensor("w.scales", DType::BF16, vec![rows, cols / group_size], &scales),
        biases: tensor("w.biases", bias_dtype, vec![rows, cols / group_size], &biases),
    }
}

/// Random K-quant blocks (Q2_K … Q6_K) for a `rows × cols` matrix: random
/// levels, scales and mins, with the f16 `d` (and `dmin`) scaled by the
/// type's largest scale·level product and √cols, so outputs stay O(1).
pub fn kquant_tensor(r: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Tensor {
    let (bb, n) = (dtype.block_bytes(), rows * cols / 256);
    let random_bytes =
        |r: &mut Rng, count: usize| (0..count).map(|_| (r.f() * 128.0 + 128.0) as u8).collect::<Vec<_>>();
    let half = |r: &mut Rng, step: f32| half::f16::from_f32(step * (1.5 + r.f())).to_le_bytes();
    // (largest |scale·level|, bytes before the f16s, f16s at the end).
    let (range, lead, tail) = match dtype {
        DType::Q2_K => (15.0 * 3.0, 80, 2),
        DType::Q3_K => (32.0 * 4.0, 108, 1),
        DType::Q6_K => (128.0 * 32.0, 208, 1),
        _ => (63.0 * 15.0, 0, 0),
    };
    let step = 1.0 / (range * (cols as f32).sqrt());
    let mut bytes = Vec::with_capacity(n * bb);
    for _ in 0..n {
        if lead == 0 {
            // Q4_K, Q5_K: d and dmin first.
            bytes.extend(half(r, step));
            bytes.extend(half(r, step));
            bytes.extend(random_bytes(r, bb - 4));
            continue;
        }
        bytes.extend(random_bytes(r, lead));
        for _ in 0..tail {
            bytes.extend(half(r, step));
        }
    }
    Tensor::new("w".into(), dtype, vec![rows, cols], Bytes::from_vec(bytes)).unwrap()
}

pub fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    dirs
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn max_abs(got: &[f32], want: &[f32]) -> f32 {
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()))
}

/// An expert's matrix: a tensor as stored (floats, GGUF blocks) or MLX-style affine.
pub enum Stored {
    Tensor(Tensor),
    Affine(Box<qinfer::quant::affine::AffineTensor>),
}

/// A bench configuration (`json`) written to `dir/name.json` with this
/// vocabulary and, where given, this many layers.
pub fn config_file(dir: &Path, name: &str, json: &str, vocab: u32, layers: Option<usize>) -> PathBuf {
    let mut cfg: serde_json::Value = serde_json::from_str(json).unwrap();
    cfg["vocab_size"] = vocab.into();
    if let Some(n) = layers {
        cfg["num_hidden_layers"] = n.into();
    }
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}
