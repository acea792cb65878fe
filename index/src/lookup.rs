//! LookupRoute: matching, ranking, fallbacks and reason-code precedence.
//!
//! Order of decisions (first hit wins):
//! 1. probe tenant → NO_HINT; deadline already passed → TIMEOUT;
//!    `requireChain` without a wire chain of parallel arrays
//!    ([`ChainInput::from_wire`]) → POLICY_REQUIRES_CHAIN
//!    (these three echo no adapter: the index is not consulted);
//! 2. empty hash_scheme or malformed chain (arrays of different lengths; with
//!    chain matching on, also a negative count or an empty hash, as the
//!    server found them) → NO_HINT; no fingerprint at all → NO_HINT;
//! 3. match: chain (longest leading run per replica; drop-out is final;
//!    weakest-link freshness; coldest tier) or exact `prefix_hash`;
//! 4. hits → matched-tokens floor → score → routing floor → minimumPrefixTokens gate;
//!    an exact-path miss → TENANT_HOT (non-chain only) → gate; otherwise the
//!    diagnostic classifier (UNKNOWN_TENANT / _MODEL / _HASH_SCHEME, cold-start
//!    carve-out);
//! 5. anything that downgraded → AFFINITY_HINT when enabled, else NO_HINT;
//! 6. a deadline passed while working → TIMEOUT (and no LFU credit).
//!
//! Cost: the match step (the `matching` module) takes no lock and
//! allocates nothing. Names resolve through a per-thread memo of the last
//! resolution (four string compares when the next lookup asks the same).
//! The only allocation is the result vector (and a small one on the AFFINITY_HINT /
//! TENANT_HOT paths, the memo's copy of the names when they change, and
//! this thread's copy of the replicas' names when those change).

use std::cell::RefCell;
use std::sync::{Arc, Weak};
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::catalog::{Catalog, NameId, PartitionId, ReplicaId, ReplicaList, Scope, ScopeMemo};
use crate::clock::ms_to_secs;
use crate::cost::{MemberCost, MemberLoads, bounded_affinity, rank_by_cost};
use crate::fleet::{Fleet, ReplicaRecord};
use crate::index::CacheIndex;
use crate::matching::{Candidate, Candidates, INLINE, Leaving, Matched, walk_chain};
use crate::messages::{
    BlockChain, Chain, ChainInput, Decision, HolderMatch, LookupOutcome, LookupRequest,
    PROBE_TENANT, Reason, ReplicaScore, Tier,
};
use crate::policy::{AffinityAlgorithm, CachePolicy, Eviction, Ranker};
use smallvec::SmallVec;

use crate::store::{Key, Reader};

/// Live members of a lookup's serving set, sorted by replica id; the cost
/// ranker fills in their loads, matches and costs in place.
pub(crate) type Serving<'f> = SmallVec<[MemberCost<'f>; 32]>;

/// A positive hint before the final checks, or a downgrade.
pub(crate) enum Ranked {
    Hint(Reason, Vec<ReplicaScore>),
    /// No positive hint; the fallback may seed on the chain's block
    /// `seed_block` (the first block not every live member holds).
    Downgraded {
        seed_block: usize,
        why: Decision,
    },
    Diagnostic(Reason),
}

impl Ranked {
    pub(crate) const DOWNGRADED: Self = Self::Downgraded {
        seed_block: 0,
        why: Decision::BelowFloor,
    };
}

pub(crate) struct Ctx<'a> {
    pub policy: &'a CachePolicy,
    pub now_ms: u64,
    slo_ttft_ms: i32,
}

impl Ctx<'_> {
    pub(crate) fn freshness(&self, seen_secs: u32) -> f64 {
        self.freshness_of().of(seen_secs)
    }

    /// Freshness at this lookup's time, for scoring many entries.
    pub(crate) fn freshness_of(&self) -> Freshness {
        Freshness {
            now_secs: ms_to_secs(self.now_ms),
            ttl_secs: self.policy.eviction_ttl.as_secs_f64(),
        }
    }

    fn pressure_factor(&self, record: Option<&ReplicaRecord>) -> f64 {
        let Some(stats) = record.and_then(|r| r.stats.get()) else {
            return 1.0;
        };
        let age_ms = self.now_ms.saturating_sub(stats.at_ms);
        if age_ms as f64 > self.policy.eviction_ttl.as_secs_f64() * 1000.0 {
            return 1.0;
        }
        (1.0 - self.policy.pressure_weight * f64::from(stats.pressure)).max(0.0)
    }

    fn slo_bias(&self, freshness: f64) -> f64 {
        let tight = self.slo_ttft_ms > 0
            && (self.slo_ttft_ms as i64) < i64::from(self.policy.slo_tight_ttft_ms);
        if tight {
            1.0 + freshness * self.policy.slo_tight_bias
        } else {
            1.0
        }
    }
}

/// `1 − age / evictionTTL`, at least 0, of an entry last seen at
/// `seen_secs`, at one lookup's time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Freshness {
    now_secs: u32,
    ttl_secs: f64,
}

impl Freshness {
    pub(crate) fn of(self, seen_secs: u32) -> f64 {
        let age = f64::from(self.now_secs.saturating_sub(seen_secs));
        (1.0 - age / self.ttl_secs).max(0.0)
    }
}

/// A request's tenant, model and scheme as interned ids, resolved once.
#[derive(Debug, Clone, Copy)]
struct Names {
    tenant: Option<NameId>,
    model: Option<NameId>,
    scheme: Option<NameId>,
}

fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// The checks before the index is consulted: deadline, the policy's chain
/// requirement, the scheme, the chain's shape; `Err` is the answer.
fn admit<'r>(req: &LookupRequest<'r>, policy: &CachePolicy) -> Result<Admitted<'r>, LookupOutcome> {
    let budget = policy.lookup_timeout_ms.map(|t| req.arrived + t);
    let deadline = match (budget, req.deadline) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if expired(deadline) {
        return Err(LookupOutcome::empty(Reason::Timeout, ""));
    }
    if policy.strategy.require_chain && !req.chain.from_wire() {
        return Err(LookupOutcome::empty(Reason::PolicyRequiresChain, ""));
    }
    let adapter = req.adapter_id;
    if req.hash_scheme.is_empty() || matches!(req.chain, ChainInput::Mismatched) {
        return Err(LookupOutcome::empty(Reason::NoHint, adapter));
    }
    let chain = if policy.strategy.enable_chain_matching {
        // The chain matching would read is not a valid one.
        if matches!(req.chain, ChainInput::Invalid) {
            return Err(LookupOutcome::empty(Reason::NoHint, adapter));
        }
        req.chain.chain().filter(|c| !c.is_empty())
    } else {
        None
    };
    let request_tokens = match chain {
        Some(c) => c.token_total(0, c.len()),
        None if req.prefix_hash.is_empty() => {
            return Err(LookupOutcome::empty(Reason::NoHint, adapter));
        }
        None => i64::from(req.prefix_token_count),
    };
    Ok(Admitted {
        deadline,
        chain,
        request_tokens,
    })
}

/// The request's names, scope and partition, each name resolved once.
fn resolve<'c>(catalog: &'c Catalog, req: &LookupRequest<'_>) -> Resolved<'c> {
    let ids = LAST_RESOLVED.with_borrow_mut(|memo| {
        if let Some(ids) = memo.get(catalog.generation(), scope_names(req)) {
            return ids;
        }
        let ids = resolve_ids(catalog, req);
        memo.set(catalog.generation(), scope_names(req), ids);
        ids
    });
    Resolved {
        names: ids.names,
        scope: ids.scope.and_then(|s| catalog.scopes.get(s)),
        part: ids.part,
    }
}

fn resolve_ids(catalog: &Catalog, req: &LookupRequest<'_>) -> ResolvedIds {
    let names = Names {
        tenant: catalog.name(req.tenant_id),
        model: catalog.name(req.model_id),
        scheme: catalog.name(req.hash_scheme),
    };
    let (scope, part) = match (names.tenant, names.model, names.scheme) {
        (Some(t), Some(m), Some(s)) => (
            catalog.scope_id_of([t, m, s]),
            catalog
                .name(req.adapter_id)
                .and_then(|a| catalog.partition_of([t, m, s, a])),
        ),
        _ => (None, None),
    };
    ResolvedIds { names, scope, part }
}

/// A request's scope names, as [`ScopeMemo`] keys them.
fn scope_names<'r>(req: &LookupRequest<'r>) -> [&'r str; 4] {
    [req.tenant_id, req.model_id, req.hash_scheme, req.adapter_id]
}

/// What a request's names resolve to, as ids.
#[derive(Debug, Clone, Copy)]
struct ResolvedIds {
    names: Names,
    scope: Option<u32>,
    part: Option<PartitionId>,
}

thread_local! {
    /// The last resolution on this thread (see [`ScopeMemo`]): a gateway's
    /// lookups come in a few `(tenant, model, scheme, adapter)`
    /// combinations (about 500 of a lookup's instructions when it hits).
    static LAST_RESOLVED: std::cell::RefCell<ScopeMemo<ResolvedIds>> =
        const { std::cell::RefCell::new(ScopeMemo::empty()) };
}

thread_local! {
    /// The catalog's list of names this thread last copied, and its copy
    /// (see [`answer_names`]).
    static ANSWER_NAMES: RefCell<Option<(Weak<ReplicaList>, Arc<ReplicaList>)>> =
        const { RefCell::new(None) };
}

/// The names an answer carries (its ids resolve through them), as a
/// reference to this thread's own copy of the catalog's list. Were it a
/// reference to the catalog's list itself, every answer on every core
/// would add to and take from one count: a cache line the cores pass
/// between them, which with two threads looking up at once cost 50–110 ns
/// of a lookup's p50. The copy is shallow (it shares the list's chunks),
/// and it is made again once the catalog's list has changed (the catalog
/// changes its list only through `Arc::make_mut`, which moves it).
fn answer_names(catalog: &Catalog) -> Arc<ReplicaList> {
    let list = catalog.replica_list();
    ANSWER_NAMES.with_borrow_mut(|slot| match slot {
        Some((copied, own)) if std::ptr::eq(copied.as_ptr(), Arc::as_ptr(list)) => Arc::clone(own),
        _ => {
            let own = Arc::new(ReplicaList::clone(list));
            *slot = Some((Arc::downgrade(list), Arc::clone(&own)));
            own
        }
    })
}

/// Live members of the request's `(tenant, model)` that serve its hash
/// scheme, sorted by replica id (see the `fleet` module for liveness).
fn serving_set<'f>(
    ctx: &Ctx<'_>,
    catalog: &Catalog,
    fleet: &'f Fleet,
    at: &Resolved<'_>,
    serving: &mut Serving<'f>,
) {
    let (Some(tenant), Some(model)) = (at.names.tenant, at.names.model) else {
        return;
    };
    let (scheme, scope) = (at.names.scheme, at.scope);
    let now_ms = ctx.now_ms;
    let timeout_ms = u64::try_from(ctx.policy.replica_timeout.as_millis()).unwrap_or(u64::MAX);
    // Members are kept sorted by replica id, and so is the set. A plain
    // loop: an iterator adapter here was a call per member.
    let members = fleet.members(tenant, model);
    serving.reserve(members.len());
    for member in members {
        // An id freed by a sweep while a membership was being written is
        // never named (it has no order key).
        let order = catalog.replica_order(member.replica);
        if order == 0 || !member.serves(scheme) {
            continue;
        }
        // The record is read once: for liveness here, for the member's load
        // and the hinted prefill later.
        let record = fleet.records.get(member.replica);
        if Fleet::record_live(record, now_ms, timeout_ms, || {
            scope.is_some_and(|s| s.holds(member.replica))
        }) {
            serving.push(MemberCost {
                replica: member.replica,
                record,
                order,
                ..MemberCost::default()
            });
        }
    }
}

/// Why the answer is what it is, and the ranking after the
/// minimumPrefixTokens gate (which downgrades a hint for a short request).
fn decide(
    scene: &Scene<'_, '_>,
    ranked: Ranked,
    cands: &[Candidate],
    missed: bool,
) -> (Decision, Ranked) {
    let decision = match &ranked {
        Ranked::Hint(Reason::TenantHot, _) => Decision::TenantHot,
        Ranked::Hint(_, scores) => {
            let longest = cands.iter().map(|c| c.matched).max();
            match (scores.first(), longest) {
                (Some(top), Some(longest)) if i64::from(top.matched_tokens) < longest => {
                    Decision::Load
                }
                _ => Decision::MatchDepth,
            }
        }
        Ranked::Diagnostic(_) => Decision::Diagnostic,
        Ranked::Downgraded { .. } if missed => Decision::NoMatch,
        Ranked::Downgraded { why, .. } => *why,
    };
    let minimum = i64::from(scene.ctx.policy.minimum_prefix_tokens);
    match ranked {
        Ranked::Hint(_, _) if scene.admitted.request_tokens < minimum => {
            (Decision::PrefixGate, Ranked::DOWNGRADED)
        }
        other => (decision, other),
    }
}

/// A request that passed the checks before the index is consulted.
struct Admitted<'r> {
    /// The earlier of the policy's budget and the caller's deadline.
    deadline: Option<Instant>,
    /// The chain to match, when chain matching is on and the request has one.
    chain: Option<Chain<'r>>,
    /// The request's tokens: the chain's, else `prefix_token_count`.
    request_tokens: i64,
}

/// Where a request lands in the catalog: its names, its scope and the
/// partition of its adapter (each `None` when never seen).
struct Resolved<'c> {
    names: Names,
    scope: Option<&'c std::sync::Arc<Scope>>,
    part: Option<PartitionId>,
}

/// What the steps of one lookup after admission share.
struct Scene<'a, 'r> {
    req: &'a LookupRequest<'r>,
    ctx: Ctx<'a>,
    catalog: &'a Catalog,
    fleet: &'a Fleet,
    admitted: Admitted<'r>,
    at: Resolved<'a>,
}

impl CacheIndex {
    /// Answers one LookupRoute.
    pub fn lookup(&self, req: &LookupRequest<'_>) -> LookupOutcome {
        if req.tenant_id == PROBE_TENANT {
            return LookupOutcome::empty(Reason::NoHint, "");
        }
        self.with_policies(|policies| self.lookup_under(req, policies.for_tenant(req.tenant_id)))
    }

    /// [`lookup`](Self::lookup) under the request tenant's policy.
    fn lookup_under(&self, req: &LookupRequest<'_>, policy: &CachePolicy) -> LookupOutcome {
        let admitted = match admit(req, policy) {
            Ok(admitted) => admitted,
            Err(outcome) => return outcome,
        };
        let ctx = Ctx {
            policy,
            now_ms: self.now_ms(),
            slo_ttft_ms: req.slo_ttft_ms,
        };
        let catalog = self.catalog.read();
        let fleet = self.fleet.read();
        let at = resolve(&catalog, req);
        // Start the first block's key-table miss, and through the heads
        // table those of the first two runs the walk is likely to read;
        // the serving set is worked out while they are under way.
        let reader = self.store.reader();
        let first = match (at.part, admitted.chain) {
            (Some(p), Some(c)) => Some((p, c, Key::new(p, c.hashes.hash(0)))),
            _ => None,
        };
        if let Some((p, c, key)) = &first {
            reader.touch(key);
            reader.touch_head(*p, &c.hashes, key);
        }
        let mut serving = Serving::new();
        serving_set(&ctx, &catalog, &fleet, &at, &mut serving);
        let scene = Scene {
            req,
            ctx,
            catalog: &catalog,
            fleet: &fleet,
            admitted,
            at,
        };
        // Then start the first block's run: its directory slot (the table
        // slot has likely arrived) is loaded while the members' loads are
        // read (the cost-aware ranker reads every member's load once, for
        // the ranking and for the fallback alike); reading the slot's hint
        // before them made the lookup wait for both misses at 10M entries.
        // The hint starts the run's body and data, and the key-table misses
        // of the blocks where the request likely leaves the run (the walk
        // starts their runs' directory slots).
        // Without loads to read there is nothing to overlap: the hint is
        // read at once.
        let read_loads = policy.ranker == Ranker::CostAware && scene.at.part.is_some();
        if read_loads && let Some((_, _, key)) = &first {
            reader.touch_slot(key);
        }
        let mut loads = MemberLoads::new();
        if read_loads {
            loads.get(self, &scene.ctx, &mut serving);
        }
        let leaving = first.as_ref().map_or(Leaving::NONE, |(p, c, key)| {
            Leaving::of(&reader, *p, &c.hashes, 0, reader.touch_run(key))
        });
        let mut cands = Candidates::new();
        let matched = self.find_holders(&scene, &serving, &reader, leaving, &mut cands);
        let missed = matches!(matched, Matched::Miss);
        let ranked = self.rank(&scene, &mut serving, matched, &mut cands, &mut loads);
        let (decision, ranked) = decide(&scene, ranked, cands.as_slice(), missed);
        let outcome = self.answer(
            &scene,
            &mut serving,
            (ranked, decision),
            cands.as_slice(),
            &mut loads,
        );
        if expired(scene.admitted.deadline) {
            return LookupOutcome::empty(Reason::Timeout, "");
        }
        // The cost-aware ranker counts the hinted prefill as load.
        if policy.ranker == Ranker::CostAware {
            self.count_hinted(
                &fleet,
                &scene.ctx,
                &outcome,
                (cands.as_slice(), &serving),
                scene.admitted.request_tokens,
            );
        }
        let (part, chain) = (scene.at.part, scene.admitted.chain);
        drop(serving);
        drop(fleet);
        drop(catalog);
        // An LFU policy credits the blocks of a PREFIX_MATCH (by id: a
        // partition or replica freed meanwhile is a miss).
        if outcome.reason == Reason::PrefixMatch
            && policy.eviction == Eviction::Lfu
            && let Some(p) = part
        {
            self.credit(p, chain, req.prefix_hash, &outcome.scores, cands.as_slice());
        }
        outcome
    }

    /// The store's match step alone, the narrow interface between the store
    /// and the ranking: every holder of the request chain's leading blocks
    /// in its partition, with the length, tokens, oldest last-seen and
    /// coldest tier of its leading run, sorted by replica id. Nothing else
    /// of a lookup happens: no policy, liveness, ranking, names or counters.
    /// Empty without a chain or for a partition never seen.
    pub fn match_chain(&self, req: &LookupRequest<'_>) -> Vec<HolderMatch> {
        let Some(chain) = req.chain.chain().filter(|c| !c.is_empty()) else {
            return Vec::new();
        };
        let Some(part) = resolve(&self.catalog.read(), req).part else {
            return Vec::new();
        };
        let mut cands = Candidates::new();
        let reader = self.store.reader();
        let first = Key::new(part, chain.hashes.hash(0));
        reader.touch(&first);
        reader.touch_head(part, &chain.hashes, &first);
        // The misses a lookup starts before its walk, so that this times the
        // lookup's own walk.
        let leaving = Leaving::of(&reader, part, &chain.hashes, 0, reader.touch_run(&first));
        walk_chain(&reader, part, chain, leaving, &mut cands, |_| {});
        cands
            .as_slice()
            .iter()
            .map(|c| HolderMatch {
                replica: c.replica,
                blocks: c.blocks,
                tokens: c.matched,
                oldest_seen: c.oldest_seen,
                tier: Tier::from_u8(c.tier),
            })
            .collect()
    }

    /// The name behind a replica id of this index (see
    /// [`match_chain`](Self::match_chain)); `None` once it is freed.
    pub fn replica_name(&self, replica: u32) -> Option<std::sync::Arc<str>> {
        let catalog = self.catalog.read();
        catalog
            .replica_alive(replica)
            .then(|| catalog.replica_str(replica).clone())
    }

    /// Matching: every live holder of the chain's leading blocks (or of the
    /// exact key) becomes a candidate.
    fn find_holders<'k>(
        &self,
        scene: &Scene<'_, '_>,
        serving: &[MemberCost<'_>],
        reader: &Reader<'_>,
        leaving: Leaving<'k>,
        cands: &mut Candidates,
    ) -> Matched {
        let Scene { req, admitted, .. } = scene;
        let chain = admitted.chain;
        // The cost-aware ranker counts where the deepest match ends: the
        // walk starts that counter's miss wherever the request's match may
        // end, at each run it enters (where that run ends) and wherever its
        // match with the runs it passed ends so far (the last is nearly
        // always the deepest holder's end), so it is under way while the
        // walk goes on.
        let reuse = &scene.fleet.reuse;
        let cost_aware = scene.ctx.policy.ranker == Ranker::CostAware;
        let mut matched = match (scene.at.part, chain) {
            (Some(p), Some(c)) => walk_chain(reader, p, c, leaving, cands, |end| {
                if cost_aware {
                    reuse.prefetch(c.hashes.get(end - 1));
                }
            }),
            (Some(p), None) => self.match_exact(p, req.prefix_hash, req.prefix_token_count, cands),
            (None, _) => Matched::Miss,
        };
        // A replica that left or went silent is never named, and its
        // entries stop counting.
        cands.retain_live(serving);
        if cands.as_slice().is_empty() {
            matched = Matched::Miss;
        }
        matched
    }

    /// Ranking: the policy's ranker over the candidates, or on a miss
    /// TENANT_HOT, a diagnostic code or a downgrade.
    fn rank(
        &self,
        scene: &Scene<'_, '_>,
        serving: &mut [MemberCost<'_>],
        matched: Matched,
        cands: &mut Candidates,
        loads: &mut MemberLoads,
    ) -> Ranked {
        let Scene {
            ctx,
            catalog,
            fleet,
            ..
        } = scene;
        let request_tokens = scene.admitted.request_tokens;
        let chain = scene.admitted.chain;
        match (matched, ctx.policy.ranker) {
            (Matched::Hits, Ranker::Contract) => {
                self.rank_prefix_match(ctx, catalog, fleet, serving.len(), cands, request_tokens)
            }
            (Matched::Hits, Ranker::CostAware) => {
                let members = loads.get(self, ctx, serving);
                rank_by_cost(
                    ctx,
                    fleet,
                    members,
                    cands.as_slice(),
                    chain,
                    request_tokens,
                    self.mean_request_tokens(),
                )
            }
            (Matched::Miss, _) => {
                let hot = if chain.is_none() {
                    self.tenant_hot(ctx, catalog, fleet, scene.at.scope, serving)
                } else {
                    Vec::new()
                };
                if hot.is_empty() {
                    match self.classify(catalog, scene.req) {
                        Some(code) => Ranked::Diagnostic(code),
                        None => Ranked::DOWNGRADED,
                    }
                } else {
                    Ranked::Hint(Reason::TenantHot, hot)
                }
            }
        }
    }

    /// The answer: a positive hint as ranked, a diagnostic code, or for a
    /// downgrade the affinity fallback (AFFINITY_HINT) or NO_HINT.
    fn answer(
        &self,
        scene: &Scene<'_, '_>,
        serving: &mut [MemberCost<'_>],
        (ranked, decision): (Ranked, Decision),
        cands: &[Candidate],
        loads: &mut MemberLoads,
    ) -> LookupOutcome {
        let Scene {
            req, ctx, catalog, ..
        } = scene;
        let policy = ctx.policy;
        let adapter = req.adapter_id;
        let chain = scene.admitted.chain;
        match ranked {
            Ranked::Hint(reason, scores) => {
                LookupOutcome::ranked(reason, scores, adapter, decision, answer_names(catalog))
            }
            Ranked::Diagnostic(code) => LookupOutcome::empty(code, adapter),
            Ranked::Downgraded { seed_block, .. } => {
                let pick = match policy.ranker {
                    Ranker::Contract => {
                        self.affinity(policy, catalog, serving, chain, req.prefix_hash)
                    }
                    Ranker::CostAware => {
                        let members = loads.get(self, ctx, serving);
                        bounded_affinity(
                            policy,
                            catalog,
                            members,
                            cands,
                            chain,
                            seed_block,
                            req.prefix_hash,
                            scene.admitted.request_tokens,
                            self.mean_request_tokens(),
                        )
                    }
                };
                match pick {
                    Some(score) => LookupOutcome::ranked(
                        Reason::AffinityHint,
                        vec![score],
                        adapter,
                        decision,
                        answer_names(catalog),
                    ),
                    None => {
                        let mut outcome = LookupOutcome::empty(Reason::NoHint, adapter);
                        outcome.decision = decision;
                        outcome
                    }
                }
            }
        }
    }

    /// Counts the prefill a cost-aware hint sends to its replica as load
    /// there until the replica's next stats report.
    fn count_hinted(
        &self,
        fleet: &Fleet,
        ctx: &Ctx<'_>,
        outcome: &LookupOutcome,
        (cands, serving): (&[Candidate], &[MemberCost<'_>]),
        request_tokens: i64,
    ) {
        let now_ms = ctx.now_ms;
        let half_life_ms =
            u64::try_from(ctx.policy.balance_half_life.as_millis()).unwrap_or(u64::MAX);
        let Some(top) = outcome.scores.first() else {
            return;
        };
        let replica = top.replica;
        let matched = cands
            .iter()
            .find(|c| c.replica == replica)
            .map_or(0, |c| c.matched);
        let uncached = (request_tokens - matched).max(0) as u64;
        // A member's record was read with the serving set (the fleet's lock
        // is still held, so it is the same record).
        let record = match serving.binary_search_by_key(&replica, |l| l.replica) {
            Ok(i) => serving[i].record,
            Err(_) => fleet.records.get(replica),
        };
        if let Some(record) = record {
            record.add_pending(uncached);
            record.add_assigned(now_ms, half_life_ms);
        }
        self.observe_request_tokens(uncached as f64);
    }

    fn rank_prefix_match(
        &self,
        ctx: &Ctx<'_>,
        catalog: &Catalog,
        fleet: &Fleet,
        serving: usize,
        cands: &mut Candidates,
        request_tokens: i64,
    ) -> Ranked {
        let all = cands.as_slice();
        let scope_size = u32::try_from(serving.max(all.len())).unwrap_or(u32::MAX);
        let floor = i64::from(ctx.policy.minimum_matched_tokens);
        let records = &fleet.records;
        let mut scores = Vec::with_capacity(all.len());
        // Matched depths in order, so "how many matched at least as much" is
        // a binary search rather than a pass per candidate.
        let mut depths: SmallVec<[i64; INLINE]> = all.iter().map(|c| c.matched).collect();
        depths.sort_unstable();
        for c in all.iter().filter(|c| c.matched >= floor && c.matched > 0) {
            let power = if scope_size <= 1 {
                1.0
            } else {
                let at_least = depths.len() - depths.partition_point(|&d| d < c.matched);
                1.0 - at_least as f64 / f64::from(scope_size)
            };
            let freshness = ctx.freshness(c.oldest_seen);
            let score = c.matched as f64
                * freshness
                * ctx.pressure_factor(records.get(c.replica))
                * ctx.slo_bias(freshness)
                * power;
            let denominator = if request_tokens > 0 {
                request_tokens
            } else {
                c.matched
            };
            let hit = (c.matched as f64 / denominator as f64).min(1.0) * freshness;
            scores.push(ReplicaScore {
                replica: c.replica,
                score: score as f32,
                matched_tokens: i32::try_from(c.matched).unwrap_or(i32::MAX),
                estimated_cache_hit_prob: hit as f32,
                tier: Tier::from_u8(c.tier),
            });
        }
        if scores.is_empty() {
            return Ranked::DOWNGRADED;
        }
        sort_scores(&mut scores, catalog);
        if f64::from(scores[0].score) < ctx.policy.routing_floor_score {
            return Ranked::DOWNGRADED;
        }
        Ranked::Hint(Reason::PrefixMatch, scores)
    }

    fn tenant_hot(
        &self,
        ctx: &Ctx<'_>,
        catalog: &Catalog,
        fleet: &Fleet,
        scope: Option<&std::sync::Arc<Scope>>,
        serving: &[MemberCost<'_>],
    ) -> Vec<ReplicaScore> {
        let policy = ctx.policy;
        let max_age_ms = policy.tenant_hot_max_age.as_millis() as f64;
        let Some(scope) = scope else {
            return Vec::new();
        };
        if !policy.strategy.enable_tenant_hot || max_age_ms <= 0.0 {
            return Vec::new();
        }
        let records = &fleet.records;
        let mut scores = Vec::new();
        for replica in scope.holders() {
            if serving
                .binary_search_by_key(&replica, |l| l.replica)
                .is_err()
            {
                continue;
            }
            let Some(record) = records.get(replica) else {
                continue;
            };
            let Some(stats) = record.stats.get() else {
                continue;
            };
            let age_ms = ctx.now_ms.saturating_sub(stats.at_ms) as f64;
            if age_ms >= max_age_ms || f64::from(stats.hit_rate) < policy.tenant_hot_min_hit_rate {
                continue;
            }
            let recency = 1.0 - age_ms / max_age_ms;
            let score = f64::from(stats.hit_rate)
                * recency
                * ctx.pressure_factor(Some(record))
                * ctx.slo_bias(recency);
            scores.push(ReplicaScore {
                replica,
                score: score as f32,
                matched_tokens: 0,
                estimated_cache_hit_prob: 0.0,
                tier: Tier::Unspecified,
            });
        }
        sort_scores(&mut scores, catalog);
        scores
    }

    /// UNKNOWN_* for a set-but-wrong key, outermost first; `None` for a known scope.
    fn classify(&self, catalog: &Catalog, req: &LookupRequest<'_>) -> Option<Reason> {
        if self.entry_count() <= 0 || req.tenant_id.is_empty() || req.model_id.is_empty() {
            return None;
        }
        use std::sync::atomic::Ordering::Relaxed;
        let has = |pred: &dyn Fn(&crate::catalog::Partition) -> bool| {
            catalog
                .partitions
                .iter()
                .any(|p| pred(p) && p.entries.load(Relaxed) > 0)
        };
        let Some(tenant) = catalog.name(req.tenant_id) else {
            return Some(Reason::UnknownTenant);
        };
        if !has(&|p| p.tenant == tenant) {
            return Some(Reason::UnknownTenant);
        }
        let model = catalog.name(req.model_id);
        if !model.is_some_and(|m| has(&|p| p.tenant == tenant && p.model == m)) {
            return Some(Reason::UnknownModel);
        }
        let scheme_known = catalog
            .scope(req.tenant_id, req.model_id, req.hash_scheme)
            .is_some_and(|s| s.serving_count() > 0);
        if !scheme_known {
            return Some(Reason::UnknownHashScheme);
        }
        None
    }

    fn affinity(
        &self,
        policy: &CachePolicy,
        catalog: &Catalog,
        serving: &[MemberCost<'_>],
        chain: Option<Chain<'_>>,
        prefix_hash: &[u8],
    ) -> Option<ReplicaScore> {
        if !policy.affinity_routing {
            return None;
        }
        if serving.is_empty() {
            return None;
        }
        // The members by name (the catalog's order keys order as names do).
        let mut replicas: Vec<(u64, ReplicaId)> =
            serving.iter().map(|l| (l.order, l.replica)).collect();
        replicas.sort_unstable();
        let seed = affinity_digest(chain, prefix_hash)?;
        let names: Vec<&str> = replicas
            .iter()
            .map(|&(_, r)| &**catalog.replica_str(r))
            .collect();
        let pick = pick_affinity(policy.affinity_algorithm, &seed, &names);
        Some(ReplicaScore {
            replica: replicas[pick].1,
            score: 0.0,
            matched_tokens: 0,
            estimated_cache_hit_prob: 0.0,
            tier: Tier::Unspecified,
        })
    }

    fn credit(
        &self,
        part: PartitionId,
        chain: Option<Chain<'_>>,
        prefix_hash: &[u8],
        scores: &[ReplicaScore],
        cands: &[Candidate],
    ) {
        let reader = self.store.reader();
        for score in scores {
            let replica = score.replica;
            let blocks = cands
                .iter()
                .find(|c| c.replica == replica)
                .map_or(0, |c| c.blocks as usize);
            let credit = |key: &Key<'_>| {
                if let Some((body, pos)) = reader.locate(part, key)
                    && let Some(row) = body.row(replica)
                {
                    body.credit(row, pos);
                }
            };
            match chain {
                Some(c) => (0..blocks.min(c.hashes.len()))
                    .for_each(|i| credit(&Key::new(part, c.hashes.hash(i)))),
                None => credit(&Key::of_bytes(part, prefix_hash)),
            }
        }
    }
}

/// By score, then by name (the catalog's order keys order as names do).
fn sort_scores(scores: &mut [ReplicaScore], catalog: &Catalog) {
    scores.sort_by(|a, b| {
        b.score.total_cmp(&a.score).then_with(|| {
            catalog
                .replica_order(a.replica)
                .cmp(&catalog.replica_order(b.replica))
        })
    });
}

/// SHA-256 of the affinity seed: each chain hash prefixed by its 4-byte
/// big-endian length, concatenated; else the raw `prefix_hash`. `None` without either.
pub fn affinity_digest(chain: Option<&BlockChain>, prefix_hash: &[u8]) -> Option<[u8; 32]> {
    let mut hasher = Sha256::new();
    match chain {
        Some(c) if !c.hashes.is_empty() => {
            for i in 0..c.hashes.len() {
                let h = c.hashes.get(i);
                hasher.update((h.len() as u32).to_be_bytes());
                hasher.update(h);
            }
        }
        _ if !prefix_hash.is_empty() => hasher.update(prefix_hash),
        _ => return None,
    }
    Some(hasher.finalize().into())
}

/// Index into `replicas` (sorted by id) chosen for a seed digest.
pub fn pick_affinity(algorithm: AffinityAlgorithm, digest: &[u8; 32], replicas: &[&str]) -> usize {
    let first8 = |d: &[u8]| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        u64::from_be_bytes(b)
    };
    match algorithm {
        AffinityAlgorithm::Modulo => (first8(digest) % replicas.len().max(1) as u64) as usize,
        AffinityAlgorithm::Rendezvous => {
            let mut best = (0u64, 0usize);
            for (i, r) in replicas.iter().enumerate() {
                let mut hasher = Sha256::new();
                hasher.update(digest);
                hasher.update(r.as_bytes());
                let weight = first8(&hasher.finalize());
                if i == 0 || weight > best.0 {
                    best = (weight, i);
                }
            }
            best.1
        }
    }
}
