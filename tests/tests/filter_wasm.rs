//! The compiled `.wasm` filter under a wasmtime proxy-wasm host: configuration,
//! headers, body, gRPC success, gRPC failure and dispatch failure.
//!
//! The test builds the filter first (`cargo build -p inference-cache-filter
//! --target wasm32-wasip1 --profile wasm`, a no-op when fresh) unless
//! `INFERENCE_CACHE_FILTER_WASM` names a prebuilt file.

use crate::proxy_wasm_host;

use inference_cache_fingerprint::{encode, prefix_hashes};
use inference_cache_proto::v1alpha1::{LookupRouteRequest, LookupRouteResponse, ReplicaScore};
use prost::Message as _;
use proxy_wasm_host::{Action, ProxyWasmHost, filter_wasm};

const CONFIG: &str = r#"{
    "grpc_cluster": "inference_cache",
    "timeout_ms": 25,
    "tenant_header": "x-tenant-id",
    "tenant_id": "default",
    "replica_endpoints": {"replica-a": "10.0.0.1:8000"},
    "replica_id_is_endpoint": true,
    "models": {"llama-sql": {"model_id": "llama", "adapter_id": "sql-lora"}},
    "expose_reason_header": true
}"#;

const DESTINATION: &str = "x-gateway-destination-endpoint";
const REASON: &str = "x-inferencecache-reason";

fn host() -> anyhow::Result<ProxyWasmHost> {
    let mut host = ProxyWasmHost::load(&filter_wasm()?)?;
    host.add_cluster("inference_cache");
    anyhow::ensure!(
        host.configure(CONFIG)?,
        "the filter rejected a valid configuration"
    );
    Ok(host)
}

fn post(
    host: &mut ProxyWasmHost,
    path: &str,
    body: &str,
    extra: &[(&str, &str)],
) -> anyhow::Result<u32> {
    let length = body.len().to_string();
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        ("content-length", length.as_str()),
    ];
    headers.extend_from_slice(extra);
    host.new_stream(&headers)
}

fn response(reason: &str, replicas: &[&str]) -> Vec<u8> {
    LookupRouteResponse {
        reason_code: reason.into(),
        replica_scores: replicas
            .iter()
            .map(|id| ReplicaScore {
                replica_id: (*id).into(),
                score: 1.0,
                ..ReplicaScore::default()
            })
            .collect(),
        ..LookupRouteResponse::default()
    }
    .encode_to_vec()
}

fn tokens_body(model: &str, tokens: &[u32]) -> String {
    format!(r#"{{"model":"{model}","prompt":{tokens:?},"max_tokens":8}}"#)
}

#[test]
fn bad_configuration_is_refused_and_names_the_field() -> anyhow::Result<()> {
    let mut host = ProxyWasmHost::load(&filter_wasm()?)?;
    assert!(
        !host.configure(r#"{"grpc_cluster":"ic","replica_id_is_endpoint":true,"timeout_ms":0}"#)?
    );
    let logged = host
        .logs()
        .iter()
        .any(|(_, line)| line.contains("`timeout_ms`"));
    assert!(logged, "logs: {:?}", host.logs());
    Ok(())
}

#[test]
fn token_prompt_is_fingerprinted_and_routed() -> anyhow::Result<()> {
    let mut host = host()?;
    let tokens: Vec<u32> = (0..40).collect();
    let body = tokens_body("llama-sql", &tokens);
    let stream = post(
        &mut host,
        "/v1/completions",
        &body,
        &[("x-tenant-id", "acme"), (DESTINATION, "6.6.6.6:66")],
    )?;
    assert_eq!(host.request_headers(stream, false)?, Action::Pause);
    assert_eq!(
        host.request_header(stream, DESTINATION),
        None,
        "spoofed header removed"
    );
    // The body arrives in two chunks; the filter buffers until the end.
    let (first, second) = body.as_bytes().split_at(10);
    assert_eq!(host.request_body(stream, first, false)?, Action::Pause);
    assert!(host.grpc_calls().is_empty());
    assert_eq!(host.request_body(stream, second, true)?, Action::Pause);

    let call = host.grpc_calls()[0].clone();
    assert_eq!(call.cluster, "inference_cache");
    assert_eq!(call.service, "inferencecache.v1alpha1.InferenceCache");
    assert_eq!(call.method, "LookupRoute");
    assert_eq!(call.timeout_ms, 25);
    assert_eq!(call.context, stream);
    let request = LookupRouteRequest::decode(call.message.as_slice())?;
    let expected: Vec<Vec<u8>> = prefix_hashes(&tokens, 16)
        .into_iter()
        .map(|hash| encode(hash).to_vec())
        .collect();
    assert_eq!(request.block_hashes, expected);
    assert_eq!(request.block_token_counts, vec![16, 16]);
    assert_eq!(request.model_id, "llama");
    assert_eq!(request.adapter_id, "sql-lora");
    assert_eq!(request.tenant_id, "acme");
    assert_eq!(request.hash_scheme, "vllm");

    host.grpc_success(
        call.token,
        &response("PREFIX_MATCH", &["replica-a", "replica-b"]),
    )?;
    assert_eq!(host.resumed(stream), 1);
    assert_eq!(
        host.request_header(stream, DESTINATION).as_deref(),
        Some("10.0.0.1:8000")
    );
    host.response_headers(stream, false)?;
    assert_eq!(
        host.response_header(stream, REASON).as_deref(),
        Some("PREFIX_MATCH")
    );
    host.finish(stream)?;
    assert_eq!(host.metric("inferencecache_filter.routed"), Some(1));
    assert_eq!(
        host.metric("inferencecache_filter.reason.PREFIX_MATCH"),
        Some(1)
    );
    assert_eq!(
        host.metric("inferencecache_filter.destination_header_removed"),
        Some(1)
    );
    Ok(())
}

#[test]
fn chat_and_string_prompts_are_sent_for_the_server_to_tokenize() -> anyhow::Result<()> {
    let mut host = host()?;
    let chat = r#"{"model":"qwen","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
    let stream = post(&mut host, "/v1/chat/completions", chat, &[])?;
    host.request_headers(stream, false)?;
    host.request_body(stream, chat.as_bytes(), true)?;
    let request = LookupRouteRequest::decode(host.grpc_calls()[0].message.as_slice())?;
    assert_eq!(request.messages.len(), 2);
    assert_eq!(request.messages[1].content, "hi");
    assert_eq!(request.tenant_id, "default");
    assert!(request.block_hashes.is_empty());

    let text = r#"{"model":"qwen","prompt":"Once upon a time"}"#;
    let stream = post(&mut host, "/v1/completions", text, &[])?;
    host.request_headers(stream, false)?;
    host.request_body(stream, text.as_bytes(), true)?;
    let request = LookupRouteRequest::decode(host.grpc_calls()[1].message.as_slice())?;
    assert_eq!(request.raw_prompt, "Once upon a time");
    Ok(())
}

#[test]
fn affinity_hint_to_an_ip_port_replica_is_routed() -> anyhow::Result<()> {
    let mut host = host()?;
    let body = tokens_body("m", &(0..16).collect::<Vec<_>>());
    let stream = post(&mut host, "/v1/completions", &body, &[])?;
    host.request_headers(stream, false)?;
    host.request_body(stream, body.as_bytes(), true)?;
    let token = host.grpc_calls()[0].token;
    host.grpc_success(token, &response("AFFINITY_HINT", &["127.0.0.1:8002"]))?;
    assert_eq!(
        host.request_header(stream, DESTINATION).as_deref(),
        Some("127.0.0.1:8002")
    );
    Ok(())
}

#[test]
fn no_hint_and_unknown_replicas_leave_the_request_alone() -> anyhow::Result<()> {
    let mut host = host()?;
    for (reason, replicas, header) in [
        ("NO_HINT", &["replica-a"][..], "NO_HINT"),
        ("UNKNOWN_MODEL", &[][..], "UNKNOWN_MODEL"),
        ("PREFIX_MATCH", &["not-an-endpoint"][..], "UNKNOWN_REPLICA"),
    ] {
        let body = tokens_body("m", &(0..32).collect::<Vec<_>>());
        let stream = post(&mut host, "/v1/completions", &body, &[])?;
        host.request_headers(stream, false)?;
        host.request_body(stream, body.as_bytes(), true)?;
        let token = host
            .grpc_calls()
            .last()
            .map(|call| call.token)
            .unwrap_or_default();
        host.grpc_success(token, &response(reason, replicas))?;
        assert_eq!(host.resumed(stream), 1);
        assert_eq!(host.request_header(stream, DESTINATION), None);
        host.response_headers(stream, false)?;
        assert_eq!(
            host.response_header(stream, REASON).as_deref(),
            Some(header)
        );
        host.finish(stream)?;
    }
    assert_eq!(
        host.metric("inferencecache_filter.failure.unknown_replica"),
        Some(1)
    );
    Ok(())
}

#[test]
fn grpc_failure_resumes_untouched() -> anyhow::Result<()> {
    let mut host = host()?;
    let body = tokens_body("m", &(0..32).collect::<Vec<_>>());
    let stream = post(&mut host, "/v1/completions", &body, &[])?;
    host.request_headers(stream, false)?;
    host.request_body(stream, body.as_bytes(), true)?;
    let token = host.grpc_calls()[0].token;
    // Envoy reports a timeout as a non-zero status (14 or 1 seen).
    host.grpc_failure(token, 14)?;
    assert_eq!(host.resumed(stream), 1);
    assert_eq!(host.request_header(stream, DESTINATION), None);
    host.response_headers(stream, false)?;
    assert_eq!(
        host.response_header(stream, REASON).as_deref(),
        Some("GRPC_ERROR")
    );
    assert_eq!(
        host.metric("inferencecache_filter.failure.grpc_error"),
        Some(1)
    );

    // A response that is not a LookupRouteResponse.
    let stream = post(&mut host, "/v1/completions", &body, &[])?;
    host.request_headers(stream, false)?;
    host.request_body(stream, body.as_bytes(), true)?;
    let token = host.grpc_calls()[1].token;
    host.grpc_success(token, &[0xff, 0xff, 0xff])?;
    assert_eq!(host.resumed(stream), 1);
    assert_eq!(
        host.metric("inferencecache_filter.failure.decode_error"),
        Some(1)
    );
    Ok(())
}

#[test]
fn dispatch_failure_continues_synchronously() -> anyhow::Result<()> {
    let mut host = ProxyWasmHost::load(&filter_wasm()?)?;
    // No cluster declared: the host refuses the call like Envoy does for an unknown cluster.
    assert!(host.configure(CONFIG)?);
    let body = tokens_body("m", &(0..32).collect::<Vec<_>>());
    let stream = post(&mut host, "/v1/completions", &body, &[])?;
    assert_eq!(host.request_headers(stream, false)?, Action::Pause);
    assert_eq!(
        host.request_body(stream, body.as_bytes(), true)?,
        Action::Continue
    );
    assert!(host.grpc_calls().is_empty());
    assert_eq!(host.resumed(stream), 0);
    host.response_headers(stream, false)?;
    assert_eq!(
        host.response_header(stream, REASON).as_deref(),
        Some("DISPATCH_FAILED")
    );
    assert_eq!(
        host.metric("inferencecache_filter.failure.dispatch_failed"),
        Some(1)
    );
    Ok(())
}

#[test]
fn malformed_bodies_and_other_requests_pass_through() -> anyhow::Result<()> {
    let mut host = host()?;
    let junk = "{\"model\": \u{fffd} not json";
    let stream = post(&mut host, "/v1/completions", junk, &[])?;
    host.request_headers(stream, false)?;
    assert_eq!(
        host.request_body(stream, junk.as_bytes(), true)?,
        Action::Continue
    );
    host.response_headers(stream, false)?;
    assert_eq!(
        host.response_header(stream, REASON).as_deref(),
        Some("INVALID_JSON")
    );

    // Non-UTF-8 body bytes never panic the filter.
    let stream = post(&mut host, "/v1/chat/completions", "xx", &[])?;
    host.request_headers(stream, false)?;
    assert_eq!(
        host.request_body(stream, &[0xc3, 0x28], true)?,
        Action::Continue
    );

    let stream = host.new_stream(&[
        (":method", "GET"),
        (":path", "/v1/models"),
        (DESTINATION, "1.1.1.1:1"),
    ])?;
    assert_eq!(host.request_headers(stream, true)?, Action::Continue);
    assert_eq!(host.request_header(stream, DESTINATION), None);
    host.response_headers(stream, false)?;
    assert_eq!(host.response_header(stream, REASON), None);

    // Declared body over max_body_bytes (default 1 MiB): not buffered.
    let stream = host.new_stream(&[
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-length", "2000000"),
    ])?;
    assert_eq!(host.request_headers(stream, false)?, Action::Continue);
    assert!(host.grpc_calls().is_empty());
    assert_eq!(
        host.metric("inferencecache_filter.failure.body_too_large"),
        Some(1)
    );
    Ok(())
}

#[test]
fn reason_is_hidden_from_clients_by_default_and_kept_in_the_filter_state() -> anyhow::Result<()> {
    let mut host = ProxyWasmHost::load(&filter_wasm()?)?;
    host.add_cluster("inference_cache");
    assert!(host.configure(r#"{"grpc_cluster":"inference_cache","replica_id_is_endpoint":true}"#)?);
    let body = tokens_body("m", &(0..32).collect::<Vec<_>>());
    let stream = post(&mut host, "/v1/completions", &body, &[])?;
    host.request_headers(stream, false)?;
    host.request_body(stream, body.as_bytes(), true)?;
    let token = host.grpc_calls()[0].token;
    host.grpc_success(token, &response("PREFIX_MATCH", &["127.0.0.1:8002"]))?;
    // An upstream's copy of the header is removed too.
    host.add_upstream_response_header(stream, REASON, "TENANT_HOT");
    host.response_headers(stream, false)?;
    assert_eq!(host.response_header(stream, REASON), None);
    assert_eq!(
        host.property(stream, &["inferencecache_reason"]).as_deref(),
        Some(&b"PREFIX_MATCH"[..])
    );
    Ok(())
}

#[test]
fn tenant_from_route_metadata_ignores_the_client_header() -> anyhow::Result<()> {
    let mut host = ProxyWasmHost::load(&filter_wasm()?)?;
    host.add_cluster("inference_cache");
    assert!(host.configure(
        r#"{"grpc_cluster":"inference_cache","replica_id_is_endpoint":true,"tenant_id":"default",
            "tenant":{"route_metadata":{"namespace":"inference_cache","path":["tenant"]}}}"#
    )?);
    let body = tokens_body("m", &(0..32).collect::<Vec<_>>());
    for (metadata, expected) in [(Some("team-a"), "team-a"), (None, "default")] {
        let stream = post(
            &mut host,
            "/v1/completions",
            &body,
            &[("x-tenant-id", "intruder")],
        )?;
        if let Some(tenant) = metadata {
            host.set_property(
                stream,
                &[
                    "xds",
                    "route_metadata",
                    "filter_metadata",
                    "inference_cache",
                    "tenant",
                ],
                tenant.as_bytes(),
            );
        }
        host.request_headers(stream, false)?;
        host.request_body(stream, body.as_bytes(), true)?;
        let call = host
            .grpc_calls()
            .last()
            .cloned()
            .unwrap_or_else(|| panic!("no call"));
        let request = LookupRouteRequest::decode(call.message.as_slice())?;
        assert_eq!(request.tenant_id, expected);
        host.grpc_failure(call.token, 14)?;
        host.finish(stream)?;
    }
    Ok(())
}
