//! The `InferenceCache` gRPC service: translates wire messages to the server's
//! domain calls and back. Protobuf types stop here.
//!
//! Consumer-side handlers never return an error status: every failure becomes
//! a fail-open envelope (empty `replica_scores` with a reason code).
//!
//! ReportOutcomes feeds the hint-accuracy book ([`crate::outcomes`]) that
//! `GetCacheState`, `/metrics` and `/snapshot/accuracy` show; it is a
//! producer-class write, authenticated and scoped like ReportCacheState.
//!
//! LookupRoute, ReportCacheState, PublishEvent and GetCacheState are backed by
//! the cache index: this module converts wire messages into the index's plain
//! types ([`resolve_input`] decides which prompt input a lookup uses) and the
//! answers back. Ingest runs per streamed message, so lookups interleave with
//! a long-lived ReportCacheState stream.
//!
//! Every wire input is bounded here, once, before it reaches the index
//! (see [`crate::limits`]), and callers are authenticated and scoped to their
//! tenants here (see [`crate::auth`]). The wire's `int32` token counts and
//! byte-string hashes are checked here too, once, after the bounds
//! ([`block_chain`], [`exact_token_count`]): the index takes typed chains
//! (`index::BlockChain`), an update carries the reasons of the entries
//! refused here ([`cache_update`]) and a lookup says which kind of chain it
//! has (`index::ChainInput`), so drops and answers are what they were when
//! the index checked the wire itself.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::inference_cache_server::InferenceCache;
use inference_cache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, CacheSummary, GetCacheStateRequest, GetCacheStateResponse,
    LookupPdRouteRequest, LookupPdRouteResponse, LookupRouteRequest, LookupRouteResponse, Metric,
    OutcomeReport, RenderTemplateRequest, RenderTemplateResponse, ReplicaAccuracy,
    StreamEventsRequest, StreamMetricsRequest,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Authorizer, Credentials};
use crate::index_runtime::IndexState;
use crate::limits::{Limits, MAX_GRPC_DEADLINE};
use crate::metrics::Metrics;
use crate::prompt_inputs::{PromptState, TextInput, TokenizeFailure};
use inference_cache_index as index;
use inference_cache_proto::v1alpha1::{ReplicaScore, ReplicaStats};

/// Boxed server-streaming response.
type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Implementation of the generated `InferenceCache` trait.
pub struct CacheService {
    metrics: Arc<Metrics>,
    index: Arc<IndexState>,
    prompts: Arc<PromptState>,
    limits: Arc<Limits>,
    auth: Arc<Authorizer>,
    /// Cancelled when the shutdown drain deadline passes: open producer streams end.
    cut: CancellationToken,
}

impl CacheService {
    /// Creates the service over shared metrics, the cache index and the prompt inputs.
    pub fn new(metrics: Arc<Metrics>, index: Arc<IndexState>, prompts: Arc<PromptState>) -> Self {
        Self {
            metrics,
            index,
            prompts,
            limits: Arc::new(Limits::default()),
            auth: Arc::new(Authorizer::with_config(None, false)),
            cut: CancellationToken::new(),
        }
    }

    /// Sets the request limits, the authorizer and the token that ends open
    /// streams at the drain deadline.
    pub fn with_guards(
        mut self,
        limits: Arc<Limits>,
        auth: Arc<Authorizer>,
        cut: CancellationToken,
    ) -> Self {
        self.limits = limits;
        self.auth = auth;
        self.cut = cut;
        self
    }

    /// The fail-open envelope with `reason`, counted like any other answer.
    fn fail_open(&self, reason: &str, started: Instant) -> Response<LookupRouteResponse> {
        let response = LookupRouteResponse {
            reason_code: reason.to_owned(),
            lookup_latency_us: elapsed_us(started),
            ..Default::default()
        };
        self.metrics
            .record_lookup(&response.reason_code, started.elapsed().as_secs_f64());
        let decision = if reason == reason::TIMEOUT {
            index::Decision::Timeout
        } else {
            index::Decision::NotConsulted
        };
        self.metrics.record_decision(reason, decision.as_str());
        Response::new(response)
    }

    /// Applies the lookup limits in place: an over-long chain or token list is
    /// cut to a prefix (still a valid lookup); a hash wider than the scheme
    /// allows makes the lookup fail open (`false`).
    /// The caller's deadline: its `grpc-timeout` from `started`, clamped to
    /// [`MAX_GRPC_DEADLINE`] so no deadline arithmetic can overflow.
    fn caller_deadline(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        started: Instant,
    ) -> Option<Instant> {
        let timeout = grpc_timeout(metadata)?;
        if timeout > MAX_GRPC_DEADLINE {
            self.metrics.record_limit("grpc_timeout_clamped");
        }
        started.checked_add(timeout.min(MAX_GRPC_DEADLINE))
    }

    /// Turns a text input into a token chain, or says why not: `Ok(None)` is
    /// the tokenizer fail-open (no tokenizer for the model, or it failed),
    /// `Err(())` a timeout.
    async fn tokenize(
        &self,
        request: &LookupRouteRequest,
        deadline: Option<Instant>,
    ) -> Result<Option<Vec<u32>>, ()> {
        let policies = self.index.index.policies();
        let policy = policies.for_tenant(&request.tenant_id);
        // Inputs the index answers without a chain: do not spend a tokenization on them.
        if request.tenant_id == index::PROBE_TENANT
            || request.hash_scheme.is_empty()
            || policy.strategy.require_chain
            || !self.prompts.has_tokenizer(&request.model_id)
        {
            return Ok(None);
        }
        if request.messages.len() > self.limits.max_chat_messages {
            self.metrics.record_limit("chat_messages");
            return Ok(None);
        }
        if crate::limits::prompt_bytes(request) > self.limits.max_prompt_bytes {
            self.metrics.record_limit("prompt_bytes");
            return Ok(None);
        }
        let Some(input) = TextInput::from_request(request) else {
            return Ok(None);
        };
        match self
            .prompts
            .tokenize(&request.model_id, input, policy.lookup_timeout_ms, deadline)
            .await
        {
            Ok(ids) => Ok(Some(ids)),
            Err(TokenizeFailure::Timeout(budget)) => {
                tracing::debug!(model = %request.model_id, ?budget, "tokenization timed out");
                Err(())
            }
            Err(TokenizeFailure::Busy(slots)) => {
                tracing::debug!(model = %request.model_id, slots, "every tokenization slot busy");
                self.metrics.record_limit("tokenize_concurrency");
                Err(())
            }
            Err(error) => {
                tracing::debug!(model = %request.model_id, %error, "tokenization failed, no hint");
                Ok(None)
            }
        }
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
        if request.variables.len() > self.limits.max_template_variables {
            self.metrics.record_limit("template_variables");
            let mut response = Response::new(RenderTemplateResponse {
                tenant_namespace: request.tenant_id.into_bytes(),
                reason_code: reason::RENDER_ERROR.to_owned(),
                ..Default::default()
            });
            let detail = format!(
                "{} variables, more than --max-template-variables {}",
                request.variables.len(),
                self.limits.max_template_variables
            );
            if let Ok(detail) = detail.parse() {
                response.metadata_mut().insert(RENDER_ERROR_HEADER, detail);
            }
            return Ok(response);
        }
        let variables: std::collections::HashMap<String, String> =
            request.variables.into_iter().collect();
        let tenant_namespace = request.tenant_id.into_bytes();
        match self.prompts.render(&request.template_ref, &variables) {
            Ok(rendered) => Ok(Response::new(RenderTemplateResponse {
                rendered_prompt: rendered.text.into_bytes(),
                stable_prefix_hash: rendered.stable_prefix_hash.to_vec(),
                tenant_namespace,
                reason_code: reason::OK.to_owned(),
                template_revision: rendered.revision.to_string(),
            })),
            Err(error) => {
                let code = if error.is_not_found() {
                    reason::TEMPLATE_NOT_FOUND
                } else {
                    reason::RENDER_ERROR
                };
                let mut response = Response::new(RenderTemplateResponse {
                    tenant_namespace,
                    reason_code: code.to_owned(),
                    ..Default::default()
                });
                // The reason code is the contract; the detail (e.g. the missing slot) rides in metadata.
                if let Ok(detail) = error.to_string().parse() {
                    response.metadata_mut().insert(RENDER_ERROR_HEADER, detail);
                }
                Ok(response)
            }
        }
    }

    async fn lookup_route(
        &self,
        request: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        let started = Instant::now();
        let deadline = self.caller_deadline(request.metadata(), started);
        let credentials = Credentials::of(&request);
        let mut request = request.into_inner();
        match self.auth.consumer(&credentials) {
            Ok(caller) if caller.may_read(&request.tenant_id) => {}
            Ok(_) => {
                self.metrics.record_auth_refused("LookupRoute", "tenant");
                return Ok(self.fail_open(reason::NO_HINT, started));
            }
            Err(refusal) => {
                self.metrics
                    .record_auth_refused("LookupRoute", refusal.reason);
                return Ok(self.fail_open(reason::NO_HINT, started));
            }
        }
        if !crate::limits::bound_lookup(&self.limits, &self.metrics, &mut request) {
            return Ok(self.fail_open(reason::NO_HINT, started));
        }
        let mut input = resolve_input(&request, self.index.engine_block_size);
        let mut token_ids = Vec::new();
        if input == ResolvedInput::NeedsTokenizer {
            match self.tokenize(&request, deadline).await {
                Ok(Some(ids)) => {
                    input = ResolvedInput::Tokens(inference_cache_fingerprint::request_chain(
                        &ids,
                        self.index.engine_block_size,
                    ));
                    token_ids = ids;
                }
                Ok(None) => {}
                Err(()) => return Ok(self.fail_open(reason::TIMEOUT, started)),
            }
        }
        let outcome = lookup(&self.index, &request, &input, started, deadline);
        // Shadow mode: the same answer, flagged so gateways measure it without routing.
        let shadow = self
            .index
            .index
            .policies()
            .for_tenant(&request.tenant_id)
            .shadow;
        let decision = outcome.decision.as_str();
        tracing::debug!(
            tenant = %request.tenant_id,
            reason = outcome.reason.as_str(),
            decision,
            replica = outcome.top().map_or("", |(name, _)| name),
            matched_tokens = outcome.top().map_or(0, |(_, s)| s.matched_tokens),
            "lookup answered"
        );
        self.metrics
            .record_decision(outcome.reason.as_str(), decision);
        let response = LookupRouteResponse {
            replica_scores: outcome.named_scores().map(replica_score).collect(),
            reason_code: outcome.reason.as_str().to_owned(),
            lookup_latency_us: elapsed_us(started),
            token_ids,
            adapter_id: outcome.adapter_id,
            shadow,
        };
        self.metrics
            .record_lookup(&response.reason_code, started.elapsed().as_secs_f64());
        Ok(Response::new(response))
    }

    async fn lookup_pd_route(
        &self,
        request: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        let started = Instant::now();
        self.metrics.record_rpc("LookupPDRoute");
        let deadline = self.caller_deadline(request.metadata(), started);
        let credentials = Credentials::of(&request);
        let request = request.into_inner();
        let refused = match self.auth.consumer(&credentials) {
            Ok(caller) if caller.may_read(&request.tenant_id) => None,
            Ok(_) => Some("tenant"),
            Err(refusal) => Some(refusal.reason),
        };
        if let Some(why) = refused {
            self.metrics.record_auth_refused("LookupPDRoute", why);
            return Ok(Response::new(LookupPdRouteResponse {
                reason_code: reason::NO_HINT.to_owned(),
                ..Default::default()
            }));
        }
        let query = crate::pd_route::PdQuery {
            tenant_id: &request.tenant_id,
            model_id: &request.model_id,
            prefix_hash: &request.prefix_hash,
            prefix_token_count: exact_token_count(request.prefix_token_count),
            topology: &request.pd_topology_ref,
            arrived: started,
            deadline,
        };
        let answer = crate::pd_route::route(
            &self.index.index,
            &self.index.pd_topologies(),
            &query,
            self.index.now_ms(),
        );
        Ok(Response::new(LookupPdRouteResponse {
            prefill_replica_id: answer.prefill_replica_id,
            decode_replica_id: answer.decode_replica_id,
            transport_hint: answer.transport_hint,
            reason_code: answer.reason.to_owned(),
        }))
    }

    async fn get_cache_state(
        &self,
        request: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        self.metrics.record_rpc("GetCacheState");
        let credentials = Credentials::of(&request);
        let request = request.into_inner();
        match self.auth.consumer(&credentials) {
            Ok(caller) if caller.may_read(&request.tenant_id) => {}
            Ok(_) => {
                self.metrics.record_auth_refused("GetCacheState", "tenant");
                return Err(Status::permission_denied(
                    "GetCacheState: tenant outside the caller's grant",
                ));
            }
            Err(refusal) => {
                self.metrics
                    .record_auth_refused("GetCacheState", refusal.reason);
                return Err(refusal.status("GetCacheState"));
            }
        }
        let state = self
            .index
            .index
            .cache_state(&request.tenant_id, &request.model_id);
        let summary = CacheSummary {
            replica_count: state.summary.replica_count,
            prefix_count: state.summary.prefix_count,
            entry_count: state.summary.entry_count,
            mean_hit_rate: state.summary.mean_hit_rate,
            mean_pressure: state.summary.mean_pressure,
            cache_memory_bytes: state.summary.cache_memory_bytes,
        };
        let replicas = state
            .replicas
            .into_iter()
            .map(|r| match r.stats {
                Some(s) => ReplicaStats {
                    replica_id: r.replica_id,
                    cache_memory_bytes: s.cache_memory_bytes,
                    hit_rate: s.hit_rate,
                    pressure: s.pressure,
                    client_version: s.client_version,
                    t2_hit_tokens: s.t2_hit_tokens,
                    t2_query_tokens: s.t2_query_tokens,
                    requests_waiting: s.requests_waiting,
                    requests_running: s.requests_running,
                    kv_cache_usage: s.kv_cache_usage,
                },
                None => ReplicaStats {
                    replica_id: r.replica_id,
                    ..Default::default()
                },
            })
            .collect();
        let accuracy = self
            .metrics
            .outcomes
            .rows(&request.tenant_id, &request.model_id)
            .into_iter()
            .map(replica_accuracy)
            .collect();
        Ok(Response::new(GetCacheStateResponse {
            replicas,
            summary: Some(summary),
            accuracy,
        }))
    }

    async fn report_outcomes(
        &self,
        request: Request<OutcomeReport>,
    ) -> Result<Response<Ack>, Status> {
        self.metrics.record_rpc("ReportOutcomes");
        let caller = self
            .auth
            .producer(&Credentials::of(&request))
            .map_err(|refusal| {
                self.metrics
                    .record_auth_refused("ReportOutcomes", refusal.reason);
                refusal.status("ReportOutcomes")
            })?;
        let report = request.into_inner();
        for outcome in &report.outcomes {
            if let Err(refusal) =
                caller.may_write(&outcome.tenant_id, [outcome.replica_id.as_str()])
            {
                self.metrics
                    .record_auth_refused("ReportOutcomes", refusal.reason);
                return Err(refusal.status(&format!(
                    "ReportOutcomes: outcome of replica {:?} in tenant {:?}",
                    outcome.replica_id, outcome.tenant_id
                )));
            }
        }
        let book = &self.metrics.outcomes;
        book.dropped_by_gateways.inc_by(report.dropped);
        let outcomes: Vec<crate::outcomes::Outcome> = report
            .outcomes
            .into_iter()
            // The reserved probe scope is never written through the public contract.
            .filter(|outcome| outcome.tenant_id != index::PROBE_TENANT)
            .map(|outcome| crate::outcomes::Outcome {
                tenant_id: outcome.tenant_id,
                model_id: outcome.model_id,
                replica_id: outcome.replica_id,
                predicted_tokens: u64::try_from(outcome.predicted_tokens).unwrap_or(0),
                cached_tokens: u64::try_from(outcome.cached_tokens).unwrap_or(0),
                routed: outcome.routed,
                shadow: outcome.shadow,
            })
            .collect();
        let recorded = book.record(&outcomes);
        self.metrics
            .record_limit_n("outcome_series", recorded.folded);
        self.metrics
            .record_limit_n("outcome_id_bytes", recorded.refused);
        self.metrics.record_limit_n("outcome_batch", recorded.cut);
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: reason::OK.to_owned(),
        }))
    }

    async fn report_cache_state(
        &self,
        request: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        self.metrics.record_rpc("ReportCacheState");
        let caller = self
            .auth
            .producer(&Credentials::of(&request))
            .map_err(|refusal| {
                self.metrics
                    .record_auth_refused("ReportCacheState", refusal.reason);
                refusal.status("ReportCacheState")
            })?;
        let mut stream = request.into_inner();
        loop {
            let next = tokio::select! {
                biased;
                () = self.cut.cancelled() => {
                    self.metrics.streams_cut.inc();
                    return Err(Status::unavailable("ReportCacheState: server shutting down"));
                }
                next = stream.message() => next,
            };
            let update = match next {
                Ok(Some(update)) => update,
                Ok(None) => break,
                // Over --grpc-max-message-bytes: passed on as is (counted by the transport layer).
                Err(status) if status.code() == tonic::Code::OutOfRange => return Err(status),
                Err(status) => {
                    return Err(Status::invalid_argument(format!(
                        "ReportCacheState: bad CacheStateUpdate: {}",
                        status.message()
                    )));
                }
            };
            let stats_replica = update
                .stats
                .as_ref()
                .map(|s| s.replica_id.as_str())
                .filter(|r| !r.is_empty());
            let replicas = std::iter::once(update.replica_id.as_str()).chain(stats_replica);
            if let Err(refusal) = caller.may_write(&update.tenant_id, replicas) {
                self.metrics
                    .record_auth_refused("ReportCacheState", refusal.reason);
                return Err(refusal.status(&format!(
                    "ReportCacheState: update of replica {:?} for tenant {:?}",
                    update.replica_id, update.tenant_id
                )));
            }
            let mut update = update;
            crate::limits::bound_update(&self.limits, &self.metrics, &mut update);
            self.index.ingest(&cache_update(update));
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: reason::OK.to_owned(),
        }))
    }

    async fn publish_event(&self, request: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.metrics.record_rpc("PublishEvent");
        let caller = self
            .auth
            .producer(&Credentials::of(&request))
            .map_err(|refusal| {
                self.metrics
                    .record_auth_refused("PublishEvent", refusal.reason);
                refusal.status("PublishEvent")
            })?;
        let event = request.into_inner();
        if let Err(refusal) = caller.may_write(&event.tenant_id, [event.replica_id.as_str()]) {
            self.metrics
                .record_auth_refused("PublishEvent", refusal.reason);
            return Err(refusal.status(&format!(
                "PublishEvent: event for replica {:?} in tenant {:?}",
                event.replica_id, event.tenant_id
            )));
        }
        let Some(event) = crate::streams::index_event(&event) else {
            return Ok(Response::new(Ack {
                accepted: false,
                reason_code: UNKNOWN_EVENT_TYPE.to_owned(),
            }));
        };
        self.index.publish(&event);
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: reason::OK.to_owned(),
        }))
    }

    type StreamCacheEventsStream = ResponseStream<CacheEvent>;

    async fn stream_cache_events(
        &self,
        request: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        self.metrics.record_rpc("StreamCacheEvents");
        let caller = self
            .auth
            .consumer(&Credentials::of(&request))
            .map_err(|refusal| {
                self.metrics
                    .record_auth_refused("StreamCacheEvents", refusal.reason);
                refusal.status("StreamCacheEvents")
            })?;
        let request = request.into_inner();
        if !request.tenant_id.is_empty() && !caller.may_read(&request.tenant_id) {
            self.metrics
                .record_auth_refused("StreamCacheEvents", "tenant");
            return Err(Status::permission_denied(
                "StreamCacheEvents: tenant outside the caller's grant",
            ));
        }
        let events = self.index.streams().watch(request, caller);
        Ok(Response::new(Box::pin(events)))
    }

    type StreamMetricsStream = ResponseStream<Metric>;

    async fn stream_metrics(
        &self,
        request: Request<StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        self.metrics.record_rpc("StreamMetrics");
        if let Err(refusal) = self.auth.consumer(&Credentials::of(&request)) {
            self.metrics
                .record_auth_refused("StreamMetrics", refusal.reason);
            return Err(refusal.status("StreamMetrics"));
        }
        let snapshots = self
            .index
            .streams()
            .metric_snapshots(Arc::clone(&self.metrics), request.into_inner());
        Ok(Response::new(Box::pin(snapshots)))
    }
}

/// Response metadata key carrying why RenderTemplate failed (e.g. the missing slot).
pub const RENDER_ERROR_HEADER: &str = "x-inferencecache-render-error";

/// Ack reason of a PublishEvent whose type is unspecified or unknown.
const UNKNOWN_EVENT_TYPE: &str = "UNKNOWN_EVENT_TYPE";

/// Which prompt input a LookupRoute uses, by the contract's precedence.
#[derive(Debug, PartialEq)]
pub(crate) enum ResolvedInput {
    /// A wire `block_hashes` chain of parallel arrays (of equal, non-zero
    /// length; its counts and hashes are checked when it is converted).
    WireChain,
    /// A wire chain whose arrays disagree in length: malformed, NO_HINT.
    MalformedChain,
    /// The legacy exact `prefix_hash`.
    ExactHash,
    /// `token_ids` fingerprinted with the engine block size (may be empty when too short).
    Tokens(inference_cache_fingerprint::RequestChain),
    /// messages / raw_prompt / prompt_text: the server tokenizes them (or fails open).
    NeedsTokenizer,
    /// Nothing to fingerprint.
    Nothing,
}

/// Resolves the request's prompt input: chain > prefix_hash > token_ids > messages /
/// raw_prompt / prompt_text. Every input mode funnels through here.
pub(crate) fn resolve_input(request: &LookupRouteRequest, block_size: usize) -> ResolvedInput {
    let chain_len = request.block_hashes.len();
    if chain_len > 0 || !request.block_token_counts.is_empty() {
        return if chain_len == request.block_token_counts.len() {
            ResolvedInput::WireChain
        } else {
            ResolvedInput::MalformedChain
        };
    }
    if !request.prefix_hash.is_empty() {
        return ResolvedInput::ExactHash;
    }
    if !request.token_ids.is_empty() {
        return ResolvedInput::Tokens(inference_cache_fingerprint::request_chain(
            &request.token_ids,
            block_size,
        ));
    }
    if !request.messages.is_empty()
        || !request.messages_json.is_empty()
        || !request.raw_prompt.is_empty()
        || !request.prompt_text.is_empty()
    {
        return ResolvedInput::NeedsTokenizer;
    }
    ResolvedInput::Nothing
}

/// Resolves the input and asks the index.
fn lookup(
    state: &IndexState,
    request: &LookupRouteRequest,
    input: &ResolvedInput,
    arrived: Instant,
    deadline: Option<Instant>,
) -> index::LookupOutcome {
    let mut query =
        index::LookupRequest::new(&request.tenant_id, &request.model_id, &request.hash_scheme);
    // A salted request looks only in its salt's partition (the subscriber
    // reports salted blocks under the same key).
    let partition =
        inference_cache_fingerprint::partition_key(&request.adapter_id, &request.cache_salt);
    query.adapter_id = &partition;
    query.slo_ttft_ms = request.slo.as_ref().map_or(0, |s| s.ttft_ms);
    query.arrived = arrived;
    query.deadline = deadline;
    let chain = match input {
        ResolvedInput::WireChain => {
            block_chain(&request.block_hashes, &request.block_token_counts).ok()
        }
        ResolvedInput::Tokens(chain) => derived_chain(chain),
        _ => None,
    };
    match (input, &chain) {
        (ResolvedInput::WireChain, wire) => {
            query.chain = wire
                .as_ref()
                .map_or(index::ChainInput::Invalid, index::ChainInput::Wire);
            query.prefix_hash = &request.prefix_hash;
            query.prefix_token_count = exact_token_count(request.prefix_token_count);
        }
        (ResolvedInput::MalformedChain, _) => query.chain = index::ChainInput::Mismatched,
        (ResolvedInput::ExactHash, _) => {
            query.prefix_hash = &request.prefix_hash;
            query.prefix_token_count = exact_token_count(request.prefix_token_count);
        }
        (ResolvedInput::Tokens(_), Some(derived)) => {
            query.chain = index::ChainInput::Derived(derived);
        }
        (ResolvedInput::Tokens(_) | ResolvedInput::NeedsTokenizer | ResolvedInput::Nothing, _) => {}
    }
    let mut outcome = state.index.lookup(&query);
    if *input == ResolvedInput::NeedsTokenizer && outcome.reason == index::Reason::NoHint {
        // Tokenizer fail-open envelope: returned before the index is consulted.
        outcome.adapter_id.clear();
    } else if !outcome.adapter_id.is_empty() {
        // Echo the request's adapter id, never the salted partition key.
        outcome.adapter_id.clone_from(&request.adapter_id);
    }
    outcome
}

fn replica_accuracy(row: crate::outcomes::AccuracyRow) -> ReplicaAccuracy {
    let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    ReplicaAccuracy {
        replica_id: row.replica_id,
        mode: row.mode.to_owned(),
        outcomes: count(row.outcomes),
        hinted_hit: count(row.hinted_hit),
        hinted_miss: count(row.hinted_miss),
        not_hinted_hit: count(row.not_hinted_hit),
        not_hinted_miss: count(row.not_hinted_miss),
        predicted_tokens: count(row.predicted_tokens),
        cached_tokens: count(row.cached_tokens),
        median_ratio: row.median_ratio,
        median_abs_error: row.median_abs_error,
    }
}

fn replica_score((name, s): (&str, &index::ReplicaScore)) -> ReplicaScore {
    ReplicaScore {
        replica_id: name.to_owned(),
        score: s.score,
        matched_tokens: s.matched_tokens,
        estimated_cache_hit_prob: s.estimated_cache_hit_prob,
        tier: s.tier as i32,
    }
}

/// A wire chain (`block_hashes` and the parallel `block_token_counts`) as
/// the index's: [`index::DropReason::MalformedChain`] for a negative count
/// or arrays of different lengths, else [`index::DropReason::EmptyHash`] for
/// an empty hash. The one check of a wire chain, for ingest and lookups alike.
pub fn block_chain(
    hashes: &[Vec<u8>],
    token_counts: &[i32],
) -> Result<index::BlockChain, index::DropReason> {
    let counts = token_counts
        .iter()
        .map(|&n| u32::try_from(n))
        .collect::<Result<Vec<u32>, _>>()
        .map_err(|_| index::DropReason::MalformedChain)?;
    index::BlockChain::new(hashes, counts)
}

/// The chain the server fingerprinted from token ids (`None` when the ids
/// fill no block).
pub fn derived_chain(
    chain: &inference_cache_fingerprint::RequestChain,
) -> Option<index::BlockChain> {
    let counts = chain
        .block_token_counts
        .iter()
        .map(|&n| u32::try_from(n).unwrap_or(0))
        .collect();
    index::BlockChain::from_words(chain.block_hashes.clone(), counts)
        .ok()
        .filter(|c| !c.is_empty())
}

/// A wire exact-key token count: a negative one counts as none (0).
pub fn exact_token_count(count: i32) -> u32 {
    u32::try_from(count).unwrap_or(0)
}

/// A `ReportCacheState` message as the index's typed update (no limits
/// applied: see [`crate::limits::bound_update`]). Each entry's chain is
/// checked here ([`block_chain`]); an entry it refuses is not passed on, only
/// its reason ([`index::CacheUpdate::rejected`]), which ingest counts as
/// dropped as if it had checked the entry itself.
pub fn cache_update(update: CacheStateUpdate) -> index::CacheUpdate {
    let mut rejected = Vec::new();
    let prefixes = update
        .prefixes
        .into_iter()
        .filter_map(|p| {
            let chain = block_chain(&p.block_hashes, &p.block_token_counts)
                .map_err(|reason| rejected.push(reason))
                .ok()?;
            Some(index::PrefixReport {
                prefix_hash: p.prefix_hash,
                token_count: exact_token_count(p.token_count),
                chain,
                tier: index::Tier::from_i32(p.tier),
                adapter_id: p.adapter_id,
            })
        })
        .collect();
    index::CacheUpdate {
        replica_id: update.replica_id,
        model_id: update.model_id,
        tenant_id: update.tenant_id,
        hash_scheme: update.hash_scheme,
        adapter_id: update.adapter_id,
        prefixes,
        rejected,
        stats: update.stats.map(|s| index::ReplicaStatsReport {
            replica_id: s.replica_id,
            cache_memory_bytes: s.cache_memory_bytes,
            hit_rate: s.hit_rate,
            pressure: s.pressure,
            client_version: s.client_version,
            t2_hit_tokens: s.t2_hit_tokens,
            t2_query_tokens: s.t2_query_tokens,
            requests_waiting: s.requests_waiting,
            requests_running: s.requests_running,
            kv_cache_usage: s.kv_cache_usage,
        }),
    }
}

/// The caller's `grpc-timeout` (e.g. `100m`), if any. A value past `u64`
/// saturates; callers clamp it (see [`CacheService::caller_deadline`]).
fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().unwrap_or(u64::MAX);
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_precedence() {
        let mut r = LookupRouteRequest {
            prompt_text: "hi".into(),
            ..Default::default()
        };
        assert_eq!(resolve_input(&r, 16), ResolvedInput::NeedsTokenizer);
        r.token_ids = (0..40).collect();
        match resolve_input(&r, 16) {
            ResolvedInput::Tokens(chain) => assert_eq!(chain.block_token_counts, vec![16, 16]),
            other => panic!("{other:?}"),
        }
        r.prefix_hash = vec![1; 8];
        assert_eq!(resolve_input(&r, 16), ResolvedInput::ExactHash);
        r.block_hashes = vec![vec![1; 8]];
        assert_eq!(resolve_input(&r, 16), ResolvedInput::MalformedChain);
        r.block_token_counts = vec![16];
        assert_eq!(resolve_input(&r, 16), ResolvedInput::WireChain);
        assert_eq!(
            resolve_input(&LookupRouteRequest::default(), 16),
            ResolvedInput::Nothing
        );
    }

    #[test]
    fn cache_update_checks_each_chain_once() {
        use index::DropReason::{EmptyHash, MalformedChain};
        use inference_cache_proto::v1alpha1::PrefixEntry;
        let entry = |hashes: Vec<Vec<u8>>, counts: Vec<i32>| PrefixEntry {
            block_hashes: hashes,
            block_token_counts: counts,
            ..Default::default()
        };
        let update = cache_update(CacheStateUpdate {
            prefixes: vec![
                entry(vec![vec![1; 8]], vec![-1]),
                entry(vec![vec![1; 8]; 2], vec![16]),
                entry(vec![vec![1; 8], Vec::new()], vec![16, 16]),
                entry(vec![vec![1; 8], vec![2; 16]], vec![16, 16]),
                PrefixEntry {
                    prefix_hash: vec![3; 8],
                    token_count: -5,
                    ..Default::default()
                },
            ],
            ..Default::default()
        });
        assert_eq!(update.rejected, [MalformedChain, MalformedChain, EmptyHash]);
        assert_eq!(update.prefixes.len(), 2);
        let hashes: Vec<&[u8]> = update.prefixes[0].chain.hashes().collect();
        assert_eq!(hashes, [&[1u8; 8][..], &[2; 16][..]]);
        assert_eq!(update.prefixes[0].chain.token_counts(), [16, 16]);
        // A negative exact-key count reads as none, as it always did.
        assert_eq!(
            (
                update.prefixes[1].token_count,
                update.prefixes[1].chain.len()
            ),
            (0, 0)
        );
        assert_eq!(
            block_chain(&[vec![1; 8]], &[16]).map(|c| c.tokens()),
            Ok(16)
        );
    }

    /// The index speaks plain Rust, the wire speaks strings: the index's
    /// names must be exactly the proto's, both ways.
    #[test]
    fn index_names_are_the_wire_names() {
        use inference_cache_proto::reason as wire;
        let wire_codes = [
            wire::PREFIX_MATCH,
            wire::TENANT_HOT,
            wire::AFFINITY_HINT,
            wire::NO_HINT,
            wire::POLICY_REQUIRES_CHAIN,
            wire::TIMEOUT,
            wire::UNKNOWN_TENANT,
            wire::UNKNOWN_MODEL,
            wire::UNKNOWN_HASH_SCHEME,
        ];
        let index_codes: Vec<&str> = index::Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(index_codes, wire_codes);
        assert_eq!(index::PROBE_TENANT, inference_cache_proto::PROBE_TENANT);
    }

    #[test]
    fn grpc_timeout_units() {
        let mut m = tonic::metadata::MetadataMap::new();
        assert_eq!(grpc_timeout(&m), None);
        m.insert("grpc-timeout", "250m".parse().expect("ascii"));
        assert_eq!(
            grpc_timeout(&m),
            Some(std::time::Duration::from_millis(250))
        );
        m.insert("grpc-timeout", "3S".parse().expect("ascii"));
        assert_eq!(grpc_timeout(&m), Some(std::time::Duration::from_secs(3)));
        m.insert("grpc-timeout", "-3S".parse().expect("ascii"));
        assert_eq!(grpc_timeout(&m), None);
    }

    #[test]
    fn huge_grpc_timeouts_are_clamped_not_overflowed() {
        let metrics = Arc::new(Metrics::new());
        let mut registry = prometheus_client::registry::Registry::default();
        let index = Arc::new(
            IndexState::new(&crate::IndexSettings::default(), &mut registry).expect("index"),
        );
        let prompts = Arc::new(
            PromptState::new(
                &crate::PromptSettings {
                    templates_dir: None,
                    ..Default::default()
                },
                1,
                &mut registry,
            )
            .expect("prompts"),
        );
        let service = CacheService::new(metrics, index, prompts);
        let now = Instant::now();
        for value in [
            "9300000000000000000S",
            "99999999999999999999999H",
            "18446744073709551615H",
        ] {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", value.parse().expect("ascii"));
            let deadline = service.caller_deadline(&m, now).expect("a deadline");
            assert_eq!(deadline - now, MAX_GRPC_DEADLINE, "{value}");
        }
    }
}
