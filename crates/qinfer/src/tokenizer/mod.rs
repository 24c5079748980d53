//! Text ↔ token ids, and chat templates. Wraps a `tokenizers::Tokenizer` built
//! from a Hugging Face `tokenizer.json` ([`Tokenizer::from_dir`]) or from GGUF
//! metadata ([`gguf::from_metadata`]), and reproduces what transformers does
//! around it: special-token strings, BOS handling, clean-up of tokenization
//! spaces and `apply_chat_template`.

mod chat;
mod cleanup;
pub mod gguf;
mod hf;
mod pyjson;
mod specials;
pub mod stream;
mod strftime;
mod token_bytes;

use std::sync::OnceLock;

pub use chat::{ChatMessage, ChatOptions, ContentPart};

use crate::{Error, Result};
use specials::SpecialTokens;

/// A JSON value printed as Python's `json.dumps(value, ensure_ascii=False)`
/// prints it (`, ` and `: ` separators, Python's floats): how transformers'
/// `tojson` and vLLM's tool-call arguments print JSON.
pub fn python_json(value: &serde_json::Value) -> String {
    pyjson::dumps(&minijinja::Value::from_serialize(value)).unwrap_or_else(|_| value.to_string())
}

/// How `encode(.., add_special_tokens = true)` treats BOS beyond what the
/// tokenizer's own post-processor does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BosRule {
    /// Whatever the post-processor does.
    AsTokenizer,
    /// Make sure the ids start with this BOS (config says `add_bos_token: true`, or GGUF add_bos).
    Ensure(u32),
    /// Drop a BOS the post-processor added (config says `add_bos_token: false`).
    Strip(u32),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    specials: SpecialTokens,
    eos_ids: Vec<u32>,
    bos_rule: BosRule,
    /// Appended when encoding with special tokens (GGUF `add_eos_token`).
    append_eos: Option<u32>,
    /// transformers' `clean_up_tokenization_spaces`.
    clean_up_spaces: bool,
    chat: Option<chat::ChatTemplate>,
    /// A copy of `inner` that does not match special tokens in text, made on
    /// first use by `encode_with(.., parse_special = false)`.
    literal: OnceLock<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .field("bos_rule", &self.bos_rule)
            .field("has_chat_template", &self.has_chat_template())
            .finish()
    }
}

fn tk_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(format!("{what}: {e}"))
}

pub(crate) struct Parts {
    pub inner: tokenizers::Tokenizer,
    pub specials: SpecialTokens,
    pub eos_ids: Vec<u32>,
    pub bos_rule: BosRule,
    pub append_eos: Option<u32>,
    pub clean_up_spaces: bool,
    pub chat_template: Option<String>,
}

impl Tokenizer {
    pub(crate) fn from_parts(p: Parts) -> Result<Tokenizer> {
        // A BOS the post-processor already adds needs no rule.
        let bos_rule = match p.bos_rule {
            BosRule::Ensure(id) | BosRule::Strip(id) => {
                let adds = p.inner.encode("", true).map_err(|e| tk_err("encode", e))?.get_ids().first() == Some(&id);
                match (p.bos_rule, adds) {
                    (BosRule::Ensure(_), true) | (BosRule::Strip(_), false) => BosRule::AsTokenizer,
                    (rule, _) => rule,
                }
            }
            BosRule::AsTokenizer => BosRule::AsTokenizer,
        };
        let chat = p.chat_template.map(chat::ChatTemplate::new).transpose()?;
        Ok(Tokenizer {
            inner: p.inner,
            specials: p.specials,
            eos_ids: p.eos_ids,
            bos_rule,
            append_eos: p.append_eos,
            clean_up_spaces: p.clean_up_spaces,
            chat,
            literal: OnceLock::new(),
        })
    }

    /// Token ids for `text`. Special tokens written in the text (`<|im_start|>`)
    /// become their ids; `add_special_tokens` adds BOS/EOS as the tokenizer is
    /// configured to.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special_tokens, true)
    }

    /// Like [`Tokenizer::encode`]; with `parse_special` false, special
    /// (control) tokens written in the text are tokenized as plain text, as
    /// llama.cpp does with `parse_special = false`. Non-special added tokens
    /// still match.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.inner
        } else {
            self.literal.get_or_init(|| {
                let mut t = self.inner.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = tok.encode(text, add_special_tokens).map_err(|e| tk_err("encode", e))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens {
            match self.bos_rule {
                BosRule::AsTokenizer => {}
                BosRule::Ensure(bos) => ids.insert(0, bos),
                BosRule::Strip(bos) => {
                    if ids.first() == Some(&bos) {
                        ids.remove(0);
                    }
                }
            }
            if let Some(eos) = self.append_eos {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self.decode_raw(ids, skip_special_tokens)?;
        Ok(if self.clean_up_spaces { cleanup::clean_up_tokenization(&text) } else { text })
    }

    /// Decoding without the clean-up pass (the stream decoder applies it itself).
    /// Ids the vocabulary does not know (padding rows of a larger embedding)
    /// decode to nothing, as in transformers.
    pub(crate) fn decode_raw(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| tk_err("decode", e))
    }

    pub(crate) fn clean_up_spaces(&self) -> bool {
        self.clean_up_spaces
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// The same tokenizer with `source` as its chat template, checked for
    /// syntax now.
    pub fn with_chat_template(mut self, source: String) -> Result<Tokenizer> {
        self.chat = Some(chat::ChatTemplate::new(source)?);
        Ok(self)
    }

    /// Each id's bytes below `vocab` (ids the tokenizer lacks: empty) and
    /// whether it is special, for matching tokens against text (a grammar
    /// engine's view of the vocabulary).
    pub fn token_bytes(&self, vocab: usize) -> Result<Vec<(Vec<u8>, bool)>> {
        token_bytes::token_bytes(&self.inner, vocab)
    }

    /// The raw chat template source, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat.as_ref().map(|c| c.source())
    }

    pub fn apply_chat_template(&self, messages: &[ChatMessage], opts: &ChatOptions) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| Error::Template("the tokenizer has no chat template".into()))?;
        chat.render(messages, opts, &self.specials)
    }

    /// Ids that end generation according to the tokenizer (its EOS token; for
    /// GGUF also the end-of-turn token). May be empty.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.specials.bos.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.specials.eos.as_deref()
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
