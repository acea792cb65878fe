//! Resolved settings of `inference-cache serve`, validated once at start-up.

use std::net::SocketAddr;

use crate::index_runtime::IndexSettings;
use crate::prompt_inputs::PromptSettings;

/// Everything [`crate::start`] needs. `Default` is the embedded default
/// configuration the binary runs with when no flag is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// gRPC listen address (plaintext HTTP/2).
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address (`/healthz`, `/readyz`, `/metrics`).
    pub admin_addr: SocketAddr,
    /// Cache index: policy file, entry cap, engine block size, sweep interval.
    pub index: IndexSettings,
    /// Tokenizers (prompt_text, messages, raw_prompt) and PromptTemplates.
    pub prompts: PromptSettings,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], 9090)),
            admin_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            index: IndexSettings::default(),
            prompts: PromptSettings::default(),
        }
    }
}

impl ServeConfig {
    /// Both listeners on an ephemeral loopback port (for tests and benchmarks).
    pub fn ephemeral() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            index: IndexSettings::default(),
            prompts: PromptSettings {
                templates_dir: None,
                ..PromptSettings::default()
            },
        }
    }
}
