//! `/v1/embeddings` (OpenAI's shape, with vLLM's extensions) and
//! `/v1/rerank` (the shape vLLM, llama.cpp and Jina accept) for servers
//! running an embedding or a reranking model: every input is a prompt-only
//! engine request, run beside any other work, its result finished here.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use qinfer::engine::pooling::{PoolingConfig, RerankFormat, finish_embedding};
use qinfer::engine::request::{Output, Request, Task};
use serde_json::{Value, json};

use crate::bridge::{Submitted, submit};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::params::Body;
use crate::{AppState, Ready, ServedTask};

const F: Flavor = Flavor::OpenAi;

/// Waits for a prompt-only request's one output.
async fn pooled(mut s: Submitted) -> ApiResult<Output> {
    while let Some(item) = s.rx.recv().await {
        let out = item.map_err(|e| ApiError::with_status(F, axum::http::StatusCode::INTERNAL_SERVER_ERROR, e))?;
        if crate::exchange::timed_out(&out, &s.timed_out) {
            return Err(crate::exchange::timeout_error(F));
        }
        if out.finish.is_some() {
            return Ok(out);
        }
    }
    Err(ApiError::with_status(F, axum::http::StatusCode::SERVICE_UNAVAILABLE, "the engine stopped"))
}

/// Submits every prompt, then waits for all (dropping them aborts the rest).
async fn run_all(state: &AppState, ready: &Ready, prompts: Vec<Vec<u32>>, task: Task) -> ApiResult<Vec<Output>> {
    let subs = prompts
        .into_iter()
        .map(|prompt| {
            let req = Request { prompt, task: task.clone(), ..Default::default() };
            submit(&ready.engine, req, &state.latency, state.opts.request_timeout)
                .map_err(|e| ApiError::bad_request(F, None, e.to_string()))
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let mut outs = Vec::with_capacity(subs.len());
    for s in subs {
        outs.push(pooled(s).await?);
    }
    Ok(outs)
}

/// `truncate_prompt_tokens` (vLLM's): keep only the last k tokens (-1: as
/// many as the context holds); inputs longer than the context are refused
/// otherwise, naming the limit.
fn fit(b: &Body<'_>, ids: Vec<u32>, limit: usize, field: &str) -> ApiResult<Vec<u32>> {
    let keep = match b.i64("truncate_prompt_tokens")? {
        None => None,
        Some(-1) => Some(limit),
        Some(k) if k >= 1 => Some((k as usize).min(limit)),
        Some(_) => return Err(b.bad("truncate_prompt_tokens", "must be -1 or at least 1")),
    };
    if ids.is_empty() {
        return Err(b.bad(field, "holds an empty input"));
    }
    match keep {
        Some(k) if ids.len() > k => Ok(ids[ids.len() - k..].to_vec()),
        None if ids.len() > limit => Err(b.bad(
            field,
            format!(
                "holds an input of {} tokens; this model's context holds {limit} (set truncate_prompt_tokens to keep the last ones)",
                ids.len()
            ),
        )),
        _ => Ok(ids),
    }
}

fn usage(outs: &[Output]) -> Value {
    let n: usize = outs.iter().map(|o| o.usage.prompt_tokens).sum();
    json!({"prompt_tokens": n, "total_tokens": n})
}

pub async fn embeddings(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    let v = Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    if state.check_model(F, b.str("model")?)?.is_some() {
        return Err(b.bad("model", "LoRA adapters are served for generation only"));
    }
    let ServedTask::Embed(cfg) = &ready.task else {
        return Err(ApiError::bad_request(
            F,
            None,
            "this model does not serve embeddings (start the server with an embedding model, or --task embed)",
        ));
    };
    let base64 = match b.str("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(b.bad("encoding_format", format!("must be \"float\" or \"base64\", not {other:?}"))),
    };
    let dimensions = b.u64("dimensions")?.map(|d| d as usize);
    let hidden = ready.engine.model().config().hidden_size;
    if let Some(d) = dimensions
        && !(1..=hidden).contains(&d)
    {
        return Err(b.bad("dimensions", format!("must be between 1 and {hidden}, this model's width")));
    }
    let prompts = embedding_inputs(&b, ready, cfg)?;
    state.admit(F, ready)?;
    let outs = run_all(&state, ready, prompts, Task::Embed(cfg.pooling)).await?;
    let mut data = Vec::with_capacity(outs.len());
    for (i, o) in outs.iter().enumerate() {
        let v = finish_embedding(o.pooled.clone().unwrap_or_default(), cfg.normalize, dimensions)
            .map_err(|e| b.bad("dimensions", e))?;
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(axum::Json(json!({
        "object": "list", "data": data, "model": state.opts.served_model_name, "usage": usage(&outs),
    }))
    .into_response())
}

/// `input`: a string, strings, token ids, or lists of token ids; text gets
/// the named prompt (`prompt_name`) or Qwen3-Embedding's instruction format
/// (`instruction`) first.
fn embedding_inputs(b: &Body<'_>, ready: &Ready, cfg: &PoolingConfig) -> ApiResult<Vec<Vec<u32>>> {
    let limit = ready.engine.config().max_model_len;
    let vocab = ready.engine.model().config().vocab_size;
    let prompt_name = b.str("prompt_name")?;
    let instruction = b.str("instruction")?;
    let text = |s: &str| -> ApiResult<Vec<u32>> {
        let tok = crate::chat_prompt::tokenizer(ready, F)?;
        let s = cfg.input_text(s, prompt_name, instruction).map_err(|e| b.bad("prompt_name", e))?;
        tok.encode(&s, true).map_err(|e| b.bad("input", e))
    };
    let ids = |a: &[Value]| -> ApiResult<Vec<u32>> {
        a.iter()
            .map(|t| match t.as_u64() {
                Some(t) if (t as usize) < vocab => Ok(t as u32),
                _ => Err(b.bad("input", format!("holds a token id outside the vocabulary of {vocab}"))),
            })
            .collect()
    };
    let inputs = match b.get("input") {
        Some(Value::String(s)) => vec![text(s)?],
        Some(Value::Array(a)) if a.is_empty() => return Err(b.bad("input", "is empty")),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            a.iter().map(|s| text(s.as_str().unwrap_or_default())).collect::<ApiResult<_>>()?
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => vec![ids(a)?],
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => {
            a.iter().map(|x| ids(x.as_array().map_or(&[][..], |v| v))).collect::<ApiResult<_>>()?
        }
        _ => return Err(b.bad("input", "must be a string, an array of strings, token ids, or arrays of token ids")),
    };
    inputs.into_iter().map(|x| fit(b, x, limit, "input")).collect()
}

pub async fn rerank(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    let ready = state.ready(F)?;
    let v = Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    if state.check_model(F, b.str("model")?)?.is_some() {
        return Err(b.bad("model", "LoRA adapters are served for generation only"));
    }
    let ServedTask::Rerank(format) = &ready.task else {
        return Err(ApiError::bad_request(
            F,
            None,
            "this model does not rerank (start the server with a Qwen3-Reranker-style model and --task rerank)",
        ));
    };
    let query = b.str("query")?.ok_or_else(|| b.bad("query", "is required (a string)"))?;
    let documents: Vec<String> = match b.get("documents") {
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|d| match d {
                Value::String(s) => Ok(s.clone()),
                Value::Object(o) => o
                    .get("text")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| b.bad("documents", "holds an object without a string `text`")),
                _ => Err(b.bad("documents", "must hold strings or objects with `text`")),
            })
            .collect::<ApiResult<_>>()?,
        _ => return Err(b.bad("documents", "is required (a non-empty array)")),
    };
    let top_n = match b.u64("top_n")? {
        Some(0) => return Err(b.bad("top_n", "must be at least 1")),
        Some(n) => (n as usize).min(documents.len()),
        None => documents.len(),
    };
    let return_documents = b.bool("return_documents")?;
    let instruction = b.str("instruction")?;
    let tok = crate::chat_prompt::tokenizer(ready, F)?;
    let limit = ready.engine.config().max_model_len;
    let prompts = documents
        .iter()
        .map(|d| {
            let ids = tok.encode(&format.prompt(query, d, instruction), true).map_err(|e| b.bad("documents", e))?;
            fit(&b, ids, limit, "documents")
        })
        .collect::<ApiResult<Vec<_>>>()?;
    state.admit(F, ready)?;
    let outs = run_all(&state, ready, prompts, Task::Score(format.score_ids())).await?;
    let mut results: Vec<(usize, f32)> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| (i, RerankFormat::relevance(o.pooled.as_deref().unwrap_or(&[0.0, 0.0]))))
        .collect();
    results.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let results: Vec<Value> = results
        .into_iter()
        .take(top_n)
        .map(|(i, score)| {
            let mut r = json!({"index": i, "relevance_score": score});
            if return_documents {
                r["document"] = json!({"text": documents[i]});
            }
            r
        })
        .collect();
    Ok(axum::Json(json!({
        "id": state.id("rerank"), "object": "list", "model": state.opts.served_model_name,
        "results": results, "usage": usage(&outs),
    }))
    .into_response())
}
