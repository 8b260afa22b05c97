//! The plugin loader: scans `plugin_dirs` for shared libraries, loads each with
//! `lib_header_from_path` and [`init_module`] (abi_stable's checks, oriented for older plugins in a
//! newer host), checks what it declares against the host and
//! indexes accepted plugins by their declared name. Refused files are kept with the reason, so a
//! missing plugin's error can say why a candidate was not taken.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use abi_stable::abi_stability::abi_checking::{check_layout_compatibility_with_globals, CheckingGlobals};
use abi_stable::library::{lib_header_from_path, LibHeader, LibraryError, RootModule};
use abi_stable::prefix_type::PrefixRefTrait;
use abi_stable::sabi_types::VersionNumber;
use abi_stable::std_types::{RBoxError, RStr};
use abi_stable::StableAbi;
use rlhf_plugin_api::abi::{EnvPluginModRef, HostContext, HostLogger, LogLevel, PluginModRef};
use rlhf_plugin_api::{
    Context, PluginKind, API_MAJOR, API_MINOR, ENV_API_MAJOR, ENV_API_MINOR, TCH_VERSION, TORCH_VERSION,
};

use crate::error::{Result, TrainerError};

/// What a loaded plugin declared, plus where it came from.
#[derive(Debug, Clone)]
pub struct PluginMeta {
    pub name: String,
    pub kind: PluginKind,
    pub version: String,
    pub description: String,
    pub path: PathBuf,
}

/// A plugin accepted by the loader.
#[derive(Clone)]
pub struct LoadedPlugin {
    pub meta: PluginMeta,
    pub(crate) module: PluginModRef,
}

/// An environment plugin accepted by the loader (its own root module, [`EnvPluginModRef`]).
#[derive(Clone)]
pub struct LoadedEnv {
    /// What it declared.
    pub name: String,
    pub version: String,
    pub description: String,
    pub path: PathBuf,
    pub(crate) module: EnvPluginModRef,
}

/// One accepted library: an algorithm or reward plugin, or an environment plugin.
enum Loaded {
    Plugin(LoadedPlugin),
    Env(LoadedEnv),
}

impl Loaded {
    fn name(&self) -> &str {
        match self {
            Loaded::Plugin(p) => &p.meta.name,
            Loaded::Env(e) => &e.name,
        }
    }

    fn path(&self) -> &Path {
        match self {
            Loaded::Plugin(p) => &p.meta.path,
            Loaded::Env(e) => &e.path,
        }
    }
}

/// All plugins found in the configured directories.
#[derive(Default)]
pub struct PluginRegistry {
    plugins: BTreeMap<String, LoadedPlugin>,
    environments: BTreeMap<String, LoadedEnv>,
    /// Files that were not accepted, with the reason.
    pub refused: Vec<(PathBuf, String)>,
    /// The directories scanned, in order.
    dirs: Vec<PathBuf>,
}

extern "C" fn host_log(level: LogLevel, plugin: RStr<'_>, message: RStr<'_>) {
    let level = match level {
        LogLevel::Error => tracing::Level::ERROR,
        LogLevel::Warn => tracing::Level::WARN,
        LogLevel::Info => tracing::Level::INFO,
        LogLevel::Debug => tracing::Level::DEBUG,
        LogLevel::Trace => tracing::Level::TRACE,
    };
    crate::plugin_log::emit(plugin.as_str(), level, message.as_str());
}

/// The context every plugin constructor receives.
pub fn host_context(device: &str, seed: u64, samples_per_prompt: u32) -> HostContext {
    let ctx = Context { device: device.into(), seed, samples_per_prompt };
    HostContext { logger: HostLogger { log: host_log }, context_json: ctx.to_json().into() }
}

/// The directory of the running executable: where cargo puts the workspace's plugin libraries.
pub fn default_plugin_dirs() -> Vec<PathBuf> {
    std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).into_iter().collect()
}

fn describe(e: &LibraryError) -> String {
    match e {
        LibraryError::OpenError { err, .. } => format!("not a loadable library ({err})"),
        LibraryError::GetSymbolError { .. } => "not an rlhf plugin (no abi_stable root module)".into(),
        LibraryError::IncompatibleVersionNumber { expected_version, actual_version, .. } => format!(
            "interface version mismatch: the plugin was built against plugin-api {actual_version}, this host has {expected_version}"
        ),
        LibraryError::AbiInstability(report) => {
            // abi_stable's report ends with the informative lines ("Error:mismatched type ...").
            let text = report.to_string();
            let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            let detail = lines
                .iter()
                .rev()
                .find(|l| l.contains("mismatched") || l.starts_with("Error"))
                .or(lines.last())
                .map(|l| l.trim_start_matches("Error:").trim())
                .unwrap_or("");
            format!("abi layout mismatch with this host's plugin-api ({detail})")
        }
        other => {
            let text = other.to_string();
            format!("refused by abi_stable: {}", text.lines().next().unwrap_or(""))
        }
    }
}

/// The root module of a plugin library, after abi_stable's version and layout checks, oriented for
/// this interface's promise: a plugin of ABI 4.m loads into every host 4.n with n >= m.
///
/// abi_stable's own `init_root_module` assumes the opposite (a library at least as new as its
/// loader): it refuses a plugin whose vtables have fewer methods than the host's, i.e. every older
/// plugin once a minor appends an optional method. So the plugin's layout is checked as the
/// interface and the host's as the implementation: every type, field and method the plugin has,
/// the host has with the same layout, and the host may have more (the appended methods, whose
/// defaults run for an older plugin's object). A newer plugin (more methods than the host) passes
/// the usual direction instead, and its declared `api_minor` refuses it in [`load_file`] with a
/// clear message. Each check gets its own `CheckingGlobals`: abi_stable's process-wide map merges
/// what it learnt about the prefix types of every library checked, and once a 4.0 plugin is in it,
/// it refuses every 4.1 plugin checked after it. Plugins never exchange objects with each other,
/// so there is nothing to keep consistent across them.
fn init_module<M: RootModule + StableAbi + PrefixRefTrait>(
    header: &'static LibHeader,
) -> std::result::Result<M, LibraryError> {
    // The crate version is 0.MAJOR.x (abi.rs): the same 0.MAJOR, whatever the patch.
    let expected = VersionNumber::new(M::VERSION_STRINGS)?;
    let actual = VersionNumber::new(header.version_strings())?;
    if (expected.major, expected.minor) != (actual.major, actual.minor) {
        return Err(LibraryError::IncompatibleVersionNumber {
            library_name: M::NAME,
            expected_version: expected,
            actual_version: actual,
        });
    }
    let host = <M as StableAbi>::LAYOUT;
    if let Some(plugin) = header.layout() {
        if let Err(older) = check_layout_compatibility_with_globals(plugin, host, &CheckingGlobals::new()) {
            if check_layout_compatibility_with_globals(host, plugin, &CheckingGlobals::new()).is_err() {
                return Err(LibraryError::AbiInstability(RBoxError::new(older).to_formatted_error()));
            }
        }
    }
    // SAFETY: the layout of the library's root module was checked against `M` above (one exported
    // without a layout constant is trusted, as abi_stable's `init_root_module` does).
    unsafe { header.unchecked_layout::<M>() }.map_err(|e| e.into_library_error::<M>())
}

/// Whether the library exports an environment plugin's root module: its layout's full type
/// (`PrefixRef<'a, EnvPluginMod>`; the plain name is `PrefixRef` for every root module).
fn is_environment(header: &LibHeader) -> bool {
    let env = <EnvPluginModRef as StableAbi>::LAYOUT.full_type().to_string();
    header.layout().is_some_and(|l| l.full_type().to_string() == env)
}

/// Loads one file of any kind; `Err` is the reason it was refused.
fn load_any(path: &Path) -> std::result::Result<Loaded, String> {
    let header = lib_header_from_path(path).map_err(|e| describe(&e))?;
    if is_environment(header) {
        return load_env(header, path).map(Loaded::Env);
    }
    load_file(path).map(Loaded::Plugin)
}

/// Checks an environment plugin's declaration against this host.
fn load_env(header: &'static LibHeader, path: &Path) -> std::result::Result<LoadedEnv, String> {
    let module: EnvPluginModRef = init_module(header).map_err(|e| describe(&e))?;
    let info = (module.info())();
    if info.api_major != ENV_API_MAJOR || info.api_minor > ENV_API_MINOR {
        return Err(format!(
            "interface version mismatch: environment plugin `{}` was built against environment ABI {}.{}, this host \
             has {ENV_API_MAJOR}.{ENV_API_MINOR}",
            info.name, info.api_major, info.api_minor
        ));
    }
    check_versions(&info.name, info.torch_version.as_str(), info.tch_version.as_str())?;
    Ok(LoadedEnv {
        name: info.name.into(),
        version: info.version.into(),
        description: info.description.into(),
        path: path.to_path_buf(),
        module,
    })
}

/// The libtorch and tch versions a plugin was built with must be this host's.
fn check_versions(name: &str, torch: &str, tch: &str) -> std::result::Result<(), String> {
    if torch != TORCH_VERSION {
        return Err(format!(
            "torch version mismatch: plugin `{name}` was built against libtorch {torch}, this host against {TORCH_VERSION}"
        ));
    }
    if tch != TCH_VERSION {
        return Err(format!(
            "tch version mismatch: plugin `{name}` was built with tch {tch}, this host with {TCH_VERSION}"
        ));
    }
    Ok(())
}

/// Loads one algorithm or reward plugin file; `Err` is the reason it was refused.
pub fn load_file(path: &Path) -> std::result::Result<LoadedPlugin, String> {
    let header = lib_header_from_path(path).map_err(|e| describe(&e))?;
    if is_environment(header) {
        return Err("an environment plugin, not an algorithm or reward plugin".into());
    }
    let module: PluginModRef = init_module(header).map_err(|e| describe(&e))?;
    let info = (module.info())();
    // Same major, and a minor no newer than ours: a newer host appends only what older plugins
    // can ignore (see plugin-api's `abi` docs); a newer plugin may need inputs this host lacks.
    if info.api_major != API_MAJOR {
        return Err(format!(
            "interface version mismatch: plugin `{}` was built against plugin-api ABI {}.{}, this host has {API_MAJOR}.{API_MINOR} (another major: rebuild the plugin against plugin-api {API_MAJOR}.x)",
            info.name, info.api_major, info.api_minor
        ));
    }
    if info.api_minor > API_MINOR {
        return Err(format!(
            "interface version mismatch: plugin `{}` was built against plugin-api ABI {}.{}, this host has {API_MAJOR}.{API_MINOR} (a plugin needs a host at least as new as its ABI minor)",
            info.name, info.api_major, info.api_minor
        ));
    }
    check_versions(&info.name, info.torch_version.as_str(), info.tch_version.as_str())?;
    Ok(LoadedPlugin {
        meta: PluginMeta {
            name: info.name.into(),
            kind: info.kind,
            version: info.version.into(),
            description: info.description.into(),
            path: path.to_path_buf(),
        },
        module,
    })
}

fn is_shared_library(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "so" || e == "dylib" || e == "dll")
}

impl PluginRegistry {
    /// Scans each directory (not recursively) for shared libraries and loads them. Two plugins
    /// declaring one name are both refused.
    pub fn scan(dirs: &[PathBuf]) -> Result<Self> {
        let mut reg = PluginRegistry { dirs: dirs.to_vec(), ..PluginRegistry::default() };
        let mut seen = std::collections::HashSet::new();
        let mut by_name: BTreeMap<String, Vec<Loaded>> = BTreeMap::new();
        for dir in dirs {
            let entries = std::fs::read_dir(dir).map_err(|e| {
                TrainerError::Plugin(format!("plugin_dirs: {}: cannot read directory ({e})", dir.display()))
            })?;
            let mut files: Vec<PathBuf> =
                entries.flatten().map(|e| e.path()).filter(|p| p.is_file() && is_shared_library(p)).collect();
            files.sort();
            for path in files {
                let canonical = path.canonicalize().unwrap_or_else(|_| path.clone());
                if !seen.insert(canonical) {
                    continue;
                }
                match load_any(&path) {
                    Ok(p) => by_name.entry(p.name().to_string()).or_default().push(p),
                    Err(reason) => {
                        tracing::debug!("plugin loader: refused {}: {reason}", path.display());
                        reg.refused.push((path, reason));
                    }
                }
            }
        }
        for (name, mut found) in by_name {
            if found.len() == 1 {
                match found.remove(0) {
                    Loaded::Plugin(p) => reg.plugins.insert(name, p).map(|_| ()),
                    Loaded::Env(e) => reg.environments.insert(name, e).map(|_| ()),
                };
            } else {
                let files: Vec<String> = found.iter().map(|p| p.path().display().to_string()).collect();
                for p in found {
                    reg.refused.push((
                        p.path().to_path_buf(),
                        format!("two plugins declare the name `{name}`: {}", files.join(" and ")),
                    ));
                }
            }
        }
        Ok(reg)
    }

    /// Accepted plugins, by name.
    pub fn plugins(&self) -> impl Iterator<Item = &PluginMeta> {
        self.plugins.values().map(|p| &p.meta)
    }

    /// Accepted environment plugins, by name.
    pub fn environments(&self) -> impl Iterator<Item = &LoadedEnv> {
        self.environments.values()
    }

    /// The environment plugin `name`, or an error listing those available and the refusals.
    pub fn environment(&self, name: &str) -> Result<&LoadedEnv> {
        if let Some(e) = self.environments.get(name) {
            return Ok(e);
        }
        if let Some(p) = self.plugins.get(name) {
            return Err(TrainerError::Plugin(format!(
                "`{name}` ({}) is a {} plugin, not an environment plugin",
                p.meta.path.display(),
                p.meta.kind
            )));
        }
        let available: Vec<&str> = self.environments.keys().map(String::as_str).collect();
        let available = if available.is_empty() { "(none)".to_string() } else { available.join(", ") };
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        let mut msg = format!(
            "no environment plugin named `{name}`; available: {available} (plugin_dirs scanned: {})",
            dirs.join(", ")
        );
        let refused: Vec<String> = self
            .refused
            .iter()
            .filter(|(p, r)| r.contains(&format!("`{name}`")) || p.to_string_lossy().contains(&name.replace('-', "_")))
            .map(|(p, r)| format!("{}: {r}", p.display()))
            .collect();
        if !refused.is_empty() {
            msg.push_str(&format!("; refused: {}", refused.join("; ")));
        }
        Err(TrainerError::Plugin(msg))
    }

    /// The directories scanned.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Names of accepted plugins of a kind.
    pub fn names(&self, kind: PluginKind) -> Vec<String> {
        self.plugins.values().filter(|p| p.meta.kind == kind).map(|p| p.meta.name.clone()).collect()
    }

    /// The plugin `name` of `kind`, or an error listing what is available and what was refused.
    pub fn get(&self, name: &str, kind: PluginKind) -> Result<&LoadedPlugin> {
        match self.plugins.get(name) {
            Some(p) if p.meta.kind == kind => Ok(p),
            None if self.environments.contains_key(name) => Err(TrainerError::Plugin(format!(
                "`{name}` ({}) is an environment plugin, not a {kind} plugin (environments go in [environment])",
                self.environments[name].path.display()
            ))),
            Some(p) => Err(TrainerError::Plugin(format!(
                "`{name}` ({}) is a {} plugin, not a {kind} plugin",
                p.meta.path.display(),
                p.meta.kind
            ))),
            None => {
                let available = self.names(kind);
                let available = if available.is_empty() { "(none)".to_string() } else { available.join(", ") };
                let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
                let dirs = if dirs.is_empty() { "(none)".to_string() } else { dirs.join(", ") };
                let mut msg =
                    format!("no {kind} plugin named `{name}`; available: {available} (plugin_dirs scanned: {dirs})");
                let related = |(p, r): &&(PathBuf, String)| {
                    r.contains(&format!("`{name}`")) || p.to_string_lossy().contains(&name.replace('-', "_"))
                };
                // The refusals that may concern `name`; with no plugin of this kind at all, every one.
                let mut refused: Vec<&(PathBuf, String)> = self.refused.iter().filter(related).collect();
                if refused.is_empty() && self.names(kind).is_empty() {
                    refused = self.refused.iter().collect();
                }
                if !refused.is_empty() {
                    let refused: Vec<String> = refused.iter().map(|(p, r)| format!("{}: {r}", p.display())).collect();
                    msg.push_str(&format!("; refused: {}", refused.join("; ")));
                }
                Err(TrainerError::Plugin(msg))
            }
        }
    }
}
