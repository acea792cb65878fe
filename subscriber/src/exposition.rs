//! A reader for the Prometheus text exposition format (the `/metrics` page of
//! vLLM and SGLang), as far as load reporting needs it: every sample's
//! name, labels, value and optional timestamp.
//!
//! Accepted: `# HELP` / `# TYPE` / other comments and OpenMetrics' `# EOF`
//! (skipped), blank lines, `\r\n` line ends, label values with escaped
//! quotes, backslashes and newlines (`\"`, `\\`, `\n`) and with `,`, `}` or
//! spaces inside the quotes, a trailing comma in the label set, quoted
//! UTF-8 metric and label names (`{"my.metric", "a.b"="x"}`), values in any
//! float notation Prometheus writes (`1`, `-0.5`, `1.5e-07`, `+Inf`, `-Inf`,
//! `NaN`), an optional integer or float timestamp, and an OpenMetrics
//! exemplar after ` # `. A line that does not parse is counted and skipped:
//! one bad line never hides the rest of the page.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name as exposed (with `_total`, `_bucket`, ... suffixes).
    pub name: String,
    /// Label pairs in page order, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The value (may be NaN or infinite: checking is the caller's job).
    pub value: f64,
    /// The sample's timestamp in milliseconds, when the line carries one.
    pub timestamp_ms: Option<i64>,
}

impl Sample {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every sample of one page, plus how many lines were skipped as malformed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    /// Samples in page order.
    pub samples: Vec<Sample>,
    /// Lines that were neither a comment, blank, nor a valid sample.
    pub malformed_lines: usize,
}

/// Parses a whole exposition page.
pub fn parse_exposition(text: &str) -> Exposition {
    let mut out = Exposition::default();
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let line = line.trim_start_matches([' ', '\t']);
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_sample(line) {
            Some(sample) => out.samples.push(sample),
            None => out.malformed_lines += 1,
        }
    }
    out
}

/// Parses one sample line (not a comment, not blank).
pub fn parse_sample(line: &str) -> Option<Sample> {
    let mut cursor = Cursor { rest: line };
    let mut name = if cursor.peek() == Some('{') {
        None
    } else {
        Some(cursor.bare_name()?)
    };
    let mut labels = Vec::new();
    let braced = cursor.eat('{');
    if braced {
        loop {
            cursor.skip_spaces();
            if cursor.eat('}') {
                break;
            }
            let key = if cursor.peek() == Some('"') {
                cursor.quoted()?
            } else {
                cursor.bare_name()?
            };
            cursor.skip_spaces();
            if cursor.eat('=') {
                cursor.skip_spaces();
                let value = cursor.quoted()?;
                labels.push((key, value));
            } else if name.is_none() && labels.is_empty() {
                // `{"metric.name", ...}`: a quoted name with no `=`.
                name = Some(key);
            } else {
                return None;
            }
            cursor.skip_spaces();
            if cursor.eat(',') {
                continue;
            }
            if cursor.eat('}') {
                break;
            }
            return None;
        }
    }
    let name = name.filter(|n| !n.is_empty())?;
    // Value (separated by blanks; after a `}` they are optional), then an
    // optional timestamp, then an optional exemplar.
    if !cursor.skip_spaces() && !braced {
        return None;
    }
    let value = parse_value(cursor.token()?)?;
    let mut timestamp_ms = None;
    if cursor.skip_spaces() && !cursor.rest.is_empty() && !cursor.rest.starts_with('#') {
        timestamp_ms = Some(parse_timestamp(cursor.token()?)?);
        cursor.skip_spaces();
    }
    if !cursor.rest.is_empty() && !cursor.rest.starts_with('#') {
        return None;
    }
    Some(Sample {
        name,
        labels,
        value,
        timestamp_ms,
    })
}

/// A float as Prometheus writes it (Go's `ParseFloat` forms, case-insensitive
/// `NaN` / `Inf` / `Infinity` with an optional sign).
pub fn parse_value(token: &str) -> Option<f64> {
    let (sign, body) = match token.as_bytes().first()? {
        b'+' => (1.0, &token[1..]),
        b'-' => (-1.0, &token[1..]),
        _ => (1.0, token),
    };
    if body.eq_ignore_ascii_case("inf") || body.eq_ignore_ascii_case("infinity") {
        return Some(sign * f64::INFINITY);
    }
    if body.eq_ignore_ascii_case("nan") {
        return Some(f64::NAN);
    }
    // Digits, one dot, one exponent: no other spellings Rust would take.
    if body.is_empty()
        || !body
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
    {
        return None;
    }
    body.parse::<f64>().ok().map(|v| sign * v)
}

/// A timestamp: integer milliseconds (text format) or float seconds
/// (OpenMetrics).
fn parse_timestamp(token: &str) -> Option<i64> {
    if let Ok(ms) = token.parse::<i64>() {
        return Some(ms);
    }
    let seconds = parse_value(token)?;
    if !seconds.is_finite() {
        return None;
    }
    let ms = (seconds * 1000.0).round();
    (ms.abs() < 9.0e18).then_some(ms as i64)
}

struct Cursor<'a> {
    rest: &'a str,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<char> {
        self.rest.chars().next()
    }

    fn eat(&mut self, c: char) -> bool {
        match self.rest.strip_prefix(c) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    /// Skips spaces and tabs; true when at least one was skipped.
    fn skip_spaces(&mut self) -> bool {
        let trimmed = self.rest.trim_start_matches([' ', '\t']);
        let skipped = trimmed.len() != self.rest.len();
        self.rest = trimmed;
        skipped
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` (label names never contain `:`, but
    /// accepting it costs nothing).
    fn bare_name(&mut self) -> Option<String> {
        let end = self
            .rest
            .bytes()
            .position(|b| !(b.is_ascii_alphanumeric() || b == b'_' || b == b':'))
            .unwrap_or(self.rest.len());
        let name = &self.rest[..end];
        if name.is_empty() || name.as_bytes()[0].is_ascii_digit() {
            return None;
        }
        self.rest = &self.rest[end..];
        Some(name.to_owned())
    }

    /// A double-quoted string with `\\`, `\"` and `\n` escapes.
    fn quoted(&mut self) -> Option<String> {
        if !self.eat('"') {
            return None;
        }
        let mut out = String::new();
        let mut chars = self.rest.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    self.rest = &self.rest[i + 1..];
                    return Some(out);
                }
                '\\' => match chars.next()?.1 {
                    'n' => out.push('\n'),
                    '\\' => out.push('\\'),
                    '"' => out.push('"'),
                    // Unknown escapes are kept as written.
                    other => {
                        out.push('\\');
                        out.push(other);
                    }
                },
                c => out.push(c),
            }
        }
        None
    }

    /// Up to the next space or tab.
    fn token(&mut self) -> Option<&str> {
        let end = self.rest.find([' ', '\t']).unwrap_or(self.rest.len());
        if end == 0 {
            return None;
        }
        let (token, rest) = self.rest.split_at(end);
        self.rest = rest;
        Some(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Sample {
        parse_sample(line).unwrap_or_else(|| panic!("{line:?} should parse"))
    }

    #[test]
    fn plain_labelled_and_timestamped_samples() {
        let s = one("vllm:num_requests_waiting 3");
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(s.value, 3.0);
        assert!(s.labels.is_empty());
        let s = one(r#"vllm:num_requests_running{engine="0",model_name="qwen"} 2.0 1712345678901"#);
        assert_eq!(s.label("engine"), Some("0"));
        assert_eq!(s.label("model_name"), Some("qwen"));
        assert_eq!(s.timestamp_ms, Some(1_712_345_678_901));
        let s = one("x{} 1.5e-07");
        assert_eq!(s.value, 1.5e-07);
        let s = one("x{a=\"1\",} -2E+3");
        assert_eq!(s.value, -2000.0);
        assert_eq!(s.labels.len(), 1);
    }

    #[test]
    fn escaped_and_awkward_label_values() {
        let s = one(r#"m{path="C:\\dir\\",q="say \"hi\", then }",nl="a\nb", sp = "x y" } 7"#);
        assert_eq!(s.label("path"), Some("C:\\dir\\"));
        assert_eq!(s.label("q"), Some("say \"hi\", then }"));
        assert_eq!(s.label("nl"), Some("a\nb"));
        assert_eq!(s.label("sp"), Some("x y"));
        assert_eq!(s.value, 7.0);
    }

    #[test]
    fn special_values() {
        assert!(one("m NaN").value.is_nan());
        assert_eq!(one("m +Inf").value, f64::INFINITY);
        assert_eq!(one("m -Inf").value, f64::NEG_INFINITY);
        assert_eq!(one("m inf").value, f64::INFINITY);
        assert_eq!(one("m -0").value, 0.0);
        assert_eq!(one("m 1e3").value, 1000.0);
        assert!(parse_sample("m 0x10").is_none());
        assert!(parse_sample("m 1_000").is_none());
        assert!(parse_sample("m infinityy").is_none());
    }

    #[test]
    fn openmetrics_shapes() {
        let s = one(r#"{"vllm.weird name",engine="0"} 4"#);
        assert_eq!(s.name, "vllm.weird name");
        assert_eq!(s.label("engine"), Some("0"));
        let s = one(r#"m_total{a="b"} 5 # {trace_id="x"} 1.0 1.5"#);
        assert_eq!(s.value, 5.0);
        assert_eq!(s.timestamp_ms, None);
        let s = one("m_total 5 1.5 # {trace_id=\"x\"} 1");
        assert_eq!(s.timestamp_ms, Some(1500));
    }

    #[test]
    fn malformed_lines_are_counted_not_fatal() {
        let page = "# HELP m help\n# TYPE m gauge\n\nm{a=\"1\"} 1\r\nm{a=\"unterminated} 2\n\
                    m{a=1} 3\n9bad 1\nm\nm 1 2 3\nm{a=\"x\"}4\n  m{a=\"2\"} 5\n# EOF\n";
        let exposition = parse_exposition(page);
        assert_eq!(exposition.samples.len(), 3);
        assert_eq!(exposition.samples[1].value, 4.0, "no blank needed after }}");
        assert_eq!(exposition.samples[2].value, 5.0);
        assert_eq!(exposition.malformed_lines, 5);
    }
}
