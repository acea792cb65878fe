//! Filter overhead: latency added by the wasm filter, Envoy with it vs the same
//! Envoy bootstrap without it, measured in the same run.
//!
//! Run (prints a table; ignored by default because it takes ~30 s):
//!
//! ```text
//! scripts/setup-envoy.sh
//! cargo test -p inference-cache-tests --test envoy_overhead -- --ignored --nocapture
//! ```
//!
//! Set-up: the real server on loopback with three replicas ingested, three
//! loopback backends, and two Envoys started from `envoy/envoy.yaml` — one
//! with the filter, one with the filter removed. One keep-alive HTTP/1.1
//! connection per Envoy sends `/v1/completions` with a 256-token prompt
//! (16 blocks; the filter fingerprints it and calls LookupRoute). Requests
//! alternate between the two Envoys in batches so drift hits both equally;
//! `OVERHEAD_REQUESTS` (default 4000, at least 2000) requests per Envoy.

#[path = "../src/proxy_wasm_host.rs"]
mod proxy_wasm_host;
#[path = "../src/proxy_wasm_host_envoy.rs"]
mod proxy_wasm_host_envoy;

use std::time::{Duration, Instant};

use anyhow::ensure;
use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use inference_cache_tests::TestServer;
use proxy_wasm_host_envoy::{Backend, Envoy, EnvoySetup, HttpClient, REPLICAS, tokens_body};

const MODEL: &str = "e2e-model";
const BATCH: usize = 100;

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn filter_overhead() -> anyhow::Result<()> {
    let requests: usize = std::env::var("OVERHEAD_REQUESTS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(4000)
        .max(2000);
    let server = TestServer::start().await?;
    let mut backends = Vec::new();
    for name in REPLICAS {
        backends.push(Backend::start(name).await?);
    }
    let prompt: Vec<u32> = (0..256).collect();
    let mut grpc = server.client().await?;
    for (index, replica) in REPLICAS.iter().enumerate() {
        // Replica b holds the prompt's prefix; the others hold other prefixes.
        let tokens: Vec<u32> = if index == 1 {
            prompt[..192].to_vec()
        } else {
            (50_000 * (index as u32 + 1)..50_000 * (index as u32 + 1) + 192).collect()
        };
        let chain = request_chain(&tokens, 16);
        grpc.report_cache_state(tokio_stream::iter(vec![CacheStateUpdate {
            replica_id: (*replica).into(),
            model_id: MODEL.into(),
            tenant_id: "default".into(),
            hash_scheme: "vllm".into(),
            prefixes: vec![PrefixEntry {
                block_hashes: chain
                    .block_hashes
                    .iter()
                    .map(|hash| hash.to_vec())
                    .collect(),
                block_token_counts: chain.block_token_counts,
                ..PrefixEntry::default()
            }],
            ..CacheStateUpdate::default()
        }]))
        .await?;
    }
    let addrs = [backends[0].addr, backends[1].addr, backends[2].addr];
    let setup = |with_filter| EnvoySetup {
        grpc: server.grpc_addr(),
        backends: addrs,
        timeout_ms: 20,
        with_filter,
    };
    let with = Envoy::start(&setup(true)).await?;
    let without = Envoy::start(&setup(false)).await?;
    let mut client_with = HttpClient::connect(with.addr).await?;
    let mut client_without = HttpClient::connect(without.addr).await?;
    let body = tokens_body(MODEL, &prompt);

    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..200 {
        client_with
            .post("/v1/completions", &[], body.clone())
            .await?;
        client_without
            .post("/v1/completions", &[], body.clone())
            .await?;
    }
    let mut with_times = Vec::with_capacity(requests);
    let mut without_times = Vec::with_capacity(requests);
    while with_times.len() < requests {
        for _ in 0..BATCH {
            let started = Instant::now();
            let response = client_with
                .post("/v1/completions", &[], body.clone())
                .await?;
            with_times.push(started.elapsed());
            ensure!(response.status == 200, "status {}", response.status);
            let reason = response
                .header("x-inferencecache-reason")
                .unwrap_or("-")
                .to_owned();
            *reasons.entry(reason).or_default() += 1;
        }
        for _ in 0..BATCH {
            let started = Instant::now();
            let response = client_without
                .post("/v1/completions", &[], body.clone())
                .await?;
            without_times.push(started.elapsed());
            ensure!(response.status == 200, "status {}", response.status);
        }
    }
    with_times.sort();
    without_times.sort();
    let row = |label: &str, times: &[Duration]| {
        println!(
            "| {label} | {} | {:.0} | {:.0} | {:.0} |",
            times.len(),
            micros(percentile(times, 0.5)),
            micros(percentile(times, 0.99)),
            micros(percentile(times, 0.999)),
        );
    };
    println!("| Envoy | requests | p50 µs | p99 µs | p99.9 µs |");
    println!("|---|---|---|---|---|");
    row("without filter", &without_times);
    row("with filter", &with_times);
    println!(
        "| added by the filter | | {:.0} | {:.0} | {:.0} |",
        micros(percentile(&with_times, 0.5)) - micros(percentile(&without_times, 0.5)),
        micros(percentile(&with_times, 0.99)) - micros(percentile(&without_times, 0.99)),
        micros(percentile(&with_times, 0.999)) - micros(percentile(&without_times, 0.999)),
    );
    println!("reasons (with filter): {reasons:?}");
    Ok(())
}
