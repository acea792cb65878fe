//! Engine load: scrape the engine's Prometheus page and turn it into
//! `ReplicaStats`.
//!
//! With `--engine-metrics-url` the subscriber fetches the page every
//! `--metrics-interval` (default 1s) over plain HTTP/1.1 and sends one
//! stats-only `ReportCacheState` update per good scrape. Mapping (the first
//! name present wins; vLLM exposes old and new names side by side during a
//! rename, so they are never added together):
//!
//! | `ReplicaStats` field | vLLM | SGLang |
//! |---|---|---|
//! | `requests_waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | `requests_running` | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | `kv_cache_usage` | `vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc` | `sglang:token_usage` |
//! | `hit_rate` | `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (older `vllm:gpu_prefix_cache_hits_total` / `_queries_total`): hits over queries between two scrapes; the v0 gauge `vllm:gpu_prefix_cache_hit_rate` when there are no counters | `sglang:cache_hit_rate` |
//! | `t2_hit_tokens` / `t2_query_tokens` | `vllm:external_prefix_cache_hits_total` / `vllm:external_prefix_cache_queries_total` (cumulative, as the engine counts them) | – |
//! | `pressure` | `max(kv_cache_usage, waiting / (waiting + running + 1))`, in `[0, 1]` | same |
//!
//! Label sets of one name (data-parallel engines: `engine="0"`, `"1"`, ...)
//! are combined: request counts and counters are summed, fractions
//! (`kv_cache_usage`, the hit-rate gauges) averaged. Counters are also read
//! without their `_total` suffix. A value that is NaN, infinite or negative
//! (or above 1 for a fraction) is rejected and counted
//! (`inferencecache_subscriber_engine_values_rejected_total{field=...}`);
//! the field falls back to the next name, else it is reported as 0.
//!
//! `hit_rate` between scrapes with no prefix-cache queries keeps its last
//! value; the first scrape uses the lifetime ratio; a counter that went
//! backwards (engine restart) counts from zero. A scrape that fails
//! (connect, HTTP status, timeout, a page with none of the load metrics) is
//! counted and logged at most once a minute, and sends nothing: the server
//! treats stats it has not heard about for a while as unknown.
//!
//! Every scrape also checks the engine's cache configuration
//! (`vllm:cache_config_info`) against `--block-size`: see [`crate::selfcheck`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::header;
use hyper_util::rt::TokioIo;
use inference_cache_proto::v1alpha1::ReplicaStats;
use tokio::sync::watch;

use crate::args::MetricsUrl;
use crate::exposition::{Sample, parse_exposition};
use crate::metrics::Metrics;

/// Largest metrics page read (bytes).
const MAX_PAGE_BYTES: usize = 16 * 1024 * 1024;
/// Minimum time between two warnings about failed scrapes.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// How one field's samples are validated and combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Combine {
    /// Non-negative, summed over label sets.
    Sum,
    /// In `[0, 1]`, averaged over label sets.
    Mean,
}

/// One field read from a page.
#[derive(Debug, Clone, Copy, PartialEq)]
struct FieldSpec {
    field: &'static str,
    names: &'static [&'static str],
    combine: Combine,
}

const WAITING: FieldSpec = FieldSpec {
    field: "requests_waiting",
    names: &["vllm:num_requests_waiting", "sglang:num_queue_reqs"],
    combine: Combine::Sum,
};
const RUNNING: FieldSpec = FieldSpec {
    field: "requests_running",
    names: &["vllm:num_requests_running", "sglang:num_running_reqs"],
    combine: Combine::Sum,
};
const KV_USAGE: FieldSpec = FieldSpec {
    field: "kv_cache_usage",
    names: &[
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ],
    combine: Combine::Mean,
};
const HIT_RATE_GAUGE: FieldSpec = FieldSpec {
    field: "hit_rate",
    names: &["vllm:gpu_prefix_cache_hit_rate", "sglang:cache_hit_rate"],
    combine: Combine::Mean,
};
/// (hits, queries) counter pairs, newest naming first.
const PREFIX_COUNTERS: &[(&str, &str)] = &[
    (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ),
    ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    (
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_queries_total",
    ),
    (
        "vllm:gpu_prefix_cache_hits",
        "vllm:gpu_prefix_cache_queries",
    ),
];
const T2_COUNTERS: &[(&str, &str)] = &[
    (
        "vllm:external_prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "vllm:external_prefix_cache_queries",
    ),
];

/// The load metrics one page holds, combined over label sets; `None` when
/// the page has no valid sample of a field.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineReading {
    /// Requests queued for prefill.
    pub requests_waiting: Option<f64>,
    /// Requests running.
    pub requests_running: Option<f64>,
    /// KV-cache usage fraction.
    pub kv_cache_usage: Option<f64>,
    /// Cumulative prefix-cache (hits, queries), in tokens.
    pub prefix_counters: Option<(f64, f64)>,
    /// A hit-rate gauge (vLLM v0, SGLang).
    pub hit_rate_gauge: Option<f64>,
    /// Cumulative external (tier-2) prefix-cache (hits, queries), in tokens.
    pub t2_counters: Option<(f64, f64)>,
    /// Rejected values per field (NaN, infinite, negative, fraction > 1).
    pub rejected: Vec<(&'static str, u32)>,
}

impl EngineReading {
    /// Reads the load metrics out of a parsed page.
    pub fn from_samples(samples: &[Sample]) -> Self {
        let mut by_name: HashMap<&str, Vec<f64>> = HashMap::new();
        for sample in samples {
            by_name
                .entry(sample.name.as_str())
                .or_default()
                .push(sample.value);
        }
        let mut reading = Self::default();
        reading.requests_waiting = reading.field(&by_name, &WAITING);
        reading.requests_running = reading.field(&by_name, &RUNNING);
        reading.kv_cache_usage = reading.field(&by_name, &KV_USAGE);
        reading.hit_rate_gauge = reading.field(&by_name, &HIT_RATE_GAUGE);
        reading.prefix_counters = reading.pair(&by_name, "hit_rate", PREFIX_COUNTERS);
        reading.t2_counters = reading.pair(&by_name, "t2_tokens", T2_COUNTERS);
        reading
    }

    /// Parses a page and reads it.
    pub fn from_text(text: &str) -> Self {
        Self::from_samples(&parse_exposition(text).samples)
    }

    /// Whether the page carries any load metric at all (else it is not an
    /// engine's page, or not yet).
    pub fn has_load(&self) -> bool {
        self.requests_waiting.is_some()
            || self.requests_running.is_some()
            || self.kv_cache_usage.is_some()
    }

    fn reject(&mut self, field: &'static str, count: u32) {
        if count == 0 {
            return;
        }
        match self.rejected.iter_mut().find(|(f, _)| *f == field) {
            Some((_, n)) => *n += count,
            None => self.rejected.push((field, count)),
        }
    }

    /// Combines the valid values of `name`; `None` when it has none.
    fn combine(
        &mut self,
        by_name: &HashMap<&str, Vec<f64>>,
        field: &'static str,
        name: &str,
        combine: Combine,
    ) -> Option<f64> {
        let values = by_name.get(name)?;
        let valid =
            |v: &&f64| v.is_finite() && **v >= 0.0 && (combine == Combine::Sum || **v <= 1.0);
        let good: Vec<f64> = values.iter().filter(valid).copied().collect();
        self.reject(field, (values.len() - good.len()) as u32);
        if good.is_empty() {
            return None;
        }
        let sum: f64 = good.iter().sum();
        Some(match combine {
            Combine::Sum => sum,
            Combine::Mean => sum / good.len() as f64,
        })
    }

    fn field(&mut self, by_name: &HashMap<&str, Vec<f64>>, spec: &FieldSpec) -> Option<f64> {
        spec.names
            .iter()
            .find_map(|name| self.combine(by_name, spec.field, name, spec.combine))
    }

    fn pair(
        &mut self,
        by_name: &HashMap<&str, Vec<f64>>,
        field: &'static str,
        names: &[(&str, &str)],
    ) -> Option<(f64, f64)> {
        names.iter().find_map(|(hits, queries)| {
            let hits = self.combine(by_name, field, hits, Combine::Sum);
            let queries = self.combine(by_name, field, queries, Combine::Sum);
            hits.zip(queries)
        })
    }
}

/// Engine load in `ReplicaStats` terms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests queued for prefill.
    pub requests_waiting: u32,
    /// Requests running.
    pub requests_running: u32,
    /// KV-cache usage fraction, `[0, 1]`.
    pub kv_cache_usage: f32,
    /// Prefix-cache hit rate, `[0, 1]`.
    pub hit_rate: f32,
    /// `max(kv_cache_usage, waiting / (waiting + running + 1))`, `[0, 1]`.
    pub pressure: f32,
    /// Cumulative tier-2 hit tokens.
    pub t2_hit_tokens: i64,
    /// Cumulative tier-2 query tokens.
    pub t2_query_tokens: i64,
}

impl EngineLoad {
    /// The stats message for `replica_id`.
    pub fn to_stats(&self, replica_id: &str) -> ReplicaStats {
        ReplicaStats {
            replica_id: replica_id.to_owned(),
            hit_rate: self.hit_rate,
            pressure: self.pressure,
            t2_hit_tokens: self.t2_hit_tokens,
            t2_query_tokens: self.t2_query_tokens,
            requests_waiting: self.requests_waiting,
            requests_running: self.requests_running,
            kv_cache_usage: self.kv_cache_usage,
            ..Default::default()
        }
    }
}

/// The 0..1 pressure of a replica: how full its KV cache is, or how much
/// of its work is queued, whichever is higher.
pub fn pressure(waiting: f64, running: f64, kv_cache_usage: f64) -> f64 {
    let queued = waiting / (waiting + running + 1.0);
    kv_cache_usage.max(queued).clamp(0.0, 1.0)
}

/// Turns successive readings into [`EngineLoad`]s (the hit rate needs the
/// previous scrape's counters).
#[derive(Debug, Clone, Default)]
pub struct LoadEstimator {
    previous: Option<(f64, f64)>,
    hit_rate: Option<f64>,
}

impl LoadEstimator {
    /// A fresh estimator (no previous scrape).
    pub fn new() -> Self {
        Self::default()
    }

    /// The load of one reading; `None` when it has no load metric.
    pub fn next(&mut self, reading: &EngineReading) -> Option<EngineLoad> {
        if !reading.has_load() {
            return None;
        }
        let waiting = reading.requests_waiting.unwrap_or(0.0);
        let running = reading.requests_running.unwrap_or(0.0);
        let kv = reading.kv_cache_usage.unwrap_or(0.0);
        if let Some((hits, queries)) = reading.prefix_counters {
            let (dh, dq) = match self.previous {
                Some((h0, q0)) if hits >= h0 && queries >= q0 => (hits - h0, queries - q0),
                // First scrape, or the engine restarted: counters from zero.
                _ => (hits, queries),
            };
            self.previous = Some((hits, queries));
            if dq > 0.0 {
                self.hit_rate = Some((dh / dq).clamp(0.0, 1.0));
            }
        } else {
            self.previous = None;
            if let Some(gauge) = reading.hit_rate_gauge {
                self.hit_rate = Some(gauge);
            }
        }
        let (t2_hits, t2_queries) = reading.t2_counters.unwrap_or((0.0, 0.0));
        Some(EngineLoad {
            requests_waiting: to_u32(waiting),
            requests_running: to_u32(running),
            kv_cache_usage: kv as f32,
            hit_rate: self.hit_rate.unwrap_or(0.0) as f32,
            pressure: pressure(waiting, running, kv) as f32,
            t2_hit_tokens: to_i64(t2_hits),
            t2_query_tokens: to_i64(t2_queries),
        })
    }
}

fn to_u32(value: f64) -> u32 {
    // Saturating float → int conversion; values are finite and non-negative.
    value.round() as u32
}

fn to_i64(value: f64) -> i64 {
    value.round() as i64
}

/// Stats from a good scrape, and when it was taken.
#[derive(Debug, Clone)]
pub(crate) struct Scraped {
    pub(crate) stats: ReplicaStats,
    pub(crate) at: Instant,
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ScrapeError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    #[error("bad request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("HTTP status {0}")]
    Status(hyper::StatusCode),
    #[error("reading the page: {0}")]
    Body(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("the page has none of the engine load metrics")]
    NoLoadMetrics,
}

/// Fetches the page once.
pub(crate) async fn fetch(url: &MetricsUrl) -> Result<String, ScrapeError> {
    let stream = tokio::net::TcpStream::connect((url.host.as_str(), url.port))
        .await
        .map_err(ScrapeError::Connect)?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let request = hyper::Request::get(url.path.as_str())
        .header(header::HOST, url.authority.as_str())
        // The classic text format: vLLM and SGLang serve it by default, and
        // asking for it keeps OpenMetrics negotiation out of the way.
        .header(header::ACCEPT, "text/plain;version=0.0.4;q=1,*/*;q=0.1")
        .header(header::USER_AGENT, "inference-cache-subscriber")
        .body(Empty::<Bytes>::new())?;
    let result = async {
        let response = sender.send_request(request).await?;
        if !response.status().is_success() {
            return Err(ScrapeError::Status(response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_PAGE_BYTES)
            .collect()
            .await
            .map_err(|e| ScrapeError::Body(e.to_string()))?
            .to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
    .await;
    drop(sender);
    driver.abort();
    result
}

/// Scrapes, parses and estimates once.
pub(crate) async fn scrape_once(
    url: &MetricsUrl,
    timeout: Duration,
    block_size: u32,
    estimator: &mut LoadEstimator,
    metrics: &Metrics,
) -> Result<EngineLoad, ScrapeError> {
    let page = tokio::time::timeout(timeout, fetch(url))
        .await
        .map_err(|_| ScrapeError::Timeout(timeout))??;
    let exposition = parse_exposition(&page);
    metrics
        .engine_lines_malformed
        .inc_by(exposition.malformed_lines as u64);
    metrics
        .config_check
        .check_page(&exposition.samples, block_size);
    let reading = EngineReading::from_samples(&exposition.samples);
    for (field, count) in &reading.rejected {
        metrics
            .engine_values_rejected
            .get_or_create(&[("field", field)])
            .inc_by(u64::from(*count));
        tracing::debug!(field, count, "rejected engine metric values");
    }
    estimator.next(&reading).ok_or(ScrapeError::NoLoadMetrics)
}

/// Scrapes `url` every `interval` until `shutdown` flips to true; publishes
/// each good scrape's stats on `tx`.
pub(crate) async fn run_scraper(
    url: MetricsUrl,
    interval: Duration,
    replica_id: String,
    block_size: u32,
    tx: watch::Sender<Option<Scraped>>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let timeout = interval.clamp(Duration::from_secs(1), Duration::from_secs(10));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut estimator = LoadEstimator::new();
    let mut failing_since: Option<Instant> = None;
    let mut last_warning: Option<Instant> = None;
    let mut suppressed = 0u64;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let scraped = tokio::select! {
            scraped = scrape_once(&url, timeout, block_size, &mut estimator, &metrics) => scraped,
            _ = shutdown.changed() => return,
        };
        match scraped {
            Ok(load) => {
                metrics.engine_scrapes_ok.inc();
                if failing_since.take().is_some() {
                    tracing::info!(%url, "engine metrics scrape recovered");
                }
                suppressed = 0;
                last_warning = None;
                tx.send_replace(Some(Scraped {
                    stats: load.to_stats(&replica_id),
                    at: Instant::now(),
                }));
            }
            Err(error) => {
                metrics.engine_scrapes_failed.inc();
                failing_since.get_or_insert_with(Instant::now);
                if last_warning.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                    tracing::warn!(
                        %url,
                        %error,
                        suppressed,
                        "engine metrics scrape failed; no load reported until it works"
                    );
                    last_warning = Some(Instant::now());
                    suppressed = 0;
                } else {
                    suppressed += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_is_the_higher_of_usage_and_queueing() {
        assert_eq!(pressure(0.0, 0.0, 0.0), 0.0);
        assert_eq!(pressure(0.0, 10.0, 0.3), 0.3);
        assert!((pressure(10.0, 5.0, 0.2) - 10.0 / 16.0).abs() < 1e-12);
        assert!(pressure(1e9, 0.0, 0.0) < 1.0);
        assert_eq!(pressure(0.0, 0.0, 1.0), 1.0);
    }

    #[test]
    fn hit_rate_from_counter_deltas() {
        let page = |h: f64, q: f64| {
            format!(
                "vllm:num_requests_waiting 0\nvllm:prefix_cache_hits_total {h}\nvllm:prefix_cache_queries_total {q}\n"
            )
        };
        let mut estimator = LoadEstimator::new();
        let first = estimator
            .next(&EngineReading::from_text(&page(30.0, 100.0)))
            .expect("load");
        assert!((first.hit_rate - 0.3).abs() < 1e-6, "lifetime ratio first");
        let second = estimator
            .next(&EngineReading::from_text(&page(120.0, 200.0)))
            .expect("load");
        assert!((second.hit_rate - 0.9).abs() < 1e-6, "90 of the last 100");
        let idle = estimator
            .next(&EngineReading::from_text(&page(120.0, 200.0)))
            .expect("load");
        assert_eq!(idle.hit_rate, second.hit_rate, "no queries: unchanged");
        let restarted = estimator
            .next(&EngineReading::from_text(&page(5.0, 10.0)))
            .expect("load");
        assert!(
            (restarted.hit_rate - 0.5).abs() < 1e-6,
            "reset counts from 0"
        );
    }

    #[test]
    fn bad_values_are_rejected_per_field() {
        let reading = EngineReading::from_text(
            "vllm:num_requests_waiting{engine=\"0\"} NaN\n\
             vllm:num_requests_waiting{engine=\"1\"} 4\n\
             vllm:num_requests_running -1\n\
             vllm:kv_cache_usage_perc 1.5\n\
             vllm:gpu_cache_usage_perc 0.25\n",
        );
        assert_eq!(reading.requests_waiting, Some(4.0));
        assert_eq!(reading.requests_running, None);
        assert_eq!(
            reading.kv_cache_usage,
            Some(0.25),
            "falls back to the old name"
        );
        let rejected: HashMap<_, _> = reading.rejected.iter().copied().collect();
        assert_eq!(rejected.get("requests_waiting"), Some(&1));
        assert_eq!(rejected.get("requests_running"), Some(&1));
        assert_eq!(rejected.get("kv_cache_usage"), Some(&1));
    }

    #[test]
    fn a_page_without_load_metrics_is_no_load() {
        let mut estimator = LoadEstimator::new();
        assert!(
            estimator
                .next(&EngineReading::from_text("process_cpu_seconds_total 3\n"))
                .is_none()
        );
    }
}
