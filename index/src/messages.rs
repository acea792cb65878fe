//! Plain input and output types of the index: what producers report, what a
//! lookup asks and what it answers. No transport types; the server converts.
//!
//! Inputs are borrowed where the caller already owns the bytes (a lookup never
//! copies the request's hashes) and owned where they are moved in from a
//! decoded message (ingest).

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

/// Reserved tenant of the server's self-test; unreadable and unwritable here.
pub const PROBE_TENANT: &str = "inferencecache.io/probe";

/// Where a replica holds a prefix, most local first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash, Serialize)]
#[repr(u8)]
pub enum Tier {
    /// No per-prefix evidence (TENANT_HOT / AFFINITY_HINT); normalized to T1 at ingest.
    #[default]
    Unspecified = 0,
    /// Engine KV cache.
    T1 = 1,
    /// External offload (e.g. LMCache).
    T2 = 2,
    /// Remote / disaggregated.
    T3 = 3,
}

impl Tier {
    /// The tier for a wire value; unknown values are treated as unspecified.
    pub fn from_i32(value: i32) -> Self {
        match value {
            1 => Self::T1,
            2 => Self::T2,
            3 => Self::T3,
            _ => Self::Unspecified,
        }
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        Self::from_i32(i32::from(value))
    }
}

/// One reported prefix: a block chain, a legacy single hash, or both.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefixReport {
    /// Legacy exact-match key.
    pub prefix_hash: Vec<u8>,
    /// Tokens behind `prefix_hash`.
    pub token_count: i32,
    /// Per-block hashes, parallel to `block_token_counts`.
    pub block_hashes: Vec<Vec<u8>>,
    /// Tokens per block.
    pub block_token_counts: Vec<i32>,
    /// Where the replica holds it; unspecified means T1.
    pub tier: Tier,
    /// Index partition; empty falls back to the update's adapter.
    pub adapter_id: String,
}

/// Replica load and hit statistics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReplicaStatsReport {
    /// Replica the stats describe; empty means the update's replica.
    pub replica_id: String,
    /// KV cache memory in use.
    pub cache_memory_bytes: i64,
    /// Prefix-cache hit rate in [0, 1].
    pub hit_rate: f32,
    /// Memory pressure in [0, 1].
    pub pressure: f32,
    /// Opaque client-library version.
    pub client_version: String,
    /// Cumulative tier-2 hit tokens.
    pub t2_hit_tokens: i64,
    /// Cumulative tier-2 query tokens.
    pub t2_query_tokens: i64,
    /// Requests queued for prefill at the engine.
    pub requests_waiting: u32,
    /// Requests admitted and running at the engine.
    pub requests_running: u32,
    /// Fraction of the engine's KV cache in use, in [0, 1].
    pub kv_cache_usage: f32,
}

/// One additive delta from a replica.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheUpdate {
    /// Reporting replica.
    pub replica_id: String,
    /// Model served.
    pub model_id: String,
    /// Tenant the prefixes belong to.
    pub tenant_id: String,
    /// Compatibility domain of the hashes; empty drops every prefix.
    pub hash_scheme: String,
    /// Default partition for prefixes that set none.
    pub adapter_id: String,
    /// Added or refreshed prefixes.
    pub prefixes: Vec<PrefixReport>,
    /// Latest statistics, if any.
    pub stats: Option<ReplicaStatsReport>,
}

/// Why an ingested prefix was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The update had no hash_scheme.
    EmptyHashScheme,
    /// block_hashes and block_token_counts differ in length, or a count is negative.
    MalformedChain,
    /// An empty hash inside a chain, or neither chain nor prefix_hash.
    EmptyHash,
    /// The update named no replica.
    EmptyReplica,
    /// The update targets the reserved probe tenant.
    ProbeTenant,
}

impl DropReason {
    /// Every reason, for metric pre-registration.
    pub const ALL: [Self; 5] = [
        Self::EmptyHashScheme,
        Self::MalformedChain,
        Self::EmptyHash,
        Self::EmptyReplica,
        Self::ProbeTenant,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EmptyHashScheme => "empty_hash_scheme",
            Self::MalformedChain => "malformed_chain",
            Self::EmptyHash => "empty_hash",
            Self::EmptyReplica => "empty_replica",
            Self::ProbeTenant => "probe_tenant",
        }
    }
}

/// What one ingest call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestReport {
    /// Prefix reports accepted.
    pub accepted_prefixes: u64,
    /// Block-replica entries written (new or refreshed).
    pub entries_written: u64,
    /// Entries that did not exist before.
    pub entries_added: u64,
    /// New entries refused because the index is at its global entry cap.
    pub entries_refused: u64,
    /// Holders that made room at the holders-per-key bound.
    pub holders_displaced: u64,
    /// Dropped prefix reports by reason.
    pub dropped: Vec<(DropReason, u64)>,
    /// Whether stats were recorded.
    pub stats_recorded: bool,
}

impl IngestReport {
    pub(crate) fn drop(&mut self, reason: DropReason, n: u64) {
        if n == 0 {
            return;
        }
        match self.dropped.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, count)) => *count += n,
            None => self.dropped.push((reason, n)),
        }
    }

    /// Dropped count for one reason.
    pub fn dropped_for(&self, reason: DropReason) -> u64 {
        self.dropped
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }
}

/// Kind of a cache event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Additions come through updates; a no-op here.
    PrefixAdded,
    /// A replica dropped a prefix.
    PrefixEvicted,
    /// Replica liveness.
    ReplicaUpdated,
    /// A replica flushed its cache.
    AllCleared,
}

/// A producer event.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheEvent {
    /// What happened.
    pub kind: EventKind,
    /// Replica it happened on.
    pub replica_id: String,
    /// Model; empty means every model (ALL_CLEARED only).
    pub model_id: String,
    /// Tenant; empty means every tenant (ALL_CLEARED only).
    pub tenant_id: String,
    /// Prefix evicted (PREFIX_EVICTED).
    pub prefix_hash: Vec<u8>,
    /// Narrows PREFIX_EVICTED to one partition; empty sweeps all partitions.
    pub adapter_id: String,
}

/// Outcome of an event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventReport {
    /// Whether the event was applied (probe-tenant events are not).
    pub applied: bool,
    /// Block-replica entries removed.
    pub entries_removed: u64,
}

/// Block hashes of a lookup chain.
#[derive(Debug, Clone, Copy)]
pub enum BlockHashes<'a> {
    /// Wire bytes, any width.
    Bytes(&'a [Vec<u8>]),
    /// Wire form of 8-byte fingerprints.
    Fixed(&'a [[u8; 8]]),
}

impl<'a> BlockHashes<'a> {
    /// Number of hashes.
    pub fn len(&self) -> usize {
        match self {
            Self::Bytes(b) => b.len(),
            Self::Fixed(f) => f.len(),
        }
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hash `i` as bytes.
    pub fn get(&self, i: usize) -> &'a [u8] {
        match *self {
            Self::Bytes(b) => &b[i],
            Self::Fixed(f) => &f[i],
        }
    }
}

/// A block chain: hashes and the tokens in each block.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a> {
    /// Hashes in order.
    pub hashes: BlockHashes<'a>,
    /// Tokens per block (same length as `hashes`).
    pub token_counts: &'a [i32],
}

/// A lookup as the server resolved it from the wire.
#[derive(Debug, Clone)]
pub struct LookupRequest<'a> {
    /// tenant_id.
    pub tenant_id: &'a str,
    /// model_id.
    pub model_id: &'a str,
    /// hash_scheme.
    pub hash_scheme: &'a str,
    /// adapter_id (partition).
    pub adapter_id: &'a str,
    /// Resolved chain (wire chain, else derived from token ids); `None` when absent.
    pub chain: Option<Chain<'a>>,
    /// True when the wire chain's arrays disagree in length (malformed → NO_HINT).
    pub chain_malformed: bool,
    /// True when the request carried a valid, non-empty wire chain (for `requireChain`).
    pub wire_chain: bool,
    /// Legacy exact-match key.
    pub prefix_hash: &'a [u8],
    /// Tokens behind `prefix_hash`.
    pub prefix_token_count: i32,
    /// SLO TTFT in milliseconds (0 = none).
    pub slo_ttft_ms: i32,
    /// When the request arrived (start of the `lookupTimeoutMs` budget).
    pub arrived: Instant,
    /// The caller's own deadline, if any.
    pub deadline: Option<Instant>,
}

impl<'a> LookupRequest<'a> {
    /// A request with only the keys set; everything else empty.
    pub fn new(tenant_id: &'a str, model_id: &'a str, hash_scheme: &'a str) -> Self {
        Self {
            tenant_id,
            model_id,
            hash_scheme,
            adapter_id: "",
            chain: None,
            chain_malformed: false,
            wire_chain: false,
            prefix_hash: &[],
            prefix_token_count: 0,
            slo_ttft_ms: 0,
            arrived: Instant::now(),
            deadline: None,
        }
    }
}

/// LookupRoute reason codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Ranked replicas holding a leading run of the prompt.
    PrefixMatch,
    /// Warm replicas of the scope, no prefix evidence.
    TenantHot,
    /// One stable replica from the prompt fingerprint.
    AffinityHint,
    /// Nothing to say.
    NoHint,
    /// The tenant requires a wire chain.
    PolicyRequiresChain,
    /// The deadline passed.
    Timeout,
    /// tenant_id unknown to a non-empty index.
    UnknownTenant,
    /// (tenant, model) has no entries.
    UnknownModel,
    /// (tenant, model) has entries, none under hash_scheme.
    UnknownHashScheme,
}

impl Reason {
    /// Every code, for metric pre-registration.
    pub const ALL: [Self; 9] = [
        Self::PrefixMatch,
        Self::TenantHot,
        Self::AffinityHint,
        Self::NoHint,
        Self::PolicyRequiresChain,
        Self::Timeout,
        Self::UnknownTenant,
        Self::UnknownModel,
        Self::UnknownHashScheme,
    ];

    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PrefixMatch => "PREFIX_MATCH",
            Self::TenantHot => "TENANT_HOT",
            Self::AffinityHint => "AFFINITY_HINT",
            Self::NoHint => "NO_HINT",
            Self::PolicyRequiresChain => "POLICY_REQUIRES_CHAIN",
            Self::Timeout => "TIMEOUT",
            Self::UnknownTenant => "UNKNOWN_TENANT",
            Self::UnknownModel => "UNKNOWN_MODEL",
            Self::UnknownHashScheme => "UNKNOWN_HASH_SCHEME",
        }
    }
}

/// One ranked replica.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaScore {
    /// Replica id.
    pub replica_id: Arc<str>,
    /// Ranking score (higher is better).
    pub score: f32,
    /// Tokens of the request the replica holds.
    pub matched_tokens: i32,
    /// matched / request tokens × freshness.
    pub estimated_cache_hit_prob: f32,
    /// Coldest tier across the matched run; unspecified without prefix evidence.
    pub tier: Tier,
}

/// What decided a lookup's answer, next to its reason code: a small, fixed
/// set, so it can label a metric and answer "why is my hit rate low" from
/// the metrics alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// PREFIX_MATCH on the replica with the longest live match.
    MatchDepth,
    /// PREFIX_MATCH on a replica with a shorter match than another live one:
    /// queued work or balance outweighed the extra cached tokens.
    Load,
    /// Downgraded: only a head most live members hold matched (a shared
    /// system prompt or tool preamble says nothing about where to go).
    SharedHead,
    /// Downgraded: the match was below `minimumMatchedTokens` or the routing
    /// floor (short, or stale).
    BelowFloor,
    /// Downgraded: no live member holds the request's first block.
    NoMatch,
    /// TENANT_HOT: the tenant's hottest replicas, for a non-chain miss.
    TenantHot,
    /// Downgraded: the request is shorter than `minimumPrefixTokens`.
    PrefixGate,
    /// A diagnostic code (unknown tenant, model or hash scheme).
    Diagnostic,
    /// The deadline passed.
    Timeout,
    /// Answered before the index was consulted: the probe tenant, a
    /// malformed or missing fingerprint, or a policy that requires a chain.
    NotConsulted,
}

impl Decision {
    /// Every decision, in declaration order.
    pub const ALL: [Self; 10] = [
        Self::MatchDepth,
        Self::Load,
        Self::SharedHead,
        Self::BelowFloor,
        Self::NoMatch,
        Self::TenantHot,
        Self::PrefixGate,
        Self::Diagnostic,
        Self::Timeout,
        Self::NotConsulted,
    ];

    /// A stable snake_case name (metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MatchDepth => "match_depth",
            Self::Load => "load",
            Self::SharedHead => "shared_head",
            Self::BelowFloor => "below_floor",
            Self::NoMatch => "no_match",
            Self::TenantHot => "tenant_hot",
            Self::PrefixGate => "prefix_gate",
            Self::Diagnostic => "diagnostic",
            Self::Timeout => "timeout",
            Self::NotConsulted => "not_consulted",
        }
    }
}

/// What a lookup answers.
#[derive(Debug, Clone, PartialEq)]
pub struct LookupOutcome {
    /// Reason code.
    pub reason: Reason,
    /// Ranked replicas, best first (empty for every fail-open code).
    pub scores: Vec<ReplicaScore>,
    /// Echo of the partition consulted; empty on envelopes returned before the index is consulted.
    pub adapter_id: String,
    /// What decided the answer.
    pub decision: Decision,
}

impl LookupOutcome {
    pub(crate) fn empty(reason: Reason, adapter: &str) -> Self {
        let decision = match reason {
            Reason::Timeout => Decision::Timeout,
            Reason::UnknownTenant | Reason::UnknownModel | Reason::UnknownHashScheme => {
                Decision::Diagnostic
            }
            _ => Decision::NotConsulted,
        };
        Self {
            reason,
            scores: Vec::new(),
            adapter_id: adapter.to_owned(),
            decision,
        }
    }
}

/// A replica's stats as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaState {
    /// Replica id.
    pub replica_id: String,
    /// Last reported statistics.
    pub stats: Option<ReplicaStatsReport>,
    /// When the stats arrived (ms since the epoch).
    pub stats_received_ms: Option<u64>,
    /// Last update or REPLICA_UPDATED event (ms since the epoch).
    pub last_heard_ms: Option<u64>,
    /// Block-replica entries held in the scope asked about.
    pub entries: i64,
    /// It heartbeats (`REPLICA_UPDATED` naming tenant and model), so it
    /// leaves the serving set after `replicaTimeout` of silence.
    pub heartbeats: bool,
    /// Prefill tokens hinted to it since its last stats report.
    pub pending_tokens: u64,
    /// How full its cache runs: its recent evictions per recent store, in
    /// [0, 1] (1: every block it stores evicts one; see `fullCacheWeight`).
    pub cache_full: f64,
    /// `tenant/model` serving sets it is a member of.
    pub member_of: Vec<String>,
}

/// `(tenant, model)` aggregate (GetCacheState).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CacheSummary {
    /// Replicas holding at least one entry.
    pub replica_count: i32,
    /// Distinct prefix keys.
    pub prefix_count: i64,
    /// Block-replica entries.
    pub entry_count: i64,
    /// Mean hit rate over replicas with stats.
    pub mean_hit_rate: f32,
    /// Mean pressure over replicas with stats.
    pub mean_pressure: f32,
    /// Sum of reported cache memory.
    pub cache_memory_bytes: i64,
}

/// GetCacheState answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ScopeState {
    /// Replicas holding entries in the scope, sorted by id.
    pub replicas: Vec<ReplicaState>,
    /// Aggregate.
    pub summary: CacheSummary,
}

/// Per-tenant row of the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantSnapshot {
    /// Tenant id.
    pub tenant_id: String,
    /// Models with entries.
    pub models: Vec<String>,
    /// Replicas holding entries for the tenant.
    pub replica_count: usize,
    /// Distinct prefix keys.
    pub prefix_count: i64,
    /// Block-replica entries.
    pub entry_count: i64,
}

/// Cluster aggregate served at `/snapshot` (metadata only).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    /// When it was taken (ms since the epoch).
    pub taken_at_ms: u64,
    /// Block-replica entries in the index.
    pub entry_count: i64,
    /// Distinct prefix keys.
    pub prefix_count: i64,
    /// Global entry cap.
    pub max_entries: u64,
    /// Every replica with entries or stats.
    pub replicas: Vec<ReplicaState>,
    /// Every tenant with entries.
    pub tenants: Vec<TenantSnapshot>,
}

/// Why entries left the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictionReason {
    /// Older than the tenant's evictionTTL.
    Ttl,
    /// Over the global entry cap.
    Capacity,
    /// Over the tenant's quota.maxIndexEntries.
    Quota,
    /// PREFIX_EVICTED / ALL_CLEARED from a producer.
    Event,
    /// Made room for a newer holder of a key at the holders-per-key bound.
    HoldersPerKey,
}

impl EvictionReason {
    /// Every reason, for metric pre-registration.
    pub const ALL: [Self; 5] = [
        Self::Ttl,
        Self::Capacity,
        Self::Quota,
        Self::Event,
        Self::HoldersPerKey,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ttl => "ttl",
            Self::Capacity => "capacity",
            Self::Quota => "quota",
            Self::Event => "event",
            Self::HoldersPerKey => "holders_per_key",
        }
    }
}

/// What one sweep removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Expired by TTL.
    pub ttl: u64,
    /// Evicted for per-tenant quotas.
    pub quota: u64,
    /// Evicted for the global cap.
    pub capacity: u64,
    /// Serving-set memberships ended because heartbeats stopped.
    pub members_expired: u64,
    /// Interned tenant / model / scheme / adapter names and replica ids
    /// freed because nothing refers to them any more.
    pub names_freed: u64,
    /// Partitions freed because they hold no entries.
    pub partitions_freed: u64,
}
