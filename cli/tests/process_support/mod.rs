//! An `inference-cache serve` process of this build on loopback ports, for
//! tests and benches that need the real binary: spawn it, wait until it is
//! ready, talk to it over gRPC and HTTP, and kill it (also on drop).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// A running server and its ports.
pub struct ServerProcess {
    pub child: Child,
    pub grpc: u16,
    pub admin: u16,
}

impl ServerProcess {
    /// `inference-cache serve` with no shutdown delay, both listeners on
    /// free loopback ports, and `args` after them.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Self {
        let (grpc, admin) = (free_port(), free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_inference-cache"))
            .args(["serve", "--shutdown-delay", "0s"])
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn inference-cache serve");
        Self { child, grpc, admin }
    }

    /// A gRPC client, once the listener accepts (30 s at most).
    pub async fn client(&self) -> InferenceCacheClient<tonic::transport::Channel> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match InferenceCacheClient::connect(format!("http://127.0.0.1:{}", self.grpc)).await {
                Ok(c) => return c,
                Err(e) => assert!(Instant::now() < deadline, "server never listened: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `GET path` on the admin listener (status 0 and no body when it
    /// cannot be reached).
    pub async fn get(&self, path: &str) -> crate::http::HttpResponse {
        crate::http::get(("127.0.0.1", self.admin), path)
            .await
            .unwrap_or_default()
    }

    /// The status of `/readyz` (0 when unreachable).
    pub async fn readyz(&self) -> u16 {
        self.get("/readyz").await.status
    }

    /// Waits until `/readyz` answers 200 (30 s at most).
    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.readyz().await != 200 {
            assert!(Instant::now() < deadline, "never ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
