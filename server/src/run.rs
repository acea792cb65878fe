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
use tonic::transport::server::TcpIncoming;

use crate::admin::{self, AdminState};
use crate::auth::Authorizer;
use crate::config::ServeConfig;
use crate::grpc::CacheService;
use crate::index_runtime::{ClockHandle, IndexState};
use crate::metrics::Metrics;
use crate::prompt_inputs::PromptState;
use crate::replication::{self, ReplayClock};

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

/// Binds the listeners and starts serving in the background.
pub async fn start(config: ServeConfig) -> anyhow::Result<RunningServer> {
    config
        .outcomes
        .watch
        .validate()
        .map_err(anyhow::Error::msg)?;
    let mut metrics = Metrics::with_outcomes(config.outcomes.clone());
    let mut index_settings = config.index.clone();
    let replay_clock = config.replication.as_ref().map(|_| {
        let clock = Arc::new(ReplayClock::new(Arc::clone(&config.index.clock.0)));
        index_settings.clock = ClockHandle(clock.clone());
        clock
    });
    let index = Arc::new(IndexState::new(&index_settings, metrics.registry_mut())?);
    // shutdown: the trigger; stop_accepting: after the delay; cut: at the drain deadline;
    // log_stop: once both listeners have closed.
    let shutdown = CancellationToken::new();
    let stop_accepting = CancellationToken::new();
    let cut = CancellationToken::new();
    let log_stop = CancellationToken::new();
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
                shutdown.clone(),
                log_stop.clone(),
            )
            .await?,
        );
    }
    // Stops the log tasks if start-up fails from here on.
    let log_guard = log_stop.clone().drop_guard();
    let prompts = Arc::new(PromptState::new(
        &config.prompts,
        config.limits.tokenize_concurrency,
        metrics.registry_mut(),
    )?);
    let metrics = Arc::new(metrics);
    let security = &config.security;
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
    let grpc_listener = TcpListener::bind(config.grpc_addr)
        .await
        .with_context(|| format!("binding the gRPC listener on {}", config.grpc_addr))?;
    let admin_listener = TcpListener::bind(config.admin_addr)
        .await
        .with_context(|| format!("binding the admin listener on {}", config.admin_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    if ready.load(Ordering::Acquire) {
        health_reporter
            .set_serving::<InferenceCacheServer<CacheService>>()
            .await;
    } else {
        // Replaying the shared log: gRPC health says what /readyz says.
        health_reporter
            .set_not_serving::<InferenceCacheServer<CacheService>>()
            .await;
        spawn_serving_when_ready(
            health_reporter.clone(),
            Arc::clone(&ready),
            shutdown.clone(),
        );
    }
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

    let limits = Arc::new(config.limits.clone());
    let service = InferenceCacheServer::new(
        CacheService::new(
            Arc::clone(&metrics),
            Arc::clone(&index),
            Arc::clone(&prompts),
        )
        .with_guards(Arc::clone(&limits), Arc::clone(&auth), cut.clone()),
    )
    .max_decoding_message_size(limits.grpc_max_message_bytes);

    index.spawn_background(config.index.sweep_interval, stop_accepting.clone());
    crate::canary::spawn(
        Arc::clone(&prompts),
        Arc::clone(&index),
        Arc::clone(&metrics),
        config.outcomes.watch.canary_interval,
        stop_accepting.clone(),
    );
    crate::accuracy_watch::spawn(Arc::clone(&metrics), stop_accepting.clone());
    prompts.spawn_background(stop_accepting.clone());
    auth.spawn_background(stop_accepting.clone());
    metrics.server_up.set(1);

    let keepalive = limits.grpc_keepalive_interval;
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(limits.grpc_max_concurrent_streams))
        .http2_keepalive_interval((!keepalive.is_zero()).then_some(keepalive))
        .http2_keepalive_timeout(Some(limits.grpc_keepalive_timeout));
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .context("configuring TLS on the gRPC listener")?;
    }
    let oversized = {
        let metrics = Arc::clone(&metrics);
        tower::util::MapResponseLayer::new(move |response: http::Response<tonic::body::Body>| {
            if is_oversized(response.headers()) {
                metrics.record_limit("grpc_message_bytes");
            }
            response
        })
    };
    let grpc_serve = builder
        .layer(oversized)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY a response split over writes waits out
            // the peer's delayed ACK (40 ms on Linux): far past any budget.
            TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
            stop_accepting.clone().cancelled_owned(),
        );
    let drain = config.shutdown.drain_timeout;
    let grpc = {
        let stop = stop_accepting.clone();
        async move {
            let mut serve = std::pin::pin!(grpc_serve);
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
        }
    };
    let admin = {
        let stop = stop_accepting.clone();
        let state = AdminState {
            metrics: Arc::clone(&metrics),
            ready: Arc::clone(&ready),
        };
        let routes = admin::router(state)
            .merge(index.routes(security.admin_policy, security.admin_snapshot));
        let serve = axum::serve(admin_listener, routes)
            .with_graceful_shutdown(stop.clone().cancelled_owned())
            .into_future();
        async move {
            tokio::select! {
                result = serve => result,
                () = drain_deadline(stop, drain) => Ok(()),
            }
        }
    };
    let sequence = {
        let shutdown = shutdown.clone();
        let metrics = Arc::clone(&metrics);
        let delay = config.shutdown.delay;
        let index = Arc::clone(&index);
        async move {
            shutdown.cancelled().await;
            ready.store(false, Ordering::Release);
            index.streams().close();
            metrics.server_up.set(0);
            health_reporter
                .set_not_serving::<InferenceCacheServer<CacheService>>()
                .await;
            health_reporter
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            tracing::info!(
                ?delay,
                ?drain,
                "not ready; stop accepting after the shutdown delay, then drain"
            );
            tokio::time::sleep(delay).await;
            stop_accepting.cancel();
        }
    };

    tracing::info!(%grpc_addr, %admin_addr, tls = security.tls.is_some(), auth = auth.enabled(), "serving");
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
        shutdown,
        tasks,
    })
}
