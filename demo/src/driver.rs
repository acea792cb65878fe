//! Sends the workload through one gateway at its arrival times (open loop:
//! a slow engine does not slow the arrivals) and records, per request, the
//! latency the client sees (its time to first token: engines answer when
//! the prefill ends), the prompt and cached tokens the engine reports in
//! `usage`, the routing outcome and the engine that served it.
//!
//! Concurrency: one task per request; the shared [`RunStats`] sits behind a
//! mutex the live progress and the page read.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;
use serde_json::Value;

use crate::gateway::{InProcessGateway, post_json};
use crate::workload::DemoRequest;

/// Where the driver sends requests.
#[derive(Debug, Clone)]
pub enum Target {
    /// Routed in-process (filter logic or round-robin), sent straight to the engine.
    InProcess(Arc<InProcessGateway>),
    /// An HTTP gateway (Envoy) listening here; the outcome is its reason
    /// header, or the given label when it sends none (no filter).
    Gateway(SocketAddr, &'static str),
}

/// Counters of one run, updated as responses arrive.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Run name ("inference-cache", "round-robin").
    pub name: String,
    /// Requests in the workload.
    pub total: usize,
    /// Requests answered 200.
    pub done: usize,
    /// Requests that failed (transport error or non-200).
    pub failed: usize,
    /// Prompt tokens of the answered requests.
    pub prompt_tokens: u64,
    /// Of which the serving engine had cached.
    pub cached_tokens: u64,
    /// Client-measured time to first token of each answered request, ms.
    pub ttft_ms: Vec<f64>,
    /// Routing outcomes by reason code.
    pub outcomes: BTreeMap<String, u64>,
    /// Requests per engine.
    pub per_engine: BTreeMap<String, u64>,
}

/// The numbers shown for a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// Run name.
    pub name: String,
    /// Requests in the workload.
    pub total: usize,
    /// Answered.
    pub done: usize,
    /// Failed.
    pub failed: usize,
    /// Cached over prompt tokens, in [0, 1].
    pub hit_rate: f64,
    /// TTFT median, ms.
    pub ttft_p50_ms: f64,
    /// TTFT 99th percentile, ms.
    pub ttft_p99_ms: f64,
    /// TTFT mean, ms.
    pub ttft_mean_ms: f64,
    /// Routing outcomes by reason code.
    pub outcomes: BTreeMap<String, u64>,
    /// Requests per engine.
    pub per_engine: BTreeMap<String, u64>,
}

impl RunStats {
    /// A run of `total` requests, nothing answered yet.
    pub fn new(name: &str, total: usize) -> Self {
        Self {
            name: name.to_owned(),
            total,
            ..Self::default()
        }
    }

    /// The summary of what has been answered so far.
    pub fn summary(&self) -> RunSummary {
        let mut sorted = self.ttft_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let mean = if sorted.is_empty() {
            0.0
        } else {
            sorted.iter().sum::<f64>() / sorted.len() as f64
        };
        RunSummary {
            name: self.name.clone(),
            total: self.total,
            done: self.done,
            failed: self.failed,
            hit_rate: if self.prompt_tokens == 0 {
                0.0
            } else {
                self.cached_tokens as f64 / self.prompt_tokens as f64
            },
            ttft_p50_ms: percentile(&sorted, 0.50),
            ttft_p99_ms: percentile(&sorted, 0.99),
            ttft_mean_ms: mean,
            outcomes: self.outcomes.clone(),
            per_engine: self.per_engine.clone(),
        }
    }
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Sends every request at its time through `target`; returns when all are answered.
pub async fn drive(requests: Arc<Vec<DemoRequest>>, target: Target, stats: Arc<Mutex<RunStats>>) {
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..requests.len() {
        tokio::time::sleep_until(start + requests[index].at).await;
        let (requests, target, stats) = (requests.clone(), target.clone(), stats.clone());
        tasks.spawn(async move {
            let request = &requests[index];
            let sent = Instant::now();
            let result = send(&target, request.body()).await;
            let elapsed_ms = sent.elapsed().as_secs_f64() * 1000.0;
            record(&stats, result, elapsed_ms);
        });
    }
    while tasks.join_next().await.is_some() {}
}

struct Answer {
    status: u16,
    outcome: Option<String>,
    engine: Option<String>,
    body: bytes::Bytes,
}

async fn send(target: &Target, body: String) -> anyhow::Result<Answer> {
    const PATH: &str = "/v1/completions";
    match target {
        Target::InProcess(gateway) => {
            let route = gateway.route(PATH, body.as_bytes()).await;
            let response = post_json(route.engine, PATH, body).await?;
            Ok(Answer {
                status: response.status,
                outcome: Some(route.outcome),
                engine: Some(route.engine.to_string()),
                body: response.body,
            })
        }
        Target::Gateway(addr, unlabelled) => {
            let response = post_json(*addr, PATH, body).await?;
            Ok(Answer {
                status: response.status,
                outcome: Some(response.reason.unwrap_or_else(|| (*unlabelled).to_owned())),
                engine: response.served_by,
                body: response.body,
            })
        }
    }
}

fn record(stats: &Mutex<RunStats>, result: anyhow::Result<Answer>, elapsed_ms: f64) {
    let mut stats = stats.lock();
    let answer = match result {
        Ok(answer) if answer.status == 200 => answer,
        Ok(answer) => {
            tracing::debug!(status = answer.status, "demo request failed");
            stats.failed += 1;
            return;
        }
        Err(error) => {
            tracing::debug!(%error, "demo request failed");
            stats.failed += 1;
            return;
        }
    };
    let usage: Option<(u64, u64)> =
        serde_json::from_slice::<Value>(&answer.body)
            .ok()
            .and_then(|body| {
                let usage = body.get("usage")?;
                let prompt = usage.get("prompt_tokens")?.as_u64()?;
                let cached = usage
                    .pointer("/prompt_tokens_details/cached_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                Some((prompt, cached))
            });
    let Some((prompt, cached)) = usage else {
        stats.failed += 1;
        return;
    };
    stats.done += 1;
    stats.prompt_tokens += prompt;
    stats.cached_tokens += cached;
    stats.ttft_ms.push(elapsed_ms);
    *stats
        .outcomes
        .entry(answer.outcome.unwrap_or_else(|| "UNKNOWN".to_owned()))
        .or_default() += 1;
    *stats
        .per_engine
        .entry(answer.engine.unwrap_or_else(|| "unknown".to_owned()))
        .or_default() += 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), 50.0);
        assert_eq!(percentile(&values, 0.99), 99.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn summary_hit_rate_is_cached_over_prompt_tokens() {
        let mut stats = RunStats::new("x", 3);
        stats.prompt_tokens = 400;
        stats.cached_tokens = 100;
        stats.ttft_ms = vec![30.0, 10.0, 20.0];
        let summary = stats.summary();
        assert_eq!(summary.hit_rate, 0.25);
        assert_eq!(summary.ttft_p50_ms, 20.0);
        assert_eq!(summary.ttft_p99_ms, 30.0);
        assert_eq!(summary.ttft_mean_ms, 20.0);
    }
}
