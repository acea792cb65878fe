//! The `inference-cache` binary: documented flags, start-up on real sockets,
//! and graceful shutdown on SIGTERM.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_inference-cache");

#[test]
fn help_documents_every_serve_flag() {
    let output = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .expect("run --help");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--grpc-addr",
        "--admin-addr",
        "--log-format",
        "--tls-cert",
        "--tls-key",
        "--client-ca",
        "--auth-file",
        "--allow-unauthenticated-producers",
        "--admin-snapshot",
        "--admin-policy",
        "--grpc-max-message-bytes",
        "--grpc-max-concurrent-streams",
        "--outcome-max-series",
        "--outcome-max-id-bytes",
        "--outcome-max-batch",
        "--accuracy-check-interval",
        "--accuracy-window",
        "--accuracy-min-samples",
        "--accuracy-miss-percent",
        "--accuracy-partial-percent",
        "--canary-interval",
        "--grpc-keepalive-interval",
        "--grpc-keepalive-timeout",
        "--max-hash-bytes",
        "--max-chain-blocks",
        "--max-token-ids",
        "--max-prompt-bytes",
        "--max-chat-messages",
        "--max-update-entries",
        "--max-template-variables",
        "--tokenize-concurrency",
        "--shutdown-delay",
        "--drain-timeout",
    ] {
        assert!(help.contains(flag), "serve --help lacks {flag}:\n{help}");
    }
    assert!(
        help.contains("0.0.0.0:9090") && help.contains("127.0.0.1:8080"),
        "{help}"
    );
    // --admin-addr lists the routes the admin listener serves, no more, no less.
    let routes: Vec<&str> = help
        .lines()
        .find_map(|line| line.trim().strip_prefix("Admin HTTP listen address:"))
        .expect("the --admin-addr help")
        .trim()
        .trim_end_matches('.')
        .split(", ")
        .collect();
    assert_eq!(routes, inference_cache_server::ADMIN_ROUTES, "{help}");
}

#[test]
fn bad_flag_values_are_named() {
    let output = Command::new(BIN)
        .args(["serve", "--grpc-addr", "not-an-address"])
        .output()
        .expect("run serve");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--grpc-addr"), "{stderr}");
}

#[test]
fn serves_then_drains_on_sigterm() {
    let mut child = Command::new(BIN)
        .args([
            "--log-format",
            "json",
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
            "--shutdown-delay",
            "0",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    let serving = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|line| line.contains("\"serving\""))
        .expect("a 'serving' log line");
    let log: serde_json::Value = serde_json::from_str(&serving).expect("JSON log line");
    let admin = log["fields"]["admin_addr"]
        .as_str()
        .expect("admin_addr field")
        .to_owned();

    let reply = crate::http::get_blocking(&admin, "/healthz").expect("admin listener accepts");
    assert_eq!(reply.status, 200, "{reply:?}");

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    assert!(status.is_ok_and(|s| s.success()));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(exit) = child.try_wait().expect("wait") {
            assert!(exit.success(), "exit status {exit}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "server did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l.contains("stopped")), "{rest:?}");
}

/// GET `path` on `addr`; the status line, or `None` when nothing accepts.
fn get_status(addr: &str, path: &str) -> Option<String> {
    crate::http::get_blocking(addr, path)
        .ok()
        .map(|response| response.status_line)
}

#[test]
fn sigterm_fails_readiness_before_the_listeners_close() {
    let mut child = Command::new(BIN)
        .args([
            "--log-format",
            "json",
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
            "--shutdown-delay",
            "3s",
            "--drain-timeout",
            "1s",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    let mut warned = false;
    let serving = lines
        .by_ref()
        .map_while(Result::ok)
        .inspect(|line| warned |= line.contains("PRODUCERS ARE UNAUTHENTICATED"))
        .find(|line| line.contains("\"serving\""))
        .expect("a 'serving' log line");
    assert!(
        warned,
        "no start-up warning about unauthenticated producers"
    );
    let log: serde_json::Value = serde_json::from_str(&serving).expect("JSON log line");
    let admin = log["fields"]["admin_addr"]
        .as_str()
        .expect("admin_addr field")
        .to_owned();
    let grpc = log["fields"]["grpc_addr"]
        .as_str()
        .expect("grpc_addr field")
        .to_owned();
    assert_eq!(
        get_status(&admin, "/readyz").as_deref(),
        Some("HTTP/1.1 200 OK")
    );

    let sent = std::time::Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    assert!(status.is_ok_and(|s| s.success()));
    // Not ready at once, while both listeners still accept.
    let deadline = sent + Duration::from_millis(2000);
    loop {
        let readyz = get_status(&admin, "/readyz");
        if readyz.as_deref() == Some("HTTP/1.1 503 Service Unavailable") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "readyz still {readyz:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(sent.elapsed() < Duration::from_millis(2500));
    assert!(
        std::net::TcpStream::connect(&grpc).is_ok(),
        "gRPC stopped accepting during the delay"
    );
    let deadline = sent + Duration::from_secs(10);
    loop {
        if let Some(exit) = child.try_wait().expect("wait") {
            assert!(exit.success(), "exit status {exit}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "server did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        sent.elapsed() >= Duration::from_secs(1),
        "{:?}",
        sent.elapsed()
    );
}
