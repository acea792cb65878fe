//! The routing policies a replay compares, and the baselines' routers.
//!
//! Every router answers "which replica" for one request from what a gateway
//! could know at that instant (see [`Router`]). The baselines are stateless or
//! nearly so; the `inference-cache` rows live in the `routed` module. Each
//! router is single-threaded and O(1) per request, except least-loaded
//! (O(replicas)).

use std::fmt;
use std::str::FromStr;

use inference_cache_index::Ranker;

use crate::error::ReplayError;
use crate::replica::{Replica, ServingModel};
use crate::rng::{Rng, mix64};
use crate::trace::Request;

/// One row of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// The real index and ranker with the policy as configured (`--policy-file`
    /// or the built-in default), behind the gateway's routing rule.
    InferenceCache,
    /// As [`Policy::InferenceCache`] with `spec.ranker: Contract`.
    InferenceCacheContract,
    /// As [`Policy::InferenceCache`] with `spec.ranker: CostAware`.
    InferenceCacheCostAware,
    /// Replica `i mod N` for the i-th request.
    RoundRobin,
    /// A uniformly random replica (seeded by `--seed`).
    Random,
    /// The replica with the fewest queued prefill tokens; ties rotate.
    LeastLoaded,
    /// A stateless hash of the first two block hashes, modulo N.
    SessionHash,
    /// One shared LRU of N × capacity blocks (the hit rate no placement can
    /// beat by much); requests are placed least-loaded for the load columns.
    PooledOracle,
}

impl Policy {
    /// Every policy, in table order.
    pub const ALL: [Self; 8] = [
        Self::InferenceCache,
        Self::InferenceCacheContract,
        Self::InferenceCacheCostAware,
        Self::RoundRobin,
        Self::Random,
        Self::LeastLoaded,
        Self::SessionHash,
        Self::PooledOracle,
    ];

    /// Name on the command line and in JSON.
    pub fn id(self) -> &'static str {
        match self {
            Self::InferenceCache => "inference-cache",
            Self::InferenceCacheContract => "inference-cache-contract",
            Self::InferenceCacheCostAware => "inference-cache-cost-aware",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::LeastLoaded => "least-loaded",
            Self::SessionHash => "session-hash",
            Self::PooledOracle => "pooled-oracle",
        }
    }

    /// Row label in the table and the plot.
    pub fn label(self) -> &'static str {
        match self {
            Self::InferenceCacheContract => "inference-cache (contract)",
            Self::InferenceCacheCostAware => "inference-cache (cost-aware)",
            other => other.id(),
        }
    }

    /// Whether the row routes through the inference-cache index.
    pub fn uses_index(self) -> bool {
        self.ranker_override().is_some() || self == Self::InferenceCache
    }

    /// The ranker forced on the tenant's policy, for the variant rows.
    pub fn ranker_override(self) -> Option<Ranker> {
        match self {
            Self::InferenceCacheContract => Some(Ranker::Contract),
            Self::InferenceCacheCostAware => Some(Ranker::CostAware),
            _ => None,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for Policy {
    type Err = String;

    /// Accepts the id, the label, or `contract` / `cost-aware` for the variants.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wanted = text.trim().to_ascii_lowercase();
        let alias = match wanted.as_str() {
            "contract" => Some(Self::InferenceCacheContract),
            "cost-aware" | "costaware" => Some(Self::InferenceCacheCostAware),
            "oracle" => Some(Self::PooledOracle),
            _ => None,
        };
        alias
            .or_else(|| {
                Self::ALL
                    .into_iter()
                    .find(|p| p.id() == wanted || p.label() == wanted)
            })
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|p| p.id()).collect();
                format!("unknown policy {text:?} (known: {})", known.join(", "))
            })
    }
}

/// What a router sees when it picks a replica.
#[derive(Debug, Clone, Copy)]
pub struct RouteContext<'a> {
    /// Simulated time, milliseconds.
    pub now_ms: f64,
    /// Every replica, advanced to `now_ms`.
    pub replicas: &'a [Replica],
    /// The serving model (for load estimates).
    pub model: &'a ServingModel,
    /// Tokens per block.
    pub block_size: u32,
}

/// A routing policy driven by the simulator, with feedback hooks for the
/// policies that learn from the replicas as a subscriber would report them.
pub trait Router {
    /// Called once before the first request, with every replica idle.
    fn start(&mut self, _replicas: &[Replica]) -> Result<(), ReplayError> {
        Ok(())
    }

    /// Called every stats interval with every replica advanced to `now_ms`.
    fn report_stats(&mut self, _now_ms: f64, _replicas: &[Replica]) -> Result<(), ReplayError> {
        Ok(())
    }

    /// The replica (index into `context.replicas`) that serves `request`.
    fn route(
        &mut self,
        context: &RouteContext<'_>,
        request: &Request,
    ) -> Result<usize, ReplayError>;

    /// Called after `replica` admitted `request`: `stored` are its newly
    /// stored block hashes (prompt order), `evicted` the blocks it evicted.
    fn admitted(
        &mut self,
        _context: &RouteContext<'_>,
        _replica: usize,
        _request: &Request,
        _stored: &[u64],
        _evicted: &[u64],
    ) -> Result<(), ReplayError> {
        Ok(())
    }

    /// Reason codes counted so far (code, count), for the index-backed rows.
    fn reasons(&self) -> Option<Vec<(String, u64)>> {
        None
    }

    /// The reuse (tokens) the router predicted for the request it routed
    /// last, for the index-backed rows; `None` when it makes no prediction.
    fn predicted_tokens(&self) -> Option<u64> {
        None
    }

    /// Called after the last request.
    fn finish(&mut self) -> Result<(), ReplayError> {
        Ok(())
    }
}

/// `i mod N`.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// The next replica of `n`.
    pub fn pick(&mut self, n: usize) -> usize {
        let pick = self.next % n;
        self.next = self.next.wrapping_add(1);
        pick
    }
}

impl Router for RoundRobin {
    fn route(&mut self, context: &RouteContext<'_>, _: &Request) -> Result<usize, ReplayError> {
        Ok(self.pick(context.replicas.len()))
    }
}

/// Uniformly random, seeded.
#[derive(Debug)]
pub struct RandomRouter {
    rng: Rng,
}

impl RandomRouter {
    /// A router drawing from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed ^ 0x7261_6e64),
        }
    }
}

impl Router for RandomRouter {
    fn route(&mut self, context: &RouteContext<'_>, _: &Request) -> Result<usize, ReplayError> {
        Ok(self.rng.below(context.replicas.len() as u64) as usize)
    }
}

/// Fewest queued prefill tokens; among ties, the first at or after a cursor
/// that advances every request (so an idle fleet is filled round-robin).
#[derive(Debug, Default)]
pub struct LeastLoaded {
    cursor: usize,
}

impl Router for LeastLoaded {
    fn route(&mut self, context: &RouteContext<'_>, _: &Request) -> Result<usize, ReplayError> {
        let n = context.replicas.len();
        let mut best = (f64::INFINITY, 0);
        for step in 0..n {
            let i = (self.cursor + step) % n;
            let queued = context.replicas[i].queued_prefill_tokens(context.now_ms, context.model);
            if queued < best.0 {
                best = (queued, i);
            }
        }
        self.cursor = (self.cursor + 1) % n;
        Ok(best.1)
    }
}

/// `hash(first two block hashes) mod N` — what a stateless gateway can do.
#[derive(Debug, Default)]
pub struct SessionHash;

impl SessionHash {
    /// The replica of `blocks` among `n`.
    pub fn pick(blocks: &[u64], n: usize) -> usize {
        let head = blocks
            .iter()
            .take(2)
            .fold(0x5e55_1017u64, |acc, &h| mix64(acc ^ h));
        (head % n as u64) as usize
    }
}

impl Router for SessionHash {
    fn route(
        &mut self,
        context: &RouteContext<'_>,
        request: &Request,
    ) -> Result<usize, ReplayError> {
        Ok(Self::pick(&request.blocks, context.replicas.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_id_label_and_alias() {
        for p in Policy::ALL {
            assert_eq!(p.id().parse::<Policy>(), Ok(p));
            assert_eq!(p.label().parse::<Policy>(), Ok(p));
        }
        assert_eq!(
            "Cost-Aware".parse::<Policy>(),
            Ok(Policy::InferenceCacheCostAware)
        );
        assert!("longest-match".parse::<Policy>().is_err());
        assert!(Policy::InferenceCacheCostAware.uses_index());
        assert!(!Policy::SessionHash.uses_index());
    }

    #[test]
    fn session_hash_depends_only_on_the_first_two_blocks() {
        let n = 8;
        assert_eq!(
            SessionHash::pick(&[1, 2, 3], n),
            SessionHash::pick(&[1, 2, 9, 9], n)
        );
        let spread: std::collections::HashSet<usize> = (0..200u64)
            .map(|i| SessionHash::pick(&[i, i + 1000], n))
            .collect();
        assert_eq!(spread.len(), n);
    }
}
