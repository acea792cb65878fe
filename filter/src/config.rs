//! Plugin configuration: the JSON an operator writes, validated once into [`Settings`].
//!
//! Parsing walks the JSON object field by field so every error names the
//! offending field (`timeout_ms: must be between 1 and 60000`); unknown fields
//! are errors too, so a typo never silently falls back to a default. The
//! adapter calls [`Settings::from_json`] in `on_configure` and refuses to start
//! the plugin on error. Runs once per configuration, never per request.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use inference_cache_proto::envoy::{GrpcService, grpc_service};
use inference_cache_proto::reason;
use prost::Message as _;
use serde_json::{Map, Value};

/// Default `timeout_ms`: the LookupRoute budget per request.
pub const DEFAULT_TIMEOUT_MS: u64 = 20;
/// Default `destination_header`, the Gateway API Inference Extension convention.
pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Default `reason_header`, added to every response of an inference request.
pub const DEFAULT_REASON_HEADER: &str = "x-inferencecache-reason";
/// Default `hash_scheme` sent with every lookup.
pub const DEFAULT_HASH_SCHEME: &str = "vllm";
/// Default `block_size` (tokens per KV block) for token-id prompts.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Default `max_body_bytes`: Envoy's default per-connection buffer limit.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Default `max_response_body_bytes`: the most of one response copied to measure cache reuse.
pub const DEFAULT_MAX_RESPONSE_BODY_BYTES: usize = 1 << 20;
/// Default `outcome_flush_ms`: how often a worker sends its buffered outcomes.
pub const DEFAULT_OUTCOME_FLUSH_MS: u64 = 1000;
/// Default `outcome_batch_max`: most outcomes in one `ReportOutcomes` call.
pub const DEFAULT_OUTCOME_BATCH_MAX: usize = 256;
/// Default `outcome_buffer_max`: most outcomes a worker holds between reports.
pub const DEFAULT_OUTCOME_BUFFER_MAX: usize = 1024;
/// Default `routable_reasons`.
pub const DEFAULT_ROUTABLE_REASONS: [&str; 3] = [
    reason::PREFIX_MATCH,
    reason::TENANT_HOT,
    reason::AFFINITY_HINT,
];

const MAX_TIMEOUT_MS: u64 = 60_000;
const MAX_BLOCK_SIZE: u64 = 4096;
const MAX_BODY_LIMIT: u64 = 256 << 20;
const MAX_OUTCOME_FLUSH_MS: u64 = 60_000;
const MAX_OUTCOME_COUNT: u64 = 100_000;

/// A configuration the filter cannot run with; names the field and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid plugin configuration: `{field}`: {reason}")]
pub struct ConfigError {
    /// Dotted path of the offending field (`models.llama.adapter_id`), or `<root>`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// The engine-facing identity an OpenAI `model` name maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelTarget {
    /// `LookupRouteRequest.model_id`.
    pub model_id: String,
    /// `LookupRouteRequest.adapter_id` (LoRA adapter); empty for the base model.
    pub adapter_id: String,
}

/// Where a request's tenant id comes from (`tenant`, or the older `tenant_header`).
///
/// Only a source the gateway controls is trustworthy: route metadata, dynamic
/// metadata or filter state written by an earlier filter (an authn filter),
/// or a header that such a filter overwrites and that the edge strips from
/// client requests. A header a client may send as it likes lets any client
/// claim any tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    /// Always `tenant_id`.
    Fixed,
    /// A request header (lower-case).
    Header(String),
    /// `filter_metadata[namespace]` of the matched route, then `path`.
    RouteMetadata {
        /// Metadata namespace (`filter_metadata` key).
        namespace: String,
        /// Keys into the namespace's struct; the value must be a string.
        path: Vec<String>,
    },
    /// The request's dynamic metadata `namespace`, then `path`.
    DynamicMetadata {
        /// Metadata namespace (for example `envoy.filters.http.jwt_authn`).
        namespace: String,
        /// Keys into the namespace's struct; the value must be a string.
        path: Vec<String>,
    },
    /// A filter-state object by name, as a string.
    FilterState(String),
}

impl TenantSource {
    /// The host property path this source reads, if it reads one.
    pub fn property_path(&self) -> Option<Vec<&str>> {
        let (root, namespace, path): (&[&str], &str, &[String]) = match self {
            TenantSource::Fixed | TenantSource::Header(_) => return None,
            TenantSource::FilterState(key) => return Some(vec!["filter_state", key.as_str()]),
            TenantSource::RouteMetadata { namespace, path } => (
                &["xds", "route_metadata", "filter_metadata"],
                namespace,
                path,
            ),
            TenantSource::DynamicMetadata { namespace, path } => {
                (&["metadata", "filter_metadata"], namespace, path)
            }
        };
        let mut full = root.to_vec();
        full.push(namespace);
        full.extend(path.iter().map(String::as_str));
        Some(full)
    }
}

/// Validated filter settings, shared read-only by every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Envoy cluster serving the `InferenceCache` gRPC service.
    pub grpc_cluster: String,
    /// `:authority` of LookupRoute calls: `grpc_authority`, else derived from
    /// an Istio cluster name; `None` lets Envoy send the cluster name.
    pub grpc_authority: Option<String>,
    /// What `dispatch_grpc_call` is given: the cluster name, or with an
    /// authority an encoded Envoy `GrpcService` naming both.
    pub grpc_upstream: String,
    /// LookupRoute budget; Envoy cancels the call after it.
    pub timeout: Duration,
    /// Where the tenant id comes from.
    pub tenant: TenantSource,
    /// Fixed tenant id, or the fallback when the source yields nothing.
    pub tenant_id: String,
    /// `LookupRouteRequest.hash_scheme`.
    pub hash_scheme: String,
    /// Tokens per KV block, for fingerprinting token-id prompts.
    pub block_size: usize,
    /// Header the pool cluster's `override_host` load-balancing policy reads (lower-case).
    pub destination_header: String,
    /// Header reporting the outcome; `None` disables it.
    pub reason_header: Option<String>,
    /// Whether clients see `reason_header`. Off by default: the reason tells
    /// a client whether a prompt is cached, so it is removed from every
    /// response and reported to operators through counters and the
    /// `inferencecache_reason` filter state instead.
    pub expose_reason_header: bool,
    /// Replica id → `ip:port`.
    pub replica_endpoints: HashMap<String, String>,
    /// Replica ids not in `replica_endpoints` are used as the endpoint when they are `ip:port`.
    pub replica_id_is_endpoint: bool,
    /// OpenAI `model` name → (model_id, adapter_id); unmapped names are sent as they are.
    pub models: HashMap<String, ModelTarget>,
    /// Reason codes whose top replica is routed to.
    pub routable_reasons: HashSet<String>,
    /// Bodies larger than this are not buffered; the request continues untouched.
    pub max_body_bytes: usize,
    /// Most bytes of a looked-up request's response copied (JSON) or held as
    /// one unfinished line (event stream) to read the engine's
    /// `cached_tokens`; past it the measurement stops (counted) and the
    /// response is untouched. `0` turns the measurement off. vLLM reports
    /// `cached_tokens` only when started with `--enable-prompt-tokens-details`.
    pub max_response_body_bytes: usize,
    /// How often each worker sends its measured outcomes to the server
    /// (`ReportOutcomes`, off the request path); also that call's timeout.
    /// Zero turns reporting off (the local accuracy counters remain).
    pub outcome_flush: Duration,
    /// Most outcomes in one `ReportOutcomes` call; the rest wait for the next tick.
    pub outcome_batch_max: usize,
    /// Most outcomes a worker holds between reports; past it outcomes are
    /// dropped (counter `inferencecache_filter.outcomes.dropped`) and the
    /// server is told how many.
    pub outcome_buffer_max: usize,
}

impl Settings {
    /// A configuration with every default and the given gRPC cluster.
    pub fn with_cluster(grpc_cluster: &str) -> Self {
        Self {
            grpc_cluster: grpc_cluster.to_owned(),
            grpc_authority: None,
            grpc_upstream: grpc_cluster.to_owned(),
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            tenant: TenantSource::Fixed,
            tenant_id: String::new(),
            hash_scheme: DEFAULT_HASH_SCHEME.to_owned(),
            block_size: DEFAULT_BLOCK_SIZE,
            destination_header: DEFAULT_DESTINATION_HEADER.to_owned(),
            reason_header: Some(DEFAULT_REASON_HEADER.to_owned()),
            expose_reason_header: false,
            replica_endpoints: HashMap::new(),
            replica_id_is_endpoint: false,
            models: HashMap::new(),
            routable_reasons: DEFAULT_ROUTABLE_REASONS
                .iter()
                .map(|code| (*code).to_owned())
                .collect(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_response_body_bytes: DEFAULT_MAX_RESPONSE_BODY_BYTES,
            outcome_flush: Duration::from_millis(DEFAULT_OUTCOME_FLUSH_MS),
            outcome_batch_max: DEFAULT_OUTCOME_BATCH_MAX,
            outcome_buffer_max: DEFAULT_OUTCOME_BUFFER_MAX,
        }
    }

    /// Parses and validates the plugin configuration JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|error| ConfigError::new("<root>", format!("not valid JSON: {error}")))?;
        let Value::Object(object) = value else {
            return Err(ConfigError::new("<root>", "must be a JSON object"));
        };
        let Some(cluster) = object.get("grpc_cluster") else {
            return Err(ConfigError::new("grpc_cluster", "is required"));
        };
        let cluster = non_empty_string("grpc_cluster", cluster)?;
        if let Some(tenant) = object.get("tenant") {
            if object.contains_key("tenant_header") {
                return Err(ConfigError::new(
                    "tenant_header",
                    "cannot be combined with `tenant`; use `tenant: {\"header\": ...}`",
                ));
            }
            if tenant.get("fixed").is_some() && object.contains_key("tenant_id") {
                return Err(ConfigError::new(
                    "tenant_id",
                    "cannot be combined with `tenant: {\"fixed\": ...}`",
                ));
            }
        }
        let mut settings = Self::with_cluster(&cluster);
        for (key, value) in &object {
            settings.apply(key, value)?;
        }
        if settings.grpc_authority.is_none() {
            settings.grpc_authority = istio_authority(&settings.grpc_cluster);
        }
        if let Some(authority) = &settings.grpc_authority {
            settings.grpc_upstream = grpc_upstream(&settings.grpc_cluster, authority)?;
        }
        if settings.replica_endpoints.is_empty() && !settings.replica_id_is_endpoint {
            return Err(ConfigError::new(
                "replica_endpoints",
                "is empty and `replica_id_is_endpoint` is false, so no hint could ever be routed",
            ));
        }
        if settings.tenant == TenantSource::Header(settings.destination_header.clone()) {
            let field = if object.contains_key("tenant") {
                "tenant.header"
            } else {
                "tenant_header"
            };
            return Err(ConfigError::new(
                field,
                "must differ from `destination_header`",
            ));
        }
        Ok(settings)
    }

    fn apply(&mut self, key: &str, value: &Value) -> Result<(), ConfigError> {
        match key {
            "grpc_cluster" => {}
            "grpc_authority" => self.grpc_authority = Some(non_empty_string(key, value)?),
            "timeout_ms" => {
                let millis = integer_in(key, value, 1, MAX_TIMEOUT_MS)?;
                self.timeout = Duration::from_millis(millis);
            }
            "tenant_header" => self.tenant = TenantSource::Header(header_name(key, value)?),
            "tenant" => {
                let (source, fixed) = tenant_source(key, value)?;
                self.tenant = source;
                if let Some(tenant) = fixed {
                    self.tenant_id = tenant;
                }
            }
            "tenant_id" => self.tenant_id = string(key, value)?,
            "hash_scheme" => self.hash_scheme = non_empty_string(key, value)?,
            "block_size" => {
                let size = integer_in(key, value, 1, MAX_BLOCK_SIZE)?;
                self.block_size = usize::try_from(size)
                    .map_err(|_| ConfigError::new(key, "does not fit this platform"))?;
            }
            "destination_header" => self.destination_header = header_name(key, value)?,
            "reason_header" => {
                let name = string(key, value)?;
                self.reason_header = if name.is_empty() {
                    None
                } else {
                    Some(header_name(key, value)?)
                };
            }
            "expose_reason_header" => {
                self.expose_reason_header = value
                    .as_bool()
                    .ok_or_else(|| ConfigError::new(key, "must be true or false"))?;
            }
            "replica_endpoints" => self.replica_endpoints = endpoints(key, value)?,
            "replica_id_is_endpoint" => {
                self.replica_id_is_endpoint = value
                    .as_bool()
                    .ok_or_else(|| ConfigError::new(key, "must be true or false"))?;
            }
            "models" => self.models = models(key, value)?,
            "routable_reasons" => self.routable_reasons = reasons(key, value)?,
            "max_body_bytes" => {
                let size = integer_in(key, value, 1, MAX_BODY_LIMIT)?;
                self.max_body_bytes = usize::try_from(size)
                    .map_err(|_| ConfigError::new(key, "does not fit this platform"))?;
            }
            "max_response_body_bytes" => {
                let size = integer_in(key, value, 0, MAX_BODY_LIMIT)?;
                self.max_response_body_bytes = usize::try_from(size)
                    .map_err(|_| ConfigError::new(key, "does not fit this platform"))?;
            }
            "outcome_flush_ms" => {
                let millis = integer_in(key, value, 0, MAX_OUTCOME_FLUSH_MS)?;
                self.outcome_flush = Duration::from_millis(millis);
            }
            "outcome_batch_max" => {
                let count = integer_in(key, value, 1, MAX_OUTCOME_COUNT)?;
                self.outcome_batch_max = usize::try_from(count)
                    .map_err(|_| ConfigError::new(key, "does not fit this platform"))?;
            }
            "outcome_buffer_max" => {
                let count = integer_in(key, value, 1, MAX_OUTCOME_COUNT)?;
                self.outcome_buffer_max = usize::try_from(count)
                    .map_err(|_| ConfigError::new(key, "does not fit this platform"))?;
            }
            other => {
                return Err(ConfigError::new(other, "unknown field"));
            }
        }
        Ok(())
    }

    /// The (model_id, adapter_id) to look up for an OpenAI `model` name.
    pub fn model_target(&self, model: &str) -> ModelTarget {
        self.models
            .get(model)
            .cloned()
            .unwrap_or_else(|| ModelTarget {
                model_id: model.to_owned(),
                adapter_id: String::new(),
            })
    }

    /// The replica id of an upstream `ip:port` (the reverse of
    /// [`Settings::endpoint_of`]): a `replica_endpoints` entry naming it, else
    /// the address itself when `replica_id_is_endpoint` is set.
    pub fn replica_of(&self, endpoint: &str) -> Option<String> {
        let mut named: Vec<&String> = self
            .replica_endpoints
            .iter()
            .filter(|(_, value)| value.as_str() == endpoint)
            .map(|(id, _)| id)
            .collect();
        named.sort();
        if let Some(id) = named.first() {
            return Some((*id).clone());
        }
        (self.replica_id_is_endpoint && endpoint.parse::<SocketAddr>().is_ok())
            .then(|| endpoint.to_owned())
    }

    /// The `ip:port` to route a replica id to, if it has one.
    pub fn endpoint_of(&self, replica_id: &str) -> Option<String> {
        if let Some(endpoint) = self.replica_endpoints.get(replica_id) {
            return Some(endpoint.clone());
        }
        if self.replica_id_is_endpoint && replica_id.parse::<SocketAddr>().is_ok() {
            return Some(replica_id.to_owned());
        }
        None
    }
}

/// `<host>:<port>` of an Istio cluster name (`outbound|<port>|<subset>|<host>`).
/// Such names are not valid HTTP/2 authorities, and Envoy uses the cluster
/// name as the `:authority` of a gRPC call unless told otherwise, which
/// servers that check it (the inference-cache server does) reject.
fn istio_authority(cluster: &str) -> Option<String> {
    let mut parts = cluster.split('|');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("outbound" | "inbound"), Some(port), Some(_subset), Some(host))
            if parts.next().is_none() && !host.is_empty() && port.parse::<u16>().is_ok() =>
        {
            Some(format!("{host}:{port}"))
        }
        _ => None,
    }
}

/// An Envoy `GrpcService` naming the cluster and the authority, as the text
/// `dispatch_grpc_call` takes. The proxy-wasm SDK passes it as a string, so
/// the encoding must be valid UTF-8, which it is while every length fits in
/// one byte.
fn grpc_upstream(cluster: &str, authority: &str) -> Result<String, ConfigError> {
    let service = GrpcService {
        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
            grpc_service::EnvoyGrpc {
                cluster_name: cluster.to_owned(),
                authority: authority.to_owned(),
            },
        )),
    };
    String::from_utf8(service.encode_to_vec()).map_err(|_| {
        ConfigError::new(
            "grpc_authority",
            "with `grpc_cluster` must stay under 124 bytes in total",
        )
    })
}

fn string(field: &str, value: &Value) -> Result<String, ConfigError> {
    value
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ConfigError::new(field, "must be a string"))
}

fn non_empty_string(field: &str, value: &Value) -> Result<String, ConfigError> {
    let text = string(field, value)?;
    if text.trim().is_empty() {
        return Err(ConfigError::new(field, "must not be empty"));
    }
    Ok(text)
}

fn integer_in(field: &str, value: &Value, min: u64, max: u64) -> Result<u64, ConfigError> {
    match value.as_u64() {
        Some(number) if (min..=max).contains(&number) => Ok(number),
        _ => Err(ConfigError::new(
            field,
            format!("must be an integer between {min} and {max}"),
        )),
    }
}

fn header_name(field: &str, value: &Value) -> Result<String, ConfigError> {
    let name = non_empty_string(field, value)?.to_ascii_lowercase();
    let valid = name
        .bytes()
        .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_');
    if !valid {
        return Err(ConfigError::new(
            field,
            "must be an HTTP header name (letters, digits, '-', '_')",
        ));
    }
    Ok(name)
}

/// `{"header": name}`, `{"route_metadata": {"namespace", "path"}}`,
/// `{"dynamic_metadata": {"namespace", "path"}}`, `{"filter_state": key}` or
/// `{"fixed": tenant}`; the fixed form also returns the tenant id.
fn tenant_source(
    field: &str,
    value: &Value,
) -> Result<(TenantSource, Option<String>), ConfigError> {
    let fields = object(field, value)?;
    let mut entries = fields.iter();
    let (Some((kind, inner)), None) = (entries.next(), entries.next()) else {
        return Err(ConfigError::new(
            field,
            "must name exactly one source: header, route_metadata, dynamic_metadata, filter_state or fixed",
        ));
    };
    let path = format!("{field}.{kind}");
    match kind.as_str() {
        "header" => Ok((TenantSource::Header(header_name(&path, inner)?), None)),
        "filter_state" => Ok((
            TenantSource::FilterState(non_empty_string(&path, inner)?),
            None,
        )),
        "fixed" => Ok((TenantSource::Fixed, Some(non_empty_string(&path, inner)?))),
        "route_metadata" | "dynamic_metadata" => {
            let (namespace, keys) = metadata_key(&path, inner)?;
            let source = if kind == "route_metadata" {
                TenantSource::RouteMetadata {
                    namespace,
                    path: keys,
                }
            } else {
                TenantSource::DynamicMetadata {
                    namespace,
                    path: keys,
                }
            };
            Ok((source, None))
        }
        _ => Err(ConfigError::new(path, "unknown tenant source")),
    }
}

/// `{"namespace": "...", "path": ["key", ...]}`, `path` non-empty.
fn metadata_key(field: &str, value: &Value) -> Result<(String, Vec<String>), ConfigError> {
    let mut namespace = None;
    let mut keys = Vec::new();
    for (key, value) in object(field, value)? {
        let path = format!("{field}.{key}");
        match key.as_str() {
            "namespace" => namespace = Some(non_empty_string(&path, value)?),
            "path" => {
                let items = value
                    .as_array()
                    .ok_or_else(|| ConfigError::new(&path, "must be an array of keys"))?;
                for (index, item) in items.iter().enumerate() {
                    keys.push(non_empty_string(&format!("{path}[{index}]"), item)?);
                }
            }
            _ => return Err(ConfigError::new(path, "unknown field")),
        }
    }
    let namespace =
        namespace.ok_or_else(|| ConfigError::new(format!("{field}.namespace"), "is required"))?;
    if keys.is_empty() {
        return Err(ConfigError::new(
            format!("{field}.path"),
            "must name at least one key",
        ));
    }
    Ok((namespace, keys))
}

fn object<'a>(field: &str, value: &'a Value) -> Result<&'a Map<String, Value>, ConfigError> {
    value
        .as_object()
        .ok_or_else(|| ConfigError::new(field, "must be a JSON object"))
}

fn endpoints(field: &str, value: &Value) -> Result<HashMap<String, String>, ConfigError> {
    let mut map = HashMap::new();
    for (replica, endpoint) in object(field, value)? {
        let path = format!("{field}.{replica}");
        let endpoint = string(&path, endpoint)?;
        if endpoint.parse::<SocketAddr>().is_err() {
            return Err(ConfigError::new(
                path,
                "must be a literal ip:port (the address of the replica in the pool cluster)",
            ));
        }
        map.insert(replica.clone(), endpoint);
    }
    Ok(map)
}

fn models(field: &str, value: &Value) -> Result<HashMap<String, ModelTarget>, ConfigError> {
    let mut map = HashMap::new();
    for (name, target) in object(field, value)? {
        let path = format!("{field}.{name}");
        let target = match target {
            Value::String(model_id) if !model_id.is_empty() => ModelTarget {
                model_id: model_id.clone(),
                adapter_id: String::new(),
            },
            Value::Object(fields) => {
                let mut target = ModelTarget {
                    model_id: name.clone(),
                    adapter_id: String::new(),
                };
                for (key, value) in fields {
                    let path = format!("{path}.{key}");
                    match key.as_str() {
                        "model_id" => target.model_id = non_empty_string(&path, value)?,
                        "adapter_id" => target.adapter_id = string(&path, value)?,
                        _ => return Err(ConfigError::new(path, "unknown field")),
                    }
                }
                target
            }
            _ => {
                return Err(ConfigError::new(
                    path,
                    "must be a model id string or {\"model_id\", \"adapter_id\"}",
                ));
            }
        };
        map.insert(name.clone(), target);
    }
    Ok(map)
}

fn reasons(field: &str, value: &Value) -> Result<HashSet<String>, ConfigError> {
    let items = value
        .as_array()
        .ok_or_else(|| ConfigError::new(field, "must be an array of reason codes"))?;
    let mut set = HashSet::new();
    for (index, item) in items.iter().enumerate() {
        set.insert(non_empty_string(&format!("{field}[{index}]"), item)?);
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Settings, ConfigError> {
        Settings::from_json(json.as_bytes())
    }

    fn field_of(json: &str) -> String {
        match parse(json) {
            Ok(settings) => panic!("accepted: {settings:?}"),
            Err(error) => error.field,
        }
    }

    #[test]
    fn outcome_reporting_bounds_are_validated() {
        let settings = parse(
            r#"{"grpc_cluster":"ic","replica_id_is_endpoint":true,
                "outcome_flush_ms":0,"outcome_batch_max":8,"outcome_buffer_max":32}"#,
        )
        .expect("valid config");
        assert_eq!(settings.outcome_flush, Duration::ZERO);
        assert_eq!(
            (settings.outcome_batch_max, settings.outcome_buffer_max),
            (8, 32)
        );
        for (field, value) in [
            ("outcome_flush_ms", "60001"),
            ("outcome_batch_max", "0"),
            ("outcome_buffer_max", "100001"),
            ("outcome_buffer_max", "\"1\""),
        ] {
            let json = format!(
                r#"{{"grpc_cluster":"ic","replica_id_is_endpoint":true,"{field}":{value}}}"#
            );
            assert_eq!(field_of(&json), field, "{json}");
        }
    }

    #[test]
    fn upstream_addresses_map_back_to_replica_ids() {
        let mut settings = Settings::with_cluster("ic");
        settings
            .replica_endpoints
            .insert("replica-a".into(), "10.0.0.1:8000".into());
        assert_eq!(
            settings.replica_of("10.0.0.1:8000").as_deref(),
            Some("replica-a")
        );
        assert_eq!(settings.replica_of("10.0.0.2:8000"), None);
        settings.replica_id_is_endpoint = true;
        assert_eq!(
            settings.replica_of("10.0.0.2:8000").as_deref(),
            Some("10.0.0.2:8000")
        );
        assert_eq!(settings.replica_of("not-an-address"), None);
    }

    #[test]
    fn minimal_config_takes_every_default() {
        let settings =
            parse(r#"{"grpc_cluster":"ic","replica_id_is_endpoint":true}"#).expect("valid config");
        assert_eq!(settings.grpc_cluster, "ic");
        assert_eq!(settings.timeout, Duration::from_millis(20));
        assert_eq!(settings.hash_scheme, "vllm");
        assert_eq!(settings.block_size, 16);
        assert_eq!(settings.destination_header, DEFAULT_DESTINATION_HEADER);
        assert_eq!(
            settings.reason_header.as_deref(),
            Some(DEFAULT_REASON_HEADER)
        );
        assert_eq!(settings.max_body_bytes, 1 << 20);
        assert_eq!(settings.max_response_body_bytes, 1 << 20);
        assert_eq!(settings.outcome_flush, Duration::from_millis(1000));
        assert_eq!(settings.outcome_batch_max, DEFAULT_OUTCOME_BATCH_MAX);
        assert_eq!(settings.outcome_buffer_max, DEFAULT_OUTCOME_BUFFER_MAX);
        assert_eq!(settings.routable_reasons.len(), 3);
        assert!(settings.routable_reasons.contains("AFFINITY_HINT"));
        assert_eq!(settings.tenant, TenantSource::Fixed);
        assert_eq!(settings.tenant_id, "");
        assert!(!settings.expose_reason_header);
    }

    #[test]
    fn full_config_parses() {
        let settings = parse(
            r#"{
                "grpc_cluster": "inference_cache",
                "timeout_ms": 50,
                "tenant_header": "X-Tenant-Id",
                "tenant_id": "default",
                "hash_scheme": "sglang",
                "block_size": 32,
                "destination_header": "x-dest",
                "reason_header": "",
                "replica_endpoints": {"a": "10.0.0.1:8000", "b": "[::1]:9000"},
                "models": {
                    "llama-sql": {"model_id": "llama", "adapter_id": "sql-lora"},
                    "alias": "qwen"
                },
                "routable_reasons": ["PREFIX_MATCH"],
                "max_body_bytes": 4194304,
                "max_response_body_bytes": 0
            }"#,
        )
        .expect("valid config");
        assert_eq!(settings.max_response_body_bytes, 0);
        assert_eq!(settings.tenant, TenantSource::Header("x-tenant-id".into()));
        assert_eq!(settings.reason_header, None);
        assert_eq!(settings.block_size, 32);
        assert_eq!(settings.endpoint_of("b").as_deref(), Some("[::1]:9000"));
        assert_eq!(settings.endpoint_of("10.0.0.9:1"), None);
        assert_eq!(
            settings.model_target("llama-sql"),
            ModelTarget {
                model_id: "llama".into(),
                adapter_id: "sql-lora".into()
            }
        );
        assert_eq!(settings.model_target("alias").model_id, "qwen");
        assert_eq!(settings.model_target("other").model_id, "other");
        assert_eq!(settings.routable_reasons.len(), 1);
    }

    #[test]
    fn replica_id_as_endpoint_needs_ip_and_port() {
        let settings =
            parse(r#"{"grpc_cluster":"ic","replica_id_is_endpoint":true}"#).expect("valid config");
        assert_eq!(
            settings.endpoint_of("127.0.0.1:8001").as_deref(),
            Some("127.0.0.1:8001")
        );
        assert_eq!(settings.endpoint_of("replica-a"), None);
        assert_eq!(settings.endpoint_of("localhost:8000"), None);
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field_of("[]"), "<root>");
        assert_eq!(field_of("{"), "<root>");
        assert_eq!(
            field_of(r#"{"replica_id_is_endpoint":true}"#),
            "grpc_cluster"
        );
        assert_eq!(field_of(r#"{"grpc_cluster":""}"#), "grpc_cluster");
        let base = r#""grpc_cluster":"ic","replica_id_is_endpoint":true"#;
        for (extra, field) in [
            (r#""timeout_ms":0"#, "timeout_ms"),
            (r#""timeout_ms":"20""#, "timeout_ms"),
            (r#""timeout_ms":-5"#, "timeout_ms"),
            (r#""block_size":0"#, "block_size"),
            (r#""hash_scheme":"""#, "hash_scheme"),
            (r#""destination_header":"bad header""#, "destination_header"),
            (r#""tenant_header":7"#, "tenant_header"),
            (
                r#""replica_endpoints":{"a":"host:80"}"#,
                "replica_endpoints.a",
            ),
            (r#""replica_endpoints":[]"#, "replica_endpoints"),
            (r#""models":{"m":{"model":"x"}}"#, "models.m.model"),
            (r#""models":{"m":3}"#, "models.m"),
            (
                r#""routable_reasons":["PREFIX_MATCH",""]"#,
                "routable_reasons[1]",
            ),
            (r#""max_body_bytes":0"#, "max_body_bytes"),
            (
                r#""replica_id_is_endpoint":"yes""#,
                "replica_id_is_endpoint",
            ),
            (r#""timeout":20"#, "timeout"),
        ] {
            assert_eq!(field_of(&format!("{{{base},{extra}}}")), field, "{extra}");
        }
    }

    #[test]
    fn a_config_that_can_never_route_is_rejected() {
        assert_eq!(field_of(r#"{"grpc_cluster":"ic"}"#), "replica_endpoints");
        assert_eq!(
            field_of(
                r#"{"grpc_cluster":"ic","replica_id_is_endpoint":true,
                    "tenant_header":"x-gateway-destination-endpoint"}"#
            ),
            "tenant_header"
        );
    }

    #[test]
    fn error_message_names_field_and_reason() {
        let error = parse(r#"{"grpc_cluster":"ic","timeout_ms":0}"#).err();
        assert_eq!(
            error.map(|error| error.to_string()),
            Some(
                "invalid plugin configuration: `timeout_ms`: must be an integer between 1 and 60000"
                    .to_owned()
            )
        );
    }

    #[test]
    fn istio_cluster_names_get_a_valid_authority() {
        use inference_cache_proto::envoy::{GrpcService, grpc_service};
        let settings = parse(
            r#"{"grpc_cluster":"outbound|9090||inference-cache.ns.svc.cluster.local",
                "replica_id_is_endpoint":true}"#,
        )
        .expect("valid config");
        assert_eq!(
            settings.grpc_authority.as_deref(),
            Some("inference-cache.ns.svc.cluster.local:9090")
        );
        let service = GrpcService::decode(settings.grpc_upstream.as_bytes()).expect("GrpcService");
        assert_eq!(
            service.target_specifier,
            Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                grpc_service::EnvoyGrpc {
                    cluster_name: "outbound|9090||inference-cache.ns.svc.cluster.local".into(),
                    authority: "inference-cache.ns.svc.cluster.local:9090".into(),
                }
            ))
        );
    }

    #[test]
    fn plain_cluster_names_are_dispatched_as_they_are() {
        for cluster in ["inference_cache", "outbound|x||host", "outbound|9090||"] {
            let settings = parse(&format!(
                r#"{{"grpc_cluster":"{cluster}","replica_id_is_endpoint":true}}"#
            ))
            .expect("valid config");
            assert_eq!(settings.grpc_authority, None, "{cluster}");
            assert_eq!(settings.grpc_upstream, cluster);
        }
    }

    #[test]
    fn explicit_authority_wins_and_must_fit() {
        let settings = parse(
            r#"{"grpc_cluster":"outbound|9090||a.b","grpc_authority":"cache.internal:7000",
                "replica_id_is_endpoint":true}"#,
        )
        .expect("valid config");
        assert_eq!(
            settings.grpc_authority.as_deref(),
            Some("cache.internal:7000")
        );
        assert!(settings.grpc_upstream.contains("cache.internal:7000"));
        let long = "h".repeat(130);
        let error = parse(&format!(
            r#"{{"grpc_cluster":"ic","grpc_authority":"{long}","replica_id_is_endpoint":true}}"#
        ))
        .err();
        assert_eq!(error.map(|e| e.field), Some("grpc_authority".to_owned()));
        let error =
            parse(r#"{"grpc_cluster":"ic","grpc_authority":"","replica_id_is_endpoint":true}"#)
                .err();
        assert_eq!(error.map(|e| e.field), Some("grpc_authority".to_owned()));
    }

    #[test]
    fn tenant_sources_parse() {
        let base = r#""grpc_cluster":"ic","replica_id_is_endpoint":true"#;
        let parse_tenant = |tenant: &str| {
            parse(&format!("{{{base},{tenant}}}"))
                .map(|settings| (settings.tenant, settings.tenant_id))
        };
        assert_eq!(
            parse_tenant(
                r#""tenant":{"route_metadata":{"namespace":"inference_cache","path":["tenant"]}},
                   "tenant_id":"default""#
            ),
            Ok((
                TenantSource::RouteMetadata {
                    namespace: "inference_cache".into(),
                    path: vec!["tenant".into()]
                },
                "default".into()
            ))
        );
        assert_eq!(
            parse_tenant(
                r#""tenant":{"dynamic_metadata":{"namespace":"envoy.filters.http.jwt_authn","path":["p","tenant"]}}"#
            )
            .map(|(source, _)| source.property_path().map(|path| path.join("/"))),
            Ok(Some(
                "metadata/filter_metadata/envoy.filters.http.jwt_authn/p/tenant".into()
            ))
        );
        assert_eq!(
            parse_tenant(r#""tenant":{"header":"X-Tenant"}"#),
            Ok((TenantSource::Header("x-tenant".into()), String::new()))
        );
        assert_eq!(
            parse_tenant(r#""tenant":{"fixed":"team-a"}"#),
            Ok((TenantSource::Fixed, "team-a".into()))
        );
        assert_eq!(
            parse_tenant(r#""tenant":{"filter_state":"io.tenant"}"#),
            Ok((TenantSource::FilterState("io.tenant".into()), String::new()))
        );
        assert_eq!(
            TenantSource::RouteMetadata {
                namespace: "ns".into(),
                path: vec!["a".into(), "b".into()]
            }
            .property_path(),
            Some(vec![
                "xds",
                "route_metadata",
                "filter_metadata",
                "ns",
                "a",
                "b"
            ])
        );
    }

    #[test]
    fn bad_tenant_sources_name_the_field() {
        let base = r#""grpc_cluster":"ic","replica_id_is_endpoint":true"#;
        for (extra, field) in [
            (r#""tenant":"x-tenant""#, "tenant"),
            (r#""tenant":{}"#, "tenant"),
            (r#""tenant":{"header":"a","fixed":"b"}"#, "tenant"),
            (r#""tenant":{"cookie":"a"}"#, "tenant.cookie"),
            (r#""tenant":{"header":"bad header"}"#, "tenant.header"),
            (r#""tenant":{"fixed":""}"#, "tenant.fixed"),
            (
                r#""tenant":{"route_metadata":{"path":["t"]}}"#,
                "tenant.route_metadata.namespace",
            ),
            (
                r#""tenant":{"route_metadata":{"namespace":"n","path":[]}}"#,
                "tenant.route_metadata.path",
            ),
            (
                r#""tenant":{"dynamic_metadata":{"namespace":"n","path":[""]}}"#,
                "tenant.dynamic_metadata.path[0]",
            ),
            (
                r#""tenant":{"dynamic_metadata":{"namespace":"n","key":"t"}}"#,
                "tenant.dynamic_metadata.key",
            ),
            (
                r#""tenant":{"header":"x-gateway-destination-endpoint"}"#,
                "tenant.header",
            ),
            (
                r#""tenant":{"header":"x-t"},"tenant_header":"x-t""#,
                "tenant_header",
            ),
            (r#""tenant":{"fixed":"a"},"tenant_id":"b""#, "tenant_id"),
            (r#""expose_reason_header":"yes""#, "expose_reason_header"),
        ] {
            assert_eq!(field_of(&format!("{{{base},{extra}}}")), field, "{extra}");
        }
    }

    #[test]
    fn reason_header_is_hidden_unless_exposed() {
        let settings = parse(
            r#"{"grpc_cluster":"ic","replica_id_is_endpoint":true,"expose_reason_header":true}"#,
        )
        .expect("valid config");
        assert!(settings.expose_reason_header);
    }
}
