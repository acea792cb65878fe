//! The in-process backend: a fresh [`CacheIndex`] per row on a
//! [`ManualClock`] that follows simulated time, so freshness, stats age,
//! `replicaTimeout` and the TTL sweep all run on the trace's clock (compressed
//! by `--speedup`), not on the wall clock.
//!
//! The sweep runs every [`SWEEP_INTERVAL_MS`] of simulated time, as the server
//! does by default. The index is capped at [`MAX_ENTRIES`] block-replica
//! entries, far above what `replicas × capacity` can reach, so only the
//! replicas' own evictions and the TTL remove entries.

use std::sync::Arc;

use inference_cache_index::{
    BlockChain, CacheEvent, CacheIndex, CacheUpdate, ChainInput, LookupRequest, ManualClock,
    PolicySet,
};

use crate::error::ReplayError;
use crate::routed::{Answer, Backend, HASH_SCHEME, MODEL, TENANT};

/// Simulated time between TTL sweeps (the server's default `--sweep-interval`).
pub const SWEEP_INTERVAL_MS: f64 = 10_000.0;
/// Global entry cap of the replay's index.
pub const MAX_ENTRIES: u64 = 1 << 32;

/// A [`CacheIndex`] in this process.
#[derive(Debug)]
pub struct InProcess {
    index: CacheIndex,
    clock: ManualClock,
    epoch_ms: u64,
    next_sweep_ms: f64,
}

impl InProcess {
    /// A fresh index with `policies`.
    pub fn new(policies: PolicySet) -> Self {
        let clock = ManualClock::default();
        let epoch_ms = inference_cache_index::Clock::now_ms(&clock);
        let index = CacheIndex::new(Arc::new(clock.clone()), MAX_ENTRIES);
        index.set_policies(policies);
        Self {
            index,
            clock,
            epoch_ms,
            next_sweep_ms: SWEEP_INTERVAL_MS,
        }
    }

    /// The index, for inspection.
    pub fn index(&self) -> &CacheIndex {
        &self.index
    }
}

impl Backend for InProcess {
    fn set_time(&mut self, now_ms: f64) {
        self.clock.set_ms(self.epoch_ms + now_ms.max(0.0) as u64);
    }

    fn ingest(&mut self, update: CacheUpdate) -> Result<(), ReplayError> {
        self.index.ingest(&update);
        Ok(())
    }

    fn publish(&mut self, events: Vec<CacheEvent>) -> Result<(), ReplayError> {
        for event in &events {
            self.index.publish(event);
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
        let mut request = LookupRequest::new(TENANT, MODEL, HASH_SCHEME);
        let counts = token_counts
            .iter()
            .map(|&n| u32::try_from(n).unwrap_or(0))
            .collect();
        let chain = BlockChain::new(hashes, counts);
        if !hashes.is_empty() {
            request.chain = match &chain {
                Ok(chain) => ChainInput::Wire(chain),
                Err(_) => ChainInput::Invalid,
            };
        }
        let outcome = self.index.lookup(&request);
        let matched = outcome
            .scores
            .first()
            .map_or(0, |s| u64::try_from(s.matched_tokens).unwrap_or(0));
        let answer = Answer {
            reason: outcome.reason.as_str().to_owned(),
            first: outcome.top().map(|(name, _)| name.to_string()),
        };
        Ok((answer, matched))
    }

    fn housekeeping(&mut self, now_ms: f64) {
        if now_ms >= self.next_sweep_ms {
            self.index.sweep();
            self.next_sweep_ms = now_ms + SWEEP_INTERVAL_MS;
        }
    }
}
