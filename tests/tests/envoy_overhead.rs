//! Filter overhead: latency added by the wasm filter, Envoy with it vs the same
//! Envoy bootstrap without it, measured in the same run.
//!
//! Run (prints a table; ignored by default because it takes ~1 min). Build
//! with `--release`: in the test profile the workspace's own crates, the
//! in-process server included, are compiled without optimisation.
//!
//! ```text
//! scripts/setup-envoy.sh
//! OVERHEAD_REQUESTS=3000 cargo test --release -p inference-cache-tests --test envoy envoy_overhead:: -- --ignored --nocapture
//! ```
//!
//! Set-up: the real server on loopback with three replicas ingested, three
//! loopback backends, and two Envoys started from `envoy/envoy.yaml` — one
//! with the filter, one with the filter removed. One keep-alive HTTP/1.1
//! connection per series sends a POST with the same ~1.2 KB body, a
//! 256-token `/v1/completions` prompt (16 blocks). The series split the
//! filter's cost into its parts:
//!
//! - `without filter`: the baseline (round-robin cluster);
//! - `without filter, routed by header`: the client sets the destination
//!   header itself (this Envoy also lacks the edge removal of that header),
//!   so the pool's override_host policy picks the host a routed request
//!   goes to, without a lookup;
//! - `filter, other path`: the filter in the chain, request not inspected
//!   (`/v1/embeddings`);
//! - `filter, parsed, no lookup`: body buffered and parsed, no gRPC call
//!   (the body names no model: MISSING_MODEL);
//! - `filter, lookup`: the full path — fingerprint, LookupRoute through
//!   Envoy, destination header (PREFIX_MATCH to the holder).
//!
//! A last row times the same LookupRoute sent by the test's own gRPC
//! client straight to the server: the floor of the lookup's round trip.
//! Requests rotate between the series in batches so drift hits all equally;
//! `OVERHEAD_REQUESTS` (default 4000, at least 2000) requests per series.

use crate::proxy_wasm_host_envoy;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::ensure;
use inference_cache_proto::v1alpha1::LookupRouteRequest;
use inference_cache_tests::{Holder, TestServer, contract_ranker_config, hold_tokens, wire_chain};
use proxy_wasm_host_envoy::{Backend, Envoy, EnvoySetup, HttpClient, REPLICAS, tokens_body};

const MODEL: &str = "e2e-model";
const TENANT: &str = "default";
const BATCH: usize = 100;
const REASON: &str = "x-inferencecache-reason";
const DESTINATION: &str = "x-gateway-destination-endpoint";

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// `/proc/loadavg`'s three averages, for the record.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".to_owned())
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

/// One series of timed requests over its own connection.
struct Series {
    label: &'static str,
    client: HttpClient,
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: String,
    /// The reason header its responses should carry (`None`: no header).
    reason: Option<&'static str>,
    times: Vec<Duration>,
    /// Timed responses whose reason header was not `reason`, by header value.
    unexpected: BTreeMap<String, usize>,
}

impl Series {
    fn new(label: &'static str, client: HttpClient, path: &'static str, body: &str) -> Self {
        Self {
            label,
            client,
            path,
            headers: Vec::new(),
            body: body.to_owned(),
            reason: None,
            times: Vec::new(),
            unexpected: BTreeMap::new(),
        }
    }

    fn expecting(mut self, reason: &'static str) -> Self {
        self.reason = Some(reason);
        self
    }

    fn with_header(mut self, name: &'static str, value: String) -> Self {
        self.headers.push((name, value));
        self
    }

    /// One request: its latency, counting a reason header other than the expected one.
    async fn send(&mut self, timed: bool) -> anyhow::Result<()> {
        let started = Instant::now();
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect();
        let response = self
            .client
            .post(self.path, &headers, self.body.clone())
            .await?;
        let elapsed = started.elapsed();
        ensure!(
            response.status == 200,
            "{}: status {}",
            self.label,
            response.status
        );
        if !timed {
            return Ok(());
        }
        self.times.push(elapsed);
        let reason = response.header(REASON);
        if reason != self.reason {
            let seen = reason.unwrap_or("(none)").to_owned();
            *self.unexpected.entry(seen).or_default() += 1;
        }
        Ok(())
    }
}

async fn ingest(server: &TestServer, prompt: &[u32]) -> anyhow::Result<()> {
    let mut grpc = server.client().await?;
    for (index, replica) in REPLICAS.iter().enumerate() {
        // Replica b holds the prompt's prefix; the others hold other prefixes.
        let tokens: Vec<u32> = if index == 1 {
            prompt[..192].to_vec()
        } else {
            (50_000 * (index as u32 + 1)..50_000 * (index as u32 + 1) + 192).collect()
        };
        let holder = Holder {
            replica,
            tenant: TENANT,
            model: MODEL,
            adapter: "",
        };
        hold_tokens(&mut grpc, holder, &tokens).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn filter_overhead() -> anyhow::Result<()> {
    println!("load average at start: {}", load_average());
    let requests: usize = std::env::var("OVERHEAD_REQUESTS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(4000)
        .max(2000);
    // The contract's ranker: every timed lookup names the holder, as the
    // series expect (the cost-aware default spreads a repeated prompt).
    let policy = tempfile::tempdir()?;
    let server = TestServer::start_with(contract_ranker_config(policy.path())?).await?;
    let mut backends = Vec::new();
    for name in REPLICAS {
        backends.push(Backend::start(name).await?);
    }
    let prompt: Vec<u32> = (0..256).collect();
    ingest(&server, &prompt).await?;
    let addrs = [backends[0].addr, backends[1].addr, backends[2].addr];
    let setup = |with_filter| EnvoySetup {
        grpc: server.grpc_addr(),
        backends: addrs,
        timeout_ms: 20,
        with_filter,
        expose_reason: true,
        route_tenant: None,
        server_tls: None,
    };
    let with = Envoy::start(&setup(true)).await?;
    let without = Envoy::start(&setup(false)).await?;
    let body = tokens_body(MODEL, &prompt);
    // Same length as `body`; the filter parses it all, then finds no model.
    let no_model = body.replacen("\"model\"", "\"mode1\"", 1);
    let mut series = vec![
        Series::new(
            "without filter",
            HttpClient::connect(without.addr).await?,
            "/v1/completions",
            &body,
        ),
        Series::new(
            "without filter, routed by header",
            HttpClient::connect(without.addr).await?,
            "/v1/completions",
            &body,
        )
        .with_header(DESTINATION, backends[1].addr.to_string()),
        Series::new(
            "filter, other path",
            HttpClient::connect(with.addr).await?,
            "/v1/embeddings",
            &body,
        ),
        Series::new(
            "filter, parsed, no lookup",
            HttpClient::connect(with.addr).await?,
            "/v1/completions",
            &no_model,
        )
        .expecting("MISSING_MODEL"),
        Series::new(
            "filter, lookup",
            HttpClient::connect(with.addr).await?,
            "/v1/completions",
            &body,
        )
        .expecting("PREFIX_MATCH"),
    ];
    let (block_hashes, block_token_counts) = wire_chain(&prompt);
    let lookup = LookupRouteRequest {
        model_id: MODEL.into(),
        tenant_id: TENANT.into(),
        hash_scheme: "vllm".into(),
        block_hashes,
        block_token_counts,
        ..LookupRouteRequest::default()
    };
    let mut grpc = server.client().await?;
    let mut grpc_times = Vec::with_capacity(requests);
    let mut grpc_reasons = BTreeMap::<String, usize>::new();

    for _ in 0..200 {
        for one in &mut series {
            one.send(false).await?;
        }
        grpc.lookup_route(lookup.clone()).await?;
    }
    while grpc_times.len() < requests {
        for one in &mut series {
            for _ in 0..BATCH {
                one.send(true).await?;
            }
        }
        for _ in 0..BATCH {
            let started = Instant::now();
            let response = grpc.lookup_route(lookup.clone()).await?.into_inner();
            grpc_times.push(started.elapsed());
            *grpc_reasons.entry(response.reason_code).or_default() += 1;
        }
    }
    grpc_times.sort();
    for one in &mut series {
        one.times.sort();
    }
    let at = |times: &[Duration], fraction| micros(percentile(times, fraction));
    println!("| series | requests | p50 µs | p99 µs | p99.9 µs |");
    println!("|---|---:|---:|---:|---:|");
    for one in &series {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} |",
            one.label,
            one.times.len(),
            at(&one.times, 0.5),
            at(&one.times, 0.99),
            at(&one.times, 0.999),
        );
    }
    let baseline = &series[0].times;
    for one in &series[1..] {
        println!(
            "| added: {} | | {:+.0} | {:+.0} | {:+.0} |",
            one.label,
            at(&one.times, 0.5) - at(baseline, 0.5),
            at(&one.times, 0.99) - at(baseline, 0.99),
            at(&one.times, 0.999) - at(baseline, 0.999),
        );
    }
    println!(
        "| direct gRPC LookupRoute (no Envoy) | {} | {:.0} | {:.0} | {:.0} |",
        grpc_times.len(),
        at(&grpc_times, 0.5),
        at(&grpc_times, 0.99),
        at(&grpc_times, 0.999),
    );
    println!("load average at end: {}", load_average());
    for one in &series {
        if !one.unexpected.is_empty() {
            println!(
                "{}: {:?} of {} responses did not report {:?}",
                one.label,
                one.unexpected,
                one.times.len(),
                one.reason.unwrap_or("(none)")
            );
        }
    }
    println!("direct LookupRoute reasons: {grpc_reasons:?}");
    for one in &series {
        let off: usize = one.unexpected.values().sum();
        ensure!(
            off * 100 <= one.times.len(),
            "{}: over 1% of responses took another path, so the series does not measure it",
            one.label
        );
    }
    ensure!(
        grpc_reasons.keys().all(|reason| reason == "PREFIX_MATCH"),
        "the direct lookups must match the filter's: {grpc_reasons:?}"
    );
    Ok(())
}
