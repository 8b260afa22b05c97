//! The plugin loader: scans `plugin_dirs` for shared libraries, loads each with
//! `lib_header_from_path(..)?.init_root_module()`, checks what it declares against the host and
//! indexes accepted plugins by their declared name. Refused files are kept with the reason, so a
//! missing plugin's error can say why a candidate was not taken.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use abi_stable::library::{lib_header_from_path, LibraryError};
use abi_stable::std_types::{RResult, RStr, RVec};
use rlhf_plugin_api::abi::{
    AlgorithmBox, ExperienceAbi, HostContext, HostLogger, LogLevel, LossAbi, MinibatchAbi, PluginModRef, PreparedAbi,
    RewardBox, SampleAbi, ScoresAbi,
};
use rlhf_plugin_api::{PluginError, PluginKind, Requirements, API_VERSION, TCH_VERSION, TORCH_VERSION};

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
    module: PluginModRef,
}

/// All plugins found in the configured directories.
#[derive(Default)]
pub struct PluginRegistry {
    plugins: BTreeMap<String, LoadedPlugin>,
    /// Files that were not accepted, with the reason.
    pub refused: Vec<(PathBuf, String)>,
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
    HostContext { logger: HostLogger { log: host_log }, device: device.into(), seed, samples_per_prompt }
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

/// Loads one file; `Err` is the reason it was refused.
pub fn load_file(path: &Path) -> std::result::Result<LoadedPlugin, String> {
    let header = lib_header_from_path(path).map_err(|e| describe(&e))?;
    let module = header.init_root_module::<PluginModRef>().map_err(|e| describe(&e))?;
    let info = (module.info())();
    if info.api_version != API_VERSION {
        return Err(format!(
            "interface version mismatch: plugin `{}` declares plugin-api ABI {}, this host has {API_VERSION}",
            info.name, info.api_version
        ));
    }
    if info.torch_version.as_str() != TORCH_VERSION {
        return Err(format!(
            "torch version mismatch: plugin `{}` was built against libtorch {}, this host against {TORCH_VERSION}",
            info.name, info.torch_version
        ));
    }
    if info.tch_version.as_str() != TCH_VERSION {
        return Err(format!(
            "tch version mismatch: plugin `{}` was built with tch {}, this host with {TCH_VERSION}",
            info.name, info.tch_version
        ));
    }
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
        let mut reg = PluginRegistry::default();
        let mut seen = std::collections::HashSet::new();
        let mut by_name: BTreeMap<String, Vec<LoadedPlugin>> = BTreeMap::new();
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
                match load_file(&path) {
                    Ok(p) => by_name.entry(p.meta.name.clone()).or_default().push(p),
                    Err(reason) => {
                        tracing::debug!("plugin loader: refused {}: {reason}", path.display());
                        reg.refused.push((path, reason));
                    }
                }
            }
        }
        for (name, mut found) in by_name {
            if found.len() == 1 {
                reg.plugins.insert(name, found.remove(0));
            } else {
                let files: Vec<String> = found.iter().map(|p| p.meta.path.display().to_string()).collect();
                for p in found {
                    reg.refused.push((
                        p.meta.path.clone(),
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

    /// Names of accepted plugins of a kind.
    pub fn names(&self, kind: PluginKind) -> Vec<String> {
        self.plugins.values().filter(|p| p.meta.kind == kind).map(|p| p.meta.name.clone()).collect()
    }

    /// The plugin `name` of `kind`, or an error listing what is available and what was refused.
    pub fn get(&self, name: &str, kind: PluginKind) -> Result<&LoadedPlugin> {
        match self.plugins.get(name) {
            Some(p) if p.meta.kind == kind => Ok(p),
            Some(p) => Err(TrainerError::Plugin(format!(
                "`{name}` ({}) is a {} plugin, not a {kind} plugin",
                p.meta.path.display(),
                p.meta.kind
            ))),
            None => {
                let mut msg = format!("no {kind} plugin named `{name}`; available: {}", self.names(kind).join(", "));
                let related: Vec<String> = self
                    .refused
                    .iter()
                    .filter(|(p, r)| {
                        r.contains(&format!("`{name}`")) || p.to_string_lossy().contains(&name.replace('-', "_"))
                    })
                    .map(|(p, r)| format!("{}: {r}", p.display()))
                    .collect();
                if !related.is_empty() {
                    msg.push_str(&format!("; refused: {}", related.join("; ")));
                }
                Err(TrainerError::Plugin(msg))
            }
        }
    }
}

fn call_err(meta: &PluginMeta, e: PluginError, section: &str) -> TrainerError {
    let message = match (&e.kind, e.key.as_ref().into_option()) {
        (rlhf_plugin_api::ErrorKind::Config, Some(key)) if !key.is_empty() => format!("{section}.{key}: {}", e.message),
        _ => e.to_string(),
    };
    TrainerError::PluginCall { name: meta.name.clone(), path: meta.path.clone(), message }
}

/// An algorithm instance and where it came from.
pub struct AlgorithmHandle {
    pub meta: PluginMeta,
    obj: AlgorithmBox,
}

impl AlgorithmHandle {
    /// Builds the algorithm; `section` names its config section in errors (`algorithm.config`).
    pub fn new(p: &LoadedPlugin, config_json: &str, ctx: HostContext, section: &str) -> Result<Self> {
        match (p.module.new_algorithm())(RStr::from_str(config_json), ctx) {
            RResult::ROk(obj) => Ok(AlgorithmHandle { meta: p.meta.clone(), obj }),
            RResult::RErr(e) => Err(call_err(&p.meta, e, section)),
        }
    }

    /// What the algorithm needs.
    pub fn requirements(&self) -> Requirements {
        self.obj.requirements()
    }

    /// See [`rlhf_plugin_api::Algorithm::prepare`].
    pub fn prepare(&mut self, exp: ExperienceAbi<'_>) -> Result<PreparedAbi> {
        self.obj.prepare(exp).into_result().map_err(|e| call_err(&self.meta, e, "algorithm.config"))
    }

    /// See [`rlhf_plugin_api::Algorithm::loss`].
    pub fn loss(&mut self, mb: MinibatchAbi<'_>) -> Result<LossAbi> {
        self.obj.loss(mb).into_result().map_err(|e| call_err(&self.meta, e, "algorithm.config"))
    }

    /// The plugin's checkpoint state (JSON).
    pub fn state(&self) -> Result<serde_json::Value> {
        let text = self.obj.state().into_result().map_err(|e| call_err(&self.meta, e, "algorithm state"))?;
        plugin_state_json(&self.meta, text.as_str())
    }

    /// Restores the plugin's checkpoint state.
    pub fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let text = state.to_string();
        self.obj.load_state(RStr::from_str(&text)).into_result().map_err(|e| call_err(&self.meta, e, "algorithm state"))
    }
}

fn plugin_state_json(meta: &PluginMeta, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| TrainerError::PluginCall {
        name: meta.name.clone(),
        path: meta.path.clone(),
        message: format!("state() returned invalid JSON: {e}"),
    })
}

/// A reward source instance.
pub struct RewardHandle {
    pub meta: PluginMeta,
    obj: RewardBox,
}

impl RewardHandle {
    /// Builds the reward source; `section` names its config section in errors (`rewards[0].config`).
    pub fn new(p: &LoadedPlugin, config_json: &str, ctx: HostContext, section: &str) -> Result<Self> {
        match (p.module.new_reward())(RStr::from_str(config_json), ctx) {
            RResult::ROk(obj) => Ok(RewardHandle { meta: p.meta.clone(), obj }),
            RResult::RErr(e) => Err(call_err(&p.meta, e, section)),
        }
    }

    /// Scores; the count is checked against the number of samples.
    pub fn score(&mut self, samples: Vec<SampleAbi>) -> Result<ScoresAbi> {
        let n = samples.len();
        let out = self.obj.score(RVec::from(samples)).into_result().map_err(|e| call_err(&self.meta, e, "rewards"))?;
        if out.scores.len() != n {
            return Err(TrainerError::PluginCall {
                name: self.meta.name.clone(),
                path: self.meta.path.clone(),
                message: format!("returned {} scores for {n} samples", out.scores.len()),
            });
        }
        Ok(out)
    }

    /// The plugin's checkpoint state (JSON).
    pub fn state(&self) -> Result<serde_json::Value> {
        let text = self.obj.state().into_result().map_err(|e| call_err(&self.meta, e, "reward state"))?;
        plugin_state_json(&self.meta, text.as_str())
    }

    /// Restores the plugin's checkpoint state.
    pub fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let text = state.to_string();
        self.obj.load_state(RStr::from_str(&text)).into_result().map_err(|e| call_err(&self.meta, e, "reward state"))
    }
}
