//! `rlhf train`: the RL run's sections (`[run]`, `[model]`, `[data]`, `[rollout]`, `[train]`,
//! `[warmup]`, `[algorithm]`, `[[rewards]]`, `[eval]`, `[checkpoint]`, `[wandb]`), the embedded presets, and
//! loading with range checks.

use std::path::PathBuf;

use figment::Figment;
use serde::{Deserialize, Serialize};

use rlhf_models::LoraConfig;
use rlhf_wandb::WandbConfig;

use super::eval::EvalConfig;
use super::rollout::RolloutConfig;
use super::train::TrainConfig;
use super::warmup::WarmupConfig;
use super::{
    base_layer, describe_figment, layer, schema, ConfigSource, DataConfig, KeySource, Layers, Named, SetOverride,
    PRESETS,
};
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
    /// Write every step's scored samples (prompt, completion, its token ids, reward) to
    /// `<run_dir>/rollouts/step-<N>.jsonl`, as verl's `trainer.rollout_data_dir` does.
    pub save_rollouts: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            seed: 42,
            run_dir: None,
            device: "cpu".into(),
            dtype: "f32".into(),
            save_actor: true,
            save_rollouts: false,
        }
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
    /// Keep a vision-language policy's vision tower (and its patch merger) frozen, as TRL, verl
    /// and OpenRLHF do by default; `false` trains it with the language model.
    pub freeze_vision: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            actor: "builtin:tiny".into(),
            reference: None,
            critic: "actor".into(),
            lora: LoraConfig::default(),
            critic_lora: LoraConfig::default(),
            freeze_vision: true,
        }
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
    /// Multi-turn episodes with an environment plugin (off unless `environment.plugin` is set).
    #[serde(default)]
    pub environment: super::EnvironmentConfig,
    /// Held-out evaluation (off unless `eval.data` is set).
    #[serde(default)]
    pub eval: EvalConfig,
    #[serde(default)]
    pub distributed: super::DistributedConfig,
    /// Directories scanned for plugin libraries; empty = the directory of the `rlhf` executable
    /// (where cargo puts the workspace's plugins).
    #[serde(default)]
    pub plugin_dirs: Vec<PathBuf>,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Weights & Biases sink (on when `WANDB_API_KEY` is set, unless `enabled = false`).
    #[serde(default)]
    pub wandb: WandbConfig,
    /// TensorBoard event files (`[tensorboard] dir`); off by default.
    #[serde(default)]
    pub tensorboard: crate::tensorboard::TensorboardConfig,
    /// Where the base config came from (the file, or `preset NAME`), for error messages.
    #[serde(skip)]
    pub source: String,
    /// Which layer set each key, for errors found after loading ([`RlConfig::source_of`]).
    #[serde(skip)]
    pub layers: Layers,
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
                (
                    Figment::from(super::Aliased { inner: Named(label.clone(), &text), aliases: super::aliases::RL }),
                    label,
                )
            }
            _ => base_layer(source, PRESETS, super::aliases::RL)?,
        };
        // `--algo NAME` picks the plugin, except when it names a preset used as the base: the
        // preset says which plugin it runs (`reinforce-pp-baseline` runs `reinforce-pp`).
        let preset_base = matches!(source, ConfigSource::Preset(n) if Some(n.as_str()) == algo && PRESETS.iter().any(|(p, _)| p == n));
        if let Some(algo) = algo.filter(|_| !preset_base) {
            fig = fig.merge(SetOverride {
                label: format!("--algo {algo}"),
                key: "algorithm.name".into(),
                value: toml::Value::String(algo.into()),
            });
        }
        let fig = layer(fig, &schema::<RlConfig>(), sets, super::aliases::RL)?;
        let mut cfg: RlConfig = fig.extract().map_err(|e| describe_figment(e, &label))?;
        let src = KeySource { fig: &fig, base: &label };
        super::plugin_sections::check(&src)?;
        cfg.validate(&src)?;
        let m = &cfg.model;
        let dropout = [&m.lora, &m.critic_lora].iter().filter(|l| l.rank > 0).map(|l| l.dropout).fold(0.0, f64::max);
        cfg.distributed.apply_to_checkpointing(&src, &mut cfg.train.gradient_checkpointing, dropout)?;
        cfg.source = label;
        cfg.layers = Layers(Some(fig.clone()));
        Ok((cfg, fig))
    }

    /// The layer that set dotted `key` — the file or preset, an `RLHF_` variable, a `--set` — for
    /// errors found after loading (`rewards[0].config.x` is looked up as `rewards`); the base
    /// source for a key no layer set.
    pub fn source_of(&self, key: &str) -> String {
        self.layers.of(key, &self.source)
    }

    fn validate(&self, src: &KeySource) -> Result<()> {
        self.environment.validate(self.rewards.len(), src)?;
        self.rollout.validate(self.model.lora.rank, src)?;
        if self.environment.enabled() && (self.rollout.overlong_filter || self.rollout.overlong_buffer > 0) {
            let key = if self.rollout.overlong_filter { "rollout.overlong_filter" } else { "rollout.overlong_buffer" };
            return Err(src.error(key, "applies to single-turn rollouts; an episode's length is not one response's"));
        }
        if self.rollout.engine == super::rollout::EngineKind::Vllm
            && self.rollout.vllm.weight_sync == super::rollout::WeightSync::Lora
            && self.warmup.steps > 0
        {
            return Err(src.error(
                "rollout.vllm.weight_sync",
                "\"lora\" serves the adapter on the server's base model, which a supervised warm-up changes: set \
                 warmup.steps = 0, or use \"full\"",
            ));
        }
        self.validate_train(src)?;
        self.rollout.filter_groups.validate(&self.score_names(), src)?;
        if !self.environment.enabled() || self.environment.reward != super::EnvReward::Env {
            self.validate_rewards(src)?;
        }
        let mut names: Vec<&str> = self.rewards.iter().map(|r| r.name.as_deref().unwrap_or(&r.plugin)).collect();
        if self.environment.scores_env() {
            names.push("env");
        }
        self.eval.validate(&names, src)?;
        self.distributed.validate(src)?;
        super::check_shared(src, &self.data.columns(), &self.tensorboard)?;
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        if self.data.max_prompt_len == 0 {
            return bad(
                "data.max_prompt_len",
                "must be >= 1 (a prompt of no tokens gives the policy nothing to answer)",
            );
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
        Ok(())
    }

    /// `[train]` and `[warmup]`: the optimizer settings through [`OptimConfig::check`] (its
    /// setting names mapped to this section's keys), then the loop's own.
    fn validate_train(&self, src: &KeySource) -> Result<()> {
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        let t = &self.train;
        for (lr_key, optim) in [("train.lr", t.actor_optim()), ("train.critic_lr", t.critic_optim())] {
            if let Err((setting, msg)) = optim.check() {
                let key = match setting {
                    "lr" => lr_key,
                    "betas" => "train.adam_betas",
                    "eps" => "train.adam_eps",
                    "weight_decay" => "train.weight_decay",
                    "max_grad_norm" => "train.max_grad_norm",
                    other => other,
                };
                return bad(key, msg);
            }
        }
        if t.minibatch_size == 0 {
            return bad("train.minibatch_size", "must be >= 1");
        }
        if t.gradient_accumulation_steps == 0 {
            return bad("train.gradient_accumulation_steps", "must be >= 1");
        }
        if t.ppo_epochs == 0 {
            return bad("train.ppo_epochs", "must be >= 1");
        }
        if t.logprob_chunk_elements < 1 {
            return bad("train.logprob_chunk_elements", "must be >= 1");
        }
        match t.micro_batch_tokens {
            Some(0) => return bad("train.micro_batch_tokens", "must be >= 1"),
            Some(_) if !t.padding_free => {
                let msg = "needs train.padding_free = true (a padded micro-batch costs its rows × the batch's width, \
                           whatever its tokens: train.minibatch_size sizes those)";
                return bad("train.micro_batch_tokens", msg);
            }
            Some(n) if (n as i64) < self.data.max_prompt_len as i64 + self.rollout.max_new_tokens => {
                let longest = self.data.max_prompt_len as i64 + self.rollout.max_new_tokens;
                tracing::warn!(
                    "train.micro_batch_tokens = {n} is less than the longest sequence (data.max_prompt_len + \
                     rollout.max_new_tokens = {longest}): a sequence longer than {n} tokens is a micro-batch of its own"
                );
            }
            _ => {}
        }
        for (key, lora) in
            [("model.lora.dropout", &self.model.lora), ("model.critic_lora.dropout", &self.model.critic_lora)]
        {
            if t.gradient_checkpointing && lora.rank > 0 && lora.dropout > 0.0 {
                let msg = format!("needs {key} = 0 (the recomputed forward would draw other dropout masks)");
                return bad("train.gradient_checkpointing", &msg);
            }
        }
        if let Some(d) = t.ema_decay {
            if !(0.0..1.0).contains(&d) {
                return bad("train.ema_decay", "must be in [0, 1)");
            }
        }
        if !t.ptx_coef.is_finite() {
            return bad("train.ptx_coef", "must be finite");
        }
        if t.ptx_coef != 0.0 && t.ptx_data.is_none() {
            return bad("train.ptx_data", "needed when train.ptx_coef != 0");
        }
        let w = &self.warmup;
        if w.target != "label" && w.target.strip_prefix("metadata.").is_none_or(str::is_empty) {
            return bad("warmup.target", "must be \"label\" or \"metadata.KEY\"");
        }
        if w.steps > 0 && w.batch_size == 0 {
            return bad("warmup.batch_size", "must be >= 1 when warmup.steps > 0");
        }
        if w.steps > 0 && !(w.lr.is_finite() && w.lr > 0.0) {
            return bad("warmup.lr", "must be a finite number > 0 when warmup.steps > 0");
        }
        let batch = self.rollout.prompts_per_batch * self.rollout.samples_per_prompt;
        if t.minibatch_size > batch {
            tracing::warn!(
                "train.minibatch_size = {} is more than a generation batch (rollout.prompts_per_batch × \
                 rollout.samples_per_prompt = {batch}): every optimizer step takes the whole batch",
                t.minibatch_size
            );
        }
        Ok(())
    }

    /// `[[rewards]]`: at least one, finite weights, distinct names (each source's metrics are
    /// `rewards/<name>/...`: two of one name would overwrite each other's).
    /// The names of a step's scores: the reward sources, `env`, `overlong`.
    fn score_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.rewards.iter().map(|r| r.name.clone().unwrap_or(r.plugin.clone())).collect();
        names.extend(self.environment.scores_env().then(|| "env".to_string()));
        names.extend((self.rollout.overlong_buffer > 0).then(|| "overlong".to_string()));
        names
    }

    fn validate_rewards(&self, src: &KeySource) -> Result<()> {
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        if self.rewards.is_empty() {
            return bad("rewards", "at least one [[rewards]] entry is needed");
        }
        let names: Vec<&str> = self.rewards.iter().map(|r| r.name.as_deref().unwrap_or(&r.plugin)).collect();
        for (i, r) in self.rewards.iter().enumerate() {
            if !r.weight.is_finite() {
                return bad(&format!("rewards[{i}].weight"), "must be finite");
            }
            if let Some(first) = names[..i].iter().position(|n| *n == names[i]) {
                return bad(
                    &format!("rewards[{i}].name"),
                    &format!(
                        "rewards[{first}] and rewards[{i}] are both named `{}` (a name defaults to the plugin's); \
                         their metrics would overwrite each other: give each a distinct `name`",
                        names[i]
                    ),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpo(sets: &[&str]) -> Result<RlConfig> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RlConfig::load(&ConfigSource::Preset("grpo".into()), None, &sets)
    }

    #[test]
    fn range_checks_name_the_key_and_the_layer() {
        let lr = "must be a finite number > 0";
        for (set, key, msg) in [
            ("train.lr=nan", "train.lr", lr),
            ("train.lr=-1e-5", "train.lr", lr),
            ("train.lr=inf", "train.lr", lr),
            ("train.critic_lr=-inf", "train.critic_lr", lr),
            ("train.critic_lr=nan", "train.critic_lr", lr),
            ("train.adam_betas=[2, 3]", "train.adam_betas", "must be two numbers in [0, 1)"),
            ("train.adam_eps=0", "train.adam_eps", "must be a finite number > 0"),
            ("train.weight_decay=-0.1", "train.weight_decay", "must be a finite number >= 0"),
            ("train.max_grad_norm=-1", "train.max_grad_norm", "must be >= 0"),
            ("rollout.top_k=-1", "rollout.top_k", "must be >= 0"),
            ("train.logprob_chunk_elements=0", "train.logprob_chunk_elements", "must be >= 1"),
            ("warmup.batch_size=0", "warmup.batch_size", "must be >= 1"),
            ("warmup.lr=0", "warmup.lr", "must be a finite number > 0"),
            ("warmup.lr=nan", "warmup.lr", "must be a finite number > 0"),
        ] {
            let e = grpo(&[set]).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--set {set}: {key}: {msg}")), "{set}: {e}");
        }
        // The warm-up's settings matter only when it runs.
        let cfg = grpo(&["warmup.steps=0", "warmup.batch_size=0", "warmup.lr=0"]).unwrap();
        assert_eq!(cfg.warmup.batch_size, 0);
        // A value from a file names the file.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[algorithm]\nname = \"grpo\"\n[train]\ncritic_lr = -1.0\n[[rewards]]\nplugin = \"reward-rules\"\n",
        )
        .unwrap();
        let e = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: train.critic_lr: {lr}", path.display())), "{e}");
    }

    #[test]
    fn reward_names_must_be_distinct() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let write = |rewards: &str| std::fs::write(&path, format!("[algorithm]\nname = \"grpo\"\n{rewards}")).unwrap();
        write(
            "[[rewards]]\nplugin = \"reward-rules\"\nname = \"accuracy\"\n[[rewards]]\nplugin = \"reward-model\"\n\
             [[rewards]]\nplugin = \"reward-http\"\nname = \"accuracy\"\n",
        );
        let e = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}: rewards[2].name: rewards[0] and rewards[2] are both named `accuracy`",
                path.display()
            )),
            "{e}"
        );
        // A name defaults to the plugin's.
        write("[[rewards]]\nplugin = \"reward-rules\"\n[[rewards]]\nplugin = \"reward-rules\"\nweight = 0.5\n");
        let e = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap_err().to_string();
        assert!(e.contains("rewards[0] and rewards[1] are both named `reward-rules`"), "{e}");
        write("[[rewards]]\nplugin = \"reward-rules\"\n[[rewards]]\nplugin = \"reward-rules\"\nname = \"format\"\n");
        let cfg = RlConfig::load(&ConfigSource::File(path.clone()), None, &[]).unwrap();
        assert_eq!(cfg.rewards.len(), 2);
    }

    #[test]
    fn plugin_sections_keep_the_layer_of_each_key() {
        let cfg = grpo(&["algorithm.config.beta=-1"]).unwrap();
        assert_eq!(cfg.source_of("algorithm.config.beta"), "--set algorithm.config.beta=-1");
        assert_eq!(cfg.source_of("algorithm.config.epsilon"), "preset grpo");
        assert_eq!(cfg.source_of("rewards[0].config.exact_match"), "preset grpo");
        // (The preset's [eval] judges answers by its `accuracy` source, which this replaces.)
        let cfg = grpo(&["rewards=[{ plugin = \"reward-rules\", config = { exact = 1 } }]", "eval.data=\"\""]).unwrap();
        assert!(cfg.source_of("rewards[0].config.exact").starts_with("--set rewards="));
        assert_eq!(RlConfig::default().source_of("algorithm.config.beta"), "");
        // A key no layer sets is blamed on the layer that made its section, not the preset.
        let cfg = grpo(&["environment.plugin=\"env-http\"", "environment.reward=\"sum\""]).unwrap();
        let src = cfg.source_of("environment.config.url");
        assert!(src.starts_with("--set environment."), "{src}");
        assert_eq!(cfg.source_of("nothing.here"), "preset grpo");
    }
}
