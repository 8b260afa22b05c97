//! `cargo xtask gen-arith`: writes `configs/data/arith-words.jsonl`, the synthetic arithmetic
//! word problems of `configs/grpo-smollm2.toml`, and the drills of `configs/grpo-smollm2-arith.toml`
//! ([`crate::arith_drill`]). The problems come from seeded generators, so the committed files can
//! be checked against them (`--check`, and unit tests).
//!
//! Each line is a chat prompt and its answer:
//! `{"messages": [{"role": "system", ...}, {"role": "user", ...}], "label": "17", "kind": "add"}`.
//! The system prompt asks for the final answer after `####` on the last line, which is what
//! `reward-rules` extracts (`extract = "hash"`, or `auto`) and what its default `format` pattern
//! checks.

use std::{fs, path::Path};

use anyhow::{bail, Context, Result};

use crate::splitmix::Rng;

/// Where the data lives, relative to the project root.
pub(crate) const DEFAULT_OUT: &str = "configs/data/arith-words.jsonl";
/// How many problems, and the generator's seed.
const COUNT: usize = 200;
const SEED: u64 = 20_241_122;

pub(crate) const SYSTEM_PROMPT: &str = "You are a careful math tutor. Solve the word problem step by step. \
On the last line, write the final answer as a whole number after '####', like this:\n#### 42";

const NAMES: [&str; 10] = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jun"];
const ITEMS: [&str; 10] =
    ["apples", "marbles", "pencils", "stickers", "cookies", "books", "coins", "flowers", "shells", "cards"];

/// One problem: its kind, question and integer answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) kind: &'static str,
    pub(crate) question: String,
    pub(crate) answer: i64,
}

fn problem(rng: &mut Rng) -> Problem {
    let name = rng.pick(&NAMES);
    let item = rng.pick(&ITEMS);
    match rng.next() % 5 {
        0 => {
            let (a, b) = (rng.range(2, 30), rng.range(2, 30));
            Problem {
                kind: "add",
                question: format!(
                    "{name} has {a} {item}. A friend gives {name} {b} more. How many {item} does {name} have now?"
                ),
                answer: a + b,
            }
        }
        1 => {
            let a = rng.range(10, 40);
            let b = rng.range(1, a - 1);
            Problem {
                kind: "sub",
                question: format!(
                    "{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?"
                ),
                answer: a - b,
            }
        }
        2 => {
            let (a, b) = (rng.range(2, 9), rng.range(2, 9));
            Problem {
                kind: "mul",
                question: format!(
                    "There are {a} boxes with {b} {item} in each box. How many {item} are there in total?"
                ),
                answer: a * b,
            }
        }
        3 => {
            let (each, friends) = (rng.range(2, 9), rng.range(2, 6));
            let total = each * friends;
            Problem {
                kind: "div",
                question: format!(
                    "{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
                ),
                answer: each,
            }
        }
        _ => {
            let (a, b) = (rng.range(5, 25), rng.range(2, 15));
            let c = rng.range(1, a + b - 1);
            Problem {
                kind: "two-step",
                question: format!(
                    "{name} has {a} {item}, buys {b} more, and then loses {c}. How many {item} does {name} have now?"
                ),
                answer: a + b - c,
            }
        }
    }
}

/// The `COUNT` distinct problems of the data set, in order.
pub(crate) fn problems() -> Vec<Problem> {
    let mut rng = Rng(SEED);
    let mut out: Vec<Problem> = Vec::with_capacity(COUNT);
    while out.len() < COUNT {
        let p = problem(&mut rng);
        if !out.iter().any(|q| q.question == p.question) {
            out.push(p);
        }
    }
    out
}

/// The JSONL text of the data set. Keys are written in a fixed order by hand (serde_json's map
/// order depends on a feature another crate of the build may switch on).
pub(crate) fn jsonl() -> String {
    let js = |s: &str| serde_json::Value::from(s).to_string();
    let mut text = String::new();
    for p in problems() {
        text.push_str(&format!(
            r#"{{"messages":[{{"role":"system","content":{}}},{{"role":"user","content":{}}}],"label":{},"kind":{}}}"#,
            js(SYSTEM_PROMPT),
            js(&p.question),
            js(&p.answer.to_string()),
            js(p.kind),
        ));
        text.push('\n');
    }
    text
}

/// `gen-arith [--out FILE] [--check]`.
pub(crate) fn run(out: Option<&Path>, check: bool) -> Result<()> {
    let root = match out {
        Some(dir) => dir.to_path_buf(),
        None => crate::project_root(),
    };
    let (train, test) = crate::arith_drill::drills();
    let files = [
        (root.join(DEFAULT_OUT), jsonl(), COUNT),
        (root.join(crate::arith_drill::TRAIN_OUT), crate::arith_drill::jsonl(&train), train.len()),
        (root.join(crate::arith_drill::TEST_OUT), crate::arith_drill::jsonl(&test), test.len()),
    ];
    for (path, text, n) in files {
        if check {
            let existing = fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
            if existing != text {
                bail!("{} differs from what `cargo xtask gen-arith` generates; regenerate it", path.display());
            }
            eprintln!("{} is up to date ({n} problems)", path.display());
            continue;
        }
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("could not create {}", dir.display()))?;
        }
        fs::write(&path, text).with_context(|| format!("could not write {}", path.display()))?;
        eprintln!("wrote {n} problems to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_distinct_with_correct_non_negative_answers() {
        let ps = problems();
        assert_eq!(ps.len(), COUNT);
        for p in &ps {
            let nums: Vec<i64> = p
                .question
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect();
            let want = match (p.kind, nums.as_slice()) {
                ("add", [a, b]) => a + b,
                ("sub", [a, b]) => a - b,
                ("mul", [a, b]) => a * b,
                ("div", [total, friends]) => {
                    assert_eq!(total % friends, 0, "{p:?}");
                    total / friends
                }
                ("two-step", [a, b, c]) => a + b - c,
                _ => panic!("unexpected problem {p:?}"),
            };
            assert_eq!(p.answer, want, "{p:?}");
            assert!(p.answer > 0, "{p:?}");
        }
        for kind in ["add", "sub", "mul", "div", "two-step"] {
            assert!(ps.iter().filter(|p| p.kind == kind).count() >= 20, "{kind} underrepresented");
        }
    }

    #[test]
    fn the_committed_file_is_what_the_generator_writes() {
        let path = crate::project_root().join(DEFAULT_OUT);
        let committed = fs::read_to_string(&path).unwrap();
        assert!(committed == jsonl(), "{} is stale: run `cargo xtask gen-arith`", path.display());
        let first: serde_json::Value = serde_json::from_str(committed.lines().next().unwrap()).unwrap();
        assert_eq!(first["messages"][0]["content"], SYSTEM_PROMPT);
        assert!(first["label"].is_string());
    }
}
