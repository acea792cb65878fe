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
//! Run: `cargo bench -p inference-cache-server --bench name_flood`

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, PrefixEntry, cache_event::Type,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// `cargo bench` passes `--bench`; under `cargo test` a short smoke pass runs.
fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

struct Server {
    child: Child,
    grpc: u16,
    admin: u16,
}

impl Server {
    fn spawn() -> Self {
        let (grpc, admin) = (free_port(), free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_inference-cache"))
            .args(["serve", "--shutdown-delay", "0s", "--sweep-interval", "1s"])
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn inference-cache serve");
        Self { child, grpc, admin }
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("/proc/<pid>/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS")
    }

    async fn get(&self, path: &str) -> String {
        let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", self.admin)).await else {
            return String::new();
        };
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        if stream.write_all(request.as_bytes()).await.is_err() {
            return String::new();
        }
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw).await;
        String::from_utf8_lossy(&raw).into_owned()
    }

    async fn client(&self) -> InferenceCacheClient<tonic::transport::Channel> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.get("/readyz").await.starts_with("HTTP/1.1 200")
                && let Ok(c) =
                    InferenceCacheClient::connect(format!("http://127.0.0.1:{}", self.grpc)).await
            {
                return c;
            }
            assert!(Instant::now() < deadline, "server never became ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
    let server = Server::spawn();
    let mut client = server.client().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = server.rss_kib();

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
    let flooded = server.rss_kib();
    let entries = metric(
        &server.get("/metrics").await,
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
    let cleared = server.rss_kib();

    // The sweeps free the names nothing refers to any more.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let snapshot = server.get("/snapshot").await;
        if !snapshot.contains("flood-") || Instant::now() > deadline {
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = server.rss_kib();
    let entries_after = metric(
        &server.get("/metrics").await,
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
