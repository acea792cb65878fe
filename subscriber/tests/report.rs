//! Publisher (real ZMQ, byte-exact vLLM frames from Python) → subscriber →
//! a recording gRPC server: what reaches the ReportCacheState stream and
//! PublishEvent, for both vLLM layouts, LoRA, cache salts (vLLM and SGLang
//! layouts), tiers, gaps, malformed frames and an unavailable or restarting
//! server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::*;
use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::{CacheTier, cache_event};
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

async fn stored_chain_is_reported(layout: &str) {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);

    let prompt = tokens(64, 100);
    // Two events: the first two blocks, then a suffix chained from block 2.
    publisher.publish(
        json!([
            stored(&[11, 12], None, &prompt[..32]),
            stored(&[13, 14], Some(12), &prompt[32..]),
        ]),
        layout,
    );
    let want = chain(&prompt);
    assert!(
        eventually(WAIT, || server.received().blocks().len() >= 4).await,
        "blocks never arrived: {:?}",
        server.received()
    );
    let received = server.received();
    let blocks: Vec<Vec<u8>> = received.blocks().into_iter().map(|b| b.2).collect();
    assert_eq!(
        blocks, want,
        "fingerprints equal a gateway's chain of the same tokens"
    );
    for (adapter, tier, _) in received.blocks() {
        assert_eq!(adapter, "");
        assert_eq!(tier, CacheTier::T1 as i32);
    }
    let updates = received.block_updates();
    let update = &updates[0];
    assert_eq!(update.replica_id, "replica-a");
    assert_eq!(update.tenant_id, "team-a");
    assert_eq!(update.model_id, "qwen3");
    assert_eq!(update.hash_scheme, "vllm");
    assert_eq!(
        update.prefixes[0].block_token_counts,
        vec![16; update.prefixes[0].block_hashes.len()]
    );

    // Remove block 14, then clear everything.
    publisher.publish(json!([removed(&[14], "GPU")]), layout);
    assert!(eventually(WAIT, || !server.received().cache_events().is_empty()).await);
    let event = server.received().cache_events()[0].clone();
    assert_eq!(event.r#type, cache_event::Type::PrefixEvicted as i32);
    assert_eq!(event.prefix_hash, want[3]);
    assert_eq!(event.replica_id, "replica-a");
    assert_eq!(event.adapter_id, "");

    publisher.publish(json!([{"type": "AllBlocksCleared"}]), layout);
    assert!(eventually(WAIT, || server.received().cache_events().len() >= 2).await);
    assert_eq!(
        server.received().cache_events()[1].r#type,
        cache_event::Type::AllCleared as i32
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_blocks_stored_total"),
        4.0
    );
    assert_eq!(
        metric(
            &sub,
            "inferencecache_subscriber_events_total{type=\"BlockStored\"}"
        ),
        2.0
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn array_layout_stored_removed_cleared() {
    stored_chain_is_reported("array").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_layout_stored_removed_cleared() {
    stored_chain_is_reported("map").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_unsigned_and_bytes_hashes_link_parents() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(48, 7);
    // Parent given in the signed form of the same 64 bits as the unsigned hash.
    let big: i128 = u64::MAX as i128 - 4; // 0xffff...fffb
    let signed_same_bits: i128 = -5;
    let bytes_parent = json!({"hex": "ab".repeat(32)});
    let mut third = stored(&[0], None, &prompt[32..]);
    third["block_hashes"] = json!([{"hex": "cd".repeat(32)}]);
    third["parent_block_hash"] = bytes_parent.clone();
    let mut second = stored(&[0], Some(signed_same_bits), &prompt[16..32]);
    second["block_hashes"] = json!([bytes_parent]);
    publisher.publish(
        json!([stored(&[big], None, &prompt[..16]), second, third]),
        "array",
    );
    assert!(eventually(WAIT, || server.received().blocks().len() >= 3).await);
    let blocks: Vec<Vec<u8>> = server
        .received()
        .blocks()
        .into_iter()
        .map(|b| b.2)
        .collect();
    assert_eq!(blocks, chain(&prompt));
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
async fn lora_blocks_are_partitioned_and_unmapped_ids_dropped() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(
        &publisher,
        server.addr,
        false,
        &["--lora-adapter-names", "1=sql-lora,2=chat-lora"],
    )
    .await;
    publisher.wait_subscriber(1);
    let prompt = tokens(16, 0);
    let mut mapped = stored(&[1], None, &prompt);
    mapped["lora_id"] = json!(2);
    let mut unmapped = stored(&[2], None, &prompt);
    unmapped["lora_id"] = json!(9);
    let mut named = stored(&[3], None, &prompt);
    named["lora_id"] = json!(9);
    named["lora_name"] = json!("named-lora");
    publisher.publish(json!([mapped, unmapped, named]), "map");
    assert!(eventually(WAIT, || server.received().blocks().len() >= 2).await);
    let adapters: Vec<String> = server
        .received()
        .blocks()
        .into_iter()
        .map(|b| b.0)
        .collect();
    assert_eq!(
        adapters,
        vec!["chat-lora".to_owned(), "named-lora".to_owned()]
    );
    assert_eq!(
        metric(
            &sub,
            "inferencecache_subscriber_blocks_dropped_total{reason=\"unmapped_lora\"}"
        ),
        1.0
    );
    // The eviction is narrowed to the block's adapter.
    publisher.publish(json!([removed(&[1], "GPU")]), "map");
    assert!(eventually(WAIT, || !server.received().cache_events().is_empty()).await);
    assert_eq!(server.received().cache_events()[0].adapter_id, "chat-lora");
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offload_tier_re_reports_evicted_blocks_at_t2() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &["--offload-tier"]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(32, 0);
    publisher.publish(json!([stored(&[1, 2], None, &prompt)]), "array");
    publisher.publish(json!([removed(&[2], "GPU")]), "array");
    assert!(eventually(WAIT, || server.received().blocks().len() >= 3).await);
    let blocks = server.received().blocks();
    let want = chain(&prompt);
    assert_eq!(
        blocks[2],
        (String::new(), CacheTier::T2 as i32, want[1].clone())
    );
    assert!(
        server.received().cache_events().is_empty(),
        "no eviction while T2 holds it"
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_tier2_rereports_total"),
        1.0
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_medium_blocks_are_t2() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(16, 0);
    let mut cpu = stored(&[5], None, &prompt);
    cpu["medium"] = json!("CPU");
    publisher.publish(json!([cpu]), "map");
    assert!(eventually(WAIT, || !server.received().blocks().is_empty()).await);
    assert_eq!(server.received().blocks()[0].1, CacheTier::T2 as i32);
    // Removal from the CPU tier evicts it.
    publisher.publish(json!([removed(&[5], "CPU")]), "map");
    assert!(eventually(WAIT, || !server.received().cache_events().is_empty()).await);
    sub.shutdown().await;
    server.kill().await;
}

async fn gap_is_filled_by_replay(format: &str) {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start(format);
    let sub = subscriber(&publisher, server.addr, true, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(48, 0);
    publisher.publish(json!([stored(&[1], None, &prompt[..16])]), "array");
    // Lost on the wire: only the replay buffer has it.
    publisher.publish_unsent(json!([stored(&[2], Some(1), &prompt[16..32])]), "array");
    publisher.publish(json!([stored(&[3], Some(2), &prompt[32..])]), "array");
    assert!(
        eventually(WAIT, || server.received().blocks().len() >= 3).await,
        "replayed block missing: {:?}",
        server.received()
    );
    let blocks: Vec<Vec<u8>> = server
        .received()
        .blocks()
        .into_iter()
        .map(|b| b.2)
        .collect();
    assert_eq!(
        blocks,
        chain(&prompt),
        "replayed batch applied before the later one"
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_sequence_gaps_total"),
        1.0
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_batches_replayed_total"),
        1.0
    );
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_batches_missed_total"),
        0.0
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_replay_v25_replies() {
    gap_is_filled_by_replay("v25").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_replay_v26_replies() {
    gap_is_filled_by_replay("v26").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_is_counted() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(48, 0);
    publisher.publish(json!([stored(&[1], None, &prompt[..16])]), "array");
    publisher.publish_unsent(json!([stored(&[2], Some(1), &prompt[16..32])]), "array");
    publisher.publish(json!([stored(&[3], Some(2), &prompt[32..])]), "array");
    assert!(
        eventually(WAIT, || {
            metric(&sub, "inferencecache_subscriber_batches_missed_total") == 1.0
        })
        .await
    );
    // Block 3's parent was never seen: dropped, not reported under a wrong key.
    assert!(
        eventually(WAIT, || {
            metric(
                &sub,
                "inferencecache_subscriber_blocks_dropped_total{reason=\"unknown_parent\"}",
            ) == 1.0
        })
        .await
    );
    // Block 1's report may still be on its way when block 3 is dropped.
    assert!(eventually(WAIT, || server.received().blocks().len() == 1).await);
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_are_counted_and_skipped() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let topic = hex(b"kv-events");
    // Wrong frame count, short seq, and garbage msgpack with a valid seq.
    publisher.command(json!({"op": "raw", "frames_hex": [topic]}));
    publisher.command(json!({"op": "raw", "frames_hex": [topic, "0001", "90"]}));
    publisher.command(json!({"op": "raw", "frames_hex": [topic, "0000000000000000", "c1c1"]}));
    // A good batch still gets through (its seq 0 follows the garbage's seq 0:
    // seen as an engine restart, which is harmless here).
    publisher.publish(json!([stored(&[1], None, &tokens(16, 0))]), "array");
    assert!(eventually(WAIT, || !server.received().blocks().is_empty()).await);
    assert_eq!(
        metric(&sub, "inferencecache_subscriber_frames_malformed_total"),
        3.0
    );
    sub.shutdown().await;
    server.kill().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_unavailable_then_back_gets_the_state() {
    let addr = free_port();
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(32, 0);
    publisher.publish(json!([stored(&[1, 2], None, &prompt)]), "array");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(metric(&sub, "inferencecache_subscriber_server_errors_total") >= 1.0);
    let server = RecordingServer::start(addr).await;
    assert!(
        eventually(Duration::from_secs(15), || server.received().blocks().len()
            >= 2)
        .await,
        "state never delivered after the server came up"
    );
    let blocks: Vec<Vec<u8>> = server
        .received()
        .blocks()
        .into_iter()
        .map(|b| b.2)
        .collect();
    assert_eq!(blocks, chain(&prompt));
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_mid_stream_resends_everything() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let addr = server.addr;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let first = tokens(32, 0);
    publisher.publish(json!([stored(&[1, 2], None, &first)]), "array");
    assert!(eventually(WAIT, || server.received().blocks().len() >= 2).await);
    server.kill().await;

    let second = tokens(32, 1000);
    publisher.publish(json!([stored(&[3, 4], None, &second)]), "array");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let restarted = RecordingServer::start(addr).await;
    assert!(
        eventually(Duration::from_secs(15), || restarted
            .received()
            .blocks()
            .len()
            >= 4)
        .await,
        "restarted server did not get the state: {:?}",
        restarted.received()
    );
    let mut got: Vec<Vec<u8>> = restarted
        .received()
        .blocks()
        .into_iter()
        .map(|b| b.2)
        .collect();
    got.sort();
    got.dedup();
    let mut want = chain(&first);
    want.extend(chain(&second));
    want.sort();
    assert_eq!(got, want);
    assert!(metric(&sub, "inferencecache_subscriber_resyncs_total") >= 1.0);
    // A resync starts by clearing what the replica had before.
    assert_eq!(
        restarted
            .received()
            .cache_events()
            .first()
            .map(|e| e.r#type),
        Some(cache_event::Type::AllCleared as i32)
    );
    sub.shutdown().await;
    restarted.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_serves_prometheus_text() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    let addr = sub.metrics_addr().expect("metrics enabled");
    let page = crate::http::get(addr, "/metrics").await.expect("scrape");
    assert_eq!(page.status, 200, "{page:?}");
    let body = page.body;
    assert!(body.contains("inferencecache_subscriber_frames_total"));
    assert!(body.contains("inferencecache_subscriber_buffer_dropped_total"));
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_blocks_are_refreshed_with_a_liveness_event() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(
        &publisher,
        server.addr,
        false,
        &["--refresh-interval", "1s", "--heartbeat-interval", "0s"],
    )
    .await;
    publisher.wait_subscriber(1);
    let prompt = tokens(32, 0);
    publisher.publish(json!([stored(&[1, 2], None, &prompt)]), "array");
    publisher.publish(json!([removed(&[2], "GPU")]), "array");
    assert!(
        eventually(WAIT, || {
            server
                .received()
                .events
                .iter()
                .any(|e| e.r#type == cache_event::Type::ReplicaUpdated as i32)
        })
        .await,
        "no liveness event: {:?}",
        server.received()
    );
    // Blocks: the two stores, then the refresh of the one still held.
    assert!(eventually(WAIT, || server.received().blocks().len() >= 3).await);
    let blocks = server.received().blocks();
    assert_eq!(blocks[2].2, chain(&prompt)[0]);
    assert!(metric(&sub, "inferencecache_subscriber_refreshes_total") >= 1.0);
    sub.shutdown().await;
    server.kill().await;
}

/// Salted requests from both engines' wire layouts: every block is reported,
/// and evicted, under `partition_key(adapter, salt)`; unsalted blocks stay in
/// the bare adapter partition.
async fn salted_blocks_are_reported_under_their_partition(layout: &str) {
    use inference_cache_fingerprint::partition_key;
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(&publisher, server.addr, false, &[]).await;
    publisher.wait_subscriber(1);
    let prompt = tokens(48, 500);
    let want = chain(&prompt);

    // vLLM: the salt is in block 0's extra_keys, after a multimodal pair;
    // the child event names no salt and inherits it through its parent.
    let mut first = stored(&[1, 2], None, &prompt[..32]);
    first["vllm_extra_keys"] = json!([[["img-1", 3], "tenant-a", {"hex": "0707"}], null]);
    let mut child = stored(&[3], Some(2), &prompt[32..]);
    child["vllm_extra_keys"] = json!([null]);
    // The same tokens unsalted, under other engine hashes.
    let plain = stored(&[4, 5, 6], None, &prompt);
    // SGLang: a salt on every event (0.5.18-0.5.19 array + map, 0.5.20+ key).
    let mut sglang = stored(&[7], None, &prompt[..16]);
    sglang["sglang_cache_salt"] = json!("tenant-b");
    let mut sglang_child = stored(&[8], Some(7), &prompt[16..32]);
    sglang_child["sglang_cache_salt"] = json!("tenant-b");
    publisher.publish(json!([first, child, plain, sglang, sglang_child]), layout);
    assert!(
        eventually(WAIT, || server.received().blocks().len() >= 8).await,
        "blocks never arrived: {:?}",
        server.received()
    );
    let tenant_a = partition_key("", "tenant-a").into_owned();
    let tenant_b = partition_key("", "tenant-b").into_owned();
    let blocks: Vec<(String, Vec<u8>)> = server
        .received()
        .blocks()
        .into_iter()
        .map(|(adapter, _, hash)| (adapter, hash))
        .collect();
    assert_eq!(
        blocks,
        vec![
            (tenant_a.clone(), want[0].clone()),
            (tenant_a.clone(), want[1].clone()),
            (tenant_a.clone(), want[2].clone()),
            (String::new(), want[0].clone()),
            (String::new(), want[1].clone()),
            (String::new(), want[2].clone()),
            (tenant_b.clone(), want[0].clone()),
            (tenant_b.clone(), want[1].clone()),
        ]
    );
    assert_eq!(
        metric(
            &sub,
            "inferencecache_subscriber_events_total{type=\"BlockStored\"}"
        ),
        5.0,
        "no salted event is skipped"
    );

    // Removals carry the partition key of the removed block.
    publisher.publish(json!([removed(&[3, 6, 8], "GPU")]), layout);
    assert!(eventually(WAIT, || server.received().cache_events().len() >= 3).await);
    let mut evicted: Vec<(String, Vec<u8>)> = server
        .received()
        .cache_events()
        .into_iter()
        .map(|e| {
            assert_eq!(e.r#type, cache_event::Type::PrefixEvicted as i32);
            (e.adapter_id, e.prefix_hash)
        })
        .collect();
    // One PublishEvent per block: their arrival order is not part of the contract.
    evicted.sort();
    let mut expected = vec![
        (tenant_a, want[2].clone()),
        (String::new(), want[2].clone()),
        (tenant_b, want[1].clone()),
    ];
    expected.sort();
    assert_eq!(evicted, expected);
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_blocks_array_layout() {
    salted_blocks_are_reported_under_their_partition("array").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_blocks_map_layout() {
    salted_blocks_are_reported_under_their_partition("map").await;
}
