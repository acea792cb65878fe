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
//! - sequence gaps are filled from the engine's replay socket; ZMQ and gRPC
//!   connections are re-established with backoff; while the server is away a
//!   bounded buffer holds pending work (oldest dropped, counted) and the whole
//!   tracked state is re-sent once it is back.
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
mod decode;
mod event;
mod metrics;
mod pipeline;
mod report;
mod source;
mod tracker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use args::{EndpointSettings, Settings, SettingsError, SubscribeArgs};
pub use decode::{DecodeError, decode_batch};
pub use event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
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
}

impl Subscriber {
    /// Starts every task; returns once the `/metrics` listener is bound.
    /// Connections to engines and the server are made in the background.
    pub async fn start(settings: Settings) -> Result<Self, StartError> {
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
        let reporter = Reporter::new(settings.clone(), pipeline.clone(), metrics.clone());
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

/// Body of `inference-cache subscribe`: runs until SIGINT or SIGTERM.
pub async fn run(args: SubscribeArgs) -> anyhow::Result<()> {
    let settings = args.resolve()?;
    let subscriber = Subscriber::start(settings).await?;
    if let Some(addr) = subscriber.metrics_addr() {
        tracing::info!(%addr, "serving subscriber /metrics");
    }
    shutdown_signal().await;
    tracing::info!("shutting down the KV-event subscriber");
    subscriber.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
