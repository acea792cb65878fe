//! Prometheus metrics of the server, exposed as text on the admin `/metrics`.
//!
//! One [`Metrics`] value owns the registry; handlers hold an `Arc` and record
//! into lock-free counters and histograms. It also owns the hint-accuracy
//! [`OutcomeBook`] (`ReportOutcomes`), which `/metrics`, `/snapshot/accuracy`
//! and `GetCacheState` read.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::outcomes::{OutcomeBook, OutcomeSettings};

/// Label set carrying a LookupRoute reason code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason code of the response.
    pub reason_code: String,
}

/// Label set of a LookupRoute answer: its reason code and what decided it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabel {
    /// The reason code of the response.
    pub reason_code: String,
    /// What decided it (`inference_cache_index::Decision`, snake_case).
    pub decision: &'static str,
}

/// Label set naming an RPC.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabel {
    /// gRPC method name.
    pub rpc: String,
}

/// Label set naming a request limit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    /// Which limit (`hash_bytes`, `prompt_bytes`, ...).
    pub limit: String,
}

/// Label set of a dropped or adjusted `ReplicaStats`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatsLabel {
    /// `not_finite`, `negative` or `clamped`.
    pub reason: String,
}

/// Label set of a refused call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthLabel {
    /// gRPC method name.
    pub rpc: String,
    /// Why it was refused.
    pub reason: String,
}

/// Label set of a canary run.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `pass` or `fail`.
    pub result: String,
}

/// All server metrics and the registry that renders them.
pub struct Metrics {
    registry: Registry,
    /// `inferencecache_lookup_route_calls_total{reason_code}`.
    pub lookup_calls: Family<ReasonLabel, Counter>,
    /// `inferencecache_lookup_decisions_total{reason_code,decision}`.
    pub lookup_decisions: Family<DecisionLabel, Counter>,
    /// `inferencecache_lookup_route_latency_seconds`, 10 µs to ~160 ms.
    pub lookup_latency: Histogram,
    /// `inferencecache_rpc_calls_total{rpc}` for the non-lookup RPCs.
    pub rpc_calls: Family<RpcLabel, Counter>,
    /// `inferencecache_server_up`: 1 while serving.
    pub server_up: Gauge,
    /// `inferencecache_limit_hits_total{limit}`: requests or entries a limit cut or refused.
    pub limit_hits: Family<LimitLabel, Counter>,
    /// `inferencecache_stats_rejected_total{reason}`: ReplicaStats dropped or clamped.
    pub stats_rejected: Family<StatsLabel, Counter>,
    /// `inferencecache_auth_refused_total{rpc,reason}`: calls refused by authentication or authorization.
    pub auth_refused: Family<AuthLabel, Counter>,
    /// `inferencecache_shutdown_streams_cut_total`: calls still open when the drain deadline passed.
    pub streams_cut: Counter,
    /// Hint accuracy per (tenant, model, replica, mode), from `ReportOutcomes`.
    pub outcomes: OutcomeBook,
    /// `inferencecache_canary_checks_total{result}`: canary runs by result.
    pub canary_checks: Family<ResultLabel, Counter>,
    /// `inferencecache_canary_ok`: 1 when the last canary run agreed, 0 when
    /// it did not, -1 before the first run.
    pub canary_ok: Gauge,
    /// The last canary run's disagreements, for `/readyz`.
    canary_failure: parking_lot::Mutex<Option<String>>,
}

impl Metrics {
    /// Creates the registry with every metric registered.
    pub fn new() -> Self {
        Self::with_outcomes(OutcomeSettings::default())
    }

    /// Like [`Metrics::new`], with the given bounds of the outcome aggregation.
    pub fn with_outcomes(outcome_settings: OutcomeSettings) -> Self {
        let mut registry = Registry::with_prefix("inferencecache");
        let lookup_calls = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "lookup_route_calls",
            "LookupRoute calls by reason code",
            lookup_calls.clone(),
        );
        let lookup_decisions = Family::<DecisionLabel, Counter>::default();
        registry.register(
            "lookup_decisions",
            "LookupRoute answers by reason code and the factor that decided them (match_depth, load, shared_head, below_floor, no_match, tenant_hot, prefix_gate, diagnostic, timeout, not_consulted)",
            lookup_decisions.clone(),
        );
        let lookup_latency = Histogram::new(exponential_buckets(0.000_01, 2.0, 15));
        registry.register(
            "lookup_route_latency_seconds",
            "LookupRoute handler latency",
            lookup_latency.clone(),
        );
        let rpc_calls = Family::<RpcLabel, Counter>::default();
        registry.register(
            "rpc_calls",
            "Calls of RPCs other than LookupRoute",
            rpc_calls.clone(),
        );
        let server_up = Gauge::default();
        registry.register(
            "server_up",
            "1 while the server is serving",
            server_up.clone(),
        );
        let limit_hits = Family::<LimitLabel, Counter>::default();
        registry.register(
            "limit_hits",
            "Requests or entries cut or refused by a request limit, by limit",
            limit_hits.clone(),
        );
        for limit in crate::limits::LIMIT_LABELS {
            let _ = limit_hits.get_or_create(&LimitLabel {
                limit: limit.to_owned(),
            });
        }
        let stats_rejected = Family::<StatsLabel, Counter>::default();
        registry.register(
            "stats_rejected",
            "ReplicaStats dropped (not_finite, negative) or clamped to 1 (clamped) at ingest",
            stats_rejected.clone(),
        );
        for reason in crate::limits::STATS_REASONS {
            let _ = stats_rejected.get_or_create(&StatsLabel {
                reason: reason.to_owned(),
            });
        }
        let auth_refused = Family::<AuthLabel, Counter>::default();
        registry.register(
            "auth_refused",
            "Calls refused by producer authentication or tenant scoping, by RPC and reason",
            auth_refused.clone(),
        );
        let streams_cut = Counter::default();
        registry.register(
            "shutdown_streams_cut",
            "Calls still open when the shutdown drain deadline passed, ended by the server",
            streams_cut.clone(),
        );
        for limit in ["outcome_series", "outcome_id_bytes", "outcome_batch"] {
            let _ = limit_hits.get_or_create(&LimitLabel {
                limit: limit.to_owned(),
            });
        }
        let outcomes = OutcomeBook::new(outcome_settings, &mut registry);
        let canary_checks = Family::<ResultLabel, Counter>::default();
        registry.register(
            "canary_checks",
            "Canary runs (tokenizer, fingerprint and index agree on a known prompt) by result",
            canary_checks.clone(),
        );
        for result in ["pass", "fail"] {
            let _ = canary_checks.get_or_create(&ResultLabel {
                result: result.to_owned(),
            });
        }
        let canary_ok = Gauge::default();
        canary_ok.set(-1);
        registry.register(
            "canary_ok",
            "1 when the last canary run agreed, 0 when it did not, -1 before the first run",
            canary_ok.clone(),
        );
        Self {
            registry,
            lookup_calls,
            lookup_decisions,
            lookup_latency,
            rpc_calls,
            server_up,
            limit_hits,
            stats_rejected,
            auth_refused,
            streams_cut,
            outcomes,
            canary_checks,
            canary_ok,
            canary_failure: parking_lot::Mutex::new(None),
        }
    }

    /// Records one canary run.
    pub fn record_canary(&self, report: &crate::canary::CanaryReport) {
        let result = if report.passed() { "pass" } else { "fail" };
        self.canary_checks
            .get_or_create(&ResultLabel {
                result: result.to_owned(),
            })
            .inc();
        self.canary_ok.set(i64::from(report.passed()));
        *self.canary_failure.lock() = (!report.passed()).then(|| report.failures.join("; "));
    }

    /// The last canary run's disagreements, if it had any.
    pub fn canary_failure(&self) -> Option<String> {
        self.canary_failure.lock().clone()
    }

    /// Mutable access to the registry, for components registering their own metrics at start-up.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Counts one LookupRoute answer.
    pub fn record_lookup(&self, reason_code: &str, seconds: f64) {
        self.lookup_calls
            .get_or_create(&ReasonLabel {
                reason_code: reason_code.to_owned(),
            })
            .inc();
        self.lookup_latency.observe(seconds);
    }

    /// Counts what decided one LookupRoute answer.
    pub fn record_decision(&self, reason_code: &str, decision: &'static str) {
        self.lookup_decisions
            .get_or_create(&DecisionLabel {
                reason_code: reason_code.to_owned(),
                decision,
            })
            .inc();
    }

    /// Counts one call of `rpc`.
    pub fn record_rpc(&self, rpc: &str) {
        self.rpc_calls
            .get_or_create(&RpcLabel {
                rpc: rpc.to_owned(),
            })
            .inc();
    }

    /// Counts one hit of `limit`.
    pub fn record_limit(&self, limit: &str) {
        self.record_limit_n(limit, 1);
    }

    /// Counts `n` hits of `limit`.
    pub fn record_limit_n(&self, limit: &str, n: u64) {
        self.limit_hits
            .get_or_create(&LimitLabel {
                limit: limit.to_owned(),
            })
            .inc_by(n);
    }

    /// Counts one ReplicaStats dropped or clamped for `reason`.
    pub fn record_stats_rejected(&self, reason: &str) {
        self.stats_rejected
            .get_or_create(&StatsLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts one call of `rpc` refused for `reason`.
    pub fn record_auth_refused(&self, rpc: &str, reason: &str) {
        self.auth_refused
            .get_or_create(&AuthLabel {
                rpc: rpc.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(error) = encode(&mut out, &self.registry) {
            tracing::error!(%error, "encoding metrics failed");
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_lookup_counters_by_reason() {
        let metrics = Metrics::new();
        metrics.record_lookup("NO_HINT", 0.000_02);
        metrics.record_lookup("NO_HINT", 0.000_03);
        let text = metrics.render();
        assert!(
            text.contains("inferencecache_lookup_route_calls_total{reason_code=\"NO_HINT\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("inferencecache_lookup_route_latency_seconds_count 2"),
            "{text}"
        );
    }

    #[test]
    fn renders_lookup_decisions() {
        let metrics = Metrics::new();
        metrics.record_decision("AFFINITY_HINT", "shared_head");
        let text = metrics.render();
        assert!(
            text.contains(
                "inferencecache_lookup_decisions_total{reason_code=\"AFFINITY_HINT\",decision=\"shared_head\"} 1"
            ),
            "{text}"
        );
    }
}
