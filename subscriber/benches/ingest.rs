//! Subscriber throughput: engine ZMQ frames → decoded, fingerprinted,
//! batched → blocks on the server's ReportCacheState stream / in its index.
//!
//! Run: `scripts/setup-subscriber.sh && cargo build -p inference-cache-server
//! && cargo bench -p inference-cache-subscriber --bench ingest` (add
//! `-- --quick` for a short run). Needs the venv with pyzmq + msgpack.
//!
//! The load comes from `tests/kv_publisher.py` (real pyzmq PUB, byte-exact
//! vLLM batches, pre-encoded, then sent back to back). Two sinks: an
//! in-process gRPC server that counts the blocks it receives (the
//! subscriber alone), and the real `inference-cache serve` binary (found
//! via `$INFERENCE_CACHE_BIN` or the target directory), whose index entry
//! count is polled with GetCacheState. The clock runs from the first frame
//! sent until every block has arrived, so the figures are end-to-end
//! events/s and blocks/s through ZMQ, decoding, fingerprinting, the
//! pipeline and the gRPC stream (and, for the second sink, index ingest).
//! "blocks per CPU s" divides by the CPU time of this process (subscriber
//! plus, for the first sink, the counting server), a figure that holds up
//! when other work shares the machine. A decode-only number is printed too.
//! Target: ≥ 200k blocks/s.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inference_cache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inference_cache_proto::v1alpha1::*;
use inference_cache_subscriber::{SubscribeArgs, Subscriber, decode_batch};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone, Default)]
struct Counter {
    blocks: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl InferenceCache for Counter {
    async fn render_template(
        &self,
        _: Request<RenderTemplateRequest>,
    ) -> Result<Response<RenderTemplateResponse>, Status> {
        Err(Status::unimplemented(""))
    }
    async fn lookup_route(
        &self,
        _: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        Err(Status::unimplemented(""))
    }
    async fn lookup_pd_route(
        &self,
        _: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        Err(Status::unimplemented(""))
    }
    async fn get_cache_state(
        &self,
        _: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        Err(Status::unimplemented(""))
    }
    async fn report_cache_state(
        &self,
        request: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        let mut stream = request.into_inner();
        while let Some(update) = stream.next().await {
            let blocks: usize = update?.prefixes.iter().map(|p| p.block_hashes.len()).sum();
            self.blocks.fetch_add(blocks as u64, Ordering::Relaxed);
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: "OK".into(),
        }))
    }
    async fn publish_event(&self, _: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: "OK".into(),
        }))
    }
    type StreamCacheEventsStream = tokio_stream::Empty<Result<CacheEvent, Status>>;
    async fn stream_cache_events(
        &self,
        _: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }
    type StreamMetricsStream = tokio_stream::Empty<Result<Metric, Status>>;
    async fn stream_metrics(
        &self,
        _: Request<StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }
}

struct Publisher {
    stdin: std::process::ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
    child: std::process::Child,
    endpoint: String,
}

impl Publisher {
    fn start() -> Self {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let python = std::env::var_os("KV_EVENTS_PYTHON")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("../.cache/venv/bin/python"));
        let mut child = Command::new(&python)
            .arg(root.join("tests/kv_publisher.py"))
            .arg("serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{}: {e}; run scripts/setup-subscriber.sh", python.display())
            });
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("greeting");
        let hello: Value = serde_json::from_str(&line).unwrap_or_else(|_| {
            panic!("publisher failed to start ({line:?}); run scripts/setup-subscriber.sh")
        });
        Self {
            stdin,
            stdout,
            child,
            endpoint: hello["pub"].as_str().expect("pub").to_owned(),
        }
    }

    fn command(&mut self, command: Value) -> Value {
        self.send(command);
        self.answer()
    }

    /// Writes a command without waiting for its answer.
    fn send(&mut self, command: Value) {
        writeln!(self.stdin, "{command}").expect("write");
        self.stdin.flush().expect("flush");
    }

    /// Reads the next answer line.
    fn answer(&mut self) -> Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read");
        serde_json::from_str(&line).expect("json")
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"op": "quit"}));
        let _ = self.stdin.flush();
        std::thread::sleep(Duration::from_millis(200));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU seconds (user + system, all threads) this process has used so far,
/// from `/proc/self/stat` (clock ticks of 10 ms).
fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
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
        "| workload | events | blocks | wall s | events/s | blocks/s | CPU s | blocks per CPU s | publisher send s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
}

/// Where the subscriber reports to.
enum Sink {
    /// An in-process server counting blocks (measures the subscriber alone).
    Counting,
    /// The real server binary; progress is its index's entry count.
    Server(PathBuf),
}

/// `$INFERENCE_CACHE_BIN`, else `target/<profile>/inference-cache` next to this bench.
fn server_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("INFERENCE_CACHE_BIN") {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    ["inference-cache"]
        .iter()
        .map(|name| profile_dir.join(name))
        .chain(
            profile_dir
                .parent()
                .map(|t| t.join("debug/inference-cache")),
        )
        .find(|p| p.is_file())
}

struct ServerProcess(std::process::Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Progress of one run: blocks counted, or entries in the real index.
async fn progress(sink: &Sink, counter: &Counter, addr: std::net::SocketAddr) -> u64 {
    match sink {
        Sink::Counting => counter.blocks.load(Ordering::Relaxed),
        Sink::Server(_) => {
            let Ok(mut client) =
                inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient::connect(
                    format!("http://{addr}"),
                )
                .await
            else {
                return 0;
            };
            client
                .get_cache_state(GetCacheStateRequest {
                    model_id: "bench".into(),
                    tenant_id: "bench".into(),
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().summary)
                .map(|s| u64::try_from(s.entry_count).unwrap_or(0))
                .unwrap_or(0)
        }
    }
}

async fn measure(run: &Run, sink: Sink) {
    let counter = Counter::default();
    let (addr, _server_process, server_task) = match &sink {
        Sink::Counting => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let service = InferenceCacheServer::new(counter.clone());
            let task = tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            (addr, None, Some(task))
        }
        Sink::Server(binary) => {
            let addr = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("free port");
            let child = Command::new(binary)
                .args([
                    "serve",
                    "--grpc-addr",
                    &addr.to_string(),
                    "--admin-addr",
                    "127.0.0.1:0",
                ])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn inference-cache");
            let process = ServerProcess(child);
            let ready_by = Instant::now() + Duration::from_secs(20);
            while inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient::connect(
                format!("http://{addr}"),
            )
            .await
            .is_err()
            {
                assert!(Instant::now() < ready_by, "server did not start");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (addr, Some(process), None)
        }
    };
    let poll = match sink {
        Sink::Counting => Duration::from_millis(1),
        Sink::Server(_) => Duration::from_millis(20),
    };
    let mut publisher = tokio::task::block_in_place(Publisher::start);
    let args = SubscribeArgs::try_parse_from([
        "subscribe",
        "--endpoint",
        &publisher.endpoint,
        "--server",
        &format!("http://{addr}"),
        "--replica-id",
        "bench",
        "--tenant",
        "bench",
        "--model",
        "bench",
        "--metrics-listen",
        "off",
        "--buffer-size",
        "10000000",
        "--max-tracked-blocks",
        "10000000",
    ])
    .expect("flags");
    let subscriber = Subscriber::start(args.resolve().expect("settings"))
        .await
        .expect("start");
    tokio::task::block_in_place(|| {
        publisher.command(json!({"op": "wait_subscriber", "count": 1, "timeout": 20}))
    });
    // Warm-up: one block whose tokens equal the run's first block (the real
    // index counts it once), also proving the path is connected.
    tokio::task::block_in_place(|| {
        publisher.command(json!({"op": "prepare", "batches": 1, "events_per_batch": 1,
            "blocks_per_event": 1, "first_hash": 1_000_000_000u64}));
        publisher.command(json!({"op": "blast"}))
    });
    while progress(&sink, &counter, addr).await < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let blocks = run.batches * run.events_per_batch * run.blocks_per_event;
    let target = match sink {
        Sink::Counting => blocks + 1,
        Sink::Server(_) => blocks,
    };
    tokio::task::block_in_place(|| {
        publisher.command(json!({"op": "prepare", "batches": run.batches,
            "events_per_batch": run.events_per_batch, "blocks_per_event": run.blocks_per_event}))
    });
    let cpu_start = process_cpu_seconds();
    let start = Instant::now();
    publisher.send(json!({"op": "blast"}));
    let deadline = start + Duration::from_secs(120);
    let mut done = progress(&sink, &counter, addr).await;
    while done < target && Instant::now() < deadline {
        tokio::time::sleep(poll).await;
        done = progress(&sink, &counter, addr).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu_start;
    let answer = tokio::task::block_in_place(|| publisher.answer());
    let received = done.min(target) - (target - blocks);
    let events = (run.batches * run.events_per_batch) as f64;
    let complete = if done >= target { "" } else { " (INCOMPLETE)" };
    println!(
        "| {}{} | {} | {} | {:.3} | {:.0} | {:.0} | {:.2} | {:.0} | {:.3} |",
        run.label,
        complete,
        events,
        received,
        seconds,
        events / seconds,
        received as f64 / seconds,
        cpu,
        received as f64 / cpu.max(0.01),
        answer["send_seconds"].as_f64().unwrap_or(f64::NAN)
    );
    subscriber.shutdown().await;
    if let Some(task) = server_task {
        task.abort();
    }
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
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 1 } else { 4 };
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
    println!("Sink: in-process gRPC server counting received blocks\n");
    print_header();
    for run in &runs {
        runtime.block_on(measure(run, Sink::Counting));
    }
    match server_binary() {
        Some(binary) => {
            println!(
                "\nSink: the `inference-cache serve` binary's index ({}); progress read with GetCacheState\n",
                binary.display()
            );
            print_header();
            for run in &runs {
                runtime.block_on(measure(run, Sink::Server(binary.clone())));
            }
        }
        None => println!(
            "\n(no inference-cache binary: `cargo build -p inference-cache-server` to measure into the real index)"
        ),
    }
    let (events_per_s, blocks_per_s) = decode_only(if quick { 2_000 } else { 10_000 }, 16, 4);
    println!(
        "\ndecode only (4 blocks/event, 16 events/batch): {events_per_s:.0} events/s, {blocks_per_s:.0} blocks/s"
    );
}
