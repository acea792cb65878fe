//! End to end: Python vLLM publisher → subscriber → the real
//! `inference-cache serve` binary → LookupRoute with token_ids.
//!
//! The binary is taken from `$INFERENCE_CACHE_BIN`, else from this test's
//! target directory (`target/<profile>/inference-cache`); build it first with
//! `cargo build -p inference-cache`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheTier, LookupRouteRequest, LookupRouteResponse};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

async fn server_on(addr: SocketAddr) -> ServerProcess {
    ServerProcess::start(addr).await
}

async fn lookup(server: SocketAddr, tokens: &[u32], adapter: &str) -> LookupRouteResponse {
    lookup_salted(server, tokens, adapter, "").await
}

async fn lookup_salted(
    server: SocketAddr,
    tokens: &[u32],
    adapter: &str,
    cache_salt: &str,
) -> LookupRouteResponse {
    let mut client = InferenceCacheClient::connect(format!("http://{server}"))
        .await
        .expect("connect");
    client
        .lookup_route(LookupRouteRequest {
            model_id: "qwen3".into(),
            tenant_id: "team-a".into(),
            hash_scheme: "vllm".into(),
            token_ids: tokens.to_vec(),
            adapter_id: adapter.into(),
            cache_salt: cache_salt.into(),
            ..Default::default()
        })
        .await
        .expect("lookup")
        .into_inner()
}

/// Polls LookupRoute until `check` accepts the answer; returns the last one.
async fn lookup_until(
    server: SocketAddr,
    tokens: &[u32],
    adapter: &str,
    check: impl Fn(&LookupRouteResponse) -> bool,
) -> LookupRouteResponse {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let answer = lookup(server, tokens, adapter).await;
        if check(&answer) || std::time::Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn matched(answer: &LookupRouteResponse) -> i32 {
    answer
        .replica_scores
        .iter()
        .find(|s| s.replica_id == "replica-a")
        .map(|s| s.matched_tokens)
        .unwrap_or(0)
}

fn is_match(tokens: i32) -> impl Fn(&LookupRouteResponse) -> bool {
    move |a| a.reason_code == reason::PREFIX_MATCH && matched(a) == tokens
}

fn no_match(a: &LookupRouteResponse) -> bool {
    a.reason_code != reason::PREFIX_MATCH && matched(a) == 0
}

fn prompt(offset: u32) -> Vec<u32> {
    (offset..offset + 128).collect()
}

fn hashes(first: i128) -> Vec<i128> {
    (first..first + 8).collect()
}

async fn prefix_match_then_lost(layout: &str) {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, addr, false, &[]).await;
    publisher.wait_subscriber(1);

    let tokens = prompt(1);
    let hs = hashes(100);
    publisher.publish(
        json!([
            stored(&hs[..4], None, &tokens[..64]),
            stored(&hs[4..], Some(hs[3]), &tokens[64..])
        ]),
        layout,
    );
    let answer = lookup_until(addr, &tokens, "", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "stored chain not matched: {answer:?}"
    );
    assert_eq!(answer.replica_scores[0].replica_id, "replica-a");

    // Drop the last four blocks: the leading half still matches.
    publisher.publish(json!([removed(&hs[4..], "GPU")]), layout);
    let answer = lookup_until(addr, &tokens, "", is_match(64)).await;
    assert!(is_match(64)(&answer), "partial match expected: {answer:?}");

    // Remove the rest: no prefix evidence left.
    publisher.publish(json!([removed(&hs[..4], "GPU")]), layout);
    let answer = lookup_until(addr, &tokens, "", no_match).await;
    assert!(no_match(&answer), "removed chain still matched: {answer:?}");

    // Store again, then AllBlocksCleared.
    publisher.publish(json!([stored(&hs, None, &tokens)]), layout);
    let answer = lookup_until(addr, &tokens, "", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "re-stored chain not matched: {answer:?}"
    );
    publisher.publish(json!([{"type": "AllBlocksCleared"}]), layout);
    let answer = lookup_until(addr, &tokens, "", no_match).await;
    assert!(no_match(&answer), "cleared chain still matched: {answer:?}");

    sub.shutdown().await;
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_array_layout_match_remove_clear() {
    prefix_match_then_lost("array").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_map_layout_match_remove_clear() {
    prefix_match_then_lost("map").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_lora_partitions() {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(
        &publisher,
        addr,
        false,
        &["--lora-adapter-names", "1=sql-lora"],
    )
    .await;
    publisher.wait_subscriber(1);
    let tokens = prompt(5);
    let mut lora = stored(&hashes(200), None, &tokens);
    lora["lora_id"] = json!(1);
    let mut unmapped = stored(&hashes(300), None, &prompt(9000));
    unmapped["lora_id"] = json!(4);
    publisher.publish(json!([lora, unmapped]), "array");

    let answer = lookup_until(addr, &tokens, "sql-lora", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "adapter partition not matched: {answer:?}"
    );
    assert_eq!(answer.adapter_id, "sql-lora");
    let base = lookup(addr, &tokens, "").await;
    assert!(
        no_match(&base),
        "base partition must not see LoRA blocks: {base:?}"
    );
    let other = lookup(addr, &prompt(9000), "").await;
    assert!(
        no_match(&other),
        "unmapped LoRA id must be dropped: {other:?}"
    );
    sub.shutdown().await;
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_offload_tier_keeps_evicted_blocks_at_t2() {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, addr, false, &["--offload-tier"]).await;
    publisher.wait_subscriber(1);
    let tokens = prompt(77);
    let hs = hashes(400);
    publisher.publish(json!([stored(&hs, None, &tokens)]), "map");
    let answer = lookup_until(addr, &tokens, "", is_match(128)).await;
    assert_eq!(
        answer.replica_scores.first().map(|s| s.tier),
        Some(CacheTier::T1 as i32)
    );
    publisher.publish(json!([removed(&hs[6..], "GPU")]), "map");
    let answer = lookup_until(addr, &tokens, "", |a| {
        is_match(128)(a) && a.replica_scores[0].tier == CacheTier::T2 as i32
    })
    .await;
    assert!(
        is_match(128)(&answer),
        "evicted blocks must stay matchable: {answer:?}"
    );
    assert_eq!(
        answer.replica_scores[0].tier,
        CacheTier::T2 as i32,
        "{answer:?}"
    );
    sub.shutdown().await;
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_gap_is_replayed() {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v26");
    let sub = subscriber(&publisher, addr, true, &[]).await;
    publisher.wait_subscriber(1);
    let tokens = prompt(3);
    let hs = hashes(500);
    publisher.publish(json!([stored(&hs[..3], None, &tokens[..48])]), "array");
    publisher.publish_unsent(
        json!([stored(&hs[3..6], Some(hs[2]), &tokens[48..96])]),
        "array",
    );
    publisher.publish(
        json!([stored(&hs[6..], Some(hs[5]), &tokens[96..])]),
        "array",
    );
    let answer = lookup_until(addr, &tokens, "", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "replayed middle not matched: {answer:?}"
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_batches_replayed_total"),
        1.0
    );
    sub.shutdown().await;
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_server_restart_mid_stream() {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let first = prompt(10_000);
    publisher.publish(json!([stored(&hashes(600), None, &first)]), "array");
    let answer = lookup_until(addr, &first, "", is_match(128)).await;
    assert!(is_match(128)(&answer), "{answer:?}");

    server.kill();
    let second = prompt(20_000);
    publisher.publish(json!([stored(&hashes(700), None, &second)]), "array");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let server = server_on(addr).await;
    let answer = lookup_until(addr, &second, "", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "block stored while down not delivered: {answer:?}"
    );
    let answer = lookup_until(addr, &first, "", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "state from before the restart not restored: {answer:?}"
    );
    sub.shutdown().await;
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_engine_load_reaches_get_cache_state() {
    use inference_cache_proto::v1alpha1::GetCacheStateRequest;
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let page = MetricsPage::start(&fixture("vllm_v1_dp2_metrics.txt"));
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(
        &publisher,
        addr,
        false,
        &[
            "--engine-metrics-url",
            &page.url(),
            "--metrics-interval",
            "200ms",
        ],
    )
    .await;
    publisher.wait_subscriber(1);
    let tokens = prompt(31);
    publisher.publish(json!([stored(&hashes(800), None, &tokens)]), "array");
    let mut client = InferenceCacheClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let deadline = std::time::Instant::now() + WAIT;
    let stats = loop {
        let state = client
            .get_cache_state(GetCacheStateRequest {
                tenant_id: "team-a".into(),
                model_id: "qwen3".into(),
            })
            .await
            .expect("GetCacheState")
            .into_inner();
        let stats = state
            .replicas
            .into_iter()
            .find(|r| r.replica_id == "replica-a" && r.requests_running > 0);
        if let Some(stats) = stats {
            break stats;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "engine load never reached GetCacheState"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(stats.requests_waiting, 4);
    assert_eq!(stats.requests_running, 16);
    assert!((stats.kv_cache_usage - 0.6).abs() < 1e-6);
    assert!((stats.pressure - 0.6).abs() < 1e-6);
    assert!((stats.hit_rate - 0.25).abs() < 1e-6);
    sub.shutdown().await;
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_sigterm_of_the_subscribe_process_says_goodbye() {
    use inference_cache_proto::v1alpha1::cache_event::Type as EventType;
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut child = std::process::Command::new(server_binary())
        .args([
            "subscribe",
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
        ])
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn inference-cache subscribe");
    assert!(
        eventually(WAIT, || !server.received().announcements().is_empty()).await,
        "the subscribe process never announced its replica"
    );
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "inference-cache subscribe did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "exit status {status:?}");
    let received = server.received();
    assert_eq!(
        received.arrivals.last(),
        Some(&Arrival::Event(EventType::AllCleared as i32)),
        "no goodbye: {:?}",
        received.arrivals
    );
    let mut log = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("read stderr");
    assert!(log.contains("ALL_CLEARED"), "{log}");
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_late_start_replays_from_zero() {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v26");
    let tokens = prompt(40_000);
    let hs = hashes(900);
    // Published before the subscriber runs (it started late, or restarted).
    publisher.publish_unsent(json!([stored(&hs[..3], None, &tokens[..48])]), "array");
    publisher.publish_unsent(
        json!([stored(&hs[3..6], Some(hs[2]), &tokens[48..96])]),
        "map",
    );
    let sub = subscriber(&publisher, addr, true, &[]).await;
    publisher.wait_subscriber(1);
    publisher.publish(
        json!([stored(&hs[6..], Some(hs[5]), &tokens[96..])]),
        "array",
    );
    let answer = lookup_until(addr, &tokens, "", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "blocks published before the subscriber started are missing: {answer:?}"
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_first_frame_replays_total"),
        1.0
    );
    sub.shutdown().await;
    server.kill();
}

/// Polls a salted LookupRoute until `check` accepts the answer.
async fn lookup_salted_until(
    server: SocketAddr,
    tokens: &[u32],
    cache_salt: &str,
    check: impl Fn(&LookupRouteResponse) -> bool,
) -> LookupRouteResponse {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let answer = lookup_salted(server, tokens, "", cache_salt).await;
        if check(&answer) || std::time::Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Salted blocks reported by the subscriber (vLLM `extra_keys`, SGLang's
/// 0.5.19 salt map) match only lookups with the same `cache_salt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_salted_blocks_match_only_the_same_salt() {
    let server = server_on(free_port()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, addr, false, &[]).await;
    publisher.wait_subscriber(1);

    // vLLM: salt on block 0 only; the second event inherits it.
    let tokens = prompt(1);
    let hs = hashes(100);
    let mut first = stored(&hs[..4], None, &tokens[..64]);
    first["vllm_extra_keys"] = json!([["tenant-a"], null, null, null]);
    let mut rest = stored(&hs[4..], Some(hs[3]), &tokens[64..]);
    rest["vllm_extra_keys"] = json!([null, null, null, null]);
    // SGLang 0.5.19: the salt map after the array's fields, on every event.
    let other = prompt(5000);
    let mut sglang = stored(&hashes(200), None, &other);
    sglang["sglang_cache_salt"] = json!("tenant-b");
    publisher.publish(json!([first, rest, sglang]), "array");

    let answer = lookup_salted_until(addr, &tokens, "tenant-a", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "salted lookup not matched: {answer:?}"
    );
    let answer = lookup_salted_until(addr, &other, "tenant-b", is_match(128)).await;
    assert!(
        is_match(128)(&answer),
        "SGLang salted blocks not matched: {answer:?}"
    );

    // Unsalted and other-salt lookups of the same tokens never match.
    assert!(
        no_match(&lookup(addr, &tokens, "").await),
        "unsalted matched salted blocks"
    );
    assert!(
        no_match(&lookup(addr, &other, "").await),
        "unsalted matched salted blocks"
    );
    let answer = lookup_salted(addr, &tokens, "", "tenant-b").await;
    assert!(no_match(&answer), "another salt matched: {answer:?}");
    let answer = lookup_salted(addr, &other, "", "tenant-a").await;
    assert!(no_match(&answer), "another salt matched: {answer:?}");

    // Removal reaches the salted partition.
    publisher.publish(json!([removed(&hs[4..], "GPU")]), "array");
    let answer = lookup_salted_until(addr, &tokens, "tenant-a", is_match(64)).await;
    assert!(
        is_match(64)(&answer),
        "salted removal not applied: {answer:?}"
    );

    sub.shutdown().await;
    server.kill();
}
