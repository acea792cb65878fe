//! Prometheus metrics of the server, exposed as text on the admin `/metrics`.
//!
//! One [`Metrics`] value owns the registry; handlers hold an `Arc` and record
//! into lock-free counters and histograms.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label set carrying a LookupRoute reason code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason code of the response.
    pub reason_code: String,
}

/// Label set naming an RPC.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabel {
    /// gRPC method name.
    pub rpc: String,
}

/// All server metrics and the registry that renders them.
pub struct Metrics {
    registry: Registry,
    /// `inferencecache_lookup_route_calls_total{reason_code}`.
    pub lookup_calls: Family<ReasonLabel, Counter>,
    /// `inferencecache_lookup_route_latency_seconds`, 10 µs to ~160 ms.
    pub lookup_latency: Histogram,
    /// `inferencecache_rpc_calls_total{rpc}` for the non-lookup RPCs.
    pub rpc_calls: Family<RpcLabel, Counter>,
    /// `inferencecache_server_up`: 1 while serving.
    pub server_up: Gauge,
}

impl Metrics {
    /// Creates the registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("inferencecache");
        let lookup_calls = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "lookup_route_calls",
            "LookupRoute calls by reason code",
            lookup_calls.clone(),
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
        Self {
            registry,
            lookup_calls,
            lookup_latency,
            rpc_calls,
            server_up,
        }
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

    /// Counts one call of `rpc`.
    pub fn record_rpc(&self, rpc: &str) {
        self.rpc_calls
            .get_or_create(&RpcLabel {
                rpc: rpc.to_owned(),
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
}
