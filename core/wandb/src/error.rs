//! The crate's error type.

/// What can go wrong: invalid settings (returned by [`crate::WandbSettings::from_env`]) and, inside
/// the background thread, failed requests (never returned to training code; they are counted in
/// [`crate::WandbStats`] and the last one is kept as text in [`crate::WandbStats::last_error`]).
#[derive(Debug, thiserror::Error)]
pub enum WandbError {
    /// A setting from the environment or the `[wandb]` config section is unusable.
    #[error("wandb: invalid setting `{field}`: {reason}")]
    InvalidSetting {
        /// The config field or environment variable.
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// The HTTP client could not be built (for example TLS initialisation failed).
    #[error("wandb: could not build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// The request did not get an HTTP answer: connection refused, DNS, timeout, broken body.
    #[error("wandb: request to {url} failed: {source}")]
    Transport {
        /// The endpoint.
        url: String,
        /// The underlying error.
        #[source]
        source: reqwest::Error,
    },
    /// The server refused the API key (HTTP 401 or 403); the sink disables itself.
    #[error("wandb: {url} rejected the API key (HTTP {status}); check WANDB_API_KEY")]
    Unauthorized {
        /// The endpoint.
        url: String,
        /// 401 or 403.
        status: u16,
    },
    /// Any other non-2xx answer (after the retries, for the retryable ones).
    #[error("wandb: {url} answered HTTP {status}: {body}")]
    Status {
        /// The endpoint.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The start of the response body.
        body: String,
    },
    /// The GraphQL endpoint answered 200 with an `errors` list.
    #[error("wandb: GraphQL error from {url}: {message}")]
    GraphQl {
        /// The endpoint.
        url: String,
        /// The error messages, joined.
        message: String,
    },
    /// A 2xx answer whose body lacked what was needed.
    #[error("wandb: unexpected response from {url}: {reason}")]
    BadResponse {
        /// The endpoint.
        url: String,
        /// What was missing or malformed.
        reason: String,
    },
    /// `finish` (or drop) was called and its deadline passed before this request could be made.
    #[error("wandb: the finish deadline passed before the request could be completed")]
    DeadlineExceeded,
}

impl WandbError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        WandbError::InvalidSetting { field, reason: reason.into() }
    }
}
