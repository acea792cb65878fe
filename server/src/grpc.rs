//! The `InferenceCache` gRPC service: translates wire messages to the server's
//! domain calls and back. Protobuf types stop here.
//!
//! Consumer-side handlers never return an error status: every failure becomes
//! a fail-open envelope (empty `replica_scores` with a reason code).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::inference_cache_server::InferenceCache;
use inference_cache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, CacheSummary, GetCacheStateRequest, GetCacheStateResponse,
    LookupPdRouteRequest, LookupPdRouteResponse, LookupRouteRequest, LookupRouteResponse, Metric,
    RenderTemplateRequest, RenderTemplateResponse, StreamEventsRequest, StreamMetricsRequest,
};
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::Metrics;

/// Boxed server-streaming response.
type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Implementation of the generated `InferenceCache` trait.
pub struct CacheService {
    metrics: Arc<Metrics>,
}

impl CacheService {
    /// Creates the service over shared metrics.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self { metrics }
    }
}

/// Microseconds since `started`, saturating.
fn elapsed_us(started: Instant) -> i64 {
    i64::try_from(started.elapsed().as_micros()).unwrap_or(i64::MAX)
}

#[tonic::async_trait]
impl InferenceCache for CacheService {
    async fn render_template(
        &self,
        request: Request<RenderTemplateRequest>,
    ) -> Result<Response<RenderTemplateResponse>, Status> {
        self.metrics.record_rpc("RenderTemplate");
        let request = request.into_inner();
        Ok(Response::new(RenderTemplateResponse {
            tenant_namespace: request.tenant_id.into_bytes(),
            reason_code: reason::TEMPLATE_NOT_FOUND.to_owned(),
            ..Default::default()
        }))
    }

    async fn lookup_route(
        &self,
        _request: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        let started = Instant::now();
        let response = LookupRouteResponse {
            reason_code: reason::NO_HINT.to_owned(),
            lookup_latency_us: elapsed_us(started),
            ..Default::default()
        };
        self.metrics
            .record_lookup(&response.reason_code, started.elapsed().as_secs_f64());
        Ok(Response::new(response))
    }

    async fn lookup_pd_route(
        &self,
        _request: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        self.metrics.record_rpc("LookupPDRoute");
        Ok(Response::new(LookupPdRouteResponse {
            reason_code: reason::NO_HINT.to_owned(),
            ..Default::default()
        }))
    }

    async fn get_cache_state(
        &self,
        _request: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        self.metrics.record_rpc("GetCacheState");
        Ok(Response::new(GetCacheStateResponse {
            replicas: Vec::new(),
            summary: Some(CacheSummary::default()),
        }))
    }

    async fn report_cache_state(
        &self,
        request: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        self.metrics.record_rpc("ReportCacheState");
        let mut stream = request.into_inner();
        while let Some(update) = stream.message().await.map_err(|status| {
            Status::invalid_argument(format!(
                "ReportCacheState: bad CacheStateUpdate: {}",
                status.message()
            ))
        })? {
            tracing::trace!(replica = %update.replica_id, prefixes = update.prefixes.len(), "update");
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: reason::OK.to_owned(),
        }))
    }

    async fn publish_event(&self, _request: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.metrics.record_rpc("PublishEvent");
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: reason::OK.to_owned(),
        }))
    }

    type StreamCacheEventsStream = ResponseStream<CacheEvent>;

    async fn stream_cache_events(
        &self,
        _request: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        self.metrics.record_rpc("StreamCacheEvents");
        Ok(Response::new(Box::pin(futures::stream::empty())))
    }

    type StreamMetricsStream = ResponseStream<Metric>;

    async fn stream_metrics(
        &self,
        _request: Request<StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        self.metrics.record_rpc("StreamMetrics");
        Ok(Response::new(Box::pin(futures::stream::empty())))
    }
}
