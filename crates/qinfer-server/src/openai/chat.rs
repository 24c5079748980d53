//! `/v1/chat/completions`: messages (tool calls and results included)
//! through the template; the answer split into reasoning, content and tool
//! calls, whole or streamed.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use qinfer::engine::request::{FinishReason, Usage};
use qinfer::tokenizer::{ChatMessage, ContentPart};
use serde_json::{Value, json};

use super::{F, ask, chat_usage, data};
use crate::chat_prompt::{chat_format, output_constraint, rendered_prompt, tokenizer};
use crate::chat_stream::{ChatStream, Piece, ReasoningTokens};
use crate::error::{ApiError, ApiResult};
use crate::exchange::{collect, merged, sse, submit_n, timed_out, timeout_error};
use crate::images::{self, ImageRef};
use crate::logprobs;
use crate::params::Body;
use crate::structured;
use crate::tools::Tools;
use crate::{AppState, now_secs, openai_finish};

/// Text of a message's `content`: a string, null, or text parts joined.
fn content(
    b: &Body<'_>,
    field: &str,
    v: Option<&Value>,
    images: &mut Vec<ImageRef>,
) -> ApiResult<(String, Vec<ContentPart>)> {
    match v {
        Some(Value::String(s)) => Ok((s.clone(), Vec::new())),
        None | Some(Value::Null) => Ok((String::new(), Vec::new())),
        Some(Value::Array(items)) => {
            let (mut text, mut parts) = (String::new(), Vec::new());
            for (k, p) in items.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        let t = p
                            .get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| b.bad(field, "has a text part without `text`"))?;
                        text.push_str(t);
                        parts.push(ContentPart::Text(t.to_string()));
                    }
                    Some("image_url") => {
                        let at = format!("{field}.content[{k}].image_url");
                        let url = match p.get("image_url") {
                            Some(Value::String(u)) => u.as_str(),
                            Some(o) => o
                                .get("url")
                                .and_then(Value::as_str)
                                .ok_or_else(|| b.bad(&at, "needs a string `url`"))?,
                            None => return Err(b.bad(&at, "is missing")),
                        };
                        images.push(ImageRef::from_url(format!("{at}.url"), url, F)?);
                        parts.push(ContentPart::Image);
                    }
                    Some(kind) => {
                        return Err(
                            b.bad(field, format!("has a `{kind}` part; text and image_url parts are supported"))
                        );
                    }
                    None => return Err(b.bad(field, "has a content part without `type`")),
                }
            }
            // Text alone renders as the string it joins into.
            if !parts.contains(&ContentPart::Image) {
                parts.clear();
            }
            Ok((text, parts))
        }
        Some(_) => Err(b.bad(field, "`content` must be a string or an array of parts")),
    }
}

/// An assistant message's `tool_calls`, with each call's `arguments` JSON
/// string parsed into the object templates expect.
fn tool_calls(b: &Body<'_>, field: &str, v: Option<&Value>) -> ApiResult<Vec<Value>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    let calls = v.as_array().ok_or_else(|| b.bad(field, "`tool_calls` must be an array"))?;
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let at = format!("{field}.tool_calls[{j}]");
            let f = c.get("function").ok_or_else(|| b.bad(&at, "needs `function`"))?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| b.bad(&at, "needs `function.name`"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                    .map_err(|e| b.bad(&at, format!("`function.arguments` is not valid JSON: {e}")))?,
                None | Some(Value::Null) => json!({}),
                Some(v) => v.clone(),
            };
            let mut call = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
            if let Some(id) = c.get("id") {
                call["id"] = id.clone();
            }
            Ok(call)
        })
        .collect()
}

/// The chat messages as the template takes them.
fn messages(b: &Body<'_>, images: &mut Vec<ImageRef>) -> ApiResult<Vec<ChatMessage>> {
    let items = b.get("messages").and_then(Value::as_array).ok_or_else(|| b.bad("messages", "must be an array"))?;
    if items.is_empty() {
        return Err(b.bad("messages", "must hold at least one message"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let field = format!("messages[{i}]");
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| b.bad(&field, "needs a string `role`"))?;
            let text = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_string);
            let (content, parts) = content(b, &field, m.get("content"), images)?;
            Ok(ChatMessage {
                role: role.to_string(),
                content,
                // SGLang and llama.cpp name it `reasoning_content`; vLLM now `reasoning`.
                reasoning_content: text("reasoning_content").or_else(|| text("reasoning")),
                tool_calls: tool_calls(b, &field, m.get("tool_calls"))?,
                tool_call_id: text("tool_call_id"),
                name: text("name"),
                parts,
            })
        })
        .collect()
}

pub async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    ready.check_generates(F)?;
    let v = Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    state.check_model(F, b.str("model")?)?;
    let thinking = match b.get("chat_template_kwargs") {
        None => None,
        Some(Value::Object(kw)) => {
            if let Some(k) = kw.keys().find(|k| *k != "enable_thinking") {
                return Err(b.bad("chat_template_kwargs", format!("has `{k}`; only `enable_thinking` is passed on")));
            }
            kw.get("enable_thinking")
                .map(|t| {
                    t.as_bool().ok_or_else(|| b.bad("chat_template_kwargs", "`enable_thinking` must be a boolean"))
                })
                .transpose()?
        }
        Some(_) => return Err(b.bad("chat_template_kwargs", "must be an object")),
    };
    let tok = tokenizer(ready, F)?;
    let tools = crate::tools::openai(&b)?;
    let rendered = tools.as_ref().and_then(Tools::rendered);
    let mut image_refs = Vec::new();
    let msgs = messages(&b, &mut image_refs)?;
    images::supported(ready.images.as_ref(), &image_refs, F)?;
    let (mut prompt, prompt_text) = rendered_prompt(tok, &msgs, thinking, rendered, F)?;
    let images = images::prepare(ready.images.as_ref(), &image_refs, &mut prompt, F).await?;
    let format = chat_format(tok, &b, tools.as_ref(), &mut prompt, &prompt_text)?;
    let top = logprobs::chat_request(&b)?;
    let mut a = ask(&state, ready, &b, prompt, top)?;
    a.req.images = images;
    if !format.forced.is_empty() && b.get("response_format").is_some() {
        return Err(b.bad("response_format", "cannot be combined with a required or named tool call"));
    }
    a.req.constraint = output_constraint(ready, &b, &format, structured::response_format(&b)?, None)?;
    let tok = ready.engine.tokenizer().cloned();
    state.admit(F, ready)?;
    let subs = submit_n(&state, ready, a.req, a.n, F)?;
    let (id, created) = (state.id("chatcmpl"), now_secs());
    let reasoning = format.reasoning_prompt.is_some();
    if !a.stream {
        let mut choices = Vec::new();
        let mut usage = Vec::new();
        let mut reasoning_tokens = 0;
        for (i, s) in subs.into_iter().enumerate() {
            let c = collect(s, F).await?;
            usage.push(c.usage);
            let mut counter = ReasoningTokens::new(&format);
            counter.push(&c.token_ids);
            reasoning_tokens += counter.count;
            let (w, called) = ChatStream::whole(&format, &c.text);
            let mut message = json!({"role": "assistant", "content": w.content});
            if reasoning {
                message["reasoning_content"] = if w.reasoning.is_empty() { Value::Null } else { json!(w.reasoning) };
            }
            if !w.calls.is_empty() {
                if w.content.is_empty() {
                    message["content"] = Value::Null;
                }
                let calls: Vec<Value> = (w.calls.iter())
                    .map(|(name, args)| json!({"id": state.id("call"), "type": "function", "function": {"name": name, "arguments": args}}))
                    .collect();
                message["tool_calls"] = json!(calls);
            }
            let lps = top.map_or(Value::Null, |_| logprobs::chat(tok.as_deref(), &c.logprobs));
            choices.push(json!({
                "index": i,
                "message": message,
                "finish_reason": chat_finish(c.finish, called),
                "logprobs": lps,
            }));
        }
        return Ok(axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": a.model,
            "choices": choices, "usage": chat_usage(&usage, reasoning.then_some(reasoning_tokens)),
        }))
        .into_response());
    }
    let (stream, guards) = merged(subs);
    let n = a.n;
    Ok(sse(move |tx| async move {
        let guards = guards;
        let chunk = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": a.model, "choices": choices});
        let mut streams = Vec::with_capacity(n);
        let mut thought = vec![ReasoningTokens::new(&format); n];
        for i in 0..n {
            let (cs, first) = ChatStream::new(&format);
            streams.push(cs);
            let role = json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}]);
            let mut events = vec![data(chunk(role))];
            for p in first {
                if let Some(d) = delta(&p, &state) {
                    events
                        .push(data(chunk(json!([{"index": i, "delta": d, "finish_reason": null, "logprobs": null}]))));
                }
            }
            for e in events {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
        }
        let (mut usage, mut done) = (vec![Usage::default(); n], 0);
        futures_util::pin_mut!(stream);
        while let Some((i, item)) = stream.next().await {
            let out = match item {
                Ok(o) => o,
                Err(e) => {
                    let _ = tx
                        .send(data(ApiError::with_status(F, axum::http::StatusCode::INTERNAL_SERVER_ERROR, e).body()))
                        .await;
                    return;
                }
            };
            if timed_out(&out, &guards.timed_out[i]) {
                let _ = tx.send(data(timeout_error(F).body())).await;
                return;
            }
            usage[i] = out.usage;
            thought[i].push(&out.token_ids);
            let mut pieces = streams[i].push(&out.text);
            if out.finish.is_some() {
                pieces.extend(streams[i].finish());
            }
            let mut deltas: Vec<Value> = pieces.iter().filter_map(|p| delta(p, &state)).collect();
            // The tokens' log probabilities ride on the first delta they made
            // (an empty one when their text is still held back).
            let mut lps = match top {
                Some(_) if !out.logprobs.is_empty() => {
                    if deltas.is_empty() {
                        deltas.push(json!({}));
                    }
                    logprobs::chat(tok.as_deref(), &out.logprobs)
                }
                _ => Value::Null,
            };
            for d in deltas {
                let c = json!([{"index": i, "delta": d, "finish_reason": null, "logprobs": lps.take()}]);
                if tx.send(data(chunk(c))).await.is_err() {
                    return;
                }
            }
            if let Some(f) = out.finish {
                let reason = chat_finish(f, streams[i].called());
                let end = json!([{"index": i, "delta": {}, "finish_reason": reason, "logprobs": null}]);
                if tx.send(data(chunk(end))).await.is_err() {
                    return;
                }
                done += 1;
                if done == n {
                    break;
                }
            }
        }
        if a.include_usage {
            let mut last = chunk(json!([]));
            let reasoning_tokens = reasoning.then(|| thought.iter().map(|t| t.count).sum());
            last["usage"] = chat_usage(&usage, reasoning_tokens);
            let _ = tx.send(data(last)).await;
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    }))
}

/// `tool_calls` when the answer called a tool and ended by itself.
fn chat_finish(f: FinishReason, called: bool) -> &'static str {
    if called && f == FinishReason::Stop { "tool_calls" } else { openai_finish(f) }
}

/// A piece of a choice as a streamed delta (a call's id given at its start).
fn delta(p: &Piece, state: &AppState) -> Option<Value> {
    Some(match p {
        Piece::Reasoning(r) => json!({"reasoning_content": r}),
        Piece::Content(c) => json!({"content": c}),
        Piece::ToolStart { index, name } => {
            json!({"tool_calls": [{"index": index, "id": state.id("call"), "type": "function",
                "function": {"name": name, "arguments": ""}}]})
        }
        Piece::ToolArgs { index, delta } => json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
        Piece::ToolEnd { .. } => return None,
    })
}
