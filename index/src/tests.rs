//! Rule-by-rule tests of ingest, events, lookup, ranking and sweeping, driven
//! by a [`ManualClock`] so no test sleeps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::*;

mod routing;

const T: &str = "team-a";
const M: &str = "llama";
const S: &str = "vllm";

struct Fixture {
    clock: ManualClock,
    index: CacheIndex,
}

/// An empty index under the contract's ranker (the rule-by-rule tests below
/// pin the contract; `routing` tests the cost-aware ranker).
fn fixture() -> Fixture {
    let clock = ManualClock::default();
    let index = CacheIndex::new(Arc::new(clock.clone()), DEFAULT_MAX_ENTRIES);
    let f = Fixture { clock, index };
    f.policy("");
    f
}

fn h(n: u64) -> Vec<u8> {
    n.to_be_bytes().to_vec()
}

fn chain(range: std::ops::Range<u64>) -> Vec<Vec<u8>> {
    range.map(h).collect()
}

fn update(replica: &str, prefixes: Vec<PrefixReport>) -> CacheUpdate {
    CacheUpdate {
        replica_id: replica.into(),
        tenant_id: T.into(),
        model_id: M.into(),
        hash_scheme: S.into(),
        prefixes,
        ..Default::default()
    }
}

fn chain_prefix(blocks: &[Vec<u8>], tokens: u32) -> PrefixReport {
    PrefixReport {
        chain: BlockChain::new(blocks, vec![tokens; blocks.len()]).expect("a valid chain"),
        ..Default::default()
    }
}

fn exact_prefix(hash: u64, tokens: u32) -> PrefixReport {
    PrefixReport {
        prefix_hash: h(hash),
        token_count: tokens,
        ..Default::default()
    }
}

impl Fixture {
    /// ALL_CLEARED for `replica`, across every tenant and model.
    fn clear(&self, replica: &str) -> EventReport {
        self.index.publish(&CacheEvent {
            kind: EventKind::AllCleared,
            replica_id: replica.into(),
            model_id: String::new(),
            tenant_id: String::new(),
            prefix_hash: Vec::new(),
            adapter_id: String::new(),
        })
    }

    fn hold(&self, replica: &str, blocks: &[Vec<u8>]) {
        self.index
            .ingest(&update(replica, vec![chain_prefix(blocks, 64)]));
    }

    fn stats(&self, replica: &str, hit_rate: f32, pressure: f32) {
        let mut u = update(replica, vec![]);
        u.stats = Some(ReplicaStatsReport {
            hit_rate,
            pressure,
            cache_memory_bytes: 1000,
            ..Default::default()
        });
        self.index.ingest(&u);
    }

    /// Installs a default policy with `yaml_spec` lines; the contract's
    /// ranker unless the lines name one.
    fn policy(&self, yaml_spec: &str) {
        let ranker = if yaml_spec.contains("ranker:") {
            ""
        } else {
            "  ranker: Contract\n"
        };
        let doc = format!(
            "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {{name: p, namespace: \"*\"}}\nspec:\n{ranker}{yaml_spec}"
        );
        self.index
            .set_policies(PolicySet::from_yaml(&doc).expect("policy"));
    }

    fn lookup_chain(&self, blocks: &[Vec<u8>]) -> LookupOutcome {
        let counts = vec![64; blocks.len()];
        let mut r = LookupRequest::new(T, M, S);
        let block_chain = BlockChain::new(blocks, counts.to_vec()).expect("a valid chain");
        r.chain = ChainInput::Wire(&block_chain);
        self.index.lookup(&r)
    }

    fn lookup_exact(&self, hash: u64, tokens: u32) -> LookupOutcome {
        let bytes = h(hash);
        let mut r = LookupRequest::new(T, M, S);
        r.prefix_hash = &bytes;
        r.prefix_token_count = tokens;
        self.index.lookup(&r)
    }
}

pub(crate) fn heartbeat(index: &CacheIndex, replica: &str) {
    index.publish(&CacheEvent {
        kind: EventKind::ReplicaUpdated,
        replica_id: replica.into(),
        tenant_id: T.into(),
        model_id: M.into(),
        prefix_hash: Vec::new(),
        adapter_id: String::new(),
    });
}

fn ids(o: &LookupOutcome) -> Vec<&str> {
    o.replica_ids().collect()
}

#[test]
fn worked_example_three_two_one_blocks() {
    let f = fixture();
    let blocks = chain(1..4);
    f.hold("A", &blocks[..3]);
    f.hold("B", &blocks[..2]);
    f.hold("C", &blocks[..1]);
    let o = f.lookup_chain(&blocks);
    assert_eq!(o.reason, Reason::PrefixMatch);
    assert_eq!(ids(&o), ["A", "B", "C"]);
    let matched: Vec<i32> = o.scores.iter().map(|s| s.matched_tokens).collect();
    assert_eq!(matched, [192, 128, 64]);
    // Fresh entries, no stats, no SLO: score = matched × distinguishing power.
    let expect = [192.0 * 2.0 / 3.0, 128.0 / 3.0, 0.0];
    for (s, e) in o.scores.iter().zip(expect) {
        assert!((f64::from(s.score) - e).abs() < 1e-3, "{} vs {e}", s.score);
    }
    assert!((o.scores[0].estimated_cache_hit_prob - 1.0).abs() < 1e-6);
    assert!((o.scores[2].estimated_cache_hit_prob - 1.0 / 3.0).abs() < 1e-6);
    assert_eq!(o.scores[0].tier, Tier::T1);
}

/// An answer's names are this thread's copy of the catalog's list: two
/// answers share one (not the catalog's own), a name interned after it is
/// resolved by the next answer through a fresh copy, and another thread
/// answers through a copy of its own.
#[test]
fn answers_carry_this_threads_copy_of_the_names() {
    let f = fixture();
    let blocks = chain(1..4);
    f.hold("A", &blocks[..3]);
    let first = f.lookup_chain(&blocks);
    let second = f.lookup_chain(&blocks);
    let names = first.names().expect("a ranked answer has names");
    assert!(Arc::ptr_eq(names, second.names().expect("names")));
    assert!(!Arc::ptr_eq(names, f.index.catalog.read().replica_list()));
    f.hold("B", &blocks[..2]);
    let third = f.lookup_chain(&blocks);
    assert!(!Arc::ptr_eq(names, third.names().expect("names")));
    assert_eq!(ids(&third), ["A", "B"]);
    assert_eq!(ids(&first), ["A"], "an earlier answer keeps its names");
    let elsewhere =
        std::thread::scope(|s| s.spawn(|| f.lookup_chain(&blocks)).join().expect("thread"));
    assert!(!Arc::ptr_eq(
        elsewhere.names().expect("names"),
        third.names().expect("names")
    ));
    assert_eq!(ids(&elsewhere), ids(&third));
}

#[test]
fn drop_out_is_final_and_block_zero_required() {
    let f = fixture();
    let blocks = chain(1..5);
    // B holds blocks 0, 2, 3 but not 1: its run is one block.
    f.hold("A", &blocks[..2]);
    f.index.ingest(&update(
        "B",
        vec![chain_prefix(
            &[blocks[0].clone(), blocks[2].clone(), blocks[3].clone()],
            64,
        )],
    ));
    // C holds everything but block 0: never a candidate.
    f.hold("C", &blocks[1..]);
    f.policy("  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n");
    let o = f.lookup_chain(&blocks);
    assert_eq!(o.reason, Reason::PrefixMatch);
    assert_eq!(ids(&o), ["A", "B"]);
    assert_eq!(o.scores[1].matched_tokens, 64);
}

/// A request leaves a run wherever its parent-chained hashes part from the
/// run's: before, at or after where earlier reports left it (the run's
/// branch hint, which the walk tries first), or not at all.
#[test]
fn a_request_leaves_a_run_where_its_hashes_part_from_it() {
    let f = fixture();
    f.policy("  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n");
    let whole = chain(0..64);
    // B left A's run after 20 blocks, for a branch of its own.
    let mut branch = chain(0..20);
    branch.extend(chain(1_000..1_044));
    f.hold("A", &whole);
    f.hold("B", &branch);
    let parting = |at: u64, rest: u64| {
        let mut c = chain(0..at);
        c.extend(chain(5_000 + at..5_000 + at + rest));
        c
    };
    let cases: [(Vec<Vec<u8>>, i32, i32); 8] = [
        (whole.clone(), 64, 20),
        (branch[..30].to_vec(), 20, 30),
        (branch.clone(), 20, 64),
        (parting(7, 5), 7, 7),
        (parting(19, 1), 19, 19),
        (parting(21, 9), 21, 20),
        (parting(45, 19), 45, 20),
        (chain(0..30), 30, 20),
    ];
    for (request, a, b) in cases {
        let o = f.lookup_chain(&request);
        let matched = |r: &str| {
            o.replica_ids()
                .zip(&o.scores)
                .find(|(id, _)| *id == r)
                .map(|(_, s)| s.matched_tokens / 64)
        };
        assert_eq!(
            (matched("A"), matched("B")),
            (Some(a), Some(b)),
            "a request of {} blocks",
            request.len()
        );
    }
}

#[test]
fn weakest_link_freshness_and_coldest_tier() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks[..1]);
    f.clock.advance(Duration::from_secs(15 * 60));
    let mut p = chain_prefix(&blocks[1..2], 64);
    p.tier = Tier::T2;
    f.index.ingest(&update("A", vec![p]));
    f.hold("B", &blocks[..1]); // distinguishes A
    let o = f.lookup_chain(&blocks);
    assert_eq!(o.reason, Reason::PrefixMatch);
    let a = &o.scores[0];
    assert_eq!(o.replica_id(a), "A");
    assert_eq!(a.tier, Tier::T2);
    // oldest block is 15 of 30 minutes old → freshness 0.5; power 1 - 1/2.
    assert!(
        (f64::from(a.score) - 128.0 * 0.5 * 0.5).abs() < 1e-3,
        "{}",
        a.score
    );
    assert!((a.estimated_cache_hit_prob - 0.5).abs() < 1e-6);
}

#[test]
fn tier_last_write_wins_and_unspecified_is_t1() {
    let f = fixture();
    let mut p = exact_prefix(9, 128);
    p.tier = Tier::T2;
    f.index.ingest(&update("A", vec![p.clone()]));
    f.index.ingest(&update("B", vec![exact_prefix(99, 128)]));
    assert_eq!(f.lookup_exact(9, 128).scores[0].tier, Tier::T2);
    p.tier = Tier::Unspecified;
    f.index.ingest(&update("A", vec![p]));
    assert_eq!(f.lookup_exact(9, 128).scores[0].tier, Tier::T1);
}

#[test]
fn exact_path_and_legacy_key_from_chain() {
    let f = fixture();
    let blocks = chain(1..3);
    let mut p = chain_prefix(&blocks, 64);
    p.prefix_hash = h(777);
    p.token_count = 128;
    f.index.ingest(&update("A", vec![p]));
    f.hold("B", &chain(50..51));
    let o = f.lookup_exact(777, 128);
    assert_eq!(o.reason, Reason::PrefixMatch);
    assert_eq!(ids(&o), ["A"]);
    assert_eq!(o.scores[0].matched_tokens, 128);
    assert_eq!(f.index.entry_count(), 4);
    assert_eq!(f.index.prefix_count(), 4);
}

#[test]
fn chain_lookup_hits_legacy_entry_on_first_block() {
    let f = fixture();
    f.index.ingest(&update("A", vec![exact_prefix(1, 64)]));
    f.hold("B", &chain(50..51));
    let o = f.lookup_chain(&chain(1..4));
    assert_eq!(o.reason, Reason::PrefixMatch);
    assert_eq!(ids(&o), ["A"]);
    assert_eq!(o.scores[0].matched_tokens, 64);
}

#[test]
fn malformed_and_empty_scheme_ingest_dropped_and_counted() {
    let f = fixture();
    // A chain is checked when it is built ...
    assert_eq!(
        BlockChain::new(&chain(1..3), vec![64]),
        Err(DropReason::MalformedChain)
    );
    assert_eq!(
        BlockChain::new(&[Vec::<u8>::new()], vec![64]),
        Err(DropReason::EmptyHash)
    );
    assert_eq!(
        BlockChain::from_words(vec![[1; 8]], vec![]),
        Err(DropReason::MalformedChain)
    );
    // ... and what the sender refused is counted with the update's drops.
    let mut u = update("A", vec![PrefixReport::default(), exact_prefix(5, 16)]);
    u.rejected = vec![DropReason::MalformedChain, DropReason::EmptyHash];
    let r = f.index.ingest(&u);
    assert_eq!(r.dropped_for(DropReason::MalformedChain), 1);
    assert_eq!(r.dropped_for(DropReason::EmptyHash), 2);
    assert_eq!(r.accepted_prefixes, 1);
    // The checks of the whole update come first: a refused prefix counts
    // under their reason.
    let mut u = update("A", vec![exact_prefix(6, 16)]);
    u.hash_scheme.clear();
    u.rejected = vec![DropReason::MalformedChain];
    let r = f.index.ingest(&u);
    assert_eq!(r.dropped_for(DropReason::EmptyHashScheme), 2);
    assert_eq!(r.dropped_for(DropReason::MalformedChain), 0);
    assert_eq!(f.index.entry_count(), 1);
    let mut u = update("A", vec![exact_prefix(6, 16)]);
    u.tenant_id = PROBE_TENANT.into();
    u.rejected = vec![DropReason::EmptyHash];
    assert_eq!(f.index.ingest(&u).dropped_for(DropReason::ProbeTenant), 2);
    let mut u = update("", vec![]);
    u.rejected = vec![DropReason::EmptyHash];
    let r = f.index.ingest(&u);
    assert_eq!(
        (r.dropped_for(DropReason::EmptyReplica), r.dropped.len()),
        (1, 1)
    );
    assert_eq!(f.index.entry_count(), 1);
}

#[test]
fn malformed_and_empty_scheme_lookups_are_no_hint() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    for malformed in [ChainInput::Mismatched, ChainInput::Invalid] {
        let mut r = LookupRequest::new(T, M, S);
        r.chain = malformed;
        r.adapter_id = "x";
        let o = f.index.lookup(&r);
        assert_eq!(
            (o.reason, o.adapter_id.as_str(), o.decision),
            (Reason::NoHint, "x", Decision::NotConsulted),
            "{malformed:?}"
        );
    }
    let mut r = LookupRequest::new(T, M, "");
    let bytes = h(1);
    r.prefix_hash = &bytes;
    assert_eq!(f.index.lookup(&r).reason, Reason::NoHint);
    // No fingerprint at all.
    assert_eq!(
        f.index.lookup(&LookupRequest::new(T, M, S)).reason,
        Reason::NoHint
    );
}

#[test]
fn matched_tokens_floor_downgrades_to_affinity_or_no_hint() {
    let f = fixture();
    let blocks = chain(1..3);
    let p = PrefixReport {
        chain: BlockChain::new(&blocks, vec![16, 16]).expect("a valid chain"),
        ..Default::default()
    };
    f.index.ingest(&update("A", vec![p]));
    f.hold("B", &chain(50..51));
    let counts = [16, 16];
    let mut r = LookupRequest::new(T, M, S);
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    let o = f.index.lookup(&r);
    assert_eq!(o.reason, Reason::AffinityHint);
    assert_eq!(o.scores.len(), 1);
    assert_eq!((o.scores[0].score, o.scores[0].matched_tokens), (0.0, 0));
    f.policy("  affinityRouting: Disabled\n");
    assert_eq!(f.index.lookup(&r).reason, Reason::NoHint);
}

#[test]
fn routing_floor_downgrades_equal_depth() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    f.hold("B", &blocks);
    // Both at the same depth: power 0 → score 0 < 0.1.
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::AffinityHint);
    f.policy("  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::NoHint);
    f.policy("  routingFloorScore: \"0\"\n");
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::PrefixMatch);
}

#[test]
fn single_replica_has_full_power() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    let o = f.lookup_chain(&blocks);
    assert_eq!(o.reason, Reason::PrefixMatch);
    assert!((o.scores[0].score - 128.0).abs() < 1e-3);
}

#[test]
fn minimum_prefix_tokens_gate_in_both_affinity_modes() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    f.policy("  minimumPrefixTokens: 1000\n");
    let o = f.lookup_chain(&blocks);
    assert_eq!((o.reason, ids(&o)), (Reason::AffinityHint, vec!["A"]));
    f.policy("  minimumPrefixTokens: 1000\n  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::NoHint);
    // TENANT_HOT is gated too.
    f.stats("A", 0.9, 0.0);
    f.policy("  minimumPrefixTokens: 1000\n  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_exact(12345, 64).reason, Reason::NoHint);
    f.policy("  minimumPrefixTokens: 1000\n");
    assert_eq!(f.lookup_exact(12345, 64).reason, Reason::AffinityHint);
}

#[test]
fn tenant_hot_for_exact_misses_only() {
    let f = fixture();
    f.hold("A", &chain(1..2));
    f.hold("B", &chain(2..3));
    f.hold("C", &chain(3..4));
    f.stats("A", 0.5, 0.0);
    f.stats("B", 0.9, 0.5);
    f.stats("C", 0.05, 0.0); // below the hit-rate floor
    let o = f.lookup_exact(999, 64);
    assert_eq!(o.reason, Reason::TenantHot);
    assert_eq!(ids(&o), ["A", "B"]);
    assert!((o.scores[0].score - 0.5).abs() < 1e-6);
    assert!((o.scores[1].score - 0.45).abs() < 1e-6);
    assert!(
        o.scores
            .iter()
            .all(|s| s.matched_tokens == 0 && s.tier == Tier::Unspecified)
    );
    // Chain misses never fall to TENANT_HOT.
    assert_eq!(
        f.lookup_chain(&chain(100..102)).reason,
        Reason::AffinityHint
    );
    // Stats age out of the window.
    f.clock.advance(Duration::from_secs(5 * 60));
    assert_eq!(f.lookup_exact(999, 64).reason, Reason::AffinityHint);
}

#[test]
fn a_members_stats_report_goes_through_while_a_lookup_reads_the_fleet() {
    let f = fixture();
    f.hold("A", &chain(1..2));
    f.stats("A", 0.5, 0.0);
    // A lookup holds the fleet shared from its serving set to its answer.
    let in_flight = f.index.fleet.read();
    let (done, arrived) = std::sync::mpsc::channel();
    let fixture = &f;
    std::thread::scope(|s| {
        s.spawn(move || {
            fixture.stats("A", 0.9, 0.5);
            done.send(()).expect("the test waits for it");
        });
        let waited = arrived.recv_timeout(Duration::from_secs(10));
        drop(in_flight);
        assert!(
            waited.is_ok(),
            "a member's stats report waited for a lookup"
        );
    });
    // And lookups rank with the new figures.
    let o = f.lookup_exact(999, 64);
    assert_eq!(o.reason, Reason::TenantHot);
    assert!((o.scores[0].score - 0.45).abs() < 1e-6, "{:?}", o.scores);
}

#[test]
fn a_lookup_reads_a_scopes_holders_while_an_ingest_counts_them() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    f.stats("A", 0.9, 0.0);
    // Silent past the replica timeout: A still serves, as it never
    // heartbeat and holds entries, which the lookup reads from the scope;
    // the TENANT_HOT path reads the same holders.
    f.clock.advance(Duration::from_secs(31));
    let scope = Arc::clone(f.index.catalog.read().scope(T, M, S).expect("the scope"));
    let counting = scope.counting();
    let (done, arrived) = std::sync::mpsc::channel();
    let fixture = &f;
    let blocks = &blocks;
    std::thread::scope(|s| {
        s.spawn(move || {
            let outcomes = (fixture.lookup_chain(blocks), fixture.lookup_exact(999, 64));
            done.send(outcomes).expect("the test waits for it");
        });
        let waited = arrived.recv_timeout(Duration::from_secs(10));
        drop(counting);
        let (matched, hot) = waited.expect("a lookup waited for an ingest counting entries");
        assert_eq!(matched.reason, Reason::PrefixMatch);
        assert_eq!(matched.scores.len(), 1);
        assert_eq!(matched.replica_id(&matched.scores[0]), "A");
        assert_eq!(hot.reason, Reason::TenantHot);
        assert_eq!(hot.replica_id(&hot.scores[0]), "A");
    });
    // Once A holds nothing there, neither path names it.
    assert_eq!(f.clear("A").entries_removed, 2);
    assert_ne!(f.lookup_chain(blocks).reason, Reason::PrefixMatch);
    assert_ne!(f.lookup_exact(999, 64).reason, Reason::TenantHot);
}

#[test]
fn tenant_hot_disabled_and_zero_age() {
    let f = fixture();
    f.hold("A", &chain(1..2));
    f.stats("A", 0.9, 0.0);
    f.policy("  strategy: {enableTenantHot: false}\n  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_exact(999, 64).reason, Reason::NoHint);
    f.policy("  tenantHotMaxAge: 0s\n  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_exact(999, 64).reason, Reason::NoHint);
}

#[test]
fn slo_bias_and_pressure() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    f.stats("A", 0.5, 0.25);
    let counts = [64, 64];
    let mut r = LookupRequest::new(T, M, S);
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    let base = f.index.lookup(&r).scores[0].score;
    assert!((base - 128.0 * 0.75).abs() < 1e-3, "{base}");
    r.slo_ttft_ms = 100;
    let tight = f.index.lookup(&r).scores[0].score;
    assert!((tight - 128.0 * 0.75 * 2.0).abs() < 1e-3, "{tight}");
    r.slo_ttft_ms = 500;
    assert!((f.index.lookup(&r).scores[0].score - base).abs() < 1e-6);
    // Stats older than the TTL are ignored.
    f.clock.advance(Duration::from_secs(31 * 60));
    f.hold("A", &blocks);
    r.slo_ttft_ms = 0;
    assert!((f.index.lookup(&r).scores[0].score - 128.0).abs() < 1e-3);
}

#[test]
fn diagnostics_outer_to_inner_and_cold_start() {
    let f = fixture();
    let probe = |t: &'static str, m: &'static str, s: &'static str| {
        let bytes = h(424242);
        let mut r = LookupRequest::new(t, m, s);
        r.prefix_hash = &bytes;
        f.index.lookup(&r).reason
    };
    assert_eq!(probe("nobody", M, S), Reason::NoHint, "cold start");
    f.hold("A", &chain(1..2));
    assert_eq!(probe("nobody", M, S), Reason::UnknownTenant);
    assert_eq!(probe("nobody", "other", "sglang"), Reason::UnknownTenant);
    assert_eq!(probe(T, "other", "sglang"), Reason::UnknownModel);
    assert_eq!(probe(T, M, "sglang"), Reason::UnknownHashScheme);
    assert_eq!(probe(T, M, S), Reason::AffinityHint);
    assert_eq!(probe("", M, S), Reason::NoHint);
    assert_eq!(probe(T, "", S), Reason::NoHint);
    // Chain misses classify the same way.
    let blocks = chain(500..502);
    let counts = [64, 64];
    let mut r = LookupRequest::new(T, M, "sglang");
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    assert_eq!(f.index.lookup(&r).reason, Reason::UnknownHashScheme);
    // An unseen adapter in a known domain is a novel-prefix miss.
    let mut r = LookupRequest::new(T, M, S);
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    r.adapter_id = "never-seen";
    let o = f.index.lookup(&r);
    assert_eq!(
        (o.reason, o.adapter_id.as_str()),
        (Reason::AffinityHint, "never-seen")
    );
}

#[test]
fn timeout_precedence_and_no_credit() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    f.policy("  eviction: LFU\n  lookupTimeoutMs: 5\n");
    let counts = [64, 64];
    let mut r = LookupRequest::new(T, M, S);
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    r.adapter_id = "x";
    r.arrived = Instant::now() - Duration::from_millis(50);
    let o = f.index.lookup(&r);
    assert_eq!(
        (o.reason, o.adapter_id.as_str(), o.scores.len()),
        (Reason::Timeout, "", 0)
    );
    r.arrived = Instant::now();
    r.deadline = Some(Instant::now() - Duration::from_millis(1));
    assert_eq!(f.index.lookup(&r).reason, Reason::Timeout);
    // Timed-out lookups credited nothing: check access counters via LFU order.
    assert_eq!(access_of(&f, "A", &blocks[0]), 0);
    r.deadline = None;
    r.adapter_id = "";
    assert_eq!(f.index.lookup(&r).reason, Reason::PrefixMatch);
    assert_eq!(access_of(&f, "A", &blocks[0]), 1);
    assert_eq!(access_of(&f, "A", &blocks[1]), 1);
}

fn access_of(f: &Fixture, replica: &str, hash: &[u8]) -> u16 {
    let catalog = f.index.catalog.read();
    let part = catalog.partition(T, M, S, "").expect("partition");
    let r = catalog.replica(replica).expect("replica");
    let reader = f.index.store.reader();
    reader
        .locate(part, &crate::store::Key::of_bytes(part, hash))
        .and_then(|(body, pos)| {
            let cell = body.cell(body.row(r)?, pos);
            cell.held().then(|| cell.access())
        })
        .unwrap_or(u16::MAX)
}

#[test]
fn lfu_credit_only_on_prefix_match_in_lfu_namespaces() {
    let f = fixture();
    let blocks = chain(1..3);
    f.hold("A", &blocks);
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::PrefixMatch);
    assert_eq!(
        access_of(&f, "A", &blocks[0]),
        0,
        "LRU namespaces stay side-effect free"
    );
    f.policy("  eviction: LFU\n  minimumPrefixTokens: 1000\n");
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::AffinityHint);
    assert_eq!(
        access_of(&f, "A", &blocks[0]),
        0,
        "non-hit responses credit nothing"
    );
}

#[test]
fn require_chain_and_chain_matching_gates() {
    let f = fixture();
    let blocks = chain(1..3);
    let mut p = chain_prefix(&blocks, 64);
    p.prefix_hash = h(900);
    p.token_count = 128;
    f.index.ingest(&update("A", vec![p]));
    f.policy("  strategy: {requireChain: true}\n");
    let o = f.lookup_exact(900, 128);
    assert_eq!(
        (o.reason, o.adapter_id.as_str()),
        (Reason::PolicyRequiresChain, "")
    );
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::PrefixMatch);
    // A derived (token-id) chain is not a wire chain.
    let fixed: Vec<[u8; 8]> = (1u64..3).map(u64::to_be_bytes).collect();
    let counts = [64, 64];
    let mut r = LookupRequest::new(T, M, S);
    let block_chain = BlockChain::new(&fixed, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    assert_eq!(f.index.lookup(&r).reason, Reason::PolicyRequiresChain);
    // A wire chain of parallel arrays meets the requirement even when it is
    // not valid (then NO_HINT); arrays of different lengths do not.
    let mut bad = LookupRequest::new(T, M, S);
    bad.adapter_id = "x";
    bad.chain = ChainInput::Invalid;
    let o = f.index.lookup(&bad);
    assert_eq!((o.reason, o.adapter_id.as_str()), (Reason::NoHint, "x"));
    bad.chain = ChainInput::Mismatched;
    let o = f.index.lookup(&bad);
    assert_eq!(
        (o.reason, o.adapter_id.as_str()),
        (Reason::PolicyRequiresChain, "")
    );
    f.policy("");
    assert_eq!(f.index.lookup(&r).reason, Reason::PrefixMatch);
    // enableChainMatching=false: chain stripped, exact prefix_hash used.
    f.policy("  strategy: {enableChainMatching: false}\n");
    let legacy = h(900);
    r.prefix_hash = &legacy;
    r.prefix_token_count = 128;
    let o = f.index.lookup(&r);
    assert_eq!(
        (o.reason, o.scores[0].matched_tokens),
        (Reason::PrefixMatch, 128)
    );
    // So is an invalid wire chain's (a mismatched one is still NO_HINT).
    bad.adapter_id = "";
    bad.prefix_hash = &legacy;
    bad.prefix_token_count = 128;
    bad.chain = ChainInput::Invalid;
    assert_eq!(f.index.lookup(&bad).reason, Reason::PrefixMatch);
    bad.chain = ChainInput::Mismatched;
    assert_eq!(f.index.lookup(&bad).reason, Reason::NoHint);
    r.prefix_hash = &[];
    assert_eq!(f.index.lookup(&r).reason, Reason::NoHint);
}

#[test]
fn adapter_partitions_and_echo() {
    let f = fixture();
    let blocks = chain(1..3);
    let mut u = update("A", vec![chain_prefix(&blocks, 64)]);
    u.adapter_id = "sql-lora".into();
    f.index.ingest(&u);
    let mut p = chain_prefix(&blocks, 64);
    p.adapter_id = "chat-lora".into();
    let mut u = update("B", vec![p]);
    u.adapter_id = "sql-lora".into(); // entry adapter wins
    f.index.ingest(&u);
    f.policy("  affinityRouting: Disabled\n");
    let counts = [64, 64];
    for (adapter, want) in [
        ("sql-lora", vec!["A"]),
        ("chat-lora", vec!["B"]),
        ("", vec![]),
    ] {
        let mut r = LookupRequest::new(T, M, S);
        let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
        r.chain = ChainInput::Derived(&block_chain);
        r.adapter_id = adapter;
        let o = f.index.lookup(&r);
        assert_eq!(o.adapter_id, adapter);
        assert_eq!(ids(&o), want, "adapter {adapter}");
    }
}

#[test]
fn events_evict_narrow_and_wide_and_clear() {
    let f = fixture();
    let blocks = chain(1..3);
    for adapter in ["a1", "a2"] {
        let mut u = update("A", vec![chain_prefix(&blocks, 64)]);
        u.adapter_id = adapter.into();
        f.index.ingest(&u);
    }
    f.hold("B", &blocks);
    assert_eq!(f.index.entry_count(), 6);
    let ev = |kind, adapter: &str, hash: Vec<u8>, replica: &str| CacheEvent {
        kind,
        replica_id: replica.into(),
        model_id: M.into(),
        tenant_id: T.into(),
        prefix_hash: hash,
        adapter_id: adapter.into(),
    };
    let r = f
        .index
        .publish(&ev(EventKind::PrefixEvicted, "a1", blocks[0].clone(), "A"));
    assert_eq!(r.entries_removed, 1);
    let r = f
        .index
        .publish(&ev(EventKind::PrefixEvicted, "", blocks[1].clone(), "A"));
    assert_eq!(r.entries_removed, 2);
    assert_eq!(
        f.index
            .publish(&ev(EventKind::PrefixAdded, "", blocks[0].clone(), "C"))
            .entries_removed,
        0
    );
    assert_eq!(f.index.entry_count(), 3);
    let r = f
        .index
        .publish(&ev(EventKind::AllCleared, "a2", vec![], "A"));
    assert_eq!(r.entries_removed, 1, "ALL_CLEARED ignores the adapter");
    assert_eq!(f.index.entry_count(), 2);
    assert_eq!(f.index.evictions(EvictionReason::Event), 4);
    let mut probe = ev(EventKind::AllCleared, "", vec![], "B");
    probe.tenant_id = PROBE_TENANT.into();
    assert!(!f.index.publish(&probe).applied);
    assert_eq!(f.index.entry_count(), 2);
    f.clock.advance(Duration::from_secs(3));
    assert!(
        f.index
            .publish(&ev(EventKind::ReplicaUpdated, "", vec![], "B"))
            .applied
    );
    let state = f.index.cache_state(T, M);
    let b = state
        .replicas
        .iter()
        .find(|r| r.replica_id == "B")
        .expect("B");
    assert_eq!(b.last_heard_ms, Some(f.clock.now_ms()));
    // Serving scope shrinks when the last entry goes.
    f.index.publish(&ev(EventKind::AllCleared, "", vec![], "B"));
    assert_eq!(f.index.cache_state(T, M).summary.replica_count, 0);
    assert_eq!(f.index.prefix_count(), 0);
}

#[test]
fn probe_tenant_is_unreadable() {
    let f = fixture();
    f.hold("A", &chain(1..2));
    let bytes = h(1);
    let mut r = LookupRequest::new(PROBE_TENANT, M, S);
    r.prefix_hash = &bytes;
    r.adapter_id = "x";
    let o = f.index.lookup(&r);
    assert_eq!((o.reason, o.adapter_id.as_str()), (Reason::NoHint, ""));
    assert_eq!(f.index.cache_state(PROBE_TENANT, M), ScopeState::default());
    assert!(
        f.index
            .snapshot()
            .tenants
            .iter()
            .all(|t| t.tenant_id != PROBE_TENANT)
    );
}

#[test]
fn cache_state_and_snapshot_aggregate() {
    let f = fixture();
    f.hold("A", &chain(1..4));
    f.hold("B", &chain(1..2));
    let mut u = update("C", vec![chain_prefix(&chain(1..2), 64)]);
    u.hash_scheme = "sglang".into();
    f.index.ingest(&u);
    f.stats("A", 0.5, 0.2);
    f.stats("B", 0.7, 0.4);
    let s = f.index.cache_state(T, M);
    assert_eq!(s.summary.replica_count, 3);
    assert_eq!(s.summary.entry_count, 5);
    assert_eq!(s.summary.prefix_count, 4);
    assert!((s.summary.mean_hit_rate - 0.6).abs() < 1e-6);
    assert!((s.summary.mean_pressure - 0.3).abs() < 1e-6);
    assert_eq!(s.summary.cache_memory_bytes, 2000);
    assert_eq!(
        s.replicas
            .iter()
            .map(|r| r.replica_id.as_str())
            .collect::<Vec<_>>(),
        ["A", "B", "C"]
    );
    assert_eq!(f.index.cache_state(T, "other"), ScopeState::default());
    let snap = f.index.snapshot();
    assert_eq!(snap.entry_count, 5);
    assert_eq!(snap.tenants.len(), 1);
    assert_eq!(snap.tenants[0].replica_count, 3);
    assert_eq!(snap.tenants[0].models, [M]);
}

#[test]
fn ttl_sweep_uses_tenant_ttl() {
    let f = fixture();
    f.hold("A", &chain(1..3));
    f.clock.advance(Duration::from_secs(20 * 60));
    f.hold("B", &chain(5..6));
    assert_eq!(f.index.sweep(), SweepReport::default());
    f.clock.advance(Duration::from_secs(11 * 60));
    let r = f.index.sweep();
    assert_eq!(r.ttl, 2);
    assert_eq!(f.index.entry_count(), 1);
    assert_eq!(f.index.evictions(EvictionReason::Ttl), 2);
    f.policy("  evictionTTL: 5m\n");
    assert_eq!(f.index.sweep().ttl, 1);
    assert_eq!(f.index.entry_count(), 0);
    assert_eq!(f.index.prefix_count(), 0);
}

#[test]
fn global_cap_evicts_lru() {
    let f = fixture();
    for i in 0..10u64 {
        f.hold("A", &chain(i..i + 1));
        f.clock.advance(Duration::from_secs(1));
    }
    f.index.set_max_entries(6);
    let r = f.index.sweep();
    assert_eq!(r.capacity, 4);
    assert_eq!(f.index.entry_count(), 6);
    assert_eq!(f.index.evictions(EvictionReason::Capacity), 4);
    // The four oldest went.
    f.policy("  minimumMatchedTokens: 0\n  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_chain(&chain(3..4)).reason, Reason::NoHint);
    assert_eq!(f.lookup_chain(&chain(4..5)).reason, Reason::PrefixMatch);
}

#[test]
fn tenant_quota_evicts_lfu() {
    let f = fixture();
    f.policy("  eviction: LFU\n");
    for i in 0..4u64 {
        f.hold("A", &chain(i..i + 1));
        f.clock.advance(Duration::from_secs(1));
    }
    // Credit blocks 0 and 1 (oldest) so LFU keeps them over LRU order.
    for _ in 0..2 {
        assert_eq!(f.lookup_chain(&chain(0..1)).reason, Reason::PrefixMatch);
        assert_eq!(f.lookup_chain(&chain(1..2)).reason, Reason::PrefixMatch);
    }
    f.policy("  eviction: LFU\n  quota: {maxIndexEntries: 2}\n");
    let r = f.index.sweep();
    assert_eq!(r.quota, 2);
    assert_eq!(f.index.entry_count(), 2);
    assert_eq!(f.lookup_chain(&chain(0..1)).reason, Reason::PrefixMatch);
    assert_eq!(f.lookup_chain(&chain(1..2)).reason, Reason::PrefixMatch);
    assert_ne!(f.lookup_chain(&chain(2..3)).reason, Reason::PrefixMatch);
}

#[test]
fn quota_and_cap_hold_at_ingest() {
    let f = fixture();
    f.policy("  quota: {maxIndexEntries: 5}\n");
    let report = f
        .index
        .ingest(&update("A", vec![chain_prefix(&chain(0..8), 16)]));
    assert_eq!((report.entries_added, report.entries_refused), (5, 3));
    assert_eq!(f.index.entry_count(), 5);
    // Refreshing what is held is never refused.
    let report = f
        .index
        .ingest(&update("A", vec![chain_prefix(&chain(0..5), 16)]));
    assert_eq!((report.entries_written, report.entries_refused), (5, 0));
    // Another tenant is not held to this one's quota, only to the global cap.
    f.index.set_max_entries(9);
    let mut other = update("B", vec![chain_prefix(&chain(100..110), 16)]);
    other.tenant_id = "other".into();
    let report = f.index.ingest(&other);
    assert_eq!((report.entries_added, report.entries_refused), (4, 6));
    assert_eq!(f.index.entry_count(), 9);
    assert_eq!(f.index.entries_refused(), 9);
}

#[test]
fn affinity_test_vectors_modulo_and_rendezvous() {
    let blocks: Vec<Vec<u8>> = vec![h(1), h(2)];
    let counts = [16, 16];
    let c = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    let digest = affinity_digest(Some(&c), &[]).expect("seed");
    // The same hashes kept as words seed the same digest.
    let words = BlockChain::from_words(vec![1u64.to_be_bytes(), 2u64.to_be_bytes()], vec![16; 2]);
    assert_eq!(affinity_digest(words.ok().as_ref(), &[]), Some(digest));
    // Seed bytes: 00000008 0000000000000001 00000008 0000000000000002.
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, AFFINITY_VECTOR_DIGEST);
    let replicas = ["r0", "r1", "r2", "r3", "r4"];
    assert_eq!(
        pick_affinity(AffinityAlgorithm::Modulo, &digest, &replicas),
        AFFINITY_VECTOR_MODULO
    );
    assert_eq!(
        pick_affinity(AffinityAlgorithm::Rendezvous, &digest, &replicas),
        AFFINITY_VECTOR_RENDEZVOUS
    );
    // Raw prefix_hash seed when there is no chain.
    let raw = affinity_digest(None, &h(1)).expect("seed");
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "cd2662154e6d76b2b2b92e70c0cac3ccf534f9b74eb5b89819ec509083d00a50"
    );
    let seven = ["r0", "r1", "r2", "r3", "r4", "r5", "r6"];
    assert_eq!(pick_affinity(AffinityAlgorithm::Modulo, &raw, &seven), 5);
    assert_eq!(
        pick_affinity(AffinityAlgorithm::Rendezvous, &raw, &seven),
        2
    );
    assert!(affinity_digest(None, &[]).is_none());
}

// Pinned with an independent computation (Python hashlib) of the documented construction.
const AFFINITY_VECTOR_DIGEST: &str =
    "d442d40d2b7b30a3fedbfe229bd161dc60a5154f55411f8a8739bf76d75382f4";
const AFFINITY_VECTOR_MODULO: usize = 0;
const AFFINITY_VECTOR_RENDEZVOUS: usize = 2;

#[test]
fn affinity_is_stable_and_rendezvous_moves_few() {
    let f = fixture();
    for r in ["r0", "r1", "r2", "r3"] {
        f.hold(r, &chain(1000..1001));
    }
    let pick = |f: &Fixture, seed: u64| {
        let o = f.lookup_chain(&chain(seed * 10..seed * 10 + 2));
        assert_eq!(o.reason, Reason::AffinityHint);
        o.replica_id(&o.scores[0]).to_string()
    };
    let first: Vec<String> = (1..50).map(|s| pick(&f, s)).collect();
    let again: Vec<String> = (1..50).map(|s| pick(&f, s)).collect();
    assert_eq!(first, again);
    f.policy("  affinityAlgorithm: Rendezvous\n");
    let before: Vec<String> = (1..200).map(|s| pick(&f, s)).collect();
    f.hold("r4", &chain(1000..1001));
    let after: Vec<String> = (1..200).map(|s| pick(&f, s)).collect();
    let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
    assert!(
        after.iter().zip(&before).all(|(a, b)| a == b || a == "r4"),
        "only moves to the new replica"
    );
    assert!(moved < 80, "rendezvous moved {moved} of 199");
}

#[test]
fn wide_hashes_match_within_scheme() {
    let f = fixture();
    let blocks: Vec<Vec<u8>> = vec![vec![1; 16], vec![2; 16]];
    f.hold("A", &blocks);
    let o = f.lookup_chain(&blocks);
    assert_eq!(
        (o.reason, o.scores[0].matched_tokens),
        (Reason::PrefixMatch, 128)
    );
}

#[test]
fn fixed_and_byte_chains_are_the_same_keys() {
    let f = fixture();
    f.hold("A", &chain(1..3));
    let fixed: Vec<[u8; 8]> = (1u64..3).map(u64::to_be_bytes).collect();
    let counts = [64, 64];
    let mut r = LookupRequest::new(T, M, S);
    let block_chain = BlockChain::new(&fixed, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    assert_eq!(f.index.lookup(&r).reason, Reason::PrefixMatch);
}

#[test]
fn all_cleared_touches_only_what_the_replica_held() {
    let f = fixture();
    // A holds 3 runs of its own, B one run shared with A's first chain.
    for c in 0..3u64 {
        f.hold("A", &chain(c * 100..c * 100 + 40));
    }
    f.hold("B", &chain(0..40));
    f.hold("B", &chain(1000..1010));
    let (keys, runs, _) = f.index.store.write().shape();
    assert_eq!((keys, runs), (130, 4));
    let a = f.index.catalog.read().replica("A").expect("A");
    let b = f.index.catalog.read().replica("B").expect("B");
    assert_eq!(f.index.store.write().runs_of(a), 3);
    assert_eq!(f.index.store.write().runs_of(b), 2);
    assert_eq!(f.clear("A").entries_removed, 120);
    assert_eq!(f.index.store.write().runs_of(a), 0);
    // A's private runs are freed with their keys; the shared run stays for B.
    let (keys, runs, _) = f.index.store.write().shape();
    assert_eq!((keys, runs), (50, 2));
    assert_eq!(f.index.entry_count(), 50);
    assert_eq!(f.index.prefix_count(), 50);
    assert_eq!(f.clear("B").entries_removed, 50);
    assert_eq!(f.index.store.write().shape().0, 0);
    assert_eq!((f.index.entry_count(), f.index.prefix_count()), (0, 0));
}

#[test]
fn a_cleared_name_flood_frees_names_partitions_and_replicas() {
    let f = fixture();
    f.hold("A", &chain(0..4));
    heartbeat(&f.index, "A");
    f.index.sweep();
    let baseline = f.index.catalog.read().interned();
    let flood = 10_000u64;
    for i in 0..flood {
        let mut u = update(
            &format!("flood-{i}"),
            vec![chain_prefix(&chain(i..i + 2), 16)],
        );
        u.tenant_id = format!("tenant-{i}");
        u.model_id = format!("model-{i}");
        u.adapter_id = format!("adapter-{i}");
        f.index.ingest(&u);
    }
    let [names, replicas, partitions, _] = f.index.catalog.read().interned();
    let peak_room = f.index.catalog.read().room();
    assert!(names >= baseline[0] + 3 * flood as usize);
    assert_eq!(replicas, baseline[1] + flood as usize);
    assert_eq!(partitions, baseline[2] + flood as usize);
    // Nothing is freed while the names are in use.
    assert_eq!(f.index.sweep().partitions_freed, 0);
    for i in 0..flood {
        let report = f.index.publish(&CacheEvent {
            kind: EventKind::AllCleared,
            replica_id: format!("flood-{i}"),
            model_id: String::new(),
            tenant_id: String::new(),
            prefix_hash: Vec::new(),
            adapter_id: String::new(),
        });
        assert_eq!(report.entries_removed, 2);
    }
    let writes = f.index.catalog.writes();
    let report = f.index.sweep();
    assert_eq!(report.partitions_freed, flood);
    assert!(report.names_freed >= 4 * flood, "{report:?}");
    assert_eq!(f.index.catalog.read().interned(), baseline);
    // Freed a chunk per hold of the exclusive lock, with lookups between.
    let holds = f.index.catalog.writes() - writes;
    let items = report.partitions_freed + report.names_freed;
    assert!(
        holds >= items / crate::sweep::FREE_CHUNK as u64,
        "{items} freed in {holds} holds"
    );
    // The maps give their room back too (but for a few slots in each of
    // their parts, however large the flood).
    let room = f.index.catalog.read().room();
    assert!(
        room * 8 < peak_room,
        "room {room} of {peak_room} at the peak"
    );
    assert_eq!(f.index.snapshot().replicas.len(), 1);
    // What stayed still answers, and a freed name comes back as new.
    assert_eq!(f.lookup_chain(&chain(0..4)).reason, Reason::PrefixMatch);
    let mut u = update("flood-7", vec![chain_prefix(&chain(7..9), 16)]);
    u.tenant_id = "tenant-7".into();
    f.index.ingest(&u);
    let mut r = LookupRequest::new("tenant-7", M, S);
    let blocks = chain(7..9);
    let counts = [16, 16];
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    let o = f.index.lookup(&r);
    assert_eq!(ids(&o), ["flood-7"]);
}

/// Every partition the catalog keeps is filed under live names.
fn assert_names_live(index: &CacheIndex) {
    let catalog = index.catalog.read();
    for (id, p) in catalog.partitions.with_ids() {
        for n in [p.tenant, p.model, p.adapter] {
            let name = catalog.name_str(n);
            assert_eq!(
                catalog.name(name),
                Some(n),
                "partition {id} is filed under a freed name ({name:?} now)"
            );
        }
    }
}

#[test]
fn a_name_taken_into_use_between_chunks_of_a_sweep_is_kept() {
    let f = fixture();
    f.hold("A", &chain(0..4));
    let flood = 1_000u64;
    for i in 0..flood {
        let mut u = update(
            &format!("flood-{}", i % 50),
            vec![chain_prefix(&chain(i..i + 2), 16)],
        );
        u.adapter_id = format!("adapter-{i}");
        f.index.ingest(&u);
    }
    for r in 0..50 {
        f.clear(&format!("flood-{r}"));
    }
    // Between the first chunks a new partition is filed under a flood
    // adapter's name (as an ingest does before it waits for the store's
    // writer, which the sweep holds), then a replica is heard from (a
    // write of the fleet): each time what is due is found again.
    let mut between = 0;
    let freed = f.index.free_unused_between(|| {
        between += 1;
        if between == 1 {
            f.index.catalog_write().intern_partition(
                "keeper",
                M,
                S,
                &format!("adapter-{}", flood - 1),
            );
        }
        if between == 2 {
            f.index.fleet_write().heard(0, 0);
        }
    });
    assert!(between >= 2, "the flood was freed in {between} chunks");
    assert_names_live(&f.index);
    assert_eq!(freed.partitions as u64, flood + 1, "{freed:?}");
    // What is due once nothing writes between the chunks all goes.
    let catalog = f.index.catalog.read();
    assert!(catalog.partition("keeper", M, S, "adapter-0").is_none());
    assert!(catalog.name("adapter-0").is_none());
    drop(catalog);
    assert_eq!(f.lookup_chain(&chain(0..4)).reason, Reason::PrefixMatch);
}

#[test]
fn a_sweep_with_nothing_to_free_never_holds_a_lookup_up() {
    let f = fixture();
    f.hold("A", &chain(0..4));
    heartbeat(&f.index, "A");
    f.index.sweep();
    // A lookup holds the catalog and the fleet shared while it works; a
    // sweep that took either exclusively would wait for it to finish.
    let catalog = f.index.catalog.read();
    let fleet = f.index.fleet.read();
    let (done, finished) = std::sync::mpsc::channel();
    let index = &f.index;
    std::thread::scope(|s| {
        s.spawn(move || done.send(index.sweep()).expect("the test waits for it"));
        let report = finished.recv_timeout(Duration::from_secs(10));
        drop((catalog, fleet));
        let report = report.expect("a sweep with nothing to free waited for a lookup");
        assert_eq!(
            (
                report.partitions_freed,
                report.names_freed,
                report.members_expired
            ),
            (0, 0, 0)
        );
    });
    assert_eq!(f.lookup_chain(&chain(0..4)).reason, Reason::PrefixMatch);
    // What is due still goes: the replica's membership once its heartbeats
    // stop, and its partition and names once it holds nothing.
    f.clock.advance(Duration::from_secs(31));
    assert_eq!(f.index.sweep().members_expired, 1);
    assert_eq!(f.clear("A").entries_removed, 4);
    let report = f.index.sweep();
    assert_eq!(report.partitions_freed, 1);
    assert!(report.names_freed >= 4, "{report:?}");
}

#[test]
fn block_chains_of_any_width_match_like_their_bytes() {
    let mixed: Vec<Vec<u8>> = vec![h(1), vec![7; 16], h(3)];
    let c = BlockChain::new(&mixed, vec![64; 3]).expect("a valid chain");
    let bytes: Vec<&[u8]> = mixed.iter().map(Vec::as_slice).collect();
    assert_eq!(c.hashes().collect::<Vec<_>>(), bytes);
    assert_eq!((c.len(), c.tokens()), (3, 192));
    let f = fixture();
    f.index.ingest(&update(
        "A",
        vec![PrefixReport {
            chain: c.clone(),
            ..Default::default()
        }],
    ));
    f.hold("B", &chain(50..51));
    let o = f.lookup_chain(&mixed);
    assert_eq!(
        (o.reason, o.scores[0].matched_tokens),
        (Reason::PrefixMatch, 192)
    );
    // An 8-byte hash is the same key in a chain of words and in a wide one.
    let words = BlockChain::from_words(vec![1u64.to_be_bytes()], vec![64]).expect("a valid chain");
    let mut r = LookupRequest::new(T, M, S);
    r.chain = ChainInput::Wire(&words);
    let o = f.index.lookup(&r);
    assert_eq!((o.reason, ids(&o)), (Reason::PrefixMatch, vec!["A"]));
}

#[test]
fn a_lookup_sees_names_as_they_come_and_go() {
    // The same request, asked again and again on one thread, before its
    // names exist, while they do, after they are freed and once they are
    // interned again under new ids.
    let f = fixture();
    let blocks = chain(0..4);
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::NoHint);
    f.hold("A", &blocks);
    assert_eq!(f.lookup_chain(&blocks).reason, Reason::PrefixMatch);
    assert_eq!(ids(&f.lookup_chain(&blocks)), ["A"]);
    f.clear("A");
    let report = f.index.sweep();
    assert!(report.partitions_freed >= 1, "{report:?}");
    assert!(report.names_freed >= 1, "{report:?}");
    assert_ne!(f.lookup_chain(&blocks).reason, Reason::PrefixMatch);
    f.hold("B", &blocks);
    assert_eq!(ids(&f.lookup_chain(&blocks)), ["B"]);
}

#[test]
fn the_match_step_reports_every_holder_s_leading_run_before_ranking() {
    let f = fixture();
    let blocks = chain(1..9);
    f.hold("A", &blocks[..6]);
    f.hold("B", &blocks[..3]);
    f.clock.advance(Duration::from_secs(30));
    // C holds everything but block 4: its run ends at the hole.
    f.hold("C", &blocks);
    f.index.publish(&CacheEvent {
        kind: EventKind::PrefixEvicted,
        replica_id: "C".into(),
        tenant_id: T.into(),
        model_id: M.into(),
        prefix_hash: blocks[4].clone(),
        adapter_id: String::new(),
    });
    f.hold("D", &blocks[1..]);
    let counts = vec![64; blocks.len()];
    let typed = BlockChain::new(&blocks, counts).expect("a valid chain");
    let mut r = LookupRequest::new(T, M, S);
    r.chain = ChainInput::Wire(&typed);
    let found: Vec<(String, u32, i64)> = f
        .index
        .match_chain(&r)
        .iter()
        .map(|m| {
            let name = f.index.replica_name(m.replica).expect("a live id");
            (name.to_string(), m.blocks, m.tokens)
        })
        .collect();
    let mut sorted = found.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            ("A".into(), 6, 384),
            ("B".into(), 3, 192),
            ("C".into(), 4, 256)
        ],
        "D lacks block 0"
    );
    let c = f
        .index
        .match_chain(&r)
        .into_iter()
        .find(|m| m.blocks == 4)
        .expect("C");
    let a = f
        .index
        .match_chain(&r)
        .into_iter()
        .find(|m| m.blocks == 6)
        .expect("A");
    assert_eq!(c.oldest_seen, a.oldest_seen + 30, "C reported 30 s later");
    assert_eq!(c.tier, Tier::T1);
    // The lookup ranks exactly these runs.
    let o = f.index.lookup(&r);
    let mut ranked: Vec<(String, i32)> = o
        .named_scores()
        .map(|(name, s)| (name.to_string(), s.matched_tokens))
        .collect();
    ranked.sort();
    assert_eq!(
        ranked,
        [("A".into(), 384), ("B".into(), 192), ("C".into(), 256)]
    );
    // Nothing for a chain of another partition, or no chain at all.
    let mut other = LookupRequest::new(T, M, "sglang");
    other.chain = ChainInput::Wire(&typed);
    assert!(f.index.match_chain(&other).is_empty());
    assert!(f.index.match_chain(&LookupRequest::new(T, M, S)).is_empty());
}

#[test]
fn alternating_scopes_each_land_in_their_own_partition() {
    // Ingest resolves an update's scope names through a memo of the last
    // update's: alternating scopes, an adapter of its own and a scope freed
    // and interned again must each still land in their own partition.
    let f = fixture();
    // Each scope differs from the one before in one name.
    let scopes = [
        ("tenant-a", ""),
        ("tenant-a", "lora"),
        ("tenant-b", "lora"),
        ("tenant-b", ""),
    ];
    let ingest = |tenant: &str, adapter: &str, base: u64| {
        let mut u = update("A", vec![chain_prefix(&chain(base..base + 4), 16)]);
        u.tenant_id = tenant.into();
        u.adapter_id = adapter.into();
        f.index.ingest(&u);
    };
    let found = |tenant: &str, adapter: &str, base: u64| {
        let blocks = chain(base..base + 4);
        let block_chain = BlockChain::new(&blocks, vec![16; 4]).expect("a valid chain");
        let mut r = LookupRequest::new(tenant, M, S);
        r.adapter_id = adapter;
        r.chain = ChainInput::Wire(&block_chain);
        f.index.lookup(&r).reason == Reason::PrefixMatch
    };
    // Two updates of each scope in a row: the second one's names are the
    // remembered ones.
    for round in 0..6u64 {
        for (k, &(tenant, adapter)) in scopes.iter().enumerate() {
            ingest(tenant, adapter, 1000 * k as u64 + 10 * round);
            ingest(tenant, adapter, 1000 * k as u64 + 10 * round + 5);
        }
    }
    for offset in (0..6u64).flat_map(|round| [10 * round, 10 * round + 5]) {
        for (k, &(tenant, adapter)) in scopes.iter().enumerate() {
            let base = 1000 * k as u64 + offset;
            for (j, &(t, a)) in scopes.iter().enumerate() {
                assert_eq!(
                    found(t, a, base),
                    j == k,
                    "{tenant}/{adapter}'s chain {base} looked up in {t}/{a}"
                );
            }
        }
    }
    f.clear("A");
    f.index.sweep();
    ingest("tenant-b", "", 5000);
    assert!(found("tenant-b", "", 5000));
    assert!(!found("tenant-a", "", 5000));
    assert!(!found("tenant-b", "", 1000), "cleared");
}

#[test]
fn an_answer_keeps_the_names_it_gave_while_replicas_come_and_go() {
    let f = fixture();
    let blocks = chain(0..3);
    f.hold("A", &blocks);
    f.hold("B", &blocks[..2]);
    let o = f.lookup_chain(&blocks);
    assert_eq!(ids(&o), ["A", "B"]);
    // Each score's id is the index's own, and names the same replica.
    for (name, score) in o.named_scores() {
        assert_eq!(f.index.replica_name(score.replica).as_deref(), Some(name));
    }
    // Replicas named after the answer (the catalog copies the list the
    // answer shares, then adds to its own) and A's id freed by a sweep.
    for r in 0..300 {
        f.hold(&format!("late-{r}"), &chain(1000 + r..1001 + r));
    }
    let a = o.scores[0].replica;
    f.clear("A");
    f.clock.advance(Duration::from_secs(3600));
    f.index.sweep();
    assert_eq!(f.index.replica_name(a), None, "A's id is freed");
    assert_eq!(ids(&o), ["A", "B"]);
    assert_eq!(o.top().map(|(name, _)| name), Some("A"));
    // A later answer names what the catalog holds now.
    f.hold("B", &blocks);
    assert_eq!(ids(&f.lookup_chain(&blocks)), ["B"]);
    // Answers compare by name, not by one index's ids: the same holdings
    // reported in another order give other ids and an equal answer.
    let twin = fixture();
    twin.hold("B", &blocks[..2]);
    twin.hold("A", &blocks);
    let again = fixture();
    again.hold("A", &blocks);
    again.hold("B", &blocks[..2]);
    let (x, y) = (twin.lookup_chain(&blocks), again.lookup_chain(&blocks));
    assert_ne!(x.scores[0].replica, y.scores[0].replica);
    assert_eq!(x, y);
    assert_eq!(ids(&x), ["A", "B"]);
    assert!(format!("{x:?}").contains("\"A\""), "{x:?}");
}
