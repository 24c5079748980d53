//! The SwiGLU feed-forward block: `down(silu(gate(x)) ⊙ up(x))`.

use super::WeightLoader;
use crate::Result;
use crate::backend::Backend;

pub struct Mlp<B: Backend> {
    /// gate|up stacked into one weight (backends that fuse projections), or
    /// gate and up.
    gate_up: Vec<B::Weight>,
    down_proj: B::Weight,
}

impl<B: Backend> Mlp<B> {
    /// `p` is the module prefix, e.g. `model.layers.3.mlp`; `width` the intermediate size.
    pub fn load(ld: &WeightLoader<B>, p: &str, hidden: usize, width: usize) -> Result<Self> {
        let names = [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight")];
        Ok(Mlp {
            gate_up: ld.stacked_rows(&names, &[[width, hidden], [width, hidden]])?,
            down_proj: ld.get(&format!("{p}.down_proj.weight"), &[hidden, width])?,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        let h = match self.gate_up.as_slice() {
            [gate_up] => b.linear_swiglu(x, gate_up),
            [gate, up] => b.silu_mul(&b.linear(x, gate, None), &b.linear(x, up, None)),
            _ => unreachable!("stacked_rows returns one weight or one per name"),
        };
        b.linear(&h, &self.down_proj, None)
    }
}
