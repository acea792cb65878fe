//! Request traces in Mooncake's JSONL format, and their reader and writer.
//!
//! One JSON object per line: `timestamp` (arrival, milliseconds from the
//! start), `input_length` (prompt tokens), `output_length` (generated tokens)
//! and `hash_ids` (one id per block of `block_size` tokens, each already a
//! prefix hash: it stands for the block *and everything before it*). So a
//! replica's cache hit is the number of leading ids it holds, and
//! `len(hash_ids) == ceil(input_length / block_size)`; every block is full but
//! the last, which holds `input_length - block_size × (n - 1)` tokens.
//!
//! Parsing is strict about the fields it uses (a bad line is an error naming
//! the line and the field) and ignores fields it does not know. Records are
//! sorted by arrival (stably) after reading, so an unsorted file still replays
//! in arrival order. Cost: one pass, one `Vec<u64>` per request.

use std::io::{BufRead, Write};

use serde_json::Value;

use crate::error::TraceError;

/// Block size of Mooncake's published traces, in tokens.
pub const DEFAULT_TRACE_BLOCK_SIZE: u32 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Arrival, milliseconds from the start of the trace.
    pub arrival_ms: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
    /// Prefix hash of each block of the prompt, in order.
    pub blocks: Vec<u64>,
}

/// A whole trace: requests in arrival order and the block size of their hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Tokens per block.
    pub block_size: u32,
    /// Requests, sorted by arrival.
    pub requests: Vec<Request>,
}

impl Trace {
    /// Reads a Mooncake JSONL trace; blank lines are skipped.
    pub fn from_jsonl(reader: impl BufRead, block_size: u32) -> Result<Self, TraceError> {
        let mut requests = Vec::new();
        for (index, line) in reader.lines().enumerate() {
            let number = index + 1;
            let line = line.map_err(|e| TraceError {
                line: number,
                field: None,
                reason: format!("unreadable: {e}"),
            })?;
            if line.trim().is_empty() {
                continue;
            }
            requests.push(parse_record(&line, number, block_size)?);
        }
        requests.sort_by_key(|r| r.arrival_ms);
        Ok(Self {
            block_size,
            requests,
        })
    }

    /// Writes the trace as Mooncake JSONL.
    pub fn write_jsonl(&self, mut writer: impl Write) -> std::io::Result<()> {
        for r in &self.requests {
            let record = serde_json::json!({
                "timestamp": r.arrival_ms,
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": r.blocks,
            });
            serde_json::to_writer(&mut writer, &record)?;
            writer.write_all(b"\n")?;
        }
        writer.flush()
    }

    /// Tokens in the leading `blocks` blocks of `request` (the last block may be partial).
    pub fn leading_tokens(&self, request: &Request, blocks: usize) -> u64 {
        if blocks >= request.blocks.len() {
            u64::from(request.input_tokens)
        } else {
            blocks as u64 * u64::from(self.block_size)
        }
    }

    /// Tokens in block `i` of `request`.
    pub fn block_tokens(&self, request: &Request, i: usize) -> u32 {
        if i + 1 == request.blocks.len() {
            request.input_tokens - self.block_size * (request.blocks.len() as u32 - 1)
        } else {
            self.block_size
        }
    }

    /// Total prompt blocks.
    pub fn total_blocks(&self) -> u64 {
        self.requests.iter().map(|r| r.blocks.len() as u64).sum()
    }
}

fn parse_record(line: &str, number: usize, block_size: u32) -> Result<Request, TraceError> {
    let err = |field: Option<&'static str>, reason: String| TraceError {
        line: number,
        field,
        reason,
    };
    let value: Value =
        serde_json::from_str(line).map_err(|e| err(None, format!("not a JSON object: {e}")))?;
    let Value::Object(object) = value else {
        return Err(err(None, "not a JSON object".into()));
    };
    let field = |name: &'static str| {
        object
            .get(name)
            .ok_or_else(|| err(Some(name), "missing".into()))
    };
    let count = |name: &'static str| -> Result<u32, TraceError> {
        let v = field(name)?;
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                err(
                    Some(name),
                    format!("expected a token count (integer 0..=4294967295), got {v}"),
                )
            })
    };
    let timestamp = field("timestamp")?;
    let arrival_ms = match timestamp.as_u64() {
        Some(ms) => ms,
        None => match timestamp.as_f64() {
            Some(ms) if ms >= 0.0 && ms.is_finite() => ms.round() as u64,
            _ => {
                return Err(err(
                    Some("timestamp"),
                    format!("expected non-negative milliseconds, got {timestamp}"),
                ));
            }
        },
    };
    let input_tokens = count("input_length")?;
    let output_tokens = count("output_length")?;
    let ids = field("hash_ids")?;
    let Some(ids) = ids.as_array() else {
        return Err(err(
            Some("hash_ids"),
            format!("expected an array of non-negative integers, got {ids}"),
        ));
    };
    let mut blocks = Vec::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        let Some(id) = id.as_u64() else {
            return Err(err(
                Some("hash_ids"),
                format!("element {i} is not a non-negative integer: {id}"),
            ));
        };
        blocks.push(id);
    }
    let expected = input_tokens.div_ceil(block_size) as usize;
    if blocks.len() != expected {
        return Err(err(
            Some("hash_ids"),
            format!(
                "{} ids, but input_length {input_tokens} at {block_size} tokens per block needs \
                 {expected} (is --trace-block-size right?)",
                blocks.len()
            ),
        ));
    }
    Ok(Request {
        arrival_ms,
        input_tokens,
        output_tokens,
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Trace, TraceError> {
        Trace::from_jsonl(text.as_bytes(), 4)
    }

    #[test]
    fn reads_records_sorted_with_partial_last_block() {
        let trace = parse(concat!(
            r#"{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1, 2, 3], "extra": 1}"#,
            "\n\n",
            r#"{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [7]}"#,
            "\n"
        ))
        .expect("valid trace");
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(trace.requests[0].blocks, [7]);
        let second = &trace.requests[1];
        assert_eq!(second.arrival_ms, 5);
        assert_eq!(trace.block_tokens(second, 0), 4);
        assert_eq!(trace.block_tokens(second, 2), 2);
        assert_eq!(trace.leading_tokens(second, 2), 8);
        assert_eq!(trace.leading_tokens(second, 3), 10);
        assert_eq!(trace.total_blocks(), 4);
    }

    #[test]
    fn rejects_bad_lines_naming_line_and_field() {
        let good = r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}"#;
        let cases = [
            ("not json", None),
            (r#"[1, 2]"#, None),
            (
                r#"{"input_length": 4, "output_length": 1, "hash_ids": [1]}"#,
                Some("timestamp"),
            ),
            (
                r#"{"timestamp": -3, "input_length": 4, "output_length": 1, "hash_ids": [1]}"#,
                Some("timestamp"),
            ),
            (
                r#"{"timestamp": 0, "input_length": "4", "output_length": 1, "hash_ids": [1]}"#,
                Some("input_length"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "hash_ids": [1]}"#,
                Some("output_length"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": 1}"#,
                Some("hash_ids"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [-1]}"#,
                Some("hash_ids"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]}"#,
                Some("hash_ids"),
            ),
        ];
        for (bad, field) in cases {
            let text = format!("{good}\n{good}\n{bad}\n{good}\n");
            let error = parse(&text).expect_err(bad);
            assert_eq!(error.line, 3, "{bad}");
            assert_eq!(error.field, field, "{bad}");
            let message = error.to_string();
            assert!(message.starts_with("line 3"), "{message}");
            if let Some(field) = field {
                assert!(message.contains(field), "{message}");
            }
        }
    }

    #[test]
    fn jsonl_round_trips() {
        let trace = Trace {
            block_size: 4,
            requests: vec![Request {
                arrival_ms: 3,
                input_tokens: 6,
                output_tokens: 9,
                blocks: vec![10, 11],
            }],
        };
        let mut out = Vec::new();
        trace.write_jsonl(&mut out).expect("write to memory");
        assert_eq!(Trace::from_jsonl(&out[..], 4).expect("reads back"), trace);
    }
}
