//! The replay loop: requests in arrival order through one policy over N
//! simulated replicas, and the figures of one table row.
//!
//! Per request at simulated time `t = timestamp / speedup`: every replica is
//! advanced to `t` (stats intervals that fell before `t` are reported first,
//! each at its own instant); the router picks a replica; that replica's LRU
//! counts the leading hits and admits the prompt's blocks (the pooled oracle
//! uses one shared LRU instead); the uncached tokens join the replica's FIFO
//! prefill queue, which gives the TTFT; the router is told what the replica
//! stored and evicted. Cost: O(replicas + blocks) per request plus the
//! router's own work; no allocation per request on the baselines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use inference_cache_index::PolicySet;
use serde::Serialize;

use crate::error::ReplayError;
use crate::inprocess::InProcess;
use crate::lru::BlockLru;
use crate::policy::{
    LeastLoaded, Policy, RandomRouter, RoundRobin, RouteContext, Router, SessionHash,
};
use crate::replica::{Replica, Served, ServingModel};
use crate::report::HintAccuracy;
use crate::routed::{IndexRouter, ReportAt};
use crate::trace::{Request, Trace};

/// Default prefill throughput per replica, tokens per second.
pub const DEFAULT_PREFILL_TPS: f64 = 20_000.0;
/// Default decode time per output token, milliseconds.
pub const DEFAULT_TPOT_MS: f64 = 20.0;
/// Default interval between load reports, milliseconds of simulated time.
pub const DEFAULT_STATS_INTERVAL_MS: f64 = 500.0;
/// Default interval between re-reports of every held block, milliseconds of
/// simulated time: the subscriber's own default `--refresh-interval` (10 min).
pub const DEFAULT_REFRESH_INTERVAL_MS: f64 = 600_000.0;

/// Validated simulation parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Replicas in the fleet (at least 1).
    pub replicas: usize,
    /// LRU capacity of each replica, in blocks.
    pub capacity_blocks: usize,
    /// Serving-time model.
    pub model: ServingModel,
    /// Arrival times are divided by this (> 0).
    pub speedup: f64,
    /// Simulated milliseconds between load reports (> 0).
    pub stats_interval_ms: f64,
    /// Seed of the random policy.
    pub seed: u64,
    /// When admissions and evictions reach the index.
    pub report_at: ReportAt,
    /// Simulated milliseconds between the subscriber's re-reports of every
    /// block a replica holds (`None`: never).
    pub refresh_interval_ms: Option<f64>,
}

impl SimConfig {
    /// `replicas` × `capacity_blocks` with every other parameter at its default.
    pub fn new(replicas: usize, capacity_blocks: usize) -> Self {
        Self {
            replicas,
            capacity_blocks,
            model: ServingModel {
                prefill_tps: DEFAULT_PREFILL_TPS,
                tpot_ms: DEFAULT_TPOT_MS,
            },
            speedup: 1.0,
            stats_interval_ms: DEFAULT_STATS_INTERVAL_MS,
            seed: 1,
            report_at: ReportAt::Routing,
            refresh_interval_ms: Some(DEFAULT_REFRESH_INTERVAL_MS),
        }
    }
}

/// TTFT distribution of a row, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TtftSummary {
    /// Mean.
    pub mean: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl TtftSummary {
    /// Summarizes `values` (sorted in place).
    pub fn from_values(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            let i = (p * values.len() as f64).ceil() as usize;
            values[i.clamp(1, values.len()) - 1]
        };
        Self {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: rank(0.50),
            p99: rank(0.99),
            max: values[values.len() - 1],
        }
    }
}

/// Count per replica and its max / mean.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Spread {
    /// One value per replica.
    pub per_replica: Vec<u64>,
    /// Largest value.
    pub max: u64,
    /// Mean over replicas.
    pub mean: f64,
    /// `max / mean` (1 is perfectly even; 0 when everything is 0).
    pub max_over_mean: f64,
}

impl Spread {
    /// The spread of `per_replica`.
    pub fn new(per_replica: Vec<u64>) -> Self {
        let max = per_replica.iter().copied().max().unwrap_or(0);
        let mean = if per_replica.is_empty() {
            0.0
        } else {
            per_replica.iter().sum::<u64>() as f64 / per_replica.len() as f64
        };
        let max_over_mean = if mean > 0.0 { max as f64 / mean } else { 0.0 };
        Self {
            per_replica,
            max,
            mean,
            max_over_mean,
        }
    }
}

/// One reason code's count and share of the requests.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReasonShare {
    /// Wire reason code.
    pub code: String,
    /// Lookups that answered it.
    pub count: u64,
    /// `count / requests`.
    pub share: f64,
}

/// One row of the comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyResult {
    /// Policy id (`--policies` name).
    pub policy: &'static str,
    /// Row label.
    pub label: &'static str,
    /// Requests replayed.
    pub requests: u64,
    /// Prompt blocks found in the serving cache (leading runs).
    pub hit_blocks: u64,
    /// Prompt blocks.
    pub blocks: u64,
    /// Prompt tokens in those hit blocks.
    pub hit_tokens: u64,
    /// Prompt tokens.
    pub tokens: u64,
    /// `hit_blocks / blocks`.
    pub block_hit_rate: f64,
    /// `hit_tokens / tokens`.
    pub token_hit_rate: f64,
    /// Block hit rate over the pooled oracle's, when the oracle ran.
    pub oracle_ratio: Option<f64>,
    /// Modelled TTFT, milliseconds.
    pub ttft_ms: TtftSummary,
    /// Requests per replica.
    pub requests_per_replica: Spread,
    /// Uncached (prefilled) tokens per replica.
    pub prefill_tokens_per_replica: Spread,
    /// Blocks held in each replica's cache at the end (the pooled oracle's
    /// shared cache counts as one).
    pub cached_blocks: Vec<u64>,
    /// Reason codes, for the rows that ask the index.
    pub reasons: Option<Vec<ReasonShare>>,
    /// Predicted reuse (the hint's `matched_tokens`) against the reuse the
    /// serving replica's cache gave, for the rows that ask the index.
    pub hint_accuracy: Option<HintAccuracy>,
    /// Wall-clock seconds the row took to replay.
    pub wall_seconds: f64,
}

/// Replays `trace` through `policy` with the in-process index (for the
/// inference-cache rows, under `policies` with the row's ranker forced).
pub fn simulate(
    trace: &Trace,
    policy: Policy,
    config: &SimConfig,
    policies: &PolicySet,
    progress: Option<&AtomicU64>,
) -> Result<PolicyResult, ReplayError> {
    if policy.uses_index() {
        let backend = InProcess::new(policies_for(policy, policies));
        let mut router = IndexRouter::new(backend, config);
        return simulate_with(trace, policy, config, &mut router, progress);
    }
    match policy {
        Policy::RoundRobin => {
            simulate_with(trace, policy, config, &mut RoundRobin::default(), progress)
        }
        Policy::Random => simulate_with(
            trace,
            policy,
            config,
            &mut RandomRouter::new(config.seed),
            progress,
        ),
        Policy::SessionHash => simulate_with(trace, policy, config, &mut SessionHash, progress),
        _ => simulate_with(trace, policy, config, &mut LeastLoaded::default(), progress),
    }
}

/// The policy set a row runs under: `base`, with the row's ranker forced on
/// the replay tenant's policy.
pub fn policies_for(policy: Policy, base: &PolicySet) -> PolicySet {
    let mut set = base.clone();
    if let Some(ranker) = policy.ranker_override() {
        let mut tenant = set.for_tenant(crate::routed::TENANT).clone();
        tenant.ranker = ranker;
        set.insert(crate::routed::TENANT, tenant);
    }
    set
}

/// Replays `trace` through `router`; `policy` names the row (the pooled
/// oracle's hits come from one shared LRU whatever `router` picks).
pub fn simulate_with(
    trace: &Trace,
    policy: Policy,
    config: &SimConfig,
    router: &mut dyn Router,
    progress: Option<&AtomicU64>,
) -> Result<PolicyResult, ReplayError> {
    let started = Instant::now();
    let mut run = Run::new(trace, config, policy);
    router.start(&run.replicas)?;
    for (i, request) in trace.requests.iter().enumerate() {
        let now_ms = request.arrival_ms as f64 / config.speedup;
        run.advance(now_ms, router)?;
        let target = router.route(&run.context(now_ms), request)?;
        if target >= run.replicas.len() {
            return Err(ReplayError::Setting {
                flag: "policies",
                reason: format!("{policy} routed to replica {target} of {}", config.replicas),
            });
        }
        let hit = run.serve(now_ms, target, request);
        if let Some(predicted) = router.predicted_tokens() {
            run.accuracy.add(predicted, hit);
        }
        router.admitted(
            &run.context(now_ms),
            target,
            request,
            &run.stored,
            &run.evicted,
        )?;
        if let Some(progress) = progress
            && i % 64 == 63
        {
            progress.fetch_add(64, Ordering::Relaxed);
        }
    }
    router.finish()?;
    if let Some(progress) = progress {
        progress.fetch_add(trace.requests.len() as u64 % 64, Ordering::Relaxed);
    }
    Ok(run.into_result(policy, router.reasons(), started))
}

/// The state of one row's replay.
struct Run<'a> {
    trace: &'a Trace,
    config: &'a SimConfig,
    replicas: Vec<Replica>,
    /// The pooled oracle's shared cache.
    pooled: Option<BlockLru>,
    ttfts: Vec<f64>,
    hit_blocks: u64,
    hit_tokens: u64,
    tokens: u64,
    /// Net blocks stored and evicted by the last request.
    stored: Vec<u64>,
    evicted: Vec<u64>,
    next_stats_ms: f64,
    accuracy: HintAccuracy,
}

impl<'a> Run<'a> {
    fn new(trace: &'a Trace, config: &'a SimConfig, policy: Policy) -> Self {
        Self {
            trace,
            config,
            replicas: (0..config.replicas)
                .map(|_| Replica::new(config.capacity_blocks))
                .collect(),
            pooled: (policy == Policy::PooledOracle)
                .then(|| BlockLru::new(config.capacity_blocks.saturating_mul(config.replicas))),
            ttfts: Vec::with_capacity(trace.requests.len()),
            hit_blocks: 0,
            hit_tokens: 0,
            tokens: 0,
            stored: Vec::new(),
            evicted: Vec::new(),
            next_stats_ms: config.stats_interval_ms,
            accuracy: HintAccuracy::default(),
        }
    }

    /// Reports the stats intervals that end by `now_ms`, each at its own
    /// instant, then brings every replica to `now_ms`.
    fn advance(&mut self, now_ms: f64, router: &mut dyn Router) -> Result<(), ReplayError> {
        while self.next_stats_ms <= now_ms {
            let at = self.next_stats_ms;
            self.replicas.iter_mut().for_each(|r| r.advance(at));
            router.report_stats(at, &self.replicas)?;
            self.next_stats_ms += self.config.stats_interval_ms;
        }
        self.replicas.iter_mut().for_each(|r| r.advance(now_ms));
        Ok(())
    }

    fn context(&self, now_ms: f64) -> RouteContext<'_> {
        RouteContext {
            now_ms,
            replicas: &self.replicas,
            model: &self.config.model,
            block_size: self.trace.block_size,
        }
    }

    /// `target` serves `request`: hits, admission, FIFO prefill, counters.
    /// Returns the prompt tokens its cache held.
    fn serve(&mut self, now_ms: f64, target: usize, request: &Request) -> u64 {
        self.stored.clear();
        self.evicted.clear();
        let cache = match self.pooled.as_mut() {
            Some(pooled) => pooled,
            None => &mut self.replicas[target].cache,
        };
        let hits = cache.admit(&request.blocks, &mut self.stored, &mut self.evicted);
        let hit = self.trace.leading_tokens(request, hits);
        self.hit_blocks += hits as u64;
        self.hit_tokens += hit;
        self.tokens += u64::from(request.input_tokens);
        let served = Served {
            prompt_tokens: u64::from(request.input_tokens),
            uncached_tokens: u64::from(request.input_tokens) - hit,
            output_tokens: request.output_tokens,
            blocks: request.blocks.len() as u64,
        };
        let ttft = self.replicas[target].serve(now_ms, served, &self.config.model);
        self.ttfts.push(ttft);
        hit
    }

    fn into_result(
        mut self,
        policy: Policy,
        reasons: Option<Vec<(String, u64)>>,
        started: Instant,
    ) -> PolicyResult {
        let requests = self.trace.requests.len() as u64;
        let blocks = self.trace.total_blocks();
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let reasons = reasons.map(|counts| {
            counts
                .into_iter()
                .map(|(code, count)| ReasonShare {
                    share: ratio(count, requests),
                    code,
                    count,
                })
                .collect()
        });
        let per_replica = |f: fn(&Replica) -> u64| self.replicas.iter().map(f).collect();
        PolicyResult {
            policy: policy.id(),
            label: policy.label(),
            requests,
            hit_blocks: self.hit_blocks,
            blocks,
            hit_tokens: self.hit_tokens,
            tokens: self.tokens,
            block_hit_rate: ratio(self.hit_blocks, blocks),
            token_hit_rate: ratio(self.hit_tokens, self.tokens),
            oracle_ratio: None,
            ttft_ms: TtftSummary::from_values(&mut self.ttfts),
            requests_per_replica: Spread::new(per_replica(|r| r.requests)),
            prefill_tokens_per_replica: Spread::new(per_replica(|r| r.prefill_tokens)),
            cached_blocks: match &self.pooled {
                Some(cache) => vec![cache.len() as u64],
                None => per_replica(|r| r.cache.len() as u64),
            },
            reasons,
            hint_accuracy: (self.accuracy.outcomes > 0).then(|| self.accuracy.finished()),
            wall_seconds: started.elapsed().as_secs_f64(),
        }
    }
}

/// Fills every row's `oracle_ratio` from the pooled-oracle row, if present.
pub fn fill_oracle_ratios(results: &mut [PolicyResult]) {
    let Some(oracle) = results
        .iter()
        .find(|r| r.policy == Policy::PooledOracle.id())
        .map(|r| r.block_hit_rate)
    else {
        return;
    };
    for r in results {
        r.oracle_ratio = (oracle > 0.0).then(|| r.block_hit_rate / oracle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttft_summary_uses_nearest_rank() {
        let mut values: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = TtftSummary::from_values(&mut values);
        assert_eq!((s.mean, s.p50, s.p99, s.max), (50.5, 50.0, 99.0, 100.0));
        assert_eq!(TtftSummary::from_values(&mut []), TtftSummary::default());
    }

    #[test]
    fn spread_reports_max_over_mean() {
        let s = Spread::new(vec![2, 6, 4]);
        assert_eq!((s.max, s.mean, s.max_over_mean), (6, 4.0, 1.5));
        assert_eq!(Spread::new(vec![0, 0]).max_over_mean, 0.0);
    }
}
