//! OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions`,
//! streamed as `data: {chunk}` frames ending in `data: [DONE]`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use qinfer::engine::request::{FinishReason, Output, Request, SamplingParams, StopConditions, TokenLogprob, Usage};
use qinfer::tokenizer::{ChatMessage, ChatOptions, Tokenizer};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};

use std::sync::atomic::AtomicBool;

use crate::bridge::{AbortOnDrop, Submitted, submit};
use crate::chat_stream::{ChatFormat, ChatStream, Piece, ReasoningTokens, fold};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::logprobs;
use crate::params::Body;
use crate::reasoning::has_reasoning_tags;
use crate::structured;
use crate::tool_parser::param_types;
use crate::tools::{ToolChoice, Tools, call_format, forced_start};
use crate::{AppState, Ready, fresh_seed, now_secs, openai_finish};

const F: Flavor = Flavor::OpenAi;

pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let name = &state.opts.served_model_name;
    axum::Json(json!({"object": "list", "data": [
        {"id": name, "object": "model", "created": now_secs(), "owned_by": "qinfer"}
    ]}))
    .into_response()
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

/// Text of a message's `content`: a string, null, or text parts joined.
fn content_text(b: &Body<'_>, field: &str, v: Option<&Value>) -> ApiResult<String> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t),
                (Some(kind), _) => Err(b.bad(field, format!("has a `{kind}` part; only text parts are supported"))),
                _ => Err(b.bad(field, "has a content part without `type`")),
            })
            .collect::<ApiResult<Vec<&str>>>()?
            .concat()),
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
fn messages(b: &Body<'_>) -> ApiResult<Vec<ChatMessage>> {
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
            Ok(ChatMessage {
                role: role.to_string(),
                content: content_text(b, &field, m.get("content"))?,
                // SGLang and llama.cpp name it `reasoning_content`; vLLM now `reasoning`.
                reasoning_content: text("reasoning_content").or_else(|| text("reasoning")),
                tool_calls: tool_calls(b, &field, m.get("tool_calls"))?,
                tool_call_id: text("tool_call_id"),
                name: text("name"),
            })
        })
        .collect()
}

/// The chat through the model's template: its tokens and its text.
pub fn rendered_prompt(
    tok: &Tokenizer,
    msgs: &[ChatMessage],
    thinking: Option<bool>,
    tools: Option<Vec<Value>>,
    flavor: Flavor,
) -> ApiResult<(Vec<u32>, String)> {
    if !tok.has_chat_template() {
        return Err(ApiError::bad_request(flavor, Some("messages"), "this model has no chat template"));
    }
    let opts = ChatOptions { add_generation_prompt: true, enable_thinking: thinking, tools };
    let text = tok
        .apply_chat_template(msgs, &opts)
        .map_err(|e| ApiError::bad_request(flavor, Some("messages"), format!("the chat template failed: {e}")))?;
    let ids = tok.encode(&text, false).map_err(|e| ApiError::bad_request(flavor, Some("messages"), e.to_string()))?;
    Ok((ids, text))
}

pub fn tokenizer(ready: &Ready, flavor: Flavor) -> ApiResult<&Tokenizer> {
    ready
        .engine
        .tokenizer()
        .map(|t| t.as_ref())
        .ok_or_else(|| ApiError::bad_request(flavor, None, "this model has no tokenizer"))
}

/// Submits `n` copies of a request (seeds `seed`, `seed + 1`, …): engine
/// errors (a prompt over the context, say) are the client's, named.
pub fn submit_n(state: &AppState, ready: &Ready, req: Request, n: usize, flavor: Flavor) -> ApiResult<Vec<Submitted>> {
    (0..n)
        .map(|i| {
            let mut r = req.clone();
            r.sampling.seed = r.sampling.seed.wrapping_add(i as u64);
            submit(&ready.engine, r, &state.latency, state.opts.request_timeout)
                .map_err(|e| ApiError::bad_request(flavor, None, e.to_string()))
        })
        .collect()
}

/// A request's whole result.
pub struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: FinishReason,
    pub stop_string: Option<String>,
    pub usage: Usage,
}

/// The error a request that ran past the timeout gets.
pub fn timeout_error(flavor: Flavor) -> ApiError {
    ApiError::with_status(
        flavor,
        axum::http::StatusCode::GATEWAY_TIMEOUT,
        "the request ran past this server's request timeout and was stopped",
    )
}

/// Whether an output ends a request the timeout aborted.
pub fn timed_out(out: &Output, flag: &AtomicBool) -> bool {
    out.finish == Some(FinishReason::Abort) && flag.load(std::sync::atomic::Ordering::Relaxed)
}

pub async fn collect(mut s: Submitted, flavor: Flavor) -> ApiResult<Collected> {
    let mut text = String::new();
    let (mut logprobs, mut token_ids) = (Vec::new(), Vec::new());
    while let Some(item) = s.rx.recv().await {
        let out = item.map_err(|e| ApiError::with_status(flavor, axum::http::StatusCode::INTERNAL_SERVER_ERROR, e))?;
        if timed_out(&out, &s.timed_out) {
            return Err(timeout_error(flavor));
        }
        text.push_str(&out.text);
        logprobs.extend(out.logprobs);
        token_ids.extend(out.token_ids);
        if let Some(finish) = out.finish {
            return Ok(Collected { text, token_ids, logprobs, finish, stop_string: out.stop_string, usage: out.usage });
        }
    }
    Err(ApiError::with_status(flavor, axum::http::StatusCode::SERVICE_UNAVAILABLE, "the engine stopped"))
}

/// Every choice's outputs on one stream, tagged with the choice's index;
/// the choices' abort guards and timeout flags.
pub fn merged(
    subs: Vec<Submitted>,
) -> (impl futures_util::Stream<Item = (usize, Result<Output, String>)> + Send + 'static, Guards) {
    let mut streams = Vec::new();
    let mut guards = Guards::default();
    for (i, s) in subs.into_iter().enumerate() {
        streams.push(UnboundedReceiverStream::new(s.rx).map(move |item| (i, item)));
        guards.aborts.push(s.guard);
        guards.timed_out.push(s.timed_out);
    }
    (futures_util::stream::select_all(streams), guards)
}

#[derive(Default)]
pub struct Guards {
    pub aborts: Vec<AbortOnDrop>,
    pub timed_out: Vec<Arc<AtomicBool>>,
}

/// An SSE response whose events `produce` sends; when the client goes away
/// the sender fails and `produce` ends, dropping what it holds.
pub fn sse<Fut>(produce: impl FnOnce(mpsc::Sender<Event>) -> Fut) -> Response
where
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Event>(64);
    tokio::spawn(produce(tx));
    Sse::new(ReceiverStream::new(rx).map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default()).into_response()
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
    let model = state.opts.served_model_name.clone();
    let cache_salt = cache_salt(b)?;
    Ok(Ask {
        req: Request { prompt, sampling, stop, cache_salt, ..Default::default() },
        n,
        stream,
        include_usage,
        model,
    })
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
    let (mut prompt, prompt_text) = rendered_prompt(tok, &messages(&b)?, thinking, rendered, F)?;
    let format = chat_format(tok, &b, tools.as_ref(), &mut prompt, &prompt_text)?;
    let top = logprobs::chat_request(&b)?;
    let mut a = ask(&state, ready, &b, prompt, top)?;
    if !format.forced.is_empty() && b.get("response_format").is_some() {
        return Err(b.bad("response_format", "cannot be combined with a required or named tool call"));
    }
    let opens_think = format.reasoning_prompt.as_ref().is_some_and(|p| p.trim_end().ends_with("<think>"));
    a.req.constraint = constraint(ready, &b, opens_think)?;
    let tok = ready.engine.tokenizer().cloned();
    state.admit(F, ready)?;
    let subs = submit_n(&state, ready, a.req, a.n, F)?;
    let (id, created) = (state.id("chatcmpl"), now_secs());
    let reasoning = format.reasoning_prompt.is_some();
    if !a.stream {
        let mut choices = Vec::new();
        let mut usage = Vec::new();
        let mut thought = ReasoningTokens::new(&format);
        for (i, s) in subs.into_iter().enumerate() {
            let c = collect(s, F).await?;
            usage.push(c.usage);
            let mut counter = ReasoningTokens::new(&format);
            counter.push(&c.token_ids);
            thought.count += counter.count;
            let (mut cs, mut pieces) = ChatStream::new(&format);
            pieces.extend(cs.push(&c.text));
            pieces.extend(cs.finish());
            let w = fold(pieces);
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
                "finish_reason": chat_finish(c.finish, cs.called()),
                "logprobs": lps,
            }));
        }
        let reasoning_tokens = reasoning.then_some(thought.count);
        return Ok(axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": a.model,
            "choices": choices, "usage": chat_usage(&usage, reasoning_tokens),
        }))
        .into_response());
    }
    let (stream, guards) = merged(subs);
    let n = a.n;
    Ok(sse(move |tx| async move {
        let guards = guards;
        let chunk = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": a.model, "choices": choices});
        let mut streams = Vec::with_capacity(n);
        let mut call_ids: Vec<Vec<String>> = vec![Vec::new(); n];
        let mut thought = vec![ReasoningTokens::new(&format); n];
        for (i, ids) in call_ids.iter_mut().enumerate() {
            let (cs, first) = ChatStream::new(&format);
            streams.push(cs);
            let role = json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}]);
            let mut events = vec![data(chunk(role))];
            for p in first {
                if let Some(d) = delta(&p, ids, &state) {
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
            let mut deltas: Vec<Value> = pieces.iter().filter_map(|p| delta(p, &mut call_ids[i], &state)).collect();
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

/// The constraint `response_format` asks for, compiled (a bad schema is a 400).
fn constraint(
    ready: &Ready,
    b: &Body<'_>,
    opens_think: bool,
) -> ApiResult<Option<std::sync::Arc<dyn qinfer::engine::request::ConstraintFactory>>> {
    let Some(grammar) = structured::response_format(b)? else { return Ok(None) };
    let made = ready.grammars(F)?.constraint(Some(grammar), None, opens_think);
    made.map(Some).map_err(|e| b.bad("response_format", format!("cannot be enforced: {e}")))
}

/// How a chat's output is read: reasoning split out where the vocabulary
/// has the tags, tool calls parsed where tools are offered; a required or
/// named call's opening appended to `prompt`.
pub fn chat_format(
    tok: &Tokenizer,
    b: &Body<'_>,
    tools: Option<&Tools>,
    prompt: &mut Vec<u32>,
    prompt_text: &str,
) -> ApiResult<ChatFormat> {
    let mut f = ChatFormat::default();
    let mut text = prompt_text.to_string();
    if let Some(t) = tools.filter(|t| t.choice != ToolChoice::None) {
        let form = call_format(tok, b)?;
        let (appended, forced) = forced_start(&t.choice, form, prompt_text);
        if !appended.is_empty() {
            prompt.extend(tok.encode(&appended, false).map_err(|e| b.bad("tool_choice", e))?);
            text.push_str(&appended);
        }
        f.tools = Some(param_types(&t.list));
        f.forced = forced;
        f.single_call = !t.parallel;
    }
    if has_reasoning_tags(|t| tok.token_to_id(t)) {
        f.reasoning_prompt = Some(text);
        f.think_ids = tok.token_to_id("<think>").zip(tok.token_to_id("</think>"));
    }
    Ok(f)
}

/// `tool_calls` when the answer called a tool and ended by itself.
fn chat_finish(f: FinishReason, called: bool) -> &'static str {
    if called && f == FinishReason::Stop { "tool_calls" } else { openai_finish(f) }
}

/// A piece of a choice as a streamed delta (a call's id given at its start).
fn delta(p: &Piece, ids: &mut Vec<String>, state: &AppState) -> Option<Value> {
    Some(match p {
        Piece::Reasoning(r) => json!({"reasoning_content": r}),
        Piece::Content(c) => json!({"content": c}),
        Piece::ToolStart { index, name } => {
            ids.push(state.id("call"));
            json!({"tool_calls": [{"index": index, "id": ids[ids.len() - 1], "type": "function",
                "function": {"name": name, "arguments": ""}}]})
        }
        Piece::ToolArgs { index, delta } => json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
        Piece::ToolEnd { .. } => return None,
    })
}

/// The prompt of `/v1/completions`: a string, one-string array, or token ids.
fn completion_prompt(b: &Body<'_>, tok: Option<&Tokenizer>, vocab: usize) -> ApiResult<Vec<u32>> {
    let text = |s: &str| -> ApiResult<Vec<u32>> {
        let tok = tok.ok_or_else(|| b.bad("prompt", "must be token ids: this model has no tokenizer"))?;
        tok.encode(s, true).map_err(|e| b.bad("prompt", e))
    };
    let ids = match b.get("prompt") {
        Some(Value::String(s)) => text(s)?,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => text(a[0].as_str().unwrap_or_default())?,
        Some(Value::Array(a)) if a.iter().all(Value::is_u64) => {
            a.iter().map(|t| t.as_u64().unwrap_or(u64::MAX) as u32).collect()
        }
        Some(Value::Array(_)) => {
            return Err(b.bad(
                "prompt",
                "must be a string, an array of one string, or an array of token ids (one prompt per request)",
            ));
        }
        _ => return Err(b.bad("prompt", "is required (a string or token ids)")),
    };
    if ids.is_empty() {
        return Err(b.bad("prompt", "is empty"));
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(b.bad("prompt", format!("holds token id {t}, outside the vocabulary of {vocab}")));
    }
    Ok(ids)
}

pub async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    ready.check_generates(F)?;
    let v = Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    state.check_model(F, b.str("model")?)?;
    let vocab = ready.engine.model().config().vocab_size;
    let prompt = completion_prompt(&b, ready.engine.tokenizer().map(|t| t.as_ref()), vocab)?;
    let top = logprobs::completion_request(&b)?;
    let mut a = ask(&state, ready, &b, prompt, top)?;
    a.req.constraint = constraint(ready, &b, false)?;
    let tok = ready.engine.tokenizer().cloned();
    state.admit(F, ready)?;
    let subs = submit_n(&state, ready, a.req, a.n, F)?;
    let (id, created) = (state.id("cmpl"), now_secs());
    if !a.stream {
        let mut choices = Vec::new();
        let mut usage = Vec::new();
        for (i, s) in subs.into_iter().enumerate() {
            let c = collect(s, F).await?;
            usage.push(c.usage);
            let lps = top.map_or(Value::Null, |_| logprobs::completion(tok.as_deref(), &c.logprobs, &mut 0));
            choices
                .push(json!({"index": i, "text": c.text, "finish_reason": openai_finish(c.finish), "logprobs": lps}));
        }
        return Ok(axum::Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": a.model,
            "choices": choices, "usage": usage_json(&usage),
        }))
        .into_response());
    }
    let (stream, guards) = merged(subs);
    let n = a.n;
    Ok(sse(move |tx| async move {
        let guards = guards;
        let chunk = |choices: Value| json!({"id": id, "object": "text_completion", "created": created, "model": a.model, "choices": choices});
        let (mut usage, mut done) = (vec![Usage::default(); n], 0);
        let mut offsets = vec![0; n];
        futures_util::pin_mut!(stream);
        while let Some((i, item)) = stream.next().await {
            let Ok(out) = item else {
                let _ = tx.send(data(json!({"error": {"message": "the engine failed", "type": "server_error"}}))).await;
                return;
            };
            if timed_out(&out, &guards.timed_out[i]) {
                let _ = tx.send(data(timeout_error(F).body())).await;
                return;
            }
            usage[i] = out.usage;
            let finish = out.finish.map(openai_finish);
            let lps = match top {
                Some(_) if !out.logprobs.is_empty() => {
                    logprobs::completion(tok.as_deref(), &out.logprobs, &mut offsets[i])
                }
                _ => Value::Null,
            };
            if (!out.text.is_empty() || finish.is_some() || !lps.is_null())
                && tx
                    .send(data(chunk(
                        json!([{"index": i, "text": out.text, "finish_reason": finish, "logprobs": lps}]),
                    )))
                    .await
                    .is_err()
            {
                return;
            }
            if finish.is_some() {
                done += 1;
                if done == n {
                    break;
                }
            }
        }
        if a.include_usage {
            let mut last = chunk(json!([]));
            last["usage"] = usage_json(&usage);
            let _ = tx.send(data(last)).await;
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    }))
}
