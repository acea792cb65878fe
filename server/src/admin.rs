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
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/snapshot/accuracy", get(accuracy))
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
