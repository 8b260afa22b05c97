//! Embeds an rpath to the libtorch this binary was built against, so `rlhf` runs without LD_LIBRARY_PATH.
fn main() {
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        println!("cargo:rustc-env=RLHF_LIBTORCH_LIB={lib}");
    }
}
