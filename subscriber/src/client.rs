//! The gRPC client towards the server: TLS, client certificates and the
//! bearer token.
//!
//! `--server https://...` turns TLS on (rustls with the `ring` provider):
//! the server's certificate is verified against `--tls-ca` when given, else
//! against the system's trust store; `--tls-cert` / `--tls-key` present a
//! client certificate (mutual TLS); `--tls-server-name` overrides the name
//! checked. `--token-file` adds `authorization: Bearer <token>` to every
//! call. Every file is read again on each (re)connect, so rotated
//! certificates and tokens are picked up without a restart; a file that
//! cannot be read fails that connect (logged, retried with backoff), and
//! [`check`] fails start-up on it.

use std::path::Path;
use std::time::Duration;

use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::args::{Settings, TlsSettings};

/// The client type every call goes through.
pub(crate) type Client = InferenceCacheClient<InterceptedService<Channel, Auth>>;

/// Adds the bearer token (when configured) to every request.
#[derive(Debug, Clone, Default)]
pub(crate) struct Auth {
    header: Option<MetadataValue<Ascii>>,
}

impl Interceptor for Auth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(header) = &self.header {
            request
                .metadata_mut()
                .insert("authorization", header.clone());
        }
        Ok(request)
    }
}

/// The client cannot be set up from its files.
#[derive(Debug, thiserror::Error)]
pub enum ClientSetupError {
    /// A file cannot be read.
    #[error("cannot read {flag} {path}: {source}")]
    Read {
        /// The flag naming the file.
        flag: &'static str,
        /// The file.
        path: String,
        /// The read error.
        source: std::io::Error,
    },
    /// The token file holds no usable token.
    #[error("--token-file {path}: {reason}")]
    BadToken {
        /// The file.
        path: String,
        /// What is wrong with its content.
        reason: &'static str,
    },
    /// A PEM file holds nothing usable.
    #[error("{flag} {path}: no PEM block found")]
    NotPem {
        /// The flag naming the file.
        flag: &'static str,
        /// The file.
        path: String,
    },
    /// tonic refused the endpoint or TLS configuration.
    #[error("{0}")]
    Transport(#[from] tonic::transport::Error),
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, ClientSetupError> {
    std::fs::read(path).map_err(|source| ClientSetupError::Read {
        flag,
        path: path.display().to_string(),
        source,
    })
}

fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, ClientSetupError> {
    let pem = read(flag, path)?;
    if !pem.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(ClientSetupError::NotPem {
            flag,
            path: path.display().to_string(),
        });
    }
    Ok(pem)
}

/// The TLS configuration of `tls`, reading its files now.
pub(crate) fn tls_config(tls: &TlsSettings) -> Result<ClientTlsConfig, ClientSetupError> {
    let mut config = ClientTlsConfig::new();
    config = match &tls.ca {
        Some(ca) => config.ca_certificate(Certificate::from_pem(read_pem("--tls-ca", ca)?)),
        None => config.with_native_roots(),
    };
    if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
        config = config.identity(Identity::from_pem(
            read_pem("--tls-cert", cert)?,
            read_pem("--tls-key", key)?,
        ));
    }
    if let Some(name) = &tls.server_name {
        config = config.domain_name(name.clone());
    }
    Ok(config)
}

/// The `authorization` value from the token file (first line, trimmed).
pub(crate) fn read_token(path: &Path) -> Result<MetadataValue<Ascii>, ClientSetupError> {
    let bad = |reason| ClientSetupError::BadToken {
        path: path.display().to_string(),
        reason,
    };
    let content = read("--token-file", path)?;
    let content = String::from_utf8(content).map_err(|_| bad("not UTF-8 text"))?;
    let token = content.lines().next().unwrap_or("").trim();
    if token.is_empty() {
        return Err(bad("empty"));
    }
    let mut value = MetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| bad("the token must be printable ASCII"))?;
    value.set_sensitive(true);
    Ok(value)
}

/// Everything a connect needs, read from disk now.
fn prepare(settings: &Settings) -> Result<(Endpoint, Auth), ClientSetupError> {
    let mut endpoint = Endpoint::from_shared(settings.server.clone())?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5));
    if let Some(tls) = &settings.tls {
        endpoint = endpoint.tls_config(tls_config(tls)?)?;
    }
    let header = settings.token_file.as_deref().map(read_token).transpose()?;
    Ok((endpoint, Auth { header }))
}

/// Checks every file the client will read (start-up fails on a bad one).
pub fn check(settings: &Settings) -> Result<(), ClientSetupError> {
    prepare(settings).map(|_| ())
}

/// Why connecting failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error(transparent)]
    Setup(#[from] ClientSetupError),
    #[error("{}", error_chain(.0))]
    Transport(#[from] tonic::transport::Error),
}

/// An error and its sources, `: `-separated (tonic's transport errors say
/// little more than "transport error" on their own).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// Connects to the server with the current files.
pub(crate) async fn connect(settings: &Settings) -> Result<Client, ConnectError> {
    let (endpoint, auth) = prepare(settings)?;
    let channel = endpoint.connect().await?;
    Ok(InferenceCacheClient::with_interceptor(channel, auth))
}
