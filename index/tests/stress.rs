//! Many threads at once on one index: long-chain lookups (both rankers),
//! ingest of overlapping chains, single-block removals, ALL_CLEARED,
//! heartbeats, stats and sweeps. Fails on a hang (a watchdog bounds every
//! round), a panic, or an answer no index could give: a replica outside the
//! fleet, or a PREFIX_MATCH claiming more tokens than the request has.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use inference_cache_index::{
    BlockChain, CacheEvent, CacheIndex, CacheUpdate, ChainInput, EventKind, LookupRequest,
    PolicySet, PrefixReport, Reason, ReplicaStatsReport, SystemClock,
};

const REPLICAS: u64 = 6;
const CHAIN: u64 = 256;
const ROUND: Duration = Duration::from_millis(1500);
const WATCHDOG: Duration = Duration::from_secs(20);
/// Global entry cap of the index under test (small, so ingest hits it).
const CAP: u64 = 2_000;

fn policy(ranker: &str) -> PolicySet {
    let doc = format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {{name: p, namespace: \"*\"}}\nspec: {{ranker: {ranker}, minimumMatchedTokens: 16}}\n"
    );
    PolicySet::from_yaml(&doc).expect("policy")
}

fn block(family: u64, i: u64) -> Vec<u8> {
    ((family << 32) | i).to_be_bytes().to_vec()
}

fn chain(family: u64, len: u64) -> Vec<Vec<u8>> {
    (0..len).map(|i| block(family, i)).collect()
}

fn replica(r: u64) -> String {
    format!("10.0.0.{r}:8000")
}

fn update(r: u64, prefixes: Vec<PrefixReport>, stats: Option<ReplicaStatsReport>) -> CacheUpdate {
    CacheUpdate {
        replica_id: replica(r),
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        prefixes,
        stats,
        ..Default::default()
    }
}

fn event(kind: EventKind, r: u64, hash: Vec<u8>) -> CacheEvent {
    CacheEvent {
        kind,
        replica_id: replica(r),
        tenant_id: "t".into(),
        model_id: "m".into(),
        prefix_hash: hash,
        adapter_id: String::new(),
    }
}

/// One round: `threads` workers for `ROUND`; returns lookups answered.
fn round(seed: u64, threads: usize) -> u64 {
    let index = Arc::new(CacheIndex::new(Arc::new(SystemClock), CAP));
    index.set_policies(policy(if seed.is_multiple_of(2) {
        "CostAware"
    } else {
        "Contract"
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let lookups = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for worker in 0..threads {
        let (index, stop, lookups) = (index.clone(), stop.clone(), lookups.clone());
        handles.push(thread::spawn(move || {
            let mut n = seed.wrapping_mul(31).wrapping_add(worker as u64);
            let mut next = || {
                n ^= n << 13;
                n ^= n >> 7;
                n ^= n << 17;
                n
            };
            let counts = vec![16; CHAIN as usize];
            let ranker_is_contract = !seed.is_multiple_of(2);
            while !stop.load(Ordering::Relaxed) {
                let family = next() % 4;
                let r = next() % REPLICAS;
                match worker % 6 {
                    // Lookups of long overlapping chains.
                    0..=2 => {
                        let len = 1 + next() % CHAIN;
                        let hashes = chain(family, len);
                        let mut req = LookupRequest::new("t", "m", "vllm");
                        let block_chain = BlockChain::new(&hashes, counts[..len as usize].to_vec())
                            .expect("a valid chain");
                        req.chain = ChainInput::Derived(&block_chain);
                        let out = index.lookup(&req);
                        let names: Vec<&str> = out.replica_ids().collect();
                        for (i, (&name, s)) in names.iter().zip(&out.scores).enumerate() {
                            let known = (0..REPLICAS).any(|r| name == replica(r));
                            assert!(known, "unknown replica {name}");
                            assert!(i64::from(s.matched_tokens) <= 16 * len as i64);
                            assert!(!names[..i].contains(&name), "{name} named twice");
                            if out.reason == Reason::PrefixMatch && ranker_is_contract {
                                assert!(s.matched_tokens > 0 && s.matched_tokens % 16 == 0);
                            }
                        }
                        if out.reason == Reason::PrefixMatch {
                            assert!(!out.scores.is_empty());
                        }
                        lookups.fetch_add(1, Ordering::Relaxed);
                    }
                    // Ingest of overlapping chains, with stats.
                    3 => {
                        let len = 1 + next() % CHAIN;
                        let stats = ReplicaStatsReport {
                            requests_waiting: (next() % 8) as u32,
                            requests_running: (next() % 8) as u32,
                            ..Default::default()
                        };
                        index.ingest(&update(
                            r,
                            vec![PrefixReport {
                                chain: BlockChain::new(&chain(family, len), vec![16; len as usize])
                                    .expect("a valid chain"),
                                ..Default::default()
                            }],
                            Some(stats),
                        ));
                    }
                    // Removals and heartbeats.
                    4 => {
                        let i = next() % CHAIN;
                        index.publish(&event(EventKind::PrefixEvicted, r, block(family, i)));
                        index.publish(&event(EventKind::ReplicaUpdated, r, Vec::new()));
                    }
                    // ALL_CLEARED and sweeps.
                    _ => {
                        if next() % 8 == 0 {
                            index.publish(&event(EventKind::AllCleared, r, Vec::new()));
                        }
                        index.sweep();
                        thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }));
    }
    thread::sleep(ROUND);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("worker panicked");
    }
    // The cap holds at ingest: never above it by more than one update.
    assert!(index.entry_count() <= CAP as i64 + CHAIN as i64);
    assert!(index.prefix_count() <= index.entry_count());
    if !seed.is_multiple_of(2) {
        quiescent_check(&index);
    }
    lookups.load(Ordering::Relaxed)
}

/// Once writers stop, every chain answer must agree with the per-block
/// state read through exact lookups: each holder of block 0 is named, with
/// the tokens of its leading run of held blocks.
fn quiescent_check(index: &CacheIndex) {
    // No floors, so every holder of a key is named.
    let open = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: p, namespace: \"*\"}\nspec: {ranker: Contract, minimumMatchedTokens: 0, routingFloorScore: \"0\", affinityRouting: Disabled}\n";
    index.set_policies(PolicySet::from_yaml(open).expect("policy"));
    let counts = vec![16; CHAIN as usize];
    for family in 0..4 {
        let hashes = chain(family, CHAIN);
        let holders: Vec<Vec<String>> = hashes
            .iter()
            .map(|h| {
                let mut req = LookupRequest::new("t", "m", "vllm");
                req.prefix_hash = h;
                req.prefix_token_count = 16;
                let out = index.lookup(&req);
                if out.reason == Reason::PrefixMatch {
                    out.replica_ids().map(str::to_string).collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let mut expected: Vec<(String, i32)> = (0..REPLICAS)
            .map(replica)
            .map(|r| {
                let run = holders.iter().take_while(|h| h.contains(&r)).count();
                (r, 16 * run as i32)
            })
            .filter(|&(_, tokens)| tokens >= 16)
            .collect();
        expected.sort();
        let mut req = LookupRequest::new("t", "m", "vllm");
        let block_chain = BlockChain::new(&hashes, counts.to_vec()).expect("a valid chain");
        req.chain = ChainInput::Derived(&block_chain);
        let out = index.lookup(&req);
        let mut got: Vec<(String, i32)> = if out.reason == Reason::PrefixMatch {
            out.named_scores()
                .map(|(name, s)| (name.to_string(), s.matched_tokens))
                .collect()
        } else {
            Vec::new()
        };
        got.sort();
        assert_eq!(
            got, expected,
            "family {family}: chain answer vs per-block state"
        );
    }
}

#[test]
fn no_hang_no_panic_under_concurrent_lookups_ingest_and_removals() {
    for seed in 0..10u64 {
        let (tx, rx) = mpsc::channel();
        let started = Instant::now();
        thread::spawn(move || {
            let answered = round(seed, 12);
            let _ = tx.send(answered);
        });
        match rx.recv_timeout(WATCHDOG) {
            Ok(answered) => assert!(answered > 0, "round {seed}: no lookup completed"),
            Err(_) => panic!(
                "round {seed}: the index hung (no progress after {:?})",
                started.elapsed()
            ),
        }
    }
}

/// Writers take the catalog's and the fleet's write locks in the gaps
/// between lookups (they try before they wait): with lookups running back
/// to back on several threads, a stream of updates under new names (catalog
/// writes) and ALL_CLEARED / re-join cycles (fleet writes) still completes,
/// and lookups keep being answered meanwhile.
#[test]
fn writers_are_not_starved_by_lookups_back_to_back() {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let index = Arc::new(CacheIndex::new(Arc::new(SystemClock), 1_000_000));
        index.set_policies(policy("Contract"));
        let blocks = chain(1, 64);
        for r in 0..REPLICAS {
            index.ingest(&update(
                r,
                vec![PrefixReport {
                    chain: BlockChain::new(&blocks, vec![16; blocks.len()]).expect("a valid chain"),
                    ..Default::default()
                }],
                None,
            ));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let (index, stop, answered, blocks) = (
                    index.clone(),
                    stop.clone(),
                    answered.clone(),
                    blocks.clone(),
                );
                thread::spawn(move || {
                    let counts = vec![16; blocks.len()];
                    while !stop.load(Ordering::Relaxed) {
                        let mut req = LookupRequest::new("t", "m", "vllm");
                        let block_chain =
                            BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
                        req.chain = ChainInput::Derived(&block_chain);
                        let outcome = index.lookup(&req);
                        // Every replica holds the chain: a hint, never nothing.
                        assert!(
                            matches!(outcome.reason, Reason::PrefixMatch | Reason::AffinityHint),
                            "{:?}",
                            outcome.reason
                        );
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // Writes start once lookups run, and go on until 300 rounds are done
        // and 1,000 lookups were answered while they ran.
        while answered.load(Ordering::Relaxed) == 0 {
            thread::yield_now();
        }
        let before = answered.load(Ordering::Relaxed);
        let mut i = 0u64;
        while i < 300 || answered.load(Ordering::Relaxed) < before + 1_000 {
            i += 1;
            // A new tenant and replica name: catalog writes and a join.
            let mut u = update(
                100 + i,
                vec![PrefixReport {
                    chain: BlockChain::new(&chain(2, 4), vec![16; 4]).expect("a valid chain"),
                    ..Default::default()
                }],
                None,
            );
            u.tenant_id = format!("tenant-{i}");
            index.ingest(&u);
            // A leave and a re-join of a serving replica: fleet writes.
            let mut clear = event(EventKind::AllCleared, REPLICAS, Vec::new());
            clear.tenant_id = String::new();
            clear.model_id = String::new();
            index.publish(&clear);
            index.ingest(&update(
                REPLICAS,
                vec![PrefixReport {
                    chain: BlockChain::new(&chain(3, 4), vec![16; 4]).expect("a valid chain"),
                    ..Default::default()
                }],
                None,
            ));
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().expect("reader");
        }
        let _ = tx.send(answered.load(Ordering::Relaxed));
    });
    match rx.recv_timeout(WATCHDOG) {
        Ok(answered) => assert!(answered > 0, "no lookup completed"),
        Err(_) => panic!("writers starved or the index hung"),
    }
}
