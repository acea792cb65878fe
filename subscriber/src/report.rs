//! The gRPC side: actions → `ReportCacheState` stream and `PublishEvent` calls.
//!
//! Stored blocks go out as chain `PrefixEntry`s (content fingerprints in the
//! 8-byte big-endian wire form, one token count per block) batched into
//! `CacheStateUpdate` messages on one long-lived client stream; the bounded
//! channel in front of the stream is the backpressure. Removals and clears
//! are `PublishEvent` calls. Because those travel on a different RPC, the
//! open stream is first finished and its Ack awaited (a barrier), so the
//! server has ingested every earlier store before it sees a removal.
//!
//! Failures never crash the process: a failed call drops the connection,
//! waits with capped, jittered exponential backoff, reconnects and asks the pipeline
//! for a resync (Clear plus the whole tracked state), since the server may
//! have restarted empty or lost messages in flight. A stream is kept open
//! even when idle — a server restart breaks it, which is how the restart is
//! noticed — and is renewed every few seconds so a draining server is not
//! held up for long.
//!
//! Membership: on every connect, and after every `ALL_CLEARED` it sends
//! (which takes the replica out of the serving set), the reporter announces
//! the replica with a `CacheStateUpdate` that carries no prefixes (and the
//! latest engine load when it is fresh). Every `--heartbeat-interval` it
//! publishes `REPLICA_UPDATED`; each good engine scrape becomes a
//! stats-only update. On shutdown it finishes the open stream and sends
//! `ALL_CLEARED` for the replica, best effort within [`GOODBYE_TIMEOUT`].

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::{StreamExt, TryStreamExt};
use inference_cache_fingerprint::encode;
use inference_cache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, CacheTier, PrefixEntry, ReplicaStats, cache_event,
};
use inference_cache_runtime::Backoff;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::args::Settings;
use crate::client::{self, Client, ConnectError};
use crate::load::Scraped;
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, Work};
use crate::tracker::{Action, Tier};

/// How often an idle reporter checks its stream.
const TICK: Duration = Duration::from_secs(1);
/// Longest life of one stream before it is finished and reopened (bounds
/// how long a draining server waits for it).
const MAX_STREAM_AGE: Duration = Duration::from_secs(5);
/// Deadline of a single send, Ack wait or unary call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Concurrent PublishEvent calls.
const PUBLISH_CONCURRENCY: usize = 32;
/// Bound on the goodbye at shutdown: finishing the stream, then
/// `ALL_CLEARED` (connecting first if needed).
pub(crate) const GOODBYE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a call to the server failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReportError {
    #[error("connect: {0}")]
    Connect(#[from] ConnectError),
    #[error("call failed: {0}")]
    Status(#[from] tonic::Status),
    #[error("stream closed by the server")]
    StreamClosed,
    #[error("timed out")]
    Timeout,
}

struct OpenStream {
    tx: mpsc::Sender<CacheStateUpdate>,
    call: JoinHandle<Result<tonic::Response<Ack>, tonic::Status>>,
    opened: Instant,
}

/// Sends the pipeline's work to the server.
pub(crate) struct Reporter {
    settings: Arc<Settings>,
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    client: Option<Client>,
    stream: Option<OpenStream>,
    /// Engine load from the scraper, when `--engine-metrics-url` is set.
    stats: Option<watch::Receiver<Option<Scraped>>>,
    /// New stats arrived while the reporter was waiting.
    stats_pending: bool,
}

impl Reporter {
    pub(crate) fn new(
        settings: Arc<Settings>,
        pipeline: Arc<Pipeline>,
        metrics: Arc<Metrics>,
        stats: Option<watch::Receiver<Option<Scraped>>>,
    ) -> Self {
        Self {
            settings,
            pipeline,
            metrics,
            client: None,
            stream: None,
            stats,
            stats_pending: false,
        }
    }

    /// Runs until `shutdown` flips to true; then says goodbye (finishes the
    /// open stream and sends `ALL_CLEARED`).
    pub(crate) async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut connected_once = false;
        let max_weight = self.settings.max_blocks_per_update.saturating_mul(8);
        let mut next_refresh = self.settings.refresh_interval.map(|i| Instant::now() + i);
        let mut next_heartbeat = self.settings.heartbeat_interval.map(|i| Instant::now() + i);
        loop {
            if *shutdown.borrow() {
                break;
            }
            if self.client.is_none() {
                let connected = tokio::select! {
                    connected = self.connect() => connected,
                    _ = shutdown.changed() => break,
                };
                match connected {
                    Ok(client) => {
                        self.client = Some(client);
                        if connected_once {
                            // The server may have restarted empty or lost
                            // messages in flight: re-send the whole state.
                            self.pipeline.request_resync();
                        }
                        connected_once = true;
                        let mut result = self.maintain_stream().await;
                        if result.is_ok() {
                            result = self.announce().await;
                        }
                        if let Err(error) = result {
                            self.fail(&error);
                            backoff.wait(shutdown.changed()).await;
                            continue;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, server = %self.settings.server, "server unavailable");
                        self.metrics.server_errors.inc();
                        backoff.wait(shutdown.changed()).await;
                        continue;
                    }
                }
            }
            if self.stats_pending || self.stats_changed() {
                self.stats_pending = false;
                if let Err(error) = self.send_stats().await {
                    self.fail(&error);
                    backoff.wait(shutdown.changed()).await;
                    continue;
                }
            }
            if let (Some(due), Some(interval)) = (next_heartbeat, self.settings.heartbeat_interval)
                && Instant::now() >= due
            {
                next_heartbeat = Some(Instant::now() + interval);
                match self.heartbeat().await {
                    Ok(()) => backoff.reset(),
                    Err(error) => {
                        self.fail(&error);
                        backoff.wait(shutdown.changed()).await;
                        continue;
                    }
                }
            }
            if let (Some(due), Some(interval)) = (next_refresh, self.settings.refresh_interval)
                && Instant::now() >= due
            {
                next_refresh = Some(Instant::now() + interval);
                match self.refresh().await {
                    Ok(()) => backoff.reset(),
                    Err(error) => {
                        self.fail(&error);
                        backoff.wait(shutdown.changed()).await;
                    }
                }
                continue;
            }
            let work = match self.pipeline.try_take(max_weight, &self.metrics) {
                Some(work) => work,
                None => {
                    let wake = [next_heartbeat, next_refresh]
                        .into_iter()
                        .flatten()
                        .fold(Instant::now() + TICK, Instant::min);
                    let idle = tokio::select! {
                        () = self.pipeline.wait() => false,
                        () = tokio::time::sleep_until(wake.into()) => true,
                        changed = next_stats(&mut self.stats) => {
                            self.stats_pending = changed;
                            false
                        }
                        _ = shutdown.changed() => false,
                    };
                    if idle && let Err(error) = self.maintain_stream().await {
                        self.fail(&error);
                        backoff.wait(shutdown.changed()).await;
                    }
                    continue;
                }
            };
            let actions = match work {
                Work::Actions(actions) => actions,
                Work::Resync(actions) => {
                    self.metrics.resyncs.inc();
                    tracing::info!(actions = actions.len(), "re-sending the tracked state");
                    actions
                }
            };
            // A slow server must not hold up shutdown (and the goodbye).
            let result = tokio::select! {
                result = self.send_actions(actions) => result,
                _ = shutdown.changed() => break,
            };
            match result {
                Ok(()) => backoff.reset(),
                Err(error) => {
                    self.fail(&error);
                    backoff.wait(shutdown.changed()).await;
                }
            }
        }
        self.goodbye().await;
    }

    /// Says goodbye: finishes the open stream (so what it carried is
    /// ingested first), then `ALL_CLEARED` for the replica. Pending deltas
    /// are not sent (the clear would undo them). Best effort, bounded by
    /// [`GOODBYE_TIMEOUT`].
    async fn goodbye(&mut self) {
        let attempt = async {
            if self.client.is_none() {
                self.client = Some(self.connect().await?);
            }
            if let Err(error) = self.finish_stream().await {
                tracing::debug!(%error, "closing the report stream on shutdown");
            }
            let clear = self.event(cache_event::Type::AllCleared, Vec::new(), "");
            self.publish(vec![clear]).await
        };
        let outcome = tokio::time::timeout(GOODBYE_TIMEOUT, attempt).await;
        match outcome {
            Ok(Ok(())) => {
                self.metrics.goodbyes.inc();
                tracing::info!(replica = %self.settings.replica_id, "replica left the serving set (ALL_CLEARED)");
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "could not send ALL_CLEARED on shutdown");
            }
            Err(_) => {
                tracing::warn!(
                    timeout = ?GOODBYE_TIMEOUT,
                    "could not send ALL_CLEARED on shutdown: timed out"
                );
            }
        }
        if let Some(stream) = self.stream.take() {
            stream.call.abort();
        }
    }

    /// Announces the replica: an update with no prefixes (the latest load
    /// when fresh). Any update makes the replica a member of its serving
    /// set.
    async fn announce(&mut self) -> Result<(), ReportError> {
        let stats = self.fresh_stats();
        self.send_update(Vec::new(), stats).await?;
        self.metrics.announcements.inc();
        Ok(())
    }

    /// Publishes `REPLICA_UPDATED` (liveness).
    async fn heartbeat(&mut self) -> Result<(), ReportError> {
        let alive = self.event(cache_event::Type::ReplicaUpdated, Vec::new(), "");
        self.publish(vec![alive]).await?;
        self.metrics.heartbeats.inc();
        Ok(())
    }

    /// Whether the scraper published stats not sent yet.
    fn stats_changed(&self) -> bool {
        self.stats
            .as_ref()
            .is_some_and(|rx| rx.has_changed().unwrap_or(false))
    }

    /// Sends the newest scraped stats (stats-only update), unless stale.
    async fn send_stats(&mut self) -> Result<(), ReportError> {
        let Some(rx) = self.stats.as_mut() else {
            return Ok(());
        };
        let latest = rx.borrow_and_update().clone();
        match latest {
            Some(scraped) if self.is_fresh(&scraped) => {
                self.send_update(Vec::new(), Some(scraped.stats)).await
            }
            _ => Ok(()),
        }
    }

    /// Stats younger than three scrape intervals (at least 3s).
    fn is_fresh(&self, scraped: &Scraped) -> bool {
        let max_age = (self.settings.metrics_interval * 3).max(Duration::from_secs(3));
        scraped.at.elapsed() <= max_age
    }

    fn fresh_stats(&self) -> Option<ReplicaStats> {
        let rx = self.stats.as_ref()?;
        let latest = rx.borrow();
        latest
            .as_ref()
            .filter(|scraped| self.is_fresh(scraped))
            .map(|scraped| scraped.stats.clone())
    }

    /// Re-reports every held block and refreshes the replica's liveness.
    async fn refresh(&mut self) -> Result<(), ReportError> {
        let actions = self.pipeline.snapshot();
        tracing::debug!(actions = actions.len(), "refreshing held blocks");
        self.metrics.refreshes.inc();
        self.send_actions(actions).await?;
        let alive = self.event(cache_event::Type::ReplicaUpdated, Vec::new(), "");
        self.publish(vec![alive]).await
    }

    fn fail(&mut self, error: &ReportError) {
        tracing::warn!(%error, "report to the server failed; reconnecting");
        self.metrics.server_errors.inc();
        if let Some(stream) = self.stream.take() {
            stream.call.abort();
        }
        self.client = None;
    }

    async fn connect(&self) -> Result<Client, ReportError> {
        Ok(client::connect(&self.settings).await?)
    }

    async fn send_actions(&mut self, actions: Vec<Action>) -> Result<(), ReportError> {
        let mut entries: Vec<PrefixEntry> = Vec::new();
        let mut entry_blocks = 0usize;
        let mut events: Vec<CacheEvent> = Vec::new();
        let max_blocks = self.settings.max_blocks_per_update;
        for action in actions {
            match action {
                Action::Store {
                    adapter,
                    tier,
                    fingerprints,
                } => {
                    if !events.is_empty() {
                        self.publish(std::mem::take(&mut events)).await?;
                    }
                    for chunk in fingerprints.chunks(max_blocks) {
                        if entry_blocks + chunk.len() > max_blocks && !entries.is_empty() {
                            self.send_update(std::mem::take(&mut entries), None).await?;
                            entry_blocks = 0;
                        }
                        entry_blocks += chunk.len();
                        entries.push(self.entry(&adapter, tier, chunk));
                    }
                }
                Action::Evict {
                    adapter,
                    fingerprints,
                } => {
                    self.flush_before_events(&mut entries, &mut entry_blocks)
                        .await?;
                    events.extend(fingerprints.iter().map(|fp| {
                        self.event(
                            cache_event::Type::PrefixEvicted,
                            encode(*fp).to_vec(),
                            &adapter,
                        )
                    }));
                }
                Action::Clear => {
                    self.flush_before_events(&mut entries, &mut entry_blocks)
                        .await?;
                    events.push(self.event(cache_event::Type::AllCleared, Vec::new(), ""));
                    // Order matters around a clear: send what precedes it now.
                    self.publish(std::mem::take(&mut events)).await?;
                    // ALL_CLEARED also takes the replica out of the serving
                    // set; it is still alive, with an empty cache.
                    self.announce().await?;
                }
            }
        }
        if !entries.is_empty() {
            self.send_update(entries, None).await?;
        }
        if !events.is_empty() {
            self.publish(events).await?;
        }
        Ok(())
    }

    async fn flush_before_events(
        &mut self,
        entries: &mut Vec<PrefixEntry>,
        entry_blocks: &mut usize,
    ) -> Result<(), ReportError> {
        if !entries.is_empty() {
            self.send_update(std::mem::take(entries), None).await?;
            *entry_blocks = 0;
        }
        // Barrier: every store sent so far is ingested before a removal.
        self.finish_stream().await
    }

    fn entry(&self, adapter: &str, tier: Tier, fingerprints: &[u64]) -> PrefixEntry {
        let block_size = i32::try_from(self.settings.block_size).unwrap_or(i32::MAX);
        PrefixEntry {
            prefix_hash: Vec::new(),
            token_count: block_size
                .saturating_mul(i32::try_from(fingerprints.len()).unwrap_or(i32::MAX)),
            block_hashes: fingerprints.iter().map(|fp| encode(*fp).to_vec()).collect(),
            block_token_counts: vec![block_size; fingerprints.len()],
            tier: match tier {
                Tier::T1 => CacheTier::T1,
                Tier::T2 => CacheTier::T2,
            } as i32,
            adapter_id: adapter.to_owned(),
        }
    }

    fn event(&self, kind: cache_event::Type, prefix_hash: Vec<u8>, adapter: &str) -> CacheEvent {
        CacheEvent {
            r#type: kind as i32,
            replica_id: self.settings.replica_id.clone(),
            model_id: self.settings.model.clone(),
            tenant_id: self.settings.tenant.clone(),
            prefix_hash,
            timestamp_us: now_us(),
            adapter_id: adapter.to_owned(),
        }
    }

    async fn send_update(
        &mut self,
        prefixes: Vec<PrefixEntry>,
        stats: Option<ReplicaStats>,
    ) -> Result<(), ReportError> {
        let with_stats = stats.is_some();
        let blocks: usize = prefixes.iter().map(|p| p.block_hashes.len()).sum();
        let update = CacheStateUpdate {
            replica_id: self.settings.replica_id.clone(),
            model_id: self.settings.model.clone(),
            tenant_id: self.settings.tenant.clone(),
            hash_scheme: self.settings.hash_scheme.clone(),
            timestamp_us: now_us(),
            prefixes,
            stats,
            adapter_id: String::new(),
        };
        let stream = self.open_stream()?;
        match tokio::time::timeout(CALL_TIMEOUT, stream.tx.send(update)).await {
            Ok(Ok(())) => {
                self.metrics.updates_sent.inc();
                self.metrics.blocks_sent.inc_by(blocks as u64);
                if with_stats {
                    self.metrics.stats_sent.inc();
                }
            }
            Ok(Err(_closed)) => return Err(self.stream_failure().await),
            Err(_) => return Err(ReportError::Timeout),
        }
        if self
            .stream
            .as_ref()
            .is_some_and(|s| s.opened.elapsed() > MAX_STREAM_AGE)
        {
            self.finish_stream().await?;
        }
        Ok(())
    }

    fn open_stream(&mut self) -> Result<&mut OpenStream, ReportError> {
        if self.stream.is_none() {
            let mut client = self.client.clone().ok_or(ReportError::StreamClosed)?;
            let (tx, rx) = mpsc::channel(16);
            let call =
                tokio::spawn(
                    async move { client.report_cache_state(ReceiverStream::new(rx)).await },
                );
            self.stream = Some(OpenStream {
                tx,
                call,
                opened: Instant::now(),
            });
        }
        self.stream.as_mut().ok_or(ReportError::StreamClosed)
    }

    /// The stream's sender is closed: report why the call ended.
    async fn stream_failure(&mut self) -> ReportError {
        let Some(stream) = self.stream.take() else {
            return ReportError::StreamClosed;
        };
        match tokio::time::timeout(CALL_TIMEOUT, stream.call).await {
            Ok(Ok(Err(status))) => ReportError::Status(status),
            Ok(_) => ReportError::StreamClosed,
            Err(_) => ReportError::Timeout,
        }
    }

    /// Ends the open stream and waits for the server's Ack.
    async fn finish_stream(&mut self) -> Result<(), ReportError> {
        let Some(stream) = self.stream.take() else {
            return Ok(());
        };
        drop(stream.tx);
        match tokio::time::timeout(CALL_TIMEOUT, stream.call).await {
            Ok(Ok(Ok(response))) => {
                self.check_ack(&response.into_inner());
                Ok(())
            }
            Ok(Ok(Err(status))) => Err(ReportError::Status(status)),
            Ok(Err(_join)) => Err(ReportError::StreamClosed),
            Err(_) => Err(ReportError::Timeout),
        }
    }

    /// Keeps one stream open: notices a stream the server ended (a failure
    /// when it ended in error), renews an old one, opens one if none.
    async fn maintain_stream(&mut self) -> Result<(), ReportError> {
        if let Some(stream) = &self.stream
            && (stream.call.is_finished() || stream.opened.elapsed() >= MAX_STREAM_AGE)
        {
            self.finish_stream().await?;
        }
        self.open_stream()?;
        Ok(())
    }

    async fn publish(&mut self, events: Vec<CacheEvent>) -> Result<(), ReportError> {
        let client = self.client.clone().ok_or(ReportError::StreamClosed)?;
        let count = events.len() as u64;
        let metrics = self.metrics.clone();
        let calls = futures::stream::iter(events.into_iter().map(|event| {
            let mut client = client.clone();
            async move {
                match tokio::time::timeout(CALL_TIMEOUT, client.publish_event(event)).await {
                    Ok(Ok(response)) => Ok(response.into_inner()),
                    Ok(Err(status)) => Err(ReportError::Status(status)),
                    Err(_) => Err(ReportError::Timeout),
                }
            }
        }))
        .buffered(PUBLISH_CONCURRENCY);
        calls
            .try_for_each(|ack| {
                if !ack.accepted {
                    metrics.acks_rejected.inc();
                }
                futures::future::ready(Ok(()))
            })
            .await?;
        self.metrics.events_published.inc_by(count);
        Ok(())
    }

    fn check_ack(&self, ack: &Ack) {
        if !ack.accepted {
            self.metrics.acks_rejected.inc();
            tracing::warn!(reason = %ack.reason_code, "server did not accept the cache-state stream");
        }
    }
}

/// Waits for new scraped stats: true when there are some; never resolves
/// without a scraper (or once it is gone).
async fn next_stats(stats: &mut Option<watch::Receiver<Option<Scraped>>>) -> bool {
    match stats {
        Some(rx) => {
            if rx.changed().await.is_ok() {
                return true;
            }
            *stats = None;
            futures::future::pending().await
        }
        None => futures::future::pending().await,
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
