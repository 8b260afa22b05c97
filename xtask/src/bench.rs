//! `cargo xtask bench NAME ARGS...`: the `rlhf` CLI measures; this only builds
//! it with `--release` and forwards to `rlhf bench NAME ARGS...`.

use anyhow::Result;

use crate::{cmd::Profile, rlhf, setup};

pub(crate) fn run(bench: &str, args: &[String]) -> Result<()> {
    let torch = setup::setup()?;
    let args: Vec<String> = ["bench".to_owned(), bench.to_owned()].into_iter().chain(args.iter().cloned()).collect();
    rlhf::exec_rlhf(&torch, Profile::Release, &args)
}
