//! `--server`: the inference-cache row driven over gRPC against a real policy
//! server on a loopback socket, compared with the in-process index.

use inference_cache_index::PolicySet;
use inference_cache_replay::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_server_routes_like_the_in_process_index() {
    let server = inference_cache_server::start(inference_cache_server::ServeConfig {
        grpc_addr: "127.0.0.1:0".parse().expect("address"),
        admin_addr: "127.0.0.1:0".parse().expect("address"),
        ..Default::default()
    })
    .await
    .expect("server starts");
    let endpoint = format!("http://{}", server.grpc_addr);
    let trace = generate(&SyntheticConfig {
        requests: 300,
        sessions: 30,
        seed: 9,
        ..SyntheticConfig::default()
    });
    let config = SimConfig::new(4, 200);
    let policies = vec![Policy::InferenceCache, Policy::PooledOracle];
    let remote = replay_trace_remote(trace.clone(), policies.clone(), config, &endpoint)
        .await
        .expect("replays against the server");
    let local = replay_trace(&trace, &policies, &config, &PolicySet::default()).expect("replays");

    let (over_grpc, in_process) = (&remote[0], &local[0]);
    assert_eq!(over_grpc.requests, 300);
    let reasons = over_grpc.reasons.as_ref().expect("reasons counted");
    assert_eq!(reasons.iter().map(|r| r.count).sum::<u64>(), 300);
    assert!(
        reasons.iter().any(|r| r.code == "PREFIX_MATCH"),
        "{reasons:?}"
    );
    // The server's clock is the wall clock, not the trace's, so ties in
    // freshness may break differently; the routing quality must not.
    assert!(
        (over_grpc.block_hit_rate - in_process.block_hit_rate).abs() < 0.05,
        "{} over gRPC vs {} in process",
        over_grpc.block_hit_rate,
        in_process.block_hit_rate
    );
    assert_eq!(
        remote[1],
        PolicyResult {
            wall_seconds: remote[1].wall_seconds,
            ..local[1].clone()
        }
    );

    // The run cleared its replicas on the way out.
    let mut client =
        inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient::connect(
            endpoint,
        )
        .await
        .expect("connects");
    let state = client
        .get_cache_state(inference_cache_proto::v1alpha1::GetCacheStateRequest {
            tenant_id: TENANT.into(),
            model_id: MODEL.into(),
        })
        .await
        .expect("GetCacheState")
        .into_inner();
    assert_eq!(state.summary.map_or(0, |s| s.entry_count), 0);
    server.shutdown().await.expect("server stops");
}
