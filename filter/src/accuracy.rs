//! Predicted vs actual prefix-cache reuse, read from the engine's response.
//!
//! A request the filter looked up carries a prediction: the server's reason
//! code and, when the request was routed on the hint, the top replica's
//! `matched_tokens` (zero otherwise). The engine's response says what it
//! actually reused: OpenAI-style `usage.prompt_tokens_details.cached_tokens`.
//!
//! - A JSON response (`application/json`) is copied chunk by chunk, as it
//!   passes, up to `max_response_body_bytes`, and parsed at its end.
//! - An event stream (`text/event-stream`) is read line by line as it passes;
//!   only the last `data:` event with a `usage` object counts. Engines send
//!   that final usage chunk only when the request set
//!   `stream_options.include_usage`; without it the response counts as
//!   `no_usage`.
//! - vLLM fills `prompt_tokens_details` only when started with
//!   `--enable-prompt-tokens-details`; a `usage` without `cached_tokens` also
//!   counts as `no_usage`.
//!
//! Nothing here holds the response: every chunk continues at once, and a
//! body that is too large, compressed or unparsable simply stops the
//! measurement (counted). Metric names are a fixed table, one set per known
//! reason code plus `OTHER`, so a misbehaving server cannot create metrics.
//! Replica ids are not part of any name: their number is unbounded and
//! proxy-wasm metrics have no labels.

use serde_json::Value;

use crate::outcome::KNOWN_REASONS;

/// How a response body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// One JSON document.
    Json,
    /// Server-sent events (`data: {...}` lines).
    EventStream,
}

/// The body kind of a `content-type` value, or `None` when it is neither.
pub fn body_kind(content_type: &str) -> Option<BodyKind> {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match essence.as_str() {
        "application/json" => Some(BodyKind::Json),
        "text/event-stream" => Some(BodyKind::EventStream),
        _ => None,
    }
}

/// What the engine reported about the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// The `usage` of a response object, when it has a `usage` object.
fn usage_of(value: &Value) -> Option<Usage> {
    let usage = value.get("usage")?.as_object()?;
    Some(Usage {
        prompt_tokens: usage.get("prompt_tokens").and_then(Value::as_u64),
        cached_tokens: usage
            .get("prompt_tokens_details")
            .and_then(|details| details.get("cached_tokens"))
            .and_then(Value::as_u64),
    })
}

/// The body was not what its content type promised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseError;

/// The `usage` of a whole JSON response body (`Ok(None)`: no `usage` object).
pub fn json_usage(body: &[u8]) -> Result<Option<Usage>, ParseError> {
    let value: Value = serde_json::from_slice(body).map_err(|_| ParseError)?;
    Ok(usage_of(&value))
}

/// A line of the event stream outgrew the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge;

/// Reads an event stream chunk by chunk, keeping only the last `usage` seen.
#[derive(Debug, Clone, Default)]
pub struct EventStreamReader {
    pending: Vec<u8>,
    last: Option<Usage>,
    limit: usize,
}

impl EventStreamReader {
    /// A reader whose unfinished line may hold at most `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            pending: Vec::new(),
            last: None,
            limit,
        }
    }

    /// Feeds the next chunk.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), TooLarge> {
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&byte| byte == b'\n') {
            if self.pending.len() + end > self.limit {
                return Err(TooLarge);
            }
            self.pending.extend_from_slice(&rest[..end]);
            let line = std::mem::take(&mut self.pending);
            self.line(&line);
            rest = &rest[end + 1..];
        }
        if self.pending.len() + rest.len() > self.limit {
            return Err(TooLarge);
        }
        self.pending.extend_from_slice(rest);
        Ok(())
    }

    /// The stream ended: the last `usage` reported, if any.
    pub fn finish(mut self) -> Option<Usage> {
        let line = std::mem::take(&mut self.pending);
        self.line(&line);
        self.last
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        // Only a chunk that mentions usage is worth parsing.
        if !contains(data, b"\"usage\"") {
            return;
        }
        if let Ok(value) = serde_json::from_slice::<Value>(data)
            && let Some(usage) = usage_of(&value)
        {
            self.last = Some(usage);
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

/// How a measured response compares with its prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Predicted reuse, and the engine reused something.
    HintedHit,
    /// Predicted reuse (`matched_tokens > 0`), and the engine reused nothing.
    HintedMiss,
    /// No reuse predicted, and the engine reused something.
    NotHintedHit,
    /// No reuse predicted, and none happened.
    NotHintedMiss,
}

/// Compares a prediction with what the engine reported.
pub fn verdict(predicted: u64, cached: u64) -> Verdict {
    match (predicted > 0, cached > 0) {
        (true, true) => Verdict::HintedHit,
        (true, false) => Verdict::HintedMiss,
        (false, true) => Verdict::NotHintedHit,
        (false, false) => Verdict::NotHintedMiss,
    }
}

/// Largest value recorded in the ratio histogram (100 × actual / predicted).
pub const MAX_RATIO_PERCENT: u64 = 10_000;

/// `100 × cached / predicted`, capped; `None` when nothing was predicted.
pub fn ratio_percent(predicted: u64, cached: u64) -> Option<u64> {
    if predicted == 0 {
        return None;
    }
    let percent = u128::from(cached) * 100 / u128::from(predicted);
    Some(
        u64::try_from(percent)
            .unwrap_or(MAX_RATIO_PERCENT)
            .min(MAX_RATIO_PERCENT),
    )
}

/// Counter of responses whose body outgrew `max_response_body_bytes` (measurement stopped).
pub const RESPONSE_TOO_LARGE_METRIC: &str = "inferencecache_filter.accuracy.response_too_large";
/// Counter of JSON responses that did not parse (measurement stopped, response untouched).
pub const RESPONSE_PARSE_ERROR_METRIC: &str = "inferencecache_filter.accuracy.parse_error";
/// Counter of responses not measured because they are compressed.
pub const RESPONSE_ENCODED_METRIC: &str = "inferencecache_filter.accuracy.encoded";

/// The metric names of one reason code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasonMetrics {
    /// The reason code (`OTHER` for unknown ones).
    pub code: &'static str,
    /// Counter: [`Verdict::HintedHit`].
    pub hinted_hit: &'static str,
    /// Counter: [`Verdict::HintedMiss`].
    pub hinted_miss: &'static str,
    /// Counter: [`Verdict::NotHintedHit`].
    pub not_hinted_hit: &'static str,
    /// Counter: [`Verdict::NotHintedMiss`].
    pub not_hinted_miss: &'static str,
    /// Counter: the response reported no `cached_tokens`.
    pub no_usage: &'static str,
    /// Histogram: `100 × cached_tokens / matched_tokens`, when matched_tokens > 0.
    pub ratio_percent: &'static str,
}

impl ReasonMetrics {
    /// The counter of a verdict.
    pub fn counter(&self, verdict: Verdict) -> &'static str {
        match verdict {
            Verdict::HintedHit => self.hinted_hit,
            Verdict::HintedMiss => self.hinted_miss,
            Verdict::NotHintedHit => self.not_hinted_hit,
            Verdict::NotHintedMiss => self.not_hinted_miss,
        }
    }
}

macro_rules! reason_metrics {
    ($($code:literal),* $(,)?) => {
        /// Accuracy metrics per reason code; the last entry is `OTHER`.
        pub const REASON_METRICS: &[ReasonMetrics] = &[$(ReasonMetrics {
            code: $code,
            hinted_hit: concat!("inferencecache_filter.accuracy.", $code, ".hinted_hit"),
            hinted_miss: concat!("inferencecache_filter.accuracy.", $code, ".hinted_miss"),
            not_hinted_hit: concat!("inferencecache_filter.accuracy.", $code, ".not_hinted_hit"),
            not_hinted_miss: concat!("inferencecache_filter.accuracy.", $code, ".not_hinted_miss"),
            no_usage: concat!("inferencecache_filter.accuracy.", $code, ".no_usage"),
            ratio_percent: concat!("inferencecache_filter.accuracy.", $code, ".ratio_percent"),
        }),*];
    };
}

reason_metrics!(
    "PREFIX_MATCH",
    "TENANT_HOT",
    "AFFINITY_HINT",
    "NO_HINT",
    "POLICY_REQUIRES_CHAIN",
    "TIMEOUT",
    "UNKNOWN_TENANT",
    "UNKNOWN_MODEL",
    "UNKNOWN_HASH_SCHEME",
    "OTHER",
);

/// The accuracy metrics of a reason code; unknown codes share `OTHER`'s.
pub fn reason_metrics(code: &str) -> &'static ReasonMetrics {
    let known = KNOWN_REASONS.contains(&code);
    let other = &REASON_METRICS[REASON_METRICS.len() - 1];
    if !known {
        return other;
    }
    REASON_METRICS
        .iter()
        .find(|metrics| metrics.code == code)
        .unwrap_or(other)
}

/// Every accuracy counter.
pub fn accuracy_counters() -> Vec<&'static str> {
    let mut names = vec![
        RESPONSE_TOO_LARGE_METRIC,
        RESPONSE_PARSE_ERROR_METRIC,
        RESPONSE_ENCODED_METRIC,
    ];
    for metrics in REASON_METRICS {
        names.extend([
            metrics.hinted_hit,
            metrics.hinted_miss,
            metrics.not_hinted_hit,
            metrics.not_hinted_miss,
            metrics.no_usage,
        ]);
    }
    names
}

/// Every accuracy histogram.
pub fn accuracy_histograms() -> Vec<&'static str> {
    REASON_METRICS
        .iter()
        .map(|metrics| metrics.ratio_percent)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types() {
        assert_eq!(body_kind("application/json"), Some(BodyKind::Json));
        assert_eq!(
            body_kind("Application/JSON; charset=utf-8"),
            Some(BodyKind::Json)
        );
        assert_eq!(
            body_kind("text/event-stream; charset=utf-8"),
            Some(BodyKind::EventStream)
        );
        assert_eq!(body_kind("text/plain"), None);
        assert_eq!(body_kind(""), None);
    }

    #[test]
    fn json_usage_with_and_without_details() {
        let body = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        assert_eq!(
            json_usage(body),
            Ok(Some(Usage {
                prompt_tokens: Some(40),
                cached_tokens: Some(32)
            }))
        );
        let plain = br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":null}}"#;
        assert_eq!(
            json_usage(plain),
            Ok(Some(Usage {
                prompt_tokens: Some(40),
                cached_tokens: None
            }))
        );
        assert_eq!(json_usage(br#"{"choices":[]}"#), Ok(None));
        assert_eq!(json_usage(b"{not json"), Err(ParseError));
    }

    #[test]
    fn event_stream_keeps_the_last_usage_across_chunk_boundaries() {
        let stream = concat!(
            "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"text\":\"\\\"usage\\\"\"}],\"usage\":null}\r\n\r\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":48,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n",
            "data: [DONE]\n\n",
        );
        for split in [1, 7, 50, stream.len()] {
            let mut reader = EventStreamReader::new(1 << 20);
            for chunk in stream.as_bytes().chunks(split) {
                reader.push(chunk).expect("within the bound");
            }
            assert_eq!(
                reader.finish(),
                Some(Usage {
                    prompt_tokens: Some(48),
                    cached_tokens: Some(16)
                }),
                "chunks of {split}"
            );
        }
        let mut without = EventStreamReader::new(1 << 20);
        without
            .push(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n")
            .expect("within the bound");
        assert_eq!(without.finish(), None);
        let mut unterminated = EventStreamReader::new(1 << 20);
        unterminated
            .push(b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":5}}}")
            .expect("within the bound");
        assert_eq!(
            unterminated.finish().and_then(|usage| usage.cached_tokens),
            Some(5)
        );
    }

    #[test]
    fn event_stream_lines_are_bounded() {
        let mut reader = EventStreamReader::new(8);
        assert_eq!(reader.push(b"data: 1\n"), Ok(()));
        assert_eq!(reader.push(b"data: 12"), Ok(()));
        assert_eq!(reader.push(b"3"), Err(TooLarge));
        let mut reader = EventStreamReader::new(8);
        assert_eq!(reader.push(b"data: 123456\n"), Err(TooLarge));
    }

    #[test]
    fn verdicts_and_ratios() {
        assert_eq!(verdict(32, 32), Verdict::HintedHit);
        assert_eq!(verdict(32, 0), Verdict::HintedMiss);
        assert_eq!(verdict(0, 16), Verdict::NotHintedHit);
        assert_eq!(verdict(0, 0), Verdict::NotHintedMiss);
        assert_eq!(ratio_percent(32, 16), Some(50));
        assert_eq!(ratio_percent(32, 48), Some(150));
        assert_eq!(ratio_percent(0, 16), None);
        assert_eq!(ratio_percent(1, u64::MAX), Some(MAX_RATIO_PERCENT));
    }

    #[test]
    fn metric_table_covers_every_known_reason_once() {
        let codes: Vec<_> = REASON_METRICS.iter().map(|metrics| metrics.code).collect();
        let mut expected = KNOWN_REASONS.to_vec();
        expected.push("OTHER");
        assert_eq!(codes, expected);
        assert_eq!(
            reason_metrics("PREFIX_MATCH").hinted_miss,
            "inferencecache_filter.accuracy.PREFIX_MATCH.hinted_miss"
        );
        assert_eq!(reason_metrics("SOMETHING_NEW").code, "OTHER");
        assert_eq!(reason_metrics("OTHER").code, "OTHER");
        let mut all = crate::outcome::all_metrics();
        assert!(accuracy_counters().iter().all(|name| all.contains(name)));
        all.extend(accuracy_histograms());
        let unique: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len());
    }
}
