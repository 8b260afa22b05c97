//! Golden runs that hold on every x86-64 kind: a run's discrete outcomes (sampled token ids,
//! counts, rule rewards, steps) are compared exactly, its float metrics and final weights within
//! tolerances measured between CPU kinds and kernel settings (`tests/golden.rs` has the figures).
//!
//! A golden file holds the run's arguments, its metrics rows (timings and memory left out), the
//! token ids it sampled at each step (RL runs, from `run.save_rollouts`), and a summary of every
//! weight tensor of the final model: its sum, sum of absolute values, L2 norm and a few elements
//! at fixed positions.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::{json, Map, Value};

use crate::rlhf_bin;

/// Float metrics: `|got − want| ≤ METRIC_ATOL + METRIC_RTOL · max(|got|, |want|)`.
pub const METRIC_RTOL: f64 = 1e-3;
/// The absolute floor for metrics near zero (a mean advantage of 1e-17 against 0).
pub const METRIC_ATOL: f64 = 1e-6;
/// Discrete metrics: equal but for the last bits of their f64 text (serde_json's default parser
/// is not correctly rounded); a real change of a count moves them by at least 1e-3 relative.
const DISCRETE_RTOL: f64 = 1e-12;
/// Weight summaries: each tensor's sum within `WEIGHT_NORM_RTOL` of its sum of magnitudes, and
/// its L1 and L2 norms within `WEIGHT_NORM_RTOL` relative (Adam turns the rounding noise of a
/// gradient that is zero in exact arithmetic into full steps: see `tests/golden.rs`).
pub const WEIGHT_NORM_RTOL: f64 = 1e-4;
/// Each fixed element within `WEIGHT_ELEMENT_RTOL` of the larger of its magnitude and the
/// tensor's root mean square (Adam scales a tiny gradient up to a full step, so single elements
/// move more than the norms).
pub const WEIGHT_ELEMENT_RTOL: f64 = 1e-3;
/// How many elements at fixed positions each weight summary keeps.
const ELEMENTS: usize = 6;

/// The environment variables that choose CPU kernels: libtorch's dispatch
/// (`ATEN_CPU_CAPABILITY`), MKL's code path (`MKL_CBWR`) and oneDNN's (`ONEDNN_MAX_CPU_ISA`).
/// A golden run starts from none of them set, then applies its [`Kernels`] setting.
pub const KERNEL_VARS: [&str; 3] = ["ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"];

/// One kernel setting: each stands in for a CPU kind this machine is not.
#[derive(Debug, Clone, Copy)]
pub struct Kernels {
    pub name: &'static str,
    pub env: &'static [(&'static str, &'static str)],
    /// A `/proc/cpuinfo` flag the CPU must have for the setting to exist.
    pub needs: Option<&'static str>,
}

/// Every setting the golden runs must pass under (`RLHF_GOLDEN_KERNELS=all`).
pub const KERNELS: [Kernels; 5] = [
    Kernels { name: "native", env: &[], needs: None },
    Kernels {
        name: "portable",
        env: &[("ATEN_CPU_CAPABILITY", "default"), ("MKL_CBWR", "COMPATIBLE"), ("ONEDNN_MAX_CPU_ISA", "SSE41")],
        needs: None,
    },
    Kernels { name: "aten-avx2", env: &[("ATEN_CPU_CAPABILITY", "avx2")], needs: Some("avx2") },
    Kernels { name: "aten-avx512", env: &[("ATEN_CPU_CAPABILITY", "avx512")], needs: Some("avx512f") },
    Kernels { name: "mkl-compatible", env: &[("MKL_CBWR", "COMPATIBLE")], needs: None },
];

/// The settings of `RLHF_GOLDEN_KERNELS` (a comma-separated list of [`KERNELS`] names, or `all`,
/// the default), less those this CPU cannot run.
pub fn selected_kernels() -> Vec<Kernels> {
    let spec = std::env::var("RLHF_GOLDEN_KERNELS").unwrap_or_else(|_| "all".into());
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |flag: &str| {
        flags.lines().find(|l| l.starts_with("flags")).is_some_and(|l| l.split_whitespace().any(|f| f == flag))
    };
    let wanted: Vec<&str> = spec.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    for name in &wanted {
        assert!(
            *name == "all" || KERNELS.iter().any(|k| k.name == *name),
            "RLHF_GOLDEN_KERNELS: unknown setting `{name}` (known: all, {})",
            KERNELS.map(|k| k.name).join(", ")
        );
    }
    KERNELS
        .into_iter()
        .filter(|k| wanted.contains(&"all") || wanted.contains(&k.name))
        .filter(|k| k.needs.is_none_or(has))
        .collect()
}

/// Whether a metric is discrete, so compared exactly: steps and epochs, counts, the learning rate
/// (a schedule of the step), and everything computed from rule rewards and accuracies in f64 on
/// the host (the same bits on every machine as long as the sampled tokens are the same).
pub fn is_discrete(key: &str) -> bool {
    const EXACT: [&str; 12] = [
        "step",
        "epoch",
        "skipped_steps",
        "reward",
        "reward_std",
        "lr",
        "lr/critic",
        "grpo/num_groups",
        "grpo/frac_zero_std_groups",
        "eval/tokens",
        "eval/accuracy",
        "train/accuracy",
    ];
    EXACT.contains(&key) || ["completions/", "rewards/", "reward_rules/"].iter().any(|p| key.starts_with(p))
}

/// Runs `rlhf ARGS --run-dir DIR` on one intra-op thread under `kernels` and returns what a
/// golden file holds. `model_sub` is the final model's directory in the run (`actor`, `model`).
/// RL runs (`train`) also write their samples (`run.save_rollouts`, which changes no number).
pub fn capture(args: &[&str], model_sub: &str, kernels: &Kernels) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let rl = args.first() == Some(&"train");
    let mut command = Command::new(rlhf_bin());
    command.args(args);
    if rl {
        command.args(["--set", "run.save_rollouts=true"]);
    }
    for var in KERNEL_VARS {
        command.env_remove(var);
    }
    let o = command
        .args(["--run-dir", run_dir.to_str().unwrap()])
        .env("OMP_NUM_THREADS", "1")
        .envs(kernels.env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .expect("spawn rlhf");
    assert!(o.status.success(), "rlhf {args:?} ({}): {}", kernels.name, String::from_utf8_lossy(&o.stderr));
    let rows: Vec<Value> = crate::behaviour_metrics(&run_dir).into_iter().map(Value::Object).collect();
    let mut got = json!({ "args": args, "metrics": rows });
    if rl {
        // Training steps only: a held-out evaluation before training is a row of step 0.
        let steps = rows.iter().filter_map(|r| r["step"].as_u64()).filter(|&s| s > 0);
        got["samples"] = json!(steps.map(|step| samples(&run_dir, step as usize)).collect::<Vec<_>>());
    }
    got["weights"] = weight_summaries(&run_dir.join(model_sub).join("model.safetensors"));
    got
}

/// Step `step`'s sampled completions as one line: `group:id id id|group:id id|…` in row order.
fn samples(run_dir: &Path, step: usize) -> String {
    let path = run_dir.join("rollouts").join(format!("step-{step}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows: Vec<String> = text
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let ids: Vec<String> =
                v["completion_ids"].as_array().unwrap().iter().map(|i| i.as_i64().unwrap().to_string()).collect();
            format!("{}:{}", v["group"], ids.join(" "))
        })
        .collect();
    rows.join("|")
}

/// Per tensor of a safetensors file: `numel`, `sum`, `abs_sum`, `l2` (accumulated in f64 in file order, so
/// the summary itself is the same on every machine) and [`ELEMENTS`] elements at fixed positions.
fn weight_summaries(path: &Path) -> Value {
    let tensors = tch::Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Map::new();
    for (name, t) in tensors {
        let flat = t.to_kind(tch::Kind::Double).flatten(0, -1);
        let v = Vec::<f64>::try_from(&flat).unwrap();
        let n = v.len();
        let elements: Vec<f64> =
            if n == 0 { Vec::new() } else { (0..ELEMENTS).map(|i| v[i * (n - 1) / (ELEMENTS - 1)]).collect() };
        out.insert(
            name,
            json!({
                "numel": n,
                "sum": v.iter().sum::<f64>(),
                "abs_sum": v.iter().map(|x| x.abs()).sum::<f64>(),
                "l2": v.iter().map(|x| x * x).sum::<f64>().sqrt(),
                "elements": elements,
            }),
        );
    }
    Value::Object(out)
}

/// `|a − b| ≤ atol + rtol · max(|a|, |b|)`.
fn close(a: f64, b: f64, rtol: f64, atol: f64) -> bool {
    (a - b).abs() <= atol + rtol * a.abs().max(b.abs())
}

/// Everything in which `got` differs from `want` beyond the tolerances, one line each (empty
/// when they agree). The arguments must be equal unless `ignore_args` (a perturbed run).
pub fn compare(got: &Value, want: &Value, ignore_args: bool) -> Vec<String> {
    let mut bad = Vec::new();
    if !ignore_args && got["args"] != want["args"] {
        bad.push(format!("recorded with other arguments: {} (now {})", want["args"], got["args"]));
    }
    compare_samples(got, want, &mut bad);
    compare_metrics(got, want, &mut bad);
    compare_weights(got, want, &mut bad);
    bad
}

/// Sampled token ids: exactly, step by step; the first step that differs is reported.
fn compare_samples(got: &Value, want: &Value, bad: &mut Vec<String>) {
    let (Some(g), Some(w)) = (got["samples"].as_array(), want["samples"].as_array()) else {
        if got["samples"] != want["samples"] {
            bad.push("one run has sampled tokens, the other has none".into());
        }
        return;
    };
    if let Some(step) = (0..g.len().max(w.len())).find(|&i| g.get(i) != w.get(i)) {
        let rows = |v: Option<&Value>| {
            v.and_then(Value::as_str).unwrap_or("").split('|').map(String::from).collect::<Vec<_>>()
        };
        let (gr, wr) = (rows(g.get(step)), rows(w.get(step)));
        let row = (0..gr.len().max(wr.len())).find(|&r| gr.get(r) != wr.get(r)).unwrap_or(0);
        bad.push(format!(
            "step {}: sampled tokens differ from row {row} on: {} (recorded {})",
            step + 1,
            gr.get(row).map_or("none", String::as_str),
            wr.get(row).map_or("none", String::as_str)
        ));
    }
}

/// Metrics rows: the same rows and keys; discrete ones exactly, floats within the tolerance.
fn compare_metrics(got: &Value, want: &Value, bad: &mut Vec<String>) {
    let (Some(g), Some(w)) = (got["metrics"].as_array(), want["metrics"].as_array()) else {
        bad.push("no metrics rows in one of the files".into());
        return;
    };
    if g.len() != w.len() {
        bad.push(format!("{} metrics rows, recorded {}", g.len(), w.len()));
    }
    for (g, w) in g.iter().zip(w) {
        let (Some(g), Some(w)) = (g.as_object(), w.as_object()) else {
            bad.push(format!("a metrics row is not an object: {g} (recorded {w})"));
            continue;
        };
        let step = &w["step"];
        for (k, wv) in w {
            let Some(gv) = g.get(k) else {
                bad.push(format!("step {step}: `{k}` is missing"));
                continue;
            };
            let ok = match (gv.as_f64(), wv.as_f64()) {
                (Some(a), Some(b)) if is_discrete(k) => close(a, b, DISCRETE_RTOL, 0.0),
                (Some(a), Some(b)) => close(a, b, METRIC_RTOL, METRIC_ATOL),
                _ => gv == wv,
            };
            if !ok {
                let how = if is_discrete(k) { "exactly" } else { "within tolerance" };
                bad.push(format!("step {step}: `{k}` = {gv}, recorded {wv} (compared {how})"));
            }
        }
        for k in g.keys().filter(|k| !w.contains_key(*k)) {
            bad.push(format!("step {step}: new metric `{k}`"));
        }
    }
}

/// Weight summaries: the same tensors, each summary within [`WEIGHT_NORM_RTOL`] and
/// [`WEIGHT_ELEMENT_RTOL`].
fn compare_weights(got: &Value, want: &Value, bad: &mut Vec<String>) {
    let (Some(g), Some(w)) = (got["weights"].as_object(), want["weights"].as_object()) else {
        bad.push("no weight summaries in one of the files (recorded before they existed? re-record)".into());
        return;
    };
    let names = |m: &Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
    if names(g) != names(w) {
        bad.push(format!("weight tensors {:?}, recorded {:?}", names(g), names(w)));
        return;
    }
    for (name, ws) in w {
        let gs = &g[name];
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let (l1, l2) = (f(ws, "abs_sum"), f(ws, "l2"));
        let empty = Vec::new();
        let (ge, we) = (gs["elements"].as_array().unwrap_or(&empty), ws["elements"].as_array().unwrap_or(&empty));
        let rms = l2 / f(ws, "numel").max(1.0).sqrt();
        let mut off = Vec::new();
        if gs["numel"] != ws["numel"] {
            off.push(format!("{} elements (recorded {})", gs["numel"], ws["numel"]));
        }
        if !close(f(gs, "sum"), f(ws, "sum"), 0.0, WEIGHT_NORM_RTOL * l1) {
            off.push(format!("sum {} (recorded {})", gs["sum"], ws["sum"]));
        }
        for k in ["abs_sum", "l2"] {
            if !close(f(gs, k), f(ws, k), WEIGHT_NORM_RTOL, 0.0) {
                off.push(format!("{k} {} (recorded {})", gs[k], ws[k]));
            }
        }
        for (i, (a, b)) in ge.iter().zip(we).enumerate() {
            let (a, b) = (a.as_f64().unwrap_or(f64::NAN), b.as_f64().unwrap_or(f64::NAN));
            if ge.len() != we.len() || !close(a, b, WEIGHT_ELEMENT_RTOL, WEIGHT_ELEMENT_RTOL * rms) {
                off.push(format!("element {i} {a} (recorded {b})"));
            }
        }
        if !off.is_empty() {
            bad.push(format!("weights `{name}`: {}", off.join(", ")));
        }
    }
}

/// What changed between an old golden file and a new run, per metric (the step of the largest
/// relative change, old → new), per sampled step and for the weights: printed when re-recording
/// so a reviewer sees what moved.
pub fn changes(old: &Value, new: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if old["args"] != new["args"] {
        out.push(format!("args: {} -> {}", old["args"], new["args"]));
    }
    let mut samples = Vec::new();
    compare_samples(new, old, &mut samples);
    out.extend(samples);
    // key -> (largest relative change, step, old, new, steps changed)
    let mut per_key: BTreeMap<String, (f64, Value, Value, Value, usize)> = BTreeMap::new();
    let empty = Vec::new();
    let new_rows = new["metrics"].as_array().unwrap_or(&empty);
    for o in old["metrics"].as_array().unwrap_or(&empty) {
        // Rows are matched by step, so a row added before the others shifts nothing.
        let n = new_rows.iter().find(|n| n["step"] == o["step"]).unwrap_or(&Value::Null);
        let (Some(o), Some(n)) = (o.as_object(), n.as_object()) else {
            out.push(format!("step {}: no such row in the new run", o["step"]));
            continue;
        };
        for (k, ov) in o {
            let nv = n.get(k).cloned().unwrap_or(Value::Null);
            if *ov == nv {
                continue;
            }
            let rel = match (ov.as_f64(), nv.as_f64()) {
                (Some(a), Some(b)) => (a - b).abs() / a.abs().max(b.abs()).max(f64::MIN_POSITIVE),
                _ => f64::INFINITY,
            };
            let e = per_key.entry(k.clone()).or_insert((-1.0, Value::Null, Value::Null, Value::Null, 0));
            e.4 += 1;
            if rel > e.0 {
                (e.0, e.1, e.2, e.3) = (rel, o["step"].clone(), ov.clone(), nv);
            }
        }
    }
    for (k, (rel, step, o, n, count)) in per_key {
        out.push(format!("`{k}`: {count} step(s) changed; largest at step {step}: {o} -> {n} (relative {rel:.2e})"));
    }
    out.push(weight_changes(old, new));
    out
}

/// The largest relative change of a weight summary between two golden files, as one line.
fn weight_changes(old: &Value, new: &Value) -> String {
    let (Some(o), Some(n)) = (old["weights"].as_object(), new["weights"].as_object()) else {
        return "weights: no summary in the old file".into();
    };
    let mut largest = (0.0f64, String::new());
    for (name, os) in o {
        let Some(ns) = n.get(name) else { return format!("weights: `{name}` is gone") };
        let rms = os["l2"].as_f64().unwrap_or(0.0) / os["numel"].as_f64().unwrap_or(1.0).max(1.0).sqrt();
        let pairs = ["abs_sum", "l2"].map(|k| (os[k].as_f64().unwrap_or(0.0), ns[k].as_f64().unwrap_or(0.0), 0.0));
        let elements =
            os["elements"].as_array().into_iter().flatten().zip(ns["elements"].as_array().into_iter().flatten());
        let elements = elements.map(|(a, b)| (a.as_f64().unwrap_or(0.0), b.as_f64().unwrap_or(0.0), rms));
        for (a, b, floor) in pairs.into_iter().chain(elements) {
            let rel = (a - b).abs() / a.abs().max(b.abs()).max(floor).max(f64::MIN_POSITIVE);
            if rel > largest.0 {
                largest = (rel, name.clone());
            }
        }
    }
    if largest.0 == 0.0 {
        "weights: unchanged".into()
    } else {
        format!("weights: largest relative change of a summary {:.2e} (`{}`)", largest.0, largest.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(loss: f64, reward: f64, samples: &str, w0: f64) -> Value {
        json!({
            "args": ["train"],
            "metrics": [{"step": 1, "loss/total": loss, "reward": reward, "grpo/advantages_mean": 1e-17}],
            "samples": [samples],
            "weights": {"w": {"numel": 4, "sum": w0 + 3.0, "abs_sum": w0.abs() + 3.0,
                              "l2": (w0 * w0 + 3.0).sqrt(), "elements": [w0, 1.0, 1.0, 1.0]}},
        })
    }

    #[test]
    fn floats_within_tolerance_discrete_values_exactly() {
        let want = file(0.5, 0.25, "0:5 7|0:5", 0.5);
        assert!(compare(&want, &want, false).is_empty());
        // A float metric a few roundings off, a mean near zero against exactly zero, a weight one
        // part in a million off: the same run.
        let mut near = file(0.5 * (1.0 + 1e-6), 0.25, "0:5 7|0:5", 0.5 * (1.0 + 1e-6));
        near["metrics"][0]["grpo/advantages_mean"] = json!(0.0);
        assert_eq!(compare(&near, &want, false), Vec::<String>::new());
        // Beyond the tolerance, or any change of a discrete value: reported, each on its own line.
        let far = file(0.5 * (1.0 + 2e-3), 0.25 + 1e-12, "0:5 8|0:5", 0.5 * (1.0 + 1e-3));
        let bad = compare(&far, &want, false);
        assert_eq!(bad.len(), 4, "{bad:#?}");
        assert!(bad[0].starts_with("step 1: sampled tokens differ from row 0 on: 0:5 8 (recorded 0:5 7)"), "{bad:?}");
        assert!(bad.iter().any(|l| l.contains("`loss/total`") && l.contains("within tolerance")), "{bad:?}");
        assert!(bad.iter().any(|l| l.contains("`reward`") && l.contains("exactly")), "{bad:?}");
        assert!(bad.iter().any(|l| l.starts_with("weights `w`: sum")), "{bad:?}");
        let mut other_args = want.clone();
        other_args["args"] = json!(["sft"]);
        assert_eq!(compare(&other_args, &want, false).len(), 1);
        assert!(compare(&other_args, &want, true).is_empty());
    }

    #[test]
    fn changes_name_each_metric_that_moved() {
        let old = file(0.5, 0.25, "0:5", 0.5);
        let new = file(0.5 * (1.0 + 1e-6), 0.25, "0:5", 0.5);
        let lines = changes(&old, &new);
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert!(
            lines[0].starts_with("`loss/total`: 1 step(s) changed; largest at step 1: 0.5 -> 0.5000005"),
            "{lines:?}"
        );
        assert_eq!(lines[1], "weights: unchanged");
    }

    #[test]
    fn discrete_metrics() {
        for k in ["step", "reward", "completions/mean_length", "rewards/accuracy/std", "reward_rules/score", "lr"] {
            assert!(is_discrete(k), "{k}");
        }
        for k in ["loss/total", "kl", "entropy", "grad_norm/actor", "grpo/reward_std", "eval/loss"] {
            assert!(!is_discrete(k), "{k}");
        }
    }
}
