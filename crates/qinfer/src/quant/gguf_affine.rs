//! ggml block types as affine weights (`w = scale·q + bias` per group of
//! values, q unsigned), for a backend that computes with affine weights but
//! has no kernels for ggml's blocks (CUDA).
//!
//! Why this is exact: in every type a value is `d·(q − k)`, `d·q + m`,
//! `d·sc·q − dmin·mn` or `d·sc·(q − k)` with f16 `d`, `m`, `dmin` and small
//! integers `q`, `sc`, `mn`, `k`. So the scale (`d`, or `d·sc`) and the bias
//! (`−k·d`, `m`, `−dmin·mn` or `−k·d·sc`) are exact in f32, and `scale·q +
//! bias` rounds at most once, as ggml's decoder does: decoded values equal
//! ggml's bit for bit (checked against gguf-py's decoder in
//! `tests/gguf_as_affine.rs`). Scales and biases stay f32 (an f16 `d` is not
//! a bf16 in general), so a 4-bit weight takes 6 bits a value instead of 4.5.
//!
//! Groups are 32 values where the type's scales cover 32 (Q4_0 … Q8_0, Q4_K,
//! Q5_K) and 16 where they cover 16 (Q2_K, Q3_K, Q6_K: 8 bits of scale and
//! bias a value on top of the levels, against 32 for the f32 they decoded to
//! before).

use rayon::prelude::*;

use super::affine::{self, AffineParams, AffineParts, AffineTensor};
use super::kquants::f16_at;
use crate::quant::kquants::{self, QK_K};
use crate::tensor::{Bytes, DType, Tensor};
use crate::{Error, Result};

/// One group of a row: its levels (`group_size` values) and the affine scale
/// and bias.
struct Group {
    q: [u8; 32],
    scale: f32,
    bias: f32,
}

/// Bits of the affine levels a ggml type becomes, None for the float types.
pub fn affine_bits(dtype: DType) -> Option<u32> {
    match dtype {
        DType::Q2_K => Some(2),
        DType::Q3_K => Some(3),
        DType::Q4_0 | DType::Q4_1 | DType::Q4_K => Some(4),
        DType::Q5_0 | DType::Q5_1 | DType::Q5_K => Some(5),
        DType::Q6_K => Some(6),
        DType::Q8_0 => Some(8),
        DType::F32 | DType::F16 | DType::BF16 | DType::U32 | DType::F8_E4M3 => None,
    }
}

/// Values per affine group of a ggml type's affine form: what one of its
/// scales covers.
pub fn affine_group_size(dtype: DType) -> usize {
    match dtype {
        DType::Q2_K | DType::Q3_K | DType::Q6_K => 16,
        _ => 32,
    }
}

/// The groups of one block of `dtype` (one for the 32-value types, eight for
/// Q4_K and Q5_K, sixteen of 16 values for Q2_K, Q3_K and Q6_K).
fn block_groups(dtype: DType, b: &[u8], out: &mut Vec<Group>) {
    let nibbles = |qs: &[u8], q: &mut [u8; 32]| {
        for j in 0..16 {
            q[j] = qs[j] & 0x0f;
            q[j + 16] = qs[j] >> 4;
        }
    };
    let mut q = [0u8; 32];
    match dtype {
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            nibbles(&b[2..18], &mut q);
            out.push(Group { q, scale: d, bias: -8.0 * d });
        }
        DType::Q4_1 => {
            nibbles(&b[4..20], &mut q);
            out.push(Group { q, scale: f16_at(b, 0), bias: f16_at(b, 2) });
        }
        DType::Q5_0 | DType::Q5_1 => {
            let (qh_at, qs_at) = if dtype == DType::Q5_1 { (4, 8) } else { (2, 6) };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            nibbles(&b[qs_at..qs_at + 16], &mut q);
            for (j, v) in q.iter_mut().enumerate() {
                *v |= (((qh >> j) & 1) as u8) << 4;
            }
            let d = f16_at(b, 0);
            let bias = if dtype == DType::Q5_1 { f16_at(b, 2) } else { -16.0 * d };
            out.push(Group { q, scale: d, bias });
        }
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for (v, &s) in q.iter_mut().zip(&b[2..34]) {
                *v = (s as i8 as i16 + 128) as u8;
            }
            out.push(Group { q, scale: d, bias: -128.0 * d });
        }
        DType::Q4_K | DType::Q5_K => {
            let u = kquants::unpack(dtype, b);
            for g in 0..QK_K / 32 {
                for (v, &x) in q.iter_mut().zip(&u.q[32 * g..32 * (g + 1)]) {
                    *v = x as u8;
                }
                // Both 16-value halves of a group share its scale and min.
                let scale = u.d * u.scales[2 * g] as f32;
                let bias = -(u.dmin * u.mins[2 * g] as f32);
                out.push(Group { q, scale, bias });
            }
        }
        DType::Q2_K | DType::Q3_K | DType::Q6_K => {
            // Value i is d·sc·q − dmin·mn (Q2_K, q ≥ 0) or d·sc·q with q
            // signed (Q3_K from −4, Q6_K from −32): levels q + k, bias −k·d·sc.
            let u = kquants::unpack(dtype, b);
            let k = match dtype {
                DType::Q3_K => 4,
                DType::Q6_K => 32,
                _ => 0,
            };
            for g in 0..QK_K / 16 {
                for (v, &x) in q.iter_mut().zip(&u.q[16 * g..16 * (g + 1)]) {
                    *v = (x as i32 + k) as u8;
                }
                let scale = u.d * u.scales[g] as f32;
                let bias = if dtype == DType::Q2_K { -(u.dmin * u.mins[g] as f32) } else { -(k as f32) * scale };
                out.push(Group { q, scale, bias });
            }
        }
        DType::F32 | DType::F16 | DType::BF16 | DType::U32 | DType::F8_E4M3 => {
            unreachable!("{} has no affine form", dtype.name())
        }
    }
}

/// Bytes of one Q4_K/Q5_K super-block record ([`superblock_records`]).
pub const SUPERBLOCK_RECORD: usize = 16;

/// Bytes of one Q3_K or Q6_K super-block record ([`superblock_records`]):
/// as many as a Q6_K file spends on its scales.
pub const SUPERBLOCK_RECORD_Q6K: usize = 18;

/// Bytes of one Q2_K super-block record ([`superblock_records`]): as many as
/// the file spends on its scales.
pub const SUPERBLOCK_RECORD_Q2K: usize = 20;

/// Bytes of the super-block record of the K-quant whose affine form has
/// `bits`-bit levels (each width is one type's): 20 for Q2_K, 18 for Q3_K
/// and Q6_K, 16 for Q4_K and Q5_K; None where no type has records.
pub fn superblock_record_bytes(bits: u32) -> Option<usize> {
    match bits {
        2 => Some(SUPERBLOCK_RECORD_Q2K),
        3 | 6 => Some(SUPERBLOCK_RECORD_Q6K),
        4 | 5 => Some(SUPERBLOCK_RECORD),
        _ => None,
    }
}

/// The scales and biases of a K-quant matrix `t` (Q2_K … Q6_K) as one
/// record per 256 values of a row (rows in order), for a GPU copy that reads
/// as many bits a value as the file where f32 scales and biases would take
/// 2 (groups of 32) or 4 (groups of 16) more:
/// - Q4_K, Q5_K (16 bytes): f16 `d` and `dmin` as stored, then per group j
///   of 32 the byte `sc_j | (m_j >> 4) << 6` (8 bytes) and `m_j & 15` as
///   nibbles, group 2i's low (4 bytes). Group j's scale is `d·sc_j`, its
///   bias `−(dmin·m_j)`.
/// - Q6_K, Q3_K (18 bytes): f16 `d`, then the sixteen signed scales of its
///   groups of 16 (Q3_K's unpacked from 6 bits, −32..31). Group j's scale
///   is `d·sc_j`, its bias `−k·d·sc_j` (k = 32 for Q6_K, 4 for Q3_K).
/// - Q2_K (20 bytes): f16 `d` and `dmin`, then the sixteen bytes `sc_j |
///   m_j << 4` as stored. Group j's scale is `d·sc_j`, its bias
///   `−(dmin·m_j)`.
///
/// Scales and biases in f32 are exactly [`as_affine`]'s. None for the other
/// types.
pub fn superblock_records(t: &Tensor) -> Option<Result<Vec<u8>>> {
    if !matches!(t.dtype, DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K) {
        return None;
    }
    let record = superblock_record_bytes(affine_bits(t.dtype)?)?;
    let bb = t.dtype.block_bytes();
    let src = t.data.as_slice();
    if !src.len().is_multiple_of(bb) || t.dtype.bytes_for(t.shape.iter().product()) != Some(src.len()) {
        return Some(Err(Error::tensor(
            &t.name,
            format!("{} bytes are not whole {} blocks", src.len(), t.dtype.name()),
        )));
    }
    let mut out = vec![0u8; src.len() / bb * record];
    let dtype = t.dtype;
    out.par_chunks_exact_mut(record).zip(src.par_chunks_exact(bb)).for_each(|(r, b)| match dtype {
        DType::Q6_K => {
            // ql (128 bytes), qh (64), scales (16), d (2).
            r[..2].copy_from_slice(&b[208..210]);
            r[2..].copy_from_slice(&b[192..208]);
        }
        DType::Q3_K => {
            // hmask (32 bytes), qs (64), scales (12, 6 bits each), d (2).
            r[..2].copy_from_slice(&b[108..110]);
            for (o, sc) in r[2..].iter_mut().zip(kquants::q3_k_scales(&b[96..108])) {
                *o = sc as i8 as u8;
            }
        }
        DType::Q2_K => {
            // scales (16 bytes), qs (64), d (2), dmin (2).
            r[..4].copy_from_slice(&b[80..84]);
            r[4..].copy_from_slice(&b[..16]);
        }
        _ => {
            r[..4].copy_from_slice(&b[..4]);
            for j in 0..8 {
                let (sc, m) = kquants::scale_min_k4(j, &b[4..16]);
                r[4 + j] = sc | ((m >> 4) << 6);
                r[12 + j / 2] |= (m & 15) << (4 * (j % 2));
            }
        }
    });
    Some(Ok(out))
}

/// Group `j`'s (scale, bias) of a record of [`superblock_records`] of a
/// `dtype` matrix, as the GPU kernels decode it (groups of 32 for Q4_K and
/// Q5_K, of 16 for the others).
pub fn record_scale_bias(dtype: DType, r: &[u8], j: usize) -> (f32, f32) {
    match dtype {
        DType::Q6_K | DType::Q3_K => {
            let scale = f16_at(r, 0) * r[2 + j] as i8 as f32;
            let k = if dtype == DType::Q6_K { 32.0 } else { 4.0 };
            (scale, -k * scale)
        }
        DType::Q2_K => (f16_at(r, 0) * (r[4 + j] & 15) as f32, -(f16_at(r, 2) * (r[4 + j] >> 4) as f32)),
        _ => {
            let (d, dmin) = (f16_at(r, 0), f16_at(r, 2));
            let sc = r[4 + j] & 63;
            let m = ((r[4 + j] >> 6) << 4) | ((r[12 + j / 2] >> (4 * (j % 2))) & 15);
            (d * sc as f32, -(dmin * m as f32))
        }
    }
}

/// `t` (a matrix of a ggml block type) as an affine weight with groups of
/// [`affine_group_size`]; None for the float types.
pub fn as_affine(t: &Tensor) -> Option<Result<AffineTensor>> {
    let bits = affine_bits(t.dtype)?;
    Some(convert(t, bits, true).and_then(|c| {
        let (rows, cols, groups) = (c.rows, c.cols, c.cols / c.params.group_size);
        let (scales, biases) = c.sides.expect("asked for");
        let tensor = |suffix: &str, dtype, cols, data: Vec<u8>| {
            Tensor::new(format!("{}{suffix}", t.name), dtype, vec![rows, cols], Bytes::from_vec(data))
        };
        let parts = AffineParts {
            packed: tensor("", DType::U32, cols * bits as usize / 32, c.packed)?,
            scales: tensor(".scales", DType::F32, groups, scales)?,
            biases: tensor(".biases", DType::F32, groups, biases)?,
            declared: Some(c.params),
        };
        AffineTensor::new(parts, cols)
    }))
}

/// The levels alone of [`as_affine`]'s form of a K-quant matrix, for a
/// copy whose scales and biases are [`superblock_records`]: skips building
/// f32 scales and biases (as many bytes as the file again for Q6_K) that
/// would be thrown away.
pub struct AffineLevels {
    pub params: AffineParams,
    pub rows: usize,
    pub cols: usize,
    /// Rows of `cols · bits / 8` bytes, packed as [`crate::quant::affine::pack`] does.
    pub packed: Vec<u8>,
}

/// [`AffineLevels`] of `t`; None for the types without an affine form.
pub fn affine_levels(t: &Tensor) -> Option<Result<AffineLevels>> {
    let bits = affine_bits(t.dtype)?;
    Some(convert(t, bits, false).map(|c| AffineLevels {
        params: c.params,
        rows: c.rows,
        cols: c.cols,
        packed: c.packed,
    }))
}

struct Converted {
    params: AffineParams,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    /// f32 scales and biases, little-endian, `rows × groups` each.
    sides: Option<(Vec<u8>, Vec<u8>)>,
}

fn convert(t: &Tensor, bits: u32, with_sides: bool) -> Result<Converted> {
    let &[rows, cols] = t.shape.as_slice() else {
        return Err(Error::tensor(&t.name, format!("expected a 2-D matrix, found shape {:?}", t.shape)));
    };
    if rows == 0 || cols == 0 {
        return Err(Error::tensor(&t.name, format!("an empty matrix, shape {:?}", t.shape)));
    }
    let group = affine_group_size(t.dtype);
    let params = AffineParams::new(bits, group, &t.name)?;
    let (block_bytes, groups) = (t.dtype.block_bytes(), cols / group);
    let row_bytes = t.dtype.bytes_for(cols).ok_or_else(|| Error::tensor(&t.name, "rows are not whole blocks"))?;
    let src = t.data.as_slice();
    if src.len() != rows * row_bytes {
        return Err(Error::tensor(&t.name, format!("{} bytes for {rows} rows of {row_bytes}", src.len())));
    }
    let packed_row = params.row_bytes(cols);
    let mut packed = vec![0u8; rows * packed_row];
    // Rows in parallel: a model's matrices hold billions of values.
    let pack_row = |row: &[u8], packed: &mut [u8]| {
        let mut row_groups = Vec::with_capacity(groups);
        for b in row.chunks_exact(block_bytes) {
            block_groups(t.dtype, b, &mut row_groups);
        }
        let mut levels = Vec::with_capacity(cols);
        for g in &row_groups {
            levels.extend_from_slice(&g.q[..group]);
        }
        let mut out = Vec::with_capacity(packed_row);
        affine::pack(bits, &levels, &mut out);
        packed.copy_from_slice(&out);
        row_groups
    };
    if !with_sides {
        packed.par_chunks_mut(packed_row).zip(src.par_chunks_exact(row_bytes)).for_each(|(packed, row)| {
            pack_row(row, packed);
        });
        return Ok(Converted { params, rows, cols, packed, sides: None });
    }
    let (mut scales, mut biases) = (vec![0u8; rows * groups * 4], vec![0u8; rows * groups * 4]);
    packed
        .par_chunks_mut(packed_row)
        .zip(scales.par_chunks_mut(groups * 4))
        .zip(biases.par_chunks_mut(groups * 4))
        .zip(src.par_chunks_exact(row_bytes))
        .for_each(|(((packed, scales), biases), row)| {
            for (i, g) in pack_row(row, packed).iter().enumerate() {
                scales[4 * i..4 * i + 4].copy_from_slice(&g.scale.to_le_bytes());
                biases[4 * i..4 * i + 4].copy_from_slice(&g.bias.to_le_bytes());
            }
        });
    Ok(Converted { params, rows, cols, packed, sides: Some((scales, biases)) })
}
