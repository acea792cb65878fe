//! LookupRoute over loopback gRPC at a fixed offered rate (open loop).
//!
//! Starts the real `inference-cache serve` binary as a separate process (so
//! client and server do not share a runtime), loads 8 replicas × 2,000 chains
//! of 64 blocks (16 tokens each, ~0.5M block-replica entries) through
//! ReportCacheState, then sends 64-block chain lookups at `GRPC_BENCH_QPS`
//! (default 20,000) for `GRPC_BENCH_SECS` (default 5) over `GRPC_BENCH_CONNS`
//! HTTP/2 connections (default 4). Latency is measured from the moment each
//! request is sent; how late sends ran against the schedule (tokio timers
//! fire on a 1 ms wheel, so sends go out in small bursts) is reported
//! separately, so a client that fell behind cannot hide queueing. The
//! server's own `lookup_latency_us`, its CPU time per request and the reason
//! codes are reported too. `GRPC_BENCH_SERVER` names another build of the
//! binary to start instead (the image's static one, say), so builds can be
//! compared under the same client.
//!
//! Run: `cargo bench -p inference-cache --bench grpc_lookup`

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use inference_cache_fingerprint::{encode, prefix_hashes};
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn chain(c: u32) -> Vec<Vec<u8>> {
    let group = c / 32;
    let mut tokens: Vec<u32> = (0..256u32).map(|t| group.wrapping_mul(7919) ^ t).collect();
    tokens.extend((0..768u32).map(|t| c.wrapping_mul(104_729).wrapping_add(t) | 0x8000_0000));
    prefix_hashes(&tokens, 16)
        .into_iter()
        .map(|h| encode(h).to_vec())
        .collect()
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i).copied().unwrap_or(0)
}

/// CPU seconds (user + system) `pid` has used, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are the
    // 12th and 13th of them, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')').context("malformed /proc stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / 100.0)
}

/// The server process; killed when dropped.
struct ServerProcess(Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Starts `inference-cache serve` on loopback and waits until it answers.
async fn spawn_server() -> anyhow::Result<(ServerProcess, String)> {
    let grpc = free_port()?;
    let admin = free_port()?;
    let binary = std::env::var_os("GRPC_BENCH_SERVER")
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_inference-cache").into());
    let child = Command::new(binary)
        .args(["serve", "--grpc-addr", &grpc.to_string()])
        .args(["--admin-addr", &admin.to_string()])
        .args(["--max-index-entries", "100000000", "--log-format", "json"])
        .stdout(Stdio::null())
        .spawn()
        .context("starting inference-cache serve")?;
    let process = ServerProcess(child);
    let url = format!("http://{grpc}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while InferenceCacheClient::connect(url.clone()).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "server did not start on {grpc}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((process, url))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    // `cargo bench` passes `--bench`; under `cargo test` run a short smoke pass
    // with the same checks.
    let full = std::env::args().any(|a| a == "--bench");
    let qps = env_or("GRPC_BENCH_QPS", if full { 20_000 } else { 500 });
    let secs = env_or("GRPC_BENCH_SECS", if full { 5 } else { 1 });
    let conns = env_or("GRPC_BENCH_CONNS", 4).max(1) as usize;
    let chains = env_or("GRPC_BENCH_CHAINS", if full { 2_000 } else { 200 }) as u32;
    let holders = 8u32;

    let (server, url) = spawn_server().await?;
    let mut loader = InferenceCacheClient::connect(url.clone()).await?;
    let all: Vec<Vec<Vec<u8>>> = (0..chains).map(chain).collect();
    let mut updates = Vec::new();
    for (c, blocks) in all.iter().enumerate() {
        for k in 0..holders.min(8) {
            // Each chain held by a rotating subset of replicas at different depths.
            let depth = blocks.len() >> (k % 4);
            updates.push(CacheStateUpdate {
                replica_id: format!("replica-{}", (c as u32 + k) % 8),
                model_id: "model".into(),
                tenant_id: "tenant".into(),
                hash_scheme: "vllm".into(),
                prefixes: vec![PrefixEntry {
                    block_hashes: blocks[..depth].to_vec(),
                    block_token_counts: vec![16; depth],
                    ..Default::default()
                }],
                ..Default::default()
            });
        }
    }
    loader
        .report_cache_state(tokio_stream::iter(updates))
        .await?;

    let all = Arc::new(all);
    let mut clients = Vec::new();
    for _ in 0..conns {
        clients.push(InferenceCacheClient::connect(url.clone()).await?);
    }
    let total = qps * secs;
    let interval = Duration::from_nanos(1_000_000_000 / qps.max(1));
    let cpu_before = cpu_seconds(server.0.id())?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(
        Duration,
        Duration,
        Result<(String, i64), String>,
    )>();
    let begin = Instant::now() + Duration::from_millis(50);
    for n in 0..total {
        let scheduled = begin + interval * n as u32;
        tokio::time::sleep_until(scheduled.into()).await;
        let mut client = clients[n as usize % conns].clone();
        let all = Arc::clone(&all);
        let tx = tx.clone();
        let lag = scheduled.elapsed();
        tokio::spawn(async move {
            let blocks = &all[(n as usize * 7919) % all.len()];
            let request = LookupRouteRequest {
                model_id: "model".into(),
                tenant_id: "tenant".into(),
                hash_scheme: "vllm".into(),
                block_token_counts: vec![16; blocks.len()],
                block_hashes: blocks.clone(),
                ..Default::default()
            };
            let sent = Instant::now();
            let answer = client
                .lookup_route(request)
                .await
                .map(|r| {
                    let r = r.into_inner();
                    (r.reason_code, r.lookup_latency_us)
                })
                .map_err(|status| format!("{:?}: {}", status.code(), status.message()));
            let _ = tx.send((sent.elapsed(), lag, answer));
        });
    }
    drop(tx);
    let mut samples = Vec::with_capacity(total as usize);
    let mut lags = Vec::with_capacity(total as usize);
    let mut server_us = Vec::with_capacity(total as usize);
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    while let Some((latency, lag, answer)) = rx.recv().await {
        samples.push(latency.as_nanos() as u64);
        lags.push(lag.as_nanos() as u64);
        let outcome = match answer {
            Ok((reason, us)) => {
                server_us.push(u64::try_from(us).unwrap_or(0));
                reason
            }
            Err(error) => format!("error {}", error.chars().take(100).collect::<String>()),
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    let wall = begin.elapsed().as_secs_f64();
    let server_cpu = cpu_seconds(server.0.id())? - cpu_before;
    for sorted in [&mut samples, &mut lags, &mut server_us] {
        sorted.sort_unstable();
    }
    let us = |ns: u64| ns as f64 / 1e3;
    println!(
        "| offered QPS | achieved QPS | requests | p50 | p99 | p99.9 | max | send lag p50 / p99 | server-side p50 / p99 | server CPU per request |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {qps} | {:.0} | {} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.0} µs / {:.0} µs | {} µs / {} µs | {:.1} µs |",
        samples.len() as f64 / wall,
        samples.len(),
        us(percentile(&samples, 0.5)),
        us(percentile(&samples, 0.99)),
        us(percentile(&samples, 0.999)),
        us(samples.last().copied().unwrap_or(0)),
        us(percentile(&lags, 0.5)),
        us(percentile(&lags, 0.99)),
        percentile(&server_us, 0.5),
        percentile(&server_us, 0.99),
        server_cpu * 1e6 / samples.len().max(1) as f64,
    );
    println!("\noutcomes: {outcomes:?}");
    let hits = outcomes.get("PREFIX_MATCH").copied().unwrap_or(0);
    anyhow::ensure!(
        hits == total,
        "every lookup targets an ingested chain, yet only {hits} of {total} were PREFIX_MATCH"
    );
    Ok(())
}
