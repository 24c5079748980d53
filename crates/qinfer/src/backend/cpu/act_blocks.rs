//! Activations quantized for the integer dot products: Q8 blocks of 32 (for
//! ggml's 32-value block types) and Q8_K blocks of 256 (for the K-quants),
//! shared by the scalar kernels and their SIMD versions.

use half::f16;

use crate::quant::kquants::QK_K;

/// One block of 32 activations: x ≈ d·q. `s` = d·Σq (needed by Q4_1's min term).
/// `d` and `s` are rounded through f16 as llama.cpp stores them.
#[derive(Debug, Clone, Copy)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

impl Q8Block {
    pub const ZERO: Q8Block = Q8Block { d: 0.0, s: 0.0, qs: [0; 32] };
}

#[inline]
pub(super) fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// One block of 256 activations: x ≈ d·q; `bsums[g]` = Σ of q over values 16g..16g+16.
#[derive(Debug, Clone, Copy)]
pub struct Q8KBlock {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; 16],
}

impl Q8KBlock {
    pub const ZERO: Q8KBlock = Q8KBlock { d: 0.0, qs: [0; QK_K], bsums: [0; 16] };
}
