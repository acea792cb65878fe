//! `monitoring/grafana-dashboard.json` and `monitoring/alerts.yaml` reference
//! only metrics the binaries export: a real server (with a policy file, after
//! a lookup, so labelled families exist) and a real KV-event subscriber are
//! started, their `/metrics` scraped, and every `inferencecache_*` name in
//! the dashboard's queries and the alert expressions must be one of theirs.
//! Also checks the two files' shape and that they cover what operators need.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use inference_cache_proto::v1alpha1::LookupRouteRequest;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_server::{ServeConfig, start};
use inference_cache_subscriber::{SubscribeArgs, Subscriber};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

async fn scrape(addr: SocketAddr) -> String {
    let page = crate::http::get(addr, "/metrics").await.expect("scrape");
    assert_eq!(page.status, 200, "{page:?}");
    page.body
}

/// Sample names a Prometheus text page exposes, from its `# TYPE` lines.
fn exported(page: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in page.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("#") || words.next() != Some("TYPE") {
            continue;
        }
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_owned());
            }
        }
    }
    names
}

/// Every `inferencecache_*` identifier in `text`.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("inferencecache_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

async fn live_metrics() -> BTreeSet<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: d, namespace: \"*\"}\nspec: {}\n",
    )
    .expect("write policy");
    let mut config = ServeConfig::ephemeral();
    config.index.policy_file = Some(policy);
    let server = start(config).await.expect("server starts");
    let mut client = InferenceCacheClient::connect(format!("http://{}", server.grpc_addr))
        .await
        .expect("connect");
    client
        .lookup_route(LookupRouteRequest {
            tenant_id: "t".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            token_ids: (0..64).collect(),
            ..LookupRouteRequest::default()
        })
        .await
        .expect("lookup");
    let server_url = format!("http://{}", server.grpc_addr);
    let args = SubscribeArgs::try_parse_from([
        "subscribe",
        "--endpoint",
        "tcp://127.0.0.1:1",
        "--server",
        &server_url,
        "--replica-id",
        "127.0.0.1:8000",
        "--tenant",
        "t",
        "--model",
        "m",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .expect("flags");
    let subscriber = Subscriber::start(args.resolve().expect("settings"))
        .await
        .expect("subscriber starts");
    // Let the subscriber announce its replica (ingest metrics move).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut names = exported(&scrape(server.admin_addr).await);
    names.extend(exported(
        &scrape(subscriber.metrics_addr().expect("metrics listener")).await,
    ));
    subscriber.shutdown().await;
    server.shutdown_token().cancel();
    server.wait().await.expect("server stops");
    names
}

fn dashboard_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("monitoring/grafana-dashboard.json"))
        .expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut exprs = Vec::new();
    for panel in panels {
        assert!(
            ids.insert(panel["id"].as_u64().expect("id")),
            "unique panel ids"
        );
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has queries", panel["title"]);
        for target in targets {
            exprs.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    exprs
}

fn alert_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("monitoring/alerts.yaml")).expect("alerts");
    let rules: serde_yaml::Value = serde_yaml::from_str(&text).expect("alerts YAML");
    let mut exprs = Vec::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("alert name");
            assert!(rule["labels"]["severity"].is_string(), "{name}: severity");
            assert!(
                rule["annotations"]["summary"].is_string(),
                "{name}: summary"
            );
            exprs.push(rule["expr"].as_str().expect("expr").to_owned());
        }
    }
    exprs
}

#[tokio::test]
async fn dashboard_and_alerts_reference_only_exported_metrics() {
    let exported = live_metrics().await;
    let dashboard = referenced(&dashboard_exprs().join("\n"));
    let alerts = referenced(&alert_exprs().join("\n"));
    for name in dashboard.iter().chain(&alerts) {
        assert!(
            exported.contains(name),
            "{name} is not exported by the server or the subscriber; exported: {exported:?}"
        );
    }
    for needed in [
        "inferencecache_lookup_route_calls_total",
        "inferencecache_lookup_route_latency_seconds_bucket",
        "inferencecache_index_entries",
        "inferencecache_index_evictions_total",
        "inferencecache_subscriber_buffer_items",
        "inferencecache_subscriber_buffer_dropped_total",
        "inferencecache_subscriber_batches_missed_total",
    ] {
        assert!(dashboard.contains(needed), "dashboard shows {needed}");
    }
    for needed in [
        "inferencecache_lookup_route_calls_total",
        "inferencecache_ingest_updates_total",
        "inferencecache_subscriber_batches_missed_total",
    ] {
        assert!(alerts.contains(needed), "alerts use {needed}");
    }
}

#[test]
fn referenced_names_are_found_in_expressions() {
    let names = referenced(
        "sum(rate(inferencecache_a_total{x=\"inferencecache_b\"}[5m])) / inferencecache_c",
    );
    assert_eq!(
        names,
        [
            "inferencecache_a_total",
            "inferencecache_b",
            "inferencecache_c"
        ]
        .into_iter()
        .map(str::to_owned)
        .collect()
    );
    let page = "# TYPE inferencecache_x counter\n# TYPE inferencecache_h histogram\n# TYPE inferencecache_g gauge\n";
    let names = exported(page);
    assert!(names.contains("inferencecache_x_total") && names.contains("inferencecache_h_bucket"));
    assert!(names.contains("inferencecache_g") && !names.contains("inferencecache_x"));
}
