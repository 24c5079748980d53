//! The storage types of stored tensors: plain floats, MLX's packed words and
//! ggml's block types.

/// The storage types a weight may have. Block-quantized types hold blocks of
/// `block_len()` values along the innermost (row) dimension.
/// Variants are spelled as ggml spells its types.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// ggml Q4_0: f16 scale `d`, 32 4-bit values, w = d·(q − 8).
    Q4_0,
    /// ggml Q4_1: f16 scale `d`, f16 min `m`, 32 4-bit values, w = d·q + m.
    Q4_1,
    /// ggml Q5_0: f16 scale `d`, 32 5-bit values (high bits in a u32), w = d·(q − 16).
    Q5_0,
    /// ggml Q5_1: f16 scale `d`, f16 min `m`, 32 5-bit values, w = d·q + m.
    Q5_1,
    /// ggml Q8_0: f16 scale `d`, 32 signed 8-bit values, w = d·q.
    Q8_0,
    /// Packed integer words: the `.weight` of an MLX affine-quantized matrix
    /// (see [`crate::quant::affine`]); meaningless without its scales and biases.
    U32,
    /// ggml Q2_K: 256 values in 16 groups of 16, 4-bit scale and min per group,
    /// f16 super-scales `d`, `dmin`; w = d·sc·q − dmin·m with 2-bit q.
    Q2_K,
    /// ggml Q3_K: 256 values, 16 groups with 6-bit signed scales, f16 `d`,
    /// 3-bit q (low 2 bits packed, high bit in a mask); w = d·(sc − 32)·(q − 4).
    Q3_K,
    /// ggml Q4_K: 256 values in 8 groups of 32, 6-bit scale and min per group,
    /// f16 `d`, `dmin`; w = d·sc·q − dmin·m with 4-bit q.
    Q4_K,
    /// ggml Q5_K: Q4_K's scales with 5-bit q (high bits in `qh`).
    Q5_K,
    /// ggml Q6_K: 256 values in 16 groups of 16, signed 8-bit scales, f16 `d`;
    /// w = d·sc·(q − 32) with 6-bit q.
    Q6_K,
    /// FP8 E4M3 ("fn": no infinities, one NaN pattern, max 448), one byte per
    /// value: the `.weight` of an FP8 checkpoint's matrix, meaningless without
    /// its scales (see [`crate::quant::fp8`]).
    F8_E4M3,
}

impl DType {
    /// Values per block (1 for plain float types).
    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::U32 | DType::F8_E4M3 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => 32,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
        }
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8_E4M3 => 1,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
        }
    }
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }
    /// ggml's K-quants: 256-value super-blocks whose dot products take
    /// activations quantized to Q8_K.
    pub fn is_k_quant(self) -> bool {
        self.block_len() == 256
    }
    /// Bytes needed for `n` values, or None when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::U32 => "U32",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::F8_E4M3 => "F8_E4M3",
        }
    }
}
