//! Python-compatible JSON text for the templates' `tojson` filter.
//!
//! Hugging Face renders chat templates with a `tojson` that is Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`, not Jinja's HTML-escaping one. Tool schemas and tool-call
//! arguments go through it, so any byte of difference changes the tokens. This
//! module reproduces `json.dumps` output exactly for the value shapes templates
//! see: insertion order kept, Python's default separators (`", "` / `": "`, or
//! `","` / `": "` with an indent), `ensure_ascii` escaping with surrogate pairs,
//! and Python's `repr` of floats (`1.0`, `1e-05`, `1e+16`).
//!
//! Pure functions over `serde_json::Value`; cost is linear in the output size.

use serde_json::Value;
use std::fmt::Write;

/// How [`dumps`] lays the text out; the fields mirror `json.dumps` arguments.
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Pretty-print with this indent string per level (`indent=2` is two spaces).
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; Python's defaults when `None`.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
}

/// Serializes `value` exactly as Python's `json.dumps` would.
pub(crate) fn dumps(value: &Value, options: &DumpOptions) -> String {
    let (item_sep, key_sep) = match &options.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if options.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut writer = Writer {
        out: String::new(),
        options,
        item_sep,
        key_sep,
    };
    writer.value(value, 0);
    writer.out
}

struct Writer<'a> {
    out: String,
    options: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl Writer<'_> {
    fn value(&mut self, value: &Value, depth: usize) {
        match value {
            Value::Null => self.out.push_str("null"),
            Value::Bool(true) => self.out.push_str("true"),
            Value::Bool(false) => self.out.push_str("false"),
            Value::Number(number) => {
                if let Some(int) = number.as_i64() {
                    let _ = write!(self.out, "{int}");
                } else if let Some(int) = number.as_u64() {
                    let _ = write!(self.out, "{int}");
                } else if let Some(float) = number.as_f64() {
                    self.out.push_str(&float_repr(float));
                }
            }
            Value::String(text) => self.string(text),
            Value::Array(items) => {
                if items.is_empty() {
                    self.out.push_str("[]");
                    return;
                }
                self.out.push('[');
                for (index, item) in items.iter().enumerate() {
                    self.separator(index, depth + 1);
                    self.value(item, depth + 1);
                }
                self.close(depth);
                self.out.push(']');
            }
            Value::Object(map) => {
                if map.is_empty() {
                    self.out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.options.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.out.push('{');
                for (index, (key, item)) in entries.into_iter().enumerate() {
                    self.separator(index, depth + 1);
                    self.string(key);
                    self.out.push_str(self.key_sep);
                    self.value(item, depth + 1);
                }
                self.close(depth);
                self.out.push('}');
            }
        }
    }

    /// Writes what goes before the `index`-th member at nesting `depth`.
    fn separator(&mut self, index: usize, depth: usize) {
        if index > 0 {
            self.out.push_str(self.item_sep);
        }
        if let Some(indent) = &self.options.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    /// Writes what goes before the closing bracket of a container at `depth`.
    fn close(&mut self, depth: usize) {
        if let Some(indent) = &self.options.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn string(&mut self, text: &str) {
        self.out.push('"');
        for ch in text.chars() {
            match ch {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(self.out, "\\u{:04x}", c as u32);
                }
                c if self.options.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional
/// notation for exponents in `-4..16`, otherwise `d.ddde±XX`.
fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0"
        } else {
            "0.0"
        }
        .to_owned();
    }
    // `{:e}` gives the shortest round-tripping digits, e.g. "1.2345e-7".
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat(point.unsigned_abs() as usize), digits)
        } else {
            let point = point as usize;
            if digits.len() <= point {
                format!("{}{}.0", digits, "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        };
        format!("{sign}{body}")
    } else {
        let mantissa = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exponent.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plain(value: &Value) -> String {
        dumps(value, &DumpOptions::default())
    }

    #[test]
    fn default_separators_and_order() {
        let value = json!({"name": "get_weather", "b": [1, 2.5, null, true], "a": {}});
        assert_eq!(
            plain(&value),
            r#"{"name": "get_weather", "b": [1, 2.5, null, true], "a": {}}"#
        );
    }

    #[test]
    fn indent_uses_compact_item_separator() {
        let options = DumpOptions {
            indent: Some("  ".to_owned()),
            ..DumpOptions::default()
        };
        let value = json!({"a": [1, {"b": "c"}], "d": []});
        assert_eq!(
            dumps(&value, &options),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"c\"\n    }\n  ],\n  \"d\": []\n}"
        );
    }

    #[test]
    fn custom_separators_and_sort_keys() {
        let options = DumpOptions {
            separators: Some((",".to_owned(), ":".to_owned())),
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&json!({"b": 1, "a": 2}), &options),
            r#"{"a":2,"b":1}"#
        );
    }

    #[test]
    fn string_escapes_match_python() {
        let value = json!("q\"b\\n\n\r\t\u{1}\u{7f}é😀");
        assert_eq!(plain(&value), "\"q\\\"b\\\\n\\n\\r\\t\\u0001\u{7f}é😀\"");
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&value, &ascii),
            "\"q\\\"b\\\\n\\n\\r\\t\\u0001\\u007f\\u00e9\\ud83d\\ude00\""
        );
    }

    #[test]
    fn floats_match_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (-0.5, "-0.5"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (123.456, "123.456"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (value, expected) in cases {
            assert_eq!(float_repr(value), expected, "{value}");
        }
    }
}
