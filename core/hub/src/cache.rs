//! The Hugging Face cache as `huggingface_hub` lays it out (and transformers reads):
//!
//! ```text
//! <cache>/models--<org>--<name>/refs/<revision>        the commit a branch or tag points to
//! <cache>/models--<org>--<name>/snapshots/<commit>/<f>  → ../../blobs/<etag> (relative symlink)
//! <cache>/models--<org>--<name>/blobs/<etag>           file contents (<etag>.incomplete while downloading)
//! ```
//!
//! `<cache>` is `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`.

use std::fs::File;
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::{HubError, HubId, Result};

/// `HF_HOME`: `$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
pub fn hf_home() -> PathBuf {
    if let Some(h) = std::env::var_os("HF_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
    base.join("huggingface")
}

/// The hub cache directory (see the module docs).
pub fn hub_cache() -> PathBuf {
    match std::env::var_os("HF_HUB_CACHE").filter(|v| !v.is_empty()) {
        Some(c) => PathBuf::from(c),
        None => hf_home().join("hub"),
    }
}

/// Whether `s` is a full 40-hex-digit commit hash.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// One repository's entry in the cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    pub dir: PathBuf,
}

impl RepoCache {
    /// `<cache>/models--<org>--<name>` (`datasets--` for a dataset).
    pub fn new(cache: &Path, id: &HubId) -> Self {
        RepoCache { dir: cache.join(format!("{}--{}", id.kind.plural(), id.repo.replace('/', "--"))) }
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where `blob` is written while it downloads (huggingface_hub's name for it).
    pub fn partial(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    /// `refs/<revision>`, or `None` when the revision is not one the Hub could have (it would
    /// name a file outside `refs/`).
    fn ref_path(&self, revision: &str) -> Option<PathBuf> {
        let refs = self.dir.join("refs");
        let path = refs.join(revision);
        (crate::paths::unsafe_revision(revision).is_none() && crate::paths::inside(&refs, &path)).then_some(path)
    }

    /// The commit `revision` resolves to in the cache: itself when it is a commit with a
    /// snapshot, else what `refs/<revision>` says.
    pub fn commit_of(&self, revision: &str) -> Option<String> {
        if is_commit(revision) && self.snapshot(revision).is_dir() {
            return Some(revision.to_string());
        }
        let text = std::fs::read_to_string(self.ref_path(revision)?).ok()?;
        let commit = text.trim().to_string();
        is_commit(&commit).then_some(commit)
    }

    /// Records that `revision` points to `commit` (nothing for a commit itself).
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<()> {
        if revision == commit {
            return Ok(());
        }
        let path = self.ref_path(revision).ok_or_else(|| self.outside(&format!("refs/{revision}")))?;
        if !is_commit(commit) {
            return Err(self.outside(&format!("a ref to `{commit}`, which is not a commit hash")));
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        }
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, commit).map_err(|e| HubError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| HubError::io(&path, e))
    }

    /// Whether `snapshots/<commit>/<file>` exists with its blob.
    pub fn has(&self, commit: &str, file: &str) -> bool {
        crate::paths::unsafe_file_name(file).is_none() && self.snapshot(commit).join(file).is_file()
    }

    /// An error saying the client refused to write `what` (it would lie outside the entry).
    fn outside(&self, what: &str) -> HubError {
        HubError::io(
            &self.dir,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("refusing to write {what}: outside the cache entry"),
            ),
        )
    }

    /// Points `snapshots/<commit>/<file>` at `blobs/<etag>` (relative, as huggingface_hub does).
    /// The commit, the file name and the ETag are checked first, and the link's directory once
    /// created must resolve inside the entry (no directory on the way is a symlink out of it).
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<()> {
        let link = self.snapshot(commit).join(file);
        let safe = is_commit(commit)
            && crate::paths::unsafe_file_name(file).is_none()
            && crate::paths::safe_etag(etag)
            && crate::paths::inside(&self.dir, &link);
        if !safe {
            return Err(self.outside(&format!("snapshots/{commit}/{file} → blobs/{etag}")));
        }
        let parent = link.parent().unwrap_or(&self.dir).to_path_buf();
        std::fs::create_dir_all(&parent).map_err(|e| HubError::io(&parent, e))?;
        let real = |p: &Path| p.canonicalize().map_err(|e| HubError::io(p, e));
        if !real(&parent)?.starts_with(real(&self.dir)?) {
            return Err(self.outside(&format!("snapshots/{commit}/{file}")));
        }
        let depth = file.matches('/').count() + 2;
        let target = PathBuf::from("../".repeat(depth)).join("blobs").join(etag);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).map_err(|e| HubError::io(&link, e))
    }

    /// Takes the repository's lock (`flock`), waiting for another process that holds it: one
    /// process at a time downloads into an entry; the others then find the files there. The lock
    /// goes with the returned file (and with the process, if it dies).
    pub fn lock(&self) -> Result<File> {
        std::fs::create_dir_all(&self.dir).map_err(|e| HubError::io(&self.dir, e))?;
        let path = self.dir.join(".rlhf.lock");
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| HubError::io(&path, e))?;
        // SAFETY: flock on a descriptor this function owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if rc != 0 {
            return Err(HubError::io(&path, std::io::Error::last_os_error()));
        }
        let _ = writeln!(file, "{}", std::process::id());
        Ok(file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_refs() {
        let dir = tempfile::tempdir().unwrap();
        let id = HubId { repo: "Org/Model-1".into(), revision: "main".into(), kind: Default::default() };
        let repo = RepoCache::new(dir.path(), &id);
        assert!(repo.dir.ends_with("models--Org--Model-1"));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        assert_eq!(repo.commit_of("main"), None);
        repo.write_ref("main", commit).unwrap();
        assert_eq!(repo.commit_of("main").as_deref(), Some(commit));
        std::fs::create_dir_all(repo.dir.join("blobs")).unwrap();
        std::fs::write(repo.blob("abc"), b"{}").unwrap();
        repo.link(commit, "config.json", "abc").unwrap();
        assert!(repo.has(commit, "config.json"));
        assert_eq!(std::fs::read_to_string(repo.snapshot(commit).join("config.json")).unwrap(), "{}");
        assert_eq!(repo.commit_of(commit).as_deref(), Some(commit));
        assert!(!is_commit("main") && is_commit(commit));
    }
}
