//! Resolved settings of `inference-cache serve`, validated once at start-up.

use std::net::SocketAddr;
use std::time::Duration;

use crate::index_runtime::IndexSettings;
use crate::limits::Limits;
use crate::outcomes::OutcomeSettings;
use crate::prompt_inputs::PromptSettings;
use crate::replication::ReplicationSettings;
use crate::security::SecuritySettings;

/// Default `--grpc-addr`.
pub const DEFAULT_GRPC_ADDR: &str = "0.0.0.0:9090";
/// Default `--admin-addr`: loopback, so `/snapshot` and `/policy` are not exposed by accident.
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:8080";
/// Default `--shutdown-delay`.
pub const DEFAULT_SHUTDOWN_DELAY: &str = "5s";
/// Default `--drain-timeout`.
pub const DEFAULT_DRAIN_TIMEOUT: &str = "20s";

/// Everything [`crate::start`] needs. `Default` is the embedded default
/// configuration the binary runs with when no flag is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// gRPC listen address (HTTP/2, TLS with [`SecuritySettings::tls`]).
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address (the routes of [`crate::ADMIN_ROUTES`]).
    pub admin_addr: SocketAddr,
    /// Cache index: policy file, entry cap, engine block size, sweep interval.
    pub index: IndexSettings,
    /// Tokenizers (prompt_text, messages, raw_prompt) and PromptTemplates.
    pub prompts: PromptSettings,
    /// Request limits.
    pub limits: Limits,
    /// TLS, producer authentication, admin exposure.
    pub security: SecuritySettings,
    /// Graceful shutdown timing.
    pub shutdown: ShutdownSettings,
    /// The shared event log on NATS JetStream (`--nats-url`); `None` keeps the index in this process only.
    pub replication: Option<ReplicationSettings>,
    /// Bounds of the outcome aggregation and the accuracy watch's thresholds.
    pub outcomes: OutcomeSettings,
}

fn addr(text: &str) -> SocketAddr {
    text.parse()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            grpc_addr: addr(DEFAULT_GRPC_ADDR),
            admin_addr: addr(DEFAULT_ADMIN_ADDR),
            index: IndexSettings::default(),
            prompts: PromptSettings::default(),
            limits: Limits::default(),
            security: SecuritySettings::default(),
            shutdown: ShutdownSettings::default(),
            replication: None,
            outcomes: OutcomeSettings::default(),
        }
    }
}

impl ServeConfig {
    /// Both listeners on an ephemeral loopback port, no shutdown delay (for tests and benchmarks).
    pub fn ephemeral() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            prompts: PromptSettings {
                templates_dir: None,
                ..PromptSettings::default()
            },
            shutdown: ShutdownSettings {
                delay: Duration::ZERO,
                drain_timeout: Duration::from_secs(5),
            },
            ..Self::default()
        }
    }
}

/// Flags of graceful shutdown, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ShutdownArgs {
    /// On SIGTERM, how long /readyz and gRPC health report not-serving before the listeners stop accepting.
    #[arg(long, default_value = DEFAULT_SHUTDOWN_DELAY, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_SHUTDOWN_DELAY")]
    pub shutdown_delay: Duration,

    /// After the listeners stop accepting, how long in-flight calls may finish before the rest are cut.
    #[arg(long, default_value = DEFAULT_DRAIN_TIMEOUT, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_DRAIN_TIMEOUT")]
    pub drain_timeout: Duration,
}

impl ShutdownArgs {
    /// Resolves the flags into settings.
    pub fn into_settings(self) -> ShutdownSettings {
        ShutdownSettings {
            delay: self.shutdown_delay,
            drain_timeout: self.drain_timeout,
        }
    }
}

/// Graceful shutdown timing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownSettings {
    /// Not-ready time before accepting stops.
    pub delay: Duration,
    /// Drain deadline after accepting stops.
    pub drain_timeout: Duration,
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        Self {
            delay: crate::limits::parse_duration(DEFAULT_SHUTDOWN_DELAY).unwrap_or_default(),
            drain_timeout: crate::limits::parse_duration(DEFAULT_DRAIN_TIMEOUT).unwrap_or_default(),
        }
    }
}
