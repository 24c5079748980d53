//! Anthropic's `/v1/messages` (and its event stream: `message_start`,
//! `content_block_start`, `ping`, `content_block_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`) and `/v1/messages/count_tokens`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use qinfer::engine::request::{ConstraintFactory, FinishReason, PreparedImage, Request, StopConditions, Usage};
use qinfer::tokenizer::{ChatMessage, ContentPart};
use serde_json::{Value, json};

use crate::AppState;
use crate::chat_prompt::{chat_format, output_constraint, rendered_prompt, tokenizer};
use crate::chat_stream::{ChatFormat, ChatStream, Piece};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::exchange::{collect, sse, submit_n};
use crate::images::{ImageRef, Source};
use crate::openai::sampling;
use crate::params::Body;
use crate::tool_parser::arguments_object;
use crate::tools::Tools;

const F: Flavor = Flavor::Anthropic;

/// Text of a `content` (or `system`): a string or text blocks.
fn text_of(b: &Body<'_>, field: &str, v: &Value) -> ApiResult<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|blk| match (blk.get("type").and_then(Value::as_str), blk.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                (Some(kind), _) => {
                    Err(b.bad(field, format!("has a `{kind}` block; only text blocks are supported here")))
                }
                _ => Err(b.bad(field, "has a block without `type`")),
            })
            .collect::<ApiResult<Vec<String>>>()
            .map(|t| t.concat()),
        _ => Err(b.bad(field, "must be a string or an array of content blocks")),
    }
}

/// One turn's blocks as chat messages: a user turn's `tool_result` blocks
/// become `tool` messages (in order, text between them a user message); an
/// assistant turn's `thinking` becomes its reasoning and its `tool_use`
/// blocks its calls.
fn turn(
    b: &Body<'_>,
    field: &str,
    role: &str,
    content: &Value,
    out: &mut Vec<ChatMessage>,
    images: &mut Vec<ImageRef>,
) -> ApiResult<()> {
    let Value::Array(blocks) = content else {
        out.push(ChatMessage::new(role, text_of(b, field, content)?));
        return Ok(());
    };
    let mut msg = ChatMessage::new(role, "");
    let mut has_text = false;
    for (k, blk) in blocks.iter().enumerate() {
        let at = format!("{field}[{k}]");
        let s = |key: &str| blk.get(key).and_then(Value::as_str);
        match (role, s("type")) {
            (_, Some("text")) => {
                let t = s("text").ok_or_else(|| b.bad(&at, "needs `text`"))?;
                msg.content.push_str(t);
                msg.parts.push(ContentPart::Text(t.to_string()));
                has_text = true;
            }
            ("user", Some("image")) => {
                let src = blk.get("source").ok_or_else(|| b.bad(&at, "needs `source`"))?;
                let field = format!("{at}.source");
                let image = match src.get("type").and_then(Value::as_str) {
                    Some("base64") => {
                        let data =
                            src.get("data").and_then(Value::as_str).ok_or_else(|| b.bad(&field, "needs `data`"))?;
                        ImageRef { field: format!("{field}.data"), source: Source::Base64(data.to_string()) }
                    }
                    Some("url") => {
                        let url = src.get("url").and_then(Value::as_str).ok_or_else(|| b.bad(&field, "needs `url`"))?;
                        ImageRef::from_url(format!("{field}.url"), url, F)?
                    }
                    _ => return Err(b.bad(&field, "needs `type` \"base64\" or \"url\"")),
                };
                images.push(image);
                msg.parts.push(ContentPart::Image);
                has_text = true;
            }
            ("assistant", Some("thinking")) => {
                let t = s("thinking").ok_or_else(|| b.bad(&at, "needs `thinking`"))?;
                msg.reasoning_content.get_or_insert_with(String::new).push_str(t);
            }
            ("assistant", Some("redacted_thinking")) => {}
            ("assistant", Some("tool_use")) => {
                let id = s("id").ok_or_else(|| b.bad(&at, "needs `id`"))?;
                let name = s("name").ok_or_else(|| b.bad(&at, "needs `name`"))?;
                let input = blk.get("input").cloned().unwrap_or_else(|| json!({}));
                msg.tool_calls
                    .push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            ("user", Some("tool_result")) => {
                if has_text {
                    let mut done = std::mem::replace(&mut msg, ChatMessage::new(role, ""));
                    if !done.parts.contains(&ContentPart::Image) {
                        done.parts.clear();
                    }
                    out.push(done);
                    has_text = false;
                }
                let id = s("tool_use_id").ok_or_else(|| b.bad(&at, "needs `tool_use_id`"))?;
                let text = match blk.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(b, &format!("{at}.content"), c)?,
                };
                let mut m = ChatMessage::new("tool", text);
                m.tool_call_id = Some(id.to_string());
                out.push(m);
            }
            (_, Some(kind)) => {
                return Err(b.bad(&at, format!("is a `{kind}` block, which a {role} turn here cannot hold")));
            }
            (_, None) => return Err(b.bad(&at, "has no `type`")),
        }
    }
    if has_text || role == "assistant" {
        // Text alone renders as the string it joins into.
        if !msg.parts.contains(&ContentPart::Image) {
            msg.parts.clear();
        }
        out.push(msg);
    }
    Ok(())
}

/// The conversation as the chat template takes it: `system` first, then the turns.
fn conversation(b: &Body<'_>, images: &mut Vec<ImageRef>) -> ApiResult<Vec<ChatMessage>> {
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
        turn(b, &format!("{field}.content"), role, content, &mut out, images)?;
    }
    Ok(out)
}

/// `thinking`: `{"type": "disabled"}` turns the template's thinking off;
/// `{"type": "enabled", "budget_tokens": N}` turns it on and caps the
/// reasoning at N tokens (Anthropic's rules: at least 1024, below
/// `max_tokens`). Returns the template's switch and the budget.
fn thinking(b: &Body<'_>, max_tokens: Option<usize>) -> ApiResult<(Option<bool>, Option<usize>)> {
    const F: &str = "thinking";
    let Some(v) = b.get(F) else { return Ok((None, None)) };
    match v.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok((Some(false), None)),
        Some("enabled") => {
            let budget = v
                .get("budget_tokens")
                .and_then(Value::as_u64)
                .ok_or_else(|| b.bad(F, "of type enabled needs an integer `budget_tokens`"))?
                as usize;
            if budget < 1024 {
                return Err(b.bad(F, "`budget_tokens` must be at least 1024"));
            }
            if let Some(m) = max_tokens
                && budget >= m
            {
                return Err(b.bad(F, format!("`budget_tokens` ({budget}) must be less than `max_tokens` ({m})")));
            }
            Ok((Some(true), Some(budget)))
        }
        _ => Err(b.bad(F, "`type` must be \"enabled\" or \"disabled\"")),
    }
}

fn stop_reason(finish: FinishReason, stop: &Option<String>, called: bool) -> &'static str {
    match (finish, stop) {
        (FinishReason::Stop, _) if called => "tool_use",
        (FinishReason::Stop, Some(_)) => "stop_sequence",
        (FinishReason::Stop, None) => "end_turn",
        (FinishReason::Length, _) => "max_tokens",
        (FinishReason::Abort, _) => "end_turn",
    }
}

fn event(name: &str, v: Value) -> Event {
    Event::default().event(name).data(v.to_string())
}

/// A request's prompt, how to read its output, and its reasoning budget as
/// a constraint.
struct Prompt {
    ids: Vec<u32>,
    images: Vec<Arc<PreparedImage>>,
    format: ChatFormat,
    constraint: Option<Arc<dyn ConstraintFactory>>,
}

/// The request's prompt (`max_tokens` None when only counting).
async fn prompt(ready: &crate::Ready, b: &Body<'_>, max_tokens: Option<usize>) -> ApiResult<Prompt> {
    let tok = tokenizer(ready, F)?;
    let tools = crate::tools::anthropic(b)?;
    let rendered = tools.as_ref().and_then(Tools::rendered);
    let (switch, budget) = thinking(b, max_tokens)?;
    let mut refs = Vec::new();
    let msgs = conversation(b, &mut refs)?;
    crate::images::supported(ready.images.as_ref(), &refs, F)?;
    let (mut prompt, text) = rendered_prompt(tok, &msgs, switch, rendered, F)?;
    let images = crate::images::prepare(ready.images.as_ref(), &refs, &mut prompt, F).await?;
    let format = chat_format(tok, b, tools.as_ref(), &mut prompt, &text)?;
    let constraint = output_constraint(ready, b, &format, None, budget)?;
    Ok(Prompt { ids: prompt, images, format, constraint })
}

pub async fn messages(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    ready.check_generates(F)?;
    let v = crate::params::Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    let adapter = state.check_model(F, b.str("model")?)?;
    let max_tokens = match b.i64("max_tokens")? {
        Some(m) if m >= 1 => m as usize,
        Some(_) => return Err(b.bad("max_tokens", "must be at least 1")),
        None => return Err(b.bad("max_tokens", "is required")),
    };
    let Prompt { ids: prompt, images, format, constraint } = prompt(ready, &b, Some(max_tokens)).await?;
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
    let req = Request { prompt, sampling, stop, cache_salt, constraint, adapter, images, ..Default::default() };
    let mut subs = submit_n(&state, ready, req, 1, F)?;
    let sub = subs.pop().expect("one submission");
    let model = match adapter {
        Some(_) => b.str("model")?.unwrap_or_default().to_string(),
        None => state.opts.served_model_name.clone(),
    };
    let id = state.id("msg");
    if !stream {
        let c = collect(sub, F).await?;
        let (w, called) = ChatStream::whole(&format, &c.text);
        let mut content = Vec::new();
        if !w.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": w.reasoning, "signature": signature(&w.reasoning)}));
        }
        if !w.content.is_empty() || w.calls.is_empty() {
            content.push(json!({"type": "text", "text": w.content}));
        }
        for (name, args) in &w.calls {
            content.push(
                json!({"type": "tool_use", "id": state.id("toolu"), "name": name, "input": arguments_object(args)}),
            );
        }
        return Ok(axum::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": stop_reason(c.finish, &c.stop_string, called),
            "stop_sequence": if called { None } else { c.stop_string },
            "usage": usage_json(&c.usage),
        }))
        .into_response());
    }
    Ok(sse(move |tx| async move {
        let mut sub = sub;
        let (mut cs, mut pending) = ChatStream::new(&format);
        let mut blocks = Blocks::default();
        // The message starts with the first output, once the prefix cache's
        // share of the prompt is known.
        let mut started = false;
        while let Some(item) = sub.rx.recv().await {
            let out = match item {
                Ok(o) => o,
                Err(e) => {
                    let err = ApiError::with_status(F, axum::http::StatusCode::INTERNAL_SERVER_ERROR, e);
                    let _ = tx.send(event("error", err.body())).await;
                    return;
                }
            };
            if crate::exchange::timed_out(&out, &sub.timed_out) {
                let _ = tx.send(event("error", crate::exchange::timeout_error(F).body())).await;
                return;
            }
            let mut events = Vec::new();
            if !std::mem::replace(&mut started, true) {
                let mut usage = usage_json(&out.usage);
                usage["output_tokens"] = json!(0);
                let start = json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": null, "stop_sequence": null, "usage": usage,
                }});
                events.push(("message_start", start));
                events.push(("ping", json!({"type": "ping"})));
            }
            pending.extend(cs.push(&out.text));
            if out.finish.is_some() {
                pending.extend(cs.finish());
            }
            for p in pending.drain(..) {
                blocks.piece(p, || state.id("toolu"), &mut events);
            }
            if let Some(f) = out.finish {
                blocks.close(&mut events);
                if blocks.next == 0 {
                    // Every message holds at least one block.
                    blocks.open("text", json!({"type": "text", "text": ""}), &mut events);
                    blocks.close(&mut events);
                }
                let called = cs.called();
                events.push((
                    "message_delta",
                    json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(f, &out.stop_string, called),
                        "stop_sequence": if called { None } else { out.stop_string.clone() }},
                    "usage": usage_json(&out.usage)}),
                ));
                events.push(("message_stop", json!({"type": "message_stop"})));
            }
            for (name, v) in events {
                if tx.send(event(name, v)).await.is_err() {
                    return;
                }
            }
            if out.finish.is_some() {
                return;
            }
        }
    }))
}

/// The content blocks of a streamed message: each piece continues the open
/// block or closes it and opens one of its own kind.
#[derive(Default)]
struct Blocks {
    /// The open block's kind ("thinking", "text", "tool_use").
    open: Option<&'static str>,
    next: usize,
    /// The open thinking block's text, for its signature.
    thinking: String,
}

impl Blocks {
    fn open(&mut self, kind: &'static str, block: Value, events: &mut Vec<(&'static str, Value)>) {
        self.close(events);
        let start = json!({"type": "content_block_start", "index": self.next, "content_block": block});
        events.push(("content_block_start", start));
        self.open = Some(kind);
        self.next += 1;
    }

    fn close(&mut self, events: &mut Vec<(&'static str, Value)>) {
        if self.open == Some("thinking") {
            let thinking = std::mem::take(&mut self.thinking);
            self.delta(json!({"type": "signature_delta", "signature": signature(&thinking)}), events);
        }
        if self.open.take().is_some() {
            events.push(("content_block_stop", json!({"type": "content_block_stop", "index": self.next - 1})));
        }
    }

    fn delta(&self, delta: Value, events: &mut Vec<(&'static str, Value)>) {
        let d = json!({"type": "content_block_delta", "index": self.next - 1, "delta": delta});
        events.push(("content_block_delta", d));
    }

    fn piece(&mut self, p: Piece, tool_id: impl FnOnce() -> String, events: &mut Vec<(&'static str, Value)>) {
        match p {
            Piece::Reasoning(t) => {
                if self.open != Some("thinking") {
                    self.open("thinking", json!({"type": "thinking", "thinking": "", "signature": ""}), events);
                }
                self.thinking.push_str(&t);
                self.delta(json!({"type": "thinking_delta", "thinking": t}), events);
            }
            Piece::Content(t) => {
                if self.open != Some("text") {
                    self.open("text", json!({"type": "text", "text": ""}), events);
                }
                self.delta(json!({"type": "text_delta", "text": t}), events);
            }
            Piece::ToolStart { name, .. } => {
                let block = json!({"type": "tool_use", "id": tool_id(), "name": name, "input": {}});
                self.open("tool_use", block, events);
            }
            Piece::ToolArgs { delta, .. } => {
                if self.open == Some("tool_use") {
                    self.delta(json!({"type": "input_json_delta", "partial_json": delta}), events);
                }
            }
            Piece::ToolEnd { .. } => self.close(events),
        }
    }
}

pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    let v = crate::params::Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    state.check_model(F, b.str("model")?)?;
    let p = prompt(ready, &b, None).await?;
    Ok(axum::Json(json!({"input_tokens": p.ids.len()})).into_response())
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

/// A thinking block's signature: the base64 of a SHA-256 digest of its
/// text. Anthropic's are opaque and checked when a block comes back; this
/// one lets a client check that the text was not altered (it proves nothing
/// about who wrote it), and blocks that come back are accepted as they are.
fn signature(thinking: &str) -> String {
    use base64::Engine as _;
    use sha2::{Digest, Sha256};
    let digest = Sha256::new().chain_update(b"qinfer thinking\n").chain_update(thinking.as_bytes()).finalize();
    base64::engine::general_purpose::STANDARD.encode(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed blocks of thinking, a tool call and text: each thinking
    /// block ends with a `signature_delta` (its value from Python's hashlib
    /// over the same text), the others without.
    #[test]
    fn a_thinking_block_ends_with_its_signature() {
        let mut blocks = Blocks::default();
        let mut events = Vec::new();
        let no_id = || -> String { unreachable!("no tool call here") };
        blocks.piece(Piece::Reasoning("Let me ".into()), no_id, &mut events);
        blocks.piece(Piece::Reasoning("think.".into()), no_id, &mut events);
        blocks.piece(Piece::ToolStart { index: 0, name: "f".into() }, || "toolu_1".into(), &mut events);
        blocks.piece(Piece::ToolArgs { index: 0, delta: "{}".into() }, no_id, &mut events);
        blocks.piece(Piece::ToolEnd { index: 0 }, no_id, &mut events);
        blocks.piece(Piece::Content("Hi".into()), no_id, &mut events);
        blocks.close(&mut events);
        let kinds: Vec<String> = (events.iter())
            .map(|(name, v)| match v["delta"]["type"].as_str() {
                Some(d) => format!("{name}:{d}"),
                None => name.to_string(),
            })
            .collect();
        let want = [
            "content_block_start",
            "content_block_delta:thinking_delta",
            "content_block_delta:thinking_delta",
            "content_block_delta:signature_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta:input_json_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta:text_delta",
            "content_block_stop",
        ];
        assert_eq!(kinds, want);
        assert_eq!(events[3].1["delta"]["signature"], "U9stJOvhxv93W/Y2anLg/7ZL+IgHX0PE29Ul8Lr+l6c=");
        assert_eq!(events[3].1["index"], 0);
        assert_eq!(signature("Let me think."), "U9stJOvhxv93W/Y2anLg/7ZL+IgHX0PE29Ul8Lr+l6c=");
    }
}
