//! The decoder every model file builds: one pre-norm residual layer shape
//! (transformers' `*DecoderLayer`), a token mixer (softmax attention or Gated
//! DeltaNet) then a feed-forward block (SwiGLU MLP or sparse MoE), laid out
//! as the architecture's [`super::spec::ModelSpec`] says.

mod adapters;
mod batch;
mod mtp;

use std::any::Any;
use std::sync::{Arc, Mutex};

use super::spec::{FeedForwardKind, TextRoot};
use crate::backend::DEVICE_PICK;
use crate::backend::ops::ModelBackend;
use crate::config::rope::Rope;
use crate::config::{LayerKind, ModelConfig};
use crate::formats::TensorSource;
use crate::kv::batch::BatchLayout;
use crate::kv::{KvCache, KvShape};
use crate::layers::attention::Attention;
use crate::layers::block::BlockInput;
use crate::layers::gdn::GatedDeltaNet;
use crate::layers::mlp::Mlp;
use crate::layers::moe::SparseMoe;
use crate::lora::{AdapterId, LoraAdapter};
use crate::models::{
    BatchOutput, BatchState, LanguageModel, Logits, MtpOutput, SequenceState, Snapshot, decode_on_host,
};
use crate::sampling::{RowPick, Sampler};
use crate::tensor::Tensor;
use crate::weights::WeightLoader;
use crate::weights::random::RandomWeights;
use crate::{Error, Result};

enum Mixer<B: ModelBackend> {
    Attention(Attention<B>),
    Linear(GatedDeltaNet<B>),
}

enum FeedForward<B: ModelBackend> {
    Dense(Mlp<B>),
    Sparse(SparseMoe<B>),
}

struct DecoderLayer<B: ModelBackend> {
    input_layernorm: B::Weight,
    mixer: Mixer<B>,
    post_attention_layernorm: B::Weight,
    ffn: FeedForward<B>,
}

pub struct DecoderModel<B: ModelBackend> {
    cfg: ModelConfig,
    backend: B,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Weight,
    /// None when tied to `embed_tokens`.
    lm_head: Option<B::Weight>,
    rope: Rope,
    /// Dropped sequences kept for reuse, where the backend asks for it.
    idle: Option<Arc<IdleSequences<B>>>,
    /// LoRA adapters placed beside the weights.
    adapters: adapters::Adapters<B::Weight>,
    /// The vision tower of a multimodal checkpoint that ships one.
    vision: Option<super::vision::VisionTower<B>>,
    /// The multi-token-prediction head, where asked for.
    mtp: Option<mtp::MtpHead<B>>,
}

impl<B: ModelBackend> DecoderLayer<B> {
    /// Layer `l` (`p`, e.g. `model.layers.3`) with this mixer and feed-forward block.
    fn load(
        ld: &WeightLoader<B>,
        cfg: &ModelConfig,
        p: &str,
        kind: LayerKind,
        ffn: FeedForwardKind,
        l: usize,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let unit_offset = cfg.arch.features().unit_offset_norms;
        let mixer = match kind {
            LayerKind::Attention => Mixer::Attention(Attention::load(ld, &format!("{p}.self_attn"), cfg, l)?),
            LayerKind::LinearAttention => {
                let g = cfg.gdn.as_ref().ok_or_else(|| Error::config("linear_num_key_heads", "missing"))?;
                Mixer::Linear(GatedDeltaNet::load(ld, &format!("{p}.linear_attn"), cfg, g)?)
            }
        };
        let ffn = match (ffn, &cfg.moe) {
            (FeedForwardKind::Sparse, Some(m)) => FeedForward::Sparse(SparseMoe::load(ld, &format!("{p}.mlp"), h, m)?),
            (FeedForwardKind::Sparse, None) => return Err(Error::config("num_experts", "missing")),
            (FeedForwardKind::Dense, _) => {
                FeedForward::Dense(Mlp::load(ld, &format!("{p}.mlp"), h, cfg.intermediate_size)?)
            }
        };
        Ok(DecoderLayer {
            input_layernorm: ld.norm(&format!("{p}.input_layernorm.weight"), h, unit_offset)?,
            mixer,
            post_attention_layernorm: ld.norm(&format!("{p}.post_attention_layernorm.weight"), h, unit_offset)?,
            ffn,
        })
    }
}

/// Where hub checkpoints keep the vision tower.
const VISION_PREFIX: &str = "model.visual.";

/// Most dropped sequences a model keeps.
const MAX_IDLE_SEQUENCES: usize = 4;

/// Dropped sequences (their KV cache, Gated DeltaNet states and recorded
/// steps) kept for the next sequence of the same capacity, on backends that
/// record steps over those buffers ([`crate::backend::Capabilities::reuse_sequences`]): a new
/// request then replays the recordings instead of recording its first steps
/// again (8B q4g64 decode of 128 tokens: 1.4% of its time; 0.6B: 6.6%).
/// Asking for another capacity frees them all, so idle buffers never keep
/// the memory from a sequence that needs it.
struct IdleSequences<B: ModelBackend>(Mutex<Vec<DecoderSequence<B>>>);

impl<B: ModelBackend> IdleSequences<B> {
    fn keep(&self, seq: DecoderSequence<B>) {
        if let Ok(mut idle) = self.0.lock() {
            if idle.len() == MAX_IDLE_SEQUENCES {
                idle.remove(0);
            }
            idle.push(seq);
        }
    }

    /// An idle sequence of `capacity`, if any; otherwise every idle one is freed.
    fn take(&self, capacity: usize) -> Option<DecoderSequence<B>> {
        let mut idle = self.0.lock().ok()?;
        match idle.iter().rposition(|s| s.cache.capacity() == capacity) {
            Some(i) => Some(idle.swap_remove(i)),
            None => {
                idle.clear();
                None
            }
        }
    }
}

/// The source behind random weights: holds nothing, so every layout probe
/// takes the default (per-expert tensors, `model.` prefix, lm_head as the config says).
struct NoTensors;

impl TensorSource for NoTensors {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        Err(Error::tensor(name, "random-weight models have no stored tensors"))
    }
    fn contains(&self, _: &str) -> bool {
        false
    }
    fn names(&self) -> Vec<String> {
        vec![]
    }
    fn raw_tensor(&self, name: &str) -> Result<Tensor> {
        self.tensor(name)
    }
}

/// Whether the x̂·(1+w) norm weights are stored with the 1 already added. mlx-lm's
/// `sanitize` for Qwen3-Next / Qwen3.5 adds it exactly when it also moves the
/// conv1d kernel axis (transformers `[C, 1, K]` → MLX `[C, K, 1]`), and uses the
/// conv shape to tell converted checkpoints from hub ones; so do we.
fn norms_stored_shifted(src: &dyn TensorSource, cfg: &ModelConfig, root: &str) -> Result<bool> {
    let Some(l) = cfg.layer_kinds.iter().position(|k| *k == LayerKind::LinearAttention) else { return Ok(false) };
    let name = format!("{root}layers.{l}.linear_attn.conv1d.weight");
    if !src.contains(&name) {
        return Ok(false);
    }
    let shape = src.tensor(&name)?.shape;
    Ok(shape.len() == 3 && shape[2] == 1 && shape[1] > 1)
}

impl<B: ModelBackend> DecoderModel<B> {
    /// The vision tower, where images run.
    fn tower(&self) -> Result<&super::vision::VisionTower<B>> {
        let Some(tower) = &self.vision else {
            return Err(Error::Invalid(format!(
                "{} (this checkpoint) has no vision tower: it takes no images",
                self.cfg.arch.name()
            )));
        };
        if !self.backend.capabilities().multimodal_positions {
            return Err(Error::Invalid(format!("images are not supported on the {} backend yet", self.backend.name())));
        }
        Ok(tower)
    }

    /// Loads weights by Hugging Face names. `on_tensor` sees each tensor as it is
    /// placed (progress reporting).
    pub fn load(cfg: ModelConfig, src: &dyn TensorSource, backend: B, on_tensor: &dyn Fn(&Tensor)) -> Result<Self> {
        Self::load_with(cfg, src, backend, on_tensor, None)
    }

    /// A model of `cfg`'s shape with made-up weights (see [`RandomWeights`]).
    pub fn random(cfg: ModelConfig, backend: B, weights: RandomWeights) -> Result<Self> {
        Self::load_with(cfg, &NoTensors, backend, &|_| {}, Some(weights))
    }

    fn load_with(
        cfg: ModelConfig,
        src: &dyn TensorSource,
        backend: B,
        on_tensor: &dyn Fn(&Tensor),
        random: Option<RandomWeights>,
    ) -> Result<Self> {
        let spec = super::model_spec(cfg.arch);
        let caps = backend.capabilities();
        if cfg.layer_kinds.contains(&LayerKind::LinearAttention) && !caps.gated_delta_net {
            return Err(Error::Invalid(format!(
                "{} has Gated DeltaNet layers, which the {} backend does not run",
                cfg.arch.name(),
                backend.name()
            )));
        }
        let sparse = (0..cfg.num_layers).any(|l| (spec.feed_forward)(&cfg, l) == FeedForwardKind::Sparse);
        if sparse && !caps.mixture_of_experts {
            return Err(Error::Invalid(format!(
                "{} has mixture-of-experts layers, which the {} backend does not run",
                cfg.arch.name(),
                backend.name()
            )));
        }
        // Before any weight: a KV format the model's heads cannot take fails fast.
        let kv_shape = KvShape { num_layers: cfg.num_layers, num_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim };
        let attention: Vec<bool> = cfg.layer_kinds.iter().map(|k| *k == LayerKind::Attention).collect();
        backend.prepare_kv(kv_shape, &attention)?;
        let TextRoot { root, lm_head: lm_head_name } = spec.text_root(src);
        let unit_offset = cfg.arch.features().unit_offset_norms;
        let norms_shifted = unit_offset && norms_stored_shifted(src, &cfg, root)?;
        let ld = WeightLoader { src, backend: &backend, on_tensor, random, norms_shifted };
        let h = cfg.hidden_size;
        spec.note_unused(src);
        let embed_tokens = ld.get(&format!("{root}embed_tokens.weight"), &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let ffn = (spec.feed_forward)(&cfg, l);
            layers.push(DecoderLayer::load(&ld, &cfg, &format!("{root}layers.{l}"), cfg.layer_kinds[l], ffn, l)?);
        }
        let norm = ld.norm(&format!("{root}norm.weight"), h, unit_offset)?;
        // Some checkpoints declare untied embeddings yet omit lm_head; others
        // say tied and still ship a copy. Use lm_head whenever it exists.
        let lm_head = if src.contains(lm_head_name) || (random.is_some() && !cfg.tie_word_embeddings) {
            Some(ld.get(lm_head_name, &[cfg.vocab_size, h])?)
        } else if cfg.tie_word_embeddings {
            None
        } else {
            return Err(Error::tensor(lm_head_name, "missing and tie_word_embeddings is false"));
        };
        let vision = match &cfg.vision {
            // Random weights (benchmarks) make the tower up too.
            Some(v) if random.is_some() || src.contains(&format!("{VISION_PREFIX}patch_embed.proj.weight")) => {
                Some(super::vision::VisionTower::load(&ld, VISION_PREFIX, v)?)
            }
            _ => None,
        };
        let mtp = match cfg.load_mtp {
            true => Some(mtp::MtpHead::load(&ld, &cfg, (spec.feed_forward)(&cfg, 0))?),
            false => None,
        };
        let rope = Rope::new(&cfg.rope, cfg.rotary_dim).with_mrope(cfg.mrope);
        let idle = backend.capabilities().reuse_sequences.then(|| Arc::new(IdleSequences(Mutex::new(Vec::new()))));
        let adapters = adapters::Adapters::default();
        Ok(DecoderModel { cfg, backend, embed_tokens, layers, norm, lm_head, rope, idle, adapters, vision, mtp })
    }

    /// Runs `tokens` through the model and hands the pass's logits
    /// activations to `finish`; with `sync`, waits for the pass and reports
    /// its failures (without, the caller does).
    fn forward_seq<R>(
        &self,
        seq: &mut DecoderSequence<B>,
        tokens: &[u32],
        logits: Logits,
        sync: bool,
        finish: &mut dyn FnMut(&B::Act) -> Result<R>,
    ) -> Result<R> {
        let b = &self.backend;
        let start = seq.cache.len();
        if start + tokens.len() > seq.cache.capacity() {
            return Err(Error::Invalid(format!(
                "sequence of {} tokens exceeds the context capacity of {}",
                start + tokens.len(),
                seq.cache.capacity()
            )));
        }
        if tokens.is_empty() {
            return Err(Error::Invalid("forward needs at least one token".into()));
        }
        let positions: Vec<usize> = (start..start + tokens.len()).collect();
        // Routing decided on the host (MoE on backends that route there)
        // differs per token: such passes are not replayable.
        let routed_on_host = self.layers.iter().any(|l| match &l.ffn {
            FeedForward::Sparse(moe) => !moe.routes_on_device(b),
            _ => false,
        });
        let active = match seq.adapter {
            Some(id) => self.adapters.active([(0..tokens.len(), Some(id))])?,
            None => adapters::Active::none(),
        };
        // A recorded step would keep one adapter's weights: steps with one run as they come.
        let replayable = tokens.len() == 1 && !routed_on_host && logits == Logits::Last && active.is_empty();
        let DecoderSequence { cache, gdn, step, .. } = seq;
        let out = b.run_step(
            step,
            start,
            tokens,
            replayable,
            &mut || self.layers_forward(cache, gdn, tokens, &positions, logits, &active),
            finish,
        )?;
        cache.set_len(start + tokens.len());
        if sync {
            b.check()?;
        }
        Ok(out)
    }

    /// Embedding, every layer, the final norm and the head: the device work of
    /// one pass, ending in the logits.
    fn layers_forward(
        &self,
        cache: &mut B::Cache,
        gdn: &mut [Option<B::GdnState>],
        tokens: &[u32],
        positions: &[usize],
        logits: Logits,
        active: &adapters::Active<B::Weight>,
    ) -> Result<B::Act> {
        let b = &self.backend;
        let mut h = b.embed(&self.embed_tokens, tokens)?;
        let eps = self.cfg.rms_norm_eps;
        // Each block's input norm is left to its first projection and its
        // output to its last one, which adds into `h` (folded into the
        // matmuls where the backend can); `normed` holds the next input norm
        // when a block's output had to be added apart (MoE), fused with it.
        let mut normed: Option<B::Act> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = BlockInput::new(&h, normed.as_ref(), &layer.input_layernorm, eps);
            let out = match &layer.mixer {
                Mixer::Attention(at) => at.forward(b, &self.cfg, &self.rope, x, cache, positions, &active.mixer(l)),
                Mixer::Linear(net) => {
                    let state = gdn[l].as_mut().expect("every linear-attention layer has a state");
                    net.forward(b, x, state, &active.mixer(l))
                }
            };
            normed = out.add_into(b, &mut h, &layer.post_attention_layernorm, eps);
            let x = BlockInput::new(&h, normed.as_ref(), &layer.post_attention_layernorm, eps);
            let out = match &layer.ffn {
                FeedForward::Dense(mlp) => mlp.forward_block(b, x, &active.ffn(l)),
                FeedForward::Sparse(moe) => moe.forward(b, x),
            };
            let next_norm = self.layers.get(l + 1).map_or(&self.norm, |n| &n.input_layernorm);
            normed = out.add_into(b, &mut h, next_norm, eps);
        }
        let last = |x: B::Act| match logits {
            Logits::Last if b.rows(&x) > 1 => b.last_row(&x),
            _ => x,
        };
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(match normed {
            Some(x) => b.linear(&last(x), head, None),
            None => b.linear_normed(&last(h), &self.norm, eps, head, None),
        })
    }
}

struct DecoderSequence<B: ModelBackend> {
    cache: B::Cache,
    /// Per layer: the Gated DeltaNet state of linear-attention layers.
    gdn: Vec<Option<B::GdnState>>,
    /// The length rolled back to by each restore so far, oldest first.
    rollbacks: Vec<usize>,
    /// The backend's recorded decode steps for this sequence.
    step: B::Step,
    /// Where this sequence's buffers go when it is dropped, if kept.
    idle: Option<Arc<IdleSequences<B>>>,
    /// The LoRA adapter its tokens run with.
    adapter: Option<AdapterId>,
}

impl<B: ModelBackend> Drop for DecoderSequence<B> {
    fn drop(&mut self) {
        if let Some(idle) = self.idle.take() {
            idle.keep(DecoderSequence {
                cache: std::mem::take(&mut self.cache),
                gdn: std::mem::take(&mut self.gdn),
                rollbacks: Vec::new(),
                step: std::mem::take(&mut self.step),
                idle: None,
                adapter: None,
            });
        }
    }
}

impl<B: ModelBackend + 'static> DecoderSequence<B> {
    /// `seq` as this model's sequence type, or an error naming the mix-up.
    fn of(seq: &mut dyn SequenceState) -> Result<&mut Self> {
        seq.as_any_mut()
            .downcast_mut::<Self>()
            .ok_or_else(|| Error::Invalid("sequence state belongs to another model".into()))
    }
}

impl<B: ModelBackend + 'static> SequenceState for DecoderSequence<B> {
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn capacity(&self) -> usize {
        self.cache.capacity()
    }
    fn snapshot(&self) -> Snapshot {
        Snapshot { len: self.cache.len(), epoch: self.rollbacks.len(), state: Box::new(self.gdn.clone()) }
    }
    fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        let gdn = snap
            .state
            .downcast_ref::<Vec<Option<B::GdnState>>>()
            .ok_or_else(|| Error::Invalid("snapshot belongs to another model".into()))?;
        let rolled_below = self.rollbacks.get(snap.epoch..).unwrap_or(&[]).iter().any(|&l| l < snap.len);
        if snap.len > self.cache.len() || rolled_below || snap.epoch > self.rollbacks.len() {
            return Err(Error::Invalid(format!(
                "snapshot at {} tokens is no longer valid for this sequence of {} tokens",
                snap.len,
                self.cache.len()
            )));
        }
        // Recorded steps address the replaced states' buffers (a clone makes
        // new ones); the cache's stay.
        if self.gdn.iter().any(Option::is_some) {
            self.step = B::Step::default();
        }
        self.gdn.clone_from(gdn);
        self.rollbacks.push(snap.len);
        self.cache.set_len(snap.len);
        Ok(())
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<B: ModelBackend + 'static> LanguageModel for DecoderModel<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn device(&self) -> String {
        self.backend.name()
    }
    fn takes_images(&self) -> bool {
        self.vision.is_some() && self.backend.capabilities().multimodal_positions
    }
    fn encode_image(&self, image: &crate::image::PreparedImage) -> Result<Vec<f32>> {
        let tower = self.tower()?;
        self.backend.run_pass(|| {
            let mut e = tower.begin(&self.backend, image)?;
            tower.advance(&self.backend, &mut e, usize::MAX)?.ok_or_else(|| Error::Invalid("tower unfinished".into()))
        })
    }
    fn begin_image(&self, image: Arc<crate::image::PreparedImage>) -> Result<super::ImageEncoding> {
        let tower = self.tower()?;
        tower.check(&image)?;
        Ok(super::ImageEncoding { image: Some(image), state: None, blocks_left: tower.config().depth })
    }
    fn advance_image(&self, e: &mut super::ImageEncoding, blocks: usize) -> Result<Option<Vec<f32>>> {
        let tower = self.tower()?;
        self.backend.run_pass(|| {
            if let Some(image) = e.image.take() {
                e.state = Some(Box::new(tower.begin(&self.backend, &image)?));
            }
            let state = (e.state.as_mut().and_then(|s| s.downcast_mut::<super::vision::Encoding<B::Act>>()))
                .ok_or_else(|| Error::Invalid("an image encoding of another model".into()))?;
            let out = tower.advance(&self.backend, state, blocks.max(1))?;
            e.blocks_left = tower.blocks_left(state);
            Ok(out)
        })
    }
    fn new_batch_state(&self, num_blocks: usize, block_size: usize, state_slots: usize) -> Result<Box<dyn BatchState>> {
        self.new_batch_state_of(num_blocks, block_size, state_slots).map(|s| Box::new(s) as Box<dyn BatchState>)
    }
    fn kv_bytes_per_token(&self) -> usize {
        let layers = self.cfg.num_attention_layers() + usize::from(self.mtp.is_some());
        self.backend.kv_bytes_per_token(layers, self.cfg.kv_dim())
    }
    fn reset_state_slot(&self, state: &mut dyn BatchState, slot: u32) -> Result<()> {
        batch::DecoderBatchState::<B>::of(state)?.reset_slot(&self.backend, slot)
    }
    fn copy_state_slot(&self, state: &mut dyn BatchState, from: u32, to: u32) -> Result<()> {
        batch::DecoderBatchState::<B>::of(state)?.copy_slot(from, to)
    }
    fn read_kv_block(&self, state: &mut dyn BatchState, block: u32) -> Result<Vec<u8>> {
        batch::DecoderBatchState::<B>::of(state)?.read_block(&self.backend, block)
    }
    fn write_kv_block(&self, state: &mut dyn BatchState, block: u32, bytes: &[u8]) -> Result<()> {
        batch::DecoderBatchState::<B>::of(state)?.write_block(&self.backend, block, bytes)
    }
    fn read_state_slot(&self, state: &mut dyn BatchState, slot: u32) -> Result<Vec<u8>> {
        batch::DecoderBatchState::<B>::of(state)?.read_slot(&self.backend, slot)
    }
    fn write_state_slot(&self, state: &mut dyn BatchState, slot: u32, bytes: &[u8]) -> Result<()> {
        batch::DecoderBatchState::<B>::of(state)?.write_slot(&self.backend, slot, bytes)
    }
    fn forward_batch(
        &self,
        state: &mut dyn BatchState,
        tokens: &[u32],
        batch: &BatchLayout,
        picks: &[Option<RowPick>],
    ) -> Result<BatchOutput> {
        if !picks.is_empty() && picks.len() != batch.logits_rows.len() {
            let n = batch.logits_rows.len();
            return Err(Error::Invalid(format!("batch: {} picks for {n} logits rows", picks.len())));
        }
        let state = batch::DecoderBatchState::<B>::of(state)?;
        let b = &self.backend;
        b.run_pass(|| {
            if let Some(padded) = self.recorded_rows(state, batch, picks) {
                let picks = self.forward_batch_recorded(state, tokens, batch, picks, padded)?;
                b.check()?;
                return Ok(BatchOutput { picks, ..Default::default() });
            }
            let batch::BatchHeads { logits, hidden } = self.forward_batch_of(state, tokens, batch)?;
            let (picks, logits) = match logits {
                Some(l) => batch::pick_rows(b, &l, picks)?,
                None => (Vec::new(), Vec::new()),
            };
            let out = BatchOutput { picks, logits, hidden: hidden.map(|h| b.to_host(&h)).unwrap_or_default() };
            b.check()?;
            Ok(out)
        })
    }
    fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }
    fn mtp_forward(
        &self,
        state: &mut dyn BatchState,
        tokens: &[u32],
        hidden: &[f32],
        batch: &BatchLayout,
        pick: bool,
    ) -> Result<MtpOutput> {
        let state = batch::DecoderBatchState::<B>::of(state)?;
        let b = &self.backend;
        b.run_pass(|| {
            let mut out = MtpOutput::default();
            if let Some((logits, y)) = self.mtp_forward_of(state, tokens, hidden, batch)? {
                out.hidden = b.to_host(&y);
                if pick {
                    let greedy = RowPick { params: Default::default(), penalized: Vec::new(), u: 0.0 };
                    let picks = vec![Some(greedy); batch.logits_rows.len()];
                    out.picks = batch::pick_rows(b, &logits, &picks)?.0;
                } else {
                    out.logits = b.to_host(&logits);
                }
            }
            b.check()?;
            Ok(out)
        })
    }
    fn new_sequence(&self, capacity: usize) -> Box<dyn SequenceState> {
        if let Some(mut seq) = self.idle.as_ref().and_then(|idle| idle.take(capacity)) {
            seq.cache.set_len(0);
            for state in seq.gdn.iter_mut().flatten() {
                self.backend.clear_gdn_state(state);
            }
            seq.idle = self.idle.clone();
            seq.adapter = None;
            return Box::new(seq);
        }
        let gdn = self
            .cfg
            .layer_kinds
            .iter()
            .map(|k| match (k, &self.cfg.gdn) {
                (LayerKind::LinearAttention, Some(g)) => Some(self.backend.new_gdn_state(g)),
                _ => None,
            })
            .collect();
        Box::new(DecoderSequence::<B> {
            cache: self.backend.new_cache(self.cfg.num_layers, self.cfg.kv_dim(), capacity),
            gdn,
            rollbacks: Vec::new(),
            step: B::Step::default(),
            idle: self.idle.clone(),
            adapter: None,
        })
    }
    fn add_adapter(&self, adapter: &LoraAdapter) -> Result<AdapterId> {
        Ok(self.adapters.insert(self.place_adapter(adapter)?))
    }
    fn has_adapter(&self, id: AdapterId) -> bool {
        self.adapters.usable(id)
    }
    fn release_adapters(&self, in_use: &[AdapterId]) {
        self.adapters.release(in_use)
    }
    fn remove_adapter(&self, id: AdapterId) -> Result<()> {
        self.adapters.remove(id)
    }
    fn set_adapter(&self, seq: &mut dyn SequenceState, id: Option<AdapterId>) -> Result<()> {
        if let Some(id) = id
            && !self.adapters.usable(id)
        {
            return Err(Error::Invalid(format!("no LoRA adapter {id} is loaded")));
        }
        DecoderSequence::<B>::of(seq)?.adapter = id;
        Ok(())
    }
    fn forward(&self, seq: &mut dyn SequenceState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let seq = DecoderSequence::<B>::of(seq)?;
        let b = &self.backend;
        b.run_pass(|| self.forward_seq(seq, tokens, logits, true, &mut |out| Ok(b.to_host(out))))
    }
    fn forward_sample(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
        sampler: &mut Sampler,
        context: &[u32],
    ) -> Result<u32> {
        let seq = DecoderSequence::<B>::of(seq)?;
        let b = &self.backend;
        if sampler.params().host_only() {
            // The bias and the counts of generated tokens live on the host.
            let mut logits =
                b.run_pass(|| self.forward_seq(seq, tokens, Logits::Last, true, &mut |out| Ok(b.to_host(out))))?;
            return Ok(sampler.sample(&mut logits, context));
        }
        let penalized = sampler.penalized(context);
        let u = sampler.draw();
        let params = sampler.params();
        b.run_pass(|| {
            self.forward_seq(seq, tokens, Logits::Last, true, &mut |out| b.sample(out, params, &penalized, u))
        })
    }
    fn decode(
        &self,
        seq: &mut dyn SequenceState,
        first: u32,
        feeds: usize,
        sampler: &mut Sampler,
        context: &mut Vec<u32>,
        on_pick: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        let dseq = DecoderSequence::<B>::of(seq)?;
        // A step started past the last accepted pick is left out by rolling
        // the cache back; Gated DeltaNet states cannot roll back, and the
        // penalties need each pick on the host before the next.
        let ahead = self.backend.capabilities().sample_ahead
            && dseq.gdn.iter().all(Option::is_none)
            && sampler.params().repetition_penalty == 1.0
            && !sampler.params().host_only();
        if !ahead {
            return decode_on_host(self, dseq, first, feeds, sampler, context, on_pick);
        }
        let b = &self.backend;
        let params = sampler.params().clone();
        let (mut token, mut fed, mut pending) = (first, 0, None);
        loop {
            // Start the next step, fed by the pick still on the device...
            let started = if fed < feeds {
                let undo = sampler.clone();
                let u = sampler.draw();
                let next_start = dseq.cache.len() + 1;
                let finish = &mut |out: &B::Act| b.sample_ahead(out, &params, u, next_start);
                let ticket = b.run_pass(|| self.forward_seq(dseq, &[token], Logits::Last, false, finish))?;
                (token, fed) = (DEVICE_PICK, fed + 1);
                Some((ticket, undo))
            } else {
                None
            };
            // ...then read the pick before it while that step runs.
            if let Some(ticket) = pending {
                let pick = b.picked(ticket)?;
                context.push(pick);
                if !on_pick(pick)? {
                    // The step started after this pick never happened,
                    // its draw included.
                    if let Some((_, undo)) = started {
                        dseq.cache.set_len(dseq.cache.len() - 1);
                        *sampler = undo;
                    }
                    break;
                }
            }
            match started {
                Some((ticket, _)) => pending = Some(ticket),
                None => break,
            }
        }
        b.check()
    }
}
