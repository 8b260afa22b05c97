//! A safe arithmetic evaluator: no code execution, no names, no calls, bounded work.
//!
//! Grammar (ASCII only, whitespace ignored), loosest binding first:
//!
//! ```text
//! expr    := term (('+' | '-') term)*
//! term    := power (('*' | '/' | '%') power)*
//! power   := sign* primary (('**' | '^') power)?     right-associative: 2**3**2 = 2**9
//! sign    := '-' | '+'
//! primary := number | '(' expr ')'
//! number  := digits ('.' digits)?                   at most 30 digits
//! ```
//!
//! As in Python, a sign binds looser than `**` on its left (`-2**2` = -4) and an exponent may be
//! signed (`2**-1` = 0.5). `/` is true division (`7/2` = 3.5); `%` is floored like Python's (the
//! result has the sign of the divisor, `-7 % 3` = 2).
//!
//! Work and stack are bounded by [`Limits`]: the expression is at most `max_chars` characters, only
//! parentheses recurse and their nesting is at most `max_depth` deep, `|exponent| <= max_exponent`,
//! and every literal, intermediate and final value satisfies `|value| <= max_abs`. Any violation is a
//! [`CalcError`] with a one-line message meant to be shown to the model.

use std::fmt;

/// Bounds on what [`evaluate`] accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Longest expression, in characters.
    pub max_chars: usize,
    /// Deepest nesting of parentheses.
    pub max_depth: usize,
    /// Largest `|exponent|` of `**` / `^`.
    pub max_exponent: u32,
    /// Largest `|value|` of any literal, intermediate or final value.
    pub max_abs: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_chars: 200, max_depth: 32, max_exponent: 64, max_abs: 1e15 }
    }
}

/// Why an expression could not be evaluated (a one-line message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalcError {
    message: String,
}

impl CalcError {
    fn new(message: impl Into<String>) -> Self {
        CalcError { message: message.into() }
    }

    /// The message, e.g. `division by zero`.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for CalcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CalcError {}

/// Most digits in one number literal.
const MAX_DIGITS: usize = 30;

/// Evaluates `expr` within `limits`.
pub fn evaluate(expr: &str, limits: &Limits) -> Result<f64, CalcError> {
    if expr.trim().is_empty() {
        return Err(CalcError::new("empty expression"));
    }
    let chars = expr.chars().count();
    if chars > limits.max_chars {
        return Err(CalcError::new(format!("expression too long ({chars} characters, at most {})", limits.max_chars)));
    }
    if let Some((i, c)) = expr.char_indices().find(|(_, c)| !c.is_ascii()) {
        let pos = expr[..i].chars().count() + 1;
        return Err(CalcError::new(format!("non-ASCII character '{c}' at position {pos}")));
    }
    let tokens = lex(expr, limits)?;
    let mut parser = Parser { src: expr, tokens, next: 0, depth: 0, limits };
    let value = parser.expr()?;
    if let Some(t) = parser.peek() {
        return Err(match t.kind {
            Kind::RParen => CalcError::new(format!("unbalanced parentheses: unmatched ')' at position {}", t.pos)),
            _ => CalcError::new(format!("expected an operator at position {}, found '{}'", t.pos, parser.text(t))),
        });
    }
    Ok(value)
}

/// `v` as the model reads it: integral values with `|v| < 2^53` without a decimal point (`1776`,
/// `-3`), others with up to 6 decimals and trailing zeros trimmed (`0.333333`, `2.5`).
pub fn format_value(v: f64) -> String {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if !v.is_finite() {
        return v.to_string();
    }
    if v.fract() == 0.0 && v.abs() < EXACT {
        return format!("{}", v as i64);
    }
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Num(f64),
    Plus,
    Minus,
    Star,
    Slash,
    Percent,
    Pow,
    LParen,
    RParen,
}

#[derive(Debug, Clone, Copy)]
struct Token {
    kind: Kind,
    /// 1-based position of the first character.
    pos: usize,
    len: usize,
}

/// Splits `src` (ASCII) into tokens; literals are checked against the limits here.
fn lex(src: &str, limits: &Limits) -> Result<Vec<Token>, CalcError> {
    let bytes = src.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let (kind, len) = match c {
            c if c.is_ascii_whitespace() => {
                i += 1;
                continue;
            }
            b'0'..=b'9' => {
                let len = number_len(&bytes[i..]);
                let text = &src[i..i + len];
                if text.bytes().filter(u8::is_ascii_digit).count() > MAX_DIGITS {
                    return Err(CalcError::new(format!(
                        "number too long at position {} (more than {MAX_DIGITS} digits)",
                        i + 1
                    )));
                }
                let v: f64 = text.parse().map_err(|_| CalcError::new(format!("bad number '{text}'")))?;
                check(v, limits)?;
                (Kind::Num(v), len)
            }
            b'*' if bytes.get(i + 1) == Some(&b'*') => (Kind::Pow, 2),
            b'^' => (Kind::Pow, 1),
            b'+' => (Kind::Plus, 1),
            b'-' => (Kind::Minus, 1),
            b'*' => (Kind::Star, 1),
            b'/' => (Kind::Slash, 1),
            b'%' => (Kind::Percent, 1),
            b'(' => (Kind::LParen, 1),
            b')' => (Kind::RParen, 1),
            other => {
                return Err(CalcError::new(format!(
                    "unexpected character {:?} at position {}",
                    char::from(other),
                    i + 1
                )))
            }
        };
        tokens.push(Token { kind, pos: i + 1, len });
        i += len;
    }
    Ok(tokens)
}

/// Length of the number at the start of `bytes` (which starts with a digit): digits, then
/// optionally `.` and at least one digit.
fn number_len(bytes: &[u8]) -> usize {
    let digits = |from: usize| bytes[from..].iter().take_while(|b| b.is_ascii_digit()).count();
    let int = digits(0);
    if bytes.get(int) == Some(&b'.') && bytes.get(int + 1).is_some_and(u8::is_ascii_digit) {
        int + 1 + digits(int + 1)
    } else {
        int
    }
}

/// `v` if it is finite and within `max_abs`.
fn check(v: f64, limits: &Limits) -> Result<f64, CalcError> {
    if v.is_nan() {
        Err(CalcError::new("non-finite result"))
    } else if v.is_infinite() || v.abs() > limits.max_abs {
        Err(CalcError::new(format!("result too large (|value| > {:e})", limits.max_abs)))
    } else {
        Ok(v)
    }
}

/// Recursive descent over the tokens; only parentheses recurse, at most `max_depth` deep.
struct Parser<'a> {
    src: &'a str,
    tokens: Vec<Token>,
    next: usize,
    depth: usize,
    limits: &'a Limits,
}

impl Parser<'_> {
    fn peek(&self) -> Option<Token> {
        self.tokens.get(self.next).copied()
    }

    fn text(&self, t: Token) -> &str {
        &self.src[t.pos - 1..t.pos - 1 + t.len]
    }

    fn expr(&mut self) -> Result<f64, CalcError> {
        let mut v = self.term()?;
        while let Some(t) = self.peek() {
            let add = match t.kind {
                Kind::Plus => true,
                Kind::Minus => false,
                _ => break,
            };
            self.next += 1;
            let rhs = self.term()?;
            v = check(if add { v + rhs } else { v - rhs }, self.limits)?;
        }
        Ok(v)
    }

    fn term(&mut self) -> Result<f64, CalcError> {
        let mut v = self.power()?;
        while let Some(t) = self.peek() {
            if !matches!(t.kind, Kind::Star | Kind::Slash | Kind::Percent) {
                break;
            }
            self.next += 1;
            let rhs = self.power()?;
            v = match t.kind {
                Kind::Star => v * rhs,
                _ if rhs == 0.0 && t.kind == Kind::Slash => return Err(CalcError::new("division by zero")),
                _ if rhs == 0.0 => return Err(CalcError::new("modulo by zero")),
                Kind::Slash => v / rhs,
                _ => {
                    let r = v % rhs;
                    if r != 0.0 && (r < 0.0) != (rhs < 0.0) {
                        r + rhs
                    } else {
                        r
                    }
                }
            };
            v = check(v, self.limits)?;
        }
        Ok(v)
    }

    /// A chain `sign* primary (** sign* primary)*`, folded from the right without recursion.
    fn power(&mut self) -> Result<f64, CalcError> {
        let mut chain: Vec<(bool, f64)> = Vec::new();
        loop {
            let mut negative = false;
            while let Some(t) = self.peek() {
                match t.kind {
                    Kind::Minus => negative = !negative,
                    Kind::Plus => {}
                    _ => break,
                }
                self.next += 1;
            }
            chain.push((negative, self.primary()?));
            match self.peek() {
                Some(t) if t.kind == Kind::Pow => self.next += 1,
                _ => break,
            }
        }
        let mut exponent = 0.0;
        for (i, (negative, base)) in chain.into_iter().rev().enumerate() {
            let v = if i == 0 { base } else { self.pow(base, exponent)? };
            exponent = if negative { -v } else { v };
        }
        Ok(exponent)
    }

    fn pow(&self, base: f64, exponent: f64) -> Result<f64, CalcError> {
        if exponent.abs() > f64::from(self.limits.max_exponent) {
            return Err(CalcError::new(format!(
                "exponent too large ({}, at most {} in absolute value)",
                format_value(exponent),
                self.limits.max_exponent
            )));
        }
        if base == 0.0 && exponent < 0.0 {
            return Err(CalcError::new("division by zero"));
        }
        let v = if exponent.fract() == 0.0 { base.powi(exponent as i32) } else { base.powf(exponent) };
        check(v, self.limits)
    }

    fn primary(&mut self) -> Result<f64, CalcError> {
        let Some(t) = self.peek() else {
            return Err(CalcError::new("unexpected end of expression (expected a number)"));
        };
        self.next += 1;
        match t.kind {
            Kind::Num(v) => Ok(v),
            Kind::LParen => {
                if self.depth >= self.limits.max_depth {
                    return Err(CalcError::new(format!(
                        "nesting too deep (more than {} levels of parentheses)",
                        self.limits.max_depth
                    )));
                }
                self.depth += 1;
                let v = self.expr()?;
                self.depth -= 1;
                match self.peek() {
                    Some(close) if close.kind == Kind::RParen => {
                        self.next += 1;
                        Ok(v)
                    }
                    Some(other) => Err(CalcError::new(format!(
                        "expected ')' or an operator at position {}, found '{}'",
                        other.pos,
                        self.text(other)
                    ))),
                    None => Err(CalcError::new(format!(
                        "unbalanced parentheses: '(' at position {} is never closed",
                        t.pos
                    ))),
                }
            }
            Kind::RParen if self.depth == 0 => {
                Err(CalcError::new(format!("unbalanced parentheses: unmatched ')' at position {}", t.pos)))
            }
            _ => Err(CalcError::new(format!("expected a number at position {}, found '{}'", t.pos, self.text(t)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(expr: &str) -> Result<f64, String> {
        evaluate(expr, &Limits::default()).map_err(|e| e.to_string())
    }

    fn err(expr: &str) -> String {
        eval(expr).expect_err(expr)
    }

    #[test]
    fn arithmetic() {
        for (expr, want) in [
            ("37*48", 1776.0),
            ("2+3*4", 14.0),
            ("(2+3)*4", 20.0),
            ("2**3**2", 512.0),
            ("2^3^2", 512.0),
            ("-3+5", 2.0),
            ("7/2", 3.5),
            ("10%4", 2.0),
            ("-7 % 3", 2.0),
            ("7 % -3", -2.0),
            ("-2**2", -4.0),
            ("(-2)**2", 4.0),
            ("2**-1", 0.5),
            ("2 * -3", -6.0),
            ("2--3", 5.0),
            ("+-+4", -4.0),
            ("\t 1.5 +\n 2.25 ", 3.75),
            ("10 - 4 - 3", 3.0),
            ("100 / 10 / 5", 2.0),
            ("9**0.5", 3.0),
            ("((((1))))", 1.0),
            ("0**0", 1.0),
        ] {
            assert_eq!(eval(expr), Ok(want), "{expr}");
        }
    }

    #[test]
    fn arithmetic_errors() {
        assert_eq!(err("1/0"), "division by zero");
        assert_eq!(err("1/(2-2)"), "division by zero");
        assert_eq!(err("5 % 0"), "modulo by zero");
        assert_eq!(err("0**-1"), "division by zero");
        assert_eq!(err("2**1000"), "exponent too large (1000, at most 64 in absolute value)");
        assert_eq!(err("2**-65"), "exponent too large (-65, at most 64 in absolute value)");
        assert_eq!(err("9**64*9**64"), "result too large (|value| > 1e15)");
        assert_eq!(err("999999999999999 + 2"), "result too large (|value| > 1e15)");
        assert_eq!(err("10000000000000000"), "result too large (|value| > 1e15)");
        assert_eq!(err("(-8)**0.5"), "non-finite result");
        let limits = Limits { max_exponent: 4, max_abs: 100.0, ..Limits::default() };
        assert!(evaluate("3**4", &limits).is_ok());
        assert_eq!(
            evaluate("3**5", &limits).unwrap_err().message(),
            "exponent too large (5, at most 4 in absolute value)"
        );
        assert_eq!(evaluate("101", &limits).unwrap_err().message(), "result too large (|value| > 1e2)");
    }

    #[test]
    fn syntax_errors() {
        assert_eq!(err(""), "empty expression");
        assert_eq!(err("   "), "empty expression");
        assert_eq!(err("3×4"), "non-ASCII character '×' at position 2");
        assert_eq!(err("2 + x"), "unexpected character 'x' at position 5");
        assert_eq!(err("import os"), "unexpected character 'i' at position 1");
        assert_eq!(err("1+"), "unexpected end of expression (expected a number)");
        assert_eq!(err(")("), "unbalanced parentheses: unmatched ')' at position 1");
        assert_eq!(err("(1+2))"), "unbalanced parentheses: unmatched ')' at position 6");
        assert_eq!(err("(1+2"), "unbalanced parentheses: '(' at position 1 is never closed");
        assert_eq!(err("(1 2)"), "expected ')' or an operator at position 4, found '2'");
        assert_eq!(err("2 3"), "expected an operator at position 3, found '3'");
        assert_eq!(err("2(3)"), "expected an operator at position 2, found '('");
        assert_eq!(err("()"), "expected a number at position 2, found ')'");
        assert_eq!(err("1 * * 2"), "expected a number at position 5, found '*'");
        assert_eq!(err(".5"), "unexpected character '.' at position 1");
        assert_eq!(err("1."), "unexpected character '.' at position 2");
        assert_eq!(err(&"1".repeat(31)), "number too long at position 1 (more than 30 digits)");
        assert_eq!(err(&format!("0.{}", "0".repeat(30))), "number too long at position 1 (more than 30 digits)");
    }

    #[test]
    fn limits_bound_size_and_depth() {
        let long = "1+".repeat(149) + "1";
        assert_eq!(long.len(), 299);
        assert_eq!(err(&(long + "0")), "expression too long (300 characters, at most 200)");
        let deep = format!("{}1{}", "(".repeat(100), ")".repeat(100));
        assert_eq!(err(&deep), "expression too long (201 characters, at most 200)");
        let roomy = Limits { max_chars: 1000, ..Limits::default() };
        let e = evaluate(&deep, &roomy).unwrap_err();
        assert_eq!(e.message(), "nesting too deep (more than 32 levels of parentheses)");
        let unclosed = "(".repeat(100_000);
        let e = evaluate(&unclosed, &Limits { max_chars: 100_000, max_depth: 256, ..Limits::default() }).unwrap_err();
        assert_eq!(e.message(), "nesting too deep (more than 256 levels of parentheses)");
        let ok = format!("{}1{}", "(".repeat(32), ")".repeat(32));
        assert_eq!(eval(&ok), Ok(1.0));
        let limits = Limits { max_chars: 100_000, max_depth: 10_000, ..Limits::default() };
        // Long sign and power chains do not recurse.
        assert_eq!(evaluate(&format!("{}5", "-".repeat(20_001)), &limits), Ok(-5.0));
        assert_eq!(evaluate(&format!("{}1", "1**".repeat(10_000)), &limits), Ok(1.0));
    }

    #[test]
    fn formats_values() {
        for (v, want) in [
            (1776.0, "1776"),
            (-3.0, "-3"),
            (0.0, "0"),
            (-0.0, "0"),
            (1.0 / 3.0, "0.333333"),
            (2.5, "2.5"),
            (-2.5, "-2.5"),
            (1e-9, "0"),
            (-1e-9, "0"),
            (2.0f64.powi(53), "9007199254740992"),
            (1e20, "100000000000000000000"),
            (123456.125, "123456.125"),
        ] {
            assert_eq!(format_value(v), want, "{v}");
        }
    }
}
