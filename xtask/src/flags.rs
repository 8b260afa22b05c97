//! Command-line parsing. Hand-rolled: every command either takes no flags or
//! forwards its arguments to another program.

use std::fmt;

pub(crate) const HELP: &str = "\
cargo xtask <command> [args]

Commands:
  setup [--python-test-deps]  install libtorch (torch==2.11.0 in a cached venv) unless LIBTORCH is set
  test [ARGS...]              build the workspace and plugins, then `cargo test --workspace ARGS...`
  lint                        `cargo fmt --check` and `cargo clippy -D warnings` on the workspace
  rlhf [--] ARGS...           build and run the `rlhf` binary (debug) with ARGS
  train --algo NAME [ARGS...] run `rlhf train --algo NAME ARGS...` (the RL host is not there yet)
  bench gen [ARGS...]         build `rlhf` with --release and run `rlhf bench gen ARGS...`
  fixtures [ARGS...]          regenerate the integration-test fixtures with transformers
  help                        print this list

Every command except `help` runs `setup` first and passes LIBTORCH, LIBTORCH_CXX11_ABI,
LD_LIBRARY_PATH and RLHF_PYTHON on to cargo and `rlhf`.
";

/// The benchmarks `cargo xtask bench` knows; each is implemented by `rlhf bench <name>`.
pub(crate) const BENCHES: &[&str] = &["gen"];

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Command {
    Help,
    Setup { python_test_deps: bool },
    Test { args: Vec<String> },
    Lint,
    Rlhf { args: Vec<String> },
    Train { args: Vec<String> },
    Bench { bench: &'static str, args: Vec<String> },
    Fixtures { args: Vec<String> },
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
        "bench" => {
            let mut rest = strip_separator(rest);
            if rest.is_empty() {
                return Err(Usage(format!("`bench` needs a benchmark name; available: {}", BENCHES.join(", "))));
            }
            let name = rest.remove(0);
            let Some(bench) = BENCHES.iter().copied().find(|b| *b == name) else {
                return Err(Usage(format!("unknown bench `{name}`; available: {}", BENCHES.join(", "))));
            };
            Command::Bench { bench, args: strip_separator(rest) }
        }
        other => return Err(Usage(format!("unknown command `{other}`"))),
    };
    Ok(command)
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
    }

    #[test]
    fn bench_names() {
        assert_eq!(
            p(&["bench", "gen", "--batch", "4"]),
            Ok(Command::Bench { bench: "gen", args: v(&["--batch", "4"]) })
        );
        assert_eq!(
            p(&["bench", "gen", "--", "--batch", "4"]),
            Ok(Command::Bench { bench: "gen", args: v(&["--batch", "4"]) })
        );
        let err = p(&["bench", "train"]).unwrap_err();
        assert!(err.to_string().contains("gen"), "{err}");
        let err = p(&["bench"]).unwrap_err();
        assert!(err.to_string().contains("gen"), "{err}");
    }

    #[test]
    fn unknown_command() {
        let err = p(&["deploy"]).unwrap_err();
        assert_eq!(err.to_string(), "unknown command `deploy`");
    }
}
