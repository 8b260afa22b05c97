//! The built-in visual task `builtin:shapes`: 56 × 56 scenes of circles and squares in four
//! colours ([`rlhf_vision::shapes`]), one shape at most per quadrant, and a question about each —
//! `which colour is the circle ?` (a circle and perhaps a square of another colour; label the
//! circle's colour) or `how many red squares ?` (0–3 red squares and perhaps one shape of another
//! colour; label the count). Every fifth of the 400 scenes is held out (`builtin:shapes-test`, 80),
//! the rest train (`builtin:shapes-train`, 320). The images travel as PNG bytes in each row's
//! `images` field, as `datasets` writes them to Parquet; the row's `question` and `shapes` are
//! kept in its metadata for reward functions.
//!
//! `builtin:tiny-qwen2.5-vl` ([`crate::builtin_vl`]) reads the task's words.

use rlhf_vision::shapes::{png, Kind, Shape, COLOURS};
use serde_json::json;

use crate::data::{RawPrompt, SplitMix};
use crate::error::{Result, TrainerError};

/// Special tokens of the task's tokenizer: padding, EOS, unknown, then Qwen-VL's vision tokens
/// (`<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`, ids 3–6).
pub const SPECIALS: &[&str] =
    &["<pad>", "<eos>", "<unk>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"];

/// The task's words after the specials.
pub const WORDS: &[&str] = &[
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "red", "green", "blue", "yellow", "circle", "square", "squares",
    "which", "colour", "is", "the", "how", "many", "?",
];

/// Scenes of the task, in a fixed order.
const SCENES: usize = 400;
/// Side of each scene in pixels (4 × 4 patches of 14: 2 × 2 merged image tokens).
const SIDE: u32 = 56;

/// The word-level `tokenizer.json` of the task (the vision tokens split out whole).
pub fn tokenizer_json() -> serde_json::Value {
    crate::builtin_tokenizer::word_level_tokenizer(SPECIALS, WORDS.iter().map(|w| w.to_string()), "<unk>")
}

/// A random quadrant other than those in `taken`.
fn free_quadrant(rng: &mut SplitMix, taken: &[usize]) -> usize {
    let free: Vec<usize> = (0..4).filter(|q| !taken.contains(q)).collect();
    free[(rng.next_u64() % free.len() as u64) as usize]
}

/// Scene `i`'s shapes, question and answer.
fn scene(i: usize, rng: &mut SplitMix) -> (Vec<Shape>, &'static str, String) {
    let mut shapes: Vec<Shape> = Vec::new();
    let taken = |s: &[Shape]| s.iter().map(|s| s.quadrant).collect::<Vec<_>>();
    let other_colour = |rng: &mut SplitMix, not: usize| (not + 1 + (rng.next_u64() % 3) as usize) % COLOURS.len();
    if i.is_multiple_of(2) {
        let colour = (rng.next_u64() % 4) as usize;
        shapes.push(Shape { kind: Kind::Circle, colour, quadrant: free_quadrant(rng, &[]) });
        if rng.next_u64().is_multiple_of(2) {
            let quadrant = free_quadrant(rng, &taken(&shapes));
            shapes.push(Shape { kind: Kind::Square, colour: other_colour(rng, colour), quadrant });
        }
        (shapes, "which colour is the circle ?", COLOURS[colour].0.to_string())
    } else {
        let count = (rng.next_u64() % 4) as usize;
        for _ in 0..count {
            shapes.push(Shape { kind: Kind::Square, colour: 0, quadrant: free_quadrant(rng, &taken(&shapes)) });
        }
        if count < 4 && rng.next_u64().is_multiple_of(2) {
            let kind = if rng.next_u64().is_multiple_of(2) { Kind::Circle } else { Kind::Square };
            let quadrant = free_quadrant(rng, &taken(&shapes));
            shapes.push(Shape { kind, colour: other_colour(rng, 0), quadrant });
        }
        (shapes, "how many red squares ?", count.to_string())
    }
}

/// Prompts of `builtin:shapes{split}`: `""` (all 400), `-train` (320) or `-test` (80).
pub fn prompts(split: &str) -> Result<Vec<RawPrompt>> {
    prompts_sized(split, SIDE)
}

/// [`prompts`] with the scenes drawn `side` pixels a side (the benchmark's larger images).
pub fn prompts_sized(split: &str, side: u32) -> Result<Vec<RawPrompt>> {
    let keep = |i: usize| match split {
        "" => Ok(true),
        "-train" => Ok(i % 5 != 4),
        "-test" => Ok(i % 5 == 4),
        other => Err(TrainerError::Config(format!(
            "unknown built-in task `builtin:shapes{other}` (available: builtin:shapes, builtin:shapes-train, \
             builtin:shapes-test)"
        ))),
    };
    let mut rng = SplitMix(0x5AA9E5);
    let mut out = Vec::new();
    for i in 0..SCENES {
        let (shapes, question, answer) = scene(i, &mut rng);
        if !keep(i)? {
            continue;
        }
        let bytes = png(&shapes, side).map_err(|e| TrainerError::Run(e.to_string()))?;
        let described: Vec<String> = shapes
            .iter()
            .map(|s| format!("{} {:?} in quadrant {}", COLOURS[s.colour].0, s.kind, s.quadrant).to_lowercase())
            .collect();
        out.push(RawPrompt::Text {
            prompt: format!("<image> {question}"),
            label: Some(answer),
            metadata: json!({
                "images": [{"bytes": {"$binary": rlhf_vision::prompt::encode_base64(&bytes)},
                            "path": format!("shapes/{i}.png")}],
                "question": question,
                "shapes": described,
            }),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The splits partition the scenes; answers follow the scenes (a circle's colour, a count of
    /// red squares); both questions are in both splits.
    #[test]
    fn splits_partition_the_scenes_and_answers_describe_them() {
        let (all, train, test) = (prompts("").unwrap(), prompts("-train").unwrap(), prompts("-test").unwrap());
        assert_eq!((all.len(), train.len(), test.len()), (400, 320, 80));
        let mut rng = SplitMix(0x5AA9E5);
        for i in 0..40 {
            let (shapes, question, answer) = scene(i, &mut rng);
            match question {
                "which colour is the circle ?" => {
                    let circle = shapes.iter().find(|s| s.kind == Kind::Circle).unwrap();
                    assert_eq!(COLOURS[circle.colour].0, answer);
                    assert!(shapes.iter().filter(|s| s.kind == Kind::Square).all(|s| s.colour != circle.colour));
                }
                _ => {
                    let red = shapes.iter().filter(|s| s.kind == Kind::Square && s.colour == 0).count();
                    assert_eq!(red.to_string(), answer);
                }
            }
            let mut quadrants: Vec<usize> = shapes.iter().map(|s| s.quadrant).collect();
            quadrants.sort_unstable();
            quadrants.dedup();
            assert_eq!(quadrants.len(), shapes.len(), "one shape per quadrant");
        }
        let questions = |p: &[RawPrompt]| {
            p.iter()
                .map(|p| match p {
                    RawPrompt::Text { metadata, .. } => metadata["question"].as_str().unwrap().to_string(),
                    RawPrompt::Chat { .. } => unreachable!(),
                })
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        assert_eq!((questions(&train), questions(&test)), (2, 2));
        assert!(prompts("-dev").is_err());
    }

    /// Without the images no policy is right more than about a third of the time: for each
    /// question, the most frequent answer is at most 35 % of its prompts, in either split.
    #[test]
    fn the_question_alone_gives_away_little() {
        for split in ["-train", "-test"] {
            let mut counts: std::collections::HashMap<(String, String), usize> = Default::default();
            let mut per_question: std::collections::HashMap<String, usize> = Default::default();
            for p in prompts(split).unwrap() {
                let RawPrompt::Text { metadata, label, .. } = p else { unreachable!() };
                let q = metadata["question"].as_str().unwrap().to_string();
                *counts.entry((q.clone(), label.unwrap())).or_default() += 1;
                *per_question.entry(q).or_default() += 1;
            }
            for ((q, answer), n) in &counts {
                let share = *n as f64 / per_question[q] as f64;
                assert!(share <= 0.35, "{split}: `{answer}` answers {:.0} % of `{q}`", 100.0 * share);
            }
        }
    }
}
