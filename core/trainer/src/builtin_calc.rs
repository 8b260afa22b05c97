//! The built-in tool-use task: `builtin:multiplication` (products of a two-digit and a two- or
//! three-digit number, label the product) and `builtin:tiny-calc`, the tiny Llama with a
//! vocabulary that writes `env-calculator`'s tool calls: digits, `*`, `=` and the tags `<calc>`,
//! `</calc>`, `<result>`, `</result>` (whole tokens). Text has no spaces: digits are single tokens
//! and the decoder fuses them (`37*48=` ↔ `3 7 * 4 8 =`), so the calculator reads the expression
//! the policy wrote and the policy reads the result the calculator wrote, digit by digit.
//!
//! Each prompt's `metadata.demo` is a tool-using answer, `<calc>37*48</calc><result>1776</result>1776`:
//! the supervised warm-up of `configs/grpo-calculator.toml` (`warmup.target = "metadata.demo"`)
//! teaches the call format from it; RL then trains on episodes with the real calculator.

use serde_json::json;

use crate::data::{RawPrompt, SplitMix};
use crate::error::{Result, TrainerError};

/// The tool-call tags of `env-calculator`'s default config.
pub const TAGS: &[&str] = &["<calc>", "</calc>", "<result>", "</result>"];

/// Prompts of the task (600, seeded): every sixth is held out (`-test`, 100), the rest train
/// (`-train`, 500); `""` is all of them.
pub fn prompts(split: &str) -> Result<Vec<RawPrompt>> {
    let mut rng = SplitMix(0xCA1C);
    let all = (0..600usize).map(|i| {
        let a = 10 + rng.next_u64() % 90;
        let b = 10 + rng.next_u64() % 990;
        let p = a * b;
        let prompt = RawPrompt::Text {
            prompt: format!("{a}*{b}="),
            label: Some(p.to_string()),
            metadata: json!({"a": a, "b": b, "demo": format!("<calc>{a}*{b}</calc><result>{p}</result>{p}")}),
        };
        (i, prompt)
    });
    let keep = |i: usize| match split {
        "" => Ok(true),
        "-train" => Ok(i % 6 != 5),
        "-test" => Ok(i % 6 == 5),
        other => Err(TrainerError::Config(format!(
            "unknown built-in task `builtin:multiplication{other}` (available: builtin:multiplication, \
             builtin:multiplication-train, builtin:multiplication-test)"
        ))),
    };
    let mut out = Vec::new();
    for (i, p) in all {
        if keep(i)? {
            out.push(p);
        }
    }
    Ok(out)
}

/// `tokenizer.json` of `builtin:tiny-calc` and its vocabulary size: `<pad>` 0, `<eos>` 1,
/// `<unk>` 2, digits 3–12, `*` 13, `=` 14, the tags 15–18.
pub fn tokenizer_json() -> (serde_json::Value, i64) {
    let specials = ["<pad>", "<eos>", "<unk>"];
    let digits: Vec<String> = (0..10).map(|d| d.to_string()).collect();
    let words: Vec<&str> = specials
        .iter()
        .copied()
        .chain(digits.iter().map(String::as_str))
        .chain(["*", "="])
        .chain(TAGS.iter().copied())
        .collect();
    let vocab: serde_json::Map<String, serde_json::Value> =
        words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
    let added: Vec<_> = words
        .iter()
        .enumerate()
        .filter(|(_, w)| specials.contains(w) || TAGS.contains(w))
        .map(|(i, w)| {
            json!({"id": i, "content": w, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": specials.contains(w)})
        })
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Digits", "individual_digits": true},
            {"type": "Punctuation", "behavior": "Isolated"}
        ]},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    (tok, words.len() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calc_vocabulary_round_trips_prompts_and_tool_calls() {
        let dir = tempfile::tempdir().unwrap();
        crate::builtin_models::write_model("tiny-calc", dir.path(), 1).unwrap();
        let tok = rlhf_tokenizer::HfTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.encode("37*48=", false).unwrap(), [6, 10, 13, 7, 11, 14]);
        let demo = "<calc>37*48</calc><result>1776</result>1776";
        let ids = tok.encode(demo, false).unwrap();
        assert_eq!(ids.len(), 17);
        assert_eq!(&ids[..2], &[15, 6]);
        assert!(!ids.contains(&2), "no unknown token in {ids:?}");
        assert_eq!(tok.decode(&[&ids[..], &[1]].concat(), true).unwrap(), demo);
        let m = rlhf_models::CausalLm::from_dir(dir.path(), tch::Device::Cpu, tch::Kind::Float).unwrap();
        assert_eq!(m.arch().vocab_size, 19);
    }

    #[test]
    fn the_task_splits_into_train_and_test() {
        let (train, test, all) = (prompts("-train").unwrap(), prompts("-test").unwrap(), prompts("").unwrap());
        assert_eq!((train.len(), test.len(), all.len()), (500, 100, 600));
        match &all[0] {
            RawPrompt::Text { prompt, label: Some(l), metadata } => {
                let (a, b) = (metadata["a"].as_u64().unwrap(), metadata["b"].as_u64().unwrap());
                assert_eq!(prompt, &format!("{a}*{b}="));
                assert_eq!(l, &(a * b).to_string());
                assert_eq!(metadata["demo"], format!("<calc>{a}*{b}</calc><result>{l}</result>{l}"));
            }
            other => panic!("{other:?}"),
        }
        assert!(prompts("-nope").is_err());
    }
}
