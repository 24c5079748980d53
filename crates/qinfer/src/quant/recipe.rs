//! mlx-lm's mixed-precision recipes (`mlx_lm.convert --quant-predicate`,
//! `mixed_quant_predicate_builder`), following llama.cpp's Q4_K_M choices.

use crate::{Error, Result};

/// `v_proj` and `down_proj` (experts' and shared experts' included) get the
/// high width on the first and last eighth of the layers and on every third
/// layer in between (`i < L/8 or i >= 7L/8 or (i - L/8) % 3 == 2`), `lm_head`
/// always; everything else, routers included, the low width. A recipe replaces
/// the model's own predicate (mlx-lm's 8-bit routers), as it does in mlx-lm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    Mixed2_6,
    Mixed3_4,
    Mixed3_6,
    Mixed4_6,
}

impl Recipe {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "mixed_2_6" => Ok(Recipe::Mixed2_6),
            "mixed_3_4" => Ok(Recipe::Mixed3_4),
            "mixed_3_6" => Ok(Recipe::Mixed3_6),
            "mixed_4_6" => Ok(Recipe::Mixed4_6),
            other => Err(Error::Invalid(format!(
                "unknown recipe `{other}`; expected mixed_2_6, mixed_3_4, mixed_3_6 or mixed_4_6"
            ))),
        }
    }

    /// (low, high) bits.
    fn bits(self) -> (u32, u32) {
        match self {
            Recipe::Mixed2_6 => (2, 6),
            Recipe::Mixed3_4 => (3, 4),
            Recipe::Mixed3_6 => (3, 6),
            Recipe::Mixed4_6 => (4, 6),
        }
    }

    /// Bits for `module` (a weight name without `.weight`). The layer index is
    /// the first numeric path component, 0 when there is none (embeddings,
    /// `lm_head`): where mlx-lm's positional lookup lands for these models.
    pub fn bits_for(self, module: &str, num_layers: usize) -> u32 {
        let (low, high) = self.bits();
        let index = module.split('.').find_map(|p| p.parse::<usize>().ok()).unwrap_or(0);
        let l8 = num_layers / 8;
        let more = index < l8 || index >= 7 * num_layers / 8 || (index as i64 - l8 as i64).rem_euclid(3) == 2;
        let v_like = ["v_proj", "v_a_proj", "v_b_proj"].iter().any(|v| module.contains(v));
        let wants_high = (v_like || module.contains("down_proj")) && more;
        if wants_high || module.contains("lm_head") { high } else { low }
    }
}
