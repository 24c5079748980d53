//! Incremental detokenization for streaming output.
//!
//! A token may end in the middle of a UTF-8 character (byte-level BPE, byte
//! fallback), and some decoders treat the first token of a sequence specially,
//! so tokens cannot be decoded one at a time. Instead a small window of ids is
//! decoded twice — up to the last emitted position and up to the newest id — and
//! only the difference is emitted, once it no longer ends in U+FFFD (an
//! incomplete character). The window then slides forward. With clean-up of
//! tokenization spaces on, text that a clean-up rule could still change is held
//! back until it cannot. The pieces concatenate to `decode(all ids)`, given
//! that [`StreamDecoder::finish`] is called at the end.

use super::Tokenizer;
use super::cleanup::{clean_up_tokenization, safe_split};
use crate::Result;

/// The state of an incremental decode, apart from its tokenizer, so that a
/// long-lived owner (the engine's sequences) can keep one per stream and
/// hand the tokenizer in at each step.
#[derive(Debug, Clone)]
pub struct DecodeStream {
    skip_special_tokens: bool,
    /// Ids from the window start on.
    ids: Vec<u32>,
    /// `ids[..read]` has been emitted (before clean-up).
    read: usize,
    /// Raw text emitted by the window but held back from clean-up.
    held: String,
}

impl DecodeStream {
    pub fn new(skip_special_tokens: bool) -> Self {
        DecodeStream { skip_special_tokens, ids: Vec::new(), read: 0, held: String::new() }
    }

    /// Adds one id; returns newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = tok.decode_raw(&self.ids[..self.read], self.skip_special_tokens)?;
        let now = tok.decode_raw(&self.ids, self.skip_special_tokens)?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(delta) = now.get(before.len()..).map(str::to_string) else {
            return Ok(None);
        };
        // Slide the window: the ids just emitted become its prefix.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(self.emit(tok, delta))
    }

    /// Flushes text still held: a trailing incomplete character (as U+FFFD, like
    /// `decode`) and anything held back for clean-up. Call once generation ends.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let before = tok.decode_raw(&self.ids[..self.read], self.skip_special_tokens)?;
        let now = tok.decode_raw(&self.ids, self.skip_special_tokens)?;
        let mut out = std::mem::take(&mut self.held);
        if let Some(delta) = now.get(before.len()..) {
            out.push_str(delta);
        }
        self.ids.clear();
        self.read = 0;
        if tok.clean_up_spaces() {
            out = clean_up_tokenization(&out);
        }
        Ok((!out.is_empty()).then_some(out))
    }

    fn emit(&mut self, tok: &Tokenizer, delta: String) -> Option<String> {
        if !tok.clean_up_spaces() {
            return Some(delta);
        }
        self.held.push_str(&delta);
        let cut = safe_split(&self.held);
        let out = clean_up_tokenization(&self.held[..cut]);
        self.held.drain(..cut);
        (!out.is_empty()).then_some(out)
    }
}

/// A [`DecodeStream`] with its tokenizer.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    state: DecodeStream,
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tok: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder { tok, state: DecodeStream::new(skip_special_tokens) }
    }

    /// Adds one id; returns newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.state.push(self.tok, id)
    }

    /// Flushes text still held (see [`DecodeStream::finish`]).
    pub fn finish(&mut self) -> Result<Option<String>> {
        self.state.finish(self.tok)
    }
}

impl Tokenizer {
    /// Incremental decoding that skips special tokens, for streaming generated text.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self, true)
    }

    /// Incremental decoding with an explicit choice about special tokens.
    pub fn stream_decoder_with(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}
