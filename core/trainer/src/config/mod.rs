//! The RL run configuration: a TOML preset or file, then `--set key=value` overrides, merged with
//! figment and extracted into `deny_unknown_fields` structs. Errors name the source and the key
//! (`configs/grpo.toml: train.actor_lr: invalid type: found string "x", expected f64`).
//! Plugin sections (`algorithm.config`, `rewards[i].config`) are passed to the plugin as JSON,
//! which parses them with its own `deny_unknown_fields` struct.

use std::path::PathBuf;

use figment::providers::{Format, Toml};
use figment::Figment;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use rlhf_models::LoraConfig;
use rlhf_wandb::WandbConfig;

use crate::error::{Result, TrainerError};

/// Seeds, devices and where outputs go.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Seeds libtorch, data order and sampling.
    pub seed: u64,
    /// Run directory (metrics.jsonl, config, exported model); default `runs/<algo>-<unix time>`.
    pub run_dir: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: String,
    /// `f32` or `bf16` for the trained models.
    pub dtype: String,
    /// Save the final actor in Hugging Face format under `<run_dir>/actor`.
    pub save_actor: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { seed: 42, run_dir: None, device: "cpu".into(), dtype: "f32".into(), save_actor: true }
    }
}

/// Which checkpoints play which role.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Hugging Face directory of the policy, or `builtin:tiny` for the embedded tiny Llama.
    pub actor: String,
    /// Frozen reference policy; default: the actor's initial weights.
    pub reference: Option<String>,
    /// Critic: `actor` (backbone copied from the actor, fresh value head) or a directory holding a
    /// reward model / critic in `*ForSequenceClassification` layout.
    pub critic: String,
    /// LoRA on the actor (`rank = 0`: full fine-tuning). The exported actor is merged.
    pub lora: LoraConfig,
    /// LoRA on the critic (its value head always trains).
    pub critic_lora: LoraConfig,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            actor: "builtin:tiny".into(),
            reference: None,
            critic: "actor".into(),
            lora: LoraConfig::default(),
            critic_lora: LoraConfig::default(),
        }
    }
}

/// Prompt data.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// JSONL with `prompt` or chat `messages`, optional `label`; or `builtin:addition`.
    pub prompts: String,
    /// Prompts longer than this many tokens are truncated from the left (with a warning).
    pub max_prompt_len: usize,
    /// Render prompts through the tokenizer's chat template when it has one.
    pub apply_chat_template: bool,
    /// Shuffle prompts every pass over the data.
    pub shuffle: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig { prompts: "builtin:addition".into(), max_prompt_len: 256, apply_chat_template: true, shuffle: true }
    }
}

/// Generation during rollout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Distinct prompts per generation batch.
    pub prompts_per_batch: usize,
    /// Responses sampled per prompt (GRPO's G).
    pub samples_per_prompt: usize,
    pub max_new_tokens: i64,
    pub temperature: f64,
    /// 1.0 disables.
    pub top_p: f64,
    /// 0 disables.
    pub top_k: i64,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            prompts_per_batch: 8,
            samples_per_prompt: 4,
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
        }
    }
}

/// Learning-rate schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    Linear,
    Cosine,
}

/// Optimisation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Generation batches (each followed by `ppo_epochs` passes over its minibatches).
    pub steps: usize,
    /// Passes over each generation batch.
    pub ppo_epochs: usize,
    /// Samples per optimizer step (DeepSpeed-Chat's per-device mini batch).
    pub minibatch_size: usize,
    pub actor_lr: f64,
    pub critic_lr: f64,
    pub weight_decay: f64,
    pub adam_betas: (f64, f64),
    pub adam_eps: f64,
    /// Optimizer steps of linear warm-up.
    pub warmup_steps: usize,
    pub schedule: Schedule,
    /// Gradient-norm clip per model (0 disables).
    pub max_grad_norm: f64,
    /// EMA decay of an extra actor copy (DeepSpeed-Chat's `enable_ema`); none = off.
    pub ema_decay: Option<f64>,
    /// Weight of the unsupervised LM loss on `ptx_data` (InstructGPT's PPO-ptx); 0 = off.
    pub ptx_coef: f64,
    /// JSONL with a `text` field for the ptx loss.
    pub ptx_data: Option<PathBuf>,
    /// Upper bound on `rows × vocab` fp32 logits materialised at once.
    pub logprob_chunk_elements: i64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 100,
            ppo_epochs: 1,
            minibatch_size: 32,
            actor_lr: 1e-6,
            critic_lr: 5e-6,
            weight_decay: 0.0,
            adam_betas: (0.9, 0.95),
            adam_eps: 1e-8,
            warmup_steps: 0,
            schedule: Schedule::Constant,
            max_grad_norm: 1.0,
            ema_decay: None,
            ptx_coef: 0.0,
            ptx_data: None,
            logprob_chunk_elements: 1 << 26,
        }
    }
}

/// Optional supervised warm-up of the actor before RL (used by the embedded defaults, whose tiny
/// model starts from random weights).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmupConfig {
    /// Optimizer steps; 0 = none.
    pub steps: usize,
    pub lr: f64,
    pub batch_size: usize,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        WarmupConfig { steps: 0, lr: 1e-3, batch_size: 32 }
    }
}

/// Checkpoints: `<run_dir>/checkpoints/step-NNNNNN`, written atomically.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Write one every this many steps (0: only at the end).
    pub every: usize,
    /// Keep the last this many (older ones are deleted once a new one is complete; >= 1).
    pub keep: usize,
    /// Also write one when the run ends.
    pub at_end: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 100, keep: 2, at_end: true }
    }
}

/// The algorithm plugin and its own config section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlgorithmConfig {
    /// Declared plugin name (`grpo`, `ppo`, `ppo-seq`, ...).
    pub name: String,
    /// Passed to the plugin as JSON.
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
}

/// One reward source.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    /// Declared plugin name (`reward-rules`, ...).
    pub plugin: String,
    /// Metric name (`rewards/<name>/mean`); default: the plugin name.
    pub name: Option<String>,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}

fn one() -> f64 {
    1.0
}

/// The whole RL configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlConfig {
    #[serde(default)]
    pub run: RunConfig,
    #[serde(default)]
    pub model: ModelConfig,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub rollout: RolloutConfig,
    #[serde(default)]
    pub train: TrainConfig,
    #[serde(default)]
    pub warmup: WarmupConfig,
    pub algorithm: AlgorithmConfig,
    #[serde(default)]
    pub rewards: Vec<RewardConfig>,
    /// Directories scanned for plugin libraries; empty = the directory of the `rlhf` executable
    /// (where cargo puts the workspace's plugins).
    #[serde(default)]
    pub plugin_dirs: Vec<PathBuf>,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Weights & Biases sink (on when `WANDB_API_KEY` is set, unless `enabled = false`).
    #[serde(default)]
    pub wandb: WandbConfig,
    /// Where the base config came from (the file, or `preset NAME`), for error messages.
    #[serde(skip)]
    pub source: String,
}

/// The presets in `configs/`, compiled in so `rlhf train --algo NAME` works from anywhere.
pub const PRESETS: &[(&str, &str)] = &[
    ("grpo", include_str!("../../../configs/grpo.toml")),
    ("ppo", include_str!("../../../configs/ppo.toml")),
    ("ppo-seq", include_str!("../../../configs/ppo-seq.toml")),
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
        Ok(SetOverride { label: format!("--set {spec}"), key: key.to_string(), value: toml_value(value) })
    }
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

/// The environment prefix: `RLHF_TRAIN__ACTOR_LR=1e-6` sets `train.actor_lr`.
pub const ENV_PREFIX: &str = "RLHF_";

/// The shape of a command's config: `T`'s serialised default (keys and nesting).
fn schema<T: Serialize + Default>() -> serde_json::Value {
    serde_json::to_value(T::default()).unwrap_or_default()
}

/// The configs of every command (`train`, `sft`, `rm`): an `RLHF_` variable meant for one of them
/// is skipped by the others instead of failing them as an unknown key.
fn command_schemas() -> [serde_json::Value; 3] {
    [schema::<RlConfig>(), schema::<crate::sft::SftConfig>(), schema::<crate::rm::RmConfig>()]
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
fn env_layer(this: &serde_json::Value) -> Vec<SetOverride> {
    let mut vars: Vec<(String, String)> =
        std::env::vars().filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.contains("__")).collect();
    vars.sort();
    let others = command_schemas();
    let mut out = Vec::new();
    for (name, value) in vars {
        let key = name[ENV_PREFIX.len()..].to_lowercase().replace("__", ".");
        let first = key.split('.').next().unwrap_or("");
        let section_here = this.get(first).is_some();
        if has_key(this, &key) || (section_here && !others.iter().any(|o| has_key(o, &key))) {
            out.push(SetOverride { label: name, key, value: toml_value(&value) });
        } else if others.iter().any(|o| has_key(o, &key)) {
            tracing::debug!("{name}: skipped (a key of another command's config)");
        } else {
            tracing::warn!("{name}: ignored (no section `{first}` in this config)");
        }
    }
    out
}

/// The env layer and the `--set` overrides over `base`, in that order (CLI last).
fn layer(base: Figment, this: &serde_json::Value, sets: &[String]) -> Result<Figment> {
    let mut fig = base;
    for var in env_layer(this) {
        fig = fig.merge(var);
    }
    for s in sets {
        fig = fig.merge(SetOverride::parse(s)?);
    }
    Ok(fig)
}

/// The base layer: a TOML file (which must exist) or an embedded preset by name.
fn base_layer(source: &ConfigSource, presets: &[(&str, &str)]) -> Result<(Figment, String)> {
    match source {
        ConfigSource::File(path) => {
            if !path.is_file() {
                return Err(TrainerError::Config(format!("{}: config file not found", path.display())));
            }
            Ok((Figment::from(Toml::file(path)), path.display().to_string()))
        }
        ConfigSource::Preset(name) => match presets.iter().find(|(n, _)| n == name) {
            Some((_, text)) => Ok((Figment::from(Named(format!("preset {name}"), text)), format!("preset {name}"))),
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
) -> Result<T> {
    Ok(load_layered_figment::<T>(source, presets, sets)?.0)
}

/// [`load_layered`], also returning the merged figment (for provenance).
pub fn load_layered_figment<T: DeserializeOwned + Serialize + Default>(
    source: &ConfigSource,
    presets: &[(&str, &str)],
    sets: &[String],
) -> Result<(T, Figment)> {
    let (base, label) = base_layer(source, presets)?;
    let fig = layer(base, &schema::<T>(), sets)?;
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
    /// The source of dotted `key` (`rewards[0].weight` is looked up as `rewards`).
    pub fn of(&self, key: &str) -> String {
        let key = key.split('[').next().unwrap_or(key);
        self.fig.find_metadata(key).map(source_name).unwrap_or_else(|| self.base.to_string())
    }

    /// A config error `SOURCE: KEY: MSG` naming where `key` came from.
    pub fn error(&self, key: &str, msg: &str) -> TrainerError {
        TrainerError::Config(format!("{}: {key}: {msg}", self.of(key)))
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

impl RlConfig {
    /// Loads the base (file or preset), applies `--set` overrides, forces `algorithm.name` to
    /// `algo` when given, and validates.
    pub fn load(source: &ConfigSource, algo: Option<&str>, sets: &[String]) -> Result<Self> {
        Ok(Self::load_figment(source, algo, sets)?.0)
    }

    /// [`RlConfig::load`], also returning the merged figment (for `rlhf config show`).
    pub fn load_figment(source: &ConfigSource, algo: Option<&str>, sets: &[String]) -> Result<(Self, Figment)> {
        let (mut fig, label) = match source {
            ConfigSource::Preset(name) if !PRESETS.iter().any(|(n, _)| n == name) => {
                // A plugin without a preset runs the grpo preset's task with its own defaults.
                let mut table: toml::Table =
                    PRESETS[0].1.parse().map_err(|e| TrainerError::Config(format!("preset grpo: {e}")))?;
                let mut algo_table = toml::Table::new();
                algo_table.insert("name".into(), toml::Value::String(name.clone()));
                table.insert("algorithm".into(), toml::Value::Table(algo_table));
                let text = toml::to_string(&table).map_err(|e| TrainerError::Config(format!("preset grpo: {e}")))?;
                let label = format!("preset grpo (for {name})");
                (Figment::from(Named(label.clone(), &text)), label)
            }
            _ => base_layer(source, PRESETS)?,
        };
        if let Some(algo) = algo {
            fig = fig.merge(SetOverride {
                label: format!("--algo {algo}"),
                key: "algorithm.name".into(),
                value: toml::Value::String(algo.into()),
            });
        }
        let fig = layer(fig, &schema::<RlConfig>(), sets)?;
        let mut cfg: RlConfig = fig.extract().map_err(|e| describe_figment(e, &label))?;
        cfg.validate(&KeySource { fig: &fig, base: &label })?;
        cfg.source = label;
        Ok((cfg, fig))
    }

    fn validate(&self, src: &KeySource) -> Result<()> {
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        if self.rollout.prompts_per_batch == 0 {
            return bad("rollout.prompts_per_batch", "must be >= 1");
        }
        if self.rollout.samples_per_prompt == 0 {
            return bad("rollout.samples_per_prompt", "must be >= 1");
        }
        if self.rollout.max_new_tokens < 1 {
            return bad("rollout.max_new_tokens", "must be >= 1");
        }
        if self.rollout.temperature.is_nan() || self.rollout.temperature <= 0.0 {
            return bad("rollout.temperature", "must be > 0 (RL needs sampling)");
        }
        if !(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0) {
            return bad("rollout.top_p", "must be in (0, 1]");
        }
        if self.train.minibatch_size == 0 {
            return bad("train.minibatch_size", "must be >= 1");
        }
        if self.train.ppo_epochs == 0 {
            return bad("train.ppo_epochs", "must be >= 1");
        }
        if self.rewards.is_empty() {
            return bad("rewards", "at least one [[rewards]] entry is needed");
        }
        for (i, r) in self.rewards.iter().enumerate() {
            if !r.weight.is_finite() {
                return bad(&format!("rewards[{i}].weight"), "must be finite");
            }
        }
        if let Some(d) = self.train.ema_decay {
            if !(0.0..1.0).contains(&d) {
                return bad("train.ema_decay", "must be in [0, 1)");
            }
        }
        if self.checkpoint.keep == 0 {
            return bad("checkpoint.keep", "must be >= 1");
        }
        for (key, l) in [("model.lora", &self.model.lora), ("model.critic_lora", &self.model.critic_lora)] {
            if let Err(e) = l.validate() {
                let msg = e.to_string();
                let msg = msg.trim_start_matches("invalid input: lora");
                let field = msg.trim_start_matches('.').split(':').next().unwrap_or("");
                return Err(TrainerError::Config(format!("{}: {key}{msg}", src.of(&format!("{key}.{field}")))));
            }
        }
        if self.train.ptx_coef != 0.0 && self.train.ptx_data.is_none() {
            return bad("train.ptx_data", "needed when train.ptx_coef != 0");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_and_overrides_apply() {
        for (name, _) in PRESETS {
            let cfg = RlConfig::load(&ConfigSource::Preset(name.to_string()), None, &[]).unwrap();
            assert_eq!(cfg.algorithm.name, *name);
        }
        let sets = vec!["train.steps=3".to_string(), "run.device=cpu".to_string()];
        let cfg = RlConfig::load(&ConfigSource::Preset("grpo".into()), Some("ppo"), &sets).unwrap();
        assert_eq!(cfg.train.steps, 3);
        assert_eq!(cfg.algorithm.name, "ppo");
    }

    #[test]
    fn errors_name_source_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "[algorithm]\nname = \"grpo\"\n[train]\nactor_lr = \"x\"\n[[rewards]]\nplugin = \"r\"\n")
            .unwrap();
        let e = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("train.actor_lr") && e.contains("invalid type"), "{e}");

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
