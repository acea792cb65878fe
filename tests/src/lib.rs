//! Shared helpers for the cross-crate tests: a real server on loopback port 0,
//! a connected gRPC client, reporting a token prompt's blocks as held, and a
//! minimal HTTP/1.1 GET for the admin listener.

pub mod test_files;

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context as _, ensure};
use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use inference_cache_server::{RunningServer, ServeConfig, start};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::transport::Channel;

/// A server started in-process on ephemeral loopback ports.
pub struct TestServer {
    server: RunningServer,
}

impl TestServer {
    /// Starts a server with the embedded defaults on port 0.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(ServeConfig::ephemeral()).await
    }

    /// Starts a server with `config` (use [`ServeConfig::ephemeral`] as the base).
    pub async fn start_with(config: ServeConfig) -> anyhow::Result<Self> {
        Ok(Self {
            server: start(config).await?,
        })
    }

    /// Bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.server.grpc_addr
    }

    /// Bound admin address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.server.admin_addr
    }

    /// A connected plaintext gRPC channel.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        let endpoint = format!("http://{}", self.grpc_addr());
        Channel::from_shared(endpoint)?
            .connect()
            .await
            .context("connecting to the test server")
    }

    /// A connected InferenceCache client.
    pub async fn client(&self) -> anyhow::Result<InferenceCacheClient<Channel>> {
        Ok(InferenceCacheClient::new(self.channel().await?))
    }

    /// GET `path` on the admin listener.
    pub async fn admin_get(&self, path: &str) -> anyhow::Result<HttpResponse> {
        http_get(self.admin_addr(), path).await
    }

    /// Stops the server and waits for it to drain.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.server.shutdown().await
    }
}

/// [`ServeConfig::ephemeral`] with a policy file, written into `dir`, that
/// pins the wire contract's ranker for every tenant. Gateway tests check
/// where a hint sends a request; under the default cost-aware ranker a
/// prefix requested over and over is spread by recent load, so repeated
/// requests would not keep naming its holder.
pub fn contract_ranker_config(dir: &Path) -> anyhow::Result<ServeConfig> {
    let path = dir.join("policy.yaml");
    std::fs::write(
        &path,
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
         metadata: { name: contract-ranker, namespace: \"*\" }\nspec:\n  ranker: Contract\n",
    )?;
    let mut config = ServeConfig::ephemeral();
    config.index.policy_file = Some(path);
    Ok(config)
}

/// Who holds a prompt's blocks: one replica in one (tenant, model, adapter)
/// partition. Blocks are 16 tokens under the `vllm` hash scheme, as the
/// filter's and the server's defaults expect.
#[derive(Debug, Clone, Copy)]
pub struct Holder<'a> {
    /// Replica id as an engine would report it.
    pub replica: &'a str,
    /// Tenant id.
    pub tenant: &'a str,
    /// Model id.
    pub model: &'a str,
    /// LoRA adapter id; empty for the base model.
    pub adapter: &'a str,
}

/// The block chain of `tokens` (16-token blocks) as the wire carries it:
/// `block_hashes` and `block_token_counts`.
pub fn wire_chain(tokens: &[u32]) -> (Vec<Vec<u8>>, Vec<i32>) {
    let chain = request_chain(tokens, 16);
    let hashes = chain
        .block_hashes
        .iter()
        .map(|hash| hash.to_vec())
        .collect();
    (hashes, chain.block_token_counts)
}

/// Reports the block chain of `tokens` as held by `holder` through
/// ReportCacheState, and fails unless the server accepts it.
pub async fn hold_tokens(
    client: &mut InferenceCacheClient<Channel>,
    holder: Holder<'_>,
    tokens: &[u32],
) -> anyhow::Result<()> {
    let (block_hashes, block_token_counts) = wire_chain(tokens);
    let update = CacheStateUpdate {
        replica_id: holder.replica.into(),
        model_id: holder.model.into(),
        tenant_id: holder.tenant.into(),
        adapter_id: holder.adapter.into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            block_hashes,
            block_token_counts,
            ..PrefixEntry::default()
        }],
        ..CacheStateUpdate::default()
    };
    let ack = client
        .report_cache_state(tokio_stream::iter([update]))
        .await?
        .into_inner();
    ensure!(ack.accepted, "ingest not accepted: {}", ack.reason_code);
    Ok(())
}

/// Status and body of an HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    /// HTTP status code.
    pub status: u16,
    /// Response body (the connection is closed by the request, so read to the end).
    pub body: String,
}

/// A one-shot HTTP/1.1 GET with `Connection: close`.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<HttpResponse> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("HTTP response without header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("HTTP status line")?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok(HttpResponse { status, body })
}

/// Decodes a chunked transfer-encoded body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}
