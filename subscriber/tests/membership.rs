//! Fleet membership over real sockets: the subscriber announces its replica
//! at start, heartbeats `REPLICA_UPDATED`, re-announces after a clear and
//! says goodbye (`ALL_CLEARED`) on shutdown and on SIGTERM; a restarted
//! subscriber replays what the engine published before its first frame.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::cache_event::Type as EventType;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

fn tokens(n: u32, offset: u32) -> Vec<u32> {
    (offset..offset + n).collect()
}

fn chain(tokens: &[u32]) -> Vec<Vec<u8>> {
    request_chain(tokens, 16)
        .block_hashes
        .into_iter()
        .map(|h| h.to_vec())
        .collect()
}

fn is_event(arrival: &Arrival, kind: EventType) -> bool {
    *arrival == Arrival::Event(kind as i32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announces_at_start_then_heartbeats() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let sub = subscriber_with(
        &format!("http://{}", server.addr),
        &["--heartbeat-interval", "200ms"],
    )
    .await;
    assert!(
        eventually(WAIT, || server.received().heartbeats().len() >= 3).await,
        "heartbeats never arrived: {:?}",
        server.received()
    );
    let received = server.received();
    assert_eq!(
        received.arrivals[0],
        Arrival::Update {
            prefixes: 0,
            stats: false
        },
        "the first word is the announcement"
    );
    let announce = &received.updates[0];
    assert_eq!(announce.replica_id, "replica-a");
    assert_eq!(announce.tenant_id, "team-a");
    assert_eq!(announce.model_id, "qwen3");
    assert_eq!(announce.hash_scheme, "vllm");
    assert!(announce.prefixes.is_empty());
    for beat in received.heartbeats() {
        assert_eq!(beat.replica_id, "replica-a");
        assert_eq!(beat.tenant_id, "team-a");
        assert_eq!(beat.model_id, "qwen3");
    }
    // The interval holds: 3 beats take at least two intervals.
    assert!(metric(&sub, "inferencecache_subscriber_heartbeats_total") >= 3.0);
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_announcements_total"),
        1.0
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_interval_is_respected() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let started = Instant::now();
    let sub = subscriber_with(
        &format!("http://{}", server.addr),
        &["--heartbeat-interval", "500ms"],
    )
    .await;
    assert!(eventually(WAIT, || server.received().heartbeats().len() >= 4).await);
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(1900),
        "4 beats at 500ms need about 2s, took {elapsed:?}"
    );
    let beats = server.received().heartbeats().len();
    assert!(beats <= 6, "{beats} beats in {elapsed:?}");
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_says_goodbye_after_the_stream_is_ingested() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(32, 0);
    publisher.publish(json!([stored(&[1, 2], None, &prompt)]), "array");
    assert!(eventually(WAIT, || server.received().blocks().len() >= 2).await);
    let started = Instant::now();
    let metrics_before = metric(&sub, "inferencecache_subscriber_goodbyes_total");
    let probe = sub.metrics().render();
    assert!(probe.contains("inferencecache_subscriber_goodbyes_total"));
    assert_eq!(metrics_before, 0.0);
    sub.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let received = server.received();
    let last = received.arrivals.last().expect("arrivals");
    assert!(
        is_event(last, EventType::AllCleared),
        "the last word is ALL_CLEARED: {:?}",
        received.arrivals
    );
    let goodbye = received.cache_events().last().cloned().expect("goodbye");
    assert_eq!(goodbye.replica_id, "replica-a");
    assert_eq!(goodbye.tenant_id, "team-a");
    assert_eq!(goodbye.model_id, "qwen3");
    assert!(goodbye.prefix_hash.is_empty());
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_when_the_server_is_away() {
    let sub = subscriber_with(&format!("http://{}", free_port()), &[]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    sub.shutdown().await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "shutdown took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_cache_is_announced_again() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    publisher.publish(json!([stored(&[1], None, &tokens(16, 0))]), "array");
    assert!(eventually(WAIT, || !server.received().blocks().is_empty()).await);
    publisher.publish(json!([{"type": "AllBlocksCleared"}]), "array");
    assert!(
        eventually(WAIT, || {
            let arrivals = server.received().arrivals;
            arrivals
                .iter()
                .position(|a| is_event(a, EventType::AllCleared))
                .is_some_and(|at| {
                    arrivals[at + 1..]
                        .iter()
                        .any(|a| matches!(a, Arrival::Update { prefixes: 0, .. }))
                })
        })
        .await,
        "no announcement after the clear: {:?}",
        server.received().arrivals
    );
    sub.shutdown().await;
    server.kill().await;
}

async fn replays_from_zero_when_the_first_frame_is_late(format: &str) {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start(format);
    let prompt = tokens(48, 0);
    // Published before the subscriber listens (it starts late, or restarted).
    publisher.publish_unsent(json!([stored(&[1], None, &prompt[..16])]), "array");
    publisher.publish_unsent(json!([stored(&[2], Some(1), &prompt[16..32])]), "map");
    let sub = subscriber(&publisher, server.addr, true, &[]).await;
    publisher.wait_subscriber(1);
    let seq = publisher.publish(json!([stored(&[3], Some(2), &prompt[32..])]), "array");
    assert_eq!(seq, 2);
    assert!(
        eventually(WAIT, || server.received().blocks().len() >= 3).await,
        "replayed blocks missing: {:?}",
        server.received()
    );
    let blocks: Vec<Vec<u8>> = server
        .received()
        .blocks()
        .into_iter()
        .map(|b| b.2)
        .collect();
    assert_eq!(blocks, chain(&prompt), "history applied before the frame");
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_first_frame_replays_total"),
        1.0
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_batches_replayed_total"),
        2.0
    );
    assert_eq!(
        metric(
            &sub,
            "inferencecache_subscriber_blocks_dropped_total{reason=\"unknown_parent\"}"
        ),
        0.0
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_first_frame_replays_from_zero_v25() {
    replays_from_zero_when_the_first_frame_is_late("v25").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_first_frame_replays_from_zero_v26() {
    replays_from_zero_when_the_first_frame_is_late("v26").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_first_frame_without_replay_drops_orphans() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let prompt = tokens(32, 0);
    publisher.publish_unsent(json!([stored(&[1], None, &prompt[..16])]), "array");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    publisher.publish(json!([stored(&[2], Some(1), &prompt[16..])]), "array");
    assert!(
        eventually(WAIT, || {
            metric(
                &sub,
                "inferencecache_subscriber_blocks_dropped_total{reason=\"unknown_parent\"}",
            ) == 1.0
        })
        .await
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_first_frame_replays_total"),
        0.0
    );
    assert!(server.received().blocks().is_empty());
    sub.shutdown().await;
    server.kill().await;
}

/// Environment variable carrying the child's subscribe flags (one per line).
const CHILD_ARGS: &str = "SUBSCRIBER_TEST_CHILD_ARGS";

/// Not a test of its own: the body of the child process that
/// [`sigterm_says_goodbye`] starts (this test binary, filtered to this
/// function). Without the variable it does nothing.
#[test]
fn child_runs_the_subscribe_command() {
    let Ok(flags) = std::env::var(CHILD_ARGS) else {
        return;
    };
    let mut argv = vec!["subscribe".to_owned()];
    argv.extend(flags.lines().map(str::to_owned));
    let args = inference_cache_subscriber::SubscribeArgs::try_parse_from(argv).expect("flags");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime
        .block_on(inference_cache_subscriber::run(args))
        .expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_says_goodbye() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let flags = [
        "--endpoint",
        "tcp://127.0.0.1:1",
        "--server",
        &format!("http://{}", server.addr),
        "--replica-id",
        "replica-a",
        "--tenant",
        "team-a",
        "--model",
        "qwen3",
        "--metrics-listen",
        "off",
    ]
    .join("\n");
    let exe = std::env::current_exe().expect("test executable");
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "membership::child_runs_the_subscribe_command",
            "--nocapture",
        ])
        .env(CHILD_ARGS, flags)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    assert!(
        eventually(WAIT, || !server.received().announcements().is_empty()).await,
        "the child never announced its replica"
    );
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let started = Instant::now();
    let exited = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the child did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(exited.success(), "child exited with {exited:?}");
    let received = server.received();
    assert!(
        received
            .arrivals
            .last()
            .is_some_and(|a| is_event(a, EventType::AllCleared)),
        "no goodbye: {:?}",
        received.arrivals
    );
    server.kill().await;
}
