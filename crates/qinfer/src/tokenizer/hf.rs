//! Hugging Face tokenizer directories: `tokenizer.json`, `tokenizer_config.json`
//! (special-token strings, `add_bos_token`, `clean_up_tokenization_spaces`,
//! `chat_template`) and `chat_template.jinja` / `chat_template.json`.

use std::path::Path;

use serde_json::Value;

use super::{BosRule, Parts, SpecialTokens, Tokenizer};
use crate::{Error, Result};

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::malformed(path, e.to_string()))
}

/// A special token given as `"<s>"`, `{"content": "<s>", ...}` or null.
fn token_string(cfg: &Value, key: &str, path: &Path) -> Result<Option<String>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(Error::malformed(path, format!("`{key}` object has no string `content`"))),
        },
        Some(other) => Err(Error::malformed(path, format!("`{key}`: expected a string or {{content}}, found {other}"))),
    }
}

fn opt_bool(cfg: &Value, key: &str, path: &Path) -> Result<Option<bool>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(Error::malformed(path, format!("`{key}`: expected a boolean, found {other}"))),
    }
}

/// `chat_template` as a string, or a list of `{name, template}` (use "default").
fn template_from_value(v: &Value, path: &Path) -> Result<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => {
            for item in list {
                let name = item.get("name").and_then(Value::as_str);
                let template = item.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => return Err(Error::malformed(path, "`chat_template` list entries need `name` and `template`")),
                }
            }
            Ok(None)
        }
        other => Err(Error::malformed(path, format!("`chat_template`: expected a string or a list, found {other}"))),
    }
}

/// transformers prefers `chat_template.jinja`, then the config's
/// `chat_template`, then `chat_template.json`.
fn chat_template(dir: &Path, cfg: &Value, cfg_path: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja).map(Some).map_err(|e| Error::io(&jinja, e));
    }
    if let Some(v) = cfg.get("chat_template")
        && let Some(t) = template_from_value(v, cfg_path)?
    {
        return Ok(Some(t));
    }
    let json_path = dir.join("chat_template.json");
    match read_json(&json_path)? {
        Some(v) => match v.get("chat_template") {
            Some(t) => template_from_value(t, &json_path),
            None => Ok(None),
        },
        None => Ok(None),
    }
}

fn additional_tokens(cfg: &Value, path: &Path) -> Result<Vec<String>> {
    match cfg.get("additional_special_tokens") {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                Value::Object(o) => o
                    .get("content")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| Error::malformed(path, "`additional_special_tokens` entry without `content`")),
                other => Err(Error::malformed(path, format!("`additional_special_tokens`: unexpected {other}"))),
            })
            .collect(),
        Some(other) => {
            Err(Error::malformed(path, format!("`additional_special_tokens`: expected a list, found {other}")))
        }
    }
}

pub(super) fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        return Ok(None);
    }
    let inner = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::malformed(&tok_path, e.to_string()))?;
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = read_json(&cfg_path)?.unwrap_or(Value::Object(Default::default()));
    let specials = SpecialTokens {
        bos: token_string(&cfg, "bos_token", &cfg_path)?,
        eos: token_string(&cfg, "eos_token", &cfg_path)?,
        unk: token_string(&cfg, "unk_token", &cfg_path)?,
        pad: token_string(&cfg, "pad_token", &cfg_path)?,
        sep: token_string(&cfg, "sep_token", &cfg_path)?,
        cls: token_string(&cfg, "cls_token", &cfg_path)?,
        mask: token_string(&cfg, "mask_token", &cfg_path)?,
        additional: additional_tokens(&cfg, &cfg_path)?,
    };
    let bos_id = specials.bos.as_deref().and_then(|b| inner.token_to_id(b));
    let bos_rule = match (opt_bool(&cfg, "add_bos_token", &cfg_path)?, bos_id) {
        (Some(true), Some(id)) => BosRule::Ensure(id),
        (Some(false), Some(id)) => BosRule::Strip(id),
        (Some(true), None) => {
            return Err(Error::malformed(
                &cfg_path,
                "`add_bos_token` is true but `bos_token` is missing or not in the vocabulary",
            ));
        }
        (Some(false) | None, None) | (None, Some(_)) => BosRule::AsTokenizer,
    };
    let eos_ids = match specials.eos.as_deref() {
        None => vec![],
        Some(e) => match inner.token_to_id(e) {
            Some(id) => vec![id],
            None => return Err(Error::malformed(&cfg_path, format!("`eos_token` {e:?} is not in the vocabulary"))),
        },
    };
    let chat_template = chat_template(dir, &cfg, &cfg_path)?;
    Tokenizer::from_parts(Parts {
        inner,
        specials,
        eos_ids,
        bos_rule,
        append_eos: None,
        clean_up_spaces: opt_bool(&cfg, "clean_up_tokenization_spaces", &cfg_path)?.unwrap_or(false),
        chat_template,
    })
    .map(Some)
}

impl Tokenizer {
    /// Loads `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`)
    /// from a model directory; None when there is no `tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        from_dir(dir)
    }
}
