//! Errors of image loading and processing, each naming the image and what is wrong with it.

use std::path::PathBuf;

/// What went wrong with an image or a processor configuration.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not an image this crate decodes (or a corrupt one).
    #[error("{source_name}: not a decodable image ({message})")]
    Decode { source_name: String, message: String },
    /// The image's size is outside what the processor accepts.
    #[error("{source_name}: {message}")]
    Size { source_name: String, message: String },
    /// An image could not be encoded.
    #[error("cannot encode an image: {0}")]
    Encode(String),
    /// A processor configuration value is wrong.
    #[error("{path}: {key}: {message}")]
    Config { path: PathBuf, key: String, message: String },
}

pub type Result<T> = std::result::Result<T, VisionError>;
