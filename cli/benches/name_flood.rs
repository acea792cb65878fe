//! A flood of names against the release server: how much memory distinct
//! tenant / model / replica names take, and whether it comes back once they
//! are cleared.
//!
//! Starts `inference-cache serve` (the binary of this build) with a one-second
//! sweep, reads its resident size (`VmRSS`) after start-up, then reports
//! `NAME_FLOOD_NAMES` (default 100,000) updates, each from a new replica for a
//! new tenant and model with one two-block chain; then sends ALL_CLEARED for
//! every replica, timing those events, and waits for the sweeps to free the
//! names. It prints RSS at each step, the ratio to start-up, and the mean cost
//! of one ALL_CLEARED at the start and at the end of the clearing (it should
//! not grow with the number of names still held).
//!
//! Under `cargo test` (no `--bench`) it runs once with 2,000 names as a smoke
//! test. Linux only (reads `/proc`).
//!
//! Run: `cargo bench -p inference-cache --bench name_flood`

#[path = "../../tests/src/http.rs"]
mod http;
#[path = "../tests/process_support/mod.rs"]
mod process_support;

use std::time::{Duration, Instant};

use inference_cache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, PrefixEntry, cache_event::Type,
};
use process_support::ServerProcess;

/// `cargo bench` passes `--bench`; under `cargo test` a short smoke pass runs.
fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Resident size of the server process, KiB.
fn rss_kib(server: &ServerProcess) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id()))
        .expect("/proc/<pid>/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

fn replica(i: u64) -> String {
    format!("flood-replica-{i:08}.pods.example.internal:8000")
}

fn update(i: u64) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: replica(i),
        model_id: format!("flood-model-{i:08}"),
        tenant_id: format!("flood-tenant-{i:08}"),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            block_hashes: vec![
                (2 * i).to_be_bytes().to_vec(),
                (2 * i + 1).to_be_bytes().to_vec(),
            ],
            block_token_counts: vec![16, 16],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The value of an unlabelled series in a Prometheus exposition.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let names: u64 = if full_run() {
        std::env::var("NAME_FLOOD_NAMES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000)
    } else {
        2_000
    };
    let server = ServerProcess::spawn(&["--sweep-interval", "1s"]);
    server.wait_ready().await;
    let mut client = server.client().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = rss_kib(&server);

    const BATCH: u64 = 1_000;
    let mut next = 0;
    while next < names {
        let end = (next + BATCH).min(names);
        client
            .report_cache_state(tokio_stream::iter((next..end).map(update)))
            .await
            .expect("report");
        next = end;
    }
    let flooded = rss_kib(&server);
    let entries = metric(
        &server.get("/metrics").await.body,
        "inferencecache_index_entries",
    );

    // ALL_CLEARED for every replica; the cost of the first and last tenth.
    let tenth = (names / 10).max(1);
    let (mut first, mut last) = (Duration::ZERO, Duration::ZERO);
    let started = Instant::now();
    for i in 0..names {
        let t = Instant::now();
        client
            .publish_event(CacheEvent {
                r#type: Type::AllCleared as i32,
                replica_id: replica(i),
                ..Default::default()
            })
            .await
            .expect("ALL_CLEARED");
        if i < tenth {
            first += t.elapsed();
        } else if i >= names - tenth {
            last += t.elapsed();
        }
    }
    let clearing = started.elapsed();
    let cleared = rss_kib(&server);

    // The sweeps free the names nothing refers to any more.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let snapshot = server.get("/snapshot").await.body;
        if !snapshot.contains("flood-") || Instant::now() > deadline {
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = rss_kib(&server);
    let entries_after = metric(
        &server.get("/metrics").await.body,
        "inferencecache_index_entries",
    );

    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "name flood: {names} tenant / model / replica names, one 2-block chain each \
         (index entries {:?}, after clearing {:?})",
        entries, entries_after
    );
    println!(
        "| step | RSS | × start-up |\n|---|---:|---:|\n\
         | start-up | {:.1} MiB | 1.00 |\n| names reported | {:.1} MiB | {:.2} |\n\
         | every replica ALL_CLEARED | {:.1} MiB | {:.2} |\n| names freed by the sweep | {:.1} MiB | {:.2} |",
        mib(baseline),
        mib(flooded),
        flooded as f64 / baseline as f64,
        mib(cleared),
        cleared as f64 / baseline as f64,
        mib(after),
        after as f64 / baseline as f64,
    );
    println!(
        "ALL_CLEARED round trips: {:.1} µs mean over the first tenth, {:.1} µs over the last; \
         {:.2} s for all",
        first.as_secs_f64() * 1e6 / tenth as f64,
        last.as_secs_f64() * 1e6 / tenth as f64,
        clearing.as_secs_f64()
    );
}
