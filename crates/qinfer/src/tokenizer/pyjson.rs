//! `tojson` as transformers defines it for chat templates: Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
//! sort_keys=sort_keys)`, which differs from minijinja's built-in (spaces after
//! `,` and `:`, no HTML escaping, Python float formatting).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The minijinja filter: `x | tojson`, `x | tojson(indent=2)`.
pub(crate) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")),
        },
    };
    // Python's defaults: (', ', ': '), or (',', ': ') when indenting.
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (a.to_string(), b.to_string()),
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair")),
            }
        }
        _ => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
    };
    let style = Style { indent, item_sep, key_sep, sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

/// `json.dumps(value, ensure_ascii=False)`.
pub(crate) fn dumps(value: &Value) -> Result<String, Error> {
    let style = Style { indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(out)
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v),
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Bytes => write_str(out, &String::from_utf8_lossy(v.as_bytes().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, style, depth, '[', ']', items.len(), |out, i| {
                write_value(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            write_container(out, style, depth, '{', '}', keys.len(), |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(s) => write_str(out, s),
                    None => write_str(out, &key.to_string()),
                }
                out.push_str(&style.key_sep);
                write_value(out, &v.get_item(key)?, style, depth + 1)
            })?;
        }
        ValueKind::Plain | ValueKind::Invalid => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize {v}")));
        }
        // ValueKind is non-exhaustive.
        _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize {v}"))),
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    style: &Style,
    depth: usize,
    open: char,
    close: char,
    n: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        newline(out, style, depth + 1);
        item(out, i)?;
    }
    newline(out, style, depth);
    out.push(close);
    Ok(())
}

fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        // Integers of any width print as-is (Python ints are unbounded).
        out.push_str(&v.to_string());
        return;
    }
    match f64::try_from(v.clone()) {
        Ok(f) => out.push_str(&python_float_repr(f)),
        Err(_) => out.push_str(&v.to_string()),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, positional for
/// exponents in [-4, 16), else `1e+16` style; `NaN`/`Infinity` as json.dumps writes them.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // `{:e}` gives the shortest round-trip digits as d.ddde±x.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let s = if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{digits}{}.0", "0".repeat((int_len - n) as usize))
            } else {
                format!("{}.{}", &digits[..int_len as usize], &digits[int_len as usize..])
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_format_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (123.456, "123.456"),
            (1.5e-7, "1.5e-07"),
        ];
        for (f, s) in cases {
            assert_eq!(python_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v = Value::from_serialize(serde_json::json!({"b": [1, 2.0, "x\"y\n"], "a": null, "c": {"é": true}}));
        // Keys in the order given, as Python's dicts keep them.
        assert_eq!(dumps(&v).unwrap(), r#"{"b": [1, 2.0, "x\"y\n"], "a": null, "c": {"é": true}}"#);
    }
}
