//! Rotary position embedding frequencies, computed as transformers does
//! (`_compute_default_rope_parameters`, `_compute_llama3_parameters`): in f32.

use crate::config::vision::Mrope;
use crate::config::{RopeConfig, RopeScaling, RopeStyle};

#[derive(Debug, Clone)]
pub struct Rope {
    /// One inverse frequency per rotated pair: `rotary_dim / 2` entries.
    pub inv_freq: Vec<f32>,
    pub style: RopeStyle,
    /// Dimensions rotated at the start of each head (= head_dim for full rotary).
    pub rotary_dim: usize,
    /// Where a token's temporal, height and width positions go (multimodal models).
    pub mrope: Option<Mrope>,
}

impl Rope {
    pub fn new(cfg: &RopeConfig, rotary_dim: usize) -> Self {
        let half = rotary_dim / 2;
        let mut inv_freq: Vec<f32> =
            (0..half).map(|i| 1.0 / cfg.theta.powf((2 * i) as f32 / rotary_dim as f32)).collect();
        if let Some(scaling) = &cfg.scaling {
            match *scaling {
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                    let old = original_max_position as f32;
                    let low_wavelen = old / low_freq_factor;
                    let high_wavelen = old / high_freq_factor;
                    for f in inv_freq.iter_mut() {
                        let wavelen = 2.0 * std::f32::consts::PI / *f;
                        let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        *f = if medium {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        };
                    }
                }
            }
        }
        Rope { inv_freq, style: cfg.style, rotary_dim, mrope: None }
    }

    /// The same frequencies with multimodal sections.
    pub fn with_mrope(self, mrope: Option<Mrope>) -> Self {
        Rope { mrope, ..self }
    }

    /// (cos, sin) of every pair's angle for a token at temporal, height and
    /// width positions `pos`: each pair takes its section's component.
    /// Without sections, the temporal position (all three are equal for text).
    pub fn cos_sin_multimodal(&self, pos: [u32; 3], cos: &mut [f32], sin: &mut [f32]) {
        for (i, f) in self.inv_freq.iter().enumerate() {
            let p = pos[self.mrope.map_or(0, |m| m.component(i))];
            let angle = (p as f32 * *f) as f64;
            cos[i] = angle.cos() as f32;
            sin[i] = angle.sin() as f32;
        }
    }

    /// (cos, sin) of every pair's angle at `pos`; the angle is an f32 product as in the reference.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = (pos as f32 * *f) as f64;
            cos[i] = angle.cos() as f32;
            sin[i] = angle.sin() as f32;
        }
    }

    /// Rotates one head in place.
    pub fn apply(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.rotary_dim / 2;
        match self.style {
            RopeStyle::Neox => {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = b * cos[i] + a * sin[i];
                }
            }
        }
    }
}
