//! Checks shared by the plugins' configs: an endpoint URL ([`parse_endpoint`]) and a secret
//! header read from the environment ([`secret_header`]). Errors are typed; each plugin names
//! the config key in front of their message.

use std::env::VarError;

use reqwest::header::HeaderValue;
use reqwest::Url;

/// Why a URL cannot be an endpoint. `text` is the URL as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("invalid URL `{text}`: {reason}")]
    Invalid { text: String, reason: String },
    #[error("`{text}`: https needs the plugin built with its `tls` feature (on by default)")]
    NeedsTls { text: String },
    #[error("`{text}`: scheme must be http or https, not {scheme}")]
    Scheme { text: String, scheme: String },
    #[error("`{text}` has no host")]
    NoHost { text: String },
}

/// `text` as an endpoint: an absolute `http` URL with a host, or `https` when `tls` (whether the
/// plugin was built with TLS: pass `cfg!(feature = "tls")`).
pub fn parse_endpoint(text: &str, tls: bool) -> Result<Url, UrlError> {
    let url = Url::parse(text).map_err(|e| UrlError::Invalid { text: text.to_string(), reason: e.to_string() })?;
    match url.scheme() {
        "http" => {}
        "https" if tls => {}
        "https" => return Err(UrlError::NeedsTls { text: text.to_string() }),
        other => return Err(UrlError::Scheme { text: text.to_string(), scheme: other.to_string() }),
    }
    if url.host().is_none() {
        return Err(UrlError::NoHost { text: text.to_string() });
    }
    Ok(url)
}

/// Why an environment variable cannot be sent as a header. Holds the variable's name, never its
/// value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("environment variable `{0}` is not set")]
    NotSet(String),
    #[error("environment variable `{0}` is not valid UTF-8")]
    NotUnicode(String),
    #[error("environment variable `{0}` is empty")]
    Empty(String),
    #[error("environment variable `{0}` holds characters not allowed in a header")]
    NotAHeader(String),
}

/// The value of environment variable `name` (`value`, as `std::env::var(name)` returned it) as
/// a header value: trimmed, after `prefix` (`"Bearer "` for a bearer token, `""` to send it
/// verbatim), and marked sensitive so it never shows in debug output. An unset, empty or
/// blank variable is an error.
pub fn secret_header(name: &str, value: Result<String, VarError>, prefix: &str) -> Result<HeaderValue, SecretError> {
    let value = match value {
        Ok(v) => v,
        Err(VarError::NotPresent) => return Err(SecretError::NotSet(name.to_string())),
        Err(VarError::NotUnicode(_)) => return Err(SecretError::NotUnicode(name.to_string())),
    };
    let value = value.trim();
    if value.is_empty() {
        return Err(SecretError::Empty(name.to_string()));
    }
    let mut header =
        HeaderValue::from_str(&format!("{prefix}{value}")).map_err(|_| SecretError::NotAHeader(name.to_string()))?;
    header.set_sensitive(true);
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(parse_endpoint("http://h:1/x?k=1", false).unwrap().as_str(), "http://h:1/x?k=1");
        assert_eq!(parse_endpoint("https://h/", true).unwrap().scheme(), "https");
        let err = |text: &str, tls: bool| parse_endpoint(text, tls).unwrap_err().to_string();
        assert_eq!(
            err("https://h/", false),
            "`https://h/`: https needs the plugin built with its `tls` feature (on by default)"
        );
        assert_eq!(err("ftp://h/", true), "`ftp://h/`: scheme must be http or https, not ftp");
        assert_eq!(err("localhost:5000", true), "`localhost:5000`: scheme must be http or https, not localhost");
        assert_eq!(err("not a url", true), "invalid URL `not a url`: relative URL without a base");
        assert_eq!(err("http:", true), "invalid URL `http:`: empty host");
        assert_eq!(err("unix:/run/sock", true), "`unix:/run/sock`: scheme must be http or https, not unix");
    }

    #[test]
    fn secrets_are_trimmed_sensitive_headers() {
        let h = secret_header("T", Ok(" s3cret\n".into()), "Bearer ").unwrap();
        assert_eq!(h.to_str().unwrap(), "Bearer s3cret");
        assert!(h.is_sensitive() && !format!("{h:?}").contains("s3cret"));
        assert_eq!(secret_header("T", Ok("Bearer x".into()), "").unwrap().to_str().unwrap(), "Bearer x");
        let err = |value: Result<String, VarError>| secret_header("T", value, "").unwrap_err().to_string();
        assert_eq!(err(Err(VarError::NotPresent)), "environment variable `T` is not set");
        assert_eq!(err(Ok("  ".into())), "environment variable `T` is empty");
        assert_eq!(err(Ok("a\nb".into())), "environment variable `T` holds characters not allowed in a header");
    }
}
