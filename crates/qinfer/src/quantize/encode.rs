//! Values written back in a float storage type.

use crate::tensor::DType;

/// `values` as little-endian `dtype` (bf16, f16 or f32).
pub(super) fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        DType::F32
        | DType::U32
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q8_0
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::F8_E4M3 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}
