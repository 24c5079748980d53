//! FP8 weights: E4M3 ("fn": no infinities, max ±448) values, one byte each,
//! times a float scale shared by a block of the matrix.
//!
//! Checkpoints scale blocks of `bm × bn` values (Qwen's FP8 editions: 128×128,
//! `weight_scale_inv`), whole rows (compressed-tensors' channel strategy) or
//! the whole matrix (its tensor strategy). Every layout is held here the same
//! way: each row's runs of `group` columns share one f32 scale, the block
//! scales repeated for the rows of their block. That costs 4 bytes per
//! `group` values (3% at 128) and lets a matrix be split or stacked by rows
//! anywhere (fused gate|up experts whose halves end inside a block).
//!
//! The dequantized value is `f32(q) · scale` in f32, as transformers'
//! `Fp8Dequantize` and vLLM's block-scaled kernels compute it.

use crate::tensor::{Bytes, DType, Tensor};
use crate::{Error, Result};

pub use super::e4m3::{E4M3_MAX, E4M3_TABLE, e4m3_to_f32, f32_to_e4m3};

/// How a checkpoint scales its FP8 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale per `rows × cols` block (edge blocks partial): a 2-D scale
    /// tensor `[⌈out/rows⌉, ⌈in/cols⌉]` per matrix.
    Block { rows: usize, cols: usize },
    /// One scale per output row: `[out, 1]` or `[out]`.
    Channel,
    /// One scale for the matrix: `[]` or `[1]`.
    Tensor,
}

/// An FP8 weight as computed with: `weight` holds the E4M3 bytes
/// `[…, rows, cols]`; `scales` (f32) `[…, rows, ⌈cols/group⌉]`, the scale of
/// each row's run of `group` columns.
#[derive(Debug, Clone)]
pub struct Fp8Tensor {
    pub name: String,
    pub weight: Tensor,
    pub scales: Tensor,
    pub group: usize,
}

impl Fp8Tensor {
    /// The stored weight and its stored scale tensor (`scale_name` names it in
    /// errors), laid out as `scaling` says; `[E, rows, cols]` stacks of
    /// experts carry a leading `E` on both.
    pub fn from_stored(weight: Tensor, scale: Tensor, scaling: Fp8Scaling) -> Result<Self> {
        let name = weight.name.clone();
        if weight.dtype != DType::F8_E4M3 {
            return Err(Error::tensor(&name, format!("expected F8_E4M3, found {}", weight.dtype.name())));
        }
        match scale.dtype {
            DType::F32 | DType::F16 | DType::BF16 => {}
            other => {
                return Err(Error::tensor(&scale.name, format!("expected F32, F16 or BF16, found {}", other.name())));
            }
        }
        let Some((&cols, outer)) = weight.shape.split_last() else {
            return Err(Error::tensor(&name, "an FP8 weight needs at least one dimension"));
        };
        let Some((&rows, lead)) = outer.split_last() else {
            return Err(Error::tensor(&name, format!("expected a matrix, found shape {:?}", weight.shape)));
        };
        let mats: usize = lead.iter().product();
        let stored = scale.to_f32_vec();
        let bad_shape = |want: String| {
            Error::tensor(
                &scale.name,
                format!(
                    "shape {:?} does not fit {} scaling of {:?}: expected {want}",
                    scale.shape,
                    scaling_name(scaling),
                    weight.shape
                ),
            )
        };
        let (group, sr, sc) = match scaling {
            Fp8Scaling::Block { rows: bm, cols: bn } => {
                if bm == 0 || bn == 0 {
                    return Err(Error::tensor(&name, "weight_block_size must be positive"));
                }
                let (sr, sc) = (rows.div_ceil(bm), cols.div_ceil(bn));
                let mut want = lead.to_vec();
                want.extend([sr, sc]);
                if scale.shape != want {
                    return Err(bad_shape(format!("{want:?}")));
                }
                (bn, sr, sc)
            }
            Fp8Scaling::Channel => {
                let ok = scale.shape == [lead, &[rows, 1]].concat() || scale.shape == [lead, &[rows]].concat();
                if !ok {
                    return Err(bad_shape(format!("{:?}", [lead, &[rows, 1]].concat())));
                }
                (cols, 0, 0)
            }
            Fp8Scaling::Tensor => {
                let ok = stored.len() == mats
                    && (scale.shape.is_empty() || scale.shape.iter().skip(lead.len()).all(|&d| d == 1));
                if !ok {
                    return Err(bad_shape(format!("{:?} or {:?}", lead, [lead, &[1]].concat())));
                }
                (cols, 0, 0)
            }
        };
        // The scale of matrix m's row r, column group g.
        let per_row = |m: usize, r: usize, g: usize| match scaling {
            Fp8Scaling::Block { rows: bm, .. } => stored[(m * sr + r / bm) * sc + g],
            Fp8Scaling::Channel => stored[m * rows + r],
            Fp8Scaling::Tensor => stored[m],
        };
        let groups = cols.div_ceil(group.max(1));
        let mut expanded = Vec::with_capacity(mats * rows * groups * 4);
        for m in 0..mats {
            for r in 0..rows {
                for g in 0..groups {
                    expanded.extend_from_slice(&per_row(m, r, g).to_le_bytes());
                }
            }
        }
        let mut shape = outer.to_vec();
        shape.push(groups);
        let scales = Tensor::new(format!("{name}(scales)"), DType::F32, shape, Bytes::from_vec(expanded))?;
        Ok(Fp8Tensor { name, weight, scales, group })
    }

    /// The logical shape `[…, rows, cols]`.
    pub fn shape(&self) -> &[usize] {
        &self.weight.shape
    }

    /// Entries `[start, start + len)` along the outermost dimension (no copy
    /// of the values): one expert of a stack, or a run of a matrix's rows.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(Fp8Tensor {
            name: self.name.clone(),
            weight: self.weight.narrow(start, len)?,
            scales: self.scales.narrow(start, len)?,
            group: self.group,
        })
    }

    /// Drops a leading dimension of 1 (`[1, rows, cols]` → `[rows, cols]`).
    pub fn squeeze_outer(&self) -> Result<Self> {
        if self.weight.shape.first() != Some(&1) || self.weight.shape.len() < 2 {
            return Err(Error::tensor(&self.name, format!("cannot squeeze shape {:?}", self.weight.shape)));
        }
        Ok(Fp8Tensor {
            name: self.name.clone(),
            weight: self.weight.reshape(self.weight.shape[1..].to_vec())?,
            scales: self.scales.reshape(self.scales.shape[1..].to_vec())?,
            group: self.group,
        })
    }

    /// Matrices of one row length and group stacked by rows into `name`;
    /// None when they differ.
    pub fn concat_rows(name: &str, parts: &[&Fp8Tensor]) -> Result<Option<Fp8Tensor>> {
        let Some(first) = parts.first() else { return Ok(None) };
        if parts.iter().any(|p| p.group != first.group) {
            return Ok(None);
        }
        let w: Vec<&Tensor> = parts.iter().map(|p| &p.weight).collect();
        let s: Vec<&Tensor> = parts.iter().map(|p| &p.scales).collect();
        let (Some(weight), Some(scales)) =
            (Tensor::concat_rows(name, &w)?, Tensor::concat_rows(&format!("{name}(scales)"), &s)?)
        else {
            return Ok(None);
        };
        Ok(Some(Fp8Tensor { name: name.to_string(), weight, scales, group: first.group }))
    }

    /// Every value dequantized, row-major (tests, small matrices).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let cols = *self.weight.shape.last().unwrap_or(&0);
        let groups = cols.div_ceil(self.group.max(1));
        let scales = self.scales.to_f32_vec();
        let q = self.weight.data.as_slice();
        let mut out = Vec::with_capacity(q.len());
        for (r, row) in q.chunks_exact(cols.max(1)).enumerate() {
            let s = &scales[r * groups..(r + 1) * groups];
            out.extend(row.iter().enumerate().map(|(c, &b)| e4m3_to_f32(b) * s[c / self.group]));
        }
        out
    }
}

fn scaling_name(s: Fp8Scaling) -> String {
    match s {
        Fp8Scaling::Block { rows, cols } => format!("{rows}×{cols} block"),
        Fp8Scaling::Channel => "per-channel".into(),
        Fp8Scaling::Tensor => "per-tensor".into(),
    }
}

/// Qwen's block-FP8 recipe for one `[rows, cols]` matrix (transformers'
/// `Fp8Quantize`, extended to partial edge blocks): per block, the scale is
/// `448 / max|w|` (1 for an all-zero block), values are `clamp(w · scale,
/// ±448)` rounded to E4M3, and the stored `weight_scale_inv` is `1 / scale`.
/// Returns the E4M3 bytes and the `[⌈rows/bm⌉, ⌈cols/bn⌉]` inverse scales.
pub fn quantize_blocks(w: &[f32], rows: usize, cols: usize, bm: usize, bn: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), rows * cols);
    let (sr, sc) = (rows.div_ceil(bm), cols.div_ceil(bn));
    let mut q = vec![0u8; rows * cols];
    let mut inv = vec![0f32; sr * sc];
    for bi in 0..sr {
        for bj in 0..sc {
            let (r0, r1) = (bi * bm, ((bi + 1) * bm).min(rows));
            let (c0, c1) = (bj * bn, ((bj + 1) * bn).min(cols));
            let mut amax = 0f32;
            for r in r0..r1 {
                for &v in &w[r * cols + c0..r * cols + c1] {
                    amax = amax.max(v.abs());
                }
            }
            // torch evaluates `448 / amax` as `amax.reciprocal() * 448`: two
            // roundings, which the scale (and ties of the values) must follow.
            let scale = if amax > 0.0 { (1.0 / amax) * E4M3_MAX } else { 1.0 };
            for r in r0..r1 {
                for c in c0..c1 {
                    q[r * cols + c] = f32_to_e4m3((w[r * cols + c] * scale).clamp(-E4M3_MAX, E4M3_MAX));
                }
            }
            inv[bi * sc + bj] = 1.0 / scale;
        }
    }
    (q, inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Tensor {
        Tensor::new(name.into(), dtype, shape, Bytes::from_vec(bytes)).unwrap()
    }

    fn f32_tensor(name: &str, shape: Vec<usize>, v: &[f32]) -> Tensor {
        Tensor::from_f32(name, shape, v).unwrap()
    }

    #[test]
    fn block_scales_expand_to_rows_with_partial_edges() {
        // 5 × 7 matrix in 2 × 3 blocks: scale grid 3 × 3, edges partial.
        let (rows, cols) = (5, 7);
        let w = tensor("w", DType::F8_E4M3, vec![rows, cols], vec![0x38; rows * cols]); // all 1.0
        let grid: Vec<f32> = (0..9).map(|i| (i + 1) as f32).collect();
        let s = f32_tensor("s", vec![3, 3], &grid);
        let t = Fp8Tensor::from_stored(w, s, Fp8Scaling::Block { rows: 2, cols: 3 }).unwrap();
        let v = t.to_f32_vec();
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(v[r * cols + c], grid[(r / 2) * 3 + c / 3], "({r}, {c})");
            }
        }
        // Rows 1..4 cross a block boundary and keep their scales.
        let part = t.narrow(1, 3).unwrap().to_f32_vec();
        assert_eq!(part, v[cols..4 * cols]);
        let bad = Fp8Tensor::from_stored(
            tensor("w", DType::F8_E4M3, vec![rows, cols], vec![0; rows * cols]),
            f32_tensor("w_scale_inv", vec![2, 3], &[1.0; 6]),
            Fp8Scaling::Block { rows: 2, cols: 3 },
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("w_scale_inv") && bad.contains("[3, 3]"), "{bad}");
    }

    #[test]
    fn channel_and_tensor_scales() {
        let w = tensor("w", DType::F8_E4M3, vec![2, 3], vec![0x38, 0x40, 0xB8, 0x38, 0x38, 0x38]);
        let c =
            Fp8Tensor::from_stored(w.clone(), f32_tensor("s", vec![2, 1], &[0.5, 3.0]), Fp8Scaling::Channel).unwrap();
        assert_eq!(c.to_f32_vec(), [0.5, 1.0, -0.5, 3.0, 3.0, 3.0]);
        let t = Fp8Tensor::from_stored(w.clone(), f32_tensor("s", vec![], &[2.0]), Fp8Scaling::Tensor).unwrap();
        assert_eq!(t.to_f32_vec(), [2.0, 4.0, -2.0, 2.0, 2.0, 2.0]);
        assert!(Fp8Tensor::from_stored(w, f32_tensor("s", vec![3], &[1.0; 3]), Fp8Scaling::Channel).is_err());
    }

    #[test]
    fn stacked_experts_narrow_to_their_own_scales() {
        // 2 experts of 4 × 4 in 2 × 4 blocks.
        let w = tensor("e", DType::F8_E4M3, vec![2, 4, 4], vec![0x38; 32]);
        let s = f32_tensor("s", vec![2, 2, 1], &[1.0, 2.0, 3.0, 4.0]);
        let t = Fp8Tensor::from_stored(w, s, Fp8Scaling::Block { rows: 2, cols: 4 }).unwrap();
        let e1 = t.narrow(1, 1).unwrap().squeeze_outer().unwrap();
        assert_eq!(e1.shape(), [4, 4]);
        assert_eq!(e1.to_f32_vec(), [[3.0; 8], [4.0; 8]].concat());
    }

    #[test]
    fn quantize_blocks_follows_the_recipe() {
        // A block whose max maps to 448 exactly, an all-zero block, a partial edge.
        let (rows, cols) = (2, 3);
        let w = [1.0, -0.5, 0.0, 2.0, 0.25, 0.0];
        let (q, inv) = quantize_blocks(&w, rows, cols, 2, 2);
        assert_eq!(inv, [2.0 / 448.0, 1.0]);
        assert_eq!(e4m3_to_f32(q[3]), 448.0);
        assert_eq!(e4m3_to_f32(q[0]), 224.0);
        assert_eq!(q[2], 0);
        let back: Vec<f32> = q.iter().enumerate().map(|(i, &b)| e4m3_to_f32(b) * inv[(i % cols) / 2]).collect();
        for (a, b) in back.iter().zip(w) {
            assert!((a - b).abs() <= b.abs() / 16.0, "{a} vs {b}");
        }
    }
}
