//! A prompt's images as the batched forward takes them: where each image's
//! tokens sit in the prompt, the temporal, height and width rotary position
//! of every token of the sequence, and each image's tokens (the vision
//! tower's output), set once the engine has run the tower over it.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::image::PreparedImage;
use crate::kv::batch::InputEmbeds;
use crate::kv::prefix::MediaSpan;
use crate::models::LanguageModel;
use crate::models::vision::rope_positions;
use crate::{Error, Result};

/// One image's tokens in a prompt.
#[derive(Debug)]
pub struct ImageTokens {
    /// Its first token's index in the prompt.
    pub start: usize,
    pub len: usize,
    pub hash: [u8; 32],
    /// `[len, hidden]`: what its tokens' rows take as input.
    embeds: OnceLock<Arc<Vec<f32>>>,
}

#[derive(Debug)]
pub struct Media {
    /// The prompt tokens' three rotary positions.
    positions: Vec<[u32; 3]>,
    /// What later tokens add to their index for their position.
    delta: i64,
    images: Vec<ImageTokens>,
    hidden: usize,
}

impl Media {
    /// Places `images` at the prompt's image placeholders, in order, after
    /// checking that `model` takes them; their tokens come later
    /// ([`Media::set_tokens`]).
    pub fn new(model: &dyn LanguageModel, prompt: &[u32], images: &[Arc<PreparedImage>]) -> Result<Self> {
        let cfg = model.config();
        let vision = match (&cfg.vision, model.takes_images()) {
            (Some(v), true) => v,
            (Some(_), false) => {
                return Err(Error::Invalid(format!(
                    "images are not supported for this model on {} yet (or its checkpoint has no vision tower)",
                    model.device()
                )));
            }
            (None, _) => {
                return Err(Error::Invalid(format!("{} is a text-only model: it takes no images", cfg.arch.name())));
            }
        };
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid).collect();
        let (positions, delta) = rope_positions(prompt, &grids, vision)?;
        let mut placed = Vec::with_capacity(images.len());
        let mut from = 0;
        for img in images {
            let start = from
                + prompt[from..].iter().position(|&t| t == vision.image_token_id).expect("rope_positions found it");
            let len = img.tokens(vision.spatial_merge_size);
            placed.push(ImageTokens { start, len, hash: img.hash, embeds: OnceLock::new() });
            from = start + len;
        }
        Ok(Media { positions, delta, images: placed, hidden: cfg.hidden_size })
    }

    /// Sets image `i`'s tokens, `[len, hidden]`.
    pub fn set_tokens(&self, i: usize, values: Arc<Vec<f32>>) -> Result<()> {
        let img = &self.images[i];
        if values.len() != img.len * self.hidden {
            return Err(Error::Invalid(format!(
                "the vision tower gave {} values for {} tokens of width {}",
                values.len(),
                img.len,
                self.hidden
            )));
        }
        img.embeds.set(values).map_err(|_| Error::Invalid(format!("image {i}'s tokens are already set")))
    }

    /// Image `i`'s hash (of its grid and pixel values).
    pub fn hash(&self, i: usize) -> [u8; 32] {
        self.images[i].hash
    }

    /// Whether every image's tokens are set.
    pub fn ready(&self) -> bool {
        self.images.iter().all(|i| i.embeds.get().is_some())
    }

    /// The rotary positions of the sequence's token at index `i`.
    pub fn position(&self, i: usize) -> [u32; 3] {
        match self.positions.get(i) {
            Some(&p) => p,
            None => [(i as i64 + self.delta) as u32; 3],
        }
    }

    /// The input embeddings of the sequence's tokens `tokens`, which sit at
    /// batch rows from `first_row` on.
    pub fn embeds(&self, tokens: Range<usize>, first_row: usize) -> Vec<InputEmbeds> {
        (self.images.iter())
            .filter_map(|img| {
                let (lo, hi) = (tokens.start.max(img.start), tokens.end.min(img.start + img.len));
                (lo < hi).then(|| InputEmbeds {
                    row: first_row + lo - tokens.start,
                    values: img.embeds.get().expect("a sequence runs once its images are encoded").clone(),
                    take: lo - img.start..hi - img.start,
                })
            })
            .collect()
    }

    /// Where each image's tokens are, for the prefix cache's keys.
    pub fn spans(&self) -> Vec<MediaSpan> {
        self.images.iter().map(|i| MediaSpan { start: i.start, len: i.len, hash: i.hash }).collect()
    }
}

/// One sequence's rows of a batch whose rows carry three rotary positions
/// (once any of its sequences has images): the rows at positions `at` take
/// those positions (equal for a sequence without images), and each row at
/// position p the input of token p + `shift` where that is an image's
/// token: 0 for the model's own rows, 1 for the MTP head's, whose row p
/// takes the token after it. The rows start at batch row `first_row`.
pub fn place_rows(
    media: Option<&Media>,
    at: Range<usize>,
    shift: usize,
    first_row: usize,
    positions: &mut Vec<[u32; 3]>,
    embeds: &mut Vec<InputEmbeds>,
) {
    match media {
        Some(m) => {
            positions.extend(at.clone().map(|p| m.position(p)));
            embeds.extend(m.embeds(at.start + shift..at.end + shift, first_row));
        }
        None => positions.extend(at.map(|p| [p as u32; 3])),
    }
}
