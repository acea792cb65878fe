//! The demo's Envoy: a real Envoy process in front of the engine pool, with
//! the compiled inference-cache filter (the inference-cache run) or without
//! it (the round-robin run). The configuration is `envoy/envoy.yaml`'s,
//! reduced to what the demo needs: one listener, the filter (tenant fixed to
//! the demo's, replica ids used as endpoints, the reason header exposed so
//! the demo can count outcomes), the policy server's cluster, and the pool
//! cluster with `override_host` over round robin.
//!
//! Envoy writes its log next to its generated configuration in a fresh
//! directory under the system temporary directory; the process is killed
//! when the [`EnvoyGateway`] is dropped.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{Value, json};

/// A running Envoy; killed on drop.
#[derive(Debug)]
pub struct EnvoyGateway {
    child: Child,
    listener: SocketAddr,
    dir: PathBuf,
}

/// `envoy` on `PATH`, else the binary `scripts/setup-envoy.sh` installs
/// (`$ENVOY_BIN`, then `.cache/envoy/bin/envoy` under the working directory).
pub fn find_envoy() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("envoy"))
            .find(|candidate| candidate.is_file())
    });
    on_path
        .or_else(|| std::env::var_os("ENVOY_BIN").map(PathBuf::from))
        .or_else(|| Some(PathBuf::from(".cache/envoy/bin/envoy")))
        .filter(|path| path.is_file())
}

/// The filter built by `cargo build -p inference-cache-filter --target
/// wasm32-wasip1 --profile wasm`, under `$CARGO_TARGET_DIR` or `target/`.
pub fn find_filter_wasm() -> Option<PathBuf> {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), PathBuf::from);
    Some(target.join("wasm32-wasip1/wasm/inference_cache_filter.wasm"))
        .filter(|path| path.is_file())
}

impl EnvoyGateway {
    /// Starts Envoy in front of `engines`, with the filter asking `grpc`
    /// when `with_filter`; returns once its listener accepts connections.
    pub async fn start(
        binary: &Path,
        wasm: &Path,
        engines: &[SocketAddr],
        grpc: SocketAddr,
        with_filter: bool,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let port = free_port()?;
        let listener = SocketAddr::from(([127, 0, 0, 1], port));
        let wasm =
            std::fs::canonicalize(wasm).with_context(|| format!("filter {}", wasm.display()))?;
        let config = bootstrap(port, &wasm, engines, grpc, with_filter, timeout);
        let dir = std::env::temp_dir().join(format!(
            "inference-cache-demo-envoy-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        let config_path = dir.join("envoy.json");
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        let log = std::fs::File::create(dir.join("envoy.log"))?;
        let child = Command::new(binary)
            .arg("-c")
            .arg(&config_path)
            .args(["--base-id", &port.to_string(), "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting Envoy {}", binary.display()))?;
        let mut gateway = Self {
            child,
            listener,
            dir,
        };
        for _ in 0..300 {
            if let Ok(Some(status)) = gateway.child.try_wait() {
                anyhow::bail!("Envoy exited ({status}):\n{}", gateway.log_tail());
            }
            if tokio::net::TcpStream::connect(listener).await.is_ok() {
                return Ok(gateway);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!(
            "Envoy did not listen on {listener} within 15 s:\n{}",
            gateway.log_tail()
        )
    }

    /// The last lines of Envoy's log, for error messages.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The client-facing listener.
    pub fn listener(&self) -> SocketAddr {
        self.listener
    }
}

impl Drop for EnvoyGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn socket(addr: SocketAddr) -> Value {
    json!({"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}})
}

fn bootstrap(
    port: u16,
    wasm: &Path,
    engines: &[SocketAddr],
    grpc: SocketAddr,
    with_filter: bool,
    timeout: Duration,
) -> Value {
    let settings = crate::gateway::filter_settings(timeout);
    let plugin = json!({
        "grpc_cluster": "inference_cache",
        "timeout_ms": settings.timeout.as_millis() as u64,
        "tenant": {"fixed": crate::TENANT},
        "hash_scheme": settings.hash_scheme,
        "block_size": settings.block_size,
        "replica_id_is_endpoint": true,
        "expose_reason_header": true,
        "max_body_bytes": 4_194_304,
    });
    let mut filters = Vec::new();
    if with_filter {
        filters.push(json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "inference_cache",
                    "root_id": "inference_cache",
                    "allow_on_headers_stop_iteration": true,
                    "failure_policy": "FAIL_OPEN",
                    "vm_config": {
                        "vm_id": "inference_cache",
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": {"local": {"filename": wasm.display().to_string()}},
                    },
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": plugin.to_string(),
                    },
                },
            },
        }));
    }
    filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }));
    let round_robin = json!({"typed_extension_config": {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
    }});
    let pool_policy = if with_filter {
        json!({"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": settings.destination_header}],
                "fallback_policy": {"policies": [round_robin]},
            },
        }}]})
    } else {
        json!({"policies": [round_robin]})
    };
    json!({
        "static_resources": {
            "listeners": [{
                "name": "demo",
                "address": socket(SocketAddr::from(([127, 0, 0, 1], port))),
                "per_connection_buffer_limit_bytes": 8_388_608,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "demo",
                        "early_header_mutation_extensions": [{
                            "name": "envoy.http.early_header_mutation.header_mutation",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                                "mutations": [{"remove": settings.destination_header}],
                            },
                        }],
                        "route_config": {"virtual_hosts": [{
                            "name": "inference",
                            "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "inference_pool", "timeout": "300s"}}],
                        }]},
                        "http_filters": filters,
                    },
                }]}],
            }],
            "clusters": [
                {
                    "name": "inference_cache",
                    "type": "STATIC",
                    "connect_timeout": "0.25s",
                    "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }},
                    "load_assignment": {"cluster_name": "inference_cache", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket(grpc)}}]}]},
                },
                {
                    "name": "inference_pool",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "per_connection_buffer_limit_bytes": 8_388_608,
                    "load_balancing_policy": pool_policy,
                    "load_assignment": {
                        "cluster_name": "inference_pool",
                        "endpoints": [{"lb_endpoints": engines.iter().map(|e| json!({"endpoint": {"address": socket(*e)}})).collect::<Vec<_>>()}],
                    },
                },
            ],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_only_in_the_inference_cache_configuration() {
        let engines = [
            SocketAddr::from(([127, 0, 0, 1], 8001)),
            SocketAddr::from(([127, 0, 0, 1], 8002)),
        ];
        let grpc = SocketAddr::from(([127, 0, 0, 1], 9090));
        let with = bootstrap(
            10000,
            Path::new("/f.wasm"),
            &engines,
            grpc,
            true,
            Duration::from_millis(20),
        )
        .to_string();
        let without = bootstrap(
            10000,
            Path::new("/f.wasm"),
            &engines,
            grpc,
            false,
            Duration::from_millis(20),
        )
        .to_string();
        assert!(with.contains("envoy.filters.http.wasm") && with.contains("override_host"));
        assert!(!without.contains("envoy.filters.http.wasm") && !without.contains("override_host"));
        assert!(
            with.contains("8002")
                && with.contains("9090")
                && with.contains("\\\"fixed\\\":\\\"demo\\\"")
        );
    }
}
