//! Prompt data for RL: JSONL lines (or Parquet rows, [`crate::tabular`]) with `prompt` (text) or chat `messages`, an optional `label`
//! (string or number) and any other fields, which reach reward plugins as metadata. Prompts are
//! rendered through the chat template when configured and the tokenizer has one, tokenized, and
//! truncated from the left to `max_prompt_len` with a warning. Batches cycle through the data in
//! a seeded order that is reshuffled every pass.

use std::path::{Path, PathBuf};

use rlhf_tokenizer::{ChatMessage, HfTokenizer};
use serde_json::{Map, Value};

use crate::config::DataConfig;
use crate::error::{Result, TrainerError};
use crate::prompt_images::PromptImages;
use crate::tabular::Columns;
use rlhf_vision::ImageRef;

/// One prompt, ready for generation.
#[derive(Debug, Clone)]
pub struct PromptRecord {
    /// The text the model sees (template applied).
    pub text: String,
    pub ids: Vec<u32>,
    pub label: Option<String>,
    /// The line's other fields.
    pub metadata: Value,
    /// The prompt as chat messages before templating (a plain prompt is one user message).
    pub messages: Vec<ChatMessage>,
    /// The prompt's images, in the order of their placeholders in `ids`.
    pub images: Vec<ImageRef>,
    /// Each image's grid `[t, h, w]` in patches.
    pub grids: Vec<[usize; 3]>,
}

/// A raw prompt line before tokenization.
#[derive(Debug, Clone)]
pub enum RawPrompt {
    Text { prompt: String, label: Option<String>, metadata: Value },
    Chat { messages: Vec<ChatMessage>, label: Option<String>, metadata: Value },
}

/// splitmix64: a tiny seedable generator for data order (no extra dependency, stable across
/// versions, so resumed runs see the same order).
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// Tokenized prompts and the sampling position.
#[derive(Debug)]
pub struct PromptDataset {
    pub records: Vec<PromptRecord>,
    order: Vec<usize>,
    pos: usize,
    epoch: u64,
    shuffle: bool,
    seed: u64,
    /// Prompts that were truncated.
    pub truncated: usize,
}

fn label_of(v: Option<&Value>, at: &str) -> std::result::Result<Option<String>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(other) => Err(format!("{at}: label: expected a string or number, got {other}")),
    }
}

/// One prompt of a JSON object (a JSONL line or a Parquet row) of the file `path`; `at` is
/// `line N` or `row N`. Images stay in the metadata, checked, with relative paths resolved from
/// the file's directory ([`crate::prompt_images::normalize_row`]).
fn prompt_of(mut obj: Map<String, Value>, path: &Path, at: &str) -> std::result::Result<RawPrompt, String> {
    let base = path.parent().unwrap_or(Path::new("."));
    crate::prompt_images::normalize_row(&mut obj, base, at)?;
    let label = label_of(obj.get("label"), at)?;
    obj.remove("label");
    // TRL's conversational format: `prompt` holds the chat messages.
    let mut field = "messages";
    if matches!(obj.get("prompt"), Some(Value::Array(_))) && !obj.contains_key("messages") {
        let p = obj.remove("prompt").unwrap_or_default();
        obj.insert("messages".into(), p);
        field = "prompt";
    }
    if let Some(p) = obj.remove("prompt") {
        let Value::String(prompt) = p else {
            return Err(format!("{at}: prompt: expected a string or a list of chat messages, got {p}"));
        };
        if prompt.trim().is_empty() {
            return Err(format!("{at}: prompt: empty (a prompt needs some text)"));
        }
        Ok(RawPrompt::Text { prompt, label, metadata: Value::Object(obj) })
    } else if let Some(m) = obj.remove("messages") {
        let messages: Vec<ChatMessage> = serde_json::from_value(m)
            .map_err(|e| format!("{at}: {field}: expected [{{\"role\", \"content\"}}]: {e}"))?;
        if messages.is_empty() {
            return Err(format!("{at}: {field}: empty conversation"));
        }
        Ok(RawPrompt::Chat { messages, label, metadata: Value::Object(obj) })
    } else {
        Err(format!("{at}: needs a `prompt` or `messages` field"))
    }
}

/// Reads `data.prompts` (not a `builtin:`): a table when [`crate::tabular::is_tabular`] (Parquet, a `save_to_disk` directory), else
/// JSONL, through the column mapping of `data.prompt_key`, `messages_key` and `label_key`.
pub fn read_prompt_data(cfg: &DataConfig) -> Result<Vec<RawPrompt>> {
    let cols = cfg.columns();
    if !crate::tabular::is_tabular(&cfg.prompts) {
        return read_prompts_with(Path::new(&cfg.prompts), &cols);
    }
    let mut out = Vec::new();
    crate::tabular::for_each_row(&cfg.prompts, &cols, |n, path, row| {
        let err = |message: String| TrainerError::Data { path: path.to_path_buf(), message };
        let obj = row.map_err(|reason| err(format!("row {n}: {reason}")))?;
        out.push(prompt_of(obj, path, &format!("row {n}")).map_err(err)?);
        Ok(())
    })?;
    if out.is_empty() {
        return Err(TrainerError::Data { path: cfg.prompts.clone().into(), message: "no prompts (no rows)".into() });
    }
    Ok(out)
}

/// What identifies the prompt data of `spec` for a resume: each file read (the JSONL file, or the
/// Parquet shards) with its size and FNV-1a checksum; nothing for a built-in task. A checkpoint
/// keeps only a position in the data, so the same position in other data would be other prompts.
pub fn identity(spec: &str) -> Result<Vec<serde_json::Value>> {
    if spec.starts_with("builtin:") {
        return Ok(Vec::new());
    }
    let files =
        if crate::tabular::is_tabular(spec) { crate::tabular::shards(spec)? } else { vec![PathBuf::from(spec)] };
    files
        .iter()
        .map(|f| {
            let (bytes, fnv) = crate::checkpoint::fnv1a(f)?;
            Ok(serde_json::json!({"path": f.display().to_string(), "bytes": bytes, "fnv1a64": format!("{fnv:016x}")}))
        })
        .collect()
}

/// What a data path that is a directory but no table is told.
pub(crate) const NOT_A_DATA_DIR: &str = "is a directory with no Parquet files (*.parquet) and no `datasets` \
     save_to_disk files (state.json, dataset_dict.json): name a JSONL file, a Parquet file or a directory of them";

/// Why line 1 of a JSONL file cannot be read when it starts with a UTF-8 byte order mark (JSON
/// has none; some Windows editors write one).
pub(crate) const BOM: &str = "starts with a UTF-8 byte order mark (U+FEFF): save the file as UTF-8 without one";

/// Reads a JSONL prompt file.
pub fn read_prompts(path: &Path) -> Result<Vec<RawPrompt>> {
    read_prompts_with(path, &Columns::default())
}

/// Reads a JSONL prompt file, its fields renamed by `cols`.
pub fn read_prompts_with(path: &Path, cols: &Columns) -> Result<Vec<RawPrompt>> {
    if path.is_dir() {
        return Err(TrainerError::Data { path: path.to_path_buf(), message: NOT_A_DATA_DIR.into() });
    }
    let bytes = std::fs::read(path).map_err(|e| TrainerError::io(path, e))?;
    let mut out = Vec::new();
    // Line by line, so a line that is not UTF-8 is reported with its number.
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let n = i + 1;
        let err = |message: String| TrainerError::Data { path: path.to_path_buf(), message };
        let line = std::str::from_utf8(line.strip_suffix(b"\r").unwrap_or(line))
            .map_err(|e| err(format!("line {n}: not valid UTF-8 (invalid byte at column {})", e.valid_up_to() + 1)))?;
        if line.trim().is_empty() {
            continue;
        }
        if line.starts_with('\u{feff}') {
            return Err(err(format!("line {n}: {BOM}")));
        }
        let v: Value = serde_json::from_str(line).map_err(|e| err(format!("line {n}: not valid JSON: {e}")))?;
        let Value::Object(mut obj) = v else { return Err(err(format!("line {n}: expected a JSON object"))) };
        cols.rename(&mut obj).map_err(|reason| err(format!("line {n}: {reason}")))?;
        out.push(prompt_of(obj, path, &format!("line {n}")).map_err(err)?);
    }
    if out.is_empty() {
        return Err(TrainerError::Data {
            path: path.to_path_buf(),
            message: "no prompts (the file has no lines)".into(),
        });
    }
    Ok(out)
}

impl PromptDataset {
    /// Renders and tokenizes raw prompts (text only: a prompt with images is refused).
    pub fn new(raw: Vec<RawPrompt>, tok: &HfTokenizer, cfg: &DataConfig, seed: u64) -> Result<Self> {
        Self::new_with_images(raw, tok, cfg, seed, None)
    }

    /// [`PromptDataset::new`], with each prompt's images placed as `images` says (the model's
    /// processor and placeholders): `<image>` markers replaced, one placeholder token per merged
    /// patch. A prompt with images cannot be truncated.
    pub fn new_with_images(
        raw: Vec<RawPrompt>,
        tok: &HfTokenizer,
        cfg: &DataConfig,
        seed: u64,
        images: Option<&PromptImages>,
    ) -> Result<Self> {
        let use_template = cfg.apply_chat_template && tok.has_chat_template();
        let mut records = Vec::with_capacity(raw.len());
        let mut truncated = 0;
        for (n, r) in raw.into_iter().enumerate() {
            let at = format!("prompt {}", n + 1);
            let (text, label, mut metadata, templated, messages) = match r {
                RawPrompt::Text { prompt, label, metadata } => {
                    let messages = vec![ChatMessage::new("user", prompt.as_str())];
                    if use_template {
                        (tok.apply_chat_template(&messages, true)?, label, metadata, true, messages)
                    } else {
                        (prompt, label, metadata, false, messages)
                    }
                }
                RawPrompt::Chat { messages, label, metadata } => {
                    (tok.apply_chat_template(&messages, true)?, label, metadata, true, messages)
                }
            };
            let found = crate::prompt_images::take_images(&mut metadata, &at)?;
            // A rendered template already contains its special tokens.
            let (text, mut ids, grids) = match (found.is_empty(), images) {
                (true, _) => {
                    let ids = tok.encode(&text, !templated)?;
                    (text, ids, Vec::new())
                }
                (false, Some(images)) => images.expand(&text, tok, !templated, &found, &at)?,
                (false, None) => {
                    return Err(TrainerError::Run(format!(
                    "{at}: has {} image(s), which this run does not read (RL and evaluation read text prompts only)",
                    found.len()
                )))
                }
            };
            if ids.is_empty() {
                return Err(TrainerError::Run(format!("prompt {text:?} encodes to no tokens")));
            }
            if ids.len() > cfg.max_prompt_len {
                if !found.is_empty() {
                    return Err(TrainerError::Run(format!(
                        "{at}: {} tokens with its images, more than data.max_prompt_len = {} (a prompt with images \
                         is not truncated: raise the limit or lower the processor's max_pixels)",
                        ids.len(),
                        cfg.max_prompt_len
                    )));
                }
                truncated += 1;
                ids.drain(..ids.len() - cfg.max_prompt_len);
            }
            records.push(PromptRecord { text, ids, label, metadata, messages, images: found, grids });
        }
        if truncated > 0 {
            tracing::warn!(
                "{truncated} prompt(s) longer than data.max_prompt_len = {} tokens were truncated from the left",
                cfg.max_prompt_len
            );
        }
        let mut ds = PromptDataset {
            order: (0..records.len()).collect(),
            records,
            pos: 0,
            epoch: 0,
            shuffle: cfg.shuffle,
            seed,
            truncated,
        };
        ds.reshuffle();
        Ok(ds)
    }

    fn reshuffle(&mut self) {
        self.order = (0..self.records.len()).collect();
        if self.shuffle {
            SplitMix(self.seed ^ self.epoch.wrapping_mul(0x9E37_79B9)).shuffle(&mut self.order);
        }
    }

    /// The next `n` prompt indices, wrapping (and reshuffling) at the end of each pass.
    pub fn next_batch(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.pos == self.order.len() {
                self.pos = 0;
                self.epoch += 1;
                self.reshuffle();
            }
            out.push(self.order[self.pos]);
            self.pos += 1;
        }
        out
    }

    /// Moves to pass `epoch`, index `pos` (a checkpoint's [`PromptDataset::position`]).
    pub fn set_position(&mut self, epoch: u64, pos: usize) -> std::result::Result<(), String> {
        if pos > self.records.len() {
            return Err(format!("data position {pos} is beyond the {} prompts of this dataset", self.records.len()));
        }
        self.epoch = epoch;
        self.reshuffle();
        self.pos = pos;
        Ok(())
    }

    /// Passes completed and position within the current one.
    pub fn position(&self) -> (u64, usize) {
        (self.epoch, self.pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_prompts_messages_labels_and_rejects_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"1 + 2 =\", \"label\": 3, \"id\": 7}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
        )
        .unwrap();
        let raw = read_prompts(&p).unwrap();
        assert_eq!(raw.len(), 2);
        std::fs::write(&p, "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"solution\": \"x\"}\n").unwrap();
        match &read_prompts(&p).unwrap()[0] {
            RawPrompt::Chat { messages, metadata, .. } => {
                assert_eq!((messages.len(), messages[0].content.as_str()), (1, "hi"));
                assert_eq!(metadata["solution"], "x");
            }
            _ => panic!("a conversational prompt is chat messages"),
        }
        std::fs::write(
            &p,
            "{\"prompt\": \"1 + 2 =\", \"label\": 3, \"id\": 7}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
        )
        .unwrap();
        let raw = read_prompts(&p).unwrap();
        match &raw[0] {
            RawPrompt::Text { prompt, label, metadata } => {
                assert_eq!((prompt.as_str(), label.as_deref()), ("1 + 2 =", Some("3")));
                assert_eq!(metadata["id"], 7);
            }
            _ => panic!("expected text"),
        }
        for (content, needle) in [
            ("{\"prompt\": 1}\n", "line 1: prompt: expected a string or a list of chat messages"),
            ("{\"prompt\": [{\"role\": \"user\"}]}\n", "line 1: prompt: expected [{\"role\""),
            ("{\"x\": 1}\n", "line 1: needs a `prompt` or `messages`"),
            ("nope\n", "line 1: not valid JSON"),
            ("\u{feff}{\"prompt\": \"a\"}\n", "line 1: starts with a UTF-8 byte order mark (U+FEFF)"),
            ("{\"prompt\": \"a\", \"label\": [1]}\n", "line 1: label"),
            ("", "no prompts"),
        ] {
            std::fs::write(&p, content).unwrap();
            let e = read_prompts(&p).unwrap_err().to_string();
            assert!(e.contains("p.jsonl") && e.contains(needle), "{e}");
        }
        std::fs::write(&p, b"{\"prompt\": \"a\"}\r\n{\"prompt\": \"b\xff\"}\n").unwrap();
        let e = read_prompts(&p).unwrap_err().to_string();
        assert!(e.contains("p.jsonl: line 2: not valid UTF-8 (invalid byte at column 14)"), "{e}");
        let e = read_prompts(dir.path()).unwrap_err().to_string();
        assert_eq!(e, format!("{}: {NOT_A_DATA_DIR}", dir.path().display()));
    }

    #[test]
    fn order_is_seeded_and_covers_everything() {
        let mut a = SplitMix(3);
        let mut v: Vec<usize> = (0..10).collect();
        a.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        let mut w: Vec<usize> = (0..10).collect();
        SplitMix(3).shuffle(&mut w);
        assert_eq!(v, w);
    }
}
