//! The estimators of held-out evaluation, per prompt with `n` samples of which `c` are correct:
//!
//! - **pass@k**, unbiased (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
//!   eq. 1): the chance that at least one of `k` samples drawn without replacement from the `n` is
//!   correct, `1 − C(n−c, k) / C(n, k)`, computed as `1 − Π_{i=n−c+1}^{n} (1 − k/i)` so that no
//!   binomial coefficient overflows;
//! - **maj@n**: whether the answer most of the `n` samples give is a correct one (self-consistency,
//!   Wang et al. 2022); ties go to the answer given first, so the result is deterministic.
//!
//! Both are averaged over prompts by the caller.

/// Unbiased pass@k of one prompt with `n` samples, `c` correct (`k ≤ n`, `c ≤ n`).
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    assert!(k >= 1 && k <= n && c <= n, "pass@{k} with n = {n}, c = {c}");
    if n - c < k {
        return 1.0;
    }
    1.0 - ((n - c + 1)..=n).map(|i| 1.0 - k as f64 / i as f64).product::<f64>()
}

/// The `k` pass@k is reported for with `n` samples: 1 and each power of two up to `n`.
pub fn pass_ks(n: usize) -> Vec<usize> {
    std::iter::successors(Some(1usize), |k| k.checked_mul(2)).take_while(|&k| k <= n).collect()
}

/// maj@n of one prompt: `answers[i]` is sample `i`'s extracted answer (`None`: none could be
/// extracted, no vote) and `correct[i]` whether it is correct. The answer with the most votes wins,
/// ties going to the one given first; the prompt counts as solved when that answer's first sample
/// is correct. No answer at all: not solved.
pub fn majority_correct(answers: &[Option<String>], correct: &[bool]) -> bool {
    assert_eq!(answers.len(), correct.len());
    // (answer, votes, first sample) in order of first appearance.
    let mut tally: Vec<(&str, usize, usize)> = Vec::new();
    for (i, a) in answers.iter().enumerate() {
        let Some(a) = a.as_deref() else { continue };
        match tally.iter_mut().find(|(b, _, _)| *b == a) {
            Some(t) => t.1 += 1,
            None => tally.push((a, 1, i)),
        }
    }
    // max_by_key keeps the last of equal maxima; reversing keeps the first given.
    tally.iter().rev().max_by_key(|t| t.1).is_some_and(|&(_, _, first)| correct[first])
}

/// The answer of a response for majority voting: `full` (the trimmed text) or `last_number` (the
/// last number in it, `-` included, thousands commas dropped).
pub fn extract_answer(response: &str, how: &str) -> Option<String> {
    match how {
        "full" => Some(response.trim().to_string()).filter(|s| !s.is_empty()),
        _ => last_number(response),
    }
}

/// The last number of `text`: digits with `,` thousands separators and one optional decimal
/// part, with a leading `-` unless it follows a letter or digit (a hyphen).
fn last_number(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let end = chars.iter().rposition(char::is_ascii_digit)? + 1;
    let mut start = end;
    while start > 0 && (chars[start - 1].is_ascii_digit() || matches!(chars[start - 1], '.' | ',')) {
        start -= 1;
    }
    while start < end && !chars[start].is_ascii_digit() {
        start += 1; // a leading '.' or ',' is punctuation
    }
    let minus = start > 0 && chars[start - 1] == '-' && !(start > 1 && chars[start - 2].is_alphanumeric());
    let digits: String = chars[start..end].iter().filter(|&&c| c != ',').collect();
    Some(if minus { format!("-{digits}") } else { digits })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_matches_hand_computed_values() {
        // n = 4, c = 1: one of four draws is the correct one.
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-15);
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-15);
        assert!((pass_at_k(4, 1, 4) - 1.0).abs() < 1e-15);
        // n = 4, c = 2, k = 2: 1 − C(2,2)/C(4,2) = 1 − 1/6.
        assert!((pass_at_k(4, 2, 2) - 5.0 / 6.0).abs() < 1e-15);
        // n = 8, c = 3, k = 4: 1 − C(5,4)/C(8,4) = 1 − 5/70.
        assert!((pass_at_k(8, 3, 4) - 65.0 / 70.0).abs() < 1e-15);
        // Edge cases: none correct, all correct, one sample.
        assert_eq!(pass_at_k(4, 0, 4), 0.0);
        assert_eq!(pass_at_k(4, 4, 1), 1.0);
        assert_eq!(pass_at_k(1, 1, 1), 1.0);
        assert_eq!(pass_at_k(1, 0, 1), 0.0);
        // pass@1 is the fraction correct.
        assert!((pass_at_k(16, 5, 1) - 5.0 / 16.0).abs() < 1e-15);
        assert_eq!(pass_ks(1), [1]);
        assert_eq!(pass_ks(6), [1, 2, 4]);
        assert_eq!(pass_ks(8), [1, 2, 4, 8]);
    }

    #[test]
    fn majority_vote_with_ties_going_to_the_first_answer() {
        let a = |xs: &[&str]| xs.iter().map(|x| (!x.is_empty()).then(|| x.to_string())).collect::<Vec<_>>();
        // "7" wins 2 to 1; its first sample is correct.
        assert!(majority_correct(&a(&["7", "5", "7"]), &[true, false, true]));
        // "5" wins 2 to 1 and is wrong, though one sample is right.
        assert!(!majority_correct(&a(&["7", "5", "5"]), &[true, false, false]));
        // A 1–1 tie goes to the answer given first, either way round.
        assert!(majority_correct(&a(&["7", "5"]), &[true, false]));
        assert!(!majority_correct(&a(&["5", "7"]), &[false, true]));
        // Samples without an answer do not vote; no answer at all is not solved.
        assert!(majority_correct(&a(&["", "", "7"]), &[false, false, true]));
        assert!(!majority_correct(&a(&["", ""]), &[false, false]));
    }

    #[test]
    fn answers_for_voting() {
        assert_eq!(extract_answer("3 + 4 = 7", "last_number").as_deref(), Some("7"));
        assert_eq!(extract_answer("it is -12.5.", "last_number").as_deref(), Some("-12.5"));
        assert_eq!(extract_answer("x-3", "last_number").as_deref(), Some("3"));
        assert_eq!(extract_answer("total 1,024", "last_number").as_deref(), Some("1024"));
        assert_eq!(extract_answer("no digits", "last_number"), None);
        assert_eq!(extract_answer("  Paris \n", "full").as_deref(), Some("Paris"));
        assert_eq!(extract_answer("   ", "full"), None);
    }
}
