//! Parquet data end to end: the committed `fixtures/prompts.parquet` (zstd, three row groups,
//! written by `fixtures/make_parquet.py`) is read without Python and trains `rlhf train --algo
//! grpo` through the column mapping (`data.prompt_key`, `data.label_key`), which JSONL honours too;
//! files written by pyarrow at test time (snappy and zstd, a directory of shards, a glob, chat
//! `messages` as a list of structs) feed the RL prompts, `rlhf sft` and `rlhf rm`, with bad rows
//! counted as `row N` and a missing column refused naming the file and the column.

use std::path::Path;
use std::process::{Command, Output};

use rlhf_integration_tests::{fixtures, python, rlhf};
use rlhf_trainer::config::DataConfig;
use rlhf_trainer::data::{read_prompt_data, RawPrompt};
use rlhf_trainer::phase::{DataReport, SourceLines};
use rlhf_trainer::tabular::Columns;
use serde_json::{json, Value};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "rlhf failed:\n{}\n{}", String::from_utf8_lossy(&o.stdout), stderr(o));
    stderr(o)
}

fn error_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure: {}", String::from_utf8_lossy(&o.stdout));
    let e = stderr(o);
    assert!(!e.contains("panicked"), "rlhf panicked: {e}");
    e.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {e}")).to_string()
}

fn prompts_cfg(spec: &Path, prompt_key: &str, label_key: &str) -> DataConfig {
    DataConfig {
        prompts: s(spec).to_string(),
        prompt_key: prompt_key.into(),
        label_key: label_key.into(),
        ..DataConfig::default()
    }
}

fn text(p: &RawPrompt) -> (&str, Option<&str>, &Value) {
    match p {
        RawPrompt::Text { prompt, label, metadata } => (prompt, label.as_deref(), metadata),
        RawPrompt::Chat { .. } => panic!("expected a text prompt"),
    }
}

#[test]
fn the_shipped_fixture_reads_and_trains_without_python() {
    let f = fixtures().join("prompts.parquet");
    let raw = read_prompt_data(&prompts_cfg(&f, "question", "answer")).unwrap();
    assert_eq!(raw.len(), 12, "every row of the three row groups");
    // The label column stays in the metadata under its own name (reward functions get it so).
    assert_eq!(text(&raw[0]), ("1 + 2 =", Some("3"), &json!({"id": 0, "answer": 3})));
    assert_eq!(text(&raw[11]), ("4 + 4 =", Some("8"), &json!({"id": 11, "answer": 8})));

    // Unmapped, the file has no `prompt` column: one error naming the file and the column.
    let e = read_prompt_data(&prompts_cfg(&f, "prompt", "label")).unwrap_err().to_string();
    assert!(e.contains(s(&f)) && e.contains("no column `prompt` (or `messages`)"), "{e}");
    assert!(e.contains("the file's columns: question, answer, id"), "{e}");
    let e = read_prompt_data(&prompts_cfg(&f, "q", "answer")).unwrap_err().to_string();
    assert!(e.contains("no column `q` (data.prompt_key)"), "{e}");

    // JSONL honours the same mapping.
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = tmp.path().join("p.jsonl");
    std::fs::write(&jsonl, "{\"question\": \"1 + 2 =\", \"answer\": 3, \"id\": 0}\n").unwrap();
    let raw = read_prompt_data(&prompts_cfg(&jsonl, "question", "answer")).unwrap();
    assert_eq!(text(&raw[0]), ("1 + 2 =", Some("3"), &json!({"id": 0, "answer": 3})));

    let rd = tmp.path().join("run");
    let o = Command::new(rlhf_integration_tests::rlhf_bin())
        .args(["train", "--algo", "grpo", "--run-dir", s(&rd), "--set", &format!("data.prompts={:?}", s(&f))])
        .args(["--set", "data.prompt_key=\"question\"", "--set", "data.label_key=\"answer\"", "--set", "train.steps=2"])
        .output()
        .unwrap();
    ok(&o);
    let metrics = std::fs::read_to_string(rd.join("metrics.jsonl")).unwrap();
    // Two steps, after the preset's held-out evaluation before training (step 0).
    assert_eq!(metrics.lines().count(), 3, "{metrics}");
}

/// Writes `rows` (JSON objects; pyarrow infers the schema, a key a row lacks is a null) as Parquet.
fn write_parquet(py: &Path, path: &Path, rows: &Value, compression: &str) {
    let src = path.with_extension("json");
    std::fs::write(&src, rows.to_string()).unwrap();
    let code = "import json, sys, pyarrow as pa, pyarrow.parquet as pq\n\
                rows = json.load(open(sys.argv[1]))\n\
                keys = list(dict.fromkeys(k for r in rows for k in r))\n\
                rows = [{k: r.get(k) for k in keys} for r in rows]\n\
                pq.write_table(pa.Table.from_pylist(rows), sys.argv[2], compression=sys.argv[3], row_group_size=2)\n";
    let o = Command::new(py).args(["-c", code, s(&src), s(path), compression]).output().expect("spawn python");
    assert!(o.status.success(), "pyarrow failed (is pyarrow installed? `cargo xtask setup`): {}", stderr(&o));
    std::fs::remove_file(src).unwrap();
}

#[test]
fn prompts_sft_and_pairs_from_pyarrow_files() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();

    // RL prompts in two shards (snappy, zstd): a directory and a glob read both, in order.
    let shards = tmp.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    let rows = |from: i64, to: i64| -> Value {
        (from..to).map(|i| json!({"q": format!("{i} + 1 ="), "sum": i + 1, "split": "train"})).collect()
    };
    write_parquet(&py, &shards.join("train-00000-of-00002.parquet"), &rows(1, 4), "snappy");
    write_parquet(&py, &shards.join("train-00001-of-00002.parquet"), &rows(4, 7), "zstd");
    for spec in [shards.clone(), shards.join("train-*.parquet")] {
        let raw = read_prompt_data(&prompts_cfg(&spec, "q", "sum")).unwrap();
        let got: Vec<_> = raw.iter().map(|p| text(p).0.to_string()).collect();
        assert_eq!(got, (1..7).map(|i| format!("{i} + 1 =")).collect::<Vec<_>>(), "{}", spec.display());
        assert_eq!(text(&raw[5]), ("6 + 1 =", Some("7"), &json!({"split": "train", "sum": 7})));
    }
    // RL refuses a bad row as it refuses a bad JSONL line: naming the file and the row.
    let bad = tmp.path().join("bad.parquet");
    write_parquet(&py, &bad, &json!([{"q": "1 + 1 =", "sum": 2}, {"q": null, "sum": 3}]), "snappy");
    let e = read_prompt_data(&prompts_cfg(&bad, "q", "sum")).unwrap_err().to_string();
    assert!(e.contains(&format!("{}: row 2: needs a `prompt` or `messages` field", s(&bad))), "{e}");

    // Chat messages as a list of structs become the message objects of a JSONL line.
    let chat = tmp.path().join("chat.parquet");
    let convo = json!([{"role": "user", "content": "1 + 2 ="}, {"role": "assistant", "content": "3"}]);
    write_parquet(&py, &chat, &json!([{"conversation": convo}, {"prompt": "2 + 2 =", "response": "4"}]), "zstd");
    let cols = Columns::new(&[("messages", "messages_key", "conversation")]);
    let lines = SourceLines::read_parquet(s(&chat), &cols).unwrap();
    let objs = lines.objects(&mut DataReport::default());
    assert_eq!(Value::Object(objs[0].1.clone()), json!({"messages": convo}), "null cells are absent fields");
    assert_eq!(Value::Object(objs[1].1.clone()), json!({"prompt": "2 + 2 =", "response": "4"}));

    // SFT with renamed columns; a null response is counted like a JSONL line without one.
    let sft = tmp.path().join("sft.parquet");
    let mut sft_rows: Vec<Value> =
        (1..9).map(|i| json!({"instruction": format!("{i} + 1 ="), "output": format!("{}", i + 1)})).collect();
    sft_rows[2]["output"] = Value::Null;
    write_parquet(&py, &sft, &Value::Array(sft_rows), "snappy");
    let rd = tmp.path().join("sft-run");
    let o = rlhf(&[
        "sft",
        "--run-dir",
        s(&rd),
        "--set",
        &format!("data.train={:?}", s(&sft)),
        "--set",
        "data.prompt_key=\"instruction\"",
        "--set",
        "data.response_key=\"output\"",
        "--set",
        "train.steps=2",
    ]);
    let e = ok(&o);
    assert!(e.contains(&format!("{}: skipped 1 row (missing field `response`), first at row 3", s(&sft))), "{e}");
    assert!(rd.join("model").join("config.json").is_file());

    // RM pairs; a file without the `rejected` column is one clear error.
    let pairs = tmp.path().join("pairs.parquet");
    let pair_rows: Value = (1..9)
        .map(|i| json!({"prompt": format!("{i} + 1 ="), "chosen": format!(" {}", i + 1), "rejected": " 0"}))
        .collect();
    write_parquet(&py, &pairs, &pair_rows, "zstd");
    let rd = tmp.path().join("rm-run");
    let o =
        rlhf(&["rm", "--run-dir", s(&rd), "--set", &format!("data.train={:?}", s(&pairs)), "--set", "train.steps=2"]);
    ok(&o);
    assert!(rd.join("model").join("config.json").is_file());
    let half = tmp.path().join("half.parquet");
    write_parquet(&py, &half, &json!([{"prompt": "1 + 1 =", "chosen": " 2"}]), "snappy");
    let rd = tmp.path().join("rm-bad");
    let e = error_line(&rlhf(&["rm", "--run-dir", s(&rd), "--set", &format!("data.train={:?}", s(&half))]));
    assert!(e.contains(s(&half)) && e.contains("no column `rejected`"), "{e}");
}

/// The ptx data of PPO-ptx reads a Parquet `text` column like its JSONL lines: a one-step run
/// logs `loss/ptx`, and a file without the column is refused naming it.
#[test]
fn ptx_data_reads_parquet() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let texts = json!([
        {"text": "The quick brown fox jumps over the lazy dog."},
        {"text": "3 + 4 = 7"},
        {"text": "Adding numbers: 2 + 2 = 4, and 5 + 1 = 6."}
    ]);
    let ptx = tmp.path().join("ptx.parquet");
    write_parquet(&py, &ptx, &texts, "zstd");
    let run = tmp.path().join("run");
    let o = rlhf(&[
        "train",
        "--algo",
        "ppo",
        "--set",
        "train.steps=1",
        "--set",
        "train.ptx_coef=0.5",
        "--set",
        &format!("train.ptx_data={}", s(&ptx)),
        "--run-dir",
        s(&run),
    ]);
    ok(&o);
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let row: Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!(row["loss/ptx"].as_f64().is_some_and(f64::is_finite), "{row}");

    let wrong = tmp.path().join("wrong.parquet");
    write_parquet(&py, &wrong, &json!([{"body": "no text column here"}]), "snappy");
    let o = rlhf(&[
        "train",
        "--algo",
        "ppo",
        "--set",
        "train.steps=1",
        "--set",
        "train.ptx_coef=0.5",
        "--set",
        &format!("train.ptx_data={}", s(&wrong)),
        "--run-dir",
        s(&tmp.path().join("run2")),
    ]);
    let e = error_line(&o);
    assert!(e.contains(s(&wrong)) && e.contains("no column `text`"), "{e}");
}
