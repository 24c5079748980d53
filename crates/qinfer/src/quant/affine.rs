//! Affine group quantization, the one quantized-linear family (MLX's "affine"
//! mode): each run of `group_size` values along a row shares a scale and a
//! bias, `w = scale·q + bias` with `q` an unsigned `bits`-bit integer.
//!
//! Storage as mlx writes it: `q` values packed into little-endian u32 words as
//! one continuous bit stream per row, low bits first, so for 3, 5 and 6 bits a
//! value may straddle two words. Every run of 8 values fills exactly `bits`
//! bytes, and a group (16 values or a multiple of 32) starts on a byte
//! boundary (a word boundary from 32 on).

use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

/// Bit widths mlx's affine mode supports.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes mlx's affine mode supports (what `qinfer quantize` writes).
pub const MLX_GROUP_SIZES: [usize; 3] = [32, 64, 128];
/// Group sizes qinfer computes with: mlx's, and 16: ggml's Q2_K, Q3_K and
/// Q6_K blocks scale 16 values at a time, and become affine weights with
/// groups of 16 (formats/gguf/as_affine.rs).
pub const SUPPORTED_GROUP_SIZES: [usize; 4] = [16, 32, 64, 128];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffineParams {
    pub bits: u32,
    pub group_size: usize,
}

impl AffineParams {
    /// Checks that mlx could have written these parameters; `field` names the
    /// config entry they came from.
    pub fn new(bits: u32, group_size: usize, field: &str) -> Result<Self> {
        if !SUPPORTED_BITS.contains(&bits) {
            return Err(Error::config(format!("{field}.bits"), format!("{bits} is not one of {SUPPORTED_BITS:?}")));
        }
        if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
            return Err(Error::config(
                format!("{field}.group_size"),
                format!("{group_size} is not one of {SUPPORTED_GROUP_SIZES:?}"),
            ));
        }
        Ok(AffineParams { bits, group_size })
    }
    /// Bytes of packed values in one row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols * self.bits as usize / 8
    }
}

/// The stored pieces of one quantized weight, before their shapes are checked
/// against the module that uses them (see [`AffineTensor::new`]).
#[derive(Debug, Clone)]
pub struct AffineParts {
    pub packed: Tensor,
    pub scales: Tensor,
    pub biases: Tensor,
    /// The parameters config.json names for this module, if it names any.
    pub declared: Option<AffineParams>,
}

/// A quantized weight as stored: `packed` (u32 words `[…, rows, cols·bits/32]`),
/// `scales` and `biases` (float `[…, rows, cols/group_size]`). `shape` is the
/// logical shape, `[…, rows, cols]`.
#[derive(Debug, Clone)]
pub struct AffineTensor {
    /// The weight's name (`….weight`), for errors.
    pub name: String,
    pub shape: Vec<usize>,
    pub params: AffineParams,
    pub packed: Tensor,
    pub scales: Tensor,
    pub biases: Tensor,
}

impl AffineTensor {
    /// Checks the three tensors against each other and against the logical row
    /// length `cols`. `declared`: the parameters config.json names for this
    /// module; when absent they are inferred from the shapes, as mlx-lm's
    /// `infer_quant_config` does.
    pub fn new(parts: AffineParts, cols: usize) -> Result<Self> {
        let AffineParts { packed, scales, biases, declared } = parts;
        let name = packed.name.clone();
        if packed.dtype != DType::U32 {
            return Err(Error::tensor(
                &name,
                format!("quantized weights are packed u32, found {}", packed.dtype.name()),
            ));
        }
        for t in [&scales, &biases] {
            match t.dtype {
                DType::F32 | DType::F16 | DType::BF16 => {}
                DType::U32
                | DType::F8_E4M3
                | DType::Q4_0
                | DType::Q4_1
                | DType::Q5_0
                | DType::Q5_1
                | DType::Q8_0
                | DType::Q2_K
                | DType::Q3_K
                | DType::Q4_K
                | DType::Q5_K
                | DType::Q6_K => {
                    return Err(Error::tensor(&t.name, format!("expected F32, F16 or BF16, found {}", t.dtype.name())));
                }
            }
        }
        let (Some((&words, outer)), Some((&groups, s_outer))) = (packed.shape.split_last(), scales.shape.split_last())
        else {
            return Err(Error::tensor(&name, "a quantized weight needs at least one dimension"));
        };
        if outer != s_outer {
            return Err(Error::tensor(
                &scales.name,
                format!("shape {:?} does not match the packed weight's {:?}", scales.shape, packed.shape),
            ));
        }
        if scales.shape != biases.shape {
            return Err(Error::tensor(
                &biases.name,
                format!("shape {:?} differs from the scales' {:?}", biases.shape, scales.shape),
            ));
        }
        let inferred = (cols > 0 && groups > 0 && (words * 32).is_multiple_of(cols) && cols.is_multiple_of(groups))
            .then(|| AffineParams::new((words * 32 / cols) as u32, cols / groups, &name).ok())
            .flatten();
        let params = match (declared, inferred) {
            (Some(d), Some(i)) if d == i => d,
            (Some(d), _) => {
                return Err(Error::tensor(
                    &name,
                    format!(
                        "config.json declares {} bits, group size {}: rows of {cols} values need {} u32 words and {} \
                         scales, found {words} and {groups}",
                        d.bits,
                        d.group_size,
                        cols * d.bits as usize / 32,
                        cols / d.group_size
                    ),
                ));
            }
            (None, Some(i)) => i,
            (None, None) => {
                return Err(Error::tensor(
                    &name,
                    format!(
                        "{words} u32 words and {groups} scales per row fit no supported bits/group size for {cols} values"
                    ),
                ));
            }
        };
        let mut shape = outer.to_vec();
        shape.push(cols);
        Ok(AffineTensor { name, shape, params, packed, scales, biases })
    }

    /// Entries `[start, start + len)` along the outermost dimension (no copy):
    /// one expert of a stacked `[E, rows, cols]` weight.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        let mut shape = self.shape.clone();
        shape[0] = len;
        Ok(AffineTensor {
            name: self.name.clone(),
            shape,
            params: self.params,
            packed: self.packed.narrow(start, len)?,
            scales: self.scales.narrow(start, len)?,
            biases: self.biases.narrow(start, len)?,
        })
    }

    /// `[rows, cols]` matrices with the same quantization stacked by rows
    /// (see [`Tensor::concat_rows`]); `None` when their parameters, row
    /// lengths or storage types differ.
    pub fn concat_rows(name: &str, parts: &[&AffineTensor]) -> Result<Option<Self>> {
        let Some(first) = parts.first() else { return Ok(None) };
        if first.shape.len() != 2 || parts.iter().any(|a| a.params != first.params || a.shape[1..] != first.shape[1..])
        {
            return Ok(None);
        }
        let stack = |pick: fn(&AffineTensor) -> &Tensor| {
            Tensor::concat_rows(name, &parts.iter().map(|a| pick(a)).collect::<Vec<_>>())
        };
        let (Some(packed), Some(scales), Some(biases)) =
            (stack(|a| &a.packed)?, stack(|a| &a.scales)?, stack(|a| &a.biases)?)
        else {
            return Ok(None);
        };
        let rows = parts.iter().map(|a| a.shape[0]).sum();
        Ok(Some(AffineTensor {
            name: name.to_string(),
            shape: vec![rows, first.shape[1]],
            params: first.params,
            packed,
            scales,
            biases,
        }))
    }

    /// Drops a leading dimension of 1: `[1, rows, cols]` → `[rows, cols]`.
    pub fn squeeze_outer(&self) -> Result<Self> {
        if self.shape.len() < 2 || self.shape[0] != 1 {
            return Err(Error::tensor(&self.name, format!("cannot squeeze shape {:?}", self.shape)));
        }
        let drop = |t: &Tensor| t.reshape(t.shape[1..].to_vec());
        Ok(AffineTensor {
            name: self.name.clone(),
            shape: self.shape[1..].to_vec(),
            params: self.params,
            packed: drop(&self.packed)?,
            scales: drop(&self.scales)?,
            biases: drop(&self.biases)?,
        })
    }
}

/// Unpacks `q.len()` values (a multiple of 8) of `bits` bits from `src`
/// (exactly `q.len()·bits/8` bytes), low bits first.
#[inline]
pub fn unpack(bits: u32, src: &[u8], q: &mut [f32]) {
    debug_assert_eq!(src.len() * 8, q.len() * bits as usize);
    match bits {
        8 => {
            for (o, b) in q.iter_mut().zip(src) {
                *o = *b as f32;
            }
        }
        4 => {
            for (o, b) in q.chunks_exact_mut(2).zip(src) {
                o[0] = (b & 0x0f) as f32;
                o[1] = (b >> 4) as f32;
            }
        }
        _ => {
            // Eight values fill `bits` whole bytes: read them as one integer.
            let nb = bits as usize;
            let mask = (1u64 << bits) - 1;
            for (o, chunk) in q.chunks_exact_mut(8).zip(src.chunks_exact(nb)) {
                let mut word = [0u8; 8];
                word[..nb].copy_from_slice(chunk);
                let v = u64::from_le_bytes(word);
                for (j, oj) in o.iter_mut().enumerate() {
                    *oj = ((v >> (j * nb)) & mask) as f32;
                }
            }
        }
    }
}

/// Packs `q` (values < 2^bits, length a multiple of 8) into `out` as mlx does.
pub fn pack(bits: u32, q: &[u8], out: &mut Vec<u8>) {
    let nb = bits as usize;
    for chunk in q.chunks_exact(8) {
        let mut v = 0u64;
        for (j, &x) in chunk.iter().enumerate() {
            v |= (x as u64) << (j * nb);
        }
        out.extend_from_slice(&v.to_le_bytes()[..nb]);
    }
}

/// Quantizes one group as mlx's `affine_quantize` does: the scale spans
/// [min, max] in `2^bits − 1` steps (at least 1e-7), signed so that the edge of
/// larger magnitude is exactly representable; the bias is that edge (0 when it
/// rounds to the zero level). Returns (scale, bias); `q` receives the levels.
pub fn quantize_group(w: &[f32], bits: u32, q: &mut [u8]) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let w_max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w_min = w.iter().copied().fold(f32::INFINITY, f32::min);
    let min_is_edge = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(1e-7);
    if !min_is_edge {
        scale = -scale;
    }
    let edge = if min_is_edge { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let (scale, bias) = if q0 != 0.0 { (edge / q0, edge) } else { (scale, 0.0) };
    for (qi, wi) in q.iter_mut().zip(w) {
        *qi = ((wi - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u8;
    }
    (scale, bias)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Bytes, DType, Tensor};

    #[test]
    fn pack_then_unpack_round_trips_every_width() {
        for bits in SUPPORTED_BITS {
            let q: Vec<u8> = (0..64).map(|i| ((i * 7 + 3) % (1 << bits)) as u8).collect();
            let mut packed = Vec::new();
            pack(bits, &q, &mut packed);
            assert_eq!(packed.len(), 64 * bits as usize / 8);
            let mut back = vec![0f32; 64];
            unpack(bits, &packed, &mut back);
            assert!(back.iter().zip(&q).all(|(a, b)| *a == *b as f32), "{bits} bits");
        }
    }

    /// A `[rows, 64]` 4-bit weight whose packed words, scales and biases are
    /// `seed`-dependent.
    fn weight(name: &str, rows: usize, seed: u8, scale_dtype: DType) -> AffineTensor {
        let bytes =
            |n: usize, k: u8| Bytes::from_vec((0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(k)).collect());
        let packed = Tensor::new(format!("{name}.weight"), DType::U32, vec![rows, 8], bytes(rows * 32, seed)).unwrap();
        let per = if scale_dtype == DType::F32 { 4 } else { 2 };
        let side =
            |n: &str, k| Tensor::new(format!("{name}.{n}"), scale_dtype, vec![rows, 1], bytes(rows * per, k)).unwrap();
        let parts =
            AffineParts { packed, scales: side("scales", seed + 1), biases: side("biases", seed + 2), declared: None };
        AffineTensor::new(parts, 64).unwrap()
    }

    #[test]
    fn concat_rows_stacks_packed_scales_and_biases() {
        let (a, b) = (weight("a", 3, 1, DType::BF16), weight("b", 2, 9, DType::BF16));
        let c = AffineTensor::concat_rows("ab", &[&a, &b]).unwrap().expect("alike weights stack");
        assert_eq!((c.shape.clone(), c.params), (vec![5, 64], a.params));
        for (t, (x, y)) in [
            (&c.packed, (&a.packed, &b.packed)),
            (&c.scales, (&a.scales, &b.scales)),
            (&c.biases, (&a.biases, &b.biases)),
        ] {
            assert_eq!(t.shape[0], 5);
            assert_eq!(t.data.as_slice(), [x.data.as_slice(), y.data.as_slice()].concat());
        }
        // Scales stored differently, or other parameters: not stacked.
        assert!(AffineTensor::concat_rows("x", &[&a, &weight("f", 2, 4, DType::F32)]).unwrap().is_none());
        let mut other = weight("g", 2, 5, DType::BF16);
        other.params.group_size = 32;
        assert!(AffineTensor::concat_rows("x", &[&a, &other]).unwrap().is_none());
    }

    #[test]
    fn three_bit_values_straddle_words() {
        // Value 10 occupies bits 30..33: two bits in word 0, one in word 1.
        let mut q = vec![0u8; 32];
        q[10] = 0b101;
        let mut packed = Vec::new();
        pack(3, &q, &mut packed);
        let w0 = u32::from_le_bytes(packed[0..4].try_into().unwrap());
        let w1 = u32::from_le_bytes(packed[4..8].try_into().unwrap());
        assert_eq!((w0 >> 30, w1 & 1), (0b01, 0b1));
    }
}
