//! `WandbSink` against a mock W&B server (tests/common): the protocol (basic auth, the
//! `upsertBucket` mutation, file-stream paths from its reply, contiguous offsets, summary and
//! `complete` last), retries without duplicates, and every failure mode costing training nothing:
//! a dead file stream, failed run creation, a wrong or revoked key, an unreachable server, a
//! server that hangs past the finish deadline, a full queue, a sink dropped without `finish`.

mod common;

use std::time::{Duration, Instant};

use common::{basic_auth, capture_warnings, fast_settings, Mock, MockConfig, DEFAULT_ENTITY, KEY};
use rlhf_wandb::{WandbSink, WandbStats};
use serde_json::{json, Map, Value};

fn metrics(step: u64) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("loss".into(), json!(1.0 / (step as f64 + 1.0)));
    m.insert("reward/mean".into(), json!(step as f64 * 0.5));
    m
}

fn summary(pairs: Value) -> Map<String, Value> {
    pairs.as_object().unwrap().clone()
}

/// Logs steps `range`, returning the longest single `log` call.
fn log_steps(sink: &WandbSink, range: std::ops::Range<u64>) -> Duration {
    let mut longest = Duration::ZERO;
    for step in range {
        let m = metrics(step);
        let t = Instant::now();
        sink.log(step, m);
        longest = longest.max(t.elapsed());
    }
    longest
}

/// serde_json (without `float_roundtrip`) may parse the last digit differently.
fn assert_close(value: &Value, expected: f64) {
    let v = value.as_f64().unwrap_or(f64::NAN);
    assert!((v - expected).abs() <= 1e-12 * expected.abs().max(1.0), "{value} != {expected}");
}

fn assert_accounted(stats: &WandbStats) {
    assert_eq!(stats.lines_logged, stats.lines_sent + stats.lines_dropped, "{stats:?}");
    assert_eq!(stats.lines_pending, 0, "{stats:?}");
}

#[test]
fn happy_path_streams_every_line_in_order() {
    let mock = Mock::start(MockConfig::default());
    let ((stats, run_id, run_info), warnings) = capture_warnings(|| {
        let sink = WandbSink::start(
            mock.settings(KEY),
            json!({"lr": 1e-6, "algo": "grpo", "model": {"name": "tiny", "layers": 2}}),
        );
        // Bursts further apart than the 20 ms flush interval: several history requests.
        for burst in 0..5 {
            log_steps(&sink, burst * 10..burst * 10 + 10);
            std::thread::sleep(Duration::from_millis(60));
        }
        let run_id = sink.run_id().to_string();
        let run_info = sink.run_info();
        (sink.finish(summary(json!({"final_reward": 1.0})), 0), run_id, run_info)
    });
    assert_eq!(mock.errors(), Vec::<String>::new());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(run_id.len(), 8);

    let requests = mock.requests();
    let auth = basic_auth("api", KEY);
    assert!(requests.iter().all(|r| r.authorization.as_deref() == Some(auth.as_str())), "{requests:?}");

    // Run creation first, with project, (default) entity, run id and the wrapped config.
    let gql = &requests[0];
    assert!(gql.is_graphql(), "{gql:?}");
    let query = gql.body["query"].as_str().unwrap();
    assert!(query.contains("mutation") && query.contains("upsertBucket("), "{query}");
    let vars = &gql.body["variables"];
    assert_eq!(vars["project"], "proj");
    assert_eq!(vars["entity"], Value::Null);
    assert_eq!(vars["name"], run_id.as_str());
    let config: Value = serde_json::from_str(vars["config"].as_str().expect("config is a JSON string")).unwrap();
    assert_eq!(
        config,
        json!({"lr": {"value": 1e-6}, "algo": {"value": "grpo"}, "model": {"value": {"name": "tiny", "layers": 2}}})
    );
    assert_eq!(requests.iter().filter(|r| r.is_graphql()).count(), 1);

    // Every file-stream request went to the run the server created (checked by the mock), under
    // the entity the server chose.
    let path = format!("/files/{DEFAULT_ENTITY}/proj/{run_id}/file_stream");
    assert!(requests[1..].iter().all(|r| r.path == path), "{requests:?}");
    let run_info = run_info.expect("run created before the first sleep ended");
    assert_eq!((run_info.entity.as_str(), run_info.project.as_str()), (DEFAULT_ENTITY, "proj"));
    assert_eq!(run_info.url, format!("{}/{DEFAULT_ENTITY}/proj/runs/{run_id}", mock.base_url));

    // All 50 lines, in order, once, with contiguous offsets over several requests.
    let history = mock.history();
    assert_eq!(history.len(), 50);
    let mut last_runtime = 0.0;
    for (i, line) in history.iter().enumerate() {
        assert_eq!(line["_step"], i as u64);
        assert_close(&line["loss"], 1.0 / (i as f64 + 1.0));
        assert!(line["_timestamp"].as_f64().unwrap() > 1.6e9);
        let runtime = line["_runtime"].as_f64().unwrap();
        assert!(runtime >= last_runtime);
        last_runtime = runtime;
    }
    let writes = mock.history_writes();
    assert!(writes.len() >= 2, "expected several history requests: {writes:?}");
    let mut expected_offset = 0;
    for (offset, n) in &writes {
        assert_eq!(*offset, expected_offset, "{writes:?}");
        expected_offset += *n as u64;
    }

    // Summary after the history (mock checks order), then `complete` last.
    let summary = mock.summary().expect("summary");
    assert_eq!(summary["final_reward"], 1.0);
    assert_close(&summary["loss"], 1.0 / 50.0);
    assert_eq!(summary["_step"], 49);
    let last = requests.last().unwrap();
    assert_eq!(last.body, json!({"complete": true, "exitcode": 0}));
    assert!(requests[requests.len() - 2].summary().is_some());
    assert_eq!(mock.exit_code(), Some(0));

    assert_accounted(&stats);
    assert_eq!(stats.lines_sent, 50);
    assert_eq!(stats.requests, requests.len() as u64);
    assert_eq!(stats.failed_requests, 0);
    assert!(stats.summary_sent && stats.completed && !stats.disabled && !stats.timed_out, "{stats:?}");
}

#[test]
fn server_errors_are_retried_without_losing_or_duplicating_lines() {
    let mock = Mock::start(MockConfig { filestream_fail_first: 2, ..Default::default() });
    let (stats, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(mock.settings(KEY), json!({}));
        log_steps(&sink, 0..30);
        std::thread::sleep(Duration::from_millis(50));
        log_steps(&sink, 30..60);
        sink.finish(Map::new(), 0)
    });
    assert_eq!(mock.errors(), Vec::<String>::new());
    assert!(warnings.is_empty(), "{warnings:?}");
    let failed: Vec<_> = mock.requests().into_iter().filter(|r| r.status == 500).collect();
    assert_eq!(failed.len(), 2);
    // The retries carried the same offset: each accepted line was written once.
    let history = mock.history();
    assert_eq!(history.iter().map(|l| l["_step"].as_u64().unwrap()).collect::<Vec<_>>(), (0..60).collect::<Vec<_>>());
    assert_eq!(mock.history_writes().iter().map(|(_, n)| n).sum::<usize>(), 60);
    assert_accounted(&stats);
    assert_eq!((stats.lines_sent, stats.lines_dropped, stats.failed_requests), (60, 0, 2));
    assert!(stats.completed);
}

#[test]
fn a_dead_file_stream_costs_training_nothing_and_warns_once() {
    let mock = Mock::start(MockConfig { filestream_status: Some(500), ..Default::default() });
    let settings = mock.settings(KEY);
    let deadline = settings.finish_timeout;
    let ((stats, longest, logging, finishing), warnings) = capture_warnings(|| {
        let sink = WandbSink::start(settings, json!({"a": 1}));
        let t = Instant::now();
        let longest = log_steps(&sink, 0..1000);
        let logging = t.elapsed();
        let t = Instant::now();
        let stats = sink.finish(Map::new(), 0);
        (stats, longest, logging, t.elapsed())
    });
    // Generous bounds: `log` is a channel send, but this machine may be busy.
    assert!(longest < Duration::from_millis(200), "slowest log() took {longest:?}");
    assert!(logging < Duration::from_secs(2), "1000 log() calls took {logging:?}");
    assert!(finishing < deadline + Duration::from_secs(2), "finish took {finishing:?}");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("gave up"), "{warnings:?}");

    assert_accounted(&stats);
    assert_eq!((stats.lines_sent, stats.lines_dropped), (0, 1000));
    assert!(stats.batches_dropped >= 1);
    assert!(!stats.summary_sent && !stats.completed && !stats.timed_out && !stats.disabled, "{stats:?}");
    assert!(stats.last_error.as_deref().unwrap_or("").contains("500"), "{stats:?}");
    // 1 + max_retries attempts per request given up on.
    let file_stream = mock.requests().iter().filter(|r| r.is_file_stream()).count() as u64;
    assert_eq!(file_stream, (stats.batches_dropped + 2) * 4);
    assert!(mock.history().is_empty());
}

#[test]
fn failing_run_creation_disables_the_sink_with_one_warning() {
    let mock = Mock::start(MockConfig { graphql_status: Some(500), ..Default::default() });
    let ((stats, longest, disabled), warnings) = capture_warnings(|| {
        let sink = WandbSink::start(mock.settings(KEY), json!({}));
        log_steps(&sink, 0..10);
        let t = Instant::now();
        while !sink.is_disabled() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let disabled = sink.is_disabled();
        let longest = log_steps(&sink, 10..1000);
        (sink.finish(Map::new(), 0), longest, disabled)
    });
    assert!(disabled);
    assert!(longest < Duration::from_millis(200), "slowest log() took {longest:?}");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("could not create the run"), "{warnings:?}");
    let requests = mock.requests();
    assert_eq!(requests.len(), 4, "1 + 3 retries, no file stream: {requests:?}");
    assert!(requests.iter().all(|r| r.is_graphql()));
    assert_accounted(&stats);
    assert_eq!((stats.lines_sent, stats.lines_dropped), (0, 1000));
    assert!(stats.disabled && !stats.completed);
}

#[test]
fn graphql_errors_disable_the_sink() {
    let mock = Mock::start(MockConfig { graphql_errors: true, ..Default::default() });
    let (stats, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(mock.settings(KEY), json!({}));
        log_steps(&sink, 0..5);
        sink.finish(Map::new(), 0)
    });
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("permission denied"), "{warnings:?}");
    assert_eq!(mock.requests().len(), 1, "GraphQL errors are not retried");
    assert!(stats.disabled);
    assert_accounted(&stats);
    assert_eq!(stats.lines_dropped, 5);
}

#[test]
fn a_wrong_key_disables_the_sink_without_retrying() {
    let mock = Mock::start(MockConfig::default());
    let (stats, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(mock.settings("wrong-key"), json!({}));
        log_steps(&sink, 0..20);
        sink.finish(Map::new(), 0)
    });
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("401"), "{warnings:?}");
    let requests = mock.requests();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert_eq!(requests[0].authorization.as_deref(), Some(basic_auth("api", "wrong-key").as_str()));
    assert!(stats.disabled && !stats.completed);
    assert_accounted(&stats);
    assert_eq!(stats.lines_dropped, 20);
}

#[test]
fn a_key_revoked_mid_run_disables_the_sink() {
    let mock = Mock::start(MockConfig { filestream_status: Some(403), ..Default::default() });
    let (stats, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(mock.settings(KEY), json!({}));
        log_steps(&sink, 0..20);
        std::thread::sleep(Duration::from_millis(100));
        log_steps(&sink, 20..40);
        sink.finish(Map::new(), 0)
    });
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("403"), "{warnings:?}");
    let file_stream = mock.requests().into_iter().filter(|r| r.is_file_stream()).count();
    assert_eq!(file_stream, 1, "403 is neither retried nor followed by more requests");
    assert!(stats.disabled && !stats.summary_sent && !stats.completed);
    assert_accounted(&stats);
    assert_eq!((stats.lines_sent, stats.lines_dropped), (0, 40));
}

#[test]
fn an_unreachable_server_is_survived() {
    // A port nothing listens on any more.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let settings = fast_settings(&format!("http://127.0.0.1:{port}"), KEY);
    let deadline = settings.finish_timeout;
    let ((stats, finishing), warnings) = capture_warnings(|| {
        let sink = WandbSink::start(settings, json!({}));
        log_steps(&sink, 0..100);
        let t = Instant::now();
        (sink.finish(Map::new(), 0), t.elapsed())
    });
    assert!(finishing < deadline + Duration::from_secs(2), "finish took {finishing:?}");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(stats.disabled && !stats.timed_out, "{stats:?}");
    assert_eq!(stats.requests, 4);
    assert_accounted(&stats);
    assert_eq!(stats.lines_dropped, 100);
}

#[test]
fn finish_gives_up_at_its_deadline_on_a_hanging_server() {
    let mock = Mock::start(MockConfig { filestream_delay: Duration::from_secs(30), ..Default::default() });
    let mut settings = mock.settings(KEY);
    settings.request_timeout = Duration::from_secs(20);
    settings.finish_timeout = Duration::from_millis(500);
    let ((stats, finishing), warnings) = capture_warnings(|| {
        let sink = WandbSink::start(settings, json!({}));
        log_steps(&sink, 0..10);
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        (sink.finish(Map::new(), 0), t.elapsed())
    });
    assert!(finishing >= Duration::from_millis(450), "finish took {finishing:?}");
    assert!(finishing < Duration::from_millis(500) + Duration::from_secs(2), "finish took {finishing:?}");
    assert!(stats.timed_out, "{stats:?}");
    assert_eq!(stats.lines_pending, 10, "{stats:?}");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("unconfirmed"), "{warnings:?}");
}

#[test]
fn a_full_queue_drops_lines_and_warns_once() {
    // Run creation takes 500 ms; meanwhile only 4 lines fit in the queue.
    let mock = Mock::start(MockConfig { graphql_delay: Duration::from_millis(500), ..Default::default() });
    let mut settings = mock.settings(KEY);
    settings.queue_capacity = 4;
    let (stats, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(settings, json!({}));
        log_steps(&sink, 0..100);
        sink.finish(Map::new(), 0)
    });
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("queue full"), "{warnings:?}");
    assert_accounted(&stats);
    assert!(stats.queue_full_drops >= 90, "{stats:?}");
    assert_eq!(stats.lines_dropped, stats.queue_full_drops);
    assert_eq!(mock.history().len() as u64, stats.lines_sent);
    assert!(stats.completed);
}

#[test]
fn dropping_the_sink_without_finish_ends_the_run_as_failed() {
    let mock = Mock::start(MockConfig::default());
    let mut settings = mock.settings(KEY);
    settings.flush_interval = Duration::from_secs(60);
    let deadline = settings.finish_timeout;
    let (dropping, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(settings, json!({}));
        log_steps(&sink, 0..7);
        let t = Instant::now();
        drop(sink);
        t.elapsed()
    });
    assert!(dropping < deadline + Duration::from_secs(2), "drop took {dropping:?}");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(mock.errors(), Vec::<String>::new());
    assert_eq!(mock.history().len(), 7, "pending lines are flushed on drop");
    assert_eq!(mock.summary().unwrap()["_step"], 6);
    assert_eq!(mock.exit_code(), Some(1));
}

#[test]
fn explicit_run_settings_and_a_resumed_history() {
    let mock = Mock::start(MockConfig { history_line_count: 5, ..Default::default() });
    let mut settings = mock.settings(KEY);
    settings.entity = Some("team".into());
    settings.run_id = Some("myrun123".into());
    settings.run_name = Some("grpo-tiny".into());
    settings.group = Some("sweep-1".into());
    settings.tags = vec!["grpo".into(), "test".into()];
    let (stats, warnings) = capture_warnings(|| {
        let sink = WandbSink::start(settings, Value::Null);
        assert_eq!(sink.run_id(), "myrun123");
        log_steps(&sink, 5..8);
        sink.finish(Map::new(), 3)
    });
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(mock.errors(), Vec::<String>::new());
    let vars = mock.requests()[0].body["variables"].clone();
    assert_eq!(vars["entity"], "team");
    assert_eq!(vars["name"], "myrun123");
    assert_eq!(vars["displayName"], "grpo-tiny");
    assert_eq!(vars["groupName"], "sweep-1");
    assert_eq!(vars["tags"], json!(["grpo", "test"]));
    assert_eq!(vars["config"], Value::Null);
    assert_eq!(mock.run_path().unwrap(), "/files/team/proj/myrun123/file_stream");
    // Appended after the 5 lines the run already had.
    assert_eq!(mock.history_writes().first().unwrap().0, 5);
    assert_eq!(mock.history().len(), 8);
    assert_eq!(mock.exit_code(), Some(3));
    assert_eq!(stats.lines_sent, 3);
}

#[test]
fn an_idle_run_sends_heartbeats() {
    let mock = Mock::start(MockConfig::default());
    let mut settings = mock.settings(KEY);
    settings.heartbeat_interval = Duration::from_millis(50);
    let sink = WandbSink::start(settings, json!({}));
    std::thread::sleep(Duration::from_millis(400));
    let stats = sink.finish(Map::new(), 0);
    assert!(mock.heartbeats() >= 2, "{} heartbeats", mock.heartbeats());
    assert_eq!(mock.errors(), Vec::<String>::new());
    assert!(stats.completed);
}
