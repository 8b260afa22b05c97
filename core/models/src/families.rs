//! Which family a `config.json` is, and loading it: the `model_type` picks the family file that
//! resolves its keys ([`crate::llama`], [`crate::qwen3`], [`crate::qwen3_moe`], [`crate::gemma`],
//! [`crate::gemma4`], [`crate::olmo2`], [`crate::olmo3`], [`crate::phi3`], [`crate::qwen3_5`], [`crate::gpt2`]); before that, every key must be one the
//! family implements or one known not to change the computation ([`config::keys`]).

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{keys, parse_json, read_json, ArchConfig, Family, HfConfig, ModelConfig, Multimodal};
use crate::error::{ModelError, Result};

impl ModelConfig {
    /// Loads `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let raw: Value = read_json(&path)?;
        let Some(obj) = raw.as_object() else {
            return Err(ModelError::Json { path, message: "expected a JSON object".into() });
        };
        let hf: HfConfig = parse_json(&path, &raw.to_string())?;
        let model_type = hf.model_type.as_deref().ok_or_else(|| ModelError::config(&path, "model_type", "missing"))?;
        if let Some(mm) = MULTIMODAL.iter().find(|m| m.model_type == model_type) {
            let (hf, arch) = text_of(&path, obj, &hf, mm)?;
            return Ok(ModelConfig { path, raw, hf, arch });
        }
        let family = Family::from_model_type(model_type).ok_or_else(|| {
            ModelError::config(
                &path,
                "model_type",
                format!("unsupported `{model_type}` (supported: {})", Family::supported()),
            )
        })?;
        check_keys(&path, obj, family, "")?;
        let arch = resolve(&path, &hf, family)?;
        Ok(ModelConfig { path, raw, hf, arch })
    }
}

impl ModelConfig {
    /// Switches a multimodal model to its older tensor names when `ckpt` stores them so
    /// ([`Multimodal::legacy`]).
    pub(crate) fn match_checkpoint(&mut self, ckpt: &crate::weights::Checkpoint) {
        let Some(mm) = self.arch.multimodal else { return };
        let Some(legacy) = mm.legacy else { return };
        let embed = |m: &Multimodal| format!("{}.embed_tokens.weight", m.language_prefix);
        if !ckpt.contains(&embed(mm)) && ckpt.contains(&embed(legacy)) {
            self.arch.multimodal = Some(legacy);
        }
    }
}

/// Multimodal checkpoints whose language model loads as one of the text families.
const MULTIMODAL: &[&Multimodal] = &[
    &crate::qwen3_5::MULTIMODAL,
    &crate::qwen3_5::MULTIMODAL_MOE,
    &crate::gemma4::MULTIMODAL,
    &crate::qwen2_5_vl::MULTIMODAL,
    &crate::qwen3_vl::MULTIMODAL,
    &crate::qwen3_vl::MULTIMODAL_MOE,
];

/// The language model of a multimodal checkpoint: its `text_config` (or, for a flat config, the
/// top level without the vision keys) resolved as the text family (keys checked under
/// `text_config.`), with what only the top level says (`architectures`, the labels,
/// `tie_word_embeddings`); every top-level key must be `text_config`, inert, or the vision
/// model's. Where the family's vision tower is implemented, its `vision_config` and the
/// multimodal RoPE are read too.
fn text_of(
    path: &Path,
    obj: &Map<String, Value>,
    top: &HfConfig,
    mm: &'static Multimodal,
) -> Result<(HfConfig, ArchConfig)> {
    let (mut text, scope) = match obj.get("text_config") {
        Some(t) => (text_config(path, obj, t, mm)?, "text_config."),
        None if mm.flat => {
            let outer = |k: &String| mm.keys.contains(&k.as_str()) || k == "model_type";
            (obj.iter().filter(|(k, _)| !outer(k)).map(|(k, v)| (k.clone(), v.clone())).collect(), "")
        }
        None => {
            return Err(ModelError::config(
                path,
                "text_config",
                "missing: the language model's keys are not in this config",
            ))
        }
    };
    let mrope = crate::config::vision::take_mrope(path, &mut text, scope)?;
    if let Some(hook) = mm.text_hook {
        hook(&mut text);
    }
    check_keys(path, &text, mm.family, scope)?;
    let mut hf: HfConfig = parse_json(path, &Value::Object(text).to_string())?;
    hf.architectures = top.architectures.clone();
    hf.num_labels = top.num_labels.or(hf.num_labels);
    hf.id2label = top.id2label.clone().or(hf.id2label);
    hf.tie_word_embeddings = top.tie_word_embeddings.or(hf.tie_word_embeddings);
    if top.pad_token_id.is_some() {
        hf.pad_token_id = top.pad_token_id.clone();
    }
    let mut arch = resolve(path, &hf, mm.family)?;
    arch.multimodal = Some(mm);
    if let Some(read) = mm.vision {
        let vision = read(path, obj)?;
        if vision.out_hidden_size != arch.hidden_size {
            return Err(ModelError::config(
                path,
                "vision_config.out_hidden_size",
                format!("{} is not the language model's hidden_size {}", vision.out_hidden_size, arch.hidden_size),
            ));
        }
        let half = arch.rotary_dim / 2;
        let section = |section| crate::config::Mrope { section, interleaved: true };
        let mut mrope = mrope
            .or(mm.mrope_section.map(section))
            .ok_or_else(|| ModelError::config(path, &format!("{scope}rope_scaling.mrope_section"), "missing"))?;
        // transformers' Qwen3-VL and Qwen3.5 interleave the axes whatever `mrope_interleaved` says.
        let interleaved = vision.kind == crate::config::TowerKind::Qwen3;
        mrope.interleaved |= interleaved;
        if !interleaved && mrope.section.iter().sum::<i64>() != half {
            return Err(ModelError::config(
                path,
                &format!("{scope}rope_scaling.mrope_section"),
                format!("{:?} does not add up to the {half} rotary frequencies of a head", mrope.section),
            ));
        }
        if let Some(rope) = arch.rope.as_mut() {
            rope.mrope = Some(mrope);
        }
        if vision.deepstack_blocks.len() as i64 > arch.num_layers {
            return Err(ModelError::config(
                path,
                "vision_config.deepstack_visual_indexes",
                format!("{} deep-stack features for {} decoder layers", vision.deepstack_blocks.len(), arch.num_layers),
            ));
        }
        arch.vision = Some(vision);
    }
    Ok((hf, arch))
}

/// The `text_config` of a nested multimodal config, after checking the top-level keys around it
/// and its `model_type`.
fn text_config(path: &Path, obj: &Map<String, Value>, text: &Value, mm: &Multimodal) -> Result<Map<String, Value>> {
    let allowed = allowed_keys();
    for key in obj.keys().map(String::as_str) {
        let known = key == "text_config"
            || key == "tie_word_embeddings"
            || keys::INERT.contains(&key)
            || mm.keys.contains(&key);
        if !known && !allowed.iter().any(|a| a == key) {
            return Err(ModelError::config(
                path,
                key,
                format!(
                    "not a key this loader implements for model_type `{}` (refused rather than ignored)",
                    mm.model_type
                ),
            ));
        }
    }
    let text = text.as_object().ok_or_else(|| ModelError::config(path, "text_config", "expected an object"))?;
    match text.get("model_type").and_then(Value::as_str) {
        None => {}
        Some(t) if t == mm.text_model_type => {}
        Some(other) => {
            return Err(ModelError::config(
                path,
                "text_config.model_type",
                format!("`{other}` in a `{}` checkpoint (expected `{}`)", mm.model_type, mm.text_model_type),
            ))
        }
    }
    Ok(text.clone())
}

/// `RLHF_ALLOW_CONFIG_KEYS`, split.
fn allowed_keys() -> Vec<String> {
    let allowed = std::env::var("RLHF_ALLOW_CONFIG_KEYS").unwrap_or_default();
    allowed.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
}

/// `pad_token_id`: an integer, the first of a list, or none.
fn pad_token_id(path: &Path, hf: &HfConfig) -> Result<Option<i64>> {
    match &hf.pad_token_id {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_i64()),
        Some(Value::Array(a)) => Ok(a.first().and_then(Value::as_i64)),
        Some(other) => Err(ModelError::config(path, "pad_token_id", format!("expected an integer, got {other}"))),
    }
}

fn resolve(path: &Path, hf: &HfConfig, family: Family) -> Result<ArchConfig> {
    let mut arch = match family {
        Family::Gpt2 => crate::gpt2::resolve(path, hf)?,
        Family::Llama | Family::Mistral | Family::Qwen2 => crate::llama::resolve(path, hf, family)?,
        Family::Qwen3 => crate::qwen3::resolve(path, hf)?,
        Family::Qwen3Moe => crate::qwen3_moe::resolve(path, hf)?,
        Family::Gemma2 | Family::Gemma3 => crate::gemma::resolve(path, hf, family)?,
        Family::Olmo2 => crate::olmo2::resolve(path, hf)?,
        Family::Olmo3 => crate::olmo3::resolve(path, hf)?,
        Family::Phi3 => crate::phi3::resolve(path, hf)?,
        Family::Qwen3_5 | Family::Qwen3_5Moe | Family::Qwen3Next => crate::qwen3_5::resolve(path, hf, family)?,
        Family::GptOss => crate::gpt_oss::resolve(path, hf)?,
        Family::Gemma4 => crate::gemma4::resolve(path, hf)?,
    };
    arch.pad_token_id = pad_token_id(path, hf)?;
    arch.num_labels = hf.num_labels.or(hf.id2label.as_ref().map(|m| m.len() as i64)).unwrap_or(2);
    Ok(arch)
}

/// The keys `family` implements (beyond [`keys::INERT`]).
fn family_keys(family: Family) -> Vec<&'static str> {
    use crate::qwen3_5::{CONFIG_KEYS as HYBRID, MOE_KEYS, NEXT_KEYS};
    let keys: &[&str] = match family {
        Family::Qwen3_5Moe => return [HYBRID, MOE_KEYS].concat(),
        Family::Qwen3Next => return [HYBRID, MOE_KEYS, NEXT_KEYS].concat(),
        Family::Gpt2 => crate::gpt2::CONFIG_KEYS,
        Family::Llama | Family::Mistral | Family::Qwen2 => crate::llama::CONFIG_KEYS,
        Family::Qwen3 => crate::qwen3::CONFIG_KEYS,
        Family::Qwen3Moe => crate::qwen3_moe::CONFIG_KEYS,
        Family::Gemma2 | Family::Gemma3 => crate::gemma::CONFIG_KEYS,
        Family::Olmo2 => crate::olmo2::CONFIG_KEYS,
        Family::Olmo3 => crate::olmo3::CONFIG_KEYS,
        Family::Phi3 => crate::phi3::CONFIG_KEYS,
        Family::Qwen3_5 => HYBRID,
        Family::GptOss => crate::gpt_oss::CONFIG_KEYS,
        Family::Gemma4 => crate::gemma4::CONFIG_KEYS,
    };
    keys.to_vec()
}

/// Refuses the first key of `config` that is neither inert, implemented by `family`, nor allowed
/// by the user (`RLHF_ALLOW_CONFIG_KEYS`); errors name it after `scope` (`text_config.`).
pub(crate) fn check_keys(path: &Path, config: &Map<String, Value>, family: Family, scope: &str) -> Result<()> {
    let allowed = allowed_keys();
    let own = family_keys(family);
    let rotary = family != Family::Gpt2;
    for key in config.keys() {
        let k = key.as_str();
        let known = keys::INERT.contains(&k) || own.contains(&k) || (rotary && keys::ROTARY_DECODER.contains(&k));
        if !known && !allowed.iter().any(|a| a == k) {
            return Err(ModelError::config(
                path,
                &format!("{scope}{k}"),
                format!(
                    "not a key this loader implements for model_type `{}`; it may change the computation, so it is \
                     refused rather than ignored (if it does not, list it in RLHF_ALLOW_CONFIG_KEYS)",
                    family.model_type()
                ),
            ));
        }
    }
    Ok(())
}
