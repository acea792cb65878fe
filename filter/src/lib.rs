//! proxy-wasm filter that asks the inference-cache policy server where to route each LLM request.
//!
//! For `POST /v1/completions` and `POST /v1/chat/completions` the filter
//! buffers the JSON body, builds a `LookupRouteRequest` (a token-id prompt is
//! fingerprinted here; a string prompt goes as `raw_prompt`, a chat request
//! as `messages_json` with its tools and template options, verbatim; the
//! body's `cache_salt` too), calls `LookupRoute` through Envoy with a short timeout, and
//! on a routable hint sets the destination header (default
//! `x-gateway-destination-endpoint`) that the pool cluster's `override_host`
//! load-balancing policy reads: Envoy uses that endpoint only when it is a
//! member of the pool, and its normal load balancing otherwise. Every other
//! outcome leaves the request as it was: the cache plane never fails a
//! request.
//!
//! The crate has two layers:
//!
//! - host-agnostic logic that builds and tests natively: [`Settings`] (the
//!   plugin configuration, validated once), request classification and body
//!   parsing ([`classify`], [`parse_body`], [`lookup_request`]), the decision
//!   on a response ([`decide`], [`Outcome`]) and the per-request state
//!   machine [`RequestFlow`], which talks to Envoy only through the [`Host`]
//!   trait;
//! - the response side ([`json_usage`], [`EventStreamReader`], [`Verdict`]):
//!   for a request it looked up, the filter reads the engine's
//!   `usage.prompt_tokens_details.cached_tokens` as the response passes
//!   (never holding it) and counts how the actual reuse compares with the
//!   `matched_tokens` the hint promised (metric names in `envoy/README.md`);
//! - outcome reporting ([`OutcomeBuffer`], [`OutcomeReporter`]): each
//!   measured response becomes one outcome in a bounded per-worker buffer,
//!   which the root context's timer sends to the server in batches
//!   (`ReportOutcomes`), off the request path and fail-silent;
//! - a thin proxy-wasm adapter (only on `wasm32`) mapping SDK callbacks onto
//!   [`RequestFlow`] and implementing [`Host`] with proxy-wasm host calls.
//!
//! ```
//! use inference_cache_filter::{Api, Settings, classify, lookup_request, parse_body};
//!
//! let settings = Settings::from_json(br#"{"grpc_cluster":"ic","replica_id_is_endpoint":true}"#)
//!     .expect("valid configuration");
//! let api = classify("POST", "/v1/completions").expect("an inference request");
//! let tokens: Vec<u32> = (0..32).collect();
//! let body = format!(r#"{{"model":"llama","prompt":{tokens:?}}}"#);
//! let parsed = parse_body(api, body.as_bytes()).expect("a completions body");
//! let request = lookup_request(&settings, "tenant-a", parsed).expect("two full blocks");
//! assert_eq!(request.block_token_counts, vec![16, 16]);
//! assert_eq!(api, Api::Completions);
//! ```
//!
//! Build the plugin: `cargo build -p inference-cache-filter --target wasm32-wasip1 --profile wasm`
//! (output `target/wasm32-wasip1/wasm/inference_cache_filter.wasm`).

mod accuracy;
mod config;
mod flow;
mod outcome;
mod report;
mod request;

#[cfg(target_arch = "wasm32")]
mod adapter;

pub use accuracy::{
    BodyKind, EventStreamReader, REASON_METRICS, RESPONSE_ENCODED_METRIC,
    RESPONSE_PARSE_ERROR_METRIC, RESPONSE_TOO_LARGE_METRIC, ReasonMetrics, Usage, Verdict,
    body_kind, json_usage, reason_metrics, verdict,
};
pub use config::{
    ConfigError, DEFAULT_BLOCK_SIZE, DEFAULT_DESTINATION_HEADER, DEFAULT_HASH_SCHEME,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_RESPONSE_BODY_BYTES, DEFAULT_REASON_HEADER,
    DEFAULT_ROUTABLE_REASONS, DEFAULT_TIMEOUT_MS, ModelTarget, Settings, TenantSource,
};
pub use flow::{
    Action, DispatchError, Host, LOOKUP_METHOD, LOOKUP_SERVICE, LogLevel, REASON_PROPERTY,
    RequestFlow, UPSTREAM_ADDRESS,
};
pub use outcome::{
    FailureKind, LOOKUPS_METRIC, Outcome, ROUTED_METRIC, SHADOW_METRIC, SPOOFED_DESTINATION_METRIC,
    all_histograms, all_metrics, decide, reason_metric,
};
pub use report::{
    OUTCOMES_BUFFERED_METRIC, OUTCOMES_DROPPED_METRIC, OUTCOMES_LOST_METRIC,
    OUTCOMES_REPORTED_METRIC, OUTCOMES_REROUTED_METRIC, OutcomeBuffer, OutcomeReporter,
    REPORT_FAILED_METRIC, REPORT_METHOD, ReportHost, SharedBuffer,
};
pub use request::{
    Api, BodyError, CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, ChatRequest, ParsedRequest,
    PromptInput, classify, lookup_request, parse_body,
};
