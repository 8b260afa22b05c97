//! Sanity check of the loader test fixtures themselves: loads the built `.so` files of
//! `not-a-plugin`, `bad-layout` and `bad-info` from this profile's target directory with
//! abi_stable, as the host does, and checks that each fails (or misbehaves) the way it is meant to.
//! Builds nothing: run `cargo build -p rlhf-test-plugin-not-a-plugin -p rlhf-test-plugin-bad-layout
//! -p rlhf-test-plugin-bad-info` first (`cargo xtask test` builds the whole workspace).

use std::path::PathBuf;
use std::sync::Mutex;

use abi_stable::library::{lib_header_from_path, LibraryError, RootModule};
use abi_stable::std_types::{RResult, RStr};
use rlhf_plugin_api::abi::{keys, HostContext, HostLogger, LogLevel, PluginModRef, PreparedAbi};
use rlhf_plugin_api::tch::{Device, Kind, Tensor};
use rlhf_plugin_api::{Context, ErrorKind, Experience, Minibatch, PluginError, PluginKind, API_MAJOR, API_MINOR};

/// `bad-info` reads `RLHF_TEST_BAD_INFO` at call time, and `dlopen` reads the environment too;
/// every test holds this lock so none reads it while another sets it.
static ENV_LOCK: Mutex<()> = Mutex::new(());

fn env_lock() -> std::sync::MutexGuard<'static, ()> {
    ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The value of an `ROk`, or a panic showing the plugin's error.
fn ok<T>(r: RResult<T, PluginError>) -> T {
    match r {
        RResult::ROk(v) => v,
        RResult::RErr(e) => panic!("plugin error: {e}"),
    }
}

/// The error of an `RErr`.
fn err<T>(r: RResult<T, PluginError>, what: &str) -> PluginError {
    match r {
        RResult::ROk(_) => panic!("{what}"),
        RResult::RErr(e) => e,
    }
}

/// `target/<profile>/`: the test binary lives in its `deps/`.
fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test binary");
    exe.parent().and_then(|deps| deps.parent()).expect("test binary under target/<profile>/deps").to_path_buf()
}

/// The built cdylib of `package`, or a panic saying how to build it.
fn cdylib(package: &str) -> PathBuf {
    let file = format!("{}{}{}", std::env::consts::DLL_PREFIX, package.replace('-', "_"), std::env::consts::DLL_SUFFIX);
    let path = target_profile_dir().join(file);
    assert!(path.is_file(), "{} is missing: build it first with `cargo build -p {package}`", path.display());
    path
}

fn load(package: &str) -> Result<PluginModRef, LibraryError> {
    lib_header_from_path(&cdylib(package))?.init_root_module::<PluginModRef>()
}

extern "C" fn log(level: LogLevel, plugin: RStr<'_>, message: RStr<'_>) {
    eprintln!("[{level:?} {plugin}] {message}");
}

fn host_context() -> HostContext {
    let ctx = Context { device: "cpu".into(), seed: 0, samples_per_prompt: 2 };
    HostContext { logger: HostLogger { log }, context_json: ctx.to_json().into() }
}

/// The `advantages` tensor of a `prepare` result.
fn advantages(prepared: PreparedAbi) -> Tensor {
    let found = prepared.tensors.into_iter().find(|t| t.name.as_str() == keys::ADVANTAGES);
    found.expect("prepare returns `advantages`").tensor.into_tensor()
}

#[test]
fn not_a_plugin_is_refused() {
    let _env = env_lock();
    let Err(e) = load("rlhf-test-plugin-not-a-plugin") else { panic!("a plain cdylib must not load as a plugin") };
    assert!(matches!(e, LibraryError::GetSymbolError { .. }), "{e}");
}

#[test]
fn bad_layout_impersonates_the_api_version() {
    assert_eq!(
        rlhf_test_plugin_bad_layout::BadModRef::VERSION_STRINGS.version,
        PluginModRef::VERSION_STRINGS.version,
        "bad-layout must declare rlhf-plugin-api's version, or the loader refuses it for the version instead"
    );
}

#[test]
fn bad_layout_fails_the_layout_check() {
    let _env = env_lock();
    let Err(e) = load("rlhf-test-plugin-bad-layout") else { panic!("a different root-module layout must be refused") };
    assert!(matches!(e, LibraryError::AbiInstability(_)), "{e}");
    let text = e.to_string();
    assert!(text.to_lowercase().contains("layout") || text.contains("incompatib"), "{text}");
}

#[test]
fn bad_info_declares_what_the_environment_says() {
    let _env = env_lock();
    let module = load("rlhf-test-plugin-bad-info").unwrap_or_else(|e| panic!("bad-info must load: {e}"));
    let info = || (module.info())();

    std::env::remove_var("RLHF_TEST_BAD_INFO");
    let normal = info();
    assert_eq!(normal.name.as_str(), "test-bad-info");
    assert_eq!(normal.kind, PluginKind::Algorithm);
    assert_eq!((normal.api_major, normal.api_minor), (API_MAJOR, API_MINOR));
    assert_eq!(normal.torch_version.as_str(), rlhf_plugin_api::TORCH_VERSION);
    assert_eq!(normal.tch_version.as_str(), rlhf_plugin_api::TCH_VERSION);

    std::env::set_var("RLHF_TEST_BAD_INFO", "api");
    assert_eq!(info().api_major, API_MAJOR + 1);
    std::env::set_var("RLHF_TEST_BAD_INFO", "api-minor");
    assert_eq!((info().api_major, info().api_minor), (API_MAJOR, API_MINOR + 1));
    std::env::set_var("RLHF_TEST_BAD_INFO", "torch");
    assert_eq!(info().torch_version.as_str(), "1.0.0");
    std::env::set_var("RLHF_TEST_BAD_INFO", "tch");
    assert_eq!(info().tch_version.as_str(), "0.1.0");
    std::env::remove_var("RLHF_TEST_BAD_INFO");
}

#[test]
fn bad_info_panics_come_back_as_errors() {
    let _env = env_lock();
    let module = load("rlhf-test-plugin-bad-info").unwrap_or_else(|e| panic!("bad-info must load: {e}"));

    std::env::set_var("RLHF_TEST_BAD_INFO", "panic");
    let result = (module.new_algorithm())(RStr::from_str("{}"), host_context());
    std::env::remove_var("RLHF_TEST_BAD_INFO");
    let e = err(result, "the constructor should have panicked");
    assert_eq!(e.kind, ErrorKind::Panic, "{e}");
    assert!(e.message.contains("constructor panicked on purpose"), "{e}");

    // Asked for a reward source, an algorithm plugin says it has none.
    let e = err((module.new_reward())(RStr::from_str("{}"), host_context()), "bad-info is not a reward plugin");
    assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");

    // Unset: the tiny algorithm works through the ABI.
    let rewards = Tensor::from_slice(&[1f32, 0.]);
    let logprobs = Tensor::full([2, 3], -1.0, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mask = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
    let group_ids = Tensor::from_slice(&[0i64, 0]);
    let experience = Experience {
        rewards: rewards.shallow_clone(),
        logprobs: logprobs.shallow_clone(),
        ref_logprobs: None,
        values: None,
        action_mask: mask.shallow_clone(),
        group_ids: group_ids.shallow_clone(),
        step: 0,
        behavior_logprobs: None,
    };
    let minibatch = Minibatch {
        logprobs: logprobs.shallow_clone(),
        old_logprobs: logprobs.detach(),
        ref_logprobs: None,
        values: None,
        old_values: None,
        advantages: mask.shallow_clone(),
        returns: None,
        action_mask: mask.shallow_clone(),
        entropy: None,
        rewards: rewards.shallow_clone(),
        step: 0,
        epoch: 0,
        accumulation_steps: 1,
        step_tokens: 0.0,
        step_rows: 0.0,
        behavior_logprobs: None,
    };
    let mut algo = ok((module.new_algorithm())(RStr::from_str("{}"), host_context()));
    assert_eq!(algo.requirements().len(), 0, "bad-info requires nothing");
    let prepared = ok(experience.with_abi(|i| algo.prepare(i)));
    assert_eq!(advantages(prepared).abs().sum(Kind::Float).double_value(&[]), 0.0);
    let loss = ok(minibatch.with_abi(|i| algo.loss(i))).loss.into_tensor();
    loss.backward();
    assert_eq!(logprobs.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);

    // loss-panic: constructs, then every call reports the panic.
    std::env::set_var("RLHF_TEST_BAD_INFO", "loss-panic");
    let result = (module.new_algorithm())(RStr::from_str("{}"), host_context());
    std::env::remove_var("RLHF_TEST_BAD_INFO");
    let mut algo = ok(result);
    let e = err(experience.with_abi(|i| algo.prepare(i)), "prepare should have panicked");
    assert_eq!(e.kind, ErrorKind::Panic, "{e}");
    assert!(e.message.contains("prepare panicked on purpose"), "{e}");
    let e = err(minibatch.with_abi(|i| algo.loss(i)), "loss should have panicked");
    assert_eq!(e.kind, ErrorKind::Panic, "{e}");
    assert!(e.message.contains("loss panicked on purpose"), "{e}");
}
