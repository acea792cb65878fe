//! Producer and consumer protobufs into the index, as the server's gRPC edge
//! handles them: each record decodes a `CacheStateUpdate` (bounded and
//! converted like `ReportCacheState`, then ingested) or a `LookupRouteRequest`
//! (bounded and resolved like `LookupRoute`, then looked up), or moves the
//! clock or runs a sweep.
//!
//! Input: records of `[kind: u8][len: u8][len bytes]` (a short last record
//! takes what is left). Every lookup must answer one of the wire reason codes
//! with finite scores and a hit probability in `[0, 1]`.
#![no_main]

use std::sync::Arc;
use std::time::{Duration, Instant};

use inference_cache_index as index;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest};
use inference_cache_server::limits::{bound_lookup, bound_update};
use inference_cache_server::{
    Limits, Metrics, block_chain, cache_update, derived_chain, exact_token_count,
};
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// Small enough that the fuzzer reaches the cap and its evictions.
const MAX_ENTRIES: u64 = 256;
const BLOCK_SIZE: usize = 16;

/// The server's `resolve_input` and `lookup`, without the tokenizer (a text
/// prompt resolves to no chain, as on the tokenizer fail-open path).
fn lookup(idx: &index::CacheIndex, request: &LookupRouteRequest) -> index::LookupOutcome {
    let mut query =
        index::LookupRequest::new(&request.tenant_id, &request.model_id, &request.hash_scheme);
    let partition =
        inference_cache_fingerprint::partition_key(&request.adapter_id, &request.cache_salt);
    query.adapter_id = &partition;
    query.slo_ttft_ms = request.slo.as_ref().map_or(0, |s| s.ttft_ms);
    let now = Instant::now();
    query.arrived = now;
    query.deadline = Some(now + Duration::from_secs(60));
    let wire;
    let derived;
    if !request.block_hashes.is_empty() || !request.block_token_counts.is_empty() {
        if request.block_hashes.len() == request.block_token_counts.len() {
            wire = block_chain(&request.block_hashes, &request.block_token_counts);
            query.chain = match &wire {
                Ok(chain) => index::ChainInput::Wire(chain),
                Err(_) => index::ChainInput::Invalid,
            };
            query.prefix_hash = &request.prefix_hash;
            query.prefix_token_count = exact_token_count(request.prefix_token_count);
        } else {
            query.chain = index::ChainInput::Mismatched;
        }
    } else if !request.prefix_hash.is_empty() {
        query.prefix_hash = &request.prefix_hash;
        query.prefix_token_count = exact_token_count(request.prefix_token_count);
    } else if !request.token_ids.is_empty() {
        derived = derived_chain(&inference_cache_fingerprint::request_chain(
            &request.token_ids,
            BLOCK_SIZE,
        ));
        if let Some(chain) = &derived {
            query.chain = index::ChainInput::Derived(chain);
        }
    }
    idx.lookup(&query)
}

fn check(outcome: &index::LookupOutcome) {
    assert!(
        index::Reason::ALL.contains(&outcome.reason),
        "reason outside the wire codes: {:?}",
        outcome.reason
    );
    for score in &outcome.scores {
        assert!(score.score.is_finite(), "non-finite score: {score:?}");
        assert!(
            (0.0..=1.0).contains(&score.estimated_cache_hit_prob),
            "hit probability outside [0, 1]: {score:?}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let clock = Arc::new(index::ManualClock::new(1_000_000));
    let idx = index::CacheIndex::new(clock.clone(), MAX_ENTRIES);
    let limits = Limits::default();
    let metrics = Metrics::new();
    let mut rest = data;
    while let Some((&kind, tail)) = rest.split_first() {
        let (len, tail) = match tail.split_first() {
            Some((&len, tail)) => (usize::from(len), tail),
            None => (0, tail),
        };
        let (record, tail) = tail.split_at(len.min(tail.len()));
        rest = tail;
        match kind % 4 {
            0 => {
                if let Ok(mut update) = CacheStateUpdate::decode(record) {
                    bound_update(&limits, &metrics, &mut update);
                    let _ = idx.ingest(&cache_update(update));
                }
            }
            1 => {
                if let Ok(mut request) = LookupRouteRequest::decode(record) {
                    if bound_lookup(&limits, &metrics, &mut request) {
                        check(&lookup(&idx, &request));
                    }
                }
            }
            2 => {
                let ms = record
                    .iter()
                    .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
                clock.advance(Duration::from_millis(ms % (3 * 60 * 60 * 1000)));
            }
            _ => {
                let _ = idx.sweep();
            }
        }
    }
    assert!(
        idx.entry_count() >= 0,
        "negative entry count {}",
        idx.entry_count()
    );
});
