//! KV-event subscriber: feeds the inference-cache index from engine KV events.
//!
//! vLLM (and SGLang, with the same event shapes) publish every change of
//! their prefix cache on a ZMQ PUB socket: `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`, in msgpack batches. The subscriber listens to one
//! engine (one endpoint per data-parallel rank) and keeps the server's index
//! in step with it:
//!
//! - stored blocks are fingerprinted from their `token_ids` with
//!   `inference-cache-fingerprint` (the engine's own hashes are seeded per
//!   process and useless to gateways), chained from the parent block's
//!   fingerprint, and reported at tier T1 on a long-lived `ReportCacheState`
//!   stream;
//! - removals become `PublishEvent(PREFIX_EVICTED)` — or a T2 re-report when
//!   an offload tier still holds the block — and a cleared cache becomes
//!   `ALL_CLEARED`;
//! - LoRA blocks are partitioned by adapter name (`lora_name`, or `lora_id`
//!   through `--lora-adapter-names`); unmapped ids are dropped;
//! - salted blocks (vLLM `extra_keys` from 0.18, on a request's first block
//!   and inherited by its children; SGLang `cache_salt`) are reported, and
//!   evicted, under `partition_key(adapter, salt)`, so only lookups with the
//!   same salt match them;
//! - sequence gaps are filled from the engine's replay socket; ZMQ and gRPC
//!   connections are re-established with backoff; while the server is away a
//!   bounded buffer holds pending work (oldest dropped, counted) and the whole
//!   tracked state is re-sent once it is back;
//! - a subscriber that starts (or restarts) after its engine asks the replay
//!   socket for everything from sequence 0 when its first frame is later
//!   than 0, so blocks stored while it was away are not lost.
//!
//! Fleet membership: at start (and on every reconnect) the replica is
//! announced with a `ReportCacheState` update carrying tenant, model, hash
//! scheme, replica id and no prefixes (with the engine's load when known);
//! `PublishEvent(REPLICA_UPDATED)` naming tenant and model is sent every
//! `--heartbeat-interval` (default 5s — keep it well below the server's
//! `replicaTimeout`, default 30s, or the replica drops out of the serving
//! set between beats); after any `ALL_CLEARED` the replica is announced
//! again (it is alive, with an empty cache); on SIGTERM / SIGINT and
//! [`Subscriber::shutdown`] it says goodbye with `PublishEvent(ALL_CLEARED)`,
//! best effort within 3s.
//!
//! Load: with `--engine-metrics-url` the engine's Prometheus page is scraped
//! every `--metrics-interval` (default 1s) and sent as `ReplicaStats` in a
//! stats-only update. The metric mapping (vLLM old and new names, SGLang)
//! and the `pressure` formula, `max(kv_cache_usage, waiting / (waiting +
//! running + 1))`, are documented in [`load`]; [`exposition`] is the
//! text-format reader.
//!
//! Configuration self-check ([`selfcheck`]): every scrape compares vLLM's
//! `vllm:cache_config_info` (`block_size`, `enable_prefix_caching`) with
//! `--block-size`, and every `BlockStored` event's `block_size` is compared
//! too; a mismatch is a rate-limited WARN, the gauge
//! `inferencecache_subscriber_config_mismatch{field}` = 1 and a 503 from
//! `/readyz` on the `--metrics-listen` address, naming the mismatch.
//!
//! Security: `--server https://...` uses TLS (rustls, `ring`), verified
//! against `--tls-ca` or the system roots; `--tls-cert` / `--tls-key` add a
//! client certificate (mutual TLS); `--token-file` sends `authorization:
//! Bearer <token>` on every call, re-read on each reconnect.
//!
//! Main types: [`SubscribeArgs`] (the `inference-cache subscribe` flags),
//! [`Settings`] (validated), [`Subscriber`] (a running instance) and
//! [`run`] (the subcommand's body). Decoding is exposed as [`decode_batch`]
//! for tools and benchmarks.
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! use inference_cache_subscriber::{SubscribeArgs, Subscriber};
//!
//! let args = SubscribeArgs::try_parse_from([
//!     "subscribe", "--endpoint", "tcp://127.0.0.1:5557",
//!     "--replica-id", "10.0.0.7:8000", "--tenant", "team-a", "--model", "qwen3",
//! ])?;
//! let subscriber = Subscriber::start(args.resolve()?).await?;
//! // ... later
//! subscriber.shutdown().await;
//! # Ok(())
//! # }
//! ```

mod args;
mod client;
mod decode;
mod event;
pub mod exposition;
pub mod load;
mod metrics;
mod pipeline;
mod report;
pub mod selfcheck;
mod source;
mod tracker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use args::{
    DEFAULT_REFRESH_INTERVAL, EndpointSettings, MetricsUrl, Settings, SettingsError, SubscribeArgs,
    TlsSettings,
};
pub use client::ClientSetupError;
pub use decode::{DecodeError, decode_batch};
pub use event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
pub use exposition::{Exposition, Sample, parse_exposition, parse_sample, parse_value};
pub use load::{EngineLoad, EngineReading, LoadEstimator, pressure};
pub use metrics::Metrics;

use pipeline::Pipeline;
use report::Reporter;
use source::Source;
use tracker::TrackerOptions;

/// A running subscriber: one reader task per endpoint, one reporter task and
/// the optional `/metrics` listener.
#[derive(Debug)]
pub struct Subscriber {
    metrics: Arc<Metrics>,
    metrics_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// The subscriber could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The `/metrics` listener could not bind.
    #[error("cannot listen for /metrics on {addr}: {source}")]
    MetricsListen {
        /// Requested address.
        addr: SocketAddr,
        /// Bind error.
        source: std::io::Error,
    },
    /// A TLS or token file named by the flags is unusable.
    #[error("server client: {0}")]
    Client(#[from] ClientSetupError),
}

impl Subscriber {
    /// Starts every task; returns once the `/metrics` listener is bound.
    /// Connections to engines and the server are made in the background.
    pub async fn start(settings: Settings) -> Result<Self, StartError> {
        client::check(&settings)?;
        if settings.token_file.is_some() && settings.tls.is_none() {
            tracing::warn!(
                server = %settings.server,
                "--token-file with a plaintext --server: the bearer token crosses the network unencrypted"
            );
        }
        let settings = Arc::new(settings);
        let metrics = Arc::new(Metrics::new());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let options = TrackerOptions {
            block_size: settings.block_size,
            offload_tier: settings.offload_tier,
            lora_names: settings.lora_names.clone(),
            capacity: settings.max_tracked_blocks,
        };
        let pipeline = Arc::new(Pipeline::new(
            settings.endpoints.len(),
            &options,
            settings.buffer_size,
        ));
        let mut tasks = Vec::new();
        let mut metrics_addr = None;
        if let Some(addr) = settings.metrics_listen {
            let mut rx = shutdown_rx.clone();
            let stop = async move {
                let _ = rx.wait_for(|stop| *stop).await;
            };
            let (bound, task) = metrics::serve(addr, metrics.clone(), stop)
                .await
                .map_err(|source| StartError::MetricsListen { addr, source })?;
            metrics_addr = Some(bound);
            tasks.push(task);
        }
        let stats = settings.engine_metrics_url.clone().map(|url| {
            let (tx, rx) = watch::channel(None);
            tasks.push(tokio::spawn(load::run_scraper(
                url,
                settings.metrics_interval,
                settings.replica_id.clone(),
                settings.block_size,
                tx,
                metrics.clone(),
                shutdown_rx.clone(),
            )));
            rx
        });
        let reporter = Reporter::new(settings.clone(), pipeline.clone(), metrics.clone(), stats);
        tasks.push(tokio::spawn(reporter.run(shutdown_rx.clone())));
        for index in 0..settings.endpoints.len() {
            let source = Source::new(index, &settings, pipeline.clone(), metrics.clone());
            tasks.push(tokio::spawn(source.run(shutdown_rx.clone())));
        }
        tracing::info!(
            endpoints = settings.endpoints.len(),
            server = %settings.server,
            replica = %settings.replica_id,
            tenant = %settings.tenant,
            model = %settings.model,
            heartbeat = ?settings.heartbeat_interval,
            engine_metrics = ?settings.engine_metrics_url.as_ref().map(ToString::to_string),
            "KV-event subscriber started"
        );
        Ok(Self {
            metrics,
            metrics_addr,
            shutdown,
            tasks,
        })
    }

    /// The subscriber's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Where `/metrics` is served, if enabled.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Stops every task, finishing the report stream (bounded wait).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }
}

/// Body of `inference-cache subscribe`: runs until SIGINT or SIGTERM, then
/// shuts down gracefully (the replica says goodbye with `ALL_CLEARED`).
pub async fn run(args: SubscribeArgs) -> anyhow::Result<()> {
    let settings = args.resolve()?;
    // Signal handlers first: a signal that arrives while starting is not lost
    // (nor does it kill the process without the goodbye).
    let signal = inference_cache_runtime::termination_signal()?;
    let subscriber = Subscriber::start(settings).await?;
    if let Some(addr) = subscriber.metrics_addr() {
        tracing::info!(%addr, "serving subscriber /metrics");
    }
    signal.await;
    tracing::info!("shutting down the KV-event subscriber");
    subscriber.shutdown().await;
    Ok(())
}
