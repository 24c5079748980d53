//! LoRA updates beside a layer's projections: `y = W·x + B·(A·x)` for the
//! rows of each adapter. Where the base stacks projections into one weight
//! (q|k|v, gate|up, Gated DeltaNet's inputs), the adapter's pairs stack the
//! same way: `A` row-stacked `[Σr, in]` and `B` block-diagonal
//! `[Σout, Σr]` (zero blocks for projections it leaves alone), so the update
//! of the stacked output is one pair of matmuls.

use std::collections::BTreeMap;
use std::ops::Range;

use super::block::{BlockInput, BlockOutput};
use crate::backend::ops::ModelBackend;
use crate::lora::LoraPair;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// An adapter's pairs not yet placed, by decoder layer and projection path;
/// each layer takes its own, and what is left names what the model cannot adapt.
pub type Pending = BTreeMap<(usize, String), LoraPair>;

/// One (possibly stacked) projection's update for one adapter.
pub struct LoraSite<W> {
    /// `[Σr, in]`.
    a: W,
    /// `[Σout, Σr]`, the scaling folded in.
    b: W,
}

/// An adapter's part for one block: a site per input-projection weight, in
/// the block's form (one when its projections are stacked), and the site of
/// its last projection.
pub struct Sites<W> {
    inputs: Vec<Option<LoraSite<W>>>,
    output: Option<LoraSite<W>>,
}

impl<W> Sites<W> {
    pub fn new(inputs: Vec<Option<LoraSite<W>>>, output: Option<LoraSite<W>>) -> Self {
        Sites { inputs, output }
    }

    /// The site of input weight `i`.
    pub fn input(&self, i: usize) -> Option<&LoraSite<W>> {
        self.inputs.get(i).and_then(Option::as_ref)
    }
}

/// The rows of a forward that run with an adapter, and that adapter's part
/// for one layer (rows with no adapter are absent).
pub type Segments<'a, L> = [(Range<usize>, &'a L)];

impl<W> LoraSite<W> {
    /// The site of a projection whose output stacks `parts` (projection path
    /// in `layer`, output rows) in this order over an input of `in_dim`;
    /// None when the adapter adapts none of them.
    pub fn take<B: ModelBackend<Weight = W>>(
        b: &B,
        pending: &mut Pending,
        layer: usize,
        parts: &[(&str, usize)],
        in_dim: usize,
    ) -> Result<Option<Self>> {
        let mut pairs = Vec::with_capacity(parts.len());
        for &(path, out) in parts {
            let pair = pending.remove(&(layer, path.to_string()));
            if let Some(p) = &pair
                && (p.in_dim != in_dim || p.out_dim != out)
            {
                return Err(Error::Invalid(format!(
                    "LoRA for layers.{layer}.{path} maps {} to {} features; the model's projection maps {in_dim} to {out}",
                    p.in_dim, p.out_dim
                )));
            }
            pairs.push((pair, out));
        }
        let rank: usize = pairs.iter().filter_map(|(p, _)| p.as_ref().map(|p| p.rank)).sum();
        if rank == 0 {
            return Ok(None);
        }
        let out: usize = pairs.iter().map(|(_, o)| o).sum();
        let mut a = Vec::with_capacity(rank * in_dim);
        let mut bm = vec![0.0f32; out * rank];
        let (mut row, mut col) = (0, 0);
        for (pair, rows) in &pairs {
            if let Some(p) = pair {
                a.extend_from_slice(&p.a);
                for i in 0..p.out_dim {
                    let dst = (row + i) * rank + col;
                    bm[dst..dst + p.rank].copy_from_slice(&p.b[i * p.rank..(i + 1) * p.rank]);
                }
                col += p.rank;
            }
            row += rows;
        }
        let name = format!("lora.layers.{layer}.{}", parts.iter().map(|p| p.0).collect::<Vec<_>>().join("+"));
        Ok(Some(LoraSite {
            a: b.upload(&Tensor::from_f32(&format!("{name}.A"), vec![rank, in_dim], &a)?)?,
            b: b.upload(&Tensor::from_f32(&format!("{name}.B"), vec![out, rank], &bm)?)?,
        }))
    }
}

/// Reorders the output rows of the pair `path` of `layer` within each head
/// as llama.cpp's converter reorders llama's q/k rows for its interleaved
/// RoPE (per head, rows `[i, d/2 + i]` become `[2i, 2i + 1]`), so that an
/// adapter made on Hugging Face's order updates the rows a `llama` GGUF holds.
pub fn interleave_head_rows(pending: &mut Pending, layer: usize, path: &str, head_dim: usize) {
    let Some(p) = pending.get_mut(&(layer, path.to_string())) else { return };
    if !head_dim.is_multiple_of(2) || !p.out_dim.is_multiple_of(head_dim) {
        return;
    }
    let (r, half) = (p.rank, head_dim / 2);
    let mut b = vec![0.0; p.b.len()];
    for head in 0..p.out_dim / head_dim {
        for i in 0..half {
            for (j, from) in [i, half + i].into_iter().enumerate() {
                let (src, dst) = ((head * head_dim + from) * r, (head * head_dim + 2 * i + j) * r);
                b[dst..dst + r].copy_from_slice(&p.b[src..src + r]);
            }
        }
    }
    p.b = b;
}

/// Whether any adapter of `segs` updates the site `site` picks.
pub fn touches<W, L>(segs: &Segments<'_, L>, site: impl Fn(&L) -> Option<&LoraSite<W>>) -> bool {
    segs.iter().any(|(_, l)| site(l).is_some())
}

/// Adds each adapter's update of `x`'s rows into `y`'s (the site's
/// output), for the site `site` picks from each adapter's layer part.
pub fn apply<B: ModelBackend, L>(
    b: &B,
    y: &mut B::Act,
    x: &B::Act,
    segs: &Segments<'_, L>,
    site: impl Fn(&L) -> Option<&LoraSite<B::Weight>>,
) {
    let rows = b.rows(x);
    for (r, part) in segs {
        let Some(s) = site(part) else { continue };
        if r.start == 0 && r.end == rows {
            // The up-projection accumulates into y (a backend may do it in
            // the matmul): no [rows, out] update is written and read back.
            b.linear_add(y, &b.linear(x, &s.a, None), &s.b, None);
        } else {
            let d = b.linear(&b.linear(&b.slice_rows(x, r.clone()), &s.a, None), &s.b, None);
            b.add_rows(y, r.start, &d);
        }
    }
}

/// `linear(x, w, bias)` plus the adapters' updates.
pub fn linear<B: ModelBackend, L>(
    b: &B,
    x: &B::Act,
    w: &B::Weight,
    bias: Option<&B::Weight>,
    segs: &Segments<'_, L>,
    site: impl Fn(&L) -> Option<&LoraSite<B::Weight>>,
) -> B::Act {
    let mut y = b.linear(x, w, bias);
    apply(b, &mut y, x, segs, site);
    y
}

/// `input.linear(w, bias)` for input weight `i`, plus the adapters' updates;
/// the input norm stays folded into the matmul where no adapter touches it.
pub fn input_linear<B: ModelBackend>(
    b: &B,
    input: &BlockInput<'_, B>,
    w: &B::Weight,
    bias: Option<&B::Weight>,
    segs: &Segments<'_, Sites<B::Weight>>,
    i: usize,
) -> B::Act {
    if touches(segs, |l| l.input(i)) {
        input.with_normed(b, |x| linear(b, x, w, bias, segs, |l| l.input(i)))
    } else {
        input.linear(b, w, bias)
    }
}

/// A block's last projection of `x`: left to the caller to add into the
/// residual stream, or computed here with the adapters' updates.
pub fn output<'w, B: ModelBackend>(
    b: &B,
    x: B::Act,
    w: &'w B::Weight,
    bias: Option<&'w B::Weight>,
    segs: &Segments<'_, Sites<B::Weight>>,
) -> BlockOutput<'w, B> {
    if touches(segs, |l| l.output.as_ref()) {
        BlockOutput::Done(linear(b, &x, w, bias, segs, |l| l.output.as_ref()))
    } else {
        BlockOutput::Projected { x, w, bias }
    }
}
