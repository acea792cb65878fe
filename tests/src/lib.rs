//! Shared helpers for the cross-crate tests: a real server on loopback port 0,
//! a connected gRPC client, reporting a token prompt's blocks as held, and a
//! minimal HTTP/1.1 GET for the admin listener ([`http`]).

pub mod http;
pub mod test_files;

pub use http::HttpResponse;

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context as _, ensure};
use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use inference_cache_server::{RunningServer, ServeConfig, start};
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
        Ok(http::get(self.admin_addr(), path).await?)
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
