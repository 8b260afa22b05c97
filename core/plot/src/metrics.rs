//! Reading `metrics.jsonl`: one JSON object per line, tolerant of what a crashed or resumed run
//! leaves behind.

use std::{collections::BTreeMap, fs, io, path::Path};

use serde_json::{Map, Value};

use crate::PlotError;

/// The metrics of one run, as read from its `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// The `step` of every record kept, in file order (ascending unless a record lacked a step).
    pub steps: Vec<u64>,
    /// Every numeric key of the records but `step` (so `timestamp` too), each as `(step, value)`
    /// points in file order. Nested objects are flattened with `/` (`{"a": {"b": 1}}` is `a/b`).
    /// Null, non-numeric and non-finite values are left out, so a series may have fewer points than
    /// [`Metrics::steps`].
    pub series: BTreeMap<String, Vec<(u64, f64)>>,
    /// One line for each line that was skipped (malformed, truncated by a crash, no `step`) or that
    /// restarted the step count (a resumed run: the new records replace the old ones from that step on).
    pub warnings: Vec<String>,
}

impl Metrics {
    /// The points of the series `name`, if it has any.
    pub fn get(&self, name: &str) -> Option<&[(u64, f64)]> {
        self.series.get(name).map(Vec::as_slice).filter(|points| !points.is_empty())
    }

    /// Names of the series with at least one point, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.series.iter().filter(|(_, points)| !points.is_empty()).map(|(name, _)| name.as_str())
    }

    /// Parses the text of a `metrics.jsonl`. `path` names the file in warnings and errors only.
    pub fn parse(text: &[u8], path: &Path) -> Result<Metrics, PlotError> {
        let mut metrics = Metrics::default();
        let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
        let last_with_text = lines.iter().rposition(|line| !is_blank(line));
        for (index, line) in lines.iter().enumerate() {
            if is_blank(line) {
                continue;
            }
            let number = index + 1;
            let record = match parse_line(line) {
                Ok(record) => record,
                Err(why) => {
                    // The last line of a file with no final newline is what a crash mid-write leaves.
                    let truncated = Some(index) == last_with_text && !text.ends_with(b"\n");
                    let what = if truncated { "truncated last line" } else { "malformed line" };
                    metrics.warnings.push(format!("{}:{number}: skipped {what} ({why})", path.display()));
                    continue;
                }
            };
            metrics.push(record, number, path);
        }
        if metrics.steps.is_empty() {
            return Err(PlotError::NoValidLines { path: path.to_owned() });
        }
        Ok(metrics)
    }

    fn push(&mut self, record: Map<String, Value>, number: usize, path: &Path) {
        let Some(step) = record.get("step").and_then(as_step) else {
            self.warnings.push(format!("{}:{number}: skipped a record without an integer `step`", path.display()));
            return;
        };
        if self.steps.last().is_some_and(|&last| step <= last) {
            // A run resumed from an earlier checkpoint appends to the same file: its records win.
            self.warnings.push(format!(
                "{}:{number}: step {step} follows step {}; dropped the earlier records from step {step} on \
                 (resumed run?)",
                path.display(),
                self.steps.last().unwrap_or(&0),
            ));
            self.steps.retain(|&s| s < step);
            for points in self.series.values_mut() {
                points.retain(|&(s, _)| s < step);
            }
        }
        self.steps.push(step);
        let mut flat = Vec::new();
        flatten("", &record, &mut flat);
        for (name, value) in flat {
            if name != "step" {
                self.series.entry(name).or_default().push((step, value));
            }
        }
    }
}

/// Reads and parses `path` (a `metrics.jsonl`). Lines that do not parse are skipped and reported in
/// [`Metrics::warnings`]; it is an error only when the file is missing, unreadable or has no valid record.
pub fn read_metrics(path: &Path) -> Result<Metrics, PlotError> {
    let text = fs::read(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => PlotError::NoMetrics { path: path.to_owned() },
        _ => PlotError::Read { path: path.to_owned(), source },
    })?;
    Metrics::parse(&text, path)
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

fn parse_line(line: &[u8]) -> Result<Map<String, Value>, String> {
    let value: Value = match serde_json::from_slice(line) {
        Ok(value) => value,
        // Python's json module writes NaN and ±Infinity as bare words, which are not JSON.
        Err(err) => match non_finite_words_to_null(line) {
            Some(fixed) => serde_json::from_slice(&fixed).map_err(|_| err.to_string())?,
            None => return Err(err.to_string()),
        },
    };
    match value {
        Value::Object(map) => Ok(map),
        other => Err(format!("expected a JSON object, found {}", kind(&other))),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Replaces the bare words `NaN`, `Infinity` and `-Infinity` outside strings with `null`; `None`
/// when there are none (so there is nothing to retry).
fn non_finite_words_to_null(line: &[u8]) -> Option<Vec<u8>> {
    const WORDS: [&[u8]; 3] = [b"-Infinity", b"Infinity", b"NaN"];
    let mut out = Vec::with_capacity(line.len());
    let (mut in_string, mut escaped, mut replaced) = (false, false, false);
    let mut i = 0;
    while i < line.len() {
        let byte = line[i];
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if byte == b'"' {
            in_string = true;
        } else if let Some(word) = WORDS.iter().find(|word| line[i..].starts_with(word)) {
            out.extend_from_slice(b"null");
            i += word.len();
            replaced = true;
            continue;
        }
        out.push(byte);
        i += 1;
    }
    replaced.then_some(out)
}

fn as_step(value: &Value) -> Option<u64> {
    value.as_u64().or_else(|| {
        let x = value.as_f64()?;
        (x >= 0.0 && x.fract() == 0.0 && x <= u64::MAX as f64).then_some(x as u64)
    })
}

fn flatten(prefix: &str, map: &Map<String, Value>, out: &mut Vec<(String, f64)>) {
    for (key, value) in map {
        let name = if prefix.is_empty() { key.clone() } else { format!("{prefix}/{key}") };
        match value {
            Value::Number(number) => {
                if let Some(x) = number.as_f64().filter(|x| x.is_finite()) {
                    out.push((name, x));
                }
            }
            Value::Object(inner) => flatten(&name, inner, out),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Metrics, PlotError> {
        Metrics::parse(text.as_bytes(), Path::new("m.jsonl"))
    }

    #[test]
    fn reads_series_and_skips_non_finite_values() {
        let m = parse(
            "{\"step\":1,\"timestamp\":10.5,\"reward\":0.5,\"loss/policy\":null,\"kl\":\"n/a\"}\n\
             {\"step\":2,\"reward\":NaN,\"loss/policy\":-0.25,\"kl\":Infinity,\"x\":{\"y\":3}}\n",
        )
        .unwrap();
        assert_eq!(m.steps, vec![1, 2]);
        assert_eq!(m.get("reward"), Some(&[(1, 0.5)][..]));
        assert_eq!(m.get("loss/policy"), Some(&[(2, -0.25)][..]));
        assert_eq!(m.get("timestamp"), Some(&[(1, 10.5)][..]));
        assert_eq!(m.get("x/y"), Some(&[(2, 3.0)][..]));
        assert_eq!(m.get("kl"), None);
        assert_eq!(m.get("step"), None);
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    }

    #[test]
    fn nan_inside_strings_is_left_alone() {
        assert_eq!(
            non_finite_words_to_null(br#"{"a":"NaN \" NaN","b":NaN}"#).unwrap(),
            br#"{"a":"NaN \" NaN","b":null}"#
        );
        assert_eq!(non_finite_words_to_null(br#"{"a":1}"#), None);
        assert_eq!(non_finite_words_to_null(br#"{"a":-Infinity}"#).unwrap(), br#"{"a":null}"#);
    }

    #[test]
    fn truncated_last_line_is_a_warning() {
        let m = parse("{\"step\":1,\"reward\":0.5}\n{\"step\":2,\"rew").unwrap();
        assert_eq!(m.steps, vec![1]);
        assert_eq!(m.warnings.len(), 1);
        assert!(m.warnings[0].contains("m.jsonl:2: skipped truncated last line"), "{}", m.warnings[0]);
    }

    #[test]
    fn malformed_lines_and_records_without_step_are_skipped() {
        let m =
            parse("[1,2]\n{\"step\":1,\"reward\":0.5}\n\n{\"reward\":1}\n{\"step\":-3}\n{\"step\":2.0,\"reward\":1}\n")
                .unwrap();
        assert_eq!(m.steps, vec![1, 2]);
        assert_eq!(m.warnings.len(), 3, "{:?}", m.warnings);
        assert!(m.warnings[0].contains("m.jsonl:1: skipped malformed line (expected a JSON object"));
        assert!(m.warnings[1].contains("m.jsonl:4:"));
        assert!(m.warnings[2].contains("m.jsonl:5:"));
    }

    #[test]
    fn resumed_run_replaces_earlier_records() {
        let m = parse(
            "{\"step\":1,\"r\":1}\n{\"step\":2,\"r\":2}\n{\"step\":3,\"r\":3}\n{\"step\":2,\"r\":20}\n{\"step\":3,\"r\":30}\n",
        )
        .unwrap();
        assert_eq!(m.steps, vec![1, 2, 3]);
        assert_eq!(m.get("r").unwrap(), &[(1, 1.0), (2, 20.0), (3, 30.0)]);
        assert_eq!(m.warnings.len(), 1);
    }

    #[test]
    fn no_valid_lines_is_an_error() {
        for text in ["", "\n\n", "{\"step\":1", "not json\n{\"reward\":1}\n"] {
            let err = parse(text).unwrap_err();
            assert!(matches!(err, PlotError::NoValidLines { .. }), "{text:?}: {err}");
            assert_eq!(err.to_string(), "m.jsonl: no valid metrics record (one JSON object with a `step` per line)");
        }
    }
}
