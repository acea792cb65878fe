//! The Envoy configuration an Istio ingress gateway runs once
//! `envoy/istio/envoyfilter.yaml` is applied: the manifest's patches applied,
//! with Istio's rules (ADD, MERGE, INSERT_BEFORE, INSERT_FIRST), to the
//! gateway stand-in `tests/fixtures/istio-gateway.yaml`.
//!
//! Two things Istio does at run time are done here instead. The extension
//! config the manifest ADDs is served to Envoy over ECDS from a file, where
//! istiod serves it over ADS. Its `remote` wasm module becomes the local
//! build, which is what istio-agent hands Envoy after downloading the module.
//! Every patch must match something in the gateway configuration, and an
//! operation not implemented here is an error, so an edit to the manifest
//! cannot silently test less. MERGE follows Istio's protobuf merge: objects
//! merge field by field, lists append, scalars replace.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};

/// Where the gateway's clusters point.
pub struct Gateway {
    /// gRPC address of the inference-cache server.
    pub grpc: SocketAddr,
    /// Model-server replicas behind the gateway's default route.
    pub backends: Vec<SocketAddr>,
    /// Plugin `timeout_ms` (the manifest's 20 ms is tight on a loaded test machine).
    pub timeout_ms: u64,
    /// Plugin `expose_reason_header` (the manifest has it off).
    pub expose_reason: bool,
}

/// Cluster the manifest's plugin configuration names for the server.
const SERVER_CLUSTER: &str = "outbound|9090||inference-cache.llm-gateway.svc.cluster.local";
/// Cluster of the gateway's default route.
const POOL_CLUSTER: &str = "outbound|8000||vllm.llm-gateway.svc.cluster.local";

/// Writes the ECDS file into `dir` and returns the bootstrap (JSON text).
pub fn render(
    gateway: &Gateway,
    wasm: &Path,
    dir: &Path,
    listen: u16,
    admin: u16,
) -> anyhow::Result<String> {
    let root = crate::proxy_wasm_host::repo_root();
    let mut bootstrap = read_yaml(&root.join("tests/fixtures/istio-gateway.yaml"))?;
    let manifest = read_yaml(&root.join("envoy/istio/envoyfilter.yaml"))?;

    bootstrap["admin"]["address"]["socket_address"]["port_value"] = json!(admin);
    for listener in listeners(&mut bootstrap) {
        listener["address"]["socket_address"]["port_value"] = json!(listen);
    }
    set_endpoints(&mut bootstrap, SERVER_CLUSTER, &[gateway.grpc])?;
    set_endpoints(&mut bootstrap, POOL_CLUSTER, &gateway.backends)?;

    let mut extensions = apply_patches(&mut bootstrap, &manifest)?;
    ensure!(
        !extensions.is_empty(),
        "envoy/istio/envoyfilter.yaml adds no extension config"
    );
    for extension in &mut extensions {
        localise(extension, wasm, gateway)?;
    }
    let ecds = dir.join("ecds.json");
    let resources: Vec<Value> = extensions
        .iter()
        .map(|extension| {
            json!({
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": extension["name"],
                "typed_config": extension["typed_config"],
            })
        })
        .collect();
    std::fs::write(&ecds, json!({ "resources": resources }).to_string())?;
    serve_ecds_from(&mut bootstrap, &ecds)?;
    Ok(bootstrap.to_string())
}

fn read_yaml(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The elements of the array at `value[key]` (none when absent).
fn items<'a>(value: &'a mut Value, key: &'static str) -> impl Iterator<Item = &'a mut Value> {
    value
        .get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
}

fn listeners(bootstrap: &mut Value) -> impl Iterator<Item = &mut Value> {
    items(&mut bootstrap["static_resources"], "listeners")
}

/// The typed configs of every network filter called `name`.
fn network_filters<'a>(
    bootstrap: &'a mut Value,
    name: &'a str,
) -> impl Iterator<Item = &'a mut Value> {
    listeners(bootstrap)
        .flat_map(|listener| items(listener, "filter_chains"))
        .flat_map(|chain| items(chain, "filters"))
        .filter(move |filter| filter["name"] == name)
        .map(|filter| &mut filter["typed_config"])
}

fn set_endpoints(bootstrap: &mut Value, cluster: &str, addrs: &[SocketAddr]) -> anyhow::Result<()> {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|addr| {
            json!({ "endpoint": { "address": { "socket_address": {
                "address": addr.ip().to_string(), "port_value": addr.port() } } } })
        })
        .collect();
    let found = items(&mut bootstrap["static_resources"], "clusters")
        .find(|c| c["name"] == cluster)
        .with_context(|| format!("gateway fixture has no cluster {cluster}"))?;
    found["load_assignment"]["endpoints"] = json!([{ "lb_endpoints": endpoints }]);
    Ok(())
}

fn text<'a>(value: &'a Value, pointer: &str, what: &str) -> anyhow::Result<&'a str> {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .with_context(|| format!("{what}: no {pointer}"))
}

/// Applies every patch; returns the extension configs the manifest adds.
fn apply_patches(bootstrap: &mut Value, manifest: &Value) -> anyhow::Result<Vec<Value>> {
    let patches = manifest
        .pointer("/spec/configPatches")
        .and_then(Value::as_array)
        .context("envoy/istio/envoyfilter.yaml: no spec.configPatches")?;
    let mut extensions = Vec::new();
    for (index, patch) in patches.iter().enumerate() {
        let apply_to = text(patch, "/applyTo", "configPatches")?;
        let operation = text(patch, "/patch/operation", "configPatches")?;
        let what = format!("envoyfilter.yaml configPatches[{index}] ({apply_to} {operation})");
        ensure!(
            patch.pointer("/match/context").and_then(Value::as_str) == Some("GATEWAY"),
            "{what}: match.context must be GATEWAY"
        );
        let value = patch
            .pointer("/patch/value")
            .with_context(|| format!("{what}: no patch.value"))?;
        let applied = match (apply_to, operation) {
            ("EXTENSION_CONFIG", "ADD") => {
                extensions.push(value.clone());
                1
            }
            ("CLUSTER", "MERGE") => {
                let name = cluster_name(patch, &what)?;
                let mut count = 0;
                for cluster in items(&mut bootstrap["static_resources"], "clusters") {
                    if cluster["name"] == name.as_str() {
                        merge(cluster, value);
                        count += 1;
                    }
                }
                count
            }
            ("NETWORK_FILTER", "MERGE") => {
                let network = text(patch, "/match/listener/filterChain/filter/name", &what)?;
                let mut count = 0;
                for typed_config in network_filters(bootstrap, network) {
                    let patch_config = value
                        .get("typed_config")
                        .with_context(|| format!("{what}: no typed_config"))?;
                    ensure!(
                        typed_config["@type"] == patch_config["@type"],
                        "{what}: typed_config @type differs from the filter's"
                    );
                    merge(typed_config, patch_config);
                    count += 1;
                }
                count
            }
            ("HTTP_ROUTE", "MERGE") => {
                let vhost = text(patch, "/match/routeConfiguration/vhost/name", &what)?;
                let route_name = patch
                    .pointer("/match/routeConfiguration/vhost/route/name")
                    .and_then(Value::as_str);
                let mut count = 0;
                for hcm in
                    network_filters(bootstrap, "envoy.filters.network.http_connection_manager")
                {
                    for host in items(&mut hcm["route_config"], "virtual_hosts") {
                        if host["name"] != vhost {
                            continue;
                        }
                        for route in items(host, "routes") {
                            if route_name.is_none_or(|name| route["name"] == name) {
                                merge(route, value);
                                count += 1;
                            }
                        }
                    }
                }
                count
            }
            ("CLUSTER", "ADD") => {
                let clusters = bootstrap["static_resources"]["clusters"]
                    .as_array_mut()
                    .context("gateway fixture has no clusters")?;
                clusters.push(value.clone());
                1
            }
            ("LISTENER", "MERGE") => {
                let mut count = 0;
                for listener in listeners(bootstrap) {
                    merge(listener, value);
                    count += 1;
                }
                count
            }
            ("HTTP_FILTER", "INSERT_BEFORE") => {
                let network = text(patch, "/match/listener/filterChain/filter/name", &what)?;
                let before = text(
                    patch,
                    "/match/listener/filterChain/filter/subFilter/name",
                    &what,
                )?;
                let mut count = 0;
                for hcm in network_filters(bootstrap, network) {
                    let Some(filters) = hcm["http_filters"].as_array_mut() else {
                        continue;
                    };
                    if let Some(at) = filters.iter().position(|f| f["name"] == before) {
                        filters.insert(at, value.clone());
                        count += 1;
                    }
                }
                count
            }
            ("HTTP_ROUTE", "INSERT_FIRST") => {
                let vhost = text(patch, "/match/routeConfiguration/vhost/name", &what)?;
                let mut count = 0;
                for hcm in
                    network_filters(bootstrap, "envoy.filters.network.http_connection_manager")
                {
                    for host in items(&mut hcm["route_config"], "virtual_hosts") {
                        if host["name"] == vhost
                            && let Some(routes) = host["routes"].as_array_mut()
                        {
                            routes.insert(0, value.clone());
                            count += 1;
                        }
                    }
                }
                count
            }
            _ => bail!("{what}: not an operation this test applies"),
        };
        ensure!(applied > 0, "{what}: matched nothing in the gateway");
    }
    Ok(extensions)
}

/// The cluster a CLUSTER patch matches: `match.cluster.name`, or Istio's
/// name for `match.cluster.service` and `portNumber` (no subset).
fn cluster_name(patch: &Value, what: &str) -> anyhow::Result<String> {
    if let Some(name) = patch.pointer("/match/cluster/name").and_then(Value::as_str) {
        return Ok(name.to_owned());
    }
    let service = text(patch, "/match/cluster/service", what)?;
    let port = patch
        .pointer("/match/cluster/portNumber")
        .and_then(Value::as_u64)
        .with_context(|| format!("{what}: no /match/cluster/portNumber"))?;
    Ok(format!("outbound|{port}||{service}"))
}

/// Istio's MERGE: objects merge key by key, lists append, scalars replace.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                match target.get_mut(key) {
                    Some(existing) => merge(existing, value),
                    None => {
                        target.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (Value::Array(target), Value::Array(patch)) => target.extend(patch.iter().cloned()),
        (target, patch) => *target = patch.clone(),
    }
}

/// What istio-agent does to a wasm extension config: the `remote` module
/// becomes a local file. Also sets the plugin's `timeout_ms` and
/// `expose_reason_header`.
fn localise(extension: &mut Value, wasm: &Path, gateway: &Gateway) -> anyhow::Result<()> {
    let config = extension
        .pointer_mut("/typed_config/config")
        .context("extension config: no typed_config.config")?;
    let code = config
        .pointer_mut("/vm_config/code")
        .context("extension config: no vm_config.code")?;
    ensure!(
        code.pointer("/remote/http_uri/uri").is_some(),
        "extension config: the module should be fetched from vm_config.code.remote.http_uri"
    );
    *code = json!({ "local": { "filename": wasm } });
    let plugin = config
        .pointer_mut("/configuration/value")
        .context("extension config: no configuration.value")?;
    let mut settings: Value = serde_json::from_str(
        plugin
            .as_str()
            .context("extension config: configuration.value is not a string")?,
    )
    .context("extension config: configuration.value is not JSON")?;
    settings["timeout_ms"] = json!(gateway.timeout_ms);
    settings["expose_reason_header"] = json!(gateway.expose_reason);
    *plugin = Value::String(settings.to_string());
    Ok(())
}

/// Points every ADS-sourced filter config at the ECDS file instead.
fn serve_ecds_from(bootstrap: &mut Value, ecds: &Path) -> anyhow::Result<()> {
    let mut count = 0;
    for hcm in network_filters(bootstrap, "envoy.filters.network.http_connection_manager") {
        for filter in items(hcm, "http_filters") {
            if let Some(source) = filter.pointer_mut("/config_discovery/config_source")
                && let Some(fields) = source.as_object_mut()
                && fields.remove("ads").is_some()
            {
                fields.insert("path_config_source".into(), json!({ "path": ecds }));
                count += 1;
            }
        }
    }
    ensure!(count > 0, "no HTTP filter takes its config over ECDS");
    Ok(())
}
