//! The embedded default: a built-in task and a tiny Llama that `rlhf train --algo NAME` can run on a
//! CPU with nothing downloaded. The model is a real Hugging Face checkpoint written to disk
//! (`config.json`, safetensors, a word-level `tokenizer.json`), randomly initialised like
//! transformers does, so everything downstream — loading, generation, saving — is the same path a
//! real model takes; transformers loads it too.
//!
//! Task `builtin:addition`: prompts `a + b =` over single digits with `a + b <= 9`, label `a + b`;
//! a response is correct when its number equals the label (scored by `reward-rules`). Its split
//! `builtin:addition-train` / `builtin:addition-test` (44 / 11 prompts) is the presets' training
//! and held-out evaluation data.
//! Datasets `builtin:addition-sft` and `builtin:addition-pairs` ([`dataset`]) feed `rlhf sft` and
//! `rlhf rm` (the `cargo xtask pipeline` default), each with a held-out eval split.

use serde_json::json;

use crate::data::RawPrompt;
use crate::error::{Result, TrainerError};

/// Words of the built-in vocabulary after the three specials (`<pad>`, `<eos>`, `<unk>`).
pub(crate) const WORDS: &[&str] = &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", "the", "answer", "is"];

/// Prompts of `builtin:addition`, in a fixed order.
pub fn addition_prompts() -> Vec<RawPrompt> {
    let mut out = Vec::new();
    for a in 0..10u32 {
        for b in 0..10u32 {
            if a + b <= 9 {
                out.push(RawPrompt::Text {
                    prompt: format!("{a} + {b} ="),
                    label: Some((a + b).to_string()),
                    metadata: json!({"a": a, "b": b}),
                });
            }
        }
    }
    out
}

/// Prompts of a named built-in task: `addition` (all 55), or its split into `addition-train`
/// (44) and `addition-test` (the 11 prompts [`held_out`] of every built-in dataset), which share
/// no prompt: the presets train on the first and evaluate on the second.
pub fn task_prompts(name: &str) -> Result<Vec<RawPrompt>> {
    let split = |test: bool| {
        addition_prompts().into_iter().enumerate().filter(|&(i, _)| held_out(i) == test).map(|(_, p)| p).collect()
    };
    if let Some(split) = name.strip_prefix("multiplication") {
        return crate::builtin_calc::prompts(split);
    }
    if let Some(split) = name.strip_prefix("shapes") {
        return crate::builtin_shapes::prompts(split);
    }
    match name {
        "addition" => Ok(addition_prompts()),
        "addition-train" => Ok(split(false)),
        "addition-test" => Ok(split(true)),
        other => Err(TrainerError::Config(format!(
            "unknown built-in task `builtin:{other}` (available: builtin:addition, builtin:addition-train, \
             builtin:addition-test, builtin:multiplication, builtin:multiplication-train, builtin:multiplication-test, \
             builtin:shapes, builtin:shapes-train, builtin:shapes-test)"
        ))),
    }
}

/// The prompts `cfg.prompts` names: a built-in task (`builtin:NAME`) or a JSONL / Parquet file
/// read with `cfg`'s columns.
pub fn prompts_of(cfg: &crate::config::DataConfig) -> Result<Vec<RawPrompt>> {
    match cfg.prompts.strip_prefix("builtin:") {
        Some(task) => task_prompts(task),
        None => crate::data::read_prompt_data(cfg),
    }
}

/// (prompt, correct response) pairs for the supervised warm-up of a built-in task.
pub fn task_demonstrations(name: &str) -> Result<Vec<(String, String)>> {
    Ok(task_prompts(name)?
        .into_iter()
        .filter_map(|p| match p {
            RawPrompt::Text { prompt, label: Some(l), .. } => Some((prompt, l)),
            _ => None,
        })
        .collect())
}

/// Prompts of `builtin:addition` held out of the supervised built-in datasets (every fifth, from the
/// third): 11 of 55.
fn held_out(index: usize) -> bool {
    index % 5 == 2
}

/// Malformed answers to a prompt whose sum is `c`: every non-digit word alone, the answer repeated
/// or followed by a symbol, and six seeded random strings of 1–4 vocabulary words (never the bare
/// correct answer), so a reward model trained on them covers what a policy may say instead of a
/// number and does not reward rambling.
fn malformed(c: u32, seed: u64) -> Vec<String> {
    let mut out: Vec<String> = WORDS[10..].iter().map(|w| format!(" {w}")).collect();
    out.extend([format!(" {c} {c}"), format!(" {c} =")]);
    let mut rng = crate::data::SplitMix(seed.wrapping_mul(0x51_7CC1_B727_220A) ^ 0xADD);
    while out.len() < 13 {
        let len = 1 + (rng.next_u64() % 4) as usize;
        let words: Vec<&str> = (0..len).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect();
        let s = format!(" {}", words.join(" "));
        if s != format!(" {c}") && !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// A built-in supervised or preference dataset as JSON lines, `(train, eval)`, generated
/// deterministically:
///
/// - `addition-sft`: `{"prompt": "3 + 4 =", "response": "7"}` for every `builtin:addition` prompt;
///   eval = 11 held-out prompts.
/// - `addition-pairs`: DeepSpeed-Chat's format, `{"prompt": "3 + 4 =", "chosen": " 7", "rejected":
///   " 5"}` (responses with a leading space, as DSC writes them): per prompt, every wrong digit and
///   13 malformed answers (every non-digit word alone, `" 7 7"`, `" 7 ="`, random word strings) are
///   rejected against the correct sum; eval = every pair of the 11 held-out prompts (242), train =
///   those of the other 44 (968), so held-out accuracy is measured on prompts never trained on.
pub fn dataset(name: &str) -> Result<(Vec<serde_json::Value>, Vec<serde_json::Value>)> {
    let prompts = addition_prompts();
    let sums = prompts.iter().map(|p| match p {
        RawPrompt::Text { prompt, label: Some(l), .. } => (prompt.clone(), l.clone()),
        _ => (String::new(), String::new()),
    });
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    match name {
        "addition-sft" => {
            for (i, (prompt, sum)) in sums.enumerate() {
                let line = json!({"prompt": prompt, "response": sum});
                if held_out(i) {
                    eval.push(line)
                } else {
                    train.push(line)
                }
            }
        }
        "addition-pairs" => {
            for (i, (prompt, sum)) in sums.enumerate() {
                let c: u32 = sum.parse().unwrap_or(0);
                let wrong = (0..10u32).filter(|&w| w != c).map(|w| format!(" {w}"));
                let lines = wrong
                    .chain(malformed(c, i as u64))
                    .map(|bad| json!({"prompt": prompt, "chosen": format!(" {c}"), "rejected": bad}));
                if held_out(i) {
                    eval.extend(lines)
                } else {
                    train.extend(lines)
                }
            }
        }
        other => {
            return Err(TrainerError::Config(format!(
                "unknown built-in dataset `builtin:{other}` (available: builtin:addition-sft, builtin:addition-pairs)"
            )))
        }
    }
    Ok((train, eval))
}

pub(crate) fn tokenizer_json() -> serde_json::Value {
    crate::builtin_tokenizer::word_level_tokenizer(
        &["<pad>", "<eos>", "<unk>"],
        WORDS.iter().map(|w| w.to_string()),
        "<unk>",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin_models::{write_model, write_tiny_model};
    use tch::{Device, Kind};

    #[test]
    fn tiny_model_loads_and_tokenizes() {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(dir.path(), 1).unwrap();
        let tok = rlhf_tokenizer::HfTokenizer::from_dir(dir.path()).unwrap();
        let ids = tok.encode("3 + 4 =", true).unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(tok.decode(&[ids[0], 1], true).unwrap(), "3");
        assert_eq!(tok.eos_token_ids(), &[1]);
        let m = rlhf_models::CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
        assert_eq!(m.arch().vocab_size, 18);
        assert_eq!(addition_prompts().len(), 55);
        // `prompt + response` without a space still splits the answer off (the reward model reads it).
        assert_eq!(tok.encode("3 + 4 =7", true).unwrap(), tok.encode("3 + 4 = 7", true).unwrap());
        // The Qwen3 variants load with the same vocabulary.
        for name in ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5"] {
            let dir = tempfile::tempdir().unwrap();
            write_model(name, dir.path(), 1).unwrap();
            let m = rlhf_models::CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
            assert_eq!((m.arch().vocab_size, m.arch().head_dim), (18, 32), "{name}");
            assert_eq!(m.arch().moe.is_some(), name.ends_with("moe"));
        }
    }

    /// The presets' training and held-out prompts: together the task, sharing no prompt.
    #[test]
    fn addition_train_and_test_share_no_prompt() {
        let text = |name: &str| -> Vec<String> {
            task_prompts(name)
                .unwrap()
                .into_iter()
                .map(|p| match p {
                    RawPrompt::Text { prompt, .. } => prompt,
                    RawPrompt::Chat { .. } => unreachable!(),
                })
                .collect()
        };
        let (train, test, all) = (text("addition-train"), text("addition-test"), text("addition"));
        assert_eq!((train.len(), test.len()), (44, 11));
        assert!(test.iter().all(|p| !train.contains(p)), "a held-out prompt is trained on");
        let mut both = [train, test].concat();
        both.sort();
        let mut all = all;
        all.sort();
        assert_eq!(both, all);
        // The supervised warm-up of a run on the split sees only its training prompts.
        assert_eq!(task_demonstrations("addition-train").unwrap().len(), 44);
    }

    #[test]
    fn builtin_datasets_split_deterministically() {
        let (train, eval) = dataset("addition-sft").unwrap();
        assert_eq!((train.len(), eval.len()), (44, 11));
        assert_eq!(train[0], json!({"prompt": "0 + 0 =", "response": "0"}));
        let (train, eval) = dataset("addition-pairs").unwrap();
        assert_eq!((train.len(), eval.len()), (968, 242));
        let prompts = |v: &[serde_json::Value]| v.iter().map(|l| l["prompt"].clone()).collect::<Vec<_>>();
        assert!(prompts(&eval).iter().all(|p| !prompts(&train).contains(p)), "an eval prompt is trained on");
        assert!(eval.iter().all(|l| l["chosen"] != l["rejected"]));
        assert_eq!(dataset("addition-pairs").unwrap().1, eval);
        assert!(dataset("nope").unwrap_err().to_string().contains("builtin:addition-sft"));
    }
}
