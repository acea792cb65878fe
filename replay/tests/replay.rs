//! Black-box tests of the replay: hit rates and TTFTs computed by hand on tiny
//! traces, the in-process inference-cache rows, and the outputs.

use inference_cache_index::{PolicySet, Reason};
use inference_cache_replay::*;

const BS: u32 = 4;

fn request(arrival_ms: u64, blocks: &[u64]) -> Request {
    Request {
        arrival_ms,
        // Every last block is partial: 3 of 4 tokens.
        input_tokens: BS * blocks.len() as u32 - 1,
        output_tokens: 2,
        blocks: blocks.to_vec(),
    }
}

/// First id `x` such that session B's head `[x, x+1]` hashes to another
/// replica of 2 than session A's head `[1, 2]`.
fn other_head() -> u64 {
    let a = [1u64, 2];
    let mut probe = [0u64; 2];
    let target = {
        let trace = Trace {
            block_size: BS,
            requests: vec![request(0, &a)],
        };
        session_hash_replica(&trace)
    };
    (10..)
        .find(|&x| {
            probe = [x, x + 1];
            let trace = Trace {
                block_size: BS,
                requests: vec![request(0, &probe)],
            };
            session_hash_replica(&trace) != target
        })
        .expect("some head hashes elsewhere")
}

/// The replica session-hash sends the trace's only request to.
fn session_hash_replica(trace: &Trace) -> usize {
    let config = SimConfig::new(2, 4);
    let result = simulate(
        trace,
        Policy::SessionHash,
        &config,
        &PolicySet::default(),
        None,
    )
    .expect("replays");
    result
        .requests_per_replica
        .per_replica
        .iter()
        .position(|&n| n == 1)
        .expect("one replica served it")
}

/// Sessions A (1, 2, 3, 4) and B (b, b+1, b+2, b+3), one second apart, in the
/// order A A B B A B; prompts grow by one block per turn.
fn tiny_trace() -> Trace {
    let b = other_head();
    Trace {
        block_size: BS,
        requests: vec![
            request(0, &[1, 2]),
            request(1000, &[1, 2, 3]),
            request(2000, &[b, b + 1]),
            request(3000, &[b, b + 1, b + 2]),
            request(4000, &[1, 2, 3, 4]),
            request(5000, &[b, b + 1, b + 2, b + 3]),
        ],
    }
}

fn run(trace: &Trace, policies: &[Policy], config: &SimConfig) -> Vec<PolicyResult> {
    replay_trace(trace, policies, config, &PolicySet::default()).expect("replays")
}

#[test]
fn baselines_reproduce_hand_computed_hit_rates() {
    let trace = tiny_trace();
    let config = SimConfig::new(2, 4);
    let results = run(
        &trace,
        &[
            Policy::RoundRobin,
            Policy::SessionHash,
            Policy::PooledOracle,
        ],
        &config,
    );
    let [rr, hash, oracle] = &results[..] else {
        panic!("three rows");
    };
    // 18 blocks, 66 tokens (each prompt is 4n - 1 tokens).
    for r in &results {
        assert_eq!((r.blocks, r.tokens, r.requests), (18, 66, 6));
    }

    // Round-robin: replica 0 gets requests 0, 2, 4; replica 1 gets 1, 3, 5.
    // r0 [1,2] → R0 {1,2}. r1 [1,2,3] → R1 {1,2,3} (MRU first: 1,2,3).
    // r2 [b,b+1] → R0 {b,b+1,1,2}, full. r3 [b..b+2] on R1 (LRU order
    // 3, 2, 1 — a prompt's tail is freed first): b fills R1, b+1 evicts 3,
    // b+2 evicts 2 → R1 {1,b,b+1,b+2}.
    // r4 [1,2,3,4] on R0: hits 1, 2 (3 is on R1 only) = 2 blocks, 8 tokens.
    // r5 [b..b+3] on R1: hits b, b+1, b+2 = 3 blocks, 12 tokens.
    assert_eq!(rr.hit_blocks, 5);
    assert_eq!(rr.hit_tokens, 20);
    assert!((rr.block_hit_rate - 5.0 / 18.0).abs() < 1e-12);
    assert!((rr.token_hit_rate - 20.0 / 66.0).abs() < 1e-12);
    assert_eq!(rr.requests_per_replica.per_replica, [3, 3]);

    // Session hash: A and B each keep one replica. Hits: r1 2, r3 2, r4 3, r5 3.
    assert_eq!(hash.hit_blocks, 10);
    assert_eq!(hash.hit_tokens, 8 + 8 + 12 + 12);
    let mut spread = hash.requests_per_replica.per_replica.clone();
    spread.sort_unstable();
    assert_eq!(spread, [3, 3]);

    // Pooled oracle: one cache of 8 blocks never evicts here, so every
    // continuing turn hits its whole previous prompt: the same 10 blocks.
    assert_eq!(oracle.hit_blocks, 10);
    assert_eq!(oracle.cached_blocks, [8]);

    assert_eq!(oracle.oracle_ratio, Some(1.0));
    assert_eq!(hash.oracle_ratio, Some(1.0));
    assert!((rr.oracle_ratio.expect("oracle ran") - 0.5).abs() < 1e-12);
    // Spaced a second apart at 20k tokens/s, nobody queues: TTFT = uncached / 20 ms.
    // Round-robin prefills 66 - 20 = 46 tokens in all.
    let prefilled: u64 = rr.prefill_tokens_per_replica.per_replica.iter().sum();
    assert_eq!(prefilled, 46);
    assert!((rr.ttft_ms.mean - 46.0 / 20.0 / 6.0).abs() < 1e-9);
}

#[test]
fn ttft_follows_the_fifo_prefill_model() {
    let trace = Trace {
        block_size: BS,
        requests: vec![
            // 11 uncached tokens at 1 token/ms: TTFT 11 ms.
            request(0, &[1, 2, 3]),
            // Arrives at 5 ms: hits 3 blocks (12 tokens), prefills 3 tokens
            // after the first finishes at 11 ms: 6 ms wait + 3 ms = 9 ms.
            request(5, &[1, 2, 3, 4]),
            // Alone later: 3 tokens, 3 ms.
            request(100, &[9]),
        ],
    };
    let mut config = SimConfig::new(1, 16);
    config.model.prefill_tps = 1000.0;
    let results = run(&trace, &[Policy::RoundRobin, Policy::LeastLoaded], &config);
    for r in &results {
        assert_eq!(r.ttft_ms.mean, (11.0 + 9.0 + 3.0) / 3.0);
        assert_eq!(
            (r.ttft_ms.p50, r.ttft_ms.p99, r.ttft_ms.max),
            (9.0, 11.0, 11.0)
        );
        assert_eq!(r.prefill_tokens_per_replica.per_replica, [11 + 3 + 3]);
    }
    // --speedup 2 halves the arrival times: the second request arrives at
    // 2.5 ms and waits 8.5 ms before its 3 ms prefill.
    config.speedup = 2.0;
    let r = &run(&trace, &[Policy::RoundRobin], &config)[0];
    assert_eq!(r.ttft_ms.max, 8.5 + 3.0);
    assert_eq!(r.ttft_ms.mean, (11.0 + 11.5 + 3.0) / 3.0);
}

#[test]
fn least_loaded_avoids_the_busy_replica() {
    // Two long prompts at once, then a third: it goes to the replica that
    // finishes first; round-robin would put it behind the first.
    let trace = Trace {
        block_size: BS,
        requests: vec![
            request(0, &[1, 2, 3, 4, 5, 6, 7, 8]),
            request(0, &[20, 21]),
            request(1, &[30]),
        ],
    };
    let mut config = SimConfig::new(2, 64);
    config.model.prefill_tps = 1000.0;
    let results = run(&trace, &[Policy::RoundRobin, Policy::LeastLoaded], &config);
    // Round-robin: the third request queues behind the 31-token prefill on R0.
    assert_eq!(results[0].ttft_ms.max, 31.0 + 3.0 - 1.0);
    // Least-loaded: behind the 7-token prefill on R1 instead.
    assert_eq!(results[1].ttft_ms.max, 31.0);
    assert_eq!(results[1].requests_per_replica.per_replica, [1, 2]);
}

#[test]
fn inference_cache_rows_route_every_request_and_count_reasons() {
    let trace = generate(&SyntheticConfig {
        requests: 400,
        sessions: 40,
        seed: 11,
        ..SyntheticConfig::default()
    });
    let config = SimConfig::new(4, 300);
    let rows = [
        Policy::InferenceCache,
        Policy::InferenceCacheContract,
        Policy::InferenceCacheCostAware,
        Policy::PooledOracle,
    ];
    let results = run(&trace, &rows, &config);
    let codes: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
    for r in &results[..3] {
        assert_eq!(r.requests, 400, "{}", r.label);
        assert_eq!(r.requests_per_replica.per_replica.iter().sum::<u64>(), 400);
        let reasons = r.reasons.as_ref().expect("index rows count reasons");
        assert_eq!(
            reasons.iter().map(|s| s.count).sum::<u64>(),
            400,
            "{}",
            r.label
        );
        assert!(
            reasons.iter().all(|s| codes.contains(&s.code.as_str())),
            "{reasons:?}"
        );
        let share: f64 = reasons.iter().map(|s| s.share).sum();
        assert!((share - 1.0).abs() < 1e-9);
        assert!(r.block_hit_rate > 0.0 && r.oracle_ratio.is_some());
    }
    assert!(results[3].reasons.is_none());
}

#[test]
fn the_index_holds_exactly_what_the_replicas_hold() {
    let trace = generate(&SyntheticConfig {
        requests: 300,
        sessions: 30,
        seed: 4,
        ..SyntheticConfig::default()
    });
    // Small caches, so replicas evict and the index must follow.
    let mut config = SimConfig::new(3, 120);
    for report_at in [ReportAt::Routing, ReportAt::PrefillEnd] {
        config.report_at = report_at;
        for policy in [
            Policy::InferenceCacheContract,
            Policy::InferenceCacheCostAware,
        ] {
            let backend = InProcess::new(policies_for(policy, &PolicySet::default()));
            let mut router = IndexRouter::new(backend, &config);
            let result =
                simulate_with(&trace, policy, &config, &mut router, None).expect("replays");
            let held: u64 = result.cached_blocks.iter().sum();
            assert!(held > 0);
            let entries = router.backend().index().entry_count();
            assert_eq!(entries, held as i64, "{policy} {report_at:?}");
        }
    }
}

#[test]
fn policy_file_is_applied_and_rows_override_the_ranker() {
    let yaml = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
                metadata: { name: replay, namespace: replay }\n\
                spec: { affinityRouting: Disabled, strategy: { enableTenantHot: false } }\n";
    let set = PolicySet::from_yaml(yaml).expect("valid policy");
    let forced = policies_for(Policy::InferenceCacheCostAware, &set);
    let tenant = forced.for_tenant(TENANT);
    assert_eq!(tenant.ranker, inference_cache_index::Ranker::CostAware);
    assert!(!tenant.affinity_routing, "the file's other fields stay");
    // With affinity off, a cold index gives NO_HINT for every first turn; the
    // gateway then round-robins, and the row still routes everything.
    let trace = tiny_trace();
    let r = &replay_trace(
        &trace,
        &[Policy::InferenceCache],
        &SimConfig::new(2, 4),
        &set,
    )
    .expect("replays")[0];
    let reasons = r.reasons.as_ref().expect("counted");
    assert!(
        reasons.iter().all(|s| s.code != "AFFINITY_HINT"),
        "{reasons:?}"
    );
    assert_eq!(reasons.iter().map(|s| s.count).sum::<u64>(), 6);
}

#[test]
fn outputs_are_well_formed() {
    let trace = tiny_trace();
    let policies = [
        Policy::InferenceCache,
        Policy::RoundRobin,
        Policy::Random,
        Policy::SessionHash,
        Policy::PooledOracle,
    ];
    let results = run(&trace, &policies, &SimConfig::new(2, 4));
    let svg = render_svg("tiny <trace> & co", &results);
    assert!(svg.starts_with("<svg"));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("class=\"bar hit\"").count(), policies.len());
    assert_eq!(svg.matches("class=\"bar ttft\"").count(), policies.len());
    assert!(svg.contains("tiny &lt;trace&gt; &amp; co"));
    assert_eq!(svg.matches("<svg").count(), svg.matches("</svg>").count());

    let info = RunInfo {
        source: "tiny".into(),
        requests: 6,
        blocks: 18,
        block_size: BS,
        replicas: 2,
        capacity_blocks: 4,
        prefill_tps: 20_000.0,
        tpot_ms: 20.0,
        speedup: 1.0,
        stats_interval_ms: 500.0,
        report_at: "routing",
        refresh_interval_ms: Some(600_000.0),
        index: "in-process".into(),
    };
    let table = render_table(&info, &results);
    for p in policies {
        assert!(table.contains(p.label()), "{table}");
    }
    assert!(table.contains("reason codes"));
    let json: serde_json::Value =
        serde_json::from_str(&render_json(&info, &results)).expect("valid JSON");
    let rows = json["results"].as_array().expect("results array");
    assert_eq!(rows.len(), policies.len());
    assert_eq!(rows[1]["policy"], "round-robin");
    assert_eq!(rows[4]["oracle_ratio"], 1.0);
}

#[test]
fn random_policy_is_seeded() {
    let trace = generate(&SyntheticConfig {
        requests: 200,
        sessions: 20,
        ..SyntheticConfig::default()
    });
    let mut config = SimConfig::new(4, 100);
    let a = run(&trace, &[Policy::Random], &config);
    let b = run(&trace, &[Policy::Random], &config);
    config.seed = 2;
    let c = run(&trace, &[Policy::Random], &config);
    assert_eq!(a[0].requests_per_replica, b[0].requests_per_replica);
    assert_ne!(a[0].requests_per_replica, c[0].requests_per_replica);
}

#[test]
fn a_bad_trace_file_is_reported_with_file_line_and_field_once() {
    let path = std::env::temp_dir().join(format!("replay-bad-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .expect("temp file");
    let args = <ReplayArgsParser as clap::Parser>::parse_from([
        "replay",
        "--trace",
        path.to_str().expect("utf-8 temp path"),
    ]);
    let settings = args.args.resolve().expect("valid flags");
    let error = load_trace(&settings).expect_err("line 2 is inconsistent");
    std::fs::remove_file(&path).ok();
    let message = error.to_string();
    assert!(
        message.starts_with(&path.display().to_string()),
        "{message}"
    );
    assert_eq!(
        message.matches("line 2, field `hash_ids`").count(),
        1,
        "{message}"
    );
    assert!(std::error::Error::source(&error).is_none());
}

#[test]
fn flags_are_validated() {
    let parse = |extra: &[&str]| {
        let mut argv = vec!["replay", "--synthetic"];
        argv.extend_from_slice(extra);
        <ReplayArgsParser as clap::Parser>::try_parse_from(argv)
            .map_err(|e| e.to_string())
            .and_then(|a| a.args.resolve().map_err(|e| e.to_string()))
    };
    let ok = parse(&["--tpot", "25ms", "--policies", "round-robin,contract"]).expect("valid");
    assert_eq!(
        ok.policies,
        [Policy::RoundRobin, Policy::InferenceCacheContract]
    );
    assert_eq!(ok.sim.model.tpot_ms, 25.0);
    assert_eq!(ok.policies.len(), 2);
    assert_eq!(parse(&[]).expect("defaults").policies, Policy::ALL);
    for (bad, needle) in [
        (&["--replicas", "0"][..], "--replicas"),
        (&["--capacity-blocks", "0"], "--capacity-blocks"),
        (&["--speedup", "0"], "--speedup"),
        (&["--policies", "random,random"], "twice"),
        (&["--policies", "nope"], "unknown policy"),
        (
            &["--server", "http://127.0.0.1:1", "--policies", "contract"],
            "in-process",
        ),
        (&["--trace", "x.jsonl"], "cannot be used with"),
    ] {
        let error = parse(bad).expect_err(needle);
        assert!(error.contains(needle), "{bad:?}: {error}");
    }
    let server = parse(&["--server", "http://127.0.0.1:1"]).expect("valid");
    assert!(
        server
            .policies
            .iter()
            .all(|p| p.ranker_override().is_none())
    );
}

/// A stand-alone parser around the flags, as the binary's subcommand is.
#[derive(clap::Parser)]
struct ReplayArgsParser {
    #[command(flatten)]
    args: ReplayArgs,
}

/// Records when (in simulated time) each kind of feedback reaches the index.
#[derive(Default)]
struct Recording {
    now_ms: f64,
    /// (time, blocks) of every update with prefixes.
    stored: Vec<(f64, usize)>,
    /// (time, events) of every publish.
    evicted: Vec<(f64, usize)>,
    stats: usize,
}

impl Backend for Recording {
    fn set_time(&mut self, now_ms: f64) {
        self.now_ms = now_ms;
    }

    fn ingest(&mut self, update: inference_cache_index::CacheUpdate) -> Result<(), ReplayError> {
        assert_eq!(
            (update.tenant_id.as_str(), update.hash_scheme.as_str()),
            (TENANT, HASH_SCHEME)
        );
        if update.stats.is_some() {
            self.stats += 1;
        }
        for p in &update.prefixes {
            assert!(p.chain.hashes().all(|h| h.len() == 8));
            self.stored.push((self.now_ms, p.chain.len()));
        }
        Ok(())
    }

    fn publish(
        &mut self,
        events: Vec<inference_cache_index::CacheEvent>,
    ) -> Result<(), ReplayError> {
        self.evicted.push((self.now_ms, events.len()));
        Ok(())
    }

    fn lookup(&mut self, _: &[Vec<u8>], _: &[i32]) -> Result<Answer, ReplayError> {
        Ok(Answer {
            reason: "NO_HINT".into(),
            first: None,
        })
    }
}

#[test]
fn feedback_arrives_at_routing_time_or_when_the_prefill_ends() {
    // One replica of 4 blocks at 10 tokens/s. A 5-block prompt at 0 s
    // (19 tokens: prefill ends at 1.9 s) keeps 4 blocks; one-block prompts at
    // 5 s and 10 s (3 tokens: 0.3 s) each store a block and evict one.
    let trace = Trace {
        block_size: BS,
        requests: vec![
            request(0, &[1, 2, 3, 4, 5]),
            request(5000, &[7]),
            request(10_000, &[8]),
        ],
    };
    let mut config = SimConfig::new(1, 4);
    config.model.prefill_tps = 10.0;
    // Held-back feedback is delivered at the next stats report (every 0.5 s)
    // or lookup; what is still due at the end is delivered at the end (10 s).
    for (report_at, times) in [
        (ReportAt::Routing, [0.0, 5000.0, 10_000.0]),
        (ReportAt::PrefillEnd, [2000.0, 5500.0, 10_000.0]),
    ] {
        config.report_at = report_at;
        let mut router = IndexRouter::new(Recording::default(), &config);
        let result = simulate_with(&trace, Policy::InferenceCache, &config, &mut router, None)
            .expect("replays");
        let seen = router.backend();
        assert_eq!(
            seen.stored,
            [(times[0], 4), (times[1], 1), (times[2], 1)],
            "{report_at:?}"
        );
        assert_eq!(
            seen.evicted,
            [(times[1], 1), (times[2], 1)],
            "{report_at:?}"
        );
        // The announcement, then one report per 0.5 s up to 10 s.
        assert_eq!(seen.stats, 1 + 20);
        let reasons = result.reasons.expect("counted");
        assert_eq!((reasons[0].code.as_str(), reasons[0].count), ("NO_HINT", 3));
    }
}

#[test]
fn long_sessions_spread_within_the_balance_bound() {
    // The generator's default workload on 16 idle replicas: a few long agent
    // sessions on shared tool preambles. New sessions go where fewer
    // requests went, so those long ones do not leave a replica far ahead,
    // and the cache hits stay those of the session hash (which leaves one
    // replica several times over its share here).
    let trace = generate(&SyntheticConfig {
        seed: 6,
        ..SyntheticConfig::default()
    });
    let config = SimConfig::new(16, 4000);
    let results = run(
        &trace,
        &[Policy::InferenceCache, Policy::SessionHash],
        &config,
    );
    let (ours, hash) = (&results[0], &results[1]);
    assert!(
        ours.requests_per_replica.max_over_mean <= 1.3,
        "requests per replica: {:?}",
        ours.requests_per_replica
    );
    assert!(hash.requests_per_replica.max_over_mean > 2.0);
    assert!(
        ours.block_hit_rate >= 0.98 * hash.block_hit_rate,
        "block hit {} against the session hash's {}",
        ours.block_hit_rate,
        hash.block_hit_rate
    );
}

#[test]
fn held_blocks_are_re_reported_so_they_outlive_the_eviction_ttl() {
    // One conversation, a turn every 20 s for 6 minutes, each turn one block
    // longer; the index forgets what it has not heard of for a minute. The
    // engine keeps the conversation's head cached all along (every turn hits
    // it) but reports it stored only once, as vLLM does.
    let yaml = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
                metadata: { name: replay, namespace: replay }\n\
                spec: { evictionTTL: 1m }\n";
    let set = PolicySet::from_yaml(yaml).expect("valid policy");
    let trace = Trace {
        block_size: 64,
        requests: (0..18u64)
            .map(|turn| Request {
                arrival_ms: turn * 20_000,
                input_tokens: 64 * (turn as u32 + 3),
                output_tokens: 1,
                blocks: (1..=turn + 3).collect(),
            })
            .collect(),
    };
    let prefix_matches = |refresh_interval_ms: Option<f64>| {
        let config = SimConfig {
            refresh_interval_ms,
            ..SimConfig::new(4, 100)
        };
        let r =
            &replay_trace(&trace, &[Policy::InferenceCache], &config, &set).expect("replays")[0];
        let reasons = r.reasons.as_ref().expect("index rows count reasons");
        let count = reasons
            .iter()
            .find(|s| s.code == "PREFIX_MATCH")
            .map_or(0, |s| s.count);
        (count, r.block_hit_rate)
    };
    // Re-reported every 30 s, as the subscriber does: every turn after the
    // first is routed to the conversation's cache.
    let (refreshed, refreshed_hit) = prefix_matches(Some(30_000.0));
    assert_eq!(refreshed, 17);
    // Never re-reported: once the head is a minute old the index has dropped
    // it, and the turns lose their match.
    let (stale, stale_hit) = prefix_matches(None);
    assert!(stale <= 8, "{stale} prefix matches without refreshes");
    assert!(refreshed_hit > stale_hit);
}

#[test]
fn the_modelled_refresh_is_the_subscribers_default() {
    let subscriber =
        inference_cache_index::parse_duration(inference_cache_subscriber::DEFAULT_REFRESH_INTERVAL)
            .expect("the subscriber's default parses");
    assert_eq!(
        subscriber.as_secs_f64() * 1000.0,
        DEFAULT_REFRESH_INTERVAL_MS
    );
    assert_eq!(
        SimConfig::new(1, 1).refresh_interval_ms,
        Some(DEFAULT_REFRESH_INTERVAL_MS)
    );
}
