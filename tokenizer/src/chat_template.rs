//! Hugging Face chat templates rendered with minijinja, the way `transformers` does.
//!
//! `transformers` renders a chat template in a sandboxed Jinja2 environment with
//! `trim_blocks` and `lstrip_blocks`, the loop-controls extension, an
//! `{% generation %}` tag that marks assistant text, the globals
//! `raise_exception` and `strftime_now`, a `tojson` filter that is
//! `json.dumps`, Python string/dict methods, and the tokenizer's special tokens
//! (`bos_token`, `eos_token`, …) as variables. [`ChatTemplate`] sets up the same
//! in minijinja:
//!
//! - pycompat methods from `minijinja-contrib`, loop controls, trim/lstrip;
//! - `tojson` from [`crate::pyjson`] (key order preserved, Python separators);
//! - `strftime_now` reads the injected [`Clock`], so tests pin the date;
//! - two source rewrites, done once at load: `{% generation %}` /
//!   `{% endgeneration %}` become an always-true `if` block (the text renders
//!   unchanged, as in `transformers`), and every `{% for … in EXPR %}` iterates
//!   over `EXPR` through a check that fails on `none` — Python raises
//!   `'NoneType' object is not iterable` where minijinja would silently loop
//!   zero times, and a template error is better than tokens that differ from
//!   the engine's.
//!
//! A compiled template is immutable and `Send + Sync`; rendering allocates only
//! the output and the per-call context.

use crate::clock::Clock;
use crate::conversation::ContentFormat;
use crate::pyjson::{self, DumpOptions};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, syntax::SyntaxConfig};
use std::sync::Arc;

/// Name of the template inside its environment.
const TEMPLATE_NAME: &str = "chat";
/// Instructions one render may execute: far above any real conversation
/// (a few hundred per message), low enough that a hostile template or input
/// stops in milliseconds instead of running unbounded.
pub(crate) const CHAT_TEMPLATE_FUEL: u64 = 5_000_000;
/// Filter the `for` rewrite inserts; the prefix keeps it out of template namespaces.
const ITERABLE_FILTER: &str = "__inference_cache_iterable";

/// One compiled chat template with the globals of its model.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    content_format: ContentFormat,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` with `globals` (special tokens) visible to it.
    pub(crate) fn compile(
        source: &str,
        globals: Vec<(String, Value)>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_unknown_method_callback(python_methods);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", |value: &str, chars: Option<&str>| {
            py_strip(value, chars, true, true).to_owned()
        });
        env.add_filter(ITERABLE_FILTER, require_iterable);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: &str| {
            strftime(clock.as_ref(), format)
        });
        for (name, value) in globals {
            env.add_global(name, value);
        }
        env.add_template_owned(TEMPLATE_NAME, rewrite_source(source))?;
        Ok(Self {
            env,
            content_format: detect_content_format(source),
        })
    }

    /// Whether the template reads message content as a string or as parts.
    pub(crate) fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// Renders with a full context (`messages`, `tools`, `documents`,
    /// `add_generation_prompt` and any template keyword arguments); context
    /// variables shadow the special-token globals, as `apply_chat_template`'s
    /// kwargs override the special tokens map.
    pub(crate) fn render_context(
        &self,
        context: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, Error> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        template.render(Value::from(minijinja::value::Serde(context)))
    }

    /// Renders with `messages` and `add_generation_prompt`, `tools` and
    /// `documents` set to `none` as `apply_chat_template` passes them.
    #[cfg(test)]
    pub(crate) fn render(
        &self,
        messages: Value,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        template.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            tools => Value::from(()),
            documents => Value::from(()),
        })
    }
}

/// Python `str` / `dict` / `list` methods: minijinja-contrib's pycompat set,
/// with `strip` / `lstrip` / `rstrip` using Python's notion of whitespace.
fn python_methods(
    state: &mut minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let (left, right) = match method {
        "strip" => (true, true),
        "lstrip" => (true, false),
        "rstrip" => (false, true),
        _ => {
            return minijinja_contrib::pycompat::unknown_method_callback(
                state, value, method, args,
            );
        }
    };
    match (value.as_str(), args) {
        (Some(text), []) => Ok(Value::from(py_strip(text, None, left, right))),
        (Some(text), [chars]) if chars.is_none() => {
            Ok(Value::from(py_strip(text, None, left, right)))
        }
        (Some(text), [chars]) => match chars.as_str() {
            Some(chars) => Ok(Value::from(py_strip(text, Some(chars), left, right))),
            None => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{method} arg must be None or str"),
            )),
        },
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// Python's `str.isspace` for one character: Unicode White_Space plus the
/// ASCII separators U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip(chars)` (or `lstrip` / `rstrip`).
fn py_strip<'a>(text: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let matches = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_python_space(c),
    };
    let text = if left {
        text.trim_start_matches(matches)
    } else {
        text
    };
    if right {
        text.trim_end_matches(matches)
    } else {
        text
    }
}

/// Python's `str.strip()`.
pub(crate) fn py_strip_str(text: &str) -> &str {
    py_strip(text, None, true, true)
}

/// Python's `str.rstrip()`.
pub(crate) fn py_rstrip_str(text: &str) -> &str {
    py_strip(text, None, false, true)
}

/// `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the injected clock's local time, strftime-formatted.
fn strftime(clock: &dyn Clock, format: &str) -> Result<String, Error> {
    use std::fmt::Write;
    let items = chrono::format::StrftimeItems::new(format);
    let mut out = String::new();
    write!(out, "{}", clock.now().format_with_items(items)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

/// `tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(text) => Some(text.to_owned()),
            None => {
                let width = usize::try_from(v).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an int or a string",
                    )
                })?;
                Some(" ".repeat(width))
            }
        },
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|part| part.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be strings",
                    )
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => Some((item, key)),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ));
                }
            }
        }
    };
    let options = DumpOptions {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|err| Error::new(ErrorKind::InvalidOperation, format!("tojson: {err}")))?;
    Ok(Value::from(pyjson::dumps(&json, &options)))
}

/// Passes an iterable through unchanged; `none` is an error as in Python.
fn require_iterable(value: Value) -> Result<Value, Error> {
    if value.is_none() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "'NoneType' object is not iterable",
        ));
    }
    Ok(value)
}

/// Applies the two load-time rewrites described in the module docs.
///
/// Works on `{% … %}` tags only; text, `{{ … }}`, comments and `raw` blocks are
/// copied through byte for byte.
pub(crate) fn rewrite_source(source: &str) -> String {
    let mut out = String::with_capacity(source.len() + 64);
    let mut rest = source;
    let mut in_raw = false;
    while let Some(start) = [rest.find("{%"), rest.find("{#")]
        .into_iter()
        .flatten()
        .min()
    {
        out.push_str(&rest[..start]);
        let tail = &rest[start..];
        if tail.starts_with("{#") {
            let end = tail.find("#}").map_or(tail.len(), |i| i + 2);
            out.push_str(&tail[..end]);
            rest = &tail[end..];
            continue;
        }
        let Some(end) = find_tag_end(tail) else {
            out.push_str(tail);
            return out;
        };
        let tag = &tail[..end];
        rest = &tail[end..];
        // Split "{%-" / "-%}" markers from the statement.
        let open_len = if tag[2..].starts_with(['-', '+']) {
            3
        } else {
            2
        };
        let close_len = if tag[..tag.len() - 2].ends_with(['-', '+']) && tag.len() - 2 > open_len {
            3
        } else {
            2
        };
        let inner = &tag[open_len..tag.len() - close_len];
        let keyword = inner
            .trim_start()
            .split(|c: char| !is_ident(c))
            .next()
            .unwrap_or("");
        if in_raw {
            if keyword == "endraw" {
                in_raw = false;
            }
            out.push_str(tag);
            continue;
        }
        let replaced = match keyword {
            "raw" => {
                in_raw = true;
                None
            }
            "generation" if inner.trim() == "generation" => Some(" if true ".to_owned()),
            "endgeneration" if inner.trim() == "endgeneration" => Some(" endif ".to_owned()),
            "for" => rewrite_for(inner),
            _ => None,
        };
        match replaced {
            Some(statement) => {
                out.push_str(&tag[..open_len]);
                out.push_str(&statement);
                out.push_str(&tag[tag.len() - close_len..]);
            }
            None => out.push_str(tag),
        }
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Byte length of the `{% … %}` tag at the start of `tag`, skipping `%}` in strings.
fn find_tag_end(tag: &str) -> Option<usize> {
    let bytes = tag.as_bytes();
    let mut quote: Option<u8> = None;
    let mut i = 2;
    while i < bytes.len() {
        let b = bytes[i];
        match quote {
            Some(q) => {
                if b == b'\\' {
                    i += 1;
                } else if b == q {
                    quote = None;
                }
            }
            None => {
                if b == b'"' || b == b'\'' {
                    quote = Some(b);
                } else if b == b'%' && bytes.get(i + 1) == Some(&b'}') {
                    return Some(i + 2);
                }
            }
        }
        i += 1;
    }
    None
}

/// Top-level words of a statement with their byte offsets (outside strings and brackets).
fn top_level_words(statement: &str) -> Vec<(usize, &str)> {
    let bytes = statement.as_bytes();
    let mut words = Vec::new();
    let mut depth = 0usize;
    let mut quote: Option<u8> = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            if b == b'\\' {
                i += 1;
            } else if b == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        match b {
            b'"' | b'\'' => quote = Some(b),
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ if b.is_ascii_alphabetic() || b == b'_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                if depth == 0 {
                    words.push((start, &statement[start..i]));
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    words
}

/// `for TARGET in EXPR [if COND] [recursive]` → `for TARGET in (EXPR)|check …`.
fn rewrite_for(statement: &str) -> Option<String> {
    let words = top_level_words(statement);
    let in_at = words.iter().position(|(_, w)| *w == "in")?;
    let expr_start = words[in_at].0 + 2;
    let expr_end = words[in_at + 1..]
        .iter()
        .find(|(_, w)| *w == "if" || *w == "recursive")
        .map_or(statement.len(), |(offset, _)| *offset);
    let expr = statement[expr_start..expr_end].trim();
    if expr.is_empty() {
        return None;
    }
    Some(format!(
        "{}in ({expr})|{ITERABLE_FILTER} {}",
        &statement[..words[in_at].0],
        &statement[expr_end..]
    ))
}

/// Inner statements of every `{% … %}` tag, outside comments and raw blocks.
fn statements(source: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = source;
    let mut in_raw = false;
    while let Some(start) = [rest.find("{%"), rest.find("{#")]
        .into_iter()
        .flatten()
        .min()
    {
        let tail = &rest[start..];
        if tail.starts_with("{#") {
            let end = tail.find("#}").map_or(tail.len(), |i| i + 2);
            rest = &tail[end..];
            continue;
        }
        let Some(end) = find_tag_end(tail) else {
            break;
        };
        let tag = &tail[..end];
        rest = &tail[end..];
        let inner = tag[2..tag.len() - 2]
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        let keyword = inner.split(|c: char| !is_ident(c)).next().unwrap_or("");
        if in_raw {
            in_raw = keyword != "endraw";
            continue;
        }
        if keyword == "raw" {
            in_raw = true;
            continue;
        }
        out.push(inner);
    }
    out
}

/// An access path: a variable and the postfix operations applied to it.
struct Access<'a> {
    name: &'a str,
    /// `Some(key)` for `x['key']` / `x.key`, `None` for a slice `x[a:b]`.
    steps: Vec<Option<String>>,
}

/// Parses `name(.attr | [const] | [slice])*` at the start of `expr`; filters
/// and tests after it (`|reverse`, `is defined`) keep the access what it is.
fn parse_access(expr: &str) -> Option<Access<'_>> {
    let expr = expr.trim();
    let expr = expr
        .strip_prefix('(')
        .map_or(expr, |inner| inner.trim_start());
    let name_len = expr
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(expr.len());
    if name_len == 0 {
        return None;
    }
    let name = &expr[..name_len];
    let mut rest = &expr[name_len..];
    let mut steps = Vec::new();
    loop {
        if let Some(after) = rest.strip_prefix('.') {
            let len = after
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            steps.push(Some(after[..len].to_owned()));
            rest = &after[len..];
        } else if let Some(after) = rest.strip_prefix('[') {
            let close = after.find(']')?;
            let inside = after[..close].trim();
            if inside.contains(':') {
                steps.push(None);
            } else if inside.len() >= 2
                && ((inside.starts_with('\'') && inside.ends_with('\''))
                    || (inside.starts_with('"') && inside.ends_with('"')))
            {
                steps.push(Some(inside[1..inside.len() - 1].to_owned()));
            } else {
                // An index or a computed key: not a whole-list access.
                steps.push(Some(String::new()));
            }
            rest = &after[close + 1..];
        } else {
            break;
        }
    }
    Some(Access { name, steps })
}

/// `expr` is `var` itself or a slice / filter / test of it.
fn is_var_or_elems(expr: &str, var: &str) -> bool {
    parse_access(expr).is_some_and(|a| a.name == var && a.steps.iter().all(Option::is_none))
}

/// `expr` is `var['key']` / `var.key`, possibly sliced, filtered or tested.
fn is_attr_access(expr: &str, var: &str, key: &str) -> bool {
    parse_access(expr).is_some_and(|a| {
        a.name == var
            && a.steps.first().is_some_and(|s| s.as_deref() == Some(key))
            && a.steps[1..].iter().all(Option::is_none)
    })
}

/// vLLM's content-format detection: *openai* when the template loops over
/// the content of a message it got by looping over `messages` (or a variable
/// assigned from it), *string* otherwise.
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let statements = statements(source);
    let mut sets = Vec::new();
    let mut fors = Vec::new();
    for statement in &statements {
        if let Some(body) = statement.strip_prefix("set ")
            && let Some((target, value)) = body.split_once('=')
            && !value.starts_with('=')
        {
            let target = target.trim();
            if target.chars().all(|c| c.is_alphanumeric() || c == '_') {
                sets.push((target, value.trim()));
            }
        } else if let Some(body) = statement.strip_prefix("for ") {
            let words = top_level_words(body);
            let Some(in_at) = words.iter().position(|(_, w)| *w == "in") else {
                continue;
            };
            let target = body[..words[in_at].0].trim();
            let expr_start = words[in_at].0 + 2;
            let expr_end = words[in_at + 1..]
                .iter()
                .find(|(_, w)| *w == "if" || *w == "recursive")
                .map_or(body.len(), |(offset, _)| *offset);
            fors.push((target, body[expr_start..expr_end].trim()));
        }
    }
    let mut messages_vars = vec!["messages"];
    let mut i = 0;
    while i < messages_vars.len() {
        let var = messages_vars[i];
        for (target, value) in &sets {
            if is_var_or_elems(value, var) && !messages_vars.contains(target) {
                messages_vars.push(target);
            }
        }
        i += 1;
    }
    let message_vars: Vec<&str> = fors
        .iter()
        .filter(|(_, iter)| messages_vars.iter().any(|v| is_var_or_elems(iter, v)))
        .map(|(target, _)| *target)
        .collect();
    let loops_over_content = fors.iter().any(|(_, iter)| {
        message_vars
            .iter()
            .any(|var| is_attr_access(iter, var, "content"))
    });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FixedClock;

    fn compile(source: &str) -> ChatTemplate {
        let clock = Arc::new(FixedClock::from_ymd_hms(2026, 3, 7, 9, 30, 0));
        ChatTemplate::compile(
            source,
            vec![("bos_token".to_owned(), Value::from("<s>"))],
            clock,
        )
        .expect("template compiles")
    }

    fn messages(json: serde_json::Value) -> Value {
        Value::from(minijinja::value::Serde(&json))
    }

    #[test]
    fn rewrites_for_and_generation_tags() {
        let source = "{%- for m in messages|reverse if m.role != 'x' recursive -%}{% generation %}a{% endgeneration %}{% endfor %}";
        let rewritten = rewrite_source(source);
        assert_eq!(
            rewritten,
            "{%- for m in (messages|reverse)|__inference_cache_iterable if m.role != 'x' recursive -%}{% if true %}a{% endif %}{% endfor %}"
        );
        // Strings, comments and raw blocks are left alone.
        let untouched = "{# {% for x in y %} #}{% raw %}{% for a in b %}{% endraw %}{{ '%}' }}";
        assert_eq!(rewrite_source(untouched), untouched);
    }

    #[test]
    fn renders_hf_features() {
        let template = compile(concat!(
            "{{ bos_token }}{% for m in messages %}{% if loop.index0 > 1 %}{% break %}{% endif %}",
            "{{ m.role | upper }}:{{ m.content.strip() }}|{% endfor %}",
            "{% generation %}{{ messages[0] | tojson }}{% endgeneration %}",
            "{{ strftime_now('%d %b %Y') }}{% if add_generation_prompt %}>{% endif %}"
        ));
        let out = template
            .render(
                messages(serde_json::json!([
                    {"role": "user", "content": "  hi  "},
                    {"role": "assistant", "content": "yo"},
                    {"role": "user", "content": "never"}
                ])),
                true,
            )
            .expect("renders");
        assert_eq!(
            out,
            "<s>USER:hi|ASSISTANT:yo|{\"role\": \"user\", \"content\": \"  hi  \"}07 Mar 2026>"
        );
    }

    #[test]
    fn raise_exception_and_none_iteration_fail() {
        let template = compile("{{ raise_exception('roles must alternate') }}");
        let err = template
            .render(messages(serde_json::json!([])), true)
            .expect_err("raises");
        assert!(err.to_string().contains("roles must alternate"), "{err}");

        let template = compile("{% for t in tools %}{{ t }}{% endfor %}");
        let err = template
            .render(messages(serde_json::json!([])), true)
            .expect_err("none is not iterable");
        assert!(err.to_string().contains("not iterable"), "{err}");

        // An undefined variable still iterates as empty, as in Jinja2.
        let template = compile("{% for t in nothing %}{{ t }}{% endfor %}ok");
        assert_eq!(
            template
                .render(messages(serde_json::json!([])), true)
                .expect("renders"),
            "ok"
        );
    }

    #[test]
    fn python_printing_and_whitespace() {
        let template = compile(concat!(
            "{{ {'a': 1, 'b': [true, none, 'x', 1.5]} }}|{{ none }}|{{ false }}|",
            "{{ '\\x1c hi \\x1f'.strip() | length }}|{{ '\\x1c ho \\x1f' | trim | length }}|",
            "{{ 'xxhixx'.strip('x') }}|{{ '  a '.lstrip() }}.|{{ 'a b'.split(' ') }}"
        ));
        let out = template
            .render(messages(serde_json::json!([])), false)
            .expect("renders");
        assert_eq!(
            out,
            "{'a': 1, 'b': [True, None, 'x', 1.5]}|None|False|2|2|hi|a .|['a', 'b']"
        );
    }

    #[test]
    fn tojson_arguments() {
        let template = compile(
            "{{ messages[0] | tojson(indent=2) }}#{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}#{{ 'é' | tojson(ensure_ascii=true) }}",
        );
        let out = template
            .render(
                messages(serde_json::json!([{"role": "u", "content": 1.0}])),
                false,
            )
            .expect("renders");
        assert_eq!(
            out,
            "{\n  \"role\": \"u\",\n  \"content\": 1.0\n}#{\"content\":1.0,\"role\":\"u\"}#\"\\u00e9\""
        );
    }

    #[test]
    fn detects_the_content_format_as_vllm_does() {
        assert_eq!(
            detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}"),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{%- set loop_messages = messages[1:] -%}{%- for message in loop_messages -%}{%- for item in message['content'] | reverse -%}{{ item.text }}{% endfor %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        // Looping over something else's content does not count.
        assert_eq!(
            detect_content_format(
                "{% for m in messages %}{% endfor %}{% for x in other.content %}{% endfor %}{# {% for c in m.content %} #}"
            ),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{% for m in messages[::-1] %}{% for c in m.content[1:] %}{% endfor %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
    }
}
