//! What [`export_algorithm!`](crate::export_algorithm) and [`export_reward!`](crate::export_reward)
//! expand to call. The macros emit abi_stable's library header under its fixed symbol name through
//! `$crate` paths, so a plugin depends on this crate (and tch) only.

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RBox, RResult, RStr};

use crate::abi::{
    AlgorithmBox, AlgorithmObj_TO, EnvBox, EnvInfo, EnvObj_TO, EnvPluginMod, EnvPluginModRef, HostContext, PluginInfo,
    PluginKind, PluginMod, PluginModRef, RewardBox, RewardObj_TO, API_MAJOR, API_MINOR, ENV_API_MAJOR, ENV_API_MINOR,
    TCH_VERSION, TORCH_VERSION,
};
use crate::algorithm::{guard, Algorithm, AlgorithmAdapter, Context};
use crate::environment::{EnvAdapter, Environment};
use crate::error::PluginError;
use crate::reward::{RewardAdapter, RewardSource};

/// abi_stable's mangled name of the library-header static (checked against abi_stable by a test).
#[doc(hidden)]
pub const ROOT_MODULE_SYMBOL: &str = "_1as_0lib_1header_0root_bmodule_bloader";

/// The declaration of a plugin built by this crate.
pub fn info(name: &str, kind: PluginKind, version: &str, description: &str) -> PluginInfo {
    PluginInfo {
        name: name.into(),
        kind,
        version: version.into(),
        description: description.into(),
        api_major: API_MAJOR,
        api_minor: API_MINOR,
        torch_version: TORCH_VERSION.into(),
        tch_version: TCH_VERSION.into(),
    }
}

/// Builds the root module from the three entry points.
pub fn root_module(
    info: extern "C" fn() -> PluginInfo,
    new_algorithm: extern "C" fn(RStr<'_>, HostContext) -> RResult<AlgorithmBox, PluginError>,
    new_reward: extern "C" fn(RStr<'_>, HostContext) -> RResult<RewardBox, PluginError>,
) -> PluginModRef {
    PluginMod { info, new_algorithm, new_reward }.leak_into_prefix()
}

/// Constructs an algorithm behind the ABI object, installing the log bridge first.
pub fn new_algorithm<A: Algorithm>(
    config: RStr<'_>,
    ctx: HostContext,
    name: &'static str,
) -> RResult<AlgorithmBox, PluginError> {
    crate::log::install(ctx.logger, name);
    guard(|| {
        let a = A::new(config.as_str(), &Context::from_abi(&ctx)?)?;
        Ok(AlgorithmObj_TO::from_value(AlgorithmAdapter(a), TD_Opaque))
    })
}

/// Constructs a reward source behind the ABI object, installing the log bridge first.
pub fn new_reward<R: RewardSource>(
    config: RStr<'_>,
    ctx: HostContext,
    name: &'static str,
) -> RResult<RewardBox, PluginError> {
    crate::log::install(ctx.logger, name);
    guard(|| {
        let r = R::new(config.as_str(), &Context::from_abi(&ctx)?)?;
        Ok(RewardObj_TO::from_value(RewardAdapter(r), TD_Opaque))
    })
}

/// The declaration of an environment plugin built by this crate.
pub fn env_info(name: &str, version: &str, description: &str) -> EnvInfo {
    EnvInfo {
        name: name.into(),
        version: version.into(),
        description: description.into(),
        api_major: ENV_API_MAJOR,
        api_minor: ENV_API_MINOR,
        torch_version: TORCH_VERSION.into(),
        tch_version: TCH_VERSION.into(),
    }
}

/// Builds an environment plugin's root module.
pub fn env_root_module(
    info: extern "C" fn() -> EnvInfo,
    new_environment: extern "C" fn(RStr<'_>, HostContext) -> RResult<EnvBox, PluginError>,
) -> EnvPluginModRef {
    EnvPluginMod { info, new_environment }.leak_into_prefix()
}

/// Constructs an environment behind the ABI object, installing the log bridge first.
pub fn new_environment<E: Environment>(
    config: RStr<'_>,
    ctx: HostContext,
    name: &'static str,
) -> RResult<EnvBox, PluginError> {
    crate::log::install(ctx.logger, name);
    guard(|| {
        let e = E::new(config.as_str(), &Context::from_abi(&ctx)?)?;
        Ok(EnvObj_TO::from_value(EnvAdapter(e), TD_Opaque))
    })
}

/// The answer of an algorithm plugin asked for a reward source.
pub fn unsupported_reward(name: &str) -> RResult<RewardBox, PluginError> {
    RResult::RErr(PluginError::unsupported(format!("`{name}` is an algorithm plugin, not a reward source")))
}

/// The answer of a reward plugin asked for an algorithm.
pub fn unsupported_algorithm(name: &str) -> RResult<AlgorithmBox, PluginError> {
    RResult::RErr(PluginError::unsupported(format!("`{name}` is a reward plugin, not an algorithm")))
}

#[doc(hidden)]
pub fn _assert_box(_: RBox<()>) {}

/// Exports an [`Algorithm`] implementation as this cdylib's plugin.
///
/// ```ignore
/// rlhf_plugin_api::export_algorithm!(MyAlgo, name: "my-algo", description: "what it does");
/// ```
#[macro_export]
macro_rules! export_algorithm {
    ($ty:ty, name: $name:literal, description: $desc:expr $(,)?) => {
        $crate::__export_plugin! {
            kind: $crate::abi::PluginKind::Algorithm,
            name: $name,
            description: $desc,
            new_algorithm: |config, ctx| $crate::export::new_algorithm::<$ty>(config, ctx, $name),
            new_reward: |_config, _ctx| $crate::export::unsupported_reward($name),
        }
    };
}

/// Exports a [`RewardSource`] implementation as this cdylib's plugin.
///
/// ```ignore
/// rlhf_plugin_api::export_reward!(MyReward, name: "my-reward", description: "what it does");
/// ```
#[macro_export]
macro_rules! export_reward {
    ($ty:ty, name: $name:literal, description: $desc:expr $(,)?) => {
        $crate::__export_plugin! {
            kind: $crate::abi::PluginKind::Reward,
            name: $name,
            description: $desc,
            new_algorithm: |_config, _ctx| $crate::export::unsupported_algorithm($name),
            new_reward: |config, ctx| $crate::export::new_reward::<$ty>(config, ctx, $name),
        }
    };
}

/// Exports an [`Environment`] implementation as this cdylib's plugin (an environment plugin has
/// its own root module, [`EnvPluginModRef`]).
///
/// ```ignore
/// rlhf_plugin_api::export_environment!(MyEnv, name: "my-env", description: "what it does");
/// ```
#[macro_export]
macro_rules! export_environment {
    ($ty:ty, name: $name:literal, description: $desc:expr $(,)?) => {
        const _: () = {
            use $crate::abi::{EnvBox, EnvInfo, HostContext};
            use $crate::abi_stable::std_types::{RResult, RStr};
            use $crate::PluginError;

            extern "C" fn __rlhf_env_info() -> EnvInfo {
                $crate::export::env_info($name, env!("CARGO_PKG_VERSION"), $desc)
            }
            extern "C" fn __rlhf_new_environment(config: RStr<'_>, ctx: HostContext) -> RResult<EnvBox, PluginError> {
                $crate::export::new_environment::<$ty>(config, ctx, $name)
            }
            extern "C" fn __rlhf_root() -> $crate::abi_stable::library::RootModuleResult {
                $crate::abi_stable::library::__call_root_module_loader(|| {
                    $crate::export::env_root_module(__rlhf_env_info, __rlhf_new_environment)
                })
            }
            #[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
            pub static __RLHF_LIB_HEADER: $crate::abi_stable::library::LibHeader = unsafe {
                $crate::abi_stable::library::LibHeader::from_constructor::<$crate::abi::EnvPluginModRef>(
                    __rlhf_root,
                    $crate::abi_stable::library::CheckTypeLayout::Yes,
                )
            };
        };
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __export_plugin {
    (
        kind: $kind:expr,
        name: $name:literal,
        description: $desc:expr,
        new_algorithm: |$ac:ident, $actx:ident| $anew:expr,
        new_reward: |$rc:ident, $rctx:ident| $rnew:expr,
    ) => {
        const _: () = {
            use $crate::abi::{AlgorithmBox, HostContext, PluginInfo, RewardBox};
            use $crate::abi_stable::std_types::{RResult, RStr};
            use $crate::PluginError;

            extern "C" fn __rlhf_info() -> PluginInfo {
                $crate::export::info($name, $kind, env!("CARGO_PKG_VERSION"), $desc)
            }
            extern "C" fn __rlhf_new_algorithm(
                $ac: RStr<'_>,
                $actx: HostContext,
            ) -> RResult<AlgorithmBox, PluginError> {
                $anew
            }
            extern "C" fn __rlhf_new_reward($rc: RStr<'_>, $rctx: HostContext) -> RResult<RewardBox, PluginError> {
                $rnew
            }
            extern "C" fn __rlhf_root() -> $crate::abi_stable::library::RootModuleResult {
                $crate::abi_stable::library::__call_root_module_loader(|| {
                    $crate::export::root_module(__rlhf_info, __rlhf_new_algorithm, __rlhf_new_reward)
                })
            }
            #[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
            pub static __RLHF_LIB_HEADER: $crate::abi_stable::library::LibHeader = unsafe {
                $crate::abi_stable::library::LibHeader::from_constructor::<$crate::abi::PluginModRef>(
                    __rlhf_root,
                    $crate::abi_stable::library::CheckTypeLayout::Yes,
                )
            };
        };
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn root_module_symbol_matches_abi_stable() {
        assert_eq!(super::ROOT_MODULE_SYMBOL, abi_stable::library::ROOT_MODULE_LOADER_NAME);
    }
}
