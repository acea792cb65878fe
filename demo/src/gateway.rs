//! How a demo request reaches an engine: through Envoy with the compiled
//! filter (see [`crate::envoy`]), or through the filter's own logic run
//! in-process — the same `classify` → `parse_body` → `lookup_request` →
//! `LookupRoute` (with the filter's timeout, failing open) → `decide` steps,
//! with the hinted endpoint used only when it is a pool member and the
//! pool's round-robin otherwise, as Envoy's `override_host` does.
//!
//! The round-robin baseline is the same pool without the lookup.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use inference_cache_filter::{Outcome, Settings, classify, decide, lookup_request, parse_body};
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use tonic::transport::Channel;

/// Where a request went and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The engine chosen.
    pub engine: SocketAddr,
    /// The filter's outcome (reason code or failure), or `ROUND_ROBIN`.
    pub outcome: String,
}

/// The in-process gateway: a pool of engines, optionally with the filter's lookup.
#[derive(Debug)]
pub struct InProcessGateway {
    engines: Vec<SocketAddr>,
    next: AtomicUsize,
    lookup: Option<(Settings, InferenceCacheClient<Channel>)>,
}

/// Filter settings of the demo's gateway (both the in-process one and
/// Envoy's plugin), with a LookupRoute budget of `timeout`.
pub fn filter_settings(timeout: std::time::Duration) -> Settings {
    let mut settings = Settings::with_cluster("inference-cache");
    settings.replica_id_is_endpoint = true;
    settings.tenant_id = crate::TENANT.to_owned();
    settings.timeout = timeout;
    settings
}

impl InProcessGateway {
    /// Plain round-robin over `engines`.
    pub fn round_robin(engines: Vec<SocketAddr>) -> Self {
        Self {
            engines,
            next: AtomicUsize::new(0),
            lookup: None,
        }
    }

    /// Round-robin over `engines`, overridden by the policy server's hints.
    pub async fn inference_cache(
        engines: Vec<SocketAddr>,
        grpc: SocketAddr,
        timeout: std::time::Duration,
    ) -> anyhow::Result<Self> {
        let client = InferenceCacheClient::connect(format!("http://{grpc}")).await?;
        Ok(Self {
            engines,
            next: AtomicUsize::new(0),
            lookup: Some((filter_settings(timeout), client)),
        })
    }

    fn pool_pick(&self) -> SocketAddr {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.engines[i % self.engines.len()]
    }

    /// Routes one request body sent to `path`.
    pub async fn route(&self, path: &str, body: &[u8]) -> Route {
        let Some((settings, client)) = &self.lookup else {
            return Route {
                engine: self.pool_pick(),
                outcome: "ROUND_ROBIN".to_owned(),
            };
        };
        let outcome = lookup(settings, client.clone(), path, body).await;
        let hinted = match &outcome {
            Outcome::Routed { endpoint, .. } => endpoint
                .parse::<SocketAddr>()
                .ok()
                .filter(|addr| self.engines.contains(addr)),
            _ => None,
        };
        Route {
            engine: hinted.unwrap_or_else(|| self.pool_pick()),
            outcome: outcome.header_value().to_owned(),
        }
    }
}

async fn lookup(
    settings: &Settings,
    mut client: InferenceCacheClient<Channel>,
    path: &str,
    body: &[u8],
) -> Outcome {
    use inference_cache_filter::FailureKind;
    let Some(api) = classify("POST", path) else {
        return Outcome::NotRouted {
            reason: "NOT_INFERENCE".to_owned(),
        };
    };
    let request = match parse_body(api, body)
        .and_then(|parsed| lookup_request(settings, &settings.tenant_id, parsed))
    {
        Ok(request) => request,
        Err(error) => return Outcome::Failed(failure_of(error)),
    };
    match tokio::time::timeout(settings.timeout, client.lookup_route(request)).await {
        Ok(Ok(response)) => decide(settings, response.get_ref()),
        Ok(Err(status)) => {
            tracing::debug!(%status, "LookupRoute failed");
            Outcome::Failed(FailureKind::GrpcError)
        }
        // The filter sees its own timeout as a non-zero gRPC status too.
        Err(_) => {
            tracing::debug!(timeout = ?settings.timeout, "LookupRoute timed out");
            Outcome::Failed(FailureKind::GrpcError)
        }
    }
}

/// The filter's failure kind for a body it cannot look up.
fn failure_of(error: inference_cache_filter::BodyError) -> inference_cache_filter::FailureKind {
    use inference_cache_filter::{BodyError, FailureKind};
    match error {
        BodyError::InvalidJson => FailureKind::InvalidJson,
        BodyError::MissingModel => FailureKind::MissingModel,
        BodyError::UnsupportedPrompt => FailureKind::UnsupportedPrompt,
        BodyError::PromptTooShort => FailureKind::PromptTooShort,
    }
}

/// An HTTP/1.1 response: status, headers of interest and body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// `x-inferencecache-reason`, when the gateway exposes it.
    pub reason: Option<String>,
    /// `x-served-by`: the engine that answered.
    pub served_by: Option<String>,
    /// Body.
    pub body: Bytes,
}

/// POSTs a JSON body over a fresh HTTP/1.1 connection.
pub async fn post_json(addr: SocketAddr, path: &str, body: String) -> anyhow::Result<HttpResponse> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let reason = header(inference_cache_filter::DEFAULT_REASON_HEADER);
    let served_by = header("x-served-by");
    let body = response.into_body().collect().await?.to_bytes();
    Ok(HttpResponse {
        status,
        reason,
        served_by,
        body,
    })
}
