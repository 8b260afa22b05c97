//! Chat templates: finding the template of a model directory and rendering it with
//! minijinja the way transformers' `apply_chat_template(tokenize=False)` renders it with
//! jinja2.

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde::{Deserialize, Serialize};
use serde_json::Map;

use crate::error::{describe, one_line, TokenizerError};
use crate::pyjson::{py_float_repr, tojson_filter};
use crate::special::SpecialTokens;
use crate::strftime::{strftime, DateTime};

/// The name the template is registered under; minijinja errors say `(in chat_template:LINE)`.
const TEMPLATE_NAME: &str = "chat_template";

/// One chat turn: `{"role": "user", "content": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... — whatever the template understands.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// Builds a message from a role and its text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// The chat template of a model directory, ready to render or the reason it is not.
#[derive(Clone)]
pub(crate) enum ChatTemplate {
    /// No template anywhere.
    Missing { config_path: PathBuf },
    /// A list of named templates without one called `default`.
    NoDefault { config_path: PathBuf, names: Vec<String> },
    /// A template that failed to compile.
    Invalid { source_path: PathBuf, message: String },
    /// A compiled template.
    Ready { source_path: PathBuf, env: Box<Environment<'static>> },
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { .. } => f.write_str("Missing"),
            Self::NoDefault { names, .. } => write!(f, "NoDefault({names:?})"),
            Self::Invalid { source_path, .. } => write!(f, "Invalid({})", source_path.display()),
            Self::Ready { source_path, .. } => write!(f, "Ready({})", source_path.display()),
        }
    }
}

/// Error source marking an error raised by the template's own `raise_exception(...)`.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl ChatTemplate {
    /// Finds the template: `chat_template.jinja` in `dir` if it exists (transformers gives
    /// the separate file priority), else `chat_template` of `tokenizer_config.json`
    /// (a string, or a list of `{"name", "template"}` from which `default` is used).
    pub(crate) fn load(
        dir: &Path,
        config_path: &Path,
        config: Option<&Map<String, serde_json::Value>>,
    ) -> Result<Self, TokenizerError> {
        let jinja_path = dir.join("chat_template.jinja");
        if let Some(source) = crate::files::read_text_optional(&jinja_path)? {
            return Ok(Self::compile(jinja_path, source));
        }
        let value = config.and_then(|c| c.get("chat_template"));
        match value {
            None | Some(serde_json::Value::Null) => Ok(Self::Missing { config_path: config_path.to_path_buf() }),
            Some(serde_json::Value::String(s)) => Ok(Self::compile(config_path.to_path_buf(), s.clone())),
            Some(serde_json::Value::Array(items)) => {
                let mut names = Vec::with_capacity(items.len());
                let mut default = None;
                for (i, item) in items.iter().enumerate() {
                    let field = |name: &str| -> Result<String, TokenizerError> {
                        match item.get(name) {
                            Some(serde_json::Value::String(s)) => Ok(s.clone()),
                            other => Err(TokenizerError::WrongType {
                                path: config_path.to_path_buf(),
                                key: format!("chat_template[{i}].{name}"),
                                expected: "a string",
                                got: other.map_or_else(|| "nothing".to_owned(), describe),
                            }),
                        }
                    };
                    if !item.is_object() {
                        return Err(TokenizerError::WrongType {
                            path: config_path.to_path_buf(),
                            key: format!("chat_template[{i}]"),
                            expected: "{\"name\": ..., \"template\": ...}",
                            got: describe(item),
                        });
                    }
                    let name = field("name")?;
                    let template = field("template")?;
                    if name == "default" && default.is_none() {
                        default = Some(template);
                    }
                    names.push(name);
                }
                match default {
                    Some(source) => Ok(Self::compile(config_path.to_path_buf(), source)),
                    None if names.is_empty() => Ok(Self::Missing { config_path: config_path.to_path_buf() }),
                    None => Ok(Self::NoDefault { config_path: config_path.to_path_buf(), names }),
                }
            }
            Some(other) => Err(TokenizerError::WrongType {
                path: config_path.to_path_buf(),
                key: "chat_template".to_owned(),
                expected: "a string or a list of {\"name\": ..., \"template\": ...}",
                got: describe(other),
            }),
        }
    }

    fn compile(source_path: PathBuf, source: String) -> Self {
        let mut env = new_environment();
        let source = rewrite_generation_tags(&source).into_owned();
        match env.add_template_owned(TEMPLATE_NAME, source) {
            Ok(()) => Self::Ready { source_path, env: Box::new(env) },
            Err(e) => Self::Invalid { source_path, message: error_message(&e) },
        }
    }

    /// Whether a template was found (even one that fails to compile).
    pub(crate) fn exists(&self) -> bool {
        matches!(self, Self::Ready { .. } | Self::Invalid { .. })
    }

    /// Renders the template.
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        special: &SpecialTokens,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let (source_path, env) = match self {
            Self::Missing { config_path } => return Err(TokenizerError::NoChatTemplate { path: config_path.clone() }),
            Self::NoDefault { config_path, names } => {
                return Err(TokenizerError::NoDefaultChatTemplate { path: config_path.clone(), names: names.clone() })
            }
            Self::Invalid { source_path, message } => {
                return Err(TokenizerError::TemplateSyntax { path: source_path.clone(), message: message.clone() })
            }
            Self::Ready { source_path, env } => (source_path, env),
        };
        if messages.is_empty() {
            return Err(TokenizerError::EmptyConversation { path: source_path.clone() });
        }
        let render_err =
            |e: Error| TokenizerError::TemplateRender { path: source_path.clone(), message: error_message(&e) };
        let template = env.get_template(TEMPLATE_NAME).map_err(render_err)?;
        // Like transformers: messages, tools=None, documents=None, add_generation_prompt, and
        // the special tokens that are set (unset ones stay undefined).
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from_serialize(messages)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ];
        for (key, text) in &special.tokens {
            ctx.push((key, Value::from(text.as_str())));
        }
        for (key, value) in kwargs {
            ctx.push((key, Value::from_serialize(value)));
        }
        let ctx: Value = ctx.into_iter().collect();
        template.render(ctx).map_err(render_err)
    }
}

/// The environment transformers builds (`ImmutableSandboxedEnvironment(trim_blocks=True,
/// lstrip_blocks=True)` with loop controls, `raise_exception`, `strftime_now` and its own
/// `tojson`), in minijinja terms.
fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    // jinja2 never auto-escapes here; minijinja would for `.html`/`.json` names, not ours,
    // but be explicit.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", |value: &Value, args: Rest<Value>, kwargs: Kwargs| tojson_filter(value, &args, kwargs));
    env
}

/// `{{ value }}` the way jinja2 prints it: Python's `True`/`False`/`None` and float repr
/// instead of minijinja's `true`/`false`/`none`.
fn python_formatter(out: &mut minijinja::Output<'_>, state: &State<'_, '_>, value: &Value) -> Result<(), Error> {
    let text: Cow<'_, str> = match value.kind() {
        ValueKind::Bool => Cow::Borrowed(if value.is_true() { "True" } else { "False" }),
        ValueKind::None => Cow::Borrowed("None"),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => Cow::Owned(py_float_repr(f)),
            Err(_) => return minijinja::escape_formatter(out, state, value),
        },
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text).map_err(Error::from)
}

fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let message = match message {
        Some(v) => match v.as_str() {
            Some(s) => s.to_owned(),
            None => v.to_string(),
        },
        None => String::new(),
    };
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

fn strftime_now(format: String) -> String {
    strftime(&format, &DateTime::now_utc())
}

/// A one-line message for a minijinja error, with its sources; an error raised by the
/// template's `raise_exception` reads `template raised an exception: MSG (in chat_template:N)`.
fn error_message(e: &Error) -> String {
    let raised =
        std::iter::successors(std::error::Error::source(e), |s: &&(dyn std::error::Error + 'static)| s.source())
            .find_map(|s| s.downcast_ref::<RaisedException>());
    let mut message = match raised {
        Some(r) => {
            let mut m = format!("template raised an exception: {}", r.0);
            if let (Some(name), Some(line)) = (e.name(), e.line()) {
                m.push_str(&format!(" (in {name}:{line})"));
            }
            m
        }
        None => {
            let mut m = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                m.push_str(": ");
                m.push_str(&s.to_string());
                source = s.source();
            }
            m
        }
    };
    message = one_line(&message);
    message
}

/// Transformers registers a `{% generation %}...{% endgeneration %}` block tag (to find
/// assistant tokens); rendered as text it just outputs its body. minijinja has no custom
/// tags, so rewrite them to `{% if true %}...{% endif %}`, keeping whitespace control.
pub(crate) fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len() + 16);
    let mut rest = source;
    let mut changed = false;
    while let Some(start) = rest.find("{%") {
        let (before, tag_and_after) = rest.split_at(start);
        out.push_str(before);
        let mut i = 2;
        let bytes = tag_and_after.as_bytes();
        if matches!(bytes.get(i), Some(b'-' | b'+')) {
            i += 1;
        }
        while matches!(bytes.get(i), Some(b) if b.is_ascii_whitespace()) {
            i += 1;
        }
        let word_end = tag_and_after[i..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(tag_and_after.len(), |n| i + n);
        let word = &tag_and_after[i..word_end];
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str(&tag_and_after[..i]);
                out.push_str(r);
                rest = &tag_and_after[word_end..];
                changed = true;
            }
            None => {
                out.push_str("{%");
                rest = &tag_and_after[2..];
            }
        }
    }
    out.push_str(rest);
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_rewritten() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c"),
            "a{%- if true -%}b{% endif %}c"
        );
        assert_eq!(rewrite_generation_tags("{% if generation %}x{% endif %}"), "{% if generation %}x{% endif %}");
        assert!(matches!(rewrite_generation_tags("no tags"), Cow::Borrowed(_)));
    }
}
