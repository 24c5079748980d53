//! Tool calls parsed out of a model's text as it streams, in Qwen's two
//! forms: Hermes-style JSON (Qwen2.5, Qwen3)
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, and the XML form
//! of Qwen3-Coder and Qwen3.5
//! `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`.
//! The form is told by what follows `<tool_call>`.
//!
//! Semantics follow vLLM's `hermes` and `qwen3_coder` parsers: text before a
//! call is content; a call left open when the output ends is still a call;
//! XML parameter values lose one leading and one trailing newline and are
//! converted by the type the tool's schema gives them (string, integer,
//! number, boolean, else JSON), `null` being null; a Hermes body that is not
//! JSON with a `name` is given back as content.
//!
//! As llama.cpp's Hermes parser does, an output that begins with a bare
//! `{"name": …` object, or one fenced as a ```` ```json ```` block, is a call
//! too: small models often drop the tags.
//!
//! Streaming: a call starts (its name known) as soon as the name is whole;
//! Hermes arguments stream as their JSON text arrives, XML arguments one
//! parameter at a time.

use std::collections::HashMap;

use qinfer::tokenizer::python_json;
use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// What a piece of text adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// Call `index` begins; its arguments follow as [`ToolEvent::Args`].
    Start {
        index: usize,
        name: String,
    },
    /// More of call `index`'s arguments (JSON text; all of them concatenated
    /// form one JSON value).
    Args {
        index: usize,
        delta: String,
    },
    /// Call `index` is whole.
    End {
        index: usize,
    },
}

/// The parameter types each tool's schema declares, for XML values.
pub type ParamTypes = HashMap<String, HashMap<String, String>>;

/// The `parameters.properties.*.type` of each function tool
/// (`{"type": "function", "function": {...}}`).
pub fn param_types(tools: &[Value]) -> ParamTypes {
    let mut out = ParamTypes::new();
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        let Some(name) = f.get("name").and_then(Value::as_str) else { continue };
        let props = f.pointer("/parameters/properties").and_then(Value::as_object);
        let types = props
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                let ty = match v.get("type") {
                    Some(Value::String(s)) => s.to_lowercase(),
                    // A union such as ["integer", "null"]: its first non-null type.
                    Some(Value::Array(a)) => {
                        a.iter().filter_map(Value::as_str).find(|s| *s != "null").unwrap_or("string").to_lowercase()
                    }
                    _ => "string".to_string(),
                };
                (k.clone(), ty)
            })
            .collect();
        out.insert(name.to_string(), types);
    }
    out
}

#[derive(Debug, Default)]
struct Call {
    /// The text after `<tool_call>` so far.
    body: String,
    /// The index of the call this body started last (the XML form may hold
    /// several functions); it is open until its end.
    current: Option<usize>,
    /// Hermes: bytes of the arguments' text already sent.
    args_sent: usize,
    /// XML: bytes of `body` consumed, and parameters sent in the open function.
    xml_at: usize,
    xml_params: usize,
    xml_open: bool,
    /// XML: the open function's name.
    xml_name: String,
    /// A bare JSON call without tags: it ends where its object ends.
    bare: bool,
    /// The bare call opened a code fence.
    fenced: bool,
}

/// Splits a stream of text into content and tool calls.
#[derive(Debug)]
pub struct ToolCallParser {
    types: ParamTypes,
    /// Content text held back: it may begin `<tool_call>`.
    held: String,
    call: Option<Call>,
    calls: usize,
    /// Whitespace after a call: sent only if more text follows (the
    /// newlines between and after calls are not content).
    gap: String,
    /// Nothing has come out yet: a bare `{"name"` object would be a call.
    at_start: bool,
    /// A fenced bare call ended: its closing fence is not content.
    eat_fence: bool,
}

impl ToolCallParser {
    pub fn new(types: ParamTypes) -> Self {
        ToolCallParser {
            types,
            held: String::new(),
            call: None,
            calls: 0,
            gap: String::new(),
            at_start: true,
            eat_fence: false,
        }
    }

    /// How many calls have started.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        let mut text = text.to_string();
        loop {
            match &mut self.call {
                None => {
                    self.held.push_str(&text);
                    if self.eat_fence {
                        let t = self.held.trim_start();
                        if t.len() < FENCE.len() && FENCE.starts_with(t) {
                            return out;
                        }
                        if let Some(rest) = t.strip_prefix(FENCE) {
                            self.held = rest.to_string();
                        }
                        self.eat_fence = false;
                    }
                    if self.at_start {
                        match bare_start(&self.held) {
                            Bare::Undecided => return out,
                            Bare::Yes { from, fenced } => {
                                let body = self.held.split_off(from);
                                self.held.clear();
                                self.call = Some(Call { bare: true, fenced, ..Call::default() });
                                self.at_start = false;
                                text = body;
                                continue;
                            }
                            Bare::No => self.at_start = false,
                        }
                    }
                    if let Some(at) = self.held.find(OPEN) {
                        let before: String = self.held.drain(..at).collect();
                        self.content(&mut out, before);
                        self.gap.clear();
                        self.held.drain(..OPEN.len());
                        text = std::mem::take(&mut self.held);
                        self.call = Some(Call::default());
                        continue;
                    }
                    let keep = partial_suffix(&self.held, OPEN);
                    let cut = self.held.len() - keep;
                    let before: String = self.held.drain(..cut).collect();
                    self.content(&mut out, before);
                    return out;
                }
                Some(call) => {
                    call.body.push_str(&text);
                    let end = if call.bare {
                        let from = call.body.len() - call.body.trim_start().len();
                        value_end(call.body.as_bytes(), from).map(|e| (e, e))
                    } else {
                        call.body.find(CLOSE).map(|at| (at, at + CLOSE.len()))
                    };
                    if let Some((at, next)) = end {
                        let rest = call.body[next..].to_string();
                        call.body.truncate(at);
                        let call = self.call.take().expect("open call");
                        self.eat_fence = call.fenced;
                        self.close(call, &mut out);
                        text = rest;
                        continue;
                    }
                    let held = if call.bare { 0 } else { partial_suffix(&call.body, CLOSE) };
                    let visible = call.body.len() - held;
                    let mut call = self.call.take().expect("open call");
                    self.progress(&mut call, visible, &mut out);
                    self.call = Some(call);
                    return out;
                }
            }
        }
    }

    /// The end of the output: held text is content, an open call is closed.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        if let Some(call) = self.call.take() {
            self.close(call, &mut out);
        }
        let held = std::mem::take(&mut self.held);
        self.content(&mut out, held);
        out
    }

    /// Content text, less whitespace that follows a call and is not yet
    /// followed by anything else.
    fn content(&mut self, out: &mut Vec<ToolEvent>, text: String) {
        if self.calls == 0 {
            return push_content(out, text);
        }
        if text.trim().is_empty() {
            self.gap.push_str(&text);
            return;
        }
        let gap = std::mem::take(&mut self.gap);
        push_content(out, gap + &text);
    }

    fn start(&mut self, call: &mut Call, name: String, out: &mut Vec<ToolEvent>) {
        self.at_start = false;
        let index = self.calls;
        self.calls += 1;
        call.current = Some(index);
        out.push(ToolEvent::Start { index, name });
    }

    /// Sends what `body[..visible]` of an unfinished call makes known.
    fn progress(&mut self, call: &mut Call, visible: usize, out: &mut Vec<ToolEvent>) {
        let body = call.body[..visible].to_string();
        match form(&body) {
            Some(Form::Hermes) => {
                let scan = scan_hermes(&body);
                if call.current.is_none()
                    && let Some(name) = scan.name
                {
                    self.start(call, name, out);
                }
                if let (Some(index), Some(args)) = (call.current, scan.args) {
                    send_args(call, &body, index, args, out);
                }
            }
            Some(Form::Xml) => self.xml(call, &body, false, out),
            None => {}
        }
    }

    /// The call's body is whole (its `</tool_call>` came, or the output ended).
    fn close(&mut self, mut call: Call, out: &mut Vec<ToolEvent>) {
        let body = call.body.clone();
        match form(&body) {
            Some(Form::Hermes) => {
                let parsed = serde_json::from_str::<Value>(body.trim()).ok();
                let name = parsed.as_ref().and_then(|v| v.get("name")).and_then(Value::as_str).map(str::to_string);
                match (name, call.current) {
                    (None, None) if call.bare => push_content(out, body),
                    (None, None) => push_content(out, format!("{OPEN}{body}{CLOSE}")),
                    (name, current) => {
                        let index = match current {
                            Some(i) => i,
                            None => {
                                self.start(&mut call, name.unwrap_or_default(), out);
                                self.calls - 1
                            }
                        };
                        match scan_hermes(&body).args {
                            Some(args) => send_args(&mut call, &body, index, args, out),
                            None if call.args_sent == 0 => out.push(ToolEvent::Args { index, delta: "{}".into() }),
                            None => {}
                        }
                        out.push(ToolEvent::End { index });
                    }
                }
            }
            Some(Form::Xml) => self.xml(&mut call, &body, true, out),
            None => push_content(out, format!("{OPEN}{body}{CLOSE}")),
        }
    }

    /// Walks the XML form from where it stopped; `whole` closes what is open.
    fn xml(&mut self, call: &mut Call, body: &str, whole: bool, out: &mut Vec<ToolEvent>) {
        loop {
            let rest = &body[call.xml_at..];
            if !call.xml_open {
                let Some(at) = rest.find(FUNCTION) else { return };
                let name_from = at + FUNCTION.len();
                let Some(gt) = rest[name_from..].find('>') else {
                    if whole && !rest[name_from..].trim().is_empty() {
                        let name = rest[name_from..].trim().to_string();
                        self.open_function(call, name, out);
                        self.end_function(call, out);
                    }
                    return;
                };
                let name = rest[name_from..name_from + gt].trim().to_string();
                call.xml_at += name_from + gt + 1;
                self.open_function(call, name, out);
                continue;
            }
            let index = call.current.expect("an open function has started");
            let param = rest.find(PARAMETER);
            let fend = rest.find(FUNCTION_END);
            match (param, fend) {
                (Some(p), f) if f.is_none_or(|f| p < f) => {
                    let name_from = p + PARAMETER.len();
                    let Some(gt) = rest[name_from..].find('>') else { return };
                    let pname = rest[name_from..name_from + gt].trim().to_string();
                    let value_from = name_from + gt + 1;
                    let after = &rest[value_from..];
                    // A value ends at its close tag, the next parameter or the function's end.
                    let ends =
                        [PARAMETER_END, PARAMETER, FUNCTION_END].iter().filter_map(|t| after.find(t).map(|i| (i, *t)));
                    let (value, consumed) = match ends.min_by_key(|(i, _)| *i) {
                        Some((i, t)) => (&after[..i], if t == PARAMETER_END { i + t.len() } else { i }),
                        None if whole => (after, after.len()),
                        None => return,
                    };
                    let v = convert(value, &pname, self.types.get(&call.xml_name));
                    let sep = if call.xml_params == 0 { "{" } else { ", " };
                    let key = python_json(&Value::String(pname));
                    let delta = format!("{sep}{key}: {}", python_json(&v));
                    out.push(ToolEvent::Args { index, delta });
                    call.xml_params += 1;
                    call.xml_at += value_from + consumed;
                }
                (_, Some(f)) => {
                    call.xml_at += f + FUNCTION_END.len();
                    self.end_function(call, out);
                }
                (_, None) => {
                    if whole {
                        self.end_function(call, out);
                    }
                    return;
                }
            }
        }
    }

    fn open_function(&mut self, call: &mut Call, name: String, out: &mut Vec<ToolEvent>) {
        call.xml_open = true;
        call.xml_params = 0;
        call.xml_name = name.clone();
        self.start(call, name, out);
    }

    fn end_function(&mut self, call: &mut Call, out: &mut Vec<ToolEvent>) {
        let index = call.current.expect("an open function has started");
        let close = if call.xml_params == 0 { "{}" } else { "}" };
        out.push(ToolEvent::Args { index, delta: close.into() });
        out.push(ToolEvent::End { index });
        call.xml_open = false;
    }
}

const FENCE: &str = "```";

enum Bare {
    /// The call's object starts at byte `from`.
    Yes {
        from: usize,
        fenced: bool,
    },
    No,
    Undecided,
}

/// Whether text at the start of an output begins a bare `{"name"` call,
/// possibly inside a ```` ``` ````, ```` ```json ```` or ```` ```xml ```` fence.
fn bare_start(s: &str) -> Bare {
    let mut t = s.trim_start();
    let mut fenced = false;
    if t.starts_with(FENCE) || (t.len() < FENCE.len() && FENCE.starts_with(t) && !t.is_empty()) {
        let Some(nl) = t.find('\n') else {
            let tag = &t[t.len().min(FENCE.len())..];
            return if "json".starts_with(tag) || "xml".starts_with(tag) { Bare::Undecided } else { Bare::No };
        };
        if !matches!(t[FENCE.len()..nl].trim(), "" | "json" | "xml") {
            return Bare::No;
        }
        t = t[nl + 1..].trim_start();
        fenced = true;
    }
    let from = s.len() - t.len();
    let Some(rest) = t.strip_prefix('{') else {
        return if t.is_empty() { Bare::Undecided } else { Bare::No };
    };
    let rest = rest.trim_start();
    const KEY: &str = "\"name\"";
    if rest.starts_with(KEY) {
        Bare::Yes { from, fenced }
    } else if KEY.starts_with(rest) {
        Bare::Undecided
    } else {
        Bare::No
    }
}

/// Sends the arguments' text of Hermes `body` (its value at `from..to`, the
/// end unknown while it is open) not yet sent.
fn send_args(call: &mut Call, body: &str, index: usize, (from, to): (usize, Option<usize>), out: &mut Vec<ToolEvent>) {
    let end = to.unwrap_or(body.len());
    if from + call.args_sent < end {
        out.push(ToolEvent::Args { index, delta: body[from + call.args_sent..end].to_string() });
        call.args_sent = end - from;
    }
}

fn push_content(out: &mut Vec<ToolEvent>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Content(c)) = out.last_mut() {
        c.push_str(&text);
    } else {
        out.push(ToolEvent::Content(text));
    }
}

/// Bytes at the end of `s` that begin `tag` (a tag that may still complete).
pub fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Hermes,
    Xml,
}

/// The form a call's body has, once its first characters tell.
fn form(body: &str) -> Option<Form> {
    let t = body.trim_start();
    if t.starts_with('{') {
        Some(Form::Hermes)
    } else if t.starts_with(FUNCTION) {
        Some(Form::Xml)
    } else {
        None
    }
}

/// What is known of a Hermes body's top-level object: the name, once its
/// string is whole; where the arguments' value begins and (once whole) ends.
#[derive(Debug, Default, PartialEq)]
struct HermesScan {
    name: Option<String>,
    args: Option<(usize, Option<usize>)>,
}

fn scan_hermes(s: &str) -> HermesScan {
    let b = s.as_bytes();
    let mut out = HermesScan::default();
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if b.get(i) != Some(&b'{') {
        return out;
    }
    i += 1;
    loop {
        ws(&mut i);
        match b.get(i) {
            Some(b'"') => {}
            _ => return out,
        }
        let Some(key_end) = string_end(b, i) else { return out };
        let key: Option<String> = serde_json::from_str(&s[i..key_end]).ok();
        i = key_end;
        ws(&mut i);
        if b.get(i) != Some(&b':') {
            return out;
        }
        i += 1;
        ws(&mut i);
        if i >= b.len() {
            return out;
        }
        let from = i;
        let end = value_end(b, i);
        match key.as_deref() {
            Some("arguments") => out.args = Some((from, end)),
            Some("name") => {
                if let Some(e) = end {
                    out.name = serde_json::from_str::<String>(&s[from..e]).ok();
                }
            }
            _ => {}
        }
        let Some(e) = end else { return out };
        i = e;
        ws(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            _ => return out,
        }
    }
}

/// The end (exclusive) of the JSON string starting at `b[i] == '"'`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// The end (exclusive) of the JSON value starting at `b[i]`, if it is whole
/// (a number or literal is whole once a delimiter follows it).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b[i] {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let j = i + b[i..].iter().position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace())?;
            Some(j)
        }
    }
}

/// An XML parameter's value as vLLM's Qwen3-Coder parser converts it.
fn convert(raw: &str, param: &str, types: Option<&HashMap<String, String>>) -> Value {
    let v = raw.strip_prefix('\n').unwrap_or(raw);
    let v = v.strip_suffix('\n').unwrap_or(v);
    if v.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    let text = || Value::String(v.to_string());
    let Some(ty) = types.and_then(|t| t.get(param)) else { return text() };
    let ty = ty.as_str();
    if matches!(ty, "string" | "str" | "text" | "varchar" | "char" | "enum") {
        return text();
    }
    if ["int", "uint", "long", "short", "unsigned"].iter().any(|p| ty.starts_with(p)) {
        return v.trim().parse::<i64>().map(Value::from).unwrap_or_else(|_| text());
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        return match v.trim().parse::<f64>() {
            Ok(f) if f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15 => Value::from(f as i64),
            Ok(f) => serde_json::Number::from_f64(f).map(Value::Number).unwrap_or_else(text),
            Err(_) => text(),
        };
    }
    if matches!(ty, "boolean" | "bool" | "binary") {
        return Value::Bool(v.trim().eq_ignore_ascii_case("true"));
    }
    serde_json::from_str::<Value>(v).unwrap_or_else(|_| text())
}

/// The calls and content of a whole output.
#[cfg(test)]
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    /// Each call's name and arguments (JSON text).
    pub calls: Vec<(String, String)>,
}

#[cfg(test)]
pub fn parse_whole(types: ParamTypes, text: &str) -> Parsed {
    let mut p = ToolCallParser::new(types);
    let mut events = p.push(text);
    events.extend(p.finish());
    collect(events)
}

/// Folds events into content and calls.
#[cfg(test)]
pub fn collect(events: impl IntoIterator<Item = ToolEvent>) -> Parsed {
    let mut out = Parsed::default();
    for e in events {
        match e {
            ToolEvent::Content(c) => out.content.push_str(&c),
            ToolEvent::Start { name, .. } => out.calls.push((name, String::new())),
            ToolEvent::Args { index, delta } => out.calls[index].1.push_str(&delta),
            ToolEvent::End { .. } => {}
        }
    }
    out
}

/// The arguments' JSON text as an object, for Anthropic's `input` (a
/// non-object or broken text becomes an empty object).
pub fn arguments_object(args: &str) -> Map<String, Value> {
    match serde_json::from_str::<Value>(args) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> ParamTypes {
        param_types(&[json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": ["array", "null"]}}}}})])
    }

    /// Feeding `text` whole, and cut at every pair of positions, gives `want`
    /// (events folded, so the cut may move text between events).
    fn check(text: &str, want: Parsed) {
        assert_eq!(parse_whole(tools(), text), want, "whole: {text:?}");
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &cuts {
            for &j in cuts.iter().filter(|&&j| j >= i).step_by(3) {
                let mut p = ToolCallParser::new(tools());
                let mut ev = Vec::new();
                for piece in [&text[..i], &text[i..j], &text[j..]] {
                    ev.extend(p.push(piece));
                }
                ev.extend(p.finish());
                // Starts come before their arguments and ends after them.
                let mut open = std::collections::HashSet::new();
                for e in &ev {
                    match e {
                        ToolEvent::Start { index, .. } => assert!(open.insert(*index)),
                        ToolEvent::Args { index, .. } => assert!(open.contains(index), "{ev:?}"),
                        ToolEvent::End { index } => assert!(open.remove(index)),
                        ToolEvent::Content(_) => {}
                    }
                }
                assert!(open.is_empty(), "unended calls in {ev:?}");
                assert_eq!(collect(ev), want, "{text:?} cut at {i}, {j}");
            }
        }
    }

    fn parsed(content: &str, calls: &[(&str, &str)]) -> Parsed {
        Parsed { content: content.into(), calls: calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect() }
    }

    #[test]
    fn hermes_calls() {
        check(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"q\": \"}<\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>",
            parsed("Let me check.\n", &[("get_weather", "{\"city\": \"Paris\", \"q\": \"}<\"}"), ("g", "{}")]),
        );
        // Arguments before the name; no arguments at all; an unclosed call.
        check("<tool_call>{\"arguments\": [1, 2], \"name\": \"é\"}</tool_call>", parsed("", &[("é", "[1, 2]")]));
        check("<tool_call>{\"name\": \"f\"}</tool_call>", parsed("", &[("f", "{}")]));
        check("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n", parsed("", &[("f", "{\"a\": 1}")]));
    }

    #[test]
    fn a_bare_call_at_the_start() {
        check(
            "\n{\"name\": \"f\", \"arguments\": {\"s\": \"}\"}}\nThat is all.",
            parsed("\nThat is all.", &[("f", "{\"s\": \"}\"}")]),
        );
        check(
            "```json\n{\n  \"name\": \"f\",\n  \"arguments\": {\"n\": 1}\n}\n```",
            parsed("", &[("f", "{\"n\": 1}")]),
        );
        check("```\n{\"name\": \"f\"}\n```\nok", parsed("\nok", &[("f", "{}")]));
        check("```python\n{\"name\": \"f\"}\n```", parsed("```python\n{\"name\": \"f\"}\n```", &[]));
        check("``", parsed("``", &[]));
        check("{\"name\": 1}", parsed("{\"name\": 1}", &[]));
        check("{\"nam", parsed("{\"nam", &[]));
        check("{\"x\": 1}", parsed("{\"x\": 1}", &[]));
        check("Text {\"name\": \"f\"}", parsed("Text {\"name\": \"f\"}", &[]));
    }

    #[test]
    fn not_a_call() {
        check("no calls <tool_ here", parsed("no calls <tool_ here", &[]));
        check("<tool_call>{oops}</tool_call> after", parsed("<tool_call>{oops}</tool_call> after", &[]));
        check("<tool_call>plain</tool_call>", parsed("<tool_call>plain</tool_call>", &[]));
    }

    #[test]
    fn xml_calls() {
        check(
            "Sure.\n<tool_call>\n<function=f>\n<parameter=s>\n 12 \n</parameter>\n<parameter=n>\n12\n</parameter>\n<parameter=x>\n2.0\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1, 2.5]}\n</parameter>\n<parameter=a>\nnull\n</parameter>\n<parameter=extra>\nline1\nline2\n</parameter>\n</function>\n</tool_call>",
            parsed(
                "Sure.\n",
                &[(
                    "f",
                    "{\"s\": \" 12 \", \"n\": 12, \"x\": 2, \"b\": true, \"o\": {\"k\": [1, 2.5]}, \"a\": null, \"extra\": \"line1\\nline2\"}",
                )],
            ),
        );
        // A parameter left unclosed before the next one; two functions; no parameters.
        check(
            "<tool_call>\n<function=f>\n<parameter=n>\nx1\n<parameter=x>\n0.5\n</function>\n<function=g>\n</function>\n</tool_call>",
            parsed("", &[("f", "{\"n\": \"x1\", \"x\": 0.5}"), ("g", "{}")]),
        );
        // A function cut off in its name after one with parameters.
        check(
            "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>\n<function=g",
            parsed("", &[("f", "{\"n\": 1}"), ("g", "{}")]),
        );
        // The output ends inside a value.
        check("<tool_call>\n<function=f>\n<parameter=s>\nabc", parsed("", &[("f", "{\"s\": \"abc\"}")]));
    }

    #[test]
    fn hermes_arguments_stream_as_they_arrive() {
        let mut p = ToolCallParser::new(ParamTypes::new());
        assert_eq!(p.push("Hi <tool_"), vec![ToolEvent::Content("Hi ".into())]);
        assert_eq!(p.push("call>\n{\"name\": \"f\""), vec![ToolEvent::Start { index: 0, name: "f".into() }]);
        assert_eq!(p.push(", \"arguments\": {\"a\": "), vec![ToolEvent::Args { index: 0, delta: "{\"a\": ".into() }]);
        assert_eq!(p.push("1}}\n</tool"), vec![ToolEvent::Args { index: 0, delta: "1}".into() }]);
        assert_eq!(p.push("_call>"), vec![ToolEvent::End { index: 0 }]);
        assert_eq!(p.finish(), vec![]);
    }
}
