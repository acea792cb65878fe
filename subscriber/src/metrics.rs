//! The subscriber's own Prometheus metrics and their `/metrics` listener.
//!
//! Every counter is created once at start-up and held as a handle, so the
//! hot path is one relaxed atomic add per increment (no label lookups).
//! Names carry the `inferencecache_subscriber_` prefix.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let frames = counter("frames", "ZMQ messages received from engine publishers");
        let frames_malformed = counter(
            "frames_malformed",
            "ZMQ messages skipped because they are not KV-event batches",
        );
        let events_skipped = counter(
            "events_skipped",
            "Events inside a batch skipped as unreadable or of an unknown type",
        );
        let blocks_stored = counter(
            "blocks_stored",
            "Blocks stored by engines and fingerprinted",
        );
        let blocks_removed = counter("blocks_removed", "Tracked blocks removed by engines");
        let removals_unknown = counter(
            "removals_unknown",
            "Removed blocks whose engine hash was not tracked",
        );
        let tier2_rereports = counter(
            "tier2_rereports",
            "Blocks evicted from the device and re-reported at tier T2",
        );
        let sequence_gaps = counter("sequence_gaps", "Sequence gaps seen on publisher streams");
        let batches_missed = counter(
            "batches_missed",
            "Batches lost in sequence gaps that replay did not recover",
        );
        let batches_replayed = counter("batches_replayed", "Batches recovered through replay");
        let replay_failures = counter(
            "replay_failures",
            "Replay requests that failed or timed out",
        );
        let publisher_restarts = counter(
            "publisher_restarts",
            "Sequence numbers that went backwards (an engine restart)",
        );
        let zmq_connects = counter("zmq_connects", "ZMQ subscriptions established");
        let zmq_errors = counter("zmq_errors", "ZMQ connect or receive errors");
        let buffer_dropped = counter(
            "buffer_dropped",
            "Pending blocks or events dropped, oldest first, because the buffer was full",
        );
        let updates_sent = counter("updates_sent", "CacheStateUpdate messages sent");
        let blocks_sent = counter(
            "blocks_sent",
            "Block entries sent in CacheStateUpdate messages",
        );
        let events_published = counter("events_published", "CacheEvent messages published");
        let server_errors = counter(
            "server_errors",
            "Failed calls to the inference-cache server",
        );
        let acks_rejected = counter(
            "acks_rejected",
            "Acks from the server with accepted = false",
        );
        let resyncs = counter(
            "resyncs",
            "Full re-reports of the tracked state after a server failure or buffer overflow",
        );

        let refreshes = counter(
            "refreshes",
            "Periodic re-reports of every held block (eviction-TTL keep-alive)",
        );

        let events = Labeled::default();
        registry.register("events", "Engine events by type", events.clone());
        let dropped = Labeled::default();
        registry.register(
            "blocks_dropped",
            "Stored blocks not reported, by reason",
            dropped.clone(),
        );
        let buffer_items = Gauge::default();
        registry.register(
            "buffer_items",
            "Blocks and events waiting to be sent to the server",
            buffer_items.clone(),
        );
        let tracked_blocks = Gauge::default();
        registry.register(
            "tracked_blocks",
            "Engine block hashes remembered for chaining and removals",
            tracked_blocks.clone(),
        );
        let event = |kind| events.get_or_create(&[("type", kind)]).clone();
        let drop = |reason| dropped.get_or_create(&[("reason", reason)]).clone();
        Self {
            frames,
            frames_malformed,
            events_stored: event("BlockStored"),
            events_removed: event("BlockRemoved"),
            events_cleared: event("AllBlocksCleared"),
            events_skipped,
            blocks_stored,
            blocks_removed,
            dropped_unmapped_lora: drop("unmapped_lora"),
            dropped_unknown_parent: drop("unknown_parent"),
            dropped_block_size: drop("block_size_mismatch"),
            dropped_token_mismatch: drop("token_count_mismatch"),
            removals_unknown,
            tier2_rereports,
            sequence_gaps,
            batches_missed,
            batches_replayed,
            replay_failures,
            publisher_restarts,
            zmq_connects,
            zmq_errors,
            buffer_dropped,
            buffer_items,
            tracked_blocks,
            updates_sent,
            blocks_sent,
            events_published,
            server_errors,
            acks_rejected,
            resyncs,
            refreshes,
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

async fn render(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
}
