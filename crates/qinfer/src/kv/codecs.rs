//! The vector codecs of every (layer, KV head) of a cache format: keys and
//! values each get their own seeded rotation (and keys in TurboQuant_prod
//! their own sketch), so no two heads share quantization noise.

use std::sync::Arc;

use super::KvShape;
use super::format::{KvFormat, KvSide};
use crate::quant::turbo::VectorCodec;
use crate::quant::turbo::qjl::Sketch;
use crate::quant::turbo::rotation::seed_of;
use crate::{Error, Result};

/// The seed all rotations and sketches derive from: fixed, so a cache
/// written by one run (or backend) reads back in another.
pub const MODEL_SEED: u64 = 0x7475_7262_6f71_7561;

const KEYS: u64 = 1;
const VALUES: u64 = 2;
const SKETCH: u64 = 3;

/// Codecs indexed by attention layer (`0..shape.num_layers`, the layers
/// holding a KV cache, in model order).
pub struct KvCodecs {
    pub format: KvFormat,
    pub shape: KvShape,
    keys: Vec<VectorCodec>,
    values: Vec<VectorCodec>,
}

impl KvCodecs {
    /// `shape.num_layers` counts attention layers only.
    pub fn new(format: KvFormat, shape: KvShape) -> Result<Self> {
        let d = shape.head_dim;
        if format.rotates() && (!d.is_power_of_two() || d < 8) {
            return Err(Error::Invalid(format!(
                "KV cache format {format} rotates head vectors with a Walsh–Hadamard transform, which needs a \
                 power-of-two head dimension of at least 8; this model's is {d}"
            )));
        }
        let codec = |side: KvSide, layer: usize, head: usize, purpose: u64| {
            let seed = seed_of(MODEL_SEED, layer, head, purpose);
            match side {
                KvSide::F32 => VectorCodec::F32 { dim: d },
                KvSide::F16 => VectorCodec::F16 { dim: d },
                KvSide::Fp8 => VectorCodec::Fp8 { dim: d },
                KvSide::Turbo(b) => VectorCodec::turbo(d, b as u32, seed),
                KvSide::TurboProd(b) => {
                    let sketch = Arc::new(Sketch::seeded(d, seed_of(MODEL_SEED, layer, head, SKETCH)));
                    VectorCodec::turbo_prod(d, b as u32, seed, sketch)
                }
            }
        };
        let heads = || (0..shape.num_layers).flat_map(|l| (0..shape.num_kv_heads).map(move |h| (l, h)));
        Ok(KvCodecs {
            format,
            shape,
            keys: heads().map(|(l, h)| codec(format.keys, l, h, KEYS)).collect(),
            values: heads().map(|(l, h)| codec(format.values, l, h, VALUES)).collect(),
        })
    }

    pub fn key(&self, layer: usize, head: usize) -> &VectorCodec {
        &self.keys[layer * self.shape.num_kv_heads + head]
    }

    pub fn value(&self, layer: usize, head: usize) -> &VectorCodec {
        &self.values[layer * self.shape.num_kv_heads + head]
    }

    /// Bytes of one position's keys (all KV heads) in one layer.
    pub fn key_row_bytes(&self) -> usize {
        self.shape.num_kv_heads * self.keys[0].bytes()
    }

    pub fn value_row_bytes(&self) -> usize {
        self.shape.num_kv_heads * self.values[0].bytes()
    }

    /// Encodes `rows` (`[n, num_kv_heads·head_dim]`) of `layer`'s keys or
    /// values into `out` (`n` rows of the side's row bytes).
    pub fn encode_rows(&self, layer: usize, keys: bool, rows: &[f32], out: &mut [u8]) {
        let d = self.shape.head_dim;
        let codecs = if keys { &self.keys } else { &self.values };
        let codecs = &codecs[layer * self.shape.num_kv_heads..(layer + 1) * self.shape.num_kv_heads];
        let b = codecs[0].bytes();
        for (row, bytes) in rows.chunks_exact(d * codecs.len()).zip(out.chunks_exact_mut(b * codecs.len())) {
            for ((c, x), o) in codecs.iter().zip(row.chunks_exact(d)).zip(bytes.chunks_exact_mut(b)) {
                c.encode(x, o);
            }
        }
    }
}
