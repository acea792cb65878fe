//! Admin HTTP listener: liveness, readiness (with a `canary:` line while the
//! canary disagrees, see [`crate::canary`], and an `accuracy:` line per
//! accuracy alert, see [`crate::accuracy_watch`]; neither makes the server
//! unready), Prometheus metrics and the hint-accuracy aggregate
//! (`/snapshot/accuracy`: every outcome series the gateways reported, the
//! accuracy watch's windows and alerts, as JSON; metadata only).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;

/// Every route of the admin listener: [`router`]'s, then the index's
/// `/policy` and `/snapshot` (each of which `--admin-policy false` and
/// `--admin-snapshot false` turn off). The crate documentation and
/// `inference-cache serve --help` list the same routes; tests hold the three
/// together.
pub const ADMIN_ROUTES: [&str; 6] = [
    HEALTHZ,
    READYZ,
    METRICS,
    ACCURACY,
    crate::index_runtime::POLICY_ROUTE,
    crate::index_runtime::SNAPSHOT_ROUTE,
];

const HEALTHZ: &str = "/healthz";
const READYZ: &str = "/readyz";
const METRICS: &str = "/metrics";
const ACCURACY: &str = "/snapshot/accuracy";

/// Shared state of the admin routes.
#[derive(Clone)]
pub struct AdminState {
    /// Metrics rendered by `/metrics`.
    pub metrics: Arc<Metrics>,
    /// True once both listeners are bound, false again when shutting down.
    pub ready: Arc<AtomicBool>,
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route(HEALTHZ, get(|| async { "ok\n" }))
        .route(READYZ, get(readyz))
        .route(METRICS, get(metrics))
        .route(ACCURACY, get(accuracy))
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    // A failing canary is a detail, not unreadiness: hints fail open.
    let canary = state
        .metrics
        .canary_failure()
        .map(|failure| format!("canary: {failure}\n"))
        .unwrap_or_default();
    let canary = canary + &state.metrics.outcomes.watch().readiness_detail();
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, format!("ready\n{canary}"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{canary}"),
        )
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn accuracy(State(state): State<AdminState>) -> impl IntoResponse {
    let book = &state.metrics.outcomes;
    let settings = book.settings();
    let body = serde_json::json!({
        "maxSeries": settings.max_series,
        "maxIdBytes": settings.max_id_bytes,
        "maxBatch": settings.max_batch,
        "droppedByGateways": book.dropped_by_gateways.get(),
        "series": book.all_rows(),
        "watch": book.watch().report(),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::ADMIN_ROUTES;

    /// The crate documentation names every admin route, and no other.
    #[test]
    fn the_crate_docs_list_the_admin_routes() {
        let docs: String = include_str!("lib.rs")
            .lines()
            .filter_map(|line| line.strip_prefix("//!"))
            .collect();
        let listed: Vec<&str> = docs
            .split('`')
            .filter(|word| word.starts_with('/'))
            .collect();
        assert_eq!(listed, ADMIN_ROUTES, "{docs}");
    }
}
