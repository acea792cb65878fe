//! `deploy/` renders with `kubectl kustomize` (every overlay and the base),
//! and what it renders agrees with the binary: every `inference-cache` flag
//! in a container's args is one `--help` lists, container ports are the
//! ports the listen flags name, probes hit the admin listener's `/readyz` and
//! `/healthz`, the Service and the gateway configuration name the server's
//! real port, the subscriber sidecar and vLLM's `--kv-events-config` agree on
//! the ZMQ ports and the block size, and the policy ConfigMap is a policy the
//! server accepts.
//!
//! Needs a kubectl with kustomize v4.1+: `scripts/setup-kubectl.sh` (run by
//! `scripts/test.sh`) provides one; the test fails, saying so, without it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize as _;
use serde_yaml::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

fn kubectl() -> PathBuf {
    if let Some(path) = std::env::var_os("KUBECTL") {
        return PathBuf::from(path);
    }
    let cached = repo_root().join(".cache/kubectl/bin/kubectl");
    if cached.is_file() {
        return cached;
    }
    PathBuf::from("kubectl")
}

/// `kubectl kustomize <dir>` as a list of objects.
fn render(dir: &str) -> Vec<Value> {
    let output = Command::new(kubectl())
        .arg("kustomize")
        .arg(repo_root().join(dir))
        .output()
        .unwrap_or_else(|e| panic!("running kubectl (scripts/setup-kubectl.sh installs one): {e}"));
    assert!(
        output.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("utf-8");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn kinds(objects: &[Value]) -> BTreeSet<String> {
    objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or("?"),
                o["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

/// The `--flags` `inference-cache <subcommand> --help` documents.
fn help_flags(subcommand: &str) -> BTreeSet<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_inference-cache"))
        .args([subcommand, "--help"])
        .output()
        .expect("run --help");
    assert!(output.status.success());
    String::from_utf8_lossy(&output.stdout)
        .split(|c: char| c.is_whitespace() || c == ',' || c == '=')
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .map(|word| {
            word.trim_end_matches(|c: char| !c.is_alphanumeric() && c != '-')
                .to_owned()
        })
        .collect()
}

fn container<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_owned())
        .collect()
}

/// Value of `--name=value` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
    let prefix = format!("{name}=");
    args.iter()
        .find_map(|a| a.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {name}= in {args:?}"))
}

fn assert_flags_known(args: &[String], subcommand: &str) {
    assert_eq!(args[0], subcommand);
    let known = help_flags(subcommand);
    for arg in &args[1..] {
        let name = arg.split('=').next().unwrap_or(arg);
        assert!(
            known.contains(name),
            "{name} is not a flag of `inference-cache {subcommand}`: {known:?}"
        );
    }
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port")
}

fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_sequence()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no port {name}"))
}

fn check_server(objects: &[Value]) {
    let deployment = find(objects, "Deployment", "inference-cache");
    let server = container(deployment, "server");
    let args = args(server);
    assert_flags_known(&args, "serve");
    let grpc = port_of(flag(&args, "--grpc-addr"));
    let admin = port_of(flag(&args, "--admin-addr"));
    assert!(
        flag(&args, "--admin-addr").starts_with("0.0.0.0:"),
        "kubelet probes need a non-loopback admin address"
    );
    assert_eq!(container_port(server, "grpc"), grpc);
    assert_eq!(container_port(server, "admin"), admin);
    assert_eq!(server["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(server["livenessProbe"]["httpGet"]["path"], "/healthz");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(server[probe]["httpGet"]["port"], "admin");
    }
    assert_eq!(server["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(server["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
        true
    );
    assert!(server["resources"]["requests"]["cpu"].is_string());
    assert!(server["resources"]["requests"]["memory"].is_string());

    // The policy ConfigMap is mounted as a directory (a subPath mount never
    // sees the kubelet's ..data swap) where --policy-file points, and parses.
    let policy_path = flag(&args, "--policy-file");
    let mount = server["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| policy_path.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap_or("-"))))
        .expect("the policy file's directory is mounted");
    assert!(
        mount["subPath"].is_null(),
        "no subPath: it would not hot-reload"
    );
    let volume = deployment["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("volume");
    let configmap = find(
        objects,
        "ConfigMap",
        volume["configMap"]["name"].as_str().expect("name"),
    );
    let file = policy_path.rsplit('/').next().expect("file name");
    let text = configmap["data"][file]
        .as_str()
        .expect("policy in the ConfigMap");
    let dir = tempfile::tempdir().expect("tempdir");
    let local = dir.path().join(file);
    std::fs::write(&local, text).expect("write");
    let check = Command::new(env!("CARGO_BIN_EXE_inference-cache"))
        .args([
            "serve",
            "--grpc-addr=127.0.0.1:0",
            "--admin-addr=127.0.0.1:0",
            "--templates-dir",
            "/nonexistent",
        ])
        .arg(format!("--policy-file={}", local.display()))
        .arg("--shutdown-delay=0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("serve");
    // A bad policy fails start-up at once; a good one keeps serving.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let mut check = check;
    let exited = check.try_wait().expect("try_wait");
    let _ = check.kill();
    let output = check.wait_with_output().expect("wait");
    assert!(
        exited.is_none(),
        "the ConfigMap's policy is refused: {}",
        String::from_utf8_lossy(&output.stderr)
    );

    let service = find(objects, "Service", "inference-cache");
    let ports = service["spec"]["ports"].as_sequence().expect("ports");
    let by_target = |target: &str| {
        ports
            .iter()
            .find(|p| p["targetPort"] == target)
            .unwrap_or_else(|| panic!("no Service port to {target}"))
    };
    assert_eq!(by_target("grpc")["port"].as_u64(), Some(grpc));
    assert!(
        by_target("grpc")["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("grpc"))
    );
    assert_eq!(by_target("admin")["port"].as_u64(), Some(admin));
    let selector = &service["spec"]["selector"];
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (key, value) in selector.as_mapping().expect("selector") {
        assert_eq!(&labels[key], value, "Service selects the server pods");
    }
    let pdb = find(objects, "PodDisruptionBudget", "inference-cache");
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
}

#[test]
fn base_renders_the_server() {
    let objects = render("deploy/base");
    assert_eq!(
        kinds(&objects),
        [
            "ConfigMap/inference-cache-policy",
            "Deployment/inference-cache",
            "PodDisruptionBudget/inference-cache",
            "Service/inference-cache",
            "ServiceAccount/inference-cache",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect()
    );
    check_server(&objects);
}

#[test]
fn vllm_overlay_adds_a_subscriber_that_agrees_with_vllm_and_the_server() {
    let objects = render("deploy/overlays/vllm-example");
    check_server(&objects);
    let vllm = find(&objects, "Deployment", "vllm");
    let engine = container(vllm, "vllm");
    let engine_args = args(engine);
    let events: serde_json::Value = serde_json::from_str(flag(&engine_args, "--kv-events-config"))
        .expect("--kv-events-config is JSON");
    assert_eq!(events["enable_kv_cache_events"], true);
    assert_eq!(events["publisher"], "zmq");
    assert!(engine_args.iter().any(|a| a == "--enable-prefix-caching"));

    let sidecar = container(vllm, "kv-subscriber");
    let sidecar_args = args(sidecar);
    assert_flags_known(&sidecar_args, "subscribe");
    let endpoint_port = |key: &str| port_of(events[key].as_str().expect("endpoint"));
    assert_eq!(
        port_of(flag(&sidecar_args, "--endpoint")),
        endpoint_port("endpoint")
    );
    assert_eq!(
        port_of(flag(&sidecar_args, "--replay-endpoint")),
        endpoint_port("replay_endpoint")
    );
    assert_eq!(
        flag(&sidecar_args, "--block-size"),
        flag(&engine_args, "--block-size")
    );
    assert_eq!(
        port_of(flag(&sidecar_args, "--engine-metrics-url").trim_end_matches("/metrics")),
        container_port(engine, "http")
    );
    assert_eq!(
        container_port(sidecar, "sub-metrics"),
        port_of(flag(&sidecar_args, "--metrics-listen"))
    );

    // The sidecar reports to the server's Service, in its namespace, on its gRPC port.
    let service = find(&objects, "Service", "inference-cache");
    let namespace = service["metadata"]["namespace"]
        .as_str()
        .expect("namespace");
    let grpc_port = service["spec"]["ports"][0]["port"].as_u64().expect("port");
    assert_eq!(
        flag(&sidecar_args, "--server"),
        format!("http://inference-cache.{namespace}.svc.cluster.local:{grpc_port}")
    );
    // Replica id = the pod's endpoint the gateway routes to; the other identity flags come from the environment.
    let env = sidecar["env"].as_sequence().expect("env");
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no env {name}"))
    };
    assert_eq!(
        var("REPLICA_ID")["value"],
        format!("$(POD_IP):{}", container_port(engine, "http")).as_str()
    );
    assert_eq!(
        var("POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert!(var("MODEL_ID")["value"].is_string());
    let help = help_flags("subscribe");
    assert!(help.contains("--replica-id") && help.contains("--tenant") && help.contains("--model"));
}

#[test]
fn istio_overlay_wires_the_filter_image_to_the_server_service() {
    let objects = render("deploy/overlays/istio");
    check_server(&objects);
    let filter = find(&objects, "EnvoyFilter", "inference-cache");
    let service = find(&objects, "Service", "inference-cache");
    let namespace = service["metadata"]["namespace"]
        .as_str()
        .expect("namespace");
    assert_eq!(filter["metadata"]["namespace"].as_str(), Some(namespace));
    let wasm = &filter["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"];
    assert_eq!(wasm["allow_on_headers_stop_iteration"], true);
    let uri = wasm["vm_config"]["code"]["remote"]["http_uri"]["uri"]
        .as_str()
        .expect("uri");
    assert_eq!(
        uri,
        "oci://ghcr.io/inference-cache/inference-cache-filter:0.1.0"
    );
    let plugin: serde_json::Value = serde_json::from_str(
        wasm["configuration"]["value"]
            .as_str()
            .expect("plugin config"),
    )
    .expect("JSON");
    let grpc_port = service["spec"]["ports"][0]["port"].as_u64().expect("port");
    assert_eq!(
        plugin["grpc_cluster"],
        format!("outbound|{grpc_port}||inference-cache.{namespace}.svc.cluster.local").as_str()
    );
}
