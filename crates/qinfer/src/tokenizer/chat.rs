//! Chat templates: Jinja templates rendered with minijinja, configured to
//! behave like transformers' `apply_chat_template(tokenize=False)`:
//! `trim_blocks` and `lstrip_blocks` on, no trailing newline kept, Python
//! string/dict methods (`.strip()`, `.split()`, `.items()`), `raise_exception`,
//! `strftime_now`, transformers' `tojson`, and Python's way of printing
//! `None`, `True`/`False` and containers.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use super::pyjson;
use super::specials::SpecialTokens;
use super::strftime::DateTime;
use crate::{Error, Result};

/// One message as chat templates see it (OpenAI's shape): fields left
/// unset are undefined in the template, as when transformers is given a
/// message dict without them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's earlier reasoning (Qwen3's templates render it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant turn's calls: `{"id", "type": "function", "function":
    /// {"name", "arguments"}}` with `arguments` an object (templates iterate
    /// it or print it with `tojson`; vLLM parses OpenAI's JSON string the same way).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool result's call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Content with images: when set, the template sees `content` as these
    /// parts (`{"type": "text", "text": ...}`, `{"type": "image"}`) in
    /// place of the string, as transformers passes multimodal messages.
    #[serde(skip)]
    pub parts: Vec<ContentPart>,
}

/// One part of a multimodal message.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    Text(String),
    /// An image's place; the template writes the model's image markers there.
    Image,
}

impl ContentPart {
    fn to_json(&self) -> serde_json::Value {
        match self {
            ContentPart::Text(t) => serde_json::json!({"type": "text", "text": t}),
            ContentPart::Image => serde_json::json!({"type": "image"}),
        }
    }
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatOptions {
    /// Append the prompt that starts the assistant's turn.
    pub add_generation_prompt: bool,
    /// Passed to the template as `enable_thinking` only when set (Qwen3).
    pub enable_thinking: Option<bool>,
    /// The tools the template renders (`{"type": "function", "function":
    /// {...}}` each, as given by the client); None leaves `tools` none.
    pub tools: Option<Vec<serde_json::Value>>,
}

const NAME: &str = "chat_template";

pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

/// Python's `repr` for values Jinja2 would print that way.
fn py_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::String => py_str_repr(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key);
                out.push_str(": ");
                py_repr(out, &v.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        ValueKind::Number if !v.is_integer() => match f64::try_from(v.clone()) {
            Ok(f) => out.push_str(&pyjson::python_float_repr(f).replace("Infinity", "inf").replace("NaN", "nan")),
            Err(_) => out.push_str(&v.to_string()),
        },
        _ => out.push_str(&v.to_string()),
    }
}

fn py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let _ = write!(msg, ": {s}");
        source = s.source();
    }
    Error::Template(msg)
}

impl ChatTemplate {
    pub fn new(source: String) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, state, value| match value.kind() {
            ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
                let mut s = String::new();
                py_repr(&mut s, value);
                out.write_str(&s).map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "write failed"))
            }
            ValueKind::Number if !value.is_integer() => {
                let mut s = String::new();
                py_repr(&mut s, value);
                out.write_str(&s).map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "write failed"))
            }
            _ => minijinja::escape_formatter(out, state, value),
        });
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| DateTime::now().format(&fmt));
        env.add_template_owned(NAME, source.clone()).map_err(template_error)?;
        Ok(ChatTemplate { env, source })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn render(&self, messages: &[ChatMessage], opts: &ChatOptions, specials: &SpecialTokens) -> Result<String> {
        let messages: Vec<serde_json::Value> = (messages.iter())
            .map(|m| {
                let mut v = serde_json::to_value(m).map_err(|e| Error::Template(e.to_string()))?;
                if !m.parts.is_empty() {
                    v["content"] = m.parts.iter().map(ContentPart::to_json).collect();
                }
                Ok(v)
            })
            .collect::<Result<_>>()?;
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from_serialize(&messages)),
            ("add_generation_prompt", Value::from(opts.add_generation_prompt)),
            ("tools", opts.tools.as_ref().map_or(Value::from(()), Value::from_serialize)),
            ("documents", Value::from(())),
        ];
        // transformers passes the tokenizer's special tokens that are set.
        let named = [
            ("bos_token", &specials.bos),
            ("eos_token", &specials.eos),
            ("unk_token", &specials.unk),
            ("pad_token", &specials.pad),
            ("sep_token", &specials.sep),
            ("cls_token", &specials.cls),
            ("mask_token", &specials.mask),
        ];
        for (k, v) in named {
            if let Some(v) = v {
                ctx.push((k, Value::from(v.as_str())));
            }
        }
        if !specials.additional.is_empty() {
            ctx.push(("additional_special_tokens", Value::from_serialize(&specials.additional)));
        }
        if let Some(t) = opts.enable_thinking {
            ctx.push(("enable_thinking", Value::from(t)));
        }
        let ctx: Value = ctx.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        tmpl.render(ctx).map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, msgs: &[ChatMessage], opts: ChatOptions) -> String {
        let specials = SpecialTokens { bos: Some("<s>".into()), eos: Some("</s>".into()), ..Default::default() };
        ChatTemplate::new(src.to_string()).unwrap().render(msgs, &opts, &specials).unwrap()
    }

    #[test]
    fn chatml_with_trim_and_lstrip_blocks() {
        let src = "{% for message in messages %}\n    {{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}\n{% endfor %}\n{% if add_generation_prompt %}\n{{ '<|im_start|>assistant\\n' }}\n{% endif %}\n";
        let msgs = [ChatMessage::new("user", "Hi")];
        let out = render(src, &msgs, ChatOptions { add_generation_prompt: true, ..Default::default() });
        // lstrip_blocks strips before `{% %}` only, so the indented `{{ }}` line
        // keeps its indentation and newline, as in Jinja2.
        assert_eq!(out, "    <|im_start|>user\nHi<|im_end|>\n\n<|im_start|>assistant\n\n");
    }

    #[test]
    fn python_methods_and_globals() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().split(' ')[-1] }}|{{ m.content.startswith('  a') }}{% endfor %}{{ tools }}{% if enable_thinking is defined and enable_thinking is false %}NT{% endif %}{{ {'a': [1, 2.0, none]} | tojson }}";
        let msgs = [ChatMessage::new("user", "  a b c ")];
        let out = render(
            src,
            &msgs,
            ChatOptions { add_generation_prompt: false, enable_thinking: Some(false), ..Default::default() },
        );
        assert_eq!(out, "<s>c|TrueNoneNT{\"a\": [1, 2.0, null]}");
    }

    #[test]
    fn raise_exception_reports_message() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}".into()).unwrap();
        let e = t.render(&[], &ChatOptions::default(), &SpecialTokens::default()).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }

    #[test]
    fn loop_controls_and_namespace() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}";
        let msgs = vec![ChatMessage::new("user", "x"); 5];
        assert_eq!(render(src, &msgs, ChatOptions::default()), "2");
    }

    #[test]
    fn bad_template_is_an_error_not_a_panic() {
        assert!(ChatTemplate::new("{% for %}".into()).is_err());
    }
}
