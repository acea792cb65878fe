//! LookupPDRoute over a real socket: a PDTopology from the policy file picks
//! the prefill replica holding the prefix (else the least loaded) and the
//! least-loaded decode replica, names the transport, and fails open like
//! LookupRoute.

use crate::contract_support;

use std::time::{Duration, Instant};

use contract_support::*;
use inference_cache_proto::v1alpha1::{
    CacheStateUpdate, LookupPdRouteRequest, LookupPdRouteResponse, ReplicaStats,
};

fn topology(transport: &str) -> String {
    format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: PDTopology\nmetadata: {{name: llama-pd, namespace: \"{T}\"}}\n\
         spec:\n  hashScheme: {S}\n  transport: {transport}\n  prefill: [p1, p2]\n  decode: [d1, d2]\n"
    )
}

fn loaded(
    replica: &str,
    waiting: u32,
    prefixes: Vec<inference_cache_proto::v1alpha1::PrefixEntry>,
) -> CacheStateUpdate {
    CacheStateUpdate {
        stats: Some(ReplicaStats {
            replica_id: replica.into(),
            requests_waiting: waiting,
            ..Default::default()
        }),
        ..update(replica, prefixes)
    }
}

fn pd(hash: u64, topology: &str) -> LookupPdRouteRequest {
    LookupPdRouteRequest {
        model_id: M.into(),
        tenant_id: T.into(),
        prefix_hash: hash_of(hash),
        prefix_token_count: 256,
        pd_topology_ref: topology.into(),
    }
}

async fn ask(h: &mut Harness, request: LookupPdRouteRequest) -> LookupPdRouteResponse {
    h.client
        .lookup_pd_route(request)
        .await
        .expect("LookupPDRoute never errors")
        .into_inner()
}

#[tokio::test]
async fn prefill_by_prefix_and_load_decode_by_load_from_the_policy_topology() {
    let mut h = Harness::start(&topology("NIXL")).await;
    h.report(vec![
        loaded("p2", 5, vec![exact_entry(7, 256)]),
        loaded("p1", 0, vec![]),
        loaded("d1", 3, vec![]),
        loaded("d2", 1, vec![]),
    ])
    .await;

    let hit = ask(&mut h, pd(7, "llama-pd")).await;
    assert_eq!(
        (
            hit.prefill_replica_id.as_str(),
            hit.decode_replica_id.as_str(),
            hit.transport_hint.as_str(),
            hit.reason_code.as_str()
        ),
        ("p2", "d2", "NIXL", "PREFIX_MATCH")
    );

    // Nobody holds it: the least-loaded prefill replica, no cache claim.
    let miss = ask(&mut h, pd(8, "llama-pd")).await;
    assert_eq!(
        (
            miss.prefill_replica_id.as_str(),
            miss.decode_replica_id.as_str(),
            miss.reason_code.as_str()
        ),
        ("p1", "d2", "AFFINITY_HINT")
    );

    // Load moves: the decode pick follows.
    h.report(vec![loaded("d2", 9, vec![])]).await;
    assert_eq!(ask(&mut h, pd(7, "llama-pd")).await.decode_replica_id, "d1");

    // Fail open: an unknown topology, another tenant, a wrong hash scheme scope.
    for request in [
        pd(7, "nope"),
        LookupPdRouteRequest {
            tenant_id: "team-b".into(),
            ..pd(7, "llama-pd")
        },
        LookupPdRouteRequest {
            tenant_id: inference_cache_proto::PROBE_TENANT.into(),
            ..pd(7, "llama-pd")
        },
    ] {
        let r = ask(&mut h, request).await;
        assert_eq!(r.reason_code, "NO_HINT", "{r:?}");
        assert!(r.prefill_replica_id.is_empty() && r.decode_replica_id.is_empty());
        assert!(r.transport_hint.is_empty());
    }
    let unknown_model = ask(
        &mut h,
        LookupPdRouteRequest {
            model_id: "other".into(),
            ..pd(7, "llama-pd")
        },
    )
    .await;
    assert_eq!(unknown_model.reason_code, "UNKNOWN_MODEL");
    assert!(unknown_model.prefill_replica_id.is_empty());

    // The topology is re-read with the policy file.
    std::fs::write(
        &h.policy_path,
        format!("{}---\n{}", policy_doc("*", ""), topology("Mooncake")),
    )
    .expect("rewrite policy");
    let deadline = Instant::now() + Duration::from_secs(20);
    while ask(&mut h, pd(7, "llama-pd")).await.transport_hint != "Mooncake" {
        assert!(Instant::now() < deadline, "topology not reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.stop().await;
}

#[tokio::test]
async fn a_bad_topology_fails_start_up_with_its_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, topology("Pigeon")).expect("write");
    let mut config = inference_cache_server::ServeConfig::ephemeral();
    config.index.policy_file = Some(path);
    let error = inference_cache_server::start(config)
        .await
        .err()
        .expect("refused");
    let text = format!("{error:#}");
    assert!(text.contains("PDTopology"), "{text}");
}
