//! The Istio example in a real Envoy: `envoy/istio/envoyfilter.yaml` applied
//! to an Istio-shaped gateway configuration (see `tests/src/istio_gateway.rs`
//! for what stands in for istiod and istio-agent), in front of the real
//! server and three backends whose replica ids are their `ip:port`, as vLLM
//! pods reporting their own address would be.
//!
//! Needs `scripts/setup-envoy.sh`; builds the filter itself unless
//! `INFERENCE_CACHE_FILTER_WASM` is set.

use crate::ENVOY_SERIAL as SERIAL;
use crate::{istio_gateway, proxy_wasm_host, proxy_wasm_host_envoy};

use std::collections::BTreeSet;
use std::net::SocketAddr;

use anyhow::Context as _;
use inference_cache_tests::{Holder, TestServer, contract_ranker_config, hold_tokens};
use istio_gateway::Gateway;
use proxy_wasm_host_envoy::{Backend, Envoy, HttpClient, HttpResponse, free_port, tokens_body};

const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The manifest's model map: `llama-sql` → this model with the `sql-lora` adapter.
const MODEL_NAME: &str = "llama-sql";
const MODEL_ID: &str = "meta-llama/Llama-3.1-8B-Instruct";
const ADAPTER: &str = "sql-lora";
const TENANT: &str = "default";
const REASON: &str = "x-inferencecache-reason";

/// Fails a request that hangs (as one does when the filter's pause in the
/// headers callback is not honoured) instead of waiting out Envoy's idle timeout.
async fn within<T>(request: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::time::timeout(std::time::Duration::from_secs(30), request)
        .await
        .context("no response within 30 s")?
}

fn backend_report(response: &HttpResponse) -> anyhow::Result<serde_json::Value> {
    serde_json::from_slice(&response.body).context("backend answer is not JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoyfilter_manifest_routes_requests_in_an_istio_gateway() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let policy = tempfile::tempdir()?;
    let server = TestServer::start_with(contract_ranker_config(policy.path())?).await?;
    let mut backends = Vec::new();
    for name in ["pod-a", "pod-b", "pod-c"] {
        backends.push(Backend::start(name).await?);
    }
    let gateway = Gateway {
        grpc: server.grpc_addr(),
        backends: backends.iter().map(|b| b.addr).collect(),
        timeout_ms: 200,
        expose_reason: true,
    };
    let wasm = proxy_wasm_host::filter_wasm()?;
    let envoy = Envoy::start_rendered(|dir, listen, admin| {
        istio_gateway::render(&gateway, &wasm, dir, listen, admin)
    })
    .await?;
    let context = || format!("envoy log:\n{}", envoy.log_tail());

    // Replica ids are the pods' ip:port; the manifest leaves the replica map
    // empty and routes such ids as themselves.
    let ids: Vec<String> = backends.iter().map(|b| b.addr.to_string()).collect();
    let mut grpc = server.client().await?;
    for (index, id) in ids.iter().enumerate() {
        let base = 100_000 + 1_000 * index as u32;
        let holder = Holder {
            replica: id,
            tenant: TENANT,
            model: MODEL_ID,
            adapter: ADAPTER,
        };
        hold_tokens(&mut grpc, holder, &(base..base + 128).collect::<Vec<_>>()).await?;
    }
    let held: Vec<u32> = (0..128).collect();
    let holder = Holder {
        replica: &ids[1],
        tenant: TENANT,
        model: MODEL_ID,
        adapter: ADAPTER,
    };
    hold_tokens(&mut grpc, holder, &held).await?;

    let mut client = HttpClient::connect(envoy.addr).await?;
    // The model name maps to the adapter partition the prefix was reported
    // in; the hint names a pod of the Service, which override_host uses.
    let mut prompt = held.clone();
    prompt.extend(900..940);
    for _ in 0..5 {
        let body = tokens_body(MODEL_NAME, &prompt);
        let response = within(client.post("/v1/completions", &[], body)).await?;
        response.assert_routed("PREFIX_MATCH", "pod-b", context);
        assert_eq!(backend_report(&response)?["destination"], ids[1].as_str());
    }

    // A prompt over Envoy's default 1 MiB buffer: the listener patch raised
    // the limit, so the filter reads it and routes it instead of a 413.
    let mut long = held.clone();
    long.extend(1_000..240_000);
    let body = tokens_body(MODEL_NAME, &long);
    assert!(body.len() > 1 << 20);
    let response = within(client.post("/v1/completions", &[], body.clone())).await?;
    response.assert_routed("PREFIX_MATCH", "pod-b", context);
    assert_eq!(backend_report(&response)?["body_bytes"], body.len());

    // No hint: least request over every pod, and a client-supplied
    // destination header never reaches the pool's load balancer.
    let spoofed = [(DESTINATION, ids[2].as_str())];
    let mut served = BTreeSet::new();
    for _ in 0..30 {
        let response = within(client.get_with("/v1/models", &spoofed)).await?;
        assert_eq!(response.status, 200, "{}", context());
        assert_eq!(backend_report(&response)?["destination"], "");
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(served.len(), 3, "every pod serves: {served:?}");
    Ok(())
}

fn holder(replica: &str) -> Holder<'_> {
    Holder {
        replica,
        tenant: TENANT,
        model: MODEL_ID,
        adapter: ADAPTER,
    }
}

/// Sends `prompt` ten times; every answer must be a 200 from `pool` with no
/// reason header (the manifest keeps it inside the gateway).
async fn ten_served_by_the_pool(
    envoy: &Envoy,
    prompt: &[u32],
    pool: &[&str],
    expected_destination: &str,
) -> anyhow::Result<BTreeSet<String>> {
    let mut client = HttpClient::connect(envoy.addr).await?;
    let mut served = BTreeSet::new();
    for attempt in 0..10 {
        let body = tokens_body(MODEL_NAME, prompt);
        let response = within(client.post("/v1/completions", &[], body)).await?;
        assert_eq!(
            response.status,
            200,
            "request {attempt}: envoy log:\n{}",
            envoy.log_tail()
        );
        assert_eq!(response.header(REASON), None);
        assert_eq!(
            backend_report(&response)?["destination"],
            expected_destination
        );
        let by = response.served_by().unwrap_or_default().to_owned();
        assert!(pool.contains(&by.as_str()), "served by {by}");
        served.insert(by);
    }
    Ok(served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_to_a_dead_pod_or_outside_the_pool_fails_no_request() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let policy = tempfile::tempdir()?;
    let server = TestServer::start_with(contract_ranker_config(policy.path())?).await?;
    // pod-c is an endpoint of the Service whose port is closed (the pod died
    // and its endpoint is not yet removed).
    let live = [
        Backend::start("pod-a").await?,
        Backend::start("pod-b").await?,
    ];
    let dead: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let outsider = Backend::start_on("outsider", [127, 0, 0, 2].into()).await?;
    let gateway = Gateway {
        grpc: server.grpc_addr(),
        backends: vec![live[0].addr, live[1].addr, dead],
        timeout_ms: 200,
        expose_reason: false,
    };
    let wasm = proxy_wasm_host::filter_wasm()?;
    let envoy = Envoy::start_rendered(|dir, listen, admin| {
        istio_gateway::render(&gateway, &wasm, dir, listen, admin)
    })
    .await?;

    let mut grpc = server.client().await?;
    let dead_id = dead.to_string();
    let outsider_id = outsider.addr.to_string();
    let to_dead: Vec<u32> = (0..128).collect();
    let to_outsider: Vec<u32> = (10_000..10_128).collect();
    hold_tokens(&mut grpc, holder(&dead_id), &to_dead).await?;
    hold_tokens(&mut grpc, holder(&outsider_id), &to_outsider).await?;

    // The hint names the dead pod: the first attempt fails to connect and
    // Istio's retry policy sends the request to another pod.
    ten_served_by_the_pool(&envoy, &to_dead, &["pod-a", "pod-b"], &dead_id).await?;
    // The hint names an address outside the Service: least request picks.
    ten_served_by_the_pool(&envoy, &to_outsider, &["pod-a", "pod-b"], &outsider_id).await?;
    assert_eq!(outsider.requests(), 0, "the outsider received requests");
    let routed = envoy
        .stat("wasmcustom.inferencecache_filter.routed")
        .await?;
    assert_eq!(routed, 20, "every request carried a hint");
    // Each request hinted at the dead pod was retried once, and only those.
    let retried = envoy
        .stat("cluster.outbound|8000||vllm.llm-gateway.svc.cluster.local.upstream_rq_retry_success")
        .await?;
    assert_eq!(retried, 10, "retries that succeeded");
    Ok(())
}
