//! Architectures, one file each (`llama`, `qwen2`, `qwen3`, `qwen3_moe`,
//! `qwen3_next`, `qwen3_5`) declaring its [`spec::ModelSpec`]; the shared
//! [`decoder`] places the weights on a [`crate::backend::Backend`] and exposes
//! the object-safe [`LanguageModel`] interface to the engine.

pub mod decoder;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod spec;
pub mod vision;

use std::any::Any;
use std::sync::Arc;

use crate::config::{Architecture, ModelConfig};
use crate::kv::batch::BatchLayout;
use crate::lora::{AdapterId, LoraAdapter};
use crate::sampling::{RowPick, Sampler};
use crate::{Error, Result};

/// Which logits a forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's row: `[vocab]`.
    Last,
    /// Every token's row: `[n_tokens, vocab]`.
    All,
}

/// A point in a sequence's history that it can return to: the token count plus
/// a copy of whatever cannot be rolled back by length alone (the linear-attention
/// layers' conv and recurrent state, a few MB at most). KV rows are not copied:
/// they stay valid as long as the sequence is not rolled back below them.
pub struct Snapshot {
    pub(crate) len: usize,
    /// Number of rollbacks the sequence had seen when this was taken.
    pub(crate) epoch: usize,
    pub(crate) state: Box<dyn Any + Send>,
}

impl Snapshot {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Everything a sequence carries between forwards: KV caches for attention
/// layers, conv and recurrent state for linear-attention layers. Owned by the
/// engine, opaque to it.
pub trait SequenceState: Any + Send {
    /// Tokens already processed.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn capacity(&self) -> usize;
    fn snapshot(&self) -> Snapshot;
    /// Returns to `snap`. Fails when the sequence has since been rolled back
    /// below the snapshot (its KV rows may have been overwritten) or when the
    /// snapshot belongs to another sequence type.
    fn restore(&mut self, snap: &Snapshot) -> Result<()>;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// What a batched forward returns.
#[derive(Debug, Clone, Default)]
pub struct BatchOutput {
    /// The picks of the logits rows that came with a [`RowPick`], in order.
    pub picks: Vec<u32>,
    /// `[rows, vocab]`: the logits of the other logits rows, in order.
    pub logits: Vec<f32>,
    /// `[hidden_rows, hidden_size]`: the last layer's output after the final norm.
    pub hidden: Vec<f32>,
}

/// What the multi-token-prediction head returns for a batch.
#[derive(Debug, Clone, Default)]
pub struct MtpOutput {
    /// The greedy pick of each logits row (when picks were asked for).
    pub picks: Vec<u32>,
    /// `[logits_rows, vocab]`: the logits of the batch's logits rows (when
    /// picks were not asked for).
    pub logits: Vec<f32>,
    /// `[logits_rows, hidden_size]`: those rows' output after the head's
    /// final norm (what a chained draft step takes as its hidden state).
    pub hidden: Vec<f32>,
}

/// A model's storage for forwards over many sequences: the paged KV pool
/// and the recurrent-state slots of Gated DeltaNet layers. Owned by the
/// runner, opaque to it.
pub trait BatchState: Any + Send {
    /// Bytes of the KV pool.
    fn kv_bytes(&self) -> usize;
    /// Recurrent-state slots it holds.
    fn state_slots(&self) -> usize;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

pub trait LanguageModel: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// Short description of where it runs.
    fn device(&self) -> String;
    /// Whether [`LanguageModel::encode_image`] works: a vision tower on a
    /// backend that runs image tokens' positions.
    fn takes_images(&self) -> bool {
        false
    }
    /// One image's tokens for the prompt: `[tokens, hidden_size]`, the
    /// vision tower's merged output, fed in place of the image placeholder
    /// tokens' embeddings.
    fn encode_image(&self, image: &crate::image::PreparedImage) -> Result<Vec<f32>> {
        let _ = image;
        Err(Error::Invalid(format!("{} takes no images", self.config().arch.name())))
    }
    /// [`LanguageModel::encode_image`] in steps: checks that the image fits
    /// the tower, and returns it ready for [`LanguageModel::advance_image`].
    fn begin_image(&self, image: Arc<crate::image::PreparedImage>) -> Result<ImageEncoding> {
        let _ = image;
        Err(Error::Invalid(format!("{} takes no images", self.config().arch.name())))
    }
    /// Runs up to `blocks` more of the tower's blocks over the image (at
    /// least one, the patch embedding with the first; the merger with the
    /// last), waiting for the device: the image's tokens once it is through.
    fn advance_image(&self, encoding: &mut ImageEncoding, blocks: usize) -> Result<Option<Vec<f32>>> {
        let _ = (encoding, blocks);
        Err(Error::Invalid(format!("{} takes no images", self.config().arch.name())))
    }
    /// Storage for batched forwards: a KV pool of `num_blocks` blocks of
    /// `block_size` tokens and `state_slots` recurrent-state slots (for
    /// models with Gated DeltaNet layers).
    fn new_batch_state(&self, num_blocks: usize, block_size: usize, state_slots: usize) -> Result<Box<dyn BatchState>> {
        let _ = (num_blocks, block_size, state_slots);
        Err(Error::Invalid(format!("the model on {} does not run batched forwards", self.device())))
    }
    /// Bytes of KV pool one token takes (keys and values of every attention
    /// layer), for sizing a pool.
    fn kv_bytes_per_token(&self) -> usize {
        let cfg = self.config();
        2 * cfg.num_attention_layers() * cfg.kv_dim() * 4
    }
    /// Zeroes the recurrent states in `slot` (a new sequence starts there).
    fn reset_state_slot(&self, state: &mut dyn BatchState, slot: u32) -> Result<()> {
        let _ = (state, slot);
        Err(Error::Invalid("this model keeps no recurrent-state slots".into()))
    }
    /// Copies the recurrent states of slot `from` into slot `to` (a snapshot).
    fn copy_state_slot(&self, state: &mut dyn BatchState, from: u32, to: u32) -> Result<()> {
        let _ = (state, from, to);
        Err(Error::Invalid("this model keeps no recurrent-state slots".into()))
    }
    /// Every attention layer's keys and values of KV block `block`, copied to
    /// host memory (the prefix cache's host tier).
    fn read_kv_block(&self, state: &mut dyn BatchState, block: u32) -> Result<Vec<u8>> {
        let _ = (state, block);
        Err(Error::Invalid(format!("the model on {} does not run batched forwards", self.device())))
    }
    /// Writes bytes [`LanguageModel::read_kv_block`] returned back into `block`.
    fn write_kv_block(&self, state: &mut dyn BatchState, block: u32, bytes: &[u8]) -> Result<()> {
        let _ = (state, block, bytes);
        Err(Error::Invalid(format!("the model on {} does not run batched forwards", self.device())))
    }
    /// The recurrent states of `slot`, copied to host memory.
    fn read_state_slot(&self, state: &mut dyn BatchState, slot: u32) -> Result<Vec<u8>> {
        let _ = (state, slot);
        Err(Error::Invalid("this model keeps no recurrent-state slots".into()))
    }
    /// Writes bytes [`LanguageModel::read_state_slot`] returned into `slot`.
    fn write_state_slot(&self, state: &mut dyn BatchState, slot: u32, bytes: &[u8]) -> Result<()> {
        let _ = (state, slot, bytes);
        Err(Error::Invalid("this model keeps no recurrent-state slots".into()))
    }
    /// One forward over a ragged batch: `tokens` are the batch's rows, laid
    /// out as `batch` says. `picks` has one entry per `batch.logits_rows`
    /// (or none at all): the rows with a [`RowPick`] are picked where the
    /// logits are, and only the others' logits come back. Returns those
    /// picks and logits, and the final normed hidden states of
    /// `batch.hidden_rows`.
    fn forward_batch(
        &self,
        state: &mut dyn BatchState,
        tokens: &[u32],
        batch: &BatchLayout,
        picks: &[Option<RowPick>],
    ) -> Result<BatchOutput> {
        let _ = (state, tokens, batch, picks);
        Err(Error::Invalid(format!("the model on {} does not run batched forwards", self.device())))
    }
    /// Whether the multi-token-prediction head is loaded
    /// ([`crate::config::ModelConfig::load_mtp`]).
    fn has_mtp(&self) -> bool {
        false
    }
    /// The multi-token-prediction head over a batch (laid out as for
    /// [`LanguageModel::forward_batch`], the same block tables): row `i`
    /// joins token `tokens[i]` (the token after the one the target saw
    /// there) with `hidden` row `i` (the target's final normed hidden state
    /// there, or the head's own output for a chained draft), at the row's
    /// position; its keys and values go to the pool's head layer. With
    /// `pick`, the logits rows are picked greedily where the logits are and
    /// only the picks come back.
    fn mtp_forward(
        &self,
        state: &mut dyn BatchState,
        tokens: &[u32],
        hidden: &[f32],
        batch: &BatchLayout,
        pick: bool,
    ) -> Result<MtpOutput> {
        let _ = (state, tokens, hidden, batch, pick);
        Err(Error::Invalid(format!("{} was loaded without a multi-token-prediction head", self.config().arch.name())))
    }
    /// A fresh sequence able to hold `capacity` tokens.
    fn new_sequence(&self, capacity: usize) -> Box<dyn SequenceState>;
    /// Places a LoRA adapter beside the weights (they stay as they are);
    /// sequences and batch rows then name it by the id returned.
    fn add_adapter(&self, adapter: &LoraAdapter) -> Result<AdapterId> {
        let _ = adapter;
        Err(Error::Invalid(format!("{} does not run LoRA adapters", self.config().arch.name())))
    }
    /// Whether adapter `id` is placed.
    fn has_adapter(&self, id: AdapterId) -> bool {
        let _ = id;
        false
    }
    /// Retires an adapter: no new sequence may take it (its id is never
    /// given out again); sequences already running with it go on, and its
    /// weights are freed once [`LanguageModel::release_adapters`] says none
    /// uses it.
    fn remove_adapter(&self, id: AdapterId) -> Result<()> {
        Err(Error::Invalid(format!("no LoRA adapter {id} is loaded")))
    }
    /// Frees the retired adapters that no sequence in `in_use` runs with.
    fn release_adapters(&self, in_use: &[AdapterId]) {
        let _ = in_use;
    }
    /// The adapter `seq`'s next forwards run with (None: the base model).
    fn set_adapter(&self, seq: &mut dyn SequenceState, id: Option<AdapterId>) -> Result<()> {
        let _ = seq;
        match id {
            None => Ok(()),
            Some(id) => Err(Error::Invalid(format!("no LoRA adapter {id} is loaded"))),
        }
    }
    /// Appends `tokens` to the sequence and returns logits.
    fn forward(&self, seq: &mut dyn SequenceState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>>;
    /// Appends `tokens` and returns the token `sampler` picks from the last
    /// one's logits, given every token of the sequence so far (`context`,
    /// for the repetition penalty). Models on a device sample there, so only
    /// the token id comes back.
    fn forward_sample(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
        sampler: &mut Sampler,
        context: &[u32],
    ) -> Result<u32> {
        let mut logits = self.forward(seq, tokens, Logits::Last)?;
        Ok(sampler.sample(&mut logits, context))
    }
    /// Decodes: feeds `first`, then each pick, at most `feeds` tokens. Each
    /// pick is appended to `context` (every token of the sequence so far)
    /// and handed to `on_pick`, which stops decoding by returning false.
    /// Models on a device may start a step before the host has read the pick
    /// it feeds; a step started after the last pick that `on_pick` accepts
    /// is left out of the sequence.
    fn decode(
        &self,
        seq: &mut dyn SequenceState,
        first: u32,
        feeds: usize,
        sampler: &mut Sampler,
        context: &mut Vec<u32>,
        on_pick: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        decode_on_host(self, seq, first, feeds, sampler, context, on_pick)
    }
}

/// [`LanguageModel::decode`] one step at a time, each pick read before the
/// next step starts.
pub fn decode_on_host<M: LanguageModel + ?Sized>(
    model: &M,
    seq: &mut dyn SequenceState,
    first: u32,
    feeds: usize,
    sampler: &mut Sampler,
    context: &mut Vec<u32>,
    on_pick: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    let mut next = first;
    for _ in 0..feeds {
        next = model.forward_sample(seq, &[next], sampler, context)?;
        context.push(next);
        if !on_pick(next)? {
            break;
        }
    }
    Ok(())
}

/// The model file of `arch`.
pub fn model_spec(arch: Architecture) -> &'static spec::ModelSpec {
    match arch {
        Architecture::Llama => &llama::SPEC,
        Architecture::Qwen2 => &qwen2::SPEC,
        Architecture::Qwen3 => &qwen3::SPEC,
        Architecture::Qwen3Moe => &qwen3_moe::SPEC,
        Architecture::Qwen3Next => &qwen3_next::SPEC,
        Architecture::Qwen35 => &qwen3_5::SPEC,
        Architecture::Qwen35Moe => &qwen3_5::SPEC_MOE,
    }
}

/// An image on its way through a model's vision tower
/// ([`LanguageModel::begin_image`]): a few blocks at a time, so that an
/// engine can spread a large image over several steps.
pub struct ImageEncoding {
    /// The image until its patches are embedded.
    pub(crate) image: Option<Arc<crate::image::PreparedImage>>,
    /// The tower's state after that (the model's own type).
    pub(crate) state: Option<Box<dyn Any + Send>>,
    /// Blocks still to run.
    pub blocks_left: usize,
}
