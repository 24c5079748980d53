//! Qwen3.5's vision tower (transformers' `Qwen3_5VisionModel`): patches
//! embedded by a linear map (the Conv3d whose stride equals its kernel),
//! a learned position table resampled bilinearly to the image's grid,
//! pre-norm ViT blocks with LayerNorm, bidirectional attention over one
//! image's patches with a 2-D rotary embedding (height then width
//! frequencies), a tanh-GELU MLP, and a merger that joins each
//! `merge × merge` block of patches into one token of the language model's
//! width. The matmuls run on the model's backend; the norms, rotary,
//! attention and activations run on the host in f32.

use rayon::prelude::*;

use crate::backend::ops::ModelBackend;
use crate::config::vision::VisionConfig;
use crate::image::PreparedImage;
use crate::weights::WeightLoader;
use crate::{Error, Result};

/// LayerNorm's epsilon in every norm of the tower.
const EPS: f32 = 1e-6;

struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

impl LayerNorm {
    fn load<B: ModelBackend>(ld: &WeightLoader<B>, p: &str, dim: usize) -> Result<Self> {
        let get = |n: &str| Ok::<_, Error>(ld.tensor(&format!("{p}.{n}"), &[&[dim]])?.to_f32_vec());
        Ok(LayerNorm { weight: get("weight")?, bias: get("bias")? })
    }

    /// Each row of `x` normalized (biased variance, as torch).
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let d = self.weight.len();
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, r)| {
            let mean = r.iter().sum::<f32>() / d as f32;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let inv = 1.0 / (var + EPS).sqrt();
            for i in 0..d {
                o[i] = (r[i] - mean) * inv * self.weight[i] + self.bias[i];
            }
        });
        out
    }
}

struct Linear<W> {
    weight: W,
    bias: W,
    out: usize,
}

impl<W> Linear<W> {
    fn load<B: ModelBackend<Weight = W>>(ld: &WeightLoader<B>, p: &str, out: usize, inp: usize) -> Result<Self> {
        Ok(Linear {
            weight: ld.get(&format!("{p}.weight"), &[out, inp])?,
            bias: ld.get(&format!("{p}.bias"), &[out])?,
            out,
        })
    }

    fn apply<B: ModelBackend<Weight = W>>(&self, b: &B, x: &[f32], cols: usize) -> Vec<f32> {
        let act = b.act_from_host(x.len() / cols, cols, x);
        let y = b.to_host(&b.linear(&act, &self.weight, Some(&self.bias)));
        debug_assert_eq!(y.len(), x.len() / cols * self.out);
        y
    }
}

struct Block<W> {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Linear<W>,
    proj: Linear<W>,
    fc1: Linear<W>,
    fc2: Linear<W>,
}

pub struct VisionTower<B: ModelBackend> {
    cfg: VisionConfig,
    patch_embed: Linear<B::Weight>,
    /// `[num_position_embeddings, hidden]`.
    pos_embed: Vec<f32>,
    blocks: Vec<Block<B::Weight>>,
    merger_norm: LayerNorm,
    merger_fc1: Linear<B::Weight>,
    merger_fc2: Linear<B::Weight>,
    /// One frequency per rotated pair of each axis: `head_dim / 4`.
    inv_freq: Vec<f32>,
}

/// The tanh approximation of GELU (`gelu_pytorch_tanh`).
fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// Exact GELU (the merger's `nn.GELU()`).
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x / std::f32::consts::SQRT_2))
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
            Linear { weight: ld.place(&conv)?, bias: ld.get(&format!("{prefix}patch_embed.proj.bias"), &[h])?, out: h };
        let pos_embed =
            ld.tensor(&format!("{prefix}pos_embed.weight"), &[&[cfg.num_position_embeddings, h]])?.to_f32_vec();
        let blocks = (0..cfg.depth)
            .map(|l| {
                let b = format!("{prefix}blocks.{l}");
                Ok(Block {
                    norm1: LayerNorm::load(ld, &format!("{b}.norm1"), h)?,
                    norm2: LayerNorm::load(ld, &format!("{b}.norm2"), h)?,
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
            merger_norm: LayerNorm::load(ld, &format!("{prefix}merger.norm"), h)?,
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
    /// aligned, as `F.interpolate` over the table's square).
    fn add_positions(&self, h: &mut [f32], coords: &[(usize, usize)], grid: [usize; 3]) {
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
    }

    /// Bidirectional attention of every head over the image's patches, each
    /// head's queries and keys rotated by the patches' (row, column).
    fn attention(&self, qkv: &[f32], coords: &[(usize, usize)]) -> Vec<f32> {
        let (d, heads, hd) = (self.cfg.hidden_size, self.cfg.num_heads, self.cfg.head_dim());
        let n = coords.len();
        let (half, quarter) = (hd / 2, hd / 4);
        // cos/sin per patch and pair: pairs below hd/4 take the row, the rest the column.
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for (i, &(r, c)) in coords.iter().enumerate() {
            for j in 0..half {
                let pos = if j < quarter { r } else { c };
                let a = (pos as f32 * self.inv_freq[j % quarter]) as f64;
                cos[i * half + j] = a.cos() as f32;
                sin[i * half + j] = a.sin() as f32;
            }
        }
        let rotated = |part: usize| -> Vec<f32> {
            let mut out = vec![0f32; n * d];
            out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
                let src = &qkv[i * 3 * d + part * d..][..d];
                let (cs, sn) = (&cos[i * half..][..half], &sin[i * half..][..half]);
                for h in 0..heads {
                    let (x, y) = (&src[h * hd..][..hd], &mut o[h * hd..][..hd]);
                    for j in 0..half {
                        y[j] = x[j] * cs[j] - x[j + half] * sn[j];
                        y[j + half] = x[j + half] * cs[j] + x[j] * sn[j];
                    }
                }
            });
            out
        };
        let (q, k) = (rotated(0), rotated(1));
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; n * d];
        out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
            let mut scores = vec![0f32; n];
            for h in 0..heads {
                let qi = &q[i * d + h * hd..][..hd];
                for (j, s) in scores.iter_mut().enumerate() {
                    let kj = &k[j * d + h * hd..][..hd];
                    *s = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                }
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    total += *s;
                }
                let oh = &mut o[h * hd..][..hd];
                for (j, &p) in scores.iter().enumerate() {
                    let vj = &qkv[j * 3 * d + 2 * d + h * hd..][..hd];
                    for (x, v) in oh.iter_mut().zip(vj) {
                        *x += p / total * v;
                    }
                }
            }
        });
        out
    }

    /// The merged tokens of one image: `[tokens, out_hidden_size]`.
    pub fn encode(&self, b: &B, image: &PreparedImage) -> Result<Vec<f32>> {
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
        let d = cfg.hidden_size;
        let coords = self.patch_coords(image.grid);
        let mut h = self.patch_embed.apply(b, &image.pixels, cfg.patch_values());
        self.add_positions(&mut h, &coords, image.grid);
        for blk in &self.blocks {
            let qkv = blk.qkv.apply(b, &blk.norm1.apply(&h), d);
            let attn = blk.proj.apply(b, &self.attention(&qkv, &coords), d);
            h.iter_mut().zip(&attn).for_each(|(x, a)| *x += a);
            let mut f = blk.fc1.apply(b, &blk.norm2.apply(&h), d);
            f.par_iter_mut().for_each(|x| *x = gelu_tanh(*x));
            let f = blk.fc2.apply(b, &f, cfg.intermediate_size);
            h.iter_mut().zip(&f).for_each(|(x, a)| *x += a);
        }
        let merged = d * m * m;
        let mut x = self.merger_fc1.apply(b, &self.merger_norm.apply(&h), merged);
        x.par_iter_mut().for_each(|v| *v = gelu_erf(*v));
        Ok(self.merger_fc2.apply(b, &x, merged))
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
