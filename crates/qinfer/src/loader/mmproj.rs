//! A Qwen3.5 GGUF's vision tower from llama.cpp's projector file
//! (`mmproj-*.gguf`, `general.architecture` = `clip`, projector
//! `qwen3vl_merger`), which llama.cpp publishes beside the text model: the
//! tower's configuration from `clip.vision.*`, its tensors under the
//! checkpoint's names (`model.visual.*`), the image processor's mean and
//! standard deviation, and the text model's multimodal RoPE sections
//! (`{arch}.rope.dimension_sections`).
//!
//! What the file cannot say is taken as llama.cpp takes it: the tower's
//! rotary base is 10000 (Qwen3.5's published value; clip.cpp fixes it for
//! this projector), and images are resized to between 8 and 4096 merged
//! tokens (clip.cpp's limits for Qwen-VL projectors), not the published
//! processor's 64 to 16384.

use std::path::Path;

use super::routed::Routed;
use super::{LoadedModel, ModelFormat};
use crate::config::Architecture;
use crate::config::vision::{Mrope, VisionConfig};
use crate::formats::TensorSource;
use crate::formats::gguf::{GgufArray, GgufFile, GgufValue};
use crate::image::ImageProcessorConfig;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The checkpoint's prefix of the tower's tensors.
const TOWER: &str = "model.visual.";

/// The projector's rotary base of the tower's attention (not in the file).
const TOWER_ROPE_THETA: f32 = 10_000.0;

/// The fewest and most merged tokens an image is resized to (clip.cpp's
/// `set_limit_image_tokens(8, 4096)` for Qwen-VL projectors).
const IMAGE_TOKENS: (usize, usize) = (8, 4096);

/// Checkpoint name (after `model.visual.`) ↔ projector name, per block
/// (`blocks.{i}.…` ↔ `v.blk.{i}.…`) and for the whole tower.
const BLOCK: &[(&str, &str)] = &[
    ("norm1", "ln1"),
    ("norm2", "ln2"),
    ("attn.qkv", "attn_qkv"),
    ("attn.proj", "attn_out"),
    ("mlp.linear_fc1", "ffn_up"),
    ("mlp.linear_fc2", "ffn_down"),
];
const WHOLE: &[(&str, &str)] = &[
    ("pos_embed", "v.position_embd"),
    ("merger.norm", "v.post_ln"),
    ("merger.linear_fc1", "mm.0"),
    ("merger.linear_fc2", "mm.2"),
];

/// The projector's name of a tower tensor (`model.visual.{module}.{weight|bias}`).
fn projector_name(name: &str) -> Option<String> {
    let rest = name.strip_prefix(TOWER)?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if !matches!(suffix, "weight" | "bias") {
        return None;
    }
    if let Some((_, g)) = WHOLE.iter().find(|(h, _)| *h == module) {
        return Some(format!("{g}.{suffix}"));
    }
    let (block, module) = module.strip_prefix("blocks.")?.split_once('.')?;
    let block: usize = block.parse().ok()?;
    let (_, g) = BLOCK.iter().find(|(h, _)| *h == module)?;
    Some(format!("v.blk.{block}.{g}.{suffix}"))
}

/// The projector's tensors under the checkpoint's names.
struct Projector(GgufFile);

/// The converter splits the patch embedding's 3-D convolution
/// `[out, in, 2, p, p]` into one 2-D kernel per frame.
const PATCH: &str = "model.visual.patch_embed.proj.weight";
const PATCH_FRAMES: [&str; 2] = ["v.patch_embd.weight", "v.patch_embd.weight.1"];

impl Projector {
    fn patch_kernel(&self) -> Result<Tensor> {
        let [a, b] = PATCH_FRAMES.map(|n| self.0.raw_tensor(n));
        let (a, b) = (a?, b?);
        if a.shape != b.shape || a.shape.len() != 4 {
            let file = self.0.path().display();
            return Err(Error::tensor(PATCH, format!("frames of {:?} and {:?} in {file}", a.shape, b.shape)));
        }
        // [out, in, kh, kw] each: frame t goes to [out, in, t, kh, kw].
        let (out, inp, kh, kw) = (a.shape[0], a.shape[1], a.shape[2], a.shape[3]);
        let (a, b, p) = (a.to_f32_vec(), b.to_f32_vec(), kh * kw);
        let mut v = Vec::with_capacity(2 * a.len());
        for oc in 0..out * inp {
            v.extend_from_slice(&a[oc * p..(oc + 1) * p]);
            v.extend_from_slice(&b[oc * p..(oc + 1) * p]);
        }
        Tensor::from_f32(PATCH, vec![out, inp, 2, kh, kw], &v)
    }
}

impl TensorSource for Projector {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        if name == PATCH {
            return self.patch_kernel();
        }
        if name == "model.visual.patch_embed.proj.bias" {
            return self.0.raw_tensor("v.patch_embd.bias");
        }
        match projector_name(name) {
            Some(g) => self.0.raw_tensor(&g).map(|t| Tensor { name: name.to_string(), ..t }),
            None => Err(Error::tensor(name, format!("no such tensor in {}", self.0.path().display()))),
        }
    }
    fn contains(&self, name: &str) -> bool {
        match name {
            PATCH => PATCH_FRAMES.iter().all(|n| self.0.tensor_info(n).is_some()),
            "model.visual.patch_embed.proj.bias" => self.0.tensor_info("v.patch_embd.bias").is_some(),
            _ => projector_name(name).is_some_and(|g| self.0.tensor_info(&g).is_some()),
        }
    }
    fn names(&self) -> Vec<String> {
        self.0.names()
    }
    fn raw_tensor(&self, name: &str) -> Result<Tensor> {
        self.0.raw_tensor(name)
    }
}

impl LoadedModel {
    /// The model (a Qwen3.5 GGUF) with the vision tower of llama.cpp's
    /// projector file at `path`, so that it takes images.
    pub fn with_mmproj(self, path: &Path) -> Result<LoadedModel> {
        if !matches!(self.config.arch, Architecture::Qwen35 | Architecture::Qwen35Moe) {
            return Err(Error::malformed(
                path,
                format!("a vision projector is for Qwen3.5 models, not {}", self.config.arch.name()),
            ));
        }
        if self.format != ModelFormat::Gguf {
            return Err(Error::malformed(path, "a vision projector goes with a GGUF model"));
        }
        // The text model's RoPE sections are in its metadata, which the
        // configuration leaves out (text alone needs none).
        let text = GgufFile::open(&self.path)?;
        let file = GgufFile::open(path)?;
        let meta = file.metadata();
        let string = |k: &str| meta.get(k).and_then(GgufValue::as_str).unwrap_or_default().to_string();
        let missing = |k: &str| Error::malformed(path, format!("`{k}` is missing from its metadata"));
        let count = |k: &str| -> Result<usize> {
            meta.get(k).and_then(GgufValue::as_u64).map(|v| v as usize).ok_or_else(|| missing(k))
        };
        if string("general.architecture") != "clip" {
            return Err(Error::malformed(path, "is no vision projector (`general.architecture` is not `clip`)"));
        }
        let projector = match meta.get("clip.vision.projector_type").or_else(|| meta.get("clip.projector_type")) {
            Some(v) => v.as_str().unwrap_or_default().to_string(),
            None => return Err(missing("clip.projector_type")),
        };
        if projector != "qwen3vl_merger" {
            return Err(Error::malformed(
                path,
                format!("projector `{projector}` is not supported (supported: qwen3vl_merger, Qwen3.5's tower)"),
            ));
        }
        if let Some(GgufValue::Array(GgufArray::Bool(deep))) = meta.get("clip.vision.is_deepstack_layers")
            && deep.iter().any(|&d| d)
        {
            return Err(Error::malformed(path, "deep-stack layers (Qwen3-VL) are not supported: Qwen3.5 has none"));
        }
        let width = count("clip.vision.projection_dim")?;
        if width != self.config.hidden_size {
            return Err(Error::malformed(
                path,
                format!(
                    "is no projector for {}: its tokens are {width} wide, the model's {}",
                    self.path.display(),
                    self.config.hidden_size
                ),
            ));
        }
        let tok = self.tokenizer.as_ref().ok_or_else(|| Error::malformed(&self.path, "has no tokenizer"))?;
        let id = |t: &str| {
            tok.token_to_id(t).ok_or_else(|| Error::malformed(&self.path, format!("its tokenizer has no `{t}`")))
        };
        let frame = (file.tensor_info(PATCH_FRAMES[0]).map(|i| i.shape.clone()))
            .ok_or_else(|| Error::tensor(PATCH_FRAMES[0], format!("missing from {}", path.display())))?;
        let positions = file.tensor_info("v.position_embd.weight").map(|i| i.shape[0]);
        let vision = VisionConfig {
            depth: count("clip.vision.block_count")?,
            hidden_size: count("clip.vision.embedding_length")?,
            intermediate_size: count("clip.vision.feed_forward_length")?,
            num_heads: count("clip.vision.attention.head_count")?,
            patch_size: count("clip.vision.patch_size")?,
            temporal_patch_size: PATCH_FRAMES.len(),
            spatial_merge_size: count("clip.vision.spatial_merge_size")?,
            in_channels: frame.get(1).copied().unwrap_or(0),
            out_hidden_size: width,
            num_position_embeddings: positions.ok_or_else(|| missing("v.position_embd.weight"))?,
            rope_theta: TOWER_ROPE_THETA,
            image_token_id: id("<|image_pad|>")?,
            vision_start_token_id: id("<|vision_start|>")?,
            vision_end_token_id: id("<|vision_end|>")?,
        };
        vision.check().map_err(|e| Error::malformed(path, e.to_string()))?;
        let arch = text.architecture().unwrap_or_default().to_string();
        let sections_key = format!("{arch}.rope.dimension_sections");
        let sections: Vec<usize> = match text.metadata().get(&sections_key).and_then(GgufValue::as_array) {
            Some(GgufArray::I32(v)) => v.iter().map(|&x| x.max(0) as usize).collect(),
            Some(GgufArray::U32(v)) => v.iter().map(|&x| x as usize).collect(),
            _ => return Err(Error::malformed(&self.path, format!("`{sections_key}` is missing from its metadata"))),
        };
        let section = [0, 1, 2].map(|i| sections.get(i).copied().unwrap_or(0));
        if 2 * section.iter().sum::<usize>() != self.config.rotary_dim {
            return Err(Error::malformed(
                &self.path,
                format!(
                    "`{sections_key}` {sections:?} does not cover the {} rotated dimensions",
                    self.config.rotary_dim
                ),
            ));
        }
        let mean_std = |k: &str| match meta.get(k).and_then(GgufValue::as_array) {
            Some(GgufArray::F32(v)) if v.len() == 3 => Ok([v[0], v[1], v[2]]),
            _ => Err(missing(k)),
        };
        let token_pixels = (vision.patch_size * vision.spatial_merge_size).pow(2);
        let processor = ImageProcessorConfig {
            min_pixels: IMAGE_TOKENS.0 * token_pixels,
            max_pixels: IMAGE_TOKENS.1 * token_pixels,
            patch_size: vision.patch_size,
            temporal_patch_size: vision.temporal_patch_size,
            merge_size: vision.spatial_merge_size,
            image_mean: mean_std("clip.vision.image_mean")?,
            image_std: mean_std("clip.vision.image_std")?,
            ..Default::default()
        };
        let mut config = self.config;
        config.mrope = Some(Mrope { section, interleaved: true });
        config.vision = Some(vision);
        let size = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
        let mut files = self.files;
        files.push((path.to_path_buf(), size));
        let source = Box::new(Routed { model: self.source, other: Box::new(Projector(file)), prefix: TOWER });
        Ok(LoadedModel { config, files, source, image_processor: Some(processor), ..self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tower_names_map_to_the_projector() {
        let pairs = [
            ("model.visual.blocks.0.norm1.weight", "v.blk.0.ln1.weight"),
            ("model.visual.blocks.11.attn.qkv.bias", "v.blk.11.attn_qkv.bias"),
            ("model.visual.blocks.3.mlp.linear_fc2.weight", "v.blk.3.ffn_down.weight"),
            ("model.visual.pos_embed.weight", "v.position_embd.weight"),
            ("model.visual.merger.linear_fc2.bias", "mm.2.bias"),
            ("model.visual.merger.norm.weight", "v.post_ln.weight"),
        ];
        for (h, g) in pairs {
            assert_eq!(projector_name(h).as_deref(), Some(g), "{h}");
        }
        for n in ["model.visual.blocks.x.norm1.weight", "model.visual.merger.foo.weight", "model.norm.weight"] {
            assert!(projector_name(n).is_none(), "{n}");
        }
    }
}
