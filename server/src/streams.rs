//! The observer streams: `StreamCacheEvents` (the index changes, as
//! `CacheEvent`s) and `StreamMetrics` (periodic snapshots of `/metrics` as
//! `Metric` messages).
//!
//! Events: every change the index applies — a local ingest or one read from
//! the shared log — is offered to a `tokio::sync::broadcast` channel of
//! `--event-stream-buffer` events. Building the events costs nothing while no
//! one watches. Sending never waits: a watcher that falls more than the buffer
//! behind is dropped (its call ends with RESOURCE_EXHAUSTED) and counted in
//! `inferencecache_stream_consumers_dropped_total{stream="events"}`, so a slow
//! consumer can never slow ingest. An update becomes one `PREFIX_ADDED` per
//! reported prefix (the entry's `prefix_hash`, or its last block hash for a
//! chain; block hashes are parent-chained so the last one names the whole
//! prefix), or one `REPLICA_UPDATED` when it carries no prefix (a stats or
//! membership heartbeat); a `PublishEvent` event is passed on as it is.
//!
//! Metrics: each `StreamMetrics` call renders the registry every
//! `--metrics-stream-interval` and sends every sample (filtered by name).
//! Snapshots are made when the client reads, so a slow reader only skips
//! snapshots (counted in `..._dropped_total{stream="metrics"}`).
//!
//! Both streams end with OK when the server starts shutting down.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use inference_cache_index as index;
use inference_cache_proto::v1alpha1::{
    CacheEvent, Metric, StreamEventsRequest, StreamMetricsRequest, cache_event,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::auth::Caller;
use crate::metrics::Metrics;

/// Default `--event-stream-buffer`.
pub const DEFAULT_EVENT_BUFFER: usize = 4_096;
/// Default `--metrics-stream-interval`.
pub const DEFAULT_METRICS_INTERVAL: &str = "10s";

/// Flags of the observer streams, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// Events a StreamCacheEvents watcher may fall behind before it is dropped (counted in stream_consumers_dropped_total).
    #[arg(long, default_value_t = DEFAULT_EVENT_BUFFER as u64, value_parser = clap::value_parser!(u64).range(1..), env = "INFERENCE_CACHE_EVENT_STREAM_BUFFER")]
    pub event_stream_buffer: u64,

    /// Interval between two StreamMetrics snapshots.
    #[arg(long, default_value = DEFAULT_METRICS_INTERVAL, value_parser = parse_interval, env = "INFERENCE_CACHE_METRICS_STREAM_INTERVAL")]
    pub metrics_stream_interval: Duration,
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = crate::limits::parse_duration(text)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

impl StreamArgs {
    /// Resolves the flags.
    pub fn into_settings(self) -> StreamSettings {
        StreamSettings {
            event_buffer: usize::try_from(self.event_stream_buffer).unwrap_or(usize::MAX),
            metrics_interval: self.metrics_stream_interval,
        }
    }
}

/// Resolved settings of the observer streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSettings {
    /// Broadcast buffer of the event stream.
    pub event_buffer: usize,
    /// Interval of metric snapshots.
    pub metrics_interval: Duration,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            event_buffer: DEFAULT_EVENT_BUFFER,
            metrics_interval: parse_interval(DEFAULT_METRICS_INTERVAL).unwrap_or_default(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StreamLabel {
    stream: String,
}

/// The event broadcast and the stream settings.
pub struct Streams {
    events: broadcast::Sender<CacheEvent>,
    metrics_interval: Duration,
    closed: CancellationToken,
    watchers: Gauge,
    sent: Family<StreamLabel, Counter>,
    dropped: Family<StreamLabel, Counter>,
}

impl Streams {
    /// Creates the broadcast and registers the stream metrics.
    pub fn new(settings: &StreamSettings, registry: &mut Registry) -> Self {
        let (events, _) = broadcast::channel(settings.event_buffer.max(1));
        let streams = Self {
            events,
            metrics_interval: settings.metrics_interval,
            closed: CancellationToken::new(),
            watchers: Gauge::default(),
            sent: Family::default(),
            dropped: Family::default(),
        };
        registry.register(
            "stream_watchers",
            "Open StreamCacheEvents calls",
            streams.watchers.clone(),
        );
        registry.register(
            "stream_messages_sent",
            "Messages sent on the observer streams, by stream (events, metrics)",
            streams.sent.clone(),
        );
        registry.register(
            "stream_consumers_dropped",
            "Observer streams behind their buffer: events watchers ended, metrics snapshots skipped",
            streams.dropped.clone(),
        );
        for stream in ["events", "metrics"] {
            let label = StreamLabel {
                stream: stream.to_owned(),
            };
            let _ = streams.sent.get_or_create(&label);
            let _ = streams.dropped.get_or_create(&label);
        }
        streams
    }

    /// Ends every open stream (shutdown).
    pub fn close(&self) {
        self.closed.cancel();
    }

    /// Offers the events of an applied update to the watchers.
    pub fn emit_update(&self, update: &index::CacheUpdate) {
        if self.events.receiver_count() == 0 {
            return;
        }
        let timestamp_us = now_us();
        let event = |kind: cache_event::Type, prefix_hash: Vec<u8>, adapter_id: &str| CacheEvent {
            r#type: kind as i32,
            replica_id: update.replica_id.clone(),
            model_id: update.model_id.clone(),
            tenant_id: update.tenant_id.clone(),
            prefix_hash,
            timestamp_us,
            adapter_id: adapter_id.to_owned(),
        };
        if update.prefixes.is_empty() {
            let _ = self.events.send(event(
                cache_event::Type::ReplicaUpdated,
                Vec::new(),
                &update.adapter_id,
            ));
            return;
        }
        for p in &update.prefixes {
            let hash = if p.prefix_hash.is_empty() {
                p.chain
                    .hashes()
                    .last()
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default()
            } else {
                p.prefix_hash.clone()
            };
            let adapter = if p.adapter_id.is_empty() {
                &update.adapter_id
            } else {
                &p.adapter_id
            };
            let _ = self
                .events
                .send(event(cache_event::Type::PrefixAdded, hash, adapter));
        }
    }

    /// Offers an applied producer event to the watchers.
    pub fn emit_event(&self, event: &index::CacheEvent) {
        if self.events.receiver_count() > 0 {
            let _ = self.events.send(wire_event(event));
        }
    }

    /// The StreamCacheEvents response: events matching `request` that
    /// `caller` may read, until shutdown or until the watcher falls behind.
    pub fn watch(
        &self,
        request: StreamEventsRequest,
        caller: Caller,
    ) -> impl Stream<Item = Result<CacheEvent, Status>> + Send + 'static {
        struct Watch {
            rx: broadcast::Receiver<CacheEvent>,
            request: StreamEventsRequest,
            caller: Caller,
            closed: CancellationToken,
            sent: Counter,
            dropped: Counter,
            _open: WatcherGuard,
            done: bool,
        }
        let label = StreamLabel {
            stream: "events".to_owned(),
        };
        let watch = Watch {
            rx: self.events.subscribe(),
            request,
            caller,
            closed: self.closed.clone(),
            sent: self.sent.get_or_create(&label).clone(),
            dropped: self.dropped.get_or_create(&label).clone(),
            _open: WatcherGuard::new(self.watchers.clone()),
            done: false,
        };
        futures::stream::unfold(watch, |mut w| async move {
            if w.done {
                return None;
            }
            loop {
                let received = tokio::select! {
                    biased;
                    () = w.closed.cancelled() => return None,
                    r = w.rx.recv() => r,
                };
                match received {
                    Ok(event) => {
                        if matches(&w.request, &event) && w.caller.may_read(&event.tenant_id) {
                            w.sent.inc();
                            return Some((Ok(event), w));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        w.dropped.inc();
                        w.done = true;
                        let status = Status::resource_exhausted(format!(
                            "StreamCacheEvents: consumer too slow, {missed} events behind (--event-stream-buffer); reconnect"
                        ));
                        return Some((Err(status), w));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
    }

    /// The StreamMetrics response: a snapshot now and every interval until shutdown.
    pub fn metric_snapshots(
        &self,
        metrics: Arc<Metrics>,
        request: StreamMetricsRequest,
    ) -> impl Stream<Item = Result<Metric, Status>> + Send + 'static {
        let mut ticker = tokio::time::interval(self.metrics_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let label = StreamLabel {
            stream: "metrics".to_owned(),
        };
        let sent = self.sent.get_or_create(&label).clone();
        let skipped = self.dropped.get_or_create(&label).clone();
        let closed = self.closed.clone();
        let interval = self.metrics_interval;
        let snapshots = futures::stream::unfold(
            (ticker, None::<tokio::time::Instant>),
            move |(mut ticker, last)| {
                let (metrics, closed, names, skipped) = (
                    Arc::clone(&metrics),
                    closed.clone(),
                    request.names.clone(),
                    skipped.clone(),
                );
                async move {
                    let tick = tokio::select! {
                        biased;
                        () = closed.cancelled() => return None,
                        t = ticker.tick() => t,
                    };
                    if let Some(last) = last {
                        let missed = (tick - last).as_nanos() / interval.as_nanos().max(1);
                        if missed > 1 {
                            skipped.inc_by(u64::try_from(missed - 1).unwrap_or(u64::MAX));
                        }
                    }
                    let snapshot = parse_exposition(&metrics.render(), &names, now_us());
                    Some((
                        futures::stream::iter(snapshot.into_iter().map(Ok)),
                        (ticker, Some(tick)),
                    ))
                }
            },
        );
        futures::StreamExt::inspect(futures::StreamExt::flatten(snapshots), move |_| {
            sent.inc();
        })
    }
}

/// Decrements the open-watchers gauge when a watch ends.
struct WatcherGuard(Gauge);

impl WatcherGuard {
    fn new(gauge: Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// True when `event` passes the request's tenant, model and type filters (empty = any).
fn matches(request: &StreamEventsRequest, event: &CacheEvent) -> bool {
    (request.tenant_id.is_empty() || request.tenant_id == event.tenant_id)
        && (request.model_id.is_empty() || request.model_id == event.model_id)
        && (request.types.is_empty() || request.types.contains(&event.r#type))
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// An index event in wire form, stamped now.
pub fn wire_event(event: &index::CacheEvent) -> CacheEvent {
    let kind = match event.kind {
        index::EventKind::PrefixAdded => cache_event::Type::PrefixAdded,
        index::EventKind::PrefixEvicted => cache_event::Type::PrefixEvicted,
        index::EventKind::ReplicaUpdated => cache_event::Type::ReplicaUpdated,
        index::EventKind::AllCleared => cache_event::Type::AllCleared,
    };
    CacheEvent {
        r#type: kind as i32,
        replica_id: event.replica_id.clone(),
        model_id: event.model_id.clone(),
        tenant_id: event.tenant_id.clone(),
        prefix_hash: event.prefix_hash.clone(),
        timestamp_us: now_us(),
        adapter_id: event.adapter_id.clone(),
    }
}

/// A wire event as the index's plain event; `None` for an unspecified or unknown type.
pub fn index_event(event: &CacheEvent) -> Option<index::CacheEvent> {
    let kind = match cache_event::Type::try_from(event.r#type) {
        Ok(cache_event::Type::PrefixAdded) => index::EventKind::PrefixAdded,
        Ok(cache_event::Type::PrefixEvicted) => index::EventKind::PrefixEvicted,
        Ok(cache_event::Type::ReplicaUpdated) => index::EventKind::ReplicaUpdated,
        Ok(cache_event::Type::AllCleared) => index::EventKind::AllCleared,
        Ok(cache_event::Type::Unspecified) | Err(_) => return None,
    };
    Some(index::CacheEvent {
        kind,
        replica_id: event.replica_id.clone(),
        model_id: event.model_id.clone(),
        tenant_id: event.tenant_id.clone(),
        prefix_hash: event.prefix_hash.clone(),
        adapter_id: event.adapter_id.clone(),
    })
}

/// Suffixes a sample name may add to its metric family's name.
const SAMPLE_SUFFIXES: [&str; 5] = ["_total", "_bucket", "_count", "_sum", "_created"];

/// The samples of a Prometheus / OpenMetrics text exposition as `Metric`s;
/// `names` (sample or family names) filters them when not empty.
pub fn parse_exposition(text: &str, names: &[String], timestamp_us: i64) -> Vec<Metric> {
    let mut types: HashMap<&str, &str> = HashMap::new();
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((family, kind)) = rest.split_once(' ') {
                types.insert(family, kind.trim());
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((name, labels, value)) = parse_sample(line) else {
            continue;
        };
        let family = SAMPLE_SUFFIXES
            .iter()
            .filter_map(|s| name.strip_suffix(s))
            .find(|f| types.contains_key(f))
            .unwrap_or(name);
        if !names.is_empty() && !names.iter().any(|n| n == name || n == family) {
            continue;
        }
        out.push(Metric {
            name: name.to_owned(),
            r#type: types.get(family).copied().unwrap_or("unknown").to_owned(),
            labels,
            value,
            timestamp_us,
        });
    }
    out
}

/// `name{a="x",b="y"} value [...]` → (name, labels, value).
fn parse_sample(line: &str) -> Option<(&str, BTreeMap<String, String>, f64)> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices();
        let mut key = String::new();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '}' => {
                    end = Some(i);
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    // A quoted value with \\, \" and \n escapes.
                    if chars.next().map(|(_, q)| q) != Some('"') {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.insert(std::mem::take(&mut key), value);
                }
                other => key.push(other),
            }
        }
        rest = &body[end? + 1..];
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;

    #[test]
    fn exposition_samples_become_metrics_with_family_types() {
        let text = "# HELP inferencecache_rpc_calls Calls.\n# TYPE inferencecache_rpc_calls counter\n\
            inferencecache_rpc_calls_total{rpc=\"PublishEvent\"} 3\n\
            # TYPE inferencecache_server_up gauge\ninferencecache_server_up 1\n\
            # TYPE lat histogram\nlat_bucket{le=\"+Inf\",x=\"a \\\"b\\\"\"} 7\nlat_count 7\n# EOF\n";
        let all = parse_exposition(text, &[], 42);
        assert_eq!(all.len(), 4, "{all:?}");
        assert_eq!(all[0].name, "inferencecache_rpc_calls_total");
        assert_eq!(all[0].r#type, "counter");
        assert_eq!(all[0].labels["rpc"], "PublishEvent");
        assert_eq!(all[0].value, 3.0);
        assert_eq!(all[0].timestamp_us, 42);
        assert_eq!(all[1].r#type, "gauge");
        assert_eq!(all[2].labels["le"], "+Inf");
        assert_eq!(all[2].labels["x"], "a \"b\"");
        assert_eq!(all[3].r#type, "histogram");
        let only = parse_exposition(text, &["lat".to_owned()], 0);
        assert_eq!(
            only.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
            ["lat_bucket", "lat_count"]
        );
        let by_sample = parse_exposition(text, &["inferencecache_server_up".to_owned()], 0);
        assert_eq!(by_sample.len(), 1);
    }

    fn update(prefixes: usize) -> index::CacheUpdate {
        index::CacheUpdate {
            replica_id: "r1".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            adapter_id: "base".into(),
            prefixes: (0..prefixes)
                .map(|i| index::PrefixReport {
                    chain: index::BlockChain::new(
                        &[vec![1; 8], vec![u8::try_from(i).unwrap_or(0); 8]],
                        vec![16, 16],
                    )
                    .expect("a valid chain"),
                    ..Default::default()
                })
                .collect(),
            rejected: Vec::new(),
            stats: None,
        }
    }

    #[tokio::test]
    async fn watchers_get_filtered_events_and_a_slow_one_is_dropped() {
        let mut registry = Registry::default();
        let streams = Streams::new(
            &StreamSettings {
                event_buffer: 4,
                ..Default::default()
            },
            &mut registry,
        );
        // Nobody watching: nothing is built or kept.
        streams.emit_update(&update(3));
        let request = StreamEventsRequest {
            tenant_id: "t".into(),
            types: vec![cache_event::Type::PrefixAdded as i32],
            ..Default::default()
        };
        let mut watch = Box::pin(streams.watch(request, Caller::Open));
        streams.emit_update(&update(0)); // REPLICA_UPDATED: filtered out
        streams.emit_update(&update(2));
        let first = watch.next().await.expect("event").expect("ok");
        assert_eq!(first.r#type, cache_event::Type::PrefixAdded as i32);
        assert_eq!(first.prefix_hash, vec![0; 8]);
        assert_eq!(first.adapter_id, "base");
        let second = watch.next().await.expect("event").expect("ok");
        assert_eq!(second.prefix_hash, vec![1; 8]);
        // Fall more than the buffer behind: the watcher is ended, ingest never waited.
        for _ in 0..10 {
            streams.emit_update(&update(1));
        }
        let status = watch.next().await.expect("an end").expect_err("dropped");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(watch.next().await.is_none());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(
            text.contains("stream_consumers_dropped_total{stream=\"events\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn streams_end_cleanly_when_closed() {
        let mut registry = Registry::default();
        let streams = Streams::new(&StreamSettings::default(), &mut registry);
        let mut watch = Box::pin(streams.watch(StreamEventsRequest::default(), Caller::Open));
        let metrics = Arc::new(Metrics::new());
        metrics.record_rpc("PublishEvent");
        let mut snapshots = Box::pin(streams.metric_snapshots(
            metrics,
            StreamMetricsRequest {
                names: vec!["inferencecache_rpc_calls".into()],
            },
        ));
        let first = snapshots.next().await.expect("a metric").expect("ok");
        assert_eq!(first.name, "inferencecache_rpc_calls_total");
        assert_eq!(first.labels["rpc"], "PublishEvent");
        assert_eq!(first.value, 1.0);
        streams.close();
        assert!(watch.next().await.is_none());
        assert!(snapshots.next().await.is_none());
    }

    #[test]
    fn event_conversions_round_trip() {
        let event = index::CacheEvent {
            kind: index::EventKind::PrefixEvicted,
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            prefix_hash: vec![9; 8],
            adapter_id: "a".into(),
        };
        assert_eq!(index_event(&wire_event(&event)), Some(event));
        assert_eq!(index_event(&CacheEvent::default()), None);
    }
}
