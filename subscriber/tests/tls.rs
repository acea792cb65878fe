//! The subscriber's gRPC client over TLS: a private CA, mutual TLS with a
//! client certificate, a bearer token (re-read on reconnect), and the
//! refusals when any of them does not fit. Certificates are generated in
//! the test (`rcgen`); the server is a recording tonic server with TLS.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::*;

const WAIT: Duration = Duration::from_secs(10);

fn https(server: &RecordingServer) -> String {
    format!("https://127.0.0.1:{}", server.addr.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca() {
    let pki = TestPki::generate();
    let server = RecordingServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        ServerOptions {
            tls: Some(pki.server_tls(false)),
            token: None,
        },
    )
    .await;
    let sub = subscriber_with(
        &https(&server),
        &[
            "--tls-ca",
            &pki.path("ca.pem"),
            "--heartbeat-interval",
            "200ms",
        ],
    )
    .await;
    assert!(
        eventually(WAIT, || !server.received().announcements().is_empty()
            && !server.received().heartbeats().is_empty())
        .await,
        "nothing arrived over TLS: {:?}",
        server.received()
    );
    assert!(
        server.received().authorization.is_empty(),
        "no token configured"
    );
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_a_bearer_token() {
    let pki = TestPki::generate();
    let token = pki.dir.path().join("token");
    std::fs::write(&token, "s3cret-producer-token\n").unwrap();
    let server = RecordingServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        ServerOptions {
            tls: Some(pki.server_tls(true)),
            token: Some("s3cret-producer-token".into()),
        },
    )
    .await;
    let sub = subscriber_with(
        // By name: the certificate carries `localhost` too.
        &format!("https://localhost:{}", server.addr.port()),
        &[
            "--tls-ca",
            &pki.path("ca.pem"),
            "--tls-cert",
            &pki.path("client.pem"),
            "--tls-key",
            &pki.path("client.key"),
            "--token-file",
            token.to_str().unwrap(),
            "--heartbeat-interval",
            "200ms",
        ],
    )
    .await;
    assert!(
        eventually(WAIT, || !server.received().announcements().is_empty()
            && !server.received().heartbeats().is_empty())
        .await,
        "nothing arrived over mutual TLS: {:?}",
        server.received()
    );
    let received = server.received();
    assert_eq!(received.unauthenticated, 0);
    assert!(
        received
            .authorization
            .iter()
            .all(|h| h == "Bearer s3cret-producer-token"),
        "{:?}",
        received.authorization
    );
    sub.shutdown().await;
    // The goodbye went through the same authenticated channel.
    assert!(server.received().cache_events().last().is_some_and(
        |e| e.r#type == inference_cache_proto::v1alpha1::cache_event::Type::AllCleared as i32
    ));
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_requiring_a_client_certificate_refuses_one_without() {
    let pki = TestPki::generate();
    let server = RecordingServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        ServerOptions {
            tls: Some(pki.server_tls(true)),
            token: None,
        },
    )
    .await;
    let sub = subscriber_with(&https(&server), &["--tls-ca", &pki.path("ca.pem")]).await;
    assert!(
        eventually(WAIT, || metric(
            &sub,
            "inferencecache_subscriber_server_errors_total"
        ) >= 2.0)
        .await
    );
    assert!(server.received().updates.is_empty());
    assert!(server.received().events.is_empty());
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_from_another_ca_is_refused() {
    let pki = TestPki::generate();
    let other = TestPki::generate();
    let server = RecordingServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        ServerOptions {
            tls: Some(pki.server_tls(false)),
            token: None,
        },
    )
    .await;
    let sub = subscriber_with(&https(&server), &["--tls-ca", &other.path("ca.pem")]).await;
    assert!(
        eventually(WAIT, || metric(
            &sub,
            "inferencecache_subscriber_server_errors_total"
        ) >= 2.0)
        .await
    );
    assert!(server.received().updates.is_empty());
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_is_refused_and_a_rotated_token_is_reread() {
    let pki = TestPki::generate();
    let token = pki.dir.path().join("token");
    std::fs::write(&token, "old-token").unwrap();
    let server = RecordingServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        ServerOptions {
            tls: Some(pki.server_tls(false)),
            token: Some("new-token".into()),
        },
    )
    .await;
    let addr = server.addr;
    let sub = subscriber_with(
        &https(&server),
        &[
            "--tls-ca",
            &pki.path("ca.pem"),
            "--token-file",
            token.to_str().unwrap(),
        ],
    )
    .await;
    assert!(eventually(WAIT, || server.received().unauthenticated >= 1).await);
    assert!(server.received().updates.is_empty());
    // Rotate the token: the next reconnect reads it.
    std::fs::write(&token, "new-token\n").unwrap();
    assert!(
        eventually(Duration::from_secs(15), || !server
            .received()
            .announcements()
            .is_empty())
        .await,
        "the rotated token was not picked up: {:?}",
        server.received()
    );
    assert!(
        server
            .received()
            .authorization
            .iter()
            .all(|h| h == "Bearer new-token")
    );
    assert_eq!(server.addr, addr);
    sub.shutdown().await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_files_fail_start_up() {
    let args = inference_cache_subscriber::SubscribeArgs::try_parse_from([
        "subscribe",
        "--server",
        "https://127.0.0.1:1",
        "--replica-id",
        "r",
        "--tenant",
        "t",
        "--model",
        "m",
        "--metrics-listen",
        "off",
        "--tls-ca",
        "/nonexistent/ca.pem",
    ])
    .expect("flags");
    let error = inference_cache_subscriber::Subscriber::start(args.resolve().expect("resolve"))
        .await
        .expect_err("a missing CA file must fail start-up");
    assert!(error.to_string().contains("--tls-ca"), "{error}");

    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("token");
    std::fs::write(&empty, "\n").unwrap();
    let args = inference_cache_subscriber::SubscribeArgs::try_parse_from([
        "subscribe",
        "--replica-id",
        "r",
        "--tenant",
        "t",
        "--model",
        "m",
        "--metrics-listen",
        "off",
        "--token-file",
        empty.to_str().unwrap(),
    ])
    .expect("flags");
    let error = inference_cache_subscriber::Subscriber::start(args.resolve().expect("resolve"))
        .await
        .expect_err("an empty token must fail start-up");
    assert!(error.to_string().contains("empty"), "{error}");
}
