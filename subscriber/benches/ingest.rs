//! Subscriber throughput: engine ZMQ frames → decoded, fingerprinted,
//! batched → blocks on the server's ReportCacheState stream / in its index.
//!
//! Run: `scripts/setup-subscriber.sh && cargo bench -p
//! inference-cache-subscriber --bench ingest` (add `-- --quick` for a short
//! run). Needs the venv with pyzmq + msgpack. The bench itself runs `cargo
//! build --release -p inference-cache` into its own target directory
//! first (unless `$INFERENCE_CACHE_BIN` names a binary), so both sides of the
//! measurement are release builds. Under `cargo test` it runs the short
//! rows against the test build's server binary, as a smoke check.
//!
//! The load comes from `tests/kv_publisher.py` (real pyzmq PUB, byte-exact
//! vLLM batches, pre-encoded, then sent back to back). Two sinks: an
//! in-process gRPC server that only counts the blocks it receives (the
//! subscriber alone), and the real `inference-cache serve` binary, whose
//! index entry count is polled with GetCacheState. The clock runs from the
//! first frame sent until every block has arrived, so the figures are
//! end-to-end events/s and blocks/s through ZMQ, decoding, fingerprinting,
//! the pipeline and the gRPC stream (and, for the second sink, index
//! ingest). The CPU columns are the CPU time of this process (subscriber
//! plus, for the first sink, the counting server) and of the server process;
//! "blocks per CPU s" divides by their sum, a figure that holds up when other
//! work shares the machine. A decode-only number is printed too.
//! Target: ≥ 200k blocks/s.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Publisher, RecordingServer, ServerProcess, free_port, metric, subscriber};
use inference_cache_proto::v1alpha1::GetCacheStateRequest;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_subscriber::decode_batch;
use serde_json::json;
use tonic::transport::Channel;

/// CPU seconds (user + system, all threads) process `pid` (or `self`) has
/// used so far, from `/proc/<pid>/stat` (clock ticks of 10 ms).
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn print_header() {
    println!(
        "| workload | events | blocks | wall s | events/s | blocks/s | bench CPU s | server CPU s | blocks per CPU s | blocks per update | publisher send s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
}

/// Builds the release server binary with cargo (into this bench's target
/// directory) unless `$INFERENCE_CACHE_BIN` names one; returns its path.
fn release_server() -> PathBuf {
    if std::env::var_os("INFERENCE_CACHE_BIN").is_none() {
        let exe = std::env::current_exe().expect("bench executable path");
        // target/release/deps/<bench> → target
        let target_dir = exe
            .ancestors()
            .nth(3)
            .expect("target directory")
            .to_path_buf();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--release", "-p", "inference-cache"])
            .args(["--bin", "inference-cache"])
            .env("CARGO_TARGET_DIR", &target_dir)
            .status()
            .expect("run cargo");
        assert!(
            status.success(),
            "cargo build --release -p inference-cache failed"
        );
    }
    common::server_binary()
}

/// Where the subscriber reports to.
enum Sink {
    /// An in-process server counting blocks (measures the subscriber alone).
    Counting(RecordingServer),
    /// The real server binary; progress is its index's entry count.
    Server(ServerProcess, InferenceCacheClient<Channel>),
}

impl Sink {
    async fn start(real_server: bool) -> Self {
        if !real_server {
            return Sink::Counting(RecordingServer::start_counting(free_port()).await);
        }
        let server = ServerProcess::start(free_port()).await;
        let client = InferenceCacheClient::connect(format!("http://{}", server.addr))
            .await
            .expect("connect");
        Sink::Server(server, client)
    }

    fn addr(&self) -> std::net::SocketAddr {
        match self {
            Sink::Counting(server) => server.addr,
            Sink::Server(server, _) => server.addr,
        }
    }

    /// Blocks counted, or entries in the real index.
    async fn progress(&mut self) -> u64 {
        match self {
            Sink::Counting(server) => server.blocks_received(),
            Sink::Server(_, client) => client
                .get_cache_state(GetCacheStateRequest {
                    model_id: "qwen3".into(),
                    tenant_id: "team-a".into(),
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().summary)
                .map(|s| u64::try_from(s.entry_count).unwrap_or(0))
                .unwrap_or(0),
        }
    }

    fn server_cpu_seconds(&self) -> f64 {
        match self {
            Sink::Counting(_) => 0.0,
            Sink::Server(server, _) => cpu_seconds(&server.pid().to_string()),
        }
    }

    fn poll_interval(&self) -> Duration {
        match self {
            Sink::Counting(_) => Duration::from_millis(1),
            Sink::Server(..) => Duration::from_millis(20),
        }
    }
}

async fn measure(run: &Run, real_server: bool) {
    let mut sink = Sink::start(real_server).await;
    let mut publisher = Publisher::start("v25");
    let sub = subscriber(
        &publisher,
        sink.addr(),
        false,
        &[
            "--buffer-size",
            "10000000",
            "--max-tracked-blocks",
            "10000000",
        ],
    )
    .await;
    publisher.wait_subscriber(1);
    // Warm-up: one block whose tokens equal the run's first block (the real
    // index counts it once), also proving the path is connected.
    publisher.command(json!({"op": "prepare", "batches": 1, "events_per_batch": 1,
        "blocks_per_event": 1, "first_hash": 1_000_000_000u64}));
    publisher.command(json!({"op": "blast"}));
    while sink.progress().await < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let blocks = run.batches * run.events_per_batch * run.blocks_per_event;
    let target = match sink {
        Sink::Counting(_) => blocks + 1,
        Sink::Server(..) => blocks,
    };
    publisher.command(json!({"op": "prepare", "batches": run.batches,
        "events_per_batch": run.events_per_batch, "blocks_per_event": run.blocks_per_event}));
    let poll = sink.poll_interval();
    let cpu_start = cpu_seconds("self");
    let server_cpu_start = sink.server_cpu_seconds();
    let start = Instant::now();
    publisher.send(&json!({"op": "blast"}));
    let deadline = start + Duration::from_secs(120);
    let mut done = sink.progress().await;
    while done < target && Instant::now() < deadline {
        tokio::time::sleep(poll).await;
        done = sink.progress().await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds("self") - cpu_start;
    let server_cpu = sink.server_cpu_seconds() - server_cpu_start;
    let answer = publisher.answer();
    let updates = metric(&sub, "inferencecache_subscriber_updates_sent_total");
    let sent = metric(&sub, "inferencecache_subscriber_blocks_sent_total");
    let received = done.min(target) - (target - blocks);
    let events = (run.batches * run.events_per_batch) as f64;
    let complete = if done >= target { "" } else { " (INCOMPLETE)" };
    println!(
        "| {}{} | {} | {} | {:.3} | {:.0} | {:.0} | {:.2} | {:.2} | {:.0} | {:.0} | {:.3} |",
        run.label,
        complete,
        events,
        received,
        seconds,
        events / seconds,
        received as f64 / seconds,
        cpu,
        server_cpu,
        received as f64 / (cpu + server_cpu).max(0.01),
        sent / updates.max(1.0),
        answer["send_seconds"].as_f64().unwrap_or(f64::NAN)
    );
    sub.shutdown().await;
}

struct Run {
    label: &'static str,
    batches: u64,
    events_per_batch: u64,
    blocks_per_event: u64,
}

fn decode_only(batches: usize, events_per_batch: usize, blocks_per_event: usize) -> (f64, f64) {
    // The same shape as the publisher's, encoded here with rmpv.
    use rmpv::Value as V;
    let events: Vec<V> = (0..events_per_batch)
        .map(|e| {
            let base = (e * blocks_per_event * 16) as u32;
            V::Array(vec![
                V::from("BlockStored"),
                V::Array(
                    (0..blocks_per_event as u64)
                        .map(|h| V::from(h + 1_000_000 * e as u64))
                        .collect(),
                ),
                V::Nil,
                V::Array(
                    (base..base + blocks_per_event as u32 * 16)
                        .map(V::from)
                        .collect(),
                ),
                V::from(16),
                V::Nil,
                V::from("GPU"),
            ])
        })
        .collect();
    let batch = V::Array(vec![V::from(1.0f64), V::Array(events)]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(&mut payload, &batch).expect("encode");
    let start = Instant::now();
    let mut decoded_events = 0usize;
    for _ in 0..batches {
        decoded_events += decode_batch(&payload).expect("decodes").events.len();
    }
    let seconds = start.elapsed().as_secs_f64();
    let events = decoded_events as f64;
    (events / seconds, events * blocks_per_event as f64 / seconds)
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test` run the quick rows
    // against the server binary of the test build.
    let full = std::env::args().any(|a| a == "--bench");
    let quick = !full || std::env::args().any(|a| a == "--quick");
    // 512k blocks a row (64k with --quick): long enough for steady figures,
    // below the server's default cap of 1M index entries.
    let scale = if quick { 1 } else { 8 };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let runs = [
        Run {
            label: "1 block/event, 64 events/batch",
            batches: 1_000 * scale,
            events_per_batch: 64,
            blocks_per_event: 1,
        },
        Run {
            label: "4 blocks/event, 16 events/batch",
            batches: 1_000 * scale,
            events_per_batch: 16,
            blocks_per_event: 4,
        },
        Run {
            label: "32 blocks/event, 4 events/batch",
            batches: 500 * scale,
            events_per_batch: 4,
            blocks_per_event: 32,
        },
    ];
    let binary = if full {
        release_server()
    } else {
        common::server_binary()
    };
    println!("Sink: in-process gRPC server counting received blocks\n");
    print_header();
    for run in &runs {
        runtime.block_on(measure(run, false));
    }
    println!(
        "\nSink: the `inference-cache serve` binary's index ({}); progress read with GetCacheState\n",
        binary.display()
    );
    print_header();
    for run in &runs {
        runtime.block_on(measure(run, true));
    }
    let (events_per_s, blocks_per_s) = decode_only(if quick { 2_000 } else { 10_000 }, 16, 4);
    println!(
        "\ndecode only (4 blocks/event, 16 events/batch): {events_per_s:.0} events/s, {blocks_per_s:.0} blocks/s"
    );
}
