//! Compiles the c10d shim (`src/shim.cpp`) with torch-sys's own recipe (C++17, the libtorch
//! include dirs, the C++11 ABI libtorch was built with) plus `USE_C10D_GLOO` and the vendored
//! gloo headers that `ProcessGroupGloo.hpp` includes but the torch wheel does not ship.

use std::env;
use std::path::PathBuf;

/// The PyTorch release whose `third_party/gloo` the vendored headers come from.
const PINNED_TORCH: &str = "2.11.";

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=vendor");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Some(libtorch) = env::var_os("LIBTORCH").map(PathBuf::from) else {
        panic!("LIBTORCH is not set: run through `cargo xtask` (which installs libtorch and sets it), or export LIBTORCH=<site-packages>/torch");
    };
    let include = libtorch.join("include");
    let header = include.join("torch/csrc/distributed/c10d/ProcessGroupGloo.hpp");
    if !header.exists() {
        panic!("{}: missing; this libtorch does not ship the c10d headers", header.display());
    }
    // The vendored gloo headers match the gloo commit PyTorch 2.11 builds with; another libtorch
    // may embed another gloo (different class layouts), so refuse rather than miscompile.
    let version = std::fs::read_to_string(libtorch.join("version.py")).unwrap_or_default();
    let found =
        version.lines().find_map(|l| l.strip_prefix("__version__ = ")).map(|v| v.trim_matches(['\'', '"']).to_string());
    match found {
        Some(v) if v.starts_with(PINNED_TORCH) => {}
        other => panic!(
            "core/collective/vendor/gloo is pinned to the gloo of PyTorch {PINNED_TORCH}x, but {} says {}: refresh the vendored headers (see vendor/gloo/README.md)",
            libtorch.join("version.py").display(),
            other.as_deref().unwrap_or("no version")
        ),
    }
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(manifest.join("vendor"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-DUSE_C10D_GLOO")
        .file("src/shim.cpp")
        .compile("rlhf_c10d");
    let lib = env::var("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from).unwrap_or_else(|_| libtorch.join("lib"));
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}
