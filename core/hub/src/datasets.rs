//! Datasets named by Hub id, as `datasets.load_dataset(name, subset, split=...)` takes them:
//! `org/name[@revision][:split]` or `org/name[@revision]:subset:split` (the split defaults to
//! `train`). The repository's Parquet files of that subset and split are read from the Hugging
//! Face cache (`datasets--org--name/snapshots/<commit>/`), downloaded into it through the same
//! client as models when missing ([`crate::download`]). Which files: those whose path has the
//! subset as a directory (when one is named) and the split as a directory or as the start of the
//! file name (`main/train-00000-of-00001.parquet`, `data/train-*.parquet`,
//! `default/train/0000.parquet`); files of several subsets without one named is an error listing
//! them.

use std::path::{Path, PathBuf};

use crate::cache::RepoCache;
use crate::download::{Failure, Session};
use crate::{parse_id, Hub, HubError, HubId, RepoKind, Result};

/// A dataset id with the subset and split to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetSpec {
    pub id: HubId,
    pub subset: Option<String>,
    pub split: String,
}

/// Parses `org/name[@rev][:split]` or `org/name[@rev]:subset:split`; `None` for anything else (a
/// path, a file name with an extension the data readers know).
pub fn parse_dataset(spec: &str) -> Option<DatasetSpec> {
    let mut parts = spec.split(':');
    let repo = parts.next()?;
    let rest: Vec<&str> = parts.collect();
    let known = [".jsonl", ".json", ".parquet", ".arrow"];
    if known.iter().any(|e| repo.ends_with(e)) || rest.iter().any(|p| p.is_empty() || p.contains('/')) {
        return None;
    }
    let (subset, split) = match rest.as_slice() {
        [] => (None, "train"),
        [split] => (None, *split),
        [subset, split] => (Some(subset.to_string()), *split),
        _ => return None,
    };
    let mut id = parse_id(repo)?;
    id.kind = RepoKind::Dataset;
    Some(DatasetSpec { id, subset, split: split.to_string() })
}

impl std::fmt::Display for DatasetSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.subset {
            Some(s) => write!(f, "{}:{s}:{}", self.id, self.split),
            None => write!(f, "{}:{}", self.id, self.split),
        }
    }
}

/// The Parquet files of `files` (repository paths) that hold `spec`'s subset and split.
pub fn select(spec: &DatasetSpec, files: &[String]) -> std::result::Result<Vec<String>, String> {
    let parquet: Vec<&String> = files.iter().filter(|f| f.ends_with(".parquet")).collect();
    if parquet.is_empty() {
        return Err(format!(
            "the repository has no Parquet files (only Parquet is read); the Hub's converted copy may have them: `{}@refs/convert/parquet`",
            spec.id.repo
        ));
    }
    let in_split = |f: &str| {
        let parts: Vec<&str> = f.split('/').collect();
        let name = parts[parts.len() - 1];
        let dirs = &parts[..parts.len() - 1];
        dirs.contains(&spec.split.as_str())
            || name.starts_with(&format!("{}-", spec.split))
            || name.starts_with(&format!("{}.", spec.split))
    };
    let in_subset = |f: &str| match &spec.subset {
        Some(s) => f.split('/').rev().skip(1).any(|d| d == s),
        None => true,
    };
    let mut chosen: Vec<String> =
        parquet.iter().filter(|f| in_split(f) && in_subset(f)).map(|f| f.to_string()).collect();
    chosen.sort();
    if chosen.is_empty() {
        let shown: Vec<&str> = parquet.iter().take(8).map(|f| f.as_str()).collect();
        let more = if parquet.len() > 8 { format!(" and {} more", parquet.len() - 8) } else { String::new() };
        let subset = spec.subset.as_ref().map_or(String::new(), |s| format!(" of subset `{s}`"));
        return Err(format!(
            "no Parquet file of split `{}`{subset}; its Parquet files: {}{more}",
            spec.split,
            shown.join(", ")
        ));
    }
    if spec.subset.is_none() {
        // The directory above the split's files: one per subset when there are several.
        let parent = |f: &str| {
            let p: Vec<&str> = f.split('/').collect();
            p[..p.len() - 1].iter().filter(|d| **d != spec.split).copied().collect::<Vec<_>>().join("/")
        };
        let mut subsets: Vec<String> = chosen.iter().map(|f| parent(f)).collect();
        subsets.dedup();
        if subsets.len() > 1 {
            return Err(format!(
                "several subsets hold split `{}` ({}): name one, `{}:SUBSET:{}`",
                spec.split,
                subsets.join(", "),
                spec.id,
                spec.split
            ));
        }
    }
    Ok(chosen)
}

/// Every file below `dir`, as paths relative to it with `/` separators.
fn local_files(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = format!("{prefix}{}", e.file_name().to_string_lossy());
            if e.path().is_dir() {
                walk(&e.path(), &format!("{name}/"), out);
            } else {
                out.push(name);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", &mut out);
    out.sort();
    out
}

impl Hub {
    /// The local Parquet files of `spec`, downloading what the cache lacks (unless offline; an
    /// unreachable Hub falls back to the cache, with a warning).
    pub fn dataset(&self, spec: &DatasetSpec) -> Result<Vec<PathBuf>> {
        let id = &spec.id;
        Self::check_id(id)?;
        if !self.offline {
            crate::http::endpoint(self, id)?;
        }
        let repo = RepoCache::new(&self.cache, id);
        let _lock = repo.lock()?;
        let cached = |why: &str| -> Result<Vec<PathBuf>> {
            let miss =
                |what: String| HubError::model(id, format!("{what} in the cache {} and {why}", repo.dir.display()));
            let commit =
                repo.commit_of(&id.revision).ok_or_else(|| miss(format!("revision `{}` is not", id.revision)))?;
            let dir = repo.snapshot(&commit);
            let files =
                select(spec, &local_files(&dir)).map_err(|e| miss(format!("split `{}` is not ({e})", spec.split)))?;
            Ok(files.iter().map(|f| dir.join(f)).collect())
        };
        if self.offline {
            return cached("HF_HUB_OFFLINE is set");
        }
        match fetch(self, &repo, spec) {
            Err(Failure::Unreachable(why)) => {
                let files = cached(&why)?;
                tracing::warn!("dataset `{spec}`: {why}; using the cached files");
                Ok(files)
            }
            Err(Failure::Error(e)) => Err(e),
            Ok(files) => Ok(files),
        }
    }
}

/// Lists the repository at the revision, downloads the selected files, records the revision.
fn fetch(hub: &Hub, repo: &RepoCache, spec: &DatasetSpec) -> std::result::Result<Vec<PathBuf>, Failure> {
    let id = &spec.id;
    let s = Session::new(hub, id)?;
    let info = s.repo_info()?;
    let names: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let chosen = select(spec, &names).map_err(|e| HubError::model(id, e))?;
    for f in &chosen {
        s.file(repo, &info.sha, f)?;
    }
    repo.write_ref(&id.revision, &info.sha)?;
    let snapshot = repo.snapshot(&info.sha);
    Ok(chosen.iter().map(|f| snapshot.join(f)).collect())
}

/// The local files of a dataset spec, each spec resolved once per process; `None` when `spec` is
/// not a dataset id (or names an existing path).
pub fn resolve_dataset(spec: &str) -> Option<Result<Vec<PathBuf>>> {
    static RESOLVED: std::sync::Mutex<Vec<(String, Vec<PathBuf>)>> = std::sync::Mutex::new(Vec::new());
    if Path::new(spec).exists() {
        return None;
    }
    let parsed = parse_dataset(spec)?;
    let mut resolved = RESOLVED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, files)) = resolved.iter().find(|(s, _)| s == spec) {
        return Some(Ok(files.clone()));
    }
    let files = Hub::from_env().and_then(|hub| hub.dataset(&parsed));
    if let Ok(f) = &files {
        resolved.push((spec.to_string(), f.clone()));
    }
    Some(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> DatasetSpec {
        parse_dataset(s).unwrap()
    }

    #[test]
    fn parses_specs() {
        let d = spec("openai/gsm8k:main:test");
        assert_eq!((d.id.repo.as_str(), d.subset.as_deref(), d.split.as_str()), ("openai/gsm8k", Some("main"), "test"));
        assert_eq!(d.id.kind, RepoKind::Dataset);
        let d = spec("trl-lib/DeepMath-103K@v1");
        assert_eq!((d.id.revision.as_str(), d.subset, d.split.as_str()), ("v1", None, "train"));
        for not in ["data/train.jsonl", "data/x.parquet", "org/name:", "org/name:a:b:c", "builtin:addition", "a/b/c"] {
            assert_eq!(parse_dataset(not), None, "{not}");
        }
    }

    #[test]
    fn selects_the_split_of_a_subset() {
        let files: Vec<String> = [
            "README.md",
            "main/train-00000-of-00001.parquet",
            "main/test-00000-of-00001.parquet",
            "socratic/train-00000-of-00001.parquet",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(select(&spec("o/n:main:train"), &files).unwrap(), ["main/train-00000-of-00001.parquet"]);
        let e = select(&spec("o/n"), &files).unwrap_err();
        assert!(e.contains("several subsets hold split `train` (main, socratic)"), "{e}");
        let e = select(&spec("o/n:main:validation"), &files).unwrap_err();
        assert!(e.contains("no Parquet file of split `validation` of subset `main`"), "{e}");
        let flat: Vec<String> =
            ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-0.parquet"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        assert_eq!(select(&spec("o/n"), &flat).unwrap().len(), 2);
        let converted = vec!["default/train/0000.parquet".to_string(), "default/test/0000.parquet".to_string()];
        assert_eq!(select(&spec("o/n:train"), &converted).unwrap(), ["default/train/0000.parquet"]);
        assert!(select(&spec("o/n"), &["data.jsonl".to_string()]).unwrap_err().contains("refs/convert/parquet"));
    }
}
