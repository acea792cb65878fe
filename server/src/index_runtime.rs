//! The cache index inside the server: settings and flags, start-up, the
//! background TTL / capacity sweep, policy-file reload (on change and on
//! SIGHUP, keeping the last good policy), index metrics, and the admin
//! routes `GET /policy` and `GET /snapshot`.
//!
//! Everything here speaks the index crate's plain types; the gRPC handlers in
//! `grpc.rs` translate wire messages to and from them.
//!
//! Ingest goes through [`IndexState::ingest`] / [`IndexState::publish`]: the
//! index, the metrics, the observer event stream (`streams.rs`) and, with
//! `--nats-url`, the shared log (`replication.rs`). Changes read back from the
//! shared log go through the `apply_replicated_*` twins, which skip the log.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use inference_cache_index::{
    CacheEvent, CacheIndex, CacheUpdate, Clock, DropReason, EventReport, EvictionReason,
    IngestReport, PROBE_TENANT, PolicySet, SweepReport, SystemClock,
};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::pd_route::PdTopologies;

/// Entries, names and partitions one sweep must free before the allocator
/// is asked to hand free pages back to the system.
const RELEASE_AFTER_FREED: u64 = 1024;

/// Hands the allocator's free pages back to the system now rather than
/// when it next gets round to it. The binary allocates with mimalloc
/// (`cli/src/main.rs` says why); after a flood of names or entries is
/// cleared, a forced collection purges the pages the freed allocations
/// leave empty (see `cargo bench -p inference-cache --bench name_flood`).
/// Only a sweep that freed at least [`RELEASE_AFTER_FREED`] things asks.
/// In a process that allocates with another allocator (the library's own
/// tests) mimalloc holds nothing, and the call finds nothing to do.
fn release_free_memory() {
    // SAFETY: mi_collect takes no pointer; it walks mimalloc's own heaps
    // and may be called from any thread at any time.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}

use crate::replication::LogSink;
use crate::streams::{StreamArgs, StreamSettings, Streams};

/// The admin route of the effective policies.
pub const POLICY_ROUTE: &str = "/policy";
/// The admin route of the index contents.
pub const SNAPSHOT_ROUTE: &str = "/snapshot";

/// Default `--sweep-interval`.
pub const DEFAULT_SWEEP_INTERVAL: &str = "10s";

/// Flags of the cache index, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct IndexArgs {
    /// YAML stream of CachePolicy objects (namespace "*" is the default); re-read on change and on SIGHUP.
    #[arg(long, env = "INFERENCE_CACHE_POLICY_FILE")]
    pub policy_file: Option<PathBuf>,

    /// Global cap on block-replica entries: new entries past it are refused at ingest (counted), and the sweep evicts LRU / LFU to make room.
    #[arg(long, default_value_t = inference_cache_index::DEFAULT_MAX_ENTRIES, env = "INFERENCE_CACHE_MAX_INDEX_ENTRIES")]
    pub max_index_entries: u64,

    /// Most replicas one prefix key keeps; past it the stalest holder makes room (counted as `holders_per_key` evictions).
    #[arg(long, default_value_t = inference_cache_index::DEFAULT_MAX_HOLDERS_PER_KEY as u32, value_parser = clap::value_parser!(u32).range(1..), env = "INFERENCE_CACHE_MAX_HOLDERS_PER_KEY")]
    pub max_holders_per_key: u32,

    /// Engine KV block size used to fingerprint token_ids (must match the engines and the subscriber).
    #[arg(long, default_value_t = inference_cache_fingerprint::DEFAULT_BLOCK_SIZE, value_parser = clap::value_parser!(u32).range(1..), env = "INFERENCE_CACHE_ENGINE_BLOCK_SIZE")]
    pub engine_block_size: u32,

    /// Interval of the background TTL / capacity sweep (e.g. 10s, 1m).
    #[arg(long, default_value = DEFAULT_SWEEP_INTERVAL, value_parser = parse_interval, env = "INFERENCE_CACHE_SWEEP_INTERVAL")]
    pub sweep_interval: Duration,

    /// StreamCacheEvents / StreamMetrics flags.
    #[command(flatten)]
    pub streams: StreamArgs,
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = inference_cache_index::parse_duration(text)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

impl IndexArgs {
    /// Resolves the flags into settings.
    pub fn into_settings(self) -> IndexSettings {
        IndexSettings {
            policy_file: self.policy_file,
            max_index_entries: self.max_index_entries,
            max_holders_per_key: self.max_holders_per_key as usize,
            engine_block_size: self.engine_block_size as usize,
            sweep_interval: self.sweep_interval,
            streams: self.streams.into_settings(),
            clock: ClockHandle::default(),
        }
    }
}

/// The time source of the index; compares equal to any other (it is not configuration).
#[derive(Clone)]
pub struct ClockHandle(pub Arc<dyn Clock>);

impl Default for ClockHandle {
    fn default() -> Self {
        Self(Arc::new(SystemClock))
    }
}

impl fmt::Debug for ClockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClockHandle")
    }
}

impl PartialEq for ClockHandle {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ClockHandle {}

/// Resolved settings of the cache index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSettings {
    /// Policy file, if any.
    pub policy_file: Option<PathBuf>,
    /// Global entry cap.
    pub max_index_entries: u64,
    /// Most holders per prefix key.
    pub max_holders_per_key: usize,
    /// Tokens per engine KV block.
    pub engine_block_size: usize,
    /// Background sweep interval.
    pub sweep_interval: Duration,
    /// StreamCacheEvents / StreamMetrics settings.
    pub streams: StreamSettings,
    /// Time source (tests inject a manual clock).
    pub clock: ClockHandle,
}

impl Default for IndexSettings {
    fn default() -> Self {
        Self {
            policy_file: None,
            max_index_entries: inference_cache_index::DEFAULT_MAX_ENTRIES,
            max_holders_per_key: inference_cache_index::DEFAULT_MAX_HOLDERS_PER_KEY,
            engine_block_size: inference_cache_fingerprint::DEFAULT_BLOCK_SIZE as usize,
            sweep_interval: parse_interval(DEFAULT_SWEEP_INTERVAL).unwrap_or_default(),
            streams: StreamSettings::default(),
            clock: ClockHandle::default(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

/// Index metrics, registered in the server's registry.
#[derive(Debug, Clone, Default)]
pub struct IndexMetrics {
    entries: Gauge,
    prefixes: Gauge,
    evictions: Family<ReasonLabel, Counter>,
    ingest_updates: Counter,
    ingest_entries: Counter,
    ingest_dropped: Family<ReasonLabel, Counter>,
    ingest_refused: Counter,
    members_expired: Counter,
    policy_reloads: Family<ResultLabel, Counter>,
}

impl IndexMetrics {
    /// Registers every index metric in `registry` (prefix `inferencecache`).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "index_entries",
            "Block-replica entries in the index",
            m.entries.clone(),
        );
        registry.register(
            "index_prefixes",
            "Distinct prefix keys in the index",
            m.prefixes.clone(),
        );
        registry.register(
            "index_evictions",
            "Entries removed from the index by reason (ttl, capacity, quota, event, holders_per_key)",
            m.evictions.clone(),
        );
        registry.register(
            "ingest_updates",
            "CacheStateUpdate messages ingested",
            m.ingest_updates.clone(),
        );
        registry.register(
            "ingest_entries",
            "Block-replica entries written (added or refreshed) by ingest",
            m.ingest_entries.clone(),
        );
        registry.register(
            "ingest_dropped",
            "Prefix entries dropped at ingest by reason",
            m.ingest_dropped.clone(),
        );
        registry.register(
            "ingest_refused",
            "New block-replica entries refused at ingest because the index was at --max-index-entries",
            m.ingest_refused.clone(),
        );
        registry.register(
            "fleet_members_expired",
            "Serving-set memberships ended because a heartbeating replica went silent past replicaTimeout",
            m.members_expired.clone(),
        );
        registry.register(
            "policy_reload",
            "Policy file loads by result (success, error)",
            m.policy_reloads.clone(),
        );
        for reason in EvictionReason::ALL {
            let _ = m.evictions.get_or_create(&label(reason.as_str()));
        }
        for reason in DropReason::ALL {
            let _ = m.ingest_dropped.get_or_create(&label(reason.as_str()));
        }
        m
    }
}

fn label(reason: &str) -> ReasonLabel {
    ReasonLabel {
        reason: reason.to_owned(),
    }
}

/// The index and everything the handlers need next to it.
pub struct IndexState {
    /// The index.
    pub index: Arc<CacheIndex>,
    /// Tokens per engine KV block (token_ids → chain).
    pub engine_block_size: usize,
    metrics: IndexMetrics,
    policy_file: Option<PathBuf>,
    last_reload_error: Mutex<Option<String>>,
    streams: Streams,
    log: OnceLock<Arc<LogSink>>,
    pd_topologies: arc_swap::ArcSwap<PdTopologies>,
    clock: Arc<dyn Clock>,
}

impl IndexState {
    /// Builds the index and loads the policy file; a bad file fails start-up.
    pub fn new(settings: &IndexSettings, registry: &mut Registry) -> anyhow::Result<Self> {
        let index = Arc::new(CacheIndex::new(
            Arc::clone(&settings.clock.0),
            settings.max_index_entries,
        ));
        index.set_max_holders_per_key(settings.max_holders_per_key);
        let state = Self {
            index,
            engine_block_size: settings.engine_block_size.max(1),
            metrics: IndexMetrics::register(registry),
            policy_file: settings.policy_file.clone(),
            last_reload_error: Mutex::new(None),
            streams: Streams::new(&settings.streams, registry),
            log: OnceLock::new(),
            pd_topologies: arc_swap::ArcSwap::from_pointee(PdTopologies::default()),
            clock: Arc::clone(&settings.clock.0),
        };
        if let Some(path) = &state.policy_file {
            let (policies, topologies) = read_policies(path)?;
            tracing::info!(path = %path.display(), namespaces = policies.len(), pd_topologies = topologies.len(), "policy loaded");
            state.index.set_policies(policies);
            state.pd_topologies.store(Arc::new(topologies));
            state.count_reload("success");
        }
        Ok(state)
    }

    fn count_reload(&self, result: &str) {
        self.metrics
            .policy_reloads
            .get_or_create(&ResultLabel {
                result: result.to_owned(),
            })
            .inc();
    }

    /// Re-reads the policy file; on error logs, counts and keeps the policy in force.
    pub fn reload_policies(&self) -> bool {
        let Some(path) = &self.policy_file else {
            return false;
        };
        match read_policies(path) {
            Ok((policies, topologies)) => {
                tracing::info!(path = %path.display(), namespaces = policies.len(), pd_topologies = topologies.len(), "policy reloaded");
                self.index.set_policies(policies);
                self.pd_topologies.store(Arc::new(topologies));
                *self.last_reload_error.lock() = None;
                self.count_reload("success");
                true
            }
            Err(error) => {
                tracing::error!(path = %path.display(), "policy reload failed, keeping the last good policy: {error:#}");
                *self.last_reload_error.lock() = Some(format!("{error:#}"));
                self.count_reload("error");
                false
            }
        }
    }

    /// The PD topologies of the policy file.
    pub fn pd_topologies(&self) -> Arc<PdTopologies> {
        self.pd_topologies.load_full()
    }

    /// Now, by the index's clock (ms since the epoch).
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The observer streams fed by every applied change.
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// Sends every accepted ingest to the shared log from now on (once).
    pub fn set_log_sink(&self, sink: Arc<LogSink>) {
        if self.log.set(sink).is_err() {
            tracing::warn!("shared log sink already set; keeping the first");
        }
    }

    /// Ingests an accepted update (authorized, limits applied): the index,
    /// the metrics, the event stream and the shared log.
    pub fn ingest(&self, update: &CacheUpdate) -> IngestReport {
        let report = self.apply_replicated_update(update);
        if let Some(log) = self.log.get()
            && update.tenant_id != PROBE_TENANT
        {
            log.append_update(update);
        }
        report
    }

    /// Applies an accepted producer event: the index, the metrics, the event
    /// stream and the shared log.
    pub fn publish(&self, event: &CacheEvent) -> EventReport {
        let report = self.apply_replicated_event(event);
        if let Some(log) = self.log.get()
            && event.tenant_id != PROBE_TENANT
        {
            log.append_event(event);
        }
        report
    }

    /// Applies an update read from the shared log (not appended again).
    pub fn apply_replicated_update(&self, update: &CacheUpdate) -> IngestReport {
        let report = self.index.ingest(update);
        self.record_ingest(&report);
        if update.tenant_id != PROBE_TENANT {
            self.streams.emit_update(update);
        }
        report
    }

    /// Applies an event read from the shared log (not appended again).
    pub fn apply_replicated_event(&self, event: &CacheEvent) -> EventReport {
        let report = self.index.publish(event);
        self.record_event_removals(report.entries_removed);
        if event.tenant_id != PROBE_TENANT {
            self.streams.emit_event(event);
        }
        report
    }

    /// Records an ingest report in the metrics.
    pub fn record_ingest(&self, report: &IngestReport) {
        self.metrics.ingest_updates.inc();
        self.metrics.ingest_entries.inc_by(report.entries_written);
        self.metrics.ingest_refused.inc_by(report.entries_refused);
        if report.holders_displaced > 0 {
            self.metrics
                .evictions
                .get_or_create(&label(EvictionReason::HoldersPerKey.as_str()))
                .inc_by(report.holders_displaced);
        }
        for (reason, n) in &report.dropped {
            self.metrics
                .ingest_dropped
                .get_or_create(&label(reason.as_str()))
                .inc_by(*n);
        }
        self.refresh_gauges();
    }

    /// Records entries removed by a producer event.
    pub fn record_event_removals(&self, removed: u64) {
        if removed > 0 {
            self.metrics
                .evictions
                .get_or_create(&label(EvictionReason::Event.as_str()))
                .inc_by(removed);
        }
        self.refresh_gauges();
    }

    /// Runs one sweep and records it.
    pub fn sweep(&self) -> SweepReport {
        let report = self.index.sweep();
        self.metrics.members_expired.inc_by(report.members_expired);
        for (reason, n) in [
            (EvictionReason::Ttl, report.ttl),
            (EvictionReason::Quota, report.quota),
            (EvictionReason::Capacity, report.capacity),
        ] {
            if n > 0 {
                self.metrics
                    .evictions
                    .get_or_create(&label(reason.as_str()))
                    .inc_by(n);
            }
        }
        self.refresh_gauges();
        let freed = report.ttl
            + report.quota
            + report.capacity
            + report.names_freed
            + report.partitions_freed;
        if freed >= RELEASE_AFTER_FREED {
            release_free_memory();
        }
        report
    }

    fn refresh_gauges(&self) {
        self.metrics.entries.set(self.index.entry_count());
        self.metrics.prefixes.set(self.index.prefix_count());
    }

    /// Starts the sweep loop and the policy watchers; they stop with `shutdown`.
    pub fn spawn_background(self: &Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let state = Arc::clone(self);
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = ticker.tick() => {
                        let s = Arc::clone(&state);
                        let report = tokio::task::spawn_blocking(move || s.sweep()).await;
                        if let Ok(r) = report
                            && r != SweepReport::default()
                        {
                            tracing::debug!(ttl = r.ttl, quota = r.quota, capacity = r.capacity, "sweep");
                        }
                    }
                }
            }
        });
        if let Some(path) = self.policy_file.clone() {
            self.spawn_policy_watch(path, shutdown);
        }
    }

    fn spawn_policy_watch(self: &Arc<Self>, path: PathBuf, shutdown: CancellationToken) {
        let state = Arc::clone(self);
        crate::reload::spawn_reloader(path, "policy file", shutdown, move || {
            state.reload_policies();
        });
    }

    /// Admin routes: `GET /policy` and `GET /snapshot`, each only when enabled.
    pub fn routes(self: &Arc<Self>, policy: bool, snapshot: bool) -> Router {
        let mut router = Router::new();
        if policy {
            router = router.route(POLICY_ROUTE, get(policy_route));
        }
        if snapshot {
            router = router.route(SNAPSHOT_ROUTE, get(snapshot_route));
        }
        router.with_state(Arc::clone(self))
    }
}

/// The CachePolicy objects and the PDTopology objects of a policy file.
fn read_policies(path: &Path) -> anyhow::Result<(PolicySet, PdTopologies)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading policy file {}", path.display()))?;
    let (rest, topologies) = crate::pd_route::split_policy_stream(&text)
        .with_context(|| format!("policy file {}", path.display()))?;
    let policies =
        PolicySet::from_yaml(&rest).with_context(|| format!("policy file {}", path.display()))?;
    Ok((policies, topologies))
}

async fn policy_route(State(state): State<Arc<IndexState>>) -> impl IntoResponse {
    let body = serde_json::json!({
        "source": state.policy_file.as_ref().map(|p| p.display().to_string()),
        "lastReloadError": *state.last_reload_error.lock(),
        "policies": &*state.index.policies(),
    });
    json(body)
}

async fn snapshot_route(State(state): State<Arc<IndexState>>) -> impl IntoResponse {
    let index = Arc::clone(&state.index);
    let snapshot = tokio::task::spawn_blocking(move || index.snapshot()).await;
    match snapshot {
        Ok(s) => json(serde_json::to_value(s).unwrap_or_default()),
        Err(_) => json(serde_json::Value::Null),
    }
}

fn json(value: serde_json::Value) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
}
