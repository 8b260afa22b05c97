//! Data where users keep it: Parquet files (one file, a directory of `*.parquet` shards, or a glob
//! such as `data/train-*.parquet`) read row by row into the JSON object a JSONL line would be, and
//! the column mapping (`prompt_key`, `response_key`, … as verl/OpenRLHF name them) that renames a
//! row's (or a JSONL line's) fields to the names the parsers read.
//!
//! A row becomes `{column: value}`: strings stay strings, lists become arrays, structs (a chat
//! message) objects, numbers and booleans stay themselves; a null cell is an absent field (so a
//! file can mix `prompt`/`response` rows and `messages` rows); a binary column is read as UTF-8
//! text, and a row where it is not is counted as a bad row — but the `bytes` of a struct (an image
//! as `datasets` writes it, `{bytes, path}`) is passed on as `{"$binary": "<base64>"}`. Rows are decoded one row group at a time, so a large file is never read whole.

use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use serde_json::{Map, Value};

use crate::error::{Result, TrainerError};

/// The field names the parsers read, each with the column (or JSONL field) that holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Columns {
    /// `(name the parser reads, config key, name in the data)`.
    map: Vec<(&'static str, &'static str, String)>,
    /// Alternatives, each a set of parser names that must all be columns of a Parquet file.
    required: Vec<Vec<&'static str>>,
    /// Parser names whose renamed column is copied, not moved: the original stays in the row.
    kept: Vec<&'static str>,
    /// Config keys configured as an empty name.
    empty: Vec<&'static str>,
}

impl Columns {
    /// From `(name the parser reads, config key, configured name)`; an empty configured name is the
    /// parser's own.
    pub fn new(keys: &[(&'static str, &'static str, &str)]) -> Self {
        let map = keys
            .iter()
            .map(|(canon, key, name)| {
                (*canon, *key, if name.is_empty() { canon.to_string() } else { name.to_string() })
            })
            .collect();
        let empty = keys.iter().filter(|(_, _, name)| name.is_empty()).map(|(_, key, _)| *key).collect();
        Columns { map, required: Vec::new(), kept: Vec::new(), empty }
    }

    /// With the columns of `canon` kept under their own names too (the label column of RL data
    /// reaches reward functions under the name the dataset gives it, as TRL passes columns).
    pub fn keeping(mut self, canon: &[&'static str]) -> Self {
        self.kept = canon.to_vec();
        self
    }

    /// With the columns a Parquet file must have: any one of `sets` complete.
    pub fn requiring(mut self, sets: &[&[&'static str]]) -> Self {
        self.required = sets.iter().map(|s| s.to_vec()).collect();
        self
    }

    /// The name in the data of the parser's field `canon` (itself when unmapped).
    pub fn name<'a>(&'a self, canon: &'a str) -> &'a str {
        self.map.iter().find(|m| m.0 == canon).map_or(canon, |m| m.2.as_str())
    }

    /// The config key of the first column configured as an empty name (which reads as the
    /// parser's own name: a config should say so by leaving the key out).
    pub fn empty_key(&self) -> Option<&'static str> {
        self.empty.first().copied()
    }

    /// Whether any field is mapped to another name.
    pub fn is_identity(&self) -> bool {
        self.map.iter().all(|(canon, _, name)| canon == name)
    }

    /// Renames mapped fields of `obj` to the names the parsers read (a field already under the
    /// parser's name is replaced by the mapped one). A dotted name is a path into nested objects
    /// (`reward_model.ground_truth`, as verl keeps its answers): the value is copied out and its
    /// container stays (rewards see it as metadata). Fails, naming the path and its key, when a
    /// nested path is missing: a nested key is never optional.
    pub fn rename(&self, obj: &mut Map<String, Value>) -> std::result::Result<(), String> {
        for (canon, key, name) in &self.map {
            if canon == name {
                continue;
            }
            let value = match name.split_once('.') {
                None if self.kept.contains(canon) => obj.get(name.as_str()).cloned(),
                None => obj.remove(name.as_str()),
                Some((top, rest)) => {
                    let found = rest.split('.').try_fold(obj.get(top), |v, k| Ok::<_, ()>(v.and_then(|v| v.get(k))));
                    match found.ok().flatten() {
                        Some(v) if !v.is_null() => Some(v.clone()),
                        _ => return Err(format!("no `{name}` (data.{key})")),
                    }
                }
            };
            match value {
                Some(v) => {
                    obj.insert(canon.to_string(), v);
                }
                None => {
                    obj.remove(*canon);
                }
            }
        }
        Ok(())
    }

    /// The top-level column of the parser's field `canon` (the first part of a dotted path).
    fn column<'a>(&'a self, canon: &'a str) -> &'a str {
        let name = self.name(canon);
        name.split_once('.').map_or(name, |(top, _)| top)
    }

    /// `a` (`data.KEY`) for error messages.
    fn describe(&self, canon: &str) -> String {
        match self.map.iter().find(|m| m.0 == canon) {
            Some((c, key, name)) if c != name => format!("`{name}` (data.{key})"),
            _ => format!("`{canon}`"),
        }
    }
}

/// Whether a data spec names a table: Parquet, a directory `datasets` saved with `save_to_disk`
/// ([`crate::arrow_dir`]), or a Hub dataset (`org/name[:subset]:split`, its Parquet files).
pub fn is_tabular(spec: &str) -> bool {
    is_parquet(spec) || crate::arrow_dir::is_arrow_dir(spec) || is_hub_dataset(spec)
}

/// Whether `spec` names a dataset on the Hugging Face Hub rather than a local path.
pub fn is_hub_dataset(spec: &str) -> bool {
    !Path::new(spec).exists() && !spec.contains('*') && rlhf_hub::datasets::parse_dataset(spec).is_some()
}

/// Whether a data spec names Parquet: a `.parquet` file or glob, or a directory of `*.parquet`.
pub fn is_parquet(spec: &str) -> bool {
    let p = Path::new(spec);
    spec.ends_with(".parquet")
        || (p.is_dir()
            && std::fs::read_dir(p)
                .is_ok_and(|d| d.flatten().any(|e| e.path().extension().is_some_and(|x| x == "parquet"))))
}

/// The files of a Parquet spec, sorted: the file itself, a directory's `*.parquet`, or the matches
/// of a `*` glob in the file name.
pub fn shards(spec: &str) -> Result<Vec<PathBuf>> {
    let p = Path::new(spec);
    if crate::arrow_dir::is_arrow_dir(spec) {
        return crate::arrow_dir::files(p);
    }
    if is_hub_dataset(spec) {
        if let Some(files) = rlhf_hub::datasets::resolve_dataset(spec) {
            return files.map_err(|e| TrainerError::Data { path: p.to_path_buf(), message: e.to_string() });
        }
    }
    let err = |message: String| TrainerError::Data { path: p.to_path_buf(), message };
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let mut files: Vec<PathBuf> = if p.is_dir() {
        let d = std::fs::read_dir(p).map_err(|e| TrainerError::io(p, e))?;
        d.flatten().map(|e| e.path()).filter(|f| f.extension().is_some_and(|x| x == "parquet")).collect()
    } else if name.contains('*') {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let d = std::fs::read_dir(dir).map_err(|e| TrainerError::io(dir, e))?;
        d.flatten()
            .map(|e| e.path())
            .filter(|f| f.is_file() && f.file_name().and_then(|n| n.to_str()).is_some_and(|n| glob_match(name, n)))
            .collect()
    } else if p.is_file() {
        vec![p.to_path_buf()]
    } else {
        return Err(err("file not found".into()));
    };
    files.sort();
    if files.is_empty() {
        return Err(err("no Parquet files match".into()));
    }
    Ok(files)
}

/// `*` matches any run of characters; everything else matches itself.
fn glob_match(pat: &str, name: &str) -> bool {
    let parts: Vec<&str> = pat.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return pat == name;
    }
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// One row: its object, or why it cannot be one.
pub type Row = std::result::Result<Map<String, Value>, String>;

/// Reads every row of the Parquet files (or the saved `datasets` directory) of `spec` (renamed by
/// `cols`), calling `f(row number, file, row)`; numbers are 1-based per file. A file without the columns `cols` requires
/// ([`Columns::requiring`]) is refused with an error naming the file and the missing column.
pub fn for_each_row(spec: &str, cols: &Columns, mut f: impl FnMut(usize, &Path, Row) -> Result<()>) -> Result<()> {
    let arrow = crate::arrow_dir::is_arrow_dir(spec);
    for path in shards(spec)? {
        let err = |message: String| TrainerError::Data { path: path.clone(), message };
        // A null cell is an absent field (a column another kind of row fills).
        let finish = |mut o: Map<String, Value>| -> Row {
            o.retain(|_, v| !v.is_null());
            cols.rename(&mut o)?;
            Ok(o)
        };
        if arrow {
            check_columns(&crate::arrow_dir::columns(&path)?, cols).map_err(err)?;
            let mut n = 0;
            crate::arrow_dir::for_each_row(&path, |row| {
                n += 1;
                f(n, &path, finish(row))
            })?;
            continue;
        }
        let file = File::open(&path).map_err(|e| TrainerError::io(&path, e))?;
        let reader = SerializedFileReader::new(file).map_err(|e| err(format!("not a readable Parquet file: {e}")))?;
        let schema = reader.metadata().file_metadata().schema_descr();
        let names: Vec<String> = schema.root_schema().get_fields().iter().map(|t| t.name().to_string()).collect();
        check_columns(&names, cols).map_err(err)?;
        let rows = reader.get_row_iter(None).map_err(|e| err(format!("cannot read rows: {e}")))?;
        for (i, row) in rows.enumerate() {
            let row = row.map_err(|e| err(format!("row {}: cannot be read: {e}", i + 1)))?;
            let obj = row.get_column_iter().map(|(k, v)| Ok((k.clone(), json_of(v)?))).collect::<Row>();
            f(i + 1, &path, obj.and_then(finish))?;
        }
    }
    Ok(())
}

/// Refuses a file without the columns `cols` requires ([`Columns::requiring`]), naming the missing
/// column and the file's columns (`names`).
fn check_columns(names: &[String], cols: &Columns) -> std::result::Result<(), String> {
    let required = &cols.required;
    let has = |canon: &str| names.iter().any(|n| n == cols.column(canon));
    if required.is_empty() || required.iter().any(|set| set.iter().all(|c| has(c))) {
        return Ok(());
    }
    // Name the first missing column of the alternative closest to complete.
    let best = required.iter().rev().max_by_key(|set| set.iter().filter(|c| has(c)).count()).unwrap();
    let missing: Vec<String> = best.iter().filter(|c| !has(c)).map(|c| cols.describe(c)).collect();
    let others: Vec<String> = required
        .iter()
        .filter(|s| !std::ptr::eq(*s, best))
        .map(|s| s.iter().map(|c| cols.describe(c)).collect::<Vec<_>>().join(" + "))
        .collect();
    let alt = if others.is_empty() { String::new() } else { format!(" (or {})", others.join(", or ")) };
    Err(format!("no column {}{alt}; the file's columns: {}", missing.join(" and "), names.join(", ")))
}

fn json_of(f: &Field) -> std::result::Result<Value, String> {
    Ok(match f {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => (*n).into(),
        Field::Short(n) => (*n).into(),
        Field::Int(n) => (*n).into(),
        Field::Long(n) => (*n).into(),
        Field::UByte(n) => (*n).into(),
        Field::UShort(n) => (*n).into(),
        Field::UInt(n) => (*n).into(),
        Field::ULong(n) => (*n).into(),
        Field::Float16(x) => serde_json::Number::from_f64(f64::from(*x)).map_or(Value::Null, Value::Number),
        Field::Float(x) => serde_json::Number::from_f64(f64::from(*x)).map_or(Value::Null, Value::Number),
        Field::Double(x) => serde_json::Number::from_f64(*x).map_or(Value::Null, Value::Number),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => {
            Value::String(String::from_utf8(b.data().to_vec()).map_err(|_| "not valid UTF-8".to_string())?)
        }
        Field::Group(row) => Value::Object(
            row.get_column_iter()
                .map(|(k, v)| match v {
                    // An image as `datasets` writes its `Image` feature: `{bytes: binary, path}`.
                    Field::Bytes(b) if k == "bytes" => {
                        let text = rlhf_vision::prompt::encode_base64(b.data());
                        Ok((k.clone(), serde_json::json!({ rlhf_vision::prompt::BINARY_KEY: text })))
                    }
                    _ => Ok((k.clone(), json_of(v)?)),
                })
                .collect::<Row>()?,
        ),
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(json_of).collect::<std::result::Result<_, _>>()?)
        }
        Field::MapInternal(map) => {
            let mut o = Map::new();
            for (k, v) in map.entries() {
                let key = match json_of(k)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                o.insert(key, json_of(v)?);
            }
            Value::Object(o)
        }
        // Dates, times, decimals: their text.
        other => Value::String(other.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_and_renames() {
        assert!(glob_match("train-*.parquet", "train-00000-of-00002.parquet"));
        assert!(!glob_match("train-*.parquet", "test-0.parquet"));
        assert!(glob_match("*", "x") && glob_match("a*b*c", "a12b3c") && !glob_match("a*b*c", "acb"));
        let cols = Columns::new(&[("prompt", "prompt_key", "question"), ("label", "label_key", "")]);
        assert!(!cols.is_identity());
        let mut o: Map<String, Value> = serde_json::from_str(r#"{"question": "q", "label": 1}"#).unwrap();
        cols.rename(&mut o).unwrap();
        assert_eq!(Value::Object(o), serde_json::json!({"prompt": "q", "label": 1}));
        assert_eq!(cols.describe("prompt"), "`question` (data.prompt_key)");
        let cols = Columns::new(&[("label", "label_key", "solution")]).keeping(&["label"]);
        let mut o: Map<String, Value> = serde_json::from_str(r#"{"prompt": "q", "solution": "7"}"#).unwrap();
        cols.rename(&mut o).unwrap();
        assert_eq!(Value::Object(o), serde_json::json!({"prompt": "q", "label": "7", "solution": "7"}));
        // verl's layout: the answer nested, its container kept as metadata.
        let cols = Columns::new(&[("label", "label_key", "reward_model.ground_truth")]);
        let mut o: Map<String, Value> =
            serde_json::from_str(r#"{"prompt": "q", "reward_model": {"ground_truth": "7", "style": "rule"}}"#).unwrap();
        cols.rename(&mut o).unwrap();
        assert_eq!(o["label"], "7");
        assert_eq!(o["reward_model"]["style"], "rule");
        assert_eq!(cols.column("label"), "reward_model");
        for missing in [r#"{"reward_model": {"style": "rule"}}"#, r#"{"prompt": "q"}"#, r#"{"reward_model": 3}"#] {
            let mut o: Map<String, Value> = serde_json::from_str(missing).unwrap();
            assert_eq!(cols.rename(&mut o).unwrap_err(), "no `reward_model.ground_truth` (data.label_key)");
        }
    }
}
