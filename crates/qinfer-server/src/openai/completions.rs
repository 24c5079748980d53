//! `/v1/completions`: a text or token-id prompt, no template.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use qinfer::engine::request::Usage;
use qinfer::tokenizer::Tokenizer;
use serde_json::{Value, json};

use super::{F, ask, data, usage_json};
use crate::chat_prompt::output_constraint;
use crate::chat_stream::ChatFormat;
use crate::error::ApiResult;
use crate::exchange::{collect, merged, sse, submit_n, timed_out, timeout_error};
use crate::logprobs;
use crate::params::Body;
use crate::structured;
use crate::{AppState, now_secs, openai_finish};

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
    a.req.constraint = output_constraint(ready, &b, &ChatFormat::default(), structured::response_format(&b)?, None)?;
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
