//! What a pre-norm residual block reads and what it hands back.
//!
//! A block computes `h += f(RMSNorm(h)·w)`. Its input norm and its final
//! residual add are left to the matmuls beside them (the first projection
//! reads `h` and the norm weight, the last one adds into `h`), so a backend
//! can fold both into those matmuls instead of running a norm kernel between
//! blocks.

use crate::backend::ops::ModelBackend;

/// The input of a pre-norm block: `RMSNorm(h)·norm`.
pub enum BlockInput<'a, B: ModelBackend> {
    /// Already normed (the previous block's output was added here, not in a
    /// projection).
    Normed(&'a B::Act),
    /// Left to the block's first projection.
    Residual { h: &'a B::Act, norm: &'a B::Weight, eps: f32 },
}

impl<'a, B: ModelBackend> BlockInput<'a, B> {
    /// `normed` when the previous block's output add computed it, else
    /// `RMSNorm(h)·norm` left to the block's first projection.
    pub fn new(h: &'a B::Act, normed: Option<&'a B::Act>, norm: &'a B::Weight, eps: f32) -> Self {
        match normed {
            Some(x) => BlockInput::Normed(x),
            None => BlockInput::Residual { h, norm, eps },
        }
    }

    /// `linear(input, w, bias)`.
    pub fn linear(&self, b: &B, w: &B::Weight, bias: Option<&B::Weight>) -> B::Act {
        match self {
            BlockInput::Normed(x) => b.linear(x, w, bias),
            BlockInput::Residual { h, norm, eps } => b.linear_normed(h, norm, *eps, w, bias),
        }
    }

    /// `linear_swiglu(input, gate_up)`.
    pub fn linear_swiglu(&self, b: &B, gate_up: &B::Weight) -> B::Act {
        match self {
            BlockInput::Normed(x) => b.linear_swiglu(x, gate_up),
            BlockInput::Residual { h, norm, eps } => b.linear_swiglu_normed(h, norm, *eps, gate_up),
        }
    }

    /// `f` of the normed rows themselves (blocks that read them more than once).
    pub fn with_normed<R>(&self, b: &B, f: impl FnOnce(&B::Act) -> R) -> R {
        match self {
            BlockInput::Normed(x) => f(x),
            BlockInput::Residual { h, norm, eps } => f(&b.rms_norm(h, norm, *eps)),
        }
    }
}

/// What a block adds into the residual stream.
pub enum BlockOutput<'w, B: ModelBackend> {
    /// `linear(x, w, bias)`: the block's last projection, left to the caller
    /// to add into `h` as it computes it.
    Projected { x: B::Act, w: &'w B::Weight, bias: Option<&'w B::Weight> },
    /// The finished output (blocks that end in a sum, such as MoE).
    Done(B::Act),
}

impl<B: ModelBackend> BlockOutput<'_, B> {
    /// Adds the output into `h`. Returns `RMSNorm(h)·next_norm` when the add
    /// was a plain one (fused with that norm), None when a projection added
    /// into `h` and the next block's first projection can fold the norm.
    pub fn add_into(self, b: &B, h: &mut B::Act, next_norm: &B::Weight, eps: f32) -> Option<B::Act> {
        match self {
            BlockOutput::Projected { x, w, bias } => {
                b.linear_add_for_norm(h, &x, w, bias, next_norm);
                None
            }
            BlockOutput::Done(y) => Some(b.add_rms_norm(h, &y, next_norm, eps)),
        }
    }
}
