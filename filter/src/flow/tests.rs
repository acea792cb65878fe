//! Unit tests of the request flow against a fake host.

use std::collections::HashMap;

use inference_cache_proto::v1alpha1::{LookupRouteRequest, ReplicaScore, RouteOutcome};

use super::*;

#[derive(Default)]
struct FakeHost {
    request_headers: Vec<(String, String)>,
    response_headers: Vec<(String, String)>,
    body: Vec<u8>,
    calls: Vec<(String, String, String, Vec<u8>, Duration)>,
    refuse_dispatch: bool,
    grpc_body: Vec<u8>,
    resumed: u32,
    counters: HashMap<&'static str, u64>,
    histograms: HashMap<&'static str, Vec<u64>>,
    response_in: Vec<(String, String)>,
    response_chunk: Vec<u8>,
    logs: std::cell::RefCell<Vec<String>>,
    properties: HashMap<String, Vec<u8>>,
    /// Paths read with `property`, joined with '.'.
    property_reads: std::cell::RefCell<Vec<String>>,
}

impl FakeHost {
    fn request(method: &str, path: &str, body: &[u8]) -> Self {
        Self {
            request_headers: vec![
                (":method".into(), method.into()),
                (":path".into(), path.into()),
                ("content-length".into(), body.len().to_string()),
            ],
            body: body.to_vec(),
            ..Self::default()
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.request_headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }

    fn sent_request(&self) -> LookupRouteRequest {
        let (_, _, _, message, _) = self.calls.first().expect("a call was dispatched");
        LookupRouteRequest::decode(message.as_slice()).expect("a LookupRouteRequest")
    }
}

impl Host for FakeHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header(name).map(|value| value.as_bytes().to_vec())
    }
    fn set_request_header(&mut self, name: &str, value: &str) {
        self.remove_request_header(name);
        self.request_headers.push((name.into(), value.into()));
    }
    fn remove_request_header(&mut self, name: &str) {
        self.request_headers.retain(|(key, _)| key != name);
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        Some(self.body[..size.min(self.body.len())].to_vec())
    }
    fn dispatch_grpc(
        &mut self,
        upstream: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, DispatchError> {
        if self.refuse_dispatch {
            return Err(DispatchError);
        }
        self.calls.push((
            upstream.into(),
            service.into(),
            method.into(),
            message.to_vec(),
            timeout,
        ));
        Ok(7)
    }
    fn grpc_response_body(&self, size: usize) -> Option<Vec<u8>> {
        Some(self.grpc_body[..size.min(self.grpc_body.len())].to_vec())
    }
    fn resume_request(&mut self) {
        self.resumed += 1;
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        self.response_headers.push((name.into(), value.into()));
    }
    fn remove_response_header(&mut self, name: &str) {
        self.response_headers.retain(|(key, _)| key != name);
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let key = path.join(".");
        self.property_reads.borrow_mut().push(key.clone());
        self.properties.get(&key).cloned()
    }
    fn set_property(&mut self, path: &[&str], value: &[u8]) {
        self.properties.insert(path.join("."), value.to_vec());
    }
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.response_in
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_bytes().to_vec())
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        Some(self.response_chunk[..size.min(self.response_chunk.len())].to_vec())
    }
    fn increment_counter(&mut self, name: &'static str) {
        *self.counters.entry(name).or_default() += 1;
    }
    fn record_histogram(&mut self, name: &'static str, value: u64) {
        self.histograms.entry(name).or_default().push(value);
    }
    fn log(&self, _level: LogLevel, message: &str) {
        self.logs.borrow_mut().push(message.to_owned());
    }
}

fn settings() -> Rc<Settings> {
    let mut settings = Settings::with_cluster("inference_cache");
    settings.replica_id_is_endpoint = true;
    settings
        .replica_endpoints
        .insert("replica-a".into(), "10.0.0.1:8000".into());
    settings.tenant = TenantSource::Header("x-tenant".into());
    settings.tenant_id = "fallback".into();
    settings.expose_reason_header = true;
    Rc::new(settings)
}

const TOKENS_BODY: &[u8] =
    br#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;

/// Drives headers and a single body chunk; returns the body action.
fn send(flow: &mut RequestFlow, host: &mut FakeHost) -> Action {
    assert_eq!(flow.on_request_headers(host, false), Action::Pause);
    let size = host.body.len();
    flow.on_request_body(host, size, true)
}

fn respond(flow: &mut RequestFlow, host: &mut FakeHost, reason: &str, replicas: &[&str]) {
    host.grpc_body = LookupRouteResponse {
        reason_code: reason.into(),
        replica_scores: replicas
            .iter()
            .map(|id| ReplicaScore {
                replica_id: (*id).into(),
                ..ReplicaScore::default()
            })
            .collect(),
        ..LookupRouteResponse::default()
    }
    .encode_to_vec();
    let size = host.grpc_body.len();
    flow.on_lookup_response(host, 7, 0, size);
}

#[test]
fn token_prompt_routes_to_the_top_replica() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.request_headers
        .push(("x-tenant".into(), "acme".into()));
    let mut flow = RequestFlow::new(settings());
    assert_eq!(send(&mut flow, &mut host), Action::Pause);
    let (cluster, service, method, _, timeout) = host.calls[0].clone();
    assert_eq!(cluster, "inference_cache");
    assert_eq!(service, "inferencecache.v1alpha1.InferenceCache");
    assert_eq!(method, "LookupRoute");
    assert_eq!(timeout, Duration::from_millis(20));
    let sent = host.sent_request();
    assert_eq!(sent.tenant_id, "acme");
    assert_eq!(sent.block_hashes.len(), 1);
    assert_eq!(sent.block_token_counts, vec![16]);

    respond(
        &mut flow,
        &mut host,
        "PREFIX_MATCH",
        &["replica-a", "replica-b"],
    );
    assert_eq!(host.resumed, 1);
    assert_eq!(
        host.header("x-gateway-destination-endpoint"),
        Some("10.0.0.1:8000")
    );
    flow.on_response_headers(&mut host);
    assert_eq!(
        host.response_headers,
        vec![("x-inferencecache-reason".into(), "PREFIX_MATCH".into())]
    );
    assert_eq!(host.counter("inferencecache_filter.routed"), 1);
    assert_eq!(host.counter("inferencecache_filter.reason.PREFIX_MATCH"), 1);
    assert_eq!(host.counter("inferencecache_filter.lookups"), 1);
}

#[test]
fn client_destination_header_is_always_stripped() {
    for path in ["/v1/completions", "/v1/models"] {
        let mut host = FakeHost::request("POST", path, TOKENS_BODY);
        host.request_headers
            .push(("x-gateway-destination-endpoint".into(), "1.2.3.4:80".into()));
        let mut flow = RequestFlow::new(settings());
        flow.on_request_headers(&mut host, false);
        assert_eq!(host.header("x-gateway-destination-endpoint"), None);
        assert_eq!(
            host.counter("inferencecache_filter.destination_header_removed"),
            1
        );
    }
}

#[test]
fn no_hint_leaves_the_request_alone() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().tenant_id, "fallback");
    respond(&mut flow, &mut host, "NO_HINT", &["replica-a"]);
    assert_eq!(host.resumed, 1);
    assert_eq!(host.header("x-gateway-destination-endpoint"), None);
    flow.on_response_headers(&mut host);
    assert_eq!(host.response_headers[0].1, "NO_HINT");
    assert_eq!(host.counter("inferencecache_filter.reason.NO_HINT"), 1);
}

#[test]
fn grpc_failures_fail_open() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    flow.on_lookup_response(&mut host, 7, 14, 0);
    assert_eq!(host.resumed, 1);
    assert_eq!(host.header("x-gateway-destination-endpoint"), None);
    assert_eq!(
        flow.outcome(),
        Some(&Outcome::Failed(FailureKind::GrpcError))
    );
    assert_eq!(host.counter("inferencecache_filter.failure.grpc_error"), 1);
    // A late or foreign callback does nothing.
    flow.on_lookup_response(&mut host, 7, 0, 0);
    assert_eq!(host.resumed, 1);
}

#[test]
fn undecodable_response_fails_open() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    host.grpc_body = vec![0xff, 0xff, 0xff];
    flow.on_lookup_response(&mut host, 7, 0, 3);
    assert_eq!(host.resumed, 1);
    assert_eq!(
        flow.outcome(),
        Some(&Outcome::Failed(FailureKind::DecodeError))
    );
}

#[test]
fn unknown_replica_fails_open() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    respond(&mut flow, &mut host, "AFFINITY_HINT", &["replica-q"]);
    assert_eq!(host.header("x-gateway-destination-endpoint"), None);
    assert_eq!(
        flow.outcome(),
        Some(&Outcome::Failed(FailureKind::UnknownReplica))
    );
}

#[test]
fn dispatch_failure_continues_synchronously() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.refuse_dispatch = true;
    let mut flow = RequestFlow::new(settings());
    assert_eq!(send(&mut flow, &mut host), Action::Continue);
    assert_eq!(host.resumed, 0);
    assert_eq!(
        host.counter("inferencecache_filter.failure.dispatch_failed"),
        1
    );
    assert!(host.logs.borrow()[0].contains("inference_cache"));
    flow.on_response_headers(&mut host);
    assert_eq!(host.response_headers[0].1, "DISPATCH_FAILED");
}

#[test]
fn other_paths_and_methods_pass_without_a_header() {
    for (method, path) in [("GET", "/v1/completions"), ("POST", "/v1/embeddings")] {
        let mut host = FakeHost::request(method, path, TOKENS_BODY);
        let mut flow = RequestFlow::new(settings());
        assert_eq!(flow.on_request_headers(&mut host, false), Action::Continue);
        assert_eq!(flow.on_request_body(&mut host, 10, true), Action::Continue);
        flow.on_response_headers(&mut host);
        assert!(host.response_headers.is_empty());
        assert!(host.calls.is_empty());
    }
}

#[test]
fn oversize_bodies_are_not_buffered() {
    let mut settings = (*settings()).clone();
    settings.max_body_bytes = 64;
    let settings = Rc::new(settings);
    let big = vec![b' '; 100];
    // Declared length over the limit: no pause at all.
    let mut host = FakeHost::request("POST", "/v1/completions", &big);
    let mut flow = RequestFlow::new(settings.clone());
    assert_eq!(flow.on_request_headers(&mut host, false), Action::Continue);
    // Chunked body growing over the limit: stop buffering and continue.
    let mut host = FakeHost::request("POST", "/v1/completions", &big);
    host.remove_request_header("content-length");
    let mut flow = RequestFlow::new(settings);
    assert_eq!(flow.on_request_headers(&mut host, false), Action::Pause);
    assert_eq!(flow.on_request_body(&mut host, 40, false), Action::Pause);
    assert_eq!(
        flow.on_request_body(&mut host, 100, false),
        Action::Continue
    );
    assert_eq!(flow.on_request_body(&mut host, 100, true), Action::Continue);
    assert!(host.calls.is_empty());
    assert_eq!(
        host.counter("inferencecache_filter.failure.body_too_large"),
        1
    );
}

#[test]
fn bad_bodies_continue_with_their_failure() {
    for (body, kind) in [
        (&b"{nope"[..], FailureKind::InvalidJson),
        (br#"{"prompt":"x"}"#, FailureKind::MissingModel),
        (
            br#"{"model":"m","prompt":["a","b"]}"#,
            FailureKind::UnsupportedPrompt,
        ),
        (
            br#"{"model":"m","prompt":[1,2,3]}"#,
            FailureKind::PromptTooShort,
        ),
    ] {
        let mut host = FakeHost::request("POST", "/v1/completions", body);
        let mut flow = RequestFlow::new(settings());
        assert_eq!(send(&mut flow, &mut host), Action::Continue);
        assert_eq!(flow.outcome(), Some(&Outcome::Failed(kind)));
        assert!(host.calls.is_empty());
        assert_eq!(host.counter(kind.metric()), 1);
    }
}

#[test]
fn headers_only_request_is_not_looked_up() {
    let mut host = FakeHost::request("POST", "/v1/completions", b"");
    let mut flow = RequestFlow::new(settings());
    assert_eq!(flow.on_request_headers(&mut host, true), Action::Continue);
    assert!(host.calls.is_empty());
}

#[test]
fn chat_and_string_prompts_go_as_server_inputs() {
    let mut host = FakeHost::request(
        "POST",
        "/v1/chat/completions",
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    );
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().messages.len(), 1);
    assert_eq!(
        host.sent_request().messages_json,
        r#"[{"role":"user","content":"hi"}]"#
    );

    // Agent traffic: tools and a tool call go verbatim, with the salt.
    let messages = r#"[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"w","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"sun"}]"#;
    let tools = r#"[{"type":"function","function":{"name":"w"}}]"#;
    let body = format!(r#"{{"model":"m","messages":{messages},"tools":{tools},"cache_salt":"s"}}"#);
    let mut host = FakeHost::request("POST", "/v1/chat/completions", body.as_bytes());
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    let sent = host.sent_request();
    assert_eq!(sent.messages_json, messages);
    assert_eq!(sent.tools_json, tools);
    assert_eq!(sent.cache_salt, "s");
    assert!(sent.messages.is_empty());

    let mut host = FakeHost::request("POST", "/v1/completions", br#"{"model":"m","prompt":"hi"}"#);
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().raw_prompt, "hi");
}

#[test]
fn trailers_end_the_body() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    flow.on_request_headers(&mut host, false);
    let size = host.body.len();
    assert_eq!(flow.on_request_body(&mut host, size, false), Action::Pause);
    assert_eq!(flow.on_request_trailers(&mut host, size), Action::Pause);
    assert_eq!(host.calls.len(), 1);
}

#[test]
fn reason_header_is_removed_unless_exposed() {
    let mut hidden = (*settings()).clone();
    hidden.expose_reason_header = false;
    let hidden = Rc::new(hidden);
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(hidden.clone());
    send(&mut flow, &mut host);
    respond(&mut flow, &mut host, "PREFIX_MATCH", &["replica-a"]);
    // An upstream that sets the header itself does not leak it either.
    host.response_headers
        .push(("x-inferencecache-reason".into(), "TENANT_HOT".into()));
    flow.on_response_headers(&mut host);
    assert!(
        host.response_headers.is_empty(),
        "{:?}",
        host.response_headers
    );
    // Operators still get the outcome: counters and the filter state.
    assert_eq!(host.counter("inferencecache_filter.reason.PREFIX_MATCH"), 1);
    assert_eq!(
        host.properties.get(REASON_PROPERTY).map(Vec::as_slice),
        Some(&b"PREFIX_MATCH"[..])
    );

    // Not an inference request: an upstream's copy is removed as well.
    let mut host = FakeHost::request("GET", "/v1/models", b"");
    let mut flow = RequestFlow::new(hidden);
    flow.on_request_headers(&mut host, true);
    host.response_headers
        .push(("x-inferencecache-reason".into(), "PREFIX_MATCH".into()));
    flow.on_response_headers(&mut host);
    assert!(host.response_headers.is_empty());
}

#[test]
fn exposed_reason_header_replaces_an_upstream_copy() {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    respond(&mut flow, &mut host, "NO_HINT", &[]);
    host.response_headers
        .push(("x-inferencecache-reason".into(), "PREFIX_MATCH".into()));
    flow.on_response_headers(&mut host);
    assert_eq!(
        host.response_headers,
        vec![("x-inferencecache-reason".into(), "NO_HINT".into())]
    );
}

#[test]
fn failures_are_recorded_in_the_filter_state() {
    let mut host = FakeHost::request("POST", "/v1/completions", b"{nope");
    let mut flow = RequestFlow::new(settings());
    send(&mut flow, &mut host);
    assert_eq!(
        host.properties.get(REASON_PROPERTY).map(Vec::as_slice),
        Some(&b"INVALID_JSON"[..])
    );
}

fn with_tenant(source: TenantSource) -> Rc<Settings> {
    let mut settings = (*settings()).clone();
    settings.tenant = source;
    Rc::new(settings)
}

#[test]
fn tenant_comes_from_route_metadata_not_a_client_header() {
    let settings = with_tenant(TenantSource::RouteMetadata {
        namespace: "inference_cache".into(),
        path: vec!["tenant".into()],
    });
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.request_headers
        .push(("x-tenant".into(), "intruder".into()));
    host.properties.insert(
        "xds.route_metadata.filter_metadata.inference_cache.tenant".into(),
        b"team-a".to_vec(),
    );
    let mut flow = RequestFlow::new(settings.clone());
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().tenant_id, "team-a");

    // No metadata on the route: the fixed fallback, never the header.
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.request_headers
        .push(("x-tenant".into(), "intruder".into()));
    let mut flow = RequestFlow::new(settings);
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().tenant_id, "fallback");
}

#[test]
fn tenant_from_dynamic_metadata_and_filter_state() {
    let settings = with_tenant(TenantSource::DynamicMetadata {
        namespace: "envoy.filters.http.jwt_authn".into(),
        path: vec!["payload".into(), "tenant".into()],
    });
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.properties.insert(
        "metadata.filter_metadata.envoy.filters.http.jwt_authn.payload.tenant".into(),
        b"team-b".to_vec(),
    );
    let mut flow = RequestFlow::new(settings);
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().tenant_id, "team-b");

    let settings = with_tenant(TenantSource::FilterState("tenant.id".into()));
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.properties
        .insert("filter_state.tenant.id".into(), b"team-c".to_vec());
    let mut flow = RequestFlow::new(settings);
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().tenant_id, "team-c");
    assert_eq!(
        host.property_reads.borrow().as_slice(),
        ["filter_state.tenant.id"]
    );
}

#[test]
fn fixed_tenant_reads_nothing_from_the_request() {
    let settings = with_tenant(TenantSource::Fixed);
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.request_headers
        .push(("x-tenant".into(), "intruder".into()));
    let mut flow = RequestFlow::new(settings);
    send(&mut flow, &mut host);
    assert_eq!(host.sent_request().tenant_id, "fallback");
    assert!(host.property_reads.borrow().is_empty());
}

/// Looks a token prompt up and answers with `reason`, the top replica
/// `replica-a` promising `matched` tokens.
fn looked_up(reason: &str, matched: i32) -> (RequestFlow, FakeHost) {
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings());
    assert_eq!(send(&mut flow, &mut host), Action::Pause);
    host.grpc_body = LookupRouteResponse {
        reason_code: reason.into(),
        replica_scores: vec![ReplicaScore {
            replica_id: "replica-a".into(),
            matched_tokens: matched,
            ..ReplicaScore::default()
        }],
        ..LookupRouteResponse::default()
    }
    .encode_to_vec();
    let size = host.grpc_body.len();
    flow.on_lookup_response(&mut host, 7, 0, size);
    (flow, host)
}

/// Delivers a response: headers, then `body` in chunks of `chunk` bytes.
fn deliver(
    flow: &mut RequestFlow,
    host: &mut FakeHost,
    content_type: &str,
    body: &[u8],
    chunk: usize,
) {
    host.response_in = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), content_type.into()),
    ];
    assert_eq!(flow.on_response_headers(host), Action::Continue);
    let chunks: Vec<&[u8]> = body.chunks(chunk).collect();
    for (index, part) in chunks.iter().enumerate() {
        host.response_chunk = part.to_vec();
        let last = index + 1 == chunks.len();
        assert_eq!(
            flow.on_response_body(host, part.len(), last),
            Action::Continue
        );
    }
}

fn usage_json(cached: u64) -> Vec<u8> {
    format!(
        r#"{{"id":"cmpl-1","object":"text_completion","choices":[{{"text":"hi"}}],"usage":{{"prompt_tokens":18,"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
    )
    .into_bytes()
}

const PM: &str = "inferencecache_filter.accuracy.PREFIX_MATCH";

#[test]
fn json_response_hit_is_compared_with_the_prediction() {
    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
    deliver(&mut flow, &mut host, "application/json", &usage_json(8), 10);
    assert_eq!(host.counter(&format!("{PM}.hinted_hit")), 1);
    assert_eq!(host.counter(&format!("{PM}.hinted_miss")), 0);
    assert_eq!(
        host.histograms.get(format!("{PM}.ratio_percent").as_str()),
        Some(&vec![50])
    );
}

#[test]
fn json_response_miss_after_a_prefix_match_is_counted() {
    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
    deliver(
        &mut flow,
        &mut host,
        "application/json",
        &usage_json(0),
        1000,
    );
    assert_eq!(host.counter(&format!("{PM}.hinted_miss")), 1);
    assert_eq!(
        host.histograms.get(format!("{PM}.ratio_percent").as_str()),
        Some(&vec![0])
    );
}

#[test]
fn hit_without_a_routed_prediction_is_not_hinted() {
    let (mut flow, mut host) = looked_up("NO_HINT", 16);
    deliver(&mut flow, &mut host, "application/json", &usage_json(16), 7);
    assert_eq!(
        host.counter("inferencecache_filter.accuracy.NO_HINT.not_hinted_hit"),
        1
    );
    assert!(host.histograms.is_empty());
    let (mut flow, mut host) = looked_up("SOMETHING_NEW", 0);
    deliver(&mut flow, &mut host, "application/json", &usage_json(0), 7);
    assert_eq!(
        host.counter("inferencecache_filter.accuracy.OTHER.not_hinted_miss"),
        1
    );
}

#[test]
fn event_stream_final_usage_chunk_is_read_without_holding_the_stream() {
    let stream = concat!(
        "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":18,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n",
        "data: [DONE]\n\n",
    );
    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
    deliver(
        &mut flow,
        &mut host,
        "text/event-stream",
        stream.as_bytes(),
        13,
    );
    assert_eq!(host.counter(&format!("{PM}.hinted_hit")), 1);
    assert_eq!(
        host.histograms.get(format!("{PM}.ratio_percent").as_str()),
        Some(&vec![100])
    );
}

#[test]
fn responses_without_cached_tokens_count_as_no_usage() {
    let stream = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";
    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
    deliver(
        &mut flow,
        &mut host,
        "text/event-stream",
        stream.as_bytes(),
        5,
    );
    assert_eq!(host.counter(&format!("{PM}.no_usage")), 1);
    // vLLM without --enable-prompt-tokens-details.
    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
    let body = br#"{"choices":[],"usage":{"prompt_tokens":18,"prompt_tokens_details":null}}"#;
    deliver(&mut flow, &mut host, "application/json", body, 64);
    assert_eq!(host.counter(&format!("{PM}.no_usage")), 1);
    assert!(host.histograms.is_empty());
}

#[test]
fn oversized_or_unparsable_responses_stop_the_measurement() {
    let mut small = (*settings()).clone();
    small.max_response_body_bytes = 32;
    let (_, mut host) = looked_up("PREFIX_MATCH", 16);
    let mut flow = RequestFlow::new(Rc::new(small));
    host.calls.clear();
    assert_eq!(send(&mut flow, &mut host), Action::Pause);
    let size = host.grpc_body.len();
    flow.on_lookup_response(&mut host, 7, 0, size);
    deliver(
        &mut flow,
        &mut host,
        "application/json",
        &usage_json(16),
        10,
    );
    assert_eq!(
        host.counter("inferencecache_filter.accuracy.response_too_large"),
        1
    );
    assert_eq!(host.counter(&format!("{PM}.hinted_hit")), 0);

    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
    deliver(&mut flow, &mut host, "application/json", b"{\"usage\":", 4);
    assert_eq!(
        host.counter("inferencecache_filter.accuracy.parse_error"),
        1
    );
}

#[test]
fn only_looked_up_successful_plain_responses_are_read() {
    // Not looked up: a request the filter never classified.
    let mut host = FakeHost::request("GET", "/v1/models", b"");
    let mut flow = RequestFlow::new(settings());
    flow.on_request_headers(&mut host, true);
    deliver(&mut flow, &mut host, "application/json", &usage_json(16), 8);
    // Looked up, but the lookup failed: no prediction.
    let (mut flow, mut host) = {
        let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
        let mut flow = RequestFlow::new(settings());
        send(&mut flow, &mut host);
        flow.on_lookup_response(&mut host, 7, 14, 0);
        (flow, host)
    };
    deliver(&mut flow, &mut host, "application/json", &usage_json(16), 8);
    assert!(
        host.counters
            .keys()
            .all(|name| !name.starts_with("inferencecache_filter.accuracy.")),
        "{:?}",
        host.counters
    );
    // An error status, a compressed body, another content type.
    for (status, content_type, encoding) in [
        ("500", "application/json", ""),
        ("200", "application/json", "gzip"),
        ("200", "text/plain", ""),
    ] {
        let (mut flow, mut host) = looked_up("PREFIX_MATCH", 16);
        host.response_in = vec![
            (":status".into(), status.into()),
            ("content-type".into(), content_type.into()),
        ];
        if !encoding.is_empty() {
            host.response_in
                .push(("content-encoding".into(), encoding.into()));
        }
        flow.on_response_headers(&mut host);
        host.response_chunk = usage_json(16);
        let size = host.response_chunk.len();
        assert_eq!(
            flow.on_response_body(&mut host, size, true),
            Action::Continue
        );
        let measured = host
            .counters
            .keys()
            .filter(|name| name.starts_with(PM))
            .count();
        assert_eq!(measured, 0, "{status} {content_type} {encoding}");
    }
}

#[test]
fn trailers_end_a_measured_response() {
    let (mut flow, mut host) = looked_up("PREFIX_MATCH", 32);
    host.response_in = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "application/json".into()),
    ];
    flow.on_response_headers(&mut host);
    host.response_chunk = usage_json(16);
    let size = host.response_chunk.len();
    flow.on_response_body(&mut host, size, false);
    assert_eq!(flow.on_response_trailers(&mut host), Action::Continue);
    assert_eq!(host.counter(&format!("{PM}.hinted_hit")), 1);
    assert_eq!(
        host.histograms.get(format!("{PM}.ratio_percent").as_str()),
        Some(&vec![50])
    );
}

/// Like [`looked_up`], with the flow's outcomes going into a fresh buffer.
fn looked_up_into_buffer(
    reason: &str,
    matched: i32,
) -> (RequestFlow, FakeHost, crate::report::SharedBuffer) {
    let buffer = Rc::new(std::cell::RefCell::new(crate::report::OutcomeBuffer::new(
        1,
    )));
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    host.request_headers
        .push(("x-tenant".into(), "team-a".into()));
    let mut flow = RequestFlow::new(settings()).with_outcome_sink(Rc::clone(&buffer));
    assert_eq!(send(&mut flow, &mut host), Action::Pause);
    host.grpc_body = LookupRouteResponse {
        reason_code: reason.into(),
        replica_scores: vec![ReplicaScore {
            replica_id: "replica-a".into(),
            matched_tokens: matched,
            ..ReplicaScore::default()
        }],
        ..LookupRouteResponse::default()
    }
    .encode_to_vec();
    let size = host.grpc_body.len();
    flow.on_lookup_response(&mut host, 7, 0, size);
    (flow, host, buffer)
}

fn buffered(buffer: &crate::report::SharedBuffer) -> Vec<RouteOutcome> {
    let report = {
        let mut reporter = crate::report::OutcomeReporter::new(settings(), Rc::clone(buffer));
        let mut host = RecordingReportHost::default();
        reporter.on_tick(&mut host);
        host.sent
    };
    report
        .map(|bytes| {
            inference_cache_proto::v1alpha1::OutcomeReport::decode(bytes.as_slice())
                .expect("an OutcomeReport")
                .outcomes
        })
        .unwrap_or_default()
}

#[derive(Default)]
struct RecordingReportHost {
    sent: Option<Vec<u8>>,
}

impl crate::report::ReportHost for RecordingReportHost {
    fn dispatch_grpc(
        &mut self,
        _upstream: &str,
        _service: &str,
        _method: &str,
        message: &[u8],
        _timeout: Duration,
    ) -> Result<u32, DispatchError> {
        self.sent = Some(message.to_vec());
        Ok(1)
    }
    fn add_counter(&mut self, _name: &'static str, _amount: u64) {}
    fn log(&self, _level: LogLevel, _message: &str) {}
}

#[test]
fn a_measured_routed_response_becomes_one_buffered_outcome() {
    let (mut flow, mut host, buffer) = looked_up_into_buffer("PREFIX_MATCH", 16);
    deliver(&mut flow, &mut host, "application/json", &usage_json(8), 10);
    assert_eq!(host.counter(crate::report::OUTCOMES_BUFFERED_METRIC), 1);
    assert_eq!(
        buffered(&buffer),
        vec![RouteOutcome {
            tenant_id: "team-a".into(),
            model_id: "m".into(),
            replica_id: "replica-a".into(),
            reason_code: "PREFIX_MATCH".into(),
            predicted_tokens: 16,
            cached_tokens: 8,
            prompt_tokens: 18,
            routed: true,
            shadow: false,
        }]
    );
}

#[test]
fn a_routed_request_served_elsewhere_counts_as_unhinted_where_it_was_served() {
    // Served by the hinted endpoint: stays routed.
    let (mut flow, mut host, buffer) = looked_up_into_buffer("PREFIX_MATCH", 16);
    host.properties
        .insert("upstream.address".into(), b"10.0.0.1:8000".to_vec());
    deliver(
        &mut flow,
        &mut host,
        "application/json",
        &usage_json(16),
        64,
    );
    let outcomes = buffered(&buffer);
    assert!(outcomes[0].routed, "{outcomes:?}");
    assert_eq!(host.counter(crate::report::OUTCOMES_REROUTED_METRIC), 0);
    // The pool served it on another member: the hint did not apply.
    let (mut flow, mut host, buffer) = looked_up_into_buffer("PREFIX_MATCH", 16);
    host.properties
        .insert("upstream.address".into(), b"10.0.0.2:8000".to_vec());
    deliver(&mut flow, &mut host, "application/json", &usage_json(0), 64);
    let outcomes = buffered(&buffer);
    assert_eq!(outcomes.len(), 1);
    assert!(!outcomes[0].routed);
    assert_eq!(outcomes[0].replica_id, "10.0.0.2:8000");
    assert_eq!(outcomes[0].predicted_tokens, 0);
    assert_eq!(host.counter(crate::report::OUTCOMES_REROUTED_METRIC), 1);
    assert_eq!(
        host.counter(&format!("{PM}.not_hinted_miss")),
        1,
        "the local counters see the same outcome"
    );
}

#[test]
fn an_unhinted_outcome_names_the_replica_that_served_it() {
    let (mut flow, mut host, buffer) = looked_up_into_buffer("NO_HINT", 0);
    host.properties
        .insert("upstream.address".into(), b"10.0.0.1:8000".to_vec());
    deliver(
        &mut flow,
        &mut host,
        "application/json",
        &usage_json(16),
        64,
    );
    let outcomes = buffered(&buffer);
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].replica_id, "replica-a");
    assert_eq!(
        (outcomes[0].predicted_tokens, outcomes[0].cached_tokens),
        (0, 16)
    );
    assert!(!outcomes[0].routed);
}

#[test]
fn unmeasured_responses_buffer_nothing_and_a_full_buffer_counts_drops() {
    let (mut flow, mut host, buffer) = looked_up_into_buffer("PREFIX_MATCH", 16);
    let body = br#"{"choices":[],"usage":{"prompt_tokens":18}}"#;
    deliver(&mut flow, &mut host, "application/json", body, 64);
    assert!(buffer.borrow().is_empty());
    assert_eq!(host.counter(crate::report::OUTCOMES_BUFFERED_METRIC), 0);
    // The buffer holds one outcome: the second measured response is dropped.
    for expected_dropped in [0, 1] {
        let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
        let mut flow = RequestFlow::new(settings()).with_outcome_sink(Rc::clone(&buffer));
        send(&mut flow, &mut host);
        host.grpc_body = LookupRouteResponse {
            reason_code: "NO_HINT".into(),
            ..LookupRouteResponse::default()
        }
        .encode_to_vec();
        let size = host.grpc_body.len();
        flow.on_lookup_response(&mut host, 7, 0, size);
        deliver(&mut flow, &mut host, "application/json", &usage_json(0), 64);
        assert_eq!(
            host.counter(crate::report::OUTCOMES_DROPPED_METRIC),
            expected_dropped
        );
    }
    assert_eq!(buffer.borrow().len(), 1);
}

#[test]
fn a_shadow_answer_is_measured_but_not_routed() {
    let buffer = Rc::new(std::cell::RefCell::new(crate::report::OutcomeBuffer::new(
        4,
    )));
    let mut host = FakeHost::request("POST", "/v1/completions", TOKENS_BODY);
    let mut flow = RequestFlow::new(settings()).with_outcome_sink(Rc::clone(&buffer));
    assert_eq!(send(&mut flow, &mut host), Action::Pause);
    host.grpc_body = LookupRouteResponse {
        reason_code: "PREFIX_MATCH".into(),
        replica_scores: vec![ReplicaScore {
            replica_id: "replica-a".into(),
            matched_tokens: 16,
            ..ReplicaScore::default()
        }],
        shadow: true,
        ..LookupRouteResponse::default()
    }
    .encode_to_vec();
    let size = host.grpc_body.len();
    flow.on_lookup_response(&mut host, 7, 0, size);
    assert_eq!(host.resumed, 1);
    assert_eq!(
        host.header(crate::config::DEFAULT_DESTINATION_HEADER),
        None,
        "never routed"
    );
    assert_eq!(host.counter(crate::outcome::SHADOW_METRIC), 1);
    assert_eq!(host.counter(crate::outcome::ROUTED_METRIC), 0);
    assert_eq!(
        host.properties.get(REASON_PROPERTY).map(Vec::as_slice),
        Some(b"PREFIX_MATCH".as_slice())
    );
    // Served elsewhere; the engine reused nothing.
    host.properties
        .insert("upstream.address".into(), b"10.0.0.9:8000".to_vec());
    deliver(&mut flow, &mut host, "application/json", &usage_json(0), 64);
    let outcomes = buffered(&buffer);
    assert_eq!(outcomes.len(), 1);
    let outcome = &outcomes[0];
    assert_eq!(
        outcome.replica_id, "replica-a",
        "the replica routing would pick"
    );
    assert_eq!((outcome.predicted_tokens, outcome.cached_tokens), (16, 0));
    assert!(outcome.shadow && !outcome.routed);
}
