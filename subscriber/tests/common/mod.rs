//! Shared test harness: the Python vLLM publisher stand-in, a recording
//! gRPC server, and subscriber start-up helpers.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inference_cache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inference_cache_proto::v1alpha1::*;
use inference_cache_subscriber::{SubscribeArgs, Subscriber};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

/// Workspace root (the subscriber crate's parent).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// The venv interpreter with pyzmq + msgpack; fails with the setup hint.
pub fn python() -> PathBuf {
    let path = std::env::var_os("KV_EVENTS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/venv/bin/python"));
    let ok = Command::new(&path)
        .args(["-c", "import zmq, msgpack"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import zmq and msgpack: run scripts/setup-subscriber.sh \
         (or set KV_EVENTS_PYTHON to an interpreter that has pyzmq and msgpack)",
        path.display()
    );
    path
}

/// A running `tests/kv_publisher.py serve`.
pub struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// PUB endpoint (`tcp://127.0.0.1:port`).
    pub endpoint: String,
    /// ROUTER replay endpoint.
    pub replay: String,
}

impl Publisher {
    /// Starts a publisher; `replay_format` is `v25` or `v26`.
    pub fn start(replay_format: &str) -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/kv_publisher.py");
        let mut child = Command::new(python())
            .arg(script)
            .args(["serve", "--replay-format", replay_format])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn publisher");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("publisher greeting");
        let hello: Value = serde_json::from_str(&line).expect("greeting json");
        Self {
            child,
            stdin,
            stdout,
            endpoint: hello["pub"].as_str().expect("pub").to_owned(),
            replay: hello["replay"].as_str().expect("replay").to_owned(),
        }
    }

    /// Sends one command and returns its JSON answer.
    pub fn command(&mut self, command: Value) -> Value {
        self.send(&command);
        let answer = self.answer();
        assert_eq!(
            answer["ok"],
            json!(true),
            "publisher command {command} failed: {answer}"
        );
        answer
    }

    /// Writes one command without waiting for its answer.
    pub fn send(&mut self, command: &Value) {
        tokio::task::block_in_place(|| {
            writeln!(self.stdin, "{command}").expect("write command");
            self.stdin.flush().expect("flush");
        });
    }

    /// Reads the answer to the oldest unanswered command.
    pub fn answer(&mut self) -> Value {
        tokio::task::block_in_place(|| {
            let mut line = String::new();
            self.stdout.read_line(&mut line).expect("read answer");
            serde_json::from_str(&line).expect("answer json")
        })
    }

    /// Waits until `count` subscriptions arrived in total.
    pub fn wait_subscriber(&mut self, count: u64) {
        self.command(json!({"op": "wait_subscriber", "count": count, "timeout": 20}));
    }

    /// Publishes one batch; returns its sequence number.
    pub fn publish(&mut self, events: Value, layout: &str) -> u64 {
        let answer = self.command(json!({"op": "publish", "events": events, "layout": layout}));
        answer["seq"].as_u64().expect("seq")
    }

    /// Records a batch for replay without sending it (a lost message).
    pub fn publish_unsent(&mut self, events: Value, layout: &str) -> u64 {
        let answer = self
            .command(json!({"op": "publish", "events": events, "layout": layout, "send": false}));
        answer["seq"].as_u64().expect("seq")
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"op": "quit"}));
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `BlockStored` event in the publisher's JSON form.
pub fn stored(hashes: &[i128], parent: Option<i128>, tokens: &[u32]) -> Value {
    json!({
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": null,
        "medium": "GPU",
    })
}

/// A `BlockRemoved` event.
pub fn removed(hashes: &[i128], medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
}

/// What a [`RecordingServer`] received.
#[derive(Debug, Default, Clone)]
pub struct Received {
    pub updates: Vec<CacheStateUpdate>,
    pub events: Vec<CacheEvent>,
    pub streams: usize,
}

impl Received {
    /// Every (adapter, tier, block hash) reported, in order.
    pub fn blocks(&self) -> Vec<(String, i32, Vec<u8>)> {
        let mut out = Vec::new();
        for update in &self.updates {
            for entry in &update.prefixes {
                for hash in &entry.block_hashes {
                    out.push((entry.adapter_id.clone(), entry.tier, hash.clone()));
                }
            }
        }
        out
    }
}

#[derive(Clone, Default)]
struct Recorder {
    received: Arc<Mutex<Received>>,
    blocks: Arc<AtomicU64>,
    /// Keep the updates themselves (off: only count their blocks).
    keep_updates: bool,
}

#[tonic::async_trait]
impl InferenceCache for Recorder {
    async fn render_template(
        &self,
        _: Request<RenderTemplateRequest>,
    ) -> Result<Response<RenderTemplateResponse>, Status> {
        Err(Status::unimplemented("recording server"))
    }
    async fn lookup_route(
        &self,
        _: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        Err(Status::unimplemented("recording server"))
    }
    async fn lookup_pd_route(
        &self,
        _: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        Err(Status::unimplemented("recording server"))
    }
    async fn get_cache_state(
        &self,
        _: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        Err(Status::unimplemented("recording server"))
    }
    async fn report_cache_state(
        &self,
        request: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        self.received.lock().streams += 1;
        let mut stream = request.into_inner();
        while let Some(update) = stream.next().await {
            let update = update?;
            let blocks: usize = update.prefixes.iter().map(|p| p.block_hashes.len()).sum();
            self.blocks.fetch_add(blocks as u64, Ordering::Relaxed);
            if self.keep_updates {
                self.received.lock().updates.push(update);
            }
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: "OK".into(),
        }))
    }
    async fn publish_event(&self, request: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.received.lock().events.push(request.into_inner());
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

/// An in-test gRPC server that records ReportCacheState and PublishEvent.
/// It runs on its own runtime so [`RecordingServer::kill`] can cut every
/// connection at once, like a crashed process.
pub struct RecordingServer {
    pub addr: SocketAddr,
    received: Arc<Mutex<Received>>,
    blocks: Arc<AtomicU64>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl RecordingServer {
    /// Listens on `addr` (port 0 for an ephemeral one).
    pub async fn start(addr: SocketAddr) -> Self {
        Self::listen(addr, true)
    }

    /// Like [`RecordingServer::start`], but only counts the blocks it
    /// receives (no copy of the updates is kept).
    pub async fn start_counting(addr: SocketAddr) -> Self {
        Self::listen(addr, false)
    }

    fn listen(addr: SocketAddr, keep_updates: bool) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("server runtime");
        let listener = std::net::TcpListener::bind(addr).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let recorder = Recorder {
            keep_updates,
            ..Recorder::default()
        };
        let received = recorder.received.clone();
        let blocks = recorder.blocks.clone();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(InferenceCacheServer::new(recorder))
                .serve_with_incoming(incoming)
                .await;
        });
        Self {
            addr,
            received,
            blocks,
            runtime: Some(runtime),
        }
    }

    /// Blocks received on ReportCacheState streams so far.
    pub fn blocks_received(&self) -> u64 {
        self.blocks.load(Ordering::Relaxed)
    }

    /// A copy of everything received so far.
    pub fn received(&self) -> Received {
        self.received.lock().clone()
    }

    /// Stops abruptly (like a crash): the listener and every connection close.
    pub async fn kill(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        // Let the sockets close before the port is reused.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for RecordingServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Polls `check` every 20 ms until it holds or `timeout` passes.
pub async fn eventually<F: FnMut() -> bool>(timeout: Duration, mut check: F) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a subscriber for `publisher`, reporting to `server`.
pub async fn subscriber(
    publisher: &Publisher,
    server: SocketAddr,
    replay: bool,
    extra: &[&str],
) -> Subscriber {
    let mut argv = vec![
        "subscribe".to_owned(),
        "--endpoint".into(),
        publisher.endpoint.clone(),
        "--server".into(),
        format!("http://{server}"),
        "--replica-id".into(),
        "replica-a".into(),
        "--tenant".into(),
        "team-a".into(),
        "--model".into(),
        "qwen3".into(),
        "--metrics-listen".into(),
        "127.0.0.1:0".into(),
    ];
    if replay {
        argv.push("--replay-endpoint".into());
        argv.push(publisher.replay.clone());
    }
    argv.extend(extra.iter().map(|s| (*s).to_owned()));
    let args = SubscribeArgs::try_parse_from(argv).expect("flags parse");
    Subscriber::start(args.resolve().expect("flags resolve"))
        .await
        .expect("subscriber starts")
}

/// Sample value from the subscriber's metrics (0 when absent).
pub fn metric(subscriber: &Subscriber, name: &str) -> f64 {
    subscriber.metrics().sample(name).unwrap_or(0.0)
}

/// A free loopback port (bound then released).
pub fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

/// The `inference-cache` server binary: `$INFERENCE_CACHE_BIN`, else the one
/// next to this test executable's target directory. Fails with the build hint.
pub fn server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("INFERENCE_CACHE_BIN") {
        return PathBuf::from(path);
    }
    // target/<profile>/deps/<test-exe> → target/<profile>/inference-cache
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile> directory");
    let path = profile_dir.join("inference-cache");
    let release = if profile_dir.ends_with("release") {
        " --release"
    } else {
        ""
    };
    assert!(
        path.is_file(),
        "{} not found: build the server first with `cargo build{release} -p inference-cache-server` \
         (same CARGO_TARGET_DIR), or set INFERENCE_CACHE_BIN",
        path.display()
    );
    path
}

/// A running `inference-cache serve` process.
pub struct ServerProcess {
    pub addr: SocketAddr,
    child: Child,
}

impl ServerProcess {
    /// Starts the server on `addr` and waits until it accepts gRPC calls.
    pub async fn start(addr: SocketAddr) -> Self {
        let child = Command::new(server_binary())
            .args([
                "serve",
                "--grpc-addr",
                &addr.to_string(),
                "--admin-addr",
                "127.0.0.1:0",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn inference-cache");
        let server = Self { addr, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = async {
                let mut client =
                    inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient::connect(
                        format!("http://{addr}"),
                    )
                    .await
                    .ok()?;
                client
                    .get_cache_state(GetCacheStateRequest::default())
                    .await
                    .ok()
            };
            if ready.await.is_some() {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "inference-cache did not start on {addr}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The process id (for reading its CPU time).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process (SIGKILL: a crash, no draining).
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
