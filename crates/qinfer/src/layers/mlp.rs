//! The SwiGLU feed-forward block: `down(silu(gate(x)) ⊙ up(x))`.

use super::block::{BlockInput, BlockOutput};
use crate::Result;

use crate::backend::ops::ModelBackend;
use crate::weights::WeightLoader;

pub struct Mlp<B: ModelBackend> {
    /// gate|up stacked into one weight (backends that fuse projections), or
    /// gate and up.
    gate_up: Vec<B::Weight>,
    down_proj: B::Weight,
}

impl<B: ModelBackend> Mlp<B> {
    /// `p` is the module prefix, e.g. `model.layers.3.mlp`; `width` the intermediate size.
    pub fn load(ld: &WeightLoader<B>, p: &str, hidden: usize, width: usize) -> Result<Self> {
        let names = [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight")];
        Ok(Mlp {
            gate_up: ld.stacked_rows(&names, &[[width, hidden], [width, hidden]])?,
            down_proj: ld.get(&format!("{p}.down_proj.weight"), &[hidden, width])?,
        })
    }

    /// `silu(gate(input)) ⊙ up(input)`, the down projection's input.
    fn activations(&self, b: &B, input: &BlockInput<'_, B>) -> B::Act {
        match self.gate_up.as_slice() {
            [gate_up] => input.linear_swiglu(b, gate_up),
            [gate, up] => input.with_normed(b, |x| b.silu_mul(&b.linear(x, gate, None), &b.linear(x, up, None))),
            _ => unreachable!("stacked_rows returns one weight or one per name"),
        }
    }

    /// The block's output for `input`; the down projection is left for the
    /// caller to add into the residual stream.
    pub fn forward_block(&self, b: &B, input: BlockInput<'_, B>) -> BlockOutput<'_, B> {
        BlockOutput::Projected { x: self.activations(b, &input), w: &self.down_proj, bias: None }
    }

    /// `down(silu(gate(x)) ⊙ up(x))` of rows `x` already normed (MoE's shared expert).
    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        b.linear(&self.activations(b, &BlockInput::Normed(x)), &self.down_proj, None)
    }
}
