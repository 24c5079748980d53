//! The tools a request offers and how it lets the model use them, read from
//! OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` and Anthropic's
//! `tools` / `tool_choice`, kept in OpenAI's shape (what chat templates
//! render). A required or named call is enforced by starting the output with
//! the call's opening in the template's own format (`<tool_call>` JSON or the
//! XML form), so the model cannot answer without calling.

use qinfer::tokenizer::Tokenizer;
use serde_json::{Value, json};

use crate::error::ApiResult;
use crate::params::Body;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls: the tools are not shown to the model.
    None,
    Auto,
    /// At least one call, of any tool.
    Required,
    /// A call of this tool.
    Named(String),
}

#[derive(Debug, Clone)]
pub struct Tools {
    /// `{"type": "function", "function": {"name", "description"?, "parameters"?}}` each.
    pub list: Vec<Value>,
    pub choice: ToolChoice,
    /// More than one call per answer.
    pub parallel: bool,
}

impl Tools {
    /// The tools the template renders (none when calls are off).
    pub fn rendered(&self) -> Option<Vec<Value>> {
        (self.choice != ToolChoice::None).then(|| self.list.clone())
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.list.iter().filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
    }

    fn check_named(&self, b: &Body<'_>, field: &str) -> ApiResult<()> {
        if let ToolChoice::Named(n) = &self.choice
            && !self.names().any(|t| t == n)
        {
            return Err(b.bad(field, format!("names the tool `{n}`, which is not among `tools`")));
        }
        Ok(())
    }
}

/// OpenAI's fields; None when the request offers no tools.
pub fn openai(b: &Body<'_>) -> ApiResult<Option<Tools>> {
    let list = match b.get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let field = format!("tools[{i}]");
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(b.bad(&field, "must have `type` \"function\""));
                }
                let f = t.get("function").ok_or_else(|| b.bad(&field, "needs `function`"))?;
                check_function(b, &field, f)?;
                Ok(t.clone())
            })
            .collect::<ApiResult<_>>()?,
        Some(_) => return Err(b.bad("tools", "must be an array")),
    };
    let choice = match b.get("tool_choice") {
        None if list.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(b.bad("tool_choice", "must be \"none\", \"auto\", \"required\" or a named function")),
        },
        Some(v @ Value::Object(_)) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => ToolChoice::Named(n.to_string()),
            _ => {
                return Err(b.bad(
                    "tool_choice",
                    "as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ));
            }
        },
        Some(_) => return Err(b.bad("tool_choice", "must be a string or an object")),
    };
    let parallel = match b.get("parallel_tool_calls") {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| b.bad("parallel_tool_calls", "must be true or false"))?,
    };
    finish(b, "tool_choice", Tools { list, choice, parallel })
}

/// Anthropic's fields (`{name, description?, input_schema}` tools; `tool_choice`
/// `{type: auto|any|tool|none, name?, disable_parallel_tool_use?}`), in OpenAI's shape.
pub fn anthropic(b: &Body<'_>) -> ApiResult<Option<Tools>> {
    let list = match b.get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let field = format!("tools[{i}]");
                match t.get("type").and_then(Value::as_str) {
                    None | Some("custom") => {}
                    Some(other) => {
                        return Err(b.bad(&field, format!("has type `{other}`; only custom (client) tools are served")));
                    }
                }
                let name = t.get("name").ok_or_else(|| b.bad(&field, "needs `name`"))?;
                let schema = t.get("input_schema").ok_or_else(|| b.bad(&field, "needs `input_schema`"))?;
                let mut f = json!({"name": name});
                if let Some(d) = t.get("description") {
                    f["description"] = d.clone();
                }
                f["parameters"] = schema.clone();
                check_function(b, &field, &f)?;
                Ok(json!({"type": "function", "function": f}))
            })
            .collect::<ApiResult<_>>()?,
        Some(_) => return Err(b.bad("tools", "must be an array")),
    };
    let (choice, parallel) = match b.get("tool_choice") {
        None => (if list.is_empty() { ToolChoice::None } else { ToolChoice::Auto }, true),
        Some(v @ Value::Object(_)) => {
            let parallel = match v.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(d)) => !d,
                Some(_) => return Err(b.bad("tool_choice", "`disable_parallel_tool_use` must be a boolean")),
            };
            let choice = match (v.get("type").and_then(Value::as_str), v.get("name").and_then(Value::as_str)) {
                (Some("auto"), _) => ToolChoice::Auto,
                (Some("any"), _) => ToolChoice::Required,
                (Some("none"), _) => ToolChoice::None,
                (Some("tool"), Some(n)) => ToolChoice::Named(n.to_string()),
                (Some("tool"), None) => return Err(b.bad("tool_choice", "of type `tool` needs `name`")),
                _ => return Err(b.bad("tool_choice", "`type` must be \"auto\", \"any\", \"tool\" or \"none\"")),
            };
            (choice, parallel)
        }
        Some(_) => return Err(b.bad("tool_choice", "must be an object")),
    };
    finish(b, "tool_choice", Tools { list, choice, parallel })
}

fn check_function(b: &Body<'_>, field: &str, f: &Value) -> ApiResult<()> {
    match f.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => {}
        _ => return Err(b.bad(field, "needs a non-empty string `name`")),
    }
    match f.get("parameters") {
        None | Some(Value::Null) | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err(b.bad(field, "`parameters` must be a JSON Schema object")),
    }
}

fn finish(b: &Body<'_>, field: &str, t: Tools) -> ApiResult<Option<Tools>> {
    if t.list.is_empty() {
        return match t.choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(b.bad(field, "asks for a tool call but `tools` is empty")),
        };
    }
    t.check_named(b, field)?;
    Ok(Some(t))
}

/// How the model's template writes a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>`
    Xml,
}

/// The template's call format; a template that renders no tools, or shows
/// no call format, cannot serve them (an error naming why).
pub fn call_format(tok: &Tokenizer, b: &Body<'_>) -> ApiResult<CallFormat> {
    let src = tok.chat_template().unwrap_or_default();
    if !src.contains("tools") {
        return Err(b.bad("tools", "cannot be used with this model: its chat template does not render tools"));
    }
    if src.contains("<function=") {
        Ok(CallFormat::Xml)
    } else if src.contains("<tool_call>") {
        Ok(CallFormat::Hermes)
    } else {
        Err(b.bad("tools", "cannot be used with this model: its chat template shows no <tool_call> format to parse"))
    }
}

/// The grammar (llguidance's Lark) that a required or named call's
/// arguments follow after [`forced_start`]'s opening: each offered tool's
/// name (when any may be called), its arguments as its `parameters` schema
/// allows, then the call's end. None where the choice forces nothing.
pub fn call_grammar(t: &Tools, format: CallFormat) -> Option<String> {
    if format == CallFormat::Xml {
        return xml_call_grammar(t);
    }
    let schema = |f: &Value| match f.get("parameters") {
        Some(p @ Value::Object(_)) => p.to_string(),
        _ => json!({"type": "object"}).to_string(),
    };
    let end = lit("}\n</tool_call>");
    let function =
        |name: &str| t.list.iter().filter_map(|x| x.get("function")).find(|f| f.get("name") == Some(&json!(name)));
    match &t.choice {
        ToolChoice::None | ToolChoice::Auto => None,
        ToolChoice::Named(n) => Some(format!("start: args {end}\nargs: %json {}\n", schema(function(n)?))),
        ToolChoice::Required => {
            let mut g = String::from("start: ");
            let mut rules = String::new();
            for (i, f) in t.list.iter().filter_map(|x| x.get("function")).enumerate() {
                let name = f.get("name").and_then(Value::as_str)?;
                let head = lit(&format!("{name}\", \"arguments\": "));
                g.push_str(if i == 0 { "" } else { " | " });
                g.push_str(&format!("c{i}"));
                rules.push_str(&format!("c{i}: {head} a{i} {end}\na{i}: %json {}\n", schema(f)));
            }
            Some(format!("{g}\n{rules}"))
        }
    }
}

/// A Lark string literal (JSON's escapes, as llguidance reads them).
fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// [`call_grammar`] for the XML form (Qwen3-Coder, Qwen3.5): after the
/// forced `<function=`, a tool's name and `>`; then its parameters as the
/// chat template writes them, `<parameter=K>`, the value on its own lines,
/// `</parameter>`, in the schema's order, the required ones present; then
/// `</function>` and `</tool_call>`. A string value is raw text up to the
/// first `\n</parameter>` (as the parser reads it), an enum one of its
/// values; any other value is JSON its schema allows. A tool whose
/// parameters name no properties takes any parameters with raw values.
fn xml_call_grammar(t: &Tools) -> Option<String> {
    let end = lit("</function>\n</tool_call>");
    let functions: Vec<&Value> = t.list.iter().filter_map(|x| x.get("function")).collect();
    let mut rules = String::new();
    // The parameters of function `i`, as a rule body.
    let mut params = |i: usize, f: &Value| -> String {
        let schema = f.get("parameters").cloned().unwrap_or(json!({}));
        let Some(props) = schema.get("properties").and_then(Value::as_object).filter(|p| !p.is_empty()) else {
            rules.push_str(&format!(
                "any{i}: \"<parameter=\" /[^>\\n]+/ \">\\n\" raw{i}\nraw{i}[suffix={}]: /(.|\\n)*/\n",
                lit("\n</parameter>\n")
            ));
            return format!("any{i}*");
        };
        let required: Vec<&str> =
            schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let mut body = Vec::new();
        for (j, (name, prop)) in props.iter().enumerate() {
            let open = lit(&format!("<parameter={name}>\n"));
            let close = lit("\n</parameter>\n");
            let rule = format!("p{i}_{j}");
            let enums = prop.get("enum").and_then(Value::as_array);
            let string = prop.get("type").and_then(Value::as_str) == Some("string");
            match (string, enums) {
                (true, Some(values)) => {
                    let alts: Vec<String> =
                        values.iter().filter_map(Value::as_str).map(|v| lit(&format!("{v}\n</parameter>\n"))).collect();
                    rules.push_str(&format!("{rule}: {open} ({})\n", alts.join(" | ")));
                }
                (true, None) => {
                    rules.push_str(&format!("{rule}: {open} v{i}_{j}\nv{i}_{j}[suffix={close}]: /(.|\\n)*/\n"))
                }
                (false, _) => rules.push_str(&format!("{rule}: {open} j{i}_{j} {close}\nj{i}_{j}: %json {prop}\n")),
            }
            body.push(if required.contains(&name.as_str()) { rule } else { format!("{rule}?") });
        }
        body.join(" ")
    };
    let start = match &t.choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Named(n) => {
            let (i, f) = functions.iter().enumerate().find(|(_, f)| f.get("name") == Some(&json!(n)))?;
            format!("start: {} {end}\n", params(i, f))
        }
        ToolChoice::Required => {
            let mut alts = Vec::new();
            for (i, f) in functions.iter().enumerate() {
                let name = f.get("name").and_then(Value::as_str)?;
                let body = params(i, f);
                alts.push(format!("{} {body} {end}", lit(&format!("{name}>\n"))));
            }
            format!("start: {}\n", alts.join(" | "))
        }
    };
    Some(format!("{start}{rules}"))
}

/// The text the output must start with for `choice` (after the prompt's
/// `prompt_text`): `(appended to the prompt, read as the output's start)`.
/// A prompt that leaves `<think>` open has it closed first.
pub fn forced_start(choice: &ToolChoice, format: CallFormat, prompt_text: &str) -> (String, String) {
    let call = match (choice, format) {
        (ToolChoice::None | ToolChoice::Auto, _) => return (String::new(), String::new()),
        (ToolChoice::Required, CallFormat::Hermes) => "<tool_call>\n{\"name\": \"".to_string(),
        (ToolChoice::Named(n), CallFormat::Hermes) => {
            format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", qinfer::tokenizer::python_json(&json!(n)))
        }
        (ToolChoice::Required, CallFormat::Xml) => "<tool_call>\n<function=".to_string(),
        (ToolChoice::Named(n), CallFormat::Xml) => format!("<tool_call>\n<function={n}>\n"),
    };
    let close = if prompt_text.trim_end().ends_with("<think>") { "</think>\n\n" } else { "" };
    (format!("{close}{call}"), call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structured::Grammars;
    use llguidance::api::TopLevelGrammar;
    use qinfer::engine::request::TokenConstraint;

    fn tools(choice: ToolChoice) -> Tools {
        let f = |name: &str, props: Value| {
            json!({"type": "function", "function": {"name": name, "parameters": {"type": "object",
                "properties": props, "required": ["city"], "additionalProperties": false}}})
        };
        Tools {
            list: vec![
                f("get_weather", json!({"city": {"type": "string"}})),
                f("get_time", json!({"city": {"type": "string"}, "h24": {"type": "boolean"}})),
            ],
            choice,
            parallel: true,
        }
    }

    /// Whether `text`'s tokens all pass the constraint, and the end may follow.
    fn passes(c: &mut dyn TokenConstraint, tok: &Tokenizer, text: &str, eos: u32) -> bool {
        for t in tok.encode(text, false).unwrap() {
            let m = c.allowed().unwrap().unwrap();
            if m[t as usize / 32] >> (t % 32) & 1 == 0 {
                return false;
            }
            c.accept(t).unwrap();
        }
        let m = c.allowed().unwrap().unwrap();
        m[eos as usize / 32] >> (eos % 32) & 1 == 1
    }

    #[test]
    fn a_forced_call_follows_its_schema_to_its_end() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tokenizer/qwen3");
        let tok = Tokenizer::from_dir(std::path::Path::new(dir)).unwrap().unwrap();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let g = Grammars::new(&tok, tok.vocab_size(), eos).unwrap();
        let make = |choice| {
            let lark = call_grammar(&tools(choice), CallFormat::Hermes).unwrap();
            g.immediate(TopLevelGrammar::from_lark(lark)).unwrap()
        };
        let named = make(ToolChoice::Named("get_time".into()));
        assert!(passes(
            named.start().unwrap().as_mut(),
            &tok,
            "{\"city\": \"Lyon\", \"h24\": true}}\n</tool_call>",
            eos
        ));
        assert!(!passes(named.start().unwrap().as_mut(), &tok, "{\"town\": \"Lyon\"}}\n</tool_call>", eos));
        let any = make(ToolChoice::Required);
        assert!(passes(
            any.start().unwrap().as_mut(),
            &tok,
            "get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            eos
        ));
        assert!(!passes(any.start().unwrap().as_mut(), &tok, "get_news\", \"arguments\": {}}\n</tool_call>", eos));
        assert_eq!(call_grammar(&tools(ToolChoice::Auto), CallFormat::Hermes), None);
        assert_eq!(call_grammar(&tools(ToolChoice::Auto), CallFormat::Xml), None);
    }

    /// The XML form (Qwen3-Coder, Qwen3.5) as the chat template writes it:
    /// a string value raw up to `</parameter>` (newlines and `<` inside
    /// allowed), other values as JSON of their type, required parameters
    /// present, nothing after the call's end.
    #[test]
    fn a_forced_xml_call_follows_its_schema_to_its_end() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tokenizer/qwen3");
        let tok = Tokenizer::from_dir(std::path::Path::new(dir)).unwrap().unwrap();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let g = Grammars::new(&tok, tok.vocab_size(), eos).unwrap();
        let make = |t: &Tools| {
            let lark = call_grammar(t, CallFormat::Xml).unwrap();
            g.immediate(TopLevelGrammar::from_lark(lark)).unwrap()
        };
        let end = "</function>\n</tool_call>";
        let named = make(&tools(ToolChoice::Named("get_time".into())));
        let call = |body: &str| format!("{body}{end}");
        let ok = |c: &std::sync::Arc<dyn qinfer::engine::request::ConstraintFactory>, text: &str| {
            passes(c.start().unwrap().as_mut(), &tok, text, eos)
        };
        assert!(ok(&named, &call("<parameter=city>\nLyon\n</parameter>\n<parameter=h24>\ntrue\n</parameter>\n")));
        assert!(ok(&named, &call("<parameter=city>\nSaint-<Étienne>\nnord\n</parameter>\n")));
        // A boolean must be JSON's; the required city must come; no unknown parameter.
        assert!(!ok(&named, &call("<parameter=city>\nLyon\n</parameter>\n<parameter=h24>\nyes\n</parameter>\n")));
        assert!(!ok(&named, &call("<parameter=h24>\ntrue\n</parameter>\n")));
        assert!(!ok(&named, &call("<parameter=city>\nLyon\n</parameter>\n<parameter=zone>\nCET\n</parameter>\n")));
        assert!(!ok(&named, &format!("<parameter=city>\nLyon\n</parameter>\n{end}\nmore")));
        let any = make(&tools(ToolChoice::Required));
        assert!(ok(&any, &format!("get_weather>\n<parameter=city>\nParis\n</parameter>\n{end}")));
        assert!(!ok(&any, &format!("get_news>\n<parameter=city>\nParis\n</parameter>\n{end}")));
        // Enums and a tool without properties.
        let mut t = tools(ToolChoice::Required);
        t.list = vec![
            json!({"type": "function", "function": {"name": "unit", "parameters": {"type": "object",
                "properties": {"u": {"type": "string", "enum": ["C", "F"]}}, "required": ["u"]}}}),
            json!({"type": "function", "function": {"name": "free"}}),
        ];
        let e = make(&t);
        assert!(ok(&e, &format!("unit>\n<parameter=u>\nC\n</parameter>\n{end}")));
        assert!(!ok(&e, &format!("unit>\n<parameter=u>\nK\n</parameter>\n{end}")));
        assert!(ok(&e, &format!("free>\n<parameter=a>\nx\n</parameter>\n<parameter=b>\n2\n</parameter>\n{end}")));
        assert!(ok(&e, &format!("free>\n{end}")));
    }
}
