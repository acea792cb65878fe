//! LookupRoute contract over a real gRPC socket: every reason code, the
//! precedence between them, the floors, ranking and the input modes.

use crate::contract_support;

use contract_support::*;
use inference_cache_proto::v1alpha1::{ChatMessage, LookupRouteRequest, Slo};

const OPEN: &str = "  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n";

#[tokio::test]
async fn three_two_one_blocks_rank_by_distinguishing_power() {
    let mut h = Harness::start("").await;
    let blocks = chain(1..4);
    h.hold("A", &blocks[..3]).await;
    h.hold("B", &blocks[..2]).await;
    h.hold("C", &blocks[..1]).await;
    let r = h.lookup(chain_lookup(&blocks)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(ids(&r), ["A", "B", "C"]);
    let scores: Vec<f32> = r.replica_scores.iter().map(|s| s.score).collect();
    assert!((scores[0] - 192.0 * 2.0 / 3.0).abs() < 1e-3, "{scores:?}");
    assert!((scores[1] - 128.0 / 3.0).abs() < 1e-3, "{scores:?}");
    assert!(scores[2].abs() < 1e-6, "{scores:?}");
    let matched: Vec<i32> = r.replica_scores.iter().map(|s| s.matched_tokens).collect();
    assert_eq!(matched, [192, 128, 64]);
    assert_eq!(r.replica_scores[0].tier, 1);
    assert!(r.lookup_latency_us >= 0);
    h.stop().await;
}

#[tokio::test]
async fn exact_prefix_hash_match_and_legacy_key_of_a_chain() {
    let mut h = Harness::start("").await;
    let mut entry = chain_entry(&chain(1..3), 64);
    entry.prefix_hash = hash_of(900);
    entry.token_count = 128;
    h.report(vec![update("A", vec![entry])]).await;
    h.hold("B", &chain(50..51)).await;
    let r = h.lookup(exact_lookup(900, 128)).await;
    assert_eq!(
        (r.reason_code.as_str(), ids(&r)),
        ("PREFIX_MATCH", vec!["A"])
    );
    assert_eq!(r.replica_scores[0].matched_tokens, 128);
    h.stop().await;
}

#[tokio::test]
async fn tenant_hot_on_exact_miss_never_on_chain_miss() {
    let mut h = Harness::start(&policy_doc("*", "  affinityRouting: Disabled\n")).await;
    h.hold("A", &chain(1..2)).await;
    h.hold("B", &chain(2..3)).await;
    h.report(vec![
        stats_update("A", 0.8, 0.0),
        stats_update("B", 0.05, 0.0),
    ])
    .await;
    let r = h.lookup(exact_lookup(777, 64)).await;
    assert_eq!((r.reason_code.as_str(), ids(&r)), ("TENANT_HOT", vec!["A"]));
    assert_eq!(r.replica_scores[0].matched_tokens, 0);
    assert_eq!(r.replica_scores[0].tier, 0);
    let r = h.lookup(chain_lookup(&chain(700..702))).await;
    assert_eq!(r.reason_code, "NO_HINT");
    h.clock.advance(std::time::Duration::from_secs(301));
    assert_eq!(h.lookup(exact_lookup(777, 64)).await.reason_code, "NO_HINT");
    h.stop().await;
}

#[tokio::test]
async fn enable_tenant_hot_false_downgrades() {
    let policy = policy_doc(
        "*",
        "  affinityRouting: Disabled\n  strategy: {enableTenantHot: false}\n",
    );
    let mut h = Harness::start(&policy).await;
    h.hold("A", &chain(1..2)).await;
    h.report(vec![stats_update("A", 0.8, 0.0)]).await;
    assert_eq!(h.lookup(exact_lookup(777, 64)).await.reason_code, "NO_HINT");
    h.stop().await;
}

#[tokio::test]
async fn affinity_hint_on_novel_prefix_and_disabled_gives_no_hint() {
    let mut h = Harness::start("").await;
    for r in ["r0", "r1", "r2"] {
        h.hold(r, &chain(1000..1001)).await;
    }
    let first = h.lookup(chain_lookup(&chain(5..7))).await;
    assert_eq!(first.reason_code, "AFFINITY_HINT");
    assert_eq!(first.replica_scores.len(), 1);
    let s = &first.replica_scores[0];
    assert_eq!(
        (
            s.score,
            s.matched_tokens,
            s.estimated_cache_hit_prob,
            s.tier
        ),
        (0.0, 0, 0.0, 0)
    );
    let again = h.lookup(chain_lookup(&chain(5..7))).await;
    assert_eq!(ids(&first), ids(&again));
    std::fs::write(
        &h.policy_path,
        policy_doc("*", "  affinityRouting: Disabled\n"),
    )
    .expect("write");
    wait_for(|| async { h_lookup_reason(&h, chain_lookup(&chain(5..7))).await == "NO_HINT" }).await;
    h.stop().await;
}

async fn h_lookup_reason(h: &Harness, r: LookupRouteRequest) -> String {
    let mut client = h.client.clone();
    client
        .lookup_route(r)
        .await
        .expect("lookup")
        .into_inner()
        .reason_code
}

async fn wait_for<F, Fut>(mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if check().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("condition not reached in 5s");
}

#[tokio::test]
async fn matched_tokens_floor_then_routing_floor() {
    let mut h = Harness::start(&policy_doc("*", "  affinityRouting: Disabled\n")).await;
    let blocks = chain(1..3);
    let short = inference_cache_proto::v1alpha1::PrefixEntry {
        block_hashes: blocks.clone(),
        block_token_counts: vec![16, 16],
        ..Default::default()
    };
    h.report(vec![update("A", vec![short])]).await;
    h.hold("B", &chain(50..51)).await;
    let mut req = chain_lookup(&blocks);
    req.block_token_counts = vec![16, 16];
    assert_eq!(
        h.lookup(req).await.reason_code,
        "NO_HINT",
        "32 < 64 matched tokens"
    );
    // Equal depth on two replicas: power 0, score 0 < 0.1.
    let deep = chain(10..13);
    h.hold("A", &deep).await;
    h.hold("B", &deep).await;
    assert_eq!(h.lookup(chain_lookup(&deep)).await.reason_code, "NO_HINT");
    h.stop().await;
}

#[tokio::test]
async fn minimum_prefix_tokens_gate_both_affinity_modes() {
    let mut h = Harness::start(&policy_doc("*", "  minimumPrefixTokens: 1000\n")).await;
    let blocks = chain(1..3);
    h.hold("A", &blocks).await;
    let r = h.lookup(chain_lookup(&blocks)).await;
    assert_eq!(
        (r.reason_code.as_str(), ids(&r)),
        ("AFFINITY_HINT", vec!["A"])
    );
    std::fs::write(
        &h.policy_path,
        policy_doc(
            "*",
            "  minimumPrefixTokens: 1000\n  affinityRouting: Disabled\n",
        ),
    )
    .expect("write");
    wait_for(|| async { h_lookup_reason(&h, chain_lookup(&chain(1..3))).await == "NO_HINT" }).await;
    h.stop().await;
}

#[tokio::test]
async fn require_chain_and_chain_matching_gates() {
    let mut h = Harness::start(&policy_doc("*", "  strategy: {requireChain: true}\n")).await;
    let mut entry = chain_entry(&chain(1..3), 64);
    entry.prefix_hash = hash_of(900);
    entry.token_count = 128;
    h.report(vec![update("A", vec![entry])]).await;
    let mut exact = exact_lookup(900, 128);
    exact.adapter_id = "x".into();
    let r = h.lookup(exact).await;
    assert_eq!(
        (r.reason_code.as_str(), r.adapter_id.as_str()),
        ("POLICY_REQUIRES_CHAIN", "")
    );
    let tokens = LookupRouteRequest {
        token_ids: (0..64).collect(),
        ..exact_lookup(0, 0)
    };
    let tokens = LookupRouteRequest {
        prefix_hash: vec![],
        ..tokens
    };
    assert_eq!(h.lookup(tokens).await.reason_code, "POLICY_REQUIRES_CHAIN");
    assert_eq!(
        h.lookup(chain_lookup(&chain(1..3))).await.reason_code,
        "PREFIX_MATCH"
    );
    std::fs::write(
        &h.policy_path,
        policy_doc("*", "  strategy: {enableChainMatching: false}\n"),
    )
    .expect("write");
    wait_for(|| async {
        let mut req = chain_lookup(&chain(1..3));
        req.prefix_hash = vec![];
        h_lookup_reason(&h, req).await == "NO_HINT"
    })
    .await;
    let mut req = chain_lookup(&chain(1..3));
    req.prefix_hash = hash_of(900);
    req.prefix_token_count = 128;
    let r = h.lookup(req).await;
    assert_eq!(
        (r.reason_code.as_str(), r.replica_scores[0].matched_tokens),
        ("PREFIX_MATCH", 128)
    );
    h.stop().await;
}

#[tokio::test]
async fn diagnostic_codes_outer_to_inner_and_cold_start() {
    let mut h = Harness::start("").await;
    let with = |t: &str, m: &str, s: &str| LookupRouteRequest {
        tenant_id: t.into(),
        model_id: m.into(),
        hash_scheme: s.into(),
        ..exact_lookup(4242, 64)
    };
    assert_eq!(
        h.lookup(with("nobody", M, S)).await.reason_code,
        "NO_HINT",
        "cold start"
    );
    h.hold("A", &chain(1..2)).await;
    assert_eq!(
        h.lookup(with("nobody", "x", "y")).await.reason_code,
        "UNKNOWN_TENANT"
    );
    assert_eq!(
        h.lookup(with(T, "x", "y")).await.reason_code,
        "UNKNOWN_MODEL"
    );
    assert_eq!(
        h.lookup(with(T, M, "sglang")).await.reason_code,
        "UNKNOWN_HASH_SCHEME"
    );
    assert_eq!(h.lookup(with("", M, S)).await.reason_code, "NO_HINT");
    // Diagnostics outrank AFFINITY_HINT; a known scope falls back to affinity.
    assert_eq!(h.lookup(with(T, M, S)).await.reason_code, "AFFINITY_HINT");
    let mut chain_req = chain_lookup(&chain(300..302));
    chain_req.hash_scheme = "sglang".into();
    assert_eq!(h.lookup(chain_req).await.reason_code, "UNKNOWN_HASH_SCHEME");
    h.stop().await;
}

#[tokio::test]
async fn malformed_chain_and_empty_scheme_are_no_hint() {
    let mut h = Harness::start("").await;
    h.hold("A", &chain(1..3)).await;
    let mut bad = chain_lookup(&chain(1..3));
    bad.block_token_counts = vec![64];
    bad.prefix_hash = hash_of(1);
    assert_eq!(h.lookup(bad).await.reason_code, "NO_HINT");
    let mut empty = chain_lookup(&chain(1..3));
    empty.hash_scheme.clear();
    assert_eq!(h.lookup(empty).await.reason_code, "NO_HINT");
    h.stop().await;
}

/// A wire chain's counts and hashes are checked when the server converts
/// it: a negative count or an empty hash answers NO_HINT with the adapter
/// echoed, as a length mismatch does; under `requireChain` a length
/// mismatch is no wire chain (POLICY_REQUIRES_CHAIN) while the others are.
#[tokio::test]
async fn wire_chains_are_checked_at_the_edge() {
    let mut h = Harness::start(&policy_doc("*", "  affinityRouting: Enabled\n")).await;
    h.hold("A", &chain(1..3)).await;
    h.hold("B", &chain(50..51)).await;
    let valid = || LookupRouteRequest {
        adapter_id: "x".into(),
        ..chain_lookup(&chain(1..3))
    };
    let mut negative = valid();
    negative.block_token_counts[1] = -64;
    let mut empty_hash = valid();
    empty_hash.block_hashes[1].clear();
    let mut mismatched = valid();
    mismatched.block_token_counts.push(64);
    assert_ne!(h.lookup(valid()).await.reason_code, "NO_HINT");
    for (what, request) in [
        ("negative count", negative.clone()),
        ("empty hash", empty_hash.clone()),
        ("length mismatch", mismatched.clone()),
    ] {
        let r = h.lookup(request).await;
        assert_eq!(
            (r.reason_code.as_str(), r.adapter_id.as_str()),
            ("NO_HINT", "x"),
            "{what}"
        );
    }
    h.stop().await;
    let mut h = Harness::start(&policy_doc("*", "  strategy: {requireChain: true}\n")).await;
    h.hold("A", &chain(1..3)).await;
    for (what, request, want) in [
        ("negative count", negative, ("NO_HINT", "x")),
        ("empty hash", empty_hash, ("NO_HINT", "x")),
        ("length mismatch", mismatched, ("POLICY_REQUIRES_CHAIN", "")),
    ] {
        let r = h.lookup(request).await;
        assert_eq!(
            (r.reason_code.as_str(), r.adapter_id.as_str()),
            want,
            "{what}"
        );
    }
    h.stop().await;
}

#[tokio::test]
async fn token_ids_fingerprinted_with_engine_block_size() {
    let mut h = Harness::start_with("", |c| c.index.engine_block_size = 16).await;
    let tokens: Vec<u32> = (0..64).collect();
    let fp = inference_cache_fingerprint::request_chain(&tokens, 16);
    let blocks: Vec<Vec<u8>> = fp.block_hashes.iter().map(|b| b.to_vec()).collect();
    h.report(vec![update("A", vec![chain_entry(&blocks, 16)])])
        .await;
    let req = LookupRouteRequest {
        token_ids: tokens.clone(),
        ..chain_lookup(&[])
    };
    let r = h.lookup(req).await;
    assert_eq!(
        (r.reason_code.as_str(), r.replica_scores[0].matched_tokens),
        ("PREFIX_MATCH", 64)
    );
    assert!(
        r.token_ids.is_empty(),
        "token_ids are echoed only for server-tokenized inputs"
    );
    // A wire chain wins over token_ids.
    let req = LookupRouteRequest {
        token_ids: tokens,
        ..chain_lookup(&chain(900..901))
    };
    assert_ne!(h.lookup(req).await.reason_code, "PREFIX_MATCH");
    // Too short for one block: NO_HINT.
    let req = LookupRouteRequest {
        token_ids: (0..10).collect(),
        ..chain_lookup(&[])
    };
    assert_eq!(h.lookup(req).await.reason_code, "NO_HINT");
    h.stop().await;
}

#[tokio::test]
async fn text_inputs_without_tokenizer_fail_open_without_adapter() {
    let mut h = Harness::start("").await;
    h.hold("A", &chain(1..2)).await;
    for req in [
        LookupRouteRequest {
            prompt_text: "hello".into(),
            ..chain_lookup(&[])
        },
        LookupRouteRequest {
            raw_prompt: "hello".into(),
            ..chain_lookup(&[])
        },
        LookupRouteRequest {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: "hello".into(),
            }],
            ..chain_lookup(&[])
        },
    ] {
        let req = LookupRouteRequest {
            adapter_id: "sql-lora".into(),
            ..req
        };
        let r = h.lookup(req).await;
        assert_eq!(
            (r.reason_code.as_str(), r.adapter_id.as_str()),
            ("NO_HINT", "")
        );
        assert!(r.replica_scores.is_empty());
    }
    h.stop().await;
}

#[tokio::test]
async fn adapter_partition_and_echo() {
    let mut h = Harness::start(&policy_doc("*", "  affinityRouting: Disabled\n")).await;
    let blocks = chain(1..3);
    let mut u = update("A", vec![chain_entry(&blocks, 64)]);
    u.adapter_id = "sql-lora".into();
    h.report(vec![u]).await;
    let mut entry = chain_entry(&blocks, 64);
    entry.adapter_id = "chat-lora".into();
    h.report(vec![update("B", vec![entry])]).await;
    for (adapter, want) in [
        ("sql-lora", vec!["A"]),
        ("chat-lora", vec!["B"]),
        ("", vec![]),
    ] {
        let req = LookupRouteRequest {
            adapter_id: adapter.into(),
            ..chain_lookup(&blocks)
        };
        let r = h.lookup(req).await;
        assert_eq!(r.adapter_id, adapter);
        assert_eq!(ids(&r), want, "adapter {adapter:?}");
    }
    h.stop().await;
}

#[tokio::test]
async fn coldest_tier_of_the_run_and_last_write_wins() {
    let mut h = Harness::start("").await;
    let blocks = chain(1..3);
    let mut first = chain_entry(&blocks[..1], 64);
    first.tier = 1;
    let mut second = chain_entry(&blocks[1..], 64);
    second.tier = 2;
    h.report(vec![update("A", vec![first, second])]).await;
    let r = h.lookup(chain_lookup(&blocks)).await;
    assert_eq!(
        (r.reason_code.as_str(), r.replica_scores[0].tier),
        ("PREFIX_MATCH", 2)
    );
    let mut upgrade = chain_entry(&blocks[1..], 64);
    upgrade.tier = 0; // unspecified → T1
    h.report(vec![update("A", vec![upgrade])]).await;
    assert_eq!(
        h.lookup(chain_lookup(&blocks)).await.replica_scores[0].tier,
        1
    );
    h.stop().await;
}

#[tokio::test]
async fn slo_tight_bias_and_pressure() {
    let mut h = Harness::start("").await;
    let blocks = chain(1..3);
    h.hold("A", &blocks).await;
    h.report(vec![stats_update("A", 0.5, 0.5)]).await;
    let base = h.lookup(chain_lookup(&blocks)).await.replica_scores[0].score;
    assert!((base - 64.0).abs() < 1e-3, "{base}");
    let tight = LookupRouteRequest {
        slo: Some(Slo {
            ttft_ms: 50,
            tbt_ms: 10,
        }),
        ..chain_lookup(&blocks)
    };
    let score = h.lookup(tight).await.replica_scores[0].score;
    assert!((score - 128.0).abs() < 1e-3, "{score}");
    h.stop().await;
}

#[tokio::test]
async fn probe_tenant_lookup_is_no_hint() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    h.hold("A", &chain(1..2)).await;
    let req = LookupRouteRequest {
        tenant_id: inference_cache_proto::PROBE_TENANT.into(),
        ..chain_lookup(&chain(1..2))
    };
    let r = h.lookup(req).await;
    assert_eq!(
        (r.reason_code.as_str(), r.replica_scores.len()),
        ("NO_HINT", 0)
    );
    h.stop().await;
}

#[tokio::test]
async fn caller_deadline_already_passed_is_timeout_not_an_error() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    let blocks = chain(1..4);
    h.hold("A", &blocks).await;
    // The same lookup with time to spare is a hit, so TIMEOUT below is the deadline's doing.
    assert_eq!(
        h.lookup(chain_lookup(&blocks)).await.reason_code,
        "PREFIX_MATCH"
    );
    // grpc-timeout "1n": the deadline has passed by the time the server reads
    // it. The handler answers TIMEOUT; tonic's own deadline layers (server
    // and client side) race it and win only when the request or the answer
    // was not ready at their first poll (the caller then gets
    // DEADLINE_EXCEEDED or CANCELLED, fail-open for a gateway too). Over
    // several calls the handler's answer must show up, and no call may fail
    // any other way.
    let mut answered = 0;
    for _ in 0..20 {
        let mut request = tonic::Request::new(chain_lookup(&blocks));
        request.set_timeout(std::time::Duration::from_nanos(1));
        match h.client.lookup_route(request).await {
            Ok(r) => {
                let r = r.into_inner();
                assert_eq!(
                    (
                        r.reason_code.as_str(),
                        r.replica_scores.len(),
                        r.adapter_id.as_str()
                    ),
                    ("TIMEOUT", 0, "")
                );
                answered += 1;
            }
            // Either side's deadline layer (the server's answers
            // DEADLINE_EXCEEDED, the client's own reports CANCELLED).
            Err(status) => assert!(
                matches!(
                    status.code(),
                    tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
                ),
                "{status:?}"
            ),
        }
    }
    assert!(
        answered > 0,
        "a passed deadline is answered TIMEOUT, not failed"
    );
    h.stop().await;
}
