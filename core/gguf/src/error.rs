//! Errors: every one names the file it is about.

use std::path::{Path, PathBuf};

/// What can go wrong reading a GGUF file or importing it.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Opening, reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// The file does not start with `GGUF`.
    #[error("{}: not a GGUF file (it starts with {found}, not \"GGUF\")", path.display())]
    BadMagic { path: PathBuf, found: String },
    /// A GGUF version this reader does not implement.
    #[error("{}: GGUF version {version} is not supported (this reader reads versions 2 and 3)", path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },
    /// The file ends before something it declares.
    #[error("{}: the file is truncated: {what} needs bytes {offset}..{end}, but the file has {len} bytes", path.display())]
    Truncated { path: PathBuf, what: String, offset: u64, end: u64, len: u64 },
    /// A tensor type id this reader does not know.
    #[error(
        "{}: tensor `{tensor}` has tensor type id {type_id}, which this reader does not know (it knows {known})",
        path.display()
    )]
    UnknownTensorType { path: PathBuf, tensor: String, type_id: u32, known: String },
    /// The file is malformed.
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    /// Well-formed, but something the importer does not handle (a quantisation, an architecture).
    #[error("{}: {message}", path.display())]
    Unsupported { path: PathBuf, message: String },
    /// A metadata key is missing or has the wrong type.
    #[error("{}: metadata `{key}`: {message}", path.display())]
    Metadata { path: PathBuf, key: String, message: String },
}

impl GgufError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        GgufError::Io { path: path.to_path_buf(), source }
    }

    pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> Self {
        GgufError::Invalid { path: path.to_path_buf(), message: message.into() }
    }

    pub(crate) fn unsupported(path: &Path, message: impl Into<String>) -> Self {
        GgufError::Unsupported { path: path.to_path_buf(), message: message.into() }
    }

    pub(crate) fn metadata(path: &Path, key: &str, message: impl Into<String>) -> Self {
        GgufError::Metadata { path: path.to_path_buf(), key: key.to_owned(), message: message.into() }
    }
}

/// `Result` with [`GgufError`].
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
