//! Lookup latency of long chains: each chain of `B` blocks (512 by
//! default: 8 runs of 64) is reported whole by two replicas, `C` chains
//! (4,000 by default), then 200,000 lookups of random chains each get the
//! full ranked answer. A long prompt crosses a run end every 64 blocks,
//! which the table bench's 64-block chains never do.
//!
//! Run: `cargo bench -p inference-cache-index --bench long_chain`
//! (`B=1024 C=2000` for other sizes). Under `cargo test` a small run is a
//! smoke check.
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use inference_cache_index::{
    BlockChain, CacheIndex, CacheUpdate, ChainInput, LookupRequest, PrefixReport, SystemClock,
};

mod support;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let bench = std::env::args().any(|a| a == "--bench");
    let blocks = support::env_number("B", 512usize);
    let chains = support::env_number("C", if bench { 4000usize } else { 20 });
    let index = CacheIndex::new(Arc::new(SystemClock), u64::MAX);
    let mut all = Vec::new();
    for c in 0..chains {
        let hashes: Vec<[u8; 8]> = (0..blocks)
            .map(|b| {
                ((c as u64) << 32 | b as u64)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    .to_be_bytes()
            })
            .collect();
        let chain = BlockChain::from_words(hashes, vec![16; blocks]).expect("a valid chain");
        for r in 0..2 {
            index.ingest(&CacheUpdate {
                replica_id: format!("replica-{}", (c + r) % 8),
                tenant_id: "tenant".into(),
                model_id: "model".into(),
                hash_scheme: "vllm".into(),
                prefixes: vec![PrefixReport {
                    chain: chain.clone(),
                    ..Default::default()
                }],
                ..Default::default()
            });
        }
        all.push(chain);
    }
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut samples = Vec::new();
    for _ in 0..if bench { 200_000 } else { 1000 } {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let c = (state % chains as u64) as usize;
        let mut r = LookupRequest::new("tenant", "model", "vllm");
        r.chain = ChainInput::Wire(&all[c]);
        let t = Instant::now();
        black_box(index.lookup(&r));
        samples.push(t.elapsed().as_nanos() as u64);
    }
    samples.sort_unstable();
    let p = |q: f64| support::percentile(&samples, q) as f64 / 1e3;
    println!(
        "{chains} chains of {blocks} blocks, 2 holders: lookup p50 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs",
        p(0.5),
        p(0.99),
        p(0.999)
    );
}
