//! Command-line flags of `inference-cache replay`, resolved once into
//! validated [`ReplaySettings`]. Every default lives in one constant, shared
//! by the flags and the library types.

use std::path::PathBuf;
use std::time::Duration;

use inference_cache_index::{PolicySet, parse_duration};

use crate::chat::{ChatConfig, DEFAULT_CHAT_REQUESTS};
use crate::error::ReplayError;
use crate::policy::Policy;
use crate::replica::ServingModel;
use crate::routed::ReportAt;
use crate::sim::{DEFAULT_PREFILL_TPS, DEFAULT_STATS_INTERVAL_MS, SimConfig};
use crate::synthetic::{
    DEFAULT_AGENT_SHARE, DEFAULT_RATE, DEFAULT_REQUESTS, DEFAULT_SESSIONS, DEFAULT_SYSTEM_PROMPTS,
    SyntheticConfig,
};
use crate::trace::DEFAULT_TRACE_BLOCK_SIZE;

/// Flags of `inference-cache replay`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Replay a request trace through routing policies over simulated replicas",
    long_about = "Replays a request trace (Mooncake JSONL, or a built-in synthetic generator) \
                  through several routing policies — this server's ranker, round-robin, random, \
                  least-loaded, a session hash and a pooled-cache oracle — over N simulated \
                  replicas with LRU prefix caches and a FIFO prefill model, and prints one table \
                  row per policy: hit rates, modelled TTFT and load per replica."
)]
pub struct ReplayArgs {
    /// Trace in Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present_any = ["synthetic", "chat_model"],
        conflicts_with_all = ["synthetic", "chat_model"]
    )]
    pub trace: Option<PathBuf>,

    /// Generate the trace instead (shared system prompts, multi-turn chats, agent loops).
    #[arg(long, conflicts_with = "chat_model")]
    pub synthetic: bool,

    /// Generate a chat workload instead and render every request with this
    /// model's tokenizer and chat template (a subdirectory of
    /// --tokenizer-models-dir): OpenAI chat requests, agent loops calling tools.
    #[arg(long, value_name = "MODEL", requires = "tokenizer_models_dir")]
    pub chat_model: Option<String>,

    /// Chat workload: directory with one subdirectory per model (as `serve`'s flag).
    #[arg(long, value_name = "DIR", env = "INFERENCE_CACHE_TOKENIZER_MODELS_DIR")]
    pub tokenizer_models_dir: Option<PathBuf>,

    /// Chat workload: write tool definitions, calls and results as plain text
    /// instead (the same conversations without tools, for comparison).
    #[arg(long, requires = "chat_model")]
    pub without_tools: bool,

    /// Tokens per block of the trace's `hash_ids`.
    #[arg(long, default_value_t = DEFAULT_TRACE_BLOCK_SIZE, value_name = "TOKENS")]
    pub trace_block_size: u32,

    /// Synthetic: requests to generate (default 4000; chat workload 1000). With --trace: replay only the first N.
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,

    /// Synthetic: sessions.
    #[arg(long, default_value_t = DEFAULT_SESSIONS, value_name = "N")]
    pub sessions: usize,

    /// Synthetic: shared system prompts.
    #[arg(long, default_value_t = DEFAULT_SYSTEM_PROMPTS, value_name = "N")]
    pub system_prompts: usize,

    /// Synthetic: share of sessions that are agent loops, 0 to 1.
    #[arg(long, default_value_t = DEFAULT_AGENT_SHARE, value_name = "SHARE")]
    pub agent_share: f64,

    /// Synthetic: mean arrival rate, requests per second.
    #[arg(long, default_value_t = DEFAULT_RATE, value_name = "RPS")]
    pub rate: f64,

    /// Seed of the synthetic generator and of the random policy.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Write the trace that was replayed (e.g. the synthetic one) as Mooncake JSONL.
    #[arg(long, value_name = "FILE")]
    pub dump_trace: Option<PathBuf>,

    /// Replicas to simulate.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub replicas: usize,

    /// LRU prefix-cache capacity of each replica, in blocks.
    #[arg(long, default_value_t = 4000, value_name = "BLOCKS")]
    pub capacity_blocks: usize,

    /// Prefill throughput of each replica, tokens per second (FIFO over uncached tokens).
    #[arg(long, default_value_t = DEFAULT_PREFILL_TPS, value_name = "TOKENS")]
    pub prefill_tps: f64,

    /// Decode time per output token (decode runs in parallel with prefill).
    #[arg(long, default_value = "20ms", value_parser = parse_duration)]
    pub tpot: Duration,

    /// Divide every arrival time by this (4 = arrivals four times faster).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,

    /// Simulated time between each replica's load reports to the index.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// How often each replica re-reports every block it holds, as the KV-event
    /// subscriber does (its `--refresh-interval`), keeping blocks an engine
    /// holds for longer than the server's eviction TTL in the index; `0s`
    /// never re-reports.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub refresh_interval: Duration,

    /// When the index learns of a replica's admissions and evictions: at
    /// routing time, or when the request's prefill completes (as engines report).
    #[arg(long, value_enum, default_value_t = ReportAt::Routing)]
    pub report_at: ReportAt,

    /// Rows to compare, comma-separated: inference-cache, inference-cache-contract,
    /// inference-cache-cost-aware, round-robin, random, least-loaded, session-hash,
    /// pooled-oracle (default: all; with --server all but the two ranker variants).
    #[arg(long, value_delimiter = ',', value_name = "POLICIES")]
    pub policies: Option<Vec<Policy>>,

    /// CachePolicy YAML stream for the inference-cache rows (tenant `replay`, or `"*"`).
    #[arg(long, value_name = "FILE")]
    pub policy_file: Option<PathBuf>,

    /// Route the inference-cache row through a running server over gRPC
    /// (e.g. http://127.0.0.1:9090) instead of an in-process index.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,

    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,

    /// Also draw hit rate and TTFT per policy into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// Where the requests come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A Mooncake JSONL file, optionally cut to its first `limit` requests.
    File {
        /// The file.
        path: PathBuf,
        /// Tokens per block.
        block_size: u32,
        /// Replay only this many requests.
        limit: Option<usize>,
    },
    /// The built-in generator.
    Synthetic(SyntheticConfig),
    /// The chat workload, rendered by a real tokenizer and chat template.
    Chat(ChatConfig),
}

/// Validated settings of one replay.
#[derive(Debug, Clone)]
pub struct ReplaySettings {
    /// Requests.
    pub source: Source,
    /// Fleet and serving model.
    pub sim: SimConfig,
    /// Rows, in order.
    pub policies: Vec<Policy>,
    /// Policies of the in-process index.
    pub policy_set: PolicySet,
    /// Server URL of the inference-cache row, if not in-process.
    pub server: Option<String>,
    /// JSON output.
    pub json: bool,
    /// SVG output file.
    pub plot: Option<PathBuf>,
    /// Where to write the replayed trace.
    pub dump_trace: Option<PathBuf>,
}

fn bad(flag: &'static str, reason: impl Into<String>) -> ReplayError {
    ReplayError::Setting {
        flag,
        reason: reason.into(),
    }
}

fn positive(flag: &'static str, value: f64) -> Result<f64, ReplayError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(bad(flag, format!("must be a positive number, got {value}")))
    }
}

impl ReplayArgs {
    /// Checks every flag and reads the policy file.
    pub fn resolve(self) -> Result<ReplaySettings, ReplayError> {
        if self.replicas == 0 {
            return Err(bad("replicas", "must be at least 1"));
        }
        if self.capacity_blocks == 0 {
            return Err(bad("capacity-blocks", "must be at least 1"));
        }
        if self.trace_block_size == 0 {
            return Err(bad("trace-block-size", "must be at least 1"));
        }
        let prefill_tps = positive("prefill-tps", self.prefill_tps)?;
        let speedup = positive("speedup", self.speedup)?;
        let stats_interval_ms =
            positive("stats-interval", self.stats_interval.as_secs_f64() * 1000.0)?;
        let source = match self.trace {
            Some(path) => Source::File {
                path,
                block_size: self.trace_block_size,
                limit: self.requests,
            },
            None => {
                if !(0.0..=1.0).contains(&self.agent_share) {
                    return Err(bad("agent-share", "must be between 0 and 1"));
                }
                if self.sessions == 0 {
                    return Err(bad("sessions", "must be at least 1"));
                }
                if let Some(model) = self.chat_model {
                    let tokenizers = self
                        .tokenizer_models_dir
                        .ok_or_else(|| bad("tokenizer-models-dir", "the chat workload needs it"))?;
                    Source::Chat(ChatConfig {
                        tokenizers,
                        model,
                        tools: !self.without_tools,
                        requests: self.requests.unwrap_or(DEFAULT_CHAT_REQUESTS),
                        sessions: self.sessions,
                        system_prompts: self.system_prompts.max(1),
                        agent_share: self.agent_share,
                        rate: positive("rate", self.rate)?,
                        block_size: self.trace_block_size,
                        seed: self.seed,
                    })
                } else {
                    Source::Synthetic(SyntheticConfig {
                        requests: self.requests.unwrap_or(DEFAULT_REQUESTS),
                        sessions: self.sessions,
                        system_prompts: self.system_prompts.max(1),
                        agent_share: self.agent_share,
                        rate: positive("rate", self.rate)?,
                        block_size: self.trace_block_size,
                        seed: self.seed,
                    })
                }
            }
        };
        let policies = self.policies.unwrap_or_else(|| {
            Policy::ALL
                .into_iter()
                .filter(|p| self.server.is_none() || p.ranker_override().is_none())
                .collect()
        });
        if policies.is_empty() {
            return Err(bad("policies", "names no policy"));
        }
        let mut seen = Vec::new();
        for p in &policies {
            if seen.contains(p) {
                return Err(bad("policies", format!("{} is listed twice", p.id())));
            }
            seen.push(*p);
        }
        if self.server.is_some() {
            if let Some(p) = policies.iter().find(|p| p.ranker_override().is_some()) {
                return Err(bad(
                    "policies",
                    format!(
                        "{} needs the in-process index (with --server the server's own policy \
                         decides the ranker)",
                        p.id()
                    ),
                ));
            }
            if self.policy_file.is_some() {
                return Err(bad(
                    "policy-file",
                    "applies to the in-process index only; with --server the server's own \
                     --policy-file decides",
                ));
            }
        }
        let policy_set = match &self.policy_file {
            None => PolicySet::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|error| ReplayError::Io {
                    path: path.clone(),
                    error,
                })?;
                PolicySet::from_yaml(&text).map_err(|error| ReplayError::Policy {
                    path: path.clone(),
                    error,
                })?
            }
        };
        Ok(ReplaySettings {
            source,
            sim: SimConfig {
                replicas: self.replicas,
                capacity_blocks: self.capacity_blocks,
                model: ServingModel {
                    prefill_tps,
                    tpot_ms: self.tpot.as_secs_f64() * 1000.0,
                },
                speedup,
                stats_interval_ms,
                seed: self.seed,
                report_at: self.report_at,
                refresh_interval_ms: (!self.refresh_interval.is_zero())
                    .then_some(self.refresh_interval.as_secs_f64() * 1000.0),
            },
            policies,
            policy_set,
            server: self.server,
            json: self.json,
            plot: self.plot,
            dump_trace: self.dump_trace,
        })
    }
}

// The flag defaults above must agree with the library's.
const _: () = assert!(
    DEFAULT_STATS_INTERVAL_MS == 500.0
        && crate::sim::DEFAULT_TPOT_MS == 20.0
        && crate::sim::DEFAULT_REFRESH_INTERVAL_MS == 600_000.0
);
