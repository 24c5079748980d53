//! Architectures. Each model places its weights on a [`crate::backend::Backend`]
//! and exposes the object-safe [`LanguageModel`] interface to the engine.

pub mod decoder;
pub mod rope;

use std::any::Any;

use crate::Result;
use crate::config::ModelConfig;

/// Which logits a forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's row: `[vocab]`.
    Last,
    /// Every token's row: `[n_tokens, vocab]`.
    All,
}

/// Everything a sequence carries between forwards (KV caches now; recurrent
/// state for hybrid models later). Owned by the engine, opaque to it.
pub trait SequenceState: Any + Send {
    /// Tokens already processed.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rolls back to the first `len` tokens.
    fn truncate(&mut self, len: usize);
    fn capacity(&self) -> usize;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

pub trait LanguageModel: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// Short description of where it runs.
    fn device(&self) -> String;
    /// A fresh sequence able to hold `capacity` tokens.
    fn new_sequence(&self, capacity: usize) -> Box<dyn SequenceState>;
    /// Appends `tokens` to the sequence and returns logits.
    fn forward(&self, seq: &mut dyn SequenceState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>>;
}
