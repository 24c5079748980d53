//! Anthropic's `/v1/messages` (and its event stream: `message_start`,
//! `content_block_start`, `ping`, `content_block_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`) and `/v1/messages/count_tokens`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use qinfer::engine::request::{FinishReason, Request, StopConditions, Usage};
use qinfer::tokenizer::ChatMessage;
use serde_json::{Value, json};

use crate::AppState;
use crate::error::{ApiError, ApiResult, Flavor};
use crate::openai::{chat_prompt, collect, sampling, sse, submit_n, tokenizer};
use crate::params::Body;

const F: Flavor = Flavor::Anthropic;

/// Text of a `content` (or `system`): a string or text blocks.
fn text_of(b: &Body<'_>, field: &str, v: &Value) -> ApiResult<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|blk| match (blk.get("type").and_then(Value::as_str), blk.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                (Some(kind), _) => Err(b.bad(field, format!("has a `{kind}` block; only text blocks are supported"))),
                _ => Err(b.bad(field, "has a block without `type`")),
            })
            .collect::<ApiResult<Vec<String>>>()
            .map(|t| t.concat()),
        _ => Err(b.bad(field, "must be a string or an array of content blocks")),
    }
}

/// The conversation as the chat template takes it: `system` first, then the turns.
fn conversation(b: &Body<'_>) -> ApiResult<Vec<ChatMessage>> {
    let mut out = Vec::new();
    if let Some(sys) = b.get("system") {
        out.push(ChatMessage::new("system", text_of(b, "system", sys)?));
    }
    let items = b.get("messages").and_then(Value::as_array).ok_or_else(|| b.bad("messages", "must be an array"))?;
    if items.is_empty() {
        return Err(b.bad("messages", "must hold at least one message"));
    }
    for (i, m) in items.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => return Err(b.bad(&field, "needs `role` \"user\" or \"assistant\"")),
        };
        let content = m.get("content").ok_or_else(|| b.bad(&field, "needs `content`"))?;
        out.push(ChatMessage::new(role, text_of(b, &format!("{field}.content"), content)?));
    }
    Ok(out)
}

fn refuse_unsupported(b: &Body<'_>) -> ApiResult<()> {
    b.refuse("tools", |v| v.as_array().is_some_and(|a| a.is_empty()), "tool use is not parsed yet")?;
    b.refuse("tool_choice", |v| v.get("type") == Some(&json!("none")), "tool use is not parsed yet")?;
    b.refuse("thinking", |v| v.get("type") == Some(&json!("disabled")), "thinking budgets are not enforced yet")
}

fn stop_reason(finish: FinishReason, stop: &Option<String>) -> &'static str {
    match (finish, stop) {
        (FinishReason::Stop, Some(_)) => "stop_sequence",
        (FinishReason::Stop, None) => "end_turn",
        (FinishReason::Length, _) => "max_tokens",
        (FinishReason::Abort, _) => "end_turn",
    }
}

fn event(name: &str, v: Value) -> Event {
    Event::default().event(name).data(v.to_string())
}

pub async fn messages(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    ready.check_generates(F)?;
    let v = crate::params::Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    state.check_model(F, b.str("model")?)?;
    refuse_unsupported(&b)?;
    let max_tokens = match b.i64("max_tokens")? {
        Some(m) if m >= 1 => m as usize,
        Some(_) => return Err(b.bad("max_tokens", "must be at least 1")),
        None => return Err(b.bad("max_tokens", "is required")),
    };
    let prompt = chat_prompt(tokenizer(ready, F)?, &conversation(&b)?, None, F)?;
    let limit = ready.engine.config().max_model_len;
    if prompt.len() + max_tokens > limit {
        return Err(b.bad(
            "max_tokens",
            format!("with a prompt of {} tokens exceeds this model's context of {limit}", prompt.len()),
        ));
    }
    let sampling = sampling(&b, &ready.defaults, 1.0)?;
    let stop = StopConditions {
        max_tokens,
        stop_token_ids: ready.stop_token_ids.clone(),
        stop: if b.get("stop_sequences").is_some() { b.strings("stop_sequences")? } else { Vec::new() },
    };
    let stream = b.bool("stream")?;
    state.admit(F, ready)?;
    let cache_salt = crate::openai::cache_salt(&b)?;
    let mut subs = submit_n(ready, Request { prompt, sampling, stop, cache_salt, ..Default::default() }, 1, F)?;
    let sub = subs.pop().expect("one submission");
    let (id, model) = (state.id("msg"), state.opts.served_model_name.clone());
    if !stream {
        let c = collect(sub, F).await?;
        return Ok(axum::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": c.text}],
            "stop_reason": stop_reason(c.finish, &c.stop_string),
            "stop_sequence": c.stop_string,
            "usage": usage_json(&c.usage),
        }))
        .into_response());
    }
    Ok(sse(move |tx| async move {
        let mut sub = sub;
        let send = |name: &str, v: Value| event(name, v);
        // The message starts with the first output, once the prefix cache's
        // share of the prompt is known.
        let mut started = false;
        while let Some(item) = sub.rx.recv().await {
            let out = match item {
                Ok(o) => o,
                Err(e) => {
                    let err = ApiError::with_status(F, axum::http::StatusCode::INTERNAL_SERVER_ERROR, e);
                    let _ = tx.send(send("error", err.body())).await;
                    return;
                }
            };
            if !std::mem::replace(&mut started, true) {
                let mut usage = usage_json(&out.usage);
                usage["output_tokens"] = json!(0);
                let start = json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": null, "stop_sequence": null, "usage": usage,
                }});
                let block =
                    json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
                for e in [
                    send("message_start", start),
                    send("content_block_start", block),
                    send("ping", json!({"type": "ping"})),
                ] {
                    if tx.send(e).await.is_err() {
                        return;
                    }
                }
            }
            if !out.text.is_empty() {
                let delta = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": out.text}});
                if tx.send(send("content_block_delta", delta)).await.is_err() {
                    return;
                }
            }
            if let Some(f) = out.finish {
                let end = [
                    send("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                    send(
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(f, &out.stop_string), "stop_sequence": out.stop_string},
                        "usage": usage_json(&out.usage)}),
                    ),
                    send("message_stop", json!({"type": "message_stop"})),
                ];
                for e in end {
                    if tx.send(e).await.is_err() {
                        return;
                    }
                }
                return;
            }
        }
    }))
}

pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    let v = crate::params::Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    state.check_model(F, b.str("model")?)?;
    refuse_unsupported(&b)?;
    let prompt = chat_prompt(tokenizer(ready, F)?, &conversation(&b)?, None, F)?;
    Ok(axum::Json(json!({"input_tokens": prompt.len()})).into_response())
}

/// Anthropic's usage: `input_tokens` counts the prompt tokens not read from
/// the cache, `cache_read_input_tokens` those that were.
fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}
