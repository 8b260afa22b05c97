//! Records the libtorch version this crate is compiled against (read from the wheel's
//! `torch/version.py` next to `DEP_TCH_LIBTORCH_LIB`, or `LIBTORCH`), so host and plugins can
//! refuse to mix builds against different libtorch versions.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        candidates.push(PathBuf::from(lib).join("..").join("version.py"));
    }
    if let Ok(root) = std::env::var("LIBTORCH") {
        candidates.push(PathBuf::from(&root).join("version.py"));
        candidates.push(PathBuf::from(&root).join("build-version"));
    }
    let mut version = String::from("unknown");
    for c in candidates {
        if let Ok(text) = std::fs::read_to_string(&c) {
            println!("cargo:rerun-if-changed={}", c.display());
            let found = text
                .lines()
                .find_map(|l| l.strip_prefix("__version__ = ").map(|v| v.trim_matches(['\'', '"', ' ']).to_string()))
                .or_else(|| text.lines().next().map(|l| l.trim().to_string()));
            if let Some(v) = found.filter(|v| !v.is_empty()) {
                version = v.split('+').next().unwrap_or(&v).to_string();
                break;
            }
        }
    }
    println!("cargo:rustc-env=RLHF_TORCH_VERSION={version}");
}
