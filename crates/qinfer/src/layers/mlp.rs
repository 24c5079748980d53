//! The SwiGLU feed-forward block: `down(silu(gate(x)) ⊙ up(x))`.

use super::block::{BlockInput, BlockOutput};
use super::lora::{self, LoraSite, Pending, Segments, Sites, touches};
use crate::Result;

use crate::backend::ops::ModelBackend;
use crate::weights::WeightLoader;

pub struct Mlp<B: ModelBackend> {
    /// gate|up stacked into one weight (backends that fuse projections), or
    /// gate and up.
    gate_up: Vec<B::Weight>,
    down_proj: B::Weight,
    hidden: usize,
    width: usize,
}

impl<B: ModelBackend> Mlp<B> {
    /// `p` is the module prefix, e.g. `model.layers.3.mlp`; `width` the intermediate size.
    pub fn load(ld: &WeightLoader<B>, p: &str, hidden: usize, width: usize) -> Result<Self> {
        let names = [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight")];
        Ok(Mlp {
            gate_up: ld.stacked_rows(&names, &[[width, hidden], [width, hidden]])?,
            down_proj: ld.get(&format!("{p}.down_proj.weight"), &[hidden, width])?,
            hidden,
            width,
        })
    }

    /// An adapter's sites for this MLP (`module` is its path in layer
    /// `layer`, e.g. `mlp`), taken from `pending`: gate|up (one site when
    /// stacked, else gate and up), then down.
    pub fn lora(&self, b: &B, pending: &mut Pending, module: &str, layer: usize) -> Result<Sites<B::Weight>> {
        let (hidden, width) = (self.hidden, self.width);
        let (gate, up) = (format!("{module}.gate_proj"), format!("{module}.up_proj"));
        let parts = [(gate.as_str(), width), (up.as_str(), width)];
        let gate_up = match self.gate_up.len() {
            1 => vec![LoraSite::take(b, pending, layer, &parts, hidden)?],
            _ => parts
                .iter()
                .map(|p| LoraSite::take(b, pending, layer, std::slice::from_ref(p), hidden))
                .collect::<Result<_>>()?,
        };
        let down = LoraSite::take(b, pending, layer, &[(&format!("{module}.down_proj"), hidden)], width)?;
        Ok(Sites::new(gate_up, down))
    }

    /// `silu(gate(input)) ⊙ up(input)`, the down projection's input.
    fn activations(&self, b: &B, input: &BlockInput<'_, B>, lora: &Segments<'_, Sites<B::Weight>>) -> B::Act {
        match self.gate_up.as_slice() {
            [gate_up] if touches(lora, |l| l.input(0)) => {
                b.swiglu(&lora::input_linear(b, input, gate_up, None, lora, 0))
            }
            [gate_up] => input.linear_swiglu(b, gate_up),
            [gate, up] => input.with_normed(b, |x| {
                let g = lora::linear(b, x, gate, None, lora, |l| l.input(0));
                b.silu_mul(&g, &lora::linear(b, x, up, None, lora, |l| l.input(1)))
            }),
            _ => unreachable!("stacked_rows returns one weight or one per name"),
        }
    }

    /// The block's output for `input`; the down projection is left for the
    /// caller to add into the residual stream (or done here, with the
    /// adapters' updates).
    pub fn forward_block(
        &self,
        b: &B,
        input: BlockInput<'_, B>,
        lora: &Segments<'_, Sites<B::Weight>>,
    ) -> BlockOutput<'_, B> {
        lora::output(b, self.activations(b, &input, lora), &self.down_proj, None, lora)
    }

    /// `down(silu(gate(x)) ⊙ up(x))` of rows `x` already normed (MoE's shared expert).
    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        b.linear(&self.activations(b, &BlockInput::Normed(x), &[]), &self.down_proj, None)
    }
}
