//! Plain input and output types of the index: what producers report, what a
//! lookup asks and what it answers. No transport types; the server converts.
//!
//! Inputs are typed and valid by construction: token counts are `u32`, and a
//! [`BlockChain`] has as many token counts as hashes and no empty hash, its
//! 8-byte hashes kept as one array of words (no allocation per block). The
//! server checks the wire's `int32` counts and byte strings once, when it
//! converts a message, and reports what it refused with the same
//! [`DropReason`]s ([`CacheUpdate::rejected`]) or answers (a
//! [`ChainInput`] that is not a valid chain). A lookup borrows its chain.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::catalog::ReplicaList;
use crate::store::HashRef;

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

/// One reported prefix: a block chain, a legacy single hash, or both. One
/// with neither is dropped at ingest ([`DropReason::EmptyHash`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefixReport {
    /// Legacy exact-match key (empty: none).
    pub prefix_hash: Vec<u8>,
    /// Tokens behind `prefix_hash`.
    pub token_count: u32,
    /// The block chain (empty: none).
    pub chain: BlockChain,
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
    /// Reported prefixes refused before they became [`PrefixReport`]s (a
    /// chain [`BlockChain::new`] does not accept, or a negative token
    /// count), one reason each. Ingest counts them as dropped after the
    /// checks of the whole update (probe tenant, replica, hash scheme), so
    /// a refused prefix is counted once, under the reason it would have had
    /// among the others.
    pub rejected: Vec<DropReason>,
    /// Latest statistics, if any.
    pub stats: Option<ReplicaStatsReport>,
}

/// Why an ingested prefix was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The update had no hash_scheme.
    EmptyHashScheme,
    /// A chain's hashes and token counts differ in length, or a count is negative.
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

/// Hashes of a [`BlockChain`], stored contiguously: 8-byte hashes (what
/// every hash scheme this project fingerprints produces) as one array of
/// words, and a chain with any other width as one byte string with the end
/// offset of each hash. Never holds an empty hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BlockHashes {
    /// Every hash is 8 bytes (the wire form: big-endian).
    Narrow(Vec<[u8; 8]>),
    /// At least one hash of another width: hash `i` is
    /// `bytes[ends[i - 1]..ends[i]]` (from 0 for the first).
    Wide { bytes: Vec<u8>, ends: Vec<usize> },
}

impl Default for BlockHashes {
    fn default() -> Self {
        Self::Narrow(Vec::new())
    }
}

impl BlockHashes {
    /// Number of hashes.
    pub fn len(&self) -> usize {
        match self {
            Self::Narrow(words) => words.len(),
            Self::Wide { ends, .. } => ends.len(),
        }
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hash `i` as bytes.
    pub fn get(&self, i: usize) -> &[u8] {
        match self {
            Self::Narrow(words) => &words[i],
            Self::Wide { bytes, ends } => {
                let start = if i == 0 { 0 } else { ends[i - 1] };
                &bytes[start..ends[i]]
            }
        }
    }

    /// Hash `i` as the store reads it: an 8-byte hash is its word, with no
    /// width check for a chain of 8-byte hashes.
    pub fn hash(&self, i: usize) -> HashRef<'_> {
        match self {
            Self::Narrow(words) => HashRef::Narrow(u64::from_be_bytes(words[i])),
            Self::Wide { .. } => HashRef::from_bytes(self.get(i)),
        }
    }

    /// Every hash as the store reads it, in order.
    pub fn refs(&self) -> impl Iterator<Item = HashRef<'_>> + '_ {
        (0..self.len()).map(|i| self.hash(i))
    }
}

/// A block chain: each block's hash and the tokens in it, in order. Valid by
/// construction: as many token counts as hashes, and no empty hash (see
/// [`BlockChain::new`]); the default is the empty chain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockChain {
    pub(crate) hashes: BlockHashes,
    pub(crate) token_counts: Vec<u32>,
    /// The one token count every block has (an engine hashes full blocks
    /// only), else 0, found once when the chain is made: a lookup's token
    /// totals then count `blocks × this` instead of summing (summing the
    /// 64 counts of a request's checks alone was 2 % of a lookup).
    block_tokens: u32,
}

impl BlockChain {
    /// A chain of hashes of any width: [`DropReason::MalformedChain`] when
    /// there are not as many token counts as hashes, else
    /// [`DropReason::EmptyHash`] when a hash is empty. Hashes of 8 bytes are
    /// kept as words; any other width in the chain keeps them all as one
    /// byte string.
    pub fn new<H: AsRef<[u8]>>(hashes: &[H], token_counts: Vec<u32>) -> Result<Self, DropReason> {
        if hashes.len() != token_counts.len() {
            return Err(DropReason::MalformedChain);
        }
        let mut narrow = true;
        for hash in hashes {
            match hash.as_ref().len() {
                0 => return Err(DropReason::EmptyHash),
                8 => {}
                _ => narrow = false,
            }
        }
        let hashes = if narrow {
            BlockHashes::Narrow(
                hashes
                    .iter()
                    .map(|h| <[u8; 8]>::try_from(h.as_ref()).unwrap_or_default())
                    .collect(),
            )
        } else {
            let mut bytes = Vec::with_capacity(hashes.iter().map(|h| h.as_ref().len()).sum());
            let ends = hashes
                .iter()
                .map(|h| {
                    bytes.extend_from_slice(h.as_ref());
                    bytes.len()
                })
                .collect();
            BlockHashes::Wide { bytes, ends }
        };
        Ok(Self::of(hashes, token_counts))
    }

    fn of(hashes: BlockHashes, token_counts: Vec<u32>) -> Self {
        let block_tokens = match token_counts.split_first() {
            Some((&first, rest)) if rest.iter().all(|&n| n == first) => first,
            _ => 0,
        };
        Self {
            hashes,
            token_counts,
            block_tokens,
        }
    }

    /// A chain of 8-byte hashes (wire form, big-endian), taken as they are:
    /// [`DropReason::MalformedChain`] when there are not as many token
    /// counts as hashes.
    pub fn from_words(hashes: Vec<[u8; 8]>, token_counts: Vec<u32>) -> Result<Self, DropReason> {
        if hashes.len() != token_counts.len() {
            return Err(DropReason::MalformedChain);
        }
        Ok(Self::of(BlockHashes::Narrow(hashes), token_counts))
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.token_counts.len()
    }

    /// True for the empty chain.
    pub fn is_empty(&self) -> bool {
        self.token_counts.is_empty()
    }

    /// Block `i`'s hash.
    pub fn hash(&self, i: usize) -> &[u8] {
        self.hashes.get(i)
    }

    /// Every block's hash, in order.
    pub fn hashes(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        (0..self.len()).map(|i| self.hashes.get(i))
    }

    /// Tokens per block.
    pub fn token_counts(&self) -> &[u32] {
        &self.token_counts
    }

    /// Tokens of the whole chain.
    pub fn tokens(&self) -> u64 {
        self.tokens_between(0, self.len())
    }

    /// The one token count of every block, when they all have the same.
    fn block_tokens(&self) -> Option<u32> {
        (self.block_tokens > 0).then_some(self.block_tokens)
    }

    /// Tokens of blocks `from..to` (as far as the chain goes) as the ranking
    /// adds token counts: signed, at most `i64::MAX`.
    pub fn token_total(&self, from: usize, to: usize) -> i64 {
        i64::try_from(self.tokens_between(from, to)).unwrap_or(i64::MAX)
    }

    /// Tokens of blocks `from..to` (as far as the chain goes).
    pub(crate) fn tokens_between(&self, from: usize, to: usize) -> u64 {
        let to = to.min(self.len());
        let from = from.min(to);
        match self.block_tokens() {
            Some(each) => u64::from(each) * (to - from) as u64,
            None => self.token_counts[from..to]
                .iter()
                .map(|&n| u64::from(n))
                .sum(),
        }
    }
}

/// How a lookup is fingerprinted as a chain, as the server resolved it.
#[derive(Debug, Clone, Copy, Default)]
pub enum ChainInput<'a> {
    /// No chain: the exact `prefix_hash`, if any, is the key.
    #[default]
    None,
    /// A wire chain whose hashes and token counts differ in length:
    /// malformed, NO_HINT (after the probe tenant, TIMEOUT and
    /// POLICY_REQUIRES_CHAIN; not a wire chain for `requireChain`).
    Mismatched,
    /// A wire chain of as many token counts as hashes, with a negative
    /// count or an empty hash: a wire chain for `requireChain`, then NO_HINT
    /// when chain matching is on; with chain matching off the lookup goes
    /// on with `prefix_hash`, as for a valid wire chain.
    Invalid,
    /// A valid wire chain.
    Wire(&'a BlockChain),
    /// A chain the server computed (from token ids or a tokenized prompt).
    Derived(&'a BlockChain),
}

impl<'a> ChainInput<'a> {
    /// The chain, when there is a valid one.
    pub fn chain(self) -> Option<&'a BlockChain> {
        match self {
            Self::Wire(c) | Self::Derived(c) => Some(c),
            Self::None | Self::Mismatched | Self::Invalid => None,
        }
    }

    /// True when the request carried a wire chain of parallel arrays
    /// (what `requireChain` asks for).
    pub fn from_wire(self) -> bool {
        matches!(self, Self::Wire(_) | Self::Invalid)
    }
}

/// A chain as the lookup steps pass it on.
pub(crate) type Chain<'a> = &'a BlockChain;

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
    /// The chain: a wire chain (valid or not), one derived from token ids,
    /// or none.
    pub chain: ChainInput<'a>,
    /// Legacy exact-match key.
    pub prefix_hash: &'a [u8],
    /// Tokens behind `prefix_hash`.
    pub prefix_token_count: u32,
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
            chain: ChainInput::None,
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

/// One ranked replica. Its name is the answer's
/// ([`LookupOutcome::replica_id`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaScore {
    /// The replica's id in the index that answered (as in [`HolderMatch`]).
    pub replica: u32,
    /// Ranking score (higher is better).
    pub score: f32,
    /// Tokens of the request the replica holds.
    pub matched_tokens: i32,
    /// matched / request tokens × freshness.
    pub estimated_cache_hit_prob: f32,
    /// Coldest tier across the matched run; unspecified without prefix evidence.
    pub tier: Tier,
}

/// One holder of a chain's leading blocks as the store's match step finds
/// it: before liveness, ranking and names (see [`crate::CacheIndex::match_chain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderMatch {
    /// The replica's id in this index ([`crate::CacheIndex::replica_name`]).
    pub replica: u32,
    /// Leading blocks of the chain it holds.
    pub blocks: u32,
    /// Their tokens.
    pub tokens: i64,
    /// Oldest last-seen second among them (the weakest link).
    pub oldest_seen: u32,
    /// Coldest tier among them.
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
#[derive(Clone)]
pub struct LookupOutcome {
    /// Reason code.
    pub reason: Reason,
    /// Ranked replicas, best first (empty for every fail-open code).
    pub scores: Vec<ReplicaScore>,
    /// Echo of the partition consulted; empty on envelopes returned before the index is consulted.
    pub adapter_id: String,
    /// What decided the answer.
    pub decision: Decision,
    /// The names behind the scores' ids, as they were when it answered.
    names: Option<Arc<ReplicaList>>,
}

impl LookupOutcome {
    /// An answer that ranks replicas named in `names`.
    pub(crate) fn ranked(
        reason: Reason,
        scores: Vec<ReplicaScore>,
        adapter: &str,
        decision: Decision,
        names: Arc<ReplicaList>,
    ) -> Self {
        Self {
            reason,
            names: (!scores.is_empty()).then_some(names),
            scores,
            adapter_id: adapter.to_owned(),
            decision,
        }
    }

    /// The names this answer's ids resolve through.
    #[cfg(test)]
    pub(crate) fn names(&self) -> Option<&Arc<ReplicaList>> {
        self.names.as_ref()
    }

    /// The name of a replica this answer ranks (empty for a score it did
    /// not give).
    pub fn replica_id(&self, score: &ReplicaScore) -> &str {
        self.names
            .as_deref()
            .and_then(|n| n.name(score.replica))
            .unwrap_or("")
    }

    /// The ranked replicas' names, best first.
    pub fn replica_ids(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.named_scores().map(|(name, _)| name)
    }

    /// The best replica's name and score, if it ranks any.
    pub fn top(&self) -> Option<(&str, &ReplicaScore)> {
        self.named_scores().next()
    }

    /// The scores with their replicas' names, best first.
    pub fn named_scores(&self) -> impl ExactSizeIterator<Item = (&str, &ReplicaScore)> + '_ {
        self.scores.iter().map(|s| (self.replica_id(s), s))
    }

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
            names: None,
        }
    }
}

/// Two answers are equal when they say the same: the same replicas by name
/// (ids are one index's), scores, codes and echo.
impl PartialEq for LookupOutcome {
    fn eq(&self, other: &Self) -> bool {
        // A score without its id: everything else it says.
        fn said<'a>((name, s): (&'a str, &ReplicaScore)) -> (&'a str, ReplicaScore) {
            (name, ReplicaScore { replica: 0, ..*s })
        }
        self.reason == other.reason
            && self.decision == other.decision
            && self.adapter_id == other.adapter_id
            && self
                .named_scores()
                .map(said)
                .eq(other.named_scores().map(said))
    }
}

/// Shows each score beside its replica's name.
impl fmt::Debug for LookupOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LookupOutcome")
            .field("reason", &self.reason)
            .field("scores", &self.named_scores().collect::<Vec<_>>())
            .field("adapter_id", &self.adapter_id)
            .field("decision", &self.decision)
            .finish()
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

#[cfg(test)]
mod tests {
    use super::BlockChain;

    #[test]
    fn a_chain_counts_its_tokens_whether_blocks_are_alike_or_not() {
        let hashes = [[1u8; 8], [2; 8], [3; 8]];
        let alike = BlockChain::new(&hashes, vec![16, 16, 16]).expect("a valid chain");
        assert_eq!(alike.block_tokens(), Some(16));
        assert_eq!(alike.tokens(), 48);
        assert_eq!(
            [0, 1, 2, 3, 9].map(|k| alike.tokens_between(0, k)),
            [0, 16, 32, 48, 48]
        );
        let mixed =
            BlockChain::from_words(hashes.to_vec(), vec![16, 16, 5]).expect("a valid chain");
        assert_eq!(mixed.block_tokens(), None);
        assert_eq!(mixed.tokens(), 37);
        assert_eq!(
            [0, 1, 2, 3, 9].map(|k| mixed.tokens_between(0, k)),
            [0, 16, 32, 37, 37]
        );
        assert_eq!(BlockChain::default().tokens(), 0);
        assert_eq!(BlockChain::default().tokens_between(0, 4), 0);
        assert_eq!(mixed.tokens_between(1, 3), 21);
        assert_eq!(alike.tokens_between(1, 3), 32);
    }
}
