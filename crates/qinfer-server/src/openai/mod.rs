//! OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions`,
//! streamed as `data: {chunk}` frames ending in `data: [DONE]`; the request
//! fields both endpoints share.

mod chat;
mod completions;

use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use qinfer::engine::request::{Request, SamplingParams, StopConditions, Usage};
use serde_json::{Value, json};

pub use chat::chat;
pub use completions::completions;

use crate::error::{ApiError, ApiResult, Flavor};
use crate::params::Body;
use crate::{AppState, Ready, fresh_seed, now_secs};

const F: Flavor = Flavor::OpenAi;

pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let name = &state.opts.served_model_name;
    let created = now_secs();
    let mut data = vec![json!({"id": name, "object": "model", "created": created, "owned_by": "qinfer"})];
    // LoRA adapters as vLLM lists them: their own id, the base as parent.
    let guard = state.ready.get().map(|r| r.adapters.read().unwrap_or_else(|e| e.into_inner()));
    for a in guard.as_deref().map_or(&[][..], |a| &a[..]) {
        data.push(json!({
            "id": a.name, "object": "model", "created": created, "owned_by": "qinfer",
            "root": a.path.display().to_string(), "parent": name,
        }));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// Sampling from the fields both APIs share, over the model's defaults.
pub fn sampling(b: &Body<'_>, defaults: &SamplingParams, max_temperature: f32) -> ApiResult<SamplingParams> {
    let mut p = defaults.clone();
    if let Some(t) = b.f32_in("temperature", 0.0, max_temperature)? {
        p.temperature = t;
    }
    if let Some(x) = b.f32_in("top_p", 0.0, 1.0)? {
        if x == 0.0 {
            return Err(b.bad("top_p", "must be above 0"));
        }
        p.top_p = x;
    }
    if let Some(k) = b.i64("top_k")? {
        // -1 and 0 both mean off (vLLM's and Anthropic's conventions).
        p.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            _ => return Err(b.bad("top_k", "must be -1, 0 or a positive integer")),
        };
    }
    if let Some(x) = b.f32_in("min_p", 0.0, 1.0)? {
        p.min_p = x;
    }
    if let Some(x) = b.f32_in("repetition_penalty", f32::MIN_POSITIVE, 100.0)? {
        p.repetition_penalty = x;
    }
    p.seed = match b.i64("seed")? {
        Some(s) => s as u64,
        None => fresh_seed(),
    };
    Ok(p)
}

/// OpenAI's `presence_penalty`, `frequency_penalty` (each in [-2, 2]) and
/// `logit_bias` (token ids as strings, each bias in [-100, 100]).
fn penalties(b: &Body<'_>, p: &mut SamplingParams, vocab: usize) -> ApiResult<()> {
    if let Some(x) = b.f32_in("presence_penalty", -2.0, 2.0)? {
        p.presence_penalty = x;
    }
    if let Some(x) = b.f32_in("frequency_penalty", -2.0, 2.0)? {
        p.frequency_penalty = x;
    }
    match b.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            p.logit_bias = map
                .iter()
                .map(|(k, v)| {
                    let id = k.parse::<u32>().ok().filter(|&t| (t as usize) < vocab).ok_or_else(|| {
                        b.bad("logit_bias", format!("key {k:?} is not a token id below the vocabulary's {vocab}"))
                    })?;
                    let bias = v.as_f64().filter(|x| (-100.0..=100.0).contains(x)).ok_or_else(|| {
                        b.bad("logit_bias", format!("the bias of token {k} must be a number between -100 and 100"))
                    })?;
                    Ok((id, bias as f32))
                })
                .collect::<ApiResult<_>>()?;
        }
        Some(_) => return Err(b.bad("logit_bias", "must be an object of token ids to biases")),
    }
    Ok(())
}

/// The fields this server does not implement: refused by name unless they
/// ask for nothing.
fn refuse_unsupported(b: &Body<'_>) -> ApiResult<()> {
    b.refuse("echo", |v| v == &json!(false), "the prompt is not echoed")?;
    b.refuse("suffix", |v| v.as_str() == Some(""), "no suffix insertion")?;
    b.refuse("best_of", |v| v.as_u64() == Some(1), "only 1")
}

fn data(v: Value) -> Event {
    Event::default().data(v.to_string())
}

/// The usage of a request's choices (one prompt, counted once; the prefix
/// cache's share as the first choice found it).
fn usage_json(choices: &[Usage]) -> Value {
    let first = choices.first().copied().unwrap_or_default();
    let (prompt, completion) = (first.prompt_tokens, choices.iter().map(|u| u.completion_tokens).sum::<usize>());
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    })
}

/// A chat's usage, with its reasoning tokens where reasoning is split out.
fn chat_usage(choices: &[Usage], reasoning: Option<usize>) -> Value {
    let mut u = usage_json(choices);
    if let Some(n) = reasoning {
        u["completion_tokens_details"] = json!({"reasoning_tokens": n});
    }
    u
}

/// `cache_salt` (vLLM's extension): requests share cached prefixes only
/// with requests of the same salt.
pub fn cache_salt(b: &Body<'_>) -> ApiResult<Option<String>> {
    match b.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(_) => Err(b.bad("cache_salt", "must be a non-empty string")),
    }
}

/// What a chat or completion request asks for, read before any work.
struct Ask {
    req: Request,
    n: usize,
    stream: bool,
    include_usage: bool,
    model: String,
}

/// `logprobs`: the alternatives asked for (None: no log probabilities).
fn ask(state: &AppState, ready: &Ready, b: &Body<'_>, prompt: Vec<u32>, logprobs: Option<usize>) -> ApiResult<Ask> {
    refuse_unsupported(b)?;
    let mut sampling = sampling(b, &ready.defaults, 2.0)?;
    sampling.logprobs = logprobs;
    penalties(b, &mut sampling, ready.engine.model().config().vocab_size)?;
    let n = b.u64("n")?.unwrap_or(1) as usize;
    if n == 0 || n > state.opts.max_n {
        return Err(b.bad("n", format!("must be between 1 and {}", state.opts.max_n)));
    }
    let limit = ready.engine.config().max_model_len;
    let max_tokens = match (b.i64("max_completion_tokens")?, b.i64("max_tokens")?) {
        (Some(m), _) | (None, Some(m)) if m < 1 => {
            let field = if b.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
            return Err(b.bad(field, "must be at least 1"));
        }
        (Some(m), _) | (None, Some(m)) => m as usize,
        (None, None) => limit.saturating_sub(prompt.len()).max(1),
    };
    if prompt.len() + max_tokens > limit {
        return Err(ApiError::bad_request(
            F,
            Some(if b.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" }),
            format!(
                "this model's context holds {limit} tokens; the prompt has {} and {max_tokens} more were asked for",
                prompt.len()
            ),
        ));
    }
    let stop = b.strings("stop")?;
    let stream = b.bool("stream")?;
    let include_usage = match b.get("stream_options") {
        Some(o) => o.get("include_usage").and_then(Value::as_bool).unwrap_or(false),
        None => false,
    };
    let stop = StopConditions { max_tokens, stop_token_ids: ready.stop_token_ids.clone(), stop };
    let adapter = state.check_model(F, b.str("model")?)?;
    // Responses name what served them: the adapter's name, or the base model's.
    let model = match adapter {
        Some(_) => b.str("model")?.unwrap_or_default().to_string(),
        None => state.opts.served_model_name.clone(),
    };
    let cache_salt = cache_salt(b)?;
    Ok(Ask {
        req: Request { prompt, sampling, stop, cache_salt, adapter, ..Default::default() },
        n,
        stream,
        include_usage,
        model,
    })
}
