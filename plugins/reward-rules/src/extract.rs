//! Answer extraction and comparison: pulling the final answer out of a response (`#### 42`,
//! `\boxed{42}`, the last or first number, or the whole text), normalising it, and comparing it
//! with a label exactly or with partial credit.

use std::sync::OnceLock;

use regex::Regex;
use serde::Deserialize;

/// Where the answer is taken from in a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Extract {
    /// `hash` if the response has a `####` answer, else `boxed`, else `last_number`, else `full`.
    #[default]
    Auto,
    /// The text after the last `####` up to the end of its line (GSM8K's format).
    Hash,
    /// The content of the last `\boxed{...}`, nested braces included (MATH's format).
    Boxed,
    /// The last number in the response.
    LastNumber,
    /// The first number in the response.
    FirstNumber,
    /// The whole response, trimmed.
    Full,
}

/// A number as written in text: optional minus, digits with optional `,` thousands groups,
/// optional decimals. `12,34` is two numbers; `1,000` is one.
fn number_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?").expect("the number regex is a valid constant")
    })
}

/// Every number in `text`, in order. A `-` directly after a letter or digit is a hyphen, not a
/// minus sign (`3-5` is `3` and `5`, `x-1` is `1`).
pub fn numbers(text: &str) -> Vec<&str> {
    number_regex()
        .find_iter(text)
        .map(|m| {
            let s = m.as_str();
            let hyphen = s.starts_with('-') && text[..m.start()].chars().next_back().is_some_and(char::is_alphanumeric);
            if hyphen {
                &s[1..]
            } else {
                s
            }
        })
        .collect()
}

/// The text after the last `####` up to the end of that line, trimmed; `None` if there is no
/// `####` or nothing follows it.
pub fn hash_answer(text: &str) -> Option<&str> {
    let start = text.rfind("####")? + "####".len();
    let rest = &text[start..];
    let line = rest.split('\n').next().unwrap_or(rest).trim();
    (!line.is_empty()).then_some(line)
}

/// The content of the last `\boxed{...}` whose braces balance, trimmed; `None` if there is none.
pub fn boxed_answer(text: &str) -> Option<&str> {
    const OPEN: &str = "\\boxed{";
    let mut end_search = text.len();
    while let Some(pos) = text[..end_search].rfind(OPEN) {
        let content_start = pos + OPEN.len();
        let mut depth = 1usize;
        for (i, c) in text[content_start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(text[content_start..content_start + i].trim());
                    }
                }
                _ => {}
            }
        }
        // Unbalanced (truncated response): try an earlier one.
        end_search = pos;
    }
    None
}

/// The answer in `response` according to `how`; `None` when the requested form is absent.
/// `full` and `auto` always find something (possibly the empty string).
pub fn extract(response: &str, how: Extract) -> Option<&str> {
    match how {
        Extract::Hash => hash_answer(response),
        Extract::Boxed => boxed_answer(response),
        Extract::LastNumber => numbers(response).pop(),
        Extract::FirstNumber => numbers(response).first().copied(),
        Extract::Full => Some(response.trim()),
        Extract::Auto => hash_answer(response)
            .or_else(|| boxed_answer(response))
            .or_else(|| numbers(response).pop())
            .or_else(|| Some(response.trim())),
    }
}

/// Trims whitespace and trailing `.`s (`"42. "` → `"42"`).
pub fn normalize(s: &str) -> &str {
    s.trim().trim_end_matches('.').trim_end()
}

/// `s` as a number if it is one after dropping `,` separators and a leading `$`: `"1,000"`,
/// `"$3.50"`, `"-2"`, `"42.0"`. Words, `inf`, `nan` and exponents are not numbers here.
pub fn parse_number(s: &str) -> Option<f64> {
    let s = s.trim();
    let (sign, rest) = match s.strip_prefix('-') {
        Some(r) => ("-", r),
        None => ("", s.strip_prefix('+').unwrap_or(s)),
    };
    let rest = rest.strip_prefix('$').unwrap_or(rest);
    let digits: String = rest.chars().filter(|&c| c != ',').collect();
    let (int, frac) = digits.split_once('.').unwrap_or((&digits, ""));
    let all_digits = |p: &str| p.chars().all(|c| c.is_ascii_digit());
    if int.is_empty() && frac.is_empty() || !all_digits(int) || !all_digits(frac) {
        return None;
    }
    format!("{sign}{}.{}", if int.is_empty() { "0" } else { int }, if frac.is_empty() { "0" } else { frac })
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
}

/// Two numbers are equal when they differ by at most 1e-9 relative to the label (1e-9 absolute
/// near zero).
fn numbers_equal(a: f64, label: f64) -> bool {
    (a - label).abs() <= 1e-9 * label.abs().max(1.0)
}

/// Whether `answer` matches `label`. With `normalize`, both are [`normalize`]d and compared as
/// numbers when both parse as one ([`parse_number`]); otherwise strings are compared exactly.
pub fn matches(answer: &str, label: &str, normalize_text: bool) -> bool {
    if !normalize_text {
        return answer == label;
    }
    let (a, l) = (normalize(answer), normalize(label));
    match (parse_number(a), parse_number(l)) {
        (Some(x), Some(y)) => numbers_equal(x, y),
        _ => a == l,
    }
}

/// Partial credit in `[0, 1]`. When both sides are numbers (with `normalize`):
/// `max(0, 1 − |answer − label| / max(|label|, 1))`. Otherwise the fraction of character
/// positions that agree: `#{i : answer[i] == label[i]} / max(len(answer), len(label))`
/// (1 when both are empty).
pub fn partial_credit(answer: &str, label: &str, normalize_text: bool) -> f64 {
    let (a, l) = if normalize_text { (normalize(answer), normalize(label)) } else { (answer, label) };
    if normalize_text {
        if let (Some(x), Some(y)) = (parse_number(a), parse_number(l)) {
            return (1.0 - (x - y).abs() / y.abs().max(1.0)).max(0.0);
        }
    }
    let longest = a.chars().count().max(l.chars().count());
    if longest == 0 {
        return 1.0;
    }
    let same = a.chars().zip(l.chars()).filter(|(x, y)| x == y).count();
    same as f64 / longest as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_with_signs_groups_and_decimals() {
        assert_eq!(numbers("a -3 then 2.5 and 1,000 or 12,34."), vec!["-3", "2.5", "1,000", "12", "34"]);
        assert_eq!(numbers("pages 3-5, x-1"), vec!["3", "5", "1"]);
        assert_eq!(numbers("(-7)"), vec!["-7"]);
        assert!(numbers("no digits").is_empty());
    }

    #[test]
    fn hash_takes_the_last_marker_to_end_of_line() {
        assert_eq!(hash_answer("work\n#### 1\nmore\n#### -42 \n"), Some("-42"));
        assert_eq!(hash_answer("#### 3.5\nexplanation"), Some("3.5"));
        assert_eq!(hash_answer("no marker"), None);
        assert_eq!(hash_answer("ends with ####  "), None);
    }

    #[test]
    fn boxed_handles_nesting_and_truncation() {
        assert_eq!(boxed_answer(r"so \boxed{\frac{1}{2}}."), Some(r"\frac{1}{2}"));
        assert_eq!(boxed_answer(r"\boxed{1} then \boxed{ {a}{b{c}} }"), Some("{a}{b{c}}"));
        // The last one is cut off: fall back to the earlier, complete one.
        assert_eq!(boxed_answer(r"\boxed{7} and \boxed{\frac{1}{"), Some("7"));
        assert_eq!(boxed_answer("plain 5"), None);
    }

    #[test]
    fn extract_each_kind() {
        let r = "First 3 apples, then -2.5 more.\n\\boxed{x+1}\n#### 12";
        assert_eq!(extract(r, Extract::Hash), Some("12"));
        assert_eq!(extract(r, Extract::Boxed), Some("x+1"));
        assert_eq!(extract(r, Extract::LastNumber), Some("12"));
        assert_eq!(extract(r, Extract::FirstNumber), Some("3"));
        assert_eq!(extract("  all of it \n", Extract::Full), Some("all of it"));
        assert_eq!(extract("The answer is -2.50.", Extract::LastNumber), Some("-2.50"));
        assert_eq!(extract("words only", Extract::LastNumber), None);
        assert_eq!(extract("words only", Extract::Hash), None);
    }

    #[test]
    fn auto_prefers_hash_then_boxed_then_number_then_full() {
        assert_eq!(extract("\\boxed{5} #### 6", Extract::Auto), Some("6"));
        assert_eq!(extract("1 then \\boxed{5} then 7", Extract::Auto), Some("5"));
        assert_eq!(extract("1 then 7 cats", Extract::Auto), Some("7"));
        assert_eq!(extract(" Paris \n", Extract::Auto), Some("Paris"));
    }

    #[test]
    fn normalisation_and_numeric_comparison() {
        assert_eq!(normalize("  42. \n"), "42");
        assert_eq!(parse_number("1,000"), Some(1000.0));
        assert_eq!(parse_number("$3.50"), Some(3.5));
        assert_eq!(parse_number("-0.5"), Some(-0.5));
        assert_eq!(parse_number(".5"), Some(0.5));
        assert_eq!(parse_number("nan"), None);
        assert_eq!(parse_number("1e3"), None);
        assert_eq!(parse_number("."), None);
        assert!(matches("42.0", "42", true));
        assert!(matches("1,000", "1000", true));
        assert!(matches("42.", " 42", true));
        assert!(matches("-3", "-3.00", true));
        assert!(!matches("42.5", "42", true));
        assert!(matches("Paris.", "Paris", true));
        assert!(!matches("paris", "Paris", true));
        assert!(!matches("42.0", "42", false));
        assert!(matches("42", "42", false));
    }

    #[test]
    fn partial_credit_by_number_and_by_position() {
        assert_eq!(partial_credit("90", "100", true), 0.9);
        assert_eq!(partial_credit("0.5", "0", true), 0.5);
        assert_eq!(partial_credit("500", "100", true), 0.0);
        assert_eq!(partial_credit("abcd", "abxd", true), 0.75);
        // Extra characters count against the answer: 2 of max(4, 2) positions agree.
        assert_eq!(partial_credit("abcd", "ab", true), 0.5);
        assert_eq!(partial_credit("", "", true), 1.0);
        assert_eq!(partial_credit("", "ab", true), 0.0);
        // Without normalisation numbers are strings too: "90" vs "100" agree in 1 of 3 positions.
        assert_eq!(partial_credit("90", "100", false), 1.0 / 3.0);
    }
}
