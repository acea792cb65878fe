//! Fleet membership over a real socket: a replica joins by announcing itself
//! (REPLICA_UPDATED or a stats-only update), stays while it heartbeats, and
//! is never named once it goes silent past `replicaTimeout` or says goodbye
//! with ALL_CLEARED — under both rankers. `/snapshot` shows membership,
//! last word and load.

use crate::contract_support;

use std::time::Duration;

use contract_support::*;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, ReplicaStats, cache_event::Type};

fn heartbeat(replica: &str) -> inference_cache_proto::v1alpha1::CacheEvent {
    event(Type::ReplicaUpdated, replica, Vec::new(), "")
}

fn load(replica: &str, waiting: u32) -> CacheStateUpdate {
    CacheStateUpdate {
        stats: Some(ReplicaStats {
            requests_waiting: waiting,
            requests_running: 2,
            kv_cache_usage: 0.5,
            ..Default::default()
        }),
        ..update(replica, vec![])
    }
}

async fn novel_picks(h: &mut Harness, from: u64) -> Vec<String> {
    let mut picks = Vec::new();
    for i in 0..24 {
        let r = h
            .lookup(chain_lookup(&chain(from + i * 10..from + i * 10 + 3)))
            .await;
        picks.extend(ids(&r).into_iter().map(str::to_owned));
    }
    picks
}

#[tokio::test]
async fn join_heartbeat_expiry_and_leave() {
    for ranker in ["Contract", "CostAware"] {
        let policy = policy_doc("*", &format!("  ranker: {ranker}\n  replicaTimeout: 30s\n"));
        let mut h = Harness::start(&policy).await;
        // a holds a prefix and heartbeats; b only announces itself; c only
        // sends stats.
        h.event(heartbeat("a")).await;
        h.hold("a", &chain(1..5)).await;
        h.event(heartbeat("b")).await;
        h.report(vec![load("c", 0)]).await;
        let r = h.lookup(chain_lookup(&chain(1..5))).await;
        assert_eq!(ids(&r)[0], "a", "{ranker}");
        let picks = novel_picks(&mut h, 1000).await;
        for member in ["a", "b", "c"] {
            assert!(
                picks.iter().any(|p| p == member),
                "{ranker}: {member} never picked"
            );
        }
        let (_, snapshot) = h.admin_get("/snapshot").await;
        let snapshot: serde_json::Value = serde_json::from_str(&snapshot).expect("json");
        let c = snapshot["replicas"]
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["replica_id"] == "c"))
            .expect("c in the snapshot");
        assert_eq!(c["member_of"][0], "team-a/llama");
        assert_eq!(c["stats"]["requests_waiting"], 0);
        assert!(c["last_heard_ms"].as_u64().is_some());

        // 20 s later b and c speak again; 15 s after that a has been silent
        // for 35 s and is gone, even though it still holds the prefix.
        h.clock.advance(Duration::from_secs(20));
        h.event(heartbeat("b")).await;
        h.report(vec![load("c", 1)]).await;
        h.clock.advance(Duration::from_secs(15));
        let r = h.lookup(chain_lookup(&chain(1..5))).await;
        assert!(!ids(&r).contains(&"a"), "{ranker}: expired a named: {r:?}");
        assert!(
            !novel_picks(&mut h, 2000).await.iter().any(|p| p == "a"),
            "{ranker}"
        );

        // b says goodbye: never named again.
        h.event(event(Type::AllCleared, "b", Vec::new(), "")).await;
        let picks = novel_picks(&mut h, 3000).await;
        assert!(picks.iter().all(|p| p == "c"), "{ranker}: {picks:?}");

        // a comes back with a word and is named for its prefix again.
        h.event(heartbeat("a")).await;
        let r = h.lookup(chain_lookup(&chain(1..5))).await;
        assert_eq!(ids(&r)[0], "a", "{ranker}");
        h.stop().await;
    }
}

#[tokio::test]
async fn metrics_say_what_decided_each_answer() {
    let mut h = Harness::start(&policy_doc("*", "  ranker: CostAware\n")).await;
    for r in ["a", "b"] {
        h.event(heartbeat(r)).await;
    }
    h.hold("a", &chain(1..5)).await;
    let r = h.lookup(chain_lookup(&chain(1..5))).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    let r = h.lookup(chain_lookup(&chain(900..903))).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT");
    let series = |reason: &str, decision: &str| {
        format!(
            "inferencecache_lookup_decisions_total{{reason_code=\"{reason}\",decision=\"{decision}\"}}"
        )
    };
    assert_eq!(
        h.metric(&series("PREFIX_MATCH", "match_depth")).await,
        Some(1.0)
    );
    assert_eq!(
        h.metric(&series("AFFINITY_HINT", "no_match")).await,
        Some(1.0)
    );
    h.stop().await;
}
