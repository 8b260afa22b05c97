//! Images in prompt data, where verl and TRL users keep them: an `images` field (a list of file
//! paths, or `{"bytes", "path"}` structs as `datasets` writes its `Image` feature to Parquet), and
//! their places in the text — `<image>` markers (verl) or `{"type": "image"}` content parts of chat
//! messages (TRL) — which the model's own placeholder sequence replaces once the chat template has
//! rendered (for Qwen-VL, `<|vision_start|><|image_pad|><|vision_end|>`, as its template renders an
//! image part); then each placeholder token is repeated once per merged patch of its image.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::error::Result;
use crate::load::{load_bytes, load_path, RgbImage};

/// Where an image of a prompt is marked in its text.
pub const IMAGE_MARKER: &str = "<image>";

/// Base64 text of a binary cell, as the Parquet reader hands binary image bytes over:
/// `{"$binary": "<base64>"}`.
pub const BINARY_KEY: &str = "$binary";

/// One image of a prompt: a file, or encoded bytes (named for errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    Path(PathBuf),
    Bytes { name: String, bytes: Arc<[u8]> },
}

impl ImageRef {
    /// Decodes the image.
    pub fn load(&self) -> Result<RgbImage> {
        match self {
            ImageRef::Path(p) => load_path(p),
            ImageRef::Bytes { name, bytes } => load_bytes(bytes, name),
        }
    }

    /// The image as an RFC 2397 data URL, `data:<mime>;base64,<bytes>` — how an inference server
    /// that decodes images itself is sent them (vLLM's `image_url` content parts). The bytes are
    /// the file's as they are, not re-encoded; the MIME type is guessed from them (PNG, JPEG,
    /// WebP, GIF, BMP), `application/octet-stream` otherwise.
    pub fn data_url(&self) -> Result<String> {
        let read;
        let bytes: &[u8] = match self {
            ImageRef::Path(p) => {
                read = crate::load::read_file(p)?;
                &read
            }
            ImageRef::Bytes { bytes, .. } => bytes,
        };
        let mime = image::guess_format(bytes).map_or("application/octet-stream", |f| f.to_mime_type());
        Ok(format!("data:{mime};base64,{}", encode_base64(bytes)))
    }

    /// How errors and rewards name the image: its path, or `<row> image <i>` for bytes.
    pub fn name(&self) -> String {
        match self {
            ImageRef::Path(p) => p.display().to_string(),
            ImageRef::Bytes { name, .. } => name.clone(),
        }
    }
}

/// The images of a prompt's `images` field: a list whose entries are a path (relative ones from
/// `base`, the data file's directory) or a `{"bytes", "path"}` struct (bytes first, then the path).
/// `at` names the row in errors.
pub fn images_of(v: &Value, base: &Path, at: &str) -> std::result::Result<Vec<ImageRef>, String> {
    let list = match v {
        Value::Null => return Ok(Vec::new()),
        Value::Array(a) => a,
        other => return Err(format!("{at}: images: expected a list of images, got {}", kind(other))),
    };
    // A relative path is joined to `base` and may not leave it (`..`); an absolute one is the
    // user's own choice.
    let path = |i: usize, p: &str| -> std::result::Result<ImageRef, String> {
        let p = Path::new(p);
        if p.is_absolute() {
            return Ok(ImageRef::Path(p.to_path_buf()));
        }
        if p.components().any(|c| !matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir)) {
            return Err(format!("{at}: images[{i}]: {} leaves the data file's directory", p.display()));
        }
        Ok(ImageRef::Path(base.join(p)))
    };
    list.iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(p) if !p.is_empty() => path(i, p),
            Value::Object(o) => match (o.get("bytes"), o.get("path")) {
                (Some(Value::Object(b)), _) if b.contains_key(BINARY_KEY) => {
                    let text = b.get(BINARY_KEY).and_then(Value::as_str).unwrap_or_default();
                    let bytes = decode_base64(text).ok_or_else(|| format!("{at}: images[{i}].bytes: not base64"))?;
                    Ok(ImageRef::Bytes { name: format!("{at} image {i}"), bytes: bytes.into() })
                }
                (Some(Value::Array(b)), _) => {
                    let bytes: Option<Vec<u8>> =
                        b.iter().map(|x| x.as_u64().and_then(|x| u8::try_from(x).ok())).collect();
                    let bytes = bytes.ok_or_else(|| format!("{at}: images[{i}].bytes: expected bytes"))?;
                    Ok(ImageRef::Bytes { name: format!("{at} image {i}"), bytes: bytes.into() })
                }
                (None | Some(Value::Null), Some(Value::String(p))) if !p.is_empty() => path(i, p),
                _ => Err(format!("{at}: images[{i}]: a struct needs its `bytes` or a `path`")),
            },
            other => {
                Err(format!("{at}: images[{i}]: expected a path or a {{bytes, path}} struct, got {}", kind(other)))
            }
        })
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A chat message's `content` as text: a string as it is, a list of parts with each `text` part's
/// text and an [`IMAGE_MARKER`] for each image part (`{"type": "image"}`, or a part with an `image`
/// or `image_url` key, as Qwen's templates test). `None` for anything else.
pub fn flatten_content(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                let o = p.as_object()?;
                let ty = o.get("type").and_then(Value::as_str);
                if ty == Some("image") || o.contains_key("image") || o.contains_key("image_url") {
                    out.push_str(IMAGE_MARKER);
                } else if let Some(t) = o.get("text").and_then(Value::as_str) {
                    out.push_str(t);
                } else {
                    return None;
                }
            }
            Some(out)
        }
        _ => None,
    }
}

/// `text` with each [`IMAGE_MARKER`] replaced by `sequence`, checking there are `images` of them.
pub fn place_markers(text: &str, images: usize, sequence: &str, at: &str) -> std::result::Result<String, String> {
    let markers = text.matches(IMAGE_MARKER).count();
    if markers != images {
        return Err(format!("{at}: {markers} {IMAGE_MARKER} placeholder(s) for {images} image(s)"));
    }
    Ok(text.replace(IMAGE_MARKER, sequence))
}

/// `ids` with the `i`-th occurrence of `placeholder` repeated `tokens[i]` times (the processor's
/// expansion of `<|image_pad|>` into one token per merged patch).
pub fn expand_placeholders(
    ids: &[u32],
    placeholder: u32,
    tokens: &[usize],
    at: &str,
) -> std::result::Result<Vec<u32>, String> {
    let found = ids.iter().filter(|&&t| t == placeholder).count();
    if found != tokens.len() {
        return Err(format!("{at}: {found} image placeholder token(s) for {} image(s)", tokens.len()));
    }
    let mut out = Vec::with_capacity(ids.len() + tokens.iter().sum::<usize>());
    let mut next = tokens.iter();
    for &t in ids {
        match (t == placeholder).then(|| next.next()).flatten() {
            Some(&n) => out.extend(std::iter::repeat_n(placeholder, n)),
            None => out.push(t),
        }
    }
    Ok(out)
}

/// Standard base64 (with or without padding).
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c)? << (18 - 6 * i);
        }
        let n = match chunk.len() {
            4 => 3,
            3 => 2,
            2 => 1,
            _ => return None,
        };
        out.extend(&acc.to_be_bytes()[1..1 + n]);
    }
    Some(out)
}

/// Standard base64 with padding: how the Parquet reader passes binary image bytes on.
pub fn encode_base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let acc = chunk.iter().enumerate().fold(0u32, |a, (i, &b)| a | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() { ALPHABET[(acc >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn images_go_out_as_data_urls_of_their_own_bytes() {
        let png = b"\x89PNG\r\n\x1a\n rest".to_vec();
        let dir = std::env::temp_dir().join(format!("rlhf-data-url-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.png");
        std::fs::write(&path, &png).unwrap();
        let url = ImageRef::Path(path.clone()).data_url().unwrap();
        assert_eq!(url, format!("data:image/png;base64,{}", encode_base64(&png)));
        let jpeg = ImageRef::Bytes { name: "row 1 image 0".into(), bytes: b"\xff\xd8\xff\xe0..".to_vec().into() };
        assert!(jpeg.data_url().unwrap().starts_with("data:image/jpeg;base64,/9j/"));
        let other = ImageRef::Bytes { name: "x".into(), bytes: b"text".to_vec().into() };
        assert!(other.data_url().unwrap().starts_with("data:application/octet-stream;base64,"));
        let missing = ImageRef::Path(dir.join("missing.png")).data_url().unwrap_err().to_string();
        assert!(missing.contains("missing.png"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn images_come_as_paths_structs_and_bytes() {
        let base = Path::new("/data");
        let v = json!(["a.png", "/abs/b.png", {"bytes": null, "path": "c.png"},
            {"bytes": {"$binary": encode_base64(b"\x89PNG..")}, "path": "ignored.png"}, {"bytes": [1, 2, 3]}]);
        let got = images_of(&v, base, "row 3").unwrap();
        assert_eq!(got[0], ImageRef::Path("/data/a.png".into()));
        assert_eq!(got[1], ImageRef::Path("/abs/b.png".into()));
        assert_eq!(got[2], ImageRef::Path("/data/c.png".into()));
        assert_eq!(got[3], ImageRef::Bytes { name: "row 3 image 3".into(), bytes: b"\x89PNG..".to_vec().into() });
        assert_eq!(got[4].name(), "row 3 image 4");
        for (bad, msg) in [
            (json!("a.png"), "row 3: images: expected a list of images, got a string"),
            (json!([5]), "row 3: images[0]: expected a path or a {bytes, path} struct, got a number"),
            (json!([{"bytes": null, "path": null}]), "row 3: images[0]: a struct needs its `bytes` or a `path`"),
            (json!([{"bytes": {"$binary": "!!"}}]), "row 3: images[0].bytes: not base64"),
            (json!(["../secret.png"]), "row 3: images[0]: ../secret.png leaves the data file's directory"),
            (json!([{"path": "a/../../b.png"}]), "row 3: images[0]: a/../../b.png leaves the data file's directory"),
        ] {
            assert_eq!(images_of(&bad, base, "row 3").unwrap_err(), msg);
        }
    }

    #[test]
    fn a_device_or_a_directory_is_not_read_as_an_image() {
        let dir = tempfile::tempdir().unwrap();
        for p in [dir.path(), Path::new("/dev/zero")] {
            if p.exists() {
                let e = load_path(p).unwrap_err().to_string();
                assert!(e.ends_with("not a regular file") || e.contains("Is a directory"), "{e}");
            }
        }
    }

    #[test]
    fn base64_round_trips() {
        for n in 0..10 {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 200) as u8).collect();
            assert_eq!(decode_base64(&encode_base64(&bytes)).unwrap(), bytes);
        }
        assert_eq!(encode_base64(b"Man"), "TWFu");
        assert_eq!(encode_base64(b"Ma"), "TWE=");
    }

    #[test]
    fn markers_and_placeholders_expand_in_order() {
        let parts = json!([{"type": "image"}, {"type": "text", "text": "What is it?"}, {"image": "x"}]);
        assert_eq!(flatten_content(&parts).unwrap(), "<image>What is it?<image>");
        assert_eq!(flatten_content(&json!([{"type": "audio"}])), None);
        let text = place_markers("<image>What?<image>", 2, "<s><p><e>", "row 0").unwrap();
        assert_eq!(text, "<s><p><e>What?<s><p><e>");
        assert_eq!(
            place_markers("<image>", 2, "", "row 1").unwrap_err(),
            "row 1: 1 <image> placeholder(s) for 2 image(s)"
        );
        assert_eq!(expand_placeholders(&[1, 9, 2, 9, 3], 9, &[2, 3], "r").unwrap(), vec![1, 9, 9, 2, 9, 9, 9, 3]);
        assert!(expand_placeholders(&[9], 9, &[1, 1], "row 2").unwrap_err().contains("row 2: 1 image placeholder"));
    }
}
