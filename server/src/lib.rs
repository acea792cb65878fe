//! The inference-cache policy server.
//!
//! [`start`] binds the gRPC listener (the `inferencecache.v1alpha1.InferenceCache`
//! service plus `grpc.health.v1` and gRPC reflection) and the admin HTTP
//! listener ([`ADMIN_ROUTES`]: `/healthz`, `/readyz`, `/metrics`,
//! `/snapshot/accuracy`, `/policy`, `/snapshot`), and returns a
//! [`RunningServer`] carrying the bound addresses and a shutdown handle. The
//! `inference-cache` binary is a thin clap front end over it; tests start it
//! on port 0.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use inference_cache_server::{ServeConfig, start};
//!
//! let server = start(ServeConfig::default()).await?;
//! println!("gRPC on {}", server.grpc_addr);
//! server.shutdown().await?;
//! # Ok(())
//! # }
//! ```

mod accuracy_watch;
mod admin;
pub mod auth;
mod canary;
mod config;
mod grpc;
mod index_runtime;
pub mod limits;
mod metrics;
mod outcomes;
mod pd_route;
mod prompt_inputs;
pub mod prompt_templates;
mod reload;
mod replication;
mod run;
mod security;
mod streams;
mod watch;

pub use accuracy_watch::{AccuracyArgs, WatchSettings};
pub use admin::ADMIN_ROUTES;
pub use config::{
    DEFAULT_ADMIN_ADDR, DEFAULT_GRPC_ADDR, ServeConfig, ShutdownArgs, ShutdownSettings,
};
pub use grpc::{block_chain, cache_update, derived_chain, exact_token_count};
pub use index_runtime::{ClockHandle, IndexArgs, IndexSettings};
pub use limits::{LimitArgs, Limits};
pub use metrics::Metrics;
pub use outcomes::OutcomeSettings;
pub use prompt_inputs::{PromptArgs, PromptSettings};
pub use replication::{ReplicationArgs, ReplicationSettings};
pub use run::{RunningServer, start};
pub use security::{SecurityArgs, SecuritySettings, TlsFiles};
pub use streams::{StreamArgs, StreamSettings};
pub use watch::{WatchArgs, format_event, run as watch};
