//! A chat's prompt through the model's template (tools rendered as the
//! template renders them) and how its output is to be read.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use qinfer::engine::request::ConstraintFactory;
use qinfer::tokenizer::{ChatMessage, ChatOptions, Tokenizer};
use serde_json::Value;

use crate::Ready;
use crate::chat_stream::ChatFormat;
use crate::error::{ApiError, ApiResult, Flavor};
use crate::params::Body;
use crate::reasoning::has_reasoning_tags;
use crate::tool_parser::param_types;
use crate::tools::{ToolChoice, Tools, call_format, call_grammar, forced_start};

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
        if !forced.is_empty() {
            f.call_grammar = call_grammar(t, form);
        }
        f.forced = forced;
        f.single_call = !t.parallel;
    }
    if has_reasoning_tags(|t| tok.token_to_id(t)) {
        f.reasoning_prompt = Some(text);
        f.think_ids = tok.token_to_id("<think>").zip(tok.token_to_id("</think>"));
    }
    Ok(f)
}

/// The constraint an answer runs under, compiled now (what cannot be
/// enforced is a 400 naming its field): a required or named call's grammar;
/// otherwise `grammar` (`response_format`'s) and the reasoning's `budget`
/// (Anthropic's thinking); None when nothing limits the answer.
pub fn output_constraint(
    ready: &Ready,
    b: &Body<'_>,
    format: &ChatFormat,
    grammar: Option<TopLevelGrammar>,
    budget: Option<usize>,
) -> ApiResult<Option<Arc<dyn ConstraintFactory>>> {
    if let Some(g) = &format.call_grammar {
        let made = ready.grammars(b.flavor, "tool_choice")?.immediate(TopLevelGrammar::from_lark(g.clone()));
        return made.map(Some).map_err(|e| b.bad("tool_choice", format!("cannot be enforced: {e}")));
    }
    let field = match (&grammar, budget) {
        (None, None) => return Ok(None),
        (Some(_), _) => "response_format",
        (None, Some(_)) => "thinking",
    };
    let g = ready.grammars(b.flavor, field)?;
    if budget.is_some() && !g.reasons() {
        return Err(b.bad("thinking", "cannot be enabled: this model does not reason (no <think> tokens)"));
    }
    let made = g.constraint(grammar, budget, format.opens_think());
    made.map(Some).map_err(|e| b.bad(field, format!("cannot be enforced: {e}")))
}
