//! What the client accepts from the Hub (or from a user) before it becomes part of a path in the
//! cache: repository file names, revisions and ETags. A server is not trusted to send only what
//! the Hub itself would: a file name like `/tmp/x` or `../../x`, a revision like `../../x` or an
//! ETag of `..` would otherwise make the cache write outside itself. Every path the client writes
//! is also checked, after joining, to lie inside the repository's entry ([`inside`]).

use std::path::{Component, Path};

/// Why a repository file name (`rfilename`, an index's shard) is not a safe relative path, or
/// `None` when it is: `/`-separated segments, none empty, `.` or `..`, no backslash, no control
/// character, not absolute. The Hub itself never lists such names.
pub fn unsafe_file_name(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("it is empty");
    }
    if name.len() > 1024 {
        return Some("it is longer than 1024 bytes");
    }
    if name.starts_with('/') {
        return Some("it is an absolute path");
    }
    if name.contains('\\') {
        return Some("it contains a backslash");
    }
    if name.chars().any(char::is_control) {
        return Some("it contains a control character");
    }
    for segment in name.split('/') {
        match segment {
            "" => return Some("it has an empty path segment"),
            "." | ".." => return Some("it has a `.` or `..` segment"),
            _ => {}
        }
    }
    None
}

/// Why `revision` is not a revision the Hub could have, or `None` when it is. The Hub's
/// revisions are git refs (branches, tags, `refs/pr/N`, `refs/convert/parquet`) or commit hashes;
/// the rules are git's `check-ref-format`: no `..`, no segment that is empty, starts with `.` or
/// ends with `.lock`, none of `~ ^ : ? * [ \`, no whitespace or control character, no `@{`, not `@`,
/// not ending with `.`.
pub fn unsafe_revision(revision: &str) -> Option<&'static str> {
    if revision.is_empty() {
        return Some("it is empty");
    }
    if revision.len() > 255 {
        return Some("it is longer than 255 bytes");
    }
    if revision == "@" || revision.contains("@{") {
        return Some("git does not allow `@` or `@{` there");
    }
    if revision.contains("..") {
        return Some("it contains `..`");
    }
    if revision.chars().any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\".contains(c)) {
        return Some("it contains a space, a control character or one of ~ ^ : ? * [ \\");
    }
    if revision.ends_with('.') {
        return Some("it ends with `.`");
    }
    for segment in revision.split('/') {
        if segment.is_empty() {
            return Some("it has an empty path segment (a leading, trailing or double `/`)");
        }
        if segment.starts_with('.') || segment.ends_with(".lock") {
            return Some("a segment starts with `.` or ends with `.lock`");
        }
    }
    None
}

/// Whether an ETag (after `W/` and quotes are stripped) can name a blob: one path segment that
/// is not `.` or `..`, of printable ASCII without `/` or `\`. The Hub's are hex digests.
pub fn safe_etag(etag: &str) -> bool {
    !etag.is_empty()
        && etag.len() <= 256
        && etag != "."
        && etag != ".."
        && etag.bytes().all(|b| b.is_ascii_graphic() && b != b'/' && b != b'\\')
}

/// Whether `path` lies inside `dir`, compared lexically (neither needs to exist): `path` starts
/// with `dir` and has no `..` component. The callers join only names the checks above accepted,
/// so this is the last line of defence, not the first.
pub fn inside(dir: &Path, path: &Path) -> bool {
    path.starts_with(dir)
        && path.strip_prefix(dir).is_ok_and(|rest| rest.components().all(|c| matches!(c, Component::Normal(_))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_from_the_server_must_be_plain_relative_paths() {
        for ok in ["config.json", "main/train-00000-of-00001.parquet", "a b/c.d", "x..y.safetensors"] {
            assert_eq!(unsafe_file_name(ok), None, "{ok}");
        }
        for bad in ["", "/tmp/victim.safetensors", "../../victim", "a/../b", "a//b", "a\\b", "./a", "a/", "a\0b"] {
            assert!(unsafe_file_name(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn revisions_follow_git_ref_rules() {
        for ok in ["main", "v1.0", "refs/pr/1", "refs/convert/parquet", "0123456789abcdef0123456789abcdef01234567"] {
            assert_eq!(unsafe_revision(ok), None, "{ok}");
        }
        for bad in [
            "",
            "../../../../tmp/victim",
            "a/../b",
            "/abs",
            "a//b",
            "a/",
            ".hidden",
            "a/.b",
            "x.lock",
            "a b",
            "a\\b",
            "a:b",
            "@",
            "a@{1}",
            "end.",
            "tab\t",
        ] {
            assert!(unsafe_revision(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn etags_name_one_blob() {
        assert!(safe_etag("0123abcd") && safe_etag("abc-1.2"));
        for bad in ["", ".", "..", "a/b", "a\\b", "a b", "é"] {
            assert!(!safe_etag(bad), "{bad:?}");
        }
    }

    #[test]
    fn inside_is_lexical() {
        let dir = Path::new("/c/models--a--b");
        assert!(inside(dir, Path::new("/c/models--a--b/snapshots/x/config.json")));
        assert!(!inside(dir, Path::new("/c/models--a--b/snapshots/../../../etc")));
        assert!(!inside(dir, Path::new("/tmp/victim")));
        assert!(!inside(dir, Path::new("/c/models--a--bc/x")));
    }
}
