//! Test fixture for the plugin loader's refusals: a real algorithm plugin whose declared
//! [`PluginInfo`] and behaviour are chosen by the environment variable `RLHF_TEST_BAD_INFO`, read
//! at call time so one build serves every case:
//!
//! | value       | effect                                                         |
//! |-------------|----------------------------------------------------------------|
//! | unset / ``  | a normal plugin named `test-bad-info`                          |
//! | `api`       | `api_major` = `API_MAJOR + 1` (another major: refused)         |
//! | `api-minor` | `api_minor` = `API_MINOR + 1` (newer than the host: refused)   |
//! | `torch`     | `torch_version` = `1.0.0`                                      |
//! | `tch`       | `tch_version` = `0.1.0`                                        |
//! | `panic`     | the constructor panics (the export guard returns `Panic`)      |
//! | `loss-panic`| constructs fine; `prepare` and `loss` panic                    |
//! | `nan-loss`  | every other `loss` is NaN (the host must skip those steps)     |
//! | `wrong-count` | declares itself a reward source that returns one score too many |
//!
//! `export_algorithm!` takes the info from `export::info`, so the header is written out here by
//! hand, mirroring `__export_plugin!` in `rlhf-plugin-api`'s `export.rs`.

use rlhf_plugin_api::abi::{AlgorithmBox, HostContext, PluginInfo, PluginKind, PluginModRef, RewardBox};
use rlhf_plugin_api::abi_stable::library::{CheckTypeLayout, LibHeader, RootModuleResult};
use rlhf_plugin_api::abi_stable::std_types::{RResult, RStr};
use rlhf_plugin_api::export;
use rlhf_plugin_api::prelude::*;
use rlhf_plugin_api::{API_MAJOR, API_MINOR};

/// The environment variable that selects the misbehaviour.
pub const ENV: &str = "RLHF_TEST_BAD_INFO";
/// The plugin's declared name.
pub const NAME: &str = "test-bad-info";

/// The current value of [`ENV`] (empty when unset or not UTF-8).
fn mode() -> String {
    std::env::var(ENV).unwrap_or_default()
}

/// The info this plugin declares under the current [`ENV`].
pub fn declared_info() -> PluginInfo {
    let mut info = export::info(
        NAME,
        PluginKind::Algorithm,
        env!("CARGO_PKG_VERSION"),
        "loader test fixture; RLHF_TEST_BAD_INFO=api|api-minor|torch|tch|panic|loss-panic|nan-loss|wrong-count",
    );
    match mode().as_str() {
        "api" => info.api_major = API_MAJOR + 1,
        "api-minor" => info.api_minor = API_MINOR + 1,
        "torch" => info.torch_version = "1.0.0".into(),
        "tch" => info.tch_version = "0.1.0".into(),
        "wrong-count" => info.kind = PluginKind::Reward,
        _ => {}
    }
    info
}

/// A trivial algorithm: zero advantages, loss `0 · Σ logp` (so gradients exist and are zero).
#[derive(Debug)]
pub struct Tiny {
    panic_in_calls: bool,
    nan_loss: bool,
    calls: u64,
}

impl Algorithm for Tiny {
    fn new(_config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        match mode().as_str() {
            "panic" => panic!("{NAME}: constructor panicked on purpose ({ENV}=panic)"),
            m => Ok(Tiny { panic_in_calls: m == "loss-panic", nan_loss: m == "nan-loss", calls: 0 }),
        }
    }

    fn requirements(&self) -> Requirements {
        Requirements::default()
    }

    fn prepare(&mut self, exp: &Experience) -> Result<Prepared, PluginError> {
        if self.panic_in_calls {
            panic!("{NAME}: prepare panicked on purpose ({ENV}=loss-panic)");
        }
        Ok(Prepared { advantages: exp.action_mask.f_zeros_like()?, returns: None, metrics: Vec::new() })
    }

    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput, PluginError> {
        if self.panic_in_calls {
            panic!("{NAME}: loss panicked on purpose ({ENV}=loss-panic)");
        }
        self.calls += 1;
        let scale = if self.nan_loss && self.calls % 2 == 1 { f64::NAN } else { 0.0 };
        let loss = mb.logprobs.f_sum(Kind::Float)?.f_mul_scalar(scale)?;
        Ok(LossOutput { loss, metrics: Vec::new() })
    }
}

// The hand-written equivalent of `export_algorithm!(Tiny, name: "test-bad-info", ...)`, with
// `declared_info` in place of `export::info`.

extern "C" fn rlhf_info() -> PluginInfo {
    declared_info()
}

extern "C" fn rlhf_new_algorithm(config: RStr<'_>, ctx: HostContext) -> RResult<AlgorithmBox, PluginError> {
    export::new_algorithm::<Tiny>(config, ctx, NAME)
}

extern "C" fn rlhf_new_reward(config: RStr<'_>, ctx: HostContext) -> RResult<RewardBox, PluginError> {
    if mode() == "wrong-count" {
        export::new_reward::<OneTooMany>(config, ctx, NAME)
    } else {
        export::unsupported_reward(NAME)
    }
}

/// A broken reward source: one score more than samples (the host must refuse it).
#[derive(Debug)]
pub struct OneTooMany;

impl RewardSource for OneTooMany {
    fn new(_config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        Ok(OneTooMany)
    }

    fn score(&mut self, samples: &[Sample]) -> Result<Scores, PluginError> {
        Ok(Scores { scores: vec![0.0; samples.len() + 1], metrics: Vec::new() })
    }
}

extern "C" fn rlhf_root() -> RootModuleResult {
    rlhf_plugin_api::abi_stable::library::__call_root_module_loader(|| {
        export::root_module(rlhf_info, rlhf_new_algorithm, rlhf_new_reward)
    })
}

/// abi_stable's library header under its fixed symbol (`export::ROOT_MODULE_SYMBOL`).
#[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
pub static RLHF_LIB_HEADER: LibHeader =
    // SAFETY: the constructor returns the `PluginModRef` this header is declared for.
    unsafe { LibHeader::from_constructor::<PluginModRef>(rlhf_root, CheckTypeLayout::Yes) };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_name_matches_the_api() {
        assert_eq!(export::ROOT_MODULE_SYMBOL, "_1as_0lib_1header_0root_bmodule_bloader");
    }

    #[test]
    fn info_follows_the_environment() {
        // One test touches the variable, so tests in this binary do not race on it.
        std::env::remove_var(ENV);
        let info = declared_info();
        assert_eq!(info.name.as_str(), NAME);
        assert_eq!((info.api_major, info.api_minor), (API_MAJOR, API_MINOR));
        assert_eq!(info.torch_version.as_str(), rlhf_plugin_api::TORCH_VERSION);
        std::env::set_var(ENV, "api");
        let info = declared_info();
        assert_eq!((info.api_major, info.api_minor), (API_MAJOR + 1, API_MINOR));
        std::env::set_var(ENV, "api-minor");
        let info = declared_info();
        assert_eq!((info.api_major, info.api_minor), (API_MAJOR, API_MINOR + 1));
        std::env::set_var(ENV, "torch");
        assert_eq!(declared_info().torch_version.as_str(), "1.0.0");
        std::env::set_var(ENV, "tch");
        assert_eq!(declared_info().tch_version.as_str(), "0.1.0");
        std::env::remove_var(ENV);
    }
}
