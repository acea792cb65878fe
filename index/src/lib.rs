//! In-memory KV-cache index, ranker and routing policy behind LookupRoute,
//! ReportCacheState, PublishEvent and GetCacheState — plain Rust, no transport
//! types.
//!
//! Main types:
//! - [`CacheIndex`]: ingest ([`CacheIndex::ingest`]), events
//!   ([`CacheIndex::publish`]), lookups ([`CacheIndex::lookup`]), aggregates
//!   ([`CacheIndex::cache_state`], [`CacheIndex::snapshot`]) and bounded memory
//!   ([`CacheIndex::sweep`]).
//! - [`BlockChain`]: a reported or looked-up block chain, valid by
//!   construction (as many `u32` token counts as hashes, no empty hash);
//!   [`ChainInput`] says what chain a lookup has, or why none.
//! - [`PolicySet`] / [`CachePolicy`]: per-tenant knobs parsed from a YAML stream
//!   of CachePolicy objects.
//! - [`Clock`]: the time source, so time rules are testable ([`ManualClock`]).
//!
//! Key: `(tenant, model, hash_scheme, adapter, prefix_hash)` → per replica
//! `{last_seen, tier, access_count}` (+ the key's token count). Strings are
//! interned; blocks are stored in runs of consecutive blocks that lookups
//! read without locks; see the `store` module notes for layout and costs.
//! A lookup is the match step (`matching`: the holders of the request's
//! leading blocks, from the store alone) and then the ranking over the
//! fleet's live members (`lookup`, `cost`).
//!
//! ```
//! use std::sync::Arc;
//! use inference_cache_index::*;
//!
//! let clock = ManualClock::default();
//! let index = CacheIndex::new(Arc::new(clock), DEFAULT_MAX_ENTRIES);
//! let blocks: Vec<[u8; 8]> = (1u64..=3).map(u64::to_be_bytes).collect();
//! let chain = |n: usize| BlockChain::from_words(blocks[..n].to_vec(), vec![64; n]);
//! for (replica, held) in [("a", 3), ("b", 2), ("c", 1)] {
//!     index.ingest(&CacheUpdate {
//!         replica_id: replica.into(),
//!         tenant_id: "t".into(),
//!         model_id: "m".into(),
//!         hash_scheme: "vllm".into(),
//!         prefixes: vec![PrefixReport {
//!             chain: chain(held)?,
//!             ..Default::default()
//!         }],
//!         ..Default::default()
//!     });
//! }
//! let request_chain = chain(3)?;
//! let mut request = LookupRequest::new("t", "m", "vllm");
//! request.chain = ChainInput::Wire(&request_chain);
//! let outcome = index.lookup(&request);
//! assert_eq!(outcome.reason, Reason::PrefixMatch);
//! let order: Vec<&str> = outcome.replica_ids().collect();
//! assert_eq!(order, ["a", "b", "c"]);
//! # Ok::<(), DropReason>(())
//! ```

mod branches;
mod catalog;
mod clock;
mod cost;
mod fleet;
mod index;
mod lookup;
mod matching;
mod messages;
mod parts_map;
mod policy;
mod store;
mod sweep;
mod table;

pub use clock::{Clock, ManualClock, SystemClock};
pub use index::{CacheIndex, DEFAULT_MAX_ENTRIES, DEFAULT_MAX_HOLDERS_PER_KEY};
pub use lookup::{affinity_digest, pick_affinity};
pub use messages::{
    BlockChain, CacheEvent, CacheSummary, CacheUpdate, ChainInput, Decision, DropReason, EventKind,
    EventReport, EvictionReason, HolderMatch, IngestReport, LookupOutcome, LookupRequest,
    PROBE_TENANT, PrefixReport, Reason, ReplicaScore, ReplicaState, ReplicaStatsReport, ScopeState,
    Snapshot, SweepReport, TenantSnapshot, Tier,
};
pub use policy::{
    AffinityAlgorithm, CachePolicy, DEFAULT_NAMESPACE, Eviction, PolicyError, PolicySet, Ranker,
    Strategy, format_duration, parse_duration,
};

#[cfg(test)]
mod tests;
