//! `rlhf doctor`: does this trainer work on this machine? One command that checks the machine it
//! runs on, device by device, and writes `report.md` and `report.json`:
//!
//! 1. what the machine is: libtorch and its version, CUDA, the GPUs, the NCCL library, the CPU,
//!    and whether the `python3` found can run TRL;
//! 2. on every device: `rlhf check-device` of each fixture family (Llama, Qwen2, GPT-2) and of the
//!    built-in Qwen3, Qwen3-MoE and Qwen3.5, in f32 and bf16, against the CPU in f32;
//! 3. on the first device: the GRPO preset in f32 and bf16 (it must learn: a reward gain of at
//!    least [`checks::GAIN_MIN`]), the same preset at ZeRO stage 3 (its first step must repeat
//!    stage 0's), SFT then reward-model training from the SFT model, the GEMM peak and copy
//!    bandwidth, and (without `--quick`) one GRPO step of a random Qwen2 of Qwen2.5-0.5B's shape in
//!    bf16 (a 3.9M one on a CPU), written by `rlhf` itself, with train MFU, decode against the
//!    bandwidth bound and, when TRL is importable, TRL's step on the same model for a ratio;
//! 4. with two GPUs or more: two ranks over NCCL.
//!
//! Each check is an `rlhf` command in a child process with a deadline, so a failure, a crash or a
//! hang ends that check only; the reports are rewritten after every check, and the exit status is
//! non-zero when one failed.

mod checks;
mod probe;
mod report;
mod runner;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use checks::{Check, Ctx, Model, Outcome, Status, StepSpec, What};
use probe::Facts;
use rlhf_trainer::random_qwen2::Qwen2Shape;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Directory for report.md, report.json and one log per check: a new or empty directory, or
    /// one an earlier `rlhf doctor` wrote (its reports, logs and work files are then replaced).
    #[arg(long, default_value = "rlhf-doctor")]
    out: PathBuf,
    /// The short form (about 2 minutes on one GPU): no 0.5B step, no TRL.
    #[arg(long)]
    quick: bool,
    /// Devices to check: `cuda` (every GPU), `cuda:N` or `cpu`. Default: every GPU, else the CPU.
    #[arg(long)]
    device: Option<String>,
    /// Fixture models for check-device (default: the bundle's fixtures/models, else
    /// integration-tests/fixtures/models under the current directory).
    #[arg(long)]
    fixtures: Option<PathBuf>,
    /// Python that runs TRL's step (default: $RLHF_PYTHON, else python3); TRL runs when it imports.
    #[arg(long)]
    python: Option<PathBuf>,
    /// Never run TRL.
    #[arg(long)]
    no_trl: bool,
    /// Keep the work files (models, run directories) in OUT/work.
    #[arg(long)]
    keep: bool,
    /// Only the checks whose names start with one of these, comma-separated (`check-device,grpo`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// The fixture families `check-device` runs on, by directory name.
const FIXTURE_FAMILIES: [&str; 3] = ["llama", "qwen2", "gpt2"];
/// Built-in models of newer families that `rlhf` writes itself.
const BUILTIN_FAMILIES: [(&str, &str); 3] =
    [("qwen3", "tiny-qwen3"), ("qwen3-moe", "tiny-qwen3-moe"), ("qwen3.5", "tiny-qwen3.5")];

/// The fixture directory: `--fixtures`, the bundle's `fixtures/models` (beside `bin/`), or the
/// repository's.
fn fixtures_dir(flag: Option<&Path>) -> Option<PathBuf> {
    if let Some(f) = flag {
        return Some(f.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    let bundle = exe.parent()?.parent()?.join("fixtures/models");
    let repo = PathBuf::from("integration-tests/fixtures/models");
    [bundle, repo].into_iter().find(|d| d.is_dir())
}

/// The devices to check, from `--device` and what the probe found.
fn devices(flag: Option<&str>, facts: &Facts) -> anyhow::Result<Vec<String>> {
    let gpus: Vec<String> = facts.gpus.iter().map(|g| g.device.clone()).collect();
    let why = || facts.no_gpu.clone().unwrap_or_else(|| "no CUDA device".into());
    match flag.map(str::trim) {
        None => Ok(if gpus.is_empty() { vec!["cpu".into()] } else { gpus }),
        Some("cpu") => Ok(vec!["cpu".into()]),
        Some(d) if gpus.is_empty() && (d == "cuda" || d.starts_with("cuda:")) => {
            bail!("--device {d}: no GPU found ({})", why())
        }
        Some("cuda") => Ok(gpus),
        Some(d) if gpus.iter().any(|g| g == d) => Ok(vec![d.to_string()]),
        Some(d) if d.starts_with("cuda:") => bail!("--device {d}: not a visible GPU (found: {})", gpus.join(", ")),
        Some(d) => bail!("--device {d}: expected cpu, cuda or cuda:N"),
    }
}

fn check(name: &str, device: &str, what: What, secs: u64) -> Check {
    Check { name: name.into(), device: device.into(), what, timeout: Duration::from_secs(secs) }
}

/// The checks to run and those skipped (with why), in report order.
fn plan(args: &Args, devices: &[String], facts: &Facts, trl: Option<PathBuf>) -> (Vec<Check>, Vec<Outcome>) {
    let (mut run, mut skipped) = (Vec::new(), Vec::new());
    let skip = |name: &str, device: &str, why: &str| Outcome {
        name: name.into(),
        device: device.into(),
        status: Status::Skip,
        seconds: 0.0,
        summary: why.into(),
        figures: Default::default(),
        log: None,
    };
    let fixtures = fixtures_dir(args.fixtures.as_deref());
    for device in devices {
        match &fixtures {
            Some(dir) => {
                for family in FIXTURE_FAMILIES {
                    for dtype in ["f32", "bf16"] {
                        let what = What::CheckDevice { model: Model::Dir(dir.join(family)), dtype };
                        run.push(check(&format!("check-device {family} {dtype}"), device, what, 300));
                    }
                }
            }
            None => skipped.push(skip("check-device fixtures", device, "no fixture models found (--fixtures DIR)")),
        }
        for (family, builtin) in BUILTIN_FAMILIES {
            for dtype in ["f32", "bf16"] {
                let what = What::CheckDevice { model: Model::Builtin(builtin), dtype };
                run.push(check(&format!("check-device {family} {dtype}"), device, what, 300));
            }
        }
    }
    for device in devices.iter().filter(|d| d.starts_with("cuda")) {
        run.push(check("decode-graphs bf16", device, What::Graphs { dtype: "bf16" }, 600));
    }
    let main = &devices[0];
    let gpu = main != "cpu";
    run.push(check("grpo f32", main, What::Grpo { dtype: "f32" }, 600));
    run.push(check("grpo bf16", main, What::Grpo { dtype: "bf16" }, 600));
    run.push(check("zero3", main, What::Zero3, 300));
    run.push(check("sft-rm", main, What::SftRm, 300));
    run.push(check("peak", main, What::Peak { dtype: if gpu { "bf16" } else { "f32" } }, 180));
    let step = if gpu {
        What::Step(StepSpec {
            shape: Qwen2Shape::HALF_B,
            dtype: "bf16",
            batch: 8,
            group: 8,
            prompt: 128,
            new: 256,
            trl,
        })
    } else {
        What::Step(StepSpec { shape: Qwen2Shape::SMALL, dtype: "f32", batch: 2, group: 4, prompt: 32, new: 32, trl })
    };
    if args.quick {
        skipped.push(skip("step", main, "--quick"));
    } else {
        run.push(check("step", main, step, 900));
    }
    if facts.gpus.len() >= 2 && gpu {
        run.push(check("nccl 2 ranks", "cuda", What::Nccl, 300));
    } else {
        skipped.push(skip("nccl 2 ranks", "cuda", "needs 2 GPUs"));
    }
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|p| name.starts_with(p.as_str()));
    run.retain(|c| wanted(&c.name));
    skipped.retain(|o| wanted(&o.name));
    (run, skipped)
}

/// Refuses an `--only` prefix that no check's name starts with: a doctor that checks nothing
/// must not pass.
fn check_only(args: &Args, devices: &[String], facts: &Facts) -> anyhow::Result<()> {
    let every = Args { only: Vec::new(), ..args.clone() };
    let (run, skipped) = plan(&every, devices, facts, None);
    let mut names: Vec<&str> =
        run.iter().map(|c| c.name.as_str()).chain(skipped.iter().map(|o| o.name.as_str())).collect();
    names.dedup();
    for prefix in &args.only {
        if !names.iter().any(|n| n.starts_with(prefix.as_str())) {
            bail!("--only `{prefix}`: no check's name starts with it (the checks: {})", names.join(", "));
        }
    }
    Ok(())
}

/// The file that marks a directory as the doctor's own output.
const MARKER: &str = ".rlhf-doctor";

/// Makes `out` the doctor's output directory, refusing one it cannot own: a new directory, an
/// empty one, or one an earlier doctor wrote (it holds [`MARKER`]) is taken, and then only the
/// doctor's own `logs/` and `work/` are emptied. Anything else is left untouched: the doctor never
/// deletes what it did not write.
fn claim_out(out: &Path) -> anyhow::Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("--out {}: exists and is not a directory", out.display());
    }
    let ours = out.join(MARKER).is_file();
    let empty = std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(true);
    if !ours && !empty {
        bail!(
            "--out {}: the directory holds files an earlier `rlhf doctor` did not write (no {MARKER}); choose a new or \
             empty directory",
            out.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(
        out.join(MARKER),
        "written by rlhf doctor: its reports, logs/ and work/ are replaced by the next run\n",
    )
    .with_context(|| format!("writing {}", out.join(MARKER).display()))?;
    for d in [out.join("logs"), out.join("work")] {
        if ours && d.is_dir() {
            std::fs::remove_dir_all(&d).with_context(|| format!("emptying {}", d.display()))?;
        }
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    }
    Ok(())
}

/// The error a signal ends the doctor with (its exit status is 128 + the signal); `when` says
/// where it stopped.
fn stopped(sig: i32, when: &str) -> anyhow::Error {
    let name = rlhf_trainer::signals::name(sig);
    rlhf_trainer::signals::Stopped { signal: sig, message: format!("stopped by {name} {when}") }.into()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.out.exists() && !args.out.is_dir() {
        bail!("--out {}: exists and is not a directory", args.out.display());
    }
    crate::deadline::probe_timeout()?;
    let (started, clock) = (unix_now(), Instant::now());
    println!("rlhf doctor: looking at the machine ...");
    let mut facts = probe::probe();
    let devices = devices(args.device.as_deref(), &facts)?;
    check_only(&args, &devices, &facts)?;
    claim_out(&args.out)?;
    let work = args.out.join("work");
    let python = (!args.quick && !args.no_trl).then(|| crate::bench::trl::python(args.python.as_deref()));
    facts.trl = probe::trl(python.as_deref(), &work);
    if let Some(sig) = rlhf_trainer::signals::requested() {
        let _ = std::fs::remove_dir_all(&work);
        return Err(stopped(sig, "before the first check"));
    }
    if facts.gpus.is_empty() {
        println!("no GPU found ({}): running the CPU checks", facts.no_gpu.as_deref().unwrap_or("no CUDA device"));
    }
    let trl = python.filter(|_| facts.trl.is_ok());
    let (checks, skipped) = plan(&args, &devices, &facts, trl);
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut ctx = Ctx {
        out: args.out.clone(),
        work: work.clone(),
        fixtures: args.fixtures.clone(),
        first_reward: Default::default(),
    };
    let total = checks.len();
    // The skipped checks are listed after the ones that ran.
    let write = |ran: &[Outcome]| {
        let all = [ran, &skipped[..]].concat();
        report::write(&args.out, &facts, &all, started, clock.elapsed().as_secs_f64(), args.quick)
            .with_context(|| format!("writing the report into {}", args.out.display()))
    };
    for (i, c) in checks.iter().enumerate() {
        let o = checks::run(&mut ctx, c);
        let tag = match o.status {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        };
        println!("[{}/{total}] {tag} {} ({}) {:.1} s: {}", i + 1, o.name, o.device, o.seconds, o.summary);
        outcomes.push(o);
        write(&outcomes)?;
        if let Some(sig) = rlhf_trainer::signals::requested() {
            if !args.keep {
                let _ = std::fs::remove_dir_all(&work);
            }
            let report = args.out.join("report.md");
            let during = format!(
                "during check {} ({}): the report of the checks that ran is {}",
                c.name,
                c.device,
                report.display()
            );
            return Err(stopped(sig, &during));
        }
    }
    write(&outcomes)?;
    outcomes.extend(skipped.iter().cloned());
    if !args.keep {
        let _ = std::fs::remove_dir_all(&work);
    }
    let (pass, fail, skip) = report::counts(&outcomes);
    let md = args.out.join("report.md");
    println!(
        "{pass} passed, {fail} failed, {skip} skipped in {:.0} s: {}",
        clock.elapsed().as_secs_f64(),
        md.display()
    );
    if fail > 0 {
        let failed: Vec<String> = outcomes
            .iter()
            .filter(|o| o.status == Status::Fail)
            .map(|o| format!("{} ({})", o.name, o.device))
            .collect();
        bail!("{fail} of {} checks failed: {}; see {}", pass + fail, failed.join(", "), md.display());
    }
    Ok(())
}
