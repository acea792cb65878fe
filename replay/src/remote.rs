//! The `--server` backend: the same feeding and lookups over gRPC against a
//! running policy server (`ReportCacheState`, `PublishEvent`, `LookupRoute`).
//!
//! Ordering: each update goes out on its own short `ReportCacheState` stream
//! whose `Ack` is awaited, and a request's evictions are published (in
//! parallel) and acknowledged before the next lookup, so the server's index
//! is exactly what the simulated replicas hold when each request is routed.
//! That costs a round trip per update; a subscriber keeps one long stream.
//!
//! Time: the server runs on its own wall clock, so freshness, stats age and
//! `replicaTimeout` see the replay's real (much shorter) duration, not the
//! trace's. The simulated serving times are unaffected. Replicas are cleared
//! (`ALL_CLEARED`) before the run and after it, under tenant `replay` and
//! model `trace`, so runs do not see each other's blocks.
//!
//! The calls are made from a blocking thread through a Tokio runtime handle.

use std::time::{SystemTime, UNIX_EPOCH};

use inference_cache_index::{CacheEvent, CacheUpdate, EventKind};
use inference_cache_proto::v1alpha1 as wire;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use tokio::runtime::Handle;
use tonic::transport::{Channel, Endpoint};

use crate::error::{ReplayError, error_chain};
use crate::routed::{Answer, Backend, HASH_SCHEME, MODEL, TENANT};

/// A policy server reached over gRPC.
#[derive(Debug)]
pub struct Remote {
    runtime: Handle,
    client: InferenceCacheClient<Channel>,
    endpoint: String,
}

impl Remote {
    /// Connects to `endpoint` (e.g. `http://127.0.0.1:9090`).
    pub async fn connect(endpoint: &str) -> Result<Self, ReplayError> {
        let error = |message: String| ReplayError::Server {
            endpoint: endpoint.to_owned(),
            message,
        };
        let channel = Endpoint::from_shared(endpoint.to_owned())
            .map_err(|e| error(format!("not a valid URL: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(std::time::Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| error(format!("cannot connect: {}", error_chain(&e))))?;
        Ok(Self {
            runtime: Handle::current(),
            client: InferenceCacheClient::new(channel),
            endpoint: endpoint.to_owned(),
        })
    }

    fn error(&self, call: &str, status: &tonic::Status) -> ReplayError {
        ReplayError::Server {
            endpoint: self.endpoint.clone(),
            message: format!("{call}: {} ({:?})", status.message(), status.code()),
        }
    }

    /// Removes everything the replicas hold under the replay's tenant and model.
    pub fn clear(&mut self, replica_ids: &[String]) -> Result<(), ReplayError> {
        let events = replica_ids
            .iter()
            .map(|id| CacheEvent {
                kind: EventKind::AllCleared,
                replica_id: id.clone(),
                tenant_id: TENANT.into(),
                model_id: MODEL.into(),
                prefix_hash: Vec::new(),
                adapter_id: String::new(),
            })
            .collect();
        self.publish(events)
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn wire_update(update: CacheUpdate) -> wire::CacheStateUpdate {
    wire::CacheStateUpdate {
        replica_id: update.replica_id,
        model_id: update.model_id,
        tenant_id: update.tenant_id,
        hash_scheme: update.hash_scheme,
        timestamp_us: now_us(),
        prefixes: update
            .prefixes
            .into_iter()
            .map(|p| wire::PrefixEntry {
                prefix_hash: p.prefix_hash,
                token_count: i32::try_from(p.token_count).unwrap_or(i32::MAX),
                block_hashes: p.chain.hashes().map(<[u8]>::to_vec).collect(),
                block_token_counts: p
                    .chain
                    .token_counts()
                    .iter()
                    .map(|&n| i32::try_from(n).unwrap_or(i32::MAX))
                    .collect(),
                tier: p.tier as i32,
                adapter_id: p.adapter_id,
            })
            .collect(),
        stats: update.stats.map(|s| wire::ReplicaStats {
            replica_id: s.replica_id,
            cache_memory_bytes: s.cache_memory_bytes,
            hit_rate: s.hit_rate,
            pressure: s.pressure,
            client_version: s.client_version,
            t2_hit_tokens: s.t2_hit_tokens,
            t2_query_tokens: s.t2_query_tokens,
            requests_waiting: s.requests_waiting,
            requests_running: s.requests_running,
            kv_cache_usage: s.kv_cache_usage,
        }),
        adapter_id: update.adapter_id,
    }
}

fn wire_event(event: CacheEvent) -> wire::CacheEvent {
    let kind = match event.kind {
        EventKind::PrefixAdded => wire::cache_event::Type::PrefixAdded,
        EventKind::PrefixEvicted => wire::cache_event::Type::PrefixEvicted,
        EventKind::ReplicaUpdated => wire::cache_event::Type::ReplicaUpdated,
        EventKind::AllCleared => wire::cache_event::Type::AllCleared,
    };
    wire::CacheEvent {
        r#type: kind as i32,
        replica_id: event.replica_id,
        model_id: event.model_id,
        tenant_id: event.tenant_id,
        prefix_hash: event.prefix_hash,
        timestamp_us: now_us(),
        adapter_id: event.adapter_id,
    }
}

impl Backend for Remote {
    fn set_time(&mut self, _now_ms: f64) {}

    fn ingest(&mut self, update: CacheUpdate) -> Result<(), ReplayError> {
        let message = wire_update(update);
        let mut client = self.client.clone();
        let result = self.runtime.block_on(async move {
            client
                .report_cache_state(futures::stream::iter([message]))
                .await
        });
        result
            .map(drop)
            .map_err(|s| self.error("ReportCacheState", &s))
    }

    fn publish(&mut self, events: Vec<CacheEvent>) -> Result<(), ReplayError> {
        let calls = events.into_iter().map(|event| {
            let mut client = self.client.clone();
            async move { client.publish_event(wire_event(event)).await }
        });
        let acks = self.runtime.block_on(futures::future::join_all(calls));
        for ack in acks {
            let ack = ack
                .map_err(|s| self.error("PublishEvent", &s))?
                .into_inner();
            if !ack.accepted {
                return Err(ReplayError::Server {
                    endpoint: self.endpoint.clone(),
                    message: format!("PublishEvent not accepted: {}", ack.reason_code),
                });
            }
        }
        Ok(())
    }

    fn lookup(&mut self, hashes: &[Vec<u8>], token_counts: &[i32]) -> Result<Answer, ReplayError> {
        Ok(self.lookup_scored(hashes, token_counts)?.0)
    }

    fn lookup_scored(
        &mut self,
        hashes: &[Vec<u8>],
        token_counts: &[i32],
    ) -> Result<(Answer, u64), ReplayError> {
        let request = wire::LookupRouteRequest {
            tenant_id: TENANT.into(),
            model_id: MODEL.into(),
            hash_scheme: HASH_SCHEME.into(),
            block_hashes: hashes.to_vec(),
            block_token_counts: token_counts.to_vec(),
            ..Default::default()
        };
        let mut client = self.client.clone();
        let response = self
            .runtime
            .block_on(async move { client.lookup_route(request).await })
            .map_err(|s| self.error("LookupRoute", &s))?
            .into_inner();
        let top = response.replica_scores.into_iter().next();
        let matched = top
            .as_ref()
            .map_or(0, |s| u64::try_from(s.matched_tokens).unwrap_or(0));
        let answer = Answer {
            reason: response.reason_code,
            first: top.map(|s| s.replica_id),
        };
        Ok((answer, matched))
    }

    fn finish(&mut self, replica_ids: &[String]) -> Result<(), ReplayError> {
        self.clear(replica_ids)
    }
}
