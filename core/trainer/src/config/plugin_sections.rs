//! The plugin config sections (`algorithm.config`, `environment.config`, `rewards[i].config`)
//! reach their plugin as JSON, which has no NaN or infinity: a TOML `nan` or `inf` there would
//! arrive as `null` and be refused as "invalid type: null". They are checked here, with the
//! section's key, before any plugin sees them: each section is a table, every number finite.

use figment::value::Value;

use super::KeySource;
use crate::error::Result;

/// Checks every plugin config section of the merged layers.
pub(crate) fn check(src: &KeySource<'_>) -> Result<()> {
    for key in ["algorithm.config", "environment.config"] {
        if let Ok(v) = src.fig.find_value(key) {
            section(src, key, &v)?;
        }
    }
    if let Ok(Value::Array(_, items)) = src.fig.find_value("rewards") {
        for (i, item) in items.iter().enumerate() {
            if let Some(v) = item.as_dict().and_then(|d| d.get("config")) {
                section(src, &format!("rewards[{i}].config"), v)?;
            }
        }
    }
    Ok(())
}

fn section(src: &KeySource<'_>, key: &str, v: &Value) -> Result<()> {
    if v.as_dict().is_none() {
        let what = match v {
            Value::String(_, s) => format!("the string {s:?}"),
            Value::Array(..) => "a list".into(),
            Value::Bool(..) => "a boolean".into(),
            Value::Num(..) => "a number".into(),
            _ => "something else".into(),
        };
        return Err(src.error(key, &format!("expected a table (`{{ key = value, ... }}`), got {what}")));
    }
    finite(src, key, v)
}

/// Refuses a NaN or infinite number anywhere in `v`, naming its key.
fn finite(src: &KeySource<'_>, key: &str, v: &Value) -> Result<()> {
    match v {
        Value::Num(_, n) => match n.to_f64() {
            Some(x) if !x.is_finite() => Err(src.error(key, &format!("{x} is not a finite number"))),
            _ => Ok(()),
        },
        Value::Dict(_, d) => d.iter().try_for_each(|(k, x)| finite(src, &format!("{key}.{k}"), x)),
        Value::Array(_, items) => {
            items.iter().enumerate().try_for_each(|(i, x)| finite(src, &format!("{key}[{i}]"), x))
        }
        _ => Ok(()),
    }
}
