//! Prefill/decode routing (`LookupPDRoute`): PD topologies from the policy
//! file and the pick of one prefill and one decode replica.
//!
//! A topology is a `kind: PDTopology` object in the `--policy-file` stream,
//! beside the `CachePolicy` objects (re-read with them; a bad one keeps the
//! last good file in force):
//!
//! ```yaml
//! apiVersion: inferencecache.io/v1alpha1
//! kind: PDTopology
//! metadata: { name: llama-pd, namespace: team-a }   # namespace "*": any tenant
//! spec:
//!   hashScheme: vllm            # engine domain the prefill pool reports under
//!   transport: NIXL             # Mooncake | NIXL | Direct → transport_hint
//!   prefill: [10.0.0.1:8000, 10.0.0.2:8000]
//!   decode: [10.0.1.1:8000, 10.0.1.2:8000]
//! ```
//!
//! `pd_topology_ref` names a topology in the request tenant's namespace, else
//! in `"*"`. Decision order (each answer fills every response field):
//! 1. probe tenant, unknown topology, missing `model_id` → `NO_HINT`, no replicas;
//! 2. the index lookup of `prefix_hash` (`CacheIndex::lookup`, the same
//!    rules, timeout and diagnostics as LookupRoute): `TIMEOUT` and the
//!    `UNKNOWN_*` codes are passed on with no replicas (fail open);
//! 3. `PREFIX_MATCH` when the best-ranked holder is in the prefill pool: that
//!    replica prefills;
//! 4. otherwise `AFFINITY_HINT`: the least-loaded prefill replica;
//! 5. decode: always the least-loaded decode replica.
//!
//! Load of a replica is `pressure + requests_waiting + runningWeight ×
//! requests_running` from its last stats if younger than the tenant's
//! `loadStatsMaxAge`; a replica with no fresh stats counts as the mean of the
//! known ones. Ties (e.g. nobody reports stats) go to the rendezvous pick over
//! the tied replicas seeded by `prefix_hash`, so one prompt keeps its replicas
//! and different prompts spread. Cost: one index lookup and one read of the
//! replica table (`CacheIndex::snapshot`: per scope and replica, not per entry).

use std::collections::HashMap;

use inference_cache_index::{
    self as index, AffinityAlgorithm, CacheIndex, LookupRequest, PROBE_TENANT, Reason,
};
use serde::Deserialize;

/// `kind` of a PD topology object.
pub const KIND: &str = "PDTopology";

/// How KV moves from prefill to decode, sent as `transport_hint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
pub enum Transport {
    /// Mooncake transfer engine.
    Mooncake,
    /// NVIDIA NIXL.
    #[serde(rename = "NIXL")]
    Nixl,
    /// Engine-to-engine, no transfer service.
    Direct,
}

impl Transport {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mooncake => "Mooncake",
            Self::Nixl => "NIXL",
            Self::Direct => "Direct",
        }
    }
}

/// One prefill/decode topology.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PdTopology {
    /// `metadata.name`: what `pd_topology_ref` names.
    pub name: String,
    /// `metadata.namespace`: the tenant it serves (`*` = any).
    pub namespace: String,
    /// Engine domain of the prefill pool's reports.
    pub hash_scheme: String,
    /// Transport hint.
    pub transport: Transport,
    /// Prefill pool (replica ids as producers report them).
    pub prefill: Vec<String>,
    /// Decode pool.
    pub decode: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTopology {
    #[serde(rename = "apiVersion")]
    _api_version: String,
    #[serde(rename = "kind")]
    _kind: String,
    metadata: RawMetadata,
    spec: RawSpec,
}

#[derive(Deserialize)]
struct RawMetadata {
    name: String,
    namespace: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawSpec {
    hash_scheme: String,
    transport: Transport,
    prefill: Vec<String>,
    decode: Vec<String>,
}

/// Every topology, by (namespace, name).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PdTopologies {
    by_key: HashMap<String, PdTopology>,
}

impl PdTopologies {
    /// Validates `PDTopology` documents (`(position in the stream, document)`).
    pub fn from_documents(docs: Vec<(usize, serde_yaml::Value)>) -> anyhow::Result<Self> {
        let mut by_key = HashMap::new();
        for (position, doc) in docs {
            let raw: RawTopology = serde_yaml::from_value(doc)
                .map_err(|e| anyhow::anyhow!("document {position} (PDTopology): {e}"))?;
            let what = format!(
                "document {position} (PDTopology {}/{})",
                raw.metadata.namespace, raw.metadata.name
            );
            anyhow::ensure!(
                !raw.metadata.name.is_empty(),
                "{what}: metadata.name is empty"
            );
            anyhow::ensure!(
                !raw.spec.hash_scheme.is_empty(),
                "{what}: spec.hashScheme is empty"
            );
            anyhow::ensure!(
                !raw.spec.prefill.is_empty() && !raw.spec.decode.is_empty(),
                "{what}: spec.prefill and spec.decode need at least one replica each"
            );
            let key = key(&raw.metadata.namespace, &raw.metadata.name);
            let topology = PdTopology {
                name: raw.metadata.name,
                namespace: raw.metadata.namespace,
                hash_scheme: raw.spec.hash_scheme,
                transport: raw.spec.transport,
                prefill: raw.spec.prefill,
                decode: raw.spec.decode,
            };
            anyhow::ensure!(
                by_key.insert(key, topology).is_none(),
                "{what}: defined twice"
            );
        }
        Ok(Self { by_key })
    }

    /// The topology `name` for `tenant`, else the one in namespace `*`.
    pub fn resolve(&self, tenant: &str, name: &str) -> Option<&PdTopology> {
        self.by_key
            .get(&key(tenant, name))
            .or_else(|| self.by_key.get(&key(index::DEFAULT_NAMESPACE, name)))
    }

    /// Number of topologies.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// True without topologies.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// A PD lookup as the gRPC layer resolved it.
#[derive(Debug, Clone)]
pub struct PdQuery<'a> {
    /// tenant_id.
    pub tenant_id: &'a str,
    /// model_id.
    pub model_id: &'a str,
    /// prefix_hash (exact key).
    pub prefix_hash: &'a [u8],
    /// prefix_token_count (a negative wire count reads as 0).
    pub prefix_token_count: u32,
    /// pd_topology_ref.
    pub topology: &'a str,
    /// Arrival (start of the tenant's lookupTimeoutMs).
    pub arrived: std::time::Instant,
    /// The caller's deadline.
    pub deadline: Option<std::time::Instant>,
}

/// The answer, in plain types.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PdAnswer {
    /// Chosen prefill replica (empty on a fail-open answer).
    pub prefill_replica_id: String,
    /// Chosen decode replica (empty on a fail-open answer).
    pub decode_replica_id: String,
    /// Transport of the topology (empty on a fail-open answer).
    pub transport_hint: String,
    /// Reason code.
    pub reason: &'static str,
}

impl PdAnswer {
    fn fail_open(reason: Reason) -> Self {
        Self {
            reason: reason.as_str(),
            ..Default::default()
        }
    }
}

/// Picks a prefill and a decode replica for `query` (see the module notes).
pub fn route(
    index: &CacheIndex,
    topologies: &PdTopologies,
    query: &PdQuery<'_>,
    now_ms: u64,
) -> PdAnswer {
    if query.tenant_id == PROBE_TENANT || query.model_id.is_empty() {
        return PdAnswer::fail_open(Reason::NoHint);
    }
    let Some(topology) = topologies.resolve(query.tenant_id, query.topology) else {
        return PdAnswer::fail_open(Reason::NoHint);
    };
    let mut matched = None;
    if !query.prefix_hash.is_empty() {
        let mut request =
            LookupRequest::new(query.tenant_id, query.model_id, &topology.hash_scheme);
        request.prefix_hash = query.prefix_hash;
        request.prefix_token_count = query.prefix_token_count;
        request.arrived = query.arrived;
        request.deadline = query.deadline;
        let outcome = index.lookup(&request);
        match outcome.reason {
            Reason::Timeout
            | Reason::UnknownTenant
            | Reason::UnknownModel
            | Reason::UnknownHashScheme => return PdAnswer::fail_open(outcome.reason),
            Reason::PrefixMatch => {
                matched = outcome
                    .top()
                    .map(|(name, _)| name.to_string())
                    .filter(|r| topology.prefill.contains(r));
            }
            _ => {}
        }
    }
    let loads = Loads::read(index, query.tenant_id, now_ms);
    let digest = index::affinity_digest(None, query.prefix_hash);
    let (prefill, reason) = match matched {
        Some(replica) => (replica, Reason::PrefixMatch),
        None => (
            loads.least_loaded(&topology.prefill, digest.as_ref()),
            Reason::AffinityHint,
        ),
    };
    PdAnswer {
        prefill_replica_id: prefill,
        decode_replica_id: loads.least_loaded(&topology.decode, digest.as_ref()),
        transport_hint: topology.transport.as_str().to_owned(),
        reason: reason.as_str(),
    }
}

/// Loads of every replica with stats (replica ids are fleet-wide).
struct Loads {
    known: HashMap<String, f64>,
    mean: f64,
}

impl Loads {
    fn read(index: &CacheIndex, tenant: &str, now_ms: u64) -> Self {
        let policies = index.policies();
        let policy = policies.for_tenant(tenant);
        let max_age_ms = u64::try_from(policy.load_stats_max_age.as_millis()).unwrap_or(u64::MAX);
        let mut known = HashMap::new();
        // The snapshot names every replica with stats, holding entries or not.
        for replica in index.snapshot().replicas {
            let (Some(stats), Some(at)) = (replica.stats, replica.stats_received_ms) else {
                continue;
            };
            if now_ms.saturating_sub(at) > max_age_ms && max_age_ms > 0 {
                continue;
            }
            let load = f64::from(stats.pressure)
                + f64::from(stats.requests_waiting)
                + policy.running_weight * f64::from(stats.requests_running);
            known.insert(replica.replica_id, load);
        }
        let mean = if known.is_empty() {
            0.0
        } else {
            known.values().sum::<f64>() / known.len() as f64
        };
        Self { known, mean }
    }

    fn load(&self, replica: &str) -> f64 {
        self.known.get(replica).copied().unwrap_or(self.mean)
    }

    /// The least-loaded of `pool`; ties by rendezvous on `digest`, else the first id.
    fn least_loaded(&self, pool: &[String], digest: Option<&[u8; 32]>) -> String {
        let min = pool
            .iter()
            .map(|r| self.load(r))
            .fold(f64::INFINITY, f64::min);
        let mut tied: Vec<&str> = pool
            .iter()
            .filter(|r| self.load(r) <= min)
            .map(String::as_str)
            .collect();
        tied.sort_unstable();
        let i = digest.map_or(0, |d| {
            index::pick_affinity(AffinityAlgorithm::Rendezvous, d, &tied)
        });
        tied.get(i).map(|r| (*r).to_owned()).unwrap_or_default()
    }
}

/// Splits a policy stream: the `PDTopology` documents are parsed here, the
/// text of the others is returned for [`index::PolicySet::from_yaml`]
/// (unchanged when there is no topology).
pub fn split_policy_stream(text: &str) -> anyhow::Result<(String, PdTopologies)> {
    let mut topologies = Vec::new();
    let mut others = Vec::new();
    for (position, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(document)
            .map_err(|e| anyhow::anyhow!("document {position}: {e}"))?;
        if value.get("kind").and_then(serde_yaml::Value::as_str) == Some(KIND) {
            topologies.push((position, value));
        } else {
            others.push(value);
        }
    }
    let topologies = PdTopologies::from_documents(topologies)?;
    if topologies.is_empty() {
        return Ok((text.to_owned(), topologies));
    }
    let mut rest = String::new();
    for value in others {
        if value.is_null() {
            continue;
        }
        rest.push_str("---\n");
        rest.push_str(&serde_yaml::to_string(&value)?);
    }
    Ok((rest, topologies))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const TOPOLOGY: &str = "apiVersion: inferencecache.io/v1alpha1\nkind: PDTopology\n\
        metadata: {name: pd, namespace: team-a}\nspec:\n  hashScheme: vllm\n  transport: NIXL\n\
        \x20 prefill: [p1, p2]\n  decode: [d1, d2]\n";

    fn now() -> u64 {
        index::Clock::now_ms(&index::SystemClock)
    }

    fn index() -> CacheIndex {
        CacheIndex::new(Arc::new(index::SystemClock), 1000)
    }

    fn query<'a>(hash: &'a [u8], topology: &'a str) -> PdQuery<'a> {
        PdQuery {
            tenant_id: "team-a",
            model_id: "llama",
            prefix_hash: hash,
            prefix_token_count: 256,
            topology,
            arrived: std::time::Instant::now(),
            deadline: None,
        }
    }

    fn report(index: &CacheIndex, replica: &str, hash: Option<&[u8]>, waiting: u32) {
        index.ingest(&index::CacheUpdate {
            replica_id: replica.into(),
            model_id: "llama".into(),
            tenant_id: "team-a".into(),
            hash_scheme: "vllm".into(),
            prefixes: hash
                .map(|h| index::PrefixReport {
                    prefix_hash: h.to_vec(),
                    token_count: 256,
                    ..Default::default()
                })
                .into_iter()
                .collect(),
            stats: Some(index::ReplicaStatsReport {
                replica_id: replica.into(),
                requests_waiting: waiting,
                ..Default::default()
            }),
            ..Default::default()
        });
    }

    #[test]
    fn topologies_are_split_from_the_policy_stream_and_validated() {
        let policy = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {name: p, namespace: team-a}\nspec: {minimumMatchedTokens: 32}\n";
        let (rest, topologies) =
            split_policy_stream(&format!("{policy}---\n{TOPOLOGY}")).expect("valid");
        assert_eq!(topologies.len(), 1);
        let pd = topologies.resolve("team-a", "pd").expect("resolved");
        assert_eq!(pd.transport, Transport::Nixl);
        assert_eq!(pd.prefill, ["p1", "p2"]);
        assert!(topologies.resolve("team-b", "pd").is_none());
        let policies = index::PolicySet::from_yaml(&rest).expect("the rest parses");
        assert_eq!(policies.for_tenant("team-a").minimum_matched_tokens, 32);
        // Without a topology the text is passed on untouched.
        assert_eq!(split_policy_stream(policy).expect("valid").0, policy);
        let bad = TOPOLOGY.replace("NIXL", "Carrier pigeon");
        assert!(split_policy_stream(&bad).is_err());
        let empty = TOPOLOGY.replace("[d1, d2]", "[]");
        let error = split_policy_stream(&empty).expect_err("empty pool");
        assert!(error.to_string().contains("team-a/pd"), "{error}");
    }

    #[test]
    fn prefill_follows_the_prefix_and_decode_the_load() {
        let index = index();
        let (_, topologies) = split_policy_stream(TOPOLOGY).expect("valid");
        let hash = 7u64.to_be_bytes();
        report(&index, "p2", Some(&hash), 5);
        report(&index, "p1", None, 0);
        report(&index, "d1", None, 3);
        report(&index, "d2", None, 1);
        let answer = route(&index, &topologies, &query(&hash, "pd"), now());
        assert_eq!(
            answer,
            PdAnswer {
                prefill_replica_id: "p2".into(),
                decode_replica_id: "d2".into(),
                transport_hint: "NIXL".into(),
                reason: "PREFIX_MATCH",
            }
        );
        // A prompt nobody holds: the least-loaded prefill replica.
        let other = 8u64.to_be_bytes();
        let answer = route(&index, &topologies, &query(&other, "pd"), now());
        assert_eq!(answer.reason, "AFFINITY_HINT");
        assert_eq!(answer.prefill_replica_id, "p1");
        assert_eq!(answer.decode_replica_id, "d2");
    }

    #[test]
    fn unknown_topologies_and_the_probe_tenant_fail_open() {
        let index = index();
        let (_, topologies) = split_policy_stream(TOPOLOGY).expect("valid");
        let hash = 7u64.to_be_bytes();
        let answer = route(&index, &topologies, &query(&hash, "nope"), now());
        assert_eq!(answer, PdAnswer::fail_open(Reason::NoHint));
        let mut probe = query(&hash, "pd");
        probe.tenant_id = PROBE_TENANT;
        assert_eq!(
            route(&index, &topologies, &probe, now()),
            PdAnswer::fail_open(Reason::NoHint)
        );
        // No stats anywhere: a stable pick per prompt, spread over the pool.
        let picks: std::collections::HashSet<String> = (0u64..32)
            .map(|i| {
                let h = i.to_be_bytes();
                let a = route(&index, &topologies, &query(&h, "pd"), now());
                assert_eq!(a, route(&index, &topologies, &query(&h, "pd"), now()));
                a.decode_replica_id
            })
            .collect();
        assert_eq!(picks.len(), 2, "{picks:?}");
    }
}
