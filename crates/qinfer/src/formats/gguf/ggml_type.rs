//! ggml tensor types as numbered in GGUF (`enum ggml_type`): names and block
//! geometry for every type, so `inspect` can size and list tensors qinfer does
//! not compute with; those it computes with map to a [`DType`].

use crate::tensor::DType;

/// A ggml type id known to this reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    /// Values per block along the row.
    pub block_len: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

/// (id, name, values per block, bytes per block), from ggml's type traits.
/// Ids 4, 5 (Q4_2, Q4_3) and 31–33, 36–38 (repacked layouts) were removed
/// from ggml and never appear in files.
const TYPES: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|t| t.0 == id).map(|&(id, name, block_len, block_bytes)| GgmlType {
            id,
            name,
            block_len,
            block_bytes,
        })
    }

    /// The qinfer storage type, or None when qinfer cannot compute with it.
    pub fn dtype(self) -> Option<DType> {
        match self.id {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            30 => Some(DType::BF16),
            2 => Some(DType::Q4_0),
            3 => Some(DType::Q4_1),
            6 => Some(DType::Q5_0),
            7 => Some(DType::Q5_1),
            8 => Some(DType::Q8_0),
            10 => Some(DType::Q2_K),
            11 => Some(DType::Q3_K),
            12 => Some(DType::Q4_K),
            13 => Some(DType::Q5_K),
            14 => Some(DType::Q6_K),
            _ => None,
        }
    }

    /// Bytes for a tensor whose rows hold `row_len` values and which has `n`
    /// values in all; None on overflow or when rows are not whole blocks.
    pub fn bytes_for(self, row_len: u64, n: u64) -> Option<u64> {
        let block = self.block_len as u64;
        if !row_len.is_multiple_of(block) || !n.is_multiple_of(block) {
            return None;
        }
        (n / block).checked_mul(self.block_bytes as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_types_agree_with_dtype_geometry() {
        for &(id, _, block_len, block_bytes) in TYPES {
            let t = GgmlType::from_id(id).unwrap();
            if let Some(d) = t.dtype() {
                assert_eq!(d.block_len(), block_len, "{}", t.name);
                assert_eq!(d.block_bytes(), block_bytes, "{}", t.name);
                assert_eq!(d.name(), t.name);
            }
        }
        assert!(GgmlType::from_id(4).is_none());
        assert!(GgmlType::from_id(1000).is_none());
    }
}
