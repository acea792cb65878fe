//! Starting and stopping the server: binds both listeners, wires the services,
//! and drains them on shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use inference_cache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use crate::admin::{self, AdminState};
use crate::config::ServeConfig;
use crate::grpc::CacheService;
use crate::index_runtime::IndexState;
use crate::metrics::Metrics;
use crate::prompt_inputs::PromptState;

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
    /// A token that stops the server when cancelled (e.g. from a signal handler).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until the server stops (after its shutdown token is cancelled).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.tasks.await.context("server task panicked")?
    }

    /// Stops accepting, drains in-flight calls and waits for both listeners to close.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.wait().await
    }
}

/// Binds the listeners and starts serving in the background.
pub async fn start(config: ServeConfig) -> anyhow::Result<RunningServer> {
    let mut metrics = Metrics::new();
    let index = Arc::new(IndexState::new(&config.index, metrics.registry_mut())?);
    let prompts = Arc::new(PromptState::new(&config.prompts, metrics.registry_mut())?);
    let metrics = Arc::new(metrics);
    let grpc_listener = TcpListener::bind(config.grpc_addr)
        .await
        .with_context(|| format!("binding the gRPC listener on {}", config.grpc_addr))?;
    let admin_listener = TcpListener::bind(config.admin_addr)
        .await
        .with_context(|| format!("binding the admin listener on {}", config.admin_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<InferenceCacheServer<CacheService>>()
        .await;
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
    let service = InferenceCacheServer::new(CacheService::new(
        Arc::clone(&metrics),
        Arc::clone(&index),
        Arc::clone(&prompts),
    ));

    let shutdown = CancellationToken::new();
    index.spawn_background(config.index.sweep_interval, shutdown.clone());
    prompts.spawn_background(shutdown.clone());
    let ready = Arc::new(AtomicBool::new(true));
    metrics.server_up.set(1);

    let grpc = {
        let shutdown = shutdown.clone();
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(service)
            .serve_with_incoming_shutdown(
                // Without TCP_NODELAY a response split over writes waits out
                // the peer's delayed ACK (40 ms on Linux): far past any budget.
                TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
                async move { shutdown.cancelled().await },
            )
    };
    let admin = {
        let shutdown = shutdown.clone();
        let state = AdminState {
            metrics: Arc::clone(&metrics),
            ready: Arc::clone(&ready),
        };
        axum::serve(admin_listener, admin::router(state).merge(index.routes()))
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
    };
    let on_shutdown = {
        let shutdown = shutdown.clone();
        let metrics = Arc::clone(&metrics);
        async move {
            shutdown.cancelled().await;
            ready.store(false, Ordering::Release);
            metrics.server_up.set(0);
            health_reporter
                .set_not_serving::<InferenceCacheServer<CacheService>>()
                .await;
        }
    };

    tracing::info!(%grpc_addr, %admin_addr, "serving");
    let tasks = tokio::spawn(async move {
        let (grpc, admin, ()) = tokio::join!(grpc, admin, on_shutdown);
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
