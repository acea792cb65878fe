//! The Istio example in a real Envoy: `envoy/istio/envoyfilter.yaml` applied
//! to an Istio-shaped gateway configuration (see `tests/src/istio_gateway.rs`
//! for what stands in for istiod and istio-agent), in front of the real
//! server and three backends whose replica ids are their `ip:port`, as vLLM
//! pods reporting their own address would be.
//!
//! Needs `scripts/setup-envoy.sh`; builds the filter itself unless
//! `INFERENCE_CACHE_FILTER_WASM` is set.

#[path = "../src/istio_gateway.rs"]
mod istio_gateway;
#[path = "../src/proxy_wasm_host.rs"]
mod proxy_wasm_host;
#[path = "../src/proxy_wasm_host_envoy.rs"]
mod proxy_wasm_host_envoy;

use anyhow::Context as _;
use inference_cache_tests::{Holder, TestServer, hold_tokens};
use istio_gateway::Gateway;
use proxy_wasm_host_envoy::{Backend, Envoy, HttpClient, HttpResponse, tokens_body};

const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The manifest's model map: `llama-sql` → this model with the `sql-lora` adapter.
const MODEL_NAME: &str = "llama-sql";
const MODEL_ID: &str = "meta-llama/Llama-3.1-8B-Instruct";
const ADAPTER: &str = "sql-lora";
const TENANT: &str = "default";

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
    let server = TestServer::start().await?;
    let mut backends = Vec::new();
    for name in ["pod-a", "pod-b", "pod-c"] {
        backends.push(Backend::start(name).await?);
    }
    let gateway = Gateway {
        grpc: server.grpc_addr(),
        backends: backends.iter().map(|b| b.addr).collect(),
        timeout_ms: 200,
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
    // in; the hint goes through the inserted route and ORIGINAL_DST cluster.
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

    // No hint: the gateway's own route, round robin over every pod, and a
    // client-supplied destination header never reaches a backend.
    let spoofed = [(DESTINATION, ids[2].as_str())];
    let mut served = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let response = within(client.get_with("/v1/models", &spoofed)).await?;
        assert_eq!(response.status, 200, "{}", context());
        assert_eq!(backend_report(&response)?["destination"], "");
        served.insert(response.served_by().unwrap_or_default().to_owned());
    }
    assert_eq!(served.len(), 3, "round robin over every pod: {served:?}");
    Ok(())
}
