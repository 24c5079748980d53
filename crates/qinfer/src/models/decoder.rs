//! The dense decoder family: Llama (`LlamaForCausalLM`), Qwen2 (q/k/v bias) and
//! Qwen3 (per-head q/k RMSNorm before RoPE). Mirrors transformers'
//! `LlamaDecoderLayer` / `Qwen2Attention` / `Qwen3Attention` structure.

use std::any::Any;

use crate::backend::{AttentionShape, Backend, KvCache};
use crate::config::{Architecture, ModelConfig};
use crate::formats::TensorSource;
use crate::models::rope::Rope;
use crate::models::{LanguageModel, Logits, SequenceState};
use crate::tensor::Tensor;
use crate::{Error, Result};

struct Attention<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_bias: Option<B::Weight>,
    k_bias: Option<B::Weight>,
    v_bias: Option<B::Weight>,
    o_bias: Option<B::Weight>,
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
    window: Option<usize>,
}

struct Mlp<B: Backend> {
    gate_proj: B::Weight,
    up_proj: B::Weight,
    down_proj: B::Weight,
}

struct DecoderLayer<B: Backend> {
    input_layernorm: B::Weight,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Weight,
    mlp: Mlp<B>,
}

pub struct DecoderModel<B: Backend> {
    cfg: ModelConfig,
    backend: B,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Weight,
    /// None when tied to `embed_tokens`.
    lm_head: Option<B::Weight>,
    rope: Rope,
}

/// Fetches tensors by name and checks their shapes against the config.
struct Loader<'a, B: Backend> {
    src: &'a dyn TensorSource,
    backend: &'a B,
    on_tensor: &'a dyn Fn(&Tensor),
}

impl<B: Backend> Loader<'_, B> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        let t = self.src.tensor(name)?;
        if t.shape != shape {
            return Err(Error::tensor(name, format!("expected shape {shape:?}, found {:?}", t.shape)));
        }
        (self.on_tensor)(&t);
        self.backend.upload(&t)
    }
    fn opt(&self, name: &str, shape: &[usize], present: bool) -> Result<Option<B::Weight>> {
        if present { self.get(name, shape).map(Some) } else { Ok(None) }
    }
}

impl<B: Backend> DecoderModel<B> {
    /// Loads weights by Hugging Face names. `on_tensor` sees each tensor as it is
    /// placed (progress reporting).
    pub fn load(cfg: ModelConfig, src: &dyn TensorSource, backend: B, on_tensor: &dyn Fn(&Tensor)) -> Result<Self> {
        match cfg.arch {
            Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3 => {}
        }
        let ld = Loader { src, backend: &backend, on_tensor };
        let (h, q, kv, hd, i) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim, cfg.intermediate_size);
        let embed_tokens = ld.get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let bias = cfg.attention_bias;
            layers.push(DecoderLayer {
                input_layernorm: ld.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                self_attn: Attention {
                    q_proj: ld.get(&format!("{a}.q_proj.weight"), &[q, h])?,
                    k_proj: ld.get(&format!("{a}.k_proj.weight"), &[kv, h])?,
                    v_proj: ld.get(&format!("{a}.v_proj.weight"), &[kv, h])?,
                    o_proj: ld.get(&format!("{a}.o_proj.weight"), &[h, q])?,
                    q_bias: ld.opt(&format!("{a}.q_proj.bias"), &[q], bias)?,
                    k_bias: ld.opt(&format!("{a}.k_proj.bias"), &[kv], bias)?,
                    v_bias: ld.opt(&format!("{a}.v_proj.bias"), &[kv], bias)?,
                    o_bias: ld.opt(&format!("{a}.o_proj.bias"), &[h], cfg.o_bias)?,
                    q_norm: ld.opt(&format!("{a}.q_norm.weight"), &[hd], cfg.qk_norm)?,
                    k_norm: ld.opt(&format!("{a}.k_norm.weight"), &[hd], cfg.qk_norm)?,
                    window: cfg.layer_windows[l],
                },
                post_attention_layernorm: ld.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp: Mlp {
                    gate_proj: ld.get(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                    up_proj: ld.get(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                    down_proj: ld.get(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
                },
            });
        }
        let norm = ld.get("model.norm.weight", &[h])?;
        // Some checkpoints declare untied embeddings yet omit lm_head; others
        // say tied and still ship a copy. Use lm_head whenever it exists.
        let lm_head = if src.contains("lm_head.weight") {
            Some(ld.get("lm_head.weight", &[cfg.vocab_size, h])?)
        } else if cfg.tie_word_embeddings {
            None
        } else {
            return Err(Error::tensor("lm_head.weight", "missing and tie_word_embeddings is false"));
        };
        let rope = Rope::new(&cfg.rope, cfg.head_dim);
        Ok(DecoderModel { cfg, backend, embed_tokens, layers, norm, lm_head, rope })
    }

    fn attention_block(&self, layer: usize, x: &B::Act, cache: &mut B::Cache, positions: &[usize]) -> B::Act {
        let b = &self.backend;
        let at = &self.layers[layer].self_attn;
        let eps = self.cfg.rms_norm_eps;
        let mut q = b.linear(x, &at.q_proj, at.q_bias.as_ref());
        let mut k = b.linear(x, &at.k_proj, at.k_bias.as_ref());
        let v = b.linear(x, &at.v_proj, at.v_bias.as_ref());
        if let (Some(qn), Some(kn)) = (&at.q_norm, &at.k_norm) {
            q = b.rms_norm(&q, qn, eps);
            k = b.rms_norm(&k, kn, eps);
        }
        b.rope(&mut q, self.cfg.head_dim, positions, &self.rope);
        b.rope(&mut k, self.cfg.head_dim, positions, &self.rope);
        b.write_kv(cache, layer, &k, &v);
        let shape = AttentionShape {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            window: at.window,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
        };
        let o = b.attention(&q, cache, layer, &shape);
        b.linear(&o, &at.o_proj, at.o_bias.as_ref())
    }

    fn forward_cache(&self, cache: &mut B::Cache, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let b = &self.backend;
        let start = cache.len();
        if start + tokens.len() > cache.capacity() {
            return Err(Error::Invalid(format!(
                "sequence of {} tokens exceeds the context capacity of {}",
                start + tokens.len(),
                cache.capacity()
            )));
        }
        if tokens.is_empty() {
            return Err(Error::Invalid("forward needs at least one token".into()));
        }
        let positions: Vec<usize> = (start..start + tokens.len()).collect();
        let mut h = b.embed(&self.embed_tokens, tokens)?;
        let eps = self.cfg.rms_norm_eps;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = b.rms_norm(&h, &layer.input_layernorm, eps);
            let a = self.attention_block(l, &x, cache, &positions);
            b.add_assign(&mut h, &a);
            let x = b.rms_norm(&h, &layer.post_attention_layernorm, eps);
            let g = b.linear(&x, &layer.mlp.gate_proj, None);
            let u = b.linear(&x, &layer.mlp.up_proj, None);
            let m = b.linear(&b.silu_mul(&g, &u), &layer.mlp.down_proj, None);
            b.add_assign(&mut h, &m);
        }
        cache.set_len(start + tokens.len());
        let h = match logits {
            Logits::Last => b.last_row(&h),
            Logits::All => h,
        };
        let h = b.rms_norm(&h, &self.norm, eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(b.to_host(&b.linear(&h, head, None)))
    }
}

struct DecoderSequence<C: KvCache> {
    cache: C,
}

impl<C: KvCache + 'static> SequenceState for DecoderSequence<C> {
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn truncate(&mut self, len: usize) {
        if len < self.cache.len() {
            self.cache.set_len(len);
        }
    }
    fn capacity(&self) -> usize {
        self.cache.capacity()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<B: Backend> LanguageModel for DecoderModel<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn device(&self) -> String {
        self.backend.name()
    }
    fn new_sequence(&self, capacity: usize) -> Box<dyn SequenceState> {
        Box::new(DecoderSequence { cache: self.backend.new_cache(self.cfg.num_layers, self.cfg.kv_dim(), capacity) })
    }
    fn forward(&self, seq: &mut dyn SequenceState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let seq = seq
            .as_any_mut()
            .downcast_mut::<DecoderSequence<B::Cache>>()
            .ok_or_else(|| Error::Invalid("sequence state belongs to another model".into()))?;
        self.forward_cache(&mut seq.cache, tokens, logits)
    }
}
