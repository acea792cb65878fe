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

/// One call (or stream message) a [`RecordingServer`] received, in
/// arrival order.
#[derive(Debug, Clone, PartialEq)]
pub enum Arrival {
    /// A CacheStateUpdate with this many prefixes, with or without stats.
    Update { prefixes: usize, stats: bool },
    /// A CacheEvent of this type.
    Event(i32),
}

/// What a [`RecordingServer`] received.
#[derive(Debug, Default, Clone)]
pub struct Received {
    pub updates: Vec<CacheStateUpdate>,
    pub events: Vec<CacheEvent>,
    pub streams: usize,
    /// Every update and event in arrival order.
    pub arrivals: Vec<Arrival>,
    /// `authorization` metadata of every accepted call.
    pub authorization: Vec<String>,
    /// Calls refused for a missing or wrong bearer token.
    pub unauthenticated: usize,
}

impl Received {
    /// Events other than REPLICA_UPDATED (heartbeats and refresh liveness).
    pub fn cache_events(&self) -> Vec<CacheEvent> {
        self.events
            .iter()
            .filter(|e| e.r#type != cache_event::Type::ReplicaUpdated as i32)
            .cloned()
            .collect()
    }

    /// REPLICA_UPDATED events.
    pub fn heartbeats(&self) -> Vec<CacheEvent> {
        self.events
            .iter()
            .filter(|e| e.r#type == cache_event::Type::ReplicaUpdated as i32)
            .cloned()
            .collect()
    }

    /// Updates with no prefixes (announcements and stats-only updates).
    pub fn announcements(&self) -> Vec<CacheStateUpdate> {
        self.updates
            .iter()
            .filter(|u| u.prefixes.is_empty())
            .cloned()
            .collect()
    }

    /// Updates carrying blocks.
    pub fn block_updates(&self) -> Vec<CacheStateUpdate> {
        self.updates
            .iter()
            .filter(|u| !u.prefixes.is_empty())
            .cloned()
            .collect()
    }

    /// Every ReplicaStats received, in order.
    pub fn stats(&self) -> Vec<ReplicaStats> {
        self.updates
            .iter()
            .filter_map(|u| u.stats.clone())
            .collect()
    }

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
    /// Bearer token every call must carry, if any.
    token: Option<String>,
}

impl Recorder {
    /// Checks (and records) the call's `authorization` metadata.
    fn authorize(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let header = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if let Some(token) = &self.token
            && header.as_deref() != Some(format!("Bearer {token}").as_str())
        {
            self.received.lock().unauthenticated += 1;
            return Err(Status::unauthenticated("bad bearer token"));
        }
        if let Some(header) = header {
            self.received.lock().authorization.push(header);
        }
        Ok(())
    }
}

/// How a [`RecordingServer`] listens.
#[derive(Default)]
pub struct ServerOptions {
    /// TLS (and client-certificate) configuration.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Bearer token required on every call.
    pub token: Option<String>,
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
        self.authorize(request.metadata())?;
        self.received.lock().streams += 1;
        let mut stream = request.into_inner();
        while let Some(update) = stream.next().await {
            let update = update?;
            let blocks: usize = update.prefixes.iter().map(|p| p.block_hashes.len()).sum();
            self.blocks.fetch_add(blocks as u64, Ordering::Relaxed);
            if self.keep_updates {
                let mut received = self.received.lock();
                received.arrivals.push(Arrival::Update {
                    prefixes: update.prefixes.len(),
                    stats: update.stats.is_some(),
                });
                received.updates.push(update);
            }
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: "OK".into(),
        }))
    }
    async fn publish_event(&self, request: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.authorize(request.metadata())?;
        let event = request.into_inner();
        let mut received = self.received.lock();
        received.arrivals.push(Arrival::Event(event.r#type));
        received.events.push(event);
        drop(received);
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: "OK".into(),
        }))
    }
    async fn report_outcomes(&self, _: Request<OutcomeReport>) -> Result<Response<Ack>, Status> {
        Err(Status::unimplemented("recording server"))
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
        Self::listen(addr, true, ServerOptions::default())
    }

    /// Like [`RecordingServer::start`], with TLS and / or a required token.
    pub async fn start_with(addr: SocketAddr, options: ServerOptions) -> Self {
        Self::listen(addr, true, options)
    }

    /// Like [`RecordingServer::start`], but only counts the blocks it
    /// receives (no copy of the updates is kept).
    pub async fn start_counting(addr: SocketAddr) -> Self {
        Self::listen(addr, false, ServerOptions::default())
    }

    fn listen(addr: SocketAddr, keep_updates: bool, options: ServerOptions) -> Self {
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
            token: options.token,
            ..Recorder::default()
        };
        let received = recorder.received.clone();
        let blocks = recorder.blocks.clone();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let mut builder = tonic::transport::Server::builder();
            if let Some(tls) = options.tls {
                builder = builder.tls_config(tls).expect("server TLS config");
            }
            let _ = builder
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
        "{} not found: build the server first with `cargo build{release} -p inference-cache` \
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

/// A stand-in engine `/metrics` page over real HTTP/1.1: answers every
/// request with the current body (or the current status).
pub struct MetricsPage {
    pub addr: SocketAddr,
    state: Arc<Mutex<(u16, String)>>,
    /// Requests served.
    pub requests: Arc<AtomicU64>,
}

impl MetricsPage {
    /// Serves `body` with status 200 on an ephemeral loopback port.
    pub fn start(body: &str) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new((200u16, body.to_owned())));
        let requests = Arc::new(AtomicU64::new(0));
        let (state2, requests2) = (state.clone(), requests.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let state = state2.clone();
                let requests = requests2.clone();
                std::thread::spawn(move || {
                    use std::io::Read;
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    requests.fetch_add(1, Ordering::Relaxed);
                    let (status, body) = state.lock().clone();
                    let response = format!(
                        "HTTP/1.1 {status} X\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(response.as_bytes());
                });
            }
        });
        Self {
            addr,
            state,
            requests,
        }
    }

    /// The URL to pass as `--engine-metrics-url`.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Replaces the page.
    pub fn set(&self, body: &str) {
        *self.state.lock() = (200, body.to_owned());
    }

    /// Answers with `status` and an empty body from now on.
    pub fn fail_with(&self, status: u16) {
        *self.state.lock() = (status, String::new());
    }
}

/// A fixture file under `tests/fixtures/`.
pub fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A throw-away PKI for TLS tests: a CA, a server certificate for
/// `localhost` and `127.0.0.1`, and a client certificate, written as PEM
/// files into a temporary directory.
pub struct TestPki {
    pub dir: tempfile::TempDir,
    pub ca_pem: String,
    pub server_cert_pem: String,
    pub server_key_pem: String,
}

impl TestPki {
    pub fn generate() -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
            IsCa, KeyPair, KeyUsagePurpose,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "inference-cache test CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("ca key"))
            .expect("ca cert");
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose, cn: &str| {
            let mut params = CertificateParams::new(names).expect("leaf params");
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![usage];
            let key = KeyPair::generate().expect("leaf key");
            let cert = params.signed_by(&key, &ca).expect("leaf cert");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert_pem, server_key_pem) = leaf(
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
            "inference-cache server",
        );
        let (client_cert_pem, client_key_pem) = leaf(
            vec!["subscriber.team-a".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
            "subscriber",
        );
        let ca_pem = ca.pem();
        for (name, content) in [
            ("ca.pem", &ca_pem),
            ("client.pem", &client_cert_pem),
            ("client.key", &client_key_pem),
        ] {
            std::fs::write(dir.path().join(name), content).expect("write pem");
        }
        Self {
            dir,
            ca_pem,
            server_cert_pem,
            server_key_pem,
        }
    }

    /// Path of a file written by [`TestPki::generate`].
    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Server TLS; with `require_client_cert`, only clients whose
    /// certificate this CA signed get in.
    pub fn server_tls(&self, require_client_cert: bool) -> tonic::transport::ServerTlsConfig {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
            &self.server_cert_pem,
            &self.server_key_pem,
        ));
        if require_client_cert {
            tls = tls.client_ca_root(Certificate::from_pem(&self.ca_pem));
        }
        tls
    }
}

/// Starts a subscriber with explicit flags (no ZMQ publisher needed: the
/// endpoint may point nowhere).
pub async fn subscriber_with(server: &str, extra: &[&str]) -> Subscriber {
    let mut argv = vec![
        "subscribe".to_owned(),
        "--endpoint".into(),
        "tcp://127.0.0.1:1".into(),
        "--server".into(),
        server.to_owned(),
        "--replica-id".into(),
        "replica-a".into(),
        "--tenant".into(),
        "team-a".into(),
        "--model".into(),
        "qwen3".into(),
        "--metrics-listen".into(),
        "off".into(),
    ];
    argv.extend(extra.iter().map(|s| (*s).to_owned()));
    let args = SubscribeArgs::try_parse_from(argv).expect("flags parse");
    Subscriber::start(args.resolve().expect("flags resolve"))
        .await
        .expect("subscriber starts")
}
