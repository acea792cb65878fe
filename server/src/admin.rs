//! Admin HTTP listener: liveness, readiness, Prometheus metrics and the
//! hint-accuracy aggregate (`/snapshot/accuracy`: every outcome series the
//! gateways reported, as JSON; metadata only).

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
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
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
    let body = serde_json::json!({
        "maxSeries": book.settings().max_series,
        "droppedByGateways": book.dropped_by_gateways.get(),
        "series": book.all_rows(),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}
