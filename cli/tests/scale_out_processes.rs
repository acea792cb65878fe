//! Scale-out with real processes: two `inference-cache serve --nats-url`
//! binaries on one NATS JetStream server; one is killed with SIGKILL while
//! the other keeps ingesting and answering, then restarted: it is not ready
//! until it has replayed the log, and then answers exactly like the survivor.
//! No lookup on the survivor fails at any point.

use crate::{nats_support, process_support};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};
use nats_support::Nats;
use process_support::ServerProcess;

const POLICY: &str = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
    metadata: {name: all, namespace: \"*\"}\nspec:\n  ranker: Contract\n";

/// A server of the shared log on `nats`, under `policy`.
fn spawn(nats: &Nats, policy: &std::path::Path) -> ServerProcess {
    let policy = policy.to_str().expect("UTF-8 path");
    ServerProcess::spawn(&[
        "--nats-url",
        &nats.url(),
        "--nats-ack-timeout",
        "500ms",
        "--nats-max-bytes",
        "67108864",
        "--policy-file",
        policy,
    ])
}

fn blocks(id: u64) -> Vec<Vec<u8>> {
    (0..3)
        .map(|b| (id * 16 + b).to_be_bytes().to_vec())
        .collect()
}

fn report(id: u64) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: format!("10.0.9.{}:8000", id % 4),
        model_id: "llama".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            block_hashes: blocks(id),
            block_token_counts: vec![64; 3],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn lookup(id: u64) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: "llama".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        block_hashes: blocks(id),
        block_token_counts: vec![64; 3],
        ..Default::default()
    }
}

#[tokio::test]
async fn a_killed_server_restarts_from_the_log_and_converges_while_the_survivor_never_fails() {
    let nats = Nats::launch().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).expect("policy");
    let survivor = spawn(&nats, &policy);
    let mut victim = spawn(&nats, &policy);
    survivor.wait_ready().await;
    victim.wait_ready().await;
    let mut to_survivor = survivor.client().await;
    let mut to_victim = victim.client().await;
    to_survivor
        .report_cache_state(tokio_stream::iter((0..20).map(report)))
        .await
        .expect("report");
    to_victim
        .report_cache_state(tokio_stream::iter((20..40).map(report)))
        .await
        .expect("report");

    // Lookups on the survivor, back to back, for the whole test.
    let errors = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let prober = {
        let (errors, answered, stop) = (errors.clone(), answered.clone(), stop.clone());
        let mut client = survivor.client().await;
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.is_cancelled() {
                match client.lookup_route(lookup(i % 40)).await {
                    Ok(_) => answered.fetch_add(1, Ordering::Relaxed),
                    Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                };
                i += 1;
            }
        })
    };

    // The victim's writes are in the log once the survivor has applied them.
    // (A SIGKILL between a write's answer and JetStream's acknowledgement of
    // its append loses that append: docs/scale-out.md, "Killed server".)
    let deadline = Instant::now() + Duration::from_secs(10);
    for id in 20..40 {
        loop {
            let answer = to_survivor
                .lookup_route(lookup(id))
                .await
                .expect("lookup")
                .into_inner();
            if answer.reason_code == "PREFIX_MATCH" {
                break;
            }
            assert!(Instant::now() < deadline, "{id} never reached the survivor");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    victim.kill();
    to_survivor
        .report_cache_state(tokio_stream::iter((40..80).map(report)))
        .await
        .expect("report while the other server is down");
    let restarted = spawn(&nats, &policy);
    let mut to_restarted = restarted.client().await;
    restarted.wait_ready().await;
    // Ready means caught up: every answer matches the survivor's at once.
    for id in 0..80 {
        let a = to_survivor
            .lookup_route(lookup(id))
            .await
            .expect("lookup")
            .into_inner();
        let b = to_restarted
            .lookup_route(lookup(id))
            .await
            .expect("lookup")
            .into_inner();
        assert_eq!(a.reason_code, "PREFIX_MATCH", "{id}");
        let ids = |r: &inference_cache_proto::v1alpha1::LookupRouteResponse| {
            r.replica_scores
                .iter()
                .map(|s| s.replica_id.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            (a.reason_code.as_str(), ids(&a)),
            (b.reason_code.as_str(), ids(&b)),
            "{id}"
        );
    }
    stop.cancel();
    prober.await.expect("prober");
    assert_eq!(errors.load(Ordering::Relaxed), 0);
    assert!(answered.load(Ordering::Relaxed) > 10);
}
