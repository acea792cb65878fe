//! Fleet membership and the cost-aware ranker: who may be named, and where
//! load, shared heads and new sessions send a request.

use std::collections::HashMap;
use std::time::Duration;

use super::*;

fn cost_aware(f: &Fixture) {
    f.policy("  ranker: CostAware\n");
}

fn announce(f: &Fixture, replica: &str) {
    heartbeat(&f.index, replica);
}

fn load(f: &Fixture, replica: &str, waiting: u32, running: u32) {
    let mut u = update(replica, vec![]);
    u.stats = Some(ReplicaStatsReport {
        requests_waiting: waiting,
        requests_running: running,
        ..Default::default()
    });
    f.index.ingest(&u);
}

/// Cost-aware ranking over four announced replicas a–d that all hold a
/// three-block head (returned) and report `running` requests each.
fn fleet_sharing_a_head(f: &Fixture, running: u32) -> Vec<Vec<u8>> {
    cost_aware(f);
    let head = chain(1..4);
    for r in ["a", "b", "c", "d"] {
        announce(f, r);
        f.hold(r, &head);
        load(f, r, 0, running);
    }
    head
}

#[test]
fn an_announced_replica_with_no_blocks_is_a_member() {
    let f = fixture();
    f.hold("a", &chain(1..5));
    announce(&f, "b");
    // Contract ranker: AFFINITY_HINT picks over live members, empty ones included.
    let picks: std::collections::HashSet<String> = (100..140)
        .map(|i| f.lookup_chain(&chain(i..i + 2)))
        .filter(|o| o.reason == Reason::AffinityHint)
        .map(|o| o.replica_id(&o.scores[0]).to_string())
        .collect();
    assert_eq!(picks.len(), 2, "both members get novel prompts: {picks:?}");
    let state = f.index.snapshot();
    let b = state.replicas.iter().find(|r| r.replica_id == "b");
    assert!(b.is_some_and(|b| b.heartbeats && b.member_of == vec!["team-a/llama"]));
}

#[test]
fn a_silent_heartbeating_replica_is_never_named() {
    let f = fixture();
    for ranker in ["Contract", "CostAware"] {
        f.policy(&format!("  ranker: {ranker}\n  replicaTimeout: 30s\n"));
        announce(&f, "a");
        f.hold("a", &chain(1..5));
        announce(&f, "b");
        assert_eq!(ids(&f.lookup_chain(&chain(1..5)))[0], "a", "{ranker}");
        f.clock.advance(Duration::from_secs(20));
        announce(&f, "b");
        f.clock.advance(Duration::from_secs(15));
        // a: 35 s of silence (gone); b: 15 s (live).
        for i in 0..20 {
            let o = f.lookup_chain(&chain(1..5));
            assert!(ids(&o).iter().all(|&r| r != "a"), "{ranker}: {o:?}");
            let novel = f.lookup_chain(&chain(200 + i..202 + i));
            assert!(ids(&novel).iter().all(|&r| r != "a"), "{ranker}: {novel:?}");
        }
        // A word from it brings it back.
        announce(&f, "a");
        assert_eq!(ids(&f.lookup_chain(&chain(1..5)))[0], "a", "{ranker}");
        // The sweep frees the membership of a replica that stays silent.
        f.clock.advance(Duration::from_secs(31));
        announce(&f, "b");
        assert_eq!(f.index.sweep().members_expired, 1, "{ranker}");
        announce(&f, "a");
    }
}

#[test]
fn a_producer_that_never_heartbeats_keeps_its_entries_counting() {
    let f = fixture();
    f.hold("a", &chain(1..5));
    f.clock.advance(Duration::from_secs(600));
    let o = f.lookup_chain(&chain(1..5));
    assert_eq!((o.reason, ids(&o)), (Reason::PrefixMatch, vec!["a"]));
}

#[test]
fn all_cleared_leaves_the_serving_set() {
    let f = fixture();
    cost_aware(&f);
    announce(&f, "a");
    announce(&f, "b");
    f.hold("a", &chain(1..5));
    f.index.publish(&CacheEvent {
        kind: EventKind::AllCleared,
        replica_id: "a".into(),
        tenant_id: T.into(),
        model_id: M.into(),
        prefix_hash: Vec::new(),
        adapter_id: String::new(),
    });
    for i in 0..20 {
        let o = f.lookup_chain(&chain(300 + i..302 + i));
        assert_eq!(ids(&o), vec!["b"]);
    }
    // A replica that left every serving set and holds nothing is no longer
    // listed (a flood of names cleared leaves nothing behind in /snapshot).
    assert!(
        f.index
            .snapshot()
            .replicas
            .iter()
            .all(|r| r.replica_id != "a")
    );
}

#[test]
fn a_head_every_member_holds_does_not_decide_the_pick() {
    let f = fixture();
    cost_aware(&f);
    let twin = fixture();
    cost_aware(&twin);
    let head = chain(1..4); // a 192-token system prompt on every replica
    for r in ["a", "b", "c", "d"] {
        for index in [&f, &twin] {
            announce(index, r);
            index.hold(r, &head);
        }
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for session in 0..400u64 {
        // Sessions far apart: the engines report idle and recent-request
        // counts have decayed, so only the rendezvous hash decides.
        f.clock.advance(Duration::from_secs(600));
        twin.clock.advance(Duration::from_secs(600));
        for r in ["a", "b", "c", "d"] {
            load(&f, r, 0, 0);
            load(&twin, r, 0, 0);
        }
        let mut prompt = head.clone();
        prompt.extend(chain(1000 + session * 10..1000 + session * 10 + 3));
        let o = f.lookup_chain(&prompt);
        assert_eq!(o.reason, Reason::AffinityHint, "the head is no evidence");
        *counts
            .entry(o.replica_id(&o.scores[0]).to_string())
            .or_default() += 1;
        // Once the engines report again, the same session (nothing stored
        // yet) lands on the same replica, and so does it on a second server
        // that saw the same fleet.
        for r in ["a", "b", "c", "d"] {
            load(&f, r, 0, 0);
            load(&twin, r, 0, 0);
        }
        let top = o.replica_id(&o.scores[0]);
        assert_eq!(f.lookup_chain(&prompt).replica_ids().next(), Some(top));
        assert_eq!(twin.lookup_chain(&prompt).replica_ids().next(), Some(top));
    }
    assert_eq!(counts.len(), 4);
    assert!(counts.values().all(|&n| n >= 50), "spread: {counts:?}");
}

#[test]
fn a_distinguishing_holder_wins_when_load_is_even() {
    let f = fixture();
    let head = fleet_sharing_a_head(&f, 2);
    let mut turn = head.clone();
    turn.extend(chain(50..56));
    f.hold("c", &turn);
    let mut next = turn.clone();
    next.extend(chain(60..62));
    let o = f.lookup_chain(&next);
    assert_eq!(o.reason, Reason::PrefixMatch);
    assert_eq!(ids(&o)[0], "c");
    assert_eq!(o.scores[0].matched_tokens, 9 * 64);
    // Every holder past the floor is listed, best first.
    assert_eq!(o.scores.len(), 4);
    assert!(o.scores.windows(2).all(|w| w[0].score >= w[1].score));
}

#[test]
fn load_moves_the_pick_and_stale_stats_are_unknown() {
    let f = fixture();
    cost_aware(&f);
    for r in ["a", "b"] {
        announce(&f, r);
        load(&f, r, 0, 0);
    }
    let session = chain(1..9);
    f.hold("a", &session);
    let mut next = session.clone();
    next.extend(chain(20..22));
    // Teach the index what a request costs: hinted requests of 640 tokens.
    for i in 0..50 {
        let o = f.lookup_chain(&chain(500 + i * 10..510 + i * 10));
        assert!(!o.scores.is_empty());
    }
    for r in ["a", "b"] {
        load(&f, r, 0, 0);
    }
    assert_eq!(ids(&f.lookup_chain(&next))[0], "a", "idle: the holder");
    load(&f, "a", 40, 8);
    load(&f, "b", 0, 0);
    assert_eq!(ids(&f.lookup_chain(&next))[0], "b", "a is swamped: move");
    // Six seconds later neither has reported: both loads are unknown,
    // which is not idle for one and busy for the other.
    f.clock.advance(Duration::from_secs(6));
    announce(&f, "a");
    announce(&f, "b");
    assert_eq!(ids(&f.lookup_chain(&next))[0], "a", "stale stats ignored");
}

#[test]
fn a_burst_spreads_before_stats_catch_up() {
    let f = fixture();
    cost_aware(&f);
    for r in ["a", "b", "c", "d"] {
        announce(&f, r);
        load(&f, r, 0, 0);
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    // 40 novel 20-block requests in one instant, no stats in between.
    for i in 0..40u64 {
        let o = f.lookup_chain(&chain(10_000 + i * 100..10_020 + i * 100));
        *counts
            .entry(o.replica_id(&o.scores[0]).to_string())
            .or_default() += 1;
    }
    let max = counts.values().copied().max().unwrap_or(0);
    assert!(max <= 14, "bounded by what was just hinted: {counts:?}");
    let pending: u64 = f
        .index
        .snapshot()
        .replicas
        .iter()
        .map(|r| r.pending_tokens)
        .sum();
    assert_eq!(pending, 40 * 20 * 64, "every hinted token counted once");
}

#[test]
fn cost_aware_keeps_reason_codes_honest() {
    let f = fixture();
    cost_aware(&f);
    // No members at all: NO_HINT, as on a cold index.
    assert_eq!(f.lookup_chain(&chain(1..3)).reason, Reason::NoHint);
    announce(&f, "a");
    f.hold("a", &chain(1..3));
    // One 64-token block of evidence is below the 64-token floor? No: it
    // reaches it exactly, and `a` is the only member.
    let o = f.lookup_chain(&chain(1..2));
    assert_eq!(o.reason, Reason::PrefixMatch);
    f.policy("  ranker: CostAware\n  affinityRouting: Disabled\n");
    assert_eq!(f.lookup_chain(&chain(900..902)).reason, Reason::NoHint);
    // Diagnostics keep precedence.
    let mut r = LookupRequest::new("other", M, S);
    let blocks = chain(1..3);
    let counts = [64, 64];
    let block_chain = BlockChain::new(&blocks, counts.to_vec()).expect("a valid chain");
    r.chain = ChainInput::Derived(&block_chain);
    assert_eq!(f.index.lookup(&r).reason, Reason::UnknownTenant);
}

#[test]
fn the_entry_cap_holds_at_ingest_and_the_sweep_makes_room() {
    let f = fixture();
    f.index.set_max_entries(40);
    for r in 0..5 {
        f.hold(&format!("r{r}"), &chain(r * 100..r * 100 + 12));
        assert!(f.index.entry_count() <= 40, "never past the cap");
        f.clock.advance(Duration::from_secs(1));
    }
    assert_eq!(f.index.entry_count(), 40);
    assert_eq!(f.index.entries_refused(), 20);
    // Refreshing what is held is never refused.
    f.hold("r0", &chain(0..12));
    assert_eq!(f.index.entries_refused(), 20);
    // The sweep evicts the oldest to make room (a twentieth of the cap).
    let swept = f.index.sweep();
    assert_eq!(swept.capacity, 2);
    f.hold("r9", &chain(900..902));
    assert_eq!(f.index.entry_count(), 40);
}

#[test]
fn a_key_keeps_at_most_max_holders() {
    let f = fixture();
    f.index.set_max_holders_per_key(3);
    let blocks = chain(1..3);
    for r in 0..6 {
        f.hold(&format!("r{r}"), &blocks);
        f.clock.advance(Duration::from_secs(1));
    }
    let o = f.lookup_chain(&blocks);
    assert_eq!(o.reason, Reason::PrefixMatch);
    // The three freshest holders remain.
    let mut named = ids(&o);
    named.sort_unstable();
    assert_eq!(named, vec!["r3", "r4", "r5"]);
    assert_eq!(f.index.entry_count(), 6);
    assert_eq!(f.index.evictions(EvictionReason::HoldersPerKey), 6);
}

#[test]
fn a_lookup_over_thousands_of_holders_stays_linear() {
    let f = fixture();
    f.policy("  routingFloorScore: \"0\"\n");
    f.index.set_max_holders_per_key(8192);
    let blocks = chain(1..65);
    for r in 0..5000 {
        f.hold(&format!("10.1.{}.{}:8000", r / 250, r % 250), &blocks);
    }
    // Every holder matches all 64 blocks: the walk merges sorted lists.
    let started = std::time::Instant::now();
    let o = f.lookup_chain(&blocks);
    assert_eq!(o.scores.len(), 5000);
    assert!(o.scores.iter().all(|s| s.matched_tokens == 64 * 64));
    // Behaviour only; the figure is reported, not asserted.
    eprintln!("5000-holder lookup: {:?}", started.elapsed());
}

#[test]
fn a_hot_session_on_an_idle_fleet_is_balanced_against_new_ones() {
    let f = fixture();
    cost_aware(&f);
    let members = ["a", "b", "c", "d"];
    for r in members {
        announce(&f, r);
    }
    // One growing session sends half of all requests; new sessions send the
    // rest. Every request's blocks are stored where it was routed.
    let mut long = chain(1..20);
    f.hold("a", &long);
    let mut counts: HashMap<String, usize> = HashMap::new();
    let (mut moves, mut last) = (0, "a".to_string());
    for i in 0..400u64 {
        f.clock.advance(Duration::from_millis(100));
        for r in members {
            load(&f, r, 0, 0);
        }
        // Each turn extends the conversation by one block.
        long.push(h(50_000 + i));
        let o = f.lookup_chain(&long);
        let to = o.replica_id(&o.scores[0]).to_string();
        f.hold(&to, &long);
        if to != last {
            moves += 1;
            last = to.clone();
        }
        *counts.entry(to).or_default() += 1;
        let novel = chain(100_000 + i * 10..100_004 + i * 10);
        let o = f.lookup_chain(&novel);
        let to = o.replica_id(&o.scores[0]).to_string();
        f.hold(&to, &novel);
        *counts.entry(to).or_default() += 1;
    }
    // The hot session stays with its ever longer cache (a move would cost
    // all of it) …
    assert_eq!(moves, 0, "the hot session moved {moves} times");
    // … and new sessions go to the others, evenly.
    assert!(counts["a"] <= 410, "requests per replica: {counts:?}");
    for r in ["b", "c", "d"] {
        assert!(
            (110..=150).contains(&counts[r]),
            "requests per replica: {counts:?}"
        );
    }
}

/// A hot replica on an idle fleet: one conversation keeps extending there
/// while new sessions start from a tool preamble it holds. Returns how often
/// the conversation moved and how many new sessions went elsewhere.
/// With `forks`, every step of the conversation is also sent as a second,
/// parallel request (an agent's two tool calls off one context).
fn preamble_and_conversation(continuation_weight: &str, forks: bool) -> (usize, usize) {
    let f = fixture();
    f.policy(&format!(
        "  ranker: CostAware\n  continuationWeight: \"{continuation_weight}\"\n"
    ));
    let members = ["a", "b", "c", "d"];
    for r in members {
        announce(&f, r);
    }
    let preamble = chain(1..11);
    let mut conversation = preamble.clone();
    conversation.extend(chain(1_000..1_004));
    f.hold("a", &conversation);
    let (mut moves, mut elsewhere, mut at) = (0, 0, "a".to_string());
    for i in 0..120u64 {
        f.clock.advance(Duration::from_millis(200));
        for r in members {
            load(&f, r, 0, 0);
        }
        let mut fork = conversation.clone();
        conversation.push(h(2_000 + i));
        let o = f.lookup_chain(&conversation);
        let to = o.replica_id(&o.scores[0]).to_string();
        if to != at {
            moves += 1;
            at = to.clone();
        }
        if forks {
            fork.push(h(3_000 + i));
            let o = f.lookup_chain(&fork);
            let to = o.replica_id(&o.scores[0]).to_string();
            f.hold(&to, &fork);
            if to != at {
                moves += 1;
            }
        }
        f.hold(&to, &conversation);
        if i % 4 == 3 {
            let mut session = preamble.clone();
            session.extend(chain(10_000 + i * 10..10_008 + i * 10));
            let o = f.lookup_chain(&session);
            let to = o.replica_id(&o.scores[0]).to_string();
            f.hold(&to, &session);
            elsewhere += usize::from(to != "a");
        }
    }
    (moves, elsewhere)
}

#[test]
fn a_shared_preamble_is_copied_before_a_conversation_is_moved() {
    // By default a conversation stays with its cache, and the new sessions
    // that branch off the preamble it shares are the ones that spread.
    let (moves, elsewhere) = preamble_and_conversation("0.2", false);
    assert_eq!(moves, 0, "the conversation moved {moves} times");
    assert!(elsewhere >= 15, "{elsewhere} of 30 new sessions left a");
    // Weighing a continuation like a new session moves the conversation.
    let (moves, _) = preamble_and_conversation("1", false);
    assert!(moves > 0, "the conversation never moved");
}

#[test]
fn parallel_requests_of_one_conversation_are_not_a_shared_branch_point() {
    // Two requests forking one context at every step: the second's match
    // ends where the first's did, yet both continue the conversation and
    // stay with its cache, while new sessions still spread.
    let (moves, elsewhere) = preamble_and_conversation("0.2", true);
    assert_eq!(moves, 0, "the conversation or its fork moved {moves} times");
    assert!(elsewhere >= 15, "{elsewhere} of 30 new sessions left a");
}

#[test]
fn every_answer_says_what_decided_it() {
    let f = fixture();
    let head = fleet_sharing_a_head(&f, 0);
    let mut session = head.clone();
    session.extend(chain(50..58));
    f.hold("a", &session);
    let mut next = session.clone();
    next.extend(chain(60..62));
    // Teach the index what a request costs.
    for i in 0..50 {
        f.lookup_chain(&chain(500 + i * 10..510 + i * 10));
    }
    for r in ["a", "b", "c", "d"] {
        load(&f, r, 0, 0);
    }
    let o = f.lookup_chain(&next);
    assert_eq!(
        (o.reason, o.decision),
        (Reason::PrefixMatch, Decision::MatchDepth)
    );
    let mut fresh = head.clone();
    fresh.extend(chain(900..903));
    let o = f.lookup_chain(&fresh);
    assert_eq!(
        (o.reason, o.decision),
        (Reason::AffinityHint, Decision::SharedHead)
    );
    let o = f.lookup_chain(&chain(7_000..7_003));
    assert_eq!(
        (o.reason, o.decision),
        (Reason::AffinityHint, Decision::NoMatch)
    );
    load(&f, "a", 60, 8);
    let o = f.lookup_chain(&next);
    assert_ne!(o.replica_id(&o.scores[0]), "a", "a is swamped");
    assert_eq!(o.decision, Decision::Load);
    load(&f, "a", 0, 0);
    f.policy("  ranker: CostAware\n  minimumPrefixTokens: 100000\n");
    assert_eq!(f.lookup_chain(&next).decision, Decision::PrefixGate);
    let names: std::collections::HashSet<&str> = Decision::ALL.iter().map(|d| d.as_str()).collect();
    assert_eq!(names.len(), Decision::ALL.len());
}

/// New sessions branching off a preamble only `a` holds, over members a–d
/// whose caches are full (every block stored evicted one) or not; returns
/// how many of 40 left `a`.
fn new_sessions_leaving_the_holder(full_caches: bool, full_cache_weight: &str) -> usize {
    let f = fixture();
    f.policy(&format!(
        "  ranker: CostAware\n  fullCacheWeight: \"{full_cache_weight}\"\n"
    ));
    let members = ["a", "b", "c", "d"];
    for (i, r) in members.into_iter().enumerate() {
        announce(&f, r);
        if full_caches {
            // The engine's own churn: blocks stored, then evicted for others.
            let filler = chain(50_000 + i as u64 * 10_000..50_400 + i as u64 * 10_000);
            f.hold(r, &filler);
            for block in filler {
                f.index.publish(&CacheEvent {
                    kind: EventKind::PrefixEvicted,
                    replica_id: r.into(),
                    model_id: M.into(),
                    tenant_id: T.into(),
                    prefix_hash: block,
                    adapter_id: String::new(),
                });
            }
        }
    }
    let snapshot = f.index.snapshot();
    assert_eq!(snapshot.replicas.len(), 4, "every member is listed");
    for r in &snapshot.replicas {
        let expected = if full_caches { 1.0 } else { 0.0 };
        assert_eq!(r.cache_full, expected, "{}", r.replica_id);
    }
    let preamble = chain(1..11);
    f.hold("a", &preamble);
    let mut elsewhere = 0;
    for i in 0..40u64 {
        f.clock.advance(Duration::from_millis(500));
        for r in members {
            load(&f, r, 0, 0);
        }
        let mut session = preamble.clone();
        session.extend(chain(10_000 + i * 10..10_004 + i * 10));
        let o = f.lookup_chain(&session);
        let to = o.replica_id(&o.scores[0]).to_string();
        f.hold(&to, &session);
        elsewhere += usize::from(to != "a");
    }
    elsewhere
}

#[test]
fn full_caches_keep_new_sessions_with_the_holder_of_their_prefix() {
    // Caches with room: copying the preamble once lets sessions spread.
    let roomy = new_sessions_leaving_the_holder(false, "3");
    // Full caches: a copy evicts blocks others would reuse, so fewer leave,
    // and the full-cache weight is what keeps them.
    let full = new_sessions_leaving_the_holder(true, "3");
    let unweighted = new_sessions_leaving_the_holder(true, "0");
    assert_eq!(
        unweighted, roomy,
        "without the weight, fullness changes nothing"
    );
    assert!(
        full < roomy,
        "{full} of 40 left a with full caches, {roomy} with room"
    );
    assert!(full > 0, "balance still moves some sessions");
}

#[test]
fn the_requests_a_replica_reports_waiting_count_at_the_size_that_was_sent_there() {
    // Both replicas report a request waiting; a's is a long prompt this
    // index sent there, b's a short one. New sessions go to b.
    let f = fixture();
    cost_aware(&f);
    for r in ["a", "b"] {
        announce(&f, r);
    }
    f.hold("a", &chain(1..3));
    f.hold("b", &chain(100..102));
    let mut long = chain(1..3);
    long.extend(chain(1_000..1_300));
    assert_eq!(ids(&f.lookup_chain(&long))[0], "a");
    let mut short = chain(100..102);
    short.extend(chain(5_000..5_002));
    assert_eq!(ids(&f.lookup_chain(&short))[0], "b");
    load(&f, "a", 1, 0);
    load(&f, "b", 1, 0);
    let picks: Vec<String> = (0..4u64)
        .map(|s| {
            let o = f.lookup_chain(&chain(20_000 + s * 10..20_003 + s * 10));
            o.replica_id(&o.scores[0]).to_string()
        })
        .collect();
    assert!(picks.iter().all(|r| r == "b"), "{picks:?}");
}
