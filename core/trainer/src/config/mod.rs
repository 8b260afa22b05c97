//! Configuration of every command: a TOML preset or file, then `RLHF_SECTION__KEY` variables, then
//! `--set key=value` overrides, merged with figment and extracted into `deny_unknown_fields`
//! structs ([`rl`] for `rlhf train`, [`phases`] for `rlhf sft`/`rlhf rm`). Errors name the source and the key
//! (`configs/grpo.toml: train.lr: invalid type: found string "x", expected f64`).
//! Plugin sections (`algorithm.config`, `rewards[i].config`) are passed to the plugin as JSON,
//! which parses them with its own `deny_unknown_fields` struct.

use std::path::PathBuf;

use figment::providers::{Format, Toml};
use figment::Figment;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Result, TrainerError};
use aliases::Aliased;

pub mod aliases;
mod data;
mod distributed;
mod dpo;
mod environment;
mod eval;
mod phases;
mod plugin_sections;
mod rl;
mod rollout;
mod train;
mod warmup;

pub use crate::optim::Schedule;
pub use data::*;
pub use distributed::*;
pub use dpo::*;
pub use environment::*;
pub use eval::*;
pub use phases::*;
pub use rl::*;
pub use rollout::*;
pub use train::*;
pub use warmup::*;

/// The presets in `configs/`, compiled in so `rlhf train --algo NAME` works from anywhere.
pub const PRESETS: &[(&str, &str)] = &[
    ("grpo", include_str!("../../../../configs/grpo.toml")),
    ("ppo", include_str!("../../../../configs/ppo.toml")),
    ("ppo-seq", include_str!("../../../../configs/ppo-seq.toml")),
    ("rloo", include_str!("../../../../configs/rloo.toml")),
    ("reinforce-pp", include_str!("../../../../configs/reinforce-pp.toml")),
    ("gspo", include_str!("../../../../configs/gspo.toml")),
    ("reinforce-pp-baseline", include_str!("../../../../configs/reinforce-pp-baseline.toml")),
];

/// Where the base configuration comes from.
#[derive(Debug, Clone)]
pub enum ConfigSource {
    /// A TOML file.
    File(PathBuf),
    /// An embedded preset by name.
    Preset(String),
}

/// `--set key=value` as a figment provider named `--set key=value` (so `rlhf config show` and
/// errors say where a value came from). The value is read as TOML (number, bool, array, inline
/// table) and falls back to a plain string.
struct SetOverride {
    /// Where it came from: `--set key=value`, `--algo NAME` or `RLHF_SECTION__KEY`.
    label: String,
    key: String,
    value: toml::Value,
}

impl SetOverride {
    fn parse(spec: &str) -> Result<Self> {
        let (key, value) =
            spec.split_once('=').ok_or_else(|| TrainerError::Config(format!("--set {spec}: expected key=value")))?;
        let key = key.trim();
        if key.is_empty() {
            return Err(TrainerError::Config(format!("--set {spec}: empty key")));
        }
        let label = format!("--set {spec}");
        check_integer(&label, key, value)?;
        Ok(SetOverride { label, key: key.to_string(), value: toml_value(value) })
    }
}

/// Refuses a whole number too large for TOML's 64-bit integers, which would otherwise be read as
/// a string and refused as "found string".
fn check_integer(label: &str, key: &str, text: &str) -> Result<()> {
    let t = text.trim();
    let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
    let numeric = !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit() || c == '_');
    if numeric && matches!(toml_value(text), toml::Value::String(_)) {
        return Err(TrainerError::Config(format!(
            "{label}: {key}: {t} is out of range for an integer (at most {})",
            i64::MAX
        )));
    }
    Ok(())
}

/// A command-line or environment value read as TOML (number, bool, array, inline table), else a
/// plain string.
fn toml_value(text: &str) -> toml::Value {
    match format!("v = {}", text.trim()).parse::<toml::Table>() {
        Ok(t) => t.get("v").cloned().unwrap_or(toml::Value::String(text.to_string())),
        Err(_) => toml::Value::String(text.trim().to_string()),
    }
}

impl figment::Provider for SetOverride {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.label.clone())
    }

    fn data(&self) -> std::result::Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        figment::providers::Serialized::default(&self.key, &self.value).data()
    }
}

/// The environment prefix: `RLHF_TRAIN__LR=1e-6` sets `train.lr`.
pub const ENV_PREFIX: &str = "RLHF_";

/// The shape of a command's config: `T`'s serialised default (keys and nesting).
fn schema<T: Serialize + Default>() -> serde_json::Value {
    serde_json::to_value(T::default()).unwrap_or_default()
}

/// The configs of every command (`train`, `sft`, `rm`): an `RLHF_` variable meant for one of them
/// is skipped by the others instead of failing them as an unknown key.
fn command_schemas() -> [serde_json::Value; 3] {
    [schema::<RlConfig>(), schema::<SftConfig>(), schema::<RmConfig>()]
}

/// Whether the dotted `key` names a field of `schema`: every segment is a key of the object it
/// meets, until a value that is not an object (a leaf, an unset option, a free-form plugin
/// section), below which serde decides.
fn has_key(schema: &serde_json::Value, key: &str) -> bool {
    let mut at = schema;
    for seg in key.split('.') {
        match at {
            serde_json::Value::Object(m) => match m.get(seg) {
                Some(v) => at = v,
                None => return false,
            },
            _ => return true,
        }
    }
    true
}

/// Environment layer: variables `RLHF_<SECTION>__<KEY>` (`__` nests; names are case-insensitive;
/// values read as TOML like `--set`). Only names containing `__` are read, so `RLHF_PYTHON` is left
/// alone. A variable naming a key of this command's config applies; one naming a key of another
/// command's config only (`RLHF_TRAIN__ACTOR_LR` under `rlhf sft`) is skipped; any other variable
/// whose section exists here applies too, so its unknown key is an error naming the variable, and
/// one whose section exists nowhere is ignored with a warning.
fn env_layer(this: &serde_json::Value, aliases: &[aliases::Alias]) -> Result<Vec<SetOverride>> {
    let mut vars: Vec<(String, String)> =
        std::env::vars().filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.contains("__")).collect();
    vars.sort();
    let others = command_schemas();
    let mut out = Vec::new();
    for (name, value) in vars {
        let key = name[ENV_PREFIX.len()..].to_lowercase().replace("__", ".");
        let first = key.split('.').next().unwrap_or("");
        let section_here = this.get(first).is_some() || has_key(this, &aliases::canonical(&key, aliases));
        let elsewhere = |key: &str| {
            others
                .iter()
                .zip([aliases::RL, aliases::SUPERVISED, aliases::SUPERVISED])
                .any(|(o, a)| has_key(o, key) || has_key(o, &aliases::canonical(key, a)))
        };
        if has_key(this, &aliases::canonical(&key, aliases)) || (section_here && !elsewhere(&key)) {
            check_integer(&name, &key, &value)?;
            out.push(SetOverride { label: name, key, value: toml_value(&value) });
        } else if elsewhere(&key) {
            tracing::debug!("{name}: skipped (a key of another command's config)");
        } else {
            tracing::warn!("{name}: ignored (no section `{first}` in this config)");
        }
    }
    Ok(out)
}

/// The env layer and the `--set` overrides over `base`, in that order (CLI last), each read
/// through `aliases`.
fn layer(
    base: Figment,
    this: &serde_json::Value,
    sets: &[String],
    aliases: &'static [aliases::Alias],
) -> Result<Figment> {
    let mut fig = base;
    for var in env_layer(this, aliases)? {
        fig = fig.merge(Aliased { inner: var, aliases });
    }
    for s in sets {
        fig = fig.merge(Aliased { inner: SetOverride::parse(s)?, aliases });
    }
    Ok(fig)
}

/// The base layer: a TOML file (which must exist) or an embedded preset by name, read through
/// `aliases`.
fn base_layer(
    source: &ConfigSource,
    presets: &[(&str, &str)],
    aliases: &'static [aliases::Alias],
) -> Result<(Figment, String)> {
    match source {
        ConfigSource::File(path) => {
            if !path.is_file() {
                return Err(TrainerError::Config(format!("{}: config file not found", path.display())));
            }
            Ok((Figment::from(Aliased { inner: Toml::file(path), aliases }), path.display().to_string()))
        }
        ConfigSource::Preset(name) => match presets.iter().find(|(n, _)| n == name) {
            Some((_, text)) => Ok((
                Figment::from(Aliased { inner: Named(format!("preset {name}"), text), aliases }),
                format!("preset {name}"),
            )),
            None => Err(TrainerError::Config(format!(
                "no embedded preset `{name}` (available: {})",
                presets.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ))),
        },
    }
}

/// A TOML string provider with a readable name (figment names string sources "TOML source string").
struct Named<'a>(String, &'a str);

impl figment::Provider for Named<'_> {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.0.clone())
    }

    fn data(&self) -> std::result::Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        Toml::string(self.1).data()
    }
}

fn describe_figment(e: figment::Error, default_source: &str) -> TrainerError {
    let mut lines = Vec::new();
    for err in e {
        let key = err.path.join(".");
        let source = match &err.metadata {
            Some(m) => match &m.source {
                Some(figment::Source::File(p)) => p.display().to_string(),
                Some(s) => s.to_string(),
                // The env provider interpolates the variable's name; others are named providers.
                None => source_name(m),
            },
            None => default_source.to_string(),
        };
        let kind = err.kind.to_string();
        lines.push(if key.is_empty() { format!("{source}: {kind}") } else { format!("{source}: {key}: {kind}") });
    }
    TrainerError::Config(lines.join("; "))
}

/// Loads a `deny_unknown_fields` config struct from its layers — base (file or embedded preset),
/// then `RLHF_SECTION__KEY` environment variables, then `--set a.b=c` — with errors that name the
/// source and the key (`configs/sft.toml: train.lr: invalid type: found string "x", expected f64`).
pub fn load_layered<T: DeserializeOwned + Serialize + Default>(
    source: &ConfigSource,
    presets: &[(&str, &str)],
    sets: &[String],
    aliases: &'static [aliases::Alias],
) -> Result<T> {
    Ok(load_layered_figment::<T>(source, presets, sets, aliases)?.0)
}

/// [`load_layered`], also returning the merged figment (for provenance).
pub fn load_layered_figment<T: DeserializeOwned + Serialize + Default>(
    source: &ConfigSource,
    presets: &[(&str, &str)],
    sets: &[String],
    aliases: &'static [aliases::Alias],
) -> Result<(T, Figment)> {
    let (base, label) = base_layer(source, presets, aliases)?;
    let fig = layer(base, &schema::<T>(), sets, aliases)?;
    let cfg = fig.extract().map_err(|e| describe_figment(e, &label))?;
    Ok((cfg, fig))
}

/// Where each key's value came from, for errors found after extraction (range checks): the file,
/// preset, `RLHF_` variable or `--set` that supplied it, else the base source (a default).
pub struct KeySource<'a> {
    pub fig: &'a Figment,
    /// The base layer's name, for keys no layer sets.
    pub base: &'a str,
}

impl KeySource<'_> {
    /// The source of dotted `key` (`rewards[0].weight` is looked up as `rewards`); for a key no
    /// layer sets (a missing key), the source of its nearest section that one does — where the
    /// key belongs — and the base config when there is none.
    pub fn of(&self, key: &str) -> String {
        let mut key = key.split('[').next().unwrap_or(key);
        loop {
            if let Some(m) = self.fig.find_metadata(key) {
                return source_name(m);
            }
            match key.rsplit_once('.') {
                Some((parent, _)) => key = parent,
                None => return self.base.to_string(),
            }
        }
    }

    /// A config error `SOURCE: KEY: MSG` naming where `key` came from.
    pub fn error(&self, key: &str, msg: &str) -> TrainerError {
        TrainerError::Config(format!("{}: {key}: {msg}", self.of(key)))
    }
}

/// Checks what every phase's config shares: no data column key is empty (an empty name would
/// silently read the default column), and `tensorboard.dir`, when set, names a directory (an
/// empty one would write into the working directory).
pub(crate) fn check_shared(
    src: &KeySource,
    columns: &crate::tabular::Columns,
    tensorboard: &crate::tensorboard::TensorboardConfig,
) -> Result<()> {
    if let Some(key) = columns.empty_key() {
        return Err(src.error(&format!("data.{key}"), "is empty: name a column, or leave the key out for its default"));
    }
    if tensorboard.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
        return Err(src.error("tensorboard.dir", "is empty: name a directory, or leave it out for no event files"));
    }
    Ok(())
}

/// The merged layers of a loaded config, kept for errors found after loading (a plugin refusing
/// its config section): they say which layer set a key.
#[derive(Clone, Default)]
pub struct Layers(Option<Figment>);

impl std::fmt::Debug for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Layers")
    }
}

impl Layers {
    /// The source of dotted `key` as [`KeySource::of`] names it, `base` when unknown.
    pub fn of(&self, key: &str, base: &str) -> String {
        match &self.0 {
            Some(fig) => KeySource { fig, base }.of(key),
            None => base.to_string(),
        }
    }
}

/// A provider's name for messages: the file, `RLHF_TRAIN__STEPS` for the env layer, the preset or
/// the `--set`.
fn source_name(m: &figment::Metadata) -> String {
    match &m.source {
        Some(figment::Source::File(p)) => p.display().to_string(),
        Some(s) => s.to_string(),
        None => m.name.to_string(),
    }
}

/// Every leaf of `value` as `(dotted key, TOML value, source)`, the source being where `fig` found
/// it (a file, a preset, an `RLHF_` variable, a `--set`) or `default`.
pub fn provenance<T: Serialize>(value: &T, fig: &Figment) -> Result<Vec<(String, String, String)>> {
    let v = serde_json::to_value(value).map_err(|e| TrainerError::Config(format!("cannot serialise config: {e}")))?;
    let mut out = Vec::new();
    fn walk(v: &serde_json::Value, path: &mut Vec<String>, fig: &Figment, out: &mut Vec<(String, String, String)>) {
        match v {
            serde_json::Value::Object(m) if !m.is_empty() => {
                for (k, x) in m {
                    path.push(k.clone());
                    walk(x, path, fig, out);
                    path.pop();
                }
            }
            _ => {
                let key = path.join(".");
                let source = match fig.find_metadata(&key) {
                    Some(m) => source_name(m),
                    None => "default".to_string(),
                };
                let shown = match v {
                    serde_json::Value::Null => "(unset)".to_string(),
                    other => other.to_string(),
                };
                out.push((key, shown, source));
            }
        }
    }
    walk(&v, &mut Vec::new(), fig, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_and_overrides_apply() {
        for (name, _) in PRESETS {
            // As `rlhf train --algo NAME` loads it: a preset names the plugin it runs.
            let cfg = RlConfig::load(&ConfigSource::Preset(name.to_string()), Some(name), &[]).unwrap();
            let plugin = if *name == "reinforce-pp-baseline" { "reinforce-pp" } else { name };
            assert_eq!(cfg.algorithm.name, plugin);
        }
        let cfg =
            RlConfig::load(&ConfigSource::Preset("reinforce-pp-baseline".into()), Some("reinforce-pp-baseline"), &[])
                .unwrap();
        assert_eq!(cfg.algorithm.config["baseline"], "group_mean");
        let sets = vec!["train.steps=3".to_string(), "run.device=cpu".to_string()];
        let cfg = RlConfig::load(&ConfigSource::Preset("grpo".into()), Some("ppo"), &sets).unwrap();
        assert_eq!(cfg.train.steps, 3);
        assert_eq!(cfg.algorithm.name, "ppo");
    }

    /// Every RL preset evaluates on held-out prompts that training (and so its warm-up, which
    /// reads the training prompts' labels) never sees.
    #[test]
    fn presets_evaluate_on_prompts_training_never_sees() {
        let texts = |data: &DataConfig| -> Vec<String> {
            crate::builtin::prompts_of(data).unwrap().iter().map(|p| format!("{p:?}")).collect()
        };
        for (name, _) in PRESETS {
            let cfg = RlConfig::load(&ConfigSource::Preset(name.to_string()), Some(name), &[]).unwrap();
            assert!(cfg.eval.enabled(), "{name}: no [eval]");
            let train = texts(&cfg.data);
            let held_out = texts(&DataConfig { prompts: cfg.eval.data.clone(), ..cfg.data.clone() });
            assert!(!held_out.is_empty() && train.len() > held_out.len(), "{name}");
            assert!(held_out.iter().all(|p| !train.contains(p)), "{name}: a held-out prompt is trained on");
        }
    }

    #[test]
    fn errors_name_source_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "[algorithm]\nname = \"grpo\"\n[train]\nlr = \"x\"\n[[rewards]]\nplugin = \"r\"\n")
            .unwrap();
        let e = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("train.lr") && e.contains("invalid type"), "{e}");

        std::fs::write(&path, "[algorithm]\nname = \"grpo\"\n[train]\nstepz = 1\n").unwrap();
        let e = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap_err().to_string();
        assert!(e.contains("stepz"), "{e}");

        let e = RlConfig::load(&ConfigSource::Preset("grpo".into()), None, &["rollout.samples_per_prompt=0".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rollout.samples_per_prompt: must be >= 1"), "{e}");

        let e =
            RlConfig::load(&ConfigSource::File(dir.path().join("missing.toml")), None, &[]).unwrap_err().to_string();
        assert!(e.contains("missing.toml: config file not found"), "{e}");
    }
}
