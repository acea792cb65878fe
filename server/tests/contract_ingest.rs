//! ReportCacheState / PublishEvent / GetCacheState contract over a real gRPC
//! socket: ingest rules, events, aggregates, the probe tenant, and ingest
//! interleaving with lookups on one long-lived stream.

use crate::contract_support;

use contract_support::*;
use inference_cache_proto::v1alpha1::cache_event::Type;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, GetCacheStateRequest, PrefixEntry};

const OPEN: &str =
    "  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n  affinityRouting: Disabled\n";

#[tokio::test]
async fn malformed_and_empty_scheme_entries_are_dropped_and_counted() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    let bad = PrefixEntry {
        block_hashes: chain(1..3),
        block_token_counts: vec![64],
        ..Default::default()
    };
    let mut no_scheme = update("A", vec![exact_entry(5, 64)]);
    no_scheme.hash_scheme.clear();
    h.report(vec![update("A", vec![bad, exact_entry(6, 64)]), no_scheme])
        .await;
    assert_eq!(
        h.lookup(chain_lookup(&chain(1..2))).await.reason_code,
        "NO_HINT"
    );
    assert_eq!(
        h.lookup(exact_lookup(6, 64)).await.reason_code,
        "PREFIX_MATCH"
    );
    assert_eq!(
        h.metric("inferencecache_ingest_dropped_total{reason=\"malformed_chain\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        h.metric("inferencecache_ingest_dropped_total{reason=\"empty_hash_scheme\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(h.metric("inferencecache_index_entries").await, Some(1.0));
    h.stop().await;
}

/// The wire's counts and hashes are checked when the server converts an
/// entry: a negative count, a length mismatch or an empty hash is dropped
/// with the same reason as ever, and the checks of the whole update (the
/// probe tenant, an empty hash scheme) still come first.
#[tokio::test]
async fn chain_entries_are_checked_at_the_edge() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    let negative = PrefixEntry {
        block_hashes: chain(1..3),
        block_token_counts: vec![64, -64],
        ..Default::default()
    };
    let mismatched = PrefixEntry {
        block_hashes: chain(1..3),
        block_token_counts: vec![64, 64, 64],
        ..Default::default()
    };
    let empty_hash = PrefixEntry {
        block_hashes: vec![hash_of(1), Vec::new()],
        block_token_counts: vec![64, 64],
        ..Default::default()
    };
    let entries = vec![
        negative,
        mismatched,
        empty_hash,
        PrefixEntry::default(),
        exact_entry(6, 64),
    ];
    let mut probe = update("A", entries.clone());
    probe.tenant_id = inference_cache_proto::PROBE_TENANT.into();
    let mut no_scheme = update("A", entries.clone());
    no_scheme.hash_scheme.clear();
    h.report(vec![update("A", entries), probe, no_scheme]).await;
    assert_ne!(
        h.lookup(exact_lookup(6, 64)).await.reason_code,
        "NO_HINT",
        "the valid entry is ingested"
    );
    assert_eq!(
        h.lookup(chain_lookup(&chain(1..2))).await.reason_code,
        "NO_HINT",
        "no block of a refused chain is ingested"
    );
    for (reason, n) in [
        ("malformed_chain", 2.0),
        ("empty_hash", 2.0),
        ("probe_tenant", 5.0),
        ("empty_hash_scheme", 5.0),
    ] {
        assert_eq!(
            h.metric(&format!(
                "inferencecache_ingest_dropped_total{{reason=\"{reason}\"}}"
            ))
            .await,
            Some(n),
            "{reason}"
        );
    }
    assert_eq!(h.metric("inferencecache_index_entries").await, Some(1.0));
    h.stop().await;
}

#[tokio::test]
async fn updates_are_additive_deltas() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    h.hold("A", &chain(1..2)).await;
    h.hold("A", &chain(2..3)).await;
    assert_eq!(
        h.lookup(chain_lookup(&chain(1..2))).await.reason_code,
        "PREFIX_MATCH"
    );
    h.stop().await;
}

#[tokio::test]
async fn prefix_evicted_narrowed_by_adapter_or_across_partitions() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    let blocks = chain(1..2);
    for adapter in ["a1", "a2"] {
        let mut u = update("A", vec![chain_entry(&blocks, 64)]);
        u.adapter_id = adapter.into();
        h.report(vec![u]).await;
    }
    let looked = |adapter: &str| inference_cache_proto::v1alpha1::LookupRouteRequest {
        adapter_id: adapter.into(),
        ..chain_lookup(&blocks)
    };
    h.event(event(Type::PrefixEvicted, "A", hash_of(1), "a1"))
        .await;
    assert_eq!(h.lookup(looked("a1")).await.reason_code, "NO_HINT");
    assert_eq!(h.lookup(looked("a2")).await.reason_code, "PREFIX_MATCH");
    let mut u = update("A", vec![chain_entry(&blocks, 64)]);
    u.adapter_id = "a1".into();
    h.report(vec![u]).await;
    h.event(event(Type::PrefixEvicted, "A", hash_of(1), ""))
        .await;
    assert_eq!(h.lookup(looked("a1")).await.reason_code, "NO_HINT");
    assert_eq!(h.lookup(looked("a2")).await.reason_code, "NO_HINT");
    assert_eq!(
        h.metric("inferencecache_index_evictions_total{reason=\"event\"}")
            .await,
        Some(3.0)
    );
    h.stop().await;
}

#[tokio::test]
async fn all_cleared_across_adapters_and_prefix_added_is_a_no_op() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    let blocks = chain(1..3);
    let mut u = update("A", vec![chain_entry(&blocks, 64)]);
    u.adapter_id = "a1".into();
    h.report(vec![u, update("A", vec![chain_entry(&blocks, 64)])])
        .await;
    h.hold("B", &blocks).await;
    h.event(event(Type::PrefixAdded, "C", hash_of(1), "")).await;
    h.event(event(Type::AllCleared, "A", vec![], "a1")).await;
    assert_eq!(ids(&h.lookup(chain_lookup(&blocks)).await), ["B"]);
    let state = h
        .client
        .get_cache_state(GetCacheStateRequest {
            model_id: M.into(),
            tenant_id: T.into(),
        })
        .await
        .expect("state")
        .into_inner();
    assert_eq!(state.summary.expect("summary").entry_count, 2);
    h.stop().await;
}

#[tokio::test]
async fn replica_updated_and_unknown_event_type() {
    let mut h = Harness::start("").await;
    h.event(event(Type::ReplicaUpdated, "A", vec![], "")).await;
    let ack = h
        .client
        .publish_event(event(Type::Unspecified, "A", vec![], ""))
        .await
        .expect("event")
        .into_inner();
    assert!(!ack.accepted);
    h.stop().await;
}

#[tokio::test]
async fn get_cache_state_aggregates_tenant_model() {
    let mut h = Harness::start("").await;
    h.hold("A", &chain(1..4)).await;
    h.hold("B", &chain(1..2)).await;
    let mut other_scheme = update("C", vec![chain_entry(&chain(1..2), 64)]);
    other_scheme.hash_scheme = "sglang".into();
    h.report(vec![
        other_scheme,
        stats_update("A", 0.4, 0.2),
        stats_update("B", 0.6, 0.4),
    ])
    .await;
    let state = h
        .client
        .get_cache_state(GetCacheStateRequest {
            model_id: M.into(),
            tenant_id: T.into(),
        })
        .await
        .expect("state")
        .into_inner();
    let summary = state.summary.expect("summary");
    assert_eq!(summary.replica_count, 3);
    assert_eq!(summary.entry_count, 5);
    assert_eq!(summary.prefix_count, 4);
    assert!((summary.mean_hit_rate - 0.5).abs() < 1e-6);
    assert!((summary.mean_pressure - 0.3).abs() < 1e-6);
    assert_eq!(summary.cache_memory_bytes, 2 << 20);
    let ids: Vec<&str> = state
        .replicas
        .iter()
        .map(|r| r.replica_id.as_str())
        .collect();
    assert_eq!(ids, ["A", "B", "C"]);
    assert!((state.replicas[0].hit_rate - 0.4).abs() < 1e-6);
    h.stop().await;
}

#[tokio::test]
async fn probe_tenant_is_unwritable_and_unreadable() {
    let mut h = Harness::start(&policy_doc("*", OPEN)).await;
    let probe = inference_cache_proto::PROBE_TENANT;
    h.report(vec![CacheStateUpdate {
        tenant_id: probe.into(),
        ..update("A", vec![chain_entry(&chain(1..2), 64)])
    }])
    .await;
    let mut ev = event(Type::AllCleared, "A", vec![], "");
    ev.tenant_id = probe.into();
    h.event(ev).await;
    let state = h
        .client
        .get_cache_state(GetCacheStateRequest {
            model_id: M.into(),
            tenant_id: probe.into(),
        })
        .await
        .expect("state")
        .into_inner();
    assert!(state.replicas.is_empty());
    assert_eq!(state.summary.unwrap_or_default().entry_count, 0);
    assert_eq!(h.metric("inferencecache_index_entries").await, Some(0.0));
    let (_, snapshot) = h.admin_get("/snapshot").await;
    assert!(!snapshot.contains(probe), "{snapshot}");
    h.stop().await;
}

#[tokio::test]
async fn stream_ingests_while_lookups_run() {
    let h = Harness::start(&policy_doc("*", OPEN)).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<CacheStateUpdate>(4);
    let mut producer = h.client.clone();
    let call = tokio::spawn(async move {
        producer
            .report_cache_state(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    let mut consumer = h.client.clone();
    for i in 0..5u64 {
        tx.send(update(
            "A",
            vec![chain_entry(&chain(i * 10..i * 10 + 1), 64)],
        ))
        .await
        .expect("send");
        let mut seen = false;
        for _ in 0..100 {
            let r = consumer
                .lookup_route(chain_lookup(&chain(i * 10..i * 10 + 1)))
                .await
                .expect("lookup")
                .into_inner();
            if r.reason_code == "PREFIX_MATCH" {
                seen = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(seen, "update {i} visible while the stream is still open");
    }
    drop(tx);
    let ack = call.await.expect("join").expect("ack").into_inner();
    assert!(ack.accepted);
    h.stop().await;
}
