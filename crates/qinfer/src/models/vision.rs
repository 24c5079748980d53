//! Qwen3.5's vision tower (transformers' `Qwen3_5VisionModel`): patches
//! embedded by a linear map (the Conv3d whose stride equals its kernel),
//! a learned position table resampled bilinearly to the image's grid,
//! pre-norm ViT blocks with LayerNorm, bidirectional attention over one
//! image's patches with a 2-D rotary embedding (height then width
//! frequencies), a tanh-GELU MLP, and a merger that joins each
//! `merge × merge` block of patches into one token of the language model's
//! width. Every op runs on the model's backend ([`VisionOps`] for the ones
//! the language model lacks); the position table and the rotary angles are
//! computed on the host once per image.

use rayon::prelude::*;

use crate::backend::ops::ModelBackend;
use crate::backend::vision_ops::{Gelu, LayerNormParams, VisionHeads};
use crate::config::vision::VisionConfig;
use crate::image::PreparedImage;
use crate::weights::WeightLoader;
use crate::{Error, Result};

/// LayerNorm's epsilon in every norm of the tower.
const EPS: f32 = 1e-6;

fn load_norm<B: ModelBackend>(ld: &WeightLoader<B>, p: &str, dim: usize) -> Result<LayerNormParams<B::Weight>> {
    let weight = ld.tensor(&format!("{p}.weight"), &[&[dim]])?;
    let bias = ld.tensor(&format!("{p}.bias"), &[&[dim]])?;
    Ok(LayerNormParams {
        weight: weight.to_f32_vec(),
        bias: bias.to_f32_vec(),
        placed: (ld.place(&weight)?, ld.place(&bias)?),
    })
}

struct Linear<W> {
    weight: W,
    bias: W,
}

impl<W> Linear<W> {
    fn load<B: ModelBackend<Weight = W>>(ld: &WeightLoader<B>, p: &str, out: usize, inp: usize) -> Result<Self> {
        Ok(Linear { weight: ld.get(&format!("{p}.weight"), &[out, inp])?, bias: ld.get(&format!("{p}.bias"), &[out])? })
    }

    fn apply<B: ModelBackend<Weight = W>>(&self, b: &B, x: &B::Act) -> B::Act {
        b.linear(x, &self.weight, Some(&self.bias))
    }
}

struct Block<W> {
    norm1: LayerNormParams<W>,
    norm2: LayerNormParams<W>,
    qkv: Linear<W>,
    proj: Linear<W>,
    fc1: Linear<W>,
    fc2: Linear<W>,
}

/// One image partway through the tower: its patches' hidden states, their
/// rotary table, and the next block to run.
pub struct Encoding<A> {
    h: A,
    rotary: A,
    next: usize,
}

pub struct VisionTower<B: ModelBackend> {
    cfg: VisionConfig,
    patch_embed: Linear<B::Weight>,
    /// `[num_position_embeddings, hidden]`.
    pos_embed: Vec<f32>,
    blocks: Vec<Block<B::Weight>>,
    merger_norm: LayerNormParams<B::Weight>,
    merger_fc1: Linear<B::Weight>,
    merger_fc2: Linear<B::Weight>,
    /// One frequency per rotated pair of each axis: `head_dim / 4`.
    inv_freq: Vec<f32>,
}

impl<B: ModelBackend> VisionTower<B> {
    /// Loads the tower under `prefix` (`model.visual.`).
    pub fn load(ld: &WeightLoader<B>, prefix: &str, cfg: &VisionConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let pv = cfg.patch_values();
        let name = format!("{prefix}patch_embed.proj.weight");
        let (p, t) = (cfg.patch_size, cfg.temporal_patch_size);
        let mut conv = ld.tensor(&name, &[&[h, cfg.in_channels, t, p, p], &[h, pv]])?;
        // The Conv3d's kernel is laid out as a patch's values are.
        conv.shape = vec![h, pv];
        let patch_embed =
            Linear { weight: ld.place(&conv)?, bias: ld.get(&format!("{prefix}patch_embed.proj.bias"), &[h])? };
        let pos_embed =
            ld.tensor(&format!("{prefix}pos_embed.weight"), &[&[cfg.num_position_embeddings, h]])?.to_f32_vec();
        let blocks = (0..cfg.depth)
            .map(|l| {
                let b = format!("{prefix}blocks.{l}");
                Ok(Block {
                    norm1: load_norm(ld, &format!("{b}.norm1"), h)?,
                    norm2: load_norm(ld, &format!("{b}.norm2"), h)?,
                    qkv: Linear::load(ld, &format!("{b}.attn.qkv"), 3 * h, h)?,
                    proj: Linear::load(ld, &format!("{b}.attn.proj"), h, h)?,
                    fc1: Linear::load(ld, &format!("{b}.mlp.linear_fc1"), i, h)?,
                    fc2: Linear::load(ld, &format!("{b}.mlp.linear_fc2"), h, i)?,
                })
            })
            .collect::<Result<_>>()?;
        let merged = h * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let spatial = cfg.head_dim() / 2;
        let inv_freq = (0..spatial / 2).map(|j| 1.0 / cfg.rope_theta.powf((2 * j) as f32 / spatial as f32)).collect();
        Ok(VisionTower {
            cfg: cfg.clone(),
            patch_embed,
            pos_embed,
            blocks,
            merger_norm: load_norm(ld, &format!("{prefix}merger.norm"), h)?,
            merger_fc1: Linear::load(ld, &format!("{prefix}merger.linear_fc1"), merged, merged)?,
            merger_fc2: Linear::load(ld, &format!("{prefix}merger.linear_fc2"), cfg.out_hidden_size, merged)?,
            inv_freq,
        })
    }

    /// Each patch's (row, column) in the image's patch grid: patches come
    /// in merge-block order (block row, block column, row in block, column
    /// in block).
    fn patch_coords(&self, grid: [usize; 3]) -> Vec<(usize, usize)> {
        let m = self.cfg.spatial_merge_size;
        let [t, gh, gw] = grid;
        let mut out = Vec::with_capacity(t * gh * gw);
        for _ in 0..t {
            for br in 0..gh / m {
                for bc in 0..gw / m {
                    for ir in 0..m {
                        for ic in 0..m {
                            out.push((br * m + ir, bc * m + ic));
                        }
                    }
                }
            }
        }
        out
    }

    /// The learned position table resampled to the grid (bilinear, corners
    /// aligned, as `F.interpolate` over the table's square): one row per patch.
    fn positions(&self, coords: &[(usize, usize)], grid: [usize; 3]) -> Vec<f32> {
        let side = self.cfg.position_grid_side();
        let d = self.cfg.hidden_size;
        let axis = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            [0, 1].map(|o| {
                let tap = (floor as usize + o).min(side - 1);
                let w = (1.0 - (src - floor - o as f32).abs()).max(0.0);
                (tap, w)
            })
        };
        let mut h = vec![0f32; coords.len() * d];
        h.par_chunks_mut(d).zip(coords.par_iter()).for_each(|(row, &(r, c))| {
            for (tr, wr) in axis(r, grid[1]) {
                for (tc, wc) in axis(c, grid[2]) {
                    let w = wr * wc;
                    let e = &self.pos_embed[(tr * side + tc) * d..][..d];
                    for (x, v) in row.iter_mut().zip(e) {
                        *x += v * w;
                    }
                }
            }
        });
        h
    }

    /// Each patch's rotary cosines then sines (`[patches, head_dim]`): pairs
    /// below `head_dim / 4` turn by the patch's row, the rest by its column.
    fn rotary(&self, coords: &[(usize, usize)]) -> Vec<f32> {
        let hd = self.cfg.head_dim();
        let (half, quarter) = (hd / 2, hd / 4);
        let mut out = vec![0f32; coords.len() * hd];
        for (row, &(r, c)) in out.chunks_mut(hd).zip(coords) {
            for j in 0..half {
                let pos = if j < quarter { r } else { c };
                let a = (pos as f32 * self.inv_freq[j % quarter]) as f64;
                row[j] = a.cos() as f32;
                row[half + j] = a.sin() as f32;
            }
        }
        out
    }

    /// Checks that `image` fits this tower (whole merge blocks, the patch
    /// size the tower was trained on).
    pub fn check(&self, image: &PreparedImage) -> Result<()> {
        let cfg = &self.cfg;
        let m = cfg.spatial_merge_size;
        let [t, gh, gw] = image.grid;
        if t == 0 || gh == 0 || gw == 0 || gh % m != 0 || gw % m != 0 {
            return Err(Error::Invalid(format!("image grid {:?} is not made of {m}×{m} merge blocks", image.grid)));
        }
        if image.pixels.len() != image.patches() * cfg.patch_values() {
            return Err(Error::Invalid(format!(
                "image of {} values for {} patches of {} values (the processor's patch size differs from the model's)",
                image.pixels.len(),
                image.patches(),
                cfg.patch_values()
            )));
        }
        Ok(())
    }

    /// The image's patches embedded, with their positions added: an
    /// encoding before its first block.
    pub fn begin(&self, b: &B, image: &PreparedImage) -> Result<Encoding<B::Act>> {
        self.check(image)?;
        let cfg = &self.cfg;
        let (d, n) = (cfg.hidden_size, image.patches());
        let coords = self.patch_coords(image.grid);
        let pixels = b.act_from_host(n, cfg.patch_values(), &image.pixels);
        let mut h = self.patch_embed.apply(b, &pixels);
        drop(pixels);
        b.add_assign(&mut h, &b.act_from_host(n, d, &self.positions(&coords, image.grid)));
        let rotary = b.act_from_host(n, cfg.head_dim(), &self.rotary(&coords));
        Ok(Encoding { h, rotary, next: 0 })
    }

    /// The blocks an encoding has still to run.
    pub fn blocks_left(&self, e: &Encoding<B::Act>) -> usize {
        self.blocks.len() - e.next
    }

    /// Runs up to `blocks` more blocks of `e` (waiting for the device), and
    /// after the last the merger: then the image's merged tokens,
    /// `[tokens, out_hidden_size]`.
    pub fn advance(&self, b: &B, e: &mut Encoding<B::Act>, blocks: usize) -> Result<Option<Vec<f32>>> {
        let cfg = &self.cfg;
        let heads = VisionHeads { heads: cfg.num_heads, head_dim: cfg.head_dim() };
        let end = (e.next + blocks).min(self.blocks.len());
        for blk in &self.blocks[e.next..end] {
            let h = &mut e.h;
            let qkv = blk.qkv.apply(b, &b.layer_norm(h, &blk.norm1, EPS));
            let attn = b.vision_attention(&qkv, &e.rotary, heads);
            drop(qkv);
            b.add_assign(h, &blk.proj.apply(b, &attn));
            let mut f = blk.fc1.apply(b, &b.layer_norm(h, &blk.norm2, EPS));
            b.gelu(&mut f, Gelu::Tanh);
            b.add_assign(h, &blk.fc2.apply(b, &f));
        }
        e.next = end;
        if end < self.blocks.len() {
            b.check()?;
            return Ok(None);
        }
        let m = cfg.spatial_merge_size;
        let x = b.regroup(b.layer_norm(&e.h, &self.merger_norm, EPS), cfg.hidden_size * m * m);
        let mut x = self.merger_fc1.apply(b, &x);
        b.gelu(&mut x, Gelu::Erf);
        let out = b.to_host(&self.merger_fc2.apply(b, &x));
        b.check()?;
        Ok(Some(out))
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }
}

/// The temporal, height and width rotary positions of a prompt's tokens
/// (transformers' `get_rope_index` for images): text tokens count up on all
/// three; each image's tokens (a run of `image_token_id` of its size, in
/// prompt order) sit at the position where the image starts plus their
/// row and column in the merged grid; the text after an image continues
/// from its start plus its larger side. Returns the positions and the
/// offset later tokens add to their index (negative where images take more
/// tokens than positions).
pub fn rope_positions(prompt: &[u32], grids: &[[usize; 3]], cfg: &VisionConfig) -> Result<(Vec<[u32; 3]>, i64)> {
    let m = cfg.spatial_merge_size;
    let mut out = Vec::with_capacity(prompt.len());
    let mut images = grids.iter();
    let mut pos = 0u32;
    let mut i = 0;
    while i < prompt.len() {
        if prompt[i] != cfg.image_token_id {
            out.push([pos; 3]);
            pos += 1;
            i += 1;
            continue;
        }
        let index = grids.len() - images.len();
        let Some(&[t, gh, gw]) = images.next() else {
            return Err(Error::Invalid(format!(
                "the prompt has more image placeholders (token {}) than the {} image(s) given",
                cfg.image_token_id,
                grids.len()
            )));
        };
        let (lh, lw) = (gh / m, gw / m);
        let n = t * lh * lw;
        if i + n > prompt.len() || prompt[i..i + n].iter().any(|&x| x != cfg.image_token_id) {
            return Err(Error::Invalid(format!(
                "image {index} takes {n} placeholder tokens, but the prompt has a run of {} at token {i}",
                prompt[i..].iter().take_while(|&&x| x == cfg.image_token_id).count()
            )));
        }
        for k in 0..n {
            let (f, rc) = (k / (lh * lw), k % (lh * lw));
            out.push([pos + f as u32, pos + (rc / lw) as u32, pos + (rc % lw) as u32]);
        }
        pos += lh.max(lw) as u32;
        i += n;
    }
    if images.next().is_some() {
        return Err(Error::Invalid(format!(
            "{} image(s) given but the prompt has fewer image placeholders (token {})",
            grids.len(),
            cfg.image_token_id
        )));
    }
    Ok((out, pos as i64 - prompt.len() as i64))
}

/// A tokenized prompt with one image placeholder per image (the
/// template's marker) widened to each image's token count, as the
/// reference processor does before tokenizing.
pub fn expand_placeholders(ids: &[u32], image_token_id: u32, tokens_per_image: &[usize]) -> Result<Vec<u32>> {
    let found = ids.iter().filter(|&&t| t == image_token_id).count();
    if found != tokens_per_image.len() {
        return Err(Error::Invalid(format!(
            "the prompt has {found} image placeholder(s) (token {image_token_id}) for {} image(s)",
            tokens_per_image.len()
        )));
    }
    let mut counts = tokens_per_image.iter();
    let mut out = Vec::with_capacity(ids.len() + tokens_per_image.iter().sum::<usize>());
    for &t in ids {
        match t == image_token_id {
            true => out.extend(std::iter::repeat_n(t, *counts.next().expect("counted above"))),
            false => out.push(t),
        }
    }
    Ok(out)
}
