//! ReportOutcomes over a real socket: outcomes are aggregated per replica and
//! mode and shown by GetCacheState, `/metrics` and `/snapshot/accuracy`;
//! the probe tenant is never written; reports are producer-class writes
//! (authenticated and scoped to the principal's tenants and replicas).

use anyhow::Context as _;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{GetCacheStateRequest, OutcomeReport, RouteOutcome};
use inference_cache_server::ServeConfig;
use inference_cache_tests::TestServer;
use tonic::Code;
use tonic::transport::Channel;

fn outcome(tenant: &str, replica: &str, predicted: i64, cached: i64) -> RouteOutcome {
    RouteOutcome {
        tenant_id: tenant.into(),
        model_id: "m".into(),
        replica_id: replica.into(),
        reason_code: "PREFIX_MATCH".into(),
        predicted_tokens: predicted,
        cached_tokens: cached,
        prompt_tokens: 200,
        routed: true,
        shadow: false,
    }
}

async fn accuracy(
    client: &mut InferenceCacheClient<Channel>,
    tenant: &str,
) -> anyhow::Result<Vec<inference_cache_proto::v1alpha1::ReplicaAccuracy>> {
    Ok(client
        .get_cache_state(GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: tenant.into(),
        })
        .await?
        .into_inner()
        .accuracy)
}

#[tokio::test]
async fn reported_outcomes_show_per_replica_and_mode() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = server.client().await?;
    let mut shadow = outcome("team-a", "r1", 100, 0);
    shadow.shadow = true;
    shadow.routed = false;
    let ack = client
        .report_outcomes(OutcomeReport {
            outcomes: vec![
                outcome("team-a", "r1", 100, 100),
                outcome("team-a", "r1", 100, 96),
                outcome("team-a", "r1", 100, 0),
                outcome("team-a", "r2", 0, 48),
                shadow,
                outcome(inference_cache_proto::PROBE_TENANT, "r1", 100, 100),
            ],
            dropped: 4,
        })
        .await?
        .into_inner();
    assert!(ack.accepted);
    let rows = accuracy(&mut client, "team-a").await?;
    let summary: Vec<_> = rows
        .iter()
        .map(|row| (row.replica_id.as_str(), row.mode.as_str(), row.outcomes))
        .collect();
    assert_eq!(
        summary,
        [
            ("r1", "routed", 3),
            ("r1", "shadow", 1),
            ("r2", "routed", 1)
        ]
    );
    let r1 = &rows[0];
    assert_eq!((r1.hinted_hit, r1.hinted_miss), (2, 1));
    assert_eq!((r1.predicted_tokens, r1.cached_tokens), (300, 196));
    assert!((r1.median_ratio - 0.96).abs() < 1e-6, "{r1:?}");
    assert!((r1.median_abs_error - 0.04).abs() < 1e-6, "{r1:?}");
    assert_eq!(rows[2].not_hinted_hit, 1);
    assert!(
        accuracy(&mut client, inference_cache_proto::PROBE_TENANT)
            .await?
            .is_empty(),
        "the probe tenant is never written"
    );
    let metrics = server.admin_get("/metrics").await?.body;
    for line in [
        "inferencecache_hint_outcomes_total{tenant=\"team-a\",replica=\"r1\",mode=\"routed\",verdict=\"hinted_miss\"} 1",
        "inferencecache_hint_outcomes_total{tenant=\"team-a\",replica=\"r1\",mode=\"shadow\",verdict=\"hinted_miss\"} 1",
        "inferencecache_hint_cached_tokens_total{tenant=\"team-a\",replica=\"r1\",mode=\"routed\"} 196",
        "inferencecache_hint_outcomes_dropped_by_gateways_total 4",
        "inferencecache_rpc_calls_total{rpc=\"ReportOutcomes\"} 1",
    ] {
        assert!(metrics.contains(line), "missing {line}\n{metrics}");
    }
    assert!(
        !metrics.contains("inferencecache.io/probe"),
        "probe outcomes leaked into /metrics"
    );
    let snapshot: serde_json::Value =
        serde_json::from_str(&server.admin_get("/snapshot/accuracy").await?.body)
            .context("/snapshot/accuracy is JSON")?;
    assert_eq!(snapshot["droppedByGateways"], 4);
    assert_eq!(snapshot["series"].as_array().map(Vec::len), Some(3));
    server.shutdown().await
}

#[tokio::test]
async fn outcome_reports_are_scoped_like_producer_writes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("gateway.token"), "gw-secret\n")?;
    let auth = dir.path().join("auth.yaml");
    std::fs::write(
        &auth,
        "principals:\n  - name: gateway\n    tokenFile: gateway.token\n    tenants: [team-a]\n    replicas: [r1]\n",
    )?;
    let mut config = ServeConfig::ephemeral();
    config.security.auth_file = Some(auth);
    let server = TestServer::start_with(config).await?;
    let mut client = server.client().await?;
    let report = |replica: &str| OutcomeReport {
        outcomes: vec![outcome("team-a", replica, 64, 64)],
        dropped: 0,
    };
    let anonymous = client
        .report_outcomes(report("r1"))
        .await
        .expect_err("no credentials");
    assert_eq!(anonymous.code(), Code::Unauthenticated);
    let signed = |message: OutcomeReport| {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert("authorization", "Bearer gw-secret".parse().expect("ascii"));
        request
    };
    let outside = client
        .report_outcomes(signed(report("r2")))
        .await
        .expect_err("replica outside the grant");
    assert_eq!(outside.code(), Code::PermissionDenied);
    let mut other_tenant = report("r1");
    other_tenant.outcomes[0].tenant_id = "team-b".into();
    let denied = client
        .report_outcomes(signed(other_tenant))
        .await
        .expect_err("tenant outside the grant");
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(
        client
            .report_outcomes(signed(report("r1")))
            .await?
            .into_inner()
            .accepted
    );
    let mut read = tonic::Request::new(GetCacheStateRequest {
        model_id: "m".into(),
        tenant_id: "team-a".into(),
    });
    read.metadata_mut()
        .insert("authorization", "Bearer gw-secret".parse().expect("ascii"));
    let rows = client.get_cache_state(read).await?.into_inner().accuracy;
    assert_eq!(rows.len(), 1, "only the accepted report counts: {rows:?}");
    assert_eq!((rows[0].replica_id.as_str(), rows[0].outcomes), ("r1", 1));
    let metrics = server.admin_get("/metrics").await?.body;
    assert!(
        metrics.contains(
            "inferencecache_auth_refused_total{rpc=\"ReportOutcomes\",reason=\"replica\"} 1"
        ),
        "{metrics}"
    );
    server.shutdown().await
}

#[tokio::test]
async fn shadow_policy_flags_the_same_answer() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = dir.path().join("policy.yaml");
    let doc = |namespace: &str, shadow: bool| {
        format!(
            "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
             metadata: {{ name: p-{namespace}, namespace: {namespace} }}\nspec:\n  \
             ranker: Contract\n  minimumMatchedTokens: 0\n  shadow: {shadow}\n"
        )
    };
    std::fs::write(
        &policy,
        format!("{}---\n{}", doc("shadowed", true), doc("live", false)),
    )?;
    let mut config = ServeConfig::ephemeral();
    config.index.policy_file = Some(policy);
    let server = TestServer::start_with(config).await?;
    let mut client = server.client().await?;
    let tokens: Vec<u32> = (0..64).collect();
    let mut answers = Vec::new();
    for tenant in ["shadowed", "live"] {
        let holder = inference_cache_tests::Holder {
            replica: "r1",
            tenant,
            model: "m",
            adapter: "",
        };
        inference_cache_tests::hold_tokens(&mut client, holder, &tokens).await?;
        let answer = client
            .lookup_route(inference_cache_proto::v1alpha1::LookupRouteRequest {
                model_id: "m".into(),
                tenant_id: tenant.into(),
                hash_scheme: "vllm".into(),
                token_ids: tokens.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        answers.push(answer);
    }
    let [shadowed, live] = [&answers[0], &answers[1]];
    assert!(shadowed.shadow && !live.shadow);
    assert_eq!(shadowed.reason_code, "PREFIX_MATCH");
    assert_eq!(shadowed.reason_code, live.reason_code);
    let top = |answer: &inference_cache_proto::v1alpha1::LookupRouteResponse| {
        answer
            .replica_scores
            .first()
            .map(|score| (score.replica_id.clone(), score.matched_tokens))
    };
    assert_eq!(top(shadowed), Some(("r1".to_owned(), 64)));
    assert_eq!(top(shadowed), top(live));
    server.shutdown().await
}
