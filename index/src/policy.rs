//! Per-tenant routing and eviction policy: the `CachePolicy` custom resource.
//!
//! A policy file is a YAML stream of Kubernetes-shaped objects
//! (`apiVersion: inferencecache.io/v1alpha1`, `kind: CachePolicy`); the object's
//! `metadata.namespace` names the tenant it applies to, and `"*"` is the default
//! for tenants without one of their own. Omitted fields take the defaults of
//! [`CachePolicy::default`]. Parsing is strict: unknown fields, wrong types and
//! invalid values are rejected with a [`PolicyError`] naming the document, the
//! field and the reason, so a bad edit can be refused as a whole.
//!
//! A parsed [`PolicySet`] is immutable; the index swaps whole sets atomically,
//! and resolving a tenant's policy is one hash-map probe.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};

/// `apiVersion` every policy object must carry.
pub const API_VERSION: &str = "inferencecache.io/v1alpha1";
/// `kind` every policy object must carry.
pub const KIND: &str = "CachePolicy";
/// Namespace of the default policy.
pub const DEFAULT_NAMESPACE: &str = "*";

/// Victim order when a capacity bound forces evictions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum Eviction {
    /// Least recently seen first.
    #[default]
    #[serde(rename = "LRU")]
    Lru,
    /// Least accessed first (lookup hits credit an entry), oldest first on ties.
    #[serde(rename = "LFU")]
    Lfu,
}

/// How AFFINITY_HINT maps a prompt fingerprint onto the serving replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum AffinityAlgorithm {
    /// `u64_be(SHA-256(seed)[0..8]) % n` over replicas sorted by id.
    #[default]
    Modulo,
    /// Highest `u64_be(SHA-256(SHA-256(seed) ++ replica_id)[0..8])` wins.
    Rendezvous,
}

/// How PREFIX_MATCH candidates are ordered and how a request with no
/// distinguishing match is placed (`spec.ranker`); see `docs/routing.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum Ranker {
    /// The contract's score: matched tokens × freshness × pressure factor ×
    /// SLO bias × distinguishing power; AFFINITY_HINT seeded by the whole chain.
    Contract,
    /// Minimizes the work a request waits for on each live member: its
    /// uncached prefill tokens there plus the load already queued there.
    #[default]
    CostAware,
}

/// `spec.strategy`: per-namespace gates on the lookup path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Strategy {
    /// `false` strips block-hash chains and forces the exact `prefix_hash` path.
    pub enable_chain_matching: bool,
    /// `true` answers POLICY_REQUIRES_CHAIN unless the request carries a valid wire chain.
    pub require_chain: bool,
    /// `false` turns the TENANT_HOT fallback off.
    pub enable_tenant_hot: bool,
}

impl Default for Strategy {
    fn default() -> Self {
        Self {
            enable_chain_matching: true,
            require_chain: false,
            enable_tenant_hot: true,
        }
    }
}

/// The resolved `spec` of one CachePolicy, with every default applied.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CachePolicy {
    /// Victim order under a capacity bound.
    pub eviction: Eviction,
    /// Entry lifetime; also the horizon of the freshness factor.
    #[serde(rename = "evictionTTL", serialize_with = "ser_duration")]
    pub eviction_ttl: Duration,
    /// Lookup budget; `None` means only the caller's deadline applies.
    #[serde(serialize_with = "ser_opt_ms")]
    pub lookup_timeout_ms: Option<Duration>,
    /// Requests with fewer prefix tokens never get a positive hint.
    pub minimum_prefix_tokens: u32,
    /// Replicas that matched fewer tokens are dropped from a PREFIX_MATCH.
    pub minimum_matched_tokens: u32,
    /// The top PREFIX_MATCH score must reach this or the result downgrades.
    pub routing_floor_score: f64,
    /// Whether the AFFINITY_HINT fallback is on (`Enabled`).
    #[serde(serialize_with = "ser_enabled")]
    pub affinity_routing: bool,
    /// Replica pick of the AFFINITY_HINT fallback.
    pub affinity_algorithm: AffinityAlgorithm,
    /// Lookup gates.
    pub strategy: Strategy,
    /// Per-tenant cap on block-replica entries (`quota.maxIndexEntries`).
    pub max_index_entries: Option<u64>,
    /// Stats older than this do not make a replica TENANT_HOT; zero disables TENANT_HOT.
    #[serde(serialize_with = "ser_duration")]
    pub tenant_hot_max_age: Duration,
    /// Minimum reported hit rate of a TENANT_HOT replica.
    pub tenant_hot_min_hit_rate: f64,
    /// Weight of reported pressure in `max(0, 1 - weight * pressure)`.
    pub pressure_weight: f64,
    /// Extra weight of freshness when the request's TTFT SLO is tight.
    pub slo_tight_bias: f64,
    /// A TTFT SLO below this many milliseconds (and above zero) is tight.
    pub slo_tight_ttft_ms: u32,
    /// Ranking strategy.
    pub ranker: Ranker,
    /// A replica not heard from for this long leaves the serving set.
    #[serde(serialize_with = "ser_duration")]
    pub replica_timeout: Duration,
    /// CostAware: weight of a replica's queued work against the request's
    /// own uncached tokens (1 = both in prefill tokens, minimizing TTFT).
    pub load_weight: f64,
    /// CostAware: a running (decoding) request counts as this fraction of a
    /// waiting one.
    pub running_weight: f64,
    /// CostAware: stats older than this are unknown load, not zero load.
    #[serde(serialize_with = "ser_duration")]
    pub load_stats_max_age: Duration,
    /// CostAware: a request without a distinguishing match goes to its
    /// rendezvous-preferred member unless that member's load, or its recent
    /// requests, exceed this multiple of the mean (plus one request).
    pub load_bound: f64,
    /// CostAware: half-life of the recent-requests count that spreads new
    /// sessions.
    #[serde(serialize_with = "ser_duration")]
    pub balance_half_life: Duration,
    /// CostAware: how much dearer an uncached token gets per request queued
    /// on the average member.
    pub contention_weight: f64,
    /// CostAware: weight of the balance excess for a request that continues
    /// a conversation (its deepest match ends where no earlier request's
    /// did), against 1 for a request that starts from a shared prefix.
    pub continuation_weight: f64,
    /// CostAware: how much dearer an uncached token gets on a member whose
    /// cache is full (every block it stores evicts one; measured from its
    /// recent stores and evictions): copying a prefix there pushes out
    /// blocks that later requests would have reused.
    pub full_cache_weight: f64,
    /// Shadow mode: lookups are answered and ranked as usual, but the answer
    /// says `shadow`, so gateways do not route on it; they still report the
    /// outcome, which shows what routing would have gained.
    pub shadow: bool,
}

impl Default for CachePolicy {
    fn default() -> Self {
        Self {
            eviction: Eviction::Lru,
            eviction_ttl: Duration::from_secs(30 * 60),
            lookup_timeout_ms: None,
            minimum_prefix_tokens: 0,
            minimum_matched_tokens: 64,
            routing_floor_score: 0.1,
            affinity_routing: true,
            affinity_algorithm: AffinityAlgorithm::Modulo,
            strategy: Strategy::default(),
            max_index_entries: None,
            tenant_hot_max_age: Duration::from_secs(5 * 60),
            tenant_hot_min_hit_rate: 0.1,
            pressure_weight: 1.0,
            slo_tight_bias: 1.0,
            slo_tight_ttft_ms: 200,
            ranker: Ranker::CostAware,
            replica_timeout: Duration::from_secs(30),
            load_weight: 1.0,
            running_weight: 0.2,
            load_stats_max_age: Duration::from_secs(5),
            load_bound: 1.25,
            balance_half_life: Duration::from_secs(180),
            contention_weight: 0.5,
            continuation_weight: 0.2,
            full_cache_weight: 24.0,
            shadow: false,
        }
    }
}

/// Every effective policy: the `"*"` default plus one per namespace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicySet {
    default: Arc<CachePolicy>,
    namespaces: HashMap<String, Arc<CachePolicy>>,
}

impl PolicySet {
    /// A set with `default` for every tenant and no per-namespace policies.
    pub fn with_default(default: CachePolicy) -> Self {
        Self {
            default: Arc::new(default),
            namespaces: HashMap::new(),
        }
    }

    /// Adds (or replaces) the policy of `namespace`; `"*"` replaces the default.
    pub fn insert(&mut self, namespace: &str, policy: CachePolicy) {
        if namespace == DEFAULT_NAMESPACE {
            self.default = Arc::new(policy);
        } else {
            self.namespaces
                .insert(namespace.to_owned(), Arc::new(policy));
        }
    }

    /// The policy in force for `tenant`.
    pub fn for_tenant(&self, tenant: &str) -> &CachePolicy {
        self.namespaces.get(tenant).unwrap_or(&self.default)
    }

    /// The default policy.
    pub fn default_policy(&self) -> &CachePolicy {
        &self.default
    }

    /// Number of per-namespace policies (the default not counted).
    pub fn len(&self) -> usize {
        self.namespaces.len()
    }

    /// True when only the default applies.
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty()
    }

    /// Parses a YAML stream of CachePolicy objects.
    pub fn from_yaml(text: &str) -> Result<Self, PolicyError> {
        let mut set = Self::default();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let number = index + 1;
            let value = serde_yaml::Value::deserialize(document).map_err(|e| PolicyError {
                document: number,
                name: None,
                field: String::new(),
                reason: format!("not valid YAML: {e}"),
            })?;
            if value.is_null() {
                continue;
            }
            let name = value
                .get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(|n| n.as_str())
                .map(str::to_owned);
            let ParsedDocument { namespace, policy } =
                parse_document(value).map_err(|FieldError { field, reason }| PolicyError {
                    document: number,
                    name: name.clone(),
                    field,
                    reason,
                })?;
            if let Some(first) = seen.insert(namespace.clone(), number) {
                return Err(PolicyError {
                    document: number,
                    name,
                    field: "metadata.namespace".into(),
                    reason: format!(
                        "namespace {namespace:?} already has a policy in document {first}"
                    ),
                });
            }
            set.insert(&namespace, policy);
        }
        Ok(set)
    }
}

impl Serialize for PolicySet {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let namespaces: BTreeMap<&str, &CachePolicy> = self
            .namespaces
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_ref()))
            .collect();
        #[derive(Serialize)]
        struct View<'a> {
            default: &'a CachePolicy,
            namespaces: BTreeMap<&'a str, &'a CachePolicy>,
        }
        View {
            default: &self.default,
            namespaces,
        }
        .serialize(serializer)
    }
}

/// A policy document that could not be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct PolicyError {
    /// 1-based position of the document in the stream.
    pub document: usize,
    /// `metadata.name` of the document, when it could be read.
    pub name: Option<String>,
    /// Dotted path of the offending field (empty when the document itself is bad).
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "policy document {}", self.document)?;
        if let Some(name) = &self.name {
            write!(f, " ({name:?})")?;
        }
        if !self.field.is_empty() {
            write!(f, ", field {}", self.field)?;
        }
        write!(f, ": {}", self.reason)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawDocument {
    api_version: Option<String>,
    kind: Option<String>,
    metadata: Option<RawMetadata>,
    spec: Option<RawSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetadata {
    name: Option<String>,
    namespace: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawSpec {
    eviction: Option<String>,
    #[serde(rename = "evictionTTL")]
    eviction_ttl: Option<String>,
    lookup_timeout_ms: Option<i64>,
    minimum_prefix_tokens: Option<i64>,
    minimum_matched_tokens: Option<i64>,
    routing_floor_score: Option<Number>,
    affinity_routing: Option<String>,
    affinity_algorithm: Option<String>,
    strategy: Option<RawStrategy>,
    quota: Option<RawQuota>,
    tenant_hot_max_age: Option<String>,
    tenant_hot_min_hit_rate: Option<Number>,
    pressure_weight: Option<Number>,
    slo_tight_bias: Option<Number>,
    slo_tight_ttft_ms: Option<i64>,
    ranker: Option<String>,
    replica_timeout: Option<String>,
    load_weight: Option<Number>,
    running_weight: Option<Number>,
    load_stats_max_age: Option<String>,
    load_bound: Option<Number>,
    balance_half_life: Option<String>,
    contention_weight: Option<Number>,
    continuation_weight: Option<Number>,
    full_cache_weight: Option<Number>,
    shadow: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawStrategy {
    enable_chain_matching: Option<bool>,
    require_chain: Option<bool>,
    enable_tenant_hot: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawQuota {
    max_index_entries: Option<i64>,
}

/// A decimal given either as a YAML number or as a string (`"0.1"`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Number {
    Float(f64),
    Text(String),
}

/// A field of a document that could not be accepted.
#[derive(Debug)]
struct FieldError {
    /// Dotted path of the field (empty when the document itself is bad).
    field: String,
    /// What is wrong with it.
    reason: String,
}

fn field_err(field: &str, reason: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_owned(),
        reason: reason.into(),
    }
}

/// One accepted document: the namespace it applies to and its policy.
#[derive(Debug)]
struct ParsedDocument {
    namespace: String,
    policy: CachePolicy,
}

fn parse_document(value: serde_yaml::Value) -> Result<ParsedDocument, FieldError> {
    let raw: RawDocument = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        FieldError {
            field: if path == "." { String::new() } else { path },
            reason: e.into_inner().to_string(),
        }
    })?;
    check_type(&raw)?;
    let namespace = namespace_of(raw.metadata)?;
    let mut policy = CachePolicy::default();
    if let Some(spec) = raw.spec {
        apply_spec(&mut policy, &spec)?;
    }
    Ok(ParsedDocument { namespace, policy })
}

/// `apiVersion` and `kind` name a CachePolicy of this version.
fn check_type(raw: &RawDocument) -> Result<(), FieldError> {
    for (field, value, expected) in [
        ("apiVersion", &raw.api_version, API_VERSION),
        ("kind", &raw.kind, KIND),
    ] {
        match value.as_deref() {
            Some(value) if value == expected => {}
            Some(other) => {
                return Err(field_err(
                    field,
                    format!("expected {expected:?}, got {other:?}"),
                ));
            }
            None => return Err(field_err(field, "missing")),
        }
    }
    Ok(())
}

/// The namespace the document applies to (`"*"`: the default policy).
fn namespace_of(metadata: Option<RawMetadata>) -> Result<String, FieldError> {
    let metadata = metadata.ok_or_else(|| field_err("metadata", "missing"))?;
    let _ = (&metadata.name, &metadata.labels, &metadata.annotations);
    match metadata.namespace {
        Some(ns) if !ns.is_empty() => Ok(ns),
        _ => Err(field_err(
            "metadata.namespace",
            "missing or empty (use \"*\" for the default policy)",
        )),
    }
}

/// Applies every field `spec` sets over the defaults in `policy`, one group
/// of fields per step, in the order of [`RawSpec`]; the first bad field is
/// the error.
fn apply_spec(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    apply_eviction(policy, spec)?;
    apply_lookup_gates(policy, spec)?;
    apply_affinity(policy, spec)?;
    apply_strategy_and_quota(policy, spec)?;
    apply_tenant_hot(policy, spec)?;
    apply_contract_scoring(policy, spec)?;
    apply_ranker_and_membership(policy, spec)?;
    apply_cost_aware(policy, spec)?;
    if let Some(v) = spec.shadow {
        policy.shadow = v;
    }
    Ok(())
}

/// `eviction`, `evictionTTL`.
fn apply_eviction(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(v) = &spec.eviction {
        policy.eviction = choice(
            "spec.eviction",
            v,
            [("LRU", Eviction::Lru), ("LFU", Eviction::Lfu)],
        )?;
    }
    if let Some(v) = &spec.eviction_ttl {
        policy.eviction_ttl = positive_duration("spec.evictionTTL", v)?;
    }
    Ok(())
}

/// `lookupTimeoutMs`, `minimumPrefixTokens`, `minimumMatchedTokens`, `routingFloorScore`.
fn apply_lookup_gates(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(ms) = spec.lookup_timeout_ms {
        let ms = non_negative("spec.lookupTimeoutMs", ms)?;
        policy.lookup_timeout_ms = (ms > 0).then(|| Duration::from_millis(u64::from(ms)));
    }
    if let Some(v) = spec.minimum_prefix_tokens {
        policy.minimum_prefix_tokens = non_negative("spec.minimumPrefixTokens", v)?;
    }
    if let Some(v) = spec.minimum_matched_tokens {
        policy.minimum_matched_tokens = non_negative("spec.minimumMatchedTokens", v)?;
    }
    if let Some(v) = &spec.routing_floor_score {
        policy.routing_floor_score = decimal("spec.routingFloorScore", v)?;
    }
    Ok(())
}

/// `affinityRouting`, `affinityAlgorithm`.
fn apply_affinity(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(v) = &spec.affinity_routing {
        policy.affinity_routing = choice(
            "spec.affinityRouting",
            v,
            [("Enabled", true), ("Disabled", false)],
        )?;
    }
    if let Some(v) = &spec.affinity_algorithm {
        policy.affinity_algorithm = choice(
            "spec.affinityAlgorithm",
            v,
            [
                ("Modulo", AffinityAlgorithm::Modulo),
                ("Rendezvous", AffinityAlgorithm::Rendezvous),
            ],
        )?;
    }
    Ok(())
}

/// `strategy.*`, `quota.maxIndexEntries`.
fn apply_strategy_and_quota(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(s) = &spec.strategy {
        if let Some(v) = s.enable_chain_matching {
            policy.strategy.enable_chain_matching = v;
        }
        if let Some(v) = s.require_chain {
            policy.strategy.require_chain = v;
        }
        if let Some(v) = s.enable_tenant_hot {
            policy.strategy.enable_tenant_hot = v;
        }
    }
    if let Some(q) = &spec.quota
        && let Some(v) = q.max_index_entries
    {
        if v <= 0 {
            return Err(field_err(
                "spec.quota.maxIndexEntries",
                format!("must be positive, got {v}"),
            ));
        }
        policy.max_index_entries = u64::try_from(v).ok();
    }
    Ok(())
}

/// `tenantHotMaxAge`, `tenantHotMinHitRate`.
fn apply_tenant_hot(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(v) = &spec.tenant_hot_max_age {
        policy.tenant_hot_max_age = duration("spec.tenantHotMaxAge", v)?;
    }
    if let Some(v) = &spec.tenant_hot_min_hit_rate {
        let rate = decimal("spec.tenantHotMinHitRate", v)?;
        if rate > 1.0 {
            return Err(field_err(
                "spec.tenantHotMinHitRate",
                format!("must be within [0, 1], got {rate}"),
            ));
        }
        policy.tenant_hot_min_hit_rate = rate;
    }
    Ok(())
}

/// `pressureWeight`, `sloTightBias`, `sloTightTtftMs`.
fn apply_contract_scoring(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(v) = &spec.pressure_weight {
        policy.pressure_weight = decimal("spec.pressureWeight", v)?;
    }
    if let Some(v) = &spec.slo_tight_bias {
        policy.slo_tight_bias = decimal("spec.sloTightBias", v)?;
    }
    if let Some(v) = spec.slo_tight_ttft_ms {
        policy.slo_tight_ttft_ms = non_negative("spec.sloTightTtftMs", v)?;
    }
    Ok(())
}

/// `ranker`, `replicaTimeout`.
fn apply_ranker_and_membership(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(v) = &spec.ranker {
        policy.ranker = choice(
            "spec.ranker",
            v,
            [
                ("Contract", Ranker::Contract),
                ("CostAware", Ranker::CostAware),
            ],
        )?;
    }
    if let Some(v) = &spec.replica_timeout {
        policy.replica_timeout = positive_duration("spec.replicaTimeout", v)?;
    }
    Ok(())
}

/// The CostAware ranker's weights and bounds: `loadWeight` to `fullCacheWeight`.
fn apply_cost_aware(policy: &mut CachePolicy, spec: &RawSpec) -> Result<(), FieldError> {
    if let Some(v) = &spec.load_weight {
        policy.load_weight = decimal("spec.loadWeight", v)?;
    }
    if let Some(v) = &spec.running_weight {
        policy.running_weight = decimal("spec.runningWeight", v)?;
    }
    if let Some(v) = &spec.load_stats_max_age {
        policy.load_stats_max_age = duration("spec.loadStatsMaxAge", v)?;
    }
    if let Some(v) = &spec.load_bound {
        let bound = decimal("spec.loadBound", v)?;
        if bound < 1.0 {
            return Err(field_err(
                "spec.loadBound",
                format!("must be at least 1, got {bound}"),
            ));
        }
        policy.load_bound = bound;
    }
    if let Some(v) = &spec.balance_half_life {
        policy.balance_half_life = duration("spec.balanceHalfLife", v)?;
    }
    if let Some(v) = &spec.contention_weight {
        policy.contention_weight = decimal("spec.contentionWeight", v)?;
    }
    if let Some(v) = &spec.continuation_weight {
        let weight = decimal("spec.continuationWeight", v)?;
        if !(0.0..=1.0).contains(&weight) {
            return Err(field_err(
                "spec.continuationWeight",
                format!("must be between 0 and 1, got {weight}"),
            ));
        }
        policy.continuation_weight = weight;
    }
    if let Some(v) = &spec.full_cache_weight {
        policy.full_cache_weight = decimal("spec.fullCacheWeight", v)?;
    }
    Ok(())
}

/// One of two spellings, each standing for a value.
fn choice<T: Copy>(field: &str, value: &str, options: [(&str, T); 2]) -> Result<T, FieldError> {
    let [(first, a), (second, b)] = options;
    match value {
        v if v == first => Ok(a),
        v if v == second => Ok(b),
        other => Err(field_err(
            field,
            format!("must be {first} or {second}, got {other:?}"),
        )),
    }
}

fn duration(field: &str, text: &str) -> Result<Duration, FieldError> {
    parse_duration(text).map_err(|reason| field_err(field, reason))
}

fn positive_duration(field: &str, text: &str) -> Result<Duration, FieldError> {
    let value = duration(field, text)?;
    if value.is_zero() {
        return Err(field_err(field, "must be greater than zero"));
    }
    Ok(value)
}

fn non_negative(field: &str, value: i64) -> Result<u32, FieldError> {
    u32::try_from(value).map_err(|_| {
        field_err(
            field,
            format!("must be a non-negative 32-bit integer, got {value}"),
        )
    })
}

fn decimal(field: &str, value: &Number) -> Result<f64, FieldError> {
    let parsed = match value {
        Number::Float(f) => *f,
        Number::Text(text) => text
            .trim()
            .parse::<f64>()
            .map_err(|_| field_err(field, format!("not a decimal number: {text:?}")))?,
    };
    if !parsed.is_finite() || parsed < 0.0 {
        return Err(field_err(
            field,
            format!("must be a finite non-negative number, got {parsed}"),
        ));
    }
    Ok(parsed)
}

/// Parses a duration — the one grammar of every flag and policy field:
/// `0`, or numbers each followed by a unit, optionally separated by spaces:
/// `30m`, `1h30m`, `1h 30m`, `90s`, `250ms`, `1.5h`, `10min`, `2 days`.
/// Units: `ns`; `us`/`µs`; `ms`/`msec`/`millis`; `s`/`sec`/`secs`/`second(s)`;
/// `m`/`min`/`mins`/`minute(s)`; `h`/`hr`/`hrs`/`hour(s)`; `d`/`day(s)`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration".into());
    }
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = text;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{text:?} lacks a unit (ns, us, ms, s, m, h, d)"))?;
        if number_len == 0 {
            return Err(format!("{text:?} is not a duration like 30m or 1h30m"));
        }
        let number: f64 = rest[..number_len]
            .parse()
            .map_err(|_| format!("{text:?} has a bad number"))?;
        rest = rest[number_len..].trim_start();
        let unit_len = rest
            .find(|c: char| !(c.is_alphabetic()))
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" | "msec" | "millis" => 1e-3,
            "s" | "sec" | "secs" | "second" | "seconds" => 1.0,
            "m" | "min" | "mins" | "minute" | "minutes" => 60.0,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3600.0,
            "d" | "day" | "days" => 86_400.0,
            "" => return Err(format!("{text:?} lacks a unit (ns, us, ms, s, m, h, d)")),
            other => {
                return Err(format!(
                    "{text:?} has unknown unit {other:?} (use ns, us, ms, s, m, h, d)"
                ));
            }
        };
        total += number * scale;
        rest = rest[unit_len..].trim_start();
    }
    Duration::try_from_secs_f64(total).map_err(|_| format!("{text:?} is out of range"))
}

/// Formats a duration the way [`parse_duration`] reads it (`1h30m`, `45s`, `250ms`).
pub fn format_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d.subsec_nanos() != 0 {
        return format!("{}ms", d.as_millis());
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 {
        out.push_str(&format!("{s}s"));
    }
    out
}

fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

fn ser_opt_ms<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
}

fn ser_enabled<S: Serializer>(on: &bool, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(if *on { "Enabled" } else { "Disabled" })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: { name: team-a, namespace: team-a }
spec:
  eviction: LFU
  evictionTTL: 10m
  lookupTimeoutMs: 20
  minimumPrefixTokens: 32
  minimumMatchedTokens: 16
  routingFloorScore: "0.25"
  affinityRouting: Disabled
  affinityAlgorithm: Rendezvous
  strategy: { enableChainMatching: false, requireChain: true, enableTenantHot: false }
  quota: { maxIndexEntries: 200000 }
  tenantHotMaxAge: 1m
  pressureWeight: 0.5
  sloTightBias: 2
  sloTightTtftMs: 150
---
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: { name: default, namespace: "*" }
spec:
  minimumMatchedTokens: 0
"#;

    #[test]
    fn defaults_match_the_design() {
        let p = CachePolicy::default();
        assert_eq!(p.eviction, Eviction::Lru);
        assert_eq!(p.eviction_ttl, Duration::from_secs(1800));
        assert_eq!(p.minimum_matched_tokens, 64);
        assert!((p.routing_floor_score - 0.1).abs() < 1e-12);
        assert!(p.affinity_routing);
        assert_eq!(p.affinity_algorithm, AffinityAlgorithm::Modulo);
        assert_eq!(p.strategy, Strategy::default());
        assert!(
            p.strategy.enable_chain_matching
                && !p.strategy.require_chain
                && p.strategy.enable_tenant_hot
        );
        assert_eq!(p.tenant_hot_max_age, Duration::from_secs(300));
        assert_eq!(p.slo_tight_ttft_ms, 200);
    }

    #[test]
    fn parses_every_field_and_the_star_default() {
        let set = PolicySet::from_yaml(FULL).expect("valid");
        let a = set.for_tenant("team-a");
        assert_eq!(a.eviction, Eviction::Lfu);
        assert_eq!(a.eviction_ttl, Duration::from_secs(600));
        assert_eq!(a.lookup_timeout_ms, Some(Duration::from_millis(20)));
        assert_eq!(a.minimum_prefix_tokens, 32);
        assert_eq!(a.minimum_matched_tokens, 16);
        assert!((a.routing_floor_score - 0.25).abs() < 1e-12);
        assert!(!a.affinity_routing);
        assert_eq!(a.affinity_algorithm, AffinityAlgorithm::Rendezvous);
        assert!(
            !a.strategy.enable_chain_matching
                && a.strategy.require_chain
                && !a.strategy.enable_tenant_hot
        );
        assert_eq!(a.max_index_entries, Some(200_000));
        assert_eq!(a.tenant_hot_max_age, Duration::from_secs(60));
        assert!((a.pressure_weight - 0.5).abs() < 1e-12);
        assert!((a.slo_tight_bias - 2.0).abs() < 1e-12);
        assert_eq!(a.slo_tight_ttft_ms, 150);
        let other = set.for_tenant("team-b");
        assert_eq!(other.minimum_matched_tokens, 0);
        assert_eq!(other.eviction_ttl, Duration::from_secs(1800));
        assert_eq!(set.len(), 1);
        let json = serde_json_like(&set);
        assert!(json.contains("evictionTTL"), "{json}");
    }

    fn serde_json_like(set: &PolicySet) -> String {
        serde_yaml::to_string(set).expect("serializes")
    }

    fn error_of(text: &str) -> PolicyError {
        PolicySet::from_yaml(text).expect_err("must be rejected")
    }

    #[test]
    fn unknown_field_names_document_and_path() {
        let e = error_of(
            "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: ok, namespace: x}\n---\n\
             apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: bad, namespace: y}\nspec:\n  strategy: {requireChian: true}\n",
        );
        assert_eq!(e.document, 2);
        assert_eq!(e.name.as_deref(), Some("bad"));
        assert_eq!(e.field, "spec.strategy.requireChian");
        assert!(e.reason.contains("requireChian"), "{e}");
        let shown = e.to_string();
        assert!(
            shown.contains("document 2")
                && shown.contains("bad")
                && shown.contains("spec.strategy"),
            "{shown}"
        );
    }

    #[test]
    fn invalid_values_name_the_field() {
        let head = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: p, namespace: t}\nspec:\n";
        for (body, field) in [
            ("  eviction: FIFO\n", "spec.eviction"),
            ("  evictionTTL: 30x\n", "spec.evictionTTL"),
            ("  evictionTTL: 0s\n", "spec.evictionTTL"),
            ("  routingFloorScore: \"abc\"\n", "spec.routingFloorScore"),
            ("  routingFloorScore: \"-1\"\n", "spec.routingFloorScore"),
            ("  affinityRouting: On\n", "spec.affinityRouting"),
            ("  affinityAlgorithm: Ring\n", "spec.affinityAlgorithm"),
            ("  minimumMatchedTokens: -5\n", "spec.minimumMatchedTokens"),
            (
                "  quota: {maxIndexEntries: 0}\n",
                "spec.quota.maxIndexEntries",
            ),
            ("  lookupTimeoutMs: soon\n", "spec.lookupTimeoutMs"),
        ] {
            let e = error_of(&format!("{head}{body}"));
            assert_eq!(e.field, field, "{body}: {e}");
            assert_eq!(e.document, 1);
            assert_eq!(e.name.as_deref(), Some("p"));
        }
    }

    #[test]
    fn reasons_say_what_is_accepted_and_the_first_bad_field_wins() {
        let head = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: p, namespace: t}\nspec:\n";
        for (body, reason) in [
            ("  eviction: FIFO\n", "must be LRU or LFU, got \"FIFO\""),
            (
                "  ranker: Fast\n",
                "must be Contract or CostAware, got \"Fast\"",
            ),
            ("  replicaTimeout: 0s\n", "must be greater than zero"),
            ("  loadBound: 0.5\n", "must be at least 1, got 0.5"),
            ("  tenantHotMinHitRate: 2\n", "must be within [0, 1], got 2"),
        ] {
            let e = error_of(&format!("{head}{body}"));
            assert_eq!(e.reason, reason, "{body}: {e}");
        }
        // Whatever the order in the document, the spec's first group is checked first.
        let e = error_of(&format!("{head}  loadBound: 0.5\n  eviction: FIFO\n"));
        assert_eq!(e.field, "spec.eviction");
    }

    #[test]
    fn header_errors() {
        let e = error_of("apiVersion: v1\nkind: CachePolicy\nmetadata: {namespace: t}\n");
        assert_eq!(e.field, "apiVersion");
        let e = error_of(
            "apiVersion: inferencecache.io/v1alpha1\nkind: Other\nmetadata: {namespace: t}\n",
        );
        assert_eq!(e.field, "kind");
        let e = error_of(
            "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: n}\n",
        );
        assert_eq!(e.field, "metadata.namespace");
        let two = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: n, namespace: t}\n";
        let e = error_of(&format!("{two}---\n{two}"));
        assert_eq!((e.document, e.field.as_str()), (2, "metadata.namespace"));
        let e = error_of("a: [unclosed");
        assert_eq!(e.document, 1);
    }

    #[test]
    fn empty_stream_is_all_defaults() {
        let set = PolicySet::from_yaml("").expect("empty ok");
        assert_eq!(set.for_tenant("x"), &CachePolicy::default());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("m").is_err());
        assert_eq!(parse_duration("5d"), Ok(Duration::from_secs(5 * 86_400)));
        assert_eq!(parse_duration("10min"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2 seconds"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("5 fortnights").is_err());
        assert!(parse_duration("1h 30").is_err());
        assert_eq!(format_duration(Duration::from_secs(5400)), "1h30m");
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
    }
}
