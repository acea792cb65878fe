//! A lookup-only driver for instruction counts: builds the table bench's
//! workload (100,000 entries, `HOLDERS` replicas per chain, default 2), then
//! runs 20,000 lookups of stored chains. Under callgrind, counting only the
//! lookups, the total divided by 20,000 is the instructions per lookup — a
//! figure that, unlike time, does not move with the machine's load:
//!
//! ```sh
//! cargo build --release -p inference-cache-index --example lookup_profile
//! valgrind --tool=callgrind --toggle-collect='*CacheIndex*lookup*' \
//!   target/release/examples/lookup_profile
//! ```

#[path = "../benches/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::sync::Arc;

use inference_cache_index::{BlockHashes, CacheIndex, Chain, LookupRequest, Reason, SystemClock};
use support::{BLOCK, CHAIN_BLOCKS, Workload};

const LOOKUPS: usize = 20_000;

fn main() {
    let holders: usize = std::env::var("HOLDERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let work = Workload::new(100_000, holders);
    let index = CacheIndex::new(Arc::new(SystemClock), u64::MAX);
    for u in work.updates() {
        index.ingest(&u);
    }
    let counts = vec![BLOCK as i32; CHAIN_BLOCKS];
    let mut c = 0usize;
    let mut hits = 0usize;
    for _ in 0..LOOKUPS {
        c = (c + 7919) % work.chains.len();
        let mut request = LookupRequest::new("tenant", "model", "vllm");
        request.chain = Some(Chain {
            hashes: BlockHashes::Bytes(&work.chains[c]),
            token_counts: &counts,
        });
        let outcome = black_box(index.lookup(&request));
        hits += usize::from(matches!(
            outcome.reason,
            Reason::PrefixMatch | Reason::AffinityHint
        ));
    }
    assert_eq!(hits, LOOKUPS, "every lookup must find its chain");
    println!("{LOOKUPS} lookups, {holders} holders per chain");
}
