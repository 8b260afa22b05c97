//! The wire format, as the wandb SDK speaks it (pure functions; the HTTP side is in
//! `transport`).
//!
//! * Run creation: a GraphQL `upsertBucket` mutation POSTed to `{base}/graphql`. `name` is the run
//!   id, `displayName` the human name, `modelName` the project, `entityName` the entity (null: the
//!   key's default entity), `config` a JSON *string* whose top-level keys are wrapped as
//!   `{"key": {"value": ...}}`. The reply's `bucket.project.entity.name`, `bucket.project.name`
//!   and `bucket.name` are where the file stream goes; `bucket.historyLineCount` is the number of
//!   history lines the run already has (non-zero when an existing run id is reused), the first
//!   history offset.
//! * Streaming: POSTs to `{base}/files/{entity}/{project}/{run}/file_stream` with
//!   `{"files": {"wandb-history.jsonl": {"offset": N, "content": ["<json line>", ...]}}}`; `N` is
//!   the number of lines already written, so a retried request with the same offset overwrites
//!   rather than duplicates. `wandb-summary.json` is always sent at offset 0 with one line (the
//!   whole summary). `{"complete": true, "exitcode": N}` ends the run; `{"complete": false,
//!   "failed": false}` is the heartbeat.

use serde_json::{json, Map, Value};

use crate::error::WandbError;

/// The history file of a run.
pub const HISTORY_FILE: &str = "wandb-history.jsonl";
/// The summary file of a run.
pub const SUMMARY_FILE: &str = "wandb-summary.json";

/// Creates (or updates) the run and reads back where it lives.
pub(crate) const UPSERT_BUCKET: &str = "mutation UpsertBucket(\
$name: String, $project: String, $entity: String, $displayName: String, \
$groupName: String, $tags: [String!], $config: JSONString) {
  upsertBucket(input: {name: $name, modelName: $project, entityName: $entity, \
displayName: $displayName, groupName: $groupName, tags: $tags, config: $config}) {
    bucket {
      id
      name
      displayName
      historyLineCount
      project { name entity { name } }
    }
    inserted
  }
}";

/// Where a run lives, as the server answered `upsertBucket`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    /// Entity (user or team) the run belongs to.
    pub entity: String,
    /// Project.
    pub project: String,
    /// Run id (`bucket.name`).
    pub run_id: String,
    /// Display name, if the server returned one.
    pub display_name: Option<String>,
    /// Lines the run's history already had: the first history offset.
    pub history_line_count: u64,
    /// Web page of the run (`https://wandb.ai/{entity}/{project}/runs/{run_id}` for the hosted
    /// service; on the base URL's host otherwise).
    pub url: String,
}

/// A history line as `log` recorded it; serialised on the background thread.
#[derive(Debug)]
pub(crate) struct Record {
    pub step: u64,
    /// Unix time in seconds when `log` was called.
    pub timestamp: f64,
    /// Seconds since the sink started when `log` was called.
    pub runtime: f64,
    pub metrics: Map<String, Value>,
}

/// The run config as wandb stores it: `{"key": {"value": ...}}` for each top-level key, as a JSON
/// string. `None` for `null` or an empty object; a non-object value is stored under `config`.
pub(crate) fn wrap_config(config: &Value) -> Option<String> {
    let wrapped: Map<String, Value> = match config {
        Value::Null => return None,
        Value::Object(map) if map.is_empty() => return None,
        Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), json!({ "value": v }))).collect(),
        other => std::iter::once(("config".to_string(), json!({ "value": other }))).collect(),
    };
    Some(Value::Object(wrapped).to_string())
}

/// The GraphQL request body that creates the run.
#[allow(clippy::too_many_arguments)]
pub(crate) fn upsert_bucket_body(
    run_id: &str,
    project: &str,
    entity: Option<&str>,
    display_name: Option<&str>,
    group: Option<&str>,
    tags: &[String],
    config: &Value,
) -> Value {
    json!({
        "operationName": "UpsertBucket",
        "query": UPSERT_BUCKET,
        "variables": {
            "name": run_id,
            "project": project,
            "entity": entity,
            "displayName": display_name,
            "groupName": group,
            "tags": if tags.is_empty() { Value::Null } else { json!(tags) },
            "config": wrap_config(config),
        },
    })
}

/// Reads the run's location out of an `upsertBucket` reply; fields the server left out fall back
/// to what was asked for.
pub(crate) fn parse_upsert_reply(
    url: &str,
    reply: &Value,
    asked_run_id: &str,
    asked_project: &str,
    asked_entity: Option<&str>,
    base_url: &str,
) -> Result<RunInfo, WandbError> {
    if let Some(errors) = reply.get("errors").and_then(Value::as_array).filter(|e| !e.is_empty()) {
        let message = errors
            .iter()
            .map(|e| e.get("message").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| e.to_string()))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(WandbError::GraphQl { url: url.to_string(), message });
    }
    let bad = |reason: &str| WandbError::BadResponse { url: url.to_string(), reason: reason.to_string() };
    let bucket = reply
        .pointer("/data/upsertBucket/bucket")
        .filter(|b| b.is_object())
        .ok_or_else(|| bad("no data.upsertBucket.bucket in the reply"))?;
    let text = |pointer: &str| bucket.pointer(pointer).and_then(Value::as_str).filter(|s| !s.is_empty());
    let run_id = text("/name").unwrap_or(asked_run_id).to_string();
    let project = text("/project/name").unwrap_or(asked_project).to_string();
    let entity = text("/project/entity/name")
        .or(asked_entity)
        .ok_or_else(|| bad("the reply names no entity and none was configured"))?
        .to_string();
    let history_line_count = bucket.get("historyLineCount").and_then(Value::as_u64).unwrap_or(0);
    let url = format!("{}/{entity}/{project}/runs/{run_id}", app_url(base_url));
    Ok(RunInfo {
        entity,
        project,
        run_id,
        display_name: text("/displayName").map(str::to_string),
        history_line_count,
        url,
    })
}

/// The web app's URL for an API URL: `api.wandb.ai` → `wandb.ai`; self-hosted servers serve both.
fn app_url(base_url: &str) -> String {
    match reqwest::Url::parse(base_url) {
        Ok(url) => match url.host_str() {
            Some(host) if host.starts_with("api.wandb.") => base_url.replacen("://api.", "://", 1),
            _ => base_url.to_string(),
        },
        Err(_) => base_url.to_string(),
    }
}

/// One history line: the metrics plus `_step`, `_timestamp` and `_runtime` (these win over
/// metrics of the same name).
pub(crate) fn history_line(record: Record) -> (String, Map<String, Value>) {
    let mut line = record.metrics;
    line.insert("_step".into(), json!(record.step));
    line.insert("_timestamp".into(), json!(record.timestamp));
    line.insert("_runtime".into(), json!(record.runtime));
    (Value::Object(line.clone()).to_string(), line)
}

/// A file-stream body appending `lines` to the history at `offset`.
pub(crate) fn history_body(offset: u64, lines: &[String]) -> Value {
    json!({ "files": { HISTORY_FILE: { "offset": offset, "content": lines } } })
}

/// A file-stream body replacing the summary.
pub(crate) fn summary_body(summary: &Map<String, Value>) -> Value {
    let line = Value::Object(summary.clone()).to_string();
    json!({ "files": { SUMMARY_FILE: { "offset": 0, "content": [line] } } })
}

/// The last file-stream body: the run is over with `exit_code`.
pub(crate) fn complete_body(exit_code: i32) -> Value {
    json!({ "complete": true, "exitcode": exit_code })
}

/// An empty file-stream body that keeps the run alive.
pub(crate) fn heartbeat_body() -> Value {
    json!({ "complete": false, "failed": false })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_wrapped_as_a_json_string() {
        let s = wrap_config(&json!({"lr": 1e-6, "algo": {"name": "grpo"}})).unwrap();
        let v: Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v, json!({"lr": {"value": 1e-6}, "algo": {"value": {"name": "grpo"}}}));
        assert_eq!(wrap_config(&Value::Null), None);
        assert_eq!(wrap_config(&json!({})), None);
        assert_eq!(wrap_config(&json!(3)).unwrap(), r#"{"config":{"value":3}}"#);
    }

    #[test]
    fn upsert_reply() {
        let reply = json!({"data": {"upsertBucket": {"bucket": {
            "id": "UnVuOjE=", "name": "r1", "displayName": "happy-run-1", "historyLineCount": 7,
            "project": {"name": "p", "entity": {"name": "e"}}}, "inserted": true}}});
        let info = parse_upsert_reply("u", &reply, "r1", "p", None, "https://api.wandb.ai").unwrap();
        assert_eq!(info.entity, "e");
        assert_eq!(info.history_line_count, 7);
        assert_eq!(info.display_name.as_deref(), Some("happy-run-1"));
        assert_eq!(info.url, "https://wandb.ai/e/p/runs/r1");

        let errors = json!({"errors": [{"message": "permission denied"}], "data": {"upsertBucket": null}});
        let err = parse_upsert_reply("u", &errors, "r1", "p", None, "http://x").unwrap_err();
        assert!(err.to_string().contains("permission denied"), "{err}");
        assert!(parse_upsert_reply("u", &json!({"data": {}}), "r1", "p", Some("e"), "http://x").is_err());
        let bare = json!({"data": {"upsertBucket": {"bucket": {"id": "x"}}}});
        let info = parse_upsert_reply("u", &bare, "r1", "p", Some("e"), "http://h:8080").unwrap();
        assert_eq!((info.entity.as_str(), info.project.as_str(), info.run_id.as_str()), ("e", "p", "r1"));
        assert_eq!(info.url, "http://h:8080/e/p/runs/r1");
        assert!(parse_upsert_reply("u", &bare, "r1", "p", None, "http://x").is_err());
    }

    #[test]
    fn lines_and_bodies() {
        let mut metrics = Map::new();
        metrics.insert("loss".into(), json!(0.5));
        metrics.insert("_step".into(), json!("user value loses"));
        let (line, _) = history_line(Record { step: 3, timestamp: 1.5, runtime: 0.25, metrics });
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v, json!({"loss": 0.5, "_step": 3, "_timestamp": 1.5, "_runtime": 0.25}));
        let body = history_body(4, &[line]);
        assert_eq!(body["files"][HISTORY_FILE]["offset"], 4);
        assert_eq!(complete_body(2), json!({"complete": true, "exitcode": 2}));
    }
}
