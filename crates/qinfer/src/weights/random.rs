//! Synthetic weights of a real model's shape, for benchmarking without the
//! checkpoint: every tensor the model asks for is made on the spot in the
//! requested storage type. Values are uniform with a 1/√fan-in scale so
//! activations stay O(1); quantized types get random codes and scales directly.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::quant::affine::{AffineParams, AffineTensor};
use crate::quant::fp8::{Fp8Scaling, Fp8Tensor};
use crate::quant::kquants;
use crate::quant::recipe::Recipe;
use crate::tensor::{Bytes, DType, Tensor};
use crate::{Error, Result};

/// How to make the weights.
#[derive(Debug, Clone, Copy)]
pub struct RandomWeights {
    /// Storage type of matrices; vectors (norms, gates' biases) are f32.
    pub dtype: DType,
    /// Affine-quantize every matrix whose rows split into whole groups (as
    /// mlx-lm's conversion does) instead of storing it as `dtype`.
    pub affine: Option<AffineParams>,
    /// llama.cpp's `_M` mixes: the matrices it gives more bits (`lm_head`
    /// always; `v_proj` and `down_proj` on the layers `use_more_bits`
    /// picks) are stored as this type, of a model of `layers` layers.
    pub more_bits: Option<(DType, usize)>,
    /// Store every layer matrix as block-scaled FP8 (Qwen's FP8 editions:
    /// 128×128 blocks; embeddings, `lm_head` and MoE routers stay `dtype`).
    pub fp8: bool,
    pub seed: u64,
}

struct Rng(u64);

impl Rng {
    fn new(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, so every tensor differs and runs repeat exactly.
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        Rng((h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// How `--random-weights` stores matrices: a ggml/float type, or MLX-style
/// affine groups (`q4g64`: 4 bits, groups of 64, bf16 scales and biases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightStorage {
    Plain(DType),
    Affine(AffineParams),
    /// A GGUF `_M` file's mix (`q4_k_m`: Q4_K, Q6_K where llama.cpp's
    /// Q4_K_M gives more bits; `q5_k_m`: Q5_K and Q6_K).
    GgufMix {
        low: DType,
        high: DType,
    },
    /// Qwen's FP8 editions: E4M3 with a scale per 128×128 block, the rest bf16.
    Fp8,
}

impl std::str::FromStr for WeightStorage {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let plain = match s {
            "f32" => Some(DType::F32),
            "f16" => Some(DType::F16),
            "bf16" => Some(DType::BF16),
            "q8_0" => Some(DType::Q8_0),
            "q4_0" => Some(DType::Q4_0),
            "q4_1" => Some(DType::Q4_1),
            "q5_0" => Some(DType::Q5_0),
            "q5_1" => Some(DType::Q5_1),
            "q2_k" => Some(DType::Q2_K),
            "q3_k" => Some(DType::Q3_K),
            "q4_k" => Some(DType::Q4_K),
            "q5_k" => Some(DType::Q5_K),
            "q6_k" => Some(DType::Q6_K),
            _ => None,
        };
        if let Some(d) = plain {
            return Ok(WeightStorage::Plain(d));
        }
        match s {
            "q4_k_m" => return Ok(WeightStorage::GgufMix { low: DType::Q4_K, high: DType::Q6_K }),
            "q5_k_m" => return Ok(WeightStorage::GgufMix { low: DType::Q5_K, high: DType::Q6_K }),
            "fp8" => return Ok(WeightStorage::Fp8),
            _ => {}
        }
        let affine = s
            .strip_prefix('q')
            .and_then(|r| r.split_once('g'))
            .and_then(|(b, g)| Some((b.parse().ok()?, g.parse().ok()?)));
        match affine {
            Some((bits, group_size)) => Ok(WeightStorage::Affine(AffineParams::new(bits, group_size, s)?)),
            None => Err(Error::Invalid(format!(
                "unknown weight storage `{s}`: expected f32, f16, bf16, a ggml type (q8_0, q4_0, q4_1, q5_0, q5_1, \
                 q2_k … q6_k), q4_k_m, q5_k_m, fp8 or q<bits>g<group> (e.g. q4g64)"
            ))),
        }
    }
}

impl std::fmt::Display for WeightStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightStorage::Plain(d) => write!(f, "{}", d.name()),
            WeightStorage::Affine(p) => write!(f, "q{}g{}", p.bits, p.group_size),
            WeightStorage::GgufMix { low, .. } => write!(f, "{}_m", low.name().to_lowercase()),
            WeightStorage::Fp8 => write!(f, "fp8"),
        }
    }
}

impl RandomWeights {
    /// Weights of a model of `layers` layers (the `_M` mixes pick by layer).
    pub fn new(storage: WeightStorage, layers: usize, seed: u64) -> Self {
        match storage {
            WeightStorage::Plain(dtype) => RandomWeights { dtype, affine: None, more_bits: None, fp8: false, seed },
            // Matrices whose rows do not split into groups stay bf16, as mlx leaves them.
            WeightStorage::Affine(p) => {
                RandomWeights { dtype: DType::BF16, affine: Some(p), more_bits: None, fp8: false, seed }
            }
            WeightStorage::GgufMix { low, high } => {
                RandomWeights { dtype: low, affine: None, more_bits: Some((high, layers)), fp8: false, seed }
            }
            WeightStorage::Fp8 => RandomWeights { dtype: DType::BF16, affine: None, more_bits: None, fp8: true, seed },
        }
    }

    /// The storage type of the matrix `name`: the mix's (llama.cpp's
    /// `use_more_bits` rule is mlx-lm's mixed recipes' rule, [`Recipe`]).
    fn dtype_of(&self, name: &str) -> DType {
        match self.more_bits {
            Some((high, layers)) => {
                let module = name.strip_suffix(".weight").unwrap_or(name);
                if Recipe::Mixed4_6.bits_for(module, layers) == 6 { high } else { self.dtype }
            }
            None => self.dtype,
        }
    }

    /// The matrix `name` affine-quantized, when these weights are affine and
    /// its rows split into whole groups: random packed levels, bf16 scales and
    /// biases (mlx's default for bf16 models) spanning about ±1/√fan-in.
    pub fn affine_tensor(&self, name: &str, shape: &[usize]) -> Result<Option<AffineTensor>> {
        let Some(params) = self.affine else { return Ok(None) };
        let (Some(&cols), true) = (shape.last(), shape.len() >= 2) else { return Ok(None) };
        if !cols.is_multiple_of(params.group_size) {
            return Ok(None);
        }
        let rows: usize = shape[..shape.len() - 1].iter().product();
        let mut rng = Rng::new(self.seed, name);
        let mut packed = vec![0u8; rows * params.row_bytes(cols)];
        packed.par_chunks_mut(4096).enumerate().for_each(|(i, chunk)| {
            let mut rng = Rng::new(self.seed ^ (i as u64).wrapping_mul(0xD134_2543_DE82_EF95), name);
            chunk.iter_mut().for_each(|b| *b = rng.next() as u8);
        });
        let scale = 1.0 / (cols as f32).sqrt();
        let groups = rows * cols / params.group_size;
        let step = 2.0 * scale / ((1u32 << params.bits) - 1) as f32;
        let scales: Vec<f32> = (0..groups).map(|_| step * (1.0 + 0.1 * rng.uniform())).collect();
        let biases: Vec<f32> = (0..groups).map(|_| -scale * (1.0 + 0.1 * rng.uniform())).collect();
        let mut group_shape = shape.to_vec();
        *group_shape.last_mut().expect("2-D or more") = cols / params.group_size;
        let mut word_shape = shape.to_vec();
        *word_shape.last_mut().expect("2-D or more") = cols * params.bits as usize / 32;
        let bf16s = |n: &str, v: &[f32]| {
            let bytes = v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect();
            Tensor::new(n.to_string(), DType::BF16, group_shape.clone(), Bytes::from_vec(bytes))
        };
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        Ok(Some(AffineTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            params,
            packed: Tensor::new(name.to_string(), DType::U32, word_shape, Bytes::from_vec(packed))?,
            scales: bf16s(&format!("{stem}.scales"), &scales)?,
            biases: bf16s(&format!("{stem}.biases"), &biases)?,
        }))
    }

    /// The matrix `name` as block-scaled FP8, when these weights are FP8 and
    /// Qwen's recipe quantizes it: random finite E4M3 bytes, block scales
    /// putting values at about ±1/√fan-in.
    pub fn fp8_tensor(&self, name: &str, shape: &[usize]) -> Result<Option<Fp8Tensor>> {
        let kept = ["embed_tokens", "lm_head", "mlp.gate.weight", "shared_expert_gate"];
        if !self.fp8 || shape.len() < 2 || kept.iter().any(|k| name.contains(k)) {
            return Ok(None);
        }
        let (rows, cols) = (shape[..shape.len() - 1].iter().product::<usize>(), shape[shape.len() - 1]);
        let mut bytes = vec![0u8; rows * cols];
        bytes.par_chunks_mut(4096).enumerate().for_each(|(i, chunk)| {
            let mut rng = Rng::new(self.seed ^ (i as u64).wrapping_mul(0xD134_2543_DE82_EF95), name);
            // 0x7F and 0xFF are NaN; the rest of the byte range is finite.
            chunk.iter_mut().for_each(|b| *b = (rng.next() as u8) & 0xF7);
        });
        let block = 128;
        let mut scale_shape = shape.to_vec();
        let n = scale_shape.len();
        scale_shape[n - 2] = shape[n - 2].div_ceil(block);
        scale_shape[n - 1] = cols.div_ceil(block);
        let mut rng = Rng::new(self.seed, name);
        // Bytes up to ±240 (bit 3, the exponent's lowest, cleared), most within ±64.
        let unit = 1.0 / (cols as f32).sqrt() / 64.0;
        let scales: Vec<f32> =
            (0..scale_shape.iter().product::<usize>()).map(|_| unit * (1.0 + 0.1 * rng.uniform())).collect();
        let weight = Tensor::new(name.to_string(), DType::F8_E4M3, shape.to_vec(), Bytes::from_vec(bytes))?;
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let scale = Tensor::from_f32(&format!("{stem}.weight_scale_inv"), scale_shape, &scales)?;
        Fp8Tensor::from_stored(weight, scale, Fp8Scaling::Block { rows: block, cols: block }).map(Some)
    }

    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let mut rng = Rng::new(self.seed, name);
        let n: usize = shape.iter().product();
        let fan_in = *shape.last().unwrap_or(&1);
        if shape.len() == 1 {
            // Norm weights, A_log, dt_bias: around 1.
            let v: Vec<f32> = (0..n).map(|_| 1.0 + 0.1 * rng.uniform()).collect();
            return Tensor::from_f32(name, shape.to_vec(), &v);
        }
        let scale = 1.0 / (fan_in as f32).sqrt();
        let dtype = self.dtype_of(name);
        let dtype = if fan_in.is_multiple_of(dtype.block_len()) { dtype } else { DType::F32 };
        if let DType::F32 | DType::F16 | DType::BF16 = dtype {
            // Rows in parallel, each from its own stream: multi-GB models build in seconds.
            let width = dtype.block_bytes();
            let mut bytes = vec![0u8; n * width];
            bytes.par_chunks_mut(fan_in * width).enumerate().for_each(|(r, row)| {
                let mut rng = Rng::new(self.seed ^ (r as u64).wrapping_mul(0xD134_2543_DE82_EF95), name);
                for v in row.chunks_exact_mut(width) {
                    let x = scale * rng.uniform();
                    match dtype {
                        DType::F16 => v.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
                        DType::BF16 => v.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
                        _ => v.copy_from_slice(&x.to_le_bytes()),
                    }
                }
            });
            return Tensor::new(name.to_string(), dtype, shape.to_vec(), Bytes::from_vec(bytes));
        }
        let mut bytes = Vec::with_capacity(dtype.bytes_for(n).ok_or_else(|| Error::tensor(name, "size overflow"))?);
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("handled above"),
            DType::Q8_0 => {
                for _ in 0..n / 32 {
                    bytes.extend(f16::from_f32(scale / 127.0).to_le_bytes());
                    (0..32).for_each(|_| bytes.push(rng.next() as u8));
                }
            }
            DType::U32 => {
                return Err(Error::tensor(name, "random weights cannot be packed u32 (use an affine quantizer)"));
            }
            DType::F8_E4M3 => {
                return Err(Error::tensor(name, "random FP8 weights need their scales (use the fp8 storage)"));
            }
            DType::Q4_0 | DType::Q4_1 => {
                for _ in 0..n / 32 {
                    bytes.extend(f16::from_f32(scale / 8.0).to_le_bytes());
                    if dtype == DType::Q4_1 {
                        bytes.extend(f16::from_f32(-scale).to_le_bytes());
                    }
                    (0..16).for_each(|_| bytes.push(rng.next() as u8));
                }
            }
            DType::Q5_0 | DType::Q5_1 | DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
                // Random bits with every f16 field set to one step: values of
                // magnitude up to about `scale`. The step is `scale` over the
                // largest sub-scale × level product of the type.
                let largest = match dtype {
                    DType::Q2_K => 45.0,
                    DType::Q3_K => 128.0,
                    DType::Q4_K => 945.0,
                    DType::Q5_K => 1953.0,
                    DType::Q6_K => 4096.0,
                    _ => 16.0,
                };
                let step = scale / largest;
                let bb = dtype.block_bytes();
                for _ in 0..n / dtype.block_len() {
                    let start = bytes.len();
                    (0..bb).for_each(|_| bytes.push(rng.next() as u8));
                    for &off in kquants::f16_field_offsets(dtype) {
                        bytes[start + off..start + off + 2].copy_from_slice(&f16::from_f32(step).to_le_bytes());
                    }
                }
            }
        }
        Tensor::new(name.to_string(), dtype, shape.to_vec(), Bytes::from_vec(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_makes_a_valid_tensor_of_the_shape() {
        for dtype in
            [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::Q6_K]
        {
            let r = RandomWeights { dtype, affine: None, more_bits: None, fp8: false, seed: 1 };
            let cols = dtype.block_len().max(64);
            let t = r.tensor("w", &[3, cols]).unwrap();
            assert_eq!(t.shape, vec![3, cols]);
            assert_eq!(t.dtype, dtype);
            let v = t.to_f32_vec();
            assert!(v.iter().all(|x| x.is_finite() && x.abs() <= 0.2), "{dtype:?}");
            assert!(v.iter().any(|x| *x != 0.0));
            // Same name and seed: same values; another name: different.
            assert_eq!(r.tensor("w", &[3, cols]).unwrap().to_f32_vec(), v);
            assert_ne!(r.tensor("w2", &[3, cols]).unwrap().to_f32_vec(), v);
        }
    }

    #[test]
    fn q4_k_m_gives_more_bits_where_llama_cpp_does() {
        let storage: WeightStorage = "q4_k_m".parse().unwrap();
        assert_eq!(storage.to_string(), "q4_k_m");
        // 36 layers: use_more_bits holds for layers 0-3, 31-35 and (i - 4) % 3 == 2 between.
        let r = RandomWeights::new(storage, 36, 1);
        let dtype = |n: &str| r.tensor(n, &[2, 256]).unwrap().dtype;
        assert_eq!(dtype("lm_head.weight"), DType::Q6_K);
        assert_eq!(dtype("model.embed_tokens.weight"), DType::Q4_K);
        for (layer, more) in
            [(0, true), (3, true), (4, false), (6, true), (7, false), (9, true), (29, false), (30, true), (31, true)]
        {
            let want = if more { DType::Q6_K } else { DType::Q4_K };
            assert_eq!(dtype(&format!("model.layers.{layer}.self_attn.v_proj.weight")), want, "layer {layer}");
            assert_eq!(dtype(&format!("model.layers.{layer}.mlp.down_proj.weight")), want, "layer {layer}");
            assert_eq!(dtype(&format!("model.layers.{layer}.self_attn.q_proj.weight")), DType::Q4_K);
            assert_eq!(dtype(&format!("model.layers.{layer}.mlp.gate_proj.weight")), DType::Q4_K);
        }
    }
}
