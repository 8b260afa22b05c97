//! `cargo xtask setup`: find or install libtorch, and the Python packages the
//! fixture tests need.
//!
//! Unless `LIBTORCH` is set, libtorch comes from the `torch` wheel on PyPI,
//! installed into a venv in `${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-rs/torch-<version>/venv`.
//! A marker file is written only after a successful install; when it and
//! `libtorch_cpu.so` are present, setup starts no process at all.

use std::{
    env,
    ffi::{OsStr, OsString},
    fs::{self, File, OpenOptions},
    io,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::cmd;

/// The PyTorch release tch 0.24 is built against.
pub(crate) const TORCH_VERSION: &str = "2.11.0";
/// The transformers release the fixture and parity tests are written against.
pub(crate) const TRANSFORMERS_VERSION: &str = "5.23.0";
/// The pyarrow release the Parquet data tests write their files with.
pub(crate) const PYARROW_VERSION: &str = "26.0.1";
/// The `gguf` package (llama.cpp's Python reader) the K-quant dequantisation is checked against.
pub(crate) const GGUF_VERSION: &str = "0.19.0";
/// The packages the tests use, pinned, beyond torch: transformers, pyarrow, gguf, math-verify
/// (the `reward-python` example's answer checker), tensorboard (its reader checks the event
/// files), datasets (`save_to_disk` directories), peft (it loads the saved LoRA adapters) and
/// trl (its stored copies of the Hub's chat templates).
pub(crate) fn test_deps() -> [String; 8] {
    [
        format!("transformers=={TRANSFORMERS_VERSION}"),
        format!("pyarrow=={PYARROW_VERSION}"),
        format!("gguf=={GGUF_VERSION}"),
        "math-verify==0.9.0".to_string(),
        "tensorboard==2.21.0".to_string(),
        "datasets==5.2.0".to_string(),
        "peft==0.18.0".to_string(),
        format!("trl=={TRL_VERSION}"),
    ]
}

const TORCH_MARKER: &str = ".rlhf-torch-installed";
const LIBTORCH_CPU: &str = "lib/libtorch_cpu.so";

/// Where libtorch is, and the Python that goes with it.
#[derive(Debug)]
pub(crate) struct Torch {
    /// The libtorch directory (has `include/` and `lib/`); passed on as `LIBTORCH`.
    pub(crate) libtorch: PathBuf,
    /// `<libtorch>/lib`, prepended to `LD_LIBRARY_PATH`.
    pub(crate) lib_dir: PathBuf,
    /// The Python for fixture and parity tests; passed on as `RLHF_PYTHON`.
    pub(crate) python: Option<PathBuf>,
    /// The venv this tool manages, when `python` is its interpreter.
    venv: Option<Venv>,
}

/// `cargo xtask setup [--python-test-deps]`.
pub(crate) fn run(python_test_deps: bool) -> Result<Torch> {
    let torch = setup()?;
    if python_test_deps {
        ensure_test_deps(&torch, false)?;
    }
    Ok(torch)
}

/// Finds libtorch (`LIBTORCH`) or installs it into the cache venv, and prints `libtorch: <path>`.
pub(crate) fn setup() -> Result<Torch> {
    let torch = match env::var_os("LIBTORCH").filter(|v| !v.is_empty()) {
        Some(dir) => from_env(Path::new(&dir))?,
        None => managed()?,
    };
    eprintln!("libtorch: {}", torch.libtorch.display());
    Ok(torch)
}

impl Torch {
    fn new(libtorch: PathBuf, python: Option<PathBuf>, venv: Option<Venv>) -> Torch {
        let lib_dir = libtorch.join("lib");
        Torch { libtorch, lib_dir, python, venv }
    }

    /// The environment changes for every child process: `Some` sets, `None` removes.
    ///
    /// `ld_library_path` is the current `LD_LIBRARY_PATH`; our lib dir goes first
    /// and is not repeated, so nested runs don't grow it.
    pub(crate) fn child_env(&self, ld_library_path: Option<&OsStr>) -> Vec<(&'static str, Option<OsString>)> {
        let mut ld = OsString::from(&self.lib_dir);
        for dir in env::split_paths(ld_library_path.unwrap_or_default()) {
            if !dir.as_os_str().is_empty() && dir != self.lib_dir {
                ld.push(":");
                ld.push(dir);
            }
        }
        let mut vars = vec![
            ("LIBTORCH", Some(self.libtorch.clone().into_os_string())),
            ("LIBTORCH_CXX11_ABI", Some("1".into())),
            ("LD_LIBRARY_PATH", Some(ld)),
            // LIBTORCH is authoritative: no python at build time, no partial overrides.
            ("LIBTORCH_USE_PYTORCH", None),
            ("LIBTORCH_INCLUDE", None),
            ("LIBTORCH_LIB", None),
        ];
        if let Some(python) = &self.python {
            vars.push(("RLHF_PYTHON", Some(python.clone().into_os_string())));
        }
        vars
    }

    /// Applies [`Torch::child_env`] to `cmd`.
    /// `cargo` (the one running us, via `$CARGO`) in the project root, with this environment.
    pub(crate) fn cargo(&self) -> Command {
        let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        cmd.current_dir(crate::project_root());
        self.apply(&mut cmd);
        cmd
    }

    pub(crate) fn apply(&self, cmd: &mut Command) {
        for (key, value) in self.child_env(env::var_os("LD_LIBRARY_PATH").as_deref()) {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
    }
}

/// `LIBTORCH` is set: use it as is and install nothing.
fn from_env(dir: &Path) -> Result<Torch> {
    let libtorch =
        std::path::absolute(dir).with_context(|| format!("LIBTORCH={} is not a usable path", dir.display()))?;
    if !libtorch.join(LIBTORCH_CPU).is_file() {
        bail!(
            "LIBTORCH={} has no {LIBTORCH_CPU}: point it at a libtorch {TORCH_VERSION} directory, or unset it to let xtask install one",
            libtorch.display()
        );
    }
    // A Python for the tests: RLHF_PYTHON as given, else our venv if it exists.
    if let Some(python) = env::var_os("RLHF_PYTHON").filter(|v| !v.is_empty()) {
        return Ok(Torch::new(libtorch, Some(python.into()), None));
    }
    let venv = cache_dir().ok().map(Venv::new).filter(|v| v.python().is_file());
    let python = venv.as_ref().map(Venv::python);
    Ok(Torch::new(libtorch, python, venv))
}

/// No `LIBTORCH`: the torch wheel in the cache venv, installed if needed.
fn managed() -> Result<Torch> {
    let venv = Venv::new(cache_dir()?);
    if let Some(torch) = venv.installed_torch() {
        ensure_cuda_headers(&venv);
        return Ok(torch);
    }
    let _lock = lock(&venv.cache)?;
    if let Some(torch) = venv.installed_torch() {
        ensure_cuda_headers(&venv);
        return Ok(torch); // another xtask finished it while we waited
    }
    eprintln!("installing torch=={TORCH_VERSION} into {} (once; this downloads a few GB)", venv.dir.display());
    venv.create()?;
    venv.pip_install(&format!("torch=={TORCH_VERSION}"))?;
    let Some(torch_dir) = find_torch_dir(&venv.dir) else {
        bail!(
            "pip installed torch=={TORCH_VERSION} but there is no lib/python3*/site-packages/torch/{LIBTORCH_CPU} in {}; delete {} and run `cargo xtask setup` again",
            venv.dir.display(),
            venv.cache.display()
        );
    };
    let marker = venv.dir.join(TORCH_MARKER);
    fs::write(&marker, format!("torch=={TORCH_VERSION}\n"))
        .with_context(|| format!("could not write {}", marker.display()))?;
    let python = venv.python();
    ensure_cuda_headers(&venv);
    Ok(Torch::new(torch_dir, Some(python), Some(venv)))
}

/// The CUDA headers the torch wheel leaves out but `ProcessGroupNCCL.hpp` includes
/// (`crt/host_config.h`, `<nv/target>`): with them the NCCL library of `rlhf-collective` is
/// compiled (it is loaded only when a CUDA tensor is reduced). Versions match the wheel's
/// `nvidia-cuda-runtime` 13.0. Without them (no registry) the build skips NCCL with a warning.
const CUDA_HEADER_PACKAGES: &[&str] = &["nvidia-cuda-crt==13.0.88", "nvidia-cuda-cccl==13.0.85"];

fn ensure_cuda_headers(venv: &Venv) {
    let marker = venv.dir.join(".rlhf-cuda-headers-13.0");
    if marker.is_file() {
        return;
    }
    for package in CUDA_HEADER_PACKAGES {
        if let Err(e) = venv.pip_install(package) {
            eprintln!("warning: {package}: {e:#}; the NCCL library will not be built (CPU training is unaffected)");
            return;
        }
    }
    let _ = fs::write(&marker, CUDA_HEADER_PACKAGES.join("\n") + "\n");
}

/// Installs the Python packages the fixture tests need into the cache venv.
///
/// Skipped when their marker exists, unless `force` (CI re-checks with pip).
pub(crate) fn ensure_test_deps(torch: &Torch, force: bool) -> Result<()> {
    let Some(venv) = &torch.venv else {
        return match &torch.python {
            Some(python) => {
                eprintln!("python test deps: using RLHF_PYTHON={} as it is", python.display());
                Ok(())
            }
            None => bail!(
                "no Python for the test dependencies: LIBTORCH is set and RLHF_PYTHON is not; set RLHF_PYTHON to a Python with {}, or unset LIBTORCH",
                test_deps().join(", ")
            ),
        };
    };
    let deps = test_deps();
    let marker = venv.dir.join(format!(".rlhf-test-deps-{}", deps.join("-").replace("==", "-")));
    if !force && marker.is_file() {
        return Ok(());
    }
    let _lock = lock(&venv.cache)?;
    if !force && marker.is_file() {
        return Ok(());
    }
    venv.create()?;
    for dep in &deps {
        venv.pip_install(dep)?;
    }
    fs::write(&marker, deps.join("\n") + "\n").with_context(|| format!("could not write {}", marker.display()))?;
    Ok(())
}

/// The TRL that `rlhf bench --vs-trl` compares against.
pub(crate) const TRL_VERSION: &str = "1.16.0";

/// Installs the pinned TRL into the cache venv (for `cargo xtask bench --vs-trl`), once.
pub(crate) fn ensure_trl(torch: &Torch) -> Result<()> {
    let Some(venv) = &torch.venv else {
        eprintln!(
            "--vs-trl: LIBTORCH is set; using the Python of RLHF_PYTHON/--python as it is (needs trl=={TRL_VERSION})"
        );
        return Ok(());
    };
    let marker = venv.dir.join(format!(".rlhf-trl-{TRL_VERSION}"));
    if marker.is_file() {
        return Ok(());
    }
    let _lock = lock(&venv.cache)?;
    if marker.is_file() {
        return Ok(());
    }
    venv.pip_install(&format!("trl=={TRL_VERSION}"))?;
    fs::write(&marker, format!("trl=={TRL_VERSION}\n"))
        .with_context(|| format!("could not write {}", marker.display()))?;
    Ok(())
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-rs`: everything xtask caches lies below it.
pub(crate) fn cache_root() -> Result<PathBuf> {
    let dir = cache_dir()?;
    Ok(dir.parent().map_or(dir.clone(), Path::to_path_buf))
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-rs/torch-<version>`.
fn cache_dir() -> Result<PathBuf> {
    cache_dir_from(env::var_os("XDG_CACHE_HOME"), env::var_os("HOME"))
}

fn cache_dir_from(xdg_cache_home: Option<OsString>, home: Option<OsString>) -> Result<PathBuf> {
    // The XDG spec says to ignore relative (and empty) values.
    let base = match xdg_cache_home.map(PathBuf::from).filter(|p| p.is_absolute()) {
        Some(base) => base,
        None => {
            let home = home
                .filter(|h| !h.is_empty())
                .context("neither XDG_CACHE_HOME nor HOME is set: no cache directory for libtorch (or set LIBTORCH)")?;
            PathBuf::from(home).join(".cache")
        }
    };
    Ok(base.join("rlhf-rs").join(format!("torch-{TORCH_VERSION}")))
}

/// The `torch` package directory in `venv/lib/python3*/site-packages`, if it
/// has `lib/libtorch_cpu.so`. Looks at the file system only: no python started.
pub(crate) fn find_torch_dir(venv: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path().join("site-packages").join("torch"))
        .filter(|torch| torch.join(LIBTORCH_CPU).is_file())
        .collect();
    found.sort();
    found.pop()
}

/// The venv under the cache directory.
#[derive(Debug)]
pub(crate) struct Venv {
    pub(crate) cache: PathBuf,
    pub(crate) dir: PathBuf,
}

impl Venv {
    pub(crate) fn new(cache: PathBuf) -> Venv {
        let dir = cache.join("venv");
        Venv { cache, dir }
    }

    pub(crate) fn python(&self) -> PathBuf {
        self.dir.join("bin").join("python")
    }

    /// The finished install: marker written and libtorch in place.
    fn installed_torch(&self) -> Option<Torch> {
        if !self.dir.join(TORCH_MARKER).is_file() {
            return None;
        }
        let torch_dir = find_torch_dir(&self.dir)?;
        let venv = Venv::new(self.cache.clone());
        Some(Torch::new(torch_dir, Some(self.python()), Some(venv)))
    }

    /// `python3 -m venv <dir>`, unless the venv's python is already there.
    pub(crate) fn create(&self) -> Result<()> {
        if self.python().is_file() {
            return Ok(());
        }
        let existed = self.dir.exists();
        let mut command = Command::new("python3");
        command.args(["-m", "venv"]).arg(&self.dir);
        let result = match cmd::run(&mut command) {
            Err(err) if is_not_found(&err) => Err(err).context(
                "python3 not found on PATH: install Python 3 (with venv), or set LIBTORCH to an existing libtorch",
            ),
            Err(err) => Err(err).context("on Debian/Ubuntu the venv module is in the python3-venv package"),
            Ok(()) => Ok(()),
        };
        if result.is_err() && !existed {
            let _ = fs::remove_dir_all(&self.dir);
        }
        result
    }

    pub(crate) fn pip_install(&self, requirement: &str) -> Result<()> {
        let mut command = Command::new(self.python());
        command.args(["-m", "pip", "install", "--disable-pip-version-check", requirement]);
        cmd::run(&mut command).with_context(|| {
            format!(
                "installing {requirement} failed; if the venv is broken, delete {} and run `cargo xtask setup` again",
                self.cache.display()
            )
        })
    }
}

fn is_not_found(err: &anyhow::Error) -> bool {
    err.chain().filter_map(|e| e.downcast_ref::<io::Error>()).any(|e| e.kind() == io::ErrorKind::NotFound)
}

/// An exclusive lock on `<cache>/install.lock`, held until the file is dropped,
/// so concurrent xtask runs don't install at once. Released by the OS if we die.
pub(crate) fn lock(cache: &Path) -> Result<File> {
    fs::create_dir_all(cache).with_context(|| format!("could not create {}", cache.display()))?;
    let path = cache.join("install.lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("could not open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            eprintln!("waiting for another `cargo xtask` to finish installing ({})", path.display());
            file.lock().with_context(|| format!("could not lock {}", path.display()))?;
        }
        Err(fs::TryLockError::Error(err)) => {
            return Err(err).with_context(|| format!("could not lock {}", path.display()));
        }
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = env::temp_dir().join(format!("xtask-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn touch(path: &Path) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, b"").unwrap();
    }

    #[test]
    fn finds_torch_in_site_packages() {
        let venv = temp_dir("site-packages");
        assert_eq!(find_torch_dir(&venv), None, "no lib/ at all");

        // A torch package without the shared library does not count.
        fs::create_dir_all(venv.join("lib/python3.11/site-packages/torch/lib")).unwrap();
        fs::create_dir_all(venv.join("lib/pythonX/site-packages")).unwrap();
        assert_eq!(find_torch_dir(&venv), None);

        touch(&venv.join("lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"));
        assert_eq!(find_torch_dir(&venv), Some(venv.join("lib/python3.11/site-packages/torch")));
        fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn installed_needs_marker_and_library() {
        let cache = temp_dir("installed");
        let venv = Venv::new(cache.clone());
        touch(&venv.dir.join("lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"));
        assert!(venv.installed_torch().is_none(), "no marker yet");

        touch(&venv.dir.join(TORCH_MARKER));
        let torch = venv.installed_torch().expect("marker and library present");
        assert_eq!(torch.libtorch, venv.dir.join("lib/python3.12/site-packages/torch"));
        assert_eq!(torch.lib_dir, torch.libtorch.join("lib"));
        assert_eq!(torch.python, Some(venv.dir.join("bin/python")));
        fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn cache_dir_follows_xdg() {
        let v = |s: &str| Some(OsString::from(s));
        let want = |base: &str| Path::new(base).join(format!("rlhf-rs/torch-{TORCH_VERSION}"));
        assert_eq!(cache_dir_from(v("/xdg"), v("/home/u")).unwrap(), want("/xdg"));
        assert_eq!(cache_dir_from(None, v("/home/u")).unwrap(), want("/home/u/.cache"));
        assert_eq!(cache_dir_from(v(""), v("/home/u")).unwrap(), want("/home/u/.cache"));
        assert_eq!(cache_dir_from(v("rel"), v("/home/u")).unwrap(), want("/home/u/.cache"));
        assert!(cache_dir_from(None, None).is_err());
    }

    fn lookup<'a>(vars: &'a [(&str, Option<OsString>)], key: &str) -> Option<&'a Option<OsString>> {
        vars.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    #[test]
    fn child_env_composition() {
        let torch = Torch::new(PathBuf::from("/t/torch"), Some("/v/bin/python".into()), None);
        let vars = torch.child_env(Some(OsStr::new("/a:/t/torch/lib::/b")));
        let set = |s: &str| Some(Some(OsString::from(s)));
        assert_eq!(lookup(&vars, "LIBTORCH").cloned(), set("/t/torch"));
        assert_eq!(lookup(&vars, "LIBTORCH_CXX11_ABI").cloned(), set("1"));
        assert_eq!(lookup(&vars, "LD_LIBRARY_PATH").cloned(), set("/t/torch/lib:/a:/b"));
        assert_eq!(lookup(&vars, "RLHF_PYTHON").cloned(), set("/v/bin/python"));
        assert_eq!(lookup(&vars, "LIBTORCH_USE_PYTORCH").cloned(), Some(None));

        let torch = Torch::new(PathBuf::from("/t/torch"), None, None);
        let vars = torch.child_env(None);
        assert_eq!(lookup(&vars, "LD_LIBRARY_PATH").cloned(), set("/t/torch/lib"));
        assert_eq!(lookup(&vars, "RLHF_PYTHON"), None);
    }
}
