//! The arithmetic drills of `configs/grpo-smollm2-arith.toml`: one-step questions
//! ("What is 23 + 9?", "What is 31 - 14?", "What is 7 times 8?") that SmolLM2-135M-Instruct
//! answers right about one time in six, greedily, before any RL — often with the right sum
//! followed by a ramble whose last number is not it. A training file and a held-out file with no
//! question in common (held-out questions distinct; training ones may repeat), from the same seeded generator as the word problems (`cargo xtask
//! gen-arith` writes and `--check`s them).
//!
//! Each line: `{"messages": [{"role": "user", "content": "What is 23 + 9?"}], "label": "32", "kind": "add"}`.

use crate::splitmix::Rng;

/// The files, relative to the project root.
pub(crate) const TRAIN_OUT: &str = "configs/data/arith-drill-train.jsonl";
pub(crate) const TEST_OUT: &str = "configs/data/arith-drill-test.jsonl";
/// Questions per file, and the generator's seed.
const TRAIN: usize = 1500;
const TEST: usize = 150;
const SEED: u64 = 20_261_127;

/// One drill: kind, question and answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Drill {
    pub(crate) kind: &'static str,
    pub(crate) question: String,
    pub(crate) answer: i64,
}

/// The `i`-th drill of a file: kinds cycle add, sub, mul, so every file holds a third of each.
fn drill(rng: &mut Rng, i: usize) -> Drill {
    match i % 3 {
        0 => {
            let (a, b) = (rng.range(2, 30), rng.range(2, 30));
            Drill { kind: "add", question: format!("What is {a} + {b}?"), answer: a + b }
        }
        1 => {
            let a = rng.range(10, 40);
            let b = rng.range(1, a - 1);
            Drill { kind: "sub", question: format!("What is {a} - {b}?"), answer: a - b }
        }
        _ => {
            let (a, b) = (rng.range(2, 10), rng.range(2, 10));
            Drill { kind: "mul", question: format!("What is {a} times {b}?"), answer: a * b }
        }
    }
}

/// The training drills and the held-out drills. Held-out questions are distinct; training
/// questions may repeat (there are only 81 products) but never appear in the held-out file.
pub(crate) fn drills() -> (Vec<Drill>, Vec<Drill>) {
    let mut rng = Rng(SEED);
    let mut held_out = std::collections::HashSet::new();
    let mut test = Vec::with_capacity(TEST);
    while test.len() < TEST {
        let d = drill(&mut rng, test.len());
        if held_out.insert(d.question.clone()) {
            test.push(d);
        }
    }
    let mut train = Vec::with_capacity(TRAIN);
    while train.len() < TRAIN {
        let d = drill(&mut rng, train.len());
        if !held_out.contains(&d.question) {
            train.push(d);
        }
    }
    (train, test)
}

/// The JSONL text of `drills` (keys in a fixed order, written by hand).
pub(crate) fn jsonl(drills: &[Drill]) -> String {
    let js = |s: &str| serde_json::Value::from(s).to_string();
    drills
        .iter()
        .map(|d| {
            format!(
                r#"{{"messages":[{{"role":"user","content":{}}}],"label":{},"kind":{}}}"#,
                js(&d.question),
                js(&d.answer.to_string()),
                js(d.kind)
            ) + "\n"
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drills_are_right_distinct_and_split() {
        let (train, test) = drills();
        assert_eq!((train.len(), test.len()), (TRAIN, TEST));
        let test_q: std::collections::HashSet<_> = test.iter().map(|d| &d.question).collect();
        assert!(train.iter().all(|d| !test_q.contains(&d.question)));
        for d in train.iter().chain(&test) {
            let n: Vec<i64> = d
                .question
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect();
            let want = match (d.kind, n.as_slice()) {
                ("add", [a, b]) => a + b,
                ("sub", [a, b]) => a - b,
                ("mul", [a, b]) => a * b,
                _ => panic!("unexpected drill {d:?}"),
            };
            assert_eq!(d.answer, want, "{d:?}");
            assert!(d.answer > 0, "{d:?}");
        }
        let distinct: std::collections::HashSet<_> = test.iter().map(|d| &d.question).collect();
        assert_eq!(distinct.len(), TEST);
        for kind in ["add", "sub", "mul"] {
            assert_eq!(test.iter().filter(|d| d.kind == kind).count(), TEST / 3, "{kind}");
            assert_eq!(train.iter().filter(|d| d.kind == kind).count(), TRAIN / 3, "{kind}");
        }
    }

    #[test]
    fn the_committed_files_are_what_the_generator_writes() {
        let (train, test) = drills();
        for (file, drills) in [(TRAIN_OUT, &train), (TEST_OUT, &test)] {
            let path = crate::project_root().join(file);
            let committed = std::fs::read_to_string(&path).unwrap();
            assert!(committed == jsonl(drills), "{} is stale: run `cargo xtask gen-arith`", path.display());
        }
    }
}
