//! Policy file, bounded memory and admin surfaces over real sockets: reload on
//! change and SIGHUP (keeping the last good policy), `GET /policy`,
//! `GET /snapshot`, the TTL sweep and cap / quota eviction under LRU and LFU,
//! and the index metrics.

use crate::contract_support;

use std::time::Duration;

use contract_support::*;

#[tokio::test]
async fn bad_policy_file_fails_start_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p.yaml");
    std::fs::write(&path, policy_doc("*", "  eviction: FIFO\n")).expect("write");
    let mut config = inference_cache_server::ServeConfig::ephemeral();
    config.index.policy_file = Some(path);
    let error = match inference_cache_server::start(config).await {
        Ok(_) => panic!("must not start"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        error.contains("spec.eviction") && error.contains("document 1"),
        "{error}"
    );
}

#[tokio::test]
async fn reload_on_change_keeps_last_good_and_sighup() {
    let h = Harness::start(&policy_doc("team-a", "  minimumMatchedTokens: 7\n")).await;
    let (status, body) = h.admin_get("/policy").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(
        json["policies"]["namespaces"]["team-a"]["minimumMatchedTokens"],
        7
    );
    assert_eq!(json["policies"]["default"]["minimumMatchedTokens"], 64);
    assert_eq!(json["policies"]["default"]["evictionTTL"], "30m");

    std::fs::write(
        &h.policy_path,
        policy_doc("team-a", "  minimumMatchedTokens: 9\n"),
    )
    .expect("write");
    eventually("good edit applied", || async {
        let (_, body) = h.admin_get("/policy").await;
        body.contains("\"minimumMatchedTokens\":9")
    })
    .await;
    assert_eq!(
        h.metric("inferencecache_policy_reload_total{result=\"success\"}")
            .await,
        Some(2.0)
    );

    std::fs::write(
        &h.policy_path,
        policy_doc("team-a", "  minimumMatchedTokens: -1\n"),
    )
    .expect("write");
    eventually("bad edit counted", || async {
        h.metric("inferencecache_policy_reload_total{result=\"error\"}")
            .await
            >= Some(1.0)
    })
    .await;
    let (_, body) = h.admin_get("/policy").await;
    assert!(
        body.contains("\"minimumMatchedTokens\":9"),
        "last good policy kept: {body}"
    );
    assert!(
        body.contains("spec.minimumMatchedTokens"),
        "error shown: {body}"
    );

    // SIGHUP re-reads the file (the watcher task has installed its handler by now).
    let errors_before = h
        .metric("inferencecache_policy_reload_total{result=\"error\"}")
        .await;
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    eventually("SIGHUP reload", || async {
        h.metric("inferencecache_policy_reload_total{result=\"error\"}")
            .await
            > errors_before
    })
    .await;
    h.stop().await;
}

#[tokio::test]
async fn ttl_sweep_expires_by_tenant_ttl() {
    let mut h = Harness::start_with(&policy_doc("*", "  evictionTTL: 10m\n"), |c| {
        c.index.sweep_interval = Duration::from_millis(20);
    })
    .await;
    h.hold("A", &chain(1..3)).await;
    h.clock.advance(Duration::from_secs(5 * 60));
    h.hold("B", &chain(7..8)).await;
    h.clock.advance(Duration::from_secs(6 * 60));
    eventually("A expired", || async {
        h.metric("inferencecache_index_entries").await == Some(1.0)
    })
    .await;
    assert_eq!(
        h.metric("inferencecache_index_evictions_total{reason=\"ttl\"}")
            .await,
        Some(2.0)
    );
    h.stop().await;
}

#[tokio::test]
async fn global_cap_holds_at_ingest_and_evicts_least_recently_seen() {
    let open =
        "  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n  affinityRouting: Disabled\n";
    // Sweeps a second apart: one that ran between two of the reports below
    // (a busy machine can space them 20 ms apart) would make room early.
    let mut h = Harness::start_with(&policy_doc("*", open), |c| {
        c.index.sweep_interval = Duration::from_secs(1);
        c.index.max_index_entries = 3;
    })
    .await;
    // Past the cap, new entries are refused at ingest: the count never
    // exceeds it, not even between two sweeps.
    for i in 0..5u64 {
        h.hold("A", &chain(i..i + 1)).await;
        assert!(h.metric("inferencecache_index_entries").await <= Some(3.0));
        h.clock.advance(Duration::from_secs(1));
    }
    assert_eq!(
        h.metric("inferencecache_ingest_refused_total").await,
        Some(2.0)
    );
    // The sweep then makes room by evicting the least recently seen.
    eventually("room made", || async {
        h.metric("inferencecache_index_evictions_total{reason=\"capacity\"}")
            .await
            == Some(1.0)
    })
    .await;
    assert_eq!(
        h.lookup(chain_lookup(&chain(0..1))).await.reason_code,
        "NO_HINT"
    );
    assert_eq!(
        h.lookup(chain_lookup(&chain(1..2))).await.reason_code,
        "PREFIX_MATCH"
    );
    // A block reported again now finds room.
    h.hold("A", &chain(4..5)).await;
    assert_eq!(
        h.lookup(chain_lookup(&chain(4..5))).await.reason_code,
        "PREFIX_MATCH"
    );
    assert_eq!(h.metric("inferencecache_index_entries").await, Some(3.0));
    h.stop().await;
}

#[tokio::test]
async fn tenant_quota_evicts_least_frequently_used() {
    let open = "  eviction: LFU\n  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n  affinityRouting: Disabled\n";
    let mut h = Harness::start_with(&policy_doc("*", open), |c| {
        c.index.sweep_interval = Duration::from_millis(20);
    })
    .await;
    for i in 0..4u64 {
        h.hold("A", &chain(i..i + 1)).await;
        h.clock.advance(Duration::from_secs(1));
    }
    // Delivered hits credit the two oldest entries; LFU then keeps them over newer ones.
    for _ in 0..3 {
        h.lookup(chain_lookup(&chain(0..1))).await;
        h.lookup(chain_lookup(&chain(1..2))).await;
    }
    let quota = format!("{open}  quota: {{maxIndexEntries: 2}}\n");
    std::fs::write(&h.policy_path, policy_doc("*", &quota)).expect("write");
    eventually("quota", || async {
        h.metric("inferencecache_index_entries").await == Some(2.0)
    })
    .await;
    assert!(
        h.metric("inferencecache_index_evictions_total{reason=\"quota\"}")
            .await
            >= Some(2.0)
    );
    assert_eq!(
        h.lookup(chain_lookup(&chain(0..1))).await.reason_code,
        "PREFIX_MATCH"
    );
    assert_eq!(
        h.lookup(chain_lookup(&chain(1..2))).await.reason_code,
        "PREFIX_MATCH"
    );
    h.stop().await;
}

#[tokio::test]
async fn snapshot_is_metadata_only_aggregate() {
    let mut h = Harness::start("").await;
    h.hold("A", &chain(1..3)).await;
    h.report(vec![stats_update("A", 0.5, 0.1)]).await;
    let (status, body) = h.admin_get("/snapshot").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(json["entry_count"], 2);
    assert_eq!(json["tenants"][0]["tenant_id"], T);
    assert_eq!(json["tenants"][0]["replica_count"], 1);
    assert_eq!(json["replicas"][0]["replica_id"], "A");
    h.stop().await;
}

#[tokio::test]
async fn lookup_metrics_by_reason_code() {
    let mut h = Harness::start("").await;
    h.hold("A", &chain(1..3)).await;
    h.lookup(chain_lookup(&chain(1..3))).await;
    assert_eq!(
        h.metric("inferencecache_lookup_route_calls_total{reason_code=\"PREFIX_MATCH\"}")
            .await,
        Some(1.0)
    );
    assert!(
        h.metric("inferencecache_lookup_route_latency_seconds_count")
            .await
            >= Some(1.0)
    );
    assert!(h.metric("inferencecache_ingest_entries_total").await >= Some(2.0));
    h.stop().await;
}
