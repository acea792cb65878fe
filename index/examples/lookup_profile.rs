//! A driver for instruction counts: ingests the table bench's workload
//! (100,000 entries, `HOLDERS` replicas per chain, default 2), then runs
//! 20,000 lookups of stored chains (`ENTRIES` and `LOOKUPS` change both). Under callgrind, counting only the
//! lookups (or only the ingest), the total divided by 20,000 lookups (or by
//! the block reports, printed) is the instructions per lookup (per block) —
//! figures that, unlike times, do not move with the machine's load. With
//! `--features compare-kv-index` and `INDEX=kv-index` it does the same with
//! the published `kv-index` crate's `ChainIndex`:
//!
//! ```sh
//! cargo build --release -p inference-cache-index --features compare-kv-index --example lookup_profile
//! valgrind --tool=callgrind --toggle-collect='*CacheIndex>::lookup' \
//!   target/release/examples/lookup_profile
//! INDEX=kv-index valgrind --tool=callgrind --toggle-collect='*ChainIndex*find_matches*' \
//!   target/release/examples/lookup_profile
//! # ingest: --toggle-collect='*CacheIndex*ingest*' / '*ChainIndex*apply_stored*'
//! # the store's match step alone: OP=match, --toggle-collect='*CacheIndex*match_chain*'
//! ```
//!
//! `RANKER=Contract` ranks by the wire contract's score instead of the
//! default cost-aware ranker.
//!
//! `GAP_US=200` spaces the lookups (of either index) by that many
//! microseconds of spinning, untimed; `EVICT_KB=4096` writes a line in every
//! 64 bytes of a buffer that large before each lookup, untimed, which
//! clears the core's own caches of the lookup's code and data. Besides the
//! percentiles it prints the mean and how many lookups took over 4 µs,
//! per millisecond spent looking up: interruptions that come with time
//! (timer ticks, the host) land at the same rate per millisecond in any
//! index's lookups, though a slower lookup needs a shorter one to cross
//! the line.

#[path = "../benches/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inference_cache_index::{
    CacheIndex, ChainInput, LookupRequest, PolicySet, Reason, SystemClock,
};
use support::Workload;

/// Lookups run, unless `LOOKUPS` says otherwise (more for a sampling
/// profiler than for an instruction count).
const LOOKUPS: usize = 20_000;

fn main() {
    let holders = support::env_number("HOLDERS", 2usize);
    let lookups = support::env_number("LOOKUPS", LOOKUPS);
    let entries = support::env_number("ENTRIES", 100_000usize);
    let work = Workload::new(entries, holders);
    let mut pause = Pause::from_env();
    if std::env::var("INDEX").is_ok_and(|v| v == "kv-index") {
        #[cfg(feature = "compare-kv-index")]
        return kv_index(&work, lookups, &mut pause);
        #[cfg(not(feature = "compare-kv-index"))]
        panic!("INDEX=kv-index needs --features compare-kv-index");
    }
    let reports: usize = work
        .updates()
        .iter()
        .map(|u| u.prefixes[0].chain.len())
        .sum();
    let index = CacheIndex::new(Arc::new(SystemClock), u64::MAX);
    // `RANKER=Contract`: the wire contract's ranking instead of the default
    // cost-aware one, under an otherwise default policy.
    if let Ok(ranker) = std::env::var("RANKER") {
        let doc = format!(
            "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {{name: profile, namespace: \"*\"}}\nspec: {{ranker: {ranker}}}\n"
        );
        let policies = PolicySet::from_yaml(&doc)
            .unwrap_or_else(|e| panic!("RANKER={ranker} is not a ranker of a policy: {e}"));
        index.set_policies(policies);
    }
    for u in work.updates() {
        index.ingest(&u);
    }
    // `OP=match`: the store's match step alone (`match_chain`).
    let match_only = std::env::var("OP").is_ok_and(|v| v == "match");
    let mut c = 0usize;
    let mut hits = 0usize;
    let mut samples = Vec::with_capacity(lookups);
    for _ in 0..lookups {
        c = (c + 7919) % work.chains.len();
        // A freshly decoded request is cache-hot, as in the table bench.
        // The wait comes before the copy, so the request is as fresh as
        // one just decoded.
        pause.before_lookup();
        let decoded = work.block_chains[c].clone();
        let mut request = LookupRequest::new("tenant", "model", "vllm");
        request.chain = ChainInput::Wire(&decoded);
        let t = Instant::now();
        if match_only {
            let found = black_box(index.match_chain(&request));
            samples.push(t.elapsed().as_nanos() as u64);
            hits += usize::from(!found.is_empty());
            continue;
        }
        let outcome = black_box(index.lookup(&request));
        samples.push(t.elapsed().as_nanos() as u64);
        hits += usize::from(matches!(
            outcome.reason,
            Reason::PrefixMatch | Reason::AffinityHint
        ));
    }
    assert_eq!(hits, lookups, "every lookup must find its chain");
    println!("{reports} block reports, {lookups} lookups, {holders} holders per chain");
    print_times(&mut samples);
}

#[cfg(feature = "compare-kv-index")]
fn kv_index(work: &Workload, lookups: usize, pause: &mut Pause) {
    use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
    let index = ChainIndex::new();
    let workers: Vec<u32> = (0..support::REPLICAS)
        .map(|r| {
            index
                .intern_worker(&format!("replica-{r}"))
                .expect("worker slot")
        })
        .collect();
    let mut maps: Vec<ChainBlockMap> = (0..support::REPLICAS)
        .map(|_| ChainBlockMap::default())
        .collect();
    let mut reports = 0;
    for (c, (prefixes, contents)) in work.prefixes.iter().zip(&work.contents).enumerate() {
        let blocks: Vec<StoredBlock> = prefixes
            .iter()
            .zip(contents)
            .map(|(&s, &c)| StoredBlock {
                seq_hash: SequenceHash(s),
                content_hash: ContentHash(c),
            })
            .collect();
        for r in work.holders_of(c) {
            index
                .apply_stored(workers[r], &blocks, None, &mut maps[r])
                .expect("store");
            reports += blocks.len();
        }
    }
    let requests: Vec<Vec<ContentHash>> = work
        .contents
        .iter()
        .map(|c| c.iter().map(|&h| ContentHash(h)).collect())
        .collect();
    let mut c = 0usize;
    let mut samples = Vec::with_capacity(lookups);
    for _ in 0..lookups {
        c = (c + 7919) % requests.len();
        pause.before_lookup();
        let decoded = requests[c].clone();
        let t = Instant::now();
        let scores = black_box(index.find_matches(&decoded, false));
        samples.push(t.elapsed().as_nanos() as u64);
        assert!(
            !scores.scores.is_empty(),
            "every lookup must find its chain"
        );
    }
    println!("kv-index: {reports} block reports, {lookups} lookups");
    print_times(&mut samples);
}

/// What runs before each lookup, untimed: a server does other work
/// between lookups.
struct Pause {
    /// `GAP_US`: spinning this long.
    gap: Option<Duration>,
    /// `EVICT_KB`: a buffer that large, a line of it written every 64 bytes.
    evict: Vec<u8>,
}

impl Pause {
    fn from_env() -> Self {
        let evict_kb = support::env_number("EVICT_KB", 0u64);
        let gap_us = support::env_number("GAP_US", 0u64);
        Self {
            gap: (gap_us > 0).then(|| Duration::from_micros(gap_us)),
            evict: vec![1; usize::try_from(evict_kb * 1024).expect("EVICT_KB fits memory")],
        }
    }

    /// Writes the buffer's lines, then spins.
    fn before_lookup(&mut self) {
        for i in (0..self.evict.len()).step_by(64) {
            self.evict[i] = self.evict[i].wrapping_add(1);
        }
        black_box(&self.evict);
        let Some(gap) = self.gap else {
            return;
        };
        let until = Instant::now() + gap;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

/// Lookup time percentiles (each lookup timed alone, as in the table bench;
/// outside what callgrind counts).
fn print_times(samples: &mut [u64]) {
    samples.sort_unstable();
    let at = |q: f64| support::percentile(samples, q);
    println!(
        "lookup p50 {} ns, p90 {} ns, p99 {} ns, p99.9 {} ns",
        at(0.5),
        at(0.9),
        at(0.99),
        at(0.999)
    );
    // Lookups that took a stall of microseconds (an interrupt, a page
    // walk from memory): how often, against the time spent looking up.
    let total_ns: u64 = samples.iter().sum();
    let stalled = samples.len() - samples.partition_point(|&t| t < STALL_NS);
    println!(
        "mean {} ns, {stalled} lookups over {} µs ({:.1} per ms looking up)",
        total_ns / samples.len().max(1) as u64,
        STALL_NS / 1000,
        stalled as f64 / (total_ns as f64 / 1e6).max(f64::MIN_POSITIVE)
    );
}

/// What counts as a stall in [`print_times`].
const STALL_NS: u64 = 4_000;
