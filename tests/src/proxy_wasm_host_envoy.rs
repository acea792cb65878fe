//! A real Envoy running the compiled filter, three backend HTTP servers that
//! say who served them, and a small keep-alive HTTP/1.1 client (fixed-length
//! or chunked request bodies).
//!
//! Envoy's bootstrap is `envoy/envoy.yaml` itself, with its ports, the wasm
//! path, the access log path and (optionally) plugin settings rewritten; every rewrite must find
//! its target exactly where expected, so an edit to the example that breaks
//! the tests fails loudly instead of testing something else. Envoy comes from
//! `scripts/setup-envoy.sh` (`$ENVOY_BIN`, else `.cache/envoy/bin/envoy`); a
//! missing binary fails the test with that instruction. Each [`Envoy`] is
//! killed on drop, so it lives exactly as long as the test using it.
#![allow(
    dead_code,
    reason = "shared by several test binaries, each using a subset"
)]

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail, ensure};
use futures::StreamExt as _;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Replica ids of the three backends, as `envoy/envoy.yaml` maps them.
pub const REPLICAS: [&str; 3] = ["replica-a", "replica-b", "replica-c"];
/// Header each backend answers with: the replica id that served the request.
pub const SERVED_BY: &str = "x-served-by";

/// Path of the Envoy binary, or an error naming the setup script.
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::proxy_wasm_host::repo_root().join(".cache/envoy/bin/envoy"));
    ensure!(
        path.is_file(),
        "no Envoy binary at {}: run scripts/setup-envoy.sh (or set ENVOY_BIN)",
        path.display()
    );
    Ok(path)
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Request header asking a [`Backend`] to report this many cached prompt tokens.
pub const FAKE_CACHED_TOKENS: &str = "x-fake-cached-tokens";
/// Request header asking a [`Backend`] for an event stream (`1`, `no-usage`).
pub const FAKE_STREAM: &str = "x-fake-stream";

/// Path of the health checks `envoy/envoy.yaml` sends to the pool.
pub const HEALTH_PATH: &str = "/health";

/// A backend model server stand-in: answers every request with 200, its name
/// in [`SERVED_BY`], and a JSON body with the name, path, body length and the
/// framing headers it received (`content_length`, `transfer_encoding`).
/// Counts the requests it serves, health checks apart.
///
/// A request carrying [`FAKE_CACHED_TOKENS`] is answered like an engine
/// instead: OpenAI-style `usage` with that many
/// `prompt_tokens_details.cached_tokens` (`-` for a usage without details),
/// as `application/json`, or as a `text/event-stream` whose final chunk
/// carries the usage when [`FAKE_STREAM`] is `1` (no usage chunk at all when
/// it is `no-usage`).
pub struct Backend {
    /// Replica id it reports.
    pub name: String,
    /// Listening address.
    pub addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Backend {
    /// Starts a backend on a port of 127.0.0.1.
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        Self::start_on(name, IpAddr::from([127, 0, 0, 1])).await
    }

    /// Starts a backend on a free port of `ip` (any loopback address).
    pub async fn start_on(name: &str, ip: IpAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let addr = listener.local_addr()?;
        let name_for_task = name.to_owned();
        let requests = Arc::new(AtomicUsize::new(0));
        let counter = requests.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                let name = name_for_task.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                        let name = name.clone();
                        if request.uri().path() != HEALTH_PATH {
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                        async move { Ok::<_, Infallible>(answer(&name, request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(socket), service)
                        .await;
                });
            }
        });
        Ok(Self {
            name: name.to_owned(),
            addr,
            requests,
            task,
        })
    }

    /// Requests served so far, health checks apart.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(name: &str, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_owned();
    let destination = request
        .headers()
        .get("x-gateway-destination-endpoint")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let content_length = header("content-length");
    let transfer_encoding = header("transfer-encoding");
    let cached = request
        .headers()
        .get(FAKE_CACHED_TOKENS)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let stream = header(FAKE_STREAM);
    let length = match request.into_body().collect().await {
        Ok(body) => body.to_bytes().len(),
        Err(_) => 0,
    };
    let body = serde_json::json!({
        "served_by": name,
        "path": path,
        "body_bytes": length,
        "destination": destination,
        "content_length": content_length,
        "transfer_encoding": transfer_encoding,
    })
    .to_string();
    let mut response = match cached {
        Some(cached) => engine_answer(&cached, &stream),
        None => Response::new(Full::new(Bytes::from(body))),
    };
    if let Ok(value) = name.parse() {
        response.headers_mut().insert(SERVED_BY, value);
    }
    response
}

/// An engine-like completion carrying `cached` cached prompt tokens.
fn engine_answer(cached: &str, stream: &str) -> Response<Full<Bytes>> {
    let details = match cached.parse::<u64>() {
        Ok(count) => serde_json::json!({ "cached_tokens": count }),
        Err(_) => serde_json::Value::Null,
    };
    let usage = serde_json::json!({
        "prompt_tokens": 168,
        "completion_tokens": 1,
        "total_tokens": 169,
        "prompt_tokens_details": details,
    });
    let choice = serde_json::json!([{ "index": 0, "text": "x", "finish_reason": "length" }]);
    let (content_type, body) = if stream.is_empty() {
        let body = serde_json::json!({ "id": "cmpl-e2e", "object": "text_completion", "choices": choice, "usage": usage });
        ("application/json", body.to_string())
    } else {
        let chunk = serde_json::json!({ "id": "cmpl-e2e", "choices": choice, "usage": null });
        let mut body = format!("data: {chunk}\n\n");
        if stream != "no-usage" {
            let last = serde_json::json!({ "id": "cmpl-e2e", "choices": [], "usage": usage });
            body.push_str(&format!("data: {last}\n\n"));
        }
        body.push_str("data: [DONE]\n\n");
        ("text/event-stream", body)
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

/// Where Envoy's clusters point and what to change in the plugin configuration.
pub struct EnvoySetup {
    /// gRPC address of the inference-cache server (or a fake).
    pub grpc: SocketAddr,
    /// Backends for replica-a, -b, -c, in that order.
    pub backends: [SocketAddr; 3],
    /// Plugin `timeout_ms`.
    pub timeout_ms: u64,
    /// Whether the wasm filter is in the chain (false for the overhead baseline).
    pub with_filter: bool,
    /// Plugin `expose_reason_header` (the shipped file has it off).
    pub expose_reason: bool,
    /// The tenant in the route's metadata (the shipped file has `default`).
    pub route_tenant: Option<String>,
    /// TLS to the server: the shipped file's commented variant, enabled.
    pub server_tls: Option<ServerTls>,
}

/// How Envoy's cluster for the server uses TLS.
pub struct ServerTls {
    /// Holds `ca.pem`, and `gateway.pem` / `gateway-key.pem` (the client
    /// certificate), the names the shipped variant uses.
    pub dir: PathBuf,
    /// Whether Envoy presents the client certificate.
    pub client_certificate: bool,
    /// The plugin's `grpc_authority` (a name in the server's certificate).
    pub authority: String,
}

/// The shipped file's commented `transport_socket` for the server's
/// cluster, uncommented, with its files in `tls.dir`.
fn enable_server_tls(text: &str, tls: &ServerTls) -> anyhow::Result<String> {
    const FIRST: &str = "    # transport_socket:\n";
    let start = text
        .find(FIRST)
        .ok_or_else(|| anyhow!("envoy/envoy.yaml: no commented transport_socket"))?;
    let end = start
        + text[start..]
            .find("\n\n")
            .ok_or_else(|| anyhow!("envoy/envoy.yaml: transport_socket block does not end"))?;
    let mut block = String::new();
    let mut skip = 0;
    for line in text[start..end].lines() {
        let line = line
            .strip_prefix("    # ")
            .ok_or_else(|| anyhow!("envoy/envoy.yaml: `{line}` inside the TLS block"))?;
        if skip > 0 {
            skip -= 1;
            continue;
        }
        if !tls.client_certificate && line.trim() == "tls_certificates:" {
            skip = 2;
            continue;
        }
        block.push_str("    ");
        block.push_str(line);
        block.push('\n');
    }
    let dir = format!("{}/", tls.dir.display());
    let block = block.replace("/etc/inference-cache/", &dir);
    let mut text = format!("{}{}{}", &text[..start], block, &text[end + 1..]);
    text = replace_once(
        &text,
        "\"grpc_cluster\": \"inference_cache\",",
        &format!(
            "\"grpc_cluster\": \"inference_cache\", \"grpc_authority\": \"{}\",",
            tls.authority
        ),
    )?;
    Ok(text)
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    child: Child,
    /// Client-facing listener.
    pub addr: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
    log: PathBuf,
    dir: TempDir,
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn replace_once(text: &str, from: &str, to: &str) -> anyhow::Result<String> {
    let count = text.matches(from).count();
    ensure!(
        count == 1,
        "envoy/envoy.yaml: expected `{from}` exactly once, found {count}"
    );
    Ok(text.replacen(from, to, 1))
}

/// Name of the access log file in Envoy's scratch directory.
const ACCESS_LOG: &str = "access.log";

/// `envoy/envoy.yaml` with the test's ports, wasm path, access log (in
/// `dir`) and settings.
pub fn render_bootstrap(
    setup: &EnvoySetup,
    wasm: &Path,
    dir: &Path,
    listen: u16,
    admin: u16,
) -> anyhow::Result<String> {
    let path = crate::proxy_wasm_host::repo_root().join("envoy/envoy.yaml");
    let mut text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text = replace_once(&text, "port_value: 10000", &format!("port_value: {listen}"))?;
    text = replace_once(&text, "port_value: 9901", &format!("port_value: {admin}"))?;
    text = replace_once(
        &text,
        "port_value: 9090",
        &format!("port_value: {}", setup.grpc.port()),
    )?;
    for (default_port, backend) in [8001, 8002, 8003].iter().zip(setup.backends) {
        text = replace_once(
            &text,
            &format!("port_value: {default_port}"),
            &format!("port_value: {}", backend.port()),
        )?;
        text = replace_once(
            &text,
            &format!("\"127.0.0.1:{default_port}\""),
            &format!("\"{backend}\""),
        )?;
    }
    text = replace_once(
        &text,
        "filename: target/wasm32-wasip1/wasm/inference_cache_filter.wasm",
        &format!("filename: {}", wasm.display()),
    )?;
    text = replace_once(
        &text,
        "\"timeout_ms\": 20,",
        &format!("\"timeout_ms\": {},", setup.timeout_ms),
    )?;
    text = replace_once(
        &text,
        "path: /dev/stdout",
        &format!("path: {}", dir.join(ACCESS_LOG).display()),
    )?;
    if let Some(tls) = &setup.server_tls {
        text = enable_server_tls(&text, tls)?;
    }
    if let Some(tenant) = &setup.route_tenant {
        text = replace_once(
            &text,
            "inference_cache: { tenant: default }",
            &format!("inference_cache: {{ tenant: {tenant} }}"),
        )?;
    }
    if setup.expose_reason {
        text = replace_once(
            &text,
            "\"expose_reason_header\": false,",
            "\"expose_reason_header\": true,",
        )?;
    }
    if !setup.with_filter {
        // The baseline also keeps a client's destination header, so a
        // benchmark can time the pool's override_host path without a lookup.
        let start = text
            .find("          early_header_mutation_extensions:")
            .ok_or_else(|| anyhow!("early_header_mutation_extensions not found"))?;
        let end = text
            .find("          # One line per request")
            .ok_or_else(|| anyhow!("access log comment not found"))?;
        ensure!(
            start < end,
            "envoy/envoy.yaml: edge mutation after the access log"
        );
        text.replace_range(start..end, "");
        let start = text
            .find("          - name: envoy.filters.http.wasm")
            .ok_or_else(|| anyhow!("wasm filter entry not found"))?;
        let end = text
            .find("          - name: envoy.filters.http.router")
            .ok_or_else(|| anyhow!("router entry not found"))?;
        text.replace_range(start..end, "");
    }
    Ok(text)
}

impl Envoy {
    /// Starts Envoy with `envoy/envoy.yaml` on free ports and waits until its
    /// listener accepts.
    pub async fn start(setup: &EnvoySetup) -> anyhow::Result<Self> {
        let wasm = crate::proxy_wasm_host::filter_wasm()?;
        Self::start_rendered(|dir, listen, admin| {
            render_bootstrap(setup, &wasm, dir, listen, admin)
        })
        .await
    }

    /// Starts Envoy with the bootstrap `render(scratch dir, listener port,
    /// admin port)` returns (it may write further files into the scratch
    /// directory) and waits until its listener accepts.
    pub async fn start_rendered(
        render: impl FnOnce(&Path, u16, u16) -> anyhow::Result<String>,
    ) -> anyhow::Result<Self> {
        let binary = envoy_binary()?;
        let listen = free_port()?;
        let admin = free_port()?;
        let dir = std::env::temp_dir().join(format!(
            "inference-cache-envoy-{}-{listen}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        let dir = TempDir(dir);
        let config = dir.0.join("envoy.yaml");
        std::fs::write(&config, render(&dir.0, listen, admin)?)?;
        let log = dir.0.join("envoy.log");
        // One worker thread: every test drives an Envoy over a handful of
        // connections, and each worker would start its own wasm VM; on a
        // small machine running two Envoys next to the server, extra idle
        // workers only add start-up time and threads to schedule.
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "info"])
            // Flush the log often, so a failing test's log tail is current.
            .args(["--file-flush-interval-msec", "100"])
            .arg("--log-path")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut envoy = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], listen)),
            admin: SocketAddr::from(([127, 0, 0, 1], admin)),
            log,
            dir,
        };
        envoy.wait_ready().await?;
        Ok(envoy)
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("envoy exited with {status}:\n{}", self.log_tail());
            }
            if let Ok(mut client) = HttpClient::connect(self.admin).await
                && let Ok(response) = client.get("/ready").await
                && response.status == 200
                && TcpStream::connect(self.addr).await.is_ok()
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("envoy did not become ready:\n{}", self.log_tail())
    }

    /// The last lines of Envoy's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The access log's lines so far (empty when the bootstrap has none).
    pub fn access_log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.0.join(ACCESS_LOG))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Waits (up to 5 s) until the access log holds at least `count` lines
    /// (Envoy flushes it every 100 ms here) and returns them.
    pub async fn access_log_lines(&self, count: usize) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let lines = self.access_log();
            if lines.len() >= count {
                return Ok(lines);
            }
            ensure!(
                Instant::now() < deadline,
                "access log has {} lines, wanted {count}:\n{}",
                lines.len(),
                lines.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A counter from the admin `/stats` endpoint (0 when absent).
    pub async fn stat(&self, name: &str) -> anyhow::Result<u64> {
        let mut client = HttpClient::connect(self.admin).await?;
        let response = client.get(&format!("/stats?filter={name}")).await?;
        for line in response.body_text().lines() {
            if let Some((key, value)) = line.split_once(": ")
                && key.trim() == name
            {
                return Ok(value.trim().parse()?);
            }
        }
        Ok(0)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP response, fully read.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: hyper::HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

impl HttpResponse {
    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    /// The body as text.
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Which backend served it.
    pub fn served_by(&self) -> Option<&str> {
        self.header(SERVED_BY)
    }

    /// Asserts a 200 carrying `reason` in the `x-inferencecache-reason`
    /// header and served by `backend`; `context` (e.g. Envoy's log tail) is
    /// printed on failure.
    pub fn assert_routed(&self, reason: &str, backend: &str, context: impl Fn() -> String) {
        assert_eq!(self.status, 200, "{}", context());
        assert_eq!(
            self.header("x-inferencecache-reason"),
            Some(reason),
            "{}",
            context()
        );
        assert_eq!(self.served_by(), Some(backend), "{}", context());
    }
}

/// A request body: fixed length (`Content-Length`) or streamed (chunked).
type ClientBody = UnsyncBoxBody<Bytes, Infallible>;

/// One keep-alive HTTP/1.1 connection.
pub struct HttpClient {
    sender: hyper::client::conn::http1::SendRequest<ClientBody>,
    host: String,
}

impl HttpClient {
    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self {
            sender,
            host: addr.to_string(),
        })
    }

    /// GET `path`.
    pub async fn get(&mut self, path: &str) -> anyhow::Result<HttpResponse> {
        self.send("GET", path, &[], fixed(Bytes::new())).await
    }

    /// GET `path` with extra headers.
    pub async fn get_with(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<HttpResponse> {
        self.send("GET", path, headers, fixed(Bytes::new())).await
    }

    /// POST a JSON body to `path` with extra headers.
    pub async fn post(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> anyhow::Result<HttpResponse> {
        self.send("POST", path, headers, fixed(body.into())).await
    }

    /// POST a JSON body to `path` as `Transfer-Encoding: chunked` (no
    /// `Content-Length`): one chunk per element of `chunks`, each written
    /// after `pause` so they reach Envoy as separate reads.
    pub async fn post_chunked(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        chunks: Vec<Bytes>,
        pause: Duration,
    ) -> anyhow::Result<HttpResponse> {
        let frames = futures::stream::iter(chunks).then(move |chunk| async move {
            tokio::time::sleep(pause).await;
            Ok::<_, Infallible>(Frame::data(chunk))
        });
        let mut all = headers.to_vec();
        all.push(("transfer-encoding", "chunked"));
        let body = StreamBody::new(frames).boxed_unsync();
        self.send("POST", path, &all, body).await
    }

    async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: ClientBody,
    ) -> anyhow::Result<HttpResponse> {
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.host);
        if method == "POST" {
            builder = builder.header("content-type", "application/json");
        }
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder.body(body)?;
        self.sender.ready().await?;
        let response = self.sender.send_request(request).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(HttpResponse {
            status,
            headers,
            body,
        })
    }
}

fn fixed(body: Bytes) -> ClientBody {
    Full::new(body).boxed_unsync()
}

/// `body` cut into `count` nearly equal chunks (the last takes the remainder).
pub fn split_body(body: &[u8], count: usize) -> Vec<Bytes> {
    let size = body.len().div_ceil(count.max(1)).max(1);
    body.chunks(size).map(Bytes::copy_from_slice).collect()
}

/// A completions body with a token-id prompt.
pub fn tokens_body(model: &str, tokens: &[u32]) -> String {
    format!(r#"{{"model":"{model}","prompt":{tokens:?},"max_tokens":8}}"#)
}
