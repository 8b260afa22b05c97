//! The doctor's checks: what each runs (an `rlhf` command in a child process) and how its output
//! becomes a pass or a fail with figures.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Map, Value};

use rlhf_trainer::random_qwen2::{write_qwen2, Qwen2Shape};

use super::runner::{last_error, run_rlhf, Exit};

/// The least reward gain (mean of the last 10 % of steps minus the first 10 %) the GRPO preset must
/// show in its 300 steps. On CPUs (f32) and on an H200 (f32 and bf16) it gains 0.45–0.55 from
/// about 0.23; a run that does not learn stays within ±0.1.
pub const GAIN_MIN: f64 = 0.25;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub name: String,
    pub device: String,
    pub status: Status,
    pub seconds: f64,
    /// One line: the figures that matter, or what went wrong.
    pub summary: String,
    pub figures: Map<String, Value>,
    /// The check's log, relative to the report's directory.
    pub log: Option<String>,
}

/// Where a model under test comes from.
#[derive(Debug, Clone)]
pub enum Model {
    /// A Hugging Face directory (the fixture models).
    Dir(PathBuf),
    /// A built-in model `rlhf` writes itself (`tiny-qwen3`, `tiny-qwen3-moe`, `tiny-qwen3.5`).
    Builtin(&'static str),
}

/// What a check does.
#[derive(Debug, Clone)]
pub enum What {
    /// `rlhf check-device` of one model in one dtype against the CPU in f32.
    CheckDevice { model: Model, dtype: &'static str },
    /// The GRPO preset (300 steps) on the device; it must learn.
    Grpo { dtype: &'static str },
    /// The GRPO preset at ZeRO stage 3 on one process for 30 steps.
    Zero3,
    /// SFT (50 steps), then reward-model training (100 steps) starting from the SFT model.
    SftRm,
    /// The GEMM peak and copy bandwidth of the device.
    Peak { dtype: &'static str },
    /// One GRPO step of a random Qwen2, beside TRL's when `trl` names a Python.
    Step(StepSpec),
    /// Graph decode against eager decode of every family, token for token (`rlhf check-graphs`).
    Graphs { dtype: &'static str },
    /// Two ranks on two GPUs over NCCL.
    Nccl,
}

/// The model and batch of the `step` check.
#[derive(Debug, Clone)]
pub struct StepSpec {
    pub shape: Qwen2Shape,
    pub dtype: &'static str,
    pub batch: i64,
    pub group: i64,
    pub prompt: i64,
    pub new: i64,
    pub trl: Option<PathBuf>,
}

/// A planned check.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub device: String,
    pub what: What,
    pub timeout: Duration,
}

impl Check {
    /// A file-name-safe id: `grpo-bf16-cuda0`.
    pub fn id(&self) -> String {
        let raw = format!("{}-{}", self.name, self.device);
        raw.chars()
            .filter_map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    Some(c)
                } else if c == ' ' {
                    Some('-')
                } else {
                    None
                }
            })
            .collect()
    }
}

/// What checks share while they run: where logs and work files go, and the first-step rewards
/// of the stage-0 GRPO runs by device (which the stage-3 run must repeat).
pub struct Ctx {
    pub out: PathBuf,
    pub work: PathBuf,
    /// `--fixtures`, where the fixture models are looked for.
    pub fixtures: Option<PathBuf>,
    pub first_reward: BTreeMap<String, f64>,
}

/// `--set key=value` with `value` written as TOML (a string quoted, a number as is).
fn set(key: &str, value: impl Into<Value>) -> [String; 2] {
    ["--set".to_string(), format!("{key}={}", value.into())]
}

fn strings(xs: &[&str]) -> Vec<String> {
    xs.iter().map(|s| s.to_string()).collect()
}

/// Runs `check` and says how it went.
pub fn run(ctx: &mut Ctx, check: &Check) -> Outcome {
    let start = Instant::now();
    let log_name = format!("logs/{}.log", check.id());
    let log = ctx.out.join(&log_name);
    let _ = std::fs::remove_file(&log);
    let result = match &check.what {
        What::CheckDevice { model, dtype } => check_device(ctx, check, model, dtype, &log),
        What::Grpo { dtype } => grpo(ctx, check, dtype, &log),
        What::Zero3 => zero3(ctx, check, &log),
        What::SftRm => sft_rm(ctx, check, &log),
        What::Peak { dtype } => peak(check, dtype, &log),
        What::Step(spec) => step(ctx, check, spec, &log),
        What::Graphs { dtype } => graphs(ctx, check, dtype, &log),
        What::Nccl => nccl(ctx, check, &log),
    };
    let (status, summary, figures) = match result {
        Ok((summary, figures)) => (Status::Pass, summary, figures),
        Err(Failure { summary, figures }) => (Status::Fail, summary, figures),
    };
    Outcome {
        name: check.name.clone(),
        device: check.device.clone(),
        status,
        seconds: start.elapsed().as_secs_f64(),
        summary,
        figures,
        log: log.is_file().then_some(log_name),
    }
}

/// A failed check: what went wrong, and whatever figures were read before.
pub struct Failure {
    pub summary: String,
    pub figures: Map<String, Value>,
}

type Done = Result<(String, Map<String, Value>), Failure>;

fn fail(summary: impl Into<String>) -> Failure {
    Failure { summary: summary.into(), figures: Map::new() }
}

/// Runs `args` for `check`; an exit other than 0 becomes the failure naming the log's last error.
fn exec(check: &Check, args: &[String], log: &Path) -> Result<(), Failure> {
    let done = run_rlhf(args, log, check.timeout);
    match done.exit {
        Exit::Ok => Ok(()),
        Exit::TimedOut => Err(fail(format!("timed out after {:.0} s: {}", done.seconds, last_error(log)))),
        Exit::Failed(code) => Err(fail(format!(
            "exit {}: {}",
            code.map_or("by a signal".to_string(), |c| c.to_string()),
            last_error(log)
        ))),
        Exit::NotStarted(why) => Err(fail(why)),
        Exit::Stopped(sig) => Err(fail(format!("stopped by {}", rlhf_trainer::signals::name(sig)))),
    }
}

/// The last line of `log` that parses as a JSON object holding `key`.
fn json_line(log: &Path, key: &str) -> Option<Value> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .rev()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v.get(key).is_some())
}

/// The directory of `model`, writing a built-in one into the work directory first.
fn model_dir(ctx: &Ctx, model: &Model) -> Result<PathBuf, Failure> {
    Ok(match model {
        Model::Dir(d) => d.clone(),
        Model::Builtin(name) => {
            let dir = ctx.work.join("models").join(name);
            if !dir.join("config.json").is_file() {
                rlhf_trainer::builtin_models::write_model(name, &dir, 0)
                    .map_err(|e| fail(format!("writing builtin:{name}: {e}")))?;
            }
            dir
        }
    })
}

/// `rlhf check-graphs` on every family the doctor has (the fixtures when found, the built-in
/// Qwen3, Qwen3-MoE and Qwen3.5): graph decode must sample what eager decode samples (a model
/// whose step cannot be captured decodes eagerly both ways, and says why).
fn graphs(ctx: &Ctx, check: &Check, dtype: &str, log: &Path) -> Done {
    let mut models = Vec::new();
    if let Some(dir) = super::fixtures_dir(ctx.fixtures.as_deref()) {
        models.extend(super::FIXTURE_FAMILIES.iter().map(|f| dir.join(f)));
    }
    for (_, builtin) in super::BUILTIN_FAMILIES {
        models.push(model_dir(ctx, &Model::Builtin(builtin))?);
    }
    let list = models.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(",");
    let args =
        [strings(&["check-graphs", "--models", &list, "--device", &check.device, "--dtype", dtype, "--json"])].concat();
    exec(check, &args, log)?;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).collect();
    let mut figures = Map::new();
    let mut parts = Vec::new();
    for v in lines.iter().filter(|v| v.get("checks").is_some()) {
        let name = v["model"].as_str().unwrap_or("?").to_string();
        let (mut same, mut total, mut replays) = (0, 0, 0);
        for c in v["checks"].as_object().into_iter().flat_map(|m| m.values()) {
            same += c["equal"].as_i64().unwrap_or(0);
            total += c["total"].as_i64().unwrap_or(0);
            replays += c["replays"].as_i64().unwrap_or(0);
        }
        let how = match v["eager_because"].as_str() {
            Some(_) => "eager (cannot be captured)".to_string(),
            None => format!("{replays} replays"),
        };
        parts.push(format!("{name} {same}/{total} ({how})"));
        figures.insert(name, json!({"equal": same, "total": total, "replays": replays}));
    }
    Ok((format!("graph decode = eager decode, tokens equal: {}", parts.join(", ")), figures))
}

fn check_device(ctx: &Ctx, check: &Check, model: &Model, dtype: &str, log: &Path) -> Done {
    let dir = model_dir(ctx, model)?;
    let args = [
        strings(&["check-device", "--model"]),
        vec![dir.display().to_string()],
        strings(&["--device", &check.device, "--dtype", dtype, "--json"]),
    ]
    .concat();
    exec(check, &args, log)?;
    let v = json_line(log, "relative").ok_or_else(|| fail("no figures in the output"))?;
    let f = |k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    let mut figures = Map::new();
    for k in ["relative", "tolerance", "same_top", "positions", "greedy_equal", "greedy_total"] {
        figures.insert(k.to_string(), f(k));
    }
    Ok((
        format!(
            "max |Δlogit| {:.2e} of the largest (tolerance {}); top token {}/{}; greedy {}/{}",
            f("relative").as_f64().unwrap_or(f64::NAN),
            f("tolerance"),
            f("same_top"),
            f("positions"),
            f("greedy_equal"),
            f("greedy_total")
        ),
        figures,
    ))
}

/// The rewards of a run's training steps, in step order (from its `metrics.jsonl`).
pub fn rewards(run_dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v.get("reward")?.as_f64())
        .collect()
}

/// The first and the last `eval/loss` of a run (its held-out loss before and after training).
fn eval_loss_ends(run_dir: &Path) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).ok()?;
    let losses: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v.get("eval/loss")?.as_f64())
        .collect();
    Some((*losses.first()?, *losses.last()?))
}

/// Mean of the first and the last 10 % of `xs` (at least one each).
pub fn ends(xs: &[f64]) -> (f64, f64) {
    let k = (xs.len() / 10).max(1).min(xs.len().max(1));
    let mean = |s: &[f64]| if s.is_empty() { f64::NAN } else { s.iter().sum::<f64>() / s.len() as f64 };
    (mean(&xs[..k.min(xs.len())]), mean(&xs[xs.len().saturating_sub(k)..]))
}

/// The median `step_time` of a run.
fn median_step(run_dir: &Path) -> f64 {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    let mut t: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v.get("step_time")?.as_f64())
        .collect();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

fn train_args(check: &Check, run_dir: &Path, extra: &[[String; 2]]) -> Vec<String> {
    let mut args = strings(&["train", "--algo", "grpo", "--run-dir"]);
    args.push(run_dir.display().to_string());
    args.extend(set("run.device", check.device.as_str()));
    for pair in extra {
        args.extend(pair.iter().cloned());
    }
    args
}

fn grpo(ctx: &mut Ctx, check: &Check, dtype: &str, log: &Path) -> Done {
    let run_dir = ctx.work.join(check.id());
    let _ = std::fs::remove_dir_all(&run_dir);
    exec(check, &train_args(check, &run_dir, &[set("run.dtype", dtype)]), log)?;
    let r = rewards(&run_dir);
    let (first, last) = ends(&r);
    let median = median_step(&run_dir);
    if dtype == "f32" {
        if let Some(&x) = r.first() {
            ctx.first_reward.insert(check.device.clone(), x);
        }
    }
    let figures = Map::from_iter([
        ("steps".to_string(), json!(r.len())),
        ("reward_first".to_string(), json!(first)),
        ("reward_last".to_string(), json!(last)),
        ("gain".to_string(), json!(last - first)),
        ("median_step_s".to_string(), json!(median)),
    ]);
    let text = format!(
        "reward {first:.3} → {last:.3} over {} steps (gain {:.3}; at least {GAIN_MIN} needed); median step {median:.3} s",
        r.len(),
        last - first,
    );
    if r.len() < 10 || r.iter().any(|x| !x.is_finite()) || (last - first).is_nan() || last - first < GAIN_MIN {
        return Err(Failure { summary: format!("did not learn: {text}"), figures });
    }
    Ok((text, figures))
}

fn zero3(ctx: &Ctx, check: &Check, log: &Path) -> Done {
    let run_dir = ctx.work.join(check.id());
    let _ = std::fs::remove_dir_all(&run_dir);
    let extra = [set("train.steps", 30), set("distributed.zero_stage", 3)];
    exec(check, &train_args(check, &run_dir, &extra), log)?;
    let r = rewards(&run_dir);
    let mut figures = Map::from_iter([("steps".to_string(), json!(r.len()))]);
    if r.len() != 30 || r.iter().any(|x| !x.is_finite()) {
        return Err(Failure { summary: format!("{} finite step rewards of 30", r.len()), figures });
    }
    let (first, last) = ends(&r);
    figures.insert("reward_first".into(), json!(first));
    figures.insert("reward_last".into(), json!(last));
    match ctx.first_reward.get(&check.device) {
        // Before the first update both runs hold the same weights and draw the same samples.
        Some(&stage0) if (r[0] - stage0).abs() > 1e-6 => Err(Failure {
            summary: format!("step 1 reward {:.4} differs from stage 0's {stage0:.4} on the same weights", r[0]),
            figures,
        }),
        Some(_) => Ok((format!("30 steps, reward {first:.3} → {last:.3}; step 1 equals stage 0's"), figures)),
        None => Ok((format!("30 steps, reward {first:.3} → {last:.3}"), figures)),
    }
}

/// `before X, after Y` of a phase's closing line `label: before X, after Y (...)`.
pub fn before_after(log: &Path, label: &str) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(log).ok()?;
    let rest = text.lines().rev().find_map(|l| l.strip_prefix(label))?;
    let rest = rest.trim_start().strip_prefix("before ")?;
    let (before, rest) = rest.split_once(", after ")?;
    let after = rest.split_whitespace().next()?;
    Some((before.trim().parse().ok()?, after.trim_end_matches(',').parse().ok()?))
}

fn sft_rm(ctx: &Ctx, check: &Check, log: &Path) -> Done {
    let sft_dir = ctx.work.join(format!("{}-sft", check.id()));
    let rm_dir = ctx.work.join(format!("{}-rm", check.id()));
    for d in [&sft_dir, &rm_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
    let device = set("run.device", check.device.as_str());
    let mut sft = strings(&["sft", "--set", "train.steps=50", "--run-dir"]);
    sft.push(sft_dir.display().to_string());
    sft.extend(device.iter().cloned());
    exec(check, &sft, log)?;
    let ppl = before_after(log, "eval perplexity:").ok_or_else(|| fail("no perplexity in the SFT output"))?;
    let mut rm = strings(&["rm", "--set", "train.steps=100", "--run-dir"]);
    rm.push(rm_dir.display().to_string());
    rm.extend(device.iter().cloned());
    rm.extend(set("model.path", sft_dir.join("model").display().to_string()));
    exec(check, &rm, log)?;
    let acc = before_after(log, "eval accuracy:").ok_or_else(|| fail("no accuracy in the RM output"))?;
    let loss = eval_loss_ends(&rm_dir).ok_or_else(|| fail("no eval/loss in the RM metrics"))?;
    let figures = Map::from_iter([
        ("sft_ppl_before".to_string(), json!(ppl.0)),
        ("sft_ppl_after".to_string(), json!(ppl.1)),
        ("rm_loss_before".to_string(), json!(loss.0)),
        ("rm_loss_after".to_string(), json!(loss.1)),
        ("rm_accuracy_before".to_string(), json!(acc.0)),
        ("rm_accuracy_after".to_string(), json!(acc.1)),
    ]);
    let text = format!(
        "SFT held-out perplexity {:.2} → {:.2} (50 steps); RM from it, held-out loss {:.3} → {:.3}, accuracy \
         {:.3} → {:.3} (100 steps)",
        ppl.0, ppl.1, loss.0, loss.1, acc.0, acc.1
    );
    // The reward model learns when its held-out pairwise loss falls by a tenth and its accuracy ends
    // above 0.6. Not "accuracy rises": the fresh score head's accuracy on the 242 held-out pairs
    // depends on its random draw (0.27–0.69 over seeds 1–4 and the default), and from the high
    // draws a run that learns can end a few pairs lower (the default seed: 0.690 → 0.653 with the
    // loss falling 0.63 → 0.35; the other seeds end at 0.76–0.87).
    if ppl.1 < ppl.0 && loss.1 < 0.9 * loss.0 && acc.1 > 0.6 {
        Ok((text, figures))
    } else {
        Err(Failure { summary: format!("did not learn: {text}"), figures })
    }
}

fn bench_args(check: &Check, model: &str, dtype: &str) -> Vec<String> {
    strings(&["bench", "--model", model, "--device", &check.device, "--dtype", dtype, "--json", "--no-record"])
}

fn peak(check: &Check, dtype: &str, log: &Path) -> Done {
    let args = [bench_args(check, "builtin:tiny", dtype), strings(&["--only", "gen", "--repeats", "1"])].concat();
    exec(check, &args, log)?;
    let m = json_line(log, "machine").and_then(|v| v.get("machine").cloned()).ok_or_else(|| fail("no figures"))?;
    let (gemm, copy) = (m["gemm_tflops"].as_f64().unwrap_or(f64::NAN), m["copy_gbps"].as_f64().unwrap_or(f64::NAN));
    let figures = Map::from_iter([("gemm_tflops".to_string(), json!(gemm)), ("copy_gbps".to_string(), json!(copy))]);
    Ok((format!("{dtype} GEMM {gemm:.1} TFLOP/s, memory copy {copy:.0} GB/s (read + write)"), figures))
}

fn step(ctx: &Ctx, check: &Check, spec: &StepSpec, log: &Path) -> Done {
    let StepSpec { shape, dtype, batch, group, prompt, new, trl } = spec;
    let dir = ctx.work.join("models").join(format!("qwen2-random-{}", shape.params()));
    let kind = if *dtype == "bf16" { tch::Kind::BFloat16 } else { tch::Kind::Float };
    if !dir.join("config.json").is_file() {
        write_qwen2(&dir, shape, kind, 0).map_err(|e| fail(format!("writing the random Qwen2: {e}")))?;
    }
    let mut args = bench_args(check, &dir.display().to_string(), dtype);
    for (k, v) in [("--batch", batch), ("-g", group), ("--prompt-len", prompt), ("--new-tokens", new)] {
        args.extend([k.to_string(), v.to_string()]);
    }
    // Decode steps by batch: one sequence, the step's batch, and four times it.
    let rows = batch * group;
    args.extend(strings(&["--only", "gen,train,rl,decode", "--decode-batches"]));
    args.push(format!("1,{rows},{}", 4 * rows));
    let mut trl_note = None;
    match trl {
        Some(py) => {
            let with = [args.clone(), strings(&["--vs-trl", "--python"]), vec![py.display().to_string()]].concat();
            if let Err(f) = exec(check, &with, log) {
                // Our step is measured again without TRL; TRL's failure is reported beside it.
                trl_note = Some(format!("TRL failed: {}", f.summary));
                exec(check, &args, log)?;
            }
        }
        None => exec(check, &args, log)?,
    }
    let v = json_line(log, "rl").ok_or_else(|| fail("no figures in the bench output"))?;
    let num = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let figures = Map::from_iter([
        ("params".to_string(), json!(shape.params())),
        ("step_s".to_string(), json!(num("/rl/figures/step_s"))),
        ("generate_s".to_string(), json!(num("/rl/figures/generate"))),
        ("train_mfu".to_string(), json!(num("/train/mfu"))),
        ("decode_tokens_per_s".to_string(), json!(num("/gen/tokens_per_s"))),
        ("decode_bandwidth_fraction".to_string(), json!(num("/gen/hbm_fraction"))),
        ("decode".to_string(), v.get("decode").cloned().unwrap_or(Value::Null)),
        ("trl_step_s".to_string(), v.pointer("/trl/step_s").cloned().unwrap_or(Value::Null)),
        ("vs_trl".to_string(), v.get("vs_trl").cloned().unwrap_or(Value::Null)),
    ]);
    let trl_text = match (v.get("vs_trl").and_then(Value::as_f64), trl_note, trl) {
        (Some(x), _, _) => format!("TRL {:.2} s, ours {x:.2}x faster", num("/trl/step_s")),
        (None, Some(note), _) => note,
        (None, None, None) => "TRL not run".to_string(),
        (None, None, Some(_)) => "TRL gave no figure".to_string(),
    };
    let decode: Vec<String> = v
        .get("decode")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|r| {
            let ms = r["graphs_ms"].as_f64().or(r["eager_ms"].as_f64()).unwrap_or(f64::NAN);
            format!("{ms:.2} ms at {}", r["batch"])
        })
        .collect();
    Ok((
        format!(
            "{:.0}M-parameter Qwen2, B={batch} G={group}, {prompt}+{new} tokens, {dtype}: GRPO step {:.2} s ({trl_text}; \
             generate {:.0} % of it); train MFU {:.1} %; decode {:.0} tokens/s, {:.1} % of the memory-bandwidth bound; \
             decode step {}",
            shape.params() as f64 / 1e6,
            num("/rl/figures/step_s"),
            100.0 * num("/rl/figures/generate") / num("/rl/figures/step_s"),
            100.0 * num("/train/mfu"),
            num("/gen/tokens_per_s"),
            100.0 * num("/gen/hbm_fraction"),
            decode.join(", "),
        ),
        figures,
    ))
}

fn nccl(ctx: &Ctx, check: &Check, log: &Path) -> Done {
    let run_dir = ctx.work.join(check.id());
    let _ = std::fs::remove_dir_all(&run_dir);
    let mut args = train_args(check, &run_dir, &[]);
    args.extend(strings(&["--nproc", "2", "--set", "train.steps=20"]));
    exec(check, &args, log)?;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let same = text.lines().find(|l| l.contains("identical on 2 ranks"));
    let r = rewards(&run_dir);
    let figures = Map::from_iter([("steps".to_string(), json!(r.len()))]);
    match same {
        Some(line) => {
            Ok((format!("20 steps on 2 GPUs: {}", line.split("INFO").last().unwrap_or(line).trim()), figures))
        }
        None => Err(Failure { summary: "the ranks never confirmed identical parameters".into(), figures }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_read_from_logs_and_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("a.log");
        std::fs::write(&log, "INFO x\neval perplexity: before 19.1668, after 3.7380 (11 eval examples; 44 train)\n")
            .unwrap();
        assert_eq!(before_after(&log, "eval perplexity:"), Some((19.1668, 3.738)));
        assert_eq!(before_after(&log, "eval accuracy:"), None);
        std::fs::write(&log, "{\"other\": 1}\n{\"relative\": 2e-6, \"same_top\": 5}\nnot json\n").unwrap();
        assert_eq!(json_line(&log, "relative").unwrap()["same_top"], 5);
        let lines: String = (0..20).map(|i| format!("{{\"step\": {i}, \"reward\": {}}}\n", i as f64 / 10.0)).collect();
        std::fs::write(dir.path().join("metrics.jsonl"), format!("{{\"step\": 0, \"eval/pass@1\": 0.1}}\n{lines}"))
            .unwrap();
        let r = rewards(dir.path());
        assert_eq!(r.len(), 20);
        let (first, last) = ends(&r);
        assert!((first - 0.05).abs() < 1e-12 && (last - 1.85).abs() < 1e-12, "{first} {last}");
        assert_eq!(ends(&[0.5]), (0.5, 0.5));
    }

    #[test]
    fn ids_are_file_names() {
        let c = Check {
            name: "check-device qwen3 bf16".into(),
            device: "cuda:1".into(),
            what: What::Zero3,
            timeout: Duration::ZERO,
        };
        assert_eq!(c.id(), "check-device-qwen3-bf16-cuda1");
    }
}
