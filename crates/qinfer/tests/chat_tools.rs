//! Chat templates rendering tools, assistant tool calls, tool results and
//! earlier reasoning, against what transformers renders for the same
//! conversations (tests/fixtures/tools/chats.json, written by
//! scripts/make_fixtures_tools.py): Qwen3's template, Qwen2.5-Coder's, and
//! an XML-style template iterating the arguments as Qwen3-Coder's does.

use std::path::Path;

use qinfer::tokenizer::{ChatMessage, ChatOptions, Tokenizer};
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn message(m: &Value) -> ChatMessage {
    let s = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_string);
    ChatMessage {
        role: s("role").unwrap(),
        content: s("content").unwrap_or_default(),
        reasoning_content: s("reasoning_content"),
        tool_calls: m.get("tool_calls").and_then(Value::as_array).cloned().unwrap_or_default(),
        tool_call_id: s("tool_call_id"),
        name: s("name"),
        parts: Vec::new(),
    }
}

#[test]
fn tools_and_tool_calls_render_as_transformers_renders_them() {
    let path = root().join("tests/fixtures/tools/chats.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let base = root().join("tests/fixtures/tokenizer/qwen3");
    let mut checked = 0;
    for c in fixture["cases"].as_array().unwrap() {
        let name = c["template"].as_str().unwrap();
        let source = fixture["templates"][name].as_str().unwrap().to_string();
        let tok = Tokenizer::from_dir(&base).unwrap().unwrap().with_chat_template(source).unwrap();
        let msgs: Vec<ChatMessage> = c["messages"].as_array().unwrap().iter().map(message).collect();
        let opts = ChatOptions {
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
            tools: Some(c["tools"].as_array().unwrap().clone()),
            ..Default::default()
        };
        let got = tok.apply_chat_template(&msgs, &opts).unwrap();
        assert_eq!(got, c["rendered"].as_str().unwrap(), "template {name}, messages {msgs:?}");
        checked += 1;
    }
    assert_eq!(checked, 12);
}

#[test]
fn python_json_prints_as_json_dumps() {
    let v: Value =
        serde_json::from_str(r#"{"b": [1, 2.5, 1e300, "é\"\n"], "a": {"x": null, "y": true}, "c": 0.1}"#).unwrap();
    assert_eq!(
        qinfer::tokenizer::python_json(&v),
        r#"{"b": [1, 2.5, 1e+300, "é\"\n"], "a": {"x": null, "y": true}, "c": 0.1}"#
    );
}
