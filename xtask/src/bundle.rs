//! `cargo xtask bundle [--debug] [--out DIR]`: a relocatable directory (and a `.tar.gz` of it) that
//! runs where PyTorch is installed but Rust is not: the stripped `rlhf` binary and every shipped
//! plugin in `bin/`, `configs/`, `examples/`, the small fixture models (`fixtures/models/`), the
//! NCCL shim when this libtorch has one, and `bin/rlhf`, a launcher that finds libtorch at run
//! time — `$LIBTORCH`, else the `torch` package of the `python3` on `PATH`, else the project's own
//! venv — and refuses another torch version with one line naming both. The binaries' run path is
//! rewritten to `$ORIGIN`, so nothing points at the build machine's libtorch.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd::{self, Profile};
use crate::setup::{self, TORCH_VERSION};

/// The launcher script (`bin/rlhf`); `@TORCH_VERSION@` is replaced by the version built against.
const LAUNCHER: &str = include_str!("bundle_launcher.sh");

pub(crate) fn run(args: &[String]) -> Result<()> {
    let debug = args.iter().any(|a| a == "--debug");
    let out = match args.iter().position(|a| a == "--out") {
        Some(i) => PathBuf::from(args.get(i + 1).context("--out needs a directory")?),
        None => cmd::target_dir().join("bundle"),
    };
    if let Some(bad) =
        args.iter().enumerate().find(|(i, a)| *a != "--debug" && *a != "--out" && !(*i > 0 && args[i - 1] == "--out"))
    {
        bail!("bundle: unexpected argument `{}` (usage: cargo xtask bundle [--debug] [--out DIR])", bad.1);
    }
    let torch = setup::setup()?;
    let profile = if debug { Profile::Debug } else { Profile::Release };
    let mut build = torch.cargo();
    build.arg("build").args(if debug { &[][..] } else { &["--release"][..] }).args(["-p", "rlhf-cli"]);
    for p in crate::test::plugin_packages(&crate::project_root().join("plugins"))? {
        build.args(["-p", &p]);
    }
    cmd::run(&mut build)?;
    let dir = out.join(format!("rlhf-{}-x86_64-linux", env!("CARGO_PKG_VERSION")));
    assemble(&cmd::target_dir().join(profile.dir()), &torch_lib(&torch)?, &dir)?;
    let name = dir.file_name().context("bundle name")?.to_string_lossy().into_owned();
    let tar = out.join(format!("{name}.tar.gz"));
    let mut c = Command::new("tar");
    c.arg("-czf").arg(&tar).arg("-C").arg(&out).arg(&name);
    cmd::run(&mut c)?;
    let size = fs::metadata(&tar)?.len() as f64 / (1 << 20) as f64;
    println!("bundle: {} ({size:.1} MiB packed)", tar.display());
    if size > 50.0 {
        eprintln!("warning: the bundle is over 50 MiB");
    }
    Ok(())
}

/// The `lib` directory of the libtorch the build used (whose path the binaries' run path names).
fn torch_lib(torch: &setup::Torch) -> Result<PathBuf> {
    Ok(torch.lib_dir.clone())
}

/// Builds the bundle directory `dir` from the binaries in `profile_dir` (`target/debug` or
/// `target/release`); `torch_lib` is the run path the build wrote into them.
pub(crate) fn assemble(profile_dir: &Path, torch_lib: &Path, dir: &Path) -> Result<()> {
    let root = crate::project_root();
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("could not remove {}", dir.display()))?;
    }
    let bin = dir.join("bin");
    fs::create_dir_all(&bin)?;
    let mut binaries = vec![(profile_dir.join("rlhf"), bin.join("rlhf-bin"))];
    for p in crate::test::plugin_packages(&root.join("plugins"))? {
        let file = format!("lib{}.so", p.replace('-', "_"));
        let from = profile_dir.join(&file);
        if !from.is_file() {
            bail!("{}: not built (run without --debug, or `cargo xtask test` first)", from.display());
        }
        binaries.push((from, bin.join(file)));
    }
    // The libraries reached only on CUDA, loaded at run time from beside the binary.
    for lib in ["librlhf_nccl.so", "librlhf_cuda_graph.so"] {
        if let Some(built) = newest(profile_dir.join("build"), lib) {
            binaries.push((built, bin.join(lib)));
        }
    }
    for (from, to) in &binaries {
        fs::copy(from, to).with_context(|| format!("could not copy {}", from.display()))?;
        let status = Command::new("strip").arg("--strip-unneeded").arg(to).status();
        if !status.is_ok_and(|s| s.success()) {
            eprintln!("warning: could not strip {}", to.display());
        }
        rewrite_run_path(to, torch_lib)?;
    }
    let launcher = LAUNCHER.replace("@TORCH_VERSION@", TORCH_VERSION);
    fs::write(bin.join("rlhf"), launcher)?;
    set_executable(&bin.join("rlhf"))?;
    copy_tree(&root.join("configs"), &dir.join("configs"))?;
    copy_tree(&root.join("examples"), &dir.join("examples"))?;
    copy_tree(&root.join("integration-tests/fixtures/models"), &dir.join("fixtures/models"))?;
    fs::write(dir.join("TORCH_VERSION"), format!("{TORCH_VERSION}\n"))?;
    Ok(())
}

/// The most recently modified file named `name` below `dir`.
fn newest(dir: PathBuf, name: &str) -> Option<PathBuf> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == name) {
                let t = e.metadata().and_then(|m| m.modified()).ok()?;
                if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
                    best = Some((t, p));
                }
            }
        }
    }
    best.map(|(_, p)| p)
}

/// Replaces the run path string `old` (a whole NUL-terminated string of the file: the dynamic
/// section's `DT_RUNPATH`) by `$ORIGIN`, padded with NULs to the same length, so the binary looks
/// for libraries next to itself (and where the launcher's `LD_LIBRARY_PATH` says), never on the
/// build machine.
pub(crate) fn rewrite_run_path(file: &Path, old: &Path) -> Result<usize> {
    let mut bytes = fs::read(file)?;
    let old = old.to_string_lossy().into_owned().into_bytes();
    let new = b"$ORIGIN";
    let mut count = 0;
    let mut i = 0;
    while let Some(k) = bytes[i..].windows(old.len()).position(|w| w == old.as_slice()) {
        let at = i + k;
        let whole = (at == 0 || bytes[at - 1] == 0) && bytes.get(at + old.len()) == Some(&0);
        if whole && old.len() >= new.len() {
            bytes[at..at + new.len()].copy_from_slice(new);
            bytes[at + new.len()..at + old.len()].fill(0);
            count += 1;
        }
        i = at + old.len();
    }
    fs::write(file, bytes)?;
    Ok(count)
}

fn set_executable(p: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut perm = fs::metadata(p)?.permissions();
    perm.set_mode(0o755);
    fs::set_permissions(p, perm)?;
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for e in fs::read_dir(from).with_context(|| format!("could not read {}", from.display()))? {
        let e = e?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            copy_tree(&src, &dst)?;
        } else {
            fs::copy(&src, &dst).with_context(|| format!("could not copy {}", src.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_path_is_rewritten_only_where_it_is_a_whole_string() {
        let dir = std::env::temp_dir().join(format!("xtask-bundle-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let f = dir.join("bin");
        let old = "/opt/torch/lib";
        fs::write(&f, b"\0/opt/torch/lib\0x/opt/torch/lib/y\0/opt/torch/lib\0").unwrap();
        assert_eq!(rewrite_run_path(&f, Path::new(old)).unwrap(), 2);
        let got = fs::read(&f).unwrap();
        assert_eq!(&got[..16], b"\0$ORIGIN\0\0\0\0\0\0\0\0");
        assert!(got.windows(17).any(|w| w == b"x/opt/torch/lib/y"), "a longer string is left alone");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A `python3` on PATH that never answers is given up at the launcher's deadline
    /// (`RLHF_PROBE_TIMEOUT`), with a warning, and the search goes on (here: to no libtorch at all).
    #[test]
    fn the_launcher_gives_a_hanging_python3_a_deadline() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = std::env::temp_dir().join(format!("xtask-launcher-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        let (bin, path, home) = (tmp.join("bundle/bin"), tmp.join("path"), tmp.join("home"));
        for d in [&bin, &path, &home] {
            fs::create_dir_all(d).unwrap();
        }
        let script = |file: &Path, text: &str| {
            fs::write(file, text).unwrap();
            fs::set_permissions(file, fs::Permissions::from_mode(0o755)).unwrap();
        };
        script(&bin.join("rlhf"), &LAUNCHER.replace("@TORCH_VERSION@", TORCH_VERSION));
        script(&bin.join("rlhf-bin"), "#!/bin/sh\necho ran\n");
        script(&path.join("python3"), "#!/bin/sh\nexec sleep 600\n");
        let mut child = Command::new(bin.join("rlhf"))
            .env_remove("LIBTORCH")
            .env("HOME", &home)
            .env("PATH", format!("{}:/usr/bin:/bin", path.display()))
            .env("RLHF_PROBE_TIMEOUT", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t0.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                panic!("the launcher still waits for python3 after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("python3 did not answer within 1 s (RLHF_PROBE_TIMEOUT)"), "{err}");
        assert!(err.contains("error: no libtorch found"), "{err}");
        fs::remove_dir_all(&tmp).unwrap();
    }

    /// A debug bundle of this build, moved to another directory, runs the built-in GRPO preset
    /// with `LIBTORCH` unset and the venv's `python3` first on `PATH`; a libtorch of another
    /// version is refused with one line naming both. Needs the workspace and plugins built and
    /// `LIBTORCH`/`RLHF_PYTHON` set, as `cargo xtask test` does.
    #[test]
    fn a_moved_bundle_finds_libtorch_through_python3_and_refuses_another_version() {
        let (Some(libtorch), Some(python)) = (std::env::var_os("LIBTORCH"), std::env::var_os("RLHF_PYTHON")) else {
            assert!(std::env::var_os("CI").is_none(), "run the tests through `cargo xtask test` under CI");
            eprintln!("LIBTORCH or RLHF_PYTHON unset: skipping the bundle test");
            return;
        };
        let profile = cmd::target_dir().join("debug");
        if !profile.join("rlhf").is_file() {
            assert!(std::env::var_os("CI").is_none(), "target/debug/rlhf not built");
            return;
        }
        let tmp = std::env::temp_dir().join(format!("xtask-bundle-run-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        let built = tmp.join("built");
        assemble(&profile, &Path::new(&libtorch).join("lib"), &built).unwrap();
        let moved = tmp.join("elsewhere/rlhf");
        fs::create_dir_all(moved.parent().unwrap()).unwrap();
        fs::rename(&built, &moved).unwrap();
        let python_dir = Path::new(&python).parent().unwrap().to_path_buf();
        let run = |args: &[&str], libtorch: Option<&Path>| {
            let mut c = Command::new(moved.join("bin/rlhf"));
            c.args(args)
                .current_dir(&tmp)
                .env_remove("LD_LIBRARY_PATH")
                .env_remove("RLHF_NCCL_LIB")
                .env_remove("RLHF_CUDA_GRAPH_LIB");
            c.env("PATH", format!("{}:/usr/bin:/bin", python_dir.display()));
            match libtorch {
                Some(d) => c.env("LIBTORCH", d),
                None => c.env_remove("LIBTORCH"),
            };
            c.output().unwrap()
        };
        let o = run(&["train", "--algo", "grpo", "--no-progress", "--run-dir", "run", "--set", "train.steps=2"], None);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(tmp.join("run/actor/model.safetensors").is_file());
        // The doctor finds the bundle's own fixture models (the working directory has none).
        let o = run(&["doctor", "--quick", "--device", "cpu", "--only", "check-device llama", "--out", "doc"], None);
        assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let report = fs::read_to_string(tmp.join("doc/report.json")).unwrap();
        assert!(report.contains("\"passed\": 2") && report.contains("check-device llama bf16"), "{report}");
        let fake = tmp.join("torch-2.10");
        fs::create_dir_all(fake.join("lib")).unwrap();
        fs::write(fake.join("version.py"), "__version__ = '2.10.0+cpu'\n").unwrap();
        let o = run(&["--help"], Some(&fake));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.lines().count() == 1, "{err}");
        assert!(
            err.contains("is torch 2.10.0; this bundle needs torch 2.11.0") && err.contains("from LIBTORCH"),
            "{err}"
        );
        fs::remove_dir_all(&tmp).unwrap();
    }
}
