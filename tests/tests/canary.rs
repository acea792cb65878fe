//! The canary on a running server: its first run (right after start) agrees,
//! which `/metrics` and `/readyz` show.

use std::time::{Duration, Instant};

use inference_cache_tests::TestServer;

#[tokio::test]
async fn the_first_canary_run_agrees_and_shows_in_metrics() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = server.admin_get("/metrics").await?.body;
        let has = |line: &str| metrics.lines().any(|l| l == line);
        if has("inferencecache_canary_ok 1") {
            assert!(
                has("inferencecache_canary_checks_total{result=\"pass\"} 1"),
                "{metrics}"
            );
            assert!(
                has("inferencecache_canary_checks_total{result=\"fail\"} 0"),
                "{metrics}"
            );
            break;
        }
        assert!(
            !has("inferencecache_canary_ok 0"),
            "the canary failed on a correct server:\n{metrics}\n{}",
            server.admin_get("/readyz").await?.body
        );
        assert!(
            Instant::now() < deadline,
            "no canary run within 10 s:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ready = server.admin_get("/readyz").await?;
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));
    server.shutdown().await
}
