//! Keys and values stored encoded (any [`super::KvFormat`] but f32): per
//! layer one byte buffer of keys and one of values, a row of
//! `num_kv_heads` encoded head vectors per position or slot.
//!
//! Rows are encoded relative to an *anchor*: per sequence and layer, its
//! key and value at position 0 (so the anchor never depends on how a
//! prompt was split into chunks, and the first position, often an attention
//! sink, is stored exactly as zero offsets). Models with biased
//! projections (Qwen2's keys) carry a large near-constant vector in every
//! key, which would otherwise set the quantization step of every
//! coordinate. Subtracting it is exact: a key offset shifts all of a
//! query's scores equally (softmax does not change), and a value offset is
//! added back once to the weighted sum (the weights sum to one).
//!
//! Keys are also divided per channel by scales from the spread of the
//! sequence's first [`SCALE_ROWS`] keys (the fourth root of each channel's
//! variance over the head's mean, so halfway between one step for all
//! channels and one per channel), and queries multiplied by them, which
//! leaves scores unchanged: a rotation spreads quantization error evenly
//! over channels, and this keeps less of it in channels whose keys vary
//! little. A sequence's anchor lives with its first block, so sequences
//! sharing a cached prefix share it.

use std::collections::HashMap;
use std::sync::Arc;

use half::f16;

use super::codecs::KvCodecs;
use crate::quant::turbo::codec::butterfly;

/// Rows whose spread sets a sequence's per-channel key scales.
const SCALE_ROWS: usize = 16;

/// An anchor's values per `kv_dim`: key offsets, value offsets, key scales.
const ANCHOR_VALUES: usize = 3;

/// One layer of encoded rows, as attention reads it.
pub struct CodedLayer<'a> {
    pub codecs: &'a KvCodecs,
    /// The codecs' (attention) layer these rows were encoded by.
    pub codec_layer: usize,
    pub keys: &'a [u8],
    pub values: &'a [u8],
    anchors: &'a HashMap<u32, Box<[f32]>>,
}

impl CodedLayer<'_> {
    /// The value offset of anchor `id`, which attention adds to its output
    /// (key offsets only shift scores, which softmax ignores).
    pub fn value_anchor(&self, id: u32) -> &[f32] {
        self.part(id, 1)
    }

    /// The key offset of anchor `id`.
    pub fn key_anchor(&self, id: u32) -> &[f32] {
        self.part(id, 0)
    }

    /// The per-channel key scales of anchor `id` (queries are multiplied by them).
    pub fn key_scales(&self, id: u32) -> &[f32] {
        self.part(id, 2)
    }

    fn part(&self, id: u32, i: usize) -> &[f32] {
        let d = self.codecs.shape.kv_dim();
        &self.anchor(id)[i * d..(i + 1) * d]
    }

    fn anchor(&self, id: u32) -> &[f32] {
        self.anchors.get(&id).expect("a sequence's first rows set its anchor")
    }
}

/// The sum of one head's values in the order the CUDA anchor kernel's
/// block reduction takes it (a warp's butterfly per 32 channels, then one
/// over the warps' sums), so both backends make the same key scales.
fn head_sum(x: &[f32]) -> f32 {
    if !x.len().is_multiple_of(32) || x.len() > 32 * 32 {
        return x.iter().sum();
    }
    let mut warps = [0f32; 32];
    for (w, chunk) in warps.iter_mut().zip(x.chunks_exact(32)) {
        *w = butterfly(chunk.try_into().expect("32 channels"));
    }
    butterfly(warps)
}

pub struct CodedRows {
    pub codecs: Arc<KvCodecs>,
    /// The codecs' layer of each of these rows' layers.
    codec_layers: Vec<usize>,
    keys: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
    /// Per layer, anchors by id (a sequence's first block; 0 for the one
    /// sequence of a growable cache): `kv_dim` key offsets, then value offsets.
    anchors: Vec<HashMap<u32, Box<[f32]>>>,
}

impl CodedRows {
    /// Rows for `slots` positions per layer (zeroed, so memory is committed
    /// as rows are written), or growable ones when `slots` is 0; layer `l`
    /// is encoded by the codecs of layer `codec_layers[l]`.
    pub fn new(codecs: Arc<KvCodecs>, codec_layers: Vec<usize>, slots: usize) -> Self {
        let (kb, vb) = (codecs.key_row_bytes(), codecs.value_row_bytes());
        CodedRows {
            keys: codec_layers.iter().map(|_| vec![0u8; slots * kb]).collect(),
            values: codec_layers.iter().map(|_| vec![0u8; slots * vb]).collect(),
            anchors: codec_layers.iter().map(|_| HashMap::new()).collect(),
            codec_layers,
            codecs,
        }
    }

    /// Sets anchor `id` of `layer` to the first rows of `k` and `v`
    /// (position 0's key and value).
    fn set_anchor(&mut self, layer: usize, id: u32, k: &[f32], v: &[f32]) {
        let d = self.codecs.shape.kv_dim();
        let hd = self.codecs.shape.head_dim;
        let n = (k.len() / d).min(SCALE_ROWS);
        let scales = |x: &[f32]| {
            let mut ms = vec![0f32; d];
            for row in x.chunks_exact(d).take(n) {
                for ((m, a), b) in ms.iter_mut().zip(row).zip(&x[..d]) {
                    *m += (a - b) * (a - b) / n as f32;
                }
            }
            let mut s = vec![1f32; d];
            for (sh, mh) in s.chunks_exact_mut(hd).zip(ms.chunks_exact(hd)) {
                let mean = head_sum(mh) / hd as f32;
                if n > 1 && mean > 0.0 {
                    for (si, mi) in sh.iter_mut().zip(mh) {
                        *si = ((mi.max(mean * 1e-2)) / mean).powf(0.25);
                    }
                }
            }
            s
        };
        // Stored in f16 (as the CUDA pool stores them); each is used as
        // stored, so the rounding changes nothing that softmax or the
        // added-back offset would not undo.
        let a: Vec<f32> = [&k[..d], &v[..d], &scales(k)]
            .concat()
            .iter()
            .map(|&x| f16::from_f32(x.clamp(-65504.0, 65504.0)).to_f32())
            .collect();
        self.anchors[layer].insert(id, a.into());
    }

    /// Anchor `id` of `layer` (`[keys | values]`, `kv_dim` each), if set.
    pub fn anchor(&self, layer: usize, id: u32) -> Option<&[f32]> {
        self.anchors[layer].get(&id).map(|a| &a[..])
    }

    /// Rows of `k` and `v` relative to anchor `id`: minus its offsets, over its scales.
    fn relative(&self, layer: usize, id: u32, k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let d = self.codecs.shape.kv_dim();
        let a = self.anchor(layer, id).expect("a sequence's first rows set its anchor");
        let keys =
            k.chunks_exact(d).flat_map(|r| r.iter().zip(&a[..d]).zip(&a[2 * d..]).map(|((x, o), s)| (x - o) / s));
        let values = v.chunks_exact(d).flat_map(|r| r.iter().zip(&a[d..2 * d]).map(|(x, o)| x - o));
        (keys.collect(), values.collect())
    }

    /// Encodes rows of `k` and `v` (`[n, kv_dim]`) as positions `[at, at+n)`
    /// of `layer` (the cache's one sequence, anchor 0), dropping any rows
    /// after them.
    pub fn append(&mut self, layer: usize, at: usize, k: &[f32], v: &[f32]) {
        let n = k.len() / self.codecs.shape.kv_dim();
        if at == 0 {
            self.set_anchor(layer, 0, k, v);
        }
        let (k, v) = self.relative(layer, 0, k, v);
        for (keys, buf, src) in [(true, &mut self.keys[layer], &k), (false, &mut self.values[layer], &v)] {
            let row = if keys { self.codecs.key_row_bytes() } else { self.codecs.value_row_bytes() };
            buf.resize(at * row, 0);
            buf.resize((at + n) * row, 0);
            self.codecs.encode_rows(self.codec_layers[layer], keys, src, &mut buf[at * row..]);
        }
    }

    /// Encodes row `i` of `k` and `v` (rows of one sequence, the first at
    /// position `start`) into slot `slots[i]` of `layer`, relative to anchor
    /// `anchor` (set from these rows when `start` is 0).
    pub fn write_slots(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32], start: usize, anchor: u32) {
        if start == 0 {
            self.set_anchor(layer, anchor, k, v);
        }
        let (k, v) = self.relative(layer, anchor, k, v);
        let (k, v) = (&k[..], &v[..]);
        let d = self.codecs.shape.kv_dim();
        assert_eq!(k.len(), slots.len() * d, "one key row per slot");
        let (kb, vb) = (self.codecs.key_row_bytes(), self.codecs.value_row_bytes());
        for (i, &s) in slots.iter().enumerate() {
            let s = s as usize;
            assert!((s + 1) * kb <= self.keys[layer].len(), "slot {s} is past the pool");
            let c = self.codec_layers[layer];
            self.codecs.encode_rows(c, true, &k[i * d..(i + 1) * d], &mut self.keys[layer][s * kb..(s + 1) * kb]);
            self.codecs.encode_rows(c, false, &v[i * d..(i + 1) * d], &mut self.values[layer][s * vb..(s + 1) * vb]);
        }
    }

    /// Everything attention reads of `layer`.
    pub fn layer(&self, layer: usize) -> CodedLayer<'_> {
        CodedLayer {
            codecs: &self.codecs,
            codec_layer: self.codec_layers[layer],
            keys: &self.keys[layer],
            values: &self.values[layer],
            anchors: &self.anchors[layer],
        }
    }

    /// Bytes of `block_size` slots over every layer, with the anchor the
    /// block may carry (zeros if none).
    pub fn block_bytes(&self, block_size: usize) -> usize {
        let anchor = ANCHOR_VALUES * self.codecs.shape.kv_dim() * 4;
        self.keys.len() * (block_size * (self.codecs.key_row_bytes() + self.codecs.value_row_bytes()) + anchor)
    }

    /// Every layer's keys and values of slots `[block·block_size, +block_size)`.
    pub fn read_block(&self, block: u32, block_size: usize) -> Vec<u8> {
        let (kb, vb) = (block_size * self.codecs.key_row_bytes(), block_size * self.codecs.value_row_bytes());
        let mut out = Vec::with_capacity(self.block_bytes(block_size));
        let zeros = vec![0f32; ANCHOR_VALUES * self.codecs.shape.kv_dim()];
        for (l, (k, v)) in self.keys.iter().zip(&self.values).enumerate() {
            out.extend_from_slice(&k[block as usize * kb..(block as usize + 1) * kb]);
            out.extend_from_slice(&v[block as usize * vb..(block as usize + 1) * vb]);
            out.extend_from_slice(bytemuck::cast_slice(self.anchor(l, block).unwrap_or(&zeros)));
        }
        out
    }

    /// Writes what [`CodedRows::read_block`] returned back into `block`.
    pub fn write_block(&mut self, block: u32, block_size: usize, data: &[u8]) {
        let (kb, vb) = (block_size * self.codecs.key_row_bytes(), block_size * self.codecs.value_row_bytes());
        let b = block as usize;
        let ab = ANCHOR_VALUES * self.codecs.shape.kv_dim() * 4;
        for (l, (k, v)) in self.keys.iter_mut().zip(self.values.iter_mut()).enumerate() {
            let at = l * (kb + vb + ab);
            k[b * kb..(b + 1) * kb].copy_from_slice(&data[at..at + kb]);
            v[b * vb..(b + 1) * vb].copy_from_slice(&data[at + kb..at + kb + vb]);
            let anchor: Vec<f32> = data[at + kb + vb..at + kb + vb + ab]
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            self.anchors[l].insert(block, anchor.into());
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(Vec::len).sum()
    }
}
