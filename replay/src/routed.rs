//! The `inference-cache` rows: the real index and ranker, fed as the engine
//! subscriber would feed them, behind the gateway's routing rule.
//!
//! Feeding (the same for the in-process index and a `--server`):
//! - at start every replica announces itself with a stats-only update (no
//!   prefixes, zero load);
//! - every stats interval each replica reports its [`Load`] as
//!   `ReplicaStats` (`requests_waiting`, `requests_running`,
//!   `kv_cache_usage`, `pressure`, `hit_rate`);
//! - when a replica admits a request, the blocks it newly stored are ingested
//!   as one chain (`PrefixReport { chain }`,
//!   hash ids as 8-byte big-endian values) and every block it evicted is
//!   published as `PREFIX_EVICTED`. With [`ReportAt::Routing`] the index
//!   learns of them at once (the moment the replica's cache changes in the
//!   simulation), before the next request is routed; with
//!   [`ReportAt::PrefillEnd`] they are held back until the request's prefill
//!   completes, as a real engine reports them, and delivered in order per
//!   replica. Blocks that were already held are not re-reported, as the
//!   engine emits no event for a cache hit;
//! - every refresh interval (the subscriber's `--refresh-interval`, 10 min by
//!   default) each replica re-reports every block it holds and the index has
//!   heard of, as the subscriber does, so blocks that stay cached for hours
//!   (a system prompt every request hits) outlive the index's eviction TTL
//!   exactly as they do behind a real subscriber.
//!
//! Lookup: `tenant "replay"`, `model "trace"`, `hash_scheme "vllm"`, the
//! request's whole chain as a wire chain. Gateway rule: route to
//! `scores[0]` on PREFIX_MATCH / TENANT_HOT / AFFINITY_HINT, else round-robin.
//! Every reason code is counted.

use std::collections::{BTreeMap, VecDeque};

use hashbrown::{HashMap, HashSet};

use inference_cache_index::{
    BlockChain, CacheEvent, CacheUpdate, EventKind, PrefixReport, ReplicaStatsReport,
};

use crate::error::ReplayError;
use crate::policy::{RoundRobin, RouteContext, Router};
use crate::replica::{Load, Replica};
use crate::sim::SimConfig;
use crate::trace::Request;

/// Tenant every replayed request belongs to.
pub const TENANT: &str = "replay";
/// Model every replayed request asks for.
pub const MODEL: &str = "trace";
/// Hash scheme of the trace's block ids.
pub const HASH_SCHEME: &str = "vllm";

/// Most blocks in one refresh update (the subscriber's
/// `--max-blocks-per-update` default).
const REFRESH_CHUNK_BLOCKS: usize = 1024;

/// Reason codes on which the gateway follows the first replica of the answer.
const ROUTED_ON: [&str; 3] = ["PREFIX_MATCH", "TENANT_HOT", "AFFINITY_HINT"];

/// Replica id of replica `i`: `10.0.0.1:8000`, `10.0.0.2:8000`, …
pub fn replica_id(i: usize) -> String {
    let n = i + 1;
    format!("10.0.{}.{}:8000", n / 256, n % 256)
}

/// When a replica's admissions and evictions reach the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ReportAt {
    /// At routing time, when the simulated cache changes (the index is never behind).
    #[default]
    Routing,
    /// When the request's prefill completes, as an engine reports them.
    PrefillEnd,
}

/// Feedback held back until its due time.
#[derive(Debug)]
struct Pending {
    due_ms: f64,
    update: Option<CacheUpdate>,
    events: Vec<CacheEvent>,
}

/// A lookup answer, reduced to what the gateway uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The reason code.
    pub reason: String,
    /// The first ranked replica, if any.
    pub first: Option<String>,
}

/// Where the index lives: in this process or behind a server.
pub trait Backend {
    /// Simulated time moved to `now_ms` (the in-process clock follows it).
    fn set_time(&mut self, now_ms: f64);
    /// One ReportCacheState update.
    fn ingest(&mut self, update: CacheUpdate) -> Result<(), ReplayError>;
    /// PublishEvent calls, in any order.
    fn publish(&mut self, events: Vec<CacheEvent>) -> Result<(), ReplayError>;
    /// LookupRoute with a wire chain.
    fn lookup(&mut self, hashes: &[Vec<u8>], token_counts: &[i32]) -> Result<Answer, ReplayError>;
    /// [`Backend::lookup`], with the first ranked replica's `matched_tokens`
    /// (the reuse the hint predicts; 0 when the backend does not say).
    fn lookup_scored(
        &mut self,
        hashes: &[Vec<u8>],
        token_counts: &[i32],
    ) -> Result<(Answer, u64), ReplayError> {
        Ok((self.lookup(hashes, token_counts)?, 0))
    }
    /// Called after every stats report (the in-process index runs its TTL sweep).
    fn housekeeping(&mut self, _now_ms: f64) {}
    /// Called once after the last request.
    fn finish(&mut self, _replica_ids: &[String]) -> Result<(), ReplayError> {
        Ok(())
    }
}

/// Routes through a [`Backend`] and feeds it what the replicas do.
#[derive(Debug)]
pub struct IndexRouter<B> {
    backend: B,
    ids: Vec<String>,
    fallback: RoundRobin,
    reasons: BTreeMap<String, u64>,
    hashes: Vec<Vec<u8>>,
    counts: Vec<i32>,
    report_at: ReportAt,
    /// Per replica, in due order (a replica's prefills end in FIFO order).
    pending: Vec<VecDeque<Pending>>,
    /// The last routed request's predicted reuse: the hint's `matched_tokens`
    /// when routed on it, 0 otherwise.
    predicted: Option<u64>,
    /// Re-report every held block this often (simulated ms), next at `next_refresh_ms`.
    refresh_interval_ms: Option<f64>,
    next_refresh_ms: f64,
    /// Token count of every block reported stored (a partial last block has fewer).
    block_tokens: HashMap<u64, i32>,
}

impl<B: Backend> IndexRouter<B> {
    /// A router over the configuration's replicas, fed at its `report_at` and
    /// refreshed every `refresh_interval_ms`.
    pub fn new(backend: B, config: &SimConfig) -> Self {
        let replicas = config.replicas;
        let refresh_interval_ms = config.refresh_interval_ms.filter(|&ms| ms > 0.0);
        Self {
            backend,
            ids: (0..replicas).map(replica_id).collect(),
            fallback: RoundRobin::default(),
            reasons: BTreeMap::new(),
            hashes: Vec::new(),
            counts: Vec::new(),
            report_at: config.report_at,
            pending: (0..replicas).map(|_| VecDeque::new()).collect(),
            predicted: None,
            refresh_interval_ms,
            next_refresh_ms: refresh_interval_ms.unwrap_or(f64::INFINITY),
            block_tokens: HashMap::new(),
        }
    }

    /// Re-reports every block each replica holds whose admission the index
    /// has been told of (a block whose report is still held back is left to
    /// that report), in updates of at most [`REFRESH_CHUNK_BLOCKS`].
    fn refresh(&mut self, replicas: &[Replica]) -> Result<(), ReplayError> {
        for (i, replica) in replicas.iter().enumerate() {
            let undelivered: HashSet<Vec<u8>> = self.pending[i]
                .iter()
                .filter_map(|p| p.update.as_ref())
                .flat_map(|u| {
                    u.prefixes
                        .iter()
                        .flat_map(|p| p.chain.hashes().map(<[u8]>::to_vec))
                })
                .collect();
            let blocks: Vec<u64> = replica
                .cache
                .blocks()
                .filter(|h| !undelivered.contains(h.to_be_bytes().as_slice()))
                .collect();
            for chunk in blocks.chunks(REFRESH_CHUNK_BLOCKS) {
                let mut hashes = Vec::with_capacity(chunk.len());
                wire_hashes(chunk, &mut hashes);
                let counts = chunk
                    .iter()
                    .map(|h| self.block_tokens.get(h).copied().unwrap_or(0))
                    .collect();
                let update = CacheUpdate {
                    prefixes: vec![chain_report(&hashes, counts)],
                    ..self.update(i)
                };
                self.backend.ingest(update)?;
            }
        }
        Ok(())
    }

    /// Delivers the held-back feedback due by `now_ms`.
    fn deliver(&mut self, now_ms: f64) -> Result<(), ReplayError> {
        for queue in &mut self.pending {
            while queue.front().is_some_and(|p| p.due_ms <= now_ms) {
                let Some(pending) = queue.pop_front() else {
                    break;
                };
                if let Some(update) = pending.update {
                    self.backend.ingest(update)?;
                }
                if !pending.events.is_empty() {
                    self.backend.publish(pending.events)?;
                }
            }
        }
        Ok(())
    }

    /// The backend, for inspection after a run.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn update(&self, replica: usize) -> CacheUpdate {
        CacheUpdate {
            replica_id: self.ids[replica].clone(),
            tenant_id: TENANT.into(),
            model_id: MODEL.into(),
            hash_scheme: HASH_SCHEME.into(),
            ..Default::default()
        }
    }

    fn stats_update(&self, replica: usize, load: Load) -> CacheUpdate {
        CacheUpdate {
            stats: Some(ReplicaStatsReport {
                replica_id: self.ids[replica].clone(),
                hit_rate: load.hit_rate,
                pressure: load.pressure,
                requests_waiting: load.waiting,
                requests_running: load.running,
                kv_cache_usage: load.kv_usage,
                ..Default::default()
            }),
            ..self.update(replica)
        }
    }

    fn report_all(&mut self, replicas: &[Replica]) -> Result<(), ReplayError> {
        for (i, replica) in replicas.iter().enumerate() {
            let update = self.stats_update(i, replica.load());
            self.backend.ingest(update)?;
        }
        Ok(())
    }
}

/// One reported chain: the hashes and their token counts (the replay's
/// chains are always parallel and never hold an empty hash).
fn chain_report(hashes: &[Vec<u8>], counts: Vec<i32>) -> PrefixReport {
    let counts = counts
        .into_iter()
        .map(|n| u32::try_from(n).unwrap_or(0))
        .collect();
    PrefixReport {
        chain: BlockChain::new(hashes, counts).unwrap_or_default(),
        ..Default::default()
    }
}

/// Fills `out` with the 8-byte big-endian form of `blocks`, reusing its buffers.
fn wire_hashes(blocks: &[u64], out: &mut Vec<Vec<u8>>) {
    out.truncate(blocks.len());
    for (slot, hash) in out.iter_mut().zip(blocks) {
        slot.clear();
        slot.extend_from_slice(&hash.to_be_bytes());
    }
    for hash in &blocks[out.len()..] {
        out.push(hash.to_be_bytes().to_vec());
    }
}

impl<B: Backend> Router for IndexRouter<B> {
    fn start(&mut self, replicas: &[Replica]) -> Result<(), ReplayError> {
        self.backend.set_time(0.0);
        self.report_all(replicas)
    }

    fn report_stats(&mut self, now_ms: f64, replicas: &[Replica]) -> Result<(), ReplayError> {
        self.backend.set_time(now_ms);
        self.deliver(now_ms)?;
        self.report_all(replicas)?;
        if let Some(interval) = self.refresh_interval_ms
            && now_ms >= self.next_refresh_ms
        {
            self.next_refresh_ms = now_ms + interval;
            self.refresh(replicas)?;
        }
        self.backend.housekeeping(now_ms);
        Ok(())
    }

    fn route(
        &mut self,
        context: &RouteContext<'_>,
        request: &Request,
    ) -> Result<usize, ReplayError> {
        self.backend.set_time(context.now_ms);
        self.deliver(context.now_ms)?;
        wire_hashes(&request.blocks, &mut self.hashes);
        self.counts.clear();
        let n = request.blocks.len();
        self.counts.extend((0..n).map(|i| {
            if i + 1 == n {
                (request.input_tokens - context.block_size * (n as u32 - 1)) as i32
            } else {
                context.block_size as i32
            }
        }));
        let (answer, matched_tokens) = self.backend.lookup_scored(&self.hashes, &self.counts)?;
        let pick = match &answer.first {
            Some(first) if ROUTED_ON.contains(&answer.reason.as_str()) => {
                self.ids.iter().position(|id| id == first)
            }
            _ => None,
        };
        self.predicted = Some(if pick.is_some() { matched_tokens } else { 0 });
        *self.reasons.entry(answer.reason).or_default() += 1;
        Ok(pick.unwrap_or_else(|| self.fallback.pick(self.ids.len())))
    }

    fn admitted(
        &mut self,
        context: &RouteContext<'_>,
        replica: usize,
        request: &Request,
        stored: &[u64],
        evicted: &[u64],
    ) -> Result<(), ReplayError> {
        let update = (!stored.is_empty()).then(|| {
            let last = request.blocks.last().copied();
            let last_tokens = request.input_tokens
                - context.block_size * (request.blocks.len() as u32).saturating_sub(1);
            let mut chain = Vec::new();
            wire_hashes(stored, &mut chain);
            let counts = stored
                .iter()
                .map(|&h| {
                    let tokens = if Some(h) == last {
                        last_tokens as i32
                    } else {
                        context.block_size as i32
                    };
                    self.block_tokens.insert(h, tokens);
                    tokens
                })
                .collect();
            CacheUpdate {
                prefixes: vec![chain_report(&chain, counts)],
                ..self.update(replica)
            }
        });
        let events = evicted
            .iter()
            .map(|h| CacheEvent {
                kind: EventKind::PrefixEvicted,
                replica_id: self.ids[replica].clone(),
                tenant_id: TENANT.into(),
                model_id: MODEL.into(),
                prefix_hash: h.to_be_bytes().to_vec(),
                adapter_id: String::new(),
            })
            .collect();
        let due_ms = match self.report_at {
            ReportAt::Routing => context.now_ms,
            ReportAt::PrefillEnd => context.replicas[replica].prefill_end_ms(),
        };
        self.pending[replica].push_back(Pending {
            due_ms,
            update,
            events,
        });
        if self.report_at == ReportAt::Routing {
            self.deliver(context.now_ms)?;
        }
        Ok(())
    }

    fn reasons(&self) -> Option<Vec<(String, u64)>> {
        Some(self.reasons.iter().map(|(k, v)| (k.clone(), *v)).collect())
    }

    fn predicted_tokens(&self) -> Option<u64> {
        self.predicted
    }

    fn finish(&mut self) -> Result<(), ReplayError> {
        self.deliver(f64::INFINITY)?;
        self.backend.finish(&self.ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ids_are_distinct_addresses() {
        assert_eq!(replica_id(0), "10.0.0.1:8000");
        assert_eq!(replica_id(6), "10.0.0.7:8000");
        assert_eq!(replica_id(255), "10.0.1.0:8000");
    }

    #[test]
    fn wire_hashes_reuse_buffers_and_are_big_endian() {
        let mut out = Vec::new();
        wire_hashes(&[1, 2, 3], &mut out);
        wire_hashes(&[0x0102, 7], &mut out);
        assert_eq!(
            out,
            [vec![0, 0, 0, 0, 0, 0, 1, 2], vec![0, 0, 0, 0, 0, 0, 0, 7]]
        );
    }
}
