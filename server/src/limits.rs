//! Bounds on everything a caller sends, checked once at the gRPC edge.
//!
//! Each limit is a `serve` flag with a default below; hitting one is counted
//! in `inferencecache_limit_hits_total{limit}` and never panics or errors a
//! consumer RPC (lookups fail open):
//!
//! | limit | on a lookup | on ingest |
//! |---|---|---|
//! | `hash_bytes` | a wider hash in the chain / `prefix_hash`: `NO_HINT` | the entry is dropped |
//! | `chain_blocks` | the chain is cut to its first N blocks (still a prefix) | the entry is dropped |
//! | `token_ids` | the ids are cut to the first N (still a prefix) | — |
//! | `prompt_bytes` / `chat_messages` | not tokenized: `NO_HINT` (a chat counts its messages, tools, documents and template kwargs) | — |
//! | `update_entries` | — | entries past the N-th of one update are dropped |
//! | `template_variables` | RenderTemplate answers `RENDER_ERROR` | — |
//! | `tokenize_concurrency` | all tokenization slots busy: `TIMEOUT` at once | — |
//! | `grpc_message_bytes` | tonic refuses the message (`RESOURCE_EXHAUSTED`) | the stream ends `RESOURCE_EXHAUSTED` |
//!
//! Hash width: the schemes this project fingerprints (`vllm`, `sglang`) use
//! 8-byte hashes, so a wider hash there is refused; any other scheme may use
//! up to `--max-hash-bytes`.
//!
//! Floats in `ReplicaStats` (`hit_rate`, `pressure`, `kv_cache_usage`) are
//! fractions: NaN, infinite or negative values (or a negative counter) drop
//! the stats of that update (`inferencecache_stats_rejected_total{reason}`),
//! values above 1 are clamped to 1 (counted as `reason="clamped"`).

use std::time::Duration;

use clap::builder::TypedValueParser as _;

use crate::metrics::Metrics;

/// Default `--grpc-max-message-bytes`: tonic's own default, 4 MiB.
pub const DEFAULT_GRPC_MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Default `--grpc-max-concurrent-streams` per HTTP/2 connection.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;
/// Default `--grpc-keepalive-interval`.
pub const DEFAULT_KEEPALIVE_INTERVAL: &str = "30s";
/// Default `--grpc-keepalive-timeout`.
pub const DEFAULT_KEEPALIVE_TIMEOUT: &str = "10s";
/// Hash width of the schemes this project fingerprints.
pub const KNOWN_SCHEME_HASH_BYTES: usize = 8;
/// Schemes whose hashes are [`KNOWN_SCHEME_HASH_BYTES`] wide.
pub const KNOWN_SCHEMES: [&str; 2] = ["vllm", "sglang"];
/// Default `--max-hash-bytes` for other schemes.
pub const DEFAULT_MAX_HASH_BYTES: usize = 64;
/// Default `--max-chain-blocks`.
pub const DEFAULT_MAX_CHAIN_BLOCKS: usize = 8192;
/// Default `--max-token-ids`.
pub const DEFAULT_MAX_TOKEN_IDS: usize = 131_072;
/// Default `--max-prompt-bytes` (prompt_text, raw_prompt, or all message contents together).
pub const DEFAULT_MAX_PROMPT_BYTES: usize = 1 << 20;
/// Default `--max-chat-messages`.
pub const DEFAULT_MAX_CHAT_MESSAGES: usize = 1024;
/// Default `--max-update-entries` (block-replica entries one CacheStateUpdate may carry).
pub const DEFAULT_MAX_UPDATE_ENTRIES: usize = 65_536;
/// Default `--max-template-variables`.
pub const DEFAULT_MAX_TEMPLATE_VARIABLES: usize = 64;
/// The longest caller deadline honoured; a longer `grpc-timeout` is clamped to it.
pub const MAX_GRPC_DEADLINE: Duration = Duration::from_secs(3600);

/// Every limit label, for metric pre-registration.
pub const LIMIT_LABELS: [&str; 10] = [
    "grpc_message_bytes",
    "hash_bytes",
    "chain_blocks",
    "token_ids",
    "prompt_bytes",
    "chat_messages",
    "update_entries",
    "template_variables",
    "tokenize_concurrency",
    "grpc_timeout_clamped",
];

/// Reasons a `ReplicaStats` is dropped or adjusted.
pub const STATS_REASONS: [&str; 3] = ["not_finite", "negative", "clamped"];

/// Default `--tokenize-concurrency`: the CPU count.
pub fn default_tokenize_concurrency() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Flags of the request limits, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Largest gRPC message the server decodes (bytes); larger ones are refused RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = DEFAULT_GRPC_MAX_MESSAGE_BYTES, env = "INFERENCE_CACHE_GRPC_MAX_MESSAGE_BYTES")]
    pub grpc_max_message_bytes: usize,

    /// Concurrent HTTP/2 streams per gRPC connection (advertised to the peer).
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_STREAMS, value_parser = clap::value_parser!(u32).range(1..), env = "INFERENCE_CACHE_GRPC_MAX_CONCURRENT_STREAMS")]
    pub grpc_max_concurrent_streams: u32,

    /// HTTP/2 keepalive ping interval on gRPC connections ("0" disables).
    #[arg(long, default_value = DEFAULT_KEEPALIVE_INTERVAL, value_parser = parse_duration, env = "INFERENCE_CACHE_GRPC_KEEPALIVE_INTERVAL")]
    pub grpc_keepalive_interval: Duration,

    /// A connection whose keepalive ping is not answered within this is closed.
    #[arg(long, default_value = DEFAULT_KEEPALIVE_TIMEOUT, value_parser = parse_duration, env = "INFERENCE_CACHE_GRPC_KEEPALIVE_TIMEOUT")]
    pub grpc_keepalive_timeout: Duration,

    /// Widest block hash accepted for hash schemes other than vllm / sglang (those take 8 bytes).
    #[arg(long, default_value_t = DEFAULT_MAX_HASH_BYTES, value_parser = clap::value_parser!(u32).range(1..=4096).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_HASH_BYTES")]
    pub max_hash_bytes: usize,

    /// Longest block chain of one lookup (cut to it) or one ingested entry (dropped).
    #[arg(long, default_value_t = DEFAULT_MAX_CHAIN_BLOCKS, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_CHAIN_BLOCKS")]
    pub max_chain_blocks: usize,

    /// Most token_ids of one lookup (cut to them).
    #[arg(long, default_value_t = DEFAULT_MAX_TOKEN_IDS, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_TOKEN_IDS")]
    pub max_token_ids: usize,

    /// Largest prompt the server tokenizes: prompt_text, raw_prompt, or all message contents together (bytes).
    #[arg(long, default_value_t = DEFAULT_MAX_PROMPT_BYTES, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_PROMPT_BYTES")]
    pub max_prompt_bytes: usize,

    /// Most chat messages of one lookup.
    #[arg(long, default_value_t = DEFAULT_MAX_CHAT_MESSAGES, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_CHAT_MESSAGES")]
    pub max_chat_messages: usize,

    /// Most block-replica entries one CacheStateUpdate may carry; the rest are dropped.
    #[arg(long, default_value_t = DEFAULT_MAX_UPDATE_ENTRIES, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_UPDATE_ENTRIES")]
    pub max_update_entries: usize,

    /// Most variables of one RenderTemplate request.
    #[arg(long, default_value_t = DEFAULT_MAX_TEMPLATE_VARIABLES, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_MAX_TEMPLATE_VARIABLES")]
    pub max_template_variables: usize,

    /// Tokenizations running at once; a lookup arriving when all are busy answers TIMEOUT at once [default: CPU count].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_TOKENIZE_CONCURRENCY")]
    pub tokenize_concurrency: Option<usize>,
}

/// A duration in the server's grammar (`0`, `500ms`, `10s`, `1m30s`), zero allowed.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    inference_cache_index::parse_duration(text)
}

fn default_duration(text: &str) -> Duration {
    parse_duration(text).unwrap_or_default()
}

impl LimitArgs {
    /// Resolves the flags into settings.
    pub fn into_settings(self) -> Limits {
        Limits {
            grpc_max_message_bytes: self.grpc_max_message_bytes,
            grpc_max_concurrent_streams: self.grpc_max_concurrent_streams,
            grpc_keepalive_interval: self.grpc_keepalive_interval,
            grpc_keepalive_timeout: self.grpc_keepalive_timeout,
            max_hash_bytes: self.max_hash_bytes,
            max_chain_blocks: self.max_chain_blocks,
            max_token_ids: self.max_token_ids,
            max_prompt_bytes: self.max_prompt_bytes,
            max_chat_messages: self.max_chat_messages,
            max_update_entries: self.max_update_entries,
            max_template_variables: self.max_template_variables,
            tokenize_concurrency: self
                .tokenize_concurrency
                .unwrap_or_else(default_tokenize_concurrency),
        }
    }
}

/// Resolved request limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest decoded gRPC message.
    pub grpc_max_message_bytes: usize,
    /// HTTP/2 streams per connection.
    pub grpc_max_concurrent_streams: u32,
    /// Keepalive ping interval; zero disables.
    pub grpc_keepalive_interval: Duration,
    /// Keepalive ping timeout.
    pub grpc_keepalive_timeout: Duration,
    /// Widest hash for schemes other than the known ones.
    pub max_hash_bytes: usize,
    /// Longest chain.
    pub max_chain_blocks: usize,
    /// Most token ids of one lookup.
    pub max_token_ids: usize,
    /// Largest prompt tokenized.
    pub max_prompt_bytes: usize,
    /// Most chat messages.
    pub max_chat_messages: usize,
    /// Most entries per update.
    pub max_update_entries: usize,
    /// Most RenderTemplate variables.
    pub max_template_variables: usize,
    /// Concurrent tokenizations.
    pub tokenize_concurrency: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            grpc_max_message_bytes: DEFAULT_GRPC_MAX_MESSAGE_BYTES,
            grpc_max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            grpc_keepalive_interval: default_duration(DEFAULT_KEEPALIVE_INTERVAL),
            grpc_keepalive_timeout: default_duration(DEFAULT_KEEPALIVE_TIMEOUT),
            max_hash_bytes: DEFAULT_MAX_HASH_BYTES,
            max_chain_blocks: DEFAULT_MAX_CHAIN_BLOCKS,
            max_token_ids: DEFAULT_MAX_TOKEN_IDS,
            max_prompt_bytes: DEFAULT_MAX_PROMPT_BYTES,
            max_chat_messages: DEFAULT_MAX_CHAT_MESSAGES,
            max_update_entries: DEFAULT_MAX_UPDATE_ENTRIES,
            max_template_variables: DEFAULT_MAX_TEMPLATE_VARIABLES,
            tokenize_concurrency: default_tokenize_concurrency(),
        }
    }
}

impl Limits {
    /// Widest hash accepted under `scheme`.
    pub fn hash_width(&self, scheme: &str) -> usize {
        if KNOWN_SCHEMES.contains(&scheme) {
            KNOWN_SCHEME_HASH_BYTES
        } else {
            self.max_hash_bytes
        }
    }
}

/// Outcome of checking one `ReplicaStats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsCheck {
    /// Every value is in range.
    Valid,
    /// A fraction above 1 was clamped to 1.
    Clamped,
    /// A fraction is NaN or infinite: the stats are dropped.
    NotFinite,
    /// A value is negative: the stats are dropped.
    Negative,
}

impl StatsCheck {
    /// Metric label (`None` when nothing happened).
    pub fn label(self) -> Option<&'static str> {
        match self {
            Self::Valid => None,
            Self::Clamped => Some("clamped"),
            Self::NotFinite => Some("not_finite"),
            Self::Negative => Some("negative"),
        }
    }
}

/// Checks the fractions and counters of a stats report, clamping fractions above 1.
pub fn check_stats(stats: &mut inference_cache_proto::v1alpha1::ReplicaStats) -> StatsCheck {
    let fractions = [stats.hit_rate, stats.pressure, stats.kv_cache_usage];
    if fractions.iter().any(|f| !f.is_finite()) {
        return StatsCheck::NotFinite;
    }
    if fractions.iter().any(|f| *f < 0.0)
        || stats.cache_memory_bytes < 0
        || stats.t2_hit_tokens < 0
        || stats.t2_query_tokens < 0
    {
        return StatsCheck::Negative;
    }
    let mut clamped = false;
    for f in [
        &mut stats.hit_rate,
        &mut stats.pressure,
        &mut stats.kv_cache_usage,
    ] {
        if *f > 1.0 {
            *f = 1.0;
            clamped = true;
        }
    }
    if clamped {
        StatsCheck::Clamped
    } else {
        StatsCheck::Valid
    }
}

/// Applies the lookup limits to a request in place, counting what they hit:
/// a too-wide hash fails the lookup open (`false`); a too-long chain or
/// token list is cut to a prefix, which is still a valid lookup.
pub fn bound_lookup(
    limits: &Limits,
    metrics: &Metrics,
    request: &mut inference_cache_proto::v1alpha1::LookupRouteRequest,
) -> bool {
    let width = limits.hash_width(&request.hash_scheme);
    if request.prefix_hash.len() > width || request.block_hashes.iter().any(|h| h.len() > width) {
        metrics.record_limit("hash_bytes");
        return false;
    }
    let max = limits.max_chain_blocks;
    if request.block_hashes.len() > max
        && request.block_hashes.len() == request.block_token_counts.len()
    {
        request.block_hashes.truncate(max);
        request.block_token_counts.truncate(max);
        metrics.record_limit("chain_blocks");
    }
    if request.token_ids.len() > limits.max_token_ids {
        request.token_ids.truncate(limits.max_token_ids);
        metrics.record_limit("token_ids");
    }
    true
}

/// Applies the ingest limits to an update in place, counting what they drop:
/// entries with a too-wide hash or a too-long chain, and entries past the
/// per-update cap; stats with invalid values. Runs on the wire message,
/// before its entries' chains are checked (`grpc::cache_update`).
pub fn bound_update(
    limits: &Limits,
    metrics: &Metrics,
    update: &mut inference_cache_proto::v1alpha1::CacheStateUpdate,
) {
    let width = limits.hash_width(&update.hash_scheme);
    let mut budget = limits.max_update_entries;
    let mut over_budget = 0u64;
    update.prefixes.retain(|p| {
        if p.prefix_hash.len() > width || p.block_hashes.iter().any(|h| h.len() > width) {
            metrics.record_limit("hash_bytes");
            return false;
        }
        if p.block_hashes.len() > limits.max_chain_blocks
            || p.block_token_counts.len() > limits.max_chain_blocks
        {
            metrics.record_limit("chain_blocks");
            return false;
        }
        let entries = p.block_hashes.len().max(1);
        if entries > budget {
            over_budget += 1;
            budget = 0;
            return false;
        }
        budget -= entries;
        true
    });
    if over_budget > 0 {
        metrics.record_limit_n("update_entries", over_budget);
    }
    if let Some(stats) = update.stats.as_mut() {
        let check = check_stats(stats);
        if let Some(label) = check.label() {
            metrics.record_stats_rejected(label);
        }
        if matches!(check, StatsCheck::NotFinite | StatsCheck::Negative) {
            update.stats = None;
        }
    }
}

/// Bytes the server would template and tokenize for a lookup's text input,
/// by the input precedence: a chat (`messages_json`, else the `messages`
/// roles and contents) together with its `tools_json`, `documents_json` and
/// `chat_template_kwargs_json`; else `raw_prompt`; else `prompt_text`.
pub fn prompt_bytes(request: &inference_cache_proto::v1alpha1::LookupRouteRequest) -> usize {
    let chat_extras = [
        &request.tools_json,
        &request.documents_json,
        &request.chat_template_kwargs_json,
    ]
    .iter()
    .map(|s| s.len())
    .fold(0usize, usize::saturating_add);
    if !request.messages_json.is_empty() {
        request.messages_json.len().saturating_add(chat_extras)
    } else if !request.messages.is_empty() {
        request
            .messages
            .iter()
            .map(|m| m.content.len().saturating_add(m.role.len()))
            .fold(chat_extras, usize::saturating_add)
    } else if !request.raw_prompt.is_empty() {
        request.raw_prompt.len()
    } else {
        request.prompt_text.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_proto::v1alpha1::{
        CacheStateUpdate as CacheUpdate, PrefixEntry as PrefixReport,
        ReplicaStats as ReplicaStatsReport,
    };

    #[test]
    fn prompt_bytes_follow_the_input_precedence() {
        use inference_cache_proto::v1alpha1::{ChatMessage, LookupRouteRequest};
        let mut r = LookupRouteRequest {
            prompt_text: "x".repeat(10),
            ..Default::default()
        };
        assert_eq!(prompt_bytes(&r), 10);
        r.raw_prompt = "y".repeat(20);
        assert_eq!(prompt_bytes(&r), 20);
        r.tools_json = "t".repeat(5);
        r.messages.push(ChatMessage {
            role: "user".into(),
            content: "z".repeat(30),
        });
        assert_eq!(prompt_bytes(&r), 5 + 4 + 30);
        r.messages_json = "m".repeat(100);
        r.documents_json = "d".repeat(7);
        assert_eq!(prompt_bytes(&r), 100 + 5 + 7);
    }

    #[test]
    fn stats_fractions_are_checked() {
        let mut s = ReplicaStatsReport {
            hit_rate: f32::NAN,
            ..Default::default()
        };
        assert_eq!(check_stats(&mut s), StatsCheck::NotFinite);
        s.hit_rate = f32::INFINITY;
        assert_eq!(check_stats(&mut s), StatsCheck::NotFinite);
        s.hit_rate = -0.5;
        assert_eq!(check_stats(&mut s), StatsCheck::Negative);
        s.hit_rate = 0.5;
        s.kv_cache_usage = 3.0;
        assert_eq!(check_stats(&mut s), StatsCheck::Clamped);
        assert_eq!(s.kv_cache_usage, 1.0);
        assert_eq!(check_stats(&mut s), StatsCheck::Valid);
        s.cache_memory_bytes = -1;
        assert_eq!(check_stats(&mut s), StatsCheck::Negative);
    }

    #[test]
    fn update_bounds_drop_and_count() {
        let metrics = Metrics::new();
        let limits = Limits {
            max_chain_blocks: 4,
            max_update_entries: 6,
            ..Limits::default()
        };
        let entry = |width: usize, blocks: usize| PrefixReport {
            block_hashes: vec![vec![1; width]; blocks],
            block_token_counts: vec![16; blocks],
            ..Default::default()
        };
        let mut update = CacheUpdate {
            hash_scheme: "vllm".into(),
            prefixes: vec![
                entry(8, 3),
                entry(9, 1),
                entry(8, 5),
                entry(8, 3),
                entry(8, 2),
            ],
            stats: Some(ReplicaStatsReport {
                pressure: f32::NAN,
                ..Default::default()
            }),
            ..Default::default()
        };
        bound_update(&limits, &metrics, &mut update);
        let kept: Vec<usize> = update
            .prefixes
            .iter()
            .map(|p| p.block_hashes.len())
            .collect();
        assert_eq!(kept, vec![3, 3], "{kept:?}");
        assert!(update.stats.is_none());
        let text = metrics.render();
        for series in [
            "inferencecache_limit_hits_total{limit=\"hash_bytes\"} 1",
            "inferencecache_limit_hits_total{limit=\"chain_blocks\"} 1",
            "inferencecache_limit_hits_total{limit=\"update_entries\"} 1",
            "inferencecache_stats_rejected_total{reason=\"not_finite\"} 1",
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        // Another scheme may use wider hashes, up to --max-hash-bytes.
        let mut other = CacheUpdate {
            hash_scheme: "custom".into(),
            prefixes: vec![entry(32, 1), entry(65, 1)],
            ..Default::default()
        };
        bound_update(&limits, &metrics, &mut other);
        assert_eq!(other.prefixes.len(), 1);
    }
}
