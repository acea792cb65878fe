//! Starting and stopping the server: binds both listeners, wires the services,
//! and shuts down in stages.
//!
//! Shutdown (SIGTERM, SIGINT or [`RunningServer::shutdown`]): `/readyz`
//! answers 503 and gRPC health reports NOT_SERVING at once; after
//! `--shutdown-delay` (time for load balancers to notice) both listeners stop
//! accepting and in-flight calls drain; after `--drain-timeout` the calls
//! still open (a producer stream that never closes) are ended with
//! UNAVAILABLE and the server stops without waiting for them. The observer
//! streams (StreamCacheEvents, StreamMetrics) end with OK at the first step.
//!
//! With `--nats-url` the index is fed from the shared log too, and `/readyz`
//! answers 503 (gRPC health NOT_SERVING for the service) until the log has
//! been replayed (see `replication.rs`). At the end of a shutdown the
//! appends still queued for the log are published (for at most
//! `--nats-ack-timeout`) before the server reports stopped.

use std::future::{Future, IntoFuture as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use inference_cache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;
use tonic::transport::ServerTlsConfig;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use crate::admin::{self, AdminState};
use crate::auth::Authorizer;
use crate::config::ServeConfig;
use crate::grpc::CacheService;
use crate::index_runtime::{ClockHandle, IndexState};
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::prompt_inputs::PromptState;
use crate::replication::{self, ReplayClock};
use crate::security::SecuritySettings;

/// How often gRPC health looks at readiness while the shared log is replayed.
const READY_POLL: Duration = Duration::from_millis(20);

/// How long handlers get to end their streams once the drain deadline cuts them.
const CUT_GRACE: Duration = Duration::from_secs(1);

/// A started server. Dropping it does not stop it; call [`RunningServer::shutdown`].
pub struct RunningServer {
    /// Bound gRPC address (the real port when configured with port 0).
    pub grpc_addr: SocketAddr,
    /// Bound admin HTTP address.
    pub admin_addr: SocketAddr,
    shutdown: CancellationToken,
    tasks: JoinHandle<anyhow::Result<()>>,
}

impl RunningServer {
    /// A token that starts the shutdown sequence when cancelled (e.g. from a signal handler).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until the server stops (after its shutdown token is cancelled).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.tasks.await.context("server task panicked")?
    }

    /// Runs the shutdown sequence (not ready, delay, drain, cut) and waits for both listeners to close.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.wait().await
    }
}

/// True for a response refusing a message over `--grpc-max-message-bytes`.
fn is_oversized(headers: &http::HeaderMap) -> bool {
    headers.get("grpc-status").is_some_and(|v| v == "11")
        && headers
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            // grpc-message is percent-encoded (spaces as %20).
            .is_some_and(|m| m.replace("%20", " ").contains("message length too large"))
}

/// Reports the service SERVING on gRPC health once `ready` is set (the
/// shared log replayed), unless the shutdown started first.
fn spawn_serving_when_ready(
    reporter: tonic_health::server::HealthReporter,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        while !ready.load(Ordering::Acquire) {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(READY_POLL) => {}
            }
        }
        if !shutdown.is_cancelled() {
            reporter
                .set_serving::<InferenceCacheServer<CacheService>>()
                .await;
        }
    });
}

/// Resolves `drain` after `stop` is cancelled.
async fn drain_deadline(stop: CancellationToken, drain: Duration) {
    stop.cancelled().await;
    tokio::time::sleep(drain).await;
}

/// The cancellation tokens of the shutdown, one per stage.
#[derive(Clone)]
struct Stages {
    /// The trigger: not ready from here on.
    shutdown: CancellationToken,
    /// After the shutdown delay: both listeners stop accepting.
    stop_accepting: CancellationToken,
    /// At the drain deadline: the calls still open are ended.
    cut: CancellationToken,
    /// Once both listeners have closed: the shared log's tasks stop.
    log_stop: CancellationToken,
}

impl Stages {
    fn new() -> Self {
        Self {
            shutdown: CancellationToken::new(),
            stop_accepting: CancellationToken::new(),
            cut: CancellationToken::new(),
            log_stop: CancellationToken::new(),
        }
    }
}

/// The cache index and, with `--nats-url`, the shared log feeding it.
struct IndexAndLog {
    index: Arc<IndexState>,
    /// Set once the index is complete: at once without a shared log, after
    /// the replay with one.
    ready: Arc<AtomicBool>,
    /// The shared log's publisher, which ends once the appends still queued
    /// are published.
    publisher: Option<JoinHandle<()>>,
}

/// Producer authentication and the gRPC listener's TLS.
struct ProducerGuards {
    auth: Arc<Authorizer>,
    tls: Option<ServerTlsConfig>,
}

/// Both listeners, bound, and their addresses (the real ports for port 0).
struct Listeners {
    grpc: TcpListener,
    grpc_addr: SocketAddr,
    admin: TcpListener,
    admin_addr: SocketAddr,
}

/// gRPC health: the reporter the shutdown sequence sets, and its service.
struct GrpcHealth {
    reporter: HealthReporter,
    service: HealthServer<HealthService>,
}

/// Binds the listeners and starts serving in the background.
pub async fn start(config: ServeConfig) -> anyhow::Result<RunningServer> {
    config
        .outcomes
        .watch
        .validate()
        .map_err(anyhow::Error::msg)?;
    let mut metrics = Metrics::with_outcomes(config.outcomes.clone());
    let stages = Stages::new();
    let IndexAndLog {
        index,
        ready,
        publisher,
    } = start_index(&config, &mut metrics, &stages).await?;
    // Stops the log tasks if start-up fails from here on.
    let log_guard = stages.log_stop.clone().drop_guard();
    let prompts = Arc::new(PromptState::new(
        &config.prompts,
        config.limits.tokenize_concurrency,
        metrics.registry_mut(),
    )?);
    let metrics = Arc::new(metrics);
    let ProducerGuards { auth, tls } = producer_guards(&config.security)?;
    let listeners = bind(&config).await?;
    let grpc_addr = listeners.grpc_addr;
    let admin_addr = listeners.admin_addr;
    let health = grpc_health(&ready, &stages.shutdown).await;

    let limits = Arc::new(config.limits.clone());
    let service = InferenceCacheServer::new(
        CacheService::new(
            Arc::clone(&metrics),
            Arc::clone(&index),
            Arc::clone(&prompts),
        )
        .with_guards(Arc::clone(&limits), Arc::clone(&auth), stages.cut.clone()),
    )
    .max_decoding_message_size(limits.grpc_max_message_bytes);
    let drain = config.shutdown.drain_timeout;
    let grpc = grpc_server(
        GrpcServer {
            listener: listeners.grpc,
            health: health.service,
            service,
            limits: &limits,
            tls,
            metrics: &metrics,
        },
        &stages,
        drain,
    )?;
    let admin = admin_server(
        listeners.admin,
        AdminState {
            metrics: Arc::clone(&metrics),
            ready: Arc::clone(&ready),
        },
        index.routes(config.security.admin_policy, config.security.admin_snapshot),
        &stages,
        drain,
    );
    // Nothing fails from here on: the background tasks start.
    spawn_background_tasks(&config, &index, &prompts, &metrics, &auth, &stages);
    metrics.server_up.set(1);
    let sequence = shutdown_sequence(ShutdownSequence {
        stages: stages.clone(),
        ready,
        index,
        metrics,
        health: health.reporter,
        delay: config.shutdown.delay,
        drain,
    });

    tracing::info!(%grpc_addr, %admin_addr, tls = config.security.tls.is_some(), auth = auth.enabled(), "serving");
    let log_stop = log_guard.disarm();
    let tasks = tokio::spawn(async move {
        let (grpc, admin, ()) = tokio::join!(grpc, admin, sequence);
        log_stop.cancel();
        if let Some(publisher) = publisher {
            // Appends still queued reach the log before the process exits.
            let _ = publisher.await;
        }
        grpc.context("gRPC server")?;
        admin.context("admin HTTP server")?;
        tracing::info!("stopped");
        Ok(())
    });
    Ok(RunningServer {
        grpc_addr,
        admin_addr,
        shutdown: stages.shutdown,
        tasks,
    })
}

/// The index, on a clock the shared log's replay can drive when there is
/// one, and the shared log's tasks.
async fn start_index(
    config: &ServeConfig,
    metrics: &mut Metrics,
    stages: &Stages,
) -> anyhow::Result<IndexAndLog> {
    let mut index_settings = config.index.clone();
    let replay_clock = config.replication.as_ref().map(|_| {
        let clock = Arc::new(ReplayClock::new(Arc::clone(&config.index.clock.0)));
        index_settings.clock = ClockHandle(clock.clone());
        clock
    });
    let index = Arc::new(IndexState::new(&index_settings, metrics.registry_mut())?);
    // Without a shared log the index is complete at once; with one, ready after the replay.
    let ready = Arc::new(AtomicBool::new(config.replication.is_none()));
    let mut publisher = None;
    if let (Some(settings), Some(clock)) = (config.replication.clone(), replay_clock) {
        publisher = Some(
            replication::start(
                settings,
                Arc::clone(&index),
                clock,
                metrics.registry_mut(),
                Arc::clone(&ready),
                stages.shutdown.clone(),
                stages.log_stop.clone(),
            )
            .await?,
        );
    }
    Ok(IndexAndLog {
        index,
        ready,
        publisher,
    })
}

/// Loads the producers' principals and the TLS files, and warns about what
/// is left open.
fn producer_guards(security: &SecuritySettings) -> anyhow::Result<ProducerGuards> {
    let auth = Arc::new(Authorizer::new(
        security.auth_file.clone(),
        security.allow_unauthenticated_producers,
    )?);
    let tls = security
        .tls
        .as_ref()
        .map(|files| files.server_config())
        .transpose()?;
    if !auth.enabled() {
        if security.allow_unauthenticated_producers {
            tracing::warn!(
                "PRODUCERS ARE UNAUTHENTICATED: no --auth-file, and --allow-unauthenticated-producers accepts ReportCacheState / PublishEvent from any peer; anyone who can reach the gRPC port can steer routing"
            );
        } else {
            tracing::warn!(
                "PRODUCERS ARE UNAUTHENTICATED: no --auth-file; ReportCacheState / PublishEvent are accepted from loopback peers only (others are refused PERMISSION_DENIED); set --auth-file to admit remote producers"
            );
        }
    } else if tls.is_none() {
        tracing::warn!("--auth-file without --tls-cert: bearer tokens travel in plaintext");
    }
    Ok(ProducerGuards { auth, tls })
}

async fn bind(config: &ServeConfig) -> anyhow::Result<Listeners> {
    let grpc = TcpListener::bind(config.grpc_addr)
        .await
        .with_context(|| format!("binding the gRPC listener on {}", config.grpc_addr))?;
    let admin = TcpListener::bind(config.admin_addr)
        .await
        .with_context(|| format!("binding the admin listener on {}", config.admin_addr))?;
    Ok(Listeners {
        grpc_addr: grpc.local_addr()?,
        admin_addr: admin.local_addr()?,
        grpc,
        admin,
    })
}

/// gRPC health, serving once the index is `ready` (what `/readyz` says).
async fn grpc_health(ready: &Arc<AtomicBool>, shutdown: &CancellationToken) -> GrpcHealth {
    let reporter = HealthReporter::new();
    let service = HealthServer::new(HealthService::from_health_reporter(reporter.clone()));
    if ready.load(Ordering::Acquire) {
        reporter
            .set_serving::<InferenceCacheServer<CacheService>>()
            .await;
    } else {
        // Replaying the shared log: gRPC health says what /readyz says.
        reporter
            .set_not_serving::<InferenceCacheServer<CacheService>>()
            .await;
        spawn_serving_when_ready(reporter.clone(), Arc::clone(ready), shutdown.clone());
    }
    GrpcHealth { reporter, service }
}

/// The sweep, the canary, the accuracy watch and the file watchers, until
/// the listeners stop accepting.
fn spawn_background_tasks(
    config: &ServeConfig,
    index: &Arc<IndexState>,
    prompts: &Arc<PromptState>,
    metrics: &Arc<Metrics>,
    auth: &Arc<Authorizer>,
    stages: &Stages,
) {
    let stop = &stages.stop_accepting;
    index.spawn_background(config.index.sweep_interval, stop.clone());
    crate::canary::spawn(
        Arc::clone(prompts),
        Arc::clone(index),
        Arc::clone(metrics),
        config.outcomes.watch.canary_interval,
        stop.clone(),
    );
    crate::accuracy_watch::spawn(Arc::clone(metrics), stop.clone());
    prompts.spawn_background(stop.clone());
    auth.spawn_background(stop.clone());
}

/// What the gRPC listener serves, and how.
struct GrpcServer<'a> {
    listener: TcpListener,
    health: HealthServer<HealthService>,
    service: InferenceCacheServer<CacheService>,
    limits: &'a Limits,
    tls: Option<ServerTlsConfig>,
    metrics: &'a Arc<Metrics>,
}

/// The gRPC server: it stops accepting with the listeners, and at the drain
/// deadline the calls still open are cut (given [`CUT_GRACE`] to end).
fn grpc_server(
    grpc: GrpcServer<'_>,
    stages: &Stages,
    drain: Duration,
) -> anyhow::Result<impl Future<Output = Result<(), tonic::transport::Error>> + use<>> {
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(inference_cache_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection (v1)")?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(inference_cache_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .context("building gRPC reflection (v1alpha)")?;
    let limits = grpc.limits;
    let keepalive = limits.grpc_keepalive_interval;
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(limits.grpc_max_concurrent_streams))
        .http2_keepalive_interval((!keepalive.is_zero()).then_some(keepalive))
        .http2_keepalive_timeout(Some(limits.grpc_keepalive_timeout));
    if let Some(tls) = grpc.tls {
        builder = builder
            .tls_config(tls)
            .context("configuring TLS on the gRPC listener")?;
    }
    let oversized = {
        let metrics = Arc::clone(grpc.metrics);
        tower::util::MapResponseLayer::new(move |response: http::Response<tonic::body::Body>| {
            if is_oversized(response.headers()) {
                metrics.record_limit("grpc_message_bytes");
            }
            response
        })
    };
    let serve = builder
        .layer(oversized)
        .add_service(grpc.health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(grpc.service)
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY a response split over writes waits out
            // the peer's delayed ACK (40 ms on Linux): far past any budget.
            TcpIncoming::from(grpc.listener).with_nodelay(Some(true)),
            stages.stop_accepting.clone().cancelled_owned(),
        );
    let stop = stages.stop_accepting.clone();
    let cut = stages.cut.clone();
    Ok(async move {
        let mut serve = std::pin::pin!(serve);
        tokio::select! {
            result = &mut serve => result,
            () = drain_deadline(stop, drain) => {
                tracing::warn!(?drain, "drain timeout passed, cutting the calls still open");
                cut.cancel();
                match tokio::time::timeout(CUT_GRACE, &mut serve).await {
                    Ok(result) => result,
                    Err(_) => {
                        tracing::warn!("calls still open after the cut; stopping without them");
                        Ok(())
                    }
                }
            }
        }
    })
}

/// The admin HTTP server: it stops accepting with the gRPC listener, and
/// stops at the drain deadline at the latest.
fn admin_server(
    listener: TcpListener,
    state: AdminState,
    index_routes: axum::Router,
    stages: &Stages,
    drain: Duration,
) -> impl Future<Output = std::io::Result<()>> + use<> {
    let stop = stages.stop_accepting.clone();
    let routes = admin::router(state).merge(index_routes);
    let serve = axum::serve(listener, routes)
        .with_graceful_shutdown(stop.clone().cancelled_owned())
        .into_future();
    async move {
        tokio::select! {
            result = serve => result,
            () = drain_deadline(stop, drain) => Ok(()),
        }
    }
}

/// What the shutdown sequence acts on.
struct ShutdownSequence {
    stages: Stages,
    ready: Arc<AtomicBool>,
    index: Arc<IndexState>,
    metrics: Arc<Metrics>,
    health: HealthReporter,
    delay: Duration,
    drain: Duration,
}

/// From the trigger: not ready (`/readyz`, gRPC health, the observer
/// streams end), then after the delay the listeners stop accepting.
async fn shutdown_sequence(sequence: ShutdownSequence) {
    let ShutdownSequence {
        stages,
        ready,
        index,
        metrics,
        health,
        delay,
        drain,
    } = sequence;
    stages.shutdown.cancelled().await;
    ready.store(false, Ordering::Release);
    index.streams().close();
    metrics.server_up.set(0);
    health
        .set_not_serving::<InferenceCacheServer<CacheService>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    tracing::info!(
        ?delay,
        ?drain,
        "not ready; stop accepting after the shutdown delay, then drain"
    );
    tokio::time::sleep(delay).await;
    stages.stop_accepting.cancel();
}
