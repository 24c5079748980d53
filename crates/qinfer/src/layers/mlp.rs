//! The SwiGLU feed-forward block: `down(silu(gate(x)) ⊙ up(x))`.

use super::WeightLoader;
use crate::Result;
use crate::backend::Backend;

pub struct Mlp<B: Backend> {
    gate_proj: B::Weight,
    up_proj: B::Weight,
    down_proj: B::Weight,
}

impl<B: Backend> Mlp<B> {
    /// `p` is the module prefix, e.g. `model.layers.3.mlp`; `width` the intermediate size.
    pub fn load(ld: &WeightLoader<B>, p: &str, hidden: usize, width: usize) -> Result<Self> {
        Ok(Mlp {
            gate_proj: ld.get(&format!("{p}.gate_proj.weight"), &[width, hidden])?,
            up_proj: ld.get(&format!("{p}.up_proj.weight"), &[width, hidden])?,
            down_proj: ld.get(&format!("{p}.down_proj.weight"), &[hidden, width])?,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        let g = b.linear(x, &self.gate_proj, None);
        let u = b.linear(x, &self.up_proj, None);
        b.linear(&b.silu_mul(&g, &u), &self.down_proj, None)
    }
}
