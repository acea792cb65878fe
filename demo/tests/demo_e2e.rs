//! `inference-cache demo`, short runs end to end: the real policy server,
//! simulated engines publishing vLLM KV events over ZMQ, one real subscriber
//! per engine, and the gateway — the filter's logic in-process, and a real
//! Envoy with the compiled filter. Both runs must complete without a failed
//! request, and routing by inference-cache must reuse more of the engines'
//! caches than round-robin.
//!
//! The Envoy test needs `scripts/setup-envoy.sh` (Envoy from PyPI) and the
//! filter built with `cargo build -p inference-cache-filter --target
//! wasm32-wasip1 --profile wasm` (both done by `scripts/test.sh` before the
//! tests); it fails, naming what is missing, otherwise.

use std::path::{Path, PathBuf};

use inference_cache_demo::{
    DemoArgs, DemoReport, INFERENCE_CACHE_RUN, PolicyServer, ROUND_ROBIN_RUN, RunSummary,
};
use inference_cache_server::{ServeConfig, start};

/// The demo runs take the whole (small) machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

async fn short_demo(extra: &[&str]) -> DemoReport {
    let server = start(ServeConfig::ephemeral())
        .await
        .expect("server starts");
    let mut args = vec![
        "demo",
        "--requests",
        "120",
        "--sessions",
        "16",
        "--duration",
        "8s",
        "--quiet",
        // Debug builds on a shared two-core machine: a wide lookup budget,
        // so what is measured is routing, not timeouts.
        "--lookup-timeout",
        "500ms",
    ];
    args.extend_from_slice(extra);
    let args = DemoArgs::try_parse_from(args).expect("demo flags");
    let report = inference_cache_demo::run(
        args,
        PolicyServer {
            grpc_addr: server.grpc_addr,
        },
    )
    .await
    .expect("demo runs");
    server.shutdown_token().cancel();
    server.wait().await.expect("server stops");
    report
}

fn check(report: &DemoReport) -> (&RunSummary, &RunSummary) {
    let [ic, rr] = report.runs.as_slice() else {
        panic!("two runs expected: {:?}", report.runs);
    };
    assert_eq!(ic.name, INFERENCE_CACHE_RUN);
    assert_eq!(rr.name, ROUND_ROBIN_RUN);
    for run in [ic, rr] {
        assert_eq!(run.total, 120, "{run:?}");
        assert_eq!(run.done, 120, "every request answered: {run:?}");
        assert_eq!(run.failed, 0, "{run:?}");
        assert!(
            run.ttft_p50_ms > 0.0 && run.ttft_p99_ms >= run.ttft_p50_ms,
            "{run:?}"
        );
        assert_eq!(run.per_engine.len(), 4, "every engine served: {run:?}");
    }
    assert!(
        ic.outcomes.get("PREFIX_MATCH").copied().unwrap_or(0) > 0,
        "the server's index was fed by the subscribers and routed on it: {ic:?}"
    );
    assert!(
        ic.hit_rate > rr.hit_rate,
        "inference-cache {:.3} vs round-robin {:.3}",
        ic.hit_rate,
        rr.hit_rate
    );
    (ic, rr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_gateway_beats_round_robin() {
    let _serial = SERIAL.lock().await;
    let report = short_demo(&["--no-envoy"]).await;
    assert!(
        report.gateway.starts_with("in-process"),
        "{}",
        report.gateway
    );
    let (_, rr) = check(&report);
    assert_eq!(rr.outcomes.get("ROUND_ROBIN").copied(), Some(120), "{rr:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_with_the_filter_beats_round_robin() {
    let _serial = SERIAL.lock().await;
    let root = repo_root();
    let envoy = std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cache/envoy/bin/envoy"));
    assert!(
        envoy.is_file(),
        "no Envoy at {}: run scripts/setup-envoy.sh (or set ENVOY_BIN)",
        envoy.display()
    );
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let wasm = target.join("wasm32-wasip1/wasm/inference_cache_filter.wasm");
    assert!(
        wasm.is_file(),
        "no filter at {}: run cargo build -p inference-cache-filter --target wasm32-wasip1 --profile wasm",
        wasm.display()
    );
    let (envoy, wasm) = (envoy.display().to_string(), wasm.display().to_string());
    let report = short_demo(&["--envoy", &envoy, "--filter-wasm", &wasm]).await;
    assert!(report.gateway.starts_with("Envoy"), "{}", report.gateway);
    let (ic, rr) = check(&report);
    // Envoy's round-robin run has no filter, so no reason header; with the
    // filter every response carries one.
    assert_eq!(rr.outcomes.get("ROUND_ROBIN").copied(), Some(120), "{rr:?}");
    assert!(
        !ic.outcomes.contains_key("NO_REASON_HEADER"),
        "the filter handled every request: {ic:?}"
    );
}
