//! [`PluginError`]: the one error type that crosses the boundary. It carries the config-key path
//! when the error is about configuration, so the host can print `algorithm.beta: ...`.

use abi_stable::std_types::{ROption, RString};
use abi_stable::StableAbi;

/// What went wrong, broadly.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The plugin's config section is invalid; `key` names the offending key.
    Config,
    /// A computation failed (shape mismatch, libtorch error, NaN where forbidden, ...).
    Compute,
    /// The plugin panicked; the panic was caught at the boundary.
    Panic,
    /// The plugin does not implement what was asked (e.g. a reward plugin asked for an algorithm).
    Unsupported,
    /// An external resource failed (file, network).
    External,
}

/// An error returned by a plugin.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct PluginError {
    pub kind: ErrorKind,
    /// Dotted key path inside the plugin's config section, for [`ErrorKind::Config`].
    pub key: ROption<RString>,
    pub message: RString,
}

impl PluginError {
    /// A config error about `key` (a dotted path such as `clip.low`).
    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        PluginError {
            kind: ErrorKind::Config,
            key: ROption::RSome(RString::from(key.into())),
            message: message.into().into(),
        }
    }

    /// A computation error.
    pub fn compute(message: impl Into<String>) -> Self {
        PluginError { kind: ErrorKind::Compute, key: ROption::RNone, message: message.into().into() }
    }

    /// An error of something outside the plugin (I/O, network).
    pub fn external(message: impl Into<String>) -> Self {
        PluginError { kind: ErrorKind::External, key: ROption::RNone, message: message.into().into() }
    }

    /// The plugin was asked for something it does not provide.
    pub fn unsupported(message: impl Into<String>) -> Self {
        PluginError { kind: ErrorKind::Unsupported, key: ROption::RNone, message: message.into().into() }
    }

    /// A caught panic.
    pub fn panic(message: impl Into<String>) -> Self {
        PluginError { kind: ErrorKind::Panic, key: ROption::RNone, message: message.into().into() }
    }
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.kind, &self.key) {
            (ErrorKind::Panic, _) => write!(f, "panicked: {}", self.message),
            (_, ROption::RSome(key)) => write!(f, "{key}: {}", self.message),
            _ => write!(f, "{}", self.message),
        }
    }
}

impl std::error::Error for PluginError {}

impl From<tch::TchError> for PluginError {
    fn from(e: tch::TchError) -> Self {
        PluginError::compute(format!("libtorch: {e}"))
    }
}

/// Parses a plugin's config section (JSON text from the host) into `T`. Use
/// `#[serde(deny_unknown_fields)]` on `T`: an unknown or mistyped key becomes a
/// [`ErrorKind::Config`] error naming the key path.
pub fn parse_config<T: serde::de::DeserializeOwned>(json: &str) -> Result<T, PluginError> {
    let json = if json.trim().is_empty() { "{}" } else { json };
    let de = &mut serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // serde_json appends " at line L column C", meaningless for a section of a TOML file.
        let inner = match inner.rfind(" at line ") {
            Some(i) => inner[..i].to_string(),
            None => inner,
        };
        if path.is_empty() || path == "." {
            // Unknown fields are reported at the parent; serde names the field in the message.
            let key = inner.strip_prefix("unknown field `").and_then(|r| r.split('`').next()).unwrap_or("").to_string();
            PluginError::config(key, inner)
        } else {
            PluginError::config(path, inner)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Cfg {
        beta: f64,
        #[serde(default)]
        clip: Clip,
    }
    #[derive(serde::Deserialize, Debug, Default)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Clip {
        #[serde(default)]
        low: f64,
    }

    #[test]
    fn config_errors_name_the_key() {
        let e = parse_config::<Cfg>(r#"{"beta": "x"}"#).unwrap_err();
        assert_eq!(e.to_string(), "beta: invalid type: string \"x\", expected f64");
        let e = parse_config::<Cfg>(r#"{"beta": 1, "clip": {"low": []}}"#).unwrap_err();
        assert!(e.to_string().starts_with("clip.low: invalid type"), "{e}");
        let e = parse_config::<Cfg>(r#"{"beta": 1, "gamma": 2}"#).unwrap_err();
        assert!(e.to_string().starts_with("gamma: unknown field `gamma`"), "{e}");
        let e = parse_config::<Cfg>("").unwrap_err();
        assert!(e.to_string().contains("missing field `beta`"), "{e}");
        assert!(parse_config::<Cfg>(r#"{"beta": 0.1}"#).is_ok());
    }
}
