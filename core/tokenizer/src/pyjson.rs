//! `json.dumps` as transformers' chat-template `tojson` filter calls it, over minijinja values.
//!
//! minijinja's own `tojson` differs from transformers' in three ways that change the rendered
//! prompt: it escapes `<`, `>`, `&` and `'` as `\u003c` etc. (HTML-safe), it uses compact
//! separators (`,` and `:` instead of Python's `, ` and `: `), and it takes no `ensure_ascii`,
//! `separators` or `sort_keys`. This module reproduces Python's output instead.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Options of `json.dumps` that transformers' `tojson` exposes.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub(crate) ensure_ascii: bool,
    /// `None`: single line. `Some(s)`: newline and `s` repeated per level.
    pub(crate) indent: Option<String>,
    pub(crate) item_separator: String,
    pub(crate) key_separator: String,
    pub(crate) sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// The `tojson` filter: `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// arguments positional or by keyword, like transformers' Python function.
pub(crate) fn tojson_filter(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments besides the value"));
    }
    let mut slots: [Option<Value>; 4] = Default::default();
    for (slot, arg) in slots.iter_mut().zip(args) {
        *slot = Some(arg.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slots[i].is_some() {
                return Err(invalid(format!("tojson got multiple values for {name}")));
            }
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = slots;

    let mut opts = DumpOptions::default();
    if let Some(v) = ensure_ascii {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = sort_keys {
        opts.sort_keys = v.is_true();
    }
    if let Some(v) = indent {
        opts.indent = match v.kind() {
            ValueKind::None | ValueKind::Undefined => None,
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            ValueKind::Number if v.is_integer() => {
                let n = i64::try_from(v.clone()).unwrap_or(0);
                Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(1024)))
            }
            _ => return Err(invalid(format!("tojson: indent must be an int or a string, got {v}"))),
        };
        if opts.indent.is_some() {
            opts.item_separator = ",".into();
        }
    }
    if let Some(v) = separators {
        if !v.is_none() && !v.is_undefined() {
            let parts: Vec<Value> =
                v.try_iter().map_err(|_| invalid("tojson: separators must be a pair of strings"))?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    opts.item_separator = a.as_str().unwrap_or_default().to_owned();
                    opts.key_separator = b.as_str().unwrap_or_default().to_owned();
                }
                _ => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
    }
    Ok(Value::from_safe_string(dumps(value, &opts)?))
}

/// Serialises `value` like Python's `json.dumps` with the given options.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    dump(value, opts, 0, &mut out)?;
    Ok(out)
}

fn newline_indent(opts: &DumpOptions, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

const MAX_DEPTH: usize = 500;

fn dump(value: &Value, opts: &DumpOptions, level: usize, out: &mut String) -> Result<(), Error> {
    if level > MAX_DEPTH {
        return Err(invalid("tojson: value nested too deeply"));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(value, out),
        ValueKind::String => write_string(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline_indent(opts, level + 1, out);
                dump(item, opts, level + 1, out)?;
            }
            newline_indent(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline_indent(opts, level + 1, out);
                write_string(key, opts.ensure_ascii, out);
                out.push_str(&opts.key_separator);
                dump(item, opts, level + 1, out)?;
            }
            newline_indent(opts, level, out);
            out.push('}');
        }
        ValueKind::Undefined => return Err(invalid("tojson: Object of type Undefined is not JSON serializable")),
        other => return Err(invalid(format!("tojson: Object of type {other} is not JSON serializable"))),
    }
    Ok(())
}

/// Python converts str, int, float, bool and None keys to strings; anything else is a TypeError.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(key, &mut s);
            Ok(s)
        }
        other => Err(invalid(format!("tojson: keys must be str, int, float, bool or None, not {other}"))),
    }
}

fn write_number(value: &Value, out: &mut String) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) if f.is_nan() => out.push_str("NaN"),
            Ok(f) if f.is_infinite() => out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" }),
            Ok(f) => out.push_str(&py_float_repr(f)),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    }
}

/// Python's `repr(float)` for finite values: shortest round-trip digits, positional
/// notation for exponents in `-4..16`, otherwise `1.5e+20` style.
pub(crate) fn py_float_repr(f: f64) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "nan".into()
        } else if f > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m.to_owned(), e.parse::<i32>().unwrap_or(0)),
        None => (sci.clone(), 0),
    };
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
    }
}

fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
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
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        // Expected values are Python 3.11's repr().
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (-0.0, "-0.0"),
            (3.0e100, "3e+100"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn strings_escape_like_python() {
        let mut out = String::new();
        write_string("a\"b\\c\n\t\u{1}<>&'é\u{7f}😀", false, &mut out);
        assert_eq!(out, "\"a\\\"b\\\\c\\n\\t\\u0001<>&'é\u{7f}😀\"");
        let mut out = String::new();
        write_string("é\u{7f}😀", true, &mut out);
        assert_eq!(out, "\"\\u00e9\\u007f\\ud83d\\ude00\"");
    }

    #[test]
    fn structures_like_python() {
        let v = Value::from_serialize(serde_json::json!({"b": [1, 2.5, null, true], "a": {}}));
        let opts = DumpOptions::default();
        let got = dumps(&v, &opts).unwrap();
        // Keys keep insertion order only with serde_json's preserve_order; compare sorted.
        let sorted = DumpOptions { sort_keys: true, ..DumpOptions::default() };
        assert_eq!(dumps(&v, &sorted).unwrap(), r#"{"a": {}, "b": [1, 2.5, null, true]}"#);
        assert!(got.contains(r#""b": [1, 2.5, null, true]"#), "{got}");
        let indented = DumpOptions {
            indent: Some("  ".into()),
            item_separator: ",".into(),
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &indented).unwrap(),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}"
        );
        assert!(dumps(&Value::UNDEFINED, &opts).is_err());
    }
}
