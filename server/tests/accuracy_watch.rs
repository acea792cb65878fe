//! The accuracy watch over real sockets: outcomes reported with
//! ReportOutcomes flag a replica whose hints are systematically wrong (a
//! wrong configuration, a stale index) at the first check after they arrive,
//! and never a correct replica, a cold start or shadow traffic; an alert
//! shows in `/metrics`, `/snapshot/accuracy` and `/readyz` (which stays 200)
//! and clears when reuse recovers; the aggregation's bounds are flags and
//! every hit is counted.

use crate::contract_support;

use std::time::Duration;

use contract_support::*;
use inference_cache_proto::v1alpha1::{OutcomeReport, RouteOutcome};
use inference_cache_server::{ServeConfig, WatchSettings};

/// A check every 200 ms over a 12 s window (60 buckets), judged from 10 hints.
fn fast_watch(config: &mut ServeConfig) {
    config.outcomes.watch = WatchSettings {
        check_interval: Duration::from_millis(200),
        window: Duration::from_secs(12),
        min_samples: 10,
        ..WatchSettings::default()
    };
}

fn routed(replica: &str, predicted: i64, cached: i64) -> RouteOutcome {
    RouteOutcome {
        tenant_id: T.into(),
        model_id: M.into(),
        replica_id: replica.into(),
        reason_code: "PREFIX_MATCH".into(),
        predicted_tokens: predicted,
        cached_tokens: cached,
        prompt_tokens: predicted + 16,
        routed: true,
        shadow: false,
    }
}

async fn send(h: &mut Harness, outcomes: Vec<RouteOutcome>) {
    let ack = h
        .client
        .report_outcomes(OutcomeReport {
            outcomes,
            dropped: 0,
        })
        .await
        .expect("ReportOutcomes")
        .into_inner();
    assert!(ack.accepted);
}

fn times(n: usize, outcome: RouteOutcome) -> Vec<RouteOutcome> {
    vec![outcome; n]
}

async fn checks(h: &Harness) -> f64 {
    h.metric("inferencecache_accuracy_checks_total")
        .await
        .expect("checks counter")
}

/// Waits for a check that started after everything reported so far was
/// recorded: the watch counts a check under the same lock outcomes are
/// recorded under, so any check counted after this reads the counter has
/// seen them.
async fn next_check(h: &Harness) {
    let before = checks(h).await;
    eventually("the next accuracy check", || async {
        checks(h).await > before
    })
    .await;
}

async fn snapshot(h: &Harness) -> serde_json::Value {
    let (status, body) = h.admin_get("/snapshot/accuracy").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("/snapshot/accuracy is JSON")
}

/// `(kind, replica)` of every raised alert.
fn alerts(snapshot: &serde_json::Value) -> Vec<(String, String)> {
    snapshot["watch"]["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .map(|alert| {
            (
                alert["kind"].as_str().unwrap_or_default().to_owned(),
                alert["replicaId"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn status_of(snapshot: &serde_json::Value, replica: &str) -> String {
    snapshot["watch"]["watched"]
        .as_array()
        .expect("watched")
        .iter()
        .find(|row| row["replicaId"] == replica)
        .and_then(|row| row["status"].as_str())
        .unwrap_or("absent")
        .to_owned()
}

fn alert_gauge(replica: &str, kind: &str) -> String {
    format!(
        "inferencecache_accuracy_alert{{tenant=\"{T}\",model=\"{M}\",replica=\"{replica}\",kind=\"{kind}\"}}"
    )
}

#[tokio::test]
async fn a_wrong_configuration_is_flagged_at_the_next_check_and_a_correct_one_is_not() {
    let mut h = Harness::start_with("", fast_watch).await;
    // r-bad: every hint promised 256 tokens and the engine reused none (a
    // block size or template the engine does not share). r-good: the engine
    // reused all but its last block. r-partial: a quarter of each promise.
    let mut outcomes = times(20, routed("r-bad", 256, 0));
    outcomes.extend(times(20, routed("r-good", 256, 240)));
    outcomes.extend(times(20, routed("r-partial", 256, 64)));
    send(&mut h, outcomes).await;
    next_check(&h).await;

    let snap = snapshot(&h).await;
    assert_eq!(
        alerts(&snap),
        [
            ("hinted_miss".to_owned(), "r-bad".to_owned()),
            ("partial_reuse".to_owned(), "r-partial".to_owned()),
        ],
        "{snap}"
    );
    assert_eq!(status_of(&snap, "r-good"), "ok", "{snap}");
    assert_eq!(snap["watch"]["watched"][0]["window"]["hintedMiss"], 20);
    let message = snap["watch"]["alerts"][0]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("20 of 20 routed hints") && message.contains("block size"),
        "{message}"
    );
    assert_eq!(
        h.metric(&alert_gauge("r-bad", "hinted_miss")).await,
        Some(1.0)
    );
    assert_eq!(
        h.metric(&alert_gauge("r-partial", "partial_reuse")).await,
        Some(1.0)
    );
    let (_, metrics) = h.admin_get("/metrics").await;
    assert!(
        !metrics.contains("replica=\"r-good\",kind="),
        "a correct replica is flagged:\n{metrics}"
    );
    assert_eq!(
        h.metric("inferencecache_accuracy_alerts{kind=\"hinted_miss\"}")
            .await,
        Some(1.0)
    );
    // Readiness names the alert but stays 200: hints fail open.
    let (status, ready) = h.admin_get("/readyz").await;
    assert_eq!(status, 200, "{ready}");
    assert!(
        ready.contains(&format!(
            "accuracy: hinted_miss tenant={T} model={M} replica=r-bad:"
        )),
        "{ready}"
    );
    assert!(!ready.contains("r-good"), "{ready}");
    // Routing is not taken down.
    let blocks = chain(0..4);
    h.hold("r-bad", &blocks).await;
    let answer = h.lookup(chain_lookup(&blocks)).await;
    assert_eq!(answer.reason_code, "PREFIX_MATCH");
    assert_eq!(ids(&answer), ["r-bad"]);

    // Still wrong: the alert is raised once, not once per check.
    send(&mut h, times(20, routed("r-bad", 256, 0))).await;
    next_check(&h).await;
    next_check(&h).await;
    assert_eq!(
        h.metric("inferencecache_accuracy_alerts_raised_total{kind=\"hinted_miss\"}")
            .await,
        Some(1.0)
    );

    // Fixed: the engine reuses what was promised, misses fall below half of
    // the window and the alert clears at the next check.
    send(&mut h, times(100, routed("r-bad", 256, 256))).await;
    next_check(&h).await;
    let snap = snapshot(&h).await;
    assert_eq!(
        alerts(&snap),
        [("partial_reuse".to_owned(), "r-partial".to_owned())],
        "{snap}"
    );
    assert_eq!(status_of(&snap, "r-bad"), "ok", "{snap}");
    assert_eq!(h.metric(&alert_gauge("r-bad", "hinted_miss")).await, None);
    assert_eq!(
        h.metric("inferencecache_accuracy_alerts{kind=\"hinted_miss\"}")
            .await,
        Some(0.0)
    );
    let (_, ready) = h.admin_get("/readyz").await;
    assert!(!ready.contains("r-bad"), "{ready}");
    h.stop().await;
}

#[tokio::test]
async fn a_stale_index_is_flagged_from_its_misses() {
    let mut h = Harness::start_with("", fast_watch).await;
    let blocks = chain(100..104);
    h.hold("r1", &blocks).await;
    let answer = h.lookup(chain_lookup(&blocks)).await;
    assert_eq!(ids(&answer), ["r1"]);
    let predicted = i64::from(answer.replica_scores[0].matched_tokens);
    assert_eq!(predicted, 256);
    // While the engine holds the blocks, the hints are right.
    send(&mut h, times(12, routed("r1", predicted, predicted - 64))).await;
    next_check(&h).await;
    let snap = snapshot(&h).await;
    assert!(alerts(&snap).is_empty(), "{snap}");
    assert_eq!(status_of(&snap, "r1"), "ok", "{snap}");

    // The engine evicts the blocks and no event reaches the index: it keeps
    // promising them, and every routed request misses.
    let stale = h.lookup(chain_lookup(&blocks)).await;
    assert_eq!(ids(&stale), ["r1"]);
    assert_eq!(i64::from(stale.replica_scores[0].matched_tokens), predicted);
    send(&mut h, times(30, routed("r1", predicted, 0))).await;
    next_check(&h).await;
    let snap = snapshot(&h).await;
    assert_eq!(
        alerts(&snap),
        [("hinted_miss".to_owned(), "r1".to_owned())],
        "{snap}"
    );
    let message = snap["watch"]["alerts"][0]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("30 of ") && message.contains("index is stale"),
        "{message}"
    );
    assert_eq!(h.metric(&alert_gauge("r1", "hinted_miss")).await, Some(1.0));
    h.stop().await;
}

#[tokio::test]
async fn a_cold_start_shadow_and_unhinted_traffic_do_not_alarm() {
    let mut h = Harness::start_with("", fast_watch).await;
    let mut shadow = routed("r-shadow", 256, 0);
    shadow.routed = false;
    shadow.shadow = true;
    let mut unhinted = routed("r-unhinted", 0, 0);
    unhinted.routed = false;
    // Fewer misses than --accuracy-min-samples: no verdict yet.
    let mut outcomes = times(5, routed("r-cold", 256, 0));
    // Shadow outcomes measure a replica Envoy picked, not the hinted one.
    outcomes.extend(times(40, shadow));
    outcomes.extend(times(40, unhinted));
    send(&mut h, outcomes).await;
    next_check(&h).await;
    let snap = snapshot(&h).await;
    assert!(alerts(&snap).is_empty(), "{snap}");
    assert_eq!(status_of(&snap, "r-cold"), "too_few_samples", "{snap}");
    assert_eq!(status_of(&snap, "r-shadow"), "absent", "{snap}");
    assert_eq!(status_of(&snap, "r-unhinted"), "absent", "{snap}");
    assert_eq!(snap["watch"]["minSamples"], 10);
    assert_eq!(snap["watch"]["checkIntervalMs"], 200);
    // The outcomes themselves are still aggregated.
    let rows = snap["series"].as_array().expect("series").len();
    assert_eq!(rows, 3, "{snap}");
    // Five more misses reach the minimum: flagged.
    send(&mut h, times(5, routed("r-cold", 256, 0))).await;
    next_check(&h).await;
    assert_eq!(
        alerts(&snapshot(&h).await),
        [("hinted_miss".to_owned(), "r-cold".to_owned())]
    );
    h.stop().await;
}

#[tokio::test]
async fn aggregation_limits_are_flags_and_each_hit_is_counted() {
    let mut h = Harness::start_with("", |config| {
        fast_watch(config);
        config.outcomes.max_batch = 8;
        config.outcomes.max_series = 2;
        config.outcomes.max_id_bytes = 16;
    })
    .await;
    // A report of 12: the first 8 are counted, 4 dropped.
    send(&mut h, times(12, routed("r1", 256, 0))).await;
    // r2 fits the series bound; r3 is folded into `_other`; the long id is refused.
    send(
        &mut h,
        vec![
            routed("r2", 256, 0),
            routed("r3", 256, 0),
            routed("r3", 256, 0),
            routed(&"x".repeat(17), 256, 0),
        ],
    )
    .await;
    for (limit, hits) in [
        ("outcome_batch", 4.0),
        ("outcome_series", 2.0),
        ("outcome_id_bytes", 1.0),
    ] {
        assert_eq!(
            h.metric(&format!(
                "inferencecache_limit_hits_total{{limit=\"{limit}\"}}"
            ))
            .await,
            Some(hits),
            "{limit}"
        );
    }
    let snap = snapshot(&h).await;
    assert_eq!(
        (&snap["maxBatch"], &snap["maxSeries"], &snap["maxIdBytes"]),
        (
            &serde_json::json!(8),
            &serde_json::json!(2),
            &serde_json::json!(16)
        )
    );
    let series: Vec<(String, u64)> = snap["series"]
        .as_array()
        .expect("series")
        .iter()
        .map(|row| {
            (
                row["replicaId"].as_str().unwrap_or_default().to_owned(),
                row["outcomes"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        series,
        [
            ("_other".to_owned(), 2),
            ("r1".to_owned(), 8),
            ("r2".to_owned(), 1)
        ]
    );
    // Folded outcomes are not watched: the watch holds at most max_series keys.
    next_check(&h).await;
    let snap = snapshot(&h).await;
    let watched: Vec<_> = snap["watch"]["watched"]
        .as_array()
        .expect("watched")
        .iter()
        .map(|row| row["replicaId"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(watched, ["r1", "r2"], "{snap}");
    h.stop().await;
}

#[tokio::test]
async fn watch_settings_it_cannot_honour_fail_start_up() {
    let mut config = ServeConfig::ephemeral();
    config.outcomes.watch.window = Duration::from_secs(1);
    config.outcomes.watch.check_interval = Duration::from_secs(2);
    let error = match inference_cache_server::start(config).await {
        Ok(_) => panic!("must not start"),
        Err(error) => format!("{error:#}"),
    };
    assert!(error.contains("--accuracy-window"), "{error}");
}
