//! The per-request state machine, written against a [`Host`] trait instead of proxy-wasm.
//!
//! ```text
//! headers ──(not an inference POST)──────────────────────────────▶ Continue
//!    │ strip client destination header; Content-Length check
//!    ▼
//! awaiting body ──(too large / bad JSON / unsupported)──────────▶ Continue
//!    │ end of stream: parse, build LookupRouteRequest, dispatch
//!    ▼
//! awaiting lookup ──(gRPC status ≠ 0, decode error, no endpoint)─▶ resume untouched
//!    │ routable reason → set destination header (not in shadow mode)
//!    ▼
//! resume ──▶ response headers: remove any reason header; add ours only when exposed
//!    │ looked up, 2xx, JSON or event stream, not compressed
//!    ▼
//! response body chunks: copied (bounded) as they pass, never held
//!    │ end of stream: read `cached_tokens`, compare with `matched_tokens`
//!    ▼
//! accuracy counters and ratio histogram (see [`crate::accuracy`]), and one
//! outcome into the worker's buffer, sent later by the root context (see
//! [`crate::report`])
//! ```
//!
//! The adapter maps [`Action`] onto proxy-wasm's and forwards callbacks; the
//! same code runs under a fake host in unit tests. One flow per request, no
//! shared mutable state; [`Settings`] is shared read-only through an `Rc`.

use std::rc::Rc;
use std::time::Duration;

use inference_cache_proto::v1alpha1::{LookupRouteResponse, RouteOutcome};
use prost::Message;

use crate::accuracy::{
    BodyKind, EventStreamReader, RESPONSE_ENCODED_METRIC, RESPONSE_PARSE_ERROR_METRIC,
    RESPONSE_TOO_LARGE_METRIC, Usage, body_kind, json_usage, ratio_percent, reason_metrics,
    verdict,
};
use crate::config::{Settings, TenantSource};
use crate::outcome::{
    FailureKind, LOOKUPS_METRIC, Outcome, ROUTED_METRIC, SHADOW_METRIC, SPOOFED_DESTINATION_METRIC,
    decide, reason_metric,
};
use crate::report::{
    OUTCOMES_BUFFERED_METRIC, OUTCOMES_DROPPED_METRIC, OUTCOMES_REROUTED_METRIC, SharedBuffer,
};
use crate::request::{Api, BodyError, classify, lookup_request, parse_body};

/// gRPC service of the lookup.
pub const LOOKUP_SERVICE: &str = inference_cache_proto::SERVICE_NAME;
/// gRPC method of the lookup.
pub const LOOKUP_METHOD: &str = "LookupRoute";
/// Property the outcome is stored under; Envoy keeps it as the filter state
/// `wasm.inferencecache_reason` (`%FILTER_STATE(wasm.inferencecache_reason:PLAIN)%`
/// in an access log).
pub const REASON_PROPERTY: &str = "inferencecache_reason";

/// Host property holding the `ip:port` of the upstream that served the request.
pub const UPSTREAM_ADDRESS: [&str; 2] = ["upstream", "address"];

/// What the host should do with the stream after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Let the request (headers and any buffered body) proceed.
    Continue,
    /// Hold the request: buffer the body or wait for the lookup.
    Pause,
}

/// Log severity, mapped onto the host's levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// Per-request detail.
    Debug,
    /// Configuration and lifecycle.
    Info,
    /// Something an operator should look at.
    Warn,
}

/// The host refused to start a gRPC call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the host refused the gRPC call")]
pub struct DispatchError;

/// The host operations one request needs (proxy-wasm in Envoy, a fake in tests).
pub trait Host {
    /// A request header's value (name lower-case), or `None` when absent.
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Sets (replaces) a request header.
    fn set_request_header(&mut self, name: &str, value: &str);
    /// Removes every value of a request header.
    fn remove_request_header(&mut self, name: &str);
    /// The first `size` bytes of the buffered request body.
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Starts a unary gRPC call to `upstream` ([`Settings::grpc_upstream`]:
    /// a cluster name or an encoded Envoy `GrpcService`); returns its token.
    fn dispatch_grpc(
        &mut self,
        upstream: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, DispatchError>;
    /// The response message of the gRPC call being delivered.
    fn grpc_response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Resumes a request paused by a previous [`Action::Pause`].
    fn resume_request(&mut self);
    /// Adds a response header.
    fn add_response_header(&mut self, name: &str, value: &str);
    /// Removes every value of a response header.
    fn remove_response_header(&mut self, name: &str);
    /// A host property (route or dynamic metadata, filter state) as raw
    /// bytes, or `None` when absent.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Stores a value in the request's filter state (readable by access logs).
    fn set_property(&mut self, path: &[&str], value: &[u8]);
    /// A response header's value (name lower-case), or `None` when absent.
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// The first `size` bytes of the response body chunk being delivered.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Adds one to a counter from [`crate::all_metrics`].
    fn increment_counter(&mut self, name: &'static str);
    /// Records a value in a histogram from [`crate::all_histograms`].
    fn record_histogram(&mut self, name: &'static str, value: u64);
    /// Writes a log line.
    fn log(&self, level: LogLevel, message: &str);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not an inference request, or already decided.
    Idle,
    /// Buffering the body of an inference request.
    AwaitingBody(Api),
    /// The lookup with this token is in flight.
    AwaitingLookup(u32),
}

/// What the lookup promised: the reason code and the reuse it predicted.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Prediction {
    reason: String,
    /// The routed replica's `matched_tokens`; zero when not routed on the hint.
    matched_tokens: u64,
    /// The routed replica; for an unhinted request the replica that served
    /// it (filled in from the upstream address), or empty.
    replica_id: String,
    /// The request was routed on the hint.
    routed: bool,
    /// The answer was in shadow mode: measured, never routed.
    shadow: bool,
}

/// The tenant and model a lookup was made for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct LookupKey {
    tenant_id: String,
    model_id: String,
}

/// The response body being read for its `usage`.
#[derive(Debug)]
enum ResponseReader {
    Json(Vec<u8>),
    EventStream(EventStreamReader),
}

/// One request's path through the filter.
#[derive(Debug)]
pub struct RequestFlow {
    settings: Rc<Settings>,
    state: State,
    outcome: Option<Outcome>,
    prediction: Option<Prediction>,
    response: Option<ResponseReader>,
    key: LookupKey,
    sink: Option<SharedBuffer>,
}

impl RequestFlow {
    /// A fresh flow for a new request.
    pub fn new(settings: Rc<Settings>) -> Self {
        Self {
            settings,
            state: State::Idle,
            outcome: None,
            prediction: None,
            response: None,
            key: LookupKey::default(),
            sink: None,
        }
    }

    /// Measured outcomes go into `buffer`, for the worker's reporter to send.
    pub fn with_outcome_sink(mut self, buffer: SharedBuffer) -> Self {
        self.sink = Some(buffer);
        self
    }

    /// How the request ended, once it has.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// Request headers arrived.
    pub fn on_request_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Action {
        let destination = self.settings.destination_header.as_str();
        if host.request_header(destination).is_some() {
            host.remove_request_header(destination);
            host.increment_counter(SPOOFED_DESTINATION_METRIC);
        }
        let method = header_string(host, ":method");
        let path = header_string(host, ":path");
        let Some(api) = classify(&method, &path) else {
            return Action::Continue;
        };
        if end_of_stream {
            self.fail(host, FailureKind::InvalidJson);
            return Action::Continue;
        }
        let declared_length = header_string(host, "content-length").trim().parse::<u64>();
        if let Ok(length) = declared_length
            && length > self.settings.max_body_bytes as u64
        {
            self.fail(host, FailureKind::BodyTooLarge);
            return Action::Continue;
        }
        self.state = State::AwaitingBody(api);
        Action::Pause
    }

    /// A chunk of request body arrived; `body_size` is the total buffered so far.
    pub fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let State::AwaitingBody(api) = self.state else {
            return Action::Continue;
        };
        if body_size > self.settings.max_body_bytes {
            self.fail(host, FailureKind::BodyTooLarge);
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.start_lookup(host, api, body_size)
    }

    /// Request trailers arrived: the body is complete.
    pub fn on_request_trailers(&mut self, host: &mut dyn Host, body_size: usize) -> Action {
        let State::AwaitingBody(api) = self.state else {
            return Action::Continue;
        };
        self.start_lookup(host, api, body_size)
    }

    fn start_lookup(&mut self, host: &mut dyn Host, api: Api, body_size: usize) -> Action {
        let body = host.request_body(body_size).unwrap_or_default();
        let tenant = self.tenant(host);
        let request = match parse_body(api, &body)
            .and_then(|parsed| lookup_request(&self.settings, &tenant, parsed))
        {
            Ok(request) => request,
            Err(error) => {
                self.fail(host, failure_of(error));
                return Action::Continue;
            }
        };
        self.key = LookupKey {
            tenant_id: request.tenant_id.clone(),
            model_id: request.model_id.clone(),
        };
        let message = request.encode_to_vec();
        match host.dispatch_grpc(
            &self.settings.grpc_upstream,
            LOOKUP_SERVICE,
            LOOKUP_METHOD,
            &message,
            self.settings.timeout,
        ) {
            Ok(token) => {
                host.increment_counter(LOOKUPS_METRIC);
                self.state = State::AwaitingLookup(token);
                Action::Pause
            }
            Err(DispatchError) => {
                host.log(
                    LogLevel::Warn,
                    &format!(
                        "LookupRoute dispatch to cluster `{}` failed; routing normally",
                        self.settings.grpc_cluster
                    ),
                );
                self.fail(host, FailureKind::DispatchFailed);
                Action::Continue
            }
        }
    }

    /// The lookup finished: `status` is the gRPC status (0 = OK, the message is `response_size` bytes).
    pub fn on_lookup_response(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        status: u32,
        response_size: usize,
    ) {
        if self.state != State::AwaitingLookup(token) {
            return;
        }
        self.state = State::Idle;
        let outcome = if status != 0 {
            host.log(
                LogLevel::Debug,
                &format!("LookupRoute ended with gRPC status {status}; routing normally"),
            );
            Outcome::Failed(FailureKind::GrpcError)
        } else {
            let body = host.grpc_response_body(response_size).unwrap_or_default();
            match LookupRouteResponse::decode(body.as_slice()) {
                Ok(response) => {
                    host.increment_counter(reason_metric(&response.reason_code));
                    let outcome = decide(&self.settings, &response);
                    let top_matched = response
                        .replica_scores
                        .first()
                        .map_or(0, |top| u64::try_from(top.matched_tokens).unwrap_or(0));
                    let (matched_tokens, replica_id, routed) = match &outcome {
                        Outcome::Routed { replica_id, .. } => {
                            (top_matched, replica_id.clone(), true)
                        }
                        // What routing would have predicted, on the replica it would have chosen.
                        Outcome::Shadow { replica_id, .. } => {
                            (top_matched, replica_id.clone(), false)
                        }
                        _ => (0, String::new(), false),
                    };
                    self.prediction = Some(Prediction {
                        reason: response.reason_code.clone(),
                        matched_tokens,
                        replica_id,
                        routed,
                        shadow: response.shadow,
                    });
                    outcome
                }
                Err(_) => Outcome::Failed(FailureKind::DecodeError),
            }
        };
        match &outcome {
            Outcome::Routed { endpoint, .. } => {
                host.set_request_header(&self.settings.destination_header, endpoint);
                host.increment_counter(ROUTED_METRIC);
            }
            Outcome::Failed(kind) => host.increment_counter(kind.metric()),
            Outcome::Shadow { .. } => host.increment_counter(SHADOW_METRIC),
            Outcome::NotRouted { .. } => {}
        }
        self.record(host, outcome);
        host.resume_request();
    }

    /// Response headers arrived: report the outcome of an inference request.
    ///
    /// The reason header leaves the gateway only when `expose_reason_header`
    /// is set; otherwise any copy of it (from an upstream, say) is removed,
    /// because it tells a client whether a prompt is cached. The outcome is
    /// always stored as the filter state [`REASON_PROPERTY`] for access logs.
    pub fn on_response_headers(&mut self, host: &mut dyn Host) -> Action {
        if let Some(name) = &self.settings.reason_header {
            host.remove_response_header(name);
            if self.settings.expose_reason_header
                && let Some(outcome) = &self.outcome
            {
                host.add_response_header(name, outcome.header_value());
            }
        }
        self.response = self.response_reader(host);
        if self.response.is_some()
            && let Some(prediction) = &mut self.prediction
            && (prediction.routed || prediction.replica_id.is_empty())
            && let Some(address) = host.property(&UPSTREAM_ADDRESS)
        {
            let served = String::from_utf8_lossy(&address);
            if !prediction.routed {
                prediction.replica_id = self.settings.replica_of(&served).unwrap_or_default();
            } else if let Some(Outcome::Routed { endpoint, .. }) = &self.outcome
                && served != endpoint.as_str()
            {
                // The pool served it elsewhere (the hinted endpoint was not a
                // healthy member): the hint did not apply to this response.
                prediction.routed = false;
                prediction.matched_tokens = 0;
                prediction.replica_id = self.settings.replica_of(&served).unwrap_or_default();
                host.increment_counter(OUTCOMES_REROUTED_METRIC);
            }
        }
        Action::Continue
    }

    /// Whether (and how) to read this response for the engine's `usage`:
    /// only after a lookup answered, only a 2xx uncompressed JSON or event
    /// stream, and only when measurement is on.
    fn response_reader(&self, host: &mut dyn Host) -> Option<ResponseReader> {
        self.prediction.as_ref()?;
        if self.settings.max_response_body_bytes == 0 {
            return None;
        }
        let status = response_header_string(host, ":status");
        if !status.starts_with('2') {
            return None;
        }
        let kind = body_kind(&response_header_string(host, "content-type"))?;
        let encoding = response_header_string(host, "content-encoding");
        if !encoding.is_empty() && !encoding.eq_ignore_ascii_case("identity") {
            host.increment_counter(RESPONSE_ENCODED_METRIC);
            return None;
        }
        Some(match kind {
            BodyKind::Json => ResponseReader::Json(Vec::new()),
            BodyKind::EventStream => ResponseReader::EventStream(EventStreamReader::new(
                self.settings.max_response_body_bytes,
            )),
        })
    }

    /// A response body chunk of `chunk_size` bytes passes; it always continues.
    ///
    /// The chunk is copied (bounded by `max_response_body_bytes`), never held:
    /// a streaming response reaches the client exactly as fast as without
    /// the filter.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        chunk_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.response.is_none() {
            return Action::Continue;
        }
        let chunk = if chunk_size == 0 {
            Vec::new()
        } else {
            host.response_body(chunk_size).unwrap_or_default()
        };
        let limit = self.settings.max_response_body_bytes;
        let fits = match &mut self.response {
            Some(ResponseReader::Json(body)) => {
                let fits = body.len() + chunk.len() <= limit;
                if fits {
                    body.extend_from_slice(&chunk);
                }
                fits
            }
            Some(ResponseReader::EventStream(reader)) => reader.push(&chunk).is_ok(),
            None => true,
        };
        if !fits {
            self.response = None;
            host.increment_counter(RESPONSE_TOO_LARGE_METRIC);
            return Action::Continue;
        }
        if end_of_stream {
            self.finish_response(host);
        }
        Action::Continue
    }

    /// Response trailers arrived: the body is complete.
    pub fn on_response_trailers(&mut self, host: &mut dyn Host) -> Action {
        self.finish_response(host);
        Action::Continue
    }

    fn finish_response(&mut self, host: &mut dyn Host) {
        let Some(reader) = self.response.take() else {
            return;
        };
        let Some(prediction) = &self.prediction else {
            return;
        };
        let usage = match reader {
            ResponseReader::Json(body) => match json_usage(&body) {
                Ok(usage) => usage,
                Err(_) => {
                    host.increment_counter(RESPONSE_PARSE_ERROR_METRIC);
                    return;
                }
            },
            ResponseReader::EventStream(reader) => reader.finish(),
        };
        let metrics = reason_metrics(&prediction.reason);
        let Some(cached) = usage.and_then(|Usage { cached_tokens, .. }| cached_tokens) else {
            host.increment_counter(metrics.no_usage);
            return;
        };
        let predicted = prediction.matched_tokens;
        host.increment_counter(metrics.counter(verdict(predicted, cached)));
        if let Some(percent) = ratio_percent(predicted, cached) {
            host.record_histogram(metrics.ratio_percent, percent);
        }
        host.log(
            LogLevel::Debug,
            &format!(
                "{}: predicted {predicted} cached tokens, engine reported {cached}",
                metrics.code
            ),
        );
        if let Some(sink) = &self.sink {
            let outcome = RouteOutcome {
                tenant_id: self.key.tenant_id.clone(),
                model_id: self.key.model_id.clone(),
                replica_id: prediction.replica_id.clone(),
                reason_code: prediction.reason.clone(),
                predicted_tokens: i64::try_from(predicted).unwrap_or(i64::MAX),
                cached_tokens: i64::try_from(cached).unwrap_or(i64::MAX),
                prompt_tokens: usage
                    .and_then(|usage| usage.prompt_tokens)
                    .and_then(|tokens| i64::try_from(tokens).ok())
                    .unwrap_or(0),
                routed: prediction.routed,
                shadow: prediction.shadow,
            };
            let kept = sink.borrow_mut().push(outcome);
            host.increment_counter(if kept {
                OUTCOMES_BUFFERED_METRIC
            } else {
                OUTCOMES_DROPPED_METRIC
            });
        }
    }

    fn fail(&mut self, host: &mut dyn Host, kind: FailureKind) {
        host.increment_counter(kind.metric());
        self.state = State::Idle;
        self.record(host, Outcome::Failed(kind));
    }

    fn record(&mut self, host: &mut dyn Host, outcome: Outcome) {
        host.set_property(&[REASON_PROPERTY], outcome.header_value().as_bytes());
        self.outcome = Some(outcome);
    }

    fn tenant(&self, host: &dyn Host) -> String {
        let value = match &self.settings.tenant {
            TenantSource::Fixed => None,
            TenantSource::Header(name) => host.request_header(name),
            source => source.property_path().and_then(|path| host.property(&path)),
        };
        match value {
            Some(value) if !value.is_empty() => String::from_utf8_lossy(&value).into_owned(),
            _ => self.settings.tenant_id.clone(),
        }
    }
}

fn header_string(host: &dyn Host, name: &str) -> String {
    host.request_header(name)
        .map(|value| String::from_utf8_lossy(&value).into_owned())
        .unwrap_or_default()
}

fn response_header_string(host: &dyn Host, name: &str) -> String {
    host.response_header(name)
        .map(|value| String::from_utf8_lossy(&value).trim().to_owned())
        .unwrap_or_default()
}

fn failure_of(error: BodyError) -> FailureKind {
    match error {
        BodyError::InvalidJson => FailureKind::InvalidJson,
        BodyError::MissingModel => FailureKind::MissingModel,
        BodyError::UnsupportedPrompt => FailureKind::UnsupportedPrompt,
        BodyError::PromptTooShort => FailureKind::PromptTooShort,
    }
}

#[cfg(test)]
mod tests;
