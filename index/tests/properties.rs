//! Property tests of the chain matcher and the store.
//!
//! The first gives up to six replicas a random subset of a 12-block chain and
//! asks for a random prefix of it, under either ranker; the properties are
//! checked against a straightforward model of the longest-leading-run rule,
//! in both directions for the Contract ranker (a PREFIX_MATCH exactly when
//! some replica holds block 0). The second runs
//! random interleavings of stores (whole, from the middle of a chain, or with
//! every other block missing; chains longer than a run), removals,
//! ALL_CLEARED, TTL sweeps, capacity evictions and lookups against a
//! reference map of (replica, block) → (last seen, tier), and checks every
//! lookup's holders, matched tokens, tiers and weakest-link freshness and
//! the entry and key counts after every step.

use std::sync::Arc;

use inference_cache_index::{
    BlockChain, CacheEvent, CacheIndex, CacheUpdate, ChainInput, Clock, EventKind, LookupRequest,
    ManualClock, PolicySet, PrefixReport, Reason, Tier,
};
use proptest::prelude::*;

/// No floors and no fallback, under `ranker`: with the Contract ranker a
/// request is a PREFIX_MATCH exactly when some replica holds its block 0;
/// the cost-aware ranker may also downgrade a match that distinguishes no
/// replica.
fn open_policy(ranker: &str) -> PolicySet {
    let doc = format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
metadata: {{name: open, namespace: \"*\"}}\nspec: {{ranker: {ranker}, minimumMatchedTokens: 0, minimumPrefixTokens: 0, routingFloorScore: \"0\", affinityRouting: Disabled}}\n"
    );
    PolicySet::from_yaml(&doc).expect("policy")
}

fn build(holdings: &[Vec<bool>], counts: &[u32], ranker: &str) -> (CacheIndex, Vec<Vec<u8>>) {
    let index = CacheIndex::new(Arc::new(ManualClock::default()), 1_000_000);
    index.set_policies(open_policy(ranker));
    let blocks: Vec<Vec<u8>> = (0..counts.len() as u64)
        .map(|i| (0xABCD_0000 + i).to_be_bytes().to_vec())
        .collect();
    for (r, held) in holdings.iter().enumerate() {
        let (mut hashes, mut held_counts) = (Vec::new(), Vec::new());
        for (i, &h) in held.iter().enumerate() {
            if h {
                hashes.push(blocks[i].clone());
                held_counts.push(counts[i]);
            }
        }
        let prefix = PrefixReport {
            chain: BlockChain::new(&hashes, held_counts).expect("a valid chain"),
            ..Default::default()
        };
        index.ingest(&CacheUpdate {
            replica_id: format!("r{r}"),
            tenant_id: "t".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            prefixes: vec![prefix],
            ..Default::default()
        });
    }
    (index, blocks)
}

proptest! {
    #[test]
    fn chain_lookup_respects_leading_run(
        holdings in prop::collection::vec(prop::collection::vec(any::<bool>(), 12), 1..6),
        // Counts of every size, or one size for every block (an engine's
        // full blocks, which the lookup counts without summing).
        counts in prop_oneof![
            prop::collection::vec(1u32..200, 12),
            (1u32..200).prop_map(|n| vec![n; 12]),
        ],
        asked in 1usize..=12,
        contract in any::<bool>(),
    ) {
        let ranker = if contract { "Contract" } else { "CostAware" };
        let (index, blocks) = build(&holdings, &counts, ranker);
        let mut request = LookupRequest::new("t", "m", "vllm");
        let chain = BlockChain::new(&blocks[..asked], counts[..asked].to_vec()).expect("a valid chain");
        request.chain = ChainInput::Wire(&chain);
        let outcome = index.lookup(&request);
        for (name, score) in outcome.named_scores() {
            let r: usize = name[1..].parse().expect("replica index");
            // Never a replica lacking block 0.
            prop_assert!(holdings[r][0], "{} lacks block 0", name);
            // matched_tokens is the sum of the counts of the leading run.
            let run = holdings[r][..asked].iter().take_while(|&&h| h).count();
            let expected: u32 = counts[..run].iter().sum();
            prop_assert_eq!(i64::from(score.matched_tokens), i64::from(expected));
        }
        let any_block0 = holdings.iter().any(|h| h[0]);
        if contract {
            // Both directions: a match iff some replica holds block 0.
            prop_assert_eq!(outcome.reason == Reason::PrefixMatch, any_block0, "{:?}", outcome.reason);
        }
        if outcome.reason == Reason::PrefixMatch {
            prop_assert!(any_block0);
            let mut holders: Vec<String> = holdings.iter().enumerate().filter(|(_, h)| h[0]).map(|(i, _)| format!("r{i}")).collect();
            let mut returned: Vec<String> = outcome.replica_ids().map(str::to_string).collect();
            holders.sort();
            returned.sort();
            prop_assert_eq!(returned, holders);
            for pair in outcome.scores.windows(2) {
                prop_assert!(pair[0].score >= pair[1].score);
            }
        }
    }
}

/// One step of the model-based test.
#[derive(Debug, Clone)]
enum Op {
    /// `replica` reports blocks `start..start + len` of chain `family`
    /// (every other one when `sparse`) at `tier`.
    Store {
        replica: usize,
        family: u64,
        start: u64,
        len: u64,
        sparse: bool,
        tier: i32,
    },
    /// PREFIX_EVICTED of one block.
    Remove {
        replica: usize,
        family: u64,
        block: u64,
    },
    /// ALL_CLEARED of a replica.
    Clear { replica: usize },
    /// A sweep (TTL expiry).
    Sweep,
    /// Capacity eviction of every entry older than the `nth` distinct
    /// report time (so no tie straddles the cut).
    Evict { nth: usize },
    /// A chain lookup of blocks `0..len` of a family.
    Lookup { family: u64, len: u64 },
}

const FAMILIES: u64 = 3;
const LONGEST: u64 = 150;
const REPLICAS: usize = 4;
const TTL_SECS: u64 = 12;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..REPLICAS, 0..FAMILIES, 0..LONGEST, 1..LONGEST, any::<bool>(), 0..4i32).prop_map(
            |(replica, family, start, len, sparse, tier)| Op::Store {
                replica,
                family,
                start: start / 2,
                len,
                sparse,
                tier,
            }
        ),
        2 => (0..REPLICAS, 0..FAMILIES, 0..LONGEST)
            .prop_map(|(replica, family, block)| Op::Remove { replica, family, block }),
        1 => (0..REPLICAS).prop_map(|replica| Op::Clear { replica }),
        1 => Just(Op::Sweep),
        1 => (0..8usize).prop_map(|nth| Op::Evict { nth }),
        4 => (0..FAMILIES, 1..LONGEST).prop_map(|(family, len)| Op::Lookup { family, len }),
    ]
}

fn key(family: u64, block: u64) -> Vec<u8> {
    ((family << 40) | block).to_be_bytes().to_vec()
}

/// The reference: (replica, family, block) → (last seen s, tier).
type Reference = std::collections::BTreeMap<(usize, u64, u64), (u64, i32)>;

fn event(kind: EventKind, replica: usize, hash: Vec<u8>) -> CacheEvent {
    CacheEvent {
        kind,
        replica_id: format!("r{replica}"),
        model_id: String::new(),
        tenant_id: String::new(),
        prefix_hash: hash,
        adapter_id: String::new(),
    }
}

fn run_model(ops: &[Op]) -> Result<(), TestCaseError> {
    let clock = ManualClock::default();
    let index = CacheIndex::new(Arc::new(clock.clone()), u64::MAX);
    let policy = format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
metadata: {{name: open, namespace: \"*\"}}\nspec: {{ranker: Contract, minimumMatchedTokens: 0, minimumPrefixTokens: 0, routingFloorScore: \"0\", \
affinityRouting: Disabled, evictionTTL: {TTL_SECS}s, replicaTimeout: 1h}}\n"
    );
    index.set_policies(PolicySet::from_yaml(&policy).expect("policy"));
    let mut reference = Reference::new();
    for op in ops {
        clock.advance(std::time::Duration::from_secs(1));
        let now = clock.now_ms() / 1000;
        match *op {
            Op::Store {
                replica,
                family,
                start,
                len,
                sparse,
                tier,
            } => {
                let blocks: Vec<u64> = (start..start + len)
                    .filter(|b| !sparse || b % 2 == 0)
                    .collect();
                let prefix = PrefixReport {
                    chain: BlockChain::new(
                        &blocks
                            .iter()
                            .map(|&b| key(family, b))
                            .collect::<Vec<Vec<u8>>>(),
                        vec![16; blocks.len()],
                    )
                    .expect("a valid chain"),
                    tier: Tier::from_i32(tier),
                    ..Default::default()
                };
                index.ingest(&CacheUpdate {
                    replica_id: format!("r{replica}"),
                    tenant_id: "t".into(),
                    model_id: "m".into(),
                    hash_scheme: "vllm".into(),
                    prefixes: vec![prefix],
                    ..Default::default()
                });
                for b in blocks {
                    reference.insert((replica, family, b), (now, tier.max(1)));
                }
            }
            Op::Remove {
                replica,
                family,
                block,
            } => {
                let report = index.publish(&event(
                    EventKind::PrefixEvicted,
                    replica,
                    key(family, block),
                ));
                let held = reference.remove(&(replica, family, block)).is_some();
                prop_assert_eq!(report.entries_removed, u64::from(held));
            }
            Op::Clear { replica } => {
                let report = index.publish(&event(EventKind::AllCleared, replica, Vec::new()));
                let before = reference.len();
                reference.retain(|&(r, ..), _| r != replica);
                prop_assert_eq!(report.entries_removed as usize, before - reference.len());
            }
            Op::Sweep => {
                let report = index.sweep();
                let before = reference.len();
                reference.retain(|_, &mut (seen, _)| seen + TTL_SECS >= now);
                prop_assert_eq!(report.ttl as usize, before - reference.len());
            }
            Op::Evict { nth } => {
                let mut times: Vec<u64> = reference.values().map(|&(s, _)| s).collect();
                times.sort_unstable();
                times.dedup();
                let Some(&cut) = times.get(nth) else { continue };
                // The sweep expires first; the cap then evicts what is older than `cut`.
                reference.retain(|_, &mut (seen, _)| seen + TTL_SECS >= now);
                let keep = reference.values().filter(|&&(s, _)| s >= cut).count();
                index.set_max_entries(keep as u64);
                index.sweep();
                index.set_max_entries(u64::MAX);
                reference.retain(|_, &mut (seen, _)| seen >= cut);
            }
            Op::Lookup { family, len } => {
                let blocks: Vec<Vec<u8>> = (0..len).map(|b| key(family, b)).collect();
                let counts = vec![16; blocks.len()];
                let mut request = LookupRequest::new("t", "m", "vllm");
                let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
                request.chain = ChainInput::Derived(&block_chain);
                let outcome = index.lookup(&request);
                // Per replica: matched tokens, coldest tier and the oldest
                // last-seen second of the leading run (weakest link), which
                // the Contract ranker's hit probability carries as freshness
                // (matched / request tokens × (1 − age / TTL)).
                let mut expected: Vec<(String, i32, i32, u32)> = Vec::new();
                for r in 0..REPLICAS {
                    let run: Vec<(u64, i32)> = (0..len)
                        .map_while(|b| reference.get(&(r, family, b)).copied())
                        .collect();
                    if !run.is_empty() {
                        let coldest = run.iter().map(|&(_, t)| t).max().unwrap_or(1);
                        let oldest = run.iter().map(|&(s, _)| s).min().unwrap_or(now);
                        let freshness = (1.0 - (now - oldest) as f64 / TTL_SECS as f64).max(0.0);
                        let hit = (run.len() as f64 / len as f64).min(1.0) * freshness;
                        expected.push((
                            format!("r{r}"),
                            16 * run.len() as i32,
                            coldest,
                            (hit as f32).to_bits(),
                        ));
                    }
                }
                let mut got: Vec<(String, i32, i32, u32)> = outcome
                    .named_scores()
                    .map(|(name, s)| {
                        (
                            name.to_string(),
                            s.matched_tokens,
                            s.tier as i32,
                            s.estimated_cache_hit_prob.to_bits(),
                        )
                    })
                    .collect();
                got.sort();
                prop_assert_eq!(
                    &got,
                    &expected,
                    "{:?} of family {} up to {}",
                    outcome.reason,
                    family,
                    len
                );
                prop_assert_eq!(outcome.reason == Reason::PrefixMatch, !expected.is_empty());
            }
        }
        let blocks: std::collections::BTreeSet<(u64, u64)> =
            reference.keys().map(|&(_, f, b)| (f, b)).collect();
        prop_assert_eq!(
            index.entry_count(),
            reference.len() as i64,
            "after {:?}",
            op
        );
        prop_assert_eq!(index.prefix_count(), blocks.len() as i64, "after {:?}", op);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_reference_index(ops in prop::collection::vec(op(), 1..60)) {
        run_model(&ops)?;
    }
}
