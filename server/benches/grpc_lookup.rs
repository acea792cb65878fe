//! LookupRoute over loopback gRPC at a fixed offered rate (open loop).
//!
//! Starts the server in-process on port 0, loads 8 replicas × 2,000 chains of
//! 64 blocks (16 tokens each, ~1M block-replica entries) through
//! ReportCacheState, then sends 64-block chain lookups at `GRPC_BENCH_QPS`
//! (default 20,000) for `GRPC_BENCH_SECS` (default 5) over `GRPC_BENCH_CONNS`
//! HTTP/2 connections (default 4). Latency is measured from each request's
//! scheduled send time, so a stalled server cannot hide queueing delay.
//!
//! Run: `cargo bench -p inference-cache-server --bench grpc_lookup`

use std::sync::Arc;
use std::time::{Duration, Instant};

use inference_cache_fingerprint::{encode, prefix_hashes};
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};
use inference_cache_server::{ServeConfig, start};

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
    sorted[i.min(sorted.len().saturating_sub(1))]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return Ok(());
    }
    let qps = env_or("GRPC_BENCH_QPS", 20_000);
    let secs = env_or("GRPC_BENCH_SECS", 5);
    let conns = env_or("GRPC_BENCH_CONNS", 4).max(1) as usize;
    let chains = env_or("GRPC_BENCH_CHAINS", 2_000) as u32;
    let holders = 8u32;

    let mut config = ServeConfig::ephemeral();
    config.index.max_index_entries = u64::MAX;
    let server = start(config).await?;
    let url = format!("http://{}", server.grpc_addr);
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
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, bool)>();
    let begin = Instant::now() + Duration::from_millis(50);
    for n in 0..total {
        let scheduled = begin + interval * n as u32;
        tokio::time::sleep_until(scheduled.into()).await;
        let mut client = clients[n as usize % conns].clone();
        let all = Arc::clone(&all);
        let tx = tx.clone();
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
            let ok = client
                .lookup_route(request)
                .await
                .map(|r| r.into_inner().reason_code == "PREFIX_MATCH")
                .unwrap_or(false);
            let _ = tx.send((scheduled.elapsed().as_nanos() as u64, ok));
        });
    }
    drop(tx);
    let mut samples = Vec::with_capacity(total as usize);
    let mut hits = 0u64;
    while let Some((ns, ok)) = rx.recv().await {
        samples.push(ns);
        hits += u64::from(ok);
    }
    let wall = begin.elapsed().as_secs_f64();
    samples.sort_unstable();
    println!("| offered QPS | achieved QPS | requests | PREFIX_MATCH | p50 | p99 | p99.9 | max |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {qps} | {:.0} | {} | {} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs |",
        samples.len() as f64 / wall,
        samples.len(),
        hits,
        percentile(&samples, 0.5) as f64 / 1e3,
        percentile(&samples, 0.99) as f64 / 1e3,
        percentile(&samples, 0.999) as f64 / 1e3,
        samples.last().copied().unwrap_or(0) as f64 / 1e3,
    );
    server.shutdown().await?;
    Ok(())
}
