//! Shared set-up of the contract tests: a real server on loopback port 0 with
//! a manual clock and an optional policy file, a connected client, and
//! builders for the wire messages.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use inference_cache_index::ManualClock;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, LookupRouteRequest, LookupRouteResponse, PrefixEntry,
    ReplicaStats, cache_event,
};
use inference_cache_server::{ClockHandle, RunningServer, ServeConfig, start};
use tonic::transport::Channel;

pub const T: &str = "team-a";
pub const M: &str = "llama";
pub const S: &str = "vllm";

/// A running server, its clock, client and policy file.
pub struct Harness {
    pub server: Option<RunningServer>,
    pub clock: ManualClock,
    pub client: InferenceCacheClient<Channel>,
    pub policy_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// A CachePolicy document for namespace `ns` with `spec` lines (two-space
/// indented), under the contract's ranker unless the lines name one: these
/// tests pin the wire contract's ranking.
pub fn policy_doc(ns: &str, spec: &str) -> String {
    let ranker = if spec.contains("ranker:") {
        ""
    } else {
        "  ranker: Contract\n"
    };
    format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {{name: p-{}, namespace: \"{ns}\"}}\nspec:\n{ranker}{spec}",
        ns.replace('*', "default")
    )
}

/// `policy` with a contract-ranker default prepended when it has none.
fn with_contract_default(policy: &str) -> String {
    if policy.contains("namespace: \"*\"") {
        policy.to_owned()
    } else if policy.trim().is_empty() {
        policy_doc("*", "")
    } else {
        format!("{}---\n{policy}", policy_doc("*", ""))
    }
}

impl Harness {
    /// Server with an empty index; `policy` is written to the policy file first.
    pub async fn start(policy: &str) -> Self {
        Self::start_with(policy, |_| {}).await
    }

    /// As [`Harness::start`], letting the caller adjust the config.
    pub async fn start_with(policy: &str, adjust: impl FnOnce(&mut ServeConfig)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let policy_path = dir.path().join("policy.yaml");
        std::fs::write(&policy_path, with_contract_default(policy)).expect("write policy");
        let clock = ManualClock::default();
        let mut config = ServeConfig::ephemeral();
        config.index.policy_file = Some(policy_path.clone());
        config.index.clock = ClockHandle(Arc::new(clock.clone()));
        config.index.sweep_interval = Duration::from_secs(3600);
        adjust(&mut config);
        let server = start(config).await.expect("server starts");
        let client = InferenceCacheClient::connect(format!("http://{}", server.grpc_addr))
            .await
            .expect("connect");
        Self {
            server: Some(server),
            clock,
            client,
            policy_path,
            _dir: dir,
        }
    }

    pub fn admin_addr(&self) -> std::net::SocketAddr {
        self.server.as_ref().expect("running").admin_addr
    }

    /// Streams `updates` over one ReportCacheState call.
    pub async fn report(&mut self, updates: Vec<CacheStateUpdate>) {
        let ack = self
            .client
            .report_cache_state(tokio_stream::iter(updates))
            .await
            .expect("report")
            .into_inner();
        assert!(ack.accepted);
    }

    /// Reports that `replica` holds `blocks` (64 tokens each) in the default scope.
    pub async fn hold(&mut self, replica: &str, blocks: &[Vec<u8>]) {
        self.report(vec![update(replica, vec![chain_entry(blocks, 64)])])
            .await;
    }

    pub async fn lookup(&mut self, request: LookupRouteRequest) -> LookupRouteResponse {
        self.client
            .lookup_route(request)
            .await
            .expect("lookup")
            .into_inner()
    }

    pub async fn event(&mut self, event: CacheEvent) {
        let ack = self
            .client
            .publish_event(event)
            .await
            .expect("event")
            .into_inner();
        assert!(ack.accepted);
    }

    /// GET `path` on the admin listener: (status, body).
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let response = crate::http::get(self.admin_addr(), path)
            .await
            .expect("admin GET");
        (response.status, response.body)
    }

    /// Value of a metric line (exact name with labels) in `/metrics`.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let (_, body) = self.admin_get("/metrics").await;
        body.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    pub async fn stop(mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().await.expect("shutdown");
        }
    }
}

/// Polls `check` every 25 ms until it holds; panics naming `what` after 5 s.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..200 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{what}: not reached in 5s");
}

pub fn hash_of(n: u64) -> Vec<u8> {
    n.to_be_bytes().to_vec()
}

pub fn chain(range: std::ops::Range<u64>) -> Vec<Vec<u8>> {
    range.map(hash_of).collect()
}

pub fn update(replica: &str, prefixes: Vec<PrefixEntry>) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: replica.into(),
        model_id: M.into(),
        tenant_id: T.into(),
        hash_scheme: S.into(),
        prefixes,
        ..Default::default()
    }
}

pub fn stats_update(replica: &str, hit_rate: f32, pressure: f32) -> CacheStateUpdate {
    CacheStateUpdate {
        stats: Some(ReplicaStats {
            replica_id: replica.into(),
            hit_rate,
            pressure,
            cache_memory_bytes: 1 << 20,
            ..Default::default()
        }),
        ..update(replica, vec![])
    }
}

pub fn chain_entry(blocks: &[Vec<u8>], tokens: i32) -> PrefixEntry {
    PrefixEntry {
        block_hashes: blocks.to_vec(),
        block_token_counts: vec![tokens; blocks.len()],
        ..Default::default()
    }
}

pub fn exact_entry(hash: u64, tokens: i32) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: hash_of(hash),
        token_count: tokens,
        ..Default::default()
    }
}

pub fn chain_lookup(blocks: &[Vec<u8>]) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: M.into(),
        tenant_id: T.into(),
        hash_scheme: S.into(),
        block_hashes: blocks.to_vec(),
        block_token_counts: vec![64; blocks.len()],
        ..Default::default()
    }
}

pub fn exact_lookup(hash: u64, tokens: i32) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: M.into(),
        tenant_id: T.into(),
        hash_scheme: S.into(),
        prefix_hash: hash_of(hash),
        prefix_token_count: tokens,
        ..Default::default()
    }
}

pub fn event(kind: cache_event::Type, replica: &str, hash: Vec<u8>, adapter: &str) -> CacheEvent {
    CacheEvent {
        r#type: kind as i32,
        replica_id: replica.into(),
        model_id: M.into(),
        tenant_id: T.into(),
        prefix_hash: hash,
        adapter_id: adapter.into(),
        ..Default::default()
    }
}

pub fn ids(r: &LookupRouteResponse) -> Vec<&str> {
    r.replica_scores
        .iter()
        .map(|s| s.replica_id.as_str())
        .collect()
}
