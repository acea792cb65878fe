//! The subscriber's own Prometheus metrics and their `/metrics` listener.
//!
//! Every counter is created once at start-up and held as a handle, so the
//! hot path is one relaxed atomic add per increment (no label lookups).
//! Names carry the `inferencecache_subscriber_` prefix. The listener also
//! serves `/healthz` (always 200) and `/readyz`: 503 with the text of every
//! configuration mismatch ([`crate::selfcheck`]), 200 otherwise.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};

use crate::selfcheck::ConfigCheck;

type Labeled = Family<[(&'static str, &'static str); 1], Counter>;

/// Counters and gauges of one subscriber process.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub(crate) frames: Counter,
    pub(crate) frames_malformed: Counter,
    pub(crate) events_stored: Counter,
    pub(crate) events_removed: Counter,
    pub(crate) events_cleared: Counter,
    pub(crate) events_skipped: Counter,
    pub(crate) blocks_stored: Counter,
    pub(crate) blocks_removed: Counter,
    pub(crate) dropped_unmapped_lora: Counter,
    pub(crate) dropped_unknown_parent: Counter,
    pub(crate) dropped_block_size: Counter,
    pub(crate) dropped_token_mismatch: Counter,
    pub(crate) removals_unknown: Counter,
    pub(crate) tier2_rereports: Counter,
    pub(crate) sequence_gaps: Counter,
    pub(crate) batches_missed: Counter,
    pub(crate) batches_replayed: Counter,
    pub(crate) replay_failures: Counter,
    pub(crate) publisher_restarts: Counter,
    pub(crate) zmq_connects: Counter,
    pub(crate) zmq_errors: Counter,
    pub(crate) buffer_dropped: Counter,
    pub(crate) buffer_items: Gauge,
    pub(crate) tracked_blocks: Gauge,
    pub(crate) updates_sent: Counter,
    pub(crate) blocks_sent: Counter,
    pub(crate) events_published: Counter,
    pub(crate) server_errors: Counter,
    pub(crate) acks_rejected: Counter,
    pub(crate) resyncs: Counter,
    pub(crate) refreshes: Counter,
    pub(crate) first_frame_replays: Counter,
    pub(crate) announcements: Counter,
    pub(crate) heartbeats: Counter,
    pub(crate) goodbyes: Counter,
    pub(crate) stats_sent: Counter,
    pub(crate) engine_scrapes_ok: Counter,
    pub(crate) engine_scrapes_failed: Counter,
    pub(crate) engine_lines_malformed: Counter,
    pub(crate) engine_values_rejected: Labeled,
    pub(crate) config_check: ConfigCheck,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("inferencecache_subscriber");
        let r = &mut registry;
        let events: Labeled = register(r, "events", "Engine events by type");
        let dropped: Labeled =
            register(r, "blocks_dropped", "Stored blocks not reported, by reason");
        let scrapes: Labeled = register(
            r,
            "engine_scrapes",
            "Scrapes of the engine's Prometheus page, by result",
        );
        let scrape = |result| scrapes.get_or_create(&[("result", result)]).clone();
        let event = |kind| events.get_or_create(&[("type", kind)]).clone();
        let drop = |reason| dropped.get_or_create(&[("reason", reason)]).clone();
        Self {
            frames: register(r, "frames", "ZMQ messages received from engine publishers"),
            frames_malformed: register(
                r,
                "frames_malformed",
                "ZMQ messages skipped because they are not KV-event batches",
            ),
            events_stored: event("BlockStored"),
            events_removed: event("BlockRemoved"),
            events_cleared: event("AllBlocksCleared"),
            events_skipped: register(
                r,
                "events_skipped",
                "Events inside a batch skipped as unreadable or of an unknown type",
            ),
            blocks_stored: register(
                r,
                "blocks_stored",
                "Blocks stored by engines and fingerprinted",
            ),
            blocks_removed: register(r, "blocks_removed", "Tracked blocks removed by engines"),
            dropped_unmapped_lora: drop("unmapped_lora"),
            dropped_unknown_parent: drop("unknown_parent"),
            dropped_block_size: drop("block_size_mismatch"),
            dropped_token_mismatch: drop("token_count_mismatch"),
            removals_unknown: register(
                r,
                "removals_unknown",
                "Removed blocks whose engine hash was not tracked",
            ),
            tier2_rereports: register(
                r,
                "tier2_rereports",
                "Blocks evicted from the device and re-reported at tier T2",
            ),
            sequence_gaps: register(
                r,
                "sequence_gaps",
                "Sequence gaps seen on publisher streams",
            ),
            batches_missed: register(
                r,
                "batches_missed",
                "Batches lost in sequence gaps that replay did not recover",
            ),
            batches_replayed: register(r, "batches_replayed", "Batches recovered through replay"),
            replay_failures: register(
                r,
                "replay_failures",
                "Replay requests that failed or timed out",
            ),
            publisher_restarts: register(
                r,
                "publisher_restarts",
                "Sequence numbers that went backwards (an engine restart)",
            ),
            zmq_connects: register(r, "zmq_connects", "ZMQ subscriptions established"),
            zmq_errors: register(r, "zmq_errors", "ZMQ connect or receive errors"),
            buffer_dropped: register(
                r,
                "buffer_dropped",
                "Pending blocks or events dropped, oldest first, because the buffer was full",
            ),
            buffer_items: register(
                r,
                "buffer_items",
                "Blocks and events waiting to be sent to the server",
            ),
            tracked_blocks: register(
                r,
                "tracked_blocks",
                "Engine block hashes remembered for chaining and removals",
            ),
            updates_sent: register(r, "updates_sent", "CacheStateUpdate messages sent"),
            blocks_sent: register(
                r,
                "blocks_sent",
                "Block entries sent in CacheStateUpdate messages",
            ),
            events_published: register(r, "events_published", "CacheEvent messages published"),
            server_errors: register(
                r,
                "server_errors",
                "Failed calls to the inference-cache server",
            ),
            acks_rejected: register(
                r,
                "acks_rejected",
                "Acks from the server with accepted = false",
            ),
            resyncs: register(
                r,
                "resyncs",
                "Full re-reports of the tracked state after a server failure or buffer overflow",
            ),
            refreshes: register(
                r,
                "refreshes",
                "Periodic re-reports of every held block (eviction-TTL keep-alive)",
            ),
            first_frame_replays: register(
                r,
                "first_frame_replays",
                "Replays from sequence 0 because the first frame of a publisher was later than 0",
            ),
            announcements: register(
                r,
                "announcements",
                "Stats-only updates announcing the replica (on connect and after every clear)",
            ),
            heartbeats: register(
                r,
                "heartbeats",
                "REPLICA_UPDATED liveness events sent on the heartbeat interval",
            ),
            goodbyes: register(
                r,
                "goodbyes",
                "ALL_CLEARED events sent on shutdown that the server received",
            ),
            stats_sent: register(
                r,
                "stats_sent",
                "Updates carrying engine load (ReplicaStats) sent to the server",
            ),
            engine_scrapes_ok: scrape("ok"),
            engine_scrapes_failed: scrape("failed"),
            engine_lines_malformed: register(
                r,
                "engine_lines_malformed",
                "Lines of the engine's metrics page that did not parse",
            ),
            engine_values_rejected: register(
                r,
                "engine_values_rejected",
                "Engine metric values rejected (NaN, infinite, negative, fraction above 1), by field",
            ),
            config_check: ConfigCheck::new(register(
                r,
                "config_mismatch",
                "1 while the engine's cache configuration disagrees with the subscriber's, by field",
            )),
            registry,
        }
    }

    /// The metrics in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Value of one sample by its full name and labels as rendered, e.g.
    /// `inferencecache_subscriber_blocks_dropped_total{reason="unmapped_lora"}`.
    pub fn sample(&self, name: &str) -> Option<f64> {
        self.render().lines().find_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            (key == name).then(|| value.parse().ok()).flatten()
        })
    }
}

/// Creates a metric, registers it under `name` with `help` and returns the
/// handle kept for the hot path.
fn register<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    let metric = M::default();
    registry.register(name, help, metric.clone());
    metric
}

/// Binds the `/metrics` listener; serves until `shutdown` resolves.
pub(crate) async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(metrics);
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::warn!(%error, "metrics listener stopped");
        }
    });
    Ok((local, task))
}

/// `/readyz`: 503 listing every configuration mismatch, else 200.
async fn readyz(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    readiness(&metrics)
}

fn readiness(metrics: &Metrics) -> (StatusCode, String) {
    let mismatches = metrics.config_check.mismatches();
    if mismatches.is_empty() {
        return (StatusCode::OK, "ok\n".to_owned());
    }
    let mut text = String::from("configuration mismatch:\n");
    for (field, detail) in mismatches {
        text.push_str(&format!("{field}: {detail}\n"));
    }
    (StatusCode::SERVICE_UNAVAILABLE, text)
}

async fn render(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_reports_configuration_mismatches() {
        let metrics = Metrics::new();
        assert_eq!(readiness(&metrics), (StatusCode::OK, "ok\n".to_owned()));
        metrics.config_check.event_block_size(32, 16);
        let (status, text) = readiness(&metrics);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            text.contains("event_block_size: BlockStored events carry block_size 32"),
            "{text}"
        );
        let page = crate::exposition::parse_exposition(
            "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"False\"} 1.0\n",
        );
        metrics.config_check.check_page(&page.samples, 16);
        let (status, text) = readiness(&metrics);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(text.contains("enable_prefix_caching: "), "{text}");
    }
}
