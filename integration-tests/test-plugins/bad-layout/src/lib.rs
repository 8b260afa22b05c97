//! Test fixture for the plugin loader's refusals: a genuine abi_stable library that exports a root
//! module under the usual symbol and the plugin API's module name (`rlhf_plugin`, same version),
//! but whose root-module type has a different layout from `PluginMod` — as a plugin built against
//! an incompatible `rlhf-plugin-api` would. Loading it as `PluginModRef` must fail abi_stable's
//! layout check before anything in it is called.

use abi_stable::library::{CheckTypeLayout, LibHeader, RootModule, RootModuleResult};
use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::RString;
use abi_stable::{declare_root_module_statics, StableAbi};

/// The package version of `rlhf-plugin-api` this fixture impersonates.
pub const PLUGIN_API_VERSION: &str = "0.4.0";

/// Not `PluginMod`: `info` returns a string instead of a `PluginInfo`, and the constructors are
/// missing.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = BadModRef)))]
#[sabi(missing_field(panic))]
pub struct BadMod {
    /// A name, but not in the shape the host expects.
    pub info: extern "C" fn() -> RString,
    /// A field `PluginMod` does not have.
    #[sabi(last_prefix_field)]
    pub flags: u64,
}

impl RootModule for BadModRef {
    declare_root_module_statics! {BadModRef}
    const BASE_NAME: &'static str = "rlhf_plugin";
    const NAME: &'static str = "rlhf_plugin";
    // The version of `rlhf-plugin-api` (`0.MAJOR.0`, checked by `tests/load.rs`), so the loader
    // gets past abi_stable's version check to the layout check.
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(PLUGIN_API_VERSION);
}

extern "C" fn info() -> RString {
    "test-bad-layout".into()
}

extern "C" fn root() -> RootModuleResult {
    abi_stable::library::__call_root_module_loader(|| BadMod { info, flags: 0 }.leak_into_prefix())
}

/// abi_stable's library header under its fixed symbol, declaring [`BadModRef`].
#[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
pub static LIB_HEADER: LibHeader =
    // SAFETY: the constructor returns the `BadModRef` this header is declared for.
    unsafe { LibHeader::from_constructor::<BadModRef>(root, CheckTypeLayout::Yes) };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_is_well_formed_on_its_own() {
        let m = BadMod { info, flags: 7 }.leak_into_prefix();
        assert_eq!((m.info())().as_str(), "test-bad-layout");
        assert_eq!(m.flags(), 7);
    }
}
