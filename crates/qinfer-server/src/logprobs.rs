//! Log probabilities in each OpenAI endpoint's shape. Chat: `logprobs: true`
//! with `top_logprobs` alternatives (0–20), as `{"content": [{token,
//! logprob, bytes, top_logprobs}]}`. Completions: `logprobs: N` (0–20), as
//! `{tokens, token_logprobs, top_logprobs, text_offset}`, each
//! `top_logprobs` entry holding the picked token too (as vLLM's does).
//! Tokens are shown as their text alone (a piece of a character shows as
//! U+FFFD), `bytes` its UTF-8, as vLLM shows them. The numbers are the
//! model's own distribution, before penalties and temperature.

use qinfer::engine::request::TokenLogprob;
use qinfer::tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

use crate::error::ApiResult;
use crate::params::Body;

/// Most alternatives a request may ask for.
pub const MAX_TOP: usize = 20;

/// Chat's fields: None when log probabilities are off.
pub fn chat_request(b: &Body<'_>) -> ApiResult<Option<usize>> {
    let on = b.bool("logprobs")?;
    let top = b.u64("top_logprobs")?;
    match (on, top) {
        (false, Some(t)) if t > 0 => Err(b.bad("top_logprobs", "needs `logprobs` set to true")),
        (false, _) => Ok(None),
        (true, Some(t)) if t as usize > MAX_TOP => Err(b.bad("top_logprobs", format!("must be at most {MAX_TOP}"))),
        (true, t) => Ok(Some(t.unwrap_or(0) as usize)),
    }
}

/// Completions' field.
pub fn completion_request(b: &Body<'_>) -> ApiResult<Option<usize>> {
    match b.u64("logprobs")? {
        Some(t) if t as usize > MAX_TOP => Err(b.bad("logprobs", format!("must be at most {MAX_TOP}"))),
        t => Ok(t.map(|t| t as usize)),
    }
}

fn text(tok: Option<&Tokenizer>, id: u32) -> String {
    tok.and_then(|t| t.decode(&[id], false).ok()).unwrap_or_else(|| format!("token_id:{id}"))
}

fn entry(tok: Option<&Tokenizer>, id: u32, lp: f32) -> Value {
    let t = text(tok, id);
    json!({"token": t, "logprob": finite(lp), "bytes": t.as_bytes()})
}

/// OpenAI's logprobs are numbers: an impossible token's -inf shows as the
/// most negative f32, as vLLM clamps it.
fn finite(lp: f32) -> f32 {
    lp.max(f32::MIN)
}

/// Chat's `content` list for these tokens.
pub fn chat(tok: Option<&Tokenizer>, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(tok, lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(tok, t, l)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' object for these tokens, `offset` the text offset of the
/// first (advanced past them).
pub fn completion(tok: Option<&Tokenizer>, lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for lp in lps {
        let t = text(tok, lp.token);
        offsets.push(*offset);
        *offset += t.chars().count();
        let mut top = Map::new();
        for &(id, l) in &lp.top {
            top.entry(text(tok, id)).or_insert(json!(finite(l)));
        }
        top.entry(t.clone()).or_insert(json!(finite(lp.logprob)));
        tokens.push(t);
        values.push(finite(lp.logprob));
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
}
