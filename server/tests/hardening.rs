//! Production hardening over real sockets: deadlines and floats from the
//! wire, request limits (each hit counted in /metrics), a flood of huge
//! prompts, template fuel, TLS and mTLS with certificates generated here,
//! producer authentication and tenant scoping, admin exposure, and the staged
//! shutdown (readiness first, a drain deadline that cuts open streams).

use crate::contract_support;

use std::path::Path;
use std::time::{Duration, Instant};

use contract_support::*;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{
    CacheStateUpdate, ChatMessage, GetCacheStateRequest, LookupRouteRequest, RenderTemplateRequest,
    ReplicaStats, cache_event,
};
use inference_cache_server::{ServeConfig, TlsFiles, start};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// A policy under which one matched block is a PREFIX_MATCH.
const OPEN: &str =
    "  minimumMatchedTokens: 0\n  routingFloorScore: \"0\"\n  affinityRouting: Disabled\n";

fn open_policy() -> String {
    policy_doc("*", OPEN)
}

async fn metric_at_least(h: &Harness, series: &str, min: f64) {
    let value = h.metric(series).await.unwrap_or(0.0);
    assert!(value >= min, "{series} = {value}, expected >= {min}");
}

// ---------------------------------------------------------------- deadlines, floats

#[tokio::test]
async fn huge_grpc_timeout_gets_a_normal_answer() {
    let mut h = Harness::start(&open_policy()).await;
    h.hold("A", &chain(0..2)).await;
    for timeout in ["9300000000000000000S", "99999999H", "18446744073709551615n"] {
        let mut request = tonic::Request::new(chain_lookup(&chain(0..2)));
        request
            .metadata_mut()
            .insert("grpc-timeout", timeout.parse().expect("ascii"));
        let answer = h
            .client
            .lookup_route(request)
            .await
            .unwrap_or_else(|status| panic!("{timeout}: {status}"))
            .into_inner();
        assert_eq!(answer.reason_code, "PREFIX_MATCH", "{timeout}");
        assert_eq!(ids(&answer), ["A"]);
    }
    metric_at_least(
        &h,
        "inferencecache_limit_hits_total{limit=\"grpc_timeout_clamped\"}",
        1.0,
    )
    .await;
    h.stop().await;
}

fn stats(replica: &str, hit_rate: f32, pressure: f32, kv: f32) -> CacheStateUpdate {
    CacheStateUpdate {
        stats: Some(ReplicaStats {
            replica_id: replica.into(),
            hit_rate,
            pressure,
            kv_cache_usage: kv,
            ..Default::default()
        }),
        ..update(replica, vec![])
    }
}

#[tokio::test]
async fn nan_and_negative_stats_are_dropped_and_over_one_clamped() {
    let mut h = Harness::start(&open_policy()).await;
    h.report(vec![
        stats("nan", f32::NAN, 0.5, 0.5),
        stats("inf", 0.5, f32::INFINITY, 0.5),
        stats("neg", 0.5, 0.5, -0.1),
        stats("big", 7.0, 0.5, 0.5),
    ])
    .await;
    let state = h
        .client
        .get_cache_state(GetCacheStateRequest {
            tenant_id: T.into(),
            model_id: M.into(),
        })
        .await
        .expect("state")
        .into_inner();
    for r in &state.replicas {
        for value in [r.hit_rate, r.pressure, r.kv_cache_usage] {
            assert!((0.0..=1.0).contains(&value), "{r:?}");
        }
    }
    let summary = state.summary.expect("summary");
    assert!(summary.mean_hit_rate.is_finite() && summary.mean_pressure.is_finite());
    for (reason, n) in [("not_finite", 2.0), ("negative", 1.0), ("clamped", 1.0)] {
        assert_eq!(
            h.metric(&format!(
                "inferencecache_stats_rejected_total{{reason=\"{reason}\"}}"
            ))
            .await,
            Some(n),
            "{reason}"
        );
    }
    h.stop().await;
}

// ---------------------------------------------------------------- limits

#[tokio::test]
async fn ingest_limits_drop_and_count() {
    let mut h = Harness::start_with(&open_policy(), |c| {
        c.limits.max_chain_blocks = 4;
        c.limits.max_update_entries = 6;
        c.limits.grpc_max_message_bytes = 64 << 10;
    })
    .await;
    // A 1 KiB hash under vllm (8-byte hashes), a 5-block chain, then 3 + 3 + 3 entries of a cap of 6.
    let wide = chain_entry(&[vec![7; 1 << 10]], 64);
    h.report(vec![update(
        "A",
        vec![
            wide,
            chain_entry(&chain(10..15), 64),
            chain_entry(&chain(20..23), 64),
            chain_entry(&chain(30..33), 64),
            chain_entry(&chain(40..43), 64),
        ],
    )])
    .await;
    assert_eq!(h.metric("inferencecache_index_entries").await, Some(6.0));
    for (limit, n) in [
        ("hash_bytes", 1.0),
        ("chain_blocks", 1.0),
        ("update_entries", 1.0),
    ] {
        assert_eq!(
            h.metric(&format!(
                "inferencecache_limit_hits_total{{limit=\"{limit}\"}}"
            ))
            .await,
            Some(n),
            "{limit}"
        );
    }
    // A message over --grpc-max-message-bytes: the stream is refused, the index unchanged.
    let huge = update("B", vec![chain_entry(&vec![vec![1; 8]; 10_000], 64)]);
    let refused = h
        .client
        .report_cache_state(tokio_stream::iter(vec![huge]))
        .await
        .expect_err("oversized message refused");
    assert_eq!(refused.code(), Code::OutOfRange, "{refused}");
    let big_prompt = LookupRouteRequest {
        prompt_text: "x".repeat(100 << 10),
        ..chain_lookup(&[])
    };
    let refused = h
        .client
        .lookup_route(big_prompt)
        .await
        .expect_err("oversized lookup refused");
    assert_eq!(refused.code(), Code::OutOfRange, "{refused}");
    metric_at_least(
        &h,
        "inferencecache_limit_hits_total{limit=\"grpc_message_bytes\"}",
        2.0,
    )
    .await;
    assert_eq!(h.metric("inferencecache_index_entries").await, Some(6.0));
    h.stop().await;
}

#[tokio::test]
async fn lookup_limits_cut_or_fail_open_and_count() {
    let mut h = Harness::start_with(&open_policy(), |c| {
        c.limits.max_chain_blocks = 4;
        c.limits.max_token_ids = 64;
        c.limits.max_template_variables = 2;
    })
    .await;
    h.hold("A", &chain(0..3)).await;
    // A 10-block chain is cut to its first 4 blocks: still a prefix, still a match.
    let answer = h.lookup(chain_lookup(&chain(0..10))).await;
    assert_eq!(answer.reason_code, "PREFIX_MATCH");
    assert_eq!(answer.replica_scores[0].matched_tokens, 3 * 64);
    // A hash wider than the scheme's 8 bytes: fail open.
    let mut wide = chain_lookup(&chain(0..3));
    wide.block_hashes[1] = vec![1; 9];
    assert_eq!(h.lookup(wide).await.reason_code, "NO_HINT");
    let exact = LookupRouteRequest {
        prefix_hash: vec![1; 4096],
        ..exact_lookup(0, 64)
    };
    assert_eq!(h.lookup(exact).await.reason_code, "NO_HINT");
    // 10k token ids are cut to 64: answered normally.
    let tokens = LookupRouteRequest {
        token_ids: (0..10_000).collect(),
        ..chain_lookup(&[])
    };
    let answer = h.lookup(tokens).await;
    assert!(answer.replica_scores.is_empty(), "{answer:?}");
    // RenderTemplate with more variables than allowed.
    let render = h
        .client
        .render_template(RenderTemplateRequest {
            template_ref: "any".into(),
            variables: (0..3).map(|i| (format!("v{i}"), "x".into())).collect(),
            tenant_id: T.into(),
        })
        .await
        .expect("render")
        .into_inner();
    assert_eq!(render.reason_code, "RENDER_ERROR");
    for (limit, n) in [
        ("chain_blocks", 1.0),
        ("hash_bytes", 2.0),
        ("token_ids", 1.0),
        ("template_variables", 1.0),
    ] {
        assert_eq!(
            h.metric(&format!(
                "inferencecache_limit_hits_total{{limit=\"{limit}\"}}"
            ))
            .await,
            Some(n),
            "{limit}"
        );
    }
    h.stop().await;
}

/// A models directory with one word-level tokenizer ("words") and a chat
/// template; `template` replaces the default one.
fn models_dir(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("words");
    std::fs::create_dir(&model).expect("model dir");
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "alpha": 1, "beta": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(model.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer");
    std::fs::write(model.join("chat_template.jinja"), template).expect("template");
    dir
}

const PLAIN_TEMPLATE: &str = "{% for m in messages %}{{ m.content }} {% endfor %}";

fn prompt_lookup(text: String) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: "words".into(),
        prompt_text: text,
        ..chain_lookup(&[])
    }
}

/// User + system CPU time of this process (Linux `/proc/self/stat`, 100 Hz ticks).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    Duration::from_millis(ticks * 10)
}

async fn timed_healthz(addr: std::net::SocketAddr) -> Duration {
    let started = Instant::now();
    let reply = crate::http::get(addr, "/healthz").await.expect("healthz");
    assert_eq!(reply.status, 200, "{reply:?}");
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompt_flood_leaves_health_answering() {
    let models = models_dir(PLAIN_TEMPLATE);
    let h = Harness::start_with(&open_policy(), |c| {
        c.prompts.tokenizer_models_dir = Some(models.path().to_path_buf());
        c.limits.tokenize_concurrency = 2;
    })
    .await;
    let admin = h.admin_addr();
    // 20 prompts of 3 MB (over the 1 MiB default cap) and 20 of ~900 KB
    // (under it: they compete for the 2 tokenization slots).
    let mut calls = Vec::new();
    for i in 0..40 {
        let mut client = h.client.clone();
        let text = if i % 2 == 0 {
            "alpha beta ".repeat(3_000_000 / 11)
        } else {
            "alpha beta ".repeat(900_000 / 11)
        };
        calls.push(tokio::spawn(async move {
            let started = Instant::now();
            let answer = client
                .lookup_route(prompt_lookup(text))
                .await
                .expect("answered")
                .into_inner();
            (answer.reason_code, started.elapsed())
        }));
    }
    let mut worst_health = Duration::ZERO;
    for _ in 0..10 {
        worst_health = worst_health.max(timed_healthz(admin).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    let mut slowest = Duration::ZERO;
    for call in calls {
        let (reason, took) = call.await.expect("call task");
        *reasons.entry(reason).or_default() += 1;
        slowest = slowest.max(took);
    }
    // Work left behind by timed-out tokenizations: CPU time this process
    // burns in the second after the last answer.
    let cpu_at_last_answer = process_cpu();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu_after = process_cpu().saturating_sub(cpu_at_last_answer);
    println!(
        "healthz worst {worst_health:?}, slowest lookup {slowest:?}, reasons {reasons:?}, CPU after the last answer {cpu_after:?}"
    );
    assert!(cpu_after < Duration::from_secs(2), "{cpu_after:?}");
    assert!(
        worst_health < Duration::from_millis(500),
        "healthz took {worst_health:?}"
    );
    assert_eq!(
        h.metric("inferencecache_limit_hits_total{limit=\"prompt_bytes\"}")
            .await,
        Some(20.0)
    );
    metric_at_least(
        &h,
        "inferencecache_limit_hits_total{limit=\"tokenize_concurrency\"}",
        1.0,
    )
    .await;
    h.stop().await;
}

#[tokio::test]
#[allow(clippy::needless_update)] // ChatMessage may grow fields
async fn chat_template_fuel_stops_a_runaway_template() {
    let runaway = "{% for i in range(50000) %}{% for j in range(50000) %}{% endfor %}{% endfor %}";
    let models = models_dir(runaway);
    let mut h = Harness::start_with(&open_policy(), |c| {
        c.prompts.tokenizer_models_dir = Some(models.path().to_path_buf());
        c.prompts.tokenize_timeout = Duration::from_secs(30);
    })
    .await;
    let started = Instant::now();
    let answer = h.lookup(prompt_lookup("alpha beta".into())).await;
    assert_eq!(answer.reason_code, "NO_HINT");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    // Too many chat messages: not tokenized at all.
    let chat = LookupRouteRequest {
        model_id: "words".into(),
        messages: (0..2000)
            .map(|_| ChatMessage {
                role: "user".into(),
                content: "alpha".into(),
                ..Default::default()
            })
            .collect(),
        ..chain_lookup(&[])
    };
    assert_eq!(h.lookup(chat).await.reason_code, "NO_HINT");
    assert_eq!(
        h.metric("inferencecache_limit_hits_total{limit=\"chat_messages\"}")
            .await,
        Some(1.0)
    );
    h.stop().await;
}

// ---------------------------------------------------------------- TLS and auth

struct Pki {
    ca_pem: String,
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Pki {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "inference-cache test CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let issuer = rcgen::CertifiedIssuer::self_signed(params, key).expect("CA");
        Self {
            ca_pem: issuer.pem(),
            issuer,
        }
    }

    /// (cert PEM, key PEM) for `sans` (DNS names / IPs) plus optional URI SAN.
    fn leaf(&self, sans: &[&str], uri: Option<&str>) -> (String, String) {
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(uri.try_into().expect("ia5")));
        }
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf");
        (cert.pem(), key.serialize_pem())
    }
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}

async fn tls_client(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<&(String, String)>,
) -> Result<InferenceCacheClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .expect("uri")
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(InferenceCacheClient::new(channel))
}

fn spiffe(ns: &str) -> String {
    format!("spiffe://cluster.local/ns/{ns}/sa/vllm")
}

#[tokio::test]
async fn mtls_refuses_clients_without_a_certificate_and_maps_identities() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new();
    let server_pair = pki.leaf(&["localhost"], None);
    let auth = format!(
        "principals:\n- {{name: a, identity: \"{}\", tenants: [{T}], replicas: [\"*\"]}}\n",
        spiffe("team-a")
    );
    let mut config = ServeConfig::ephemeral();
    config.security.tls = Some(TlsFiles {
        cert: write(dir.path(), "server.pem", &server_pair.0),
        key: write(dir.path(), "server.key", &server_pair.1),
        client_ca: Some(write(dir.path(), "ca.pem", &pki.ca_pem)),
    });
    config.security.auth_file = Some(write(dir.path(), "auth.yaml", &auth));
    let server = start(config).await.expect("server starts");
    let addr = server.grpc_addr;

    // No client certificate: the handshake (or the first call) fails.
    let refused = match tls_client(addr, &pki.ca_pem, None).await {
        Err(_) => true,
        Ok(mut client) => client
            .lookup_route(chain_lookup(&chain(0..1)))
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
    // Plaintext: refused.
    let plaintext = async {
        InferenceCacheClient::connect(format!("http://{addr}"))
            .await
            .ok()?
            .lookup_route(chain_lookup(&chain(0..1)))
            .await
            .ok()
    };
    assert!(plaintext.await.is_none(), "plaintext was served");

    // A certificate whose SPIFFE id names team-a: writes team-a, cannot write team-b.
    let a = pki.leaf(&[], Some(&spiffe("team-a")));
    let mut client = tls_client(addr, &pki.ca_pem, Some(&a)).await.expect("mTLS");
    client
        .report_cache_state(tokio_stream::iter(vec![update(
            "10.0.0.1:8000",
            vec![chain_entry(&chain(0..2), 64)],
        )]))
        .await
        .expect("team-a producer accepted");
    let answer = client
        .lookup_route(chain_lookup(&chain(0..2)))
        .await
        .expect("lookup")
        .into_inner();
    assert_eq!(ids(&answer), ["10.0.0.1:8000"], "{answer:?}");
    let other = CacheStateUpdate {
        tenant_id: "team-b".into(),
        ..update("10.0.0.1:8000", vec![chain_entry(&chain(5..6), 64)])
    };
    let status = client
        .report_cache_state(tokio_stream::iter(vec![other]))
        .await
        .expect_err("team-b refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");

    // A certificate from the same CA with an identity the auth file does not name.
    let stranger = pki.leaf(&[], Some(&spiffe("team-z")));
    let mut client = tls_client(addr, &pki.ca_pem, Some(&stranger))
        .await
        .expect("mTLS handshake");
    let status = client
        .report_cache_state(tokio_stream::iter(vec![update("r", vec![])]))
        .await
        .expect_err("unknown identity refused");
    assert_eq!(status.code(), Code::Unauthenticated, "{status}");
    server.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn one_sided_tls_serves_verifying_clients() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new();
    let pair = pki.leaf(&["localhost"], None);
    let mut config = ServeConfig::ephemeral();
    config.security.tls = Some(TlsFiles {
        cert: write(dir.path(), "server.pem", &pair.0),
        key: write(dir.path(), "server.key", &pair.1),
        client_ca: None,
    });
    let server = start(config).await.expect("server starts");
    let mut client = tls_client(server.grpc_addr, &pki.ca_pem, None)
        .await
        .expect("TLS");
    // Loopback producer without an auth file: accepted.
    client
        .report_cache_state(tokio_stream::iter(vec![update(
            "A",
            vec![chain_entry(&chain(0..1), 64)],
        )]))
        .await
        .expect("loopback producer");
    let answer = client
        .lookup_route(chain_lookup(&chain(0..1)))
        .await
        .expect("lookup over TLS")
        .into_inner();
    assert!(!answer.reason_code.is_empty());
    server.shutdown().await.expect("shutdown");
}

fn bearer<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("ascii"),
    );
    request
}

#[tokio::test]
async fn bearer_tokens_bind_producers_to_tenants_and_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.token", "token-a\n");
    write(dir.path(), "gw.token", "token-gw\n");
    let auth = format!(
        "principals:\n\
         - {{name: a, tokenFile: a.token, tenants: [{T}], replicas: [\"10.0.0.0/8\"]}}\n\
         - {{name: gw, tokenFile: gw.token, tenants: [\"*\"]}}\n"
    );
    let auth_path = write(dir.path(), "auth.yaml", &auth);
    let mut h = Harness::start_with(&open_policy(), |c| {
        c.security.auth_file = Some(auth_path);
        c.security.admin_snapshot = false;
    })
    .await;
    let held = || update("10.1.2.3:8000", vec![chain_entry(&chain(0..2), 64)]);

    // No token, a wrong token: UNAUTHENTICATED.
    let status = h
        .client
        .report_cache_state(tokio_stream::iter(vec![held()]))
        .await
        .expect_err("no token");
    assert_eq!(status.code(), Code::Unauthenticated);
    let status = h
        .client
        .report_cache_state(bearer(tokio_stream::iter(vec![held()]), "token-b"))
        .await
        .expect_err("wrong token");
    assert_eq!(status.code(), Code::Unauthenticated);

    // The right token: accepted within the grant (the scheme is case-insensitive).
    h.client
        .report_cache_state(bearer(tokio_stream::iter(vec![held()]), "token-a"))
        .await
        .expect("granted");
    let mut lower = tonic::Request::new(tokio_stream::iter(vec![held()]));
    lower
        .metadata_mut()
        .insert("authorization", "bearer token-a".parse().expect("ascii"));
    h.client
        .report_cache_state(lower)
        .await
        .expect("lowercase scheme");
    // An outsider replica (outside 10.0.0.0/8) and another tenant: PERMISSION_DENIED.
    for (tenant, replica) in [(T, "127.0.0.2:9999"), ("team-b", "10.1.2.3:8000")] {
        let bad = CacheStateUpdate {
            tenant_id: tenant.into(),
            ..update(replica, vec![chain_entry(&chain(5..6), 64)])
        };
        let status = h
            .client
            .report_cache_state(bearer(tokio_stream::iter(vec![bad]), "token-a"))
            .await
            .expect_err("outside the grant");
        assert_eq!(status.code(), Code::PermissionDenied, "{tenant} {replica}");
    }
    // Stats naming another replica, and a clear of another tenant: refused.
    let mut sneaky = stats("10.1.2.3:8000", 0.5, 0.5, 0.5);
    if let Some(s) = sneaky.stats.as_mut() {
        s.replica_id = "192.168.0.1:8000".into();
    }
    let status = h
        .client
        .report_cache_state(bearer(tokio_stream::iter(vec![sneaky]), "token-a"))
        .await
        .expect_err("stats replica outside the grant");
    assert_eq!(status.code(), Code::PermissionDenied);
    let clear_b = inference_cache_proto::v1alpha1::CacheEvent {
        tenant_id: "team-b".into(),
        ..event(cache_event::Type::AllCleared, "10.1.2.3:8000", vec![], "")
    };
    let status = h
        .client
        .publish_event(bearer(clear_b, "token-a"))
        .await
        .expect_err("clear of another tenant");
    assert_eq!(status.code(), Code::PermissionDenied);
    let status = h
        .client
        .publish_event(event(
            cache_event::Type::AllCleared,
            "10.1.2.3:8000",
            vec![],
            "",
        ))
        .await
        .expect_err("unauthenticated clear");
    assert_eq!(status.code(), Code::Unauthenticated);

    // Reads: the owner and the gateway see team-a; a lookup without a token,
    // or for a tenant outside the grant, is the fail-open NO_HINT.
    for token in ["token-a", "token-gw"] {
        let answer = h
            .client
            .lookup_route(bearer(chain_lookup(&chain(0..2)), token))
            .await
            .expect("lookup")
            .into_inner();
        assert_eq!(answer.reason_code, "PREFIX_MATCH", "{token}");
    }
    let anonymous = h.lookup(chain_lookup(&chain(0..2))).await;
    assert_eq!(anonymous.reason_code, "NO_HINT");
    assert!(anonymous.replica_scores.is_empty());
    let other_tenant = LookupRouteRequest {
        tenant_id: "team-b".into(),
        ..chain_lookup(&chain(0..2))
    };
    let answer = h
        .client
        .lookup_route(bearer(other_tenant, "token-a"))
        .await
        .expect("lookup")
        .into_inner();
    assert_eq!(answer.reason_code, "NO_HINT");
    let state = |tenant: &str| GetCacheStateRequest {
        tenant_id: tenant.into(),
        model_id: M.into(),
    };
    let status = h
        .client
        .get_cache_state(bearer(state("team-b"), "token-a"))
        .await
        .expect_err("other tenant's state");
    assert_eq!(status.code(), Code::PermissionDenied);
    let own = h
        .client
        .get_cache_state(bearer(state(T), "token-a"))
        .await
        .expect("own state")
        .into_inner();
    assert_eq!(own.replicas.len(), 1);

    // Counted by reason; /snapshot is off, /policy still on.
    for (series, n) in [
        ("{rpc=\"ReportCacheState\",reason=\"no_credentials\"}", 1.0),
        ("{rpc=\"ReportCacheState\",reason=\"bad_token\"}", 1.0),
        ("{rpc=\"ReportCacheState\",reason=\"replica\"}", 2.0),
        ("{rpc=\"ReportCacheState\",reason=\"tenant\"}", 1.0),
        ("{rpc=\"PublishEvent\",reason=\"tenant\"}", 1.0),
        ("{rpc=\"LookupRoute\",reason=\"tenant\"}", 1.0),
        ("{rpc=\"GetCacheState\",reason=\"tenant\"}", 1.0),
    ] {
        assert_eq!(
            h.metric(&format!("inferencecache_auth_refused_total{series}"))
                .await,
            Some(n),
            "{series}"
        );
    }
    assert_eq!(h.admin_get("/snapshot").await.0, 404);
    assert_eq!(h.admin_get("/policy").await.0, 200);
    h.stop().await;
}

// ---------------------------------------------------------------- shutdown

#[tokio::test]
async fn shutdown_fails_readiness_first_then_cuts_a_never_closing_stream() {
    const DELAY_MS: u64 = 1500;
    let mut h = Harness::start_with(&open_policy(), |c| {
        // Long enough that the checks made during it fit on a loaded
        // machine.
        c.shutdown.delay = Duration::from_millis(DELAY_MS);
        c.shutdown.drain_timeout = Duration::from_millis(500);
    })
    .await;
    assert_eq!(h.admin_get("/readyz").await.0, 200);
    // A producer stream that never closes: its sender is held open.
    let (tx, rx) = tokio::sync::mpsc::channel::<CacheStateUpdate>(4);
    tx.send(update("A", vec![chain_entry(&chain(0..1), 64)]))
        .await
        .expect("send");
    let mut producer = h.client.clone();
    let stream = tokio::spawn(async move {
        producer
            .report_cache_state(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;

    let server = h.server.take().expect("running");
    let admin = server.admin_addr;
    let grpc = server.grpc_addr;
    let token = server.shutdown_token();
    let started = Instant::now();
    token.cancel();
    let waited = tokio::spawn(async move { server.wait().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // During the delay: not ready, health NOT_SERVING, yet still accepting.
    assert!(
        crate::http::get(admin, "/readyz")
            .await
            .expect("readyz")
            .status
            == 503
    );
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        Channel::from_shared(format!("http://{grpc}"))
            .expect("uri")
            .connect()
            .await
            .expect("still accepting during the delay"),
    );
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::NotServing as i32
    );
    assert!(started.elapsed() < Duration::from_millis(DELAY_MS));

    let result = tokio::time::timeout(Duration::from_secs(5), waited)
        .await
        .expect("exit within the drain deadline")
        .expect("task");
    result.expect("clean stop");
    let took = started.elapsed();
    println!("stopped after {took:?}");
    assert!(took >= Duration::from_millis(DELAY_MS), "{took:?}");
    assert!(
        took < Duration::from_millis(DELAY_MS + 500 + 1500),
        "{took:?}"
    );
    // The producer's stream was ended by the server, not left hanging.
    let outcome = tokio::time::timeout(Duration::from_secs(2), stream)
        .await
        .expect("producer call ended")
        .expect("task");
    assert!(outcome.is_err(), "{outcome:?}");
    drop(tx);
    assert!(tokio::net::TcpStream::connect(admin).await.is_err());
}

#[tokio::test]
async fn auth_file_is_reread_on_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let principal = |token: &str| {
        let digest: String = {
            use std::fmt::Write as _;
            let hash = <sha2::Sha256 as sha2::Digest>::digest(token.as_bytes());
            hash.iter().fold(String::new(), |mut s, b| {
                let _ = write!(s, "{b:02x}");
                s
            })
        };
        format!(
            "principals:\n- {{name: p, tokenSha256: {digest}, tenants: [{T}], replicas: [\"*\"]}}\n"
        )
    };
    let path = write(dir.path(), "auth.yaml", &principal("first"));
    let auth_path = path.clone();
    let h = Harness::start_with(&open_policy(), |c| c.security.auth_file = Some(auth_path)).await;
    let report = |token: &'static str| {
        let mut client = h.client.clone();
        async move {
            client
                .report_cache_state(bearer(tokio_stream::iter(vec![update("A", vec![])]), token))
                .await
                .map(|_| ())
                .map_err(|s| s.code())
        }
    };
    assert_eq!(report("first").await, Ok(()));
    assert_eq!(report("second").await, Err(Code::Unauthenticated));
    // Replace by rename, as editors and Kubernetes secrets do.
    let staged = write(dir.path(), "auth.yaml.new", &principal("second"));
    std::fs::rename(&staged, &path).expect("rename");
    let mut accepted = false;
    for _ in 0..100 {
        if report("second").await.is_ok() {
            accepted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(accepted, "the new token was never accepted");
    assert_eq!(report("first").await, Err(Code::Unauthenticated));
    // A broken edit keeps the last good file.
    std::fs::write(&path, "principals: [{name: broken}]").expect("write");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(report("second").await, Ok(()));
    h.stop().await;
}

/// A non-loopback IPv4 address of this host (no packet is sent), if it has one.
fn non_loopback_ipv4() -> Option<std::net::IpAddr> {
    ["203.0.113.1:9", "192.0.2.1:9", "10.255.255.1:9"]
        .iter()
        .find_map(|target| {
            let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
            socket.connect(target).ok()?;
            let ip = socket.local_addr().ok()?.ip();
            (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
        })
}

#[tokio::test]
async fn unauthenticated_producers_from_other_hosts_are_refused_unless_allowed() {
    // The decision itself is unit-tested in `auth`; here a real socket from a
    // non-loopback address of this host, when it has one.
    let Some(ip) = non_loopback_ipv4() else {
        println!("no non-loopback address on this host; covered by the auth unit test only");
        return;
    };
    for allow in [false, true] {
        let mut config = ServeConfig::ephemeral();
        config.grpc_addr = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
        config.security.allow_unauthenticated_producers = allow;
        let server = start(config).await.expect("server starts");
        let admin = server.admin_addr;
        let mut client =
            InferenceCacheClient::connect(format!("http://{ip}:{}", server.grpc_addr.port()))
                .await
                .expect("connect over the host address");
        let produced = client
            .report_cache_state(tokio_stream::iter(vec![update(
                "A",
                vec![chain_entry(&chain(0..1), 64)],
            )]))
            .await;
        let looked_up = client.lookup_route(chain_lookup(&chain(0..1))).await;
        assert!(looked_up.is_ok(), "lookups stay open");
        if allow {
            produced.expect("allowed with --allow-unauthenticated-producers");
        } else {
            let status = produced.expect_err("refused from a non-loopback peer");
            assert_eq!(status.code(), Code::PermissionDenied, "{status}");
            let metrics = crate::http::get(admin, "/metrics")
                .await
                .expect("metrics")
                .body;
            assert!(
                metrics.contains(
                    "inferencecache_auth_refused_total{rpc=\"ReportCacheState\",reason=\"non_loopback_peer\"} 1"
                ),
                "{metrics}"
            );
        }
        server.shutdown().await.expect("shutdown");
    }
}
