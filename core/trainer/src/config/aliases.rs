//! Old key names, still accepted: each layer (file, preset, `RLHF_` variable, `--set`) is read
//! through [`Aliased`], which moves a value from its old key to the new one before the layers are
//! merged, with a one-line deprecation warning naming the layer. Errors and `rlhf config show`
//! then speak of the new key only, and a layer that sets both is refused.

use figment::value::{Dict, Map, Tag, Value};
use figment::{Metadata, Profile, Provider};

/// An old dotted key and the key that replaced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alias {
    pub old: &'static str,
    pub new: &'static str,
}

/// The supervised phases' (`rlhf sft`, `rm`, `dpo`) old names: the RL run's vocabulary is theirs
/// now.
pub const SUPERVISED: &[Alias] = &[
    Alias { old: "train.grad_accum", new: "train.gradient_accumulation_steps" },
    Alias { old: "train.max_steps", new: "train.steps" },
    Alias { old: "train.save_every", new: "checkpoint.every" },
    Alias { old: "lora", new: "model.lora" },
];

/// `rlhf train`'s old names.
pub const RL: &[Alias] = &[Alias { old: "train.actor_lr", new: "train.lr" }];

/// `old`'s new name under `aliases` (itself when it has none); a key below an aliased table moves
/// with it (`lora.rank` → `model.lora.rank`).
pub fn canonical(key: &str, aliases: &[Alias]) -> String {
    for a in aliases {
        if key == a.old {
            return a.new.to_string();
        }
        if let Some(rest) = key.strip_prefix(a.old).and_then(|r| r.strip_prefix('.')) {
            return format!("{}.{rest}", a.new);
        }
    }
    key.to_string()
}

/// A provider whose old keys are renamed to their new names.
pub struct Aliased<P> {
    pub inner: P,
    pub aliases: &'static [Alias],
}

impl<P: Provider> Provider for Aliased<P> {
    fn metadata(&self) -> Metadata {
        self.inner.metadata()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut data = self.inner.data()?;
        let source = super::source_name(&self.inner.metadata());
        for dict in data.values_mut() {
            for a in self.aliases {
                let Some(value) = take(dict, a.old) else { continue };
                if get(dict, a.new).is_some() {
                    return Err(figment::Error::from(format!(
                        "{source}: `{}` and `{}` are both set (`{}` is the old name of `{}`; keep one)",
                        a.old, a.new, a.old, a.new
                    )));
                }
                tracing::warn!("{source}: `{}` is deprecated, read as `{}` (rename it)", a.old, a.new);
                put(dict, a.new, value);
            }
        }
        Ok(data)
    }
}

fn get<'a>(dict: &'a Dict, key: &str) -> Option<&'a Value> {
    let (head, rest) = match key.split_once('.') {
        Some((h, r)) => (h, Some(r)),
        None => (key, None),
    };
    match (dict.get(head)?, rest) {
        (v, None) => Some(v),
        (Value::Dict(_, d), Some(r)) => get(d, r),
        _ => None,
    }
}

fn take(dict: &mut Dict, key: &str) -> Option<Value> {
    match key.split_once('.') {
        None => dict.remove(key),
        Some((head, rest)) => match dict.get_mut(head)? {
            Value::Dict(_, d) => {
                let v = take(d, rest);
                if d.is_empty() {
                    dict.remove(head);
                }
                v
            }
            _ => None,
        },
    }
}

fn put(dict: &mut Dict, key: &str, value: Value) {
    match key.split_once('.') {
        None => {
            dict.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let entry = dict.entry(head.to_string()).or_insert_with(|| Value::Dict(Tag::Default, Dict::new()));
            if !matches!(entry, Value::Dict(..)) {
                *entry = Value::Dict(Tag::Default, Dict::new());
            }
            if let Value::Dict(_, d) = entry {
                put(d, rest, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::providers::{Format, Toml};
    use figment::Figment;

    #[test]
    fn old_keys_move_to_new_ones() {
        let text = "[train]\ngrad_accum = 4\nlr = 0.1\n[lora]\nrank = 8\n";
        let fig = Figment::from(Aliased { inner: Toml::string(text), aliases: SUPERVISED });
        assert_eq!(fig.extract_inner::<u32>("train.gradient_accumulation_steps").unwrap(), 4);
        assert_eq!(fig.extract_inner::<u32>("model.lora.rank").unwrap(), 8);
        assert!(fig.find_value("train.grad_accum").is_err() && fig.find_value("lora").is_err());
        assert_eq!(fig.extract_inner::<f64>("train.lr").unwrap(), 0.1);
        let both = "[train]\ngrad_accum = 4\ngradient_accumulation_steps = 2\n";
        let e = Figment::from(Aliased { inner: Toml::string(both), aliases: SUPERVISED })
            .extract_inner::<u32>("train.steps")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`train.grad_accum` and `train.gradient_accumulation_steps` are both set"), "{e}");
        assert_eq!(canonical("lora.rank", SUPERVISED), "model.lora.rank");
        assert_eq!(canonical("train.actor_lr", RL), "train.lr");
        assert_eq!(canonical("train.lr", RL), "train.lr");
    }
}
