//! A request inside the engine: its tokens, how many of them are in the
//! cache, the blocks and state slot that hold them, its sampler and the
//! text streamed so far (held back where a stop string could still begin).

use super::adaptive::Acceptance;
use super::request::{
    FinishReason, Output, Pooling, Request, RequestId, StopConditions, Task, TokenConstraint, TokenLogprob, Usage,
};
use super::speculative::Backoff;
use std::sync::Arc;

use crate::Result;
use crate::kv::blocks::BlockTable;
use crate::kv::prefix::{BlockHashes, PrefixKeys};
use crate::runner::media::Media;
use crate::sampling::Sampler;
use crate::tokenizer::Tokenizer;
use crate::tokenizer::stream::DecodeStream;

pub struct Sequence {
    pub id: RequestId,
    /// The LoRA adapter its rows run with.
    pub adapter: Option<crate::lora::AdapterId>,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys, values and states are in the cache.
    pub computed: usize,
    /// Positions below this are computed as a prompt (the chunked form of
    /// recurrent layers): the prompt, or everything known at a recompute.
    pub prefill_len: usize,
    pub blocks: BlockTable,
    /// The prefix hashes of its full blocks (known tokens).
    pub hashes: BlockHashes,
    /// Its first blocks already named in the prefix cache.
    pub registered: usize,
    /// Prompt tokens its first admission took from the prefix cache (None
    /// before it is admitted).
    pub cached_tokens: Option<usize>,
    pub state_slot: Option<u32>,
    pub sampler: Sampler,
    /// What may be generated next (structured output), when limited.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub stop: StopConditions,
    pub task: Task,
    /// Pooling: the sum of the rows' hidden states so far (mean), or the
    /// pooled row (first, last).
    pub pooled: Vec<f32>,
    /// Times it was preempted.
    pub preemptions: usize,
    /// Draft tokens at the end of `tokens` during a speculative step (0
    /// between steps).
    pub drafts: usize,
    /// What the multi-token-prediction head proposed for its next step.
    pub proposed: Vec<u32>,
    /// When it next proposes drafts.
    pub backoff: Backoff,
    /// How often its drafts were accepted.
    pub acceptance: Acceptance,
    /// Its prompt's images.
    pub media: Option<Arc<Media>>,
    decode: DecodeStream,
    /// Generated text decoded so far, and how much of it was sent.
    text: String,
    sent: usize,
    /// Tokens generated but not yet sent.
    unsent_tokens: Vec<u32>,
    /// The log probabilities of `unsent_tokens`, when asked for.
    unsent_logprobs: Vec<TokenLogprob>,
    /// Longest stop string, in bytes (text held back from the stream).
    hold: usize,
    /// The stop string that ended it (its text is already cut).
    stopped_by: Option<String>,
}

impl Sequence {
    pub fn new(id: RequestId, req: Request, media: Option<Arc<Media>>) -> Result<Self> {
        let sampler = Sampler::new(req.sampling)?;
        let constraint = match &req.constraint {
            Some(f) => Some(f.start().map_err(|e| crate::Error::Invalid(format!("the output constraint: {e}")))?),
            None => None,
        };
        let hold = req.stop.stop.iter().map(String::len).max().unwrap_or(0);
        Ok(Sequence {
            id,
            prompt_len: req.prompt.len(),
            prefill_len: req.prompt.len(),
            tokens: req.prompt,
            computed: 0,
            blocks: BlockTable::default(),
            hashes: BlockHashes::with_media(
                &PrefixKeys { cache_salt: req.cache_salt, adapter: req.adapter },
                media.as_ref().map(|m| m.spans()).unwrap_or_default(),
            ),
            adapter: req.adapter,
            registered: 0,
            cached_tokens: None,
            state_slot: None,
            sampler,
            constraint,
            stop: req.stop,
            task: req.task,
            pooled: Vec::new(),
            preemptions: 0,
            drafts: 0,
            proposed: Vec::new(),
            backoff: Backoff::default(),
            acceptance: Acceptance::default(),
            media,
            decode: DecodeStream::new(true),
            text: String::new(),
            sent: 0,
            unsent_tokens: Vec::new(),
            unsent_logprobs: Vec::new(),
            hold,
            stopped_by: None,
        })
    }

    /// Takes its draft tokens off the end of `tokens` and returns them.
    pub fn drop_drafts(&mut self) -> Vec<u32> {
        let drafts = self.tokens.split_off(self.tokens.len() - self.drafts);
        self.drafts = 0;
        drafts
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens known but not yet in the cache.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        }
    }

    /// Whether it runs its prompt only (pooling, scoring).
    pub fn prompt_only(&self) -> bool {
        self.task != Task::Generate
    }

    /// Takes a pooling step's hidden rows (`width` values each) of positions
    /// `start..`, or a scoring step's scores.
    pub fn pool(&mut self, start: usize, hidden: &[f32], width: usize, scores: Vec<f32>) {
        match &self.task {
            Task::Generate => {}
            Task::Score(_) => {
                if !scores.is_empty() {
                    self.pooled = scores;
                }
            }
            Task::Embed(Pooling::Last) => {
                if !hidden.is_empty() {
                    self.pooled = hidden.to_vec();
                }
            }
            Task::Embed(Pooling::Cls) => {
                if start == 0 && hidden.len() >= width {
                    self.pooled = hidden[..width].to_vec();
                }
            }
            Task::Embed(Pooling::Mean) => {
                if self.pooled.is_empty() {
                    self.pooled = vec![0.0; width];
                }
                for row in hidden.chunks_exact(width.max(1)) {
                    for (s, x) in self.pooled.iter_mut().zip(row) {
                        *s += x;
                    }
                }
            }
        }
    }

    /// A prompt-only request's one output, once its prompt is computed.
    pub fn pooled_output(&mut self) -> Output {
        let mut pooled = std::mem::take(&mut self.pooled);
        if self.task == Task::Embed(Pooling::Mean) {
            let n = self.prompt_len as f32;
            pooled.iter_mut().for_each(|x| *x /= n);
        }
        Output {
            id: self.id,
            token_ids: Vec::new(),
            text: String::new(),
            finish: Some(FinishReason::Stop),
            stop_string: None,
            usage: self.usage(),
            pooled: Some(pooled),
            logprobs: Vec::new(),
        }
    }

    /// Keeps the log probability of the token about to be pushed.
    pub fn push_logprob(&mut self, lp: TokenLogprob) {
        self.unsent_logprobs.push(lp);
    }

    /// Appends a sampled token; returns why the sequence finishes, if it does.
    /// `max_len` is the most positions a sequence may hold.
    pub fn push(&mut self, token: u32, tok: Option<&Tokenizer>, max_len: usize) -> Result<Option<FinishReason>> {
        self.tokens.push(token);
        self.unsent_tokens.push(token);
        if self.stop.stop_token_ids.contains(&token) {
            return Ok(Some(FinishReason::Stop));
        }
        if let Some(tok) = tok
            && let Some(piece) = self.decode.push(tok, token)?
        {
            self.text.push_str(&piece);
            if let Some((at, stop)) = self.find_stop() {
                self.text.truncate(at);
                self.stopped_by = Some(stop);
                return Ok(Some(FinishReason::Stop));
            }
        }
        if self.generated() >= self.stop.max_tokens || self.tokens.len() >= max_len {
            return Ok(Some(FinishReason::Length));
        }
        Ok(None)
    }

    /// Where the first stop string begins in the text not yet sent, if any
    /// (a stop string may start inside text held back, never before it).
    fn find_stop(&self) -> Option<(usize, String)> {
        let from = self.sent.saturating_sub(self.hold);
        let from = (0..=from).rev().find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
        (self.stop.stop.iter())
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (i + from, s.clone())))
            .min_by_key(|(i, _)| *i)
    }

    /// The output since the last one: on `finish`, all that is left (the
    /// decoder flushed, unless a stop string cut the text); otherwise the
    /// text that no stop string can still claim.
    pub fn take_output(&mut self, finish: Option<FinishReason>, tok: Option<&Tokenizer>) -> Result<Output> {
        let end = match finish {
            Some(_) => {
                if self.stopped_by.is_none()
                    && let Some(tok) = tok
                    && let Some(rest) = self.decode.finish(tok)?
                {
                    self.text.push_str(&rest);
                    if let Some((at, stop)) = self.find_stop() {
                        self.text.truncate(at);
                        self.stopped_by = Some(stop);
                    }
                }
                self.text.len()
            }
            None => {
                let mut end = self.text.len().saturating_sub(self.hold.saturating_sub(1));
                while !self.text.is_char_boundary(end) {
                    end -= 1;
                }
                end.max(self.sent)
            }
        };
        let text = self.text[self.sent..end].to_string();
        self.sent = end;
        Ok(Output {
            id: self.id,
            token_ids: std::mem::take(&mut self.unsent_tokens),
            logprobs: std::mem::take(&mut self.unsent_logprobs),
            text,
            finish,
            stop_string: if finish.is_some() { self.stopped_by.clone() } else { None },
            usage: self.usage(),
            pooled: None,
        })
    }
}
