//! What a request to the engine says and what comes back: the prompt, how
//! to sample, when to stop; a stream of outputs ending in a finish reason
//! and the token usage.

pub use crate::image::{ImageLimits, ImageProcessorConfig, PreparedImage, prepare as prepare_image};
pub use crate::lora::{AdapterId, LoraAdapter};
pub use crate::models::vision::expand_placeholders;
pub use crate::sampling::{ConstraintFactory, SamplingParams, TokenConstraint, TokenLogprob};

/// A request's id, unique within one engine.
pub type RequestId = u64;

/// When a request stops generating.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StopConditions {
    /// Most new tokens.
    pub max_tokens: usize,
    /// Token ids that end generation (the model's EOS ids, unless ignored);
    /// the stop token counts as generated but adds no text.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the text stops before the first one.
    pub stop: Vec<String>,
}

/// How a pooling request reduces its prompt's final hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last position's (Qwen3-Embedding).
    Last,
    /// The mean over every position.
    Mean,
    /// The first position's.
    Cls,
}

/// What a request asks of the model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Task {
    /// Generate tokens.
    #[default]
    Generate,
    /// Run the prompt only and return its pooled final normed hidden state
    /// (unnormalized: the caller normalizes and truncates).
    Embed(Pooling),
    /// Run the prompt only and return the last position's logits of these
    /// token ids (a reranker's yes/no).
    Score(Vec<u32>),
}

/// A request: prompt tokens, sampling, stop conditions.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopConditions,
    /// Requests share cached prefixes only with requests of the same salt
    /// (None is a salt of its own).
    pub cache_salt: Option<String>,
    /// Generation, or a prompt-only pooling request (sampling and stop
    /// conditions then unused).
    pub task: Task,
    /// Limits what may be generated (structured output); each sequence of
    /// the request gets its own from this factory.
    pub constraint: Option<std::sync::Arc<dyn ConstraintFactory>>,
    /// The LoRA adapter it runs with (an id from
    /// [`crate::models::LanguageModel::add_adapter`]); None: the base model.
    /// Cached prefixes are shared only among requests of one adapter.
    pub adapter: Option<crate::lora::AdapterId>,
    /// The images of the prompt, in the order of their placeholders (each
    /// a run of the model's image token as long as the image's tokens).
    pub images: Vec<std::sync::Arc<crate::image::PreparedImage>>,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Aborted by its caller.
    Abort,
}

impl FinishReason {
    /// The name OpenAI's API gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Tokens a request used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache, not computed.
    pub cached_tokens: usize,
}

/// One piece of a request's stream: the tokens generated since the last
/// piece and their text (never a split UTF-8 character, never part of a
/// stop string), and on the last piece why it finished.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub id: RequestId,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
    /// The stop string that ended the request, when one did.
    pub stop_string: Option<String>,
    pub usage: Usage,
    /// A pooling request's result (on its one and last output): the pooled
    /// hidden state, or the scores.
    pub pooled: Option<Vec<f32>>,
    /// One per token of `token_ids`, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
}
