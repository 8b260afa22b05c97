//! Embeds an rpath to the libtorch this binary was built against, so `rlhf` runs without
//! LD_LIBRARY_PATH, and compiles the one-function C++ shim that asks libtorch which CPU
//! capability its kernels dispatch to (`src/aten_capability.cpp`, used by `src/machine.rs`).
fn main() {
    println!("cargo:rerun-if-changed=src/aten_capability.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        println!("cargo:rustc-env=RLHF_LIBTORCH_LIB={lib}");
    }
    // The C++ ABI libtorch was built with (torch-sys's default, as core/collective uses).
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .file("src/aten_capability.cpp")
        .compile("rlhf_aten_capability");
}
