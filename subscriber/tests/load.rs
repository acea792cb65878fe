//! Engine load: the scrape parser against vLLM (v0.6 names, current names
//! with two data-parallel engines) and SGLang exposition pages, and the
//! stats a real HTTP scrape sends to a recording gRPC server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::*;
use inference_cache_subscriber::{EngineReading, LoadEstimator, parse_exposition};

const WAIT: Duration = Duration::from_secs(10);

fn close(a: f32, b: f64) -> bool {
    (f64::from(a) - b).abs() < 1e-5
}

#[test]
fn vllm_v0_6_page() {
    let page = fixture("vllm_v0_6_metrics.txt");
    let exposition = parse_exposition(&page);
    assert_eq!(exposition.malformed_lines, 0);
    let reading = EngineReading::from_samples(&exposition.samples);
    assert_eq!(reading.requests_waiting, Some(5.0));
    assert_eq!(reading.requests_running, Some(12.0));
    assert_eq!(reading.kv_cache_usage, Some(0.4375), "gpu_cache_usage_perc");
    assert_eq!(reading.prefix_counters, None);
    assert!(reading.rejected.is_empty(), "{:?}", reading.rejected);
    let load = LoadEstimator::new().next(&reading).expect("load");
    assert_eq!(load.requests_waiting, 5);
    assert_eq!(load.requests_running, 12);
    assert!(close(load.kv_cache_usage, 0.4375));
    assert!(close(load.hit_rate, 0.6180339887), "v0 hit-rate gauge");
    assert!(close(load.pressure, 0.4375), "usage dominates 5/18");
    assert_eq!((load.t2_hit_tokens, load.t2_query_tokens), (0, 0));
}

#[test]
fn vllm_current_page_with_two_engines() {
    let page = fixture("vllm_v1_dp2_metrics.txt");
    let exposition = parse_exposition(&page);
    assert_eq!(exposition.malformed_lines, 0);
    let lora = exposition
        .samples
        .iter()
        .find(|s| s.name == "vllm:lora_requests_info")
        .expect("lora info");
    assert_eq!(
        lora.label("running_lora_adapters"),
        Some("sql-lora,chat \"v2\" lora")
    );
    let reading = EngineReading::from_samples(&exposition.samples);
    assert_eq!(reading.requests_waiting, Some(4.0), "3 + 1");
    assert_eq!(reading.requests_running, Some(16.0), "7 + 9");
    assert_eq!(
        reading.kv_cache_usage,
        Some(0.6),
        "mean over engines; the deprecated twin is not added"
    );
    assert_eq!(reading.prefix_counters, Some((2500.0, 10000.0)));
    assert_eq!(reading.t2_counters, Some((1536.0, 7500.0)));
    let mut estimator = LoadEstimator::new();
    let load = estimator.next(&reading).expect("load");
    assert_eq!(load.requests_waiting, 4);
    assert_eq!(load.requests_running, 16);
    assert!(
        close(load.hit_rate, 0.25),
        "lifetime ratio on the first scrape"
    );
    assert!(close(load.pressure, 0.6));
    assert_eq!((load.t2_hit_tokens, load.t2_query_tokens), (1536, 7500));

    // The next scrape: 1,000 more queried tokens, 800 of them hits.
    let next = page
        .replace(
            "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 1000.0",
            "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 1800.0",
        )
        .replace(
            "vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 4000.0",
            "vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 5000.0",
        );
    let load = estimator
        .next(&EngineReading::from_text(&next))
        .expect("load");
    assert!(close(load.hit_rate, 0.8), "delta between scrapes: {load:?}");
}

#[test]
fn sglang_page() {
    let page = fixture("sglang_metrics.txt");
    let exposition = parse_exposition(&page);
    assert_eq!(exposition.malformed_lines, 0);
    let load = LoadEstimator::new()
        .next(&EngineReading::from_samples(&exposition.samples))
        .expect("load");
    assert_eq!(load.requests_waiting, 40);
    assert_eq!(load.requests_running, 24);
    assert!(close(load.kv_cache_usage, 0.82));
    assert!(close(load.hit_rate, 0.375));
    assert!(close(load.pressure, 0.82));
}

#[test]
fn nan_and_negative_values_are_rejected_and_counted() {
    let page = "vllm:num_requests_waiting{engine=\"0\"} NaN\n\
                vllm:num_requests_waiting{engine=\"1\"} 2\n\
                vllm:num_requests_running{engine=\"0\"} -3\n\
                vllm:kv_cache_usage_perc{engine=\"0\"} +Inf\n\
                vllm:kv_cache_usage_perc{engine=\"1\"} 2.5e-1\n";
    let reading = EngineReading::from_text(page);
    assert_eq!(reading.requests_waiting, Some(2.0));
    assert_eq!(reading.requests_running, None);
    assert_eq!(reading.kv_cache_usage, Some(0.25));
    let total: u32 = reading.rejected.iter().map(|(_, n)| n).sum();
    assert_eq!(total, 3);
    let load = LoadEstimator::new().next(&reading).expect("load");
    assert_eq!(load.requests_running, 0);
    assert!(close(load.pressure, 2.0 / 3.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_load_reaches_the_server() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let page = MetricsPage::start(&fixture("vllm_v1_dp2_metrics.txt"));
    let sub = subscriber_with(
        &format!("http://{}", server.addr),
        &[
            "--engine-metrics-url",
            &page.url(),
            "--metrics-interval",
            "200ms",
        ],
    )
    .await;
    assert!(
        eventually(WAIT, || !server.received().stats().is_empty()).await,
        "no stats arrived: {:?}",
        server.received()
    );
    let stats = server.received().stats()[0].clone();
    assert_eq!(stats.replica_id, "replica-a");
    assert_eq!(stats.requests_waiting, 4);
    assert_eq!(stats.requests_running, 16);
    assert!(close(stats.kv_cache_usage, 0.6));
    assert!(close(stats.pressure, 0.6));
    assert_eq!(stats.t2_hit_tokens, 1536);
    // Stats-only updates name the replica's scope.
    let update = server
        .received()
        .updates
        .into_iter()
        .find(|u| u.stats.is_some())
        .expect("update");
    assert!(update.prefixes.is_empty());
    assert_eq!(update.tenant_id, "team-a");
    assert_eq!(update.model_id, "qwen3");
    assert_eq!(update.hash_scheme, "vllm");

    // New load is picked up.
    page.set(&fixture("sglang_metrics.txt"));
    assert!(
        eventually(WAIT, || server
            .received()
            .stats()
            .last()
            .is_some_and(|s| s.requests_waiting == 40))
        .await
    );

    // A failing scrape is counted and sends nothing.
    page.fail_with(503);
    assert!(
        eventually(WAIT, || metric(
            &sub,
            "inferencecache_subscriber_engine_scrapes_total{result=\"failed\"}"
        ) >= 2.0)
        .await
    );
    let sent = server.received().stats().len();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        server.received().stats().len(),
        sent,
        "no stats while failing"
    );
    assert!(
        metric(
            &sub,
            "inferencecache_subscriber_engine_scrapes_total{result=\"ok\"}"
        ) >= 2.0
    );
    assert!(metric(&sub, "inferencecache_subscriber_stats_sent_total") >= 2.0);

    // A page of the wrong kind is a failed scrape too.
    page.set("process_cpu_seconds_total 1\n");
    let failed = metric(
        &sub,
        "inferencecache_subscriber_engine_scrapes_total{result=\"failed\"}",
    );
    assert!(
        eventually(WAIT, || metric(
            &sub,
            "inferencecache_subscriber_engine_scrapes_total{result=\"failed\"}"
        ) > failed)
        .await
    );
    assert_eq!(server.received().stats().len(), sent);
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_values_are_counted_per_field() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let page = MetricsPage::start(
        "vllm:num_requests_waiting NaN\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc -0.5\n",
    );
    let sub = subscriber_with(
        &format!("http://{}", server.addr),
        &[
            "--engine-metrics-url",
            &page.url(),
            "--metrics-interval",
            "200ms",
        ],
    )
    .await;
    assert!(eventually(WAIT, || !server.received().stats().is_empty()).await);
    let stats = server.received().stats()[0].clone();
    assert_eq!(stats.requests_waiting, 0);
    assert_eq!(stats.requests_running, 2);
    assert_eq!(stats.kv_cache_usage, 0.0);
    assert!(!stats.pressure.is_nan());
    assert!(
        metric(
            &sub,
            "inferencecache_subscriber_engine_values_rejected_total{field=\"requests_waiting\"}"
        ) >= 1.0
    );
    assert!(
        metric(
            &sub,
            "inferencecache_subscriber_engine_values_rejected_total{field=\"kv_cache_usage\"}"
        ) >= 1.0
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_announcement_carries_fresh_stats() {
    let page = MetricsPage::start(&fixture("sglang_metrics.txt"));
    // The server comes up after the first scrapes: the announcement made on
    // connect carries the load already known.
    let addr = free_port();
    let sub = subscriber_with(
        &format!("http://{addr}"),
        &[
            "--engine-metrics-url",
            &page.url(),
            "--metrics-interval",
            "200ms",
        ],
    )
    .await;
    assert!(
        eventually(WAIT, || metric(
            &sub,
            "inferencecache_subscriber_engine_scrapes_total{result=\"ok\"}"
        ) >= 1.0)
        .await
    );
    let server = RecordingServer::start(addr).await;
    assert!(
        eventually(Duration::from_secs(15), || !server
            .received()
            .updates
            .is_empty())
        .await
    );
    let first = server.received().updates[0].clone();
    assert!(first.prefixes.is_empty());
    assert_eq!(first.stats.map(|s| s.requests_waiting), Some(40));
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_block_size_mismatch_is_reported_and_fails_readiness() {
    let server = RecordingServer::start("127.0.0.1:0".parse().unwrap()).await;
    let page = MetricsPage::start(&fixture("vllm_v0_6_metrics.txt"));
    // Like `subscriber_with`, but with the `/metrics` listener on.
    let argv = [
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
        "127.0.0.1:0",
        "--engine-metrics-url",
        &page.url(),
        "--metrics-interval",
        "200ms",
    ];
    let args = inference_cache_subscriber::SubscribeArgs::try_parse_from(argv).unwrap();
    let sub = inference_cache_subscriber::Subscriber::start(args.resolve().unwrap())
        .await
        .unwrap();
    let addr = sub.metrics_addr().expect("metrics listener");
    let ok = "inferencecache_subscriber_engine_scrapes_total{result=\"ok\"}";
    assert!(eventually(WAIT, || metric(&sub, ok) >= 1.0).await);
    let mismatch = "inferencecache_subscriber_config_mismatch{field=\"block_size\"}";
    assert_eq!(metric(&sub, mismatch), 0.0);
    let ready = crate::http::get(addr, "/readyz").await.expect("readyz");
    assert_eq!(ready.status, 200, "{ready:?}");

    page.set(
        "vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",prefix_caching_hash_algo=\"sha256\"} 1.0\nvllm:num_requests_running 1\n",
    );
    assert!(eventually(WAIT, || metric(&sub, mismatch) == 1.0).await);
    let ready = crate::http::get(addr, "/readyz").await.expect("readyz");
    assert_eq!(ready.status, 503);
    assert!(ready.body.contains("block_size is 32"), "{ready:?}");
    sub.shutdown().await;
    server.kill().await;
}
