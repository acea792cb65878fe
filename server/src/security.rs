//! TLS on the gRPC listener, producer authentication flags and the admin
//! routes that expose index contents.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// A TLS handshake that has not finished by then is dropped, so idle
/// half-open connections cannot pile up.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `--admin-snapshot`.
pub const DEFAULT_ADMIN_SNAPSHOT: bool = true;
/// Default `--admin-policy`.
pub const DEFAULT_ADMIN_POLICY: bool = true;

/// Flags of TLS, authentication and admin exposure, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct SecurityArgs {
    /// PEM certificate chain of the gRPC listener; with --tls-key enables TLS.
    #[arg(long, requires = "tls_key", env = "INFERENCE_CACHE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert", env = "INFERENCE_CACHE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle: every gRPC client must present a certificate it signed (mTLS).
    #[arg(long, requires = "tls_cert", env = "INFERENCE_CACHE_CLIENT_CA")]
    pub client_ca: Option<PathBuf>,

    /// YAML list of principals (bearer tokens or mTLS identities) with the
    /// tenants and replicas each may write and read; re-read on change and on SIGHUP.
    #[arg(long, env = "INFERENCE_CACHE_AUTH_FILE")]
    pub auth_file: Option<PathBuf>,

    /// Without --auth-file, accept ReportCacheState / PublishEvent from non-loopback peers.
    #[arg(long, env = "INFERENCE_CACHE_ALLOW_UNAUTHENTICATED_PRODUCERS")]
    pub allow_unauthenticated_producers: bool,

    /// Serve GET /snapshot (every tenant's index contents) on the admin listener.
    #[arg(long, default_value_t = DEFAULT_ADMIN_SNAPSHOT, action = clap::ArgAction::Set, env = "INFERENCE_CACHE_ADMIN_SNAPSHOT")]
    pub admin_snapshot: bool,

    /// Serve GET /policy on the admin listener.
    #[arg(long, default_value_t = DEFAULT_ADMIN_POLICY, action = clap::ArgAction::Set, env = "INFERENCE_CACHE_ADMIN_POLICY")]
    pub admin_policy: bool,
}

impl SecurityArgs {
    /// Resolves the flags into settings.
    pub fn into_settings(self) -> SecuritySettings {
        SecuritySettings {
            tls: match (self.tls_cert, self.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles {
                    cert,
                    key,
                    client_ca: self.client_ca,
                }),
                _ => None,
            },
            auth_file: self.auth_file,
            allow_unauthenticated_producers: self.allow_unauthenticated_producers,
            admin_snapshot: self.admin_snapshot,
            admin_policy: self.admin_policy,
        }
    }
}

/// PEM files of the gRPC listener's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
    /// CA that client certificates must chain to; `None` leaves client certificates off.
    pub client_ca: Option<PathBuf>,
}

/// Resolved security settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecuritySettings {
    /// TLS on the gRPC listener; `None` is plaintext.
    pub tls: Option<TlsFiles>,
    /// Principals file; `None` leaves producers unauthenticated (loopback only by default).
    pub auth_file: Option<PathBuf>,
    /// Accept unauthenticated producers from any peer.
    pub allow_unauthenticated_producers: bool,
    /// Serve `/snapshot`.
    pub admin_snapshot: bool,
    /// Serve `/policy`.
    pub admin_policy: bool,
}

impl Default for SecuritySettings {
    fn default() -> Self {
        Self {
            tls: None,
            auth_file: None,
            allow_unauthenticated_producers: false,
            admin_snapshot: DEFAULT_ADMIN_SNAPSHOT,
            admin_policy: DEFAULT_ADMIN_POLICY,
        }
    }
}

impl TlsFiles {
    /// Reads the PEM files into tonic's TLS configuration.
    pub fn server_config(&self) -> anyhow::Result<ServerTlsConfig> {
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).with_context(|| format!("reading {what} {}", path.display()))
        };
        let cert = read(&self.cert, "--tls-cert")?;
        let key = read(&self.key, "--tls-key")?;
        let mut config = ServerTlsConfig::new()
            .identity(Identity::from_pem(cert, key))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        if let Some(ca) = &self.client_ca {
            config = config.client_ca_root(Certificate::from_pem(read(ca, "--client-ca")?));
        }
        Ok(config)
    }
}
