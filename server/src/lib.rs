//! The inference-cache policy server.
//!
//! [`start`] binds the gRPC listener (the `inferencecache.v1alpha1.InferenceCache`
//! service plus `grpc.health.v1` and gRPC reflection) and the admin HTTP
//! listener (`/healthz`, `/readyz`, `/metrics`), and returns a [`RunningServer`]
//! carrying the bound addresses and a shutdown handle. The `inference-cache`
//! binary is a thin clap front end over it; tests start it on port 0.
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

mod admin;
mod config;
mod grpc;
mod index_runtime;
mod metrics;
mod prompt_inputs;
pub mod prompt_templates;
mod reload;
mod run;

pub use config::ServeConfig;
pub use index_runtime::{ClockHandle, IndexArgs, IndexSettings};
pub use metrics::Metrics;
pub use prompt_inputs::{PromptArgs, PromptSettings};
pub use run::{RunningServer, start};
