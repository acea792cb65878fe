//! Every RPC of the InferenceCache service, plus gRPC health and reflection,
//! called over a real loopback socket against a server started on port 0.

use futures::StreamExt as _;
use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, GetCacheStateRequest, LookupPdRouteRequest, LookupRouteRequest,
    PrefixEntry, RenderTemplateRequest, StreamEventsRequest, StreamMetricsRequest, cache_event,
};
use inference_cache_tests::TestServer;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn lookup(tenant: &str) -> LookupRouteRequest {
    let tokens: Vec<u32> = (0..64).collect();
    let chain = inference_cache_fingerprint::request_chain(&tokens, 16);
    LookupRouteRequest {
        model_id: "llama".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        block_hashes: chain.block_hashes.iter().map(|h| h.to_vec()).collect(),
        block_token_counts: chain.block_token_counts,
        ..Default::default()
    }
}

#[tokio::test]
async fn lookup_route_on_an_empty_index_fails_open() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let response = client.lookup_route(lookup("team-a")).await?.into_inner();
    assert!(response.replica_scores.is_empty());
    assert_eq!(response.reason_code, reason::NO_HINT);
    assert!(response.lookup_latency_us >= 0);
    assert!(response.token_ids.is_empty());

    // The reserved probe tenant is never answered with a hint.
    let response = client
        .lookup_route(lookup(inference_cache_proto::PROBE_TENANT))
        .await?;
    assert_eq!(response.into_inner().reason_code, reason::NO_HINT);
    server.shutdown().await
}

#[tokio::test]
async fn report_cache_state_drains_the_stream_and_acks() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let updates: Vec<CacheStateUpdate> = (0..3)
        .map(|i| CacheStateUpdate {
            replica_id: format!("10.0.0.{i}:8000"),
            model_id: "llama".into(),
            tenant_id: "team-a".into(),
            hash_scheme: "vllm".into(),
            prefixes: vec![PrefixEntry {
                prefix_hash: vec![i; 8],
                token_count: 16,
                ..Default::default()
            }],
            ..Default::default()
        })
        .collect();
    let ack = client
        .report_cache_state(tokio_stream::iter(updates))
        .await?
        .into_inner();
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, reason::OK);
    server.shutdown().await
}

#[tokio::test]
async fn publish_event_acks() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let ack = client
        .publish_event(CacheEvent {
            r#type: cache_event::Type::AllCleared as i32,
            replica_id: "r1".into(),
            model_id: "llama".into(),
            tenant_id: "team-a".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(ack.accepted);
    server.shutdown().await
}

#[tokio::test]
async fn get_cache_state_of_an_unknown_scope_is_empty() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let state = client
        .get_cache_state(GetCacheStateRequest {
            model_id: "llama".into(),
            tenant_id: "nobody".into(),
        })
        .await?
        .into_inner();
    assert!(state.replicas.is_empty());
    let summary = state.summary.unwrap_or_default();
    assert_eq!(summary.replica_count, 0);
    assert_eq!(summary.entry_count, 0);
    server.shutdown().await
}

#[tokio::test]
async fn render_template_and_pd_route_answer_without_error() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let rendered = client
        .render_template(RenderTemplateRequest {
            template_ref: "no-such-template".into(),
            tenant_id: "team-a".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(rendered.reason_code, reason::TEMPLATE_NOT_FOUND);
    assert_eq!(rendered.tenant_namespace, b"team-a");
    assert!(rendered.rendered_prompt.is_empty());

    let pd = client
        .lookup_pd_route(LookupPdRouteRequest {
            model_id: "llama".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(pd.reason_code, reason::NO_HINT);
    assert!(pd.prefill_replica_id.is_empty() && pd.decode_replica_id.is_empty());
    server.shutdown().await
}

#[tokio::test]
async fn observer_streams_deliver_and_close_cleanly_on_shutdown() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let mut events = client
        .stream_cache_events(StreamEventsRequest {
            types: vec![cache_event::Type::AllCleared as i32],
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut metrics = client
        .stream_metrics(StreamMetricsRequest {
            names: vec!["inferencecache_server_up".into()],
        })
        .await?
        .into_inner();
    let up = metrics.next().await.expect("a snapshot")?;
    assert_eq!(
        (up.name.as_str(), up.r#type.as_str()),
        ("inferencecache_server_up", "gauge")
    );
    assert_eq!(up.value, 1.0);
    for kind in [
        cache_event::Type::ReplicaUpdated,
        cache_event::Type::AllCleared,
    ] {
        client
            .publish_event(CacheEvent {
                r#type: kind as i32,
                replica_id: "10.0.0.9:8000".into(),
                model_id: "llama".into(),
                tenant_id: "team-a".into(),
                ..Default::default()
            })
            .await?;
    }
    // Only the requested type arrives.
    let cleared = events.next().await.expect("an event")?;
    assert_eq!(cleared.r#type, cache_event::Type::AllCleared as i32);
    assert_eq!(cleared.replica_id, "10.0.0.9:8000");
    assert!(cleared.timestamp_us > 0);
    server.shutdown().await?;
    assert!(events.next().await.is_none(), "event stream should end");
    assert!(metrics.next().await.is_none(), "metric stream should end");
    Ok(())
}

#[tokio::test]
async fn health_reports_serving_for_the_server_and_the_service() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut health = HealthClient::new(server.channel().await?);
    for service in ["", inference_cache_proto::SERVICE_NAME] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await?
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }
    let unknown = health
        .check(HealthCheckRequest {
            service: "nope".into(),
        })
        .await;
    assert_eq!(unknown.err().map(|s| s.code()), Some(tonic::Code::NotFound));
    server.shutdown().await
}

#[tokio::test]
async fn reflection_lists_the_services() -> anyhow::Result<()> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let server = TestServer::start().await?;
    let mut reflection = ServerReflectionClient::new(server.channel().await?);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let response = responses
        .message()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no reply"))?;
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        anyhow::bail!("unexpected reflection reply: {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names
            .iter()
            .any(|n| n == inference_cache_proto::SERVICE_NAME),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n == "grpc.health.v1.Health"),
        "{names:?}"
    );
    server.shutdown().await
}

#[tokio::test]
async fn admin_endpoints_answer() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    client.lookup_route(lookup("team-a")).await?;

    let healthz = server.admin_get("/healthz").await?;
    assert_eq!(healthz.status, 200);
    let readyz = server.admin_get("/readyz").await?;
    assert_eq!(readyz.status, 200);
    let metrics = server.admin_get("/metrics").await?;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.body.contains("inferencecache_server_up 1"),
        "{}",
        metrics.body
    );
    assert!(
        metrics
            .body
            .contains("inferencecache_lookup_route_calls_total{reason_code=\"NO_HINT\"} 1"),
        "{}",
        metrics.body
    );
    assert_eq!(server.admin_get("/nope").await?.status, 404);
    server.shutdown().await
}

#[tokio::test]
async fn shutdown_closes_both_listeners() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let (grpc, admin) = (server.grpc_addr(), server.admin_addr());
    server.shutdown().await?;
    assert!(tokio::net::TcpStream::connect(grpc).await.is_err());
    assert!(tokio::net::TcpStream::connect(admin).await.is_err());
    Ok(())
}
