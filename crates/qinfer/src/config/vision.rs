//! The multimodal parts of a config: the vision tower's shape
//! (`vision_config`), the image token ids, and the language model's
//! multimodal rotary sections (`rope_parameters.mrope_section`).

use serde_json::Value;

use super::{get, opt_f32, opt_usize};
use crate::{Error, Result};

/// Qwen3.5's vision tower (transformers' `Qwen3_5VisionConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub in_channels: usize,
    /// Width of the merged tokens (the language model's hidden size).
    pub out_hidden_size: usize,
    /// Entries of the learned position table (a square grid).
    pub num_position_embeddings: usize,
    pub rope_theta: f32,
    /// The placeholder each image token takes in the prompt.
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
    /// Side of the learned position grid.
    pub fn position_grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt() as usize
    }
    /// Values of one patch: channels × temporal patch × patch².
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// The vision tower of a multimodal config (`vision_config` beside
    /// `text_config`); None for text-only configs.
    pub(super) fn parse(outer: &Value) -> Result<Option<Self>> {
        let Some(v) = get(outer, "vision_config") else { return Ok(None) };
        let field = |e: Error| match e {
            Error::Config { field, reason } => Error::config(format!("vision_config.{field}"), reason),
            other => other,
        };
        let act = get(v, "hidden_act").and_then(Value::as_str).unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(Error::config(
                "vision_config.hidden_act",
                format!("`{act}` is not supported (gelu_pytorch_tanh)"),
            ));
        }
        if let Some(rope) = get(v, "rope_parameters")
            && let Some(kind) = get(rope, "rope_type").and_then(Value::as_str)
            && kind != "axial"
        {
            return Err(Error::config(
                "vision_config.rope_parameters.rope_type",
                format!("`{kind}` is not supported (axial)"),
            ));
        }
        let theta = get(v, "rope_parameters").map(|r| opt_f32(r, "rope_theta")).transpose().map_err(field)?.flatten();
        // Fields a config leaves out take transformers' `Qwen3_5VisionConfig` defaults.
        let or = |key: &str, default: usize| opt_usize(v, key).map(|x| x.unwrap_or(default)).map_err(field);
        let token =
            |key: &str, default: u32| -> Result<u32> { Ok(opt_usize(outer, key)?.map_or(default, |t| t as u32)) };
        let c = VisionConfig {
            depth: or("depth", 27)?,
            hidden_size: or("hidden_size", 1152)?,
            intermediate_size: or("intermediate_size", 4304)?,
            num_heads: or("num_heads", 16)?,
            patch_size: or("patch_size", 16)?,
            temporal_patch_size: or("temporal_patch_size", 2)?,
            spatial_merge_size: or("spatial_merge_size", 2)?,
            in_channels: or("in_channels", 3)?,
            out_hidden_size: or("out_hidden_size", 3584)?,
            num_position_embeddings: or("num_position_embeddings", 2304)?,
            rope_theta: theta.unwrap_or(10_000.0),
            image_token_id: token("image_token_id", 248_056)?,
            vision_start_token_id: token("vision_start_token_id", 248_053)?,
            vision_end_token_id: token("vision_end_token_id", 248_054)?,
        };
        c.check()?;
        Ok(Some(c))
    }

    /// Errors naming the field the tower cannot run with.
    pub fn check(&self) -> Result<()> {
        let c = self;
        let side = c.position_grid_side();
        if c.num_heads == 0 || !c.hidden_size.is_multiple_of(c.num_heads) || !c.head_dim().is_multiple_of(4) {
            return Err(Error::config(
                "vision_config.num_heads",
                format!(
                    "{} heads of hidden size {}: need a head size that is a multiple of 4",
                    c.num_heads, c.hidden_size
                ),
            ));
        }
        if side * side != c.num_position_embeddings || side < 2 {
            return Err(Error::config(
                "vision_config.num_position_embeddings",
                format!("{} is not the square of a side of at least 2", c.num_position_embeddings),
            ));
        }
        if c.in_channels != 3 || c.spatial_merge_size == 0 || c.temporal_patch_size == 0 {
            return Err(Error::config(
                "vision_config.in_channels",
                "need 3 channels and positive merge and temporal patch sizes",
            ));
        }
        Ok(())
    }
}

/// Multimodal RoPE: which rotated pairs take the temporal, height and width
/// position of a token (the three are equal for text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mrope {
    /// Pairs per component: temporal, height, width.
    pub section: [usize; 3],
    /// Interleaved (Qwen3-VL, Qwen3.5): pair `i` takes height where
    /// `i % 3 == 1 && i < 3·section[1]`, width where `i % 3 == 2 && i < 3·section[2]`,
    /// temporal otherwise. Otherwise (Qwen2-VL) the sections are contiguous.
    pub interleaved: bool,
}

impl Mrope {
    /// The section of a text config's `rope_parameters` (or `rope_scaling`),
    /// checked against the rotated pairs.
    pub(super) fn parse(v: &Value, rotary_dim: usize) -> Result<Option<Self>> {
        let Some(p) = get(v, "rope_parameters").or(get(v, "rope_scaling")) else { return Ok(None) };
        let Some(s) = get(p, "mrope_section") else { return Ok(None) };
        let section: [usize; 3] = serde_json::from_value(s.clone()).map_err(|_| {
            Error::config("rope_parameters.mrope_section", format!("expected three integers, found {s}"))
        })?;
        let interleaved = get(p, "mrope_interleaved").and_then(Value::as_bool).unwrap_or(false);
        if section.iter().sum::<usize>() != rotary_dim / 2 {
            return Err(Error::config(
                "rope_parameters.mrope_section",
                format!("{section:?} does not sum to the {} rotated pairs", rotary_dim / 2),
            ));
        }
        Ok(Some(Mrope { section, interleaved }))
    }

    /// Which component (0 temporal, 1 height, 2 width) rotated pair `i` takes.
    pub fn component(&self, i: usize) -> usize {
        let [t, h, w] = self.section;
        if self.interleaved {
            if i % 3 == 1 && i < 3 * h {
                1
            } else if i % 3 == 2 && i < 3 * w {
                2
            } else {
                0
            }
        } else if i < t {
            0
        } else if i < t + h {
            1
        } else {
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_sections_follow_transformers_slices() {
        // transformers: h takes slice(1, 3·h, 3), w slice(2, 3·w, 3), t the rest.
        let m = Mrope { section: [4, 2, 2], interleaved: true };
        let got: Vec<usize> = (0..8).map(|i| m.component(i)).collect();
        assert_eq!(got, vec![0, 1, 2, 0, 1, 2, 0, 0]);
        let c = Mrope { section: [2, 1, 1], interleaved: false };
        assert_eq!((0..4).map(|i| c.component(i)).collect::<Vec<_>>(), vec![0, 0, 1, 2]);
    }
}
